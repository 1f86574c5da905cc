"""NumstabCallback(max_grad_norm=M): the callback clips after the guard decided on the
unclipped gradients (the Trainer clips before any callback runs, so by default the guard
decides on clipped gradients). Tiny random-weight GPT-2 Trainers (nothing downloaded), plain
SGD so that an update is linear in the gradients and a missing clip shows."""

from __future__ import annotations

import math
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from numstab.errors import InvalidArgumentError  # noqa: E402
from numstab.frameworks.torch.step_guard import StepGuard  # noqa: E402
from numstab.guard import TrainingGuard  # noqa: E402
from numstab.guard.spikes import SpikeDetector  # noqa: E402
from numstab.integrations.transformers import NumstabCallback  # noqa: E402
from tests.tiny_models import gpt2_config, trainer_args  # noqa: E402

STEPS = 8
LR = 0.5
M = 0.05  # below every step's gradient norm (about 1 here): every step is clipped
EPS = torch.finfo(torch.float32).eps


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 4 * STEPS

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 64, (8,), generator=g)
        return {"input_ids": ids, "labels": torch.randint(0, 64, (8,), generator=g)}


# the loss of step t is multiplied by FACTORS[t]: norms spread over 10x, every one above M,
# and a 100x spike at SPIKE (gradients are linear in the loss)
FACTORS = (3.0, 0.3, 1.0, 2.0, 0.5, 1.5, 100.0, 1.0)
SPIKE = FACTORS.index(100.0)


class Scaled(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss * FACTORS[self.state.global_step]


def _train(tmp_path, trainer_norm, callback, precision="fp32", trainer=transformers.Trainer):
    config = gpt2_config()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    args = trainer_args(
        tmp_path,
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=LR,
        optim="sgd",
        max_grad_norm=trainer_norm,
        logging_steps=1,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        dataloader_drop_last=True,
        seed=0,
        data_seed=0,
    )
    run = trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    run.train()
    logs = [e for e in run.state.log_history if "grad_norm" in e]
    assert len(logs) == STEPS
    return model, logs


def _close_norms(a: float, b: float) -> bool:
    """Two float32 global norms of the same gradients, summed in other orders."""
    return abs(a - b) <= 64 * EPS * max(abs(a), abs(b))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_callback_clipping_equals_the_trainers(tmp_path, precision):
    mine = NumstabCallback(max_grad_norm=M)
    model, logs = _train(tmp_path / "callback", 0.0, mine, precision)
    theirs = NumstabCallback()
    reference, ref_logs = _train(tmp_path / "trainer", M, theirs, precision)
    assert mine.skipped_steps == theirs.skipped_steps == 0

    # the clip factor comes from two float32 sums of the same squares: it may differ by a
    # few ulps, and each SGD step moves an entry by at most LR * M (the clipped norm)
    scale = max(p.abs().max().item() for p in reference.parameters())
    tol = STEPS * (LR * M * 64 + 4 * scale) * EPS
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=0, atol=tol), (name, (p - q).abs().max().item())

    for entry, ref in zip(logs, ref_logs, strict=True):
        assert entry["grad_norm"] > M  # every step was clipped
        assert _close_norms(entry["grad_norm"], ref["grad_norm"])  # the same gradients
        # the guard's norm is the one before clipping: the Trainer's own grad_norm log
        assert _close_norms(entry["numstab_grad_norm"], entry["grad_norm"])
        # with the Trainer's clipping, the guard reads the clipped norm
        assert ref["numstab_grad_norm"] <= M * (1 + 64 * EPS)


def _spike_guard() -> TrainingGuard:
    """Gradient-norm spikes only, detected from the 4th step on (window 8, 6 sigma)."""
    return TrainingGuard(loss_spikes=None, grad_norm_spikes=SpikeDetector(window=8, warmup=4))


def test_spike_is_skipped_only_when_the_callback_clips(tmp_path):
    mine = NumstabCallback(_spike_guard(), max_grad_norm=M)
    _, logs = _train(tmp_path / "callback", 0.0, mine, trainer=Scaled)
    assert mine.skipped_steps == 1, mine.step_guard.messages
    assert "grad_norm_spike" in mine.step_guard.messages[0]
    spike = logs[SPIKE]
    assert spike["numstab_skipped_steps"] == 1 and logs[SPIKE - 1]["numstab_skipped_steps"] == 0
    assert spike["numstab_grad_norm"] > 20 * max(e["grad_norm"] for e in logs[:SPIKE])

    # the Trainer's clipping: the guard sees M * n / (n + 1e-6) on every step, flat up to
    # torch's 1e-6, and the spike only as that epsilon's share, within the norms' spread
    theirs = NumstabCallback(_spike_guard())
    _, ref_logs = _train(tmp_path / "trainer", M, theirs, trainer=Scaled)
    assert ref_logs[SPIKE]["grad_norm"] == pytest.approx(spike["grad_norm"], rel=64 * EPS)
    assert all(abs(e["numstab_grad_norm"] - M) <= 4e-6 * M for e in ref_logs)
    assert theirs.skipped_steps == 0, theirs.step_guard.messages


def test_trainer_clipping_must_be_off(tmp_path):
    """args.max_grad_norm > 0 with the callback's: the Trainer would clip first."""
    callback = NumstabCallback(max_grad_norm=M)
    with pytest.raises(InvalidArgumentError, match=r"TrainingArguments\(max_grad_norm=0\)"):
        _train(tmp_path, 1.0, callback)


@pytest.mark.parametrize("value", [0, 0.0, -1.0, math.nan, math.inf, "1.0", True, None])
def test_invalid_max_grad_norm(value):
    if value is None:  # the default: the Trainer's clipping
        assert NumstabCallback(max_grad_norm=value).step_guard.max_grad_norm is None
        return
    with pytest.raises(InvalidArgumentError, match="max_grad_norm"):
        NumstabCallback(max_grad_norm=value)


class _Args:
    deepspeed = None
    max_grad_norm = 0.0


@pytest.mark.parametrize("kind", ["FSDP", "XLA", "MEGATRON_LM"])
def test_refused_where_accelerate_clips_its_own_way(kind):
    from accelerate.utils import DistributedType

    class Optimizer:  # an AcceleratedOptimizer's distributed type
        accelerator_state = type("State", (), {"distributed_type": DistributedType[kind]})()

    callback = NumstabCallback(max_grad_norm=M)
    with pytest.raises(InvalidArgumentError, match=kind):
        callback.on_train_begin(
            _Args(), None, None, model=torch.nn.Linear(1, 1), optimizer=Optimizer()
        )
    assert callback.step_guard.torch_guard is None  # refused before anything was wrapped


def test_refused_for_dtensor_parameters():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, not initialized yet")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(2, 2)
        weight = distribute_tensor(model.weight.detach(), init_device_mesh("cpu", (1,)))
        model.weight = torch.nn.Parameter(weight)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(InvalidArgumentError, match="DTensor"):
            StepGuard(max_grad_norm=M).attach(model, optimizer)
        StepGuard().attach(model, optimizer)  # without clipping: accepted
    finally:
        dist.destroy_process_group()


class _ScalerStep:
    """accelerate's AcceleratedOptimizer.step with a GradScaler: scaler.step, then update."""

    def __init__(self, optimizer, scaler):
        self.optimizer, self.scaler = optimizer, scaler

    def step(self):
        self.scaler.step(self.optimizer)
        self.scaler.update()


@pytest.mark.parametrize("unscaled_before", [True, False])
def test_gradscaler_gradients_are_clipped_unscaled(unscaled_before):
    """The Trainer's grad-norm read unscales before the guarded step (accelerate's
    clip_grad_norm_ with inf); a loop that did not is unscaled by the step, not clipped
    scaled. Reference: torch's recipe (unscale_, clip_grad_norm_, step)."""
    results = []
    for guarded in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        loss = (model(torch.randn(16, 8)) ** 2).mean()
        scaler.scale(loss).backward()
        stepper = _ScalerStep(optimizer, scaler)
        if guarded:
            sg = StepGuard(max_grad_norm=M)
            sg.attach(model, optimizer)
            sg.wrap(stepper, scaler=lambda scaler=scaler: scaler)
            if unscaled_before:
                scaler.unscale_(optimizer)
            stepper.step()
            assert sg.skipped == 0 and sg.grad_norm > M  # the unscaled norm, before clipping
        else:
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), M)
            assert M < norm.item() < 2.0**12 * M  # clipped, and not scaled any more
            stepper.step()
        results.append([p.detach().clone() for p in model.parameters()])
    scale = max(p.abs().max().item() for p in results[1])
    tol = (LR * M * 64 + 4 * scale) * EPS
    for p, q in zip(*results, strict=True):
        assert torch.allclose(p, q, rtol=0, atol=tol), (p - q).abs().max().item()


def test_no_pass_over_the_gradients_below_the_threshold(monkeypatch):
    """With the norm the guard read already, a factor that is surely 1 is not multiplied in
    (torch's multiply by 1 changes no bit); at or above the threshold the clip is torch's."""
    from numstab.frameworks.torch.step_guard import clip_with_norm

    calls = []
    real_mul = torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda *a: calls.append(1) or real_mul(*a))
    grads = [torch.full((3,), 0.5), torch.full((2,), -0.25)]
    total = torch.linalg.vector_norm(torch.cat(grads))
    before = [g.clone() for g in grads]
    clip_with_norm(grads, 10.0, total, float(total))
    assert calls == [] and all(torch.equal(g, b) for g, b in zip(grads, before, strict=True))
    clip_with_norm(grads, 10.0, total)  # no host norm: multiplied by exactly 1, as torch
    assert calls == [1] and all(torch.equal(g, b) for g, b in zip(grads, before, strict=True))
    clip_with_norm(grads, 0.1, total, float(total))
    want = [b * torch.clamp(0.1 / (total + 1e-6), max=1.0) for b in before]
    assert calls == [1, 1] and all(torch.equal(g, w) for g, w in zip(grads, want, strict=True))
