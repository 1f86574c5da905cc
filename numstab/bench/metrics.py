"""Numbers derived from the per-step records: one run's stability summary, the fp32
agreement check across frameworks, the cross-framework spread and the gaps to fp32.

Definitions (also in docs/semantics.md §18):
- final loss: mean of the last ``max(1, steps // 10)`` losses (capped at 10), or None when
  one of them is non-finite or the run stopped early.
- outcome: ``non-finite`` (the run broke: it stopped early after ``divergence_patience``
  consecutive non-finite losses, or its last loss is non-finite; ``diverged`` is then true
  and ``divergence_step`` the first step from which the loss stays non-finite), ``worse
  than chance`` (finite to the end, but the last loss is above ``ln(vocab)``, a uniform
  guess: it did not learn; ``chance_step`` the first step from which it stays above), or
  ``learned``.
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
    diverged_at = _stays_from([x is None for x in losses])
    if record["stopped_early_at"] is None and diverged_at == n:
        diverged_at = None
    chance_at = (
        None if diverged_at is not None else _stays_from([x is None or x > chance for x in losses])
    )
    chance_at = None if chance_at == n else chance_at
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
        "init_loss": losses[0] if losses else None,
        "outcome": "non-finite"
        if diverged_at is not None
        else ("worse than chance" if chance_at is not None else "learned"),
        "diverged": diverged_at is not None,
        "divergence_step": diverged_at,
        "chance_step": chance_at,
        **_extremes(record),
        "time_per_step_ms": 1e3 * statistics.median(times[1:]) if len(times) > 1 else None,
        "first_step_s": times[0] if times else None,
        "peak_memory_mib": record["peak_memory_bytes"] / 2**20,
        "peak_memory_source": record["peak_memory_source"],
    }


def _stays_from(bad: list[bool]) -> int:
    """The first index from which every entry is true (len when the last is false)."""
    i = len(bad)
    while i > 0 and bad[i - 1]:
        i -= 1
    return i


def _extremes(record: dict[str, Any]) -> dict[str, Any]:
    """Run summaries of the per-step instability measurements (None where not measured)."""
    out = {}
    for name, reduce in (("attn_logit_max", max), ("out_logit_max", max)):
        values = [v for v in record.get(name, []) if v is not None]
        out[name] = reduce(values) if values else None
    fractions = [v for v in record.get("grad_underflow_frac", []) if v is not None]
    out["grad_underflow_frac"] = sum(fractions) / len(fractions) if fractions else None
    return out


def _losses(runs: dict[str, Any], spec: RunSpec) -> list | None:
    run = runs.get(spec.key)
    return None if run is None else run["record"]["loss"]


def _compare_curves(curves: dict[str, list], n: int, tol: float) -> dict[str, Any]:
    """Every curve against the first, step by step over the first ``n`` steps."""
    base_name = next(iter(curves))
    base = curves[base_name]
    per, ok = {}, True
    for name, curve in curves.items():
        if name == base_name:
            continue
        if len(curve) < n or len(base) < n or any(x is None for x in curve + base):
            per[name] = {"max_abs_diff": None, "first_step_over": 0}
            ok = False
            continue
        diffs = [abs(a - b) for a, b in zip(curve, base, strict=True)]
        over = next((i for i, d in enumerate(diffs) if d > tol), None)
        ok = ok and over is None
        per[name] = {"max_abs_diff": max(diffs), "first_step_over": over, "diffs": diffs}
    return {"status": "passed" if ok else "FAILED", "baseline": base_name, "frameworks": per}


def _first_lr(settings: dict[str, Any]) -> float | None:
    lrs = settings.get("lrs") or [None]
    return lrs[0]


def agreement(runs: dict[str, Any], frameworks: list[str], settings: dict, preset: Preset):
    """fp32 reference runs (at the first learning rate), step by step: max |loss - loss of
    the first framework| over the first ``agreement_steps`` steps must stay within
    ``agreement_tol`` (every loss finite). ``seeds``: across frameworks on numstab's stack
    (or the native one when only it ran); ``native_seeds``: across frameworks on the native
    stacks when both ran; ``stacks``: per framework, native against numstab."""
    n = min(preset.agreement_steps, preset.steps)
    stacks = settings.get("stacks") or ["numstab"]
    lr = _first_lr(settings)
    out: dict[str, Any] = {"steps": n, "tolerance": preset.agreement_tol, "seeds": {}}
    statuses = []

    def curve(fw: str, seed: int, stack: str) -> list | None:
        losses = _losses(runs, RunSpec(fw, *REFERENCE, seed, stack, lr))
        return None if losses is None else losses[:n]

    def check(field: str, seed: int, curves: dict[str, list]) -> None:
        if len(curves) < 2:
            result = {"status": "not checked (fewer than two runs)"}
        else:
            result = _compare_curves(curves, n, preset.agreement_tol)
        statuses.append(result["status"].split(" (")[0])
        out.setdefault(field, {})[str(seed)] = result

    for seed in settings["seeds"]:
        for i, stack in enumerate(sorted(stacks, key=lambda s: s != "numstab")):
            curves = {fw: c for fw in frameworks if (c := curve(fw, seed, stack)) is not None}
            check("seeds" if i == 0 else "native_seeds", seed, curves)
        if len(stacks) > 1:
            for fw in frameworks:
                pair = {s: curve(fw, seed, s) for s in ("numstab", "native")}
                check("stacks", f"{fw}|{seed}", {k: v for k, v in pair.items() if v is not None})
    if "FAILED" in statuses:
        out["status"] = "FAILED"
    elif statuses and all(s == "passed" for s in statuses):
        out["status"] = "passed"
    else:
        out["status"] = "not checked"
    return out


def spread(runs: dict[str, Any], frameworks: list[str], grid: list, settings: dict):
    """Per configuration, seed, stack and lr: the per-step max - min of the loss across
    frameworks, over the steps where every framework's loss is finite."""
    out = {}
    stacks = settings.get("stacks") or ["numstab"]
    variants = [(s, lr) for lr in settings.get("lrs") or [None] for s in stacks]
    for (precision, remedy, fault), seed, (stack, lr) in itertools.product(
        grid, settings["seeds"], variants
    ):
        spec = RunSpec("", precision, remedy, fault, seed, stack, lr)
        curves = [
            c for fw in frameworks if (c := _losses(runs, spec.with_(framework=fw))) is not None
        ]
        if len(curves) < 2:
            continue
        width = [
            max(v) - min(v) for v in zip(*curves, strict=False) if all(x is not None for x in v)
        ]
        out[spec.key.lstrip("|")] = {
            "frameworks": len(curves),
            "steps_compared": len(width),
            "max": max(width) if width else None,
            "mean": sum(width) / len(width) if width else None,
        }
    return out


def add_gaps(runs: dict[str, Any]) -> None:
    """final_loss - the same framework's, seed's, stack's and lr's fp32 reference final loss."""
    for key, run in runs.items():
        spec = RunSpec.from_key(key)
        ref = runs.get(spec.with_(precision="fp32", remedy="none", fault="none").key)
        mine = run["metrics"]["final_loss"]
        theirs = None if ref is None else ref["metrics"]["final_loss"]
        run["metrics"]["gap_to_fp32"] = None if mine is None or theirs is None else mine - theirs
