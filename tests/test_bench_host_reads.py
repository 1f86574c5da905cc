"""The host-read column of the loss-scaler rows of benchmarks/overhead.py is real: the counter
(benchmarks/_host_reads.py) sees a deliberate read of the step's result, once per call, and
sees none in numstab's compiled scaler step (jax.jit, tf.function) nor in torch's eager one."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import _overhead_tree
from overhead import SCALER_OP, host_reads_per_call

GRADS = _overhead_tree.make_grads(4, 400)


@pytest.mark.parametrize(
    ("framework", "compiled"), [("jax", True), ("tensorflow", True), ("torch", False)]
)
def test_scaler_step_reads_nothing_and_a_deliberate_read_is_counted(framework, compiled):
    pytest.importorskip(framework)
    ours, theirs = _overhead_tree.PAIRS[framework](GRADS, "cpu", compiled)[SCALER_OP]
    ours(), theirs()  # compiled and warm, as after the timing
    assert host_reads_per_call(framework, ours) == 0
    assert host_reads_per_call(framework, theirs) == 0  # the natives do not read either

    def read_scale():  # the step, then its new scale read on the host, as a Python float
        return float(ours()[1])

    def read_array():  # through np.asarray: the buffer protocol on CPU (JAX, TensorFlow)
        return np.asarray(ours()[0][0]).sum()

    assert host_reads_per_call(framework, read_scale) == 1
    assert host_reads_per_call(framework, read_array) == 1
    assert host_reads_per_call(framework, lambda: (read_scale(), read_array()), calls=2) == 2
