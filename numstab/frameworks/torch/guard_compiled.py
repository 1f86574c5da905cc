"""The torch device step's two hot pieces, compiled once per shape and shared in the process.

* :class:`DevicePolicy`: ``numstab.guard.policy.decide`` itself (the one implementation of
  the decision), run on a torch ``GuardState`` that it updates in place, writing the step's
  ``Decision`` as a row of ``numstab.guard.deferred.ROW_COLUMNS`` to a ``[k, 8]`` ring at
  ``step % k``.
* :func:`undo_plan`: ``t = where(apply, t, backup)`` over every tensor of a step (parameters
  and optimizer state), exact (no arithmetic on the values), in one call, bound once to the
  tensors; with ``keep``, the backup takes the result too (the model's buffers).

Both are traced with ``make_fx`` (fake tensors) and compiled by inductor
(``torch._inductor.compile``: C++ on CPU, which needs a compiler; Triton on GPU). No dynamo:
its guards cost more per call (~40 us on CPU) than the eager ops they replace. The compiled
code is specialized on the guard's constants and the tensors' shapes, dtypes, strides and
devices, and cached per such key for the life of the process. Where compilation fails (no
compiler, an unsupported device), the same code runs eagerly, with one warning: the
results are the same, only slower.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from numstab.backends import load_backend
from numstab.guard import policy
from numstab.guard.deferred import ROW_COLUMNS
from numstab.guard.monitor import global_from_leaf_norms

if TYPE_CHECKING:
    from numstab.guard.guard import TrainingGuard

_CACHE: dict[Any, Callable[..., Any] | None] = {}
# no per-call check of each input's size and stride (~0.6 us each on CPU, 14-81 inputs): the
# cache keys carry every input's shape, stride, dtype and device, or the inputs are ours
_OPTIONS = {"size_asserts": False}
_WARNED: list[bool] = []


def _compiled(key: Any, fn: Callable[..., Any], example: list[torch.Tensor]) -> Callable | None:
    """``fn`` (pure torch ops on ``example``'s tensors, in-place writes allowed) compiled by
    inductor, cached under ``key``; None where compilation failed (run ``fn`` eagerly)."""
    if key not in _CACHE:
        try:
            from torch.fx.experimental.proxy_tensor import make_fx

            with torch.no_grad():
                graph = make_fx(fn, tracing_mode="fake")(*example)
                _CACHE[key] = torch._inductor.compile(graph, example, options=_OPTIONS)
        except Exception as err:  # no C++ compiler, no Triton, an op inductor rejects
            _CACHE[key] = None
            if not _WARNED:
                _WARNED.append(True)
                warnings.warn(
                    f"numstab TrainingGuard(host_every>1): torch could not compile the "
                    f"device step ({type(err).__name__}: {err}); it runs eagerly (same "
                    f"results, slower)",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return _CACHE[key]


def _signature(tensors: list[torch.Tensor]) -> tuple:
    return tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors)


# -- the decision ----------------------------------------------------------------------------
class DevicePolicy:
    """``policy.decide`` on a torch ``GuardState`` kept on ``device``, and the rows ring."""

    def __init__(
        self, guard: TrainingGuard, device: torch.device, capacity: int, loss_scaled: bool = False
    ) -> None:
        self.guard, self.loss_scaled = guard, loss_scaled
        self.be = load_backend("torch")
        like = torch.zeros((), device=device)
        self.state_now = policy.init_state(guard, self.be, like)  # its tensors, updated in place
        self.rows = torch.zeros(capacity, len(ROW_COLUMNS), device=device)
        self._state_flat = self._flat()  # the same tensors for life: loads copy into them
        key = (
            "decide",
            guard.loss_spikes,
            guard.grad_norm_spikes,
            guard.rollback_window,
            guard.rollback_after,
            guard.snapshot_every,
            capacity,
            str(device),
            loss_scaled,
        )
        self._key = key
        self._fns: dict[bool, Callable[..., Any] | None] = {}  # by has_loss, compiled on use
        self._with_norms: dict[Any, Callable[..., Any] | None] = {}

    def _flat(self) -> list[torch.Tensor]:
        return policy.flatten_state(self.state_now)

    def _step(self, *args: torch.Tensor, has_loss: bool = True) -> tuple[torch.Tensor, ...]:
        """Pure over its arguments (flat state, ``[loss, norm]``, rows): decide (``x[0]``
        unread without a loss), write the row at ``step % k`` and the next state in place;
        ``(apply, 1 - apply as float)``."""
        *flat, x, rows = args
        state = policy.unflatten_state(self.state_now, flat)
        overflow = ~torch.isfinite(x[1]) if self.loss_scaled else None
        loss = x[0] if has_loss else None
        d, new = policy.decide(self.guard, self.be, state, loss, x[1], scaler_overflow=overflow)
        row = torch.stack([getattr(d, c).to(torch.float32) for c in ROW_COLUMNS])
        slot = torch.remainder(state.step, rows.shape[0]).reshape(1).to(torch.int64)
        rows.index_copy_(0, slot, row.reshape(1, -1))
        write_back(flat, policy.flatten_state(new))
        return d.apply, (~d.apply).to(torch.float32)

    def _step_norms(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``_step`` from (flat state, loss, the per-leaf norms, rows): the norms stacked, the
        global norm ``sqrt(sum(norms**2))`` and ``[loss, norm]`` in the same graph;
        ``(apply, found_inf, the stacked norms)``."""
        n = len(self._state_flat)
        flat, loss, norms, rows = args[:n], args[n], args[n + 1 : -1], args[-1]
        vec = torch.stack(norms)
        total = global_from_leaf_norms(self.be, vec)
        x = torch.stack([loss.reshape(()).to(torch.float32), total])
        apply, found_inf = self._step(*flat, x, rows)
        return apply, found_inf, vec

    @torch.no_grad()
    def decide_norms(
        self, loss: torch.Tensor, norms: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``decide`` from the step's loss (one element, on the state's device) and its
        per-leaf float32 gradient norms (0-d, same device; ``torch._foreach_norm``'s), in
        one call: ``(apply, found_inf, the norms as a vector)``."""
        args = [*self._state_flat, loss, *norms, self.rows]
        key = (len(norms), loss.dtype, loss.dim())
        fn = self._with_norms.get(key, _compiled)
        if fn is _compiled:
            fn = self._with_norms[key] = _compiled((*self._key, key), self._step_norms, args)
        return fn(*args) if fn is not None else self._step_norms(*args)

    @torch.no_grad()
    def decide(self, x: torch.Tensor, has_loss: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``(apply, found_inf)`` of the step whose float32 ``[loss, global norm]`` is ``x``
        (0-d bool, 0-d float ``1 - apply``); writes its row; no host read."""
        args = [*self._state_flat, x, self.rows]
        step = functools.partial(self._step, has_loss=has_loss)
        if has_loss not in self._fns:
            self._fns[has_loss] = _compiled((*self._key, has_loss), step, args)
        fn = self._fns[has_loss]
        out = fn(*args) if fn is not None else step(*args)
        return out[0], out[1]

    def read_rows(self, first_step: int, n: int) -> np.ndarray:
        """The rows of steps ``first_step .. first_step + n - 1`` (one transfer), oldest first."""
        k = self.rows.shape[0]
        rows = self.rows.cpu().numpy()
        return rows[[(first_step + i) % k for i in range(n)]]

    def state(self) -> policy.GuardState:
        """The guard state as NumPy, in one transfer (a host read: at events only)."""
        flat = self._flat()
        bits = torch.cat([t.reshape(-1).view(torch.int32) for t in flat]).cpu().numpy()
        host, at = [], 0
        for t in flat:  # every leaf is int32 or float32: 4-byte words
            word = bits[at : at + t.numel()].view(np.float32 if t.is_floating_point() else np.int32)
            host.append(word.reshape(tuple(t.shape)).copy())
            at += t.numel()
        return policy.unflatten_state(self.state_now, host)

    def load(self, state: policy.GuardState, step: int) -> None:
        """Set the device state to a (NumPy) ``GuardState``, its step counter to ``step``."""
        state = state._replace(step=np.int32(step))
        for dst, value in zip(self._flat(), policy.flatten_state(state), strict=True):
            dst.copy_(torch.as_tensor(np.asarray(value)).reshape(dst.shape))


def write_back(old: list[torch.Tensor], new: list[torch.Tensor]) -> None:
    """``old[i].copy_(new[i])`` where ``new[i]`` is another tensor: a state updated in place."""
    for was, now in zip(old, new, strict=True):
        if now is not was:
            was.copy_(now)


def compiled_or_eager(key: Any, fn: Callable[..., Any], example: list[torch.Tensor]) -> Callable:
    """``fn`` compiled for tensors like ``example`` (cached under ``key`` and their shapes,
    strides, dtypes and devices; see ``_compiled``), or ``fn`` itself where that failed."""
    compiled = _compiled((key, _signature(example)), fn, example)
    return compiled if compiled is not None else fn


# -- the undo of a bad step --------------------------------------------------------------------
def _select(flag: torch.Tensor, *pairs: torch.Tensor) -> None:
    n = len(pairs) // 2
    for t, backup in zip(pairs[:n], pairs[n:], strict=True):
        t.copy_(torch.where(flag, t, backup))


def _select_keep(flag: torch.Tensor, *pairs: torch.Tensor) -> None:
    n = len(pairs) // 2
    for t, backup in zip(pairs[:n], pairs[n:], strict=True):
        kept = torch.where(flag, t, backup)
        t.copy_(kept)
        backup.copy_(kept)


def undo_plan(
    flag: torch.Tensor,
    tensors: list[torch.Tensor],
    backups: list[torch.Tensor],
    *,
    keep: bool = False,
) -> Callable[[torch.Tensor], None]:
    """``t = where(f, t, backup)`` for each tensor (all on ``flag``'s device) and its buffer,
    bound to them (compiled once, looked up once, eager where compilation failed): a
    function of a flag ``f`` like ``flag``, for the steps that update the same tensors in
    place; to be called under ``no_grad``. ``keep``: the buffer takes the result too (the
    model's buffers, ``guard_buffers``: the copy is renewed after an applied step)."""
    if not tensors:
        return lambda f: None
    pairs = [*tensors, *backups]
    select = _select_keep if keep else _select
    key = ("keep" if keep else "undo", _signature([flag, *pairs]))
    fn = _compiled(key, select, [flag, *pairs])
    fn = fn if fn is not None else select
    return lambda f: fn(f, *pairs)  # the caller is under no_grad
