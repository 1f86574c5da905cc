"""locate_nonfinite on a Keras 3 model on every Keras backend (one process per backend:
Keras fixes its backend at import): the planted-fault catalogue of locate_models gives, on
TensorFlow, torch and JAX alike, the report torch gives for the same network; a functional
model is reported by its own layer names."""

from __future__ import annotations

import json
import re

import pytest

from tests.keras_backends import KERAS_BACKENDS, run_per_keras_backend

pytest.importorskip("keras")
pytest.importorskip("torch")

SCRIPT = r"""
import json, numpy as np, keras, torch
from keras import ops
from conformance_tests import locate_models as lm
from numstab import locate_nonfinite

sep = "_" if keras.backend.backend() == "torch" else "."  # torch names cannot hold dots
FIELDS = ("found", "layer", "phase", "nan_count", "inf_count", "params_finite",
          "inputs_finite", "nonfinite_params", "backward_checked", "layers_checked",
          "framework")

def keras_loss(logits, targets):
    t, scale = targets
    return scale * ops.mean(logits * ops.convert_to_tensor(t))

def both(fault, backward=True):
    scale = lm.LOSS_SCALE if fault == "fp16_backward" else 1.0
    ids, t = lm.tokens(with_padding=fault == "zero_div"), lm.targets()
    params = lm.weights(fault)
    ours = lm.keras_model(params, fault, sep=sep)
    theirs = lm.torch_model(params, fault)
    if not backward:
        return locate_nonfinite(ours, ids), locate_nonfinite(theirs, torch.from_numpy(ids))
    return (
        locate_nonfinite(ours, ids, loss_fn=keras_loss, targets=(t, scale)),
        locate_nonfinite(theirs, torch.from_numpy(ids), loss_fn=lm.torch_loss,
                         targets=(torch.from_numpy(t), scale)),
    )

out = {}
for fault in [*sorted(lm.FAULT_LAYER), None]:
    out[str(fault)] = [{f: getattr(r, f) for f in FIELDS} for r in both(fault)]
out["forward_only"] = [{f: getattr(r, f) for f in FIELDS} for r in both("fp16_backward", False)]

class Log(keras.layers.Layer):
    def call(self, x):
        return ops.log(x)

x = np.array([[1.0, -2.0, 3.0]], np.float32)  # log(-2 * 1) = NaN in "log"
inputs = keras.Input((3,))
hidden = keras.layers.Dense(3, kernel_initializer="identity", name="d1")(inputs)
functional = keras.Model(inputs, keras.layers.Dense(2, name="d2")(Log(name="log")(hidden)))
report = locate_nonfinite(functional, x, loss_fn=lambda y: ops.sum(y))
out["functional"] = {f: getattr(report, f) for f in FIELDS}

def value(run):
    try:
        return run()
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e)[:400]}

def outcome(run):
    return value(lambda: {f: getattr(run(), f) for f in FIELDS})

class Sub(keras.Model):
    def __init__(self):
        super().__init__(name="sub")
        self.d1 = keras.layers.Dense(3, kernel_initializer="identity", name="d1")
        self.log = Log(name="log")

    def call(self, x):
        return self.log(self.d1(x))

def unbuilt_sequential():
    d1 = keras.layers.Dense(3, kernel_initializer="identity", name="d1")
    return keras.Sequential([d1, Log(name="log"), keras.layers.Dense(2, name="d2")])

total = lambda y: ops.sum(y)
unbuilt = {}
seq = unbuilt_sequential()  # never called, no keras.Input
unbuilt["sequential"] = outcome(lambda: locate_nonfinite(seq, x))
unbuilt["sequential_again"] = outcome(lambda: locate_nonfinite(seq, x, loss_fn=total))
unbuilt["called_after"] = value(lambda: bool(np.isnan(ops.convert_to_numpy(seq(x))).any()))
sub = Sub()  # subclassed, never called
unbuilt["subclassed"] = outcome(lambda: locate_nonfinite(sub, x, loss_fn=total))
unbuilt["subclassed_called_after"] = value(lambda: list(ops.convert_to_numpy(sub(x)).shape))
unbuilt["layer_with_loss"] = outcome(
    lambda: locate_nonfinite(keras.layers.Dense(2), x, loss_fn=total))
unbuilt["cannot_build"] = outcome(
    lambda: locate_nonfinite(keras.Sequential([keras.layers.Reshape((5,))]), x))
out["unbuilt"] = unbuilt

losses = {
    "none": lambda y: None,
    "float": lambda y: 1.5,
    "int": lambda y: ops.cast(ops.sum(y), "int32"),
    "constant": lambda y: ops.convert_to_tensor(1.0),
}
clean = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
out["losses"] = {k: outcome(lambda: locate_nonfinite(clean, x, loss_fn=fn))
                 for k, fn in losses.items()}

compiles = []
if keras.backend.backend() == "jax":
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
steady = keras.Sequential(
    [keras.Input((3,)), keras.layers.Dense(3, "relu", name="d1"), keras.layers.Dense(2, name="d2")])
positive, kernel = np.abs(x), steady.layers[0].kernel
finite, inf = ops.convert_to_numpy(kernel), np.full((3, 3), np.inf, np.float32)
reuse = []
for weights in (finite, inf, finite, inf):  # inf: a step gone wrong
    if len(reuse) == 2:
        compiled_first = len(compiles)  # the pass, the reads of a found layer, assign
    kernel.assign(weights)
    reuse.append(outcome(lambda: locate_nonfinite(steady, positive, loss_fn=total)))
out["reuse"] = {"reports": reuse, "recompiles": len(compiles) - compiled_first}
print("RESULT" + json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def results():
    runs = run_per_keras_backend(SCRIPT)
    out = {}
    for backend, (code, stdout, stderr) in runs.items():
        assert code == 0, f"{backend}:\n{stderr[-3000:]}"
        out[backend] = json.loads(stdout.split("RESULT", 1)[1])
    return out


def _torch_name(name: str) -> str:
    return re.sub(r"^blocks_(\d+)", r"blocks.\1", name)


@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_planted_faults_reported_as_in_torch(results, backend):
    extra = ("functional", "unbuilt", "losses", "reuse")
    catalogue = {k: v for k, v in results[backend].items() if k not in extra}
    for fault, (ours, theirs) in catalogue.items():
        assert ours["framework"] == backend
        assert ours["found"] is theirs["found"], (fault, ours, theirs)
        if not ours["found"]:
            assert ours["layers_checked"] >= 26
            continue
        assert (_torch_name(ours["layer"]), ours["phase"]) == (theirs["layer"], theirs["phase"])
        assert ours["params_finite"] is theirs["params_finite"], (fault, ours)
        assert ours["inputs_finite"] is theirs["inputs_finite"] is True
        if fault != "fp16_backward":  # backward counts depend on the framework's fp16 kernels
            assert (ours["nan_count"], ours["inf_count"]) == (
                theirs["nan_count"],
                theirs["inf_count"],
            ), fault
        if fault == "inf_weight":  # the Keras variable's own path
            (path,) = ours["nonfinite_params"]
            assert path.endswith("/attn/v/kernel") and "blocks" in path, path
    assert not results[backend]["forward_only"][0]["found"]
    assert not results[backend]["forward_only"][0]["backward_checked"]


@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_functional_model_layers_by_name(results, backend):
    report = results[backend]["functional"]
    assert (report["layer"], report["phase"], report["inputs_finite"]) == ("log", "forward", True)
    assert report["nan_count"] == 1


@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_unbuilt_model_is_built_first(results, backend):
    """An unbuilt model is built by one plain call before locating (before: TensorFlow's
    out-of-scope graph tensors, torch's meta tensors, and on JAX variables made of tracers,
    which broke every later call of the model); one that cannot be built is refused."""
    unbuilt = results[backend]["unbuilt"]
    for case in ("sequential", "sequential_again", "subclassed"):
        report = unbuilt[case]
        assert (report.get("layer"), report.get("phase")) == ("log", "forward"), (case, report)
        assert report["nan_count"] == 1 and report["framework"] == backend
    assert unbuilt["sequential_again"]["backward_checked"]
    assert unbuilt["called_after"] is True  # still usable: log(-2) is NaN
    assert unbuilt["subclassed_called_after"] == [1, 3]
    layer = unbuilt["layer_with_loss"]
    assert (layer.get("found"), layer.get("layers_checked")) == (False, 2), layer
    refused = unbuilt["cannot_build"]
    assert refused.get("error") == "InvalidArgumentError", refused
    assert "Expected a built Keras model" in refused["message"]


@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_loss_fn_return_value_rule(results, backend):
    """§15.3's one rule for the loss, as on torch and JAX: before, None raised TensorFlow's
    or JAX's own ValueError or an AttributeError on torch; a float or an integer array
    passed on TensorFlow and JAX and raised on torch; a constant tensor raised on torch."""
    losses = results[backend]["losses"]
    for case, received in [("none", "None"), ("float", "1.5"), ("int", "dtype int32")]:
        outcome = losses[case]
        assert outcome.get("error") == "InvalidArgumentError", (case, outcome)
        assert f"framework ({backend})" in outcome["message"], outcome
        assert f"loss_fn returned {received}" in outcome["message"].replace(
            f"a {backend} array of ", ""
        ), outcome
    constant = losses["constant"]
    assert (constant.get("found"), constant.get("backward_checked")) == (False, True), constant


@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_locating_again_reads_the_new_weights(results, backend):
    """Locating the model again after its weights changed reports on the new weights; on
    JAX without compiling again (the values are arguments of the cached pass: each call
    compiled its pass anew)."""
    reports = results[backend]["reuse"]["reports"]
    for clean in reports[::2]:
        assert clean.get("found") is False and clean["layers_checked"] == 4, clean
    for bad in reports[1::2]:
        assert (bad.get("layer"), bad.get("phase"), bad["params_finite"]) == (
            "d1",
            "forward",
            False,
        ), bad
    if backend == "jax":
        assert results[backend]["reuse"]["recompiles"] == 0
