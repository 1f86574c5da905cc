"""benchmarks/data_firewall.py's own parts: a row that misses its goal times the bare loader
against itself, and the miss is called noise only where it is no larger than the spread of
that comparison of identical work; the walk floor does the drop floor's work after visiting
every field; detection rows carry the false-positive goal; --json keeps the rows of a run
stopped part-way."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def data_firewall(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import data_firewall

    return data_firewall


STEADY = [1.0, 1.0, 1.01, 1.0, 0.99, 1.0, 1.0, 1.01]  # identical work within 1%
NOISY = [1.0, 1.3, 1.0, 0.8, 1.0, 1.2, 1.0, 0.7]  # +-30% from pass to pass


@pytest.mark.parametrize(
    ("passes", "miss", "within_noise"),
    [
        (STEADY, 0.05, False),  # steady: a miss is a miss
        (NOISY, 0.05, True),  # a miss smaller than the spread of identical work
        (NOISY, 0.49, False),  # a miss larger than that spread is real, however noisy
    ],
)
def test_noise_of_pairs_passes_in_alternating_order(
    data_firewall, monkeypatch, passes, miss, within_noise
):
    """Round r times the two sides in turns (first then second, then second then first);
    the ratio is the median of first / second per round, with its quartiles; the noise is
    the farther quartile's distance from 1, and the miss is within it when no larger."""
    clock = itertools.chain(passes)
    monkeypatch.setattr(data_firewall, "timed", lambda fn: (next(clock), 0))
    got = data_firewall.noise_of(lambda: 0, rounds=4, miss=miss)
    # rounds 0 and 2 time `first` then `second`; rounds 1 and 3 `second` then `first`
    first = [passes[0], passes[3], passes[4], passes[7]]
    second = [passes[1], passes[2], passes[5], passes[6]]
    ratios = sorted(a / b for a, b in zip(first, second, strict=True))
    assert got["bare_against_itself"] == pytest.approx((ratios[1] + ratios[2]) / 2)
    q1, q3 = got["bare_against_itself_quartiles"]
    assert q1 <= got["bare_against_itself"] <= q3
    assert got["noise"] == pytest.approx(max(q3 - 1, 1 - q1))
    assert got["miss"] == miss
    assert got["miss_within_noise"] is within_noise


def test_walk_floor_drops_what_the_drop_floor_drops(data_firewall):
    """``drop_walked`` (the walk floor) visits every field: a clean batch comes back as the
    same object; a dirty one loses the samples with a NaN or inf in any float field, in
    order, from every field, as ``drop_numpy`` does for the one field it knows."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    w = rng.normal(size=16)  # float64
    batch = {"x": x, "w": w, "y": np.arange(16), "ok": np.ones(16, dtype=bool)}
    assert data_firewall.drop_walked(batch) is batch
    x[[3, 9], 1] = [np.nan, np.inf]
    w[[9, 12]] = -np.inf
    got = data_firewall.drop_walked(batch)
    kept = np.setdiff1d(np.arange(16), [3, 9, 12])
    for key, value in batch.items():
        np.testing.assert_array_equal(got[key], value[kept])
    only_x = {"x": x, "y": batch["y"]}
    for key, value in data_firewall.drop_numpy(only_x).items():
        np.testing.assert_array_equal(data_firewall.drop_walked(only_x)[key], value)


@pytest.mark.parametrize(
    ("field", "error"),
    [
        ([0.0] * 4, TypeError),  # not an array
        (np.ones(()), TypeError),  # no batch axis: len() of a 0-d array
        (np.zeros(3), ValueError),  # another batch size
        (np.zeros(4, dtype=complex), TypeError),  # no route for its dtype
        (np.zeros(4, dtype=">f4"), TypeError),  # nor for a byte-swapped one
    ],
)
def test_walk_floor_refuses_what_it_does_not_route(data_firewall, field, error):
    with pytest.raises(error):
        data_firewall.drop_walked({"x": np.zeros((4, 2), dtype=np.float32), "f": field})


def test_detection_rows_carry_the_false_positive_goal(data_firewall):
    """Detection rows (issue 20, goal 4): ``ratio`` is the false-positive rate per clean
    sample, ``goal`` 0.1%, and ``meets_goal`` holds when it and the recall goals are met.
    Rows come one at a time, as measured (the first: zscore at 3.0, d = 1)."""
    row = next(iter(data_firewall.detection_rows(6000)))
    assert (row["filter"], row["features"]) == ("zscore (3.0)", 1)
    assert row["goal"] == data_firewall.FALSE_POSITIVE_GOAL == 1e-3
    assert row["ratio"] == row["false_positive_rate"]
    recall = row["nonfinite_recall"] == 1.0 and row["outlier_recall"] >= 0.9
    assert row["meets_recall_goals"] is recall
    assert row["meets_goal"] is (row["ratio"] <= 1e-3 and recall)


@pytest.mark.parametrize("section", ["throughput", "detection"])
def test_json_keeps_the_rows_of_a_run_stopped_part_way(
    data_firewall, monkeypatch, tmp_path, section
):
    """--json is rewritten after each row: a run stopped after its first row of a section
    (a time limit) leaves that row in the file."""
    row = {"case": "first", "ratio": 1.0, "goal": 1.05, "meets_goal": True}

    def first_then_stopped(*args, **kwargs):
        yield row
        raise RuntimeError("stopped")  # what a time limit does after the first row

    tiny = (np.zeros((4, 32), np.float32), np.arange(4), np.array([], int))
    monkeypatch.setattr(data_firewall, "make_dataset", lambda n: tiny)
    first = "numpy_rows" if section == "throughput" else "detection_rows"
    for name in ("numpy_rows", "numpy_image_rows", "detection_rows"):
        fake = first_then_stopped if name == first else lambda *a, **k: iter(())
        monkeypatch.setattr(data_firewall, name, fake)
    path = tmp_path / "df.json"
    argv = ["data_firewall.py", "--loaders", "numpy", "--no-header", "--json", str(path)]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(RuntimeError, match="stopped"):
        data_firewall.main()
    got = json.loads(path.read_text())
    assert got == {"throughput": [], "detection": []} | {section: [row]}
