"""``check_numerics()`` (``mode="op"``) around Keras 3 models on every Keras backend (docs
§14.3): the ``NonFiniteError`` carries the attributes of the backend's row.

Keras's layer call (``inject_argument_info_in_traceback``) catches an exception ``e`` and
raises ``e.__class__(message)`` from None, the message wrapped in ANSI codes
(``\\x1b[1m...\\x1b[0m``) and followed by the call's arguments. Before: on Keras-torch the
``NonFiniteError`` raised by numstab's op check came out with every attribute ``None``; on
Keras-JAX ``op`` was ``'dot_general\\x1b[0m'`` (the reset code read as part of the name) and
``op_kind`` ``None``; on Keras-TensorFlow the detail was the last line of Keras's argument
list. Now the re-created exception is traced back to the original when it leaves the
context, and ANSI codes are stripped wherever numstab parses a framework's message.
"""

from __future__ import annotations

import json
import re

import pytest

from numstab import NonFiniteError, check_numerics
from numstab.numerics._ops import floating_point_match
from tests.keras_backends import KERAS_BACKENDS, run_per_keras_backend

SCRIPT = r"""
import json, numpy as np, keras, numstab

class SafeLog(keras.layers.Layer):
    def call(self, x):
        return keras.ops.log(x)  # LOG LINE

def report(fn):
    try:
        with numstab.check_numerics():
            fn()
    except Exception as e:
        fields = ("framework", "op", "op_kind", "phase", "where", "nan_count", "inf_count")
        out = {f: getattr(e, f, "missing") for f in fields}
        cause = e.__cause__
        return {**out, "type": type(e).__name__, "message": str(e),
                "cause": None if cause is None else [type(cause).__name__, str(cause)]}
    return None

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="fc"),
                          SafeLog(name="log"), keras.layers.Dense(1, name="head")])
model.compile(optimizer="sgd", loss="mse")
rng = np.random.default_rng(0)
x = -np.abs(rng.standard_normal((8, 4))).astype("float32") - 0.5
y = np.zeros((8, 1), "float32")
train = report(lambda: model.train_on_batch(x, y))

norm = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="fc"),
                         keras.layers.LayerNormalization()])
kernel = norm.get_layer("fc").kernel
value = np.array(kernel.numpy())
value[0, 0] = np.inf
kernel.assign(value)
eager = report(lambda: norm(np.ones((2, 4), "float32")))  # EAGER LINE
print("RESULT" + json.dumps({"train": train, "eager": eager}))
"""

#: the op each backend names: (train_on_batch's log, the eager call with an inf kernel)
EXPECTED = {
    "torch": (("aten.log.default", "log"), ("aten.native_layer_norm.default", None)),
    "jax": (("log", "log"), ("dot_general", "matmul")),
    "tensorflow": (("Log", "log"), ("ReadVariableOp", None)),
}
#: the native exception each backend's error keeps as its cause (§14.3)
CAUSE = {"torch": None, "jax": "FloatingPointError", "tensorflow": "InvalidArgumentError"}


def _run(backend, tmp_path):
    pytest.importorskip("keras")
    pytest.importorskip("jax" if backend == "jax" else backend)
    script = tmp_path / "keras_model.py"  # a file: frames of `python -c` are no user frames
    script.write_text(SCRIPT)
    runner = f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')"
    code, out, err = run_per_keras_backend(runner, (backend,))[backend]
    assert code == 0, err[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("RESULT"))
    lines = SCRIPT.splitlines()
    numbers = {t: 1 + next(i for i, x in enumerate(lines) if t in x) for t in ("LOG", "EAGER")}
    return json.loads(line[len("RESULT") :]), str(script), numbers


@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_the_error_of_a_keras_layer_carries_its_attributes(backend, tmp_path):
    result, path, numbers = _run(backend, tmp_path)
    for case, (op, kind), line in zip(
        ("train", "eager"), EXPECTED[backend], (numbers["LOG"], numbers["EAGER"]), strict=True
    ):
        e = result[case]
        assert e is not None, f"{case}: nothing raised"
        assert e["type"] == "NonFiniteError"
        assert (e["framework"], e["op"], e["op_kind"], e["phase"]) == (backend, op, kind, "forward")
        assert e["where"] == f"{path}:{line}", case
        assert "\x1b" not in e["message"] and e["message"].startswith("check_numerics: ")
        assert "Arguments received by" not in e["message"]
        assert (None if e["cause"] is None else e["cause"][0]) == CAUSE[backend]
        if e["cause"] is not None:  # the framework's own exception, not Keras's copy
            assert "\x1b" not in e["cause"][1] and "Arguments received" not in e["cause"][1]
        if backend == "jax":
            assert e["nan_count"] is None and e["inf_count"] is None
        else:  # exact counts (torch) / TensorFlow's counts
            assert isinstance(e["nan_count"], int) and isinstance(e["inf_count"], int)
            assert e["nan_count"] + e["inf_count"] > 0


# -- the same re-creation, without Keras ------------------------------------------------------


def _recreate(e: BaseException) -> BaseException:
    """What Keras's layer call raises for ``e`` (``e.__class__(message)`` from None)."""
    message = (
        "Exception encountered when calling Dense.call().\n\n"
        f"\x1b[1m{e.args[0]}\x1b[0m\n\nArguments received by Dense.call():\n  • x=tensor"
    )
    new = e.__class__(message)
    new._keras_call_info_injected = True
    return new


def _layer_call(e: BaseException) -> None:
    try:
        raise e
    except Exception as caught:
        raise _recreate(caught).with_traceback(caught.__traceback__) from None


def test_a_recreated_nonfinite_error_gets_its_attributes_and_message_back():
    original = NonFiniteError(
        "check_numerics: torch aten.log.default produced 1 NaN ...",
        framework="torch",
        op="aten.log.default",
        op_kind="log",
        phase="forward",
        where="model.py:3",
        nan_count=1,
        inf_count=0,
    )
    with pytest.raises(NonFiniteError) as info, check_numerics(backend="numpy"):
        _layer_call(original)
    e = info.value
    assert e is not original and e.__context__ is original and e.__suppress_context__
    assert str(e) == str(original)
    fields = ("framework", "op", "op_kind", "phase", "where", "nan_count", "inf_count")
    assert [getattr(e, f) for f in fields] == [getattr(original, f) for f in fields]


def test_a_recreated_jax_message_is_parsed_from_the_original():
    pytest.importorskip("jax")
    native = FloatingPointError("invalid value (inf) encountered in dot_general")
    with pytest.raises(NonFiniteError) as info, check_numerics(backend="jax"):
        _layer_call(native)
    e = info.value
    assert (e.framework, e.op, e.op_kind, e.phase) == ("jax", "dot_general", "matmul", "forward")
    assert e.__cause__ is native and "\x1b" not in str(e)
    assert e.where is not None and e.where.startswith(__file__)
    # only a re-creation is traced back: another class raised from None stays as it is
    with pytest.raises(ValueError, match="bad batch"), check_numerics(backend="jax"):
        try:
            raise FloatingPointError("invalid value (nan) encountered in log")
        except FloatingPointError:
            raise ValueError("bad batch: invalid value (nan) encountered in log") from None


def test_ansi_codes_are_stripped_before_a_message_is_parsed():
    pattern = re.compile(r"invalid value \((nan|inf)\) encountered in (\S+)")
    wrapped = FloatingPointError("\x1b[1minvalid value (nan) encountered in log\x1b[0m\n")
    assert floating_point_match(wrapped, pattern) == ("nan", "log")
