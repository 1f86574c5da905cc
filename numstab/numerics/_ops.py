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


def floating_point_match(exc: BaseException, pattern: re.Pattern) -> tuple[str, ...] | None:
    """The groups of ``pattern`` in a ``FloatingPointError``'s message (what the NumPy and
    JAX checkers raise), or None for any other exception or message."""
    if not isinstance(exc, FloatingPointError):
        return None
    match = pattern.search(str(exc))
    return None if match is None else match.groups()


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
