"""``finite_summary``: reduce a tree to a few numbers inside the user's compiled step.

``check_numerics(mode="sentinel")`` reads finiteness summaries, not the values. With JAX the
cheapest place to compute them is inside the ``jax.jit`` step itself: XLA schedules the
reductions with the step (no second dispatch, no second executable), and the step returns a
handful of floats instead of the whole gradient tree. ``watch`` records a ``FiniteSummary``
as it is::

    @jax.jit
    def train(params, state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        ...
        return params, state, loss, finite_summary(grads)

    with check_numerics(mode="sentinel") as cn:
        params, state, loss, grads_ok = train(params, state)
        cn.watch(grads_ok, "grads")  # no reduction, no host sync here
        cn.check()  # one host read

Formula: one sum per floating, non-empty leaf, in float32 (float64 leaves in float64;
complex leaves: real part plus imaginary part). NaN and inf propagate through a sum, so a
leaf holds NaN or inf exactly when its sum does, except that a finite leaf whose sum
overflows reads as inf and ``+inf`` next to ``-inf`` (or inf next to NaN) reads as NaN.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from numstab._dispatch import HOST, detect, framework_of, host_array
from numstab.errors import InvalidArgumentError

__all__ = ["FiniteSummary", "finite_summary"]


class FiniteSummary(NamedTuple):
    """Per-leaf sums of a tree's floating leaves, made by ``finite_summary``.

    A NamedTuple, so a JAX pytree with one array leaf: it can be returned from ``jax.jit``
    (and ``vmap``/``pmap``/``scan``) as any other output. ``CheckNumerics.watch`` records it
    without reducing it again.
    """

    sums: Any


def finite_summary(tree: Any) -> FiniteSummary:
    """The finiteness summary of every floating leaf of ``tree`` (JAX arrays), traceable:
    call it inside ``jax.jit`` and return it from the step, then ``watch`` it outside.

    ``sums`` is a 1-D array with one entry per floating, non-empty leaf (integer and empty
    leaves and ``None`` are skipped; a tree with none gives an empty array). Works eagerly too
    (one compiled reduction), though there ``watch(tree)`` does the same.

    A flax NNX ``State`` or module, an Equinox module: their arrays are the leaves (an NNX
    ``Param`` is read through its value, an activation function or a setting is no leaf).

    Raises ``InvalidArgumentError`` when the tree holds no JAX array, arrays of another
    framework (torch and TensorFlow values go to ``watch`` directly), or host leaves that are
    not numbers (a string).
    """
    from numstab.tree import flatten

    leaves = [x for x in flatten(tree)[0] if x is not None]
    framework = detect(*leaves)
    if framework != "jax":
        kinds = sorted({type(x).__name__ for x in leaves}) or ["no leaves"]
        raise InvalidArgumentError(
            "Expected a tree of JAX arrays in finite_summary() (call it inside the jitted "
            "step; for torch, TensorFlow and NumPy values pass them to watch() directly). "
            f"Received: tree with {', '.join(kinds[:4])}"
        )
    # host leaves are summed on the host (as find_nonfinite reads them): JAX without x64
    # made a float64 1e300 float32 inf
    host = [i for i, x in enumerate(leaves) if framework_of(x) == HOST]
    wide = bool(host) and _jax_keeps_float64()
    for i in host:
        leaves[i] = _host_sum(leaves[i], wide)
    from numstab import frameworks

    return FiniteSummary(frameworks.module("jax", "numerics").leaf_sums(leaves))


def _host_sum(x: Any, wide: bool) -> Any:
    """A host leaf (numbers only, else InvalidArgumentError) as NumPy reads it, a floating or
    complex non-empty one replaced by its sum taken on the host in float64 (real part plus
    imaginary part), as a ``[sum]`` of the dtype the device gives that leaf's sum: float64
    for a float64 (or complex128, or wider) leaf when ``wide`` (JAX keeps float64: with
    ``jax_enable_x64``), as the same leaf passed to ``jax.jit`` gives; else float32, a finite
    sum clamped to float32's range: NaN or inf exactly where the leaf's float64 sum is, as
    for a float64 leaf on the device."""
    import numpy as np

    x = host_array(x, "tree leaves")
    # floating or complex (ml_dtypes' bfloat16 / float8 are kind "V" to NumPy)
    inexact = x.dtype.kind in "fc" or x.dtype.name.startswith(("bfloat", "float"))
    if not inexact or x.size == 0:
        return x  # skipped by the summary (integer, bool or empty)
    with np.errstate(all="ignore"):
        total = np.sum(np.real(x).astype(np.float64))
        if np.iscomplexobj(x):
            total = total + np.sum(np.imag(x).astype(np.float64))
        if x.dtype.kind in "fc" and np.real(x).dtype.itemsize >= 8 and wide:
            return np.asarray([total], np.float64)
        high = float(np.finfo(np.float32).max)
        value = total if not np.isfinite(total) else min(max(total, -high), high)
        return np.asarray([value], np.float32)


def _jax_keeps_float64() -> bool:
    """True when JAX makes a Python float float64 (``jax_enable_x64``, also inside a
    ``jax.enable_x64`` block), False when float32 (no float64 without x64)."""
    from numstab.backends import load_backend

    be = load_backend("jax")
    return be.dtype_name(be.asarray(0.0)) == "float64"
