"""Per-framework test adapters: move NumPy data in and out, differentiate, compile.

This is test infrastructure, not library code: each framework spells gradients and
compilation its own way, and the suite needs exactly three verbs from each.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


class Harness:
    """Adapter for one backend on one device. ``compiled`` selects jit / tf.function /
    torch.compile; the numpy backend has neither gradients nor a compiler."""

    name = "abstract"
    can_compile = True
    has_gradients = True

    def __init__(self, device: str = "cpu"):
        self.device = device

    def asarray(self, x: np.ndarray, dtype: str | None = None):
        raise NotImplementedError

    def numpy(self, x) -> np.ndarray:
        """A float64 (or integer) NumPy copy of a backend array."""
        raise NotImplementedError

    def value_and_grad(self, fn: Callable, x, compiled: bool):
        """(fn(x), d fn / d x) as NumPy arrays, for a scalar-valued fn."""
        raise NotImplementedError

    def call(self, fn: Callable, compiled: bool, *args):
        raise NotImplementedError

    def call_leaves(self, fn: Callable, compiled: bool, *args) -> list:
        """fn(*args) (compiled when asked), its result flattened to NumPy leaves."""
        from numstab.tree import flatten

        compiled_fn = self._compiled(fn) if compiled else fn
        return [None if x is None else self.numpy(x) for x in flatten(compiled_fn(*args))[0]]

    def _compiled(self, fn: Callable) -> Callable:
        raise NotImplementedError

    def _to64(self, x):
        x = np.asarray(x)
        return x.astype(np.float64) if x.dtype.kind == "f" or x.dtype.name == "bfloat16" else x


class NumpyHarness(Harness):
    name = "numpy"
    can_compile = False
    has_gradients = False

    def asarray(self, x, dtype=None):
        if dtype == "bfloat16":
            import ml_dtypes

            return np.asarray(x).astype(ml_dtypes.bfloat16)
        return np.asarray(x, dtype=dtype)

    def numpy(self, x):
        return self._to64(x)

    def value_and_grad(self, fn, x, compiled):
        return self.numpy(fn(x)), None

    def call(self, fn, compiled, *args):
        return self.numpy(fn(*args))


class TorchHarness(Harness):
    name = "torch"

    def __init__(self, device="cpu"):
        super().__init__(device)
        import torch

        self.torch = torch
        self.torch_device = torch.device("cuda" if device == "gpu" else "cpu")
        if device == "gpu":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False

    def asarray(self, x, dtype=None):
        x = np.asarray(x)
        t = self.torch.from_numpy(x.astype(np.float64) if x.dtype.kind == "f" else x)
        if dtype is not None:
            t = t.to(getattr(self.torch, dtype))
        return t.to(self.torch_device)

    def numpy(self, x):
        x = x.detach().cpu()
        return self._to64(x.double().numpy() if x.is_floating_point() else x.numpy())

    def _compile(self, fn, compiled):
        # aot_eager traces through Dynamo and AOTAutograd (the paths that break on graph-
        # unfriendly code) without the minutes of C++ compilation inductor needs on CPU.
        # Dynamo caches per code object and silently falls back to eager past its recompile
        # limit; a reset per compiled call keeps every "compiled" test really compiled.
        if not compiled:
            return fn
        self.torch._dynamo.reset()
        backend = os.environ.get("NUMSTAB_TEST_TORCH_COMPILER", "aot_eager")
        return self.torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)

    def _compiled(self, fn):
        return self._compile(fn, True)

    def value_and_grad(self, fn, x, compiled):
        x = x.detach().clone().requires_grad_(True)
        out = self._compile(fn, compiled)(x)
        (grad,) = self.torch.autograd.grad(out, x, allow_unused=False)
        return self.numpy(out), self.numpy(grad)

    def call(self, fn, compiled, *args):
        return self.numpy(self._compile(fn, compiled)(*args))


class JaxHarness(Harness):
    name = "jax"

    def __init__(self, device="cpu"):
        super().__init__(device)
        import jax

        self.jax = jax
        self.jax_device = jax.devices("gpu" if device == "gpu" else "cpu")[0]
        jax.config.update("jax_default_matmul_precision", "highest")

    def asarray(self, x, dtype=None):
        x = np.asarray(x)
        if dtype is not None:
            x = self.jax.numpy.asarray(x.astype(np.float32) if x.dtype.kind == "f" else x)
            x = x.astype(dtype)
        return self.jax.device_put(x, self.jax_device)

    def numpy(self, x):
        return self._to64(np.asarray(x))

    def _compiled(self, fn):
        return self.jax.jit(fn)

    def value_and_grad(self, fn, x, compiled):
        vg = self.jax.value_and_grad(fn)
        out, grad = (self.jax.jit(vg) if compiled else vg)(x)
        return self.numpy(out), self.numpy(grad)

    def call(self, fn, compiled, *args):
        return self.numpy((self.jax.jit(fn) if compiled else fn)(*args))


class TensorflowHarness(Harness):
    name = "tensorflow"

    def __init__(self, device="cpu"):
        super().__init__(device)
        import tensorflow as tf

        self.tf = tf
        tf.config.experimental.enable_tensor_float_32_execution(False)
        self.tf_device = "/GPU:0" if device == "gpu" else "/CPU:0"

    def asarray(self, x, dtype=None):
        x = np.asarray(x)
        with self.tf.device(self.tf_device):
            t = self.tf.constant(x.astype(np.float64) if x.dtype.kind == "f" else x)
            return self.tf.cast(t, dtype) if dtype is not None else t

    def numpy(self, x):
        if x.dtype.is_floating:
            x = self.tf.cast(x, self.tf.float64)
        return self._to64(x.numpy())

    def _compiled(self, fn):
        return self.tf.function(fn)

    def value_and_grad(self, fn, x, compiled):
        tf = self.tf

        def vg(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                out = fn(x)
            return out, tape.gradient(out, x)

        with tf.device(self.tf_device):
            out, grad = (tf.function(vg) if compiled else vg)(x)
        return self.numpy(out), self.numpy(grad)

    def call(self, fn, compiled, *args):
        with self.tf.device(self.tf_device):
            return self.numpy((self.tf.function(fn) if compiled else fn)(*args))


HARNESSES = {h.name: h for h in (NumpyHarness, TorchHarness, JaxHarness, TensorflowHarness)}
