"""Normalised op names: each framework's spelling of an op mapped to one short kind.

``op_kind("aten.log.default") == op_kind("Log") == op_kind("log") == "log"``; backward
functions map to their forward op (``"SqrtBackward0"`` and TensorFlow's ``"SqrtGrad"`` give
``"sqrt"``). Unknown names give ``None``.
"""

from __future__ import annotations

import re

from numstab.errors import NonFiniteError

#: squashed name (lower case, no separators, no version or backward suffix) -> kind
KINDS: dict[str, str] = {
    **dict.fromkeys(["log", "log1p", "log2", "log10", "xlogy"], "log"),
    **dict.fromkeys(["sqrt"], "sqrt"),
    **dict.fromkeys(["rsqrt"], "rsqrt"),
    **dict.fromkeys(
        ["div", "divide", "truediv", "truedivide", "realdiv", "divnonan", "floordiv"], "div"
    ),
    **dict.fromkeys(["reciprocal", "inv"], "reciprocal"),
    **dict.fromkeys(["exp", "expm1", "exp2"], "exp"),
    **dict.fromkeys(
        [
            "mm",
            "bmm",
            "addmm",
            "baddbmm",
            "matmul",
            "batchmatmul",
            "dotgeneral",
            "dot",
            "einsum",
            "linear",
            "addmv",
            "mv",
        ],
        "matmul",
    ),
    **dict.fromkeys(["sub", "rsub", "subtract"], "sub"),
    **dict.fromkeys(["add", "addn"], "add"),
    **dict.fromkeys(["mul", "multiply"], "mul"),
    **dict.fromkeys(["pow", "power", "square", "integerpow"], "pow"),
    **dict.fromkeys(["softmax", "softmaxbackwarddata"], "softmax"),
    **dict.fromkeys(["logsoftmax"], "log_softmax"),
    **dict.fromkeys(["logsumexp", "reducelogsumexp"], "logsumexp"),
    **dict.fromkeys(["sum", "reducesum"], "sum"),
    **dict.fromkeys(["mean", "reducemean"], "mean"),
    **dict.fromkeys(["cast", "convertelementtype", "tocopy", "to", "astype", "deviceput"], "cast"),
    **dict.fromkeys(["tanh"], "tanh"),
    **dict.fromkeys(["sigmoid", "logistic"], "sigmoid"),
    **dict.fromkeys(["convolution", "conv2d", "conv", "convgeneraldilated"], "conv"),
}

_SUFFIX = re.compile(r"(backward\d*|grad|v\d+)$")


def op_kind(name: str | None) -> str | None:
    """The normalised kind of a framework op name, or None if it is not in ``KINDS``."""
    if not name:
        return None
    base = str(name)
    if base.startswith("aten"):  # "aten.log.default", "aten::div.Tensor"
        base = base.replace("::", ".").split(".")[1]
    squashed = re.sub(r"[^a-z0-9]", "", base.lower())
    for _ in range(3):  # "SqrtGrad", "BatchMatMulV2", "MmBackward0"
        if squashed in KINDS:
            return KINDS[squashed]
        stripped = _SUFFIX.sub("", squashed)
        if stripped == squashed:
            break
        squashed = stripped
    return KINDS.get(squashed)


#: a terminal colour or style code, as Keras wraps a re-raised message (``\x1b[1m...\x1b[0m``)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def strip_ansi(text: str) -> str:
    """``text`` without ANSI colour and style codes (``ESC [ <digits and ;> m``), before any
    framework message is parsed: Keras's ``\x1b[0m`` was read as part of an op's name."""
    return _ANSI.sub("", text)


def floating_point_match(exc: BaseException, pattern: re.Pattern) -> tuple[str, ...] | None:
    """The groups of ``pattern`` in a ``FloatingPointError``'s message (what the NumPy and
    JAX checkers raise; ANSI codes stripped), or None for any other exception or message."""
    if not isinstance(exc, FloatingPointError):
        return None
    match = pattern.search(strip_ansi(str(exc)))
    return None if match is None else match.groups()


def _message(exc: BaseException) -> str:
    """An exception's own message, as Keras reads it to re-create one: a TensorFlow
    ``OpError``'s ``message``, else the first argument."""
    message = getattr(exc, "message", None)
    if isinstance(message, str):
        return message
    return str(exc.args[0]) if exc.args else ""


def original_exception(exc: BaseException) -> BaseException:
    """The exception a wrapper re-created, else ``exc``. Keras's layer call
    (``inject_argument_info_in_traceback``) catches an exception ``e`` and raises
    ``e.__class__(message)`` ``from None``, the message wrapped in ANSI codes and followed
    by the call's arguments: a ``NonFiniteError`` lost every attribute, a JAX or TensorFlow
    message its form. Recognised as: raised ``from None`` while handling ``e``, of
    ``e``'s class (or marked by Keras), its message holding ``e``'s (ANSI codes stripped);
    followed inward, at most 8 times. Anything else is returned as it is."""
    for _ in range(8):
        inner = exc.__context__
        if inner is None or not exc.__suppress_context__ or exc.__cause__ is not None:
            break
        if type(exc) is not type(inner) and not getattr(exc, "_keras_call_info_injected", 0):
            break
        text = strip_ansi(_message(inner))
        if not text or text not in strip_ansi(_message(exc)):
            break
        exc = inner
    return exc


def op_error(
    framework: str,
    op: str | None,
    *,
    produced: str,
    phase: str,
    where: str | None,
    detail: str | None = None,
    nan_count: int | None = None,
    inf_count: int | None = None,
    kind: str | None = None,
) -> NonFiniteError:
    """The one NonFiniteError of op mode, worded the same for every framework:
    ``check_numerics: <framework> <op> produced <what> in the <phase> pass at <where> (...)``."""
    return NonFiniteError(
        f"check_numerics: {framework} {op or 'an op'} produced {produced} in the {phase} pass"
        + (f" at {where}" if where else "")
        + (f" ({detail})" if detail else "")
        + ".",
        framework=framework,
        op=op,
        op_kind=kind or (op_kind(op) if op else None),
        phase=phase,
        where=where,
        nan_count=nan_count,
        inf_count=inf_count,
    )
