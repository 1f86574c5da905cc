"""The JAX backend's fused cross-entropy pieces: the chunk loop (``lax.scan``), the weight
gradient's accumulation and the ``custom_vjp``, under ``jit``, eagerly (one compiled call per
settings and shapes), inside ``shard_map`` and on meshes with Explicit axes."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from numstab import _validate as v
from numstab.backends._base import generic_forced, numpy_dtype_name
from numstab.frameworks.jax.sharding import explicit_spec, pvary, varying

#: Rows of the weight gradient updated per block in ``matmul_accumulate`` (about this many bytes).
_ACCUMULATE_BLOCK_BYTES = 4 * 2**20

#: Compiled eager calls kept (one per settings of a fused call; shapes are jit's own cache).
_EAGER_CACHE_SIZE = 64
_EAGER: dict[tuple, Callable] = {}


def _product_spec(a: jax.Array, b: jax.Array) -> P | None:
    """The sharding of ``a.T @ b`` on an Explicit mesh: each operand's non-contracted axis
    as it is, the contracted (row) axis summed over (an all-reduce); None off such meshes."""
    spec_a, spec_b = explicit_spec(a), explicit_spec(b)
    if spec_a is None or spec_b is None:
        return None
    cols = tuple(spec[1] if len(spec) > 1 else None for spec in (spec_a, spec_b))
    return P(cols[0], None if cols[1] == cols[0] else cols[1])


# -- the chunk loop ---------------------------------------------------------------------------
def matmul_accumulate(acc, a, b, on_gpu: bool):
    """``JaxBackend.matmul_accumulate``: ``acc + a.T @ b`` in ``compute_dtype`` of ``a``."""
    # 16-bit operands multiplied into float32 (tensor cores on a GPU), as the generic
    wide = v.compute_dtype(numpy_dtype_name(a.dtype))
    if acc is None or on_gpu:  # XLA:GPU adds the dot into acc in its epilogue
        product = _transposed_product(a, b, wide)
        return product if acc is None else acc + product
    # ``acc + a.T @ b`` in blocks of acc's rows, each written back in place: XLA:CPU cannot
    # add a dot into its output, so one product would be a second acc-sized temporary
    vocab = a.shape[1]
    block = _ACCUMULATE_BLOCK_BYTES // (acc.dtype.itemsize * max(b.shape[1], 1))
    block = min(max(block, 1), vocab)
    full = vocab // block

    def add_block(start, acc, size=block):
        part = jax.lax.dynamic_slice_in_dim(a, start, size, axis=1)
        product = _transposed_product(part, b, wide)
        total = jax.lax.dynamic_slice_in_dim(acc, start, size) + product.astype(acc.dtype)
        return jax.lax.dynamic_update_slice_in_dim(acc, total, start, 0)

    acc = jax.lax.fori_loop(0, full, lambda i, acc: add_block(i * block, acc), acc)
    if full * block < vocab:
        acc = add_block(full * block, acc, vocab - full * block)
    return acc


def _transposed_product(a: jax.Array, b: jax.Array, wide: str) -> jax.Array:
    """``a.T @ b`` in ``wide``; on an Explicit mesh with its sharding named (rows sharded
    over a mesh axis are contracted: JAX asks where the sum goes)."""
    spec = _product_spec(a, b)
    if spec is None:
        return jnp.matmul(a.T, b, preferred_element_type=wide)
    return jnp.matmul(a.T, b, preferred_element_type=wide, out_sharding=spec)


def _zeros(shape: tuple, like: jax.ShapeDtypeStruct, strided: bool = False) -> jax.Array:
    """Zeros of ``like``'s dtype, sharding (Explicit mesh) and manual axes (shard_map): a scan
    carry must keep its type, and the step's outputs vary where its inputs do. ``strided``:
    ``shape`` has the chunk axis second, which the sharding leaves whole."""
    spec = explicit_spec(like)
    if spec is not None and strided:
        spec = P(*spec[:1], None, *spec[1:])
    if spec is None:
        zeros = jnp.zeros(shape, like.dtype)
    else:
        zeros = jnp.zeros(shape, like.dtype, out_sharding=spec)
    return pvary(zeros, varying(like))


def scan_chunks(step, carry, inputs, chunk: int, rows: int):
    """``JaxBackend.scan_chunks`` for two or more full chunks: one ``lax.scan`` with the carry
    and the outputs preallocated and updated in place (dynamic_update_slice) and the inputs
    sliced inside the body: XLA then holds one chunk's buffers, no copy of the inputs and no
    concatenation of the outputs (an unrolled Python loop under jit kept every chunk's logits
    alive).

    Strided when ``strided_count`` finds n chunks that divide the rows: the rows seen as
    (rows / n, n) and chunk k = rows k, k + n, k + 2n, ... (at most ``chunk`` of them). A
    row axis sharded in blocks over a mesh (an Auto mesh under jit: data parallelism) stays
    sharded, every chunk holding rows of every device; contiguous chunks made XLA gather
    the rows onto every device. Else contiguous chunks, the last one short. The carry's
    sums run in another order (rounding); the outputs come back in row order."""
    count = strided_count(rows, chunk)
    if count is None:
        return _scan_contiguous(step, carry, inputs, chunk, rows)
    size = rows // count
    views = tuple(None if x is None else x.reshape(size, count, *x.shape[1:]) for x in inputs)

    def body(state, i):
        carry, outputs = state
        part = tuple(
            None if x is None else jax.lax.dynamic_index_in_dim(x, i, 1, False) for x in views
        )
        carry, out = step(carry, part)
        outputs = tuple(
            None if o is None else jax.lax.dynamic_update_index_in_dim(buf, o, i, 1)
            for buf, o in zip(outputs, out, strict=True)
        )
        return (carry, outputs), None

    state = _allocate(step, carry, inputs, size, rows, count)
    (carry, outputs), _ = jax.lax.scan(body, state, jnp.arange(count))
    return carry, tuple(None if o is None else o.reshape(rows, *o.shape[2:]) for o in outputs)


def strided_count(rows: int, chunk: int) -> int | None:
    """The number n of strided chunks for ``rows`` rows of at most ``chunk``: a divisor of
    ``rows`` from low = ceil(rows / chunk) to low + max(low // 4, 1) (chunks of at least
    about 4/5 of ``chunk``: smaller ones cost time, 23% at 2046 rows in 31 chunks of 66 rows
    for 16 of 128), the one with the fewest factors 2 (rows / n then keeps most: a mesh of
    2^k devices dividing rows / n keeps the row blocks local), then the smallest; None when
    there is none (a prime number of rows, say)."""
    low = -(-rows // chunk)
    found = [n for n in _divisors(rows) if low <= n <= low + max(low // 4, 1)]
    if not found:
        return None
    return min(found, key=lambda n: ((n & -n), n))


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1 (those up to sqrt(n), then their cofactors)."""
    small = [k for k in range(1, int(n**0.5) + 1) if n % k == 0]
    return small + [n // k for k in small]


def _allocate(step, carry, inputs, size: int, rows: int, count: int | None = None) -> tuple:
    """The scan's initial state: the carry and output buffers, zeros, from the shapes of
    ``step`` on a first chunk of ``size`` rows (shapes only, no compute; traced, so no eager
    slice of a sharded array). Outputs (rows, ...) for contiguous chunks (``count`` None),
    (size, count, ...) for ``count`` strided ones."""
    first = tuple(None if x is None else jax.lax.slice_in_dim(x, 0, size) for x in inputs)
    carry_spec, out_spec = jax.eval_shape(lambda c: step(c, first), carry)
    carry = tuple(None if s is None else _zeros(s.shape, s) for s in carry_spec)
    lead = (rows,) if count is None else (size, count)
    outputs = tuple(
        None if s is None else _zeros((*lead, *s.shape[1:]), s, strided=count is not None)
        for s in out_spec
    )
    return carry, outputs


def _scan_contiguous(step, carry, inputs, chunk: int, rows: int):
    """``scan_chunks`` over consecutive chunks: the full ones in the scan, a short last one
    after it."""
    full = rows // chunk

    def run(carry, outputs, start, size):
        part = tuple(
            None if x is None else jax.lax.dynamic_slice_in_dim(x, start, size) for x in inputs
        )
        carry, out = step(carry, part)
        outputs = tuple(
            None if o is None else jax.lax.dynamic_update_slice_in_dim(buf, o, start, 0)
            for buf, o in zip(outputs, out, strict=True)
        )
        return carry, outputs

    def body(state, i):
        return run(*state, i * chunk, chunk), None

    state = _allocate(step, carry, inputs, chunk, rows)
    (carry, outputs), _ = jax.lax.scan(body, state, jnp.arange(full))
    if full * chunk < rows:
        carry, outputs = run(carry, outputs, full * chunk, rows - full * chunk)
    return carry, outputs


# -- the custom gradient ----------------------------------------------------------------------
def custom_gradient(forward, backward, args: tuple, readable: bool):
    """``JaxBackend.custom_gradient``. ``readable``: no argument is traced by jit (eager, or
    ``jax.grad`` without jit): the call then runs one ``jax.jit`` cached on the settings of
    ``forward``'s and ``backward``'s object (a traced ``lax.scan`` compiled every call)."""
    if readable:
        key = _eager_key(forward, backward)
        if key is not None:
            return _eager_call(key, forward, backward)(*args)
    return _custom_vjp_call(forward, backward, args)


def _custom_vjp_call(forward, backward, args: tuple):
    # inside shard_map every argument is cast to vary over the manual axes that any varies
    # over: a replicated weight then gets the transpose of that cast, a psum, of its
    # per-device gradient (a custom_vjp's cotangent must have its primal's type)
    axes = [frozenset() if a is None else varying(a) for a in args]
    union = frozenset().union(*axes)
    args = tuple(
        None if a is None else pvary(a, union - ax) for a, ax in zip(args, axes, strict=True)
    )
    specs = tuple(None if a is None else explicit_spec(a) for a in args)

    @jax.custom_vjp
    def fn(*primals):
        return forward(primals, (False,) * len(primals))[0]

    def fn_fwd(*primals):  # symbolic_zeros: each primal says whether it is perturbed
        values = tuple(None if p is None else p.value for p in primals)
        needs = tuple(p is not None and bool(p.perturbed) for p in primals)
        return forward(values, needs)

    def fn_bwd(residuals, cotangent):  # on an Explicit mesh, in its primal's sharding
        grads = backward(residuals, cotangent)
        return tuple(
            g if g is None or s is None else jax.sharding.reshard(g, s)
            for g, s in zip(grads, specs, strict=True)
        )

    fn.defvjp(fn_fwd, fn_bwd, symbolic_zeros=True)
    return fn(*args)


def _eager_key(forward, backward) -> tuple | None:
    """The settings of the object whose bound methods ``forward`` and ``backward`` are (the
    fused loss's plan: static settings only), hashable; None when there is no such object."""
    owner = getattr(forward, "__self__", None)
    if owner is None or getattr(backward, "__self__", None) is not owner:
        return None
    try:
        settings = tuple(sorted(vars(owner).items()))
        hash(settings)
    except TypeError:
        return None
    # and what the trace reads besides: the generic or native kernels, the block size
    return forward.__func__, backward.__func__, settings, generic_forced(), _ACCUMULATE_BLOCK_BYTES


def _eager_call(key: tuple, forward, backward) -> Callable:
    fn = _EAGER.get(key)
    if fn is None:
        while len(_EAGER) >= _EAGER_CACHE_SIZE:
            _EAGER.pop(next(iter(_EAGER)))
        fn = _EAGER[key] = jax.jit(functools.partial(_jitted_call, forward, backward))
    return fn


def _jitted_call(forward, backward, *args):
    return _custom_vjp_call(forward, backward, args)
