"""benchmarks/_goals.py: a printed ratio never reads as the opposite of its verdict (the
verdict is on the unrounded ratio, so a ratio that rounds onto its goal gets more digits);
a row without a ratio or goal prints ``-``; the JSON is rewritten whole, row after row. And
the rows of the benchmarks that use it: guard.py's floors (no goal), overhead.py's JSON of a
run stopped part-way and its dispatch rows, xla_gpu_kernels.py's rows."""

from __future__ import annotations

import dataclasses
import json
import math
import types
from collections import Counter
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def goals(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _goals

    return _goals


@pytest.mark.parametrize(
    ("ratio", "goal", "text"),
    [
        (1.0204, 1.02, "1.0204"),  # over: three decimals would print 1.020, as if met
        (1.02, 1.02, "1.020"),  # at the goal: met, and reads so
        (1.01996, 1.02, "1.020"),  # under, rounding up onto the goal: still reads as met
        (1.0200001, 1.02, "1.0200001"),
        (1.5, 1.02, "1.500"),
        (1.5, None, "1.500"),  # no goal: three decimals
        (math.nan, 1.02, "nan"),
    ],
)
def test_ratio_text_shows_why_the_verdict(goals, ratio, goal, text):
    assert goals.ratio_text(ratio, goal) == text
    if goal is not None and not math.isnan(ratio):
        assert (float(text) <= goal) == (ratio <= goal)


def test_print_rows_prints_the_digits_the_verdict_needs(goals, capsys):
    goals.print_rows([goals.goal_row("clip", 1.0204, 1.02)], [])
    line = capsys.readouterr().out.splitlines()[1]
    assert line.split() == ["clip", "1.0204", "<=", "1.02", "NO"]


def test_a_row_without_a_ratio_prints_a_dash(goals, capsys):
    """A row with nothing to compare (a count, a workspace size) prints ``-`` for its ratio,
    goal and verdict, and is left out of the count of rows with a goal."""
    assert goals.ratio_text(None, None) == "-"
    goals.print_rows(
        [goals.goal_row("M=256", None, None, output_mib=64.0)], [("output_mib", ".0f")]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["M=256", "64", "-", "-", "-"]
    assert lines[2] == "0 of 0 rows with a goal meet it"


def test_dump_json_rewrites_the_whole_file(goals, tmp_path):
    """Each call leaves the complete, latest results (written beside, then renamed over)."""
    path = tmp_path / "rows.json"
    goals.dump_json(str(path), {"rows": [1, 2, 3]})
    goals.dump_json(str(path), {"rows": [1]})
    assert json.loads(path.read_text()) == {"rows": [1]}
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]
    goals.dump_json(None, {"rows": []})  # no --json: nothing written


@pytest.fixture
def guard(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import guard

    return guard


def _guard_row(mode: str, ratio: float) -> dict:
    reads = {f"{side}_host_reads_{per}": 0.0 for side in ("plain", "guard")
             for per in ("per_step", "steady_step")}  # fmt: skip
    return {"backend": "torch", "mode": mode, "plain_ms": 1.0, "guard_ms": ratio,
            "ratio": ratio, "ratio_quartiles": [ratio, ratio], **reads}  # fmt: skip


@pytest.mark.parametrize(
    ("mode", "ratio", "extra_reads", "goal", "meets"),
    [
        ("host", 1.0, 0, 1.05, True),
        ("host", 1.2, 0, 1.05, False),
        ("device (host_every=100, undo)", 1.0, 1, 1.05, False),  # a read beyond the loop's
        ("floor: gradient norms alone", 1.2, 0, None, None),  # a reference: no goal
        ("floor gap: device / skip floor", 1.0, 0, None, None),
    ],
)
def test_guard_floor_rows_have_no_goal(guard, capsys, mode, ratio, extra_reads, goal, meets):
    """benchmarks/guard.py: a floor row is a reference (goal and verdict None, ``goal -``
    printed); another row meets 1.05 with no host read beyond the plain loop's."""
    row = guard.judged(_guard_row(mode, ratio), extra_reads)
    assert (row["goal"], row["meets_goal"]) == (goal, meets)
    line = guard.row_line(row)
    assert ("(goal -)" in line) == (goal is None)
    assert ("(goal 1.05)" in line) == (goal is not None)


def test_overhead_json_keeps_the_rows_of_a_run_stopped_part_way(monkeypatch, tmp_path):
    """benchmarks/overhead.py rewrites --json after each row: a run stopped after its first
    large-case row (a time limit) leaves that row and the dispatch row measured before it.
    Dispatch rows carry ratio (resolve time / 10 us), goal 1 and meets_goal."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import overhead

    row = overhead.Row("hard labels", "fake", "eager", 1.0, 1.0, 1.0, 1.05, True, (1.0, 1.0))

    def large(h, data, warmup, repeats, most, done=None):
        done(row)
        raise RuntimeError("stopped")  # what a time limit does after the first row

    imports = {"median_ms": 1.0, "samples_ms": [1.0], "modules_imported": []}
    monkeypatch.setattr(overhead, "measure_import", lambda: imports)
    monkeypatch.setattr(overhead, "installed", lambda names: names)
    fake = types.SimpleNamespace(name="fake", version="0", device="cpu")
    monkeypatch.setattr(overhead, "make_harness", lambda name, args: fake)
    monkeypatch.setattr(overhead, "bench_large", large)
    path = tmp_path / "o.json"
    argv = ["--backends", "torch", "--shape", "8x16", "--skip-tree", "--repeats", "1"]
    with pytest.raises(RuntimeError, match="stopped"):
        overhead.main([*argv, "--warmup", "0", "--json", str(path)])
    got = json.loads(path.read_text())
    assert got["large"] == [json.loads(json.dumps(dataclasses.asdict(row)))]
    assert got["tree"] == got["tiny"] == []
    (dispatch,) = got["dispatch"]
    assert dispatch["backend"] == "numpy"
    assert dispatch["goal"] == 1.0
    assert dispatch["ratio"] == pytest.approx(dispatch["resolve_us"] / overhead.DISPATCH_GOAL_US)
    assert dispatch["meets_goal"] == (dispatch["ratio"] <= 1.0)


def test_xla_kernel_rows_carry_a_ratio_and_no_goal(monkeypatch):
    """benchmarks/xla_gpu_kernels.py (its rows built without JAX's CUDA plugin): kernels over
    the floor's for the bare and guarded steps, no ratio for the rest; no goal (counts)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import xla_gpu_kernels as xk

    counts = {
        "plain step": Counter(fusion=30, dot=4),
        xk.FLOOR: Counter(fusion=36, dot=4),
        "guarded step, packed state": Counter(fusion=44, dot=4, copy=2),
        "policy.decide alone": Counter(fusion=3),
        "keras (jax) guarded step, packed state": Counter(fusion=90),
    }
    rows = {row["program"]: row for row in xk.kernel_rows(counts)}
    ratios = {name: row["ratio"] for name, row in rows.items()}
    assert ratios == {
        "plain step": 34 / 40,
        xk.FLOOR: 1.0,
        "guarded step, packed state": 50 / 40,
        "policy.decide alone": None,
        "keras (jax) guarded step, packed state": None,
    }
    for row in rows.values():
        assert (row["goal"], row["meets_goal"], row["floor"]) == (None, None, 40)
    assert rows["guarded step, packed state"]["ops"] == {"fusion": 44, "dot": 4, "copy": 2}
