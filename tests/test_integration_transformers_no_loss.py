"""A step without a loss is decided on the gradients alone: the loss rules get nothing. The
``Trainer`` pops ``labels`` before the forward for ``label_smoothing_factor`` (and
``compute_loss_func``), so the model's ``output.loss`` is None. Before, the callback passed a
loss of 0.0, pushed into the guard's loss window every step (count 8 with values 0.0 where the
Trainer logged ~4.04): the loss-spike rule was silently off, and a resumed window poisoned."""

from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")

from numstab.frameworks.torch.step_guard import StepGuard  # noqa: E402
from numstab.guard import TrainingGuard  # noqa: E402
from tests.tiny_models import trainer_args  # noqa: E402


class _Tokens(torch.utils.data.Dataset):
    """16 token samples; sample 5 gets NaN embeddings (through ``nan_rows``)."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(1, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _smoothed_ce(outputs, labels, num_items_in_batch=None):
    logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1])
    return torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))


@pytest.mark.parametrize("how", ["label_smoothing_factor", "compute_loss_func"])
def test_trainer_without_output_loss_feeds_no_loss_rule(tmp_path, how, caplog):
    transformers = pytest.importorskip("transformers")
    from numstab.integrations.transformers import NumstabCallback
    from tests.tiny_models import gpt2_config

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config(n_layer=2, n_embd=32))
    poison = _Tokens()[5]["input_ids"]

    def nan_rows(module, args, output):  # the poisoned sample's embeddings: NaN
        rows = (args[0] == poison).all(-1)
        return output.masked_fill(rows[:, None, None], float("nan")) if rows.any() else None

    model.transformer.wte.register_forward_hook(nan_rows)
    args = trainer_args(
        tmp_path,
        per_device_train_batch_size=2,
        num_train_epochs=1,
        logging_steps=1,
        seed=0,
        label_smoothing_factor=0.1 if how == "label_smoothing_factor" else 0.0,
    )
    callback = NumstabCallback(locate=False)
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=_Tokens(),
        callbacks=[callback],
        compute_loss_func=_smoothed_ce if how == "compute_loss_func" else None,
    )
    with caplog.at_level(logging.WARNING, logger="numstab"):
        trainer.train()
    window = callback.state_dict()["guard"]["guard_state"]["loss_window"]
    assert window["count"] == 0, window  # the loss rules got nothing
    assert trainer.state.global_step == 8 and callback.skipped_steps == 1
    messages = callback.step_guard.messages
    assert sum("no loss found" in m for m in messages) == 1  # warned once
    skips = [m for m in messages if m.startswith("numstab: skipped")]
    step = next(e["step"] for e in trainer.state.log_history if e["numstab_skipped_steps"])
    assert skips == [
        f"numstab: skipped global_step {step} (nonfinite_grad; the guard's step {step - 1})"
    ]
    logged = [r.getMessage() for r in caplog.records if r.name == "numstab"]
    assert sum("no loss found" in m for m in logged) == 1


def test_a_resumed_loss_window_is_kept_through_steps_without_a_loss():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = StepGuard(TrainingGuard())
    first.attach(model, opt, hook_loss=False)
    first.wrap(opt)
    for i in range(5):  # steps with a loss: the window holds 5 values
        opt.zero_grad()
        loss = model(torch.randn(3, 4)).pow(2).mean() + i
        loss.backward()
        first.record_loss(loss)
        opt.step()
    saved = first.state_dict()
    assert saved["guard"]["guard_state"]["loss_window"]["count"] == 5

    second = StepGuard(TrainingGuard())
    second.load_state_dict(saved)
    second.attach(model, opt, hook_loss=False)
    second.wrap(opt)
    for _ in range(3):  # no loss recorded
        opt.zero_grad()
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
    assert second.skipped == 0
    assert (
        second.state_dict()["guard"]["guard_state"]["loss_window"]
        == (saved["guard"]["guard_state"]["loss_window"])
    )
    grads = second.state_dict()["guard"]["guard_state"]["grad_norm_window"]
    assert grads["count"] == saved["guard"]["guard_state"]["grad_norm_window"]["count"] + 3
