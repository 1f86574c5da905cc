"""numstab.integrations.lightning.NumstabCallback under manual optimization, where
``training_step`` calls ``optimizer.step()`` itself. Locating the first non-finite step
replays that ``training_step``: its ``step()`` went through the guarded step again, was
skipped and located again, recursively (one NaN batch: 32 skips, 10 rollbacks, LR / 1024).
The replay must leave the training as ``locate=False`` leaves it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

from numstab.integrations.lightning import NumstabCallback  # noqa: E402
from tests.tiny_models import lightning_fit  # noqa: E402

STEPS = 8


class Manual(pl.LightningModule):
    """AdamW and a StepLR stepped by the module; ``closure``: ``step(closure)``."""

    def __init__(self, closure: bool) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Dropout(0.25), torch.nn.Linear(8, 1)
        )
        self.closure = closure
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()

        def loss_and_backward():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.manual_backward(loss)
            return loss

        if self.closure:
            opt.step(closure=loss_and_backward)
        else:
            loss_and_backward()
            self.clip_gradients(opt, gradient_clip_val=10.0)
            opt.step()
        self.lr_schedulers().step()
        self.log("calls", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)]


def _fit(callback: NumstabCallback, closure: bool):
    torch.manual_seed(0)
    module = Manual(closure)
    x = torch.randn(4 * STEPS, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randn(4 * STEPS, 1, generator=torch.Generator().manual_seed(2))
    x[13, 0] = float("nan")  # batch 3
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    return module, lightning_fit(module, loader, [callback])


@pytest.mark.parametrize("closure", [False, True], ids=["step", "step_closure"])
def test_locating_a_manual_step_leaves_the_training_alone(closure):
    runs = {}
    for locate in (False, True):
        callback = NumstabCallback(locate=locate)
        module, trainer = _fit(callback, closure)
        runs[locate] = (callback, module, trainer)
    callback, module, trainer = runs[True]
    _, plain, plain_trainer = runs[False]
    events = [e["event"] for e in callback.step_guard.torch_guard.events]
    assert trainer.global_step == STEPS  # the replay's step() counted as a step: 35 before
    assert callback.skipped_steps == 1 and "rollback" not in events
    assert callback.first_nonfinite_report.layer == "net.0"  # the NaN sample's first layer
    assert trainer.callback_metrics["calls"] == STEPS  # the replay's self.log: dropped
    opt, plain_opt = trainer.optimizers[0], plain_trainer.optimizers[0]
    assert opt.param_groups[0]["lr"] == plain_opt.param_groups[0]["lr"]  # scheduler not stepped
    assert {int(s["step"]) for s in opt.state.values()} == {STEPS - 1}
    eps = torch.finfo(torch.float32).eps
    for p, q in zip(module.parameters(), plain.parameters(), strict=True):
        # the same operations in the same order: equal up to a few ulps of the weights
        torch.testing.assert_close(p, q, rtol=4 * eps, atol=4 * eps * q.abs().max().item())
