"""How the functions that only read finiteness (``all_finite``, ``find_nonfinite``,
``check_numerics``, ``locate_nonfinite``) read the dtypes numstab does not compute in.

- float8 values (e4m3fn, e5m2, their fnuz variants, e8m0fnu) are read upcast to float32:
  every one of them is a float32 value, NaN stays NaN and inf stays inf, so the answer is
  exact, and no framework has finiteness kernels for them (torch: "aminmax_cpu" / "isinf"
  not implemented; TensorFlow: no ``IsFinite`` for them; JAX: no implicit promotion).
- float6 and float4 formats (e2m3fn, e3m2fn, e2m1fn) hold neither NaN nor inf: they cannot
  be non-finite and are skipped, as integers are (torch's packed ``float4_e2m1fn_x2`` cannot
  even be cast).
- complex values are read as their real and imaginary parts (``Backend.real_view``): a
  complex element is finite when both parts are, as NumPy's ``isfinite`` says.
"""

from __future__ import annotations

from typing import Any

from numstab import _validate as v
from numstab.backends._base import Backend


def holds_nonfinite(dtype: str) -> bool:
    """Whether a dtype numstab does not compute in has a NaN or inf encoding: float8 and
    complex do, float6/float4 not."""
    return dtype.startswith("float8_") or v.is_complex(dtype)


def is_readable(dtype: str) -> bool:
    """A dtype whose finiteness these functions read: the floats and complex."""
    return v.is_floating(dtype) or v.is_narrow_float(dtype) or v.is_complex(dtype)


def read_as(be: Backend, x: Any, dtype: str) -> Any:
    """``x`` (of ``dtype``, a floating or ``holds_nonfinite`` one) as a real floating array
    holding the same non-finite values: float8 upcast to float32, complex as its
    ``real_view`` (..., 2), any other as it is; a torch nested tensor as its elements, flat."""
    x = be.elements(x)
    if v.is_complex(dtype):
        return be.real_view(x)
    return be.cast(x, "float32") if dtype.startswith("float8_") else x


def readable(be: Backend, leaves: list[Any]) -> list[Any]:
    """``leaves`` as ``read_as`` reads them, each float6/float4 leaf dropped."""
    out = []
    for x in leaves:
        dtype = be.dtype_name(x)
        if v.is_floating(dtype) or holds_nonfinite(dtype):
            out.append(read_as(be, x, dtype))
    return out
