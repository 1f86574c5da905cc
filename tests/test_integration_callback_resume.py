"""Resuming a guarded run from its loop's checkpoint: Lightning's ``fit(ckpt_path=...)`` and
the Hugging Face Trainer's ``train(resume_from_checkpoint=...)``. The callbacks kept no state
(Lightning's ``state_dict()`` was ``{}``): after a resume the skip count restarted at 0, the
spike windows restarted empty (a spike right after the resume went through, the warmup
restarted) and the rollback window forgot its bad steps. A resumed run must end as the
uninterrupted one: the same skips, guard events and parameters."""

from __future__ import annotations

import os
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

from numstab.errors import InvalidArgumentError  # noqa: E402
from numstab.guard import SpikeDetector, TrainingGuard  # noqa: E402
from numstab.integrations.lightning import NumstabCallback  # noqa: E402
from tests.tiny_models import trainer_args  # noqa: E402

EPOCH = 4  # the checkpoint: after step 2 * EPOCH, mid-epoch (4 * EPOCH batches an epoch)
NAN_STEPS, SPIKE_STEP = (3, 12), 10  # the resume is after step 8; the spike comes right after


def _guard(window: int = 6) -> TrainingGuard:
    spikes = SpikeDetector(window=window, warmup=4)
    # 7 good steps up to the checkpoint (step 3 is skipped): a snapshot falls due there;
    # the 3 bad steps 3, 10, 12 are within the rollback window: a rollback at step 12
    return TrainingGuard(
        loss_spikes=spikes, grad_norm_spikes=spikes, snapshot_every=7, rollback_window=16
    )


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )

    def training_step(self, batch, batch_idx):
        # the batch from the step's index: Lightning restarts a plain DataLoader at its
        # first batch when it resumes mid-epoch
        g = torch.Generator().manual_seed(self.global_step)
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)
        if self.global_step in NAN_STEPS:
            x = x * float("nan")
        elif self.global_step == SPIKE_STEP:
            y = y * 1e3  # a loss and gradient-norm spike
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.95)]


def _fit(callback, max_steps: int, directory=None, ckpt_path=None):
    torch.manual_seed(0)
    module = Regressor()
    loader = torch.utils.data.DataLoader(torch.arange(16 * EPOCH), batch_size=4)
    checkpoints = (
        []
        if directory is None
        else [
            pl.callbacks.ModelCheckpoint(directory, save_last=True, every_n_train_steps=2 * EPOCH)
        ]
    )
    trainer = pl.Trainer(
        max_steps=max_steps,
        callbacks=[callback, *checkpoints],
        logger=False,
        enable_checkpointing=directory is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader, ckpt_path=ckpt_path)
    return module, trainer


def _events(callback, since: int) -> list[tuple]:
    events = callback.step_guard.torch_guard.events
    return [
        (e["event"], e["step"], tuple(e.get("reasons", ()))) for e in events if e["step"] >= since
    ]


def test_lightning_resume_decides_as_the_uninterrupted_run(tmp_path):
    whole = NumstabCallback(_guard(), locate=False)
    model, _ = _fit(whole, 4 * EPOCH)
    _fit(NumstabCallback(_guard(), locate=False), 2 * EPOCH, tmp_path)
    last = tmp_path / "last.ckpt"
    saved = torch.load(last, weights_only=True)["callbacks"]  # plain values: loads safely
    assert saved["NumstabCallback"]["skipped"] == 1
    resumed = NumstabCallback(_guard(), locate=False)
    again, trainer = _fit(resumed, 4 * EPOCH, ckpt_path=str(last))
    assert trainer.global_step == 4 * EPOCH
    assert whole.skipped_steps == resumed.skipped_steps == 3  # 1 before the resume before
    assert trainer.callback_metrics["numstab/skipped_steps"] == 3
    expected = _events(whole, 2 * EPOCH)
    assert ("skip", SPIKE_STEP, ("loss_spike", "grad_norm_spike")) in expected
    assert [e[0] for e in expected].count("rollback") == 1
    assert _events(resumed, 2 * EPOCH) == expected
    eps = torch.finfo(torch.float32).eps
    for p, q in zip(again.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=8 * eps, atol=8 * eps * q.abs().max().item())


def test_lightning_resume_with_other_guard_settings_raises(tmp_path):
    _fit(NumstabCallback(_guard(), locate=False), 2 * EPOCH, tmp_path)
    other = NumstabCallback(_guard(window=12), locate=False)
    with pytest.raises(InvalidArgumentError, match="other settings"):
        _fit(other, 4 * EPOCH, ckpt_path=str(tmp_path / "last.ckpt"))


# -- the Hugging Face Trainer -------------------------------------------------------------------
HF_STEPS, HF_SAVE, HF_POISON = 8, 4, (5, 25)  # poisoned samples: in batches 1 and 6


class Embedded(torch.utils.data.Dataset):
    """Random embeddings and labels, taken in order; the ``HF_POISON`` samples hold a NaN."""

    def __len__(self):
        return 4 * HF_STEPS

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        embeds = torch.randn(8, 32, generator=g)
        if i in HF_POISON:
            embeds[0, 0] = float("nan")
        return {"inputs_embeds": embeds, "labels": torch.randint(0, 64, (8,), generator=g)}


def _train(tmp_path, callback, max_steps: int, resume=None):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=32,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        resid_pdrop=0.0,  # no dropout: the runs' RNG streams are not this test's subject
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    args = trainer_args(
        tmp_path,
        per_device_train_batch_size=4,
        max_steps=max_steps,
        learning_rate=1e-3,
        lr_scheduler_type="constant",  # the interrupted run's schedule: for its own max_steps
        save_strategy="steps",
        save_steps=HF_SAVE,
        train_sampling_strategy="sequential",
        seed=0,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Embedded(), callbacks=[callback]
    )
    trainer.train(resume_from_checkpoint=resume)
    return model


def _hf_callback(window: int = 6):
    from numstab.integrations.transformers import NumstabCallback as HFCallback

    return HFCallback(_guard(window), locate=False)


def test_trainer_resume_decides_as_the_uninterrupted_run(tmp_path):
    whole = _hf_callback()
    model = _train(tmp_path / "whole", whole, HF_STEPS)
    _train(tmp_path / "run", _hf_callback(), HF_SAVE)
    resumed = _hf_callback()
    checkpoint = str(tmp_path / "run" / f"checkpoint-{HF_SAVE}")
    again = _train(tmp_path / "run", resumed, HF_STEPS, resume=checkpoint)
    assert whole.skipped_steps == resumed.skipped_steps >= len(HF_POISON)
    assert _events(resumed, HF_SAVE) == _events(whole, HF_SAVE)
    eps = torch.finfo(torch.float32).eps
    for p, q in zip(again.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=8 * eps, atol=8 * eps * q.abs().max().item())


def test_trainer_resume_with_other_guard_settings_raises(tmp_path):
    _train(tmp_path, _hf_callback(), HF_SAVE)
    with pytest.raises(InvalidArgumentError, match="other settings"):
        _train(tmp_path, _hf_callback(window=12), HF_STEPS, str(tmp_path / f"checkpoint-{HF_SAVE}"))
