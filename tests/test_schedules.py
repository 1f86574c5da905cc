"""warmup_cosine_schedule: arguments, Python ints, and the torch / optax / Keras adapters
against optax.warmup_cosine_decay_schedule itself."""

from __future__ import annotations

import math

import numpy as np
import pytest

from numstab.errors import InvalidArgumentError
from numstab.schedules import WarmupCosineSchedule, warmup_cosine_schedule

CONFIG = {"base_lr": 0.1, "warmup_steps": 4, "total_steps": 20, "min_lr": 0.01}


def _optax_values(steps, base_lr, warmup_steps, total_steps, min_lr=0.0, warmup_start_lr=0.0):
    import jax.numpy as jnp
    import optax

    ref = optax.warmup_cosine_decay_schedule(
        init_value=warmup_start_lr,
        peak_value=base_lr,
        warmup_steps=warmup_steps,
        decay_steps=total_steps,
        end_value=min_lr,
    )
    return np.asarray(ref(jnp.asarray(steps)), np.float64)


@pytest.mark.parametrize(
    "config",
    [
        CONFIG,
        {"base_lr": 3e-4, "warmup_steps": 0, "total_steps": 7},
        {"base_lr": 1.0, "warmup_steps": 9, "total_steps": 10, "warmup_start_lr": 0.5},
        {"base_lr": 0.0, "warmup_steps": 2, "total_steps": 5},
    ],
)
def test_python_ints_and_jax_jit_equal_optax(config):
    import jax
    import jax.numpy as jnp

    schedule = warmup_cosine_schedule(**config)
    steps = np.arange(0, config["total_steps"] + 6)
    want = _optax_values(steps, **config)
    got = [schedule(int(s)) for s in steps]
    assert all(type(x) is float for x in got)
    # optax is float32: <= 12 roundings (pi, *, /, cos, +, alpha, 1 - alpha, *, +, base_lr, *,
    # jit's reciprocal), each <= eps32 of the peak lr (values and cos' argument are <= peak, pi)
    peak = max(config["base_lr"], config.get("warmup_start_lr", 0.0))
    atol = 12 * np.finfo(np.float32).eps * peak
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    jitted = jax.jit(schedule)(jnp.asarray(steps))
    np.testing.assert_allclose(np.asarray(jitted), want, rtol=0, atol=atol)
    assert schedule(config["total_steps"] + 1000) == pytest.approx(config.get("min_lr", 0.0))
    assert schedule(0) == pytest.approx(
        config.get("warmup_start_lr", 0.0) if config["warmup_steps"] else config["base_lr"]
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup_steps": 11, "total_steps": 10}, "total_steps > warmup_steps"),
        ({"warmup_steps": 10, "total_steps": 10}, "total_steps > warmup_steps"),
        ({"base_lr": -1.0}, "base_lr"),
        ({"base_lr": math.nan}, "base_lr"),
        ({"min_lr": 0.2}, "min_lr"),
        ({"min_lr": -0.1}, "min_lr"),
        ({"warmup_start_lr": 0.5}, "warmup_start_lr"),
        ({"warmup_steps": -1}, "warmup_steps >= 0"),
        ({"warmup_steps": 2.0}, "warmup_steps to be an int"),
        ({"total_steps": "10"}, "total_steps to be an int"),
        ({"base_lr": True}, "base_lr"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    args = {"base_lr": 0.1, "warmup_steps": 1, "total_steps": 10, **kwargs}
    with pytest.raises(InvalidArgumentError, match=match):
        warmup_cosine_schedule(**args)


@pytest.mark.parametrize("step", [1.5, -1, True, "3", None])
def test_bad_steps_raise(step):
    with pytest.raises(InvalidArgumentError, match="step"):
        warmup_cosine_schedule(**CONFIG)(step)


@pytest.mark.parametrize("count", ["3", None, [3]])
def test_the_optax_adapter_refuses_what_is_no_count(count):
    """``for_optax()`` took a Python count to a jax array first: "3" and None raised JAX's
    own errors. Negative and float counts stay accepted, as optax's schedules take them."""
    pytest.importorskip("optax")
    with pytest.raises(InvalidArgumentError, match="count"):
        warmup_cosine_schedule(**CONFIG).for_optax()(count)


def test_an_unknown_backend_raises_for_a_python_step():
    from numstab.errors import UnknownBackendError

    with pytest.raises(UnknownBackendError):
        warmup_cosine_schedule(**CONFIG)(3, backend="bogus")


def test_config_round_trip():
    schedule = warmup_cosine_schedule(**CONFIG)
    again = WarmupCosineSchedule(**schedule.get_config())
    assert [again(s) for s in range(25)] == [schedule(s) for s in range(25)]
    assert "warmup_steps=4" in repr(schedule)


def test_torch_lambda_lr_follows_the_schedule_per_group():
    import torch

    schedule = warmup_cosine_schedule(**CONFIG)
    w, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": 0.5}], lr=CONFIG["base_lr"])
    scheduler = schedule.torch_scheduler(opt)
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
    seen = []
    for _ in range(25):
        seen.append(scheduler.get_last_lr())
        opt.step()
        scheduler.step()
    want = np.array([schedule(s) for s in range(25)])
    np.testing.assert_allclose([s[0] for s in seen], want, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose([s[1] for s in seen], want * 5.0, rtol=1e-12, atol=1e-15)
    # resuming from a state dict continues the schedule
    state = scheduler.state_dict()
    opt2 = torch.optim.SGD([w], lr=CONFIG["base_lr"])
    resumed = schedule.torch_scheduler(opt2)
    resumed.load_state_dict(state)
    assert resumed.last_epoch == 25


def test_torch_adapter_arguments():
    """Typed errors where LambdaLR raised AttributeError (a model for the optimizer) or a
    KeyError (resuming at last_epoch >= 0 without initial_lr); resuming with it works."""
    import torch

    schedule = warmup_cosine_schedule(**CONFIG)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=CONFIG["base_lr"])
    with pytest.raises(InvalidArgumentError, match="optimizer of type Linear"):
        schedule.for_torch(model)
    for bad, match in [(-2, "last_epoch >= -1"), (2.5, "an int"), (True, "an int")]:
        with pytest.raises(InvalidArgumentError, match=match):
            schedule.for_torch(opt, last_epoch=bad)
    with pytest.raises(InvalidArgumentError, match=r"param_groups\[0\] without it"):
        schedule.for_torch(opt, last_epoch=5)
    schedule.for_torch(opt)  # writes initial_lr
    schedule.for_torch(opt, last_epoch=5)
    assert opt.param_groups[0]["lr"] == pytest.approx(schedule(6), rel=1e-12)


def test_optax_adapter_inside_an_optimizer():
    import jax
    import jax.numpy as jnp
    import optax

    schedule = warmup_cosine_schedule(**CONFIG)
    tx = optax.sgd(schedule.optax())
    ref = optax.sgd(optax.warmup_cosine_decay_schedule(0.0, 0.1, 4, 20, 0.01))
    params = {"w": jnp.ones(3)}
    grads = {"w": jnp.asarray([1.0, -2.0, 0.5])}
    s1, s2 = tx.init(params), ref.init(params)
    step = jax.jit(
        lambda tx_state, ref_state: (tx.update(grads, tx_state), ref.update(grads, ref_state))
    )
    for _ in range(24):
        (u1, s1), (u2, s2) = step(s1, s2)
        np.testing.assert_allclose(u1["w"], u2["w"], rtol=1e-6, atol=1e-9)


def test_keras_schedule_in_fit_and_serialised():
    import keras

    schedule = warmup_cosine_schedule(**CONFIG)
    lr = schedule.keras()
    assert isinstance(lr, keras.optimizers.schedules.LearningRateSchedule)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(lr))
    assert restored.get_config() == lr.get_config() == schedule.get_config()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(lr)
    model.compile(optimizer=opt, loss="mse")
    model.fit(np.ones((12, 2)), np.ones((12, 1)), batch_size=2, epochs=1, verbose=0)
    assert int(opt.iterations) == 6
    np.testing.assert_allclose(float(opt.learning_rate), schedule(6), rtol=1e-6)
    np.testing.assert_allclose(float(restored(6)), schedule(6), rtol=1e-6)


def test_adapters_are_named_as_the_guard_entry_points():
    """for_torch / for_optax / for_keras, as TrainingGuard.for_torch, ...; the earlier names
    are the same methods."""
    cls = type(warmup_cosine_schedule(1.0, warmup_steps=1, total_steps=3))
    assert cls is WarmupCosineSchedule
    assert cls.torch_scheduler is cls.for_torch
    assert cls.optax is cls.for_optax
    assert cls.keras is cls.for_keras
