"""report.md: the tables a person reads at a glance, written from results.json's data."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from numstab.bench.spec import RunSpec, format_lr


def _fmt(x: Any, spec: str = ".3f") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return format(x, spec)


def _configs(data: dict[str, Any]) -> list[str]:
    return ["/".join(g) for g in data["settings"]["grid"]]


def _frameworks(data: dict[str, Any]) -> list[str]:
    """The frameworks of the settings whose worker ran (status "ok"), in settings order."""
    return [
        f
        for f in data["settings"]["frameworks"]
        if data["frameworks"].get(f, {}).get("status") == "ok"
    ]


def variants(data: dict[str, Any]) -> list[tuple[str, float | None]]:
    """(stack, lr) pairs of the settings, lr-major, numstab before native."""
    s = data["settings"]
    stacks = sorted(s.get("stacks") or ["numstab"], key=lambda x: x != "numstab")
    return [(st, lr) for lr in s.get("lrs") or [None] for st in stacks]


def spec_for(fw: str, config: str, seed: int, stack: str, lr: float | None) -> RunSpec:
    return RunSpec(fw, *config.split("/"), seed, stack, lr)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return [*lines, ""]


def _cell(data: dict[str, Any], spec: RunSpec, show) -> str:
    run = data["runs"].get(spec.key)
    if run is None:
        if spec.key in data.get("skipped", {}):
            return "skipped"
        return "error" if spec.key in data["errors"] else "-"
    return show(run["metrics"])


def outcome_text(m: dict[str, Any]) -> str:
    """'non-finite @k' (the run broke), 'worse than chance' (finite, did not learn), or ''."""
    if m.get("outcome", "non-finite" if m["diverged"] else "learned") == "non-finite":
        return f"non-finite @{m['divergence_step']}"
    if m.get("outcome") == "worse than chance":
        return "worse than chance"
    return ""


def _final(m: dict[str, Any]) -> str:
    word = outcome_text(m)
    if word.startswith("non-finite"):
        return f"**{word}**"
    gap = m.get("gap_to_fp32")
    text = _fmt(m["final_loss"]) + ("" if gap is None else f" ({gap:+.3f})")
    return f"_{word}: {text}_" if word else text


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


def _instability(m: dict[str, Any]) -> str:
    frac = m.get("grad_underflow_frac")
    return f"{_fmt(m.get('attn_logit_max'), '.3g')} / {_fmt(m.get('out_logit_max'), '.3g')} / " + (
        "-" if frac is None else f"{100 * frac:.2f}%"
    )


SECTIONS = [
    ("Final loss (gap to the same framework's, stack's and lr's fp32 run)", _final),
    ("Non-finite loss steps / non-finite gradient steps / skipped steps", _stability),
    ("Loss scale (start -> end)", _scale),
    ("Max attention logit / max output logit / gradient elements zero", _instability),
    ("Time per step: median of steps 2.. (first step incl. compilation)", _speed),
]


def anchor(title: str) -> str:
    """The GitHub anchor of a '### title' heading."""
    keep = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return "#" + keep.replace(" ", "-")


def section_title(title: str, seed: int) -> str:
    return f"{title} - seed {seed}"


def tables(data: dict[str, Any]) -> list[str]:
    """The per-metric tables: rows (configuration, lr, stack), columns frameworks."""
    fws = _frameworks(data)
    lines: list[str] = []
    for seed in data["settings"]["seeds"]:
        for title, show in SECTIONS:
            lines += [f"### {section_title(title, seed)}", ""]
            rows = [
                [f"`{c}`", stack, _fmt(lr, "g")]
                + [_cell(data, spec_for(fw, c, seed, stack, lr), show) for fw in fws]
                for c in _configs(data)
                for stack, lr in variants(data)
            ]
            lines += _table(["precision/remedy/fault", "stack", "lr", *fws], rows)
    return lines


def _header(data: dict[str, Any]) -> list[str]:
    s, p = data["settings"], data["settings"]["preset"]
    faults = {g[2] for g in s["grid"]}
    fault_words = []
    if faults & {"nan_batch", "lr_spike"}:
        fault_words.append(f"nan_batch / lr_spike strike at step {p['fault_step']}")
    if "logit_blowup" in faults:
        fault_words.append(f"logit_blowup scales the initial unembedding by {p['logit_scale']:g}")
    lrs = s.get("lrs") or [p["base_lr"]]
    return [
        f"Command: `{' '.join(data['command'])}`  ",
        f"Created: {data['created']}; complete: {'yes' if data['complete'] else 'NO'}"
        f" ({len(data['runs'])} of {len(data['plan'])} runs)  ",
        f"Model (preset `{p['name']}`): {p['layers']} layers, d_model {p['d_model']}, "
        f"{p['heads']} heads, vocab {p['vocab']} (chance loss ln(vocab) = "
        f"{math.log(p['vocab']):.3f}), context {p['context']}, batch {p['batch']}, "
        f"{p['steps']} steps (warmup {p['warmup_steps']}), AdamW peak lr "
        f"{', '.join(format(x, 'g') for x in lrs)} (cosine to {p['min_lr'] / p['base_lr']:g} x "
        f"peak), wd {p['weight_decay']:g}, betas ({p['beta1']}, {p['beta2']}), "
        f"clip {p['max_norm']:g}" + (f"; {'; '.join(fault_words)}" if fault_words else "") + "  ",
        f"Stacks: {', '.join(s.get('stacks') or ['numstab'])}; device: {s['device']}; seeds: "
        f"{', '.join(map(str, s['seeds']))}; load average at start: "
        f"{data['environment'].get('load_average_at_start')}",
        "",
    ]


def _agreement(data: dict[str, Any]) -> list[str]:
    agree = data["agreement"]
    lines = [
        "## fp32 agreement check",
        "",
        f"**{agree['status']}**: the fp32 runs (no remedy, no fault, first lr) step by step "
        f"over the first {agree['steps']} steps, max |loss - loss of the baseline| <= "
        f"{agree['tolerance']:g}: across frameworks on each stack, and per framework native "
        "against numstab. Every other comparison assumes this.",
        "",
    ]
    rows = []
    for field, what in (("seeds", "frameworks"), ("native_seeds", "native frameworks")):
        for seed, res in agree.get(field, {}).items():
            for fw, r in res.get("frameworks", {}).items():
                pair = f"{fw} vs {res['baseline']} ({what})"
                rows.append([seed, pair, _fmt(r["max_abs_diff"], ".2e"), res["status"]])
            if not res.get("frameworks"):
                rows.append([seed, what, "-", res["status"]])
    for key, res in agree.get("stacks", {}).items():
        fw, seed = key.split("|")
        for r in res.get("frameworks", {}).values():
            rows.append(
                [seed, f"{fw}: native vs numstab", _fmt(r["max_abs_diff"], ".2e"), res["status"]]
            )
    return lines + _table(["seed", "pair", "max abs loss diff", "status"], rows)


def _sensitivity(data: dict[str, Any]) -> list[str]:
    entries = data.get("lr_sensitivity") or []
    if not entries:
        return []
    lines = [
        "## Learning-rate sensitivity",
        "",
        "value = mean over the sweep of min(final loss, loss at initialisation) - the best "
        "final loss of the sweep; a run whose final loss is not finite counts as the loss at "
        "initialisation (Wortsman et al. 2023). 0: every lr reached the best loss. "
        "Figures: `lr_sweep_<framework>.png`.",
        "",
    ]
    lrs = entries[0]["lrs"]
    rows = [
        [
            e["framework"],
            e["stack"],
            f"`{e['precision']}/{e['remedy']}/{e['fault']}`",
            str(e["seed"]),
            *(_fmt(f) if f is not None else "**non-finite**" for f in e["final_losses"]),
            _fmt(e["init_loss"]),
            _fmt(e["value"]),
        ]
        for e in entries
    ]
    header = ["framework", "stack", "config", "seed"]
    header += [f"lr {x:g}" for x in lrs] + ["init loss", "sensitivity"]
    return lines + _table(header, rows)


def _spread_and_memory(data: dict[str, Any]) -> list[str]:
    lines = [
        "## Cross-framework spread of the loss curve",
        "",
        "Per step max - min of the loss across frameworks (steps where all are finite).",
        "",
    ]
    rows = []
    for k, v in data["spread"].items():
        spec = RunSpec.from_key("|" + k)
        rows.append(
            [
                f"`{spec.config}`",
                spec.stack,
                format_lr(spec.lr),
                str(spec.seed),
                str(v["frameworks"]),
                str(v["steps_compared"]),
                _fmt(v["max"], ".2e"),
                _fmt(v["mean"], ".2e"),
            ]
        )
    header = ["configuration", "stack", "lr", "seed", "frameworks", "steps", "max", "mean"]
    lines += _table(header, rows)
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
    return lines + _table(["framework", "MiB", "measured as"], mem_rows)


def write(data: dict[str, Any], out: Path, findings: list[str], pngs: list[Path]) -> list[Path]:
    """report.md, opening with ``findings`` and showing the plots ``pngs``; returns the
    paths written (report.md, then the plots)."""
    lines = ["# numstab bench: AMP stability across frameworks", ""]
    lines += findings
    lines += ["## Setup", "", *_header(data), "## Frameworks", ""]
    rows = []
    for fw in data["settings"]["frameworks"]:
        info = data["frameworks"].get(fw, {"status": "not run"})
        versions = ", ".join(f"{k} {v}" for k, v in info.get("versions", {}).items())
        rows.append(
            [fw, info["status"], versions or info.get("message", ""), info.get("device", "")]
        )
    lines += _table(["framework", "status", "versions / message", "device"], rows)
    lines += _agreement(data)
    chance = math.log(data["settings"]["preset"]["vocab"])
    lines += [
        "## Results",
        "",
        "Outcome: **non-finite @k** = the run broke (its loss is non-finite from step k to the "
        f"end, or {data['settings']['preset']['divergence_patience']} non-finite losses in a "
        f"row stopped it); _worse than chance_ = finite, but the last loss is above ln(vocab) "
        f"= {chance:.3f} (a uniform guess): it did not learn. Stacks: `numstab` = numstab's "
        "uniform mixed precision; `native` = the framework's own AMP recipe.",
        "",
    ]
    lines += tables(data)
    lines += _sensitivity(data)
    lines += _spread_and_memory(data)
    if data.get("skipped"):
        lines += ["## Skipped runs", ""]
        lines += [f"- `{k}`: {v}" for k, v in data["skipped"].items()] + [""]
    if data["errors"]:
        lines += ["## Errors", ""] + [f"- `{k}`: {v}" for k, v in data["errors"].items()] + [""]
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in pngs] + [""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return [path, *pngs]
