"""locate_nonfinite on unmodified Equinox and Flax NNX models: the planted-fault catalogue of
locate_models gives the report torch gives for the same network, under each library's own
layer names (Equinox field paths ``blocks[1].attn.v``; NNX attribute paths, torch's)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from conformance_tests import locate_models as lm
from conformance_tests.conftest import requested_backends
from numstab import locate_nonfinite
from numstab.errors import InvalidArgumentError

if not {"jax", "torch"} <= set(requested_backends()):
    pytest.skip("compares JAX module libraries with torch", allow_module_level=True)

LIBRARIES = {
    "equinox": (lm.equinox_model, lambda name: re.sub(r"\.(\d+)", r"[\1]", name)),
    "nnx": (lm.nnx_model, lambda name: name),
    "linen": (lm.linen_model, lambda name: re.sub(r"^blocks\.(\d+)", r"blocks_\1", name)),
}
_MODULES = {"equinox": "equinox", "nnx": "flax.nnx", "linen": "flax.linen"}
_MODELS: dict = {}


def _models(library: str, fault: str | None):
    key = (library, fault)
    if key not in _MODELS:
        pytest.importorskip(_MODULES[library])
        params = lm.weights(fault)
        _MODELS[key] = (LIBRARIES[library][0](params, fault), lm.torch_model(params, fault))
    return _MODELS[key]


def _locate(model, framework: str, fault: str | None, *, backward: bool = True):
    import jax.numpy as jnp
    import torch

    scale = lm.LOSS_SCALE if fault == "fp16_backward" else 1.0
    ids, t = lm.tokens(with_padding=fault == "zero_div"), lm.targets()
    if framework == "torch":
        inputs, targets, loss = (
            (torch.from_numpy(ids),),
            (torch.from_numpy(t), scale),
            lm.torch_loss,
        )
    else:
        inputs, targets, loss = (jnp.asarray(ids),), (jnp.asarray(t), scale), lm.jax_loss
    if not backward:
        return locate_nonfinite(model, *inputs)
    return locate_nonfinite(model, *inputs, loss_fn=loss, targets=targets)


@pytest.mark.parametrize("library", sorted(LIBRARIES))
@pytest.mark.parametrize("fault", sorted(lm.FAULT_LAYER))
def test_planted_fault_reported_as_in_torch(library, fault):
    model, torch_model = _models(library, fault)
    ours, theirs = _locate(model, "jax", fault), _locate(torch_model, "torch", fault)
    rename = LIBRARIES[library][1]
    assert ours.found and ours.layer == rename(lm.FAULT_LAYER[fault]), str(ours)
    assert (ours.phase, ours.layer) == (theirs.phase, rename(theirs.layer)), (ours, theirs)
    assert ours.params_finite is theirs.params_finite
    assert ours.inputs_finite is theirs.inputs_finite is True
    if fault != "fp16_backward":  # backward counts depend on the framework's fp16 kernels
        assert (ours.nan_count, ours.inf_count) == (theirs.nan_count, theirs.inf_count)
    assert ours.backward_checked and ours.framework == "jax"


@pytest.mark.parametrize("library", sorted(LIBRARIES))
def test_clean_run_and_forward_only(library):
    model, _ = _models(library, None)
    clean = _locate(model, "jax", None)
    assert not clean.found and clean.layers_checked >= 26, str(clean)
    model, _ = _models(library, "fp16_backward")
    forward_only = _locate(model, "jax", "fp16_backward", backward=False)
    assert not forward_only.found and not forward_only.backward_checked


def test_unsupported_model_names_what_is_supported():
    with pytest.raises(InvalidArgumentError, match="Flax NNX Module or bound linen"):
        locate_nonfinite(object(), np.zeros(3))
    linen = pytest.importorskip("flax.linen")
    with pytest.raises(InvalidArgumentError, match=r"bound Flax linen module .*bind"):
        locate_nonfinite(linen.Dense(3), np.ones((1, 2), np.float32))
