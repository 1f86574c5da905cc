"""Start one worker process per backend, in parallel, and gather their outcomes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.bad_inputs.cases import all_cases

BACKENDS = ("numpy", "torch", "jax", "tensorflow")
ROOT = Path(__file__).resolve().parents[2]


def run_all(backends: list[str] | None = None) -> dict[str, dict[str, dict]]:
    """backend -> case id -> outcome. A worker that died marks its running case ``crash``
    and the cases after it ``not run``."""
    backends = list(backends or BACKENDS)
    ids = [c.id for c in all_cases()]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    with tempfile.TemporaryDirectory() as tmp:
        procs = {}
        for name in backends:
            out = Path(tmp) / f"{name}.jsonl"
            cmd = [sys.executable, "-m", "tests.bad_inputs.worker", name, str(out)]
            procs[name] = (
                subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True),
                out,
            )
        results = {}
        for name, (proc, out) in procs.items():
            _, err = proc.communicate(timeout=600)
            rows = (
                [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
            )
            got = {r["case"]: r for r in rows}
            for i, case_id in enumerate(i for i in ids if i not in got):
                why = (
                    f"worker exited {proc.returncode}: {err.strip()[-300:]}"
                    if i == 0
                    else "not run: the worker crashed earlier"
                )
                got[case_id] = {
                    "case": case_id,
                    "backend": name,
                    "kind": "crash" if i == 0 else "not run",
                    "ok": False,
                    "why": why,
                }
            results[name] = got
    return results


def summary_table(results: dict[str, dict[str, dict]]) -> str:
    """Cases x backends: the outcome class per cell, ``!`` marking a failed cell."""
    backends = list(results)
    ids = [c.id for c in all_cases()]
    width = max(map(len, ids)) + 2
    lines = [f"{'case':<{width}}" + "".join(f"{b:<22}" for b in backends)]
    for case_id in ids:
        cells = []
        for b in backends:
            r = results[b][case_id]
            label = r.get("error") or r["kind"]
            cells.append(f"{('' if r['ok'] else '! ') + label:<22}")
        lines.append(f"{case_id:<{width}}" + "".join(cells))
    failed = sum(not r["ok"] for per in results.values() for r in per.values())
    total = sum(len(per) for per in results.values())
    lines.append(
        f"{total - failed} of {total} cells as expected ({len(ids)} cases x "
        f"{len(backends)} backends)"
    )
    return "\n".join(lines)
