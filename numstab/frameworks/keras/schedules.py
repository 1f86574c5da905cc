"""numstab's learning-rate schedules as Keras 3 ``LearningRateSchedule`` objects.

    lr = WarmupCosineDecay(1e-3, warmup_steps=100, total_steps=10_000, min_lr=1e-5)
    model.compile(optimizer=keras.optimizers.AdamW(lr), ...)

Works on every Keras backend (TensorFlow, JAX, torch): the step (the optimizer's
``iterations`` variable) is converted to the backend's tensor and evaluated by
``numstab.schedules``. Serialisable: ``get_config`` / ``from_config`` and registered as
``"numstab>WarmupCosineDecay"``, so a saved model reloads without ``custom_objects`` once this
module is imported.
"""

from __future__ import annotations

from typing import Any

import keras

from numstab.backends import BACKEND_NAMES
from numstab.schedules import WarmupCosineSchedule


@keras.saving.register_keras_serializable(package="numstab")
class WarmupCosineDecay(keras.optimizers.schedules.LearningRateSchedule):
    """``numstab.schedules.warmup_cosine_schedule`` for Keras optimizers: the same arguments
    (``base_lr``; keywords ``warmup_steps``, ``total_steps``, ``min_lr``, ``warmup_start_lr``),
    checked by ``WarmupCosineSchedule``."""

    def __init__(
        self,
        base_lr: float,
        *,
        warmup_steps: int,
        total_steps: int,
        min_lr: float = 0.0,
        warmup_start_lr: float = 0.0,
    ) -> None:
        super().__init__()
        self.schedule = WarmupCosineSchedule(
            base_lr,
            warmup_steps=warmup_steps,
            total_steps=total_steps,
            min_lr=min_lr,
            warmup_start_lr=warmup_start_lr,
        )

    def __call__(self, step: Any) -> Any:
        name = keras.backend.backend()
        if isinstance(step, keras.Variable):  # the optimizer's ``iterations``
            step = step.value
        step = keras.ops.convert_to_tensor(step)
        return self.schedule(step, backend=name if name in BACKEND_NAMES else None)

    def get_config(self) -> dict[str, Any]:
        return self.schedule.get_config()
