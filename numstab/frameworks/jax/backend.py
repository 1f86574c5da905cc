"""The JAX backend: jax.Arrays and tracers, eager and under jit; native losses from optax."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax  # noqa: F401  (the jax extra ships optax; its absence disables the backend)

from numstab.backends._base import generic_forced, numpy_dtype_name
from numstab.backends._namespace import NamespaceBackend
from numstab.frameworks.jax import fused, sharding


@jax.jit
def _leaf_finite(x):
    """``all(isfinite(x))`` as one compiled kernel: eagerly one dispatch instead of two, and
    no boolean array of x's size written and read back (compiled once per shape and dtype,
    as every eager JAX op is)."""
    return jnp.all(jnp.isfinite(x))


@jax.jit
def _stack(scalars):
    """``jnp.stack`` of 0-d arrays as one dispatch (compiled once per count): eagerly,
    jnp.stack dispatches one expand_dims per array (~10 us each)."""
    return jnp.stack(scalars)


@functools.cache
def _jitted(fn, static: tuple[str, ...], generic: bool):
    """One ``jax.jit`` of ``fn`` per (static names, NUMSTAB_FORCE_GENERIC): the generic and
    native paths trace differently, and JAX caches traces by function and arguments only, so
    each mode jits its own ``partial`` of ``fn``."""
    return jax.jit(functools.partial(fn), static_argnames=static)


class JaxBackend(NamespaceBackend):
    name = "jax"
    xp = jnp
    index_dtype = "int32"
    flushes_subnormals = True  # XLA's CPU kernels: 1 / 2**127 is 0

    def asarray(self, x, dtype=None, like=None):
        return jnp.asarray(x, dtype=dtype)

    def to_numpy(self, x):
        x = np.asarray(_concrete(x) if isinstance(x, jax.core.Tracer) else x)
        return x.astype(np.float32) if x.dtype.name == "bfloat16" else x

    def dtype_name(self, x):
        return numpy_dtype_name((x if hasattr(x, "dtype") else jnp.asarray(x)).dtype)

    def cast(self, x, dtype):
        x = x if hasattr(x, "dtype") else jnp.asarray(x)
        return x if x.dtype.name == dtype else x.astype(dtype)  # astype copies, even a no-op

    def shape(self, x):
        return tuple(jnp.shape(x))

    def is_tracing(self, x):
        return isinstance(x, jax.core.Tracer)

    def compiled_eager(self, fn, static):
        # eager jnp ops cost ~10-50 us of dispatch each on CPU: a tiny loss is one dispatch
        return _jitted(fn, static, generic_forced())

    def host_view(self, x):
        # a concrete array whose every shard lives in host memory: NumPy reads its buffer
        if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
            return None
        if not x.is_fully_addressable or any(d.platform != "cpu" for d in x.devices()):
            return None
        return np.asarray(x)

    def can_read(self, x):
        # not traced, or traced eagerly with its value at hand (jax.grad without jit), which
        # is_tracing does not tell apart; to_numpy reads such a value the same way
        return not isinstance(x, jax.core.Tracer) or _concrete(x) is not None

    def stop_gradient(self, x):
        return jax.lax.stop_gradient(x)

    def bitcast(self, x, dtype):
        return jax.lax.bitcast_convert_type(x, dtype)

    def magnitude_float32(self, x):
        # from the bits: XLA:GPU may keep a 16-bit intermediate in float32 (excess
        # precision), so cast_toward_zero's float32(rounded) > x never held (an H200: clipped
        # float16 norms 0.6% over max_norm); a bitcast needs the rounded bits
        return self.magnitude_from_bits(x)

    # fused kernels with the generic semantics
    def native_unscale_leaves(self, leaves, scale):
        # the generic's two multiplies, one compiled call (fused; eagerly one dispatch);
        # XLA turns x / s into x * (1 / s), so a division would flush too
        return _unscale_leaves(leaves, scale)

    def native_leaf_finite(self, leaves):
        return _stack([_leaf_finite(x) for x in leaves])

    def native_logsumexp(self, x, axis=-1, keepdims=False):
        return jax.nn.logsumexp(x, axis=axis, keepdims=keepdims)

    def native_shifted_logsumexp(self, x):
        # x - m <= 0 with a 0 in every finite row: no second max (jax.nn.logsumexp takes one)
        return jnp.log(jnp.sum(jnp.exp(x), axis=-1))

    def native_log_softmax(self, x):
        return jax.nn.log_softmax(x, axis=-1)

    def native_softmax_nll(self, logits, labels):
        # logsumexp - target logit never materialises log_softmax (optax's formulation; under
        # jit the gather-of-log_softmax form measured 2.2x slower). A +inf logit is NaN, as
        # in the other backends' kernels (optax would give +inf). Shifted by the max first:
        # unshifted, uniform float32 logits at 1e6 gave 1.125 for log 3 = 1.0986.
        m, m_row = self.row_shift(logits)
        lse = self.native_shifted_logsumexp(logits - m)
        return jnp.where(lse == jnp.inf, jnp.nan, lse - (self.take_rows(logits, labels) - m_row))

    def native_smoothed_nll(self, x, labels, eps, weight):
        # only eager (under jit the masked formula runs): few primitives, as optax's loss
        log_p = jax.nn.log_softmax(x, axis=-1)
        terms = log_p if weight is None else log_p * weight
        nll = -self.take_rows(terms, labels)
        return nll * (1.0 - eps) - jnp.sum(terms, axis=-1) * (eps / x.shape[-1])

    # -- schedules and adaptive clipping --

    # -- fused cross-entropy --
    # add_at_rows: the base's iota comparison, not a scatter: XLA then fuses the whole softmax
    # gradient into one elementwise pass that overwrites the logits (a scatter kept a second
    # chunk-sized buffer; measured with memory_analysis)

    def on_gpu(self, x):
        if isinstance(x, jax.core.Tracer):  # traced: compiled for the default platform
            return jax.default_backend() == "gpu"
        return all(d.platform == "gpu" for d in x.devices())

    def matmul_accumulate(self, acc, a, b):
        return fused.matmul_accumulate(acc, a, b, self.on_gpu(a))

    def scan_chunks(self, step, carry, inputs, chunk, rows):
        if rows > chunk:  # on an Explicit mesh, rows replicated: a chunk of rows is not a
            # whole number of rows per device in general (a single chunk stays sharded)
            inputs = tuple(None if x is None else sharding.unsharded_along(x, 0) for x in inputs)
        if rows // chunk < 2 and fused.strided_count(rows, chunk) is None:  # full + short
            return super().scan_chunks(step, carry, inputs, chunk, rows)
        return fused.scan_chunks(step, carry, inputs, chunk, rows)

    def custom_gradient(self, forward, backward, args):
        readable = all(a is None or self.can_read(a) for a in args)
        return fused.custom_gradient(forward, backward, args, readable)

    # -- data firewall --
    def compress(self, x, keep, axis):
        # an Explicit mesh: the kept slices gathered replicated along the axis (their count
        # need not divide the mesh)
        return jnp.compress(keep, sharding.unsharded_along(x, axis), axis=axis)


BACKEND = JaxBackend()
_unscale_leaves = jax.jit(functools.partial(JaxBackend.unscale_leaves, BACKEND))


def _concrete(x: jax.core.Tracer) -> jax.Array | None:
    """The value a tracer carries, or None: an eager ``jax.grad`` / ``jacfwd`` / ``jacrev`` /
    ``hessian`` (no jit) traces with the primal at hand, nested too (``hessian``); ``jit``,
    ``vmap`` and ``eval_shape`` tracers have none. ``np.asarray`` refuses every tracer
    (TracerArrayConversionError): read through this instead."""
    return x.to_concrete_value()
