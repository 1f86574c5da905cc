"""The torch primitives of the fused cross-entropy's chunk (docs/semantics.md §11.1): the
shifted logsumexp without its own max pass is torch.logsumexp bit for bit, and the in-place
shift equals x - shift, leaving autograd and compiled graphs their out-of-place ops."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from numstab.backends import load_backend  # noqa: E402

BE = load_backend("torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1e3, -5e4])
def test_shifted_logsumexp_is_logsumexp_bit_for_bit(dtype, offset):
    x = torch.randn(37, 1031, generator=torch.Generator().manual_seed(0)) * 20 + offset
    x = x.to(dtype)
    x[3] = -float("inf")  # a row of all -inf: shift 0
    x[5, 7] = float("inf")  # a row holding +inf: shift 0
    x[9, 2] = float("nan")
    shift, _ = BE.row_shift(x)
    shifted = x - shift
    got = BE.native_shifted_logsumexp(shifted)
    want = torch.logsumexp(shifted, dim=-1)
    assert got.dtype == want.dtype
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


def test_shift_owned_in_place_only_outside_autograd():
    x = torch.randn(4, 6)
    shift = x.amax(-1, keepdim=True)
    want = x - shift
    out = BE.shift_owned(x, shift)
    assert out.data_ptr() == x.data_ptr() and torch.equal(out, want)
    leaf = torch.randn(4, 6, requires_grad=True)
    y = leaf * 1.0
    out = BE.shift_owned(y, shift)
    assert out.data_ptr() != y.data_ptr() and torch.equal(out, y - shift)
