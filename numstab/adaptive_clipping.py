"""Adaptive gradient clipping: ZClip (z-score of the global norm), and AGC (unit-wise,
``numstab.agc``) re-exported beside it.

Both are optax-style ``init`` / ``update`` pairs written once over backend primitives. State is
a NamedTuple of backend arrays (a pytree): ``update`` reads no value on the host, so it runs
under jax.jit, tf.function and torch.compile. Norms are taken in float32 (float64 for float64
gradients); 16-bit gradients are scaled in float32 and rounded once.

    zclip = ZClip()                                   # the zclip package's defaults
    state = zclip.init(params)
    grads, state = zclip.update(grads, state)         # state.norm: the raw global norm

    agc = AGC(clip_factor=0.01, eps=1e-3)             # NFNets / optax.adaptive_grad_clip
    grads = agc.clip(grads, params)

See docs/semantics.md §13 for the formulas and the differences from zclip/optax.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

from numstab import _validate as v
from numstab._dispatch import (
    HOST,
    check_numeric_host,
    framework_of,
    hyperparameter,
    resolve_backend,
    state_on_backend,
)
from numstab._layouts import dense_only
from numstab.agc import AGC, AGC_LAYOUTS, adaptive_grad_clip
from numstab.backends import load_backend
from numstab.backends._base import Backend
from numstab.clipping import _float_leaves, _given_norm, _tree_norm, in_range, scale_leaves
from numstab.errors import InvalidArgumentError
from numstab.tree import flatten, unflatten

Array = Any
Tree = Any

ZCLIP_MODES = ("zscore", "percentile")
ZCLIP_CLIP_OPTIONS = ("adaptive_scaling", "mean")


# -- ZClip ------------------------------------------------------------------------------------
class ZClipState(NamedTuple):
    """ZClip's state, backend arrays. count: int32, finite norms collected for the warmup
    (stops at its length); buffer: float32 [max(warmup_steps, 1)], those norms; mean, var:
    float32 EMA statistics (valid once ``count`` reaches the warmup length); norm: float32, the
    last raw global norm (for logging; a float64 one past float32's range reads inf here, yet
    is clipped as the finite norm it is)."""

    count: Array
    buffer: Array
    mean: Array
    var: Array
    norm: Array


class ZClip:
    """ZClip (Kumar et al., 2025): clip the global 2-norm ``g`` when it is an outlier of its
    own EMA statistics, step for step as the ``zclip`` package's ``ZClip.step``.

    Warmup: the first ``max(warmup_steps, 1)`` finite norms are collected and gradients are
    clipped to ``max_grad_norm`` (if set): ``coef = min(1, max_grad_norm / (g + 1e-6))``. At
    the last of them ``mean`` and ``var`` become their mean and population variance.

    Afterwards, with ``std = sqrt(var)`` and ``z = (g - mean) / (std + eps)``:

    - ``mode="zscore"``: a spike is ``z > z_thresh``; its threshold is
      ``clip_factor * (mean + z_thresh * std / (z / z_thresh))`` (``clip_option=
      "adaptive_scaling"``) or ``mean`` (``clip_option="mean"``);
    - ``mode="percentile"``: the threshold is ``mean + z_thresh * std``; a spike is ``g`` above it.

    ``clip = threshold`` on a spike, else ``g``; ``limit = min(clip, max_grad_norm)``; the
    gradients are multiplied by ``limit / (g + 1e-6)`` when ``g > limit``. Then the EMA takes
    ``clip`` (not the raw norm): ``mean = alpha * mean + (1 - alpha) * clip``,
    ``var = alpha * var + (1 - alpha) * (clip - mean) ** 2`` with the NEW mean; skipped on
    spikes when ``skip_update_on_spike``.

    A non-finite ``g`` changes nothing: gradients untouched (for a loss scaler or guard to
    skip the step), statistics kept (zclip poisoned its EMA with the NaN forever).

    ``alpha``, ``z_thresh``, ``max_grad_norm``, ``eps`` and ``clip_factor`` enter only array
    math: each may be a 0-d array (``optax.inject_hyperparams``), checked when its value can
    be read, used in float32 when traced. ``warmup_steps`` sets the buffer's shape, and
    ``mode``, ``clip_option`` and ``skip_update_on_spike`` pick code: static (a readable 0-d
    array is read; a traced one raises ``InvalidArgumentError``).
    """

    def __init__(
        self,
        alpha: float = 0.97,
        z_thresh: float = 2.5,
        max_grad_norm: float | None = 1.0,
        eps: float = 1e-6,
        warmup_steps: int = 25,
        mode: str = "zscore",
        clip_option: str = "adaptive_scaling",
        clip_factor: float = 1.0,
        skip_update_on_spike: bool = False,
    ) -> None:
        number = v.check_number_or_traced  # 0-d arrays too: see the class docstring
        self.alpha = number("alpha", alpha, low=0.0, high=1.0)
        self.z_thresh = number("z_thresh", z_thresh, low=0.0, low_open=True)
        if max_grad_norm is not None:
            max_grad_norm = number("max_grad_norm", max_grad_norm, low=0.0, low_open=True)
        self.max_grad_norm = max_grad_norm
        self.eps = number("eps", eps, low=0.0)
        steps = v.check_static("warmup_steps", warmup_steps)
        self.warmup_steps = v.check_int("warmup_steps", steps)
        if self.warmup_steps < 0:
            raise InvalidArgumentError(
                f"Expected warmup_steps >= 0. Received: warmup_steps={warmup_steps!r}"
            )
        mode = mode.lower() if isinstance(mode, str) else mode
        v.check_choice("mode", mode, ZCLIP_MODES)
        clip_option = clip_option.lower() if isinstance(clip_option, str) else clip_option
        v.check_choice("clip_option", clip_option, ZCLIP_CLIP_OPTIONS)
        self.mode, self.clip_option = mode, clip_option
        self.clip_factor = number("clip_factor", clip_factor, low=0.0, low_open=True)
        self.skip_update_on_spike = v.check_bool("skip_update_on_spike", skip_update_on_spike)

    @property
    def buffer_size(self) -> int:
        """Norms collected before the EMA starts (zclip treats warmup_steps=0 as 1)."""
        return max(self.warmup_steps, 1)

    def init(self, params: Tree = None, *, backend: str | None = None) -> ZClipState:
        """A fresh state on the backend (and device) of ``params`` (any tree, or None)."""
        leaves = [x for x in flatten(params)[0] if x is not None]
        be = resolve_backend(*leaves, backend=backend)
        for leaf in leaves:
            if framework_of(leaf) == HOST:
                check_numeric_host(leaf, "params")
        like = next((x for x in leaves if hasattr(x, "device")), None)

        import numpy as np  # lazily: importing numstab imports no numpy

        # one array per field: a field shared by two (mean, var, norm) cannot be donated to a
        # jitted step (JAX: "donate the same buffer twice"; a sharded state crashed)
        shapes = ((), (self.buffer_size,), (), (), ())
        dtypes = ("int32", "float32", "float32", "float32", "float32")
        return ZClipState(
            *(be.asarray(np.zeros(s, d), like=like) for s, d in zip(shapes, dtypes, strict=True))
        )

    @dense_only
    def update(
        self,
        grads: Tree,
        state: ZClipState,
        *,
        norm: Array | None = None,
        backend: str | None = None,
    ) -> tuple[Tree, ZClipState]:
        """(clipped gradients, next state). ``None`` leaves stay None; dtypes are kept.
        ``norm``: the global 2-norm computed elsewhere (of gradients sharded over devices or
        ranks, as ``clip_by_global_norm``'s ``norm=``), used instead of this tree's own."""
        state = self._checked(state)
        found = _float_leaves(grads, backend, state.mean, name="grads", complex_ok=True)
        be, leaves, treedef = found.be, found.leaves, found.treedef
        if norm is None:
            norm = _tree_norm(found, 2.0)
        coef, state = self._coefficient(norm, state, be.name)  # state checked above
        return unflatten(treedef, scale_leaves(be, leaves, coef, toward_zero=True)), state

    def coefficient(
        self, norm: Array, state: ZClipState, *, backend: str | None = None
    ) -> tuple[Array, ZClipState]:
        """(factor to multiply the gradients by, next state) for a global norm computed
        elsewhere (for example across ranks). The factor is a 0-d array: float64 for a float64
        norm (float64 gradients), else float32. The state stays float32 whatever the norm."""
        return self._coefficient(norm, self._checked(state), backend)

    def _coefficient(
        self, norm: Array, state: ZClipState, backend: str | None
    ) -> tuple[Array, ZClipState]:
        """``coefficient`` for a checked ``state``."""
        be = resolve_backend(norm, *state, backend=backend)
        state = state_on_backend(be, state, norm)  # a host state (bare init()) joins norm's backend
        # a DTensor norm (FSDP2) becomes the global value; bad norms raise as in §7.3
        norm = be.replicated(_given_norm(be, norm, like=state.mean))
        if be.dtype_name(norm) != "float64":
            norm = be.cast(norm, "float32")
        views = [be.host_view(x) for x in (norm, *state)]  # None: traced, on a GPU, NumPy
        sign = norm if be.name == "numpy" else views[0]  # readable without a wait: checked
        if sign is not None and sign < 0:
            raise InvalidArgumentError(f"Expected norm >= 0. Received: norm={float(sign)}")
        if any(view is None for view in views):
            return self._step(be, norm, state)
        # eager, in host memory: NumPy's ~0.5 us per 0-d op (torch ~2 us, JAX and TF 10-50
        # us), then back as the framework's arrays on their devices (NumPy's dtypes kept)
        coef, new = self._step(load_backend("numpy"), views[0], ZClipState(*views[1:]))
        state = ZClipState(*(be.asarray(x, like=old) for x, old in zip(new, state, strict=True)))
        return be.asarray(coef, like=norm), state

    def _checked(self, state: Any) -> ZClipState:
        """``state`` if a ZClipState of this ZClip: an integer 0-d ``count``, a floating
        ``buffer`` of the static shape ``(max(warmup_steps, 1),)``, floating 0-d ``mean``,
        ``var`` and ``norm`` (another ZClip's buffer, or a vector field, was broadcast
        silently, or raised the framework's error). Reads static shapes and dtypes only."""
        fields = _state_spec(self.buffer_size)
        return v.check_state_fields(state, ZClipState, "ZClip.init", fields)

    def _step(self, be: Backend, g: Array, state: ZClipState) -> tuple[Array, ZClipState]:
        with be.float_errors_ignored():
            return self._masked_step(be, g, state)

    def _settings(self, be: Backend, g: Array, dtype: str) -> tuple:
        """(alpha, z_thresh, eps, clip_factor, max_grad_norm): floats, or 0-d arrays where
        traced (``hyperparameter``), float32 but max_grad_norm in ``dtype`` (the norm's; clamped to
        its range, a traced one past it is inf: neither clips anything more)."""
        settings = (self.alpha, self.z_thresh, self.eps, self.clip_factor)
        max_norm = self.max_grad_norm
        if isinstance(max_norm, float):
            max_norm = in_range(max_norm, dtype)
        elif max_norm is not None:
            max_norm = hyperparameter(be, max_norm, dtype, g)
        return (*(hyperparameter(be, x, "float32", g) for x in settings), max_norm)

    def _masked_step(self, be: Backend, g: Array, state: ZClipState) -> tuple[Array, ZClipState]:
        """The step for a float32 or float64 norm ``g``: float32 statistics, the factor in
        ``g``'s dtype (a finite float64 norm past float32's range is clipped, not treated as
        non-finite). For a float32 ``g``, ``exact`` is ``g`` and ``wide`` the identity."""
        n = self.buffer_size
        dtype = be.dtype_name(g)
        alpha, z_thresh, eps, factor, max_norm = self._settings(be, g, dtype)
        finite = be.isfinite(g)
        exact = be.where(finite, g, 0.0)  # keeps NaN out of every branch; masked below
        raw, g = g, exact
        if dtype == "float64":  # the statistics in float32, g clamped to its largest value
            raw = be.cast(raw, "float32")
            g = be.cast(_min(be, exact, in_range(float("inf"), "float32")), "float32")

        def wide(x: Array) -> Array:  # a float32 value in the factor's dtype
            return x if dtype != "float64" else be.cast(x, dtype)

        warming = state.count < n

        # warmup: collect g, clip to max_grad_norm, initialise the EMA at the n-th norm
        collect = warming & finite
        slot = be.arange(n, like=state.count) == state.count
        buffer = be.where(slot & collect, g, state.buffer)
        count = be.where(collect, state.count + 1, state.count)
        initialise = collect & (count >= n)
        first_mean = be.sum(buffer) / float(n)
        first_var = be.sum((buffer - first_mean) ** 2) / float(n)
        warm_coef = (
            exact * 0.0 + 1.0 if max_norm is None else _min(be, max_norm / (exact + 1e-6), 1.0)
        )

        # active: threshold from the EMA statistics, clip, then update the EMA with the clip
        std = be.sqrt(state.var)
        if self.mode == "percentile":
            threshold = state.mean + z_thresh * std
            spike = g > threshold
        else:
            z = (g - state.mean) / (std + eps)
            spike = z > z_thresh
            if self.clip_option == "mean":
                threshold = state.mean
            else:
                # z only where it is a spike (z > z_thresh > 0): elsewhere threshold is unused,
                # and z = 0 with std = 0 (all-zero gradients) made a 0/0 that jax_debug_nans
                # reports though the where below discards it
                safe_z = be.where(spike, z, z_thresh)
                threshold = state.mean + (z_thresh * std) / (safe_z / z_thresh)
                threshold = threshold * factor
        clip = be.where(spike, threshold, g)
        limit = clip if dtype != "float64" else be.where(spike, wide(threshold), exact)
        limit = limit if max_norm is None else _min(be, limit, max_norm)
        active_coef = be.where(exact > limit, limit / (exact + 1e-6), 1.0)
        mean = alpha * state.mean + (1.0 - alpha) * clip
        var = alpha * state.var + (1.0 - alpha) * (clip - mean) ** 2
        learn = ~warming & finite
        if self.skip_update_on_spike:
            learn = learn & ~spike

        coef = be.where(finite, be.where(warming, warm_coef, active_coef), 1.0)
        mean = be.where(initialise, first_mean, be.where(learn, mean, state.mean))
        var = be.where(initialise, first_var, be.where(learn, var, state.var))
        return be.cast(coef, dtype), ZClipState(count, buffer, mean, var, raw)


@functools.lru_cache(maxsize=64)
def _state_spec(n: int) -> tuple[tuple[str, str, tuple], ...]:
    """ZClipState's fields for ``check_state_fields``: an integer 0-d count, a floating
    buffer of length ``n``, floating 0-d mean, var and norm."""
    return (
        ("count", "i", ()),
        ("buffer", "f", (n,)),
        *((name, "f", ()) for name in ("mean", "var", "norm")),
    )


def _min(be: Backend, x: Array, bound: float | Array) -> Array:
    """min(x, bound) for a Python float or 0-d array bound (NaN-free inputs)."""
    return be.where(x > bound, bound, x)


__all__ = ["AGC", "AGC_LAYOUTS", "ZClip", "ZClipState", "adaptive_grad_clip"]
