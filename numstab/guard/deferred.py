"""The host side of a guard whose steady step stays on the device (``host_every = k > 1``).

The device runs ``numstab.guard.policy.decide`` every step and keeps, per step, a float32 row
of the step's ``Decision`` (:data:`ROW_COLUMNS`); the host reads the rows ``k`` at a time
(one transfer) and turns them back into the host dicts the runner acts on. Nothing is
recomputed on the host: the rows are the policy's own verdicts.
"""

from __future__ import annotations

from typing import Any

#: a step's row: the ``policy.Decision`` fields as float32 (booleans as 0/1, ``reasons`` as
#: its bit sum, exact in float32); the step's index is the host's count
ROW_COLUMNS = (
    "apply",
    "reasons",
    "loss",
    "grad_norm",
    "loss_z",
    "grad_norm_z",
    "rollback",
    "snapshot",
)


def decisions_from_rows(rows: Any, first_step: int) -> list[dict[str, Any]]:
    """Each row (NumPy float32 ``[n, len(ROW_COLUMNS)]``) as the host dict of a
    ``policy.Decision`` whose ``step`` is ``first_step + i``."""
    import numpy as np

    rows = np.asarray(rows, np.float32).reshape(-1, len(ROW_COLUMNS))
    out = []
    for i, row in enumerate(rows):
        d: dict[str, Any] = dict(zip(ROW_COLUMNS, row.tolist(), strict=True))
        for flag in ("apply", "rollback", "snapshot"):
            d[flag] = bool(d[flag])
        d["reasons"] = int(d["reasons"])
        d["step"] = first_step + i
        out.append(d)
    return out
