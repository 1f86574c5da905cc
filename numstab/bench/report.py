"""report.md: the tables a person reads at a glance, written from results.json's data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from numstab.bench.spec import RunSpec


def _fmt(x: Any, spec: str = ".3f") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return format(x, spec)


def _configs(data: dict[str, Any]) -> list[str]:
    return ["/".join(g) for g in data["settings"]["grid"]]


def _frameworks(data: dict[str, Any]) -> list[str]:
    return [
        f
        for f in data["settings"]["frameworks"]
        if data["frameworks"].get(f, {}).get("status") == "ok"
    ]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return [*lines, ""]


def _cell(data: dict[str, Any], fw: str, config: str, seed: int, show) -> str:
    run = data["runs"].get(RunSpec(fw, *config.split("/"), seed).key)
    if run is None:
        key = RunSpec(fw, *config.split("/"), seed).key
        return "error" if key in data["errors"] else "-"
    return show(run["metrics"])


def _final(m: dict[str, Any]) -> str:
    if m["diverged"]:
        return f"**diverged @{m['divergence_step']}**"
    gap = m.get("gap_to_fp32")
    return _fmt(m["final_loss"]) + ("" if gap is None else f" ({gap:+.3f})")


def _stability(m: dict[str, Any]) -> str:
    return f"{m['nonfinite_loss_steps']} / {m['nonfinite_grad_steps']} / {m['skipped_steps']}"


def _scale(m: dict[str, Any]) -> str:
    if m["scale_initial"] == m["scale_final"] == m["scale_min"]:
        return _fmt(m["scale_final"], "g")
    return (
        f"{_fmt(m['scale_initial'], 'g')} -> {_fmt(m['scale_final'], 'g')} "
        f"(min {_fmt(m['scale_min'], 'g')}, {m['scale_backoffs']} backoffs)"
    )


def _speed(m: dict[str, Any]) -> str:
    return f"{_fmt(m['time_per_step_ms'], '.1f')} ms ({_fmt(m['first_step_s'], '.1f')} s)"


def tables(data: dict[str, Any]) -> list[str]:
    """The per-metric tables (configuration x framework), one block per seed."""
    fws = _frameworks(data)
    lines: list[str] = []
    sections = [
        ("Final loss (gap to the same framework's fp32 run)", _final),
        ("Non-finite loss steps / non-finite gradient steps / skipped steps", _stability),
        ("Loss scale (start -> end)", _scale),
        ("Time per step: median of steps 2.. (first step incl. compilation)", _speed),
    ]
    for seed in data["settings"]["seeds"]:
        for title, show in sections:
            lines += [f"### {title} - seed {seed}", ""]
            rows = [
                [f"`{c}`", *(_cell(data, fw, c, seed, show) for fw in fws)] for c in _configs(data)
            ]
            lines += _table(["precision/remedy/fault", *fws], rows)
    return lines


def write(data: dict[str, Any], out: Path) -> list[Path]:
    """report.md and the plots; returns the paths written."""
    from numstab.bench import plots

    pngs = plots.write_all(data, out)
    s = data["settings"]
    p = s["preset"]
    agree = data["agreement"]
    lines = [
        "# numstab bench: AMP stability across frameworks",
        "",
        f"Command: `{' '.join(data['command'])}`  ",
        f"Created: {data['created']}; complete: {'yes' if data['complete'] else 'NO'}"
        f" ({len(data['runs'])} of {len(data['plan'])} runs)  ",
        f"Model (preset `{p['name']}`): {p['layers']} layers, d_model {p['d_model']}, "
        f"{p['heads']} heads, vocab {p['vocab']}, context {p['context']}, batch {p['batch']}, "
        f"{p['steps']} steps (warmup {p['warmup_steps']}), AdamW lr {p['base_lr']:g} -> "
        f"{p['min_lr']:g}, wd {p['weight_decay']:g}, betas ({p['beta1']}, {p['beta2']}), "
        f"clip {p['max_norm']:g}, faults at step {p['fault_step']}  ",
        f"Device: {s['device']}; seeds: {', '.join(map(str, s['seeds']))}; "
        f"load average at start: {data['environment'].get('load_average_at_start')}",
        "",
        "## Frameworks",
        "",
    ]
    rows = []
    for fw in s["frameworks"]:
        info = data["frameworks"].get(fw, {"status": "not run"})
        versions = ", ".join(f"{k} {v}" for k, v in info.get("versions", {}).items())
        rows.append(
            [fw, info["status"], versions or info.get("message", ""), info.get("device", "")]
        )
    lines += _table(["framework", "status", "versions / message", "device"], rows)
    lines += [
        "## fp32 agreement check",
        "",
        f"**{agree['status']}**: the fp32 runs (no remedy, no fault) of every framework, "
        f"step by step over the first {agree['steps']} steps, max |loss - loss of the "
        f"baseline framework| <= {agree['tolerance']:g}. Every other comparison assumes this.",
        "",
    ]
    rows = []
    for seed, res in agree["seeds"].items():
        for fw, r in res.get("frameworks", {}).items():
            rows.append(
                [seed, f"{fw} vs {res['baseline']}", _fmt(r["max_abs_diff"], ".2e"), res["status"]]
            )
        if not res.get("frameworks"):
            rows.append([seed, "-", "-", res["status"]])
    lines += _table(["seed", "pair", "max abs loss diff", "status"], rows)
    lines += [
        "## Results",
        "",
        "Divergence: the loss ends non-finite or above ln(vocab), or "
        f"{p['divergence_patience']} non-finite losses in a row.",
        "",
    ]
    lines += tables(data)
    lines += [
        "## Cross-framework spread of the loss curve",
        "",
        "Per step max - min of the loss across frameworks (steps where all are finite).",
        "",
    ]
    rows = [
        [
            f"`{k.split('|')[0]}`",
            k.split("|")[1],
            str(v["frameworks"]),
            str(v["steps_compared"]),
            _fmt(v["max"], ".2e"),
            _fmt(v["mean"], ".2e"),
        ]
        for k, v in data["spread"].items()
    ]
    lines += _table(["configuration", "seed", "frameworks", "steps", "max", "mean"], rows)
    mem_rows = []
    for fw in _frameworks(data):
        runs = [r for k, r in data["runs"].items() if k.startswith(fw + "|")]
        if runs:
            peak = max(r["metrics"]["peak_memory_mib"] for r in runs)
            mem_rows.append([fw, f"{peak:.0f}", runs[0]["metrics"]["peak_memory_source"]])
    lines += [
        "## Peak memory",
        "",
        "Per framework worker process (all its runs, imports included on CPU).",
        "",
    ]
    lines += _table(["framework", "MiB", "measured as"], mem_rows)
    if data["errors"]:
        lines += ["## Errors", ""] + [f"- `{k}`: {v}" for k, v in data["errors"].items()] + [""]
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in pngs] + [""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return [path, *pngs]
