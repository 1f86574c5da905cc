"""The torch guard's skipped step and the model's buffers (BatchNorm statistics), the
optimizer state's dtypes across a rollback, and the step that gives up
(numstab/frameworks/torch/guard_buffers.py, guard_groups.exact_state, guard_files.py).

The audit's repros: a NaN batch that the guard skipped still wrote NaN into
``running_mean`` (eval output NaN for good, training losses finite: no rollback); a rollback
cast a float32 master copy of bfloat16 parameters to bfloat16; after a give-up the step was
logged but not counted (history steps [0, 1, 2, 3, 3, 4])."""

from __future__ import annotations

import math

import numpy as np
import pytest

from numstab.errors import NonFiniteError
from numstab.guard import TrainingGuard

torch = pytest.importorskip("torch")
nn = torch.nn

QUIET = dict(loss_spikes=None, grad_norm_spikes=None)  # NaN steps only


def bn_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))


def batch(step, nan=False):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 3, generator=g)
    if nan:
        x[0, 0] = math.nan
    return x, x.sum(1, keepdim=True)


def buffers(model):
    return [b.clone() for b in model.buffers()]


def assert_bit_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), (x, y)


def one_step(tg, model, opt, step, nan=False, micro=1, nan_micro=None):
    """A step of ``micro`` micro-batches (the ``nan_micro``-th with a NaN input if given)."""
    opt.zero_grad()
    total = 0.0
    for i in range(micro):
        x, y = batch(10 * step + i, nan=nan or i == nan_micro)
        loss = nn.functional.mse_loss(model(x), y) / micro
        loss.backward()
        total = total + loss.detach()
    return tg.step(total)


@pytest.mark.parametrize("host_every", [1, 3])
def test_a_skipped_step_leaves_the_batchnorm_statistics_as_after_the_last_applied_one(
    host_every,
):
    torch.set_num_threads(1)
    model = bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tg = TrainingGuard(host_every=host_every, **QUIET).for_torch(model, opt)
    ref = bn_model()  # the same run without the NaN batch, unguarded
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(6):
        before = buffers(model)
        applied = one_step(tg, model, opt, step, nan=step == 3)
        if step == 3:
            assert not bool(applied)
            assert_bit_equal(buffers(model), before)
            model.eval()
            assert torch.isfinite(model(batch(0)[0])).all()
            model.train()
            continue
        assert bool(applied)
        assert model[1].num_batches_tracked.item() == before[2].item() + 1
        ref_opt.zero_grad()
        x, y = batch(10 * step)
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        assert_bit_equal(buffers(model), buffers(ref))  # updated as if the NaN never came
    tg.flush()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    assert [(e["event"], e["step"]) for e in tg.events] == [("snapshot", 0), ("skip", 3)]


@pytest.mark.parametrize("host_every", [1, 3])
def test_every_micro_batch_of_a_skipped_accumulated_step_is_undone(host_every):
    model = bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tg = TrainingGuard(host_every=host_every, **QUIET).for_torch(model, opt)
    one_step(tg, model, opt, 0, micro=3)
    before = buffers(model)
    assert not bool(one_step(tg, model, opt, 1, micro=3, nan_micro=2))
    assert_bit_equal(buffers(model), before)
    assert model[1].num_batches_tracked.item() == 3
    assert bool(one_step(tg, model, opt, 2, micro=3))
    assert model[1].num_batches_tracked.item() == 6
    tg.flush()


def test_a_model_without_buffers_pays_nothing(monkeypatch):
    """No buffer copy at all per step (host mode has no other ``_foreach_copy_``), and the
    same weights as a run without the NaN batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    ref = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    tg = TrainingGuard(**QUIET).for_torch(model, opt)
    assert tg._buffers.slots == []
    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda *a, **k: calls.append(1) or real(*a, **k))
    for step in range(4):
        assert one_step(tg, model, opt, step, nan=step == 1) == (step != 1)
        if step != 1:
            ref_opt.zero_grad()
            x, y = batch(10 * step)
            nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
    assert calls == []
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("host_every", [1, 2])
def test_rollback_and_snapshots_keep_the_buffers_of_the_last_applied_step(host_every):
    """A snapshot due after step 1 is taken as step 2 starts, after step 2's (NaN) forward
    pass: it holds the buffers after step 1 (before, the NaN ones). After the rollback the
    copy is the restored buffers: a later skip puts those back."""
    model = bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = TrainingGuard(
        snapshot_every=2, rollback_after=2, rollback_window=4, host_every=host_every, **QUIET
    )
    tg = guard.for_torch(model, opt)
    one_step(tg, model, opt, 0)
    one_step(tg, model, opt, 1)
    after_1 = buffers(model)
    one_step(tg, model, opt, 2, nan=True)  # skipped; the snapshot of step 2 taken in it
    one_step(tg, model, opt, 3, nan=True)  # skipped: rollback (read here with host_every=2)
    tg.flush()
    assert [e["event"] for e in tg.events] == ["snapshot", "snapshot", "skip", "skip", "rollback"]
    snap = tg.runner.ring.latest().payload["model"]
    assert_bit_equal([snap["1.running_mean"], snap["1.running_var"]], after_1[:2])
    assert_bit_equal(buffers(model), after_1)
    assert_bit_equal(tg._buffers.copies, after_1)
    one_step(tg, model, opt, 4, nan=True)
    tg.flush()
    assert_bit_equal(buffers(model), after_1)


class Replacing(nn.Module):
    """Keeps a running mean of its input in a buffer it replaces every forward pass."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.register_buffer("avg", torch.zeros(3))

    def forward(self, x):
        if self.training:
            self.avg = 0.9 * self.avg + 0.1 * x.detach().mean(0)
        return self.lin(x)


@pytest.mark.parametrize("host_every", [1, 2])
def test_replaced_and_converted_buffers(host_every):
    model = nn.Sequential(Replacing(), nn.BatchNorm1d(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tg = TrainingGuard(host_every=host_every, **QUIET).for_torch(model, opt)
    for step in range(2):
        one_step(tg, model, opt, step)
    before = buffers(model)
    assert len(before) == 4  # avg, running_mean, running_var, num_batches_tracked
    assert not bool(one_step(tg, model, opt, 2, nan=True))
    assert_bit_equal(buffers(model), before)
    assert bool(one_step(tg, model, opt, 3))
    assert not torch.equal(model[0].avg, before[0])
    model[0].avg = model[0].avg.double()  # another dtype: kept from the next step on
    assert bool(one_step(tg, model, opt, 4))
    before = buffers(model)
    assert not bool(one_step(tg, model, opt, 5, nan=True))
    assert_bit_equal(buffers(model), before)
    assert model[0].avg.dtype == torch.float64
    tg.flush()


class Counting(nn.Module):
    """Counts its forward passes in a buffer ``n``, once it has one."""

    def forward(self, x):
        if hasattr(self, "n"):
            self.n.add_(1)
        return x


def test_a_buffer_registered_later_is_kept_from_the_next_snapshot():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 1), Counting())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tg = TrainingGuard(snapshot_every=1, **QUIET).for_torch(model, opt)
    assert tg._buffers.slots == []
    one_step(tg, model, opt, 0)
    model[1].register_buffer("n", torch.zeros((), dtype=torch.int64))
    assert not tg.skip_batch()  # takes the snapshot due after step 0: reads the buffers
    assert not one_step(tg, model, opt, 1, nan=True)
    assert model[1].n.item() == 0
    assert not tg.skip_batch()
    assert one_step(tg, model, opt, 2)
    assert model[1].n.item() == 1


# -- optimizer state dtypes ---------------------------------------------------------------------


class Master(torch.optim.Optimizer):
    """SGD on a float32 master copy of each (bfloat16) parameter."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if "master" not in st:
                    st["master"] = p.detach().float().clone()
                st["master"].sub_(group["lr"] * p.grad.float())
                p.copy_(st["master"])


def bf16_run(guard, steps=4, nan=(3,), optimizer=Master):
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(torch.bfloat16)
    opt = optimizer(model.parameters(), lr=0.1)
    tg = guard.for_torch(model, opt)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 4, generator=g).to(torch.bfloat16)
        if step in nan:
            x[0, 0] = math.nan
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        tg.step(loss)
    tg.flush()
    return model, opt, tg


ROLL = dict(snapshot_every=2, rollback_after=1, rollback_window=1, **QUIET)


@pytest.mark.parametrize("host_every", [1, 2])
def test_a_rollback_restores_a_float32_master_of_bfloat16_parameters_exactly(host_every):
    model, opt, tg = bf16_run(TrainingGuard(host_every=host_every, **ROLL))
    assert [e["event"] for e in tg.events][-2:] == ["skip", "rollback"]
    saved = tg.runner.ring.latest().payload["optimizer"]["state"]
    for i, p in enumerate(model.parameters()):
        master = opt.state[p]["master"]
        assert master.dtype == torch.float32
        assert torch.equal(master, saved[i]["master"])
        assert torch.equal(p, master.to(torch.bfloat16))


def test_snapshot_files_keep_the_optimizer_states_dtypes(tmp_path):
    """A file stores bfloat16 as float32 and lists where (its "bfloat16" entry): a float32
    master loads as float32, Adam's bfloat16 moments as bfloat16, each bit-equal to the
    snapshot in memory. A file without the entry (an older one) loads as torch casts it."""
    from numstab.guard.snapshots import encode_tree, load_npz, write_npz_atomic

    for optimizer in (Master, torch.optim.Adam):
        folder = tmp_path / optimizer.__name__
        _, _, tg = bf16_run(TrainingGuard(snapshot_dir=folder, **ROLL), 3, (), optimizer)
        saved = tg.runner.ring.latest()
        assert saved.step == 2
        torch.manual_seed(1)
        model = nn.Linear(4, 2).to(torch.bfloat16)
        opt = optimizer(model.parameters(), lr=0.1)
        assert TrainingGuard(snapshot_dir=folder, **ROLL).for_torch(model, opt).load_snapshot() == 2
        for i, p in enumerate(model.parameters()):
            assert opt.state[p].keys() == saved.payload["optimizer"]["state"][i].keys()
            for k, x in saved.payload["optimizer"]["state"][i].items():
                assert opt.state[p][k].dtype == x.dtype and torch.equal(opt.state[p][k], x), k
        dtypes = {k: x.dtype for k, x in opt.state[model.weight].items()}
        if optimizer is Master:
            assert dtypes == {"master": torch.float32}
        else:
            assert dtypes["exp_avg"] == dtypes["exp_avg_sq"] == torch.bfloat16
    path = tmp_path / "Master" / "snapshot-000000002.npz"
    tree = load_npz(path)
    assert tree["payload"]["bfloat16"] == [["model", "weight"], ["model", "bias"]]
    del tree["payload"]["bfloat16"]
    write_npz_atomic(path, encode_tree(tree))
    model = nn.Linear(4, 2).to(torch.bfloat16)
    opt = Master(model.parameters())
    TrainingGuard(snapshot_dir=path.parent, **ROLL).for_torch(model, opt).load_snapshot()
    assert opt.state[model.weight]["master"].dtype == torch.bfloat16  # torch's cast, as before


# -- give-up ------------------------------------------------------------------------------------


@pytest.mark.parametrize("host_every", [1, 3])
def test_the_step_that_gives_up_is_counted(host_every):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = TrainingGuard(
        max_rollbacks=1, rollback_after=1, rollback_window=1, host_every=host_every, **QUIET
    )
    tg = guard.for_torch(model, opt)
    gave_up = []
    for step in range(9):
        x = torch.randn(8, 4)
        if step in (2, 3):
            x[0, 0] = math.nan
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        try:
            tg.step(loss)
        except NonFiniteError:
            gave_up.append(step)
    tg.flush()
    assert gave_up == [3 if host_every == 1 else 5]
    assert tg.history.as_arrays()["step"].tolist() == list(range(9))
    assert tg.steps_seen == 9
    if host_every == 1:
        assert int(tg.state.step) == 9
    events = [(e["event"], e["step"]) for e in tg.events if e["event"] != "snapshot"]
    assert events == [("skip", 2), ("rollback", 2), ("skip", 3), ("give_up", 3)]
    assert np.isfinite(model.weight.detach().numpy()).all()


# -- the callbacks' StepGuard -------------------------------------------------------------------


def test_step_guard_callbacks_keep_the_buffers_of_a_skipped_step():
    """The Hugging Face and Lightning callbacks step through ``StepGuard`` (host mode)."""
    from numstab.frameworks.torch.step_guard import StepGuard

    model = bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sg = StepGuard(TrainingGuard(host_every=4, **QUIET), locate=False)
    sg.attach(model, opt, hook_loss=False)
    sg.wrap(opt)
    for step in range(3):
        before = buffers(model)
        x, y = batch(step, nan=step == 1)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        sg.record_loss(loss)
        opt.step()
        if step == 1:
            assert_bit_equal(buffers(model), before)
    assert sg.skipped == 1
    assert torch.isfinite(model[1].running_mean).all()


def test_non_persistent_buffers_are_not_copied():
    """A persistent=False buffer (a causal mask, a rotary cache) is no training state: the
    snapshots (state_dict) do not hold it, and the skip copy leaves it out."""
    from numstab.frameworks.torch.guard_buffers import ModelBuffers

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model[0].register_buffer("mask", torch.ones(64, 64, dtype=torch.bool), persistent=False)
    kept = ModelBuffers(model)
    assert [name for _, name in kept.slots] == [
        "running_mean",
        "running_var",
        "num_batches_tracked",
    ]
