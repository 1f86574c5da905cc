"""Validation messages state the range really accepted and the real outcome (audit 5, F6):
``replace_value`` is a finite real (``-inf`` was refused with "in [-inf, inf)"), a value that
overflows a field's dtype to ``-inf`` says ``-inf``, and ``contamination`` is in (0, 0.5]."""

import math

import numpy as np
import pytest

from numstab.data.firewall import Firewall
from numstab.data.outliers import IsolationForestFilter
from numstab.errors import InvalidArgumentError


@pytest.mark.parametrize("value", [-math.inf, math.inf, math.nan, np.float64(-np.inf)])
def test_firewall_replace_value_must_be_a_finite_real(value):
    with pytest.raises(InvalidArgumentError) as info:
        Firewall(policy="replace", replace_value=value)
    assert "Expected replace_value to be a finite real number" in str(info.value)
    assert "[-inf" not in str(info.value)
    with pytest.raises(InvalidArgumentError, match=r"to be a real number\. Received: "):
        Firewall(policy="replace", replace_value="0")  # not a number: as before


def test_replacement_overflow_names_its_sign():
    for value, outcome in ((-1e39, "-inf"), (1e39, "inf")):
        firewall = Firewall(policy="replace", replace_value=value)
        with pytest.raises(InvalidArgumentError) as info:
            firewall.process({"x": np.array([[np.nan], [1.0]], np.float32)})
        assert f"it would replace NaN/inf with {outcome}. Received" in str(info.value)


def test_replacement_overflow_through_protect():
    from numstab.data.firewall import protect

    batches = [{"x": np.array([[np.nan], [1.0]], np.float32)}]
    with pytest.raises(InvalidArgumentError, match=r"with -inf\. Received: replace_value=-1e\+39"):
        list(protect(batches, "replace", replace_value=-1e39))


@pytest.mark.parametrize("value", [0.6, -0.1])
def test_contamination_range_is_the_same_on_both_ends(value):
    for bad in (value, 0, 0.0):
        with pytest.raises(InvalidArgumentError, match=r"Expected contamination in \(0, 0\.5\]"):
            IsolationForestFilter(contamination=bad)


def test_tf_data_guard_replace_value_must_be_a_finite_real():
    pytest.importorskip("tensorflow")
    from numstab.frameworks.tensorflow.data import TFDataGuard

    for value in (math.nan, -math.inf):
        with pytest.raises(InvalidArgumentError, match="to be a finite real number"):
            TFDataGuard(replace_value=value)


def test_tf_data_guard_replacement_overflow_names_minus_inf():
    tf = pytest.importorskip("tensorflow")
    from numstab.frameworks.tensorflow.data import TFDataGuard

    guard = TFDataGuard(replace_value=-1e39)
    with pytest.raises(InvalidArgumentError, match=r"with -inf\. Received"):
        guard.replace_nonfinite({"x": tf.constant([[np.nan]], tf.float32)})
