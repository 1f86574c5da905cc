"""find_nonfinite / assert_finite on every backend, and locate_nonfinite on one network
built with identical weights in torch, Keras and JAX, with planted faults: every backend
must name the same layer and phase (docs/semantics.md §15)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conformance_tests import locate_models as lm
from numstab.errors import InvalidArgumentError, NonFiniteError
from numstab.locate import locate_nonfinite
from numstab.nonfinite import NonFiniteRecord, assert_finite, find_nonfinite

# -- find_nonfinite / assert_finite --------------------------------------------------------

W = np.array([[1.5, np.nan, -2.0], [np.inf, 0.25, -np.inf]])
B = np.array([np.nan, np.nan, 3.0, -np.inf])
CLEAN = np.array([1.0, -1.0])


def _expected(x):
    x = np.asarray(x, np.float64)
    finite = x[np.isfinite(x)]
    return (
        int(np.isnan(x).sum()),
        int((x == np.inf).sum()),
        int((x == -np.inf).sum()),
        float(finite.min()) if finite.size else None,
        float(finite.max()) if finite.size else None,
    )


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_find_nonfinite_nested_tree(eager_target, dtype):
    h = eager_target.h
    tree = {
        "opt_state": [{"mu": {"w": h.asarray(W, dtype), "ok": h.asarray(CLEAN, dtype)}}],
        "b": h.asarray(B, "float32"),
        "steps": h.asarray(np.array([1, 2]), "int32"),  # integer leaves are never non-finite
        "none": None,
    }
    records = find_nonfinite(tree)
    assert [r.path for r in records] == ["['opt_state'][0]['mu']['w']", "['b']"]
    for record, values, want_dtype in zip(records, (W, B), (dtype, "float32"), strict=True):
        nan, pos, neg, low, high = _expected(values)
        assert (record.nan_count, record.posinf_count, record.neginf_count) == (nan, pos, neg)
        assert record.inf_count == pos + neg
        assert (record.finite_min, record.finite_max) == (low, high)
        assert record.shape == values.shape and record.dtype == want_dtype
        assert record.to_dict()["path"] == record.path
        assert record.path in str(record) and f"{nan} nan" in str(record)


def test_find_nonfinite_clean_and_all_nan(eager_target):
    h = eager_target.h
    assert find_nonfinite([h.asarray(CLEAN, "float32"), None]) == []
    assert find_nonfinite([]) == []
    (record,) = find_nonfinite([h.asarray(np.full(3, np.nan), "float32")])
    assert record.nan_count == 3 and record.finite_min is None and record.finite_max is None
    assert "no finite values" in str(record)


# a complex element counts once: NaN when a part is NaN, else +inf when a part is +inf, else
# -inf; the finite range is over the parts of the finite elements (1 - 3j and 0.5j)
NAN, INF = np.nan, np.inf
Z = np.array([1 - 3j, complex(NAN, 1), complex(INF, NAN), complex(2, INF), -INF + 5j, 0.5j])
Z = np.insert(Z, 5, complex(INF, -INF))


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_find_nonfinite_complex_leaves(eager_target, dtype):
    # before, complex leaves were skipped: find_nonfinite returned [] and assert_finite passed
    h = eager_target.h
    if dtype == "complex128" and h.name == "jax":
        pytest.skip("JAX without jax_enable_x64 has no complex128 arrays")
    tree = {"z": h.asarray(Z, dtype), "ok": h.asarray(np.array([1j, 2.0]), dtype)}
    (record,) = find_nonfinite(tree)
    assert record.path == ("z" if h.name == "torch" else "['z']")
    assert (record.nan_count, record.posinf_count, record.neginf_count) == (2, 2, 1)
    assert (record.finite_min, record.finite_max) == (-3.0, 1.0)
    assert (record.shape, record.dtype) == ((7,), dtype)
    (record,) = find_nonfinite([h.asarray(np.array([complex(np.nan, np.inf)]), dtype)])
    assert (record.nan_count, record.inf_count, record.finite_min) == (1, 0, None)
    with pytest.raises(NonFiniteError, match=r"2 nan, 2 \+inf, 1 -inf of 7"):
        assert_finite(tree)
    assert_finite({"ok": tree["ok"]})


def test_find_nonfinite_large_finite_float64(eager_target):
    if eager_target.name == "jax":
        pytest.skip("JAX without jax_enable_x64 has no float64 arrays")
    h = eager_target.h
    assert find_nonfinite([h.asarray(np.array([1e300, -1e300]), "float64")]) == []


def test_assert_finite_lists_paths(eager_target):
    h = eager_target.h
    tree = {"w": h.asarray(W, "float32"), "ok": h.asarray(CLEAN, "float32")}
    assert_finite({"ok": tree["ok"]}, name="params")  # clean: no error
    with pytest.raises(NonFiniteError) as info:
        assert_finite(tree, name="grads")
    err = info.value
    assert isinstance(err, FloatingPointError)
    # a flat dict of str -> torch.Tensor is a state dict: its keys are the paths
    path = "w" if eager_target.name == "torch" else "['w']"
    assert err.paths == (path,) and "grads" in str(err) and f"{path}:" in str(err)
    assert err.nan_count == 1 and err.inf_count == 2
    assert err.framework == eager_target.name
    assert all(isinstance(r, NonFiniteRecord) for r in err.records)


def test_assert_finite_refuses_traced_values(target, monkeypatch):
    if not target.compiled:
        pytest.skip("the traced case only")
    h = target.h
    if target.name == "torch":
        # torch.compile costs ~15 s here; the check only asks torch.compiler.is_compiling()
        import torch

        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        with pytest.raises(InvalidArgumentError, match="Expected concrete arrays"):
            assert_finite([h.asarray(CLEAN, "float32")])
        return
    x = h.asarray(CLEAN, "float32")

    def fn(x):
        assert_finite([x])
        return x

    with pytest.raises(Exception) as info:
        h.call(fn, True, x)
    chain, exc = [], info.value
    while exc is not None:
        chain.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    assert any("Expected concrete arrays" in text for text in chain), chain


def test_assert_finite_bad_name():
    with pytest.raises(InvalidArgumentError, match="name"):
        assert_finite([np.ones(2)], name=3)


def test_torch_module_and_state_dict_paths():
    if "torch" not in _requested():
        pytest.skip("torch not requested")
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    with torch.no_grad():
        model[0].weight[1, 0] = float("nan")
        model[1].running_mean[2] = float("inf")
    paths = [r.path for r in find_nonfinite(model)]
    assert paths == ["0.weight", "1.running_mean"]  # parameters, then floating buffers
    assert [r.path for r in find_nonfinite(model.state_dict())] == paths
    grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    grads["1.bias"][0] = -float("inf")
    with pytest.raises(NonFiniteError) as info:
        assert_finite(grads)
    assert info.value.paths == ("1.bias",)


def test_keras_model_paths():
    if "tensorflow" not in _requested():
        pytest.skip("tensorflow not requested")
    model = lm.keras_model(lm.weights("inf_weight"), "inf_weight")
    (record,) = find_nonfinite(model)
    assert record.path == "model/blocks.1/attn/v/kernel" and record.posinf_count == 1


def _requested():
    from conformance_tests.conftest import requested_backends

    return requested_backends()


# -- locate_nonfinite -----------------------------------------------------------------------

_JAX_MODELS: dict = {}
_MODELS: dict = {}  # (framework, fault) -> model; locate_nonfinite leaves models unchanged


def _model(builder, params, fault, key):
    if key not in _MODELS:
        _MODELS[key] = builder(params, fault)
    return _MODELS[key]


def _build(name: str, fault: str | None, *, padding: bool = False, scale: float = 1.0):
    """(model, inputs, targets, loss_fn) for one backend, all from the same NumPy weights."""
    ids, t = lm.tokens(with_padding=padding), lm.targets()
    params = lm.weights(fault)
    if name == "torch":
        import torch

        model = _model(lm.torch_model, params, fault, (name, fault))
        return model, (torch.from_numpy(ids),), (torch.from_numpy(t), scale), lm.torch_loss
    if name == "tensorflow":
        import tensorflow as tf

        model = _model(lm.keras_model, params, fault, (name, fault))
        return model, (tf.constant(ids),), (tf.constant(t), scale), lm.tf_loss
    import jax.numpy as jnp

    kind = "fp16" if fault == "fp16_backward" else "fp32"
    if kind not in _JAX_MODELS:  # one function per variant: the compiled pass is reused
        _JAX_MODELS[kind] = lm.jax_model(fault)
    inputs = (lm.jax_params(params), jnp.asarray(ids))
    return _JAX_MODELS[kind], inputs, (jnp.asarray(t), scale), lm.jax_loss


@pytest.fixture
def framework(eager_target):
    if eager_target.name == "numpy":
        pytest.skip("locate_nonfinite needs a framework with layers and autograd")
    return eager_target.name


@pytest.mark.parametrize("fault", sorted(lm.FAULT_LAYER))
def test_locate_planted_fault(framework, fault):
    scale = lm.LOSS_SCALE if fault == "fp16_backward" else 1.0
    model, inputs, targets, loss_fn = _build(
        framework, fault, padding=fault == "zero_div", scale=scale
    )
    report = locate_nonfinite(model, *inputs, loss_fn=loss_fn, targets=targets)
    assert (report.found, report.layer, report.phase) == (
        True,
        lm.FAULT_LAYER[fault],
        lm.FAULT_PHASE[fault],
    ), str(report)
    assert report.framework == framework and report.backward_checked
    assert report.inputs_finite is True
    assert report.nan_count + report.inf_count > 0
    assert report.params_finite is (fault != "inf_weight")
    if fault == "inf_weight":
        assert report.params_absmax == math.inf and len(report.nonfinite_params) == 1
        assert report.inf_count > 0
    if fault == "zero_div":
        assert (report.nan_count, report.inf_count) == (lm.DIM, 0)  # one padded token row
    if fault == "fp16_backward":
        assert report.grad_output_finite is True and report.grad_output_absmax > 65504
    text = str(report)
    assert repr(lm.FAULT_LAYER[fault]) in text and lm.FAULT_PHASE[fault] in text
    assert report.to_dict()["layer"] == report.layer


def test_locate_clean_runs(framework):
    """No fault; the zero-division fault without the padding token; the backward-only
    fault seen by a forward-only pass: nothing to report in each."""
    model, inputs, targets, loss_fn = _build(framework, None)
    report = locate_nonfinite(model, *inputs, loss_fn=loss_fn, targets=targets)
    assert not report.found and report.backward_checked, str(report)
    assert report.layers_checked >= 26 and "no NaN or inf" in str(report)
    model, inputs, targets, loss_fn = _build(framework, "zero_div", padding=False)
    assert not locate_nonfinite(model, *inputs, loss_fn=loss_fn, targets=targets).found
    model, inputs, _, _ = _build(framework, "fp16_backward", scale=lm.LOSS_SCALE)
    forward_only = locate_nonfinite(model, *inputs)
    assert not forward_only.found and not forward_only.backward_checked


def test_locate_forward_only_finds_forward_fault(framework):
    model, inputs, _, _ = _build(framework, "inf_weight")
    report = locate_nonfinite(model, *inputs)
    assert (report.layer, report.phase, report.backward_checked) == (
        "blocks.1.attn.v",
        "forward",
        False,
    )


def test_locate_bad_arguments(eager_target):
    h = eager_target.h
    x = h.asarray(np.ones((2, 3)), "float32")
    with pytest.raises(InvalidArgumentError, match="Received: model="):
        locate_nonfinite(lambda x: x, x) if eager_target.name != "jax" else locate_nonfinite(
            object(), x
        )
    with pytest.raises(InvalidArgumentError, match="loss_fn"):
        locate_nonfinite(lambda x: x, x, loss_fn="mse")
    with pytest.raises(InvalidArgumentError, match="loss_fn"):
        locate_nonfinite(lambda x: x, x, targets=x)
    if eager_target.name == "torch":
        import torch

        with pytest.raises(InvalidArgumentError, match="backend="):
            locate_nonfinite(torch.nn.Linear(3, 3), x, backend="jax")


def _two_layers(framework: str):
    """(model, input, loss_fn -> loss of an integer dtype) of ``framework``, two layers."""
    x = np.ones((2, 3), np.float32)
    if framework == "torch":
        import torch

        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
        return model, torch.from_numpy(x), lambda y: y.sum().long()
    if framework == "tensorflow":
        import keras
        import tensorflow as tf

        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), keras.layers.Dense(2)])
        return model, tf.constant(x), lambda y: tf.cast(tf.reduce_sum(y), "int32")
    import jax.numpy as jnp

    from numstab.locate.jax import layer

    def model(w, x):
        h = layer("0", lambda w, x: x @ w, w, x)
        return layer("1", lambda w, x: x @ w, w, h)

    return (lambda x: model(jnp.ones((3, 3)), x)), jnp.asarray(x), lambda y: y.sum().astype(int)


def test_locate_loss_fn_return_value_rule(framework):
    """One rule for what loss_fn returns, on every framework (§15.3): a floating array of the
    model's framework. Before, None was a silent found=False on torch and a raw ValueError
    on TensorFlow and JAX; a float or an integer array passed on TensorFlow and JAX."""
    model, x, integer_loss = _two_layers(framework)
    cases = [
        (lambda y: None, "None (NoneType)"),
        (lambda y: 1.5, "1.5 (float)"),
        (lambda y: "mse", "'mse' (str)"),
        (lambda y: np.float32(1.0), "numpy.float32"),
        (integer_loss, f"a {framework} array of dtype int"),
    ]
    for loss_fn, received in cases:
        with pytest.raises(InvalidArgumentError, match="loss_fn returned") as error:
            locate_nonfinite(model, x, loss_fn=loss_fn)
        assert f"model's framework ({framework})" in str(error.value)
        assert received in str(error.value), str(error.value)
    report = locate_nonfinite(model, x, loss_fn=lambda y: y * y)  # any shape: summed
    assert not report.found and report.backward_checked


def test_locate_keras_sequential_and_functional():
    """Sequential and functional Keras models: layers are found by their own names."""
    if "tensorflow" not in _requested():
        pytest.skip("tensorflow not requested")
    import keras
    from keras import ops

    class Log(keras.layers.Layer):
        def call(self, x):
            return ops.log(x)

    x = np.array([[1.0, -2.0, 3.0]], np.float32)  # log(-2 * 1) = NaN in "log"
    ones = keras.initializers.Ones()
    seq = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(3, kernel_initializer=ones, name="d1"),
            keras.layers.Dense(3, kernel_initializer="identity", name="d2"),
        ]
    )
    assert not locate_nonfinite(seq, x).found
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(3, kernel_initializer="identity", name="d1")(inputs)
    outputs = keras.layers.Dense(2, name="d2")(Log(name="log")(hidden))
    functional = keras.Model(inputs, outputs)
    report = locate_nonfinite(functional, x)
    assert (report.layer, report.phase, report.inputs_finite) == ("log", "forward", True)
    assert report.nan_count == 1


def test_jax_layer_is_plain_call_outside_locate():
    if "jax" not in _requested():
        pytest.skip("jax not requested")
    import jax
    import jax.numpy as jnp

    from numstab.frameworks.jax.locate import layer

    def f(p, x):
        return layer("scale", lambda p, x: p * x, p, x).sum()

    g = jax.jit(jax.grad(f))(jnp.float32(3.0), jnp.arange(3.0))
    assert float(g) == 3.0  # 0 + 1 + 2
