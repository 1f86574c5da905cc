"""PyTorch integration: a drop-in ``torch.amp.GradScaler`` whose update is ``numstab.LossScaler``.

    scaler = GradScaler()                       # or GradScaler(scaler=LossScaler(...))
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x)
    scaler.scale(loss).backward()
    if scaler.step_and_update(optimizer, max_norm=1.0):   # unscale, check, clip, step, update
        lr_scheduler.step()                     # only on applied steps

The torch-compatible calls (``scale``, ``unscale_``, ``step``, ``update``, ``get_scale``,
``state_dict``, ...) keep torch's order rules and results: with the default settings the scale,
the skipped steps and the parameters follow ``torch.amp.GradScaler`` exactly. Misuse (a second
``unscale_``, float16 gradients, ``step`` before ``scale``) raises
``numstab.InvalidArgumentError`` (a ``ValueError``) and changes nothing.

Host syncs: ``scale``, ``unscale_``, ``clip_grad_norm_`` and ``update`` issue no host sync.
``step`` reads one flag on the host to decide whether to call ``optimizer.step()`` (as torch
does), except for optimizers that skip by themselves (``fused=True`` Adam/AdamW/SGD/Adagrad),
which receive the flag as a tensor. ``step_and_update`` returns a Python bool: one sync.
``get_scale`` and ``state_dict`` read values on the host.

Distributed (``distributed.py``): when ``torch.distributed`` is initialized (or
``process_group`` is given), the non-finite flag is all-reduced with MAX before anything
depends on it, so every rank skips and backs off together. With ``sharded=True`` (FSDP-style
disjoint local parameters) ``clip_grad_norm_`` all-reduces ``sum |g|**p`` too, in the same
collective. Every rank must make the same calls in the same order.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import torch

from numstab import _validate as v
from numstab.clipping import clip_coefficient, global_norm
from numstab.errors import InvalidArgumentError
from numstab.frameworks.torch import scale_update
from numstab.frameworks.torch.clipping import dense_grads, max_norm_of, norm_type_of, scale_groups_
from numstab.frameworks.torch.distributed import (
    OptimizerState,
    Stage,
    reduce_norm,
    reduced_found_inf,
    reduction_group,
)
from numstab.frameworks.torch.grad_scaler_state import (
    Lazy,
    loss_scaler_from,
    numstab_state_dict,
    torch_state_dict,
)
from numstab.frameworks.torch.unscale import (
    check_and_unscale,
    check_new_scale,
    no_inf_checks_error,
    settle_sentinels,
)
from numstab.loss_scale import LossScaler, LossScaleState

__all__ = ["GradScaler"]

T = TypeVar("T")


class GradScaler:
    """Drop-in for ``torch.amp.GradScaler``; the scale update is ``numstab.LossScaler.update``.

    Positional arguments follow ``torch.amp.GradScaler(device, init_scale, growth_factor,
    backoff_factor, growth_interval, enabled)``; unset values take ``LossScaler``'s defaults,
    which are torch's. ``device`` only matters for ``"cuda"`` without CUDA, which disables the
    scaler with a warning, as in torch; the state lives on the device of the first scaled
    loss. ``hysteresis``, ``min_scale`` and ``max_scale`` are ``LossScaler``'s; or pass a whole
    ``scaler=LossScaler(...)`` (e.g. ``LossScaler.preset("deepspeed")``) instead of any of
    them. ``enabled=False`` makes every method a pass-through, as in torch (no finite checks:
    for bfloat16 use ``scaler=LossScaler.for_dtype(torch.bfloat16)``, a fixed scale of 1 that
    still skips non-finite steps).
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float | None = None,
        growth_factor: float | None = None,
        backoff_factor: float | None = None,
        growth_interval: int | None = None,
        enabled: bool = True,
        *,
        hysteresis: int | None = None,
        min_scale: float | None = None,
        max_scale: float | None = None,
        scaler: LossScaler | None = None,
        process_group: Any = None,
        sharded: bool = False,
    ) -> None:
        settings = {
            "init_scale": init_scale,
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": growth_interval,
            "hysteresis": hysteresis,
            "min_scale": min_scale,
            "max_scale": max_scale,
        }
        self._scaler: LossScaler = loss_scaler_from(scaler, settings)
        v.check_bool("enabled", enabled)
        v.check_bool("sharded", sharded)
        self._device = device
        self._enabled = enabled
        if enabled and device == "cuda" and not torch.cuda.is_available():
            warnings.warn(
                "numstab GradScaler(device='cuda') is enabled, but CUDA is not available. "
                "Disabling.",
                stacklevel=2,
            )
            self._enabled = False
        self._process_group = process_group
        self._sharded = sharded
        self._state: LossScaleState | None = None  # created by the first scale()
        self._pending: dict[str, Any] | None = None  # a loaded state dict awaiting scale()
        self._opt_states: dict[int, OptimizerState] = {}
        self._last_grad_norm: torch.Tensor | None = None

    # -- introspection -----------------------------------------------------------------------
    @property
    def loss_scaler(self) -> LossScaler:
        """The immutable configuration (the single home of the update rule)."""
        return self._scaler

    @property
    def state(self) -> LossScaleState | None:
        """The current (scale, growth_tracker, hysteresis_left) 0-d tensors; None before the
        first ``scale``. Replaced (not mutated) by every ``update``."""
        return self._state

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm (0-d tensor, unscaled, before clipping; across ranks when
        ``sharded``) of the last ``clip_grad_norm_`` / ``step_and_update(max_norm=...)``;
        None if none ran. Non-finite on overflow steps."""
        return self._last_grad_norm

    def is_enabled(self) -> bool:
        """Whether scaling is enabled (False: every method is a pass-through)."""
        return self._enabled

    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync); 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        if self._state is None:
            return float(self._host_values()["scale"])
        return float(self._state.scale.item())

    def get_growth_factor(self) -> float:
        """``loss_scaler.growth_factor``."""
        return self._scaler.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Replace ``growth_factor`` in the (immutable) config; validated like ``LossScaler``."""
        self._scaler = dataclasses.replace(self._scaler, growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """``loss_scaler.backoff_factor``."""
        return self._scaler.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Replace ``backoff_factor`` in the (immutable) config; validated like ``LossScaler``."""
        self._scaler = dataclasses.replace(self._scaler, backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """``loss_scaler.growth_interval``."""
        return self._scaler.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Replace ``growth_interval`` in the (immutable) config; validated like ``LossScaler``."""
        self._scaler = dataclasses.replace(self._scaler, growth_interval=new_interval)

    # -- the torch.amp.GradScaler protocol ---------------------------------------------------
    def scale(self, outputs: T) -> T:
        """``outputs * scale`` for a tensor or a (nested) list/tuple/iterable of tensors; the
        first call creates the state on the device of the first tensor. Floating only."""
        if not self._enabled:
            return outputs
        per_device: dict[torch.device, LossScaleState] = {}

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                state = self._lazy_state(value)
                local = per_device.get(value.device)
                if local is None:
                    scale = state.scale.to(value.device, non_blocking=True)
                    local = per_device[value.device] = state._replace(scale=scale)
                if value.dim() == 0 and value.dtype in (torch.float16, torch.bfloat16):
                    value = value.float()  # as torch.amp's: a 0-d loss * float32 scale
                return self._scaler.scale(value, local, backend="torch")
            if isinstance(value, (list, tuple)):
                return type(value)(map(apply, value))
            if isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping)):
                return map(apply, value)
            raise InvalidArgumentError(
                f"Expected outputs to be a tensor or an iterable of tensors. Received: {value!r}"
            )

        return apply(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Multiply the optimizer's gradients by ``1 / scale`` in place and record whether any
        was non-finite (torch's fused kernel, one launch per device and dtype; no host sync).

        Once per optimizer between ``update`` calls; a second call, float16 or integer
        gradients raise InvalidArgumentError and change nothing. The check looks at the
        gradients before unscaling (torch's kernel), so an unscale that overflows (scale < 1)
        is not flagged; ``clip_grad_norm_`` and ``step_and_update(max_norm=...)`` catch it
        through the non-finite norm.
        """
        if self._enabled:
            self._unscale(optimizer)

    def _unscale(self, optimizer: torch.optim.Optimizer, dense: dict | None = None) -> None:
        state = self._require_state("unscale_")
        opt_state = self._opt_states.get(id(optimizer)) or OptimizerState()
        if opt_state.stage is Stage.UNSCALED:
            raise InvalidArgumentError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if opt_state.stage is Stage.STEPPED:
            raise InvalidArgumentError("unscale_() is being called after step().")
        # The float64 reciprocal rounded to float32 is the correctly rounded 1/scale (53 >=
        # 2*24+2 bits), i.e. LossScaler.unscale's 1.0 / scale, whatever the compiler does.
        inv_scale = state.scale.double().reciprocal().float()
        found = check_and_unscale(optimizer, inv_scale, state.scale.device, False, dense)
        if found is None:  # no gradient: nothing recorded (step() raises, as torch's asserts)
            return
        settle_sentinels(optimizer, found, state.scale, self._scaler.scale_bounds[0])
        opt_state.found_inf = found
        opt_state.reduced = False
        opt_state.stage = Stage.UNSCALED
        self._opt_states[id(optimizer)] = opt_state

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``unscale_`` (unless done) then ``optimizer.step(*args, **kwargs)`` if every gradient
        was finite (on every rank); returns its result, or None when skipped.

        Reads one flag on the host (a sync), except for optimizers with
        ``_step_supports_amp_scaling`` (fused Adam/AdamW/SGD/Adagrad): they get
        ``optimizer.grad_scale`` and ``optimizer.found_inf`` and skip inside the kernel, and
        their result is returned either way, as in torch. Closures are not supported.
        """
        return self._step(optimizer, args, kwargs)[0]

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """The next scale: ``LossScaler.update`` with "finite" = no optimizer stepped since the
        last update saw a non-finite gradient (on any rank). No host sync.

        ``new_scale`` (a positive number, or a 1-element floating tensor without grad) sets
        the scale instead; growth tracker and hysteresis are kept, as in torch. Either way the
        per-optimizer records are cleared for the next iteration.
        """
        if not self._enabled:
            return
        state = self._require_state("update")
        if new_scale is not None:
            scale = check_new_scale(new_scale, state.scale.device)
            self._state = state._replace(scale=scale)
        else:
            recorded = [s for s in self._opt_states.values() if s.found_inf is not None]
            if not recorded:
                raise InvalidArgumentError(
                    "No inf checks were recorded prior to update(): call step(optimizer) "
                    "(or unscale_) after backward() first."
                )
            found = reduced_found_inf(recorded[0], self._group())
            for opt_state in recorded[1:]:
                found = found + reduced_found_inf(opt_state, self._group()).to(found.device)
            self._state = scale_update.update(self._scaler, state, found)
        self._opt_states = {}

    def state_dict(self) -> dict[str, Any]:
        """torch's five entries (so ``torch.amp.GradScaler.load_state_dict`` accepts it) plus
        ``"numstab"``: ``LossScaler.state_dict`` (every config and state field). Plain Python
        values (loadable with ``torch.load(weights_only=True)``); a host sync. Empty when
        disabled, as in torch."""
        if not self._enabled:
            return {}
        if self._state is None:
            _, state = LossScaler.from_state_dict(self._pending_dict(), backend="torch")
        else:
            state = self._state
        return torch_state_dict(self._scaler, self._scaler.state_dict(state, backend="torch"))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load ``state_dict()`` of this class or of ``torch.amp.GradScaler`` (whose missing
        fields keep this scaler's config; hysteresis restarts full). Validated before anything
        changes; a no-op when disabled, as in torch."""
        if not self._enabled:
            return
        data = numstab_state_dict(self._scaler, state_dict)
        like = None if self._state is None else self._state.scale
        scaler, state = LossScaler.from_state_dict(data, backend="torch", like=like)
        self._scaler = scaler
        if self._state is None:
            self._pending = scaler.state_dict(state, backend="torch")
        else:
            self._state = state

    # -- numstab additions -------------------------------------------------------------------
    def clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float | str = 2.0
    ) -> torch.Tensor:
        """Unscale (unless done), then scale the optimizer's gradients in place by
        ``max_norm / max(norm, max_norm)``, like ``numstab.clip_by_global_norm``: no epsilon,
        exactly unchanged when ``norm <= max_norm``, untouched when the step will be skipped
        (non-finite norm, or a non-finite gradient on any rank). Returns the global norm
        (0-d tensor, float32 at least; across ranks when ``sharded``). No host sync."""
        max_norm = max_norm_of(max_norm)
        norm_type = norm_type_of(norm_type)
        grads = dense_grads(optimizer)  # checked before anything changes
        opt_state = None
        if self._enabled:
            self._require_state("clip_grad_norm_")
            opt_state = self._opt_states.get(id(optimizer))
            if opt_state is not None and opt_state.stage is Stage.STEPPED:
                raise InvalidArgumentError("clip_grad_norm_() is being called after step().")
            if opt_state is None or opt_state.stage is Stage.READY:
                self._unscale(optimizer, grads)  # grouped once, for both
                opt_state = self._opt_states.get(id(optimizer))  # None: no gradient
        norm = global_norm([g for gs in grads.values() for g in gs], norm_type, backend="torch")
        group = self._group()
        norm, found = reduce_norm(norm, float(norm_type), opt_state, group, self._sharded)
        # In place (optimizers and DDP buckets hold views of these gradients), with the
        # coefficient numstab.clip_by_global_norm uses: max_norm / max(norm, max_norm), or 1
        # for a non-finite norm. In one process a gradient found non-finite makes the norm
        # non-finite; across ranks the flag may come from another rank.
        coef = clip_coefficient(norm, max_norm, backend="torch")
        if found is not None and group is not None:
            coef = torch.where(found.to(norm.device) == 0, coef, 1.0)
        scale_groups_(grads, coef)
        self._last_grad_norm = norm
        return norm

    def step_and_update(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None = None,
        *,
        norm_type: float = 2.0,
    ) -> bool:
        """The whole AMP step in the right order: unscale (unless done) -> finite check (all
        ranks) -> ``clip_grad_norm_`` on the unscaled gradients when ``max_norm`` is given ->
        ``optimizer.step()`` only if finite -> ``update``.

        Returns whether the optimizer step was applied, as a Python bool (one host sync, like
        torch's ``step``): step the LR scheduler only when True. With clipping, a non-finite
        unscaled norm also skips (and backs off). For one optimizer; with several, call
        ``clip_grad_norm_`` / ``step`` per optimizer, then ``update`` once. When disabled:
        clip and step, and return True.
        """
        if max_norm is not None:
            self.clip_grad_norm_(optimizer, max_norm, norm_type)
        if not self._enabled:
            optimizer.step()
            return True
        _, applied = self._step(optimizer, (), {})
        self.update()
        return bool(applied)

    # -- internals ---------------------------------------------------------------------------
    def _step(
        self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict
    ) -> tuple[Any, bool | Lazy]:
        if not self._enabled:
            return optimizer.step(*args, **kwargs), True
        if "closure" in kwargs:
            raise InvalidArgumentError("Closure use is not supported if GradScaler is enabled.")
        state = self._require_state("step")
        opt_state = self._opt_states.get(id(optimizer)) or OptimizerState()
        if opt_state.stage is Stage.STEPPED:
            raise InvalidArgumentError("step() has already been called since the last update().")
        ready = opt_state.stage is Stage.READY
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # the optimizer unscales and skips inside its kernel: no host sync
            if ready:  # a new record, stored below
                ones = torch.ones((), dtype=torch.float32, device=state.scale.device)
                found = check_and_unscale(optimizer, ones, state.scale.device, True)
                if found is None:  # no gradient since scale(): nothing changed
                    raise no_inf_checks_error(optimizer)
                settle_sentinels(optimizer, found, state.scale, self._scaler.scale_bounds[0])
                opt_state.found_inf, opt_state.reduced = found, False
                grad_scale = state.scale * getattr(optimizer, "grad_scale", 1)
            else:
                grad_scale = getattr(optimizer, "grad_scale", None)
            self._opt_states[id(optimizer)] = opt_state
            found = reduced_found_inf(opt_state, self._group())
            optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
            optimizer.found_inf = found  # type: ignore[attr-defined]
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
            opt_state.stage = Stage.STEPPED
            return retval, Lazy(found)
        if ready:
            self.unscale_(optimizer)
            opt_state = self._opt_states.get(id(optimizer))
        if opt_state is None:  # no gradient since scale(): torch asserts, nothing changed
            raise no_inf_checks_error(optimizer)
        applied = not bool(reduced_found_inf(opt_state, self._group()).item())  # the host sync
        retval = optimizer.step(*args, **kwargs) if applied else None
        opt_state.stage = Stage.STEPPED
        return retval, applied

    def _require_state(self, name: str) -> LossScaleState:
        if self._state is None:
            raise InvalidArgumentError(
                f"{name}() was called before scale(): the scale is created by the first "
                "scaler.scale(loss) of the iteration."
            )
        return self._state

    def _lazy_state(self, like: torch.Tensor) -> LossScaleState:
        if self._state is None:
            if self._pending is None:
                self._state = self._scaler.init(backend="torch", like=like)
            else:
                _, self._state = LossScaler.from_state_dict(
                    self._pending, backend="torch", like=like
                )
            self._pending = None
        return self._state

    def _pending_dict(self) -> dict[str, Any]:
        """The state dict the first ``scale`` will materialise (loaded, or a fresh init)."""
        if self._pending is not None:
            return self._pending
        return self._scaler.state_dict(self._scaler.init(backend="torch"), backend="torch")

    def _host_values(self) -> dict[str, Any]:
        return self._pending_dict()["state"]

    def _group(self) -> Any:
        return reduction_group(self._process_group)
