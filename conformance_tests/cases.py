"""Fixed adversarial inputs for the loss tests, as float64 NumPy data plus keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

FP16_MAX = 65504.0


@dataclass(frozen=True)
class Case:
    name: str
    logits: np.ndarray
    labels: np.ndarray
    kwargs: dict = field(default_factory=dict)
    weight: np.ndarray | None = None


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _masked(seed: int = 1) -> np.ndarray:
    x = _rng(seed).normal(0, 3, (6, 9))
    x[0, [1, 4]] = -np.inf
    x[2, 0:5] = -np.inf
    x[5, :-1] = -np.inf  # only the last class is allowed
    return x


def _soft(seed: int, shape) -> np.ndarray:
    t = _rng(seed).uniform(0, 1, shape)
    return t / t.sum(-1, keepdims=True)


def build_cases() -> list[Case]:
    r = _rng(0)
    masked_labels = np.array([0, 3, 6, 8, 2, 8])
    weight = r.uniform(0.2, 2.0, 9)
    soft_masked = _soft(5, (6, 9))
    soft_masked[np.isneginf(_masked())] = 0.0
    soft_masked /= soft_masked.sum(-1, keepdims=True)
    near_max = r.uniform(-FP16_MAX, FP16_MAX, (4, 7)).round()
    return [
        Case("plain", r.normal(0, 2, (5, 11)), r.integers(0, 11, 5)),
        Case("smoothing", r.normal(0, 2, (5, 11)), r.integers(0, 11, 5), {"label_smoothing": 0.1}),
        Case("masked_smoothing", _masked(), masked_labels, {"label_smoothing": 0.2}),
        Case(
            "weight_ignore_smoothing_z",
            _masked(),
            np.array([0, -100, 6, 8, -100, 8]),
            {"label_smoothing": 0.15, "z_loss": 1e-3},
            weight,
        ),
        Case(
            "negative_ignore_index",
            r.normal(0, 2, (4, 6)),
            np.array([1, -1, 5, -1]),
            {"ignore_index": -1, "label_smoothing": 0.1},
            r.uniform(0.5, 1.5, 6),
        ),
        Case("near_fp16_max", near_max, np.array([0, 3, 6, 2]), {"label_smoothing": 0.1}),
        Case("all_ignored", r.normal(0, 1, (3, 5)), np.full(3, -100), {"label_smoothing": 0.1}),
        Case("one_class", r.normal(0, 1, (4, 1)), np.zeros(4, int), {"label_smoothing": 0.3}),
        Case("empty_batch", np.zeros((0, 5)), np.zeros(0, int)),
        Case(
            "class_axis_1",
            r.normal(0, 2, (3, 5, 4)),
            r.integers(0, 5, (3, 4)),
            {"axis": 1, "label_smoothing": 0.1, "z_loss": 1e-2},
        ),
        Case(
            "probabilities",
            r.normal(0, 2, (4, 6)),
            _soft(3, (4, 6)),
            {"label_smoothing": 0.1, "z_loss": 1e-3},
            r.uniform(0.5, 1.5, 6),
        ),
        Case("probabilities_masked", _masked(), soft_masked, {"label_smoothing": 0.2}),
        Case(
            "large_vocab_zeros",
            np.zeros((2, 100_000)),
            np.array([0, 99_999]),
            {"label_smoothing": 0.1},
        ),
    ]


def build_nonfinite_cases() -> list[Case]:
    """Rows whose loss is +inf or NaN by contract; values only, no gradients."""
    x = _rng(7).normal(0, 1, (4, 5))
    x[0, 2] = -np.inf  # target on a masked class
    x[1, :] = -np.inf  # an all--inf row
    x[2, 1] = np.nan  # NaN propagates
    x[3, 4] = np.inf  # inf - inf: undefined, NaN
    soft = _soft(8, (4, 5))
    return [
        Case("nonfinite_rows", x, np.array([2, 0, 3, 1]), {"label_smoothing": 0.1}),
        Case("mass_on_masked_class", x, soft),
    ]


CASES = build_cases()
NONFINITE_CASES = build_nonfinite_cases()


def _finfo(dtype: str):
    import ml_dtypes  # finfo for bfloat16 too; ships with jax and tensorflow

    return ml_dtypes.finfo(dtype)


def magnitude_offsets(dtype: str) -> list[float]:
    """Common logit offsets up to half the largest finite value of ``dtype``: 1e4 and 1e6
    (where ``dtype`` holds them) and +-max/2, both signs."""
    big = float(_finfo(dtype).max)
    return [s * o for o in (1e4, 1e6, big / 2) if o <= big / 2 for s in (1.0, -1.0)]


def build_magnitude_cases(dtype: str, offset: float) -> list[Case]:
    """Logits at ``offset`` with a spread of at least 16 ulps of ``dtype`` there (so the
    classes stay distinct after rounding), -inf masks beside them, and every label kind:
    hard, smoothed (the all-classes and the masked kernels), ignored rows, probabilities.
    z-loss only where lse**2 fits in float32."""
    info = _finfo(dtype)
    ulp = 2.0 ** np.floor(np.log2(abs(offset))) * float(info.eps)
    spread = max(3.0, 16 * ulp)
    r = _rng(int(abs(np.log2(abs(offset)))) + (offset < 0))
    x = offset + r.normal(0, spread, (6, 7))
    masked = x.copy()
    masked[0, [1, 4]] = -np.inf
    masked[3, :5] = -np.inf
    labels = r.integers(0, 7, 6)
    labels[[0, 3]] = [0, 6]  # on valid classes
    ignored = labels.copy()
    ignored[2] = -100
    soft = _soft(int(abs(offset)) % 1000, (6, 7))
    soft[np.isneginf(masked)] = 0.0
    soft /= soft.sum(-1, keepdims=True)
    z = {"z_loss": 1e-4} if abs(offset) <= 1e6 else {}
    return [
        Case("uniform", np.full((3, 4), offset), np.array([0, 1, 3])),
        Case(
            "uniform_smoothed", np.full((2, 2), offset), np.array([0, 1]), {"label_smoothing": 0.1}
        ),
        Case("hard", x, labels, z),
        Case("smoothed", x, ignored, {"label_smoothing": 0.1, **z}),
        Case("masked_smoothed", masked, labels, {"label_smoothing": 0.2}),
        Case("weighted", masked, ignored, {"label_smoothing": 0.1}, r.uniform(0.5, 2, 7)),
        Case("probabilities", masked, soft, {"label_smoothing": 0.1, **z}),
    ]


#: (ignore_index, labels dtype): no label can equal it (JAX's labels are int32, the others'
#: int64), so nothing is ignored (cross_entropy and fused_linear_cross_entropy). Each failed
#: on some backend with an overflow error (the fused loss eagerly too)
UNMATCHABLE_IGNORE_INDEX = [
    (2**31, "int32"),
    (2**63, "int64"),
    (-(2**70), "int32"),
    (2**70, "int64"),
]
