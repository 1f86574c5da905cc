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


@pytest.mark.parametrize("library", sorted(LIBRARIES))
def test_a_model_of_the_same_structure_reuses_the_compiled_pass(library):
    """The model's arrays are arguments of the compiled pass, not constants in it: locating a
    model again, or another of the same structure (here with an inf weight), compiles nothing
    (each call compiled its pass again, 3 to 6 s) and reports on that model's own values."""
    import jax.monitoring

    clean, faulty = _models(library, None)[0], _models(library, "inf_weight")[0]
    assert not _locate(clean, "jax", None).found  # compiles the pass (and the details' reads)
    assert _locate(faulty, "jax", "inf_weight").found
    compiles = []

    def count(event: str, seconds: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        for model, fault in ((clean, None), (faulty, "inf_weight"), (clean, None)):
            report = _locate(model, "jax", fault)
            want = LIBRARIES[library][1](lm.FAULT_LAYER[fault]) if fault else None
            assert report.found is (fault is not None) and report.layer == want, str(report)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert compiles == []


def test_unsupported_model_names_what_is_supported():
    with pytest.raises(InvalidArgumentError, match="Flax NNX Module or bound linen"):
        locate_nonfinite(object(), np.zeros(3))
    linen = pytest.importorskip("flax.linen")
    with pytest.raises(InvalidArgumentError, match=r"bound Flax linen module .*bind"):
        locate_nonfinite(linen.Dense(3), np.ones((1, 2), np.float32))


# -- the model's own code is the layer "" (torch's root module) -----------------------------
_ROOT_FIELDS = (
    "found",
    "layer",
    "phase",
    "nan_count",
    "inf_count",
    "inputs_finite",
    "params_finite",
    "grad_output_finite",
    "layers_checked",
    "backward_checked",
)
#: (case, output) pairs: every case of ``lm.ROOT_CASES`` with an array output, and after a
#: clean sub-module a tuple and a dict output too
_ROOT_CASES = [
    *((case, "array") for case in lm.ROOT_CASES),
    ("after_child", "tuple"),
    ("after_child", "dict"),
]


def _sum_of_leaves(out):
    leaves = out.values() if isinstance(out, dict) else out if isinstance(out, tuple) else [out]
    return sum(t.sum() for t in leaves)


def _locate_root(library: str, case: str, out: str, with_loss: bool, own: bool | None = None):
    model = lm.root_net(library, case, out, own=own)
    x = np.array([1.0, np.nan, 1.0] if case == "no_children" else [1.0, 1.0, 1.0], np.float32)
    if library == "torch":
        import torch

        x = torch.from_numpy(x)
    else:
        import jax.numpy as jnp

        x = jnp.asarray(x)
    return locate_nonfinite(model, x, loss_fn=_sum_of_leaves if with_loss else None)


@pytest.mark.parametrize("library", [*sorted(LIBRARIES), "jax"])
@pytest.mark.parametrize(("case", "out"), _ROOT_CASES)
@pytest.mark.parametrize("with_loss", [False, True], ids=["forward", "loss"])
def test_the_models_own_code_is_the_layer_root_as_in_torch(library, case, out, with_loss):
    """A NaN made by the model's own code after a clean sub-module (array, tuple or dict
    output), a NaN input through a model without sub-modules (with a loss: the model's, not
    the loss's), an inf gradient of the model's own parameter: torch's report, layer ""."""
    if library == "jax" and case == "own_param_grad":
        pytest.skip("a plain JAX function has no parameters of its own")
    pytest.importorskip(_MODULES.get(library, "jax"))
    ours = _locate_root(library, case, out, with_loss)
    theirs = _locate_root("torch", case, out, with_loss, own=False if library == "jax" else None)
    assert ours.found is (case != "own_param_grad" or with_loss), str(ours)
    if ours.found:
        assert ours.layer == "" and ours.layer_type == ("net" if library == "jax" else "Net")
        assert ours.phase == ("backward" if case == "own_param_grad" else "forward")
    assert {f: getattr(ours, f) for f in _ROOT_FIELDS} == {
        f: getattr(theirs, f) for f in _ROOT_FIELDS
    }, (str(ours), str(theirs))
    assert len(ours.nonfinite_params) == len(theirs.nonfinite_params)
    assert theirs.layer_type == ("Net" if theirs.found else None)


def test_training_mode_is_refused_with_how_to_leave_it():
    """A Dropout drawing RNGs or a BatchNorm updating its statistics cannot run inside the
    traced pass: flax's TraceContextError (NNX), InvalidRngError and ModifyScopeVariableError
    (linen) became InvalidArgumentError naming the deterministic mode; the model stays
    usable, and locates once in that mode."""
    pytest.importorskip("flax")
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.fc, self.drop = nnx.Linear(3, 3, rngs=rngs), nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.fc(x))

    x = jnp.ones((2, 3))
    net = Net(nnx.Rngs(0))
    with pytest.raises(InvalidArgumentError, match=r"deterministic mode \(model\.eval\(\)\)"):
        locate_nonfinite(net, x)
    assert net(x).shape == (2, 3)
    net.eval()
    assert not locate_nonfinite(net, x).found

    class Linen(nn.Module):
        deterministic: bool

        @nn.compact
        def __call__(self, x):
            x = nn.BatchNorm(use_running_average=self.deterministic)(nn.Dense(3)(x))
            return nn.Dropout(0.5, deterministic=self.deterministic)(x)

    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    variables = Linen(False).init(rngs, x)
    for bound in (
        Linen(False).bind(variables, rngs={"dropout": jax.random.key(2)}),  # InvalidRngError
        Linen(False).bind(variables, mutable=["batch_stats"]),  # ModifyScopeVariableError
    ):
        with pytest.raises(InvalidArgumentError, match="deterministic mode"):
            locate_nonfinite(bound, x)
    assert not locate_nonfinite(Linen(True).bind(variables), x).found

    eqx = pytest.importorskip("equinox")  # Equinox's RuntimeError "Dropout requires a key"
    em = eqx.nn.Sequential([eqx.nn.Linear(3, 3, key=jax.random.key(0)), eqx.nn.Dropout(0.5)])
    with pytest.raises(InvalidArgumentError, match=r"\(eqx\.nn\.inference_mode\(model\)\)"):
        locate_nonfinite(em, x[0])
    assert not locate_nonfinite(eqx.nn.inference_mode(em), x[0]).found
