"""The plain-sentence findings that open report.md, each computed from results.json's numbers
and pointing to the table or figure it comes from. Nothing here is hand-written per run."""

from __future__ import annotations

import math
from typing import Any

from numstab.bench import report
from numstab.bench.spec import RunSpec, format_lr


def _link(title_index: int, seed: int) -> str:
    title = report.SECTIONS[title_index][0]
    name = title.split(" (")[0].split(":")[0]
    return f"[{name}]({report.anchor(report.section_title(title, seed))})"


def _runs(data: dict[str, Any], config: tuple, stack: str, lr: Any, seed: int) -> list[dict]:
    fws = report._frameworks(data)
    found = [data["runs"].get(RunSpec(fw, *config, seed, stack, lr).key) for fw in fws]
    return [r["metrics"] for r in found if r is not None]


def describe(ms: list[dict[str, Any]]) -> str:
    """'2 of 3 non-finite, 1 of 3 worse than chance' or 'all 3 learned (final loss 4.436)'."""
    n = len(ms)
    counts = {o: sum(m["outcome"] == o for m in ms) for o in ("non-finite", "worse than chance")}
    broken = [f"{k} of {n} {o}" for o, k in counts.items() if k]
    finals = [m["final_loss"] for m in ms if m["outcome"] == "learned" and m["final_loss"]]
    mean = f"final loss {sum(finals) / len(finals):.3f}" if finals else ""
    if not broken:
        return f"all {n} learned ({mean})"
    return ", ".join(broken) + (f", the others learned ({mean})" if mean else "")


def remedy_effects(data: dict[str, Any], seed: int, lr: Any) -> list[str]:
    out = []
    grid = [tuple(g) for g in data["settings"]["grid"]]
    for stack, _ in [v for v in report.variants(data) if v[1] == lr]:
        for p, r, f in grid:
            if r == "none" or (p, "none", f) not in grid:
                continue
            without = _runs(data, (p, "none", f), stack, lr, seed)
            with_ = _runs(data, (p, r, f), stack, lr, seed)
            if not without or not with_:
                continue
            out.append(
                f"- `{p}/{f}` on the {stack} stack, lr {format_lr(lr)}: without a remedy "
                f"{describe(without)}; with `{r}` {describe(with_)} ({_link(0, seed)})."
            )
    return out


def sweep_effects(data: dict[str, Any]) -> list[str]:
    """Per remedy and stack, against its no-remedy twin over the sweep: the sensitivities,
    and at the lr where the remedy changed the final loss most, the losses and logit maxima."""
    entries = data.get("lr_sensitivity") or []
    index = {
        (e["framework"], e["stack"], e["precision"], e["remedy"], e["fault"]): e for e in entries
    }
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for (fw, stack, p, r, f), e in index.items():
        twin = index.get((fw, stack, p, "none", f))
        if r != "none" and twin is not None and e["seed"] == twin["seed"]:
            groups.setdefault((stack, p, r, f), []).append((e, twin))
    out = []
    for (stack, p, r, f), pairs in groups.items():
        fws = "/".join(e["framework"] for e, _ in pairs)
        with_ = "/".join(_fmt3(e["value"]) for e, _ in pairs)
        without = "/".join(_fmt3(t["value"]) for _, t in pairs)
        text = (
            f"- `{r}` ({p}/{f}, {stack} stack) over lrs "
            f"{', '.join(format(x, 'g') for x in pairs[0][0]['lrs'])}: LR sensitivity "
            f"{with_} with it vs {without} without ({fws})"
        )
        text += _largest_effect(data, pairs) + " ([LR sensitivity](#learning-rate-sensitivity))."
        out.append(text)
    return out


def _fmt3(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _largest_effect(data: dict[str, Any], pairs: list[tuple[dict, dict]]) -> str:
    best = None
    for e, t in pairs:
        for i, (a, b) in enumerate(zip(e["final_losses"], t["final_losses"], strict=True)):
            gap = abs(
                (a if a is not None else e["init_loss"]) - (b if b is not None else t["init_loss"])
            )
            if best is None or gap > best[0]:
                best = (gap, e, t, i)
    if best is None:
        return ""
    _, e, t, i = best
    lr = e["lrs"][i]
    m = {}
    for name, entry in (("with", e), ("without", t)):
        spec = RunSpec(
            entry["framework"],
            entry["precision"],
            entry["remedy"],
            entry["fault"],
            entry["seed"],
            entry["stack"],
            lr,
        )
        run = data["runs"].get(spec.key)
        m[name] = run["metrics"] if run else {}
    return (
        f"; largest effect at lr {lr:g} ({e['framework']}): final loss "
        f"{_fmt3(e['final_losses'][i])} vs {_fmt3(t['final_losses'][i])}, max attention logit "
        f"{_fmt3(m['with'].get('attn_logit_max'))} vs {_fmt3(m['without'].get('attn_logit_max'))}, "
        f"max output logit {_fmt3(m['with'].get('out_logit_max'))} vs "
        f"{_fmt3(m['without'].get('out_logit_max'))}"
    )


def underflow(data: dict[str, Any]) -> list[str]:
    groups: dict[str, list[float]] = {}
    first_lr = (data["settings"].get("lrs") or [None])[0]
    for run in data["runs"].values():
        spec, frac = run["spec"], run["metrics"].get("grad_underflow_frac")
        if frac is None or spec["fault"] != "none" or spec.get("lr") != first_lr:
            continue
        ls = "ls" in spec["remedy"].split("+")
        name = spec["precision"] + (" with loss scaling" if ls else " without loss scaling")
        groups.setdefault(name, []).append(frac)
    if not groups:
        return []
    parts = [
        f"{name}: {100 * min(v):.2f}% to {100 * max(v):.2f}% ({len(v)} runs)"
        for name, v in sorted(groups.items())
    ]
    return [
        "- Gradient elements exactly zero (mean over steps, embedding table excluded, no fault, "
        f"lr {format_lr(first_lr)}; a 16-bit underflow shows as 0): "
        + "; ".join(parts)
        + f" ({_link(3, data['settings']['seeds'][0])})."
    ]


def stacks_differ(data: dict[str, Any], seed: int) -> list[str]:
    """Native against numstab, run by run: outcomes, skipped steps, final losses."""
    if len(data["settings"].get("stacks") or []) < 2:
        return []
    differ, skips, gaps, n = [], [], [], 0
    for key, run in data["runs"].items():
        spec = RunSpec.from_key(key)
        twin = data["runs"].get(spec.with_(stack="numstab").key)
        if spec.stack != "native" or spec.seed != seed or twin is None:
            continue
        n += 1
        a, b, name = run["metrics"], twin["metrics"], f"`{spec.framework} {spec.config}`"
        if a["outcome"] != b["outcome"]:
            differ.append(f"{name} ({a['outcome']} vs {b['outcome']})")
        elif a["outcome"] == "learned" and None not in (a["final_loss"], b["final_loss"]):
            gaps.append((abs(a["final_loss"] - b["final_loss"]), name))
        if a["skipped_steps"] != b["skipped_steps"]:
            skips.append(f"{name} ({a['skipped_steps']} vs {b['skipped_steps']})")
    if not n:
        return []
    text = f"- Native AMP recipe vs numstab's stack, {n} paired runs: the outcome differs in "
    text += f"{len(differ)}" + (": " + ", ".join(differ[:6]) if differ else "")
    if skips:
        text += f"; skipped steps (native vs numstab) differ in {len(skips)}: "
        text += ", ".join(skips[:6])
    if gaps:
        gap, where = max(gaps)
        text += f"; where both learned, final losses differ by at most {gap:.3f} ({where})"
    return [text + f" ({_link(0, seed)}, {_link(1, seed)})."]


def chance(data: dict[str, Any]) -> list[str]:
    vocab = data["settings"]["preset"]["vocab"]
    worse = [k for k, r in data["runs"].items() if r["metrics"]["outcome"] == "worse than chance"]
    if not worse:
        return []
    shown = ", ".join(f"`{k}`" for k in worse[:5]) + (" ..." if len(worse) > 5 else "")
    return [
        f"- {len(worse)} runs stayed finite but ended above ln(vocab) = {math.log(vocab):.3f} "
        f"(worse than a uniform guess: they did not learn, they did not break): {shown}."
    ]


def sensitivities(data: dict[str, Any], figures: list[str]) -> list[str]:
    entries = [e for e in data.get("lr_sensitivity") or [] if e["value"] is not None]
    if not entries:
        return []
    entries.sort(key=lambda e: e["value"])

    def name(e: dict) -> str:
        return f"{e['framework']} {e['stack']} `{e['precision']}/{e['remedy']}/{e['fault']}`"

    by_stack: dict[str, list[float]] = {}
    for e in entries:
        by_stack.setdefault(f"{e['framework']} {e['stack']}", []).append(e["value"])
    means = sorted((sum(v) / len(v), k) for k, v in by_stack.items())
    figs = ", ".join(f"`{f}`" for f in figures if f.startswith("lr_sweep")) or "no figure"
    return [
        f"- Learning-rate sensitivity: most sensitive {name(entries[-1])} "
        f"({entries[-1]['value']:.3f}), least {name(entries[0])} ({entries[0]['value']:.3f}); "
        f"averaged per framework and stack: most {means[-1][1]} ({means[-1][0]:.3f}), least "
        f"{means[0][1]} ({means[0][0]:.3f}) ([LR sensitivity](#learning-rate-sensitivity), {figs})."
    ]


def section(data: dict[str, Any], figures: list[str]) -> list[str]:
    """'## Findings' and its bullets (an empty section says why)."""
    seed = data["settings"]["seeds"][0]
    lrs = data["settings"].get("lrs") or [None]
    agree = data["agreement"]
    lines = [
        f"- fp32 agreement check **{agree['status']}** "
        "([fp32 agreement check](#fp32-agreement-check)): "
        + (
            "the frameworks (and stacks) compute the same run, so the differences below "
            "come from precision, remedy and recipe."
            if agree["status"] == "passed"
            else "read every comparison below with care."
        )
    ]
    lines += sweep_effects(data) if len(lrs) > 1 else remedy_effects(data, seed, lrs[0])
    lines += stacks_differ(data, seed) + underflow(data) + chance(data)
    lines += sensitivities(data, figures)
    if not data["runs"]:
        lines = ["- No run finished: see the frameworks table and the errors."]
    return ["## Findings", "", *lines, ""]
