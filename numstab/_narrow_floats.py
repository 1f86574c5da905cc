"""8-bit and narrower floats in the functions that only read finiteness (``all_finite``,
``find_nonfinite``, ``check_numerics``, ``locate_nonfinite``).

float8 values (e4m3fn, e5m2, their fnuz variants, e8m0fnu) are read upcast to float32: every
one of them is a float32 value, NaN stays NaN and inf stays inf, so the answer is exact, and
no framework has finiteness kernels for them (torch: "aminmax_cpu" / "isinf" not
implemented; TensorFlow: no ``IsFinite`` for them; JAX: no implicit promotion). float6 and
float4 formats (e2m3fn, e3m2fn, e2m1fn) hold neither NaN nor inf: they cannot be
non-finite and are skipped, as integers are (torch's packed ``float4_e2m1fn_x2`` cannot even
be cast).
"""

from __future__ import annotations

from typing import Any

from numstab import _validate as v
from numstab.backends._base import Backend


def holds_nonfinite(dtype: str) -> bool:
    """Whether a narrow float dtype has a NaN or inf encoding (float8 does; float6/4 not)."""
    return dtype.startswith("float8_")


def readable(be: Backend, leaves: list[Any]) -> list[Any]:
    """``leaves`` with each float8 leaf upcast to float32 and each float6/float4 leaf
    dropped; the other leaves are passed on as they are."""
    out = []
    for x in leaves:
        dtype = be.dtype_name(x)
        if not v.is_narrow_float(dtype):
            out.append(x)
        elif holds_nonfinite(dtype):
            out.append(be.cast(x, "float32"))
    return out
