"""StepGuard's gradient norm where the loop's GradScaler unscales the gradients only inside
the real step (accelerate's optimizer step, as the Trainer's, without a grad-norm read before
it): the guard decides on the unscaled norm (docs/semantics.md §16.10)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from numstab.frameworks.torch.step_guard import StepGuard  # noqa: E402
from numstab.guard.guard import TrainingGuard  # noqa: E402
from tests.accelerate_stub import Accelerated  # noqa: E402


@pytest.mark.parametrize("fused", [False, True])
def test_norm_of_gradients_the_real_step_unscales(fused):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    sg = StepGuard(TrainingGuard(), locate=False)
    sg.attach(model, opt, hook_loss=False)
    accelerated = Accelerated(opt, scaler)
    sg.wrap(accelerated, scaler=lambda: scaler)
    g = torch.Generator().manual_seed(1)
    expected = []
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        grads = [p.grad / scaler.get_scale() for p in model.parameters()]
        expected.append(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item())
        sg.record_loss(loss)
        accelerated.step()
    norms = [r[3] for r in sg.torch_guard.history._rows]
    # the scale is a power of two: dividing by it is exact; float32 norms of the same values
    assert norms == pytest.approx(expected, rel=1e-6)
    assert sg.skipped == 0
