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

Distributed: when ``torch.distributed`` is initialized (or ``process_group`` is given), the
non-finite flag is all-reduced with MAX before anything depends on it, so every rank skips and
backs off together even when only one rank overflowed. With ``sharded=True`` (each rank holds
a disjoint part of the parameters, FSDP-style, as plain local tensors), ``clip_grad_norm_``
all-reduces the per-rank ``sum |g|**p`` (``max |g|`` for p = inf), so every rank clips by the
true global norm. Both travel in one collective per step. Every rank must make the same calls
in the same order; a scaler used by only some ranks of an initialized group would hang (pass a
process group holding just those ranks).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from numstab import _validate as v
from numstab.clipping import _check_norm_type, clip_coefficient, global_norm
from numstab.errors import InvalidArgumentError, NonFiniteError
from numstab.frameworks.torch.backend import BACKEND as TORCH
from numstab.frameworks.torch.backend import is_dtensor
from numstab.loss_scale import LossScaler, LossScaleState

__all__ = ["GradScaler", "clip_grad_norm_"]

T = TypeVar("T")


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


class _OptimizerState:
    """Per optimizer and iteration: its stage and its non-finite flag (0-d float32)."""

    __slots__ = ("found_inf", "reduced", "stage")

    def __init__(self) -> None:
        self.stage = _Stage.READY
        self.found_inf: torch.Tensor | None = None  # on the scale's device
        self.reduced = False  # True once all-reduced across ranks (or nothing to reduce)


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
        settings = {k: val for k, val in settings.items() if val is not None}
        if scaler is not None:
            if not isinstance(scaler, LossScaler):
                raise InvalidArgumentError(
                    f"Expected scaler to be a numstab.LossScaler. Received: scaler={scaler!r}"
                )
            if settings:
                raise InvalidArgumentError(
                    "Expected either scaler= or individual settings, not both. Received: "
                    f"scaler={scaler!r} and {', '.join(sorted(settings))}"
                )
        if not isinstance(enabled, bool) or not isinstance(sharded, bool):
            raise InvalidArgumentError(
                f"Expected enabled and sharded to be bools. Received: enabled={enabled!r}, "
                f"sharded={sharded!r}"
            )
        self._scaler: LossScaler = scaler if scaler is not None else LossScaler(**settings)
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
        self._opt_states: dict[int, _OptimizerState] = {}
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
        if not self._enabled:
            return
        state = self._require_state("unscale_")
        opt_state = self._opt_states.get(id(optimizer)) or _OptimizerState()
        if opt_state.stage is _Stage.UNSCALED:
            raise InvalidArgumentError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if opt_state.stage is _Stage.STEPPED:
            raise InvalidArgumentError("unscale_() is being called after step().")
        # The float64 reciprocal rounded to float32 is the correctly rounded 1/scale (53 >=
        # 2*24+2 bits), i.e. LossScaler.unscale's 1.0 / scale, whatever the compiler does.
        inv_scale = state.scale.double().reciprocal().float()
        opt_state.found_inf = self._check_and_unscale(optimizer, inv_scale, allow_fp16=False)
        opt_state.reduced = False
        opt_state.stage = _Stage.UNSCALED
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
            scale = self._check_new_scale(new_scale, state.scale.device)
            self._state = state._replace(scale=scale)
        else:
            recorded = [s for s in self._opt_states.values() if s.found_inf is not None]
            if not recorded:
                raise InvalidArgumentError(
                    "No inf checks were recorded prior to update(): call step(optimizer) "
                    "(or unscale_) after backward() first."
                )
            found = self._reduced_found_inf(recorded[0])
            for opt_state in recorded[1:]:
                found = found + self._reduced_found_inf(opt_state).to(found.device)
            self._state = self._scaler.update(state, found == 0, backend="torch")
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
        data = self._scaler.state_dict(state, backend="torch")
        values = data["state"]
        return {
            "scale": float(values["scale"]),
            "growth_factor": self._scaler.growth_factor,
            "backoff_factor": self._scaler.backoff_factor,
            "growth_interval": self._scaler.growth_interval,
            "_growth_tracker": int(values["growth_tracker"]),
            "numstab": data,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load ``state_dict()`` of this class or of ``torch.amp.GradScaler`` (whose missing
        fields keep this scaler's config; hysteresis restarts full). Validated before anything
        changes; a no-op when disabled, as in torch."""
        if not self._enabled:
            return
        if not isinstance(state_dict, Mapping) or len(state_dict) == 0:
            raise InvalidArgumentError(
                "Expected a non-empty GradScaler state dict (an empty one comes from a disabled "
                f"scaler). Received: {state_dict!r}"
            )
        if "numstab" in state_dict:
            data = state_dict["numstab"]
        else:
            try:
                config = dataclasses.asdict(self._scaler)
                config.update(
                    growth_factor=state_dict["growth_factor"],
                    backoff_factor=state_dict["backoff_factor"],
                    growth_interval=state_dict["growth_interval"],
                )
                values = {
                    "scale": state_dict["scale"],
                    "growth_tracker": state_dict["_growth_tracker"],
                    "hysteresis_left": config["hysteresis"],
                }
            except KeyError as exc:
                raise InvalidArgumentError(f"Not a GradScaler state dict: missing {exc}") from exc
            data = {"config": config, "state": values}
        like = None if self._state is None else self._state.scale
        scaler, state = LossScaler.from_state_dict(data, backend="torch", like=like)
        self._scaler = scaler
        if self._state is None:
            self._pending = {"config": dataclasses.asdict(scaler), "state": _host(state)}
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
        max_norm = v.check_number("max_norm", max_norm, low=0.0, low_open=True)
        norm_type = _norm_type(norm_type)
        grads = _dense_grads(optimizer)  # checked before anything changes
        opt_state = None
        if self._enabled:
            self._require_state("clip_grad_norm_")
            opt_state = self._opt_states.get(id(optimizer))
            if opt_state is not None and opt_state.stage is _Stage.STEPPED:
                raise InvalidArgumentError("clip_grad_norm_() is being called after step().")
            if opt_state is None or opt_state.stage is _Stage.READY:
                self.unscale_(optimizer)
                opt_state = self._opt_states[id(optimizer)]
        norm = global_norm([g for gs in grads.values() for g in gs], norm_type, backend="torch")
        norm, found = self._reduce_norm(norm, float(norm_type), opt_state)
        # In place (optimizers and DDP buckets hold views of these gradients), with the
        # coefficient numstab.clip_by_global_norm uses: max_norm / max(norm, max_norm), or 1.
        coef = clip_coefficient(norm, max_norm, backend="torch")
        if found is not None:
            coef = torch.where(found.to(norm.device) == 0, coef, 1.0)
        _mul_(grads, coef)
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
    ) -> tuple[Any, bool | _Lazy]:
        if not self._enabled:
            return optimizer.step(*args, **kwargs), True
        if "closure" in kwargs:
            raise InvalidArgumentError("Closure use is not supported if GradScaler is enabled.")
        state = self._require_state("step")
        opt_state = self._opt_states.get(id(optimizer)) or _OptimizerState()
        if opt_state.stage is _Stage.STEPPED:
            raise InvalidArgumentError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # the optimizer unscales and skips inside its kernel: no host sync
            if opt_state.stage is _Stage.READY:
                ones = torch.ones((), dtype=torch.float32, device=state.scale.device)
                opt_state.found_inf = self._check_and_unscale(optimizer, ones, allow_fp16=True)
                opt_state.reduced = False
                grad_scale = state.scale * getattr(optimizer, "grad_scale", 1)
            else:
                grad_scale = getattr(optimizer, "grad_scale", None)
            self._opt_states[id(optimizer)] = opt_state
            found = self._reduced_found_inf(opt_state)
            optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
            optimizer.found_inf = found  # type: ignore[attr-defined]
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
            opt_state.stage = _Stage.STEPPED
            return retval, _Lazy(found)
        if opt_state.stage is _Stage.READY:
            self.unscale_(optimizer)
            opt_state = self._opt_states[id(optimizer)]
        applied = not bool(self._reduced_found_inf(opt_state).item())  # the host sync
        retval = optimizer.step(*args, **kwargs) if applied else None
        opt_state.stage = _Stage.STEPPED
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

    def _reduced_found_inf(self, opt_state: _OptimizerState) -> torch.Tensor:
        found = opt_state.found_inf
        assert found is not None
        if not opt_state.reduced:
            group = self._group()
            if group is not None:
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
            opt_state.reduced = True
        return found

    def _reduce_norm(
        self, norm: torch.Tensor, norm_type: float, opt_state: _OptimizerState | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(global norm, global non-finite flag or None when disabled), in one collective.
        The norm of DTensor gradients (FSDP2) is global already: it is read as replicated."""
        group = self._group()
        found = None if opt_state is None else opt_state.found_inf
        sharded = self._sharded
        if is_dtensor(norm):
            norm, sharded = norm.full_tensor(), False
        if group is None or not sharded:
            if opt_state is not None and not opt_state.reduced:
                # a non-finite unscaled norm (scale < 1 overflow) skips too, on every rank
                assert found is not None
                opt_state.found_inf = torch.maximum(found, (~torch.isfinite(norm)).to(found))
                found = self._reduced_found_inf(opt_state)
            return norm, found
        # sharded: one SUM of [sum |g|**p, flag] (MAX of [max |g|, flag] for p = inf)
        device = norm.device if found is None else found.device
        flag = torch.zeros((), device=device) if found is None else found
        if norm_type == math.inf:
            # MAX may drop a NaN (gloo's max is order-dependent): report it as inf
            local = torch.where(torch.isnan(norm), math.inf, norm)
            packed = torch.stack([local.to(device), flag.to(local.dtype)])
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
            norm = packed[0]
        else:
            packed = torch.stack([norm.to(device) ** norm_type, flag.to(norm.dtype)])
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
            norm = packed[0] ** (1.0 / norm_type) if norm_type != 1.0 else packed[0]
        if opt_state is not None:
            opt_state.found_inf = (packed[1] != 0).to(torch.float32)
            opt_state.reduced = True
            found = opt_state.found_inf
        return norm, found

    def _check_and_unscale(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, allow_fp16: bool
    ) -> torch.Tensor:
        """Validate every gradient, then run torch's fused check-and-unscale once per device
        and dtype; one flag on the scale's device, 0.0 or exactly 1.0 (fused optimizers test
        ``found_inf == 1``)."""
        assert self._state is not None
        allowed = _UNSCALE_DTYPES_FP16 if allow_fp16 else _UNSCALE_DTYPES
        groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
        sparse = []
        for group in optimizer.param_groups:  # validate all before changing anything
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.dtype not in allowed:
                    _raise_bad_grad(optimizer, allowed)
                if grad.is_sparse:
                    sparse.append(param)
                else:
                    groups.setdefault(grad.device, {}).setdefault(grad.dtype, []).append(grad)
        with torch.no_grad():
            for param in sparse:
                # check the coalesced values: duplicates summed may overflow float16
                if param.grad.dtype == torch.float16:
                    param.grad = param.grad.coalesce()
                values = param.grad._values()
                groups.setdefault(values.device, {}).setdefault(values.dtype, []).append(values)
            home = self._state.scale.device
            found_total = None
            for device, per_dtype in groups.items():
                found = torch.zeros((), dtype=torch.float32, device=device)
                inv = inv_scale.to(device, non_blocking=True)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
                found = found.to(home, non_blocking=True)
                found_total = found if found_total is None else torch.maximum(found_total, found)
        if found_total is None:  # no gradients at all: nothing can be non-finite
            found_total = torch.zeros((), dtype=torch.float32, device=home)
        return found_total

    @staticmethod
    def _check_new_scale(new_scale: Any, device: torch.device) -> torch.Tensor:
        if isinstance(new_scale, torch.Tensor):
            if (
                new_scale.numel() != 1
                or new_scale.requires_grad
                or not new_scale.is_floating_point()
            ):
                raise InvalidArgumentError(
                    "Expected new_scale to be a positive float or a 1-element floating tensor "
                    f"without grad. Received: {new_scale!r}"
                )
            return new_scale.detach().reshape(()).to(device, torch.float32, copy=True)
        value = v.check_number("new_scale", new_scale, low=0.0, low_open=True)
        return torch.full((), value, dtype=torch.float32, device=device)


def reduction_group(process_group: Any = None) -> Any:
    """The process group to reduce over: ``process_group``, else the default group when
    ``torch.distributed`` is initialized; None for a single process (world size 1)."""
    group = process_group
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


class _Lazy:
    """A step's "applied" flag read on the host only when converted to bool."""

    __slots__ = ("found",)

    def __init__(self, found: torch.Tensor) -> None:
        self.found = found

    def __bool__(self) -> bool:
        return not bool(self.found.item())


_UNSCALE_DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16})
_UNSCALE_DTYPES_FP16 = _UNSCALE_DTYPES | {torch.float16}


def _raise_bad_grad(optimizer: torch.optim.Optimizer, allowed: frozenset) -> None:
    for gi, group in enumerate(optimizer.param_groups):
        for pi, param in enumerate(group["params"]):
            grad = param.grad
            if grad is None or grad.dtype in allowed:
                continue
            where = f"param_groups[{gi}]['params'][{pi}].grad"
            if grad.dtype == torch.float16:
                raise InvalidArgumentError(
                    "Expected float32, float64 or bfloat16 gradients to unscale (keep the "
                    "parameters in float32 and let autocast compute in float16). "
                    f"Received: {where} with dtype=torch.float16"
                )
            raise InvalidArgumentError(
                "Expected floating-point gradients (float32, float64, bfloat16"
                f"{', float16' if torch.float16 in allowed else ''}). Received: {where} with "
                f"dtype={grad.dtype}"
            )


def _host(state: LossScaleState) -> dict[str, Any]:
    return {f: getattr(state, f).item() for f in LossScaleState._fields}


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.utils.clip_grad_norm_`` with ``numstab.clip_by_global_norm``'s
    semantics, in place: ``g *= max_norm / max(norm, max_norm)``.

    Takes torch's arguments: ``norm_type`` as torch reads it (``float(norm_type)``: 2.0,
    ``'inf'``, ``math.inf``, ...; numstab refuses what is not a norm: <= 0, -inf, NaN);
    ``error_if_nonfinite=True`` raises NonFiniteError on a non-finite norm, before any
    gradient changes (one host sync); ``foreach`` is accepted and ignored (numstab picks the
    multi-tensor kernels itself). Unlike torch: the norm accumulates in float32 for
    float16/bfloat16 gradients (torch's overflows to inf and zeroes them), there is no
    ``1e-6`` epsilon (gradients under the limit are exactly unchanged), and a non-finite norm
    leaves every gradient untouched (torch multiplies by NaN or 0). Returns the global norm
    as a 0-d tensor; no host sync unless ``error_if_nonfinite``.
    """
    max_norm = v.check_number("max_norm", max_norm, low=0.0, low_open=True)
    norm_type = _norm_type(norm_type)
    if foreach is not None and not isinstance(foreach, bool):
        raise InvalidArgumentError(
            f"Expected foreach a bool or None. Received: foreach={foreach!r}"
        )
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = _grads_by_device_dtype(params)
    norm = global_norm([g for gs in grads.values() for g in gs], norm_type, backend="torch")
    if error_if_nonfinite and not torch.isfinite(norm):
        raise NonFiniteError(
            f"The total norm of order {norm_type} of the gradients is {norm.item()}: "
            f"nothing was clipped (error_if_nonfinite=True)",
            framework="torch",
        )
    _mul_(grads, clip_coefficient(norm, max_norm, backend="torch"))
    return norm


def _norm_type(norm_type: Any) -> float:
    """``norm_type`` read as torch reads it, ``float(norm_type)`` (so ``'inf'`` is math.inf),
    then checked as numstab's clipping checks it (> 0, inf allowed)."""
    if isinstance(norm_type, str):
        try:
            norm_type = float(norm_type)
        except ValueError:
            raise InvalidArgumentError(
                f"Expected norm_type a number > 0 or 'inf'. Received: norm_type={norm_type!r}"
            ) from None
    return _check_norm_type(norm_type)


def _dense_grads(optimizer: torch.optim.Optimizer) -> dict[tuple, list[torch.Tensor]]:
    """The optimizer's gradients by (device, dtype); sparse ones raise."""
    return _grads_by_device_dtype(p for group in optimizer.param_groups for p in group["params"])


def _grads_by_device_dtype(params: Iterable[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    """The parameters' gradients (None skipped) by (device, dtype); sparse ones raise."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if grad.is_sparse:
            raise InvalidArgumentError(
                "Expected dense gradients to clip. Received: a sparse gradient."
            )
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    return groups


def _mul_(groups: dict[tuple, list[torch.Tensor]], coef: torch.Tensor) -> None:
    """grads *= coef (a clipping factor) in place, per device and dtype; float16/bfloat16
    multiply in float32 and round toward zero (``Backend.cast_toward_zero``), so that the
    clipped norm never exceeds the float32 one."""
    with torch.no_grad():
        for (device, dtype), grads in groups.items():
            local = coef.to(device, non_blocking=True)
            if dtype in (torch.float32, torch.float64):
                torch._foreach_mul_(grads, local.to(dtype))  # one multi-tensor kernel
            else:
                for g in grads:
                    g.copy_(TORCH.cast_toward_zero(g.float() * local, TORCH.dtype_name(g)))


# -- adaptive clipping (ZClip, AGC) --------------------------------------------------------------
def _grads_of(parameters: Any) -> list[torch.Tensor]:
    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.parameters()
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return [p.grad for p in parameters if p.grad is not None]


class ZClip:
    """ZClip on the ``.grad`` of a model's parameters, in place, as the ``zclip`` package:

        zclip = ZClip()                       # zclip's defaults (alpha=0.97, z_thresh=2.5, ...)
        loss.backward()
        norm = zclip.step(model)              # or a list of parameters
        optimizer.step()

    Same arguments and results as ``zclip.ZClip`` (see numstab.adaptive_clipping.ZClip),
    but ``step`` returns the raw global norm as a 0-d float32 tensor without a host sync, and
    the statistics are tensors (``self.state``; ``state_dict`` / ``load_state_dict``).
    """

    def __init__(self, **kwargs: Any) -> None:
        from numstab.adaptive_clipping import ZClip as Policy

        self.policy = Policy(**kwargs)
        self.state: Any = None

    def step(self, parameters: Any) -> torch.Tensor:
        from numstab.clipping import global_norm as _norm

        grads = _grads_of(parameters)
        if self.state is None:
            self.state = self.policy.init(grads, backend="torch")
        norm = _norm(grads, backend="torch") if grads else torch.zeros(())
        coef, self.state = self.policy.coefficient(norm, self.state, backend="torch")
        _scale_grads_(grads, coef)
        return norm

    def state_dict(self) -> dict[str, Any]:
        return {} if self.state is None else {k: t.clone() for k, t in self.state._asdict().items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        from numstab.adaptive_clipping import ZClipState

        self.state = ZClipState(**state_dict) if state_dict else None


def agc_(
    parameters: Any,
    clip_factor: float = 0.01,
    eps: float = 1e-3,
    *,
    layout: str = "oi",
    axis: Any = None,
) -> None:
    """AGC on the ``.grad`` of ``parameters`` (a module, a tensor or an iterable), in place.

    ``layout="oi"`` (default here): torch weights put the output axis first, so a unit is a
    row of an ``nn.Linear`` weight or an output channel of a ``ConvNd`` weight (as timm).
    """
    from numstab.adaptive_clipping import AGC

    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.parameters()
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return
    grads = [p.grad for p in params]
    policy = AGC(clip_factor, eps, layout=layout, axis=axis)
    clipped = policy.clip(grads, [p.detach() for p in params], backend="torch")
    with torch.no_grad():
        torch._foreach_copy_(grads, clipped)


def _scale_grads_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """grads *= coef in place (``_mul_``)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    _mul_(groups, coef)
