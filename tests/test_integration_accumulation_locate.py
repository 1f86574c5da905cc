"""Locating the non-finite step under gradient accumulation: every micro-batch since the last
optimizer step is replayed (those with a non-finite loss first) until one names a layer.
Before, only the step's last micro-batch was replayed: a NaN of an earlier one gave a clean
report ("no NaN or inf ... of 6 layer call(s)"), kept as ``first_nonfinite_report`` and logged
as the first non-finite layer, and no later step was located. The skip warning names the
loop's ``global_step`` (as its logs show the step); before, only the guard's own count."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")

from numstab.frameworks.torch.step_guard import StepGuard  # noqa: E402
from tests.tiny_models import trainer_args  # noqa: E402


class _WithLoss(torch.nn.Module):
    """A model returning its loss, as Hugging Face models do (the forward hooks' path)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )

    def forward(self, x, y):
        return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}


def _micro_batch(i: int, nan: bool = False):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g)
    if nan:
        x[0, 0] = float("nan")
    return x, y


def _run(steps: list[list[str]]):
    """One optimizer step per entry; each micro-batch "ok", "nan" (a NaN input: reproducible)
    or "grad" (a NaN put into a gradient after the backward pass: not reproducible)."""
    model = _WithLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sg = StepGuard()
    sg.attach(model, opt)
    sg.wrap(opt)
    calls = []
    model.net.register_forward_pre_hook(lambda m, a: calls.append(sg._locating))
    for s, kinds in enumerate(steps):
        opt.zero_grad()
        for k, kind in enumerate(kinds):
            model(*_micro_batch(10 * s + k, nan=kind == "nan"))["loss"].backward()
            if kind == "grad":
                model.net[2].weight.grad[0, 0] = float("nan")
        opt.step()
        assert sg.replay is None  # the step's micro-batches are dropped at its step
    return sg, sum(calls)  # the forwards made by locate's replays


def test_an_earlier_micro_batch_is_located_with_its_nonfinite_loss_first():
    sg, replays = _run([["ok", "ok", "ok"], ["ok", "nan", "ok"]])
    report = sg.first_nonfinite_report
    assert report is not None and report.found and report.layer == "net.0", sg.messages
    assert replays == 1  # the micro-batch whose loss was NaN, first


def test_a_step_not_reproduced_is_not_the_report_and_the_next_is_located():
    sg, _ = _run([["grad", "ok"], ["nan", "ok", "ok"]])
    assert sg.skipped == 2
    assert "not reproduced on the step's 2 micro-batch(es)" in sg.messages[1], sg.messages
    assert not any("first non-finite layer" in m for m in sg.messages[:2])
    report = sg.first_nonfinite_report
    assert report is not None and report.found and report.layer == "net.0", sg.messages


def test_locating_stops_after_three_steps_not_reproduced():
    sg, replays = _run([["grad"]] * 4 + [["nan"]])
    assert sg.skipped == 5 and sg.first_nonfinite_report is None
    assert sum("not reproduced" in m for m in sg.messages) == 3 and replays == 3
    assert sg.messages[5].endswith("not again")


def test_lightning_accumulation_locates_an_earlier_micro_batch():
    pl = pytest.importorskip("lightning.pytorch")
    from numstab.integrations.lightning import NumstabCallback
    from tests.tiny_models import lightning_fit

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
            )

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), 1e-2)

    torch.manual_seed(0)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    x[9, 0] = float("nan")  # batch 4 of 16: the first micro-batch of the second step
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)
    callback = NumstabCallback()
    trainer = lightning_fit(Regressor(), loader, [callback], accumulate_grad_batches=4)
    assert trainer.global_step == 4 and callback.skipped_steps == 1
    report = callback.first_nonfinite_report
    assert report is not None and report.found and report.layer == "net.0", report
    messages = callback.step_guard.messages
    assert messages[0] == (
        "numstab: skipped global_step 2 (nonfinite_loss, nonfinite_grad; the guard's step 1)"
    )


class _Stream(torch.utils.data.IterableDataset):
    """Samples in a fixed order (no sampler): sample 8 holds a NaN, with batches of 2 and 4
    micro-batches a step the first micro-batch of the second step."""

    def __iter__(self):
        for i in range(24):
            g = torch.Generator().manual_seed(i)
            embeds = torch.randn(8, 32, generator=g)
            if i == 8:
                embeds[0, 0] = float("nan")
            yield {"inputs_embeds": embeds, "labels": torch.randint(0, 64, (8,), generator=g)}


def test_trainer_accumulation_locates_an_earlier_micro_batch(tmp_path):
    transformers = pytest.importorskip("transformers")
    from numstab.integrations.transformers import NumstabCallback
    from tests.tiny_models import gpt2_config

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config(n_layer=2, n_embd=32))
    args = trainer_args(
        tmp_path,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        seed=0,
    )
    callback = NumstabCallback()
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_Stream(), callbacks=[callback]
    )
    trainer.train()
    assert trainer.state.global_step == 3 and callback.skipped_steps == 1
    report = callback.first_nonfinite_report
    assert report is not None and report.found, report
    assert report.layer.startswith("transformer"), report
    logs = [e for e in trainer.state.log_history if "numstab_skipped_steps" in e]
    bad = [e for e in logs if e["numstab_skipped_steps"] == 1]
    assert bad[0]["step"] == 2 and "numstab_first_nonfinite" in bad[0]
    assert callback.step_guard.messages[0].startswith("numstab: skipped global_step 2 (")
