"""The benchmarks' command lines answer before measuring anything: an unknown ``--backends``
name is a usage error (exit 2, ``unknown backends [...]; choose from ...``), never a
``KeyError`` part-way through; ``clipping_tf.py --help`` answers without importing
TensorFlow; ``locate.py`` pins torch to 1 intra-op thread by default, as guard.py,
check_numerics.py and ``numstab bench`` do. And what every benchmark writes with ``--json``
is strict JSON: a NaN or infinite number becomes null. Argument parsing only: no benchmark
runs here."""

from __future__ import annotations

import importlib
import inspect
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    """Imports a benchmark script as a module, as tests/test_bench_goals.py does."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module


def _main(module, argv: list[str], monkeypatch) -> None:
    """``module.main`` with ``argv``: through its parameter where it takes one, else
    through ``sys.argv`` (locate.py and check_numerics.py parse ``sys.argv``)."""
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
    if inspect.signature(module.main).parameters:
        module.main(argv)
    else:
        module.main()


@pytest.mark.parametrize(
    ("script", "choices"),
    [
        ("locate", "torch, tensorflow, jax, equinox, nnx"),
        ("check_numerics", "torch, jax, tensorflow"),
        ("memory", "torch, jax, tensorflow"),
    ],
)
@pytest.mark.parametrize("backends", ["numpy", "torch,numpy", " , "])
def test_unknown_backend_is_a_usage_error(bench, monkeypatch, capsys, script, choices, backends):
    module = bench(script)
    with pytest.raises(SystemExit) as exit_:
        _main(module, ["--backends", backends], monkeypatch)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown backends [" in err
    assert err.rstrip().endswith(f"choose from {choices}")
    if "numpy" in backends:
        assert "['numpy']" in err


def test_check_backends_keeps_order_and_strips(bench):
    import argparse

    goals = bench("_goals")
    parser = argparse.ArgumentParser()
    names = goals.check_backends(parser, " jax, torch,,", ["torch", "jax"])
    assert names == ["jax", "torch"]


def test_locate_pins_torch_to_one_thread_by_default(bench, monkeypatch):
    locate = bench("locate")
    seen = []

    def fake(size, repeats):
        seen.append(locate.args_threads)
        return {"plain step": (1.0, 1.0), "locate_nonfinite": (2.0, 2.0)}

    monkeypatch.setitem(locate.BENCHES, "torch", fake)
    _main(locate, ["--quick", "--backends", "torch"], monkeypatch)
    assert seen == [1]


def test_clipping_tf_help_does_not_import_tensorflow():
    """``-X importtime`` lists every module the script imported (on stderr)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(BENCHMARKS / "clipping_tf.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "--threads" in done.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    assert "_goals" in imported  # the listing was read
    assert "tensorflow" not in imported


def test_dump_json_writes_null_for_nan_and_inf(bench, tmp_path):
    goals = bench("_goals")
    path = tmp_path / "rows.json"
    row = goals.goal_row("norm only", math.nan, 1.02, max_norm=math.inf, ms=(1.0, -math.inf))
    goals.dump_json(str(path), {"rows": [row], "floor": float("nan"), "n": 3})

    def strict(token):
        raise AssertionError(f"non-JSON constant {token}")

    got = json.loads(path.read_text(), parse_constant=strict)
    assert got["rows"][0]["ratio"] is None
    assert got["rows"][0]["max_norm"] is None
    assert got["rows"][0]["ms"] == [1.0, None]
    assert got["rows"][0]["meets_goal"] is False
    assert (got["floor"], got["n"]) == (None, 3)


def test_print_rows_prints_a_dash_for_a_column_without_a_value(bench, capsys):
    goals = bench("_goals")
    goals.print_rows([goals.goal_row("norm only", 1.0, 1.02, max_norm=None)], [("max_norm", ".4g")])
    line = capsys.readouterr().out.splitlines()[1]
    assert line.split() == ["norm", "only", "-", "1.000", "<=", "1.02", "yes"]
