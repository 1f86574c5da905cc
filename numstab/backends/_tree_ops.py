"""The generic tree composites of every backend (``Backend`` inherits them): the leaves'
dtypes and sizes, per-leaf and global norms, the clip factor, scaling and finiteness, written
once over the backend's primitives. A backend may add ``native_<name>`` fused versions."""

from __future__ import annotations

import math
from typing import Any

from numstab.backends._native import native_op

Array = Any

#: leaf dtypes that ``scale_leaves`` multiplies in their own precision
_OWN_PRECISION = ("float32", "float64", "complex64", "complex128")
#: past it ``1 / scale`` is a float32 subnormal, which TensorFlow's and XLA's kernels flush to 0
SUBNORMAL_RECIPROCAL = 2.0**126


class TreeOps:
    """Composites over a list of leaves; ``self`` is a ``Backend`` (its primitives)."""

    def nonempty(self, arrays: list[Array]) -> list[Array]:
        """The arrays with at least one element (``size != 0``), in order: the leaves the
        tree functions compute on. An array of unknown size (a traced dynamic shape) is
        kept: an empty one adds nothing to a sum and scaling it is a no-op."""
        return [x for x in arrays if _maybe_nonempty(self.size(x, "float32"))]

    def dtype_names(self, arrays: list[Array]) -> set[str]:
        """The set of ``dtype_name`` over ``arrays``, asked once per distinct ``.dtype`` (the
        name is a function of it); one by one when an array has no hashable ``.dtype``."""
        try:
            one_per_dtype = {x.dtype: x for x in arrays}.values()
        except (AttributeError, TypeError):
            one_per_dtype = arrays
        return {self.dtype_name(x) for x in one_per_dtype}

    def dtypes_and_nonempty(self, arrays: list[Array]) -> tuple[set[str], list[Array]]:
        """``(dtype_names(arrays), nonempty(arrays))``: what the tree functions ask of their
        leaves first (a native version may answer in fewer passes, and return a list that
        carries what it found to its own norm and scaling kernels)."""
        return self.dtype_names(arrays), self.nonempty(arrays)

    def clip_factor(self, norm: Array, limit: float, dtype: str, tiny: bool) -> Array:
        """``limit / norm`` where ``limit < norm < inf``, else exactly 1, in ``dtype``
        (``clipping._coefficient``, which derives ``limit`` and ``dtype`` and documents the
        edge cases); ``tiny``: ``limit`` is below ``dtype``'s smallest normal (for native
        versions, which may need the generic there)."""
        bound = self.asarray(limit, dtype, like=norm)
        with self.float_errors_ignored():  # inf / inf, or 0 / 0 for a zero limit: unused
            factor = bound / self.maximum(norm, bound)
        # 1 by a select, not by limit / limit: XLA on GPU rewrote leaf * (limit / limit)
        # one ulp away from the leaf (seen with JAX 0.11 on an H200)
        return self.where((norm > bound) & (norm < math.inf), factor, 1.0)

    def leaf_power_sums(self, leaves: list[Array], ord: float, dtype: str) -> Array:
        """Each (non-empty) leaf's ``sum |g| ** p`` (``max |g|`` for p = inf), accumulated in
        ``dtype``, as a vector: one reduction per leaf, no root, nothing rescaled (for p = 1,
        2, inf and p < 1, whose terms overflow only where the norm does; other p: ``p_norms``)."""
        sums = []
        for leaf in leaves:
            x = self.cast(self.elements(leaf), dtype)  # (a torch nested tensor: flat)
            if ord == 2.0:
                sums.append(self.sum(x * x))
            elif ord == float("inf"):
                sums.append(self.max(self.abs(x)))
            elif ord == 1.0:
                sums.append(self.sum(self.abs(x)))
            else:
                sums.append(self.sum(self.abs(x) ** ord))
        return self.stack(sums)

    def power_root(self, x: Array, ord: float) -> Array:
        """``x ** (1 / p)``: ``sqrt`` for p = 2, ``x`` itself for p = 1 and p = inf."""
        if ord == 2.0:
            return self.sqrt(x)
        if ord in (1.0, float("inf")):
            return x
        return x ** (1.0 / ord)

    def leaf_norms(self, leaves: list[Array], ord: float, dtype: str) -> Array:
        """The ``ord``-norm of each (non-empty) leaf, accumulated in ``dtype``, as a vector."""
        if _rescaled(ord):
            return self.p_norms(leaves, ord, dtype, total=False)
        return self.power_root(self.leaf_power_sums(leaves, ord, dtype), ord)

    def global_norm(self, leaves: list[Array], ord: float, dtype: str) -> Array:
        """§7.2's formula, a 0-d array of ``dtype``: the leaves' power sums summed (their maxima
        maxed for p = inf), then one root; optax's reductions. (A norm of the leaf norms took
        a root and a power per leaf more: 52 more kernels than optax on XLA:CPU, 50 leaves.)
        p > 1 other than 2: ``p_norms``, rescaled."""
        if _rescaled(ord):
            return self.p_norms(leaves, ord, dtype, total=True)
        sums = self.leaf_power_sums(leaves, ord, dtype)
        return self.max(sums) if ord == float("inf") else self.power_root(self.sum(sums), ord)

    def p_norms(self, leaves: list[Array], ord: float, dtype: str, total: bool) -> Array:
        """The ``ord``-norm (1 < p < inf, p != 2) of each leaf (a vector), or of all of them
        (``total``: 0-d), rescaled by the max-abs ``M`` so that no power overflows:

            norm = M * (sum (|g| / M) ** p) ** (1 / p)        (every term in [0, 1], sum >= 1)

        exact to a few roundings of ``dtype`` for every p (an element's rounding error, raised
        to p, moves the root by at most that rounding). For p >= ``max_norm_from(dtype)`` the
        root is 1 to ``dtype``'s rounding: the max-abs norm is returned. ``M`` of 0, inf or
        NaN divides by 1: a zero tree gives 0, an inf gives inf, a NaN gives NaN."""
        maxima = self.leaf_power_sums(leaves, float("inf"), dtype)
        if total:
            maxima = self.max(maxima)
        if ord >= max_norm_from(dtype):
            return maxima
        usable = (maxima > 0.0) & (maxima < float("inf"))
        divisor = self.where(usable, maxima, 1.0)
        n = len(leaves)
        scales = [divisor] * n if total else [divisor[i] for i in range(n)]
        sums = self.stack(
            [self._scaled_power_sum(x, m, ord, dtype) for x, m in zip(leaves, scales, strict=True)]
        )
        return maxima * self.power_root(self.sum(sums) if total else sums, ord)

    def _scaled_power_sum(self, leaf: Array, scale: Array, ord: float, dtype: str) -> Array:
        """``sum (|leaf| / scale) ** p`` accumulated in ``dtype`` (``p_norms``' terms)."""
        return self.sum((self.abs(self.cast(self.elements(leaf), dtype)) / scale) ** ord)

    def scale_leaves(
        self, leaves: list[Array], factor: Array, toward_zero: bool = False
    ) -> list[Array]:
        """Each leaf times a 0-d ``factor``: float32/64 (and complex) leaves multiply in their
        own dtype (a complex leaf by ``factor + 0j``, as torch and optax scale them), 16-bit
        leaves in float32 and are rounded back once: to nearest, or ``toward_zero``
        (``cast_toward_zero``: clipping, whose result must not grow past the float32 one)."""
        out = []
        factor32 = None  # a float64 factor (float64 leaves in the tree) cast once, if needed
        for leaf in leaves:
            dtype = self.dtype_name(leaf)
            if dtype in _OWN_PRECISION:
                out.append(leaf * self.cast(factor, dtype))
                continue
            factor32 = self.cast(factor, "float32") if factor32 is None else factor32
            product = self.cast(leaf, "float32") * factor32
            out.append(
                self.cast_toward_zero(product, dtype) if toward_zero else self.cast(product, dtype)
            )
        return out

    def unscale_leaves(self, leaves: list[Array], scale: Array) -> list[Array]:
        """Each leaf divided by a 0-d float32 loss ``scale``, exact for every power of two up
        to float32's largest: ``leaf * (1 / (scale * s)) * s``, ``s = 2**-64`` where ``scale >
        2**126`` and 1 elsewhere (``x * 1`` is exact: then the values of ``leaf * (1 /
        scale)``). One factor would not do past 2**126: ``1 / scale`` is a float32 subnormal
        there, which TensorFlow's and XLA's kernels flush to 0 (every gradient became 0).
        float32/64 (and complex) leaves in their dtype, 16-bit ones in float32, rounded back
        once. For backends that flush subnormals (``flushes_subnormals``)."""
        tiny = self.asarray(2.0**-64, dtype="float32", like=scale)
        shift = self.where(scale > SUBNORMAL_RECIPROCAL, tiny, 1.0)
        first = 1.0 / (scale * shift)
        out = []
        for leaf in leaves:
            dtype = self.dtype_name(leaf)
            if dtype in _OWN_PRECISION:
                out.append(leaf * self.cast(first, dtype) * self.cast(shift, dtype))
            else:
                out.append(self.cast(self.cast(leaf, "float32") * first * shift, dtype))
        return out

    def cast_toward_zero(self, x: Array, dtype: str) -> Array:
        """float32 ``x`` as the 16-bit ``dtype``, rounded toward zero: ``|out| <= |x|``
        everywhere (round to nearest can move a value up by half a spacing, which below the
        normal range is any fraction of it: 0.6 * 2**-24 becomes 2**-24 in float16). A value
        that rounded away from zero steps back one spacing (``step_toward_zero``); NaN stays
        NaN, and a finite value past the dtype's largest becomes that largest, not inf."""
        with self.float_errors_ignored():  # a finite overflow is handled below, not reported
            rounded = self.cast(x, dtype)
        away = self.magnitude_float32(rounded) > self.abs(x)
        return self.where(away, self.step_toward_zero(rounded), rounded)

    def magnitude_float32(self, x: Array) -> Array:
        """``|x|`` of a 16-bit ``x`` as float32, exactly ``x``'s value (a backend whose compiler
        may keep 16-bit values in float32 reads it from the bits instead)."""
        return self.abs(self.cast(x, "float32"))

    def magnitude_from_bits(self, x: Array) -> Array:
        """``|x|`` of a float16 / bfloat16 ``x`` as float32, built from its bit pattern alone
        (``magnitude_float32`` where a compiler keeps 16-bit values in float32: a cast would
        read the unrounded value). Integer operators, so for backends whose arrays have them."""
        bits = self.cast(self.bitcast(x, "int16"), "int32") & 0x7FFF  # the sign bit cleared
        if self.dtype_name(x) == "bfloat16":  # the top half of a float32
            return self.bitcast(bits << 16, "float32")
        exponent, mantissa = bits >> 10, bits & 0x3FF  # float16: 5 exponent, 10 mantissa bits
        normal = self.bitcast(((exponent + 112) << 23) | (mantissa << 13), "float32")
        special = self.bitcast((mantissa << 13) | 0x7F800000, "float32")  # inf, NaN
        subnormal = self.cast(mantissa, "float32") * 2.0**-24
        return self.where(exponent == 0, subnormal, self.where(exponent == 31, special, normal))

    def leaf_finite(self, leaves: list[Array]) -> Array:
        """A boolean vector, one entry per (non-empty) leaf: every element of that leaf is
        finite. Stays on the device: the first pass of ``find_nonfinite`` and ``all_finite``."""
        return self.stack([self.all(self.isfinite(self.elements(leaf))) for leaf in leaves])

    def all_finite(self, leaves: list[Array]) -> Array:
        """One 0-d boolean: every element of every leaf is finite."""
        return self.all(native_op(self, "leaf_finite")(leaves))


def max_norm_from(dtype: str) -> float:
    """The smallest p from which the p-norm is the max-abs norm to ``dtype``'s rounding u
    (2**-24 for float32, 2**-53 for float64): with ``M = max |g|`` over n elements,
    ``M <= norm_p <= M * n ** (1 / p)``, and ``n ** (1 / p) <= 1 + u`` once
    ``p >= ln(n) / ln(1 + u)``; with n < 2**63 (any array), ``p >= 63 ln 2 / ln(1 + u)``:
    about 7.33e8 for float32 and 3.94e17 for float64."""
    unit = 2.0**-53 if dtype == "float64" else 2.0**-24
    return 63.0 * math.log(2.0) / math.log1p(unit)


def _rescaled(ord: float) -> bool:
    """The p-norms computed by ``p_norms``: 1 < p < inf other than 2 (whose unrescaled sum of
    squares is the documented, optax's and torch's; p <= 1 sums terms that overflow only
    where the norm itself does)."""
    return 1.0 < ord < float("inf") and ord != 2.0


def _maybe_nonempty(size: Any) -> bool:
    """False only for a size known to be 0 (a Python int; a traced size is unknown)."""
    return not isinstance(size, int) or size != 0
