"""numstab.data: non-finite outlier features and rejected batches, on every installed backend.

- A sample whose outlier features are not all finite (an ``outlier_fields`` callable taking
  the log of a negative value) is an outlier, never learned: one NaN made a filter's
  statistics NaN and blind for good (docs/semantics.md §17.5).
- What an ``outlier_fields`` callable returns is checked: a string, None or objects raised
  NumPy's ValueError / IndexError / TypeError (§17.6).
- A rejected call leaves the firewall as it was (§2.1): stats, the filter's state, records and
  the later global indices. A torch batch was counted before ``replace_value`` was checked.
"""

from __future__ import annotations

import copy
import importlib.util

import numpy as np
import pytest

from numstab.data import Firewall, IsolationForestFilter, MADFilter, ZScoreFilter
from numstab.errors import InvalidArgumentError

BACKENDS = ["numpy"] + [b for b in ("torch", "tensorflow", "jax") if importlib.util.find_spec(b)]
HAS_SKLEARN = importlib.util.find_spec("sklearn") is not None


def _to(backend: str, x: np.ndarray | dict):
    """``x`` as an array of ``backend`` (same dtype); a dict of them item by item."""
    if isinstance(x, dict):
        return {k: _to(backend, v) for k, v in x.items()}
    if backend == "torch":
        import torch

        return torch.from_numpy(x.copy())
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.constant(x)
    if backend == "jax":
        import jax.numpy as jnp

        return jnp.asarray(x)
    return x


def _log_first_column(backend: str):
    """An ``outlier_fields`` callable in the batch's own framework: ``log(x[:, :1])``
    (NaN for a negative value, -inf for 0), returned as that framework's tensor."""
    if backend == "torch":
        import torch

        return lambda b: torch.log(b[:, :1])
    if backend == "tensorflow":
        import tensorflow as tf

        return lambda b: tf.math.log(b[:, :1])
    if backend == "jax":
        import jax.numpy as jnp

        return lambda b: jnp.log(b[:, :1])

    def log(b):
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.log(b[:, :1])

    return log


def _positive(n: int, seed: int = 0) -> np.ndarray:
    return (np.abs(np.random.default_rng(seed).normal(size=(n, 2))) + 1.0).astype(np.float32)


# -- finding 1: non-finite outlier features ------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_callable_features_are_outliers_and_never_learned(backend):
    fw = Firewall(
        "drop", outliers=ZScoreFilter(warmup=4), outlier_fields=_log_first_column(backend)
    )
    warm = _positive(8)
    warm[3, 0], warm[5, 0] = -1.0, 0.0  # log: NaN, -inf (in the warm-up)
    out = fw.process(_to(backend, warm))
    assert np.asarray(out).shape == (6, 2)
    assert fw.stats.outliers == (3, 5) and fw.stats.dropped == (3, 5)
    assert {r.reason for r in fw.stats.records} == {"outlier"}
    learned = np.log(np.delete(warm, [3, 5], axis=0)[:, :1].astype(np.float64))
    assert fw.outliers.count == 6
    np.testing.assert_allclose(fw.outliers.mean, learned.mean(axis=0), rtol=1e-6)
    far = _positive(8, seed=1)
    far[2, 0] = 1e30  # log 69: far out; before, the NaN mean passed it
    far[6, 0] = -2.0
    fw.process(_to(backend, far))
    assert fw.stats.outliers == (3, 5, 10, 14)
    assert np.isfinite(fw.outliers.mean).all() and np.isfinite(fw.outliers.m2).all()


FILTERS = {
    "zscore": lambda: ZScoreFilter(warmup=4),
    "mad": lambda: MADFilter(window=8, warmup=4),
}
if HAS_SKLEARN:
    FILTERS["isolation_forest"] = lambda: IsolationForestFilter(warmup=4, n_estimators=5)


def _learned(f) -> np.ndarray:
    """The statistics (or samples) a filter learned, as one float64 vector."""
    if isinstance(f, ZScoreFilter):
        return np.concatenate([[f.count], f.mean, f.m2])
    if isinstance(f, MADFilter):
        return f.buffer[: f.filled].ravel()
    return np.concatenate([f.low, f.high])


@pytest.mark.parametrize("make", FILTERS.values(), ids=FILTERS.keys())
def test_a_filter_flags_nonfinite_rows_and_learns_only_the_finite_ones(make):
    f, ref = make(), make()
    x = np.array([[np.nan, 1.0], [1.0, 2.0], [2.0, np.inf], [3.0, 1.0], [2.0, 2.0], [1.5, 1.0]])
    np.testing.assert_array_equal(f(x), [True, False, True, False, False, False])
    ref(x[[1, 3, 4, 5]])
    np.testing.assert_array_equal(_learned(f), _learned(ref))
    # after the warm-up too: flagged, not learned (sklearn's predict raised on NaN)
    before = _learned(f).copy()
    flags = f(np.array([[-np.inf, 1.0], [np.nan, np.nan]]))
    np.testing.assert_array_equal(flags, [True, True])
    np.testing.assert_array_equal(_learned(f), before)


@pytest.mark.parametrize(
    "features",
    ["abc", [[1.0], [1.0, 2.0]], np.ones((3, 1)) * 1j, [object()]],
    ids=["str", "ragged", "complex", "objects"],
)
def test_a_filter_refuses_features_that_are_not_real_numbers(features):
    # before: NumPy's ValueError / TypeError, and a complex value lost its imaginary part
    f = ZScoreFilter(warmup=2)
    with pytest.raises(InvalidArgumentError, match="Expected outlier features"):
        f(features)
    assert f.count == 0 and f.num_features is None


def test_screen_changes_nothing_until_learn():
    f = ZScoreFilter(warmup=2)
    flags, learn = f.screen(np.array([[1.0], [2.0], [np.nan]]))
    assert flags.tolist() == [False, False, True] and f.count == 0 and f.num_features is None
    learn()
    assert f.count == 2 and f.num_features == 1 and f.mean.tolist() == [1.5]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "returned",
    ["abc", None, [object()] * 4, 3.0, np.ones((3, 1)), [[1.0], [1.0, 2.0]], np.ones((4, 0))],
    ids=["str", "None", "objects", "scalar", "rows", "ragged", "no-feature"],
)
def test_bad_outlier_fields_results_raise_invalid_argument(backend, returned):
    fw = Firewall("drop", outliers=ZScoreFilter(warmup=2), outlier_fields=lambda b: returned)
    with pytest.raises(InvalidArgumentError, match=r"outlier_fields to return .*Received: "):
        fw.process(_to(backend, _positive(4)))
    assert fw.stats.samples_seen == fw.stats.batches_seen == 0
    assert fw.outliers.count == 0 and fw.outliers.num_features is None


def test_complex_callable_features_hold_both_parts():
    # before, NumPy dropped the imaginary part (ComplexWarning): an outlier there passed
    fw = Firewall("drop", outliers=ZScoreFilter(threshold=6.0, warmup=8), outlier_fields=np.asarray)
    z = np.random.default_rng(2).normal(size=(2, 16, 2)) @ np.array([1.0, 1j])
    fw.process(z[0])
    far = z[1].copy()
    far[4] += 1e3j
    assert len(fw.process(far)) == 15 and fw.stats.outliers == (20,)
    assert fw.outliers.num_features == 2


# -- finding 2: a rejected batch leaves the firewall as it was -------------------------------
def _snapshot(fw: Firewall) -> tuple:
    f = fw.outliers
    state = None if f is None else {k: copy.deepcopy(v) for k, v in vars(f).items()}
    return copy.deepcopy(vars(fw.stats)), repr(state)


def _float16_nan_batch() -> np.ndarray:
    b = np.ones((4, 2), np.float16)
    b[1, 1] = np.nan
    return b


def _features_change():
    fw = Firewall("drop", outliers=ZScoreFilter(warmup=2))
    return fw, _positive(4), np.ones((4, 3), np.float32)


def _replace_1e5():
    # nested: past the flat short way, whose check came first already (NumPy only)
    return Firewall("replace", replace_value=1e5), None, {"a": {"x": _float16_nan_batch()}}


def _replace_1e5_after_learning():
    fw = Firewall("replace", replace_value=1e5, outliers=ZScoreFilter(warmup=2))
    return fw, np.ones((4, 2), np.float16), _float16_nan_batch()


def _wrong_rows():
    fw = Firewall("drop", outliers=ZScoreFilter(warmup=2), outlier_fields=lambda b: np.ones((3, 1)))
    return fw, None, _positive(4)


def _unknown_path():
    fw = Firewall("drop", outliers=ZScoreFilter(warmup=2), outlier_fields=["['nope']"])
    return fw, None, _positive(4)


REJECTIONS = {
    "replace_value": _replace_1e5,
    "replace_value-outliers": _replace_1e5_after_learning,
    "feature-count": _features_change,
    "rows": _wrong_rows,
    "unknown-path": _unknown_path,
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", REJECTIONS)
def test_a_rejected_batch_leaves_stats_filter_and_indices(backend, kind):
    fw, first, rejected = REJECTIONS[kind]()
    if first is not None:
        fw.process(_to(backend, first))
    before = _snapshot(fw)
    with pytest.raises(InvalidArgumentError):
        fw.process(_to(backend, rejected))
    assert _snapshot(fw) == before
    # the next batch keeps its global indices: its sample 1 is the stream's next + 1
    seen, batches = fw.stats.samples_seen, fw.stats.batches_seen
    ok = np.ones((4, 2 if first is None else first.shape[1]), np.float32)
    ok[1, 0] = np.nan
    fw.policy, fw.outlier_fields = "drop", None
    fw.process(_to(backend, ok))
    assert fw.stats.nonfinite[-1] == seen + 1 and fw.stats.batches_seen == batches + 1


def test_a_rejected_ragged_batch_under_quarantine_is_not_counted(tmp_path):
    tf = pytest.importorskip("tensorflow")
    fw = Firewall("drop", quarantine_dir=tmp_path)
    ragged = tf.ragged.constant([[1.0], [np.nan, 2.0], [3.0, 4.0, 5.0]])
    before = _snapshot(fw)
    with pytest.raises(InvalidArgumentError, match="fixed-size samples"):
        fw.process({"r": ragged})
    assert _snapshot(fw) == before and not list(tmp_path.iterdir())


@pytest.mark.parametrize("make", FILTERS.values(), ids=FILTERS.keys())
def test_a_feature_too_large_to_learn_is_an_outlier(make):
    """A finite feature past ``learnable`` (1e200 for the float64 statistics: its squared
    deviation overflowed, m2 and std became inf and nothing was flagged again; 1e39 for
    scikit-learn's float32) is flagged and not learned, and the filter still flags later."""
    f, ref = make(), make()
    huge = 1e200 if f.learnable > 1e100 else 1e39
    x = np.array([[1.0, 2.0], [huge, 1.0], [3.0, 1.0], [2.0, 2.0], [1.5, 1.0], [-huge, 0.0]])
    np.testing.assert_array_equal(f(x), [False, True, False, False, False, True])
    ref(x[[0, 2, 3, 4]])
    np.testing.assert_array_equal(_learned(f), _learned(ref))
    assert np.isfinite(_learned(f)).all()
    np.testing.assert_array_equal(f(np.array([[2.0, 1.5], [1e6, 1.0]])), [False, True])
