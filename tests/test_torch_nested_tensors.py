"""Nested tensors in torch ``check_numerics`` (both modes) and ``locate_nonfinite``.

``nn.TransformerEncoder`` in eval with ``src_key_padding_mask`` (the fast path) passes nested
tensors between its layers; ``sum`` and ``aminmax`` have no nested kernel, so they are read as
their components' elements. A NaN inside the nested path is still found.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from numstab.errors import NonFiniteError  # noqa: E402
from numstab.frameworks.torch.numerics import checkable, readable, summary  # noqa: E402
from numstab.locate import locate_nonfinite  # noqa: E402
from numstab.numerics import check_numerics  # noqa: E402

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def _quiet_prototype_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*nested tensors is in prototype.*")
        yield


def _encoder(nan: bool = False):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2).eval()
    if nan:
        with torch.no_grad():
            enc.layers[1].linear1.weight[0, 0] = NAN
    x = torch.randn(3, 7, 16)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, 4:] = True
    return enc, x, pad


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_tensors_are_read_as_their_components(layout):
    parts = [torch.ones(2, 3), torch.ones(4, 3)]
    parts[1][3, 2] = NAN
    t = torch.nested.nested_tensor(parts, layout=layout)
    assert checkable(t)
    assert readable(t).shape == (18,) and torch.isnan(readable(t)).sum() == 1
    assert torch.isnan(summary(t)).item()
    assert torch.isfinite(summary(torch.nested.nested_tensor([torch.ones(2, 3)]))).item()


@pytest.mark.parametrize("mode", ["sentinel", "op"])
def test_clean_encoder_fast_path_runs_under_check_numerics(mode):
    enc, x, pad = _encoder()
    with torch.no_grad():
        expected = enc(x, src_key_padding_mask=pad)  # the fast path: zeros where padded
        with check_numerics(mode=mode, backend="torch"):
            y = enc(x, src_key_padding_mask=pad)
    torch.testing.assert_close(y, expected)


def test_nan_in_the_nested_path_is_found_by_the_sentinel():
    enc, x, pad = _encoder(nan=True)
    sentinel = check_numerics(mode="sentinel", backend="torch")
    with pytest.raises(NonFiniteError) as info, torch.no_grad(), sentinel:
        enc(x, src_key_padding_mask=pad)
    assert info.value.op == "layers.1 (TransformerEncoderLayer)"
    assert info.value.phase == "forward"


def test_nan_in_the_nested_path_is_found_in_op_mode():
    enc, x, pad = _encoder(nan=True)
    with pytest.raises(NonFiniteError) as info, torch.no_grad(), check_numerics(backend="torch"):
        enc(x, src_key_padding_mask=pad)
    err = info.value
    assert err.phase == "forward" and err.nan_count > 0
    assert "nested" in str(err)


def test_locate_runs_clean_on_the_encoder_fast_path():
    enc, x, pad = _encoder()
    with torch.no_grad():
        report = locate_nonfinite(enc, x, src_key_padding_mask=pad)
    assert not report.found and report.layers_checked > 0


def test_locate_finds_a_nan_in_the_nested_path():
    enc, x, pad = _encoder(nan=True)
    with torch.no_grad():
        report = locate_nonfinite(enc, x, src_key_padding_mask=pad)
    assert report.found and report.phase == "forward" and report.nan_count > 0
    assert report.layer.startswith("layers.1")


def test_find_nonfinite_and_assert_finite_read_nested_components():
    """find_nonfinite raised torch's NotImplementedError (no ``ne`` for NestedTensorCPU)."""
    import numstab as ns

    t = torch.nested.nested_tensor([torch.tensor([1.0, NAN]), torch.tensor([2.0, 3.0, INF])])
    (record,) = ns.find_nonfinite({"n": t})
    assert (record.path, record.nan_count, record.posinf_count, record.shape) == ("n", 1, 1, (5,))
    assert (record.finite_min, record.finite_max) == (1.0, 3.0)
    with pytest.raises(NonFiniteError, match="1 nan, 1 \\+inf") as info:
        ns.assert_finite({"n": t})
    assert info.value.framework == "torch"
    assert ns.find_nonfinite([torch.nested.nested_tensor([torch.ones(2)])]) == []


def test_assert_finite_names_the_framework_of_an_iterator():
    """assert_finite reads its tree twice: an iterator was empty the second time, and the
    error named the numpy framework."""
    import numstab as ns

    with pytest.raises(NonFiniteError) as info:
        ns.assert_finite(iter([torch.tensor([NAN])]))
    assert info.value.framework == "torch"
