"""numstab.integrations.keras_clipping: ZClipOptimizer and AGCOptimizer under model.fit against
numstab's ZClip, the optax integration and optax.adaptive_grad_clip; saving, configs, wrapping
order with loss scaling, IndexedSlices, argument errors; the JAX and torch backends of Keras
in subprocesses (started first, so they run while the TensorFlow tests do)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
if keras.backend.backend() != "tensorflow":
    pytest.skip("Keras runs another backend in this process", allow_module_level=True)

from numstab.adaptive_clipping import AGC, ZClip  # noqa: E402
from numstab.errors import InvalidArgumentError  # noqa: E402
from numstab.integrations.keras_clipping import AGCOptimizer, ZClipOptimizer  # noqa: E402

B = 4  # batch size; one batch per step
EPS32 = float(np.finfo(np.float32).eps)


def _spiky_data(steps=40, seed=7):
    """Per step a batch (x, t) with spikes at steps 5 (in the warmup), 30, 33 and 34."""
    rng = np.random.default_rng(seed)
    xs, ts = [], []
    for i in range(steps):
        s = {5: 6, 30: 15, 33: 40, 34: 40}.get(i, 1)
        xs.append(rng.normal(0, 0.3 * s, (B, 4)).astype(np.float32))
        ts.append(rng.normal(0, 1, (B, 3)).astype(np.float32))
    return xs, ts


def _linear_loss(y_true, y_pred):
    """sum(y_pred * y_true) per sample: its gradient does not depend on the weights, so the
    reference can compute every step's raw gradient from the data alone."""
    return keras.ops.sum(y_pred * y_true, axis=-1)


def _raw_grads(x, t):
    """The gradients model.fit takes for Dense(3) on (x, t) (loss averaged over the batch)."""
    return [x.T @ t / len(x), t.sum(0) / len(x)]


def _optax_zclip():
    """(numstab.integrations.optax.zclip(), its update under jax.jit), or a skip."""
    jax = pytest.importorskip("jax")
    pytest.importorskip("optax")
    from numstab.integrations.optax import zclip

    tx = zclip()
    return tx, jax.jit(tx.update)


class _Record(keras.callbacks.Callback):
    def __init__(self, read):
        super().__init__()
        self.read, self.seen = read, []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(self.read())


def _state_numpy(opt):
    return {k: np.asarray(x) for k, x in opt.zclip_state._asdict().items()}


# -- JAX and torch backends of Keras: subprocesses, started before the TensorFlow tests ----------
_OTHER_BACKEND_SCRIPT = r"""
import json, sys
import numpy as np
import keras
from numstab.adaptive_clipping import AGC, ZClip
from numstab.integrations.keras_clipping import AGCOptimizer, ZClipOptimizer

jit = sys.argv[1] == "1"
rng = np.random.default_rng(7)
xs = [rng.normal(0, 0.3 * (40 if i in (30, 33) else 1), (4, 4)).astype(np.float32)
      for i in range(32)]
ts = [rng.normal(0, 1, (4, 3)).astype(np.float32) for _ in xs]
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
opt = ZClipOptimizer(keras.optimizers.SGD(1.0), warmup_steps=10)
model.compile(optimizer=opt, loss=lambda y, p: keras.ops.sum(p * y, axis=-1), jit_compile=jit)
model.fit(np.concatenate(xs), np.concatenate(ts), batch_size=4, shuffle=False, verbose=0)
policy = ZClip(warmup_steps=10)
state, w, clipped = policy.init(backend="numpy"), np.zeros((4, 3), np.float32), 0
EPS, tolerance, cond, scale, spread2, alpha = 2.0**-23, 0.0, 1.0, 0.0, 0.0, 0.97
for x, t in zip(xs, ts):
    g = [x.T @ t / 4, t.sum(0) / 4]
    terms = [np.abs(x).T @ np.abs(t) / 4, np.abs(t).sum(0) / 4]  # what the B-term sums add
    active, var_before = int(state.count) == 10, float(state.var)
    (gw, gb), state = policy.update(g, state)
    if active:  # the EMA's (c - mean)**2, from var = alpha * var + (1 - alpha) * (c - mean)**2
        spread2 = max(spread2, max(float(state.var) - alpha * var_before, 0) / (1 - alpha))
    clipped += not np.allclose(gw, g[0])
    w -= gw
    coef = np.linalg.norm(gw) / np.linalg.norm(g[0])
    # per SGD step: an ulp of the weights, eps * B of the sums' terms (x.T @ t / B on two
    # paths, clipped by coef) and eps * 15 of the step (a float32 norm of 15 squares)
    tolerance += EPS * (np.abs(w).max() + 4 * coef * terms[0].max() + 15 * np.abs(gw).max())
    cond = max(cond, np.linalg.norm(np.concatenate([a.ravel() for a in terms]))
               / np.linalg.norm(np.concatenate([a.ravel() for a in g])))
    # >= every later EMA input c: a norm below the z-score limit, or the (lower) threshold
    scale = max(scale, float(state.mean) + 2.5 * (float(state.var) ** 0.5 + 1e-6))
np.testing.assert_allclose(model.get_weights()[0], w, rtol=0, atol=tolerance)
# ZClip's state. Each norm: eps * (B * cond + 9) (the sums of B products, cancelling by cond,
# and a float32 norm of 15 squares); the mean adds 10 eps (warmup mean) and 3 eps per EMA
# step, damped by alpha to 3 / (1 - alpha) at most; the variance (a mean of (c - mean)**2)
# moves by 2 max|c - mean| times its inputs' errors (each c <= scale, the norms' bound)
# and by the same roundings as the mean, relative to itself
scale = max(scale, float(state.buffer.max()))
spread = max(spread2**0.5, np.abs(state.buffer - state.buffer.mean()).max())  # warmup's too
eps_norm = EPS * (4 * cond + 9)
eps_mean = eps_norm + EPS * (10 + 3 * min(32 - 10, 1 / (1 - alpha)))
ours = opt.zclip_state
got = {k: np.asarray(x) for k, x in ours._asdict().items()}
assert got["count"] == state.count
np.testing.assert_allclose(got["buffer"], state.buffer, rtol=eps_norm, atol=0)
np.testing.assert_allclose(got["norm"], state.norm, rtol=eps_norm, atol=0)
np.testing.assert_allclose(got["mean"], state.mean, rtol=eps_mean, atol=0)
var_atol = 2 * spread * scale * (eps_norm + eps_mean) + eps_mean * state.var
np.testing.assert_allclose(got["var"], state.var, rtol=0, atol=var_atol)
assert type(ours.mean).__module__.split(".")[0] in ("jax", "jaxlib", "torch"), type(ours.mean)
assert clipped >= 3 and int(opt.iterations) == 32

# AGC: two steps of a Dense layer; the second reads the updated kernel
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
w0 = [rng.normal(0, 1, (4, 3)).astype(np.float32), rng.normal(0, 1, 3).astype(np.float32)]
model.set_weights(w0)
model.compile(optimizer=AGCOptimizer(keras.optimizers.SGD(1.0), 0.05),
              loss=lambda y, p: keras.ops.sum(p * y, axis=-1), jit_compile=jit)
model.fit(np.concatenate(xs[:2]), np.concatenate(ts[:2]), batch_size=4, shuffle=False, verbose=0)
w = [p.copy() for p in w0]
for x, t in zip(xs[:2], ts[:2]):
    g = AGC(0.05).clip([x.T @ t / 4, t.sum(0) / 4], w)
    w = [p - d for p, d in zip(w, g)]
for got, want in zip(model.get_weights(), w):  # 2 steps: ulps of the weights and of the steps
    np.testing.assert_allclose(got, want, rtol=0, atol=2 * 2.0**-23 * 8 * np.abs(want).max())
print(json.dumps({"backend": keras.backend.backend(), "clipped": clipped}))
"""

_OTHER_BACKENDS = {"jax": "1", "torch": "0"}  # torch.compile (jit_compile=True) is too slow here


@pytest.fixture(scope="module", autouse=True)
def other_backends(tmp_path_factory):
    """Start one subprocess per other Keras backend; the last test collects them."""
    script = tmp_path_factory.mktemp("keras_clipping") / "other_backend.py"
    script.write_text(_OTHER_BACKEND_SCRIPT)
    procs = {}
    for name, jit in _OTHER_BACKENDS.items():
        env = {**os.environ, "KERAS_BACKEND": name, "TF_CPP_MIN_LOG_LEVEL": "3"}
        env["NUMSTAB_CONFIG"] = str(script.parent / "absent.toml")  # no backend configured
        env.pop("NUMSTAB_BACKEND", None)
        procs[name] = subprocess.Popen(
            [sys.executable, str(script), jit],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- ZClip ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("jit_compile", [False, True])
def test_zclip_under_fit_matches_numstab_zclip_step_by_step(jit_compile):
    xs, ts = _spiky_data()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="zeros")])
    opt = ZClipOptimizer(keras.optimizers.SGD(1.0))
    model.compile(optimizer=opt, loss=_linear_loss, jit_compile=jit_compile)
    record = _Record(lambda: (model.get_weights(), _state_numpy(opt)))
    model.fit(
        np.concatenate(xs), np.concatenate(ts), batch_size=B, shuffle=False, verbose=0,
        callbacks=[record],
    )  # fmt: skip
    assert len(record.seen) == len(xs) and int(opt.iterations) == len(xs)

    policy = ZClip()
    state = policy.init(backend="numpy")
    # once: the optax integration under jax.jit on the same gradients gives the same states
    optax_tx = _optax_zclip() if not jit_compile else None
    optax_state = optax_tx and optax_tx[0].init(_raw_grads(xs[0], ts[0]))
    before = [np.zeros((4, 3), np.float32), np.zeros(3, np.float32)]
    clipped = 0
    for step, (x, t, (after, ours)) in enumerate(zip(xs, ts, record.seen, strict=True)):
        raw = _raw_grads(x, t)
        want, state = policy.update(raw, state)
        for b, a, w in zip(before, after, want, strict=True):  # SGD(1.0): the step is -grad
            # x.T @ t / B on two paths (B products each), a norm of 15 squares, the weights
            atol = EPS32 * (2 * np.abs(b).max() + (B + 15) * np.abs(w).max())
            np.testing.assert_allclose(b - a, w, rtol=0, atol=atol, err_msg=f"step {step}")
        for field, value in state._asdict().items():
            np.testing.assert_allclose(ours[field], value, rtol=1e-5, err_msg=f"{field} {step}")
        if optax_tx:
            _, optax_state = optax_tx[1](raw, optax_state)
            for field, value in optax_state._asdict().items():
                np.testing.assert_allclose(ours[field], value, rtol=1e-5, err_msg=f"optax {field}")
        clipped += not np.allclose(want[0], raw[0])
        before = after
    assert clipped >= 4  # the warmup spike and the three late ones
    assert ours["count"].dtype == np.int32 and ours["buffer"].shape == (25,)


def test_zclip_sees_unscaled_gradients_inside_loss_scale_optimizers():
    """model.compile wraps the optimizer in Keras' LossScaleOptimizer under mixed_float16:
    ZClip then runs on the unscaled gradients. Same with numstab's LossScaleOptimizer."""
    from numstab.integrations.keras import LossScaleOptimizer

    g = np.array([3.0, 4.0], np.float32)
    for outer in (keras.optimizers.LossScaleOptimizer, LossScaleOptimizer):
        opt = outer(ZClipOptimizer(keras.optimizers.SGD(1.0), warmup_steps=1))
        var = keras.Variable(np.zeros(2, np.float32))
        opt.apply([tf.constant(g) * opt.scale_loss(1.0)], [var])
        inner = opt.inner_optimizer
        assert float(inner.zclip_state.norm) == pytest.approx(5.0)
        np.testing.assert_allclose(var.numpy(), -g / 5.0, rtol=1e-5)  # to max_grad_norm=1
        assert int(opt.iterations) == 1


@pytest.mark.filterwarnings("ignore:Gradients do not exist")  # the None gradient, on purpose
def test_zclip_indexed_slices_norm_sums_repeated_indices():
    """An embedding gradient with a repeated row: the norm is the dense gradient's (4, not
    sqrt(10) as for the raw values), and the gradient reaching the inner optimizer stays
    sparse."""
    seen = []

    class Spy(keras.optimizers.SGD):
        def apply(self, grads, trainable_variables=None):
            seen.append(grads)
            super().apply(grads, trainable_variables)

    opt = ZClipOptimizer(Spy(1.0), warmup_steps=1)
    table = keras.Variable(np.zeros((5, 2), np.float32))
    other = keras.Variable(np.zeros(3, np.float32))
    grad = tf.IndexedSlices(tf.constant([[3.0, 0.0], [1.0, 0.0]]), tf.constant([1, 1]), [5, 2])
    opt.apply([grad, None], [table, other])
    assert float(opt.zclip_state.norm) == pytest.approx(4.0)
    assert isinstance(seen[0][0], tf.IndexedSlices) and seen[0][1] is None
    np.testing.assert_allclose(table.numpy()[1], [-1.0, 0.0], rtol=1e-5)
    np.testing.assert_array_equal(other.numpy(), np.zeros(3))


# -- AGC -----------------------------------------------------------------------------------------
def test_agc_under_fit_matches_optax_adaptive_grad_clip():
    """Three fit steps of a Conv2D + Dense model: each step equals SGD on optax's AGC of the
    gradients at the weights of that step (so the wrapper reads the current parameters)."""
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")

    def make():
        return keras.Sequential(
            [
                keras.Input((5, 5, 2)),
                keras.layers.Conv2D(4, 3, bias_initializer="random_normal"),
                keras.layers.Flatten(),
                keras.layers.Dense(3, bias_initializer="random_normal"),
            ]
        )

    keras.utils.set_random_seed(3)
    model, twin = make(), make()
    rng = np.random.default_rng(3)
    x = rng.normal(0, 1, (3 * B, 5, 5, 2)).astype(np.float32)
    # targets near the predictions: small gradients, some units under the limit
    y = (model(x).numpy() + rng.normal(0, 0.03, (3 * B, 3))).astype(np.float32)
    start = model.get_weights()
    model.compile(
        optimizer=AGCOptimizer(keras.optimizers.SGD(1.0), clip_factor=0.05),
        loss="mse",
        jit_compile=True,
    )
    record = _Record(model.get_weights)
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0, callbacks=[record])
    loss_fn = keras.losses.MeanSquaredError()
    reference = jax.jit(optax.adaptive_grad_clip(0.05).update)
    before, clipped, kept = start, 0, 0
    for step, after in enumerate(record.seen):
        twin.set_weights(before)
        with tf.GradientTape() as tape:
            loss = loss_fn(y[step * B : (step + 1) * B], twin(x[step * B : (step + 1) * B]))
        raw = [g.numpy() for g in tape.gradient(loss, twin.trainable_variables)]
        want, _ = reference(raw, optax.EmptyState(), before)
        pred = twin(x[step * B : (step + 1) * B]).numpy()
        residual = pred - y[step * B : (step + 1) * B]
        for b, a, w, r in zip(before, after, want, raw, strict=True):
            atol = _sgd_update_atol(b, np.asarray(w), pred, residual)
            np.testing.assert_allclose(b - a, w, rtol=0, atol=atol, err_msg=f"step {step}")
            same = np.isclose(np.asarray(w), r, rtol=1e-6, atol=0).all(
                axis=tuple(range(r.ndim - 1))
            )
            clipped, kept = clipped + int((~same).sum()), kept + int(same.sum())
        before = after
    assert clipped > 0 and kept > 0  # units on both sides of the limit


def _sgd_update_atol(before, update, pred, residual) -> float:
    """How far ``before - after`` may sit from a float32 update computed on another path
    (fit's compiled step against an eager tape: other reduction orders, other kernels).

    Two sources, both float32 rounding (eps): recovering the update from the weights costs
    an ulp of each weight, 2 eps max|w|; and the gradient is a sum of terms larger than
    itself: MSE's residual pred - y cancels pred's digits (condition rms(pred)/rms(residual))
    and each element sums DEPTH products (forward 18 conv taps + 36 dense inputs, backward
    B * 9 conv positions + 3 outputs), so its error is eps * condition * DEPTH times the
    tensor's largest update: near-zero elements make a relative tolerance meaningless."""
    eps = float(np.finfo(np.float32).eps)
    depth = 18 + 36 + B * 9 + 3
    condition = np.sqrt(np.mean(pred**2)) / np.sqrt(np.mean(residual**2))
    return eps * (2 * np.abs(before).max() + condition * depth * np.abs(update).max())


def test_agc_densifies_indexed_slices():
    opt = AGCOptimizer(keras.optimizers.SGD(1.0), clip_factor=0.1)
    start = np.arange(10, dtype=np.float32).reshape(5, 2)
    table = keras.Variable(start)
    grad = tf.IndexedSlices(tf.constant([[30.0, 0.0], [10.0, 0.0]]), tf.constant([1, 1]), [5, 2])
    opt.apply([grad], [table])
    want = AGC(0.1).clip([tf.convert_to_tensor(grad).numpy()], [start])[0]
    np.testing.assert_allclose(start - table.numpy(), want, rtol=1e-6)


# -- saving and configs --------------------------------------------------------------------------
def test_zclip_state_is_saved_and_restored_with_the_model(tmp_path):
    xs, ts = _spiky_data(steps=12)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(
        optimizer=ZClipOptimizer(keras.optimizers.Adam(1e-2), warmup_steps=4, z_thresh=2.0),
        loss=_linear_loss,
    )
    for x, t in zip(xs, ts, strict=True):  # eager steps (no tracing): the state is what counts
        model.optimizer.apply([tf.constant(g) for g in _raw_grads(x, t)], model.trainable_variables)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(
        tmp_path / "m.keras", custom_objects={"_linear_loss": _linear_loss}
    )
    opt = loaded.optimizer
    assert isinstance(opt, ZClipOptimizer) and isinstance(
        opt.inner_optimizer, keras.optimizers.Adam
    )
    assert opt.get_config() == model.optimizer.get_config()
    assert opt.policy.z_thresh == 2.0 and int(opt.iterations) == 12
    for field, value in _state_numpy(model.optimizer).items():
        np.testing.assert_array_equal(_state_numpy(opt)[field], value, err_msg=field)
    assert int(_state_numpy(opt)["count"]) == 4  # the statistics are live, not initial
    for a, b in zip(opt.variables, model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "make",
    [
        lambda: ZClipOptimizer(
            keras.optimizers.Adam(3e-4),
            alpha=0.9,
            max_grad_norm=None,
            mode="percentile",
            warmup_steps=3,
            skip_update_on_spike=True,
            name="zc",
        ),
        lambda: AGCOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), 0.02, 1e-2, axis=(0, 1)),
        lambda: AGCOptimizer(keras.optimizers.SGD(0.1), layout="oi"),
    ],
)
def test_get_config_round_trips(make):
    opt = make()
    config = opt.get_config()
    again = type(opt).from_config(config)
    assert again.get_config() == config
    assert type(again.inner_optimizer) is type(opt.inner_optimizer)
    assert vars(again.policy) == vars(opt.policy)
    # by registered name, without custom_objects
    revived = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(revived) is type(opt) and revived.get_config() == config
    assert float(revived.learning_rate) == pytest.approx(float(opt.inner_optimizer.learning_rate))


def test_learning_rate_and_iterations_are_the_inner_optimizers():
    inner = keras.optimizers.SGD(0.5)
    opt = ZClipOptimizer(inner)
    var = keras.Variable(np.zeros(2, np.float32))
    opt.apply_gradients([(tf.constant([0.1, 0.1]), var)])
    assert opt.iterations is inner.iterations and int(opt.iterations) == 1
    opt.learning_rate = 0.25
    assert float(inner.learning_rate) == 0.25
    np.testing.assert_allclose(var.numpy(), [-0.05, -0.05], rtol=1e-6)
    # the inner optimizer's EMA: finalize_variable_values (end of model.fit) is delegated
    ema = ZClipOptimizer(keras.optimizers.SGD(1.0, use_ema=True, ema_momentum=0.5))
    var = keras.Variable(np.zeros(2, np.float32))
    for _ in range(2):
        ema.apply([tf.constant([0.1, 0.1])], [var])
    average = ema.inner_optimizer._model_variables_moving_average[0].numpy()
    assert not np.allclose(average, var.numpy())
    ema.finalize_variable_values([var])
    np.testing.assert_array_equal(var.numpy(), average)


# -- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda sgd: ZClipOptimizer(sgd, alpha=1.5), "alpha"),
        (lambda sgd: ZClipOptimizer(sgd, z_thresh=0.0), "z_thresh"),
        (lambda sgd: ZClipOptimizer(sgd, warmup_steps=-1), "warmup_steps"),
        (lambda sgd: ZClipOptimizer(sgd, mode="median"), "mode"),
        (lambda sgd: ZClipOptimizer(sgd, alpah=0.9), "alpah"),
        (lambda sgd: ZClipOptimizer("adam"), "inner_optimizer"),
        (lambda sgd: ZClipOptimizer(keras.optimizers.LossScaleOptimizer(sgd)), "inner_optimizer"),
        (lambda sgd: ZClipOptimizer(keras.optimizers.SGD(loss_scale_factor=8.0)), "loss_scale"),
        (
            lambda sgd: AGCOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=2)),
            "gradient_accumulation_steps",
        ),
        (lambda sgd: AGCOptimizer(sgd, clip_factor=0.0), "clip_factor"),
        (lambda sgd: AGCOptimizer(sgd, eps=-1.0), "eps"),
        (lambda sgd: AGCOptimizer(sgd, layout="hwio"), "layout"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(make, name):
    with pytest.raises(InvalidArgumentError, match=name):
        make(keras.optimizers.SGD(0.1))


def test_bad_calls_raise():
    opt = AGCOptimizer(keras.optimizers.SGD(0.1))
    var = keras.Variable(np.zeros((2, 3), np.float32))
    with pytest.raises(InvalidArgumentError, match="trainable_variables"):
        opt.apply([tf.zeros((2, 3))])
    with pytest.raises(InvalidArgumentError, match="one gradient per variable"):
        opt.apply([tf.zeros((2, 3)), tf.zeros(3)], [var])
    with pytest.raises(InvalidArgumentError, match="shape"):
        opt.apply([tf.zeros((3, 2))], [var])


def test_a_gradient_of_another_shape_is_a_typed_error_for_every_wrapper():
    """ZClipOptimizer and numstab's LossScaleOptimizer raised TensorFlow's own error from the
    variable update (AGCOptimizer's shape check was its own); the shared pairing checks now."""
    from numstab.integrations.keras import LossScaleOptimizer

    for opt in (ZClipOptimizer(keras.optimizers.SGD(0.1)),
                LossScaleOptimizer(keras.optimizers.SGD(0.1))):  # fmt: skip
        var = keras.Variable(np.zeros((2,), np.float32))
        with pytest.raises(InvalidArgumentError, match=r"grads\[0\].shape=\(3,\)"):
            opt.apply([tf.ones(3)], [var])


def test_unsupported_keras_backend_raises(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "openvino")
    with pytest.raises(InvalidArgumentError, match="KERAS_BACKEND='openvino'"):
        ZClipOptimizer(keras.optimizers.SGD(0.1))


# -- the other backends (collects the subprocesses) ----------------------------------------------
@pytest.mark.parametrize("backend", sorted(_OTHER_BACKENDS))
def test_other_keras_backends_match_numstab(other_backends, backend):
    pytest.importorskip(backend)
    proc = other_backends[backend]
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["backend"] == backend and result["clipped"] >= 3
