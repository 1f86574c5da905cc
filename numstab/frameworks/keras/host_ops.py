"""The per-batch device work of the Keras guard's host mode (``TrainingGuard(host_every=1)``),
each as one call of the backend rather than a few eager ops per variable:

    copier(variables)()           -> the variables' values in new buffers (the undo copy)
    update_reader(weights, tracker)(undo weights)
                                  -> NumPy float32 [tracker values..., ||w - w'|| per weight]

On the 4x256 MLP with Adam (34 variables, 10 weights) on a 2-core CPU the eager versions
cost, per batch: the copy 1.3 ms on TensorFlow and JAX (one ``ops.copy`` per variable), the
norms 2.0 ms on TensorFlow (five eager ops per weight). Here: TensorFlow, one graph function
for each (captured variables; a read is a snapshot, as every TF tensor is immutable); JAX,
one ``jax.jit`` for each; torch, eager ``torch`` ops (a few µs each) with the norms as one
multi-tensor kernel. The norms are ``layer_norms``': float32, one 2-norm per weight.

    to_numpy(variable)            -> a NumPy copy of one variable's value (a single read)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import ops

from numstab.backends import load_backend
from numstab.guard.monitor import layer_norms


def copier(variables: list[Any]) -> Callable[..., list[Any]]:
    """A function returning the variables' current values in new buffers (safe to keep while
    Keras updates, or on JAX donates, the variables); on JAX it may be given the values (from
    Keras' training state) in place of reading the variables."""
    backend = keras.backend.backend()
    if backend == "jax":
        from numstab.frameworks.jax.guard import copy_tree

        return lambda values=None: copy_tree(values or [v.value for v in variables])
    if backend == "tensorflow":
        import tensorflow as tf

        def reads() -> list[Any]:
            return [tf.identity(v.value) for v in variables]

        fn = tf.function(reads, autograph=False).get_concrete_function()
        return lambda values=None: list(fn()) if variables else []
    return lambda values=None: [ops.copy(v.value) for v in variables]


def to_numpy(variable: Any) -> np.ndarray:
    """A NumPy copy of ``variable``'s value. On TensorFlow through ``tf.convert_to_tensor``:
    under a ``tf.distribute`` strategy a sync-on-read variable (the loss tracker's ``total``
    and ``count``, one copy per replica) converts to its cross-replica value (the sum over
    replicas for these) that way, while NumPy's conversion of it raises ``ValueError: object
    __array__ method not producing an array``; a mirrored variable (weights, optimizer
    variables) gives its value either way. JAX, torch: ``ops.convert_to_numpy``."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return np.array(tf.convert_to_tensor(variable.value))
    return np.array(ops.convert_to_numpy(variable.value))


def update_reader(weights: list[Any], tracker: list[Any]) -> Callable[..., np.ndarray]:
    """A function of the weights' undo copy: the tracker's values (its ``total`` and
    ``count``) and the 2-norm of each weight's update ``w - w'``, as one float32 NumPy vector
    read in one transfer. On JAX it may be given ``(weights' values, tracker's values)``."""
    backend = keras.backend.backend()
    be = load_backend(backend)

    def current() -> tuple[list[Any], list[Any]]:
        return [w.value for w in weights], [t.value for t in tracker]

    if backend == "jax":
        jitted = _jax_totals_and_norms(be)
        return lambda undo, now=None: np.asarray(jitted(*(now or current()), undo), np.float32)
    if backend == "tensorflow":
        import tensorflow as tf

        graph = tf.function(lambda undo: _totals_and_norms(be, *current(), undo), autograph=False)
        return lambda undo, now=None: np.asarray(graph(undo).numpy(), np.float32)
    return lambda undo, now=None: np.asarray(
        ops.convert_to_numpy(_totals_and_norms(be, *current(), undo)), np.float32
    )


def _totals_and_norms(be: Any, ws: list[Any], ts: list[Any], undo: list[Any]) -> Any:
    f32 = lambda x: be.cast(x, "float32")
    norms, _ = layer_norms(be, [f32(w) - f32(u) for w, u in zip(ws, undo, strict=True)])
    return be.concat([be.stack([f32(t) for t in ts]), norms]) if ts else norms


@functools.cache
def _jax_totals_and_norms(be: Any) -> Callable[..., Any]:
    import jax

    return jax.jit(functools.partial(_totals_and_norms, be))


def jax_state_places(model: Any, variables: list[Any]) -> list[tuple[str, int]] | None:
    """Where each variable sits in Keras' JAX training state (``model._jax_state``, whose
    lists follow these four variable lists), or None off JAX or where one is missing."""
    if keras.backend.backend() != "jax" or not hasattr(model, "jax_state_sync"):
        return None
    lists = {
        "trainable_variables": model.trainable_variables,
        "non_trainable_variables": model.non_trainable_variables,
        "optimizer_variables": model.optimizer.variables,
        "metrics_variables": model.metrics_variables,
    }
    where = {id(v): (key, j) for key, vs in lists.items() for j, v in enumerate(vs)}
    places = [where.get(id(v)) for v in variables]
    return None if None in places else places
