"""The learning-rate sweep figure (the shape of Wortsman et al. 2023, figure 1): per
framework, final loss against peak learning rate, one line per (stack, precision, remedy,
fault); a run whose final loss is not finite is drawn as a red cross at the loss at
initialisation (as the sensitivity counts it); the dotted line is ln(vocab)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from numstab.bench.plot_style import OUTCOME_COLORS, pyplot

MARKERS = {"numstab": "o", "native": "s"}


def lr_curves(data: dict[str, Any], out: Path) -> list[Path]:
    entries = [
        e for e in data.get("lr_sensitivity") or [] if e["seed"] == data["settings"]["seeds"][0]
    ]
    written = []
    for fw in dict.fromkeys(e["framework"] for e in entries):
        path = out / f"lr_sweep_{fw}.png"
        _one_framework(data, [e for e in entries if e["framework"] == fw], fw, path)
        written.append(path)
    return written


def _one_framework(data: dict[str, Any], entries: list[dict], fw: str, path: Path) -> None:
    plt = pyplot()
    chance = math.log(data["settings"]["preset"]["vocab"])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    cmap = plt.get_cmap("tab10")
    configs = list(dict.fromkeys((e["precision"], e["remedy"], e["fault"]) for e in entries))
    for e in entries:
        colour = cmap(configs.index((e["precision"], e["remedy"], e["fault"])) % 10)
        finals = [math.nan if f is None else f for f in e["final_losses"]]
        value = "-" if e["value"] is None else f"{e['value']:.2f}"
        label = f"{e['stack']} {e['precision']}/{e['remedy']}/{e['fault']} (sens. {value})"
        ls = "-" if e["stack"] == "numstab" else "--"
        ax.plot(
            e["lrs"],
            finals,
            ls=ls,
            marker=MARKERS.get(e["stack"], "o"),
            ms=4,
            color=colour,
            label=label,
        )
        broken = [lr for lr, f in zip(e["lrs"], e["final_losses"], strict=True) if f is None]
        if broken and e["init_loss"] is not None:
            ax.plot(
                broken,
                [e["init_loss"]] * len(broken),
                "x",
                ms=8,
                color=OUTCOME_COLORS["non-finite"],
            )
    ax.axhline(chance, color="grey", ls=":", lw=1.0, label="ln(vocab): chance")
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final loss")
    ax.set_title(
        f"{fw}: final loss vs learning rate (x = non-finite, drawn at the initial loss)", fontsize=9
    )
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
