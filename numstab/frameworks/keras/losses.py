"""numstab's cross-entropy as Keras 3 ``Loss`` classes, on every Keras backend (TensorFlow,
JAX, torch): ``model.compile(loss=SparseCategoricalCrossentropy(label_smoothing=0.1))``.

They follow Keras' conventions: ``call(y_true, y_pred)`` (that order), logits in ``y_pred``
(``from_logits`` is always true: numstab's losses take logits), per-sample losses reduced by
Keras (``reduction``, ``sample_weight``, masks). Serialisable: registered with Keras
(``package="numstab"``, as ``numstab>SparseCategoricalCrossentropy``), so a model compiled
with them is reloaded by ``keras.models.load_model``; ``get_config`` holds every argument
(``dtype`` included, which Keras' own losses leave out).

- ``SparseCategoricalCrossentropy``: integer class ids of shape ``(batch,)`` or, as Keras'
  own sparse loss accepts, ``(batch, 1)``. Keras converts ``y_true`` to the loss's float
  dtype before ``call``; the ids are cast back to int32. ``ignore_index`` (Keras:
  ``ignore_class``): those rows get loss 0 and a Keras mask, so ``"sum_over_batch_size"``
  averages over the other rows, as Keras' ``ignore_class`` does. The default ``None`` ignores
  nothing: every id, -100 included, must be in ``[0, K)`` (docs/semantics.md §4.4.6).
- ``CategoricalCrossentropy``: probability (or one-hot) targets of ``y_pred``'s shape.
- ``label_smoothing`` spreads over the unmasked classes (docs/semantics.md §4.4); ``z_loss``
  adds ``z * logsumexp(y_pred) ** 2`` per sample.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from numstab import _validate as v
from numstab.errors import InvalidArgumentError
from numstab.losses import cross_entropy

# ``ignore_index=None``: no label is ignored. An int outside every index dtype can equal no
# label (docs/semantics.md §4.4.4), so -100 stays an out-of-range label (§4.4.6).
_IGNORE_NOTHING = 2**70
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1  # the ids are cast to int32


class _NumstabCrossentropy(keras.losses.Loss):
    def __init__(
        self,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        reduction: str = "sum_over_batch_size",
        name: str | None = None,
        dtype: Any = None,
    ) -> None:
        try:
            super().__init__(name=name, reduction=reduction, dtype=dtype)
        except ValueError as err:  # Keras' own check of reduction (or dtype)
            raise InvalidArgumentError(
                f"Expected reduction and dtype as keras.losses.Loss takes them. Received: "
                f"reduction={reduction!r}, dtype={dtype!r} (Keras: {err})"
            ) from None
        self._dtype_arg = dtype  # (``get_config``: Keras' own leaves the dtype out)
        self.label_smoothing = v.check_number("label_smoothing", label_smoothing, low=0.0, high=1.0)
        self.z_loss = v.check_number("z_loss", z_loss, low=0.0)

    def _loss(self, y_pred: Any, labels: Any, ignore_index: int) -> Any:
        try:
            return cross_entropy(
                y_pred,
                labels,
                label_smoothing=self.label_smoothing,
                z_loss=self.z_loss,
                ignore_index=ignore_index,
                reduction="none",
            )
        except InvalidArgumentError as err:  # the sentinel is no argument of the user's
            sentinel = f" or equal to ignore_index={_IGNORE_NOTHING}"
            if ignore_index != _IGNORE_NOTHING or sentinel not in str(err):
                raise
            raise InvalidArgumentError(str(err).replace(sentinel, "")) from None

    def get_config(self) -> dict[str, Any]:
        dtype = self._dtype_arg
        return {
            **super().get_config(),
            "dtype": None if dtype is None else self._dtype_policy.name,
            "label_smoothing": self.label_smoothing,
            "z_loss": self.z_loss,
        }


@keras.saving.register_keras_serializable(package="numstab")
class SparseCategoricalCrossentropy(_NumstabCrossentropy):
    """Cross-entropy of integer class ids; see the module docstring."""

    def __init__(
        self,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        ignore_index: int | None = None,
        reduction: str = "sum_over_batch_size",
        name: str = "numstab_sparse_categorical_crossentropy",
        dtype: Any = None,
    ) -> None:
        super().__init__(label_smoothing, z_loss, reduction, name, dtype)
        self.ignore_index = (
            None if ignore_index is None else v.check_int("ignore_index", ignore_index)
        )

    def call(self, y_true: Any, y_pred: Any) -> Any:
        _check_ids_exact(self.dtype, y_pred.shape[-1])
        if len(y_true.shape) == len(y_pred.shape) and y_true.shape[-1] == 1:
            y_true = ops.squeeze(y_true, axis=-1)  # (batch, 1), as Keras' sparse loss takes
        labels = ops.cast(y_true, "int32")
        ignore = _IGNORE_NOTHING if self.ignore_index is None else self.ignore_index
        losses = self._loss(y_pred, labels, ignore)
        if self.ignore_index is not None and _INT32_MIN <= self.ignore_index <= _INT32_MAX:
            # (else no int32 id can equal it, and comparing would overflow: §4.4.4)
            from keras.src.backend import set_keras_mask  # as Keras' own ignore_class

            set_keras_mask(losses, ops.not_equal(labels, self.ignore_index))
        return losses

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "ignore_index": self.ignore_index}


#: the largest n such that the float dtype holds every integer in [0, n] exactly
_EXACT_INTEGERS = {"float16": 2**11, "bfloat16": 2**8, "float32": 2**24, "float64": 2**53}


def _check_ids_exact(dtype: Any, classes: int | None) -> None:
    """``InvalidArgumentError`` where the loss dtype cannot hold every class id exactly: Keras
    converts ``y_true`` to it before ``call`` (float16 made id 2049 into 2048, bfloat16 2051
    into 2048, a finite, silently wrong loss; Keras' own sparse loss does the same). An
    unknown class count (a traced shape) is not checked."""
    largest = _EXACT_INTEGERS.get(str(dtype))
    if classes is None or largest is None or classes - 1 <= largest:
        return
    raise InvalidArgumentError(
        f"Expected a loss dtype that holds every class id exactly: Keras converts y_true to "
        f"the loss's dtype ({dtype}) before the loss sees it, and {dtype} holds the integers "
        f"exactly only up to {largest}, so ids of the {classes} classes would be rounded to "
        f"other classes. Use dtype='float32' (the default). Received: dtype={dtype!r}, "
        f"classes={classes}"
    )


@keras.saving.register_keras_serializable(package="numstab")
class CategoricalCrossentropy(_NumstabCrossentropy):
    """Cross-entropy of probability (or one-hot) targets; see the module docstring."""

    def __init__(
        self,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        reduction: str = "sum_over_batch_size",
        name: str = "numstab_categorical_crossentropy",
        dtype: Any = None,
    ) -> None:
        super().__init__(label_smoothing, z_loss, reduction, name, dtype)

    def call(self, y_true: Any, y_pred: Any) -> Any:
        return self._loss(y_pred, ops.cast(y_true, y_pred.dtype), _IGNORE_NOTHING)
