"""numstab.integrations.keras.LossScaleOptimizer: trajectories against Keras 3 and tf-keras,
skip semantics, model.fit, checkpoints, clipping order, argument errors."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
if keras.backend.backend() != "tensorflow":
    pytest.skip("Keras runs another backend in this process", allow_module_level=True)

import numstab  # noqa: E402
from numstab import InvalidArgumentError, LossScaler, LossScaleState  # noqa: E402
from numstab.integrations.keras import LossScaleOptimizer  # noqa: E402

F, INF, NAN = 0.5, math.inf, math.nan  # a finite unscaled gradient value, and two bad ones
# finite / non-finite steps: growths at 3 in a row, back-to-back overflows, growth after them
PATTERN = [F, F, F, INF, F, F, F, F, NAN, NAN, F, F, F, F, F, F, INF, F]


def _state(opt: LossScaleOptimizer) -> tuple[float, int, int]:
    s = opt.state
    return (float(s.scale), int(s.growth_tracker), int(s.hysteresis_left))


def _feed(opt, var, value: float) -> None:
    """One apply() of an unscaled gradient ``value`` (every element), scaled by opt's scale."""
    scale = opt.dynamic_scale if opt.built else opt.initial_scale
    opt.apply([tf.fill(var.shape, tf.constant(value, tf.float32)) * scale], [var])


# -- trajectories against the libraries the presets name ---------------------------------------


def test_keras_preset_matches_keras3_loss_scale_optimizer_step_by_step():
    ours = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), LossScaler.preset("keras", growth_interval=3)
    )
    theirs = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), dynamic_growth_steps=3)
    w_ours = keras.Variable(np.ones(3, np.float32))
    w_theirs = keras.Variable(np.ones(3, np.float32))
    assert ours.initial_scale == theirs.initial_scale == 2.0**15
    seen = set()
    for step, g in enumerate(PATTERN):
        _feed(ours, w_ours, g)
        _feed(theirs, w_theirs, g)
        context = f"step {step}, gradient {g}"
        assert float(ours.dynamic_scale) == float(theirs.dynamic_scale), context
        assert int(ours.growth_tracker) == int(theirs.step_counter), context
        assert int(ours.iterations) == int(theirs.iterations), context
        np.testing.assert_array_equal(w_ours.numpy(), w_theirs.numpy(), err_msg=context)
        seen.add(float(ours.dynamic_scale))
    # the pattern did exercise growth and backoff
    assert int(ours.iterations) == PATTERN.count(F)
    assert min(seen) < 2.0**15 < max(seen)


def test_tf_keras_preset_matches_tf_keras_loss_scale_optimizer_including_floor():
    tf_keras = pytest.importorskip("tf_keras")
    ours = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), LossScaler.preset("tf_keras", init_scale=4.0, growth_interval=3)
    )
    theirs = tf_keras.mixed_precision.LossScaleOptimizer(
        tf_keras.optimizers.SGD(0.1), initial_scale=4.0, dynamic_growth_steps=3
    )
    w_ours = keras.Variable(np.ones(3, np.float32))
    w_theirs = tf.Variable(np.ones(3, np.float32))
    # overflows from 4 go below 1 without the floor: 2, 1, 1, 1
    pattern = [INF, INF, INF, INF, F, F, F, *PATTERN]
    for step, g in enumerate(pattern):
        _feed(ours, w_ours, g)
        grad = tf.fill([3], tf.constant(g, tf.float32)) * theirs.loss_scale
        (grad,) = theirs.get_unscaled_gradients([grad])  # tf-keras leaves this to the user
        theirs.apply_gradients([(grad, w_theirs)])
        context = f"step {step}, gradient {g}"
        assert float(ours.dynamic_scale) == float(theirs.loss_scale), context
        assert int(ours.growth_tracker) == int(theirs.dynamic_counter), context
        np.testing.assert_array_equal(w_ours.numpy(), w_theirs.numpy(), err_msg=context)
        if step == 3:
            assert float(ours.dynamic_scale) == 1.0  # floored
    # tf-keras advances iterations on skipped steps, numstab (like Keras 3) does not
    assert int(theirs.iterations) == len(pattern)
    assert int(ours.iterations) == pattern.count(F)


def test_state_machine_is_numstabs_with_hysteresis_in_tf_function():
    scaler = LossScaler(init_scale=8.0, growth_interval=2, hysteresis=2, min_scale=1.0)
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), scaler)
    w = keras.Variable(np.ones(2, np.float32))
    opt.build([w])

    @tf.function
    def step(g):
        opt.apply([tf.fill([2], g) * opt.dynamic_scale], [w])

    oracle = scaler.init(backend="numpy")
    for g in [INF, F, INF, INF, F, F, INF, INF, INF, F]:
        step(tf.constant(g, tf.float32))
        oracle = scaler.update(oracle, math.isfinite(g))
        assert _state(opt) == (
            float(oracle.scale),
            int(oracle.growth_tracker),
            int(oracle.hysteresis_left),
        )


# -- skip semantics -----------------------------------------------------------------------------


@pytest.mark.parametrize("jit_compile", [False, True])
def test_skipped_step_changes_no_variable_and_freezes_iterations(jit_compile):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    opt = LossScaleOptimizer(keras.optimizers.Adam(schedule))
    opt.build(model.trainable_variables)
    x = tf.ones((4, 3))

    @tf.function(jit_compile=jit_compile)
    def step(poison):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x) ** 2) * poison
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    step(tf.constant(1.0))
    before = [v.numpy() for v in (*model.variables, *opt.inner_optimizer.variables)]
    lr_before = float(opt.learning_rate)
    step(tf.constant(math.nan))
    after = [v.numpy() for v in (*model.variables, *opt.inner_optimizer.variables)]
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(opt.iterations) == 1
    assert float(opt.learning_rate) == lr_before  # the schedule froze
    assert float(opt.dynamic_scale) == 2.0**14
    step(tf.constant(1.0))
    assert int(opt.iterations) == 2
    assert float(opt.dynamic_scale) == 2.0**14


def _fit_model(x: np.ndarray, y: np.ndarray, jit_compile: bool) -> tuple:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.05), max_norm=10.0)
    model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    return model, opt


@pytest.mark.parametrize("jit_compile", [False, True])
def test_fit_with_a_nan_batch_skips_it_and_keeps_weights_clean(jit_compile):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = rng.normal(size=(16, 1)).astype(np.float32)
    x_bad = x.copy()
    x_bad[9, 2] = np.nan  # batch 2 of 4
    model, opt = _fit_model(x_bad, y, jit_compile)
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert int(opt.iterations) == 3
    assert float(opt.dynamic_scale) == 2.0**14
    if jit_compile:
        return  # the comparison with a clean run (two more builds) runs once, without XLA
    # the same as training without that batch
    keep = np.r_[0:8, 12:16]
    clean, _ = _fit_model(x[keep], y[keep], jit_compile)
    for a, b in zip(model.get_weights(), clean.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_compile_under_mixed_float16_does_not_wrap_it_again():
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        opt = LossScaleOptimizer(keras.optimizers.SGD(0.01))
        model.compile(optimizer=opt, loss="mse")
        assert model.optimizer is opt
        model.fit(np.ones((4, 4), np.float32), np.ones((4, 1)), verbose=0)
        assert int(opt.iterations) == 1
    finally:
        keras.config.set_dtype_policy(previous)


# -- clipping -----------------------------------------------------------------------------------


def test_clipping_acts_on_unscaled_gradients():
    opt = LossScaleOptimizer(
        keras.optimizers.SGD(1.0), LossScaler.preset("keras", init_scale=1024.0), max_norm=1.0
    )
    w = keras.Variable(np.zeros(2, np.float32))
    b = keras.Variable(np.zeros(1, np.float32))
    unscaled = [tf.constant([3.0, 4.0]), tf.constant([12.0])]  # global norm 13
    opt.apply([g * 1024.0 for g in unscaled], [w, b])
    expected, norm = numstab.clip_by_global_norm(unscaled, 1.0)
    assert float(norm) == 13.0
    np.testing.assert_allclose(w.numpy(), -expected[0].numpy(), rtol=1e-6)
    np.testing.assert_allclose(b.numpy(), -expected[1].numpy(), rtol=1e-6)
    np.testing.assert_allclose(w.numpy(), [-3 / 13, -4 / 13], rtol=1e-6)


def test_norm_type_inf_and_small_norms_untouched():
    opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), max_norm=2.0, norm_type=math.inf)
    w = keras.Variable(np.zeros(3, np.float32))
    _feed(opt, w, 1.5)  # max |g| = 1.5 <= 2: unchanged
    np.testing.assert_array_equal(w.numpy(), [-1.5] * 3)
    _feed(opt, w, 4.0)  # max |g| = 4: halved
    np.testing.assert_array_equal(w.numpy(), [-3.5] * 3)


def test_finite_gradients_whose_norm_overflows_skip_the_step():
    opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), LossScaler(init_scale=1.0), max_norm=1.0)
    w = keras.Variable(np.zeros(2, np.float32))
    opt.apply([tf.constant([3e38, 3e38])], [w])  # every element finite, the norm is inf
    np.testing.assert_array_equal(w.numpy(), [0.0, 0.0])
    assert int(opt.iterations) == 0
    assert float(opt.dynamic_scale) == 0.5


def test_sparse_gradients_of_an_embedding():
    emb = keras.layers.Embedding(5, 2, embeddings_initializer="zeros")
    emb.build((None,))
    opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), max_norm=1.0)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(emb(tf.constant([1, 3])) * tf.constant([[3.0, 0.0], [0.0, 4.0]]))
        scaled = opt.scale_loss(loss)
    (grad,) = tape.gradient(scaled, emb.trainable_variables)
    assert isinstance(grad, tf.IndexedSlices)
    opt.apply([grad], emb.trainable_variables)
    table = emb.embeddings.numpy()
    np.testing.assert_allclose(table[1], [-0.6, 0.0], rtol=1e-6)
    np.testing.assert_allclose(table[3], [0.0, -0.8], rtol=1e-6)
    assert not table[[0, 2, 4]].any()


# -- state, checkpoints, config -----------------------------------------------------------------


def _trained(scaler: LossScaler, pattern: list) -> tuple:
    opt = LossScaleOptimizer(keras.optimizers.Adam(0.01), scaler, max_norm=3.0)
    w = keras.Variable(np.ones(2, np.float32))
    for g in pattern:
        _feed(opt, w, g)
    return opt, w


def test_checkpoint_round_trips_every_state_field(tmp_path):
    scaler = LossScaler(init_scale=64.0, growth_interval=5, hysteresis=3)
    # three overflows: backoff, hysteresis spent (0); two finite steps: tracker 2
    opt, w = _trained(scaler, [F, INF, INF, INF, F, F])
    saved = _state(opt)
    assert saved == (32.0, 2, 0)  # every field differs from its initial value (64, 0, 3)
    assert int(opt.iterations) == 3
    path = tf.train.Checkpoint(optimizer=opt, w=w).save(str(tmp_path / "ckpt"))

    # into a built optimizer
    fresh, w2 = _trained(scaler, [F])
    tf.train.Checkpoint(optimizer=fresh, w=w2).restore(path).assert_existing_objects_matched()
    assert _state(fresh) == saved
    assert int(fresh.iterations) == 3
    for a, b in zip(opt.inner_optimizer.variables, fresh.inner_optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())

    # into an unbuilt one: restored when build() creates the variables
    later = LossScaleOptimizer(keras.optimizers.Adam(0.01), scaler, max_norm=3.0)
    w3 = keras.Variable(np.zeros(2, np.float32))
    tf.train.Checkpoint(optimizer=later, w=w3).restore(path)
    later.build([w3])
    assert _state(later) == saved
    np.testing.assert_array_equal(w3.numpy(), w.numpy())


def test_keras_model_save_and_load_round_trip_state(tmp_path):
    scaler = LossScaler(init_scale=64.0, growth_interval=3, hysteresis=2)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    opt = LossScaleOptimizer(keras.optimizers.Adam(0.01), scaler, max_norm=1.0)
    model.compile(optimizer=opt, loss="mse")
    x = np.ones((8, 3), np.float32)
    x[5, 0] = np.nan  # absorbed by the hysteresis, then two finite steps
    model.fit(x, np.ones((8, 1)), batch_size=4, shuffle=False, verbose=0)
    model.fit(x[:4], np.ones((4, 1)), batch_size=4, verbose=0)
    assert _state(opt) == (64.0, 1, 1)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer, LossScaleOptimizer)
    assert loaded.optimizer.scaler == scaler
    assert _state(loaded.optimizer) == (64.0, 1, 1)
    assert int(loaded.optimizer.iterations) == 2


def test_get_config_round_trip_and_state_before_build():
    scaler = LossScaler.preset("deepspeed", init_scale=128.0)
    opt = LossScaleOptimizer(keras.optimizers.Adam(0.01), scaler, max_norm=2.0, norm_type=1.0)
    assert isinstance(opt.state, LossScaleState)
    init = scaler.init(backend="numpy")
    assert _state(opt) == (128.0, int(init.growth_tracker), int(init.hysteresis_left))
    assert float(opt.scale_loss(tf.constant(0.5))) == 64.0
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(clone, LossScaleOptimizer)
    assert clone.scaler == scaler
    assert (clone.max_norm, clone.norm_type) == (2.0, 1.0)
    assert isinstance(clone.inner_optimizer, keras.optimizers.Adam)


def test_scale_loss_keeps_dtype():
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    out = opt.scale_loss(tf.constant(1.5, tf.float16))
    assert out.dtype == tf.float16
    assert float(out) == 1.5 * 2.0**15


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_norm": 0.0}, "max_norm"),
        ({"max_norm": -1.0}, "max_norm"),
        ({"max_norm": math.nan}, "max_norm"),
        ({"max_norm": "1"}, "max_norm"),
        ({"norm_type": 0.0}, "norm_type"),
        ({"scaler": {"init_scale": 2.0}}, "scaler"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        LossScaleOptimizer(keras.optimizers.SGD(0.1), **kwargs)


def test_bad_inner_optimizer_raises():
    with pytest.raises(InvalidArgumentError, match="inner_optimizer"):
        LossScaleOptimizer("sgd")
    with pytest.raises(InvalidArgumentError, match="inner_optimizer"):
        LossScaleOptimizer(LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    with pytest.raises(InvalidArgumentError, match="inner_optimizer"):
        LossScaleOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))


def test_bad_calls_raise():
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    w = keras.Variable(np.ones(2, np.float32))
    with pytest.raises(InvalidArgumentError, match="trainable_variables"):
        opt.apply([tf.ones(2)])
    with pytest.raises(InvalidArgumentError, match="one gradient per variable"):
        opt.apply([tf.ones(2), tf.ones(2)], [w])
    with pytest.raises(InvalidArgumentError, match="loss"):
        opt.scale_loss(tf.constant(3))
    with pytest.raises(InvalidArgumentError, match="floating"):
        opt.apply([tf.ones(2, tf.int32)], [w])
