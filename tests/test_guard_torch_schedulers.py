"""A torch guard's LR cut under every scheduler of torch.optim.lr_scheduler that computes
LRs from stored values (docs/semantics.md §16.6): after each rollback, every LR the scheduler
gives is the cumulative ``lr_factor`` times the LR an unguarded run of the same schedule gives
at the same scheduler step; ``get_last_lr()`` is the cut LRs at once; a second rollback to
one snapshot does not scale twice."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from torch.optim import lr_scheduler as L  # noqa: E402

import numstab  # noqa: E402
from numstab.frameworks.torch import lr_scaling  # noqa: E402
from numstab.guard import TrainingGuard  # noqa: E402

EPS64 = torch.finfo(torch.float64).eps
LRS = (0.1, 0.05)  # the param groups' learning rates
FACTOR = 0.3  # not a power of 2: the cut rounds, so the tolerance is exercised
AFTER = 14  # scheduler steps checked after the last rollback (>= 10)

SCHEDULERS = {
    "LambdaLR": lambda o, n: L.LambdaLR(o, lambda t: 0.9**t),
    "MultiplicativeLR": lambda o, n: L.MultiplicativeLR(o, lambda t: 0.95),
    "StepLR": lambda o, n: L.StepLR(o, step_size=3, gamma=0.5),
    "MultiStepLR": lambda o, n: L.MultiStepLR(o, [4, 9, 15, 22], gamma=0.5),
    "ConstantLR": lambda o, n: L.ConstantLR(o, factor=0.5, total_iters=12),
    "LinearLR": lambda o, n: L.LinearLR(o, 0.2, 1.0, total_iters=20),
    "ExponentialLR": lambda o, n: L.ExponentialLR(o, gamma=0.9),
    "PolynomialLR": lambda o, n: L.PolynomialLR(o, total_iters=40, power=2.0),
    "CosineAnnealingLR": lambda o, n: L.CosineAnnealingLR(o, T_max=7, eta_min=0.01),
    "CosineAnnealingWarmRestarts": lambda o, n: L.CosineAnnealingWarmRestarts(
        o, T_0=5, T_mult=2, eta_min=0.01
    ),
    "CyclicLR": lambda o, n: L.CyclicLR(o, [0.01, 0.004][:n], [0.1, 0.05][:n], step_size_up=4),
    "OneCycleLR": lambda o, n: L.OneCycleLR(o, [0.1, 0.05][:n], total_steps=80),
    "SequentialLR": lambda o, n: L.SequentialLR(
        o, [L.LinearLR(o, 0.1, 1.0, 4), L.CosineAnnealingLR(o, 6, eta_min=0.01)], [5]
    ),
    "ChainedScheduler": lambda o, n: L.ChainedScheduler(
        [L.ConstantLR(o, 0.5, 6), L.CosineAnnealingLR(o, 8, eta_min=0.005)]
    ),
    "ReduceLROnPlateau": lambda o, n: L.ReduceLROnPlateau(
        o, factor=0.5, patience=1, min_lr=[0.02, 0.01][:n]
    ),
    "WarmupCosineSchedule": lambda o, n: numstab.WarmupCosineSchedule(
        0.1, warmup_steps=4, total_steps=30, min_lr=0.01
    ).for_torch(o),
}

# (NaN batches, keep_snapshots): one rollback; two to one snapshot (only one kept); two to
# two snapshots (the second goes one further back); a second one to a snapshot taken after
# the first rollback (its LRs already cut once)
SCENARIOS = {
    "one": ({9}, 2),
    "twice_to_one_snapshot": ({9, 11}, 1),
    "to_two_snapshots": ({9, 11}, 2),
    "to_a_later_snapshot": ({6, 16}, 2),
}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: torch's thread pool only adds contention on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _setup(name: str, groups: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 1) for _ in range(groups)])
    params = [
        {"params": m.parameters(), "lr": lr} for m, lr in zip(model, LRS[:groups], strict=True)
    ]
    opt = torch.optim.SGD(params, lr=LRS[0])
    return model, opt, SCHEDULERS[name](opt, groups)


def _step(scheduler) -> None:
    if isinstance(scheduler, L.ReduceLROnPlateau):
        scheduler.step(1.0)  # a plateau: the LR drops every patience + 1 steps to min_lrs
    else:
        scheduler.step()


def _position(scheduler) -> int:
    """The scheduler steps taken (ChainedScheduler: its first child's)."""
    if hasattr(scheduler, "last_epoch"):
        return scheduler.last_epoch
    return _position(scheduler._schedulers[0])


def _lrs(opt) -> list[float]:
    return [float(g["lr"]) for g in opt.param_groups]


def _reference(name: str, groups: int, steps: int) -> list[list[float]]:
    """The LRs of an unguarded run after 0, 1, ..., ``steps`` scheduler steps."""
    _, opt, scheduler = _setup(name, groups)
    out = [_lrs(opt)]
    for _ in range(steps):
        opt.step()  # no gradients: a no-op, in torch's order (no warning)
        _step(scheduler)
        out.append(_lrs(opt))
    return out


def _guarded(name: str, groups: int, nan_at: set[int], keep: int):
    """A guarded run (a snapshot every 4 applied steps, a rollback at each NaN batch, the
    scheduler stepped after each applied step) until AFTER scheduler steps past the last
    rollback; per batch: (scheduler position, the LR factor, group LRs, get_last_lr())."""
    model, opt, scheduler = _setup(name, groups)
    guard = TrainingGuard(
        snapshot_every=4,
        keep_snapshots=keep,
        rollback_after=1,
        lr_factor=FACTOR,
        loss_spikes=None,
        grad_norm_spikes=None,
    )
    tg = guard.for_torch(model, opt, scheduler=scheduler)
    records, factor, since = [], 1.0, None
    for t in range(200):
        bad = math.nan if t in nan_at else 1.0
        opt.zero_grad()
        loss = sum(p.sum() for p in model.parameters()) * 0.0 + bad
        loss.backward()
        if tg.step(loss):
            _step(scheduler)
            since = None if since is None else since + 1
        rollbacks = [e for e in tg.events if e["event"] == "rollback"]
        if len(rollbacks) == len(nan_at):
            factor, since = rollbacks[-1]["lr_factor"], since or 0
        elif rollbacks:
            factor = rollbacks[-1]["lr_factor"]
        last = [float(x) for x in scheduler.get_last_lr()]
        records.append((_position(scheduler), factor, _lrs(opt), last))
        if since is not None and since >= AFTER:
            return records, len(rollbacks)
    raise AssertionError("the run did not get AFTER scheduler steps past its rollbacks")


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_lr_after_a_rollback_is_the_cut_times_the_unguarded_one(name, scenario, groups):
    nan_at, keep = SCENARIOS[scenario]
    records, rollbacks = _guarded(name, groups, nan_at, keep)
    assert rollbacks == len(nan_at)
    reference = _reference(name, groups, max(r[0] for r in records))
    # each LR is the same few float64 operations on values cut once per rollback (a
    # recursive scheduler: one multiply-add per step since the snapshot): a few ulps of the
    # largest LR per step
    tol = 8 * EPS64 * max(LRS) * (len(records) + 1)
    for t, (position, factor, lrs, last) in enumerate(records):
        want = [factor * x for x in reference[position]]
        assert lrs == pytest.approx(want, rel=0, abs=tol), (t, position)
        assert last == pytest.approx(lrs, rel=0, abs=tol), (t, "get_last_lr")
    assert factor == pytest.approx(FACTOR ** len(nan_at), rel=4 * torch.finfo().eps)


def test_a_user_scheduler_gets_its_base_lrs_cut_and_the_rest_left_alone():
    """An unknown scheduler class: what it has of the known LR attributes is cut, anything
    else stays, nothing raises."""

    class Halving(L.LRScheduler):
        def __init__(self, opt):
            self.note, self.eta_min = "kept", None
            super().__init__(opt)

        def get_lr(self):
            return [b * 0.5 ** (self.last_epoch // 3) for b in self.base_lrs]

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = Halving(opt)
    lr_scaling.scale_lr(opt, sched, 0.25, 0.25, kept=1, restored=True)
    assert sched.base_lrs == [0.025] and sched.note == "kept" and sched.eta_min is None
    assert sched.get_last_lr() == [0.025] and opt.param_groups[0]["lr"] == 0.025


def test_groups_added_after_the_snapshot_take_ratio_now_and_a_scalar_takes_ratio():
    """Group i < kept (restored): ``ratio``; later groups: ``ratio_now``; a scalar eta_min
    (restored with the scheduler's state): ``ratio``; a scheduler not restored: all
    ``ratio_now``."""
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    sched = L.CosineAnnealingLR(opt, T_max=5, eta_min=0.01)
    opt.add_param_group({"params": b.parameters(), "lr": 0.2, "initial_lr": 0.2})
    sched.base_lrs.append(0.2)
    lr_scaling.scale_lr(opt, sched, 0.5, 0.25, kept=1, restored=True)
    assert _lrs(opt) == [0.05, 0.05] and sched.base_lrs == [0.05, 0.05]
    assert sched.eta_min == 0.005 and sched.get_last_lr() == [0.05, 0.05]
    lr_scaling.scale_lr(opt, sched, 0.5, 0.25, kept=1, restored=False)
    assert _lrs(opt) == [0.025, 0.0125] and sched.base_lrs == [0.0125, 0.0125]
    assert sched.eta_min == 0.00125


def test_tensor_lrs_are_cut_in_place():
    """An optimizer built with a tensor lr keeps its tensors (scaled in place)."""
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([w], lr=torch.tensor(0.1))
    sched = L.LambdaLR(opt, lambda t: 1.0)
    lr = opt.param_groups[0]["lr"]
    lr_scaling.scale_lr(opt, sched, 0.5, 0.5, kept=1, restored=True)
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.05)
    (last,) = sched.get_last_lr()
    assert float(last) == pytest.approx(0.05) and last is not lr
