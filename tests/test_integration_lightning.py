"""numstab.integrations.lightning.NumstabCallback with a real lightning.Trainer, in each
precision Lightning allows on CPU. One sample is poisoned (NaN): without the callback the run
ends with NaN weights; with it, that one step is skipped and its layer is named."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

from numstab.errors import InvalidArgumentError  # noqa: E402
from numstab.integrations.lightning import NumstabCallback  # noqa: E402
from tests.tiny_models import lightning_fit  # noqa: E402


class Regressor(pl.LightningModule):
    def __init__(self, optimizers: int = 1) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )
        self.optimizers_count = optimizers
        self.automatic_optimization = optimizers == 1  # Lightning: several need manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        if not self.automatic_optimization:
            for opt in self.optimizers():
                opt.zero_grad()
            self.manual_backward(loss)
            for opt in self.optimizers():
                opt.step()
        return loss

    def configure_optimizers(self):
        opts = [torch.optim.AdamW(self.parameters(), lr=1e-2) for _ in range(self.optimizers_count)]
        return opts[0] if len(opts) == 1 else opts


def _data(poison: bool = True):
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randn(32, 1, generator=torch.Generator().manual_seed(2))
    if poison:
        x[13, 0] = float("nan")  # batch 3 of 8
    return x, y


def _fit(
    precision: str | None,
    callbacks: list,
    module: Regressor | None = None,
    poison: bool = True,
    **trainer_kwargs,
):
    torch.manual_seed(0)
    model = module or Regressor()
    x, y = _data(poison)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    return model, lightning_fit(model, loader, callbacks, precision=precision, **trainer_kwargs)


def _finite(model) -> bool:
    return all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_poisoned_batch_is_skipped_and_named(precision):
    plain, _ = _fit(precision, [])
    assert not _finite(plain)  # the test can fail: unguarded, the NaN reaches the weights
    callback = NumstabCallback()
    model, trainer = _fit(precision, [callback])
    assert _finite(model)
    assert trainer.global_step == 8  # every batch was stepped or skipped: the run completed
    assert callback.skipped_steps == 1
    assert callback.first_nonfinite_report.layer == "net.0"
    assert trainer.callback_metrics["numstab/skipped_steps"] == 1
    assert torch.isfinite(trainer.callback_metrics["numstab/grad_norm"])
    steps = {int(s["step"]) for s in trainer.optimizers[0].state.values()}
    assert steps == {7}  # AdamW never counted the skipped step


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_the_guard_reads_gradients_before_lightning_clips_them(precision):
    """With gradient_clip_val, the guard read the clipped gradients: every recorded norm was
    at most the threshold, so a gradient-norm spike could never be seen."""
    callback = NumstabCallback()
    model, _ = _fit(precision, [callback], gradient_clip_val=1e-3)
    history = callback.step_guard.torch_guard.history.as_arrays()
    norms = history["grad_norm"][history["applied"]]
    assert len(norms) == 7 and (norms > 1e-2).all(), norms  # the poisoned step is skipped
    assert _finite(model) and callback.skipped_steps == 1


@pytest.mark.parametrize("case", ["accumulate", "16-mixed"])
def test_the_guard_records_the_mean_micro_batch_loss(case):
    """Lightning hands on_before_backward the loss divided by accumulate_grad_batches (and
    times the GradScaler's scale under "16-mixed"): the guard recorded that, and a
    GradientAccumulationScheduler switch made the loss jump, so clean steps were skipped."""
    from lightning.pytorch.plugins import MixedPrecision

    torch.manual_seed(0)
    module = Regressor()
    x, y = _data(poison=False)
    with torch.no_grad():  # each batch's loss with the initial weights
        losses = [
            torch.nn.functional.mse_loss(module.net(x[i : i + 4]), y[i : i + 4])
            for i in range(0, 16, 4)
        ]
    callback = NumstabCallback(locate=False)
    if case == "accumulate":
        _fit("32-true", [callback], module, poison=False, accumulate_grad_batches=4)
        expected, rtol = torch.stack(losses).mean(), 1e-5  # the first step's 4 micro-batches
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        _fit(
            None,
            [callback],
            module,
            poison=False,
            plugins=[MixedPrecision("16-mixed", "cpu", scaler)],
        )
        expected, rtol = losses[0], 1e-2  # fp16 matmuls
    loss = callback.step_guard.torch_guard.history.as_arrays()["loss"][0]
    assert loss == pytest.approx(expected.item(), rel=rtol)


def test_callback_reused_by_a_second_fit_guards_it():
    """Lightning makes a new optimizer for every fit(): the guard stayed bound to the first
    one, so the second fit ran unguarded and ended with NaN weights."""
    callback = NumstabCallback(locate=False)
    _fit("32-true", [callback])
    assert callback.skipped_steps == 1
    model, _ = _fit("32-true", [callback])  # a new Trainer and module
    assert _finite(model) and callback.skipped_steps == 2


def test_unsupported_settings_raise_typed_errors():
    with pytest.raises(InvalidArgumentError, match="guard"):
        NumstabCallback(guard=3)
    with pytest.raises(InvalidArgumentError, match="locate to be a bool"):
        NumstabCallback(locate="yes")
    with pytest.raises(InvalidArgumentError, match="one optimizer"):
        _fit("32-true", [NumstabCallback()], Regressor(optimizers=2))
