"""Adaptive gradient clipping, unit-wise (AGC, NFNets): ``optax.adaptive_grad_clip``'s rule
written once over backend primitives, ``grads = AGC(clip_factor=0.01, eps=1e-3).clip(grads,
params)``. ``numstab.adaptive_clipping`` re-exports it beside ZClip; docs/semantics.md §13.2
has the units of each layout and the differences from optax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from numstab import _validate as v
from numstab._dispatch import hyperparameter, resolve_backend, to_backend
from numstab._layouts import dense_only
from numstab.backends._base import Backend
from numstab.clipping import in_range
from numstab.errors import InvalidArgumentError
from numstab.tree import flatten_with_paths, leaves_with_paths, unflatten

Array = Any
Tree = Any

AGC_LAYOUTS = ("io", "oi")
INF = float("inf")


class AGC:
    """Adaptive gradient clipping (Brock et al., 2021), as ``optax.adaptive_grad_clip``.

    For every unit (a slice of a leaf, see ``unit_axes``) with gradient norm ``|G|`` and
    parameter norm ``|W|`` (float32 sums of squares, float64 for float64 leaves)::

        limit = clip_factor * max(|W|, eps)
        G    <- G * (limit / max(|G|, 1e-6))        if limit <= |G| < inf and limit < inf
        G    <- G                                   otherwise

    A non-finite ``|G|`` (a NaN or inf in the unit, or a sum of squares past the dtype's
    largest value) or ``|W|`` leaves the unit unchanged, as ``clip_by_global_norm`` leaves a
    tree whose norm is not finite (optax made [inf, 1] [nan, 0] and [1e20, 1e20] [0, 0]).

    Units (``layout``): ``"io"`` (default; optax, Flax and Keras kernels, output axis last):
    a leaf whose squeezed rank is <= 1 is one unit; rank 2 and 3 reduce axis 0; rank 4 axes
    (0, 1, 2); rank 5 axes (0, 1, 2, 3). ``"oi"`` (torch ``nn.Linear`` / ``ConvNd`` weights,
    output axis first, as timm): rank <= 1 is one unit, otherwise every axis but 0 is reduced.
    ``axis=`` overrides both for every leaf.

    ``clip_factor`` and ``eps`` may be 0-d arrays (``optax.inject_hyperparams``), checked when
    readable, used in the compute dtype when traced (a traced ``eps`` past its range is inf).
    ``axis`` and ``layout`` pick the units: static (a traced array raises).
    """

    def __init__(
        self,
        clip_factor: float = 0.01,
        eps: float = 1e-3,
        *,
        layout: str = "io",
        axis: int | Sequence[int] | None = None,
    ) -> None:
        number = v.check_number_or_traced  # 0-d arrays too: see the class docstring
        self.clip_factor = number("clip_factor", clip_factor, low=0.0, low_open=True)
        self.eps = number("eps", eps, low=0.0)
        v.check_choice("layout", layout, AGC_LAYOUTS)
        self.layout = layout
        if axis is not None:
            axes = (axis,) if not isinstance(axis, (tuple, list)) else tuple(axis)
            axis = _distinct(tuple(v.check_int("axis", v.check_static("axis", a)) for a in axes))
        self.axis = axis

    def init(self, params: Tree = None, *, backend: str | None = None) -> tuple:
        """AGC is stateless: an empty tuple."""
        return ()

    def update(
        self, grads: Tree, state: tuple, params: Tree, *, backend: str | None = None
    ) -> tuple[Tree, tuple]:
        return self.clip(grads, params, backend=backend), state

    @dense_only
    def clip(self, grads: Tree, params: Tree, *, backend: str | None = None) -> Tree:
        """The clipped gradient tree (same structure, ``None`` leaves kept, dtypes kept)."""
        # a unit's norm spans every row: sparse gradients (tf.IndexedSlices) are made dense
        named, treedef = flatten_with_paths(grads, sparse_as_dense=True)
        paths = [path for path, _ in named]
        g_leaves = [leaf for _, leaf in named]
        p_leaves = _params_by_path(named, params)
        present = [x for x in (*g_leaves, *p_leaves) if x is not None]
        be = resolve_backend(*present, backend=backend)
        like = next((x for x in present if hasattr(x, "device")), None)
        out = []
        for path, g, p in zip(paths, g_leaves, p_leaves, strict=True):
            if g is None:
                out.append(None)
                continue
            if p is None:
                raise InvalidArgumentError(
                    f"Expected a parameter for every gradient. Received: params{path}=None"
                )
            g, p = to_backend(be, g, like, "grads"), to_backend(be, p, like, "params")
            with be.float_errors_ignored():  # an overflowing sum of squares is handled
                out.append(self._clip_leaf(be, g, p, path))
        return unflatten(treedef, out)

    def unit_axes(self, shape: tuple) -> tuple[int, ...] | None:
        """The axes reduced for one unit's norm (None: the whole leaf)."""
        if self.axis is not None:
            return self.axis
        rank = len(shape)
        if self.layout == "oi":
            return None if rank <= 1 else tuple(range(1, rank))
        if sum(d != 1 for d in shape) <= 1:  # optax: jnp.squeeze(x).ndim <= 1
            return None
        defaults = {2: (0,), 3: (0,), 4: (0, 1, 2), 5: (0, 1, 2, 3)}
        if rank not in defaults:
            raise InvalidArgumentError(
                f"Expected parameters of rank 1 to 5 for AGC's default units (or axis=). "
                f"Received: shape={shape}"
            )
        return defaults[rank]

    def _clip_leaf(self, be: Backend, g: Array, p: Array, path: str) -> Array:
        dtype = be.dtype_name(g)
        for name, x in (("grads", g), ("params", p)):
            if not v.is_floating(be.dtype_name(x)):
                raise InvalidArgumentError(
                    f"Expected floating-point {name} ({v.FLOAT_DTYPES}). Received: "
                    f"{name}{path} with dtype={be.dtype_name(x)}"
                )
        if not v.shapes_match(be.shape(g), be.shape(p)):
            raise InvalidArgumentError(
                f"Expected each gradient to have its parameter's shape. Received: at {path!r} "
                f"grad shape={be.shape(g)}, param shape={be.shape(p)}"
            )
        axes = self.unit_axes(be.shape(g))
        if axes is not None:  # (0, -2) on a matrix names axis 0 twice
            axes = _distinct(tuple(v.normalize_axis(a, len(be.shape(g))) for a in axes), axes)
        compute = v.compute_dtype(dtype)
        g32, p32 = be.cast(g, compute), be.cast(p, compute)
        g_norm = _unit_norm(be, g32, axes)
        eps = self.eps
        if isinstance(eps, float):  # past the compute dtype: its largest finite value
            eps = in_range(eps, compute)
        factor, eps = (
            hyperparameter(be, self.clip_factor, compute, g),
            hyperparameter(be, eps, compute, g),
        )
        limit = factor * be.maximum(_unit_norm(be, p32, axes), eps)
        clipped = g32 * (limit / be.maximum(g_norm, 1e-6))
        # a unit whose norm is not finite (a NaN or inf element, or a sum of squares past the
        # dtype's largest value) or whose limit is not (its parameter's) is left as it is:
        # never a half-NaN, half-zero or zeroed unit (optax: [inf, 1] -> [nan, 0])
        clip = (g_norm >= limit) & (g_norm < INF) & (limit < INF)
        out = be.where(clip, clipped, g32)
        return out if dtype == compute else be.cast_toward_zero(out, dtype)  # never above limit


def _params_by_path(named: list[tuple[str, Any]], params: Tree) -> list:
    """The parameter at each gradient's path (None for a None gradient), paired by path, not
    position (``jax.jit`` sorts dict keys). A None gradient matches any params subtree (§6
    rule 5: Equinox's ``filter_grad``); any other unpaired leaf is a structure mismatch."""
    p_by_path = dict(leaves_with_paths(params))
    wanted = [path for path, g in named if g is not None]
    nones = [path for path, g in named if g is None]
    missing = [path for path in wanted if path not in p_by_path]
    paired = set(wanted)
    extra = [p for p in p_by_path if p not in paired and not _under_any(p, nones)]
    if missing or extra:
        raise InvalidArgumentError(
            "Expected params with the structure of grads. Received: "
            f"{len(wanted)} gradient leaves (not None) and {len(p_by_path)} parameter leaves"
            + (f"; no parameter at {missing[0] or 'the root'}" if missing else "")
            + (f"; no gradient at {extra[0] or 'the root'}" if extra and not missing else "")
        )
    return [None if g is None else p_by_path[path] for path, g in named]


def _under_any(path: str, prefixes: list[str]) -> bool:
    """``path`` is one of ``prefixes`` or below one (``.w[0]``: below ``''``, ``.w``; not
    ``.weight`` below ``.w``)."""
    return any(path == q or (path.startswith(q) and path[len(q)] in ".[") for q in prefixes)


def _distinct(axes: tuple, given: tuple | None = None) -> tuple:
    """Non-empty, repeat-free ``axes`` (``()`` meant elements or whole leaves per backend)."""
    if not axes or len(set(axes)) < len(axes):
        raise InvalidArgumentError(
            f"Expected axis to name one or more distinct axes. Received: axis={given or axes}"
        )
    return axes


def _unit_norm(be: Backend, x: Array, axes: tuple[int, ...] | None) -> Array:
    """sqrt(sum x**2) over ``axes`` (all when None), kept broadcastable against ``x``."""
    if axes is None:
        return be.sqrt(be.sum(x * x))
    return be.sqrt(be.sum(x * x, axis=axes, keepdims=True))


def adaptive_grad_clip(
    grads: Tree,
    params: Tree,
    clip_factor: float = 0.01,
    eps: float = 1e-3,
    *,
    layout: str = "io",
    axis: int | Sequence[int] | None = None,
    backend: str | None = None,
) -> Tree:
    """``AGC(clip_factor, eps, layout=layout, axis=axis).clip(grads, params)``."""
    return AGC(clip_factor, eps, layout=layout, axis=axis).clip(grads, params, backend=backend)


__all__ = ["AGC", "AGC_LAYOUTS", "adaptive_grad_clip"]
