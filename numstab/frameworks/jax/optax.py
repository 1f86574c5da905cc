"""Dynamic loss scaling and gradient clipping as an ``optax.GradientTransformation``.

    scaler = numstab.LossScaler.preset("jmp")             # or LossScaler() (torch defaults)
    tx = loss_scaled(optax.adam(1e-3), scaler, max_norm=1.0)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: scale_loss(loss_fn(p, batch), opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)   # grads are SCALED
        return optax.apply_updates(params, updates), opt_state

``update`` unscales the gradients (``LossScaler.unscale``), checks that they are finite, clips
the unscaled gradients by their global norm (``numstab.clip_by_global_norm``) when ``max_norm``
is given, and calls the inner transformation. On a non-finite step it returns zero updates and
leaves the inner state untouched (its step count too, so schedules freeze), as
``optax.apply_if_finite`` and Keras 3's ``LossScaleOptimizer`` do. The scale then follows
``LossScaler.update``: the state machine lives only in ``numstab.loss_scale``.

Everything is traced: ``jax.lax.cond`` picks the branch, nothing reads a value on the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from numstab import _validate as v
from numstab.clipping import clip_by_global_norm, global_norm
from numstab.errors import InvalidArgumentError
from numstab.frameworks.jax.eager import eager_jit
from numstab.frameworks.jax.sharding import pvary, varying
from numstab.frameworks.jax.tree_checks import check_matches, check_state_made_by
from numstab.loss_scale import LossScaler, LossScaleState

__all__ = [
    "LossScaledState",
    "current_scale",
    "find_loss_scale_state",
    "loss_scaled",
    "scale_loss",
]


class LossScaledState(NamedTuple):
    """State of :func:`loss_scaled`: a pytree whose leaves are all arrays.

    The scaler's configuration is not in here: it is static, closed over by the
    transformation, so it survives ``jit``, ``scan`` and checkpointing of this state.
    """

    inner_state: Any  # the inner transformation's state, untouched on non-finite steps
    loss_scale: LossScaleState  # scale, growth_tracker, hysteresis_left
    last_finite: jax.Array  # bool, 0-d: were the last step's unscaled gradients finite
    total_notfinite: jax.Array  # int32, 0-d: number of skipped steps since init
    grad_norm: jax.Array | None  # float32, 0-d: last pre-clip norm; None without max_norm


def loss_scaled(
    inner: optax.GradientTransformation,
    scaler: LossScaler | None = None,
    *,
    max_norm: float | None = None,
    norm_type: float | None = None,
    axis_name: Hashable | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wrap ``inner`` so that it receives unscaled, checked and (optionally) clipped gradients.

    Args:
      inner: the optimizer to protect, e.g. ``optax.adam(1e-3)``.
      scaler: the loss-scaling configuration; default ``LossScaler()`` (torch's defaults).
        ``LossScaler.preset("jmp")`` reproduces ``jmp.DynamicLossScale(2**15)``.
      max_norm: clip the unscaled gradients to this global norm (after unscaling, never on
        the scaled values); ``None`` does not clip.
      norm_type: the p of the global p-norm (``math.inf`` for the max-norm); None is 2.0.
        It picks the code, so it is static: with ``optax.inject_hyperparams`` (which makes
        numeric arguments arrays, hence the None default) pass it in ``static_args``.
      axis_name: a mapped axis (``shard_map``, ``pmap``, ``vmap``) over which the gradients
        are sharded, each device holding a disjoint slice (as after a reduce-scatter): the
        finite flag is AND-reduced (``lax.pmin``) and the norm is that of the whole tree
        (``lax.psum`` of the slices' ``|g|**p``; ``pmax`` for inf), so every device takes the
        same decision, and clips by the same factor, even when only one of them overflows.
        Leaves replicated on every device would be counted once per device in the norm:
        gradients that are already all-reduced need no ``axis_name`` (they agree anyway).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`LossScaledState`.
      ``update(grads, state, params=None, **extra_args)`` expects the gradients of the scaled
      loss (:func:`scale_loss`).

    ``optax.inject_hyperparams(loss_scaled)(inner, ...)``: ``max_norm`` is injected (while
    traced it clips by ``1 / max(norm / max_norm, 1)``, which is ``max_norm / max(norm,
    max_norm)`` to one rounding). Eager updates run as one cached ``jax.jit``.

    Edge cases: a non-finite global norm (elements beyond about 1e19 overflow a float32 sum of
    squares) counts as a non-finite step. With a fixed scaler (``dynamic=False``, e.g.
    ``LossScaler.for_dtype(jnp.bfloat16)``) non-finite steps are still skipped, without limit.
    """
    given = inner
    inner, scaler, max_norm, norm_type = _checked(inner, scaler, max_norm, norm_type, axis_name)

    def init(params: Any) -> LossScaledState:
        return LossScaledState(
            inner_state=inner.init(params),
            loss_scale=scaler.init(backend="jax"),
            last_finite=jnp.asarray(True),
            total_notfinite=jnp.zeros([], jnp.int32),
            grad_norm=None if max_norm is None else jnp.zeros([], jnp.float32),
        )

    # a traced max_norm (closed over, unseen by eager_jit's test of the arguments) is already
    # inside a trace; eagerly one compiled call, not a lax.cond compiled each time
    if isinstance(max_norm, jax.core.Tracer):
        eager_step = _step_fn(inner, scaler, max_norm, norm_type, axis_name)
    else:
        eager_step = _eager_step(given, inner, scaler, max_norm, norm_type, axis_name)

    def update(
        updates: Any, state: LossScaledState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, LossScaledState]:
        if not isinstance(state, LossScaledState):
            raise InvalidArgumentError(
                f"Expected the LossScaledState made by this transformation's init. Received: "
                f"{type(state).__name__}"
            )
        check_matches(updates, params)
        return eager_step(updates, state, params, extra_args)

    return optax.GradientTransformationExtraArgs(init, update)


def _eager_step(given, inner, scaler, max_norm, norm_type, axis_name) -> Callable[..., tuple]:
    """``_step_fn`` as one ``eager_jit``, kept per setting (``given``: the inner transformation
    as the caller passed it): ``optax.inject_hyperparams`` builds ``loss_scaled`` anew on every
    update, which compiled the step anew each time (an unhashable setting is not kept)."""
    key = (given, scaler, max_norm, norm_type, axis_name)
    try:
        step = _EAGER_STEPS.get(key)
    except TypeError:
        return eager_jit(_step_fn(inner, scaler, max_norm, norm_type, axis_name))
    if step is None:
        if len(_EAGER_STEPS) >= _EAGER_STEPS_KEPT:
            _EAGER_STEPS.pop(next(iter(_EAGER_STEPS)))  # the oldest
        step = _EAGER_STEPS[key] = eager_jit(
            _step_fn(inner, scaler, max_norm, norm_type, axis_name)
        )
    return step


_EAGER_STEPS: dict[tuple, Callable[..., tuple]] = {}
_EAGER_STEPS_KEPT = 64


def _step_fn(inner, scaler, max_norm, norm_type, axis_name) -> Callable[..., tuple]:
    """loss_scaled's traced update: ``step(updates, state, params, extra_args)``."""

    def step(updates: Any, state: LossScaledState, params: Any, extra_args: dict) -> tuple:
        grads, finite, norm = _unscaled_and_clipped(
            updates, scaler, state.loss_scale, max_norm, norm_type, axis_name
        )

        def apply(_: None) -> tuple[Any, Any]:
            return inner.update(grads, state.inner_state, params, **extra_args)

        try:
            out_shapes = jax.eval_shape(apply, None)
        except Exception as error:
            check_state_made_by(inner.init, grads, state.inner_state, "state.inner_state", error)
            raise

        def skip(_: None) -> tuple[Any, Any]:
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shapes[0])
            return zeros, state.inner_state

        apply, skip = _same_varying_axes(apply, skip)
        new_updates, inner_state = jax.lax.cond(finite, apply, skip, None)
        loss_scale = scaler.update(state.loss_scale, finite, backend="jax")
        return new_updates, LossScaledState(
            inner_state=inner_state,
            loss_scale=loss_scale,
            last_finite=finite,
            total_notfinite=state.total_notfinite + jnp.where(finite, 0, 1).astype(jnp.int32),
            # float32 as init made it: float64 gradients (x64) give a float64 norm, and a
            # leaf changing dtype breaks lax.scan and recompiles a jitted loop
            grad_norm=None if norm is None else norm.astype(state.grad_norm.dtype),
        )

    return step


def _checked(inner: Any, scaler: Any, max_norm: Any, norm_type: Any, axis_name: Any) -> tuple:
    """loss_scaled's arguments, checked: (inner with extra args, scaler, max_norm, norm_type)."""
    if not isinstance(inner, optax.GradientTransformation):
        raise InvalidArgumentError(
            f"Expected an optax.GradientTransformation as inner. Received: {type(inner).__name__}"
        )
    if scaler is None:
        scaler = LossScaler()
    elif not isinstance(scaler, LossScaler):
        raise InvalidArgumentError(
            f"Expected a numstab.LossScaler or None. Received: scaler of type "
            f"{type(scaler).__name__}"
        )
    if max_norm is not None:
        max_norm = v.check_number_or_traced("max_norm", max_norm, low=0.0, low_open=True)
    norm_type = 2.0 if norm_type is None else v.check_static("norm_type", norm_type)
    if norm_type != math.inf:
        norm_type = v.check_number("norm_type", norm_type, low=0.0, low_open=True)
    _check_axis_name(axis_name)
    return optax.with_extra_args_support(inner), scaler, max_norm, norm_type


def _check_axis_name(axis_name: Any) -> None:
    if axis_name is not None and not isinstance(axis_name, Hashable):
        raise InvalidArgumentError(f"Expected a hashable axis_name. Received: {axis_name!r}")


def _across(collective: Callable[..., Any], x: Any, axis_name: Hashable) -> Any:
    """``collective(x, axis_name)`` (``lax.psum``, ``pmin``, ``pmax``), with a typed error
    where no enclosing ``shard_map`` / ``pmap`` / ``vmap`` binds the axis (JAX's NameError)."""
    try:
        return collective(x, axis_name)
    except NameError as exc:
        raise InvalidArgumentError(
            f"Expected axis_name to name an axis of an enclosing shard_map, pmap or vmap (call "
            f"update inside it, or pass axis_name=None). Received: axis_name={axis_name!r}, "
            f"which no enclosing transformation binds"
        ) from exc


def _unscaled_and_clipped(updates, scaler, loss_scale, max_norm, norm_type, axis_name):
    """(gradients unscaled and, with max_norm, clipped; the step's finite flag, agreed over
    ``axis_name``; the global norm or None)."""
    grads, finite = scaler.unscale(updates, loss_scale, backend="jax")
    finite = jnp.asarray(finite)
    if axis_name is not None:
        finite = _across(jax.lax.pmin, finite.astype(jnp.int32), axis_name) > 0
    norm = None
    if max_norm is not None:
        norm = None if axis_name is None else _norm_across(grads, norm_type, axis_name)
        grads, norm = clip_by_global_norm(
            grads, max_norm, norm_type=norm_type, norm=norm, backend="jax"
        )
        finite = finite & jnp.isfinite(norm)
    return grads, finite, norm


def _same_varying_axes(*branches: Callable[[None], Any]) -> list[Callable[[None], Any]]:
    """The branches, each output leaf cast to vary over the union of the manual axes (shard_map)
    that the branches' leaves vary over: ``lax.cond`` needs equal types, and zeros or the
    untouched inner state may vary over fewer axes than the inner update's outputs."""
    shapes = [jax.eval_shape(branch, None) for branch in branches]
    union = jax.tree.map(lambda *avals: frozenset().union(*map(varying, avals)), *shapes)
    if not any(jax.tree.leaves(union, is_leaf=lambda x: isinstance(x, frozenset))):
        return list(branches)  # outside shard_map: nothing to cast

    def aligned(branch: Callable[[None], Any], avals: Any) -> Callable[[None], Any]:
        def run(_: None) -> Any:
            return jax.tree.map(
                lambda x, aval, axes: pvary(x, axes - varying(aval)), branch(None), avals, union
            )

        return run

    return [aligned(b, s) for b, s in zip(branches, shapes, strict=True)]


def _norm_across(grads: Any, norm_type: float, axis_name: Hashable) -> jax.Array:
    """The global norm of a tree of which each device holds part: the local norms combined
    over ``axis_name`` (clip_by_global_norm then applies the same factor everywhere)."""
    local = global_norm(grads, norm_type, backend="jax")
    if norm_type == math.inf:
        return _across(jax.lax.pmax, local, axis_name)
    if norm_type == 2.0:
        return jnp.sqrt(_across(jax.lax.psum, local * local, axis_name))
    if norm_type == 1.0:
        return _across(jax.lax.psum, local, axis_name)
    return _across(jax.lax.psum, local**norm_type, axis_name) ** (1.0 / norm_type)


def find_loss_scale_state(opt_state: Any) -> LossScaleState:
    """The ``LossScaleState`` inside ``opt_state``: a :class:`LossScaledState`, or any optax
    state holding exactly one (``optax.chain``, ``MultiSteps``, ``inject_hyperparams``).

    Its fields are arrays: under ``flax.nnx.Optimizer``, which wraps every leaf of the state
    in an ``nnx.OptArray``, the arrays those hold (no copy, no host sync)."""
    if isinstance(opt_state, LossScaledState):
        return _arrays(opt_state.loss_scale)
    if isinstance(opt_state, LossScaleState):
        return _arrays(opt_state)
    found = loss_scaled_states(opt_state)
    if len(found) != 1:
        raise InvalidArgumentError(
            f"Expected an optimizer state holding exactly one LossScaledState (from "
            f"numstab.integrations.optax.loss_scaled). Received: one holding {len(found)}"
        )
    return _arrays(found[0].loss_scale)


def _arrays(state: LossScaleState) -> LossScaleState:
    """``state`` with each field that is a Flax NNX ``Variable`` (``nnx.Optimizer``'s
    ``OptArray``) replaced by the array it holds; other fields as they are."""
    import sys

    if "flax.nnx" not in sys.modules:  # no Variable can exist: flax is never imported here
        return state
    variable = sys.modules["flax.nnx"].Variable
    if not any(isinstance(x, variable) for x in state):
        return state
    return LossScaleState(*(x[...] if isinstance(x, variable) else x for x in state))


def loss_scaled_states(opt_state: Any) -> list[LossScaledState]:
    """Every :class:`LossScaledState` node of ``opt_state`` (a static walk of its tree)."""
    is_scaled = lambda x: isinstance(x, LossScaledState)
    return [n for n in jax.tree.leaves(opt_state, is_leaf=is_scaled) if is_scaled(n)]


def current_scale(opt_state: Any) -> jax.Array:
    """The current loss scale (float32, 0-d array; no host sync) of ``opt_state``."""
    return find_loss_scale_state(opt_state).scale


# LossScaler.scale reads only the state, never the configuration
_ANY_SCALER = LossScaler()


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
    """``loss * current_scale(opt_state)``, multiplied in float32, in the loss's dtype.

    Differentiate this scaled loss and pass its gradients to ``update``.
    """
    return _ANY_SCALER.scale(loss, find_loss_scale_state(opt_state), backend="jax")


# -- adaptive clipping (ZClip, AGC) --------------------------------------------------------------
def zclip(
    alpha: float = 0.97,
    z_thresh: float = 2.5,
    max_grad_norm: float | None = 1.0,
    eps: float = 1e-6,
    warmup_steps: int = 25,
    mode: str = "zscore",
    clip_option: str = "adaptive_scaling",
    clip_factor: float = 1.0,
    skip_update_on_spike: bool = False,
    *,
    axis_name: Hashable | None = None,
) -> optax.GradientTransformation:
    """``numstab.adaptive_clipping.ZClip`` (same arguments and defaults) as a
    GradientTransformation; its state is a ``ZClipState`` (``state.norm``: the last raw
    global norm). Chain it before the optimizer: ``optax.chain(zclip(), optax.adamw(lr))``.

    ``axis_name``: as ``loss_scaled``'s, a mapped axis (``shard_map``) over which each device
    holds a disjoint slice of the gradients: the norm is that of the whole tree (``lax.psum``
    of the slices' squared norms), so every device clips by the same factor and keeps the
    same statistics. Without it, inside ``shard_map`` each device would use its own slice's.

    ``optax.inject_hyperparams(zclip)(...)``: ``alpha``, ``z_thresh``, ``max_grad_norm``,
    ``eps`` and ``clip_factor`` are injected (``state.hyperparams`` changes them).
    ``warmup_steps`` sets the state's buffer shape at ``init``: while traced, ``update`` takes
    it from that buffer (``max(warmup_steps, 1)``); a changed readable value raises."""
    from numstab.adaptive_clipping import ZClip

    settings = {
        "alpha": alpha,
        "z_thresh": z_thresh,
        "max_grad_norm": max_grad_norm,
        "eps": eps,
        "mode": mode,
        "clip_option": clip_option,
        "clip_factor": clip_factor,
        "skip_update_on_spike": skip_update_on_spike,
    }
    traced = v.host_scalar(warmup_steps) is v.TRACED
    policy = None if traced else ZClip(warmup_steps=warmup_steps, **settings)
    _check_axis_name(axis_name)

    def init_fn(params: Any) -> Any:
        return (policy or ZClip(warmup_steps=warmup_steps, **settings)).init(params, backend="jax")

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        _check_zclip_state(state, policy)
        # traced (inject_hyperparams under jit): the buffer holds max(warmup_steps, 1) norms
        own = policy or ZClip(warmup_steps=jnp.shape(state.buffer)[0], **settings)
        norm = None if axis_name is None else _norm_across(updates, 2.0, axis_name)
        return own.update(updates, state, norm=norm, backend="jax")

    return optax.GradientTransformation(init_fn, update_fn)


def _check_zclip_state(state: Any, policy: Any) -> None:
    """InvalidArgumentError unless ``state`` is a ZClipState whose buffer fits ``policy``
    (None: warmup_steps traced, any buffer): warmup_steps cannot change after init."""
    from numstab.adaptive_clipping import ZClipState

    if not isinstance(state, ZClipState):
        raise InvalidArgumentError(
            f"Expected the ZClipState made by this transformation's init. Received: "
            f"{type(state).__name__}"
        )
    size = jnp.shape(state.buffer)
    if policy is not None and size != (policy.buffer_size,):
        raise InvalidArgumentError(
            f"Expected a ZClipState made with warmup_steps={policy.warmup_steps} (a buffer of "
            f"{policy.buffer_size}): warmup_steps sets its shape, so it cannot change after "
            f"init. Received: a state with a buffer of shape {size}"
        )


def agc(
    clip_factor: float = 0.01, eps: float = 1e-3, *, layout: str = "io", axis: Any = None
) -> optax.GradientTransformation:
    """``numstab.agc.AGC`` as a GradientTransformation: the values of
    ``optax.adaptive_grad_clip(clip_factor, eps)`` (16-bit gradients normed in float32).

    ``optax.inject_hyperparams(agc)(...)``: ``clip_factor`` and ``eps`` are injected;
    ``axis`` picks the units and must be in ``static_args`` when given as an int."""
    from numstab.agc import AGC

    policy = AGC(clip_factor, eps, layout=layout, axis=axis)

    def init_fn(params: Any) -> optax.EmptyState:
        return optax.EmptyState()

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        if params is None:
            raise InvalidArgumentError(
                "Expected params for AGC (its limit is relative to the parameter norms). "
                "Received: params=None"
            )
        return policy.clip(updates, params, backend="jax"), state

    return optax.GradientTransformation(init_fn, update_fn)
