"""numstab.guard in a PyTorch loop: a NaN at step k kills an unguarded run and not a guarded
one; rollback restores model and optimizer exactly and lowers the LR; disk snapshots; history."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from numstab.errors import InvalidArgumentError  # noqa: E402
from numstab.guard import TrainingGuard, load_npz, read_log  # noqa: E402

STEPS, BATCH = 150, 32
_g = torch.Generator().manual_seed(0)
X = torch.randn(256, 8, generator=_g)
Y = X @ torch.randn(8, 1, generator=_g) + 0.1 * torch.randn(256, 1, generator=_g)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: torch's thread pool only adds contention on a shared CPU (20x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def batch(step: int, nan_steps=()):
    i = (step % 8) * BATCH
    x = X[i : i + BATCH].clone()
    if step in nan_steps:
        x[0, 0] = math.nan
    return x, Y[i : i + BATCH]


def train(guard: TrainingGuard | None, nan_steps=(), steps: int = STEPS, on_step=None):
    model, opt = make()
    tg = guard.for_torch(model, opt) if guard is not None else None
    for step in range(steps):
        x, y = batch(step, nan_steps)
        if tg is not None and tg.skip_batch():
            continue
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if tg is None:
            opt.step()
        else:
            tg.step(loss)
        if on_step is not None:
            on_step(step, model, opt, tg)
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(X), Y).item()
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    return final, finite, model, opt, tg


def test_nan_at_step_k_kills_the_plain_loop_and_the_guard_survives_it(tmp_path):
    clean, clean_finite, *_ = train(None)
    dead, dead_finite, *_ = train(None, nan_steps={40})
    log = tmp_path / "guard.jsonl"
    kept, finite, _, _, tg = train(TrainingGuard(log_path=log), nan_steps={40})
    assert clean_finite and math.isfinite(clean)
    assert not dead_finite and math.isnan(dead)  # without the guard the run dies
    assert finite and abs(kept - clean) <= 0.05 * clean, (kept, clean)
    skips = [e for e in read_log(log) if e["event"] == "skip"]
    assert [(e["step"], e["reasons"]) for e in skips] == [
        (40, ["nonfinite_loss", "nonfinite_grad"])
    ]
    assert skips[0]["loss"] == "NaN"
    assert tg.runner.skipped == 1 and tg.runner.rollbacks == 0


def test_a_finite_loss_spike_is_skipped_after_the_warmup():
    def spiky(step):
        x, y = batch(step)
        return (x * 30.0, y) if step == 100 else (x, y)

    model, opt = make()
    tg = TrainingGuard().for_torch(model, opt)
    applied = []
    for step in range(105):
        x, y = spiky(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        applied.append(tg.step(loss))
    assert applied == [i != 100 for i in range(105)]
    skip = next(e for e in tg.events if e["event"] == "skip")
    assert skip["step"] == 100 and "loss_spike" in skip["reasons"]
    assert skip["loss_z"] > 6.0 and math.isfinite(skip["loss"])


def test_rollback_restores_model_and_optimizer_exactly_and_lowers_the_lr():
    guard = TrainingGuard(snapshot_every=10, rollback_after=3, skip_after_rollback=2)
    seen = {}

    def on_step(step, model, opt, tg):
        if step == 19:  # the snapshot after 20 good steps
            seen["params"] = [p.detach().clone() for p in model.parameters()]
            seen["exp_avg"] = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
        if step == 22:  # the third NaN: rolled back right now
            seen["after"] = [p.detach().clone() for p in model.parameters()]
            seen["exp_avg_after"] = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
            seen["lr"] = opt.param_groups[0]["lr"]
            seen["adam_step"] = float(opt.state[next(model.parameters())]["step"])

    final, finite, _, opt, tg = train(guard, nan_steps={20, 21, 22}, on_step=on_step)
    for a, b in zip(seen["params"], seen["after"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(seen["exp_avg"], seen["exp_avg_after"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert seen["lr"] == pytest.approx(0.025) and seen["adam_step"] == 20.0
    events = [(e["event"], e["step"]) for e in tg.events if e["event"] != "snapshot"]
    assert events == [
        ("skip", 20),
        ("skip", 21),
        ("skip", 22),
        ("rollback", 22),
        ("skip_batch", 23),
        ("skip_batch", 23),
    ]
    rollback = next(e for e in tg.events if e["event"] == "rollback")
    assert rollback["to_step"] == 20 and rollback["offending_steps"] == [20, 21, 22]
    assert rollback["lr_factor"] == 0.5
    assert finite and math.isfinite(final) and opt.param_groups[0]["lr"] == pytest.approx(0.025)


def test_disk_snapshots_resume_a_fresh_model(tmp_path):
    guard = TrainingGuard(snapshot_every=25, snapshot_dir=tmp_path, keep_on_disk=2)
    train(guard, steps=60)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["snapshot-000000025.npz", "snapshot-000000050.npz"]
    tree = load_npz(tmp_path / files[-1])  # plain arrays, no pickle
    assert set(tree) == {"payload", "guard_state", "lr_factor", "step"} and tree["step"] == 50
    fresh, fresh_opt = make()
    resumed = TrainingGuard(snapshot_dir=tmp_path).for_torch(fresh, fresh_opt)
    assert resumed.load_snapshot() == 50 and resumed.steps_seen == 50
    saved = tree["payload"]["model"]
    for name, p in fresh.named_parameters():
        np.testing.assert_array_equal(p.detach().numpy(), saved[name])
    assert fresh_opt.state_dict()["param_groups"][0]["betas"] == (0.9, 0.999)
    assert float(fresh_opt.state[next(fresh.parameters())]["step"]) == 50.0


def test_snapshot_files_that_do_not_fit_raise_before_restoring(tmp_path):
    """Each gave its own error: FileNotFoundError, ValueError, zipfile.BadZipFile, torch's
    RuntimeError after loading the parameters that fit, or a broadcast error one step later
    (a file of a guard with another rollback_window)."""
    guard = TrainingGuard(snapshot_every=25, snapshot_dir=tmp_path, keep_on_disk=2)
    train(guard, steps=30)
    fresh, fresh_opt = make()
    before = [p.detach().clone() for p in fresh.parameters()]
    tg = TrainingGuard(snapshot_dir=tmp_path).for_torch(fresh, fresh_opt)
    for step in (7, "25", 2.5, -1, True):
        with pytest.raises(InvalidArgumentError, match=r"step"):
            tg.load_snapshot(step)
    other = TrainingGuard(snapshot_dir=tmp_path, rollback_window=4, rollback_after=2)
    with pytest.raises(InvalidArgumentError, match=r"bad_flags of shape \(4,\)"):
        other.for_torch(fresh, fresh_opt).load_snapshot()
    wide = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    wide_opt = torch.optim.Adam(wide.parameters())
    with pytest.raises(InvalidArgumentError, match=r"'0.weight' of shape \(32, 8\)"):
        TrainingGuard(snapshot_dir=tmp_path).for_torch(wide, wide_opt).load_snapshot()
    two_groups = torch.optim.Adam([{"params": [p]} for p in fresh.parameters()])
    with pytest.raises(InvalidArgumentError, match="optimizer's parameter groups"):
        TrainingGuard(snapshot_dir=tmp_path).for_torch(fresh, two_groups).load_snapshot()
    path = tmp_path / "snapshot-000000025.npz"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a truncated file
    with pytest.raises(InvalidArgumentError, match="Expected a numstab snapshot file"):
        tg.load_snapshot(25)
    for p, b in zip(fresh.parameters(), before, strict=True):
        assert torch.equal(p, b)  # nothing was restored by a rejected load
    assert tg.steps_seen == 0


def test_history_holds_fused_layer_norms_and_exports(tmp_path):
    _, _, model, _, tg = train(TrainingGuard(), steps=12, nan_steps={5})
    h = tg.history.as_arrays()
    assert h["names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert h["layer_norms"].shape == (12, 4) and h["step"].tolist() == list(range(12))
    assert h["applied"].tolist() == [i != 5 for i in range(12)]
    ok = h["applied"]
    np.testing.assert_allclose(
        np.sqrt((h["layer_norms"][ok] ** 2).sum(1)), h["grad_norm"][ok], rtol=1e-5
    )
    # the last row is the norm of the last step's gradients
    last = [torch.linalg.vector_norm(p.grad).item() for p in model.parameters()]
    np.testing.assert_allclose(h["layer_norms"][-1], last, rtol=1e-5)
    tg.history.to_csv(tmp_path / "h.csv")
    rows = (tmp_path / "h.csv").read_text().splitlines()
    assert rows[0] == "step,applied,loss,grad_norm,0.weight,0.bias,2.weight,2.bias"
    assert len(rows) == 13
    tg.history.plot(tmp_path / "h.png")
    assert (tmp_path / "h.png").stat().st_size > 0


def test_torch_bad_arguments():
    model, opt = make()
    with pytest.raises(InvalidArgumentError, match=r"torch\.nn\.Module"):
        TrainingGuard().for_torch("model", opt)
    with pytest.raises(InvalidArgumentError, match=r"torch\.optim\.Optimizer"):
        TrainingGuard().for_torch(model, [opt])
    with pytest.raises(InvalidArgumentError, match=r"process_group to be a torch\.distributed"):
        TrainingGuard().for_torch(model, opt, process_group="x")  # AttributeError at a step
    tg = TrainingGuard().for_torch(model, opt)
    with pytest.raises(InvalidArgumentError, match=r"loss to be a scalar \(one element\)"):
        tg.step(torch.ones(3))
    with pytest.raises(InvalidArgumentError, match="loss to be a scalar number"):
        tg.step("1.0")
    # the rule of TrainingGuard.decide: a complex loss lost its imaginary part, a bool or
    # float8 one was taken as a number, a NumPy 0-d array was refused
    for loss in (torch.tensor(1 + 1j), torch.tensor(True), torch.ones(()).to(torch.float8_e4m3fn)):
        with pytest.raises(InvalidArgumentError, match="loss of a floating"):
            tg.step(loss)
    with pytest.raises(InvalidArgumentError, match="step_fn to be a callable"):
        tg.step(1.0, step_fn=5)  # was a TypeError after the decision had counted the step
    assert tg.steps_seen == 0 and not tg.history.as_arrays()["step"].size
    assert tg.step(np.array(1.0)) and tg.step(np.float32(1.0)) and tg.steps_seen == 2


def test_a_step_fn_that_raises_leaves_the_guard_as_before_the_step():
    # a loop that catches the error (an OOM, say) and goes on must not find the guard one
    # step ahead with no history row for it
    model, opt = make()
    tg = TrainingGuard().for_torch(model, opt)
    assert tg.step(1.0)

    def oom():
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        tg.step(1.0, step_fn=oom)
    assert tg.steps_seen == 1 and tg.history.as_arrays()["step"].tolist() == [0]
    assert tg.step(1.0) and tg.steps_seen == 2


def test_rollback_scales_a_scheduler_base_lr_so_the_factor_survives_scheduler_steps():
    model, opt = make()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))
    tg = TrainingGuard(snapshot_every=5, rollback_after=2).for_torch(model, opt, scheduler=sched)
    for step in range(12):
        x, y = batch(step, nan_steps={8, 9})
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if tg.step(torch.nn.functional.mse_loss(model(x), y)):
            sched.step()
    # rolled back at step 9 to the snapshot after 5 steps; then 2 more applied steps
    assert [e["event"] for e in tg.events if e["event"] != "snapshot"] == [
        "skip",
        "skip",
        "rollback",
    ]
    assert sched.base_lrs == [pytest.approx(0.025)]
    assert sched.last_epoch == 5 + 2
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025 / (1 + 0.01 * 7))


@pytest.mark.parametrize("host_every", [1, 4])
def test_measure_grads_decides_on_the_gradients_before_clipping(host_every):
    model, opt = make()
    tg = TrainingGuard(host_every=host_every).for_torch(model, opt)
    x, y = batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    before = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    tg.measure_grads()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    assert tg.step(1.0)
    tg.flush()
    (recorded,) = tg.history.as_arrays()["grad_norm"]
    assert recorded == pytest.approx(before.item(), rel=1e-5) and recorded > 1e-2
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    assert tg.step(1.0)  # not measured: read at the step, clipped
    tg.flush()
    assert tg.history.as_arrays()["grad_norm"][1] == pytest.approx(1e-3, rel=1e-4)


@pytest.mark.parametrize(("host_every", "optim"), [(1, "adam"), (4, "adam"), (4, "sgd")])
def test_a_layer_unfrozen_after_the_guard_was_built_is_checked_and_undone(
    host_every, optim, monkeypatch
):
    """Gradual unfreezing: the guard took the trainable parameters at construction, so a NaN
    gradient in a layer unfrozen later was applied (host mode) or, in device mode, the
    skipped step was undone everywhere but there (it was not in the backup)."""
    from numstab.frameworks.torch import guard_compiled

    monkeypatch.setattr(guard_compiled, "_compiled", lambda *a: None)  # eager: no compile time
    model, _ = make()
    opt = (
        torch.optim.Adam(model.parameters(), lr=0.05)
        if optim == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    )
    model[0].requires_grad_(False)
    tg = TrainingGuard(host_every=host_every).for_torch(model, opt)
    for step in range(6):
        if step == 2:
            model[0].requires_grad_(True)
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == 4:
            model[0].weight.grad[0, 0] = math.nan  # the unfrozen layer's gradient only
        tg.step(torch.nn.functional.mse_loss(model(x), y))
    tg.flush()
    assert [e["step"] for e in tg.events if e["event"] == "skip"] == [4]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert tg.history.names == ["0.weight", "0.bias", "2.weight", "2.bias"]  # frozen ones too
    layers = tg.history.as_arrays()["layer_norms"]
    assert layers[0, 0] == 0 and layers[2, 0] > 0  # frozen: no gradient, norm 0


def test_a_rollback_after_add_param_group_keeps_the_added_group():
    """Lightning's BackboneFinetuning adds a param group: rolling back to a snapshot taken
    before raised torch's ValueError (a different number of parameter groups)."""
    model, _ = make()
    opt = torch.optim.Adam(model[2].parameters(), lr=0.05)
    tg = TrainingGuard(rollback_after=1, rollback_window=2).for_torch(model, opt)
    snapshot = [p.detach().clone() for p in model.parameters()]
    for step in range(2):  # one applied step on the head alone, then the group is added
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == 1:
            opt.add_param_group({"params": list(model[0].parameters()), "lr": 0.01})
        assert tg.step(torch.nn.functional.mse_loss(model(x), y))
    x, y = batch(2, nan_steps={2})
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert not tg.step(torch.nn.functional.mse_loss(model(x), y))
    assert [e["to_step"] for e in tg.events if e["event"] == "rollback"] == [0]
    for p, before in zip(model.parameters(), snapshot, strict=True):
        torch.testing.assert_close(p.detach(), before, rtol=0, atol=0)
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.025), pytest.approx(0.005)]
    assert not opt.state  # as at the snapshot: no state for either group
    x, y = batch(3)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert tg.step(torch.nn.functional.mse_loss(model(x), y))  # the run goes on, both groups
    assert model[0].weight.detach().ne(snapshot[0]).any() and len(opt.state) == 4
    opt.param_groups[0]["params"].pop()  # any other change of the groups: a typed error
    with pytest.raises(InvalidArgumentError, match=r"changed to sizes \[1, 2\]"):
        tg.restore(tg.runner.ring.latest().payload)


@pytest.mark.parametrize("host_every", [1, 3])
def test_a_group_added_over_foreign_tensors_is_refused_at_the_next_step(host_every):
    """add_param_group over a tensor outside the model (checked at construction only, before):
    its NaN gradient was applied and no rollback restored it. Refused before anything moves;
    a group of the model's own parameters is taken."""
    model, _ = make()
    opt = torch.optim.SGD(model[2].parameters(), lr=0.05)
    tg = TrainingGuard(host_every=host_every).for_torch(model, opt)
    opt.add_param_group({"params": list(model[0].parameters())})
    foreign = torch.nn.Parameter(torch.ones(3))
    opt.add_param_group({"params": [foreign]})
    x, y = batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    foreign.grad = torch.full((3,), math.nan)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(InvalidArgumentError, match=r"add_param_group.*1 optimizer parameter"):
        tg.step(torch.nn.functional.mse_loss(model(x), y))
    assert torch.equal(foreign, torch.ones(3))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    opt.param_groups.pop()  # the user's fix: the model's groups only, checked again
    assert tg.step(torch.nn.functional.mse_loss(model(x), y))


def test_a_second_rollback_scales_the_added_group_once():
    """The added group kept its learning rate through a restore, yet was multiplied by the
    new factor over the snapshot's: after a second rollback, past an earlier snapshot, by
    0.25 / 1 rather than 0.25 / 0.5 (once too often)."""
    model, _ = make()
    opt = torch.optim.SGD(model[2].parameters(), lr=0.05)
    tg = TrainingGuard(snapshot_every=2, rollback_after=1, rollback_window=2).for_torch(model, opt)
    lrs = []
    for step, bad in enumerate([False, False, False, True, True]):  # snapshots at 0 and 2
        x, y = batch(step, nan_steps={step} if bad else set())
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == 2:
            opt.add_param_group({"params": list(model[0].parameters()), "lr": 0.01})
        tg.step(torch.nn.functional.mse_loss(model(x), y))
        lrs.append([g["lr"] for g in opt.param_groups])
    rollbacks = [(e["to_step"], e["lr_factor"]) for e in tg.events if e["event"] == "rollback"]
    assert rollbacks == [(2, 0.5), (0, 0.25)]
    assert lrs[-2] == [pytest.approx(0.025), pytest.approx(0.005)]
    assert lrs[-1] == [pytest.approx(0.0125), pytest.approx(0.0025)]


def test_step_guard_names_the_skip_after_a_rollback_and_locates_only_once(caplog):
    """The skip message read the last event, a rollback's: "skipped step 2 ()"; a
    locate_nonfinite that failed (a compiled module) was tried again on every bad step; and
    the step logged locate's message in place of its own skip message."""
    from numstab.frameworks.torch.step_guard import StepGuard

    model, opt = make()
    sg = StepGuard(TrainingGuard(rollback_after=2, rollback_window=2))
    sg.attach(model, opt, hook_loss=False)
    sg.wrap(opt)
    replays = []

    def replay():
        replays.append(1)
        raise RuntimeError("cannot replay a compiled module")

    for step in range(4):
        x, y = batch(step, nan_steps={1, 2})
        sg.replay = functools.partial(replay)  # as the hooks keep it
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        sg.record_loss(loss)
        opt.step()
    assert [e["event"] for e in sg.torch_guard.events][-2:] == ["skip", "rollback"]
    assert sg.messages == [
        "numstab: skipped step 1 (nonfinite_loss, nonfinite_grad)",
        "numstab: locate_nonfinite failed: RuntimeError('cannot replay a compiled module')",
        "numstab: skipped step 2 (nonfinite_loss, nonfinite_grad)",
    ]
    assert len(replays) == 1 and sg.skipped == 2
    assert [r.getMessage() for r in caplog.records if r.name == "numstab"] == sg.messages


def test_device_mode_history_stays_in_step_after_a_step_fn_that_raised(monkeypatch):
    """With host_every > 1 the device state counts a step whose step_fn raised; the host's
    count did not, so every later row was read as the step before's (the NaN batch's skip
    logged one step early)."""
    from numstab.frameworks.torch import guard_compiled

    monkeypatch.setattr(guard_compiled, "_compiled", lambda *a: None)  # eager: no compile time
    model, opt = make()
    tg = TrainingGuard(host_every=4).for_torch(model, opt)

    def oom():
        raise RuntimeError("out of memory")

    for step in range(8):
        x, y = batch(step, nan_steps={5})
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == 2:
            with pytest.raises(RuntimeError, match="out of memory"):
                tg.step(loss, step_fn=oom)
            continue
        tg.step(loss)
    tg.flush()
    assert tg.history.as_arrays()["step"].tolist() == list(range(8))
    assert [e["step"] for e in tg.events if e["event"] == "skip"] == [5]
