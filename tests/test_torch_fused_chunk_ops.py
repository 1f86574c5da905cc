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
@pytest.mark.parametrize("vocab", [1031, 100_003])  # 100_003: rows exp'd in blocks of 20
def test_shifted_logsumexp_is_logsumexp_bit_for_bit(dtype, offset, vocab):
    x = torch.randn(37, vocab, generator=torch.Generator().manual_seed(0)) * 20 + offset
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


def test_shifted_logsumexp_under_autograd_keeps_its_gradient():
    x = torch.randn(5, 9, requires_grad=True)
    BE.native_shifted_logsumexp(x - x.detach().amax(-1, keepdim=True)).sum().backward()
    torch.testing.assert_close(x.grad, torch.softmax(x.detach(), -1))


@pytest.mark.parametrize("vocab", [7, 50_000])  # 50_000 at 128 rows: blocks of 16384 rows
def test_chunk_logits_on_cpu_are_the_product(vocab):
    """The chunk logits ``h @ w.T``, built from blocks of ``w``'s rows: every column equals
    the product (each entry is one dot product over d; float32 rounding, d = 256, allows a
    few ulps of its magnitude), and under autograd the gradient flows."""
    gen = torch.Generator().manual_seed(1)
    h, w = torch.randn(128, 256, generator=gen), torch.randn(vocab, 256, generator=gen)
    got = BE.matmul(h, w, transpose_b=True)
    want = (h.double() @ w.double().T).float()
    assert got.shape == (128, vocab) and got.is_contiguous()
    scale = (h.abs().double() @ w.abs().double().T).float()
    assert bool(((got - want).abs() <= 256 * torch.finfo(torch.float32).eps * scale).all())
    hg, hr = h.clone().requires_grad_(), h.clone().requires_grad_()
    BE.matmul(hg, w, transpose_b=True).sum().backward()
    (hr @ w.T).sum().backward()  # the same sums over the vocabulary, as torch orders them
    torch.testing.assert_close(hg.grad, hr.grad)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_step_allocates_one_weight_sized_tensor(reduction):
    """Forward and backward allocate one weight-sized tensor, dweight: autograd also
    materialised a zero gradient for each residual output of the custom Function (a second
    [V, d] buffer, 256 MiB at benchmarks/memory.py's shape, where the torch peak was 1.66x
    the floor; ~1.0 since)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from numstab.fused_cross_entropy import fused_linear_cross_entropy

    class NewWeightSized(TorchDispatchMode):  # ops whose output is a new [V, d]-sized buffer
        def __init__(self, numel):
            super().__init__()
            self.numel, self.ops = numel, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {
                a.untyped_storage().data_ptr()
                for a in [*args, *(kwargs or {}).values()]
                if isinstance(a, torch.Tensor)
            }
            for t in out if isinstance(out, (tuple, list)) else (out,):
                new = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given
                if new and t.numel() >= self.numel:
                    self.ops.append(str(func))
            return out

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(64, 64, generator=gen, requires_grad=True)
    w = torch.randn(512, 64, generator=gen, requires_grad=True)  # [V, d]: 4x a [16, V] chunk
    y = torch.randint(0, 512, (64,), generator=gen)
    with NewWeightSized(w.numel()) as mode:
        loss = fused_linear_cross_entropy(h, w, y, chunk_size=16, reduction=reduction)
        _, dw = torch.autograd.grad(loss.sum(), [h, w])
    assert dw.shape == w.shape
    assert len(mode.ops) == 1, mode.ops
