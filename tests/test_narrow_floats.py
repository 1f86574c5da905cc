"""8-bit and narrower floats (docs/semantics.md §3): what only reads finiteness reads float8
upcast to float32 (exactly: NaN and inf kept) and skips float6/float4 (no NaN, no inf);
everything that computes refuses them with ``InvalidArgumentError`` (the bad-input matrix,
tests/bad_inputs, checks that part on every backend).

Before, torch raised its own ``NotImplementedError`` ("aminmax_cpu" / "isinf" not implemented
for 'Float8_e4m3fn') from ``all_finite``, ``find_nonfinite``, ``check_numerics`` and the data
firewall, TensorFlow its ``IsFinite`` error, JAX a ``TypePromotionError`` from
``finite_summary``, and JAX's ``clip_by_global_norm`` changed float8 leaves it should have left
untouched (2.0 became 1.875 for a NaN norm).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import numstab as ns
from numstab import _validate as v
from numstab.backends import load_backend
from numstab.errors import InvalidArgumentError, NonFiniteError

NAN, INF = math.nan, math.inf
BACKENDS = ["numpy", "torch", "jax", "tensorflow"]


def _array(backend: str, values, dtype: str):
    be = load_backend(backend)
    return be.cast(be.asarray(np.asarray(values, np.float32)), dtype)


@pytest.mark.parametrize(
    ("dtype", "floating", "narrow"),
    [
        ("float16", True, False),
        ("bfloat16", True, False),
        ("float32", True, False),
        ("float64", True, False),  # starts with "float6", and is no float6
        ("float128", True, False),
        ("float8_e4m3fn", False, True),
        ("float8_e5m2fnuz", False, True),
        ("float6_e2m3fn", False, True),
        ("float4_e2m1fn", False, True),
        ("int8", False, False),
        ("complex64", False, False),
    ],
)
def test_dtype_names(dtype, floating, narrow):
    assert v.is_floating(dtype) is floating
    assert v.is_narrow_float(dtype) is narrow
    assert v.is_complex(dtype) is dtype.startswith("complex")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_readers_take_float8_upcast(backend, dtype):
    has_inf = dtype == "float8_e5m2"  # e4m3fn has NaN but no inf encoding
    values = [1.5, NAN, -3.0, *([INF, -INF] if has_inf else [])]
    leaf = _array(backend, values, dtype)
    clean = _array(backend, [0.5, -2.0], dtype)
    tree = [clean, leaf, _array(backend, [1.0], "float32")]

    assert bool(np.asarray(load_backend(backend).to_numpy(ns.all_finite(tree)))) is False
    assert bool(np.asarray(load_backend(backend).to_numpy(ns.all_finite([clean])))) is True
    (record,) = ns.find_nonfinite(tree)
    assert (record.path, record.dtype, record.shape) == ("[1]", dtype, (len(values),))
    assert (record.nan_count, record.posinf_count, record.neginf_count) == (
        1,
        int(has_inf),
        int(has_inf),
    )
    assert (record.finite_min, record.finite_max) == (-3.0, 1.5)
    with pytest.raises(NonFiniteError, match=r"\[1\]: 1 nan"):
        ns.assert_finite(tree)
    with pytest.raises(InvalidArgumentError, match=f"leaf 0 with dtype={dtype}"):
        ns.global_norm(tree)


@pytest.mark.parametrize(
    ("backend", "dtypes"),
    [("numpy", ["float4_e2m1fn", "float6_e3m2fn"]), ("jax", ["float4_e2m1fn"])],  # XLA: no f6
)
def test_float4_and_float6_leaves_cannot_be_nonfinite(backend, dtypes):
    leaves = [_array(backend, [1.0, 6.0], dtype) for dtype in dtypes]
    assert ns.find_nonfinite(leaves) == []
    assert bool(np.asarray(load_backend(backend).to_numpy(ns.all_finite(leaves)))) is True
    with pytest.raises(InvalidArgumentError, match="dtype=float4_e2m1fn"):
        ns.clip_by_value(leaves, -1.0, 1.0)


def test_numpy_backend_casts_to_every_ml_dtypes_float():
    for name in ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"):
        x = load_backend("numpy").cast(np.array([1.0, 3.0], np.float32), name)
        assert x.dtype == getattr(ml_dtypes, name) and x.astype(np.float32).tolist() == [1, 3]


# -- the observers of a model's intermediate values ---------------------------------------------
def test_torch_op_mode_reads_float8_outputs():
    torch = pytest.importorskip("torch")
    x = torch.tensor([1.0, 2.0])
    with ns.check_numerics(backend="torch"):  # torch had no aminmax for float8: it raised
        y = x.to(torch.float8_e4m3fn).float() * 2
    assert y.tolist() == [2.0, 4.0]
    with pytest.raises(NonFiniteError) as caught, ns.check_numerics(backend="torch"):
        torch.tensor([1e6]).to(torch.float8_e5m2)  # past e5m2's 57344: inf
    assert (caught.value.nan_count, caught.value.inf_count) == (0, 1)
    assert "float8_e5m2" in str(caught.value)


def test_torch_sentinel_records_float8_module_outputs():
    torch = pytest.importorskip("torch")

    class Quantize(torch.nn.Module):
        def forward(self, x):
            return x.to(torch.float8_e5m2)

    model = torch.nn.Sequential(torch.nn.Identity(), Quantize())
    with ns.check_numerics(mode="sentinel", backend="torch") as cn:
        model(torch.tensor([1.0, 3.0]))
        cn.watch([torch.tensor([0.5]).to(torch.float8_e4m3fn)], "scales")
        cn.check()
        model(torch.tensor([1.0, 1e6]))
        with pytest.raises(NonFiniteError, match="Quantize"):
            cn.check()


def test_torch_locate_reads_float8_layer_outputs():
    torch = pytest.importorskip("torch")

    class Quantize(torch.nn.Module):
        def forward(self, x):
            return x.to(torch.float8_e5m2)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Quantize())
    assert not ns.locate_nonfinite(model, torch.ones(1, 2) / 1e3).found
    with torch.no_grad():
        model[0].weight.fill_(1e5)  # outputs ~2e5, past e5m2's 57344
    report = ns.locate_nonfinite(model, torch.ones(1, 2))
    assert report.found and report.layer == "1" and report.layer_type == "Quantize"


def test_jax_watch_and_finite_summary_take_float8():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    bad = jnp.asarray([1.0, NAN], jnp.float32).astype(jnp.float8_e4m3fn)
    summary = jax.jit(ns.finite_summary)([bad, jnp.ones(2, jnp.float8_e5m2)])
    assert summary.sums.dtype == jnp.float32 and np.isnan(summary.sums[0])
    assert float(summary.sums[1]) == 2.0
    with ns.check_numerics(mode="sentinel", backend="jax") as cn:
        cn.watch([jnp.ones(2, jnp.float8_e4m3fn)], "clean")
        cn.check()
        cn.watch([bad], "scales")
        with pytest.raises(NonFiniteError, match="scales"):
            cn.check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_firewall_refuses_float8_fields_on_every_path(backend):
    # torch's fast path read float8 with a fused sum, the general path raised torch's error
    batches = [{"x": _array(backend, np.ones((4, 2)), "float8_e4m3fn"), "y": np.arange(4)}]
    with pytest.raises(InvalidArgumentError, match=r"\['x'\] with dtype=float8_e4m3fn"):
        list(ns.data.protect(batches))


def test_tensorflow_op_mode_reads_float8_outputs():
    # TensorFlow's CheckNumericsV2 has no float8 kernel: a Keras model quantized to float8
    # raised TensorFlow's "Value for attr 'T' of float8_e4m3fn is not in the list" there
    tf = pytest.importorskip("tensorflow")
    from tensorflow.python.framework import dtypes

    from numstab.frameworks.tensorflow.numerics import is_enabled

    with ns.check_numerics(backend="tensorflow"):
        back = tf.cast(tf.cast(tf.constant([1.0, 3.0]), dtypes.float8_e4m3fn), tf.float32)
    assert back.numpy().tolist() == [1.0, 3.0]
    with pytest.raises(NonFiniteError) as caught, ns.check_numerics(backend="tensorflow"):
        tf.cast(tf.constant([1.0, 1e6]), dtypes.float8_e5m2)  # past e5m2's 57344: inf
    assert (caught.value.op, caught.value.nan_count, caught.value.inf_count) == ("Cast", 0, 1)
    assert not is_enabled()  # TensorFlow's switch is off again


def test_keras_float8_model_runs_under_op_mode():
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("the TensorFlow op callback")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    for layer in model.layers:
        layer.quantize("float8")
    x = np.ones((2, 4), np.float32)
    with ns.check_numerics(backend="tensorflow"):
        y = model(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(model(x)))
