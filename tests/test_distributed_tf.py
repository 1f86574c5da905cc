"""LossScaleOptimizer under tf.distribute.MirroredStrategy over 2 logical CPU devices.

Runs in a subprocess: logical devices must be configured before TensorFlow initialises, which
the rest of the test session has already done. One replica's gradients overflow; both replicas
must skip the step, and the scale must back off once (not once per replica).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("keras")

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60

SCRIPT = r"""
import json, math, os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
os.environ["KERAS_BACKEND"] = "tensorflow"
import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras
from numstab import LossScaler
from numstab.integrations.keras import LossScaleOptimizer

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def local(strategy, var):
    return [v.numpy().tolist() for v in strategy.experimental_local_results(var.value)]


def custom_loop(max_norm):
    with strategy.scope():
        w = keras.Variable(np.zeros(2, np.float32))
        opt = LossScaleOptimizer(
            keras.optimizers.SGD(1.0), LossScaler.preset("keras", growth_interval=100),
            max_norm=max_norm,
        )
        opt.build([w])

    @tf.function
    def step(poison):
        def replica_fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            # unscaled: replica 0 [3, 0], replica 1 [0, 4]; their sum [3, 4] has norm 5
            g = tf.where(tf.equal(rid, 0), tf.constant([3.0, 0.0]), tf.constant([0.0, 4.0]))
            bad = tf.logical_and(poison, tf.equal(rid, 1))
            g = tf.where(bad, tf.constant([0.0, math.inf]), g)  # replica 1 only overflows
            opt.apply([g * opt.dynamic_scale], [w])

        strategy.run(replica_fn)

    trace = []
    for poison in (False, True, True, False):
        step(tf.constant(poison))
        trace.append(
            {"w": local(strategy, w), "scale": local(strategy, opt.dynamic_scale),
             "tracker": local(strategy, opt.growth_tracker),
             "iterations": int(opt.iterations.numpy())}
        )
    return trace


def fit():
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        opt = LossScaleOptimizer(keras.optimizers.SGD(0.01))
        model.compile(optimizer=opt, loss="mse")
    x = np.ones((8, 3), np.float32)
    x[7, 0] = np.nan  # the last sample of the second batch: one replica's half of it
    model.fit(x, np.ones((8, 1), np.float32), batch_size=4, shuffle=False, verbose=0)
    return {
        "finite": bool(all(np.isfinite(v).all() for v in model.get_weights())),
        "scale": local(strategy, opt.dynamic_scale),
        "iterations": int(opt.iterations.numpy()),
    }


print(json.dumps({
    "replicas": strategy.num_replicas_in_sync,
    "plain": custom_loop(None),
    "clipped": custom_loop(1.0),
    "fit": fit(),
}))
"""


@pytest.fixture(scope="module")
def result() -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "tensorflow"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert time.perf_counter() - start < TIMEOUT_S
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _same_on_every_replica(values: list) -> object:
    assert all(v == values[0] for v in values), values
    return values[0]


S = 2.0**15


def test_two_replicas(result):
    assert result["replicas"] == 2


@pytest.mark.parametrize(
    ("mode", "update"), [("plain", [3.0, 4.0]), ("clipped", [0.6, 0.8])], ids=["plain", "clipped"]
)
def test_overflow_on_one_replica_skips_every_replica_and_backs_off_once(result, mode, update):
    trace = result[mode]
    w = [_same_on_every_replica(step["w"]) for step in trace]
    scale = [_same_on_every_replica(step["scale"]) for step in trace]
    tracker = [_same_on_every_replica(step["tracker"]) for step in trace]
    # step 1 applies the replicas' summed gradient (clipped to norm 1: [0.6, 0.8])
    assert w[0] == pytest.approx([-update[0], -update[1]], rel=1e-6)
    # steps 2 and 3: replica 1 overflows, both skip, the scale halves once per step
    assert w[1] == w[0]
    assert w[2] == w[0]
    assert scale == [S, S / 2, S / 4, S / 4]
    assert tracker == [1, 0, 0, 1]
    assert [step["iterations"] for step in trace] == [1, 1, 1, 2]
    assert w[3] == pytest.approx([-2 * update[0], -2 * update[1]], rel=1e-6)


def test_model_fit_with_nan_in_one_replicas_shard(result):
    fit = result["fit"]
    assert fit["finite"]
    assert _same_on_every_replica(fit["scale"]) == S / 2
    assert fit["iterations"] == 1
