"""PNG plots (matplotlib, Agg): loss curves, loss-scale trajectories, the stability heat map."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from numstab.bench.spec import RunSpec

COLORS = {"torch": "tab:red", "jax": "tab:blue", "tensorflow": "tab:orange"}
# wide solid under thin dashed / dotted: curves that coincide stay visible
STYLES = {
    "torch": {"lw": 3.0, "ls": "-", "alpha": 0.6},
    "jax": {"lw": 1.6, "ls": "--"},
    "tensorflow": {"lw": 1.2, "ls": ":"},
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(n: int) -> tuple[int, int]:
    cols = min(3, n)
    return math.ceil(n / cols), cols


def _ok(data: dict[str, Any]) -> list[str]:
    return [
        f
        for f in data["settings"]["frameworks"]
        if data["frameworks"].get(f, {}).get("status") == "ok"
    ]


def loss_curves(data: dict[str, Any], path: Path, seed: int) -> Path:
    plt = _pyplot()
    configs = [tuple(g) for g in data["settings"]["grid"]]
    rows, cols = _grid(len(configs))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, config in zip(axes.flat, configs, strict=False):
        for fw in _ok(data):
            run = data["runs"].get(RunSpec(fw, *config, seed).key)
            if run is None:
                continue
            y = [math.nan if v is None else v for v in run["record"]["loss"]]
            label = fw + (" (diverged)" if run["metrics"]["diverged"] else "")
            ax.plot(range(len(y)), y, color=COLORS.get(fw), label=label, **STYLES.get(fw, {}))
        ax.set_title("/".join(config), fontsize=9)
        ax.set_xlabel("step (0-based)", fontsize=8)
        ax.set_ylabel("loss", fontsize=8)
        ax.tick_params(labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(configs) :]:
        ax.axis("off")
    fig.suptitle(f"Loss per step (seed {seed}); gaps = non-finite loss")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def loss_scales(data: dict[str, Any], path: Path, seed: int) -> Path | None:
    plt = _pyplot()
    configs = [tuple(g) for g in data["settings"]["grid"] if g[0] == "fp16" and "ls" in g[1]]
    if not configs:
        return None
    rows, cols = _grid(len(configs))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, config in zip(axes.flat, configs, strict=False):
        for fw in _ok(data):
            run = data["runs"].get(RunSpec(fw, *config, seed).key)
            if run is not None:
                scale = run["record"]["scale"]
                ax.step(
                    range(1, len(scale) + 1),
                    scale,
                    where="post",
                    color=COLORS.get(fw),
                    label=fw,
                    **STYLES.get(fw, {}),
                )
        ax.set_yscale("log", base=2)
        ax.set_title("/".join(config), fontsize=9)
        ax.set_xlabel("step (0-based)", fontsize=8)
        ax.set_ylabel("loss scale", fontsize=8)
        ax.tick_params(labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(configs) :]:
        ax.axis("off")
    fig.suptitle(f"Dynamic loss scale per step (seed {seed})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def heat_map(data: dict[str, Any], path: Path) -> Path:
    """framework x configuration: colour = skipped-step rate, 1.0 (dark) when diverged; the
    text says 'div@k' or the skipped rate (averaged over seeds)."""
    plt = _pyplot()
    fws = _ok(data)
    configs = ["/".join(g) for g in data["settings"]["grid"]]
    values, labels = [], []
    for fw in fws:
        row, text = [], []
        for config in configs:
            runs = [
                data["runs"].get(RunSpec(fw, *config.split("/"), s).key)
                for s in data["settings"]["seeds"]
            ]
            runs = [r["metrics"] for r in runs if r is not None]
            if not runs:
                row.append(math.nan)
                text.append("-")
                continue
            diverged = [m for m in runs if m["diverged"]]
            if diverged:
                row.append(1.0)
                steps = ",".join(str(m["divergence_step"]) for m in diverged)
                text.append(
                    f"div@{steps}" + (f"\n{len(diverged)}/{len(runs)}" if len(runs) > 1 else "")
                )
            else:
                rate = sum(m["skipped_rate"] for m in runs) / len(runs)
                row.append(rate)
                text.append(f"{100 * rate:.0f}%")
        values.append(row)
        labels.append(text)
    fig, ax = plt.subplots(figsize=(1.1 * len(configs) + 2, 0.7 * len(fws) + 2.2))
    image = ax.imshow(values, cmap="Reds", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(configs)), configs, rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(len(fws)), fws, fontsize=8)
    for i, row in enumerate(labels):
        for j, text in enumerate(row):
            dark = not math.isnan(values[i][j]) and values[i][j] > 0.6
            ax.text(
                j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black"
            )
    fig.colorbar(image, ax=ax, label="skipped-step rate (1 = diverged)")
    ax.set_title("Stability: diverged (div@step) or skipped-step rate")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_all(data: dict[str, Any], out: Path) -> list[Path]:
    """Every plot for the runs in ``data`` (none when no run finished)."""
    written: list[Path] = []
    if not data["runs"] or not _ok(data):
        return written
    for seed in data["settings"]["seeds"]:
        suffix = "" if len(data["settings"]["seeds"]) == 1 else f"_seed{seed}"
        written.append(loss_curves(data, out / f"loss_curves{suffix}.png", seed))
        scale = loss_scales(data, out / f"loss_scale{suffix}.png", seed)
        if scale is not None:
            written.append(scale)
    written.append(heat_map(data, out / "stability_heatmap.png"))
    return written
