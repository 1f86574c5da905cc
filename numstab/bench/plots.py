"""PNG plots (matplotlib, Agg): loss curves, loss-scale trajectories, the stability heat map."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from numstab.bench.plot_style import OUTCOME_COLORS, STACK_DASH, pyplot
from numstab.bench.report import _frameworks
from numstab.bench.spec import RunSpec

COLORS = {"torch": "tab:red", "jax": "tab:blue", "tensorflow": "tab:orange"}
# wide solid under thin dashed / dotted: curves that coincide stay visible
STYLES = {
    "torch": {"lw": 3.0, "ls": "-", "alpha": 0.6},
    "jax": {"lw": 1.6, "ls": "--"},
    "tensorflow": {"lw": 1.2, "ls": ":"},
}


def _grid(n: int) -> tuple[int, int]:
    cols = min(3, n)
    return math.ceil(n / cols), cols


def _panels(data: dict[str, Any], keep=lambda config: True) -> list[tuple[tuple, str, Any]]:
    """(config, stack-independent) panels: one per configuration and learning rate."""
    from numstab.bench.report import variants

    lrs = list(dict.fromkeys(lr for _, lr in variants(data)))
    configs = [tuple(g) for g in data["settings"]["grid"] if keep(tuple(g))]
    return [(c, lr) for c in configs for lr in lrs]


def _runs_in(data: dict[str, Any], config: tuple, lr: Any, seed: int):
    from numstab.bench.report import variants

    for stack, _ in [v for v in variants(data) if v[1] == lr]:
        for fw in _frameworks(data):
            run = data["runs"].get(RunSpec(fw, *config, seed, stack, lr).key)
            if run is not None:
                yield fw, stack, run


def _style(fw: str, stack: str) -> dict[str, Any]:
    style = dict(STYLES.get(fw, {}))
    if stack == "native":
        style.update(ls=STACK_DASH["native"], lw=1.4, alpha=0.9)
    return style


def _finish(fig: Any, axes: Any, used: int, title: str, path: Path) -> Path:
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    pyplot().close(fig)
    return path


def loss_curves(data: dict[str, Any], path: Path, seed: int) -> Path:
    """One panel per configuration (and lr), one line per framework and stack; the dotted
    grey line is ln(vocab), the loss of a uniform guess ("chance")."""
    plt = pyplot()
    panels = _panels(data)
    chance = math.log(data["settings"]["preset"]["vocab"])
    rows, cols = _grid(len(panels))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, (config, lr) in zip(axes.flat, panels, strict=False):
        top = chance
        for fw, stack, run in _runs_in(data, config, lr, seed):
            y = [math.nan if v is None else v for v in run["record"]["loss"]]
            top = max([top, *(v for v in y if not math.isnan(v))])
            outcome = run["metrics"].get("outcome", "learned")
            label = f"{fw} {stack}" + ("" if outcome == "learned" else f" ({outcome})")
            ax.plot(range(len(y)), y, color=COLORS.get(fw), label=label, **_style(fw, stack))
        ax.axhline(chance, color="grey", ls=":", lw=1.0, label="ln(vocab): chance")
        if top > 3 * chance:
            ax.set_yscale("log")
        lr_text = "" if lr is None else f" lr {lr:g}"
        ax.set_title("/".join(config) + lr_text, fontsize=9)
        ax.set_xlabel("step (0-based)", fontsize=8)
        ax.set_ylabel("loss", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    title = f"Loss per step (seed {seed}); gaps = non-finite loss; dotted = ln(vocab)"
    return _finish(fig, axes, len(panels), title, path)


def loss_scales(data: dict[str, Any], path: Path, seed: int) -> Path | None:
    plt = pyplot()
    panels = _panels(data, lambda c: c[0] == "fp16" and "ls" in c[1].split("+"))
    if not panels:
        return None
    rows, cols = _grid(len(panels))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, (config, lr) in zip(axes.flat, panels, strict=False):
        for fw, stack, run in _runs_in(data, config, lr, seed):
            scale = run["record"]["scale"]
            ax.step(
                range(len(scale)),
                scale,
                where="post",
                color=COLORS.get(fw),
                label=f"{fw} {stack}",
                **_style(fw, stack),
            )
        ax.set_yscale("log", base=2)
        ax.set_title("/".join(config) + ("" if lr is None else f" lr {lr:g}"), fontsize=9)
        ax.set_xlabel("step (0-based)", fontsize=8)
        ax.set_ylabel("loss scale", fontsize=8)
        ax.tick_params(labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    title = f"Dynamic loss scale per step (seed {seed}): numstab LossScaler / native scaler"
    return _finish(fig, axes, len(panels), title, path)


def _heat_cell(runs: list[dict[str, Any]]) -> tuple[Any, str]:
    """(RGB colour, text) of one heat-map cell: red non-finite, salmon worse than chance,
    white -> blue by the skipped-step rate of runs that learned."""
    if not runs:
        return (0.93, 0.93, 0.93), "-"
    broken = [m for m in runs if m.get("outcome") == "non-finite"]
    if broken:
        return _rgb(OUTCOME_COLORS["non-finite"]), "NaN@" + ",".join(
            str(m["divergence_step"]) for m in broken
        )
    if any(m.get("outcome") == "worse than chance" for m in runs):
        return _rgb(OUTCOME_COLORS["worse than chance"]), "> chance"
    rate = sum(m["skipped_rate"] for m in runs) / len(runs)
    shade = 1.0 - 0.6 * min(1.0, rate / 0.5)
    return (shade, shade, 1.0), f"{100 * rate:.0f}% skip"


def _rgb(hex_colour: str) -> tuple[float, float, float]:
    return tuple(int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5))


def heat_map(data: dict[str, Any], path: Path) -> Path:
    """(framework, stack) x (configuration, lr): red = non-finite (NaN@step), salmon = worse
    than chance, white -> blue = skipped-step rate of a run that learned (over seeds)."""
    from numstab.bench.report import variants

    plt = pyplot()
    panels = _panels(data)
    stacks = list(dict.fromkeys(st for st, _ in variants(data)))
    rows = [(fw, st) for fw in _frameworks(data) for st in stacks]
    colours, labels = [], []
    for fw, stack in rows:
        colour_row, text_row = [], []
        for config, lr in panels:
            runs = [
                data["runs"].get(RunSpec(fw, *config, s, stack, lr).key)
                for s in data["settings"]["seeds"]
            ]
            colour, text = _heat_cell([r["metrics"] for r in runs if r is not None])
            colour_row.append(colour)
            text_row.append(text)
        colours.append(colour_row)
        labels.append(text_row)
    names = ["/".join(c) + ("" if lr is None else f" {lr:g}") for c, lr in panels]
    fig, ax = plt.subplots(figsize=(1.0 * len(panels) + 2.5, 0.5 * len(rows) + 2.4))
    ax.imshow(colours, aspect="auto")
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(len(rows)), [f"{fw} {st}" for fw, st in rows], fontsize=8)
    for i, row in enumerate(labels):
        for j, text in enumerate(row):
            dark = sum(colours[i][j]) < 1.5
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="w" if dark else "k")
    ax.set_title(
        "red: non-finite (NaN@step) | salmon: worse than chance | blue: skipped-step rate",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def write_all(data: dict[str, Any], out: Path) -> list[Path]:
    """Every plot for the runs in ``data`` (none when no run finished)."""
    from numstab.bench import plots_sweep

    written: list[Path] = []
    if not data["runs"] or not _frameworks(data):
        return written
    for seed in data["settings"]["seeds"]:
        suffix = "" if len(data["settings"]["seeds"]) == 1 else f"_seed{seed}"
        written.append(loss_curves(data, out / f"loss_curves{suffix}.png", seed))
        scale = loss_scales(data, out / f"loss_scale{suffix}.png", seed)
        if scale is not None:
            written.append(scale)
    written.append(heat_map(data, out / "stability_heatmap.png"))
    written += plots_sweep.lr_curves(data, out)
    return written
