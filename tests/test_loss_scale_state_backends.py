"""LossScaler states across backends and from state dicts (docs/semantics.md §8.3, §8.5).

- A host state (``LossScaler().init()`` with no backend: NumPy arrays) meeting torch,
  TensorFlow or JAX arrays joins their backend: before, torch's ``scale``/``unscale``/``update``
  raised a raw AttributeError or TypeError (``.to`` on a NumPy array) and TensorFlow's
  ``update`` an AttributeError.
- ``from_state_dict`` (and the torch ``GradScaler.load_state_dict`` built on it) refuses a
  scale that is not a positive finite number: inf unscaled every gradient to 0 with
  ``finite=True``, -4 flipped their sign (gradient ascent), NaN skipped every step, forever.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import numstab as ns
from numstab._dispatch import framework_of
from numstab.backends import load_backend
from numstab.errors import InvalidArgumentError

FRAMEWORKS = ["torch", "tensorflow", "jax"]


def _values(be, tree):
    return [np.asarray(be.to_numpy(x)) for x in tree]


@pytest.mark.parametrize("backend", FRAMEWORKS)
def test_a_host_state_joins_the_backend_of_the_arrays(backend):
    be = load_backend(backend)
    scaler = ns.LossScaler(init_scale=8.0, growth_interval=1)
    host_state = scaler.init()
    assert type(host_state.scale).__module__.startswith("numpy")
    own_state = scaler.init(backend=backend)
    grads = [be.asarray(np.array([2.0, -4.0], np.float32))]
    loss = be.asarray(np.float32(3.0))
    for state in (host_state, own_state):
        scaled = scaler.scale(loss, state)
        unscaled, finite = scaler.unscale(grads, state)
        new = scaler.update(state, finite)
        assert float(be.to_numpy(scaled)) == 24.0
        np.testing.assert_array_equal(_values(be, unscaled)[0], [0.25, -0.5])
        assert bool(be.to_numpy(finite))
        assert float(be.to_numpy(new.scale)) == 16.0  # grown: growth_interval=1
        assert framework_of(new.scale) == backend
    bad = scaler.update(host_state, be.asarray(np.bool_(False)))
    assert float(be.to_numpy(bad.scale)) == 4.0


@pytest.mark.parametrize("backend", FRAMEWORKS)
def test_a_host_state_and_host_data_under_a_chosen_backend(backend):
    scaler = ns.LossScaler(init_scale=4.0)
    state = scaler.init()
    grads, finite = scaler.unscale([np.array([2.0], np.float32)], state, backend=backend)
    assert framework_of(grads[0]) == backend
    with ns.use_backend(backend):
        new = scaler.update(state, finite)
    assert framework_of(new.scale) == backend


@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan, -4.0, 0.0])
def test_from_state_dict_refuses_a_scale_that_cannot_recover(scale):
    data = ns.LossScaler().state_dict(ns.LossScaler().init())
    data["state"]["scale"] = scale
    with pytest.raises(InvalidArgumentError, match="scale to be a positive finite number"):
        ns.LossScaler.from_state_dict(data)


def test_torch_grad_scaler_refuses_an_infinite_scale_before_changing_anything():
    from numstab.integrations.torch import GradScaler

    scaler = GradScaler(device="cpu", init_scale=2.0**10)
    before = scaler.state_dict()
    torch_style = {k: v for k, v in before.items() if k != "numstab"}  # torch's GradScaler's
    # numstab's own copy, which is used where torch's "scale" entry is not there to win over it
    own = {**before, "numstab": {**before["numstab"], "state": {**before["numstab"]["state"]}}}
    del own["scale"]
    own["numstab"]["state"]["scale"] = math.inf
    for bad in ({**torch_style, "scale": math.inf}, own):
        with pytest.raises(InvalidArgumentError, match="scale=inf"):
            scaler.load_state_dict(bad)
        assert scaler.state_dict() == before


@pytest.mark.parametrize(
    "values",
    [{"scale": 1e39}, {"scale": 1e-50}, {"scale": 2.0**20}, {"scale": "abc"}],
    ids=["past_float32", "below_float32", "above_max_scale", "str"],
)
def test_torch_grad_scaler_refuses_a_scale_float32_cannot_hold(values):
    """The scale is checked as stored (float32: 1e39 loaded as inf, unscaling every gradient
    to 0 with finite=True; 1e-50 as 0) and within [min_scale, max_scale]."""
    from numstab.integrations.torch import GradScaler

    scaler = GradScaler(device="cpu", scaler=ns.LossScaler(init_scale=2.0**10, max_scale=2.0**16))
    before = scaler.state_dict()
    torch_style = {k: v for k, v in before.items() if k != "numstab"}
    own = {**before, "numstab": {**before["numstab"], "state": {**before["numstab"]["state"]}}}
    del own["scale"]  # (torch's entry wins over numstab's copy: §10.1)
    own["numstab"]["state"].update(values)
    for bad in ({**torch_style, **values}, own):
        with pytest.raises(InvalidArgumentError, match="scale to be a positive finite number"):
            scaler.load_state_dict(bad)
        assert scaler.state_dict() == before


@pytest.mark.parametrize("backend", FRAMEWORKS)
def test_int32_fields_refuse_values_that_would_wrap(backend):
    """growth_interval=2**31 wrapped in int32: torch and TF grew the scale at every step."""
    with pytest.raises(InvalidArgumentError, match="growth_interval"):
        ns.LossScaler(growth_interval=2**31)
    scaler = ns.LossScaler(init_scale=8.0, growth_interval=2**31 - 1)  # the largest
    state = scaler.update(scaler.init(backend=backend), True)
    assert float(load_backend(backend).to_numpy(state.scale)) == 8.0


@pytest.mark.parametrize("backend", ["numpy", *FRAMEWORKS])
def test_a_loaded_tracker_at_int32s_largest_value_still_grows(backend):
    """A state dict's tracker of 2**31 - 1 wrapped to -2**31 on its next increment: the
    scale then never grew again. Loaded trackers at or past growth_interval - 1 grow on
    the next finite step, as those the updates make."""
    scaler = ns.LossScaler(init_scale=8.0, growth_interval=2000)
    data = scaler.state_dict(scaler.init())
    for tracker in (1999, 5000, 2**31 - 1):
        data["state"]["growth_tracker"] = tracker
        _, state = ns.LossScaler.from_state_dict(data, backend=backend)
        grown = scaler.update(state, True, backend=backend)
        be = load_backend(backend)
        assert float(be.to_numpy(grown.scale)) == 16.0, tracker
        assert int(be.to_numpy(grown.growth_tracker)) == 0, tracker
