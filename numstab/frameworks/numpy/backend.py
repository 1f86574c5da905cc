"""The NumPy backend: the readable reference every other backend is tested against."""

from __future__ import annotations

import numpy as np

from numstab.backends._base import numpy_dtype_name
from numstab.backends._namespace import NamespaceBackend


def _dtype(name: str | None):
    if name == "bfloat16":
        import ml_dtypes  # ships with jax and tensorflow; needed only for bfloat16 arrays

        return ml_dtypes.bfloat16
    return name


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
        return np.asarray(x).astype(_dtype(dtype), copy=False)

    def shape(self, x):
        return np.shape(x)

    def arange(self, n, like=None):
        return np.arange(n)

    def is_tracing(self, x):
        return False

    def float_errors_ignored(self):
        return np.errstate(all="ignore")

    def step_toward_zero(self, x):
        return (x.view(np.int16) - np.int16(1)).view(x.dtype)

    def where(self, condition, x, y):
        # a Python number takes the other side's dtype (NEP 50), which bfloat16 arrays get
        # only from ml_dtypes >= 0.7: with 0.5 the result was float64
        if isinstance(y, int | float) and isinstance(x, np.ndarray | np.generic):
            y = np.asarray(y, x.dtype)
        elif isinstance(x, int | float) and isinstance(y, np.ndarray | np.generic):
            x = np.asarray(x, y.dtype)
        return np.where(condition, x, y)

    # -- fused cross-entropy --
    def matmul(self, a, b, transpose_a=False, transpose_b=False):
        return np.matmul(a.T if transpose_a else a, b.T if transpose_b else b)

    def concat(self, arrays):
        return np.concatenate(arrays)

    def add_at_rows(self, x, index, values):
        x[np.arange(x.shape[0]), index] += values
        return x

    # -- data firewall --
    def compress(self, x, keep, axis):
        return np.compress(keep, x, axis=axis)


BACKEND = NumpyBackend()
