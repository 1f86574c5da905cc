"""Lightning's NumstabCallback under a GradScaler ("16-mixed" with an explicit scaler, which
Lightning runs on the CPU too), with a fused optimizer, after the scaler's own overflow
skips, with a closure optimizer (LBFGS), and reused for a second fit (docs/semantics.md
§16.10)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from numstab.errors import InvalidArgumentError  # noqa: E402
from numstab.integrations.lightning import NumstabCallback  # noqa: E402
from numstab.integrations.torch import GradScaler  # noqa: E402
from tests.tiny_models import lightning_fit  # noqa: E402


class Linear(pl.LightningModule):
    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.optimizer = optimizer
        self.losses: list[float] = []  # every evaluation's loss, and its batch
        self.batches: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.net(x).float() - y) ** 2).mean()
        self.losses.append(loss.item())
        self.batches.append(batch_idx)
        return loss

    def configure_optimizers(self):
        if self.optimizer == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=5)
        return torch.optim.SGD(self.parameters(), lr=0.1, fused=self.optimizer == "fused")


def _loader(poison: int | None = None, batch_size: int = 2):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    if poison is not None:
        x[poison, 0] = float("nan")
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


def _scaler(kind: str, init_scale: float):
    if kind == "torch":
        return torch.amp.GradScaler("cpu", init_scale=init_scale)
    return GradScaler("cpu", init_scale=init_scale, hysteresis=1)


def _fit_amp(optimizer: str, scaler, callback, poison: int | None = None):
    torch.manual_seed(0)
    module = Linear(optimizer)
    w0 = module.net.weight.detach().clone()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    lightning_fit(module, _loader(poison), [callback], plugins=[plugin])
    return module, (module.net.weight - w0).detach()


def _rows(callback):
    return [r[:4] for r in callback.step_guard.torch_guard.history._rows]


@pytest.mark.parametrize("kind", ["torch", "numstab"])
def test_fused_optimizer_under_grad_scaler_sees_unscaled_gradients(kind):
    # a fused optimizer unscales inside its step: Lightning does not unscale first, and the
    # guard took the norms x1024 and clipped by them (the weights moved ~1000x too little)
    runs = {}
    for optimizer in ("sgd", "fused"):
        callback = NumstabCallback(locate=False, max_grad_norm=1.0)
        _, moved = _fit_amp(optimizer, _scaler(kind, 1024.0), callback)
        runs[optimizer] = ([r[3] for r in _rows(callback)], moved)
    (norms, moved), (fused_norms, fused_moved) = runs["sgd"], runs["fused"]
    assert len(fused_norms) == 4 and max(norms) > 1.0  # some steps are clipped
    # the same fp32 gradients in both; the scale (a power of two) divides exactly: the
    # two runs differ only in the optimizer kernels' float32 rounding
    torch.testing.assert_close(torch.tensor(fused_norms), torch.tensor(norms), rtol=1e-5, atol=0)
    torch.testing.assert_close(fused_moved, moved, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["torch", "numstab"])
@pytest.mark.parametrize("optimizer", ["sgd", "fused"])
def test_scaler_overflow_skip_does_not_leak_its_loss_into_the_next_step(kind, optimizer):
    # batch 1 is NaN: the scaler skips it (never calling step, or the fused kernel skipping
    # through found_inf); its NaN loss was averaged into batch 2's and the guard skipped it
    callback = NumstabCallback(locate=False)
    module, _ = _fit_amp(optimizer, _scaler(kind, 1.0), callback, poison=2)
    rows = _rows(callback)
    assert [r[0] for r in rows] == [0, 1, 2] and all(r[1] for r in rows)
    expected = [module.losses[i] for i in (0, 2, 3)]
    # each row's loss is one batch's loss (float32 in and out: exact up to float32 rounding)
    torch.testing.assert_close(torch.tensor([r[2] for r in rows]), torch.tensor(expected))
    assert callback.skipped_steps == 0
    assert torch.isfinite(module.net.weight).all()


def _fit_lbfgs(callbacks, poison: int | None = None):
    torch.manual_seed(0)
    module = Linear("lbfgs")
    lightning_fit(module, _loader(poison, batch_size=4), callbacks)
    return module


def test_lbfgs_closure_optimizer_trains_as_without_the_callback():
    plain = _fit_lbfgs([])
    callback = NumstabCallback(locate=False)
    guarded = _fit_lbfgs([callback])  # before: TypeError, LBFGS.step() missing 'closure'
    # the same closure evaluations in the same order: the same weights, bit for bit
    assert torch.equal(guarded.net.weight, plain.net.weight)
    assert len(plain.losses) > 2 and guarded.losses == plain.losses  # LBFGS's evaluations
    rows = _rows(callback)
    assert [r[1] for r in rows] == [True, True]
    # the guard's loss is each step's first evaluation, as float32
    firsts = [plain.losses[plain.batches.index(b)] for b in (0, 1)]
    assert [r[2] for r in rows] == pytest.approx(firsts, rel=1e-6)


def test_lbfgs_nan_batch_is_skipped_and_max_grad_norm_refused():
    callback = NumstabCallback(locate=False)
    module = _fit_lbfgs([callback], poison=5)  # batch 1 of 2
    assert [r[1] for r in _rows(callback)] == [True, False]
    assert callback.skipped_steps == 1 and torch.isfinite(module.net.weight).all()
    with pytest.raises(InvalidArgumentError, match="LBFGS"):
        _fit_lbfgs([NumstabCallback(locate=False, max_grad_norm=1.0)])


def test_second_fit_locates_its_own_first_nonfinite_step():
    callback = NumstabCallback()  # locate=True
    torch.manual_seed(0)
    lightning_fit(Linear(), _loader(poison=2), [callback])
    first = callback.first_nonfinite_report
    assert first is not None
    lightning_fit(Linear(), _loader(), [callback])  # a clean run: a new model and guard
    assert callback.first_nonfinite_report is None
    lightning_fit(Linear(), _loader(poison=6), [callback])
    report = callback.first_nonfinite_report
    assert report is not None and report is not first
    assert callback.skipped_steps == 2
