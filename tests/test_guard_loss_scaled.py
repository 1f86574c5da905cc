"""The training guard beside a dynamic loss scaler: an overflow (finite loss, non-finite
gradients) is the scaler's to handle, routine while a fresh scaler's scale comes down. The
guard skips such a step without counting it toward a rollback: before, every 3 overflows in
16 steps rolled back and halved the learning rate (8x lower after the 9 overflows here)."""

from __future__ import annotations

import math

import pytest

from numstab.guard import TrainingGuard
from tests.accelerate_stub import Accelerated

torch = pytest.importorskip("torch")

OVERFLOWS = 9  # steps before the scale, 2**127 at first, comes down to where grads fit


def _torch_run(host_every: int, with_scaler_arg: bool, wrapped: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, growth_interval=10**6)
    guard = TrainingGuard(host_every=host_every)
    if wrapped:  # the Trainer's way: StepGuard around an optimizer whose step is the scaler's
        from numstab.frameworks.torch.step_guard import StepGuard

        accelerated = Accelerated(opt, scaler)
        sg = StepGuard(guard, locate=False)
        sg.attach(model, opt, hook_loss=False)
        sg.wrap(accelerated, scaler=lambda: scaler)
        tg = sg.torch_guard
    else:
        tg = guard.for_torch(model, opt, scaler=scaler if with_scaler_arg else None)
    g = torch.Generator().manual_seed(1)
    for _ in range(OVERFLOWS + 6):
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y) * 1e3
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if wrapped:
            sg.record_loss(loss)
            accelerated.step()
        else:
            tg.step(loss, step_fn=lambda: scaler.step(opt))
            scaler.update()
    tg.flush()
    events = [e["event"] for e in tg.events]
    return events, opt.param_groups[0]["lr"], model


@pytest.mark.parametrize("host_every", [1, 4])
def test_torch_overflows_of_the_scaler_do_not_roll_back(host_every):
    events, lr, model = _torch_run(host_every, with_scaler_arg=True)
    assert events.count("skip") >= OVERFLOWS and "rollback" not in events, events
    assert lr == 0.1 and all(torch.isfinite(p).all() for p in model.parameters())
    events, lr, _ = _torch_run(host_every, with_scaler_arg=False)  # the test can fail
    assert events.count("rollback") >= 2 and lr < 0.1 / 2


def test_trainer_step_guard_passes_its_scaler():
    events, lr, _ = _torch_run(1, with_scaler_arg=False, wrapped=True)
    assert events.count("skip") >= OVERFLOWS and "rollback" not in events, events
    assert lr == 0.1


def test_a_nan_loss_still_counts_under_a_scaler():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    tg = TrainingGuard(rollback_after=2).for_torch(model, opt, scaler=scaler)
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        tg.step(math.nan)
    assert [e["event"] for e in tg.events].count("rollback") >= 1


def test_scaler_argument_is_checked():
    from numstab.errors import InvalidArgumentError

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InvalidArgumentError, match=r"scaler to be a torch\.amp\.GradScaler"):
        TrainingGuard().for_torch(model, opt, scaler="fp16")


@pytest.mark.parametrize("host_every", [1, 3])
def test_optax_guard_around_loss_scaled_lets_the_scaler_back_off(host_every):
    """The guard skipped the overflow and put the whole old optimizer state back, the scale
    included: the scaler never backed off, every step overflowed, rollbacks until the guard
    gave up. Now the scale comes down and training goes on; the recorded norm is unscaled."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    optax = pytest.importorskip("optax")
    import numstab as ns
    from numstab.integrations.optax import current_scale, loss_scaled, scale_loss

    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8)) * 30
    params = {"w": jax.random.normal(jax.random.PRNGKey(0), (8, 4)) * 0.5, "b": jnp.zeros(4)}
    scaler = ns.LossScaler(init_scale=2.0**126, growth_interval=10**6)
    tx = loss_scaled(optax.sgd(1e-4), scaler)
    og = TrainingGuard(host_every=host_every).for_optax()
    opt = tx.init(params)
    gstate = og.init(params, opt)

    def loss_fn(p):
        return jnp.mean((x @ p["w"] + p["b"] - 1.0) ** 2)

    @jax.jit
    def step(params, opt, gstate):
        scaled = lambda p: (scale_loss(loss_fn(p), opt), loss_fn(p))
        (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(params)
        return og.step(tx, params, opt, gstate, loss, grads)

    norms = []
    for _ in range(OVERFLOWS + 8):
        norms.append(float(optax.global_norm(jax.grad(loss_fn)(params))))
        params, opt, gstate, d = step(params, opt, gstate)
        params, opt, gstate = og.after_step(d, params, opt, gstate)
    params, opt, gstate = og.flush(params, opt, gstate)
    events = [e["event"] for e in og.events]
    assert "rollback" not in events and events.count("skip") >= 3, events
    assert float(current_scale(opt)) < 2.0**120
    history = og.history.as_arrays()
    applied = history["applied"]
    assert applied[-4:].all(), history["applied"]
    recorded = history["grad_norm"][applied]
    want = [n for n, a in zip(norms, applied, strict=True) if a]
    assert recorded == pytest.approx(want, rel=1e-4)


def test_decide_takes_the_scalers_verdict():
    from numstab.errors import InvalidArgumentError

    guard = TrainingGuard(rollback_after=2)
    np = pytest.importorskip("numpy")
    cases = (
        (True, False, "numpy"),
        (np.bool_(True), False, "numpy"),
        (torch.tensor(True), False, "torch"),
        (torch.tensor(False), True, "torch"),
        (torch.tensor(True), False, "numpy"),  # a foreign bool: raised torch's own error
        (None, True, "numpy"),
    )
    for overflow, rollbacks, be in cases:
        state = guard.init_state(be)
        for _ in range(2):
            d, state = guard.decide(state, 1.0, math.inf, be, scaler_overflow=overflow)
            assert not d.apply
        assert bool(d.rollback) is rollbacks, overflow
    state = guard.init_state()
    for _ in range(2):  # a non-finite loss is no overflow of the scaler's: it counts
        d, state = guard.decide(state, math.nan, math.inf, scaler_overflow=True)
    assert bool(d.rollback)
    for bad in ("yes", 1, [True, False]):
        with pytest.raises(InvalidArgumentError, match="scaler_overflow to be a bool"):
            guard.decide(guard.init_state(), 1.0, 1.0, scaler_overflow=bad)
