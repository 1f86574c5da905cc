"""Tiny models and quiet loops for the integration tests (random weights, CPU, no hub)."""

from __future__ import annotations

import warnings
from typing import Any


def gpt2_config(**overrides: Any) -> Any:
    """A GPT-2 small enough for a CPU test (1 layer, 2 heads, width 16, vocab 64, 16
    positions, token 0 for BOS and EOS); ``overrides`` replace fields."""
    import transformers

    fields = dict(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    return transformers.GPT2Config(**{**fields, "bos_token_id": 0, "eos_token_id": 0, **overrides})


def lightning_fit(module: Any, loader: Any, callbacks: list, **trainer_kwargs: Any) -> Any:
    """``lightning.Trainer(...).fit(module, loader)`` for one epoch on the CPU without a logger,
    checkpoints, progress bar, model summary or warnings; returns the trainer."""
    import lightning.pytorch as pl

    settings = dict(max_epochs=1, logger=False, enable_checkpointing=False, accelerator="cpu")
    trainer = pl.Trainer(
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{**settings, **trainer_kwargs},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    return trainer


def trainer_args(output_dir: Any, **fields: Any) -> Any:
    """``transformers.TrainingArguments`` for a quiet CPU test: no reporting, no progress bar,
    no checkpoints (unless ``fields`` say otherwise), written under ``output_dir``."""
    import transformers

    quiet = dict(report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    return transformers.TrainingArguments(output_dir=str(output_dir), **{**quiet, **fields})
