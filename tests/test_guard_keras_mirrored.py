"""The Keras guard callback under ``tf.distribute.MirroredStrategy`` over 2 logical CPU devices,
in both modes (``host_every`` 1 and 4): ``fit`` skips a batch whose NaN sits in one replica's
half alike in both, and ``load_snapshot`` resumes a new process's model (its optimizer not
built yet) from the files, called outside or inside ``strategy.scope()``.

Before, the default callback (``host_every=1``) raised ``ValueError: object __array__ method
not producing an array`` at ``on_train_begin`` (NumPy's conversion of the loss tracker's
sync-on-read variables); ``load_snapshot`` raised TF's ``RuntimeError: Need to be inside
"with strategy.scope()"`` (the optimizer built outside it), and inside the scope the same
``ValueError``. Runs in subprocesses: logical devices must be configured before TensorFlow
initialises, which the rest of the test session has already done.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("keras")

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240

SCRIPT = r"""
import json, os, shutil, sys, tempfile
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
os.environ["KERAS_BACKEND"] = "tensorflow"
import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras
import numstab as ns

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32")
y = x.sum(1, keepdims=True)
bad = x.copy()
bad[20, 0] = np.nan  # batch 1 (rows 16-31): in replica 0's half (16-23) only
FIT = dict(verbose=0, shuffle=False)
phase, folder = sys.argv[1], sys.argv[2]


def model_of(seed):
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def values(model):
    return [v.numpy().tolist() for v in list(model.weights) + list(model.optimizer.variables)]


def fitted(model, data, cb=None, batch_size=16):
    history = model.fit(data, y, batch_size=batch_size, callbacks=[cb] if cb else [], **FIT)
    return {"values": values(model), "loss": history.history["loss"],
            "iterations": int(model.optimizer.iterations.numpy()),
            "skips": [e["step"] for e in cb.events if e["event"] == "skip"] if cb else []}


out = {"replicas": strategy.num_replicas_in_sync}
if phase == "fit":
    # the reference: the same epoch without the bad batch (rows 16-31) and without a guard
    keep = np.r_[0:16, 32:64]
    model = model_of(0)
    model.fit(x[keep], y[keep], batch_size=16, **FIT)
    out["reference"] = values(model)
    for host_every in (1, 4):
        out[host_every] = fitted(model_of(0), bad, ns.TrainingGuard(host_every=host_every)
                                 .keras_callback())
        # the files to resume from: 8 batches, snapshots at steps 4 and 8
        guard = ns.TrainingGuard(host_every=host_every, snapshot_every=4,
                                 snapshot_dir=f"{folder}/{host_every}")
        out[f"{host_every}-files"] = fitted(model_of(0), x, guard.keras_callback(), 8)
else:  # a new process resumes from the files, then goes on (a NaN batch skipped)
    for host_every in (1, 4):
        for where in ("outside", "inside"):
            files = tempfile.mkdtemp() + "/files"
            shutil.copytree(f"{folder}/{host_every}", files)
            model = model_of(1)
            cb = ns.TrainingGuard(host_every=host_every, snapshot_every=4,
                                  snapshot_dir=files).keras_callback()
            if where == "inside":
                with strategy.scope():
                    step = cb.load_snapshot(model)
            else:
                step = cb.load_snapshot(model)
            run = {"step": step, "loaded": values(model)}
            run.update(fitted(model, bad, cb, 8))  # the NaN: batch 2, replica 1's half
            out[f"{host_every}-{where}"] = run
print(json.dumps(out))
"""


def _run(phase: str, folder: Path) -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "tensorflow"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, phase, str(folder)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    folder = tmp_path_factory.mktemp("mirrored")
    first = _run("fit", folder)
    return first, _run("resume", folder)


def _close(a: list, b: list) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)


def test_two_replicas(runs):
    assert runs[0]["replicas"] == 2


@pytest.mark.parametrize("host_every", ["1", "4"])
def test_fit_skips_a_nan_batch_of_one_replica(runs, host_every):
    first = runs[0]
    run = first[host_every]
    assert run["skips"] == [1]
    assert run["iterations"] == 3  # 4 batches, one undone
    assert all(np.isfinite(loss) for loss in run["loss"])
    # the epoch is the one without the bad batch, in both modes alike
    _close(run["values"][:4], first["reference"][:4])
    _close(run["values"], first["1"]["values"])


@pytest.mark.parametrize("where", ["outside", "inside"])
@pytest.mark.parametrize("host_every", ["1", "4"])
def test_load_snapshot_resumes_under_the_strategy(runs, host_every, where):
    first, resumed = runs[0][f"{host_every}-files"], runs[1][f"{host_every}-{where}"]
    assert first["iterations"] == 8 and first["skips"] == []
    assert resumed["step"] == 8  # the newest file: the state after the first run's epoch
    assert resumed["loaded"] == first["values"]  # the file's values, exactly
    assert resumed["iterations"] == 15  # 7 more applied, the NaN batch undone
    assert resumed["skips"] == [10]
    assert all(np.isfinite(loss) for loss in resumed["loss"])
