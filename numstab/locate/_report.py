"""What locate_nonfinite found, and how the first bad layer is chosen (written once).

Each framework adapter turns one forward (and backward) pass into ``LayerCall`` entries,
one per call of a named layer, holding 0-d device arrays (or host floats): the abs max of
the layer's inputs, outputs and own parameters, and of the gradient it received (w.r.t. its
outputs) and the gradients it produced (w.r.t. its inputs and its own parameters). A max
propagates NaN and inf, so one number per group says both "finite?" and "how large?".
``summarise`` reads all of them to the host in one transfer and picks the first bad layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from numstab import _validate
from numstab._dispatch import framework_of
from numstab.backends import load_backend
from numstab.backends._base import Backend, native_op
from numstab.errors import InvalidArgumentError
from numstab.nonfinite import find_nonfinite

Array = Any

#: the name given to the loss function's own entry (it runs after the model's last layer)
LOSS = "<loss>"


def absmax(be: Backend, tensors: list) -> Array | None:
    """max |x| over floating, non-empty ``tensors`` as a 0-d array (None if there are none);
    NaN if any NaN, else inf if any inf. float64 stays float64, everything else float32."""
    tensors = [t for t in tensors if t is not None and _floating(be, t)]
    if not tensors:
        return None
    dtype = "float64" if any(be.dtype_name(t) == "float64" for t in tensors) else "float32"
    with be.float_errors_ignored():
        if len(tensors) == 1:  # the common case, in two ops
            return be.max(be.abs(be.cast(tensors[0], dtype)))
        return be.max(native_op(be, "leaf_norms")(tensors, math.inf, dtype))


def nonfinite_counts(*trees: Any) -> tuple[int, int]:
    """(NaN count, inf count) over the arrays of ``trees``: a located layer's counts."""
    found = [r for tree in trees for r in find_nonfinite(tree)]
    return sum(r.nan_count for r in found), sum(r.inf_count for r in found)


def nonfinite_names(names: list[str], arrays: list) -> list[str]:
    """The names of the arrays that hold a NaN or inf; ``names[i]`` names ``arrays[i]``."""
    return [names[int(r.path[1:-1])] for r in find_nonfinite(list(arrays))]  # "[i]" -> i


def check_loss(loss: Any, framework: str) -> None:
    """The one rule for ``loss_fn``'s return value, on every framework (§15.3): a
    floating-point array (float16, bfloat16, float32, float64) of the framework the model
    runs on, of any shape (summed). Anything else cannot carry the backward pass, so it
    raises InvalidArgumentError: None, a Python or NumPy number (``loss.item()``,
    ``float(loss)``), a string, a container, an integer, bool or complex array."""
    found = framework_of(loss)
    if found == framework:
        dtype = load_backend(framework).dtype_name(loss)
        if _validate.is_floating(dtype):
            return
        what = f"a {framework} array of dtype {dtype}"
    elif found != "host":
        what = f"a {found} array"
    elif isinstance(loss, (str, bytes, type(None), bool, int, float)):
        what = f"{loss!r} ({type(loss).__name__})"
    else:
        what = f"a {type(loss).__module__}.{type(loss).__qualname__}"
    raise InvalidArgumentError(
        f"Expected loss_fn to return a floating-point array of the model's framework "
        f"({framework}), of any shape (it is summed): the backward pass differentiates it, so "
        f"not None, a Python or NumPy number, or an integer, bool or complex array. "
        f"Received: loss_fn returned {what}"
    )


def _floating(be: Backend, t: Any) -> bool:
    dtype = be.dtype_name(t)
    return dtype.startswith(("float", "bfloat")) and be.size(t, dtype) != 0


@dataclasses.dataclass
class LayerCall:
    """One call of one layer. ``start`` / ``end``: when its forward began and finished;
    ``backward``: its position in the backward pass (smaller = earlier). ``shared``: one of
    its own parameters is also an own parameter of another call (tied weights, or the same
    layer called twice), so its parameter gradient is the total over every use
    (``mark_shared``; ``_backward_fault`` judges such a call by its input gradient first)."""

    name: str
    kind: str
    start: int
    end: int = -1
    backward: float | None = None
    inputs: Array | None = None
    outputs: Array | None = None
    params: Array | None = None
    grad_outputs: Array | None = None
    grad_inputs: Array | None = None
    grad_params: Array | None = None
    shared: bool = False


def mark_shared(calls: list[LayerCall], params: list[list[int]]) -> None:
    """Set ``shared`` on each call one of whose own parameters (``params[i]``: their ids,
    one list per call of ``calls``) belongs to another call too: a parameter tied between
    two layers, or any parameter of a layer called more than once. A call without
    parameters is never shared."""
    uses: dict[int, int] = {}
    for ids in params:
        for key in set(ids):
            uses[key] = uses.get(key, 0) + 1
    for call, ids in zip(calls, params, strict=True):
        call.shared = any(uses[key] > 1 for key in set(ids))


def backward_bad(call: LayerCall, grad_inputs: float | None, grad_params: float | None) -> bool:
    """Whether ``call`` made a non-finite gradient by the first backward rule: its own input
    gradient is non-finite, or its own parameter gradient is and the call is not ``shared``
    (a shared parameter's gradient is the total over every use: another use may have made
    it). Adapters that walk the backward pass lazily stop at the first such call."""
    return _bad(grad_inputs) or (_bad(grad_params) and not call.shared)


_FIELDS = ("inputs", "outputs", "params", "grad_outputs", "grad_inputs", "grad_params")


@dataclasses.dataclass(frozen=True)
class LocateReport:
    """The first layer, in execution order, whose output (forward) or gradient (backward)
    holds NaN or inf; ``found`` is False when the pass was clean.

    Absolute maxima are NaN / inf when the group is not finite, None when the layer has no
    such tensors. ``nan_count`` / ``inf_count`` count the bad output (forward) or the bad
    gradients the layer produced (backward). ``layer == ""`` is the model itself (its own
    code between sub-layers); ``"<loss>"`` is the loss function. ``inf_layer`` /
    ``inf_layer_type``: the layer where an ±inf of the forward pass that is not the reported
    fault was born (a ``-inf`` mask whose loss stayed finite), else None.
    """

    framework: str
    found: bool
    layer: str | None = None
    layer_type: str | None = None
    phase: str | None = None
    nan_count: int | None = None
    inf_count: int | None = None
    inputs_finite: bool | None = None
    inputs_absmax: float | None = None
    params_finite: bool | None = None
    params_absmax: float | None = None
    nonfinite_params: tuple[str, ...] = ()
    grad_output_finite: bool | None = None
    grad_output_absmax: float | None = None
    layers_checked: int = 0
    backward_checked: bool = False
    inf_layer: str | None = None
    inf_layer_type: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        passes = "forward and backward" if self.backward_checked else "forward"
        end = "the loss" if self.backward_checked else "the model's output"
        if not self.found:
            if self.inf_layer is None:
                return (
                    f"locate_nonfinite ({self.framework}): no NaN or inf in the {passes} "
                    f"pass of {self.layers_checked} layer call(s)."
                )
            return (
                f"locate_nonfinite ({self.framework}): no NaN in the {passes} pass of "
                f"{self.layers_checked} layer call(s), and no inf reaching {end}; "
                f"{self._inf_at()} output inf in the forward pass ({end} stayed finite)."
            )
        what = "output" if self.phase == "forward" else "gradient"
        lines = [
            f"locate_nonfinite ({self.framework}): first non-finite {what} in the "
            f"{self.phase} pass at layer {self.layer or '<model>'!r} ({self.layer_type}): "
            f"{self.nan_count} nan, {self.inf_count} inf.",
            f"  inputs: {_state(self.inputs_finite, self.inputs_absmax)}",
            f"  parameters: {_state(self.params_finite, self.params_absmax)}"
            + (
                f" ({', '.join(self.nonfinite_params)})"
                if self.nonfinite_params and self.phase == "forward"
                else ""
            ),
        ]
        if self.phase == "backward":
            lines.append(
                "  incoming gradient: " + _state(self.grad_output_finite, self.grad_output_absmax)
            )
            if self.nonfinite_params:
                lines.append(
                    f"  non-finite parameter gradients: {', '.join(self.nonfinite_params)}"
                )
        if self.inf_layer is not None:
            what = (
                f"forward inf, not the fault ({end} stayed finite)"
                if self.phase == "backward"
                else "earlier forward inf, not this fault's cause"
            )
            lines.append(f"  {what}: first at {self._inf_at()}")
        return "\n".join(lines)

    def _inf_at(self) -> str:
        return f"layer {self.inf_layer or '<model>'!r} ({self.inf_layer_type})"


def _state(finite: bool | None, value: float | None) -> str:
    if finite is None:
        return "none"
    return f"{'finite' if finite else 'NOT finite'}, abs max {value:.6g}"


def summarise(
    be: Backend,
    calls: list[LayerCall],
    *,
    backward_checked: bool,
    counts: Any,
    param_paths: Any = None,
    framework: str | None = None,
    fill: Any = None,
) -> LocateReport:
    """Read every call's maxima in one transfer and report the first bad layer.

    Where a non-finite value was born (``_Forward.born``): the call that FINISHED first
    with a non-finite output (a sub-layer finishes before its parent, so the innermost
    culprit wins); when its inputs are non-finite already, the enclosing call whose own code
    made them. The forward fault (``_Forward.fault``): the first NaN, when it was born in a
    call from finite inputs (or, when that call's own code turned an inf made inside it into
    NaN, where that inf was born); else where the first non-finite value was born, when it
    is a NaN made from an inf input or when the end result (the loss; the model's output
    without one) is not finite. An inf that reached neither (a ``-inf`` mask) is no fault:
    the backward pass is examined, and the report names where that inf was born
    (``inf_layer``). Backward (only without a forward fault): the call earliest in the
    backward pass whose own gradients (w.r.t. its inputs or own parameters) are non-finite,
    a ``shared`` parameter's total gradient counting only when no call is found so;
    when the gradient it received is non-finite already, the enclosing call whose own code
    made it (``_backward_fault``).
    ``counts(call, phase) -> (nan, inf)`` and ``param_paths(call) -> names`` give the
    details of the chosen call only; ``fill(call, phase)`` sets maxima an adapter computes
    only for the calls these rules read (inputs, parameters, incoming gradient; backward:
    own parameter gradients), each at most once per phase.
    The maxima may already be on the host (Python floats or NumPy, with ``be`` the numpy
    backend and ``framework`` set).
    """
    host = _read_all(be, calls)
    forward = _Forward(be, calls, host, fill)
    born = forward.born(_bad, calls)
    fault = forward.fault(born)
    base = {"framework": framework or be.name, "layers_checked": len(calls)}
    if born is not None and fault is not born:
        base.update(inf_layer=born.name, inf_layer_type=born.kind)
    if fault is not None:
        h = forward.maxima(fault)
        return _report(fault, h, "forward", base, backward_checked, counts, param_paths)
    made = _backward_fault(be, calls, host, fill)
    if made is None:
        return LocateReport(found=False, backward_checked=backward_checked, **base)
    call, h = made
    return _report(call, h, "backward", base, backward_checked, counts, param_paths)


def backward_needed(calls: list[LayerCall]) -> bool:
    """Whether ``summarise`` looks at the backward pass, from the calls' output maxima on
    the host: no NaN output, and the end result (the call that finished last: the loss, or
    the model) finite. An adapter that finds gradients lazily asks this first."""
    if not calls or any(_nan(c.outputs) for c in calls):
        return False
    return not _bad(max(calls, key=lambda c: c.end).outputs)


class _Forward:
    """The forward rules of ``summarise`` over the calls' maxima (``host``), each call's
    inputs filled once, when a rule first reads them (``fill``)."""

    def __init__(self, be: Backend, calls: list, host: list, fill: Any) -> None:
        self.be, self.calls, self.fill = be, calls, fill
        self.host = {id(c): h for c, h in zip(calls, host, strict=True)}
        self.filled: set[int] = set()

    def maxima(self, call: LayerCall) -> dict:
        if id(call) not in self.filled:
            self.filled.add(id(call))
            self.host[id(call)] = _filled(self.be, call, self.host[id(call)], "forward", self.fill)
        return self.host[id(call)]

    def fault(self, born: LayerCall | None) -> LayerCall | None:
        """The forward pass's fault, None when it has none (see ``summarise``); ``born``:
        where its first non-finite value was born."""
        if born is None:
            return None
        nan = self.born(_nan, self.calls)
        if nan is not None:
            if _bad(self.maxima(nan)["inputs"]):  # a NaN made from an inf it received
                return born
            # born in ``nan``'s own code, from finite values or from an inf made there
            # (by its sub-layers or its own code): where that inf was born
            inner = [c for c in self.calls if nan.start <= c.start and c.end <= nan.end]
            return self.born(_bad, inner)
        last = max(self.calls, key=lambda c: c.end)
        return born if _bad(self.host[id(last)]["outputs"]) else None

    def born(self, bad: Any, calls: list) -> LayerCall | None:
        """Where the first output among ``calls`` that is ``bad`` (non-finite, or NaN) was
        born: the call that finished first with one; when its inputs are ``bad`` already,
        no earlier call's output made them: the call whose own code made them, between
        sub-layers, the innermost enclosing call (started before it, finished after it)
        whose own inputs are not ``bad`` (or not floating: token ids). When no enclosing
        call received such inputs (the model's inputs were ``bad``), it stays. None when no
        output is ``bad``."""
        found = [c for c in calls if bad(self.host[id(c)]["outputs"])]
        if not found:
            return None
        first = min(found, key=lambda c: c.end)
        if not bad(self.maxima(first)["inputs"]):
            return first
        enclosing = [c for c in calls if c.start < first.start and c.end > first.end]
        for parent in sorted(enclosing, key=lambda c: -c.start):  # innermost first
            if not bad(self.maxima(parent)["inputs"]):  # (no floating inputs: token ids)
                return parent
        return first


def _backward_fault(
    be: Backend, calls: list[LayerCall], host: list, fill: Any
) -> tuple[LayerCall, dict] | None:
    """The backward fault and its maxima (None when the backward pass is clean): ``first``,
    the call earliest in the backward pass (smallest ``backward``) whose own input gradient
    is non-finite, or whose own parameter gradient is and that is not ``shared``
    (``backward_bad``). Only when no call is found so, a ``shared`` call's non-finite
    parameter gradient counts too (the total over every use of the parameter: tied weights,
    a layer called twice; the call earliest in the backward pass is named). When the
    gradient ``first`` received (w.r.t. its outputs) is finite, its own code made the
    non-finite value: ``first``. Otherwise no call earlier in the backward pass made it
    (their own gradients are finite), so the code of a call enclosing ``first`` did,
    between its sub-layers: the innermost call that started before ``first``, finished
    after it and received a finite gradient (or none: outputs no gradient reaches), as the
    forward rule's parent (``_Forward.born``). If none did, the outermost enclosing call
    (the model itself, ``""``), else ``first``. Only the examined calls are filled
    (``fill(call, "backward")``), innermost first."""
    by_id = {id(c): h for c, h in zip(calls, host, strict=True)}
    reached = [c for c in calls if c.backward is not None]
    bwd = [
        c
        for c in reached
        if backward_bad(c, by_id[id(c)]["grad_inputs"], by_id[id(c)]["grad_params"])
    ]
    if not bwd:  # a shared parameter's total gradient, where nothing else explains it
        bwd = [c for c in reached if _bad(by_id[id(c)]["grad_params"])]
    if not bwd:
        return None
    first = min(bwd, key=lambda c: c.backward)
    filled: dict[int, dict] = {}

    def maxima(call: LayerCall) -> dict:
        if id(call) not in filled:
            filled[id(call)] = _filled(be, call, by_id[id(call)], "backward", fill)
        return filled[id(call)]

    if not _bad(maxima(first)["grad_outputs"]):
        return first, maxima(first)
    enclosing = [c for c in calls if c.start < first.start and c.end > first.end]
    enclosing.sort(key=lambda c: -c.start)  # innermost first
    for parent in enclosing:
        if not _bad(maxima(parent)["grad_outputs"]):
            return parent, maxima(parent)
    call = enclosing[-1] if enclosing else first
    return call, maxima(call)


def _filled(be: Backend, call: LayerCall, h: dict, phase: str, fill: Any) -> dict:
    if fill is None:
        return h
    fill(call, phase)
    return _read_all(be, [call])[0]


def _bad(value: float | None) -> bool:
    return value is not None and not math.isfinite(value)


def _nan(value: float | None) -> bool:
    """A group's abs max is NaN exactly when the group holds a NaN (a max propagates it)."""
    return value is not None and math.isnan(value)


def _read_all(be: Backend, calls: list[LayerCall]) -> list[dict[str, float | None]]:
    slots = [(i, f, getattr(c, f)) for i, c in enumerate(calls) for f in _FIELDS]
    host: list[dict[str, float | None]] = [dict.fromkeys(_FIELDS) for _ in calls]
    present = []
    for i, f, x in slots:
        if isinstance(x, float):  # already on the host
            host[i][f] = x
        elif x is not None:
            present.append((i, f, x))
    if not present:
        return host
    wide = "float64" if any(be.dtype_name(x) == "float64" for _, _, x in present) else "float32"
    values = be.to_numpy(be.stack([be.cast(x, wide) for _, _, x in present])).tolist()
    for (i, f, _), value in zip(present, values, strict=True):
        host[i][f] = float(value)
    return host


def _report(call, h, phase, base, backward_checked, counts, param_paths) -> LocateReport:
    nan, inf = counts(call, phase)
    params_bad = _bad(h["params"]) or (phase == "backward" and _bad(h["grad_params"]))
    return LocateReport(
        found=True,
        layer=call.name,
        layer_type=call.kind,
        phase=phase,
        nan_count=int(nan),
        inf_count=int(inf),
        inputs_finite=None if h["inputs"] is None else not _bad(h["inputs"]),
        inputs_absmax=h["inputs"],
        params_finite=None if h["params"] is None else not _bad(h["params"]),
        params_absmax=h["params"],
        nonfinite_params=tuple(param_paths(call, phase)) if params_bad and param_paths else (),
        grad_output_finite=None
        if phase == "forward" or h["grad_outputs"] is None
        else not _bad(h["grad_outputs"]),
        grad_output_absmax=None if phase == "forward" else h["grad_outputs"],
        backward_checked=backward_checked,
        **base,
    )
