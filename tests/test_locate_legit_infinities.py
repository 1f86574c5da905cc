"""locate_nonfinite on models that output -inf on purpose (a padded-vocabulary mask, §4.4.3).

An inf of the forward pass that does not reach the loss (the model's output without a loss)
is not the fault: the backward pass is still examined, and the report names where the inf
was born (``inf_layer``). A NaN born from finite values outranks an earlier inf; an inf
that reaches the loss, or a NaN made from an inf, is blamed where the first inf was born.
Before, the mask layer was reported as the fault and the backward pass never examined
(docs/semantics.md §15.3, "Which layer is first").
"""

from __future__ import annotations

import numpy as np
import pytest

import numstab as ns

VOCAB, REAL = 16, 12  # the last VOCAB - REAL logits are padding, masked to -inf


def _torch_pad_vocab(name):
    """A torch module class (named ``name``) masking the padded logits to -inf."""
    import torch

    def forward(self, x):
        return x.masked_fill(torch.arange(x.shape[-1]) >= REAL, float("-inf"))

    return type(name, (torch.nn.Module,), {"forward": forward})


def test_torch_masked_vocab_backward_nan_is_found():
    torch = pytest.importorskip("torch")
    nn = torch.nn

    PadVocab = _torch_pad_vocab("PadVocab")

    class RowNorm(nn.Module):  # NaN gradient on an all-zero row: sqrt'(0)
        def forward(self, x):
            return x * torch.sqrt((x * x).sum(-1, keepdim=True))

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), RowNorm(), nn.Linear(8, VOCAB), PadVocab())
    x, y = torch.randn(4, 8), torch.randint(0, REAL, (4,))
    loss = lambda out: ns.cross_entropy(out, y)  # finite: -inf logits are allowed
    clean = ns.locate_nonfinite(net, x, loss_fn=loss)
    assert not clean.found and clean.backward_checked, str(clean)
    assert (clean.inf_layer, clean.inf_layer_type) == ("3", "PadVocab")
    assert "'3' (PadVocab) output inf" in str(clean) and "loss stayed finite" in str(clean)

    with torch.no_grad():
        net[0].weight.zero_()
        net[0].bias.zero_()
    report = ns.locate_nonfinite(net, x, loss_fn=loss)
    assert (report.found, report.phase, report.layer) == (True, "backward", "1"), str(report)
    assert (report.nan_count, report.inf_count) == (4 * 8, 0)
    assert report.inf_layer == "3" and "forward inf, not the fault" in str(report)

    # without a loss, the model's output is the end result: it holds the -inf, so the mask
    # is where the first non-finite value was born (as before)
    forward_only = ns.locate_nonfinite(net, x)
    assert (forward_only.phase, forward_only.layer, forward_only.inf_layer) == (
        "forward",
        "3",
        None,
    )


def test_torch_nan_from_finite_values_outranks_an_earlier_inf():
    torch = pytest.importorskip("torch")
    nn = torch.nn

    Mask = _torch_pad_vocab("Mask")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, VOCAB), Mask(), nn.Softmax(-1), nn.Linear(VOCAB, 4))
    x = torch.randn(3, 8)
    # forward only, the inf absorbed by the softmax: no fault, the mask named
    clean = ns.locate_nonfinite(net, x)
    assert not clean.found and clean.inf_layer == "1", str(clean)
    assert "no inf reaching the model's output" in str(clean)

    with torch.no_grad():
        net[3].weight[0, 0] = float("nan")
    report = ns.locate_nonfinite(net, x, loss_fn=lambda out: out.sum())
    assert (report.phase, report.layer, report.layer_type) == ("forward", "3", "Linear")
    assert report.inputs_finite and report.nonfinite_params == ("3.weight",), str(report)
    assert (report.inf_layer, report.inf_layer_type) == ("1", "Mask")
    assert "earlier forward inf, not this fault's cause" in str(report)

    # an overflow that turns into NaN downstream is still blamed where the inf was born
    net = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    with torch.no_grad():
        net[0].weight[0, 0] = float("inf")
    report = ns.locate_nonfinite(net, torch.ones(3, 8), loss_fn=lambda out: out.sum())
    assert (report.phase, report.layer, report.inf_layer) == ("forward", "0", None), str(report)


def test_nnx_and_keras_masked_vocab():
    jax = pytest.importorskip("jax")
    nnx = pytest.importorskip("flax.nnx")
    jnp = jax.numpy

    class PadVocab(nnx.Module):
        def __call__(self, x):
            return jnp.where(jnp.arange(x.shape[-1]) >= REAL, -jnp.inf, x)

    class RowNorm(nnx.Module):
        def __call__(self, x):
            return x * jnp.sqrt((x * x).sum(-1, keepdims=True))

    class Net(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.fc = nnx.Linear(8, 8, rngs=rngs)
            self.norm = RowNorm()
            self.head = nnx.Linear(8, VOCAB, rngs=rngs)
            self.pad = PadVocab()

        def __call__(self, x):
            return self.pad(self.head(self.norm(self.fc(x))))

    x = jax.random.normal(jax.random.PRNGKey(1), (4, 8))
    y = jnp.arange(4) % REAL
    net = Net()
    net.fc.kernel.value = jnp.zeros_like(net.fc.kernel.value)
    report = ns.locate_nonfinite(net, x, loss_fn=lambda out: ns.cross_entropy(out, y))
    assert (report.phase, report.layer, report.layer_type) == ("backward", "norm", "RowNorm")
    assert (report.inf_layer, report.inf_layer_type) == ("pad", "PadVocab"), str(report)

    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        return  # Keras on torch and JAX share summarise; TensorFlow is the adapter left

    class KPad(keras.layers.Layer):
        def call(self, x):
            return keras.ops.where(keras.ops.arange(VOCAB) >= REAL, -np.inf, x)

    inp = keras.Input((8,))
    out = KPad(name="pad")(keras.layers.Dense(VOCAB, name="head")(inp))
    model = keras.Model(inp, out)
    ys = keras.ops.convert_to_tensor(np.arange(4) % REAL)
    report = ns.locate_nonfinite(
        model, np.asarray(x), loss_fn=lambda out: ns.cross_entropy(out, ys)
    )
    assert not report.found and report.backward_checked, str(report)
    assert (report.inf_layer, report.inf_layer_type) == ("pad", "KPad")


KERAS_SCRIPT = r"""
import json
import numpy as np, keras
from keras import ops
import numstab as ns

VOCAB, REAL = 16, 12

class PadVocab(keras.layers.Layer):
    def call(self, x):
        return ops.where(ops.arange(VOCAB) >= REAL, -np.inf, x)

class RowNorm(keras.layers.Layer):  # NaN gradient on an all-zero row: sqrt'(0) = inf, * 0
    def call(self, x):  # (not x * sqrt: TensorFlow gives sqrt a 0 gradient where dy is 0)
        return x + ops.sqrt(ops.sum(x * x, axis=-1, keepdims=True))

keras.utils.set_random_seed(0)
inp = keras.Input((8,))
hidden = RowNorm(name="norm")(keras.layers.Dense(8, name="fc")(inp))
model = keras.Model(inp, PadVocab(name="pad")(keras.layers.Dense(VOCAB, name="head")(hidden)))
x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
y = ops.convert_to_tensor(np.arange(4) % REAL)
loss = lambda out: ns.cross_entropy(out, y)  # finite: -inf logits are allowed
FIELDS = ("found", "phase", "layer", "layer_type", "nan_count", "inf_count",
          "backward_checked", "inf_layer", "inf_layer_type")
out = {}
def record(key, report):
    out[key] = {f: getattr(report, f) for f in FIELDS}
    out[key]["text"] = str(report)
record("clean", ns.locate_nonfinite(model, x, loss_fn=loss))
fc = model.get_layer("fc")
fc.kernel.assign(np.zeros((8, 8), "float32"))
fc.bias.assign(np.zeros(8, "float32"))
record("nan", ns.locate_nonfinite(model, x, loss_fn=loss))
record("forward_only", ns.locate_nonfinite(model, x))
print("REPORTS " + json.dumps(out))
"""


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_keras_masked_vocab_backward_nan_is_found(backend):
    """The torch test above on a functional Keras model, on each Keras backend (a process
    each): the -inf padding layer is named in ``inf_layer`` and is no fault, and a real NaN
    gradient behind it (an all-zero row into a norm) is still found in the backward pass."""
    import importlib.util
    import json

    from tests.keras_backends import run_per_keras_backend

    for module in ("keras", backend):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    code, stdout, stderr = run_per_keras_backend(KERAS_SCRIPT, (backend,))[backend]
    lines = [line for line in stdout.splitlines() if line.startswith("REPORTS ")]
    assert code == 0 and lines, stderr[-4000:]
    reports = json.loads(lines[-1].removeprefix("REPORTS "))

    clean = reports["clean"]
    assert not clean["found"] and clean["backward_checked"], clean["text"]
    assert (clean["inf_layer"], clean["inf_layer_type"]) == ("pad", "PadVocab")
    assert "'pad' (PadVocab) output inf" in clean["text"]
    assert "loss stayed finite" in clean["text"]

    nan = reports["nan"]
    assert (nan["found"], nan["phase"], nan["layer"]) == (True, "backward", "norm"), nan["text"]
    assert (nan["layer_type"], nan["nan_count"], nan["inf_count"]) == ("RowNorm", 4 * 8, 0)
    assert (nan["inf_layer"], nan["inf_layer_type"]) == ("pad", "PadVocab")
    assert "forward inf, not the fault" in nan["text"]

    # without a loss, the model's output holds the -inf: the mask is the first non-finite
    forward_only = reports["forward_only"]
    got = (forward_only["phase"], forward_only["layer"], forward_only["inf_layer"])
    assert got == ("forward", "pad", None), forward_only["text"]
