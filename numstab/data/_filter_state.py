"""``state_dict`` / ``load_state_dict`` of the streaming outlier filters (zscore, mad) and
of a ``Firewall`` (``firewall_state`` / ``load_firewall_state``).

A state is a plain dict: ``filter`` (the filter's name), ``settings`` (the constructor's
keyword arguments, so a state restores the rule it was learned under), ``num_features``
(None before the first batch), the integer counters and copies of the float64 arrays
(None before anything was learned). ``state_dict`` returns copies: later batches do not
change a saved state, and loading copies again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from numstab.errors import InvalidArgumentError


class StatefulFilter:
    """A mixin for a filter whose state is ``num_features``, the non-negative ints
    ``_counts`` (the first one is 0 exactly when nothing was learned) and the float64 arrays
    ``_arrays`` (None exactly then); ``_settings`` are its constructor's arguments and
    ``_state_shapes(d)`` / ``_count_limits()`` say what a consistent state holds."""

    name: str
    _settings: tuple[str, ...] = ()
    _counts: tuple[str, ...] = ()
    _arrays: tuple[str, ...] = ()

    def _state_shapes(self, d: int) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def _count_limits(self) -> dict[str, int]:
        """The largest value of each bounded counter (inclusive)."""
        return {}

    def state_dict(self) -> dict:
        """The filter's state as a dict of copies (module docstring)."""
        state: dict[str, Any] = {
            "filter": self.name,
            "settings": {k: getattr(self, k) for k in self._settings},
            "num_features": self.num_features,
        }
        state.update({k: int(getattr(self, k)) for k in self._counts})
        for k in self._arrays:
            value = getattr(self, k)
            state[k] = None if value is None else np.array(value, dtype=np.float64)
        return state

    def load_state_dict(self, state: Mapping) -> None:
        """Restore a ``state_dict`` (settings included). ``InvalidArgumentError`` naming
        ``state`` for a state of another filter, missing or unexpected keys, bad settings,
        counters or array shapes; the filter is then unchanged."""
        if not isinstance(state, Mapping) or state.get("filter") != self.name:
            found = state.get("filter") if isinstance(state, Mapping) else type(state).__name__
            raise InvalidArgumentError(
                f"Expected state to be a state_dict of a {self.name!r} filter. Received: "
                f"state of {found!r}"
            )
        keys = {"filter", "settings", "num_features", *self._counts, *self._arrays}
        if set(state) != keys:
            raise _bad(f"keys {sorted(map(str, state))}, expected {sorted(keys)}")
        settings = state["settings"]
        if not isinstance(settings, Mapping) or set(settings) != set(self._settings):
            raise _bad(f"settings {settings!r}, expected the keys {list(self._settings)}")
        fresh = type(self)(**settings)  # checks the settings as the constructor does
        d = state["num_features"]
        if d is not None and (isinstance(d, bool) or not isinstance(d, int | np.integer) or d < 1):
            raise _bad(f"num_features={d!r}, expected None or an int >= 1")
        fresh.num_features = None if d is None else int(d)
        _load_counts(fresh, state)
        learned = getattr(fresh, self._counts[0]) > 0
        shapes = fresh._state_shapes(d) if learned and d is not None else {}
        for k in self._arrays:
            setattr(fresh, k, _load_array(k, state[k], shapes.get(k), learned, d))
        self.__dict__.update(fresh.__dict__)


def _load_counts(fresh: Any, state: Mapping) -> None:
    limits = fresh._count_limits()
    for k in fresh._counts:
        value = _count(k, state[k])
        if k in limits and value > limits[k]:
            raise _bad(f"{k}={value!r}, expected at most {limits[k]}")
        setattr(fresh, k, value)


def _load_array(key: str, value: Any, shape: Any, learned: bool, d: Any) -> Any:
    """A copy of ``value`` as float64 of ``shape``; None when nothing was learned."""
    if not learned:
        if value is not None:
            raise _bad(f"{key} set while nothing was learned (expected None)")
        return None
    if d is None:
        raise _bad("num_features=None with learned statistics")
    array = np.asarray(value) if value is not None else None
    if array is None or array.dtype.kind not in "biuf" or array.shape != shape:
        what = None if array is None else f"{array.dtype} of shape {array.shape}"
        raise _bad(f"{key}: {what}, expected float64 of shape {shape}")
    return np.array(array, dtype=np.float64)


def _bad(what: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"Expected a consistent filter state. Received: state with {what}")


#: FirewallStats' integer totals, saved and restored by ``firewall_state``
_TOTALS = (
    "samples_seen",
    "batches_seen",
    "samples_passed",
    "batches_skipped",
    "epochs",
    "nan_values",
    "inf_values",
    "replaced_values",
)


def firewall_state(firewall: Any) -> dict:
    """``Firewall.state_dict``: the stats (totals, records as dicts, quarantine files), the
    epoch counters and the outlier filter's state (None without a filter); copies."""
    from dataclasses import asdict

    stats = firewall.stats
    outliers = firewall.outliers
    if outliers is not None and not isinstance(outliers, StatefulFilter):
        raise InvalidArgumentError(
            f"Expected an outlier filter with a state_dict (zscore, mad) to save the "
            f"firewall's state. Received: the {outliers.name!r} filter"
        )
    return {
        "stats": {k: getattr(stats, k) for k in _TOTALS},
        "records": [asdict(r) for r in stats.records],
        "quarantine_files": list(stats.quarantine_files),
        "epoch": firewall._epoch,
        "epoch_start": firewall._epoch_start,
        "outliers": None if outliers is None else outliers.state_dict(),
    }


def load_firewall_state(firewall: Any, state: Mapping) -> None:
    """``Firewall.load_state_dict``: everything checked before anything changes
    (``InvalidArgumentError`` naming ``state``; the firewall is then unchanged)."""
    from numstab.data.stats import FirewallStats, SampleRecord

    keys = {"stats", "records", "quarantine_files", "epoch", "epoch_start", "outliers"}
    if not isinstance(state, Mapping) or set(state) != keys:
        got = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
        raise _bad(f"keys {got}, expected the keys of Firewall.state_dict {sorted(keys)}")
    totals = state["stats"]
    if not isinstance(totals, Mapping) or set(totals) != set(_TOTALS):
        raise _bad(f"stats {totals!r}, expected the keys {list(_TOTALS)}")
    stats = FirewallStats()
    for k in _TOTALS:
        setattr(stats, k, _count(k, totals[k]))
    try:
        records = state["records"]
        stats.records = [SampleRecord(**{**r, "fields": tuple(r["fields"])}) for r in records]
    except (TypeError, KeyError) as exc:
        raise _bad(f"records that are not SampleRecord dicts ({exc})") from None
    stats.quarantine_files = [str(p) for p in state["quarantine_files"]]
    epoch, start = _count("epoch", state["epoch"]), _count("epoch_start", state["epoch_start"])
    if start > stats.batches_seen:
        raise _bad(f"epoch_start={start} > batches_seen={stats.batches_seen}")
    saved, outliers = state["outliers"], firewall.outliers
    if (saved is None) != (outliers is None):
        raise _bad(f"outliers {'None' if saved is None else 'set'}, unlike this firewall's")
    if outliers is not None:
        if not isinstance(outliers, StatefulFilter):
            raise _bad(f"outliers for the {outliers.name!r} filter, which has no state_dict")
        outliers.load_state_dict(saved)  # checked; unchanged on error
    firewall.stats, firewall._epoch, firewall._epoch_start = stats, epoch, start


def _count(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise _bad(f"{key}={value!r}, expected an int >= 0")
    return int(value)
