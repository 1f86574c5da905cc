"""fused_linear_cross_entropy against the unfused numstab.cross_entropy(hidden @ weight.T + bias)
on every backend, eager and compiled: loss values and the gradients of hidden, weight and bias.

Both sides run on the same backend, in the same dtype and mode. Chunk sizes that do not divide
the token count are used throughout, so the last, short chunk is always exercised.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest

import numstab as ns
from conformance_tests.cases import UNMATCHABLE_IGNORE_INDEX
from numstab.backends._native import generic_forced
from numstab.errors import InvalidArgumentError
from numstab.fused_cross_entropy import default_chunk_size, fused_linear_cross_entropy

TOKENS, WIDTH, VOCAB = 14, 8, 11
#: (rtol, atol) of fused against unfused: values, then gradients. In bfloat16 both sides round
#: the logits to bfloat16, but each chunk's matmul may round differently from the full one.
TOLERANCE = {
    "float32": ((2e-5, 2e-5), (2e-5, 2e-6)),
    "bfloat16": ((1e-2, 1e-2), (3e-2, 4e-3)),
}
CASES = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-2},
    "smoothing_z_loss": {"label_smoothing": 0.2, "z_loss": 1e-3},
}


def _data(seed=0, ignored=(2, 7), batch_shape=(TOKENS,)):
    rng = np.random.default_rng(seed)
    tokens = int(np.prod(batch_shape))
    hidden = rng.normal(size=(*batch_shape, WIDTH))
    weight = rng.normal(size=(VOCAB, WIDTH)) / np.sqrt(WIDTH)
    bias = rng.normal(size=VOCAB) * 0.1
    labels = rng.integers(0, VOCAB, size=tokens)
    labels[list(ignored)] = -100
    cotangent = rng.normal(size=batch_shape)
    return hidden, weight, bias, labels.reshape(batch_shape), cotangent


def _unfused(hidden, weight, labels, *, bias=None, chunk_size=None, **kwargs):
    del chunk_size  # the unfused loss has no chunks
    product = hidden @ _transpose(weight)
    if bias is not None:
        product = product + bias
    return ns.cross_entropy(product, labels, **kwargs)


def _transpose(w):
    return w.T if hasattr(w, "T") else __import__("tensorflow").transpose(w)


def value_and_grads(target, fn, arrays, wrt, cotangent):
    """(fn(*arrays), gradients of sum(fn * cotangent) w.r.t. arrays[i] for i in wrt) as NumPy
    float64; gradients are None on the numpy backend."""
    h, compiled = target.h, target.compiled
    if target.name == "numpy":
        return h.numpy(fn(*arrays)), None
    if target.name == "torch":
        torch = h.torch
        arrays = [
            a.detach().clone().requires_grad_(True) if i in wrt else a for i, a in enumerate(arrays)
        ]
        out = h._compile(fn, compiled)(*arrays)
        cot = torch.as_tensor(cotangent, dtype=out.dtype, device=out.device)
        grads = torch.autograd.grad((out * cot).sum(), [arrays[i] for i in wrt])
        return h.numpy(out), [h.numpy(g) for g in grads]
    if target.name == "jax":
        jax = h.jax
        cot = jax.numpy.asarray(cotangent, dtype="float32")

        def objective(*args):
            out = fn(*args)
            return (out * cot).sum(), out

        vg = jax.value_and_grad(objective, argnums=tuple(wrt), has_aux=True)
        (_, out), grads = (jax.jit(vg) if compiled else vg)(*arrays)
        return h.numpy(out), [h.numpy(g) for g in grads]
    tf = h.tf
    cot = tf.constant(cotangent, dtype=tf.float32)

    def run(*args):
        with tf.GradientTape() as tape:
            for i in wrt:
                tape.watch(args[i])
            out = fn(*args)
            total = tf.reduce_sum(out * cot)
        return out, tape.gradient(total, [args[i] for i in wrt])

    with tf.device(h.tf_device):
        out, grads = (tf.function(run) if compiled else run)(*arrays)
    return h.numpy(out), [h.numpy(g) for g in grads]


def _check(target, dtype, kwargs, *, data=None, bias=True, wrt=(0, 1, 3), chunk_size=4):
    hidden, weight, b, labels, cotangent = data or _data()
    h = target.h
    arrays = [h.asarray(hidden, dtype), h.asarray(weight, dtype), h.asarray(labels)]
    if bias:
        arrays.append(h.asarray(b, dtype))
    else:
        wrt = tuple(i for i in wrt if i != 3)
    reduction = kwargs.get("reduction", "mean")
    cot = cotangent if reduction == "none" else np.float64(cotangent.flat[0])

    def call(impl):
        def fn(x, w, y, *maybe_bias):
            return impl(x, w, y, bias=maybe_bias[0] if maybe_bias else None, **kwargs)

        return fn

    fused_impl = lambda *a, **k: fused_linear_cross_entropy(*a, chunk_size=chunk_size, **k)
    got, got_grads = value_and_grads(target, call(fused_impl), arrays, wrt, cot)
    eager = SimpleNamespace(h=h, name=target.name, compiled=False)  # the reference
    want, want_grads = value_and_grads(eager, call(_unfused), arrays, wrt, cot)
    (v_rtol, v_atol), (g_rtol, g_atol) = TOLERANCE[dtype]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=v_rtol, atol=v_atol, err_msg="loss")
    if want_grads is None:
        return got, None
    for i, g, w in zip(wrt, got_grads, want_grads, strict=True):
        assert g.shape == w.shape
        scale = max(np.abs(w).max(), 1e-30)  # relative to the gradient's own size
        np.testing.assert_allclose(
            g / scale, w / scale, rtol=g_rtol, atol=g_atol, err_msg=f"gradient of arg {i}"
        )
    return got, got_grads


def test_mean_smoothing_z_loss(target):
    _check(target, "float32", CASES["smoothing_z_loss"])


#: a fast path that fell back (torch's float32-out GEMM on CUDA) warns: an error here
@pytest.mark.filterwarnings("error:numstab:RuntimeWarning")
def test_none_bfloat16_without_bias(target):
    """reduction="none" takes a per-row cotangent: its backward recomputes the chunks."""
    got, _ = _check(target, "bfloat16", {"label_smoothing": 0.1, "reduction": "none"}, bias=False)
    assert got.shape == (TOKENS,)
    assert got[2] == 0.0 and got[7] == 0.0  # ignored rows


def test_sum_hidden_only(target):
    """Gradients for hidden alone (weight and bias frozen) equal the unfused ones."""
    _check(target, "float32", {"z_loss": 1e-2, "reduction": "sum"}, wrt=(0,))


def test_weight_gradient_added_in_blocks(target, monkeypatch):
    """Backends that add each chunk's weight gradient in place, a block of vocabulary rows at a
    time (JAX, TensorFlow graphs), agree when the vocabulary spans blocks and a remainder."""
    module = sys.modules[f"numstab.frameworks.{target.name}.backend"]
    module = sys.modules.get(f"numstab.frameworks.{target.name}.fused", module)
    if not hasattr(module, "_ACCUMULATE_BLOCK_BYTES"):
        pytest.skip("this backend adds the weight gradient in one piece")
    monkeypatch.setattr(module, "_ACCUMULATE_BLOCK_BYTES", 4 * WIDTH * 3)  # 11 = 3 * 3 + 2 rows
    _check(target, "float32", CASES["smoothing_z_loss"])


def test_tensorflow_xla_jit_compile():
    """Under jit_compile=True TensorFlow's in-place chunk loop cannot compile (its offsets
    must be constants there): the plain loop runs, with the same loss and gradients."""
    tf = pytest.importorskip("tensorflow")
    hidden, weight, bias, labels, _ = _data()
    h, w, b = (tf.Variable(a.astype(np.float32)) for a in (hidden, weight, bias))
    y = tf.constant(labels)

    def loss_and_grads(fn, jit_compile):
        @tf.function(jit_compile=jit_compile)
        def step():
            with tf.GradientTape() as tape:
                loss = fn(h, w, y, bias=b, label_smoothing=0.1)
            return [loss, *tape.gradient(loss, [h, w, b])]

        return [t.numpy() for t in step()]

    expected = loss_and_grads(_unfused, False)
    for got, want in zip(
        loss_and_grads(lambda *a, **k: fused_linear_cross_entropy(*a, chunk_size=3, **k), True),
        expected,
        strict=True,
    ):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_tensorflow_graph_constants_stay_intact():
    """Inputs that are constants of the tf.function graph: grappler folds the first chunk's
    weight gradient into a constant, which the in-place accumulation must copy rather than
    overwrite. Every call gives the eager result."""
    tf = pytest.importorskip("tensorflow")
    hidden, weight, _, labels, _ = _data()

    def loss_and_grads():
        h, w, y = tf.constant(hidden), tf.constant(weight), tf.constant(labels)
        with tf.GradientTape() as tape:
            tape.watch([h, w])
            loss = fused_linear_cross_entropy(h, w, y, chunk_size=4)
        return [loss, *tape.gradient(loss, [h, w])]

    want = [t.numpy() for t in loss_and_grads()]
    step = tf.function(loss_and_grads)
    for _ in range(3):
        for got, expected in zip(step(), want, strict=True):
            np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-15)


def test_tensorflow_graph_holds_one_chunk_of_logits():
    """Under tf.function each chunk starts after the previous one is done, so the step holds
    one chunk of logits (turned into its gradient in place by the native kernel; beside its
    gradient under NUMSTAB_FORCE_GENERIC) with the weight gradient and a block of its update,
    measured by TensorFlow's CPU allocator."""
    tf = pytest.importorskip("tensorflow")
    tokens, width, vocab, chunk = 512, 16, 32768, 64  # 8 chunks of 8 MiB logits; dw 2 MiB
    rng = np.random.default_rng(0)
    with tf.device("/CPU:0"):
        h = tf.constant(rng.normal(size=(tokens, width)).astype(np.float32))
        w = tf.constant(rng.normal(size=(vocab, width)).astype(np.float32))
        y = tf.constant(rng.integers(0, vocab, tokens))

        @tf.function
        def step(h, w):
            with tf.GradientTape() as tape:
                tape.watch([h, w])
                loss = fused_linear_cross_entropy(h, w, y, chunk_size=chunk)
            dh, dw = tape.gradient(loss, [h, w])
            return loss, tf.reduce_sum(dh), tf.reduce_sum(dw)

        step(h, w)
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        step(h, w)
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    logits, dw, dh = 4 * chunk * vocab, 4 * vocab * width, 4 * tokens * width
    chunk_buffers = 2 if generic_forced() else 1  # the generic softmax gradient is a new array
    assert peak <= (chunk_buffers + 0.25) * logits + 2 * dw + dh, f"{peak / 2**20:.1f} MiB"


@pytest.mark.parametrize("case", CASES)
def test_every_case_and_dtype(eager_target, case):
    for dtype in TOLERANCE:
        _check(eager_target, dtype, CASES[case])


@pytest.mark.parametrize("chunk_size", [1, None])
def test_any_chunk_size(eager_target, chunk_size):
    _check(eager_target, "float32", {"z_loss": 1e-3, "reduction": "sum"}, chunk_size=chunk_size)


def test_batch_dimensions(eager_target):
    data = _data(seed=3, ignored=(0, 5), batch_shape=(2, 7))
    got, _ = _check(eager_target, "float32", {"reduction": "none"}, data=data)
    assert got.shape == (2, 7)


def test_every_row_ignored_gives_zero(eager_target):
    data = _data(ignored=range(TOKENS))
    got, grads = _check(eager_target, "float32", {"label_smoothing": 0.1}, data=data)
    assert got == 0.0
    if grads is not None:
        assert all(not np.any(g) for g in grads)


@pytest.mark.parametrize("ignore_index", [-100, -(2**70)])
def test_out_of_range_label_raises_eagerly(eager_target, ignore_index):
    hidden, weight, _, labels, _ = _data(ignored=(2, 7) if ignore_index == -100 else ())
    labels[4] = VOCAB
    h = eager_target.h
    with pytest.raises(InvalidArgumentError, match=r"Received: labels\[4\]=11 \(1 label"):
        fused_linear_cross_entropy(h.asarray(hidden, "float32"), h.asarray(weight, "float32"),
                                   h.asarray(labels), ignore_index=ignore_index)  # fmt: skip


@pytest.mark.parametrize(("ignore_index", "label_dtype"), UNMATCHABLE_IGNORE_INDEX)
def test_ignore_index_no_label_can_equal(target, ignore_index, label_dtype):
    """An ignore_index outside the labels' index dtype ignores nothing, eagerly and compiled,
    as the unfused loss; an out-of-range label still raises eagerly, or is a NaN row."""
    hidden, weight, bias, labels, cotangent = _data(seed=7, ignored=())
    data = hidden, weight, bias, labels.astype(label_dtype), cotangent
    kwargs = {"ignore_index": ignore_index, "label_smoothing": 0.1}
    got, _ = _check(target, "float32", kwargs, data=data)
    want = ns.cross_entropy(hidden @ weight.T + bias, labels, label_smoothing=0.1)
    np.testing.assert_allclose(got, want, rtol=2e-5)
    h, bad = target.h, labels.astype(label_dtype)
    bad[4] = VOCAB
    args = h.asarray(hidden, "float32"), h.asarray(weight, "float32"), h.asarray(bad)
    fn = lambda x, w, y: fused_linear_cross_entropy(x, w, y, reduction="none", **kwargs)
    if not target.compiled:
        with pytest.raises(InvalidArgumentError, match=r"ignore_index=.*labels\[4\]=11 \(1 l"):
            fn(*args)
        return
    rows = h.call(fn, True, *args)
    assert np.isnan(rows[4]) and np.isfinite(np.delete(rows, 4)).all()


def _bad_calls(h):
    x = h.asarray(np.zeros((6, 4)), "float32")
    w = h.asarray(np.zeros((5, 4)), "float32")
    y = h.asarray(np.zeros(6, np.int64))
    f = fused_linear_cross_entropy
    return [
        (lambda: f(None, w, y), r"hidden to be an array. Received: hidden=None"),
        (lambda: f(x, None, y), r"weight to be an array. Received: weight=None"),
        (lambda: f(x, w, None), r"labels to be an array. Received: labels=None"),
        (lambda: f(x, h.asarray(np.zeros((5, 3)), "float32"), y), r"weight of shape \(vocab, 4\)"),
        (lambda: f(x, w, h.asarray(np.zeros((6, 2), np.int64))), r"labels.shape=\(6, 2\)"),
        (lambda: f(x, w, y, chunk_size=0), r"chunk_size >= 1.*Received: chunk_size=0"),
        (lambda: f(x, w, y, chunk_size=2.0), r"chunk_size to be an int"),
        (lambda: f(h.asarray(np.zeros((6, 4), np.int32)), w, y), r"hidden.dtype=int32"),
        (lambda: f(x, w, h.asarray(np.zeros(6), "float32")), r"labels.dtype=float32"),
        (lambda: f(x, h.asarray(np.zeros((5, 4)), "float16"), y), r"weight.dtype=float16"),
        (lambda: f(x, w, y, bias=h.asarray(np.zeros(4), "float32")), r"bias.shape=\(4,\)"),
        (lambda: f(x, w, y, reduction="avg"), r"Received: reduction='avg'"),
        (lambda: f(x, w, y, label_smoothing=2.0), r"label_smoothing in \[0, 1\]"),
    ]


def test_bad_input_raises_the_same_everywhere(eager_target):
    for call, message in _bad_calls(eager_target.h):
        with pytest.raises(InvalidArgumentError, match=message):
            call()


def test_default_chunk_size_rule():
    assert default_chunk_size(4096, 65536) == 128  # 32 MiB of float32 logits
    assert default_chunk_size(32768, 131072) == 64
    assert default_chunk_size(10, 65536) == 10  # never more than the rows
    assert default_chunk_size(1000, 2**30) == 1  # never less than one row
    assert default_chunk_size(300, 65536) == 100  # 3 even chunks, not 128 + 128 + 44


@pytest.mark.parametrize("offset", [1e4, -1e6])
def test_large_common_offset(eager_target, offset):
    """A bias far from 0 shifts every logit alike: the fused loss and its gradients must keep
    the unfused loss's digits (both shift by the row max before lse - x[y] and exp(x - lse)).

    The products ``hidden @ weight.T`` are exact here (multiples of 1/32 below 2**10), so both
    sides round the same logits at ``|offset|``, whatever order or precision their matmuls sum
    in. With random products, a GPU's chunked and full matmuls differ by an ulp of the product,
    which can move a logit by an ulp of ``|offset|`` (0.06 at 1e6): that is the logits' own
    rounding, not the fused path's."""
    _, _, bias, labels, cotangent = _data(seed=5)
    rng = np.random.default_rng(5)
    hidden = rng.integers(-4, 5, size=(TOKENS, WIDTH)) / 4.0
    weight = rng.integers(-4, 5, size=(VOCAB, WIDTH)) / 8.0
    data = hidden, weight, bias + offset, labels, cotangent
    _check(eager_target, "float32", {"label_smoothing": 0.1, "z_loss": 1e-4}, data=data)
    _check(eager_target, "float32", {}, data=data)


def test_spread_near_float32_max_stays_finite(eager_target):
    """Logits spread over +-max/4: the smoothing mean is a sum of x / V (a sum of x would
    overflow to -inf and make the loss inf), equal to the unfused loss."""
    hidden, weight, bias, labels, cotangent = _data(seed=6)
    spread = np.random.default_rng(6).uniform(-1, 1, bias.shape) * np.finfo(np.float32).max / 4
    data = hidden, weight, spread, labels, cotangent
    kwargs = {"label_smoothing": 0.1, "reduction": "none"}  # a sum of 1e38 rows overflows
    got, _ = _check(eager_target, "float32", kwargs, data=data, wrt=(0,))
    assert np.isfinite(got).all()


def test_default_chunk_follows_the_backend_budget():
    from numstab.backends import load_backend

    assert load_backend("numpy").fused_chunk_bytes == 32 * 2**20
    assert default_chunk_size(4096, 65536, 64 * 2**20) == 256  # TensorFlow's budget


def test_default_chunk_budget_follows_the_device(eager_target):
    """A GPU's products need long chunks to run at speed: its budget is the GPU one."""
    from numstab.backends import load_backend

    h = eager_target.h
    be = load_backend(eager_target.name)
    x = h.asarray(np.ones((2, 2)), "float32")
    on_gpu = h.device == "gpu" and eager_target.name in ("torch", "jax")  # TF: where it sees one
    if eager_target.name == "tensorflow":
        on_gpu = h.device == "gpu" and "GPU" in x.device
    assert be.on_gpu(x) == on_gpu
    want = be.fused_chunk_bytes_gpu if on_gpu else be.fused_chunk_bytes
    assert be.fused_chunk_budget(x) == want
