"""accelerate's ``AcceleratedOptimizer`` as far as the Trainer's optimizer step goes: the
GradScaler steps (unscaling inside) and updates; for tests that drive ``StepGuard``."""

from __future__ import annotations

from typing import Any


class Accelerated:
    def __init__(self, optimizer: Any, scaler: Any) -> None:
        self.optimizer, self.scaler = optimizer, scaler

    def step(self) -> None:
        self.scaler.step(self.optimizer)
        self.scaler.update()
