"""NumPy machinery for ``check_numerics``.

- ``mode="op"``: ``np.errstate`` with ``invalid="raise"`` (NaN created: 0/0, log(-1),
  inf - inf) when ``nan``, and ``divide="raise"``, ``over="raise"`` (inf created: 1/0,
  overflow) when ``inf``; underflow is ignored. IEEE flags are only raised where a NaN or inf
  is *created*: a NaN that is already in an input passes through silently (NumPy has no
  hook for that; ``watch`` the inputs).
- ``mode="sentinel"``: ``watch`` computes the summary at once (NumPy is on the host).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import numpy as np

from numstab.errors import NonFiniteError
from numstab.numerics import _where
from numstab.numerics._ops import floating_point_match, op_error

_MESSAGE = re.compile(r"(invalid value|divide by zero|overflow) encountered in (\w+)")


class Arm:
    """NumPy's part of one active ``check_numerics`` context."""

    def __init__(self, settings, recorder) -> None:
        self.settings = settings
        self._errstate: Any = None

    def enter(self) -> None:
        if self.settings.mode != "op":
            return
        on_inf = "raise" if self.settings.inf else "ignore"
        self._errstate = np.errstate(
            invalid="raise" if self.settings.nan else "ignore",
            divide=on_inf,
            over=on_inf,
            under="ignore",
        )
        self._errstate.__enter__()

    def exit(self) -> None:
        if self._errstate is not None:
            self._errstate.__exit__(None, None, None)
            self._errstate = None

    def convert(self, exc: BaseException) -> NonFiniteError | None:
        groups = floating_point_match(exc, _MESSAGE)
        if groups is None:
            return None
        what, op = groups
        where = _where.from_traceback(exc.__traceback__)
        produced = "NaN" if what == "invalid value" else "inf"
        return op_error("numpy", op, produced=produced, phase="forward", where=where, detail=what)


def summarize(leaves: list) -> Any:
    """(has_nan, has_inf) over ``leaves`` (host data: NumPy arrays, Python and NumPy
    scalars), read element by element: exact, a finite value is never reported (no sum that
    could overflow). ml_dtypes' bfloat16 and float8 (NumPy kind "V") are read upcast to
    float32 (exact); integer, bool and float6/float4 values cannot be non-finite."""
    flags = np.zeros(2, bool)
    with np.errstate(all="ignore"):
        for x in leaves:
            x = np.asarray(x)
            if x.dtype.kind not in "fc":
                if x.dtype.kind != "V" or not x.dtype.name.startswith(("bfloat", "float8_")):
                    continue
                x = x.astype(np.float32)
            if not np.isfinite(x).all():
                flags |= (bool(np.isnan(x).any()), bool(np.isinf(x).any()))
    return flags


def quiet() -> contextlib.AbstractContextManager:
    """``summarize`` raises nothing under ``errstate``: nothing to switch off."""
    return contextlib.nullcontext()


def read_summaries(summaries: list) -> list[tuple[bool, bool]]:
    return [(bool(s[0]), bool(s[1])) for s in summaries]
