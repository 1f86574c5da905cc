"""Learning-rate sensitivity (Wortsman et al. 2023, arXiv 2309.14322, section 3.1): for one
(framework, stack, precision, remedy, fault, seed) swept over peak learning rates,

    value = mean_i min(final_i, init) - min_i final_i

where ``final_i`` is run i's final loss (metrics.run_metrics), ``init`` the loss at
initialisation (step 0's loss, the same for every learning rate) and a run whose final
loss is not finite (it diverged) counts as ``init``; the minimum is over the finite final
losses (None when there is none). 0 means every learning rate of the sweep reached the best
loss; the larger, the more the outcome depends on the learning rate.
"""

from __future__ import annotations

import itertools
from typing import Any

from numstab.bench.spec import RunSpec


def sensitivity(final_losses: list[float | None], init_loss: float | None) -> float | None:
    finite = [f for f in final_losses if f is not None]
    if not finite or init_loss is None:
        return None
    capped = [init_loss if f is None else min(f, init_loss) for f in final_losses]
    return sum(capped) / len(capped) - min(finite)


def lr_sensitivity(runs: dict[str, Any], settings: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per swept group whose runs all finished; [] without a sweep (< 2 lrs)."""
    lrs = settings.get("lrs") or []
    if len(lrs) < 2:
        return []
    out = []
    groups = itertools.product(
        settings["frameworks"],
        settings.get("stacks") or ["numstab"],
        [tuple(g) for g in settings["grid"]],
        settings["seeds"],
    )
    for fw, stack, (precision, remedy, fault), seed in groups:
        found = [runs.get(RunSpec(fw, precision, remedy, fault, seed, stack, lr).key) for lr in lrs]
        if any(r is None for r in found):
            continue
        finals = [r["metrics"]["final_loss"] for r in found]
        inits = [r["metrics"]["init_loss"] for r in found if r["metrics"]["init_loss"] is not None]
        init = inits[0] if inits else None
        out.append(
            {
                "framework": fw,
                "stack": stack,
                "precision": precision,
                "remedy": remedy,
                "fault": fault,
                "seed": seed,
                "lrs": list(lrs),
                "final_losses": finals,
                "init_loss": init,
                "value": sensitivity(finals, init),
            }
        )
    return out
