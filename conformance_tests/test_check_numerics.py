"""check_numerics: one fault catalogue, every backend, eager and compiled; state restoration.

Each catalogue case is written once over backend primitives and Python operators, runs as
value-and-gradient inside ``check_numerics(backend=...)`` and must raise ``NonFiniteError``
with the expected phase (and normalised op where the op that creates the value is
unambiguous); a clean computation of the same ops must raise nothing.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from numstab._dispatch import resolve_backend
from numstab.errors import InvalidArgumentError, NonFiniteError, UnknownBackendError
from numstab.numerics import MODES, check_numerics

NAN, INF = float("nan"), float("inf")


def _fp16_matmul(x):
    be = resolve_backend(x)
    a = be.cast(be.reshape(x, (1, 2)), "float16")
    b = be.cast(be.reshape(x, (2, 1)), "float16")
    return be.cast(a @ b, "float32")


def _complex_square(x):
    """``real((x + ix)**2)`` through a complex product: at 3e38 the product itself overflows
    (its parts are inf - inf and inf). TensorFlow's own switch skipped complex outputs and
    torch's dispatch mode checked floating ones only: both reported the next real op."""
    name = resolve_backend(x).name
    if name == "torch":
        import torch

        c = torch.complex(x, x)
        return (c * c).real
    if name == "jax":
        import jax

        c = jax.lax.complex(x, x)
        return (c * c).real
    if name == "tensorflow":
        import tensorflow as tf

        c = tf.complex(x, x)
        return tf.math.real(c * c)
    c = x + 1j * x
    return (c * c).real


#: name -> (function of x, input, expected op kind or None, phase)
CATALOGUE = {
    "log_of_negative": (lambda x: resolve_backend(x).log(x), [-1.0, 2.0], "log", "forward"),
    "sqrt_of_negative": (lambda x: resolve_backend(x).sqrt(x), [-1.0, 4.0], "sqrt", "forward"),
    "zero_over_zero": (lambda x: x / x, [0.0, 2.0], "div", "forward"),
    "exp_overflow": (lambda x: resolve_backend(x).exp(x), [1000.0, 1.0], "exp", "forward"),
    # The operands already hold inf: JAX flags the first primitive that sees them.
    "inf_minus_inf": (lambda x: x - x, [INF, 1.0], None, "forward"),
    "fp16_matmul_overflow": (_fp16_matmul, [300.0, 300.0], "matmul", "forward"),
    "nan_in_input": (lambda x: x * 2.0, [NAN, 1.0], None, "forward"),
    "complex_product_overflow": (_complex_square, [3e38, 1.0], "mul", "forward"),
    # sqrt(sum(x*x)) at 0 is 0; its gradient x / norm is 0/0 (inf * 0 on the way).
    "nan_only_in_backward": (
        lambda x: resolve_backend(x).sqrt(resolve_backend(x).sum(x * x)),
        [0.0, 0.0],
        None,
        "backward",
    ),
}


def _clean(x):
    be = resolve_backend(x)
    y = be.log(x + 2.0) + be.sqrt(x * x + 1.0) + x / (x + 3.0) + be.exp(x)
    return be.sum(y) + be.sum(_fp16_matmul(x[:2])) + be.sum(_complex_square(x))


def _native_value_and_grad(h, fn, x, compiled):
    """(fn(x) summed, gradient) as the framework's own arrays (numpy: no gradient)."""
    if h.name == "numpy":
        return fn(x).sum(), None
    if h.name == "torch":
        torch = h.torch
        x = x.detach().clone().requires_grad_(True)
        f = h._compile(lambda x: fn(x).sum(), compiled)
        out = f(x)
        return out, torch.autograd.grad(out, x)[0]
    if h.name == "jax":
        jax = h.jax
        vg = jax.value_and_grad(lambda x: fn(x).sum())
        return (jax.jit(vg) if compiled else vg)(x)
    tf = h.tf

    def vg(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = tf.reduce_sum(fn(x))
        return out, tape.gradient(out, x)

    return (tf.function(vg) if compiled else vg)(x)


def _input(h, values):
    return h.asarray(np.array(values), "float32")


# -- the catalogue, mode="op" ----------------------------------------------------------------


@pytest.mark.parametrize("case", list(CATALOGUE))
def test_catalogue_raises(target, case):
    h = target.h
    fn, values, kind, phase = CATALOGUE[case]
    if phase == "backward" and not h.has_gradients:
        pytest.skip("NumPy has no gradients")
    if case == "nan_in_input" and h.name == "numpy":
        # Documented gap: IEEE flags are raised where NaN is created, not where it propagates.
        with check_numerics(backend="numpy"):
            _native_value_and_grad(h, fn, _input(h, values), False)
        return
    x = _input(h, values)
    with pytest.raises(NonFiniteError) as info, check_numerics(backend=h.name):
        _native_value_and_grad(h, fn, x, target.compiled)
    err = info.value
    assert isinstance(err, FloatingPointError)
    assert err.framework == h.name
    assert err.phase == phase, str(err)
    if kind is not None:
        assert err.op_kind == kind, (err.op, str(err))
    assert err.op
    if h.name != "torch":  # torch's checks are numstab's own dispatch mode: no native error
        assert err.__cause__ is not None
    if not target.compiled and phase == "forward":
        assert err.where is not None and err.where.startswith(__file__), err.where


def test_clean_computation_raises_nothing(target):
    h = target.h
    x = _input(h, [0.5, 1.5, 2.0])
    with check_numerics(backend=h.name):
        value, grad = _native_value_and_grad(h, _clean, x, target.compiled)
    assert np.isfinite(h.numpy(value))
    if grad is not None:
        assert np.all(np.isfinite(h.numpy(grad)))


def test_flags_select_what_is_checked(eager_target):
    """Forward only: inf=False lets exp overflow through; nan=False lets 0/0 through
    (TensorFlow checks both or neither)."""
    h = eager_target.h
    exp_fn, exp_in = CATALOGUE["exp_overflow"][:2]
    div_fn, div_in = CATALOGUE["zero_over_zero"][:2]
    if h.name == "tensorflow":
        with check_numerics(nan=False, inf=False, backend=h.name):
            div_fn(_input(h, div_in))
        return
    with check_numerics(inf=False, backend=h.name):
        exp_fn(_input(h, exp_in))
    with check_numerics(nan=False, backend=h.name):
        div_fn(_input(h, div_in))
    with pytest.raises(NonFiniteError), check_numerics(nan=False, backend=h.name):
        exp_fn(_input(h, exp_in))
    with pytest.raises(NonFiniteError), check_numerics(inf=False, backend=h.name):
        div_fn(_input(h, div_in))


def test_backward_false_skips_gradients(eager_target):
    h = eager_target.h
    if not h.has_gradients:
        pytest.skip("NumPy has no gradients")
    if h.name in ("jax", "tensorflow"):
        pytest.skip("jax_debug_nans / check_numerics cannot tell gradient ops apart")
    fn, values = CATALOGUE["nan_only_in_backward"][:2]
    with check_numerics(backward=False, backend=h.name):
        _native_value_and_grad(h, fn, _input(h, values), False)


# -- the catalogue, mode="sentinel" ------------------------------------------------------------


@pytest.mark.parametrize("case", list(CATALOGUE))
def test_sentinel_catalogue(target, case):
    """Watching the step's value and gradient catches every case, at exit, with no sync."""
    h = target.h
    fn, values, _, phase = CATALOGUE[case]
    if phase == "backward" and not h.has_gradients:
        pytest.skip("NumPy has no gradients")
    with (
        pytest.raises(NonFiniteError) as info,
        check_numerics(mode="sentinel", backend=h.name) as cn,
    ):
        with _quiet():
            value, grad = _native_value_and_grad(h, fn, _input(h, values), target.compiled)
        cn.watch(value, "loss")
        cn.watch(grad, "grads")
    assert info.value.framework == h.name
    watched = {"loss", "grads"} & set(info.value.paths)
    assert watched if h.name != "torch" else info.value.paths  # torch also names modules


def test_sentinel_clean_and_check_point(eager_target):
    h = eager_target.h
    with check_numerics(mode="sentinel", backend=h.name) as cn:
        value, grad = _native_value_and_grad(h, _clean, _input(h, [0.5, 1.5]), False)
        cn.watch({"loss": value, "grad": grad}, "step")
        cn.check()  # explicit check point: clean
        cn.watch(_input(h, [NAN]), "bad")
        with pytest.raises(NonFiniteError) as info:
            cn.check()
        assert info.value.paths == ("bad",)
        cn.check()  # the record was cleared


def test_sentinel_watch_reads_complex_and_mixed_float_leaves(eager_target):
    # TensorFlow skipped complex leaves, and could not stack a float64 leaf's sum with a
    # float32 one's (TypeError from tf.stack); JAX, torch and NumPy read both
    h = eager_target.h
    wide = "float32" if h.name == "jax" else "float64"  # JAX without x64
    clean = [h.asarray(np.array([1.0]), wide), h.asarray(np.array([2.0, 3.0]), "float32")]
    with check_numerics(mode="sentinel", backend=h.name) as cn:
        cn.watch([*clean, h.asarray(np.array([1 + 2j]), "complex64")], "clean")
        cn.check()
        for part in (complex(NAN, 0.0), complex(0.0, INF)):
            cn.watch([*clean, h.asarray(np.array([1 + 0j, part]), "complex64")], "bad")
            with pytest.raises(NonFiniteError) as info:
                cn.check()
            assert info.value.paths == ("bad",)


#: host leaves next to the backend's arrays: NumPy arrays, Python and NumPy scalars
_HOST_FAULTS = {
    "ndarray nan": (lambda: np.array([NAN]), "NaN"),
    "python float nan": (lambda: NAN, "NaN"),
    "numpy float32 inf": (lambda: np.float32(INF), "inf"),
    "complex ndarray": (lambda: np.array([complex(1.0, NAN)]), "NaN"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fault", list(_HOST_FAULTS))
def test_watch_checks_host_leaves_next_to_arrays(eager_target, mode, fault):
    """torch dropped host leaves (NaN missed), TensorFlow and JAX raised a raw AttributeError
    (``.dtype.is_floating`` / ``'float' object has no attribute 'dtype'``): every backend reads
    them as NumPy does, in both modes."""
    h = eager_target.h
    make, what = _HOST_FAULTS[fault]
    clean = {"a": _input(h, [1.0, 2.0]), "n": 3, "f": 2.5, "h": np.ones(2, np.float32)}
    with pytest.raises(NonFiniteError) as info, check_numerics(mode=mode, backend=h.name) as cn:
        cn.watch(clean, "clean")
        cn.check()  # integers, finite host leaves: clean
        cn.watch({"a": _input(h, [1.0, 2.0]), "b": make()}, "grads")
    err = info.value
    assert (err.op, err.paths, err.phase) == ("grads", ("grads",), None)
    assert f"found {what} first in grads" in str(err)


@pytest.mark.parametrize("mode", MODES)
def test_watch_rejects_non_numeric_leaves(eager_target, mode):
    """NumPy and torch skipped a string leaf silently, JAX and TensorFlow raised a raw
    AttributeError; as find_nonfinite (§2.1, §15.1): InvalidArgumentError, nothing recorded."""
    h = eager_target.h
    bad = _input(h, [NAN])  # made outside: in mode="op" JAX checks the conversion
    with check_numerics(mode=mode, backend=h.name) as cn:
        for leaf in ("abc", np.array(["a"]), object()):
            with pytest.raises(InvalidArgumentError, match="Expected tree leaves to be an array"):
                cn.watch([bad, leaf], "grads")
        cn.watch([_input(h, [1.0])], "clean")
        cn.check()  # the rejected calls recorded nothing


@pytest.mark.parametrize("mode", MODES)
def test_watch_of_a_finite_tree_never_raises_in_watch(eager_target, mode):
    """Host leaves are read element by element (exact): values near the float32 maximum do not
    read as inf on any backend. In mode="op" watch's own reductions are not checked as the
    user's ops (JAX raised ``reduce_sum produced inf`` for a finite tree, torch named
    ``aten.detach``); a NaN watched there is reported under the watched name at exit."""
    h = eager_target.h
    big = np.full(4, 3e38, np.float32)
    with check_numerics(mode=mode, backend=h.name) as cn:
        cn.watch({"a": _input(h, [1.0]), "big": big}, "host")
        cn.watch(big, "alone")
    bad = _input(h, [1.0, NAN])
    with pytest.raises(NonFiniteError) as info, check_numerics(mode=mode, backend=h.name) as cn:
        cn.watch(bad, "grads")
    assert (info.value.op, info.value.paths) == ("grads", ("grads",))


@contextlib.contextmanager
def _quiet():
    with np.errstate(all="ignore"):
        yield


# -- torch sentinel: per-layer hooks ---------------------------------------------------------


def _torch_model(torch, fault):
    torch.manual_seed(0)

    class Scale(torch.nn.Module):  # x * |x|: finite forward, 0 * (0/0) gradient at x = 0
        def forward(self, x):
            return x * torch.sqrt((x * x).sum(-1, keepdim=True))

    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 8),
        Scale(),
        torch.nn.Linear(8, 1),
    )
    if fault == "weight":
        with torch.no_grad():
            model[2].weight[0, 0] = INF
    return model


@pytest.mark.parametrize(
    "fault, layer, phase",
    [("weight", "2 (Linear)", "forward"), ("zero_row", "2 (Linear)", "backward")],
)
def test_torch_sentinel_names_first_bad_layer(fault, layer, phase):
    torch = pytest.importorskip("torch")
    model = _torch_model(torch, fault)
    x = torch.ones(3, 4)
    if fault == "zero_row":  # layer 2 outputs zeros: Scale's gradient is NaN there
        with torch.no_grad():
            model[2].weight.zero_()
            model[2].bias.zero_()
    with pytest.raises(NonFiniteError) as info, check_numerics(mode="sentinel", backend="torch"):
        model(x).sum().backward()
    err = info.value
    assert err.framework == "torch" and err.phase == phase, str(err)
    if phase == "forward":
        assert err.op == layer, str(err)
    assert torch._C._len_torch_dispatch_stack() == 0


def test_torch_sentinel_clean_training_step():
    torch = pytest.importorskip("torch")
    model = _torch_model(torch, None)
    with check_numerics(mode="sentinel", backend="torch"):
        for _ in range(2):
            model.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
    assert not torch.nn.modules.module._global_forward_hooks


# -- state restoration -----------------------------------------------------------------------


def _state(name):
    if name == "torch":
        import torch

        return (
            torch.is_anomaly_enabled(),
            torch.is_anomaly_check_nan_enabled(),
            torch._C._len_torch_dispatch_stack(),
            torch.compiler.set_stance.__module__ and torch._dynamo.eval_frame._stance.stance,
        )
    if name == "jax":
        import jax

        names = ("jax_debug_nans", "jax_debug_infs", "jax_traceback_filtering", "jax_disable_jit")
        return tuple(getattr(jax.config, k) for k in names)
    if name == "tensorflow":
        import tensorflow as tf

        from numstab.frameworks.tensorflow.numerics import is_enabled

        return (is_enabled(), tf.config.functions_run_eagerly())
    return tuple(sorted(np.geterr().items()))


@contextlib.contextmanager
def _preset(name):
    """A non-default global state set by the user before the context."""
    if name == "torch":
        import torch

        torch.autograd.set_detect_anomaly(True, check_nan=False)
        try:
            yield
        finally:
            torch.autograd.set_detect_anomaly(False)
    elif name == "jax":
        import jax

        jax.config.update("jax_debug_nans", True)
        try:
            yield
        finally:
            jax.config.update("jax_debug_nans", False)
    elif name == "tensorflow":
        import tensorflow as tf

        tf.debugging.enable_check_numerics()
        try:
            yield
        finally:
            tf.debugging.disable_check_numerics()
    else:
        with np.errstate(over="raise", under="warn"):
            yield


@pytest.mark.parametrize("preset", [False, True])
def test_state_restored_after_clean_exit_error_and_nesting(eager_target, preset):
    h = eager_target.h
    fn, values = CATALOGUE["zero_over_zero"][:2]
    with _preset(h.name) if preset else contextlib.nullcontext():
        before = _state(h.name)
        with check_numerics(backend=h.name):
            pass
        assert _state(h.name) == before
        with pytest.raises(NonFiniteError), check_numerics(backend=h.name):
            _native_value_and_grad(h, fn, _input(h, values), False)
        assert _state(h.name) == before
        with pytest.raises(KeyError), check_numerics(backend=h.name):  # passes unchanged
            raise KeyError("x")
        assert _state(h.name) == before
        # nested: the inner context switches checks off; the outer one is back after it
        reached = []
        with pytest.raises(NonFiniteError), check_numerics(backend=h.name):
            inside = _state(h.name)
            with check_numerics(nan=False, inf=False, backend=h.name):
                _native_value_and_grad(h, fn, _input(h, values), False)  # must not raise
            assert _state(h.name) == inside
            reached.append(True)
            _native_value_and_grad(h, fn, _input(h, values), False)
        assert reached and _state(h.name) == before


def test_decorator(eager_target):
    h = eager_target.h
    fn, values = CATALOGUE["log_of_negative"][:2]
    before = _state(h.name)

    @check_numerics(backend=h.name)
    def step(x):
        return _native_value_and_grad(h, fn, x, False)

    for _ in range(2):  # reusable: a fresh context per call
        with pytest.raises(NonFiniteError) as info:
            step(_input(h, values))
        assert info.value.op_kind == "log"
        assert _state(h.name) == before
    step(_input(h, [1.0, 2.0]))


# -- bad input -------------------------------------------------------------------------------


def test_bad_arguments():
    with pytest.raises(InvalidArgumentError, match="Expected mode to be one of 'op', 'sentinel'"):
        check_numerics(mode="fast")
    with pytest.raises(InvalidArgumentError, match="Received: mode=None"):
        check_numerics(mode=None)
    for flag in ("nan", "inf", "backward"):
        with pytest.raises(InvalidArgumentError, match=f"Expected {flag} to be a bool"):
            check_numerics(**{flag: 1})
    with pytest.raises(UnknownBackendError):
        check_numerics(backend="mxnet")
    assert MODES == ("op", "sentinel")


def test_watch_rejects_traced_values():
    jax = pytest.importorskip("jax")
    with check_numerics(mode="sentinel", backend="jax") as cn:
        with pytest.raises(InvalidArgumentError, match="concrete arrays"):
            jax.jit(lambda x: cn.watch(x, "x"))(jax.numpy.ones(2))
        with pytest.raises(InvalidArgumentError, match="Expected name to be a string"):
            cn.watch(jax.numpy.ones(2), name=3)


def test_tensorflow_xla_function_is_checked():
    """tf.function(jit_compile=True) cannot hold TensorFlow's check; it runs eagerly inside."""
    tf = pytest.importorskip("tensorflow")
    f = tf.function(lambda x: tf.math.log(x) * 2.0, jit_compile=True)
    x = tf.constant([-1.0, 2.0])
    f(x)  # compiled before the context, outside it
    with pytest.raises(NonFiniteError) as info, check_numerics(backend="tensorflow"):
        f(x)
    assert info.value.op_kind == "log" and info.value.phase == "forward"
    assert not tf.config.functions_run_eagerly()


def test_tensorflow_needs_nan_and_inf_together():
    pytest.importorskip("tensorflow")
    from numstab.frameworks.tensorflow.numerics import is_enabled

    with pytest.raises(InvalidArgumentError, match="nan == inf"):
        check_numerics(inf=False, backend="tensorflow").__enter__()
    assert not is_enabled()


def test_auto_arms_imported_frameworks_and_numpy():
    """backend=None under "auto": every imported framework is armed, NumPy always."""
    import sys

    from numstab import use_backend

    with use_backend("auto"):
        with pytest.raises(NonFiniteError) as info, check_numerics():
            np.log(np.array([-1.0]))
        assert info.value.framework == "numpy" and info.value.op_kind == "log"
        if "torch" in sys.modules:
            import torch

            with pytest.raises(NonFiniteError) as info, check_numerics():
                torch.log(torch.tensor([-1.0]))
            assert info.value.framework == "torch"
