"""JAX for the benchmark: the model's ops, jax.value_and_grad, jax.jit, memory stats."""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from numstab.bench.errors import FrameworkSetupError

name = "jax"
_device = None


def setup(device: str) -> None:
    global _device
    if device == "gpu":
        try:
            _device = jax.devices("gpu")[0]
        except RuntimeError as exc:
            raise FrameworkSetupError(f"jax sees no GPU ({exc})") from exc
    else:
        _device = jax.devices("cpu")[0]


def versions() -> dict[str, str]:
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}


def device_name() -> str:
    return str(_device)


class ops:
    cast = staticmethod(lambda x, dtype: x.astype(dtype))
    take = staticmethod(lambda table, ids: jnp.take(table, ids, axis=0))
    matmul = staticmethod(jnp.matmul)
    reshape = staticmethod(jnp.reshape)
    transpose = staticmethod(jnp.transpose)
    mean = staticmethod(lambda x: jnp.mean(x, axis=-1, keepdims=True))
    rsqrt = staticmethod(jax.lax.rsqrt)
    tanh = staticmethod(jnp.tanh)
    exp = staticmethod(jnp.exp)
    max = staticmethod(lambda x: jnp.max(x, axis=-1, keepdims=True))
    sum = staticmethod(lambda x: jnp.sum(x, axis=-1, keepdims=True))
    constant = staticmethod(jnp.asarray)
    absmax = staticmethod(lambda x: jax.lax.stop_gradient(jnp.max(jnp.abs(x))).astype(jnp.float32))


def asarray(a: np.ndarray) -> jax.Array:
    return jax.device_put(np.asarray(a), _device)


def to_numpy(x: jax.Array) -> np.ndarray:
    return np.asarray(x)


def value_and_grad(fn: Callable) -> Callable:
    return jax.value_and_grad(fn, has_aux=True)


def compile(step: Callable) -> Callable:
    return jax.jit(step)


def no_grad() -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def reset_peak_memory() -> None:
    pass  # XLA's peak_bytes_in_use cannot be reset: it is the process's peak


def peak_memory() -> tuple[int, str]:
    stats = _device.memory_stats() if _device is not None else None
    if stats and "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "jax peak_bytes_in_use (process peak)"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process RSS high-water"
