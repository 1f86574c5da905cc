"""Streaming outlier filters over per-sample feature vectors (host NumPy, float64).

A filter is called once per batch with the ``(n, d)`` features of the batch's finite samples
and returns a boolean vector: True marks an outlier. It learns only from the samples it
accepts, so an outlier cannot inflate the statistics that should catch the next one. During
its warm-up a filter flags nothing and learns from every sample. A sample with a NaN or inf
feature (features computed by a callable, ``log`` of a negative value) is always an outlier,
in the warm-up too, and is never learned: one such sample would make the statistics NaN
and blind the filter for good.

``screen(features)`` splits a call in two: the flags, computed without touching the state,
and a function that learns from the accepted samples. ``Firewall.process`` learns only once
every check of the batch has passed, so a rejected batch leaves the filter as it was.

A sample is an outlier when ANY of its features is: ``max_j |z_j| > threshold``. By default
the threshold is a per-sample budget, ``false_positive_rate=DEFAULT_FALSE_POSITIVE_RATE``
(5e-4): the per-feature threshold is Bonferroni-corrected for ``d`` (``bonferroni_threshold``:
3.48 at d=1, 4.00 at d=8, 4.47 at d=64, 5.24 at d=3072), so a clean Gaussian sample is
flagged at most 0.05% of the time whatever ``d`` is. An explicit ``threshold`` is a fixed
per-feature threshold instead: on clean Gaussian data one feature exceeds 3 sigma with
probability 0.27%, and the "any feature" rule makes that ``1 - (1 - p) ** d`` per sample
(18% at d=64 for 3 sigma).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist
from typing import Any

import numpy as np

from numstab import _validate as v
from numstab.data._filter_state import StatefulFilter
from numstab.errors import BackendUnavailableError, InvalidArgumentError

MAD_SCALE = 0.6745  # Phi^-1(3/4): MAD / 0.6745 estimates sigma for Gaussian data
#: the per-sample false-positive budget of a filter given neither ``threshold`` nor
#: ``false_positive_rate``: measured 0.04% to 0.07% per clean Gaussian sample at d = 1, 8, 64
#: (the statistics are estimates), under issue 20's 0.1%
DEFAULT_FALSE_POSITIVE_RATE = 5e-4


class OutlierFilter:
    """Base class: ``__call__(features) -> outlier flags``; ``reset()`` forgets the state."""

    name = "abstract"
    #: the largest feature magnitude learned, 2**492 (~1.3e148): float64 statistics then sum
    #: squared deviations (each at most (2 * 2**492)**2) over 2**38 samples without overflow.
    #: A larger one (finite) made ``m2`` and ``std`` inf, and the filter flagged nothing ever
    #: after: such a sample is an outlier, as a NaN one is.
    learnable = 2.0**492

    def _init_threshold(self, threshold: Any, false_positive_rate: Any) -> None:
        """At most one of a per-feature ``threshold`` (> 0) or a per-sample
        ``false_positive_rate`` (in (0, 1)); neither: the rate
        ``DEFAULT_FALSE_POSITIVE_RATE``. The unused one is stored as None."""
        if threshold is not None and false_positive_rate is not None:
            raise InvalidArgumentError(
                f"Expected threshold or false_positive_rate, not both. Received: "
                f"threshold={threshold!r}, false_positive_rate={false_positive_rate!r}"
            )
        if threshold is not None:
            threshold = v.check_number("threshold", threshold, low=0.0, low_open=True)
        else:
            if false_positive_rate is None:
                false_positive_rate = DEFAULT_FALSE_POSITIVE_RATE
            false_positive_rate = v.check_number(
                "false_positive_rate",
                false_positive_rate,
                low=0.0,
                high=1.0,
                low_open=True,
                high_open=True,
            )
        self.threshold = threshold
        self.false_positive_rate = false_positive_rate

    def feature_threshold(self, d: int) -> float:
        """The per-feature threshold for ``d`` features: ``threshold``, or
        ``bonferroni_threshold(false_positive_rate, d)``."""
        if self.false_positive_rate is None:
            return self.threshold
        return bonferroni_threshold(self.false_positive_rate, d)

    def __call__(self, features: Any) -> np.ndarray:
        """Flags (True: outlier) for the ``(n, d)`` ``features``, then learns from the
        accepted samples (``screen`` followed by its ``learn``)."""
        flags, learn = self.screen(features)
        learn()
        return flags

    def screen(self, features: Any) -> tuple[np.ndarray, Callable[[], None]]:
        """``(flags, learn)``: the outlier flags of ``features`` without any change of state,
        and a function that learns from the accepted samples (and fixes ``num_features``).

        A sample whose features are not all finite, or past ``learnable`` in magnitude, is
        flagged, warm-up or not, and never learned. ``InvalidArgumentError`` (state
        untouched) for features that are not ``(n, d)`` or whose ``d`` differs from earlier
        batches."""
        x = self._check(features)
        with np.errstate(invalid="ignore"):  # NaN compares False: not learnable
            finite = (np.abs(x) <= self.learnable).all(axis=1)
        if finite.all():
            flags = self._flags(x) if len(x) else np.zeros(0, dtype=bool)
        else:  # never handed to _flags: NaN compares False, so it would pass
            flags = np.ones(len(x), dtype=bool)
            flags[finite] = self._flags(x[finite]) if finite.any() else False
        accepted = x[~flags]

        def learn() -> None:
            self.num_features = x.shape[1]
            if len(accepted):
                self._learn(accepted)

        return flags, learn

    def _check(self, features: Any) -> np.ndarray:
        """``features`` as an ``(n, d)`` float64 matrix (a vector is one feature); no state
        is changed."""
        try:
            array = np.asarray(features)
        except (TypeError, ValueError) as exc:  # a ragged list
            raise InvalidArgumentError(
                f"Expected outlier features: an (n, d) array of real numbers. Received: "
                f"{type(features).__name__} ({exc})"
            ) from None
        if not is_real_dtype(array.dtype):  # a complex value would lose its imaginary part
            raise InvalidArgumentError(
                f"Expected outlier features: an (n, d) array of real numbers. Received: "
                f"features of dtype {array.dtype}"
            )
        features = array.astype(np.float64, copy=False)
        if features.ndim == 1:
            features = features[:, None]
        if features.ndim != 2:
            raise InvalidArgumentError(
                f"Expected outlier features of shape (samples, features). "
                f"Received: features.shape={features.shape}"
            )
        d = getattr(self, "num_features", None)
        if d is not None and features.shape[1] != d:
            raise InvalidArgumentError(
                f"Expected {d} features per sample, as in earlier batches. "
                f"Received: features.shape={features.shape}. A field whose size varies "
                "between batches (dynamic padding) cannot be a feature: pass "
                "outlier_fields= the fixed-size fields, or a callable returning a fixed "
                "number of features per sample"
            )
        return features

    def _flags(self, x: np.ndarray) -> np.ndarray:
        """The outlier flags of the finite ``(n, d)`` samples ``x`` (n >= 1); no state change."""
        raise NotImplementedError

    def _learn(self, x: np.ndarray) -> None:
        """Learn from the accepted finite samples ``x`` (n >= 1)."""
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError


def is_real_dtype(dtype: np.dtype) -> bool:
    """Bool, integer or floating (ml_dtypes' bfloat16 and float8 too): values a float64
    feature holds without loss of meaning; not complex, str, object or dates."""
    name = str(dtype)
    return dtype.kind in "biuf" or v.is_floating(name) or v.is_narrow_float(name)


def _robust_ratio(deviation: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """|deviation| / scale, with 0/0 = 0 and x/0 = inf: a constant feature flags any change."""
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.abs(deviation) / scale
    return np.where(deviation == 0, 0.0, z)


class ZScoreFilter(StatefulFilter, OutlierFilter):
    """``|x - mean| / std > t`` per feature, over running (Welford) statistics; ``t`` is
    ``threshold`` if given, else set from ``false_positive_rate`` (default 5e-4 per sample)
    and ``d`` (``feature_threshold``).

    State (float64, per feature): ``count``, ``mean``, ``m2`` (sum of squared deviations);
    ``std = sqrt(m2 / (count - 1))``. Batches are merged with Chan et al.'s parallel form of
    Welford's update (exact, no catastrophic cancellation). Warm-up: until ``warmup`` samples
    were seen, nothing is flagged and every sample is learned (whole batches).
    """

    name = "zscore"
    _settings = ("threshold", "false_positive_rate", "warmup")
    _counts = ("count",)
    _arrays = ("mean", "m2")

    def __init__(
        self,
        threshold: float | None = None,
        warmup: int = 256,
        *,
        false_positive_rate: float | None = None,
    ) -> None:
        self._init_threshold(threshold, false_positive_rate)
        self.warmup = _check_count("warmup", warmup, low=2)
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.mean: np.ndarray | None = None
        self.m2: np.ndarray | None = None
        self.num_features: int | None = None

    def feature_threshold(self, d: int) -> float:
        """In rate mode, ``t / truncated_std_ratio(t)``: the statistics are learned from
        accepted samples only, so ``std`` is that of a Gaussian truncated at ``t``."""
        t = super().feature_threshold(d)
        return t if self.false_positive_rate is None else t / truncated_std_ratio(t)

    @property
    def std(self) -> np.ndarray | None:
        return None if self.mean is None else np.sqrt(self.m2 / max(self.count - 1, 1))

    def _flags(self, x: np.ndarray) -> np.ndarray:
        if self.count < self.warmup:
            return np.zeros(len(x), dtype=bool)
        z = _robust_ratio(x - self.mean, self.std)
        return (z > self.feature_threshold(x.shape[1])).any(axis=1)

    def _learn(self, x: np.ndarray) -> None:
        n = len(x)
        mean = x.mean(axis=0)
        m2 = ((x - mean) ** 2).sum(axis=0)
        if self.mean is None:
            self.count, self.mean, self.m2 = n, mean, m2
            return
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta**2 * (self.count * n / total)
        self.count = total

    def _state_shapes(self, d: int) -> dict:
        return {"mean": (d,), "m2": (d,)}


class MADFilter(StatefulFilter, OutlierFilter):
    """Robust z-score ``0.6745 * |x - median| / MAD > t`` per feature (Iglewicz and
    Hoaglin's modified z-score), ``MAD = median(|x - median|)``; ``t`` is ``threshold`` if
    given, else ``bonferroni_threshold(false_positive_rate, d)`` (rate default 5e-4).

    State: ``buffer``, the last ``window`` accepted samples (a ring, oldest replaced first);
    median and MAD are recomputed from it before each batch. Warm-up: until ``warmup``
    samples are buffered nothing is flagged and every sample is buffered.
    """

    name = "mad"
    _settings = ("threshold", "false_positive_rate", "window", "warmup")
    _counts = ("filled", "next")
    _arrays = ("buffer",)

    def __init__(
        self,
        threshold: float | None = None,
        window: int = 4096,
        warmup: int = 1024,
        *,
        false_positive_rate: float | None = None,
    ) -> None:
        self._init_threshold(threshold, false_positive_rate)
        self.window = _check_count("window", window, low=2)
        self.warmup = _check_count("warmup", warmup, low=2)
        if self.warmup > self.window:
            raise InvalidArgumentError(
                f"Expected warmup <= window. Received: warmup={warmup}, window={window}"
            )
        self.reset()

    def reset(self) -> None:
        self.buffer: np.ndarray | None = None
        self.filled = 0  # samples in the buffer
        self.next = 0  # ring position of the next write
        self.num_features: int | None = None

    def median_and_mad(self) -> tuple[np.ndarray, np.ndarray]:
        data = self.buffer[: self.filled]
        median = np.median(data, axis=0)
        return median, np.median(np.abs(data - median), axis=0)

    def _flags(self, x: np.ndarray) -> np.ndarray:
        if self.filled < self.warmup:
            return np.zeros(len(x), dtype=bool)
        median, mad = self.median_and_mad()
        z = MAD_SCALE * _robust_ratio(x - median, mad)
        return (z > self.feature_threshold(x.shape[1])).any(axis=1)

    def _learn(self, x: np.ndarray) -> None:
        if self.buffer is None:
            self.buffer = np.zeros((self.window, x.shape[1]))  # zeros: a reproducible state
        x = x[-self.window :]  # a batch larger than the window keeps its tail
        self.buffer[(self.next + np.arange(len(x))) % self.window] = x
        self.next = (self.next + len(x)) % self.window
        self.filled = min(self.filled + len(x), self.window)

    def _state_shapes(self, d: int) -> dict:
        return {"buffer": (self.window, d)}

    def _count_limits(self) -> dict[str, int]:
        return {"filled": self.window, "next": self.window - 1}


class IsolationForestFilter(OutlierFilter):
    """scikit-learn's ``IsolationForest`` fitted once on the first ``warmup`` samples.

    State: ``model`` (None until fitted), ``low`` and ``high`` (per-feature min and max of the
    warm-up window) and the warm-up buffer. After the fit, a sample is an outlier when
    ``model.predict`` says -1 (its score is below the ``contamination`` quantile of the
    warm-up scores) or when a feature lies beyond the warm-up range by more than
    ``extrapolation_margin`` times that range. The second rule exists because an isolation
    tree only splits between values it was fitted on: every point past the warm-up maximum
    lands in the same leaf as that maximum, so a 10-sigma sample scores like a 4-sigma one
    (measured: recall 0.5 on one Gaussian feature without the rule). ``None`` disables it.
    Needs the extra ``numstab[outliers]``.
    """

    learnable = float(np.finfo(np.float32).max)  # scikit-learn reads float32: beyond is inf

    name = "isolation_forest"

    def __init__(
        self,
        warmup: int = 4096,
        *,
        contamination: float = 1e-4,
        n_estimators: int = 100,
        extrapolation_margin: float | None = 0.5,
        random_state: int | None = 0,
    ) -> None:
        self.warmup = _check_count("warmup", warmup, low=2)
        self.contamination = v.check_number(
            "contamination", contamination, low=0.0, high=0.5, low_open=True
        )
        self.n_estimators = _check_count("n_estimators", n_estimators, low=1)
        if extrapolation_margin is not None:
            extrapolation_margin = v.check_number(
                "extrapolation_margin", extrapolation_margin, low=0.0
            )
        self.extrapolation_margin = extrapolation_margin
        self.random_state = random_state
        self._estimator_class = _isolation_forest_class()
        self.reset()

    def reset(self) -> None:
        self.model = None
        self.low: np.ndarray | None = None
        self.high: np.ndarray | None = None
        self._pending: list[np.ndarray] = []
        self._pending_count = 0
        self.num_features: int | None = None

    def _flags(self, x: np.ndarray) -> np.ndarray:
        if self.model is None:
            return np.zeros(len(x), dtype=bool)
        flags = self.model.predict(x) == -1
        if self.extrapolation_margin is not None:
            slack = self.extrapolation_margin * (self.high - self.low)
            flags |= ((x < self.low - slack) | (x > self.high + slack)).any(axis=1)
        return flags

    def _learn(self, x: np.ndarray) -> None:
        """Warm-up only: buffer the samples, fit once ``warmup`` were buffered."""
        if self.model is not None:
            return
        self._pending.append(x)
        self._pending_count += len(x)
        if self._pending_count >= self.warmup:
            self._fit(np.concatenate(self._pending))

    def _fit(self, data: np.ndarray) -> None:
        self.low, self.high = data.min(axis=0), data.max(axis=0)
        self.model = self._estimator_class(
            n_estimators=self.n_estimators,
            contamination=self.contamination,
            random_state=self.random_state,
        ).fit(data)
        self._pending, self._pending_count = [], 0


def _isolation_forest_class():
    try:
        from sklearn.ensemble import IsolationForest
    except ImportError as exc:
        raise BackendUnavailableError(
            f"numstab.data's 'isolation_forest' filter needs scikit-learn, which could not "
            f"be imported ({exc}). Install it with: pip install 'numstab[outliers]'"
        ) from exc
    return IsolationForest


def _check_count(name: str, value: Any, low: int) -> int:
    value = v.check_int(name, value)
    if value < low:
        raise InvalidArgumentError(f"Expected {name} >= {low}. Received: {name}={value}")
    return value


FILTERS = {f.name: f for f in (ZScoreFilter, MADFilter, IsolationForestFilter)}


def make_outlier_filter(spec: Any) -> OutlierFilter | None:
    """None, a filter object (used as is, its state shared), or a name creating a default:
    ``"zscore"``, ``"mad"``, ``"isolation_forest"``."""
    if spec is None or isinstance(spec, OutlierFilter):
        return spec
    if isinstance(spec, str) and spec in FILTERS:
        return FILTERS[spec]()
    names = ", ".join(repr(n) for n in FILTERS)
    raise InvalidArgumentError(
        f"Expected outliers to be None, one of {names}, or an OutlierFilter. "
        f"Received: outliers={spec!r}"
    )


def truncated_std_ratio(t: float) -> float:
    """std of a standard Gaussian truncated to ``|z| <= t``:
    ``sqrt(1 - 2 t phi(t) / erf(t / sqrt 2))`` (0.9941 at t = 3.29, 0.99997 at t = 4.5)."""
    return math.sqrt(1.0 - 2.0 * t * NormalDist().pdf(t) / math.erf(t / math.sqrt(2.0)))


def bonferroni_threshold(false_positive_rate: float, d: int) -> float:
    """Per-feature threshold ``Phi^-1(1 - rate / (2 d))``: each of ``d`` features gets
    ``rate / d`` of the two-sided Gaussian tail, so by the union bound a clean Gaussian sample
    is flagged with probability at most ``rate`` (``1 - (1 - rate/d) ** d``, independent
    features). For example rate 1e-3: 3.29 at d=1, 3.84 at d=8, 4.35 at d=64."""
    return NormalDist().inv_cdf(1.0 - false_positive_rate / (2.0 * d))
