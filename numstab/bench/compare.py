"""``numstab bench --compare A B``: two results.json side by side, as markdown.

Per run present in both: final loss A -> B, divergence A -> B, skipped steps A -> B and the
time-per-step ratio B / A; then the runs only in A or only in B and both agreement checks.
"""

from __future__ import annotations

from pathlib import Path

from numstab.bench import results
from numstab.bench.report import _fmt, _table


def _div(m: dict) -> str:
    return f"@{m['divergence_step']}" if m["diverged"] else "no"


def compare(path_a: Path, path_b: Path) -> str:
    a, b = results.load(path_a), results.load(path_b)
    lines = [
        f"# numstab bench: {path_a} (A) vs {path_b} (B)",
        "",
        f"fp32 agreement: A {a.get('agreement', {}).get('status', 'not computed')}, "
        f"B {b.get('agreement', {}).get('status', 'not computed')}",
        "",
    ]
    pa, pb = a["settings"]["preset"], b["settings"]["preset"]
    differ = sorted(k for k in pa if pa.get(k) != pb.get(k) and k != "grid")
    if differ:
        lines += [
            "Settings differ: "
            + ", ".join(f"{k} {pa.get(k)} -> {pb.get(k)}" for k in differ)
            + " (losses are comparable only for equal model and data settings)",
            "",
        ]
    common = [k for k in a["runs"] if k in b["runs"]]
    rows = []
    changed = 0
    for key in common:
        ma, mb = a["runs"][key]["metrics"], b["runs"][key]["metrics"]
        fa, fb = ma["final_loss"], mb["final_loss"]
        delta = None if fa is None or fb is None else fb - fa
        ta, tb = ma["time_per_step_ms"], mb["time_per_step_ms"]
        if ma["diverged"] != mb["diverged"] or ma["skipped_steps"] != mb["skipped_steps"]:
            changed += 1
        rows.append(
            [
                f"`{key}`",
                f"{_fmt(fa)} -> {_fmt(fb)}",
                _fmt(delta, "+.4f"),
                f"{_div(ma)} -> {_div(mb)}",
                f"{ma['skipped_steps']} -> {mb['skipped_steps']}",
                _fmt(tb / ta if ta and tb else None, ".2f"),
            ]
        )
    lines += [f"{len(common)} runs in both; stability changed in {changed}.", ""]
    lines += _table(
        ["run", "final loss A -> B", "delta", "diverged", "skipped", "time/step B/A"], rows
    )
    only_a = [k for k in a["runs"] if k not in b["runs"]]
    only_b = [k for k in b["runs"] if k not in a["runs"]]
    if only_a:
        lines += ["Only in A: " + ", ".join(f"`{k}`" for k in only_a), ""]
    if only_b:
        lines += ["Only in B: " + ", ".join(f"`{k}`" for k in only_b), ""]
    return "\n".join(lines)
