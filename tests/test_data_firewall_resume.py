"""Resuming a firewall: the filters' and the Firewall's ``state_dict`` / ``load_state_dict``
(copies, settings included, checked), so a resumed run flags as the first would have and
goes on numbering epochs, batches and global indices."""

from __future__ import annotations

import os

import numpy as np
import pytest

from numstab.data import Firewall, MADFilter, ZScoreFilter, protect
from numstab.errors import InvalidArgumentError

MAKERS = {
    "zscore": lambda: ZScoreFilter(threshold=4.0, warmup=16),
    "mad": lambda: MADFilter(window=64, warmup=16, false_positive_rate=1e-3),
}


def _data(n: int = 400, d: int = 3, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(n, d))
    x[::37, 1] += 12.0  # outliers
    return x


@pytest.mark.parametrize("name", MAKERS)
def test_filter_state_round_trips_and_is_a_copy(name):
    x = _data()
    a = MAKERS[name]()
    a(x[:100])
    state = a.state_dict()
    saved = {k: np.copy(v) for k, v in state.items() if isinstance(v, np.ndarray)}
    a(x[100:200])  # learning on must not change the saved state
    for k, v in saved.items():
        np.testing.assert_array_equal(state[k], v)
    b = type(a)()  # other settings: the state brings its own
    b.load_state_dict(state)
    assert (b.threshold, b.false_positive_rate, b.warmup) == (
        state["settings"]["threshold"],
        state["settings"]["false_positive_rate"],
        state["settings"]["warmup"],
    )
    uninterrupted = MAKERS[name]()
    uninterrupted(x[:100])
    want = uninterrupted(x[100:])
    assert want.any()  # the outliers are flagged
    np.testing.assert_array_equal(b(x[100:]), want)  # same state and rule, same flags


def test_filter_state_of_another_filter_or_shape_is_refused_and_changes_nothing():
    z, m = MAKERS["zscore"](), MAKERS["mad"]()
    z(_data()[:50])
    m(_data()[:50])
    before = m.state_dict()
    with pytest.raises(InvalidArgumentError, match="'mad' filter"):
        m.load_state_dict(z.state_dict())
    bad = m.state_dict()
    bad["buffer"] = bad["buffer"][:, :2]
    with pytest.raises(InvalidArgumentError, match="buffer"):
        m.load_state_dict(bad)
    bad = m.state_dict()
    bad["filled"] = 10_000
    with pytest.raises(InvalidArgumentError, match="filled"):
        m.load_state_dict(bad)
    bad = z.state_dict()
    bad["settings"] = {**bad["settings"], "warmup": 1}
    with pytest.raises(InvalidArgumentError, match="warmup"):
        ZScoreFilter().load_state_dict(bad)
    with pytest.raises(InvalidArgumentError, match="state"):
        m.load_state_dict([1, 2])
    after = m.state_dict()
    np.testing.assert_array_equal(after.pop("buffer"), before.pop("buffer"))
    assert after == before


def _batches(x, size=50):
    for i in range(0, len(x), size):
        b = x[i : i + size].copy()
        if i == 100:
            b[3, 0] = np.nan
        yield {"x": b, "id": np.arange(i, i + len(b))}


def test_firewall_resume_goes_on_numbering_and_keeps_earlier_files(tmp_path):
    x = _data(300)
    first = protect(list(_batches(x)), outliers=MAKERS["zscore"](), quarantine_dir=tmp_path)
    for _ in range(2):
        list(first)
    state = first.firewall.state_dict()
    files = sorted(os.listdir(tmp_path))

    resumed = protect(list(_batches(x)), outliers=MAKERS["zscore"](), quarantine_dir=tmp_path)
    resumed.firewall.load_state_dict(state)
    list(resumed)
    stats = resumed.stats
    assert stats.epochs == 3 and stats.samples_seen == 900
    assert set(files) <= set(os.listdir(tmp_path))  # nothing overwritten
    third = [r for r in stats.records if r.epoch == 2]
    assert third and all(600 <= r.index < 900 for r in third)
    assert stats.records[: len(first.stats.records)] == first.stats.records

    # the uninterrupted run flags the same samples in its third epoch
    reference = protect(list(_batches(x)), outliers=MAKERS["zscore"]())
    for _ in range(3):
        list(reference)
    assert reference.stats.records == stats.records


def test_firewall_state_is_checked_before_anything_changes():
    fw = Firewall(outliers=MAKERS["mad"]())
    fw.process({"x": _data()[:40]})
    state = fw.state_dict()
    with pytest.raises(InvalidArgumentError, match="samples_seen"):
        Firewall(outliers=MAKERS["mad"]()).load_state_dict(
            {**state, "stats": {**state["stats"], "samples_seen": -1}}
        )
    target = Firewall()  # no filter: a state with one is refused
    with pytest.raises(InvalidArgumentError, match="outliers"):
        target.load_state_dict(state)
    assert target.stats.samples_seen == 0
