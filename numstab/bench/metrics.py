"""Numbers derived from the per-step records: one run's stability summary, the fp32
agreement check across frameworks, the cross-framework spread and the gaps to fp32.

Definitions (also in docs/semantics.md §18):
- final loss: mean of the last ``max(1, steps // 10)`` losses (capped at 10), or None when
  one of them is non-finite or the run stopped early.
- diverged: the run stopped early (``divergence_patience`` consecutive non-finite losses),
  or its loss ends non-finite or above ``ln(vocab)`` (worse than a uniform guess). The
  divergence step is the first step from which the loss stays non-finite or above
  ``ln(vocab)`` to the end.
- time per step: median wall time of steps 2.. (step 1 includes compilation; reported
  apart as ``first_step_s``), each including the host read of loss, flag, norm and scale.
"""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Any

from numstab.bench.spec import REFERENCE, Preset, RunSpec


def final_window(steps: int) -> int:
    return min(10, max(1, steps // 10))


def run_metrics(record: dict[str, Any], preset: Preset) -> dict[str, Any]:
    losses = record["loss"]
    n = record["steps_run"]
    chance = math.log(preset.vocab)
    bad = [x is None or x > chance for x in losses]
    diverged_at = None
    if record["stopped_early_at"] is not None or (bad and bad[-1]):
        diverged_at = n
        while diverged_at > 0 and bad[diverged_at - 1]:
            diverged_at -= 1
    tail = losses[-final_window(preset.steps) :]
    final = None
    if record["stopped_early_at"] is None and all(x is not None for x in tail):
        final = sum(tail) / len(tail)
    scales = record["scale"]
    times = record["step_time"]
    return {
        "steps_run": n,
        "nonfinite_loss_steps": sum(x is None for x in losses),
        "nonfinite_grad_steps": sum(not f for f in record["grad_finite"]),
        "skipped_steps": sum(record["skipped"]),
        "skipped_rate": sum(record["skipped"]) / max(n, 1),
        "first_nonfinite_grad_step": next(
            (i for i, f in enumerate(record["grad_finite"]) if not f), None
        ),
        "scale_initial": scales[0] if scales else None,
        "scale_final": scales[-1] if scales else None,
        "scale_min": min(scales) if scales else None,
        "scale_backoffs": sum(b < a for a, b in itertools.pairwise(scales)),
        "scale_growths": sum(b > a for a, b in itertools.pairwise(scales)),
        "final_loss": final,
        "diverged": diverged_at is not None,
        "divergence_step": diverged_at,
        "time_per_step_ms": 1e3 * statistics.median(times[1:]) if len(times) > 1 else None,
        "first_step_s": times[0] if times else None,
        "peak_memory_mib": record["peak_memory_bytes"] / 2**20,
        "peak_memory_source": record["peak_memory_source"],
    }


def _losses(runs: dict[str, Any], spec: RunSpec) -> list | None:
    run = runs.get(spec.key)
    return None if run is None else run["record"]["loss"]


def agreement(runs: dict[str, Any], frameworks: list[str], seeds: list[int], preset: Preset):
    """fp32 reference runs, step by step: max |loss - loss of the first framework| over the
    first ``agreement_steps`` steps must stay within ``agreement_tol`` (every loss finite)."""
    n = min(preset.agreement_steps, preset.steps)
    out: dict[str, Any] = {"steps": n, "tolerance": preset.agreement_tol, "seeds": {}}
    statuses = []
    for seed in seeds:
        curves = {}
        for fw in frameworks:
            losses = _losses(runs, RunSpec(fw, *REFERENCE, seed))
            if losses is not None:
                curves[fw] = losses[:n]
        if len(curves) < 2:
            out["seeds"][str(seed)] = {"status": "not checked (fewer than two frameworks ran)"}
            statuses.append("not checked")
            continue
        base_fw = next(iter(curves))
        base = curves[base_fw]
        per_fw = {}
        ok = True
        for fw, curve in curves.items():
            if fw == base_fw:
                continue
            if len(curve) < n or any(x is None for x in curve + base):
                per_fw[fw] = {"max_abs_diff": None, "first_step_over": 0}
                ok = False
                continue
            diffs = [abs(a - b) for a, b in zip(curve, base, strict=True)]
            over = next((i for i, d in enumerate(diffs) if d > preset.agreement_tol), None)
            ok = ok and over is None
            per_fw[fw] = {"max_abs_diff": max(diffs), "first_step_over": over, "diffs": diffs}
        status = "passed" if ok else "FAILED"
        statuses.append(status)
        out["seeds"][str(seed)] = {"status": status, "baseline": base_fw, "frameworks": per_fw}
    if "FAILED" in statuses:
        out["status"] = "FAILED"
    elif statuses and all(s == "passed" for s in statuses):
        out["status"] = "passed"
    else:
        out["status"] = "not checked"
    return out


def spread(runs: dict[str, Any], frameworks: list[str], grid: list, seeds: list[int]):
    """Per configuration and seed: the per-step max - min of the loss across frameworks,
    over the steps where every framework's loss is finite."""
    out = {}
    for precision, remedy, fault in grid:
        for seed in seeds:
            curves = [
                c
                for fw in frameworks
                if (c := _losses(runs, RunSpec(fw, precision, remedy, fault, seed))) is not None
            ]
            if len(curves) < 2:
                continue
            width = [
                max(v) - min(v) for v in zip(*curves, strict=False) if all(x is not None for x in v)
            ]
            out[f"{precision}/{remedy}/{fault}|{seed}"] = {
                "frameworks": len(curves),
                "steps_compared": len(width),
                "max": max(width) if width else None,
                "mean": sum(width) / len(width) if width else None,
            }
    return out


def add_gaps(runs: dict[str, Any]) -> None:
    """final_loss - the same framework's and seed's fp32 reference final loss."""
    for key, run in runs.items():
        spec = RunSpec.from_key(key)
        ref = runs.get(RunSpec(spec.framework, *REFERENCE, spec.seed).key)
        mine = run["metrics"]["final_loss"]
        theirs = None if ref is None else ref["metrics"]["final_loss"]
        run["metrics"]["gap_to_fp32"] = None if mine is None or theirs is None else mine - theirs
