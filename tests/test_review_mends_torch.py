"""Mends from a review of this session's own torch changes (each was red before its mend):

* ``locate_nonfinite`` put every buffer back with ``copy_``, which torch refuses on an
  expanded (stride-0) buffer, and cloned a lazy module's uninitialised buffer: both raised
  where locating had worked. Now only buffers written in place are copied back.
* The sentinel walked a dataclass or namedtuple output with ``numstab.tree.flatten``, which
  drains iterators: a generator inside came back empty to the caller. It also walked a
  ``ModelOutput``'s ``Cache``, re-reading the whole KV cache at every generated token.
* ``torch.amp.GradScaler.step`` stayed numstab's wrapper when another patch (``mock.patch``)
  was undone after the sentinel context exited; now the wrapper settles nothing outside a
  context.
* ``clip_grad_norm_(params, np.float32("inf"))`` was still refused, with "(0, inf)".

and from a second review of those mends: a lazy model's first NaN batch left NaN BatchNorm
statistics (its lazy buffers were materialised by the pass and not reset); sparse CSR, nested
and inference-mode buffers raised in the restore; a container holding itself was walked 32
levels deep (exponentially with three back-references); a stale wrapper was wrapped again.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import numstab as ns  # noqa: E402


class _Expanded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("pos", torch.arange(4.0).expand(3, -1), persistent=False)

    def forward(self, x):
        return self.lin(x + self.pos[0])


def test_locate_on_an_expanded_buffer_and_a_lazy_module():
    report = ns.locate_nonfinite(_Expanded(), torch.randn(2, 4), loss_fn=lambda o: o.sum())
    assert not report.found
    lazy = nn.Sequential(nn.LazyLinear(4), nn.LazyBatchNorm1d(), nn.Linear(4, 1))
    report = ns.locate_nonfinite(lazy, torch.randn(8, 3), loss_fn=lambda o: o.sum())
    assert not report.found


def test_locate_still_puts_back_a_buffer_written_in_place():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    x = torch.randn(8, 4)
    x[0, 0] = math.nan
    ns.locate_nonfinite(model, x, loss_fn=lambda o: o.sum())
    assert torch.equal(model[1].running_mean, torch.zeros(4))
    assert int(model[1].num_batches_tracked) == 0


@dataclasses.dataclass
class _Out:
    x: torch.Tensor
    chunks: object


_Pair = collections.namedtuple("_Pair", "x chunks")


class _Chunks(nn.Module):
    def __init__(self, box) -> None:
        super().__init__()
        self.box = box

    def forward(self, h):
        return self.box(h, (h[i] for i in range(3)))


@pytest.mark.parametrize("box", [_Out, _Pair])
def test_the_sentinel_leaves_a_generator_inside_an_output_alone(box):
    with ns.check_numerics(mode="sentinel") as cn:
        out = _Chunks(box)(torch.ones(3, 2))
        assert len(list(out.chunks)) == 3
        cn.check()


def test_the_sentinel_does_not_read_a_models_kv_cache():
    transformers = pytest.importorskip("transformers")
    from numstab.frameworks.torch.tensor_reads import module_tensors

    cache = transformers.DynamicCache()
    k = torch.ones(1, 2, 5, 4)
    cache.update(k, k, 0)
    logits = torch.zeros(1, 5, 8)
    out = transformers.modeling_outputs.CausalLMOutputWithPast(logits=logits, past_key_values=cache)
    assert [t is logits for t in module_tensors(out)] == [True]


def _leave_a_stale_wrapper():
    """A ``mock.patch`` begun inside a sentinel context and stopped after it puts numstab's
    wrapper of ``GradScaler.step`` back in place, as it found it; torch's own is returned."""
    original = torch.amp.GradScaler.step
    cm = ns.check_numerics(mode="sentinel")
    cm.__enter__()
    patch = mock.patch.object(torch.amp.GradScaler, "step", autospec=True, side_effect=original)
    patch.start()
    cm.__exit__(None, None, None)
    patch.stop()
    return original


def test_a_wrapper_left_by_another_patch_settles_nothing_after_the_context():
    from numstab.frameworks.torch import amp_settle

    original = _leave_a_stale_wrapper()
    try:
        with mock.patch.object(amp_settle, "settle_native") as settle:
            p = nn.Parameter(torch.ones(2))
            opt = torch.optim.SGD([p], lr=0.1)
            scaler = torch.amp.GradScaler("cpu")
            scaler.scale((p * p).sum()).backward()
            scaler.step(opt)
        assert not settle.called
    finally:
        torch.amp.GradScaler.step = original


@pytest.mark.parametrize("inf", [np.float32("inf"), np.float64("inf")])
def test_clip_grad_norm_takes_numpy_inf(inf):
    from numstab.integrations.torch import clip_grad_norm_

    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    assert float(clip_grad_norm_([p], inf)) == 5.0
    assert p.grad.tolist() == [3.0, 4.0]
    with pytest.raises(ns.InvalidArgumentError, match=r"max_norm in \(0, inf\]"):
        clip_grad_norm_([p], np.float32("nan"))


def test_locate_on_a_first_nan_batch_of_a_lazy_model_leaves_fresh_statistics():
    model = nn.Sequential(nn.LazyLinear(4), nn.LazyBatchNorm1d())
    x = torch.randn(8, 3)
    x[0, 0] = math.nan
    assert ns.locate_nonfinite(model, x).found
    bn = model[1]
    assert torch.equal(bn.running_mean, torch.zeros(4))
    assert torch.equal(bn.running_var, torch.ones(4))
    assert int(bn.num_batches_tracked) == 0


class _WithBuffer(nn.Module):
    def __init__(self, buf) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("b", buf)

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.eye(3).to_sparse_csr(),
        lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        lambda: torch.inference_mode()(lambda: torch.ones(3))(),
    ],
    ids=["sparse_csr", "nested", "inference"],
)
def test_locate_with_buffers_of_every_kind(make):
    x = torch.randn(2, 4)
    x[0, 0] = math.nan
    report = ns.locate_nonfinite(_WithBuffer(make()), x)
    assert report.found and report.layer == "lin"


def test_the_sentinel_walk_enters_a_container_once():
    from numstab.frameworks.torch.tensor_reads import module_tensors

    x = torch.ones(1)
    out = {"y": x}
    out["children"] = [out, out, out]  # holds itself: was 32 levels deep, exponentially
    assert module_tensors(out) == [x]

    @dataclasses.dataclass
    class WithDerived:
        x: torch.Tensor
        derived: torch.Tensor = dataclasses.field(init=False)

        def __post_init__(self):
            self.derived = self.x * 2

    assert module_tensors(WithDerived(x)) == [x]  # §6: a dataclass's init fields


def test_a_stale_wrapper_is_not_wrapped_again():
    from numstab.frameworks.torch import amp_settle

    original = _leave_a_stale_wrapper()
    try:
        with ns.check_numerics(mode="sentinel") as cn:
            assert torch.amp.GradScaler.step.__wrapped__ is original
            with mock.patch.object(
                amp_settle, "settle_native", wraps=amp_settle.settle_native
            ) as settle:
                p = nn.Parameter(torch.ones(2))
                opt = torch.optim.SGD([p], lr=0.1)
                scaler = torch.amp.GradScaler("cpu")
                scaler.scale((p * p).sum()).backward()
                scaler.step(opt)
            assert settle.call_count == 1
            cn.check()
        assert torch.amp.GradScaler.step is original
    finally:
        torch.amp.GradScaler.step = original
