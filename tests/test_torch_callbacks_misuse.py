"""Misuse of the torch training guard and its Hugging Face / Lightning callbacks that used to
give a silent wrong result: clipping twice under Lightning, an optimizer over tensors the
guard neither checks nor snapshots, the step's loss under transformers' gradient
accumulation, a negative skip count loaded from a state dict. Tiny random-weight models
(nothing downloaded)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")

from numstab.errors import InvalidArgumentError  # noqa: E402
from numstab.guard import TrainingGuard  # noqa: E402
from tests.tiny_models import (  # noqa: E402
    gpt2_config,
    lightning_fit,
    trainer_args,
)

EPS = torch.finfo(torch.float32).eps
QUIET = TrainingGuard(loss_spikes=None, grad_norm_spikes=None)


# -- the torch guard: an optimizer over tensors that are not the model's ---------------------------
def test_optimizer_over_other_parameters_is_refused():
    """Before: the guard checked ``a``'s zero gradients, applied the step, and ``b.weight``
    became NaN (``b`` is nowhere in the model, so no rollback could restore it either)."""
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(b.parameters(), 0.1)
    with pytest.raises(InvalidArgumentError, match=r"2 optimizer parameter\(s\) not in model"):
        QUIET.for_torch(a, opt)
    # an optimizer over part of the model (a frozen backbone) is the model's own
    model = torch.nn.Sequential(a, torch.nn.Linear(1, 1))
    tg = QUIET.for_torch(model, torch.optim.SGD(model[1].parameters(), 0.1))
    model(torch.ones(1, 2)).sum().backward()
    assert tg.step(torch.tensor(1.0))


def test_one_foreign_tensor_beside_the_models_is_refused():
    model, extra = torch.nn.Linear(2, 1), torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([*model.parameters(), extra], 0.1)
    with pytest.raises(InvalidArgumentError, match=r"1 optimizer parameter\(s\).*\(3,\)"):
        QUIET.for_torch(model, opt)


# -- Hugging Face Trainer ---------------------------------------------------------------------
def _gpt2(accepts_loss_kwargs: bool):
    transformers = pytest.importorskip("transformers")
    config = gpt2_config()
    cls = transformers.GPT2LMHeadModel
    if not accepts_loss_kwargs:  # the Trainer then divides each micro-batch's loss by k
        cls = type("NoLossKwargs", (cls,), {"accepts_loss_kwargs": False})
    torch.manual_seed(0)
    return cls(config)


class _Tokens(torch.utils.data.Dataset):
    """Sequences with a varying number of ignored labels (-100): micro-batches of one step
    hold different token counts."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 64, (8,), generator=g)
        labels = ids.clone()
        labels[: i % 5] = -100
        return {"input_ids": ids, "labels": labels}


def _hf_train(tmp_path, model, callback, accumulation: int):
    transformers = pytest.importorskip("transformers")
    args = trainer_args(
        tmp_path,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        max_steps=4,
        learning_rate=1e-3,
        logging_steps=1,
        seed=0,
        data_seed=0,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_Tokens(), callbacks=[callback]
    )
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]


def test_trainer_step_loss_is_the_one_the_trainer_logs(tmp_path):
    """With ``num_items_in_batch`` (a model accepting loss kwargs) each micro-batch's loss is
    its part of the step's loss and the Trainer sums them; the guard took their mean (the
    step's loss / k). Without (the model does not accept them), the Trainer divides each by
    k and sums: the mean, as before."""
    from numstab.integrations.transformers import NumstabCallback

    for accepts_loss_kwargs in (True, False):
        callback = NumstabCallback(QUIET)
        model = _gpt2(accepts_loss_kwargs)
        logged = _hf_train(tmp_path / str(accepts_loss_kwargs), model, callback, accumulation=2)
        guard = callback.step_guard.torch_guard.history.as_arrays()["loss"].tolist()
        assert len(guard) == len(logged) == 4
        for mine, theirs in zip(guard, logged, strict=True):
            assert abs(mine - theirs) <= 8 * EPS * abs(theirs), (accepts_loss_kwargs, guard, logged)


class _PartLoss(torch.nn.Module):
    """A loss summed over the micro-batch's items and divided by the step's item count, as
    transformers' losses are given ``num_items_in_batch``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, x, num_items_in_batch=None):
        return {"loss": (self.w * x).sum() / num_items_in_batch}


def test_trainer_step_loss_of_a_rank_is_scaled_as_the_trainers():
    """Items counted over the processes (``average_tokens_across_devices``, 2 processes):
    the Trainer multiplies each part by the process count, and its mean over the ranks is
    the step's loss; the guard's all-reduce takes the same mean of the ranks' losses."""
    transformers = pytest.importorskip("transformers")
    from numstab.integrations.transformers import NumstabCallback

    class Args:
        deepspeed, max_grad_norm = None, 0.0
        average_tokens_across_devices, world_size = True, 2

    model, callback = _PartLoss(), NumstabCallback(QUIET)
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    callback.on_train_begin(
        Args(), transformers.TrainerState(), None, model=model, optimizer=optimizer
    )
    for micro_batch in ([1.0, 2.0], [3.0]):  # 3 items in the step (here: on this rank)
        model(torch.tensor(micro_batch), num_items_in_batch=3)["loss"].backward()
    optimizer.step()
    # the Trainer's loss of this rank: 2 * (3 / 3 + 3 / 3)
    assert callback.step_guard.torch_guard.history.last[2] == 4.0


def test_trainer_refuses_an_optimizer_over_other_tensors():
    transformers = pytest.importorskip("transformers")
    from numstab.integrations.transformers import NumstabCallback

    class Args:
        deepspeed = None
        max_grad_norm = 0.0

    model, other = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    callback = NumstabCallback()
    with pytest.raises(InvalidArgumentError, match=r"not in model\.parameters"):
        callback.on_train_begin(
            Args(),
            transformers.TrainerState(),
            None,
            model=model,
            optimizer=torch.optim.SGD([*model.parameters(), *other.parameters()], 0.1),
        )
    assert callback.step_guard.torch_guard is None  # nothing was wrapped


# -- Lightning ------------------------------------------------------------------------------------
def _lightning_fit(module, callbacks, **trainer_kwargs):
    pytest.importorskip("lightning.pytorch")
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randn(32, 1, generator=torch.Generator().manual_seed(2))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    return lightning_fit(module, loader, callbacks, **trainer_kwargs)


def _regressor(extra: bool = False):
    """A linear regressor; ``extra``: a learnable offset outside the module, given to the
    optimizer in ``configure_optimizers``."""
    pl = pytest.importorskip("lightning.pytorch")

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)
            self.offset = [torch.zeros(1, requires_grad=True)] if extra else []

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.net(x) + sum(self.offset, torch.zeros(1))
            return torch.nn.functional.mse_loss(out, y) * 100  # every step clipped at 1

        def configure_optimizers(self):
            return torch.optim.SGD([*self.parameters(), *self.offset], lr=0.1)

    torch.manual_seed(0)
    return Regressor()


def test_lightning_refuses_its_clipping_with_the_callbacks():
    """Before: Lightning clipped to 1, then the guarded step multiplied the clipped gradients
    by 1 / (unclipped norm) again: the weights barely moved, no error."""
    from numstab.integrations.lightning import NumstabCallback

    module = _regressor()
    before = module.net.weight.detach().clone()
    with pytest.raises(InvalidArgumentError, match=r"gradient_clip_val=1\.0"):
        _lightning_fit(module, [NumstabCallback(max_grad_norm=1.0)], gradient_clip_val=1.0)
    assert torch.equal(module.net.weight, before)  # refused before the first step
    # either clipping alone: the same weights (up to the rounding of the norm)
    theirs, mine = _regressor(), _regressor()
    _lightning_fit(theirs, [NumstabCallback()], gradient_clip_val=1.0)
    _lightning_fit(mine, [NumstabCallback(max_grad_norm=1.0)], gradient_clip_val=0)
    assert not torch.allclose(mine.net.weight, before)
    torch.testing.assert_close(mine.net.weight, theirs.net.weight, rtol=64 * EPS, atol=64 * EPS)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_lightning_refuses_any_clipping_algorithm_with_the_callbacks(algorithm):
    from numstab.integrations.lightning import NumstabCallback

    with pytest.raises(InvalidArgumentError, match="clipped twice"):
        _lightning_fit(
            _regressor(),
            [NumstabCallback(max_grad_norm=1.0)],
            gradient_clip_val=0.5,
            gradient_clip_algorithm=algorithm,
        )


def _self_clipping_regressor(manual: bool):
    """The regressor clipping itself with ``self.clip_gradients(opt, 0.5)``: in a manual
    ``training_step``, or in an overridden ``configure_gradient_clipping``."""
    module = _regressor()
    cls = type(module)

    class SelfClipping(cls):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = not manual

        def training_step(self, batch, batch_idx):
            if not manual:
                return super().training_step(batch, batch_idx)
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(super().training_step(batch, batch_idx))
            self.clip_gradients(opt, gradient_clip_val=0.5)
            opt.step()

        def configure_gradient_clipping(
            self, optimizer, gradient_clip_val, gradient_clip_algorithm
        ):
            self.clip_gradients(optimizer, gradient_clip_val=0.5)

    torch.manual_seed(0)
    return SelfClipping()


@pytest.mark.parametrize("manual", [False, True])
def test_lightning_refuses_the_modules_own_clipping_with_the_callbacks(manual):
    """Before: the module clipped to 0.5, then the guarded step multiplied by 1 / (unclipped
    norm) again, silently. Refused at the module's clip_gradients call, before it clips; the
    check leaves with the training, and without max_grad_norm the module clips alone."""
    from numstab.integrations.lightning import NumstabCallback

    module = _self_clipping_regressor(manual)
    before = module.net.weight.detach().clone()
    with pytest.raises(InvalidArgumentError, match=r"clip_gradients\(gradient_clip_val\)=0\.5"):
        _lightning_fit(module, [NumstabCallback(max_grad_norm=1.0)])
    assert torch.equal(module.net.weight, before)
    assert "clip_gradients" not in vars(module)  # put back on the exception
    alone, plain = _self_clipping_regressor(manual), _self_clipping_regressor(manual)
    _lightning_fit(alone, [NumstabCallback()])
    _lightning_fit(plain, [])
    assert not torch.equal(alone.net.weight, before)
    torch.testing.assert_close(alone.net.weight, plain.net.weight, rtol=0, atol=0)


def test_lightning_refuses_an_optimizer_over_a_tensor_outside_the_module():
    from numstab.integrations.lightning import NumstabCallback

    with pytest.raises(InvalidArgumentError, match="Register them on the model"):
        _lightning_fit(_regressor(extra=True), [NumstabCallback()])


# -- resuming: a skip count is a count -----------------------------------------------------------
@pytest.mark.parametrize("integration", ["transformers", "lightning"])
@pytest.mark.parametrize("skipped", [-5, -1])
def test_negative_skip_count_is_refused(integration, skipped):
    pytest.importorskip(
        {"transformers": "transformers", "lightning": "lightning.pytorch"}[integration]
    )
    module = __import__(f"numstab.integrations.{integration}", fromlist=["NumstabCallback"])
    cb = module.NumstabCallback()
    with pytest.raises(InvalidArgumentError, match=rf"skipped.*Received: skipped={skipped}"):
        cb.load_state_dict({"skipped": skipped, "guard": None})
    assert cb.skipped_steps == 0
    cb.load_state_dict({"skipped": 0, "guard": None})  # the lower bound itself is accepted
