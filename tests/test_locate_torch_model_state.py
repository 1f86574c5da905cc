"""torch locate_nonfinite leaves the model and the process as it found them, and diagnoses
the computation the model makes without it (docs/semantics.md §15.3, "Cost, state and
limits"). Before: in training mode a NaN batch poisoned BatchNorm's running statistics and
counted one more batch, dropout consumed the global RNG; and an eval
``nn.TransformerEncoder`` whose fused fast path turns a fully padded sequence into NaN was
reported clean, because locate's own module hooks pushed its layers off that path."""

from __future__ import annotations

import pytest

import numstab as ns

torch = pytest.importorskip("torch")
nn = torch.nn


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))


@pytest.mark.parametrize("with_loss", [False, True])
def test_train_mode_buffers_and_rng_are_put_back(with_loss):
    model = _net().train()
    x = torch.randn(8, 4)
    x[0, 0] = float("nan")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    loss_fn = (lambda o: o.sum()) if with_loss else None
    report = ns.locate_nonfinite(model, x, loss_fn=loss_fn)
    assert report.found and report.phase == "forward"
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key  # running stats, num_batches_tracked
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert model.training


def test_buffers_put_back_on_error():
    model = _net().train()

    def loss_fn(out):
        raise RuntimeError("boom")

    mean = model[1].running_mean.clone()
    with pytest.raises(RuntimeError, match="boom"):
        ns.locate_nonfinite(model, torch.randn(8, 4), loss_fn=loss_fn)
    assert torch.equal(model[1].running_mean, mean)
    assert model[1].num_batches_tracked.item() == 0


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_transformer_fast_path_is_what_is_located():
    """The user's eval / no_grad call takes torch's fused fast path, which makes NaN for a
    fully padded sequence; locate (no loss: no_grad) takes it too and finds them. With a
    loss, the computation with gradients (no fast path) is located."""
    model = _encoder()
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    with torch.no_grad():
        expected = int(model(x, src_key_padding_mask=mask).isnan().sum())
    assert expected > 0
    report = ns.locate_nonfinite(model, x, src_key_padding_mask=mask)
    assert (report.found, report.phase) == (True, "forward")
    assert report.nan_count == expected
    assert report.layers_checked == 3  # the encoder and its two fused layers
    assert not torch.nn.modules.module._global_forward_hooks  # removed
    assert not torch.nn.modules.module._global_forward_pre_hooks
    # with a loss the pass runs with gradients, where torch takes no fast path (nor does a
    # training step): finite, and so is the report; every sub-module of the layers is seen
    assert torch.isfinite(model(x, src_key_padding_mask=mask)).all()
    report = ns.locate_nonfinite(model, x, src_key_padding_mask=mask, loss_fn=lambda o: o.sum())
    assert not report.found and report.backward_checked
    assert report.layers_checked == 20
