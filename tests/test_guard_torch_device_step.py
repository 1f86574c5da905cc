"""The torch device step's fast paths (host_every=k): the norms' reduction and the decision
in one compiled call (``DevicePolicy.decide_norms``), and the undo bound once to the
optimizer's tensors (``guard_compiled.undo_plan``). Each must give what the general path
gives: the same decisions, weights and optimizer state, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from numstab.guard import SpikeDetector, TrainingGuard
from tests.torch_guard_loop import train_guarded

torch = pytest.importorskip("torch")


class _Replacing(torch.optim.Optimizer):
    """Momentum SGD that puts a new ``avg`` tensor in its state every step (no in-place)."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["avg"] = 0.9 * st.get("avg", torch.zeros_like(p)) + p.grad
                p.sub_(group["lr"] * st["avg"])


def _run(guard, optim, one_call=True, nan_steps=(), spike_steps=(), steps=48, loss_as=None):
    torch.set_num_threads(1)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if optim == "replacing":
        opt = _Replacing(model.parameters())
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.05, fused=optim == "fused")
    tg = guard.for_torch(model, opt)
    if not one_call:
        tg._one_kernel = False  # the general path: eager norms, then decide([loss, norm])
    train_guarded(torch, tg, model, opt, steps, nan_steps, spike_steps, loss_as)
    return model, opt, tg


def _same_run(a, b, grad_norm_rtol=1e-6):
    (ma, oa, ta), (mb, ob, tb) = a, b
    assert [(e["event"], e["step"], e.get("reasons")) for e in ta.events] == [
        (e["event"], e["step"], e.get("reasons")) for e in tb.events
    ]
    for p, q in zip(ma.parameters(), mb.parameters(), strict=True):
        assert torch.equal(p, q)
        assert oa.state[p].keys() == ob.state[q].keys()
        for k, v in oa.state[p].items():
            assert torch.equal(v, ob.state[q][k]), k
    ha, hb = ta.history.as_arrays(), tb.history.as_arrays()
    for key in ("step", "applied", "loss", "layer_norms"):
        np.testing.assert_array_equal(ha[key], hb[key])
    np.testing.assert_allclose(ha["grad_norm"], hb["grad_norm"], rtol=grad_norm_rtol)


@pytest.mark.parametrize("optim", ["adam", "fused", "replacing"])
def test_one_call_step_equals_the_general_path(optim):
    guard = TrainingGuard(
        snapshot_every=10,
        rollback_after=2,
        loss_spikes=SpikeDetector(window=16, sigma=4.0, warmup=8),
        host_every=4,
    )
    kw = {"nan_steps": (0, 21, 30, 31), "spike_steps": (40,)}
    fast = _run(guard, optim, **kw)
    assert fast[2]._one_kernel
    _same_run(fast, _run(guard, optim, one_call=False, **kw))
    events = [(e["event"], e["step"]) for e in fast[2].events]
    assert ("skip", 21) in events and any(e == "rollback" for e, _ in events)


@pytest.mark.parametrize("optim", ["adam", "replacing"])
def test_undo_plan_path_equals_host_mode(optim):
    """A NaN batch after the undo was bound to the optimizer's tensors (Adam, in place) and
    with an optimizer that replaces its state tensors every step (no binding)."""
    nan = (0, 17, 33)
    host = _run(TrainingGuard(snapshot_every=1000), optim, nan_steps=nan)
    dev = _run(TrainingGuard(snapshot_every=1000, host_every=8), optim, nan_steps=nan)
    _same_run(host, dev)
    skipper = dev[2]._device.skipper
    assert (skipper._plan is not None) == (optim == "adam")


def test_other_losses_take_the_general_path():
    """A Python float or a loss of another dtype: the same run as a float32 tensor loss."""
    guard = TrainingGuard(snapshot_every=1000, host_every=4)
    ref = _run(guard, "adam", nan_steps=(9,), steps=20)
    as_float = _run(guard, "adam", nan_steps=(9,), steps=20, loss_as=lambda t: float(t.detach()))
    _same_run(ref, as_float)
    as_double = _run(guard, "adam", nan_steps=(9,), steps=20, loss_as=lambda t: t.double())
    _same_run(ref, as_double)


def test_decide_norms_equals_the_policy_and_runs_eagerly_without_a_compiler(monkeypatch):
    """decide_norms against policy.decide on NumPy fed the global norm the call reports (the
    per-leaf norms are torch._foreach_norm's; the global norm's sum may round otherwise than
    NumPy's); then the same with compilation failing: one warning, the same rows."""
    from numstab.backends import load_backend
    from numstab.frameworks.torch import guard_compiled
    from numstab.guard import policy
    from numstab.guard.deferred import decisions_from_rows

    rng = np.random.default_rng(3)
    leaves = (1 + 0.3 * rng.standard_normal((120, 5))).astype(np.float32)
    leaves[[40, 70]] = [[np.nan] * 5, [np.inf] + [1.0] * 4]
    leaves[90] *= 50.0  # a norm spike
    loss = (1 + 0.1 * rng.standard_normal(120)).astype(np.float32)
    guard = TrainingGuard(
        grad_norm_spikes=SpikeDetector(window=16, sigma=3.0, warmup=5), snapshot_every=9
    )

    def rows(dec):
        for i in range(len(loss)):
            norms = [torch.tensor(v) for v in leaves[i]]
            apply, found_inf, vec = dec.decide_norms(torch.tensor(loss[i]), norms)
            np.testing.assert_array_equal(vec.numpy(), leaves[i])
            assert float(found_inf) == float(not bool(apply))
        return decisions_from_rows(dec.read_rows(0, len(loss)), 0)

    got = rows(guard_compiled.DevicePolicy(guard, torch.device("cpu"), len(loss)))
    be = load_backend("numpy")
    state = guard.init_state(be)
    for i, g in enumerate(got):
        d, state = policy.decide(guard, be, state, loss[i], np.float32(g["grad_norm"]))
        for key in ("apply", "rollback", "snapshot", "reasons"):
            assert g[key] == d._asdict()[key].item(), (i, key)
    assert sum(not g["apply"] for g in got) >= 3

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(guard_compiled, "_CACHE", {})
    monkeypatch.setattr(guard_compiled, "_WARNED", [])
    monkeypatch.setattr(torch._inductor, "compile", no_compiler)
    with pytest.warns(RuntimeWarning, match="runs eagerly"):
        eager = rows(guard_compiled.DevicePolicy(guard, torch.device("cpu"), len(loss)))
    assert set(guard_compiled._CACHE.values()) == {None}
    for a, b in zip(got, eager, strict=True):
        assert {k: a[k] for k in ("apply", "rollback", "snapshot", "reasons")} == {
            k: b[k] for k in ("apply", "rollback", "snapshot", "reasons")
        }
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-6)


def test_state_on_another_device_is_undone_with_one_flag_copy(monkeypatch):
    """Adam's CPU step counts beside CUDA parameters: each bad step restores them with the flag
    copied once per device and step (one sync), not once per tensor."""
    import torch

    from numstab.frameworks.torch import guard_device

    copies = []
    real_on = guard_device._on
    monkeypatch.setattr(guard_device, "_on", lambda f, t: copies.append(t) or real_on(f, t))
    steps = [torch.tensor(float(i)) for i in range(5)]
    backups = [s - 1 for s in steps]
    pairs = list(zip(steps, backups, strict=True))
    guard_device.undo_elsewhere(torch.tensor(True), pairs)
    assert [s.item() for s in steps] == [0.0, 1.0, 2.0, 3.0, 4.0]  # a good step: kept
    guard_device.undo_elsewhere(torch.tensor(False), pairs)
    assert [s.item() for s in steps] == [-1.0, 0.0, 1.0, 2.0, 3.0]  # a bad one: restored
    assert len(copies) == 2  # one copy of the flag per call, for the five tensors


def test_steady_undo_walks_the_state_only_when_it_changed(monkeypatch):
    """Adam updates its state in place: once the undo is bound, a step checks the state's
    layout (every dict, key and value the same objects) instead of walking it. A state
    tensor put in its dict between steps is seen: a bad step then restores that tensor, and
    the parameters, bit for bit."""
    from numstab.frameworks.torch.guard_device import Skipper

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    params = list(model.parameters())
    skipper = Skipper(opt, params)
    walks = []
    real = Skipper._state_entries
    monkeypatch.setattr(Skipper, "_state_entries", lambda self: walks.append(1) or real(self))

    def step(good):
        opt.zero_grad()
        model(torch.randn(16, 4)).square().mean().backward()
        flag = torch.tensor(good)
        return skipper.run(flag, (~flag).float(), None)

    def snapshot():
        state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
        return [p.detach().clone() for p in params], state

    def assert_unchanged(before):
        weights, state = before
        for p, w, st in zip(params, weights, state, strict=True):
            assert torch.equal(p, w)
            assert opt.state[p].keys() == st.keys()
            for k, v in st.items():
                assert torch.equal(opt.state[p][k], v), k

    assert step(True)  # the first step creates the state: read on the host once
    step(True)  # binds the undo to the state's tensors
    walks.clear()
    for _ in range(3):
        assert not step(True)
    before = snapshot()
    assert not step(False)
    assert_unchanged(before)
    assert walks == []  # steady steps, good or bad: no walk of the state

    opt.state[params[0]]["exp_avg"] = opt.state[params[0]]["exp_avg"].clone()
    before = snapshot()
    assert not step(False)  # a new tensor in the state: walked, backed up, restored
    assert_unchanged(before)
    assert walks
    step(True)
    walks.clear()
    before = snapshot()
    assert not step(False)
    assert_unchanged(before)
    assert walks == []
