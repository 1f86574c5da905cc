"""TensorFlow for the benchmark: the model's ops, GradientTape, tf.function, memory stats."""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Callable
from typing import Any

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["KERAS_BACKEND"] = "tensorflow"  # this worker's Keras (native stack) runs on TF
import tensorflow as tf

from numstab.bench.errors import FrameworkSetupError

name = "tensorflow"
_device = "/CPU:0"


def setup(device: str) -> None:
    global _device
    if device == "gpu":
        if not tf.config.list_physical_devices("GPU"):
            raise FrameworkSetupError("tensorflow sees no GPU")
        _device = "/GPU:0"


def versions() -> dict[str, str]:
    import keras

    return {"tensorflow": tf.__version__, "keras": keras.__version__}


def device_name() -> str:
    return _device


class ops:
    cast = staticmethod(lambda x, dtype: tf.cast(x, dtype))
    take = staticmethod(lambda table, ids: tf.gather(table, ids))
    matmul = staticmethod(tf.matmul)
    reshape = staticmethod(tf.reshape)
    transpose = staticmethod(tf.transpose)
    mean = staticmethod(lambda x: tf.reduce_mean(x, axis=-1, keepdims=True))
    rsqrt = staticmethod(tf.math.rsqrt)
    tanh = staticmethod(tf.tanh)
    exp = staticmethod(tf.exp)
    max = staticmethod(lambda x: tf.reduce_max(x, axis=-1, keepdims=True))
    sum = staticmethod(lambda x: tf.reduce_sum(x, axis=-1, keepdims=True))
    constant = staticmethod(tf.constant)
    absmax = staticmethod(lambda x: tf.cast(tf.stop_gradient(tf.reduce_max(tf.abs(x))), tf.float32))


def asarray(a: np.ndarray) -> tf.Tensor:
    with tf.device(_device):
        return tf.identity(tf.constant(a))


def to_numpy(x: tf.Tensor) -> np.ndarray:
    return x.numpy()


def value_and_grad(fn: Callable) -> Callable:
    def wrapped(params: dict, *args: Any) -> tuple:
        with tf.GradientTape() as tape:
            tape.watch(list(params.values()))
            out, aux = fn(params, *args)
        grads = tape.gradient(out, params)
        return (out, aux), {k: tf.convert_to_tensor(g) for k, g in grads.items()}

    return wrapped


def compile(step: Callable) -> Callable:
    compiled = tf.function(step)

    def run(*args: Any) -> Any:
        with tf.device(_device):
            return compiled(*args)

    return run


def no_grad() -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def reset_peak_memory() -> None:
    if _device != "/CPU:0":
        tf.config.experimental.reset_memory_stats(_device.strip("/"))


def peak_memory() -> tuple[int, str]:
    if _device != "/CPU:0":
        info = tf.config.experimental.get_memory_info(_device.strip("/"))
        return int(info["peak"]), "tf get_memory_info peak"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process RSS high-water"
