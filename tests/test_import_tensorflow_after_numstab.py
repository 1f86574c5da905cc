"""``import numstab`` before ``import tensorflow`` (isort's order), then a first numstab call
inside ``tf.function``. Before, that call loaded the TensorFlow backend inside the trace, and
AutoGraph printed "AutoGraph could not transform <function _gcd_import ...> and will run it
as-is" (with a paragraph of advice) on every such first call. Now the backend loads right after
``import tensorflow``, as torch's does (``numstab/backends/_on_import.py``). A fresh process."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("tensorflow")


def test_a_first_call_inside_tf_function_is_quiet():
    code = textwrap.dedent(
        """
        import sys
        import numstab as ns
        assert "tensorflow" not in sys.modules  # importing numstab still imports no framework
        import tensorflow as tf

        assert "numstab.frameworks.tensorflow.backend" in sys.modules
        assert not [f for f in sys.meta_path if getattr(f, "name", None) == "tensorflow"]
        loss = tf.function(lambda x, y: ns.cross_entropy(x, y))
        print(float(loss(tf.zeros((2, 4)), tf.constant([0, 3]))))
        """
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert abs(float(done.stdout.split()[-1]) - 1.3862943611198906) < 1e-6  # ln 4
    assert "AutoGraph could not transform" not in done.stderr, done.stderr
