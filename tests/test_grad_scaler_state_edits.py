"""A numstab GradScaler state dict carries torch's five entries and numstab's full state under
"numstab" (§10.1). An edit of torch's entries (what torch.amp.GradScaler loads) loads into
numstab's GradScaler alike: before, the nested copy won silently."""

import pytest

torch = pytest.importorskip("torch")

from numstab.errors import InvalidArgumentError  # noqa: E402
from numstab.integrations.torch import GradScaler  # noqa: E402


def _edited():
    source = GradScaler(hysteresis=2)
    source.scale(torch.tensor(1.0))
    state = source.state_dict()
    state.update(scale=1024.0, growth_interval=100, growth_factor=4.0, _growth_tracker=7)
    return state


@pytest.mark.parametrize("make", [lambda: torch.amp.GradScaler("cpu"), GradScaler])
def test_edited_torch_entries_load_into_both_scalers(make):
    scaler = make()
    scaler.load_state_dict(_edited())
    assert scaler.get_scale() == 1024.0
    assert scaler.get_growth_interval() == 100 and scaler.get_growth_factor() == 4.0
    assert scaler.state_dict()["_growth_tracker"] == 7


def test_numstab_fields_torch_lacks_survive_the_edit():
    scaler = GradScaler()
    scaler.load_state_dict(_edited())
    assert scaler.state_dict()["numstab"]["config"]["hysteresis"] == 2


def test_a_malformed_numstab_entry_raises():
    state = _edited()
    state["numstab"] = [1, 2]
    with pytest.raises(InvalidArgumentError, match=r"state_dict\['numstab'\]"):
        GradScaler().load_state_dict(state)
