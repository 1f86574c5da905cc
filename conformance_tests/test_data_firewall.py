"""numstab.data on every backend: check_batch and per-sample non-finite counts against a
NumPy oracle; drop and replace keep the batch's framework, dtypes and the right samples."""

from __future__ import annotations

import numpy as np

from numstab.data import Firewall, check_batch, nonfinite_per_sample

RNG = np.random.default_rng(11)
N = 6
VALUES = {
    "a": RNG.normal(size=(N, 3)),
    "b": RNG.normal(size=(N, 2, 2)),
    "c": RNG.normal(size=(N,)),
}
DTYPES = {"a": "float32", "b": "float16", "c": "bfloat16"}
for key, sample, index, value in [
    ("a", 1, (2,), np.nan),
    ("a", 4, (0,), np.inf),
    ("b", 4, (1, 1), -np.inf),
    ("b", 5, (0, 0), np.nan),
    ("c", 0, (), np.nan),
    ("c", 5, (), np.inf),
]:
    VALUES[key][(sample, *index)] = value
LABELS = np.arange(N, dtype=np.int64)


def _batch(h):
    """A nested batch: a list holds floats of three dtypes and integer labels."""
    return [
        {"a": h.asarray(VALUES["a"], "float32")},
        (h.asarray(VALUES["b"], "float16"), h.asarray(VALUES["c"], "bfloat16")),
        h.asarray(LABELS),
    ]


def _oracle(values):
    flat = values.reshape(N, -1)
    return np.isnan(flat).sum(1), np.isinf(flat).sum(1)


def test_check_batch(eager_target):
    h = eager_target.h
    report = check_batch(_batch(h))
    assert [f.path for f in report.fields] == ["[0]['a']", "[1][0]", "[1][1]"]
    assert report.skipped == ("[2]",) and report.batch_size == N
    for field, key in zip(report.fields, DTYPES, strict=True):
        nan, inf = _oracle(VALUES[key])
        assert field.dtype == DTYPES[key]
        assert (field.nan_count, field.inf_count) == (nan.sum(), inf.sum())
        assert field.bad_samples == tuple(np.flatnonzero(nan + inf))
    assert report.bad_samples == (0, 1, 4, 5)
    clean = check_batch({"x": h.asarray(np.ones((N, 2)), "float32"), "y": h.asarray(LABELS)})
    assert clean.ok and clean.fields[0].bad_samples == ()


def test_nonfinite_per_sample(target):
    """Graph-safe: eager and under jax.jit / tf.function / torch.compile."""
    h = target.h
    (got,) = h.call_leaves(nonfinite_per_sample, target.compiled, _batch(h))
    want = sum(sum(_oracle(VALUES[k])) for k in VALUES)
    np.testing.assert_array_equal(got, want)


def test_drop_and_replace_keep_framework_and_dtypes(eager_target):
    h = eager_target.h
    batch = _batch(h)
    dropped = Firewall("drop").process(batch)
    keep = np.array([2, 3])
    assert type(dropped[0]["a"]) is type(batch[0]["a"])
    np.testing.assert_array_equal(h.numpy(dropped[2]), LABELS[keep])
    np.testing.assert_array_equal(h.numpy(dropped[1][0]), h.numpy(batch[1][0])[keep])
    fw = Firewall("replace", replace_value=-2.0)
    replaced = fw.process(batch)
    for got, orig in [(replaced[0]["a"], batch[0]["a"]), (replaced[1][1], batch[1][1])]:
        seen = h.numpy(orig)
        np.testing.assert_array_equal(h.numpy(got), np.where(np.isfinite(seen), seen, -2.0))
        assert str(got.dtype) == str(orig.dtype)
    assert fw.stats.replaced == (0, 1, 4, 5) and fw.stats.replaced_values == 6


def test_clean_batches_pass_untouched_even_when_their_sum_overflows(eager_target):
    """The fast path hands a clean batch on as the same object; a finite batch whose float32
    sum overflows (3e38 + 3e38) is sent the long way and still passes whole."""
    h = eager_target.h
    fw = Firewall("raise")
    clean = {"x": h.asarray(np.ones((N, 2)), "float32"), "y": h.asarray(LABELS)}
    assert fw.process(clean) is clean
    big = {"x": h.asarray(np.full((N, 2), 3e38), "float32"), "y": h.asarray(LABELS)}
    assert fw.process(big) is big
    assert fw.stats.samples_seen == fw.stats.samples_passed == 2 * N and not fw.stats.records
