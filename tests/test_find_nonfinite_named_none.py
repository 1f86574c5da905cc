"""A dict of torch grads by name keeps its key paths when a value is ``None`` (a frozen
parameter's gradient, §15.1): before, one ``None`` made every path keystr style
(``"['enc.w']"``)."""

import pytest

import numstab as ns
from numstab.errors import NonFiniteError

torch = pytest.importorskip("torch")


def _grads(*, none_first: bool) -> dict:
    nan = torch.tensor([float("nan"), 1.0])
    pairs = [("enc.b", None), ("enc.w", nan), ("dec.w", torch.ones(2)), ("dec.b", None)]
    return dict(pairs if none_first else pairs[1:] + pairs[:1])


@pytest.mark.parametrize("none_first", [True, False])
def test_paths_stay_state_dict_keys_with_none_values(none_first):
    grads = _grads(none_first=none_first)
    records = ns.find_nonfinite(grads)
    assert [r.path for r in records] == ["enc.w"]
    assert records[0].nan_count == 1 and records[0].shape == (2,)
    without_none = {k: v for k, v in grads.items() if v is not None}
    assert ns.find_nonfinite(without_none) == records


def test_assert_finite_names_the_key():
    with pytest.raises(NonFiniteError) as info:
        ns.assert_finite(_grads(none_first=True), "grads")
    assert "enc.w" in str(info.value) and "['enc.w']" not in str(info.value)


def test_all_none_and_clean_dicts():
    assert ns.find_nonfinite({"enc.w": None}) == []
    assert ns.find_nonfinite({"enc.w": torch.ones(1), "enc.b": None}) == []


def test_non_str_key_with_none_is_not_a_state_dict():
    records = ns.find_nonfinite({0: torch.tensor([float("inf")]), 1: None})
    assert [r.path for r in records] == ["[0]"]
