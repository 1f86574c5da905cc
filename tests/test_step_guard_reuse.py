"""A Hugging Face NumstabCallback reused by later Trainers (docs/semantics.md §16.10,
"Reuse"): a new guard starts, so the first run's located report is neither logged into a
clean later run's entries nor kept in place of a later run's own."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from numstab.integrations.transformers import NumstabCallback  # noqa: E402
from tests.tiny_models import trainer_args  # noqa: E402


class _Data(torch.utils.data.Dataset):
    def __init__(self, poison: set[int]) -> None:
        self.poison = poison

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        embeds = torch.randn(8, 32, generator=g)
        if i in self.poison:
            embeds[0, 0] = float("nan")
        return {"inputs_embeds": embeds, "labels": torch.randint(0, 64, (8,), generator=g)}


def _train(callback, poison: set[int], out_dir) -> list[dict]:
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    args = trainer_args(
        out_dir,
        per_device_train_batch_size=4,
        max_steps=4,
        logging_steps=1,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_Data(poison), callbacks=[callback]
    )
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def test_reused_callback_locates_each_run_afresh(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        _reuse(tmp_path)
    finally:
        transformers.logging.set_verbosity(verbosity)


def _reuse(tmp_path) -> None:
    callback = NumstabCallback()  # locate=True
    _train(callback, {5}, tmp_path / "a")
    first = callback.first_nonfinite_report
    assert first is not None and callback.skipped_steps == 1
    logs = _train(callback, set(), tmp_path / "b")  # clean
    assert len(logs) == 4 and not any("numstab_first_nonfinite" in h for h in logs)
    assert callback.first_nonfinite_report is None and callback.skipped_steps == 1
    logs = _train(callback, {9}, tmp_path / "c")
    report = callback.first_nonfinite_report
    assert report is not None and report is not first and callback.skipped_steps == 2
    assert [h.get("numstab_first_nonfinite") for h in logs][-1] == str(report)
