"""The NumPy backend: the readable reference every other backend is tested against."""

from __future__ import annotations

import numpy as np

from numstab.backends._base import numpy_dtype_name
from numstab.backends._namespace import FORWARDED, NamespaceBackend


def _dtype(name: str | None):
    if name is not None and not hasattr(np, name):  # bfloat16, float8_e4m3fn, ...
        import ml_dtypes  # ships with jax and tensorflow; needed only for these arrays

        return getattr(ml_dtypes, name)
    return name


#: dtype name -> NumPy dtype, filled on first use (builtin dtypes are singletons, so ``is``
#: tells a cast that has nothing to do)
_DTYPES: dict[str, np.dtype] = {}
_NUMBERS = (int, float)
_ARRAYS = (np.ndarray, np.generic)


class NumpyBackend(NamespaceBackend):
    name = "numpy"
    xp = np

    def asarray(self, x, dtype=None, like=None):
        return np.asarray(x, dtype=_dtype(dtype))

    def to_numpy(self, x):
        x = np.asarray(x)
        return x.astype(np.float32) if x.dtype.name == "bfloat16" else x

    def dtype_name(self, x):
        return numpy_dtype_name(np.asarray(x).dtype)

    def cast(self, x, dtype):
        # the guard's host decision casts ~25 0-d arrays a step, most already of ``dtype``
        target = _DTYPES.get(dtype)
        if target is None:
            target = _DTYPES[dtype] = np.dtype(_dtype(dtype))
        x = x if type(x) is np.ndarray else np.asarray(x)
        return x if x.dtype is target else x.astype(target)

    def shape(self, x):
        return np.shape(x)

    def is_tracing(self, x):
        return False

    def float_errors_ignored(self):
        return np.errstate(all="ignore")

    def bitcast(self, x, dtype):
        return x.view(_dtype(dtype))

    def sum(self, x, axis=None, keepdims=False):
        return np.add.reduce(x, axis=axis, keepdims=keepdims)  # np.sum's work, less wrapping

    def where(self, condition, x, y):
        # a Python number takes the other side's dtype (NEP 50), which bfloat16 arrays get
        # only from ml_dtypes >= 0.7: with 0.5 the result was float64
        if isinstance(y, _NUMBERS) and isinstance(x, _ARRAYS):
            y = np.asarray(y, x.dtype)
        elif isinstance(x, _NUMBERS) and isinstance(y, _ARRAYS):
            x = np.asarray(x, y.dtype)
        return np.where(condition, x, y)

    # -- fused cross-entropy --
    def add_at_rows(self, x, index, values):
        x[np.arange(x.shape[0]), index] += values
        return x

    def clip(self, x, low, high):
        if x.dtype.kind == "f":  # NumPy's own floats: one pass, dtype kept
            return np.clip(x, low, high)
        # bfloat16 (ml_dtypes) has no clip loop: np.clip computed it in float32
        return np.minimum(np.maximum(x, low), high)

    # -- data firewall --
    def compress(self, x, keep, axis):
        return np.compress(keep, x, axis=axis)


# NumPy's own functions as the primitives (no forwarding call: the guard's host decision
# calls some 50 primitives a step, each a few microseconds of NumPy on 0-d arrays)
for _name in FORWARDED:
    if _name not in vars(NumpyBackend):
        setattr(NumpyBackend, _name, staticmethod(getattr(np, _name)))

BACKEND = NumpyBackend()
