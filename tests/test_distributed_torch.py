"""GradScaler and the training guard across 2 gloo processes on CPU (loopback): one rank's
overflow skips every rank, and one rank's loss spike makes every rank skip the step.

The test spawns this file twice as a script (``tests/gloo_ranks.py``); each rank runs every
scenario and writes its record as JSON. Rank 0 then runs the same scenarios again after
leaving the group, as a single process: the reference. The test process itself imports no
torch (its imports cost seconds of the two CPUs the workers need).
"""

from __future__ import annotations

import importlib.util
import math
import sys

WORLD = 2
STEPS = 7
INJECT = (2, 4, 5)  # overflow steps, on one rank only
MAX_NORM = 0.05
TIMEOUT_S = 50
# (name, sharded, api, norm_type, optimizer, process_group): the default group (WORLD,
# detected) unless "explicit" (a new group of every rank passed as process_group=)
SCENARIOS = [
    ("replicated_step", False, "step", 2.0, "sgd", "default"),
    ("replicated_fused", False, "step", 2.0, "adam_fused", "default"),
    ("replicated_combined", False, "combined", 2.0, "sgd", "explicit"),
    ("sharded_l2", True, "combined", 2.0, "sgd", "default"),
    ("sharded_linf", True, "combined", math.inf, "sgd", "explicit"),
]

GUARD_STEPS = 12
GUARD_SPIKE = 9  # rank 1's local loss spikes (x 1e4); its gradients and rank 0's do not
GUARD_SCENARIOS = [("guard_replicated", False), ("guard_sharded", True)]


def _scenario(
    rank: int, world: int, sharded: bool, api: str, norm_type: float, optimizer: str, group: str
):
    import torch
    import torch.distributed as dist

    from numstab.integrations.torch import GradScaler

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    params = list(model.parameters())
    # sharded: rank r owns params[r::world] (all of them in the single-process reference)
    owned = params[rank::world] if sharded else params
    target = params[1] if sharded else params[0]  # the gradient that overflows ...
    target_owner = 1 % world if sharded else world - 1  # ... on this rank only
    if optimizer == "sgd":
        opt = torch.optim.SGD(owned, lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.Adam(owned, lr=0.01, fused=True)
    applied_steps: list[int] = []
    opt.register_step_post_hook(lambda *_: applied_steps.append(step))
    pg = dist.new_group(list(range(world))) if group == "explicit" and world > 1 else None
    scaler = GradScaler(init_scale=8.0, growth_interval=2, sharded=sharded, process_group=pg)
    g = torch.Generator().manual_seed(1)
    record: dict = {"scales": [], "flags": [], "norms": []}
    for step in range(STEPS):
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if step in INJECT and rank == target_owner:
            target.grad.view(-1)[3] = math.inf
        if api == "step":
            scaler.step(opt)
            scaler.update()
        else:
            record["flags"].append(scaler.step_and_update(opt, MAX_NORM, norm_type=norm_type))
            record["norms"].append(float(scaler.last_grad_norm))
        record["scales"].append(scaler.get_scale())
        if sharded and world > 1:  # every rank needs the whole model for the next forward
            for i, p in enumerate(params):
                dist.broadcast(p.data, src=i % world)
    if optimizer == "sgd":
        record["applied"] = applied_steps
    record["params"] = [p.detach().flatten().tolist() for p in params]
    return record


def _guard_scenario(rank: int, world: int, sharded: bool) -> dict:
    """The same batches on every rank; at GUARD_SPIKE rank 1 reports a spiking local loss.
    Sharded: rank r keeps the gradients of params[r::world] only and steps those."""
    import torch
    import torch.distributed as dist

    from numstab.guard import SpikeDetector, TrainingGuard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    params = list(model.parameters())
    owned = params[rank::world] if sharded else params
    opt = torch.optim.SGD(owned, lr=0.05)
    spikes = SpikeDetector(window=8, sigma=4.0, warmup=4)
    guard = TrainingGuard(loss_spikes=spikes, grad_norm_spikes=None, rollback_after=5)
    tg = guard.for_torch(model, opt, sharded=sharded)
    g = torch.Generator().manual_seed(1)
    record: dict = {"applied": [], "local_loss": []}
    for step in range(GUARD_STEPS):
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in params:
            if sharded and not any(p is q for q in owned):
                p.grad = None
        local = loss.detach() * (1e4 if step == GUARD_SPIKE and rank == 1 % world else 1.0)
        record["local_loss"].append(float(local))
        record["applied"].append(tg.step(local))
        if sharded and world > 1:
            for i, p in enumerate(params):
                dist.broadcast(p.data, src=i % world)
    history = tg.history.as_arrays()
    record["guard_loss"] = history["loss"].tolist()
    record["guard_norm"] = history["grad_norm"].tolist()
    record["params"] = [p.detach().flatten().tolist() for p in params]
    return record


def _fsdp2_scenario(rank: int, world: int) -> dict:
    """FSDP2 (``fully_shard`` on a CPU mesh): DTensor parameters and gradients, each rank
    holding rows of every one. The guard (a spike on rank 1 only), ZClip, the inf-norm and
    GradScaler must see the global gradients, and so must ``find_nonfinite`` when one rank's
    shard holds a NaN and another's a -inf. ``world == 1``: the same model unsharded, the
    reference (same batches on every rank, so FSDP2's averaged gradient is the same)."""
    import torch

    from numstab import AGC, ZClip, all_finite, find_nonfinite, global_norm
    from numstab.guard import SpikeDetector, TrainingGuard
    from numstab.integrations.torch import GradScaler

    def full(x):  # the global value of a DTensor, a plain tensor as it is
        return x.full_tensor() if hasattr(x, "full_tensor") else x

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05)
    spikes = SpikeDetector(window=8, sigma=4.0, warmup=4)
    guard = TrainingGuard(loss_spikes=spikes, grad_norm_spikes=None, rollback_after=5)
    tg = guard.for_torch(model, opt, sharded=True)  # a DTensor norm is global: not summed
    zclip = ZClip()
    zstate = zclip.init(params)
    g = torch.Generator().manual_seed(1)
    record: dict = {"applied": [], "zclip_norm": [], "inf_norm": [], "agc": []}
    for step in range(GUARD_STEPS):
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        grads = [p.grad for p in params]
        _, zstate = zclip.update(grads, zstate)  # warming up: the gradients are unchanged
        record["zclip_norm"].append(float(zstate.norm))
        record["inf_norm"].append(float(full(global_norm(grads, norm_type=math.inf))))
        clipped = AGC(clip_factor=0.01).clip(grads, params)  # unit-wise: rows of a weight
        record["agc"] += [x for c in clipped for x in full(c).flatten().tolist()]
        local = loss.detach() * (1e4 if step == GUARD_SPIKE and rank == 1 % world else 1.0)
        record["applied"].append(tg.step(local))
    history = tg.history.as_arrays()
    record["guard_loss"] = history["loss"].tolist()
    record["guard_norm"] = history["grad_norm"].tolist()
    record["layer_norms"] = history["layer_norms"].tolist()
    record["params"] = [full(p).detach().flatten().tolist() for p in params]

    # non-finite values in one rank's shard each: rows 4.. of params[0] live on rank 1, rows
    # 0-1 of params[2] on rank 0 (FSDP2 shards dim 0 evenly)
    grads = [p.grad for p in params]
    if world > 1:
        if rank == 1:
            grads[0].to_local()[0, 0] = math.nan
        if rank == 0:
            grads[2].to_local()[1, 2] = -math.inf
    else:
        grads[0][4, 0] = math.nan
        grads[2][1, 2] = -math.inf
    record["all_finite"] = bool(full(all_finite(grads)))
    record["records"] = [
        [r.path, r.nan_count, r.posinf_count, r.neginf_count, list(r.shape), r.finite_max]
        for r in find_nonfinite(grads)
    ]
    record["inf_norm_bad"] = float(full(global_norm(grads, norm_type=math.inf)))

    # GradScaler: an inf in rank 1's shard only makes every rank skip and back off
    scaler = GradScaler(init_scale=8.0, growth_interval=100, sharded=True)
    record["scales"], record["clip_norms"] = [], []
    for step in range(3):
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        model.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if step == 1 and rank == 1 % world:
            (params[0].grad.to_local() if world > 1 else params[0].grad[4:])[0, 1] = math.inf
        record["clip_norms"].append(float(scaler.clip_grad_norm_(opt, 1.0)))
        scaler.step(opt)
        scaler.update()
        record["scales"].append(scaler.get_scale())
    record["params_after_scaler"] = [full(p).detach().flatten().tolist() for p in params]
    return record


def _run_all(rank: int, world: int) -> dict:
    records = {name: _scenario(rank, world, *rest) for name, *rest in SCENARIOS}
    for name, sharded in GUARD_SCENARIOS:
        records[name] = _guard_scenario(rank, world, sharded)
    try:  # an error here fails its own test, not every test of the file
        records["fsdp2"] = _fsdp2_scenario(rank, world)
    except ImportError as error:  # a torch without FSDP2 (fully_shard) or DTensor
        records["fsdp2"] = {"skip": str(error)}
    except Exception as error:
        records["fsdp2"] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    return records


def _run(rank: int, world: int, folder: str) -> dict:
    return {"ranks": _run_all(rank, world)}


def _reference(rank: int, folder: str) -> dict:
    """Rank 0, out of the group: every scenario as a single process."""
    return {"reference": _run_all(0, 1)} if rank == 0 else {}


# The workers run this file as a script and skip importing pytest (seconds on a busy machine).
if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    from tests.gloo_ranks import worker_main

    worker_main(_run, WORLD, TIMEOUT_S, after=_reference)

import pytest  # noqa: E402

from tests.gloo_ranks import run_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = run_ranks(__file__, WORLD, TIMEOUT_S, tmp_path_factory.mktemp("dist"))
    return [o["ranks"] for o in out], out[0]["reference"]


NAMES = [s[0] for s in SCENARIOS]
GUARD_NAMES = [s[0] for s in GUARD_SCENARIOS]


@pytest.mark.parametrize("name", NAMES)
def test_every_rank_skips_and_backs_off_together(results, name):
    ranks, reference = results
    r0, r1 = ranks[0][name], ranks[1][name]
    expected_applied = [s for s in range(STEPS) if s not in INJECT]
    # the same decisions and scales on both ranks, and as in one process
    assert r0["scales"] == r1["scales"] == reference[name]["scales"]
    assert r0["scales"] == [8.0, 16.0, 8.0, 8.0, 4.0, 2.0, 2.0]
    if "applied" in r0:
        assert r0["applied"] == r1["applied"] == expected_applied
    if r0["flags"]:
        assert r0["flags"] == r1["flags"] == [s not in INJECT for s in range(STEPS)]
    # identical parameters on every rank
    assert r0["params"] == r1["params"]


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("replicated")])
def test_replicated_parameters_equal_single_process(results, name):
    ranks, reference = results
    assert ranks[0][name]["params"] == reference[name]["params"]


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("sharded")])
def test_sharded_norm_is_the_global_norm(results, name):
    ranks, reference = results
    ref = reference[name]
    for r in range(WORLD):
        got = ranks[r][name]
        for step, (a, b) in enumerate(zip(got["norms"], ref["norms"], strict=True)):
            if step in INJECT:
                assert not math.isfinite(a) and not math.isfinite(b)
            else:
                assert b > MAX_NORM  # clipping is active
                assert a == pytest.approx(b, rel=1e-6)
        for a, b in zip(got["params"], ref["params"], strict=True):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("name", GUARD_NAMES)
def test_guard_ranks_decide_together_on_the_mean_loss(results, name):
    """Rank 1 alone sees the spike in its local loss; both ranks skip that step (an
    unreduced decision would skip on rank 1 only and the replicas would drift apart)."""
    ranks, reference = results
    r0, r1 = ranks[0][name], ranks[1][name]
    assert r1["local_loss"][GUARD_SPIKE] > 1e3 * r0["local_loss"][GUARD_SPIKE]
    expected = [step != GUARD_SPIKE for step in range(GUARD_STEPS)]
    assert r0["applied"] == r1["applied"] == expected
    assert r0["params"] == r1["params"]
    # every rank saw the mean loss and the same global norm, that of the whole model
    assert r0["guard_loss"] == r1["guard_loss"] and r0["guard_norm"] == r1["guard_norm"]
    mean = (r0["local_loss"][GUARD_SPIKE] + r1["local_loss"][GUARD_SPIKE]) / 2
    assert r0["guard_loss"][GUARD_SPIKE] == pytest.approx(mean, rel=1e-6)
    ref = reference[name]
    for step in range(GUARD_STEPS):
        if step != GUARD_SPIKE:
            assert r0["guard_loss"][step] == pytest.approx(ref["guard_loss"][step], rel=1e-6)
        assert r0["guard_norm"][step] == pytest.approx(ref["guard_norm"][step], rel=1e-5)


def test_fsdp2_dtensor_gradients_are_seen_whole(results):
    """FSDP2 gradients are DTensors: every rank must see the global norms, the global
    non-finite counts and the same decisions as one unsharded process. Before numstab read
    them as global: ``all_finite`` and ``find_nonfinite`` missed a NaN in another rank's
    shard (a MAX collective drops NaN), and the guard, ZClip and GradScaler raised."""
    ranks, reference = results
    r0, r1, ref = ranks[0]["fsdp2"], ranks[1]["fsdp2"], reference["fsdp2"]
    if "skip" in r0:
        pytest.skip(f"no FSDP2 in this torch: {r0['skip']}")
    for r in (r0, r1, ref):
        assert "error" not in r, r.get("error")
    # rank 1's spike skips the step on both ranks, as the one process skips its own spike
    expected = [step != GUARD_SPIKE for step in range(GUARD_STEPS)]
    assert r0["applied"] == r1["applied"] == ref["applied"] == expected
    assert len(r0["layer_norms"]) == GUARD_STEPS and len(r0["layer_norms"][0]) == 4
    for rec in (r0, r1, ref):
        rec["layer_norms"] = [n for row in rec["layer_norms"] for n in row]
    for key in ("guard_norm", "zclip_norm", "inf_norm", "layer_norms", "agc"):
        assert r0[key] == r1[key], key
        assert r0[key] == pytest.approx(ref[key], rel=1e-5), key
    assert r0["guard_loss"] == r1["guard_loss"]
    spiked = GUARD_SPIKE
    assert r0["guard_loss"][:spiked] == pytest.approx(ref["guard_loss"][:spiked], rel=1e-6)
    assert r0["params"] == r1["params"]
    for a, b in zip(r0["params"], ref["params"], strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-7)
    # non-finite values in different ranks' shards: found on every rank, counted globally
    for r in (r0, r1):
        assert r["all_finite"] is False and ref["all_finite"] is False
        assert (
            [x[:5] for x in r["records"]]
            == [x[:5] for x in ref["records"]]
            == [
                ["[0]", 1, 0, 0, [8, 6]],
                ["[2]", 0, 0, 1, [3, 8]],
            ]
        )
        assert r["inf_norm_bad"] == math.inf  # a NaN reads as +inf through the MAX
    assert math.isnan(ref["inf_norm_bad"])
    # GradScaler: both ranks skip the step with rank 1's inf and back off together
    assert r0["scales"] == r1["scales"] == ref["scales"] == [8.0, 4.0, 4.0]
    assert math.isinf(r0["clip_norms"][1]) and math.isinf(r1["clip_norms"][1])
    assert r0["params_after_scaler"] == r1["params_after_scaler"]
