"""numstab.data: a firewall for input pipelines against NaN, inf and outlier samples.

- ``check_batch(batch)``: a BatchReport of NaN/inf counts per field and the bad samples;
- ``nonfinite_per_sample(batch)``: the graph-safe per-sample count behind it;
- ``protect(iterable, policy="drop" | "replace" | "raise", outliers=None, ...)``: wraps a
  torch DataLoader, a tf.data.Dataset or any iterable of batches; per-sample decisions,
  everything recorded in ``.stats`` and optionally quarantined to ``.npz`` (``guard``: its
  name before 0.2, the same function);
- ``Firewall``: the same logic per batch (``process``), also as a torch ``collate_fn``;
- ``ZScoreFilter``, ``MADFilter``, ``IsolationForestFilter``: streaming outlier filters;
- ``TFDataGuard`` (imports tensorflow on first access): graph-mode ``Dataset.filter`` /
  ``Dataset.map`` functions.

Importing this package imports NumPy but no deep-learning framework.
"""

from __future__ import annotations

from typing import Any

from numstab.data.check import BatchReport, FieldReport, check_batch, nonfinite_per_sample
from numstab.data.firewall import Firewall, GuardedIterable, guard, protect
from numstab.data.outliers import (
    IsolationForestFilter,
    MADFilter,
    OutlierFilter,
    ZScoreFilter,
    make_outlier_filter,
)
from numstab.data.stats import FirewallStats, SampleRecord

__all__ = [
    "BatchReport",
    "FieldReport",
    "Firewall",
    "FirewallStats",
    "GuardedIterable",
    "IsolationForestFilter",
    "MADFilter",
    "OutlierFilter",
    "SampleRecord",
    "TFDataGuard",
    "ZScoreFilter",
    "check_batch",
    "guard",
    "make_outlier_filter",
    "nonfinite_per_sample",
    "protect",
]


def __getattr__(name: str) -> Any:
    if name == "TFDataGuard":  # imports tensorflow: only when asked for
        from numstab import frameworks

        return frameworks.module("tensorflow", "data").TFDataGuard
    raise AttributeError(f"module 'numstab.data' has no attribute {name!r}")
