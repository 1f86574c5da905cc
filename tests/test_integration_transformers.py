"""numstab.integrations.transformers.NumstabCallback with a real Trainer on a tiny GPT-2 built
from a config (random weights, nothing downloaded). One batch is poisoned (NaN embeddings):
without the callback the run ends with NaN weights; with it, the bad step is skipped."""

from __future__ import annotations

import math
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from numstab.errors import InvalidArgumentError  # noqa: E402
from numstab.guard import TrainingGuard  # noqa: E402
from numstab.integrations.transformers import NumstabCallback  # noqa: E402
from tests.tiny_models import gpt2_config, trainer_args  # noqa: E402

POISON = 13  # the one poisoned sample: exactly one batch holds it, wherever it is shuffled
STEPS = 6


class Embedded(torch.utils.data.Dataset):
    """Random embeddings and labels; sample ``POISON`` holds a NaN."""

    def __len__(self):
        return 4 * STEPS

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        embeds = torch.randn(8, 32, generator=g)
        if i == POISON:
            embeds[0, 0] = float("nan")
        return {"inputs_embeds": embeds, "labels": torch.randint(0, 64, (8,), generator=g)}


class Clean(Embedded):
    """The same samples, without the NaN."""

    def __getitem__(self, i):
        sample = super().__getitem__(i)
        return {**sample, "inputs_embeds": torch.nan_to_num(sample["inputs_embeds"])}


def _train(tmp_path, precision: str, callbacks, train_dataset=None, **overrides):
    config = gpt2_config(n_layer=2, n_embd=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    args = trainer_args(
        tmp_path,
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=1e-3,
        logging_steps=1,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        dataloader_drop_last=True,
        seed=0,
        data_seed=0,
        **{k: v for k, v in overrides.items() if k != "eval_dataset"},
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=train_dataset or Embedded(),
        eval_dataset=overrides.get("eval_dataset"),
        callbacks=callbacks,
    )
    trainer.train()
    return model, trainer


def _finite(model) -> bool:
    return all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_poisoned_batch_is_skipped_and_named(tmp_path, precision):
    plain, _ = _train(tmp_path / "plain", precision, [])
    assert not _finite(plain)  # the test can fail: unguarded, the NaN reaches the weights

    callback = NumstabCallback()
    model, trainer = _train(tmp_path / "guarded", precision, [callback])
    assert _finite(model)
    assert trainer.state.global_step == STEPS  # the run completed
    assert callback.skipped_steps == 1
    logs = [entry for entry in trainer.state.log_history if "numstab_skipped_steps" in entry]
    assert logs and logs[-1]["numstab_skipped_steps"] == 1
    assert sum(not math.isfinite(e["numstab_grad_norm"]) for e in logs[:STEPS]) == 1
    report = callback.first_nonfinite_report
    assert report is not None and "numstab_first_nonfinite" in logs[-1]
    assert report.layer.startswith("transformer"), report  # the model's own layer names


def test_skipped_step_leaves_weights_optimizer_and_schedule_alone(tmp_path):
    """The guarded run equals a clean run that never saw the poisoned batch's step."""
    callback = NumstabCallback()
    _, trainer = _train(tmp_path, "fp32", [callback])
    lr_steps = trainer.lr_scheduler.last_epoch
    assert lr_steps == STEPS - 1  # the schedule did not advance on the skipped step
    opt_state = trainer.optimizer.optimizer.state
    steps = {int(s["step"]) for s in opt_state.values()}
    assert steps == {STEPS - 1}  # AdamW's step counters skipped it too


def test_evaluation_during_training_is_not_a_training_step(tmp_path):
    """A NaN eval loss (a dirty eval set) was taken as the next training step's loss: two
    clean steps were skipped."""
    callback = NumstabCallback()
    _, trainer = _train(
        tmp_path,
        "fp32",
        [callback],
        train_dataset=Clean(),
        eval_dataset=torch.utils.data.Subset(Embedded(), [POISON, 0, 1, 2]),
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=4,
    )
    evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    assert len(evals) == STEPS // 2 and all(math.isnan(x) for x in evals)  # it can fail
    assert callback.skipped_steps == 0, callback.step_guard.messages


def test_callback_reused_by_a_second_trainer_guards_its_model(tmp_path):
    """The guard stayed bound to the first Trainer's model: a second Trainer given the same
    callback ran unguarded and ended with NaN weights."""
    callback = NumstabCallback()
    _train(tmp_path / "first", "fp32", [callback], train_dataset=Clean())
    assert callback.skipped_steps == 0
    model, trainer = _train(tmp_path / "second", "fp32", [callback])
    assert _finite(model) and callback.skipped_steps == 1
    trainer.train()  # the same Trainer again: its optimizer is still guarded
    assert _finite(model) and callback.skipped_steps == 2


def test_bad_settings_raise_typed_errors(tmp_path):
    with pytest.raises(InvalidArgumentError, match="guard"):
        NumstabCallback(guard="olmo")
    with pytest.raises(InvalidArgumentError, match="locate to be a bool"):
        NumstabCallback(locate=1)
    callback = NumstabCallback(TrainingGuard())

    class Args:
        deepspeed = "ds_config.json"

    with pytest.raises(InvalidArgumentError, match="DeepSpeed"):
        callback.on_train_begin(Args(), None, None, model=torch.nn.Linear(1, 1))
