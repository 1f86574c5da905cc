"""What every benchmark reports (issue 20): rows carrying ``ratio``, ``goal`` and
``meets_goal``, printed as a table and written with ``--json PATH``.

A row is a plain dict: ``case`` (what was measured), the measured numbers, then ``ratio``
(numstab over the native or naive alternative timed in the same run; lower is better),
``goal`` (the largest ratio that meets it) and ``meets_goal``. Benchmarks with their own
table (``overhead.py``, ``guard.py``, ...) write the same three keys. A row with nothing to
compare (a count, a workspace size) has ``ratio`` None; a row without a goal (a reference, a
diagnostic) ``goal`` and ``meets_goal`` None; each prints ``-`` there. ``dump_json`` (and
``write_json``) rewrite the whole file: called after each row, a run stopped part-way (a
time limit) leaves the rows measured so far. The file is strict JSON: a NaN or infinite
number (a ratio over a failed measurement) is written as null.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from typing import Any

#: the issue's goals for a call against its native counterpart (issue 20, goal 2)
EAGER_GOAL = 1.05
COMPILED_GOAL = 1.02


def goal_row(case: str, ratio: float, goal: float | None, **measured: Any) -> dict[str, Any]:
    """One row: ``meets_goal`` is ``ratio <= goal`` (False for a NaN ratio); a row without a
    goal (``None``: a reference shown for context, such as the native call's first compile)
    has ``meets_goal`` None."""
    meets = None if goal is None else (not math.isnan(ratio) and ratio <= goal)
    return {"case": case, **measured, "ratio": ratio, "goal": goal, "meets_goal": meets}


def check_backends(parser: argparse.ArgumentParser, text: str, choices: Sequence[str]) -> list[str]:
    """The names in ``text`` (comma-separated ``--backends``), stripped, blanks dropped, in
    order. A name not in ``choices``, or no name at all, ends the run through
    ``parser.error`` (usage and ``unknown backends ['numpy']; choose from torch, jax``, exit
    status 2) before anything is measured, in place of a ``KeyError`` part-way through."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(choices))
    if unknown or not names:
        parser.error(f"unknown backends {unknown or [text]}; choose from {', '.join(choices)}")
    return names


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", metavar="PATH", help="also write the rows (ratio, goal, meets_goal) here"
    )


def ratio_text(ratio: float | None, goal: float | None, digits: int = 3) -> str:
    """``ratio`` to ``digits`` decimals, or more where fewer would hide the verdict: the
    verdict is on the unrounded ratio, so 1.0204 against a goal of 1.02 prints ``1.0204``,
    not a ``1.020`` that reads as met (at most 9 decimals); ``-`` for a row without one."""
    if ratio is None:
        return "-"
    if goal is not None and not math.isnan(ratio):
        while digits < 9 and (round(ratio, digits) <= goal) != (ratio <= goal):
            digits += 1
    return f"{ratio:.{digits}f}"


def print_rows(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> None:
    """The rows as a table: ``case``, then ``columns`` (``(key, format)``, e.g.
    ``("numstab_ms", ".3f")``), then ratio, goal and whether it is met (``-`` where any of
    them is None: a row with nothing in that column)."""
    keys = [key for key, _ in columns]
    headers = ["case", *keys, "ratio", "goal", "met"]
    cells = [
        [
            str(row["case"]),
            *("-" if row[key] is None else format(row[key], spec) for key, spec in columns),
            ratio_text(row["ratio"], row["goal"]),
            "-" if row["goal"] is None else f"<= {row['goal']:g}",
            {None: "-", True: "yes", False: "NO"}[row["meets_goal"]],
        ]
        for row in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    for line in (headers, *cells):
        first, *rest = (cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                        enumerate(zip(line, widths, strict=True)))  # fmt: skip
        print("  ".join([first, *rest]))
    goals = [row["meets_goal"] for row in rows if row["goal"] is not None]
    print(f"{sum(goals)} of {len(goals)} rows with a goal meet it")


def write_json(path: str | None, args: argparse.Namespace, rows: Sequence[dict]) -> None:
    """``{"args": ..., "rows": [...]}`` at ``path`` (nothing when ``path`` is None), by
    ``dump_json``: call it after each row, and a run stopped part-way keeps the rows so far."""
    dump_json(path, {"args": vars(args), "rows": list(rows)})


def finite_or_null(value: Any) -> Any:
    """``value`` with every NaN or infinite float (``float`` and its subclasses, such as
    ``numpy.float64``) replaced by None, through dicts, lists and tuples (tuples become
    lists, as JSON writes them); other values unchanged. JSON has no NaN or Infinity:
    ``json.dump`` would write the bare tokens ``NaN``/``Infinity``, which strict readers
    (``jq``, JavaScript's ``JSON.parse``) reject; null is what a reader gets instead."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


def dump_json(path: str | None, results: Any) -> None:
    """``results`` as strict JSON at ``path`` (nothing when ``path`` is None): NaN and
    infinite floats are written as null (``finite_or_null``; ``allow_nan=False`` then makes
    any that slipped through an error, never an invalid file). The whole file is rewritten:
    written beside it, then renamed over it, so that a run killed while writing leaves the
    last complete file, never a truncated one."""
    if path:
        with open(f"{path}.partial", "w") as f:
            json.dump(finite_or_null(results), f, indent=1, allow_nan=False)
        os.replace(f"{path}.partial", path)
