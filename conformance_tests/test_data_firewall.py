"""numstab.data on every backend: check_batch and per-sample non-finite counts against a
NumPy oracle; drop and replace keep the batch's framework, dtypes and the right samples."""

from __future__ import annotations

import numpy as np
import pytest

from numstab.data import Firewall, ZScoreFilter, check_batch, nonfinite_per_sample
from numstab.errors import InvalidArgumentError

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


# -- complex fields: checked, a complex element finite when both of its parts are -----------
Z = (RNG.normal(size=(N, 2)) + 1j * RNG.normal(size=(N, 2))).astype(np.complex64)
Z[1, 0] = complex(np.nan, 1.0)
Z[3, 1] = complex(2.0, -np.inf)
Z[4, 0] = complex(np.inf, np.nan)  # one NaN element (a part is NaN), as np.isnan says


def _complex_batch(h):
    return {"z": h.asarray(Z, "complex64"), "y": h.asarray(LABELS)}


def test_complex_fields_are_checked(eager_target):
    # before, a complex field was "exact": listed in skipped, its NaN passed every policy
    h = eager_target.h
    report = check_batch(_complex_batch(h))
    (field,) = report.fields
    assert (field.path, field.dtype, report.skipped) == ("['z']", "complex64", ("['y']",))
    assert (field.nan_count, field.inf_count) == (2, 1)
    assert field.bad_samples == report.bad_samples == (1, 3, 4)
    dropped = Firewall("drop").process(_complex_batch(h))
    np.testing.assert_array_equal(h.numpy(dropped["y"]), [0, 2, 5])
    np.testing.assert_array_equal(np.asarray(dropped["z"]), Z[[0, 2, 5]])
    fw = Firewall("replace", replace_value=-2.0)
    replaced = fw.process(_complex_batch(h))
    assert "complex64" in str(replaced["z"].dtype)
    # the whole element becomes replace_value (+0j); finite elements are untouched
    np.testing.assert_array_equal(np.asarray(replaced["z"]), np.where(np.isfinite(Z), Z, -2.0))
    assert fw.stats.replaced == (1, 3, 4) and fw.stats.replaced_values == 3
    # outlier features hold both parts: an imaginary part 1e3 sigmas out is an outlier
    normal = np.random.default_rng(5).normal(size=(2, 64, 2, 2)).astype(np.float32)
    warm, far = (x[..., 0] + 1j * x[..., 1] for x in normal)
    far[17, 1] = 1e3j
    fw = Firewall("drop", outliers=ZScoreFilter(threshold=8.0, warmup=64))
    fw.process({"z": h.asarray(warm, "complex64")})  # warm-up: learns, flags nothing
    out = fw.process({"z": h.asarray(far, "complex64")})
    np.testing.assert_array_equal(np.asarray(out["z"]), np.delete(far, 17, axis=0))


def test_complex_fields_per_sample(target):
    h = target.h
    (got,) = h.call_leaves(nonfinite_per_sample, target.compiled, _complex_batch(h))
    np.testing.assert_array_equal(got, (~np.isfinite(Z)).sum(axis=1))


def test_replace_value_must_be_finite_in_the_field_dtype(eager_target):
    # before, 1e5 became inf in a float16 field: the firewall put inf where NaN was
    h = eager_target.h
    fw = Firewall("replace", replace_value=1e5)
    clean = {"x": h.asarray(np.ones((N, 2)), "float16")}
    assert fw.process(clean) is clean  # nothing to replace: no error
    x = np.ones((N, 2))
    x[3, 1] = np.nan
    with pytest.raises(InvalidArgumentError, match=r"replace_value finite .*\['x'\] \(float16\)"):
        fw.process({"x": h.asarray(x, "float16"), "y": h.asarray(LABELS)})
    assert not fw.stats.records and fw.stats.replaced_values == 0
    out = fw.process({"x": h.asarray(x, "float32")})  # float32 holds 1e5
    np.testing.assert_array_equal(h.numpy(out["x"])[3], [1.0, 1e5])


def test_static_fields_count_against_every_sample(target):
    # check_batch blamed every sample for a NaN 0-d field; nonfinite_per_sample ignored it
    h = target.h
    batch = {"x": h.asarray(VALUES["a"], "float32"), "t": h.asarray(np.float32(np.nan))}
    (got,) = h.call_leaves(nonfinite_per_sample, target.compiled, batch)
    np.testing.assert_array_equal(got, sum(_oracle(VALUES["a"])) + 1)
    if not target.compiled:
        assert check_batch(batch).bad_samples == tuple(range(N))
