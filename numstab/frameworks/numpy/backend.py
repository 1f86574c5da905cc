"""The NumPy backend: the readable reference every other backend is tested against."""

from __future__ import annotations

import numpy as np

from numstab.backends._base import Backend, numpy_dtype_name


def _dtype(name: str | None):
    if name == "bfloat16":
        import ml_dtypes  # ships with jax and tensorflow; needed only for bfloat16 arrays

        return ml_dtypes.bfloat16
    return name


class NumpyBackend(Backend):
    name = "numpy"

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

    def reshape(self, x, shape):
        return np.reshape(x, shape)

    def moveaxis(self, x, source, destination):
        return np.moveaxis(x, source, destination)

    def unflatten_rows(self, rows, like):
        return np.reshape(rows, np.shape(like)[:-1])

    def arange(self, n, like=None):
        return np.arange(n)

    def is_tracing(self, x):
        return False

    def float_errors_ignored(self):
        return np.errstate(all="ignore")

    def where(self, condition, x, y):
        return np.where(condition, x, y)

    def exp(self, x):
        return np.exp(x)

    def step_toward_zero(self, x):
        return (x.view(np.int16) - np.int16(1)).view(x.dtype)

    def log(self, x):
        return np.log(x)

    def isfinite(self, x):
        return np.isfinite(x)

    def abs(self, x):
        return np.abs(x)

    def sqrt(self, x):
        return np.sqrt(x)

    def maximum(self, x, y):
        return np.maximum(x, y)

    def clip(self, x, low, high):
        return np.clip(x, low, high)

    def all(self, x):
        return np.all(x)

    def stack(self, arrays):
        return np.stack(arrays)

    def sum(self, x, axis=None, keepdims=False):
        return np.sum(x, axis=axis, keepdims=keepdims)

    def max(self, x, axis=None, keepdims=False):
        return np.max(x, axis=axis, keepdims=keepdims)

    def any(self, x):
        return bool(np.any(x))

    def take_rows(self, x, index):
        return np.take_along_axis(x, index[:, None], axis=-1)[:, 0]

    def gather(self, vector, index):
        return vector[index]

    # -- schedules and adaptive clipping --
    def cos(self, x):
        return np.cos(x)

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
