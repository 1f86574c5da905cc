"""torch gradient clipping in place, on ``.grad``: a drop-in ``clip_grad_norm_`` with
numstab's semantics, and the adaptive policies ZClip and AGC (the algorithms live in
``numstab.clipping`` and ``numstab.adaptive_clipping``; here they meet torch's gradients)."""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from numstab import _validate as v
from numstab.clipping import _check_norm_type, clip_coefficient, global_norm
from numstab.errors import InvalidArgumentError, NonFiniteError
from numstab.frameworks.torch.backend import BACKEND as TORCH

__all__ = ["ZClip", "agc_", "clip_grad_norm_"]

#: gradient dtypes scaled in their own precision (complex ones by ``coef + 0j``, as torch)
_OWN_PRECISION = (torch.float32, torch.float64, torch.complex64, torch.complex128)


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float | torch.Tensor,
    norm_type: float | str | torch.Tensor = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.utils.clip_grad_norm_`` with ``numstab.clip_by_global_norm``'s
    semantics, in place: ``g *= max_norm / max(norm, max_norm)``.

    Takes torch's arguments: ``max_norm`` a number or, as torch, a 0-d real tensor (read on
    the host, as torch's ``float(max_norm)``: a sync for a GPU tensor); ``norm_type`` as
    torch reads it (``float(norm_type)``: 2.0, ``'inf'``, ``math.inf``, a 0-d tensor, ...;
    numstab refuses what is not a norm: <= 0, -inf, NaN);
    ``error_if_nonfinite=True`` raises NonFiniteError on a non-finite norm, before any
    gradient changes (one host sync); ``foreach`` is accepted and ignored (numstab picks the
    multi-tensor kernels itself). Unlike torch: the norm accumulates in float32 for
    float16/bfloat16 gradients (torch's overflows to inf and zeroes them), there is no
    ``1e-6`` epsilon (gradients under the limit are exactly unchanged), and a non-finite norm
    leaves every gradient untouched (torch multiplies by NaN or 0). Returns the global norm
    as a 0-d tensor; no host sync unless ``error_if_nonfinite`` (or a tensor argument).
    """
    max_norm = max_norm_of(max_norm)
    norm_type = norm_type_of(norm_type)
    if foreach is not None:
        v.check_bool("foreach", foreach)
    grads = grads_by_device_dtype(tensors_of(parameters))
    norm = global_norm([g for gs in grads.values() for g in gs], norm_type, backend="torch")
    if error_if_nonfinite and not torch.isfinite(norm):
        raise NonFiniteError(
            f"The total norm of order {norm_type} of the gradients is {norm.item()}: "
            f"nothing was clipped (error_if_nonfinite=True)",
            framework="torch",
        )
    scale_groups_(grads, clip_coefficient(norm, max_norm, backend="torch"))
    return norm


def norm_type_of(norm_type: Any) -> float:
    """``norm_type`` read as torch reads it, ``float(norm_type)`` (so ``'inf'`` is math.inf,
    a 0-d tensor its value: ``host_number``), then checked as numstab's clipping checks it
    (> 0, inf allowed)."""
    norm_type = host_number("norm_type", norm_type)
    if isinstance(norm_type, str):
        try:
            norm_type = float(norm_type)
        except ValueError:
            raise InvalidArgumentError(
                f"Expected norm_type a number > 0 or 'inf'. Received: norm_type={norm_type!r}"
            ) from None
    return _check_norm_type(norm_type)


def max_norm_of(max_norm: Any) -> float:
    """``max_norm`` as torch's clipping takes it (a number or a 0-d real tensor, ``host_number``),
    checked: a real number in (0, inf]. ``inf`` clips nothing, as in torch, where
    ``clip_grad_norm_(params, float("inf"))`` measures the norm (accelerate's, the ``Trainer``'s
    ``grad_norm``): it becomes float64's largest value, which §7.3 clamps to the norm dtype's
    (numstab's own ``clip_by_global_norm`` refuses inf: there it is no bound)."""
    value = host_number("max_norm", max_norm)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):  # np.float32 too
        if value == math.inf:
            return sys.float_info.max
        if not value > 0:  # NaN, -inf, <= 0
            message = f"Expected max_norm in (0, inf]. Received: max_norm={value!r}"
            raise InvalidArgumentError(message)
    return v.check_number("max_norm", value, low=0.0, low_open=True)


def host_number(name: str, value: Any) -> Any:
    """A 0-d real tensor (not bool or complex) as the Python number it holds: torch reads
    ``max_norm`` and ``norm_type`` with ``float()``, one host read (a sync for a GPU tensor;
    the checks of NaN and sign need it too). Any other value as it is, for the caller's
    checks; a tensor of another shape or dtype: InvalidArgumentError."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
        raise InvalidArgumentError(
            f"Expected {name} to be a real number or a 0-d real tensor. Received: {name} a "
            f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
        )
    return value.item()


def dense_grads(optimizer: torch.optim.Optimizer) -> dict[tuple, list[torch.Tensor]]:
    """The optimizer's gradients by (device, dtype); sparse ones raise."""
    return grads_by_device_dtype(p for group in optimizer.param_groups for p in group["params"])


def grads_by_device_dtype(
    params: Iterable[torch.Tensor], sparse: list[torch.Tensor] | None = None
) -> dict[tuple, list[torch.Tensor]]:
    """The parameters' gradients (None skipped) by (device, dtype); a sparse one raises, or,
    given ``sparse``, its parameter goes there."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if grad.is_sparse:
            if sparse is None:
                raise InvalidArgumentError(
                    "Expected dense gradients to clip. Received: a sparse gradient."
                )
            sparse.append(param)
        else:
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
    return groups


def scale_groups_(groups: dict[tuple, list[torch.Tensor]], coef: torch.Tensor) -> None:
    """grads *= coef (a clipping factor) in place, per device and dtype; float16/bfloat16
    multiply in float32 and round toward zero (``Backend.cast_toward_zero``), so that the
    clipped norm never exceeds the float32 one."""
    with torch.no_grad():
        for (device, dtype), grads in groups.items():
            local = coef.to(device, non_blocking=True)
            if dtype in _OWN_PRECISION:
                torch._foreach_mul_(grads, local.to(dtype))  # one multi-tensor kernel
            else:
                for g in grads:
                    g.copy_(TORCH.cast_toward_zero(g.float() * local, TORCH.dtype_name(g)))


# -- adaptive clipping (ZClip, AGC) --------------------------------------------------------------
def _grads_of(parameters: Any) -> list[torch.Tensor]:
    return [p.grad for p in tensors_of(parameters) if p.grad is not None]


def tensors_of(parameters: Any) -> list[torch.Tensor]:
    """``parameters`` (a module, a tensor, or an iterable of tensors, as torch's clipping
    functions take) as a list of tensors; anything else raises InvalidArgumentError (None or
    another framework's arrays raised Python's TypeError or AttributeError)."""
    if isinstance(parameters, torch.nn.Module):
        return list(parameters.parameters())
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    try:
        found = list(parameters)
    except TypeError:
        found = None
    if found is None or not all(isinstance(p, torch.Tensor) for p in found):
        raise InvalidArgumentError(
            f"Expected parameters to be a torch module, a tensor or an iterable of tensors. "
            f"Received: {type(parameters).__name__}"
            + ("" if found is None else f" of {sorted({type(p).__name__ for p in found})}")
        )
    return found


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
        """The state ``state_dict()`` gave (``{}``: none yet), of a ZClip with the same
        ``warmup_steps``; anything else raises ``InvalidArgumentError``."""
        from numstab.adaptive_clipping import ZClipState

        if not state_dict:
            self.state = None
            return
        fields = ZClipState._fields
        keys = sorted(state_dict) if isinstance(state_dict, Mapping) else state_dict
        if not isinstance(state_dict, Mapping) or set(state_dict) != set(fields):
            raise InvalidArgumentError(
                f"Expected a ZClip state dict with the keys {list(fields)} (or {{}}). "
                f"Received: {keys!r}"
            )
        buffer = state_dict["buffer"]
        size = (self.policy.buffer_size,)
        if not isinstance(buffer, torch.Tensor) or tuple(buffer.shape) != size:
            raise InvalidArgumentError(
                f"Expected a ZClip state dict of a ZClip with warmup_steps="
                f"{self.policy.warmup_steps}: a buffer of shape {size}. Received: buffer of "
                f"shape {tuple(getattr(buffer, 'shape', ()))}"
            )
        self.state = ZClipState(**{k: state_dict[k] for k in fields})


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
    from numstab.agc import AGC

    policy = AGC(clip_factor, eps, layout=layout, axis=axis)  # checked with no .grad yet too
    params = [p for p in tensors_of(parameters) if p.grad is not None]
    if not params:
        return
    grads = [p.grad for p in params]
    clipped = policy.clip(grads, [p.detach() for p in params], backend="torch")
    with torch.no_grad():
        torch._foreach_copy_(grads, clipped)


def _scale_grads_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """grads *= coef in place (``_mul_``)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    scale_groups_(groups, coef)
