"""Under torch.compile 16-bit leaves round toward zero as in eager (§7.3): inductor keeps a
16-bit intermediate in float32, so the magnitude is read from the bits."""

import math

import numpy as np
import pytest

import numstab as ns

torch = pytest.importorskip("torch")
from numstab.frameworks.torch.backend import BACKEND as TORCH  # noqa: E402

_MAG = torch.compile(TORCH.magnitude_float32, fullgraph=True)
_CLIP = torch.compile(lambda t, m: ns.clip_by_global_norm(t, m), dynamic=False)
_CLIP_FULL = torch.compile(lambda t, m: ns.clip_by_global_norm(t, m), fullgraph=True, dynamic=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_magnitude_of_every_bit_pattern(dtype):
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    got, ref = _MAG(x).numpy(), x.float().abs().numpy()
    same = (got == ref) | (np.isnan(ref) & (np.isnan(got) | np.isinf(got)))
    assert same.all()


def _tree(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "b": torch.randn(64, generator=g).to(torch.bfloat16),
        "h": (torch.randn(32, generator=g) * 1e-3).to(torch.float16),
        "one": torch.ones(3, dtype=torch.bfloat16),
    }


@pytest.mark.parametrize("clip", [_CLIP, _CLIP_FULL], ids=["default", "fullgraph"])
@pytest.mark.parametrize("case", [0, 1, 2, "ones", "fp16_tiny"])
def test_compiled_clip_equals_eager_and_bound(clip, case):
    if case == "ones":
        tree, max_norm = {"w": torch.ones(3, dtype=torch.bfloat16)}, 1.0
    elif case == "fp16_tiny":
        tree, max_norm = [torch.full((3,), 1e-7, dtype=torch.float16)], 1e-7
    else:
        tree, max_norm = _tree(case), 0.37
    eager, _ = ns.clip_by_global_norm(tree, max_norm)
    comp, _ = clip(tree, max_norm)
    for a, b in zip(ns.tree.flatten(eager)[0], ns.tree.flatten(comp)[0], strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    leaves = [x.double() for x in ns.tree.flatten(comp)[0]]
    n = sum(x.numel() for x in leaves)
    after = math.sqrt(sum(float((x * x).sum()) for x in leaves))
    eps = float(np.finfo(np.float32).eps)
    assert after <= max_norm * (1 + (n + 3) * eps) + (1 + math.sqrt(n) / 2) * 2.0**-149


def test_compiled_agc_and_drop_in_equal_eager():
    from numstab.integrations.torch import clip_grad_norm_

    agc = ns.AGC(clip_factor=0.01)
    grads, params = [torch.ones(3, dtype=torch.bfloat16)], [torch.ones(3, dtype=torch.bfloat16)]
    assert torch.equal(torch.compile(agc.clip)(grads, params)[0], agc.clip(grads, params)[0])

    def drop_in(p):
        return clip_grad_norm_([p], 1.0)

    ps = [torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)) for _ in range(2)]
    for p in ps:
        p.grad = torch.ones(3, dtype=torch.bfloat16)
    drop_in(ps[0])
    torch.compile(drop_in)(ps[1])
    assert torch.equal(ps[0].grad, ps[1].grad)
    assert float(ps[1].grad.float().norm()) <= 1.0
