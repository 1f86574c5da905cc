"""torch ``check_numerics``: what op mode does not report, and the sentinel under torch.compile.

- Ops that make no values (``aten.empty*``, views) are not checked: uninitialised memory may
  hold whatever a freed buffer held (a NaN), though every element is written before use.
- An inf an op received (a ±inf Python scalar, a tensor argument holding inf) is not reported:
  ``-inf`` attention masks are deliberate; an inf an op creates (``log(0)``) and any NaN are.
- The sentinel's global hook stays out of compiled graphs and is one fixed entry in torch's
  hook dict: no recompile per context, no graph break (``fullgraph=True`` works).
"""

from __future__ import annotations

import logging
import math
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from numstab.errors import NonFiniteError  # noqa: E402
from numstab.numerics import check_numerics  # noqa: E402

NAN, INF = float("nan"), float("inf")
EMPTY = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}


class _NaNInEmpty(TorchDispatchMode):
    """Entered outside ``check_numerics``: fills what the empty ops return with NaN, as a
    reused NaN buffer would (deterministically)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name.split("::")[-1] in EMPTY and out.is_floating_point():
            out.fill_(NAN)
        return out


# -- finding 1: uninitialised memory ------------------------------------------------------------
def test_empty_outputs_holding_nan_are_not_faults_when_overwritten():
    x = torch.randn(8, 8)
    with _NaNInEmpty(), check_numerics(backend="torch"):
        out = torch.empty_like(x)
        assert torch.isnan(out).all()  # the planted garbage is there
        torch.mul(x, 2, out=out)
        buf = torch.empty(4)
        buf.copy_(torch.arange(4.0))
        strided = torch.empty_strided((2, 2), (1, 2)).fill_(1.0)
        fresh = x.new_empty((3,)).zero_()
    assert torch.equal(out, x * 2) and buf.sum() == 6 and strided.sum() == 4 and fresh.sum() == 0


def test_views_make_no_values_the_op_reading_them_is_blamed():
    w = torch.tensor([[1.0, NAN], [2.0, 3.0]])  # made outside the context
    with pytest.raises(NonFiniteError) as info, check_numerics(backend="torch"):
        torch.ones(1, 2) @ w.t()  # aten.t is a view: the matmul is the first op making NaN
    assert info.value.op == "aten.mm.default" and info.value.op_kind == "matmul"


# -- finding 2: inf an op received --------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda x: torch.full((3,), -INF),
        lambda x: torch.scalar_tensor(-INF),
        lambda x: x.masked_fill(x > 0, -INF),
        lambda x: x.clone().masked_fill_(x > 0, -INF),
        lambda x: torch.where(x > 0, x, -INF),
        lambda x: torch.zeros(3).fill_(INF),
        lambda x: torch.softmax(x.masked_fill(x > 1, -INF), 0),
        lambda x: (x.masked_fill(x > 1, -INF) * 2).mul_(3).add_(1),  # propagated, in place
        lambda x: torch.cat([torch.full((1,), -INF), x]).exp(),
        # transformers' finite fp16 mask: scores + finfo.min overflows to -inf on purpose
        lambda x: (x.half() * -20 + torch.tensor([0.0, -65504.0, -65504.0]).half()).float(),
    ],
)
def test_an_inf_the_op_received_is_not_reported(make):
    x = torch.tensor([-1.0, 0.5, 2.0])
    with check_numerics(backend="torch"):
        out = make(x)
    assert not torch.isnan(out).any()


@pytest.mark.parametrize(
    "make, op, kind",
    [
        (lambda x: torch.log(x * 0), "aten.log.default", "log"),
        (lambda x: torch.exp(x * 1000), "aten.exp.default", "exp"),
        (lambda x: (x * 1000).exp_(), "aten.exp_.default", "exp"),  # in place on a finite x
        (lambda x: x.half() * 60000, "aten.mul.Tensor", "mul"),  # an fp16 overflow, no mask
        (lambda x: torch.full((2,), INF) * 0, "aten.mul.Tensor", "mul"),  # NaN: always
        (
            lambda x: x.masked_fill(x > 0, -INF) - x.masked_fill(x > 0, -INF),
            "aten.sub.Tensor",
            "sub",
        ),
    ],
)
def test_an_inf_or_nan_the_op_made_is_reported(make, op, kind):
    x = torch.tensor([1.0, 2.0])
    with pytest.raises(NonFiniteError) as info, check_numerics(backend="torch"):
        make(x)
    err = info.value
    assert (err.op, err.op_kind, err.phase) == (op, kind, "forward")
    assert "test_torch_numerics_ops.py:" in err.where  # the user frame


def test_log_of_zero_reports_phase_op_and_counts():
    with pytest.raises(NonFiniteError) as info, check_numerics(backend="torch"):
        torch.log(torch.tensor([0.0, 1.0]))
    err = info.value
    assert (err.op, err.op_kind, err.phase, err.nan_count, err.inf_count) == (
        "aten.log.default",
        "log",
        "forward",
        0,
        1,
    )


def _gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 100, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    return model, ids, mask


def test_clean_gpt2_with_attention_mask_passes_forward_and_backward():
    model, ids, mask = _gpt2()
    with check_numerics(backend="torch"):
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
    assert math.isfinite(out.loss.item())


def test_nan_weight_in_gpt2_is_blamed_on_the_matmul_not_an_empty_buffer():
    model, ids, mask = _gpt2()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = NAN
    with pytest.raises(NonFiniteError) as info, _NaNInEmpty(), check_numerics(backend="torch"):
        model(input_ids=ids, attention_mask=mask)
    err = info.value
    assert (err.op, err.op_kind, err.phase) == ("aten.addmm.default", "matmul", "forward")
    assert err.nan_count > 0


@pytest.mark.parametrize("train", [True, False])
def test_clean_transformer_encoder_with_padding_mask_passes(train):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).train(train)
    x = torch.randn(3, 7, 16)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, 4:] = True
    with torch.set_grad_enabled(train), check_numerics(backend="torch"):
        y = enc(x, src_key_padding_mask=pad)
        if train:
            y.sum().backward()
    assert torch.isfinite(y).all()


# -- finding 4: the sentinel under torch.compile ------------------------------------------------
class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("fullgraph", [False, True])
def test_sentinel_keeps_its_hooks_out_of_compiled_graphs(fullgraph):
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    compiled = torch.compile(model, fullgraph=fullgraph, backend="eager")
    x = torch.randn(3, 4)
    records = _Records()
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(records)
    try:
        with torch._dynamo.config.patch(recompile_limit=2):
            for _ in range(4):  # a fresh context per step (the decorator's way)
                with check_numerics(mode="sentinel", backend="torch"):
                    for _ in range(2):
                        y = compiled(x)
                        y.sum().backward()
                assert torch.allclose(y, model(x))
            with torch.no_grad():
                model[2].weight[0, 0] = NAN
            with pytest.raises(NonFiniteError) as info, check_numerics(mode="sentinel"):
                compiled(x).sum().backward()
    finally:
        logger.removeHandler(records)
    assert not [m for m in records.messages if "recompile_limit" in m]
    assert "Sequential" in info.value.op and info.value.phase == "forward"
    assert not torch.nn.modules.module._global_forward_hooks
