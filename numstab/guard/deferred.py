"""The host side of a guard whose steady step stays on the device (``host_every = k > 1``).

The device decides every step and keeps, per step, a float32 ``[2, len(ROW_COLUMNS)]`` row:
the loss and the global gradient norm, each detector's window mean, standard deviation and
count before the step, and whether each was ok (the step was applied when both were). The
host reads the rows ``k`` at a time (one transfer) and rebuilds each step's decision from
them: the skip reasons and z-scores (exactly as ``SpikeDetector.score``, in float32), and,
in :class:`HostBook`, the bad-step ring and the applied-step count that say when to roll
back and when a snapshot is due (exactly as ``numstab.guard.policy``). The device's verdict
is the one that was acted on.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from numstab.guard import policy

if TYPE_CHECKING:
    from numstab.guard.guard import TrainingGuard

#: the columns of a step's row, one row per detector (0: the loss, 1: the gradient norm):
#: the value, the window's mean, standard deviation and count before the step, and "ok"
#: (the value is finite and no spike): the step was applied when both rows are ok
ROW_COLUMNS = ("value", "mean", "std", "count", "ok")


def detector_constants(guard: TrainingGuard) -> dict[str, list[float]]:
    """Per detector (loss, grad norm): window, warmup, sigma, two_sided, record_spikes and
    enabled as floats; a disabled detector never activates (warmup +inf) nor records."""
    inf = float("inf")
    out: dict[str, list[float]] = {k: [] for k in ("window", "warmup", "sigma", "two", "rec", "on")}
    for det in (guard.loss_spikes, guard.grad_norm_spikes):
        out["window"].append(float(det.window if det else 2))
        out["warmup"].append(float(det.effective_warmup) if det else inf)
        out["sigma"].append(float(det.sigma) if det else inf)
        out["two"].append(float(bool(det and det.two_sided)))
        out["rec"].append(float(bool(det and det.record_spikes)))
        out["on"].append(float(det is not None))
    return out


def decisions_from_rows(guard: TrainingGuard, rows: Any, first_step: int) -> list[dict[str, Any]]:
    """Each row (NumPy float32 ``[n, 2, len(ROW_COLUMNS)]``) as the host dict of a
    ``policy.Decision`` (without ``rollback``/``snapshot``: see :class:`HostBook`)."""
    import numpy as np

    c = {k: np.asarray(x, np.float32) for k, x in detector_constants(guard).items()}
    rows = np.asarray(rows, np.float32).reshape(-1, 2, len(ROW_COLUMNS))
    x, mean, std, count = (rows[:, :, j] for j in range(4))
    with np.errstate(all="ignore"):
        finite = np.isfinite(x)
        diff = np.where(c["two"] > 0, np.abs(x - mean), x - mean)
        active = (count + 1 >= c["warmup"]) & finite
        spike = active & (diff > c["sigma"] * std)
        safe = np.where(std > 0, std, np.float32(1))
        z = np.where(std > 0, diff / safe, np.where(diff > 0, np.float32(np.inf), np.float32(0)))
        z = np.where(active, z, np.float32(0))
    ok = (rows[:, :, 4] > 0).all(axis=1)  # each detector's verdict, from the device
    reasons = (~finite[:, 0]) * 1 + (~finite[:, 1]) * 2 + spike[:, 0] * 4 + spike[:, 1] * 8
    return [
        {
            "apply": bool(ok[i]),
            "reasons": int(reasons[i]),
            "loss": float(x[i, 0]),
            "grad_norm": float(x[i, 1]),
            "loss_z": float(z[i, 0]),
            "grad_norm_z": float(z[i, 1]),
            "step": first_step + i,
            "rollback": False,
            "snapshot": False,
        }
        for i in range(len(rows))
    ]


class HostBook:
    """The bad-step ring and the applied-step count of ``policy.decide``, kept on the host
    from the device's ``apply`` flags."""

    def __init__(self, guard: TrainingGuard) -> None:
        self.guard = guard
        self.bad: deque[int] = deque([0] * guard.rollback_window, maxlen=guard.rollback_window)
        self.position = 0  # the slot of policy's ring the next step goes to
        self.good = 0

    def mark(self, d: dict[str, Any]) -> None:
        """Set ``d["rollback"]`` and ``d["snapshot"]`` as ``policy.decide`` would."""
        self.bad.append(0 if d["apply"] else 1)
        self.position = (self.position + 1) % self.guard.rollback_window
        self.good += int(d["apply"])
        d["rollback"] = sum(self.bad) >= self.guard.rollback_after
        d["snapshot"] = d["apply"] and self.good >= self.guard.snapshot_every
        if d["snapshot"]:
            self.good = 0

    def reset(self) -> None:
        """After a rollback (``policy.rolled_back``): the ring and the count restart."""
        self.bad.extend([0] * self.guard.rollback_window)
        self.good = 0

    def ring(self) -> Any:
        """The ring as ``GuardState.bad_flags`` (slot ``position`` is the next one written)."""
        import numpy as np

        newest_first = list(self.bad)[::-1]
        flags = np.zeros(self.guard.rollback_window, np.int32)
        for age, bit in enumerate(newest_first):
            flags[(self.position - 1 - age) % self.guard.rollback_window] = bit
        return flags

    def state(self, windows: tuple[Any, Any], lr_factor: float, step: int) -> policy.GuardState:
        """A NumPy ``GuardState`` from the device's two windows and this book."""
        import numpy as np

        return policy.GuardState(
            loss_window=windows[0],
            grad_norm_window=windows[1],
            bad_flags=self.ring(),
            bad_position=np.int32(self.position),
            good_since_snapshot=np.int32(self.good),
            lr_factor=np.float32(lr_factor),
            step=np.int32(step),
        )
