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
print("RESULT" + json.dumps(out))
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
    catalogue = {k: v for k, v in results[backend].items() if k != "functional"}
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
