"""torch machinery for ``check_numerics``.

- ``mode="op"``: ``torch.autograd.set_detect_anomaly(True, check_nan=nan)`` (native; it gives
  the forward traceback of a failing backward node) plus a ``TorchDispatchMode`` that checks
  every floating or complex output of every aten op, forward and backward (the autograd engine runs
  backward ops under the same mode), because anomaly mode alone ignores the forward pass and
  inf. ``torch.compile``d functions run eagerly inside (``set_stance("force_eager")``): a
  dispatch mode cannot see inside a compiled graph, and ``fullgraph=True`` would refuse to run.
  Ops that make no values (``empty*``, views) are passed through; an inf the op received (a
  ±inf scalar argument, a tensor argument holding inf) is not reported, NaN always is.
- ``mode="sentinel"``: a global module forward hook (one fixed entry for every context, a
  no-op inside compiled code) records one reduction (``summary``) of
  every floating or complex tensor of a module's output, a tree (§6: nested containers,
  dataclasses; no sync), and a post-accumulate-grad hook the same
  for the gradient of each parameter of those modules (a NaN born in the backward pass reaches
  the parameter gradients of every layer before it, so the first such layer in backward order
  is named).
"""

from __future__ import annotations

import contextlib
import math
import sys
import weakref
from typing import Any

import torch
from torch.nn.modules.module import _global_forward_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from numstab.errors import NonFiniteError
from numstab.frameworks.torch import amp_settle
from numstab.frameworks.torch.distributed import is_data_parallel, max_over_ranks
from numstab.frameworks.torch.tensor_reads import (
    checkable,
    counts,
    module_tensors,
    op_tensors,
    readable,
)
from numstab.numerics import _where
from numstab.numerics._ops import op_error, op_kind, strip_ansi

#: active op-mode contexts, innermost last. Process-wide, not thread-local: on CUDA the
#: autograd engine runs backward ops on its own device threads (under the same dispatch mode).
_ACTIVE: list = []


#: ops whose output holds no values of their own: uninitialised memory (whatever a freed
#: buffer held) or storage re-pointed or resized in place; views (``func.is_view``) and
#: in-place views (``Tag.inplace_view``) only alias values that were made elsewhere
_NO_VALUES = frozenset(
    "empty empty_like new_empty empty_strided new_empty_strided empty_permuted resize_ "  # noqa: SIM905
    "resize_as_ _resize_output_ set_".split()
)
#: in-place ops that overwrite ``self`` without reading it
_WRITE_ONLY = frozenset(
    "copy_ fill_ zero_ normal_ uniform_ bernoulli_ exponential_ geometric_ cauchy_ "  # noqa: SIM905
    "log_normal_ random_".split()
)


class _Plan:
    """How one aten overload is checked, worked out from its schema once (``_PLANS``)."""

    __slots__ = ("pre", "skip", "written")

    def __init__(self, func) -> None:
        schema = func._schema
        name = schema.name.split("::")[-1]
        self.skip = name in _NO_VALUES or func.is_view or torch.Tag.inplace_view in func.tags
        written = [
            (i, a.name)
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ]
        #: arguments that hold a result after the op: not read for inf it received
        self.written = frozenset(x for pair in written for x in pair)
        #: in-place on ``self`` and reading it: whether it held inf is read before the op
        self.pre = bool(written) and written[0][0] == 0 and name not in _WRITE_ONLY


_PLANS: dict[Any, _Plan] = {}  # per aten overload


def _holds_inf(t: Any) -> Any:
    """Whether a tensor argument holds inf or ±its dtype's largest value (a device bool, read
    when needed: the finite mask idiom, transformers' ``scores + finfo(dtype).min``, overflows
    to -inf on purpose), or a Python scalar is ±inf; ``False`` for anything else."""
    if isinstance(t, torch.Tensor):
        if not checkable(t) or t.device.type == "meta" or t.layout != torch.strided:
            return False
        read, dtype = readable(t), t.dtype
        largest = torch.finfo(dtype).max if dtype.is_floating_point else math.inf
        return (torch.isinf(read) | (read.abs() == largest)).any()
    if isinstance(t, float):
        return math.isinf(t)
    if isinstance(t, complex):
        return math.isinf(t.real) or math.isinf(t.imag)
    return False


def _received_inf(plan: _Plan, args: tuple, kwargs: dict, before: Any) -> bool:
    """Whether the op was given inf: a ±inf Python scalar, or a tensor argument (or one in a
    list argument) that held inf; an argument the op wrote counts as it was before the op."""
    if before is not None and bool(before):
        return True
    values = [a for i, a in enumerate(args) if i not in plan.written]
    values += [v for k, v in kwargs.items() if k not in plan.written]
    for v in values:  # scalars first: no kernel
        if isinstance(v, (float, complex)) and _holds_inf(v):
            return True
    for v in values:
        for one in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(one, torch.Tensor) and bool(_holds_inf(one)):
                return True
    return False


class _CheckOps(TorchDispatchMode):
    """Checks every floating or complex output of every aten op; raises at the first bad one.
    Not checked: ops that make no values (``_Plan.skip``), inf the op received."""

    def __init__(self, settings) -> None:
        super().__init__()
        self.settings = settings

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        plan = _PLANS.get(func) or _PLANS.setdefault(func, _Plan(func))
        stack = _ACTIVE
        node = torch._C._current_autograd_node()
        if (
            plan.skip
            or not stack
            or stack[-1] is not self  # an inner check_numerics decides
            or (node is not None and not self.settings.backward)
        ):
            return func(*args, **kwargs)
        before = _holds_inf(args[0]) if plan.pre and self.settings.inf else None
        out = func(*args, **kwargs)
        for index, t in enumerate(op_tensors(out)):
            if t.device.type == "meta" or t.layout != torch.strided:
                continue
            read = readable(t)
            low, high = torch.stack(torch.aminmax(read)).tolist()  # one host read per output
            has_nan = math.isnan(low)
            has_inf = math.isinf(low) or math.isinf(high)
            if has_nan and self.settings.inf and not self.settings.nan:
                has_inf = bool(torch.isinf(read).any())
            if not self.settings.bad(has_nan, has_inf):
                continue
            if not (has_nan and self.settings.nan) and _received_inf(plan, args, kwargs, before):
                continue  # inf given to the op (a -inf mask, propagation): not made here
            raise _op_error(func, node, index, t, self.settings)
        return out


def _op_error(func, node, index: int, t: torch.Tensor, settings) -> NonFiniteError:
    nan_count, inf_count = counts(t)
    aten = str(func)
    if node is not None:
        phase, op = "backward", node.name()
        where = _where.from_text(str(node.metadata.get("traceback_", "")))
        detail = f"aten op {aten}, "
    else:
        phase, op = "forward", aten
        where = _where.from_stack()
        detail = ""
    return op_error(
        "torch",
        op,
        produced=f"{nan_count} NaN and {inf_count} inf in output {index}",
        phase=phase,
        where=where,
        detail=f"{detail}shape {_shape(t)}, {str(t.dtype).replace('torch.', '')}",
        nan_count=nan_count,
        inf_count=inf_count,
        kind=op_kind(op) or op_kind(aten),
    )


#: active sentinel contexts, outermost first, all served by one global forward hook
_SENTINELS: list = []
#: the hook's fixed key in torch's global forward-hook dict: ``torch.compile`` guards on that
#: dict, so a new key per context (``register_module_forward_hook``) recompiled every compiled
#: module once per context, up to the recompile limit
_HOOK_KEY = RemovableHandle(_global_forward_hooks).id


def _sentinel_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
    if torch.compiler.is_compiling():
        # traced into a compiled graph, the hook would break it (``fullgraph=True`` raises) or
        # recompile it as records accrue; the compiled module's own call is recorded eagerly
        return
    for arm in list(_SENTINELS):
        arm._forward_hook(module, args, output)


def _remove_sentinel(arm: Arm) -> None:
    _SENTINELS.remove(arm)
    if not _SENTINELS:
        _global_forward_hooks.pop(_HOOK_KEY, None)
        amp_settle.uninstall()


def settle(params: Any, handled: Any) -> None:
    """A loss scaler's verdict on the gradients of ``params`` (one optimizer's), for every
    sentinel context: ``handled()`` (called only while one is active, no sync) reads NaN
    when the scaler found them non-finite and skipped the step (§14.6)."""
    if not _SENTINELS:
        return
    value, ids = handled(), {id(p) for p in params}
    for arm in list(_SENTINELS):
        slots = arm._grad_slots
        arm.recorder.settle("torch", {slots[i] for i in ids if i in slots}, value)


def _shape(t: torch.Tensor) -> Any:
    if t.is_nested:  # ragged: no one shape
        return f"nested, {t.size(0)} components of {t.dim() - 1} dims"
    return tuple(t.shape)


class Arm:
    """torch's part of one active ``check_numerics`` context."""

    def __init__(self, settings, recorder) -> None:
        self.settings = settings
        self.recorder = recorder
        self._stack = contextlib.ExitStack()
        self._mode: _CheckOps | None = None
        self._handles: list[Any] = []
        self._hooked_params: set[int] = set()
        self._modules: weakref.WeakSet = weakref.WeakSet()
        self._last: tuple[int, int] | None = None
        self._slots: dict[Any, int] = {}
        self._grad_slots: dict[int, int] = {}  # id(parameter) -> its gradient's slot

    # -- enter / exit ------------------------------------------------------------------------
    def enter(self) -> None:
        on = self.settings.nan or self.settings.inf
        if self.settings.mode == "sentinel":
            if on:
                _SENTINELS.append(self)
                _global_forward_hooks[_HOOK_KEY] = _sentinel_hook
                amp_settle.install()  # torch's own GradScaler settles its skipped steps
                self._stack.callback(_remove_sentinel, self)
            return
        if self.settings.backward or not on:
            previous = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
            torch.autograd.set_detect_anomaly(on, check_nan=self.settings.nan or not on)
            self._stack.callback(torch.autograd.set_detect_anomaly, *previous)
        if on:
            self._stack.enter_context(torch.compiler.set_stance("force_eager"))
            self._mode = _CheckOps(self.settings)
            self._stack.enter_context(self._mode)
        # checks off inside: this context (not a mode) is innermost and outer ones defer to it
        _ACTIVE.append(self._mode or self)
        self._stack.callback(_ACTIVE.remove, self._mode or self)

    def exit(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack.close()

    # -- sentinel hooks ----------------------------------------------------------------------
    def _resolver(self, module: torch.nn.Module, param: str | None = None) -> Any:
        """Names at report time: ``"1.fc2 (Linear)"``; a gradient ``"1.fc2.weight (Linear)"``."""
        ref = weakref.ref(module)
        modules = self._modules

        def resolve() -> str:
            target = ref()
            if target is None:
                return "<deleted module>"
            qualified = ""
            for root in list(modules):
                for name, sub in root.named_modules():
                    if sub is target and len(name) > len(qualified):
                        qualified = name
            if param is not None:
                qualified = f"{qualified}.{param}" if qualified else param
            kind = type(target).__name__
            return f"{qualified} ({kind})" if qualified else kind

        return resolve

    def _record(
        self,
        key: Any,
        module: torch.nn.Module,
        phase: str,
        t: torch.Tensor,
        param: str | None = None,
    ) -> int:
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = self.recorder.slot(
                key,
                name=type(module).__name__,
                resolve=self._resolver(module, param),
                phase=phase,
                framework="torch",
            )
        # a parameter gradient waits for a loss scaler's verdict (``settle``)
        self.recorder.add("torch", slot, summary(t), maskable=param is not None)
        return slot

    def _forward_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        # ``OptimizedModule`` (what ``torch.compile(module)`` returns) once dynamo is imported
        compiled = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
        inner = compiled is not None and isinstance(module, compiled)
        if inner:  # torch.compile(module): recorded as the module it compiles
            module = module._orig_mod
        self._modules.add(module)
        for index, t in enumerate(module_tensors(output)):
            stamp = (id(t), t._version)
            if stamp == self._last:  # a container returning its last child's output
                continue
            self._last = stamp
            self._record((id(module), index, "forward"), module, "forward", t)
        if self.settings.backward:
            # the hooks inside a compiled graph do not run: hook all of its parameters here
            for owner in module.modules() if inner else (module,):
                self._hook_params(owner)

    def _hook_params(self, module: torch.nn.Module) -> None:
        for pname, param in module._parameters.items():
            if param is not None and param.requires_grad and id(param) not in self._hooked_params:
                self._hooked_params.add(id(param))
                key = (id(module), id(param), "backward")
                self._handles.append(
                    param.register_post_accumulate_grad_hook(
                        lambda p, key=key, m=module, n=pname: self._param_hook(key, m, p, n)
                    )
                )

    def _param_hook(self, key: Any, module: torch.nn.Module, p: torch.Tensor, name: str) -> None:
        grad = p.grad
        if checkable(grad):
            self._grad_slots[id(p)] = self._record(key, module, "backward", grad, name)

    def agree(self, value: int, auto: bool = False) -> int:
        """``value``'s maximum over the data-parallel ranks (``max_over_ranks``); with
        ``auto``, only where a DDP or FSDP module ran here (every rank runs those alike)."""
        if auto and not any(map(is_data_parallel, list(self._modules))):
            return value
        return max_over_ranks(value)

    # -- conversion --------------------------------------------------------------------------
    def convert(self, exc: BaseException) -> NonFiniteError | None:
        """anomaly mode's own ``RuntimeError`` (a backward node returned NaN)."""
        message = strip_ansi(str(exc))
        if not isinstance(exc, RuntimeError) or "returned nan values" not in message:
            return None
        op = message.split("'")[1] if message.count("'") >= 2 else None
        where = _where.from_traceback(exc.__traceback__)
        return op_error("torch", op, produced="NaN", phase="backward", where=where, detail=message)


_WIDE = (torch.float32, torch.float64)


def summary(t: torch.Tensor) -> Any:
    """One reduction whose value is finite exactly when ``t`` is (no sync): the sum for
    float32/64 (NaN and inf propagate; about twice as fast as min/max on CPU; a finite tensor
    whose sum overflows, beyond 3.4e38 in float32, reads as inf), else ``aminmax`` (a float16
    sum would overflow at 65504; 8-bit floats are upcast first)."""
    t = readable(t.detach())
    return t.sum() if t.dtype in _WIDE else torch.aminmax(t)


def summarize(leaves: list) -> Any:
    """Per-leaf summaries on the device, for ``watch``."""
    return [summary(t) for t in leaves if checkable(t)]


@contextlib.contextmanager
def quiet():
    """The op checks of an active ``mode="op"`` context off while ``watch`` computes its own
    summaries: they are reported under the watched name, not as an ``aten.sum`` fault."""
    if not _ACTIVE:
        yield
        return
    marker = object()  # not the innermost mode: ``_CheckOps`` passes every op through
    _ACTIVE.append(marker)
    try:
        yield
    finally:
        _ACTIVE.remove(marker)


def read_summaries(summaries: list) -> list[tuple[bool, bool]]:
    """(has_nan, has_inf) per summary: sums and (min, max) pairs are stacked per dtype and
    read in one transfer each."""
    groups: dict[Any, list[tuple[int, Any, Any]]] = {}
    for i, s in enumerate(summaries):
        for one in s if isinstance(s, list) else [s]:
            low, high = (one, one) if isinstance(one, torch.Tensor) else one
            groups.setdefault(low.dtype, []).append((i, low, high))
    out = [[False, False] for _ in summaries]
    for group in groups.values():
        lows = torch.stack([low for _, low, _ in group])
        highs = torch.stack([high for _, _, high in group])
        flags = torch.stack([torch.isnan(lows), torch.isinf(lows) | torch.isinf(highs)]).tolist()
        for (i, _, _), has_nan, has_inf in zip(group, flags[0], flags[1], strict=True):
            out[i][0] |= has_nan
            out[i][1] |= has_inf
    return [(a, b) for a, b in out]
