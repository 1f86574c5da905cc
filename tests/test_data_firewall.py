"""numstab.data: check_batch, protect (drop / replace / raise), quarantine, outlier filters.

Backend conformance of check_batch and the per-sample counts is in
conformance_tests/test_data_firewall.py; these tests cover the loaders and policies.
"""

from __future__ import annotations

import collections
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from numstab.data import (
    Firewall,
    IsolationForestFilter,
    MADFilter,
    ZScoreFilter,
    check_batch,
    nonfinite_per_sample,
    protect,
)
from numstab.data.outliers import bonferroni_threshold, truncated_std_ratio
from numstab.errors import (
    BackendMismatchError,
    BackendUnavailableError,
    InvalidArgumentError,
    MixedBackendsError,
    NonFiniteError,
    OutlierError,
)

N, D, B = 1000, 6, 64
BAD = {7: np.nan, 64: np.inf, 65: -np.inf, 400: np.nan, 999: np.inf}  # global index -> value


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, D)).astype(np.float32)
    for i, value in BAD.items():
        x[i, i % D] = value
    return x, np.arange(N)


def _batches(x, y, size=B):
    for start in range(0, len(x), size):
        yield {"x": x[start : start + size], "y": y[start : start + size]}


def _oracle(batch_x):
    """Per-sample NaN and inf counts of a (n, ...) array, in plain NumPy."""
    flat = np.asarray(batch_x, dtype=np.float64).reshape(len(batch_x), -1)
    return np.isnan(flat).sum(1), np.isinf(flat).sum(1)


# -- check_batch ----------------------------------------------------------------------------
def test_check_batch_nested_counts_paths_and_skips():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(5, 3)).astype(np.float32)
    b = rng.normal(size=(5, 2, 2))
    c = rng.normal(size=(5,)).astype(np.float16)
    a[1, 2], a[3, 0], b[3, 1, 1], b[4, 0, 0], c[0] = np.nan, np.inf, -np.inf, np.nan, np.inf
    batch = {
        "a": a,
        "nested": (b, [c, np.arange(5)]),
        "mask": np.ones(5, bool),
        "name": ["s0", "s1", "s2", "s3", "s4"],
    }
    report = check_batch(batch)
    assert report.batch_size == 5 and not report.ok and not report
    assert [f.path for f in report.fields] == ["['a']", "['nested'][0]", "['nested'][1][0]"]
    assert report.skipped == ("['nested'][1][1]", "['mask']", "['name']")
    for field, values in zip(report.fields, (a, b, c), strict=True):
        nan, inf = _oracle(values)
        assert (field.nan_count, field.inf_count) == (nan.sum(), inf.sum())
        assert field.bad_samples == tuple(np.flatnonzero(nan + inf))
        assert field.dtype == values.dtype.name and field.shape == values.shape
    assert report.bad_samples == (0, 1, 3, 4)
    assert (report.nan_count, report.inf_count) == (2, 3)
    assert "['nested'][0] (float64[5, 2, 2]): 1 NaN, 1 inf in samples [3, 4]" in str(report)
    np.testing.assert_array_equal(nonfinite_per_sample(batch), [1, 1, 0, 2, 1])


def test_check_batch_clean_batch_axis_and_static_fields():
    x = np.zeros((3, 4, 2), np.float32)
    x[1, 2, 0] = np.nan  # sample 2 along batch_axis=1
    report = check_batch((x,), batch_axis=1)
    assert report.batch_size == 4 and report.bad_samples == (2,)
    clean = check_batch({"x": np.ones((4, 2)), "lr": np.float32(0.1)})
    assert clean.ok and bool(clean) and clean.nan_count == 0
    static = check_batch({"x": np.ones((4, 2)), "scale": np.array(np.nan)})
    assert static.bad_samples == (0, 1, 2, 3)  # no batch axis: blames every sample


def test_check_batch_errors():
    with pytest.raises(InvalidArgumentError, match=r"4 samples .*\['y'\] with 3"):
        check_batch({"x": np.ones((4, 2)), "y": np.ones(3)})
    with pytest.raises(InvalidArgumentError, match="batch_axis"):
        check_batch(np.ones(3), batch_axis=True)
    with pytest.raises(InvalidArgumentError, match="batch_axis >= 0"):
        check_batch(np.ones(3), batch_axis=-1)
    torch = pytest.importorskip("torch")
    with pytest.raises(BackendMismatchError):
        check_batch({"x": torch.ones(2)}, backend="numpy")


def test_fields_of_two_frameworks_are_each_checked_in_their_own():
    """check_batch raised MixedBackendsError for a batch that Firewall.process handled field
    by field; both read each field in its framework now, and agree (backend= still asserts)."""
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    x = np.ones((4, 3), np.float32)
    x[1, 2] = np.nan
    y = np.ones((4, 2), np.float32)
    y[3, 0] = np.inf
    batch = {"x": torch.tensor(x), "y": jnp.asarray(y), "ids": np.arange(4)}
    report = check_batch(batch)
    assert (report.nan_count, report.inf_count, report.bad_samples) == (1, 1, (1, 3))
    kept = Firewall("drop").process(batch)
    assert [len(kept[k]) for k in ("x", "y", "ids")] == [2, 2, 2]
    assert np.asarray(kept["ids"]).tolist() == [0, 2]
    with pytest.raises(MixedBackendsError):
        check_batch(batch, backend="torch")


# -- protect: policies over a Python iterator -------------------------------------------------
def test_drop_removes_only_bad_samples_and_records_global_indices():
    x, y = _data()
    loader = protect(_batches(x, y), "drop")
    out = list(loader)
    good = np.setdiff1d(np.arange(N), list(BAD))
    np.testing.assert_array_equal(np.concatenate([b["y"] for b in out]), good)
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in out]), x[good])
    stats = loader.stats
    assert stats.dropped == tuple(sorted(BAD)) and stats.replaced == ()
    assert (stats.samples_seen, stats.samples_passed, stats.batches_seen) == (N, N - 5, 16)
    assert (stats.nan_values, stats.inf_values) == (2, 3)
    rec = {r.index: r for r in stats.records}
    assert (rec[65].batch, rec[65].position, rec[65].epoch) == (1, 1, 0)
    assert rec[65].fields == ("['x']",) and (rec[65].nan_count, rec[65].inf_count) == (0, 1)
    assert stats.field_counts() == {"['x']": 5}
    json.dumps(stats.summary())
    assert len(stats.to_json_lines().splitlines()) == 5


def test_clean_batches_pass_as_the_same_object():
    x, y = _data()
    batches = list(_batches(x, y))
    out = list(protect(batches, "drop"))
    assert out[2] is batches[2]  # fast path: untouched
    assert out[0] is not batches[0] and len(out[0]["y"]) == B - 1


def test_fast_and_general_paths_agree():
    """A namedtuple batch takes the general path; dict batches the fast one."""
    Pair = collections.namedtuple("Pair", "x y")
    x, y = _data()
    chunks = list(zip(x.reshape(-1, 8, D), y.reshape(-1, 8), strict=True))
    via_tuple = protect([Pair(bx, by) for bx, by in chunks])
    via_dict = protect([{"x": bx, "y": by} for bx, by in chunks])
    out_t, out_d = list(via_tuple), list(via_dict)
    assert [type(b) for b in out_t] == [Pair] * len(out_t)
    np.testing.assert_array_equal(
        np.concatenate([b.y for b in out_t]), np.concatenate([b["y"] for b in out_d])
    )
    assert via_tuple.stats.dropped == via_dict.stats.dropped == tuple(sorted(BAD))


def test_replace_sets_only_nonfinite_values():
    x, y = _data()
    loader = protect(_batches(x, y), "replace", replace_value=-7.0)
    got = np.concatenate([b["x"] for b in loader])
    np.testing.assert_array_equal(got, np.where(np.isfinite(x), x, np.float32(-7.0)))
    assert got.dtype == np.float32
    assert loader.stats.replaced == tuple(sorted(BAD)) and loader.stats.dropped == ()
    assert loader.stats.replaced_values == 5 and loader.stats.samples_passed == N


def test_raise_names_field_and_global_index():
    x, y = _data()
    loader = protect(_batches(x, y), "raise")
    with pytest.raises(NonFiniteError, match=r"sample 7 .*batch 0, position 7.*\['x'\]") as err:
        list(loader)
    assert err.value.paths == ("['x']",) and err.value.nan_count == 1
    assert err.value.phase == "data" and loader.stats.records[0].action == "raised"


def test_all_dropped_batch_is_skipped_or_kept_empty():
    x = np.full((4, 2), np.nan, np.float32)
    loader = protect([{"x": x}, {"x": np.ones((4, 2), np.float32)}])
    assert [len(b["x"]) for b in loader] == [4]
    assert loader.stats.batches_skipped == 1
    kept = list(protect([{"x": x, "s": ["a", "b", "c", "d"]}], keep_empty=True))
    assert kept[0]["x"].shape == (0, 2) and kept[0]["s"] == []


def test_string_fields_are_dropped_alongside():
    x = np.ones((3, 2), np.float32)
    x[1, 0] = np.nan
    (out,) = list(protect([{"x": x, "name": ("a", "b", "c")}]))
    assert out["name"] == ("a", "c") and out["x"].shape == (2, 2)


def test_epochs_restart_batch_numbers_and_continue_indices():
    x, y = _data()
    batches = list(_batches(x, y))
    loader = protect(batches)
    list(loader)
    list(loader)
    assert loader.stats.epochs == 2 and loader.stats.samples_seen == 2 * N
    second = [r for r in loader.stats.records if r.epoch == 1]
    assert [r.index for r in second] == [N + i for i in sorted(BAD)]
    assert second[0].batch == 0


def test_argument_errors():
    with pytest.raises(InvalidArgumentError, match="policy to be one of"):
        protect([], "skip")
    with pytest.raises(InvalidArgumentError, match="replace_value"):
        protect([], "replace", replace_value=float("nan"))
    with pytest.raises(InvalidArgumentError, match="outlier_policy"):
        protect([], outliers="zscore", outlier_policy="replace")
    with pytest.raises(InvalidArgumentError, match="outliers to be None"):
        protect([], outliers="iforest")
    with pytest.raises(InvalidArgumentError, match="iterable of batches"):
        protect(5)
    with pytest.raises(InvalidArgumentError, match="no batched field"):
        list(protect([np.float32(np.nan)]))
    with pytest.raises(InvalidArgumentError, match="outlier_fields"):
        protect([], outliers="zscore", outlier_fields="['x']")
    with pytest.raises(InvalidArgumentError, match="threshold"):
        ZScoreFilter(threshold=0)
    with pytest.raises(InvalidArgumentError, match="warmup >= 2"):
        ZScoreFilter(warmup=1)
    with pytest.raises(InvalidArgumentError, match="warmup <= window"):
        MADFilter(window=10, warmup=20)
    with pytest.raises(InvalidArgumentError, match="contamination"):
        IsolationForestFilter(contamination=0.0)


# -- quarantine ---------------------------------------------------------------------------
def test_quarantine_files_load_without_pickle(tmp_path):
    x, y = _data()
    batches = [{**b, "id": [f"s{i}" for i in b["y"]]} for b in _batches(x, y)]
    loader = protect(batches, "drop", quarantine_dir=tmp_path / "q")
    list(loader)
    files = loader.stats.quarantine_files
    assert len(files) == 4  # batches 0, 1, 6 and 15 hold bad samples
    indices = []
    for path in files:
        with np.load(path, allow_pickle=False) as f:
            paths = list(f["paths"])
            assert paths == ["['x']", "['y']", "['id']"]
            np.testing.assert_array_equal(f["field_0"], x[f["index"]])
            np.testing.assert_array_equal(f["field_1"], f["index"])
            assert list(f["field_2"]) == [f"s{i}" for i in f["index"]]
            assert set(f["reason"]) == {"nonfinite"}
            indices += list(f["index"])
    assert indices == sorted(BAD)
    assert not [p for p in (tmp_path / "q").iterdir() if p.name.startswith(".tmp")]


def test_quarantine_destination_is_checked_up_front(tmp_path):
    x, y = _data()
    # a bytes path is a path (os.path.join of bytes and the str file name raised TypeError)
    loader = protect(_batches(x, y), "drop", quarantine_dir=bytes(tmp_path / "b"))
    list(loader)
    assert len(list((tmp_path / "b").iterdir())) == 4
    # a prefix with a separator wrote outside quarantine_dir; an int became a folder "5"; an
    # existing file raised FileExistsError at the first dirty batch
    (tmp_path / "file").write_text("")
    for bad in (
        dict(quarantine_dir=tmp_path / "q", quarantine_prefix="../escaped"),
        dict(quarantine_dir=tmp_path / "q", quarantine_prefix=""),
        dict(quarantine_dir=5),
        dict(quarantine_dir=tmp_path / "file"),
    ):
        with pytest.raises(InvalidArgumentError, match="quarantine_"):
            protect(_batches(x, y), "drop", **bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "file"]


# -- torch ------------------------------------------------------------------------------
def test_torch_dataloader_wrapper_and_collate_fn(monkeypatch):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    x, y = _data()
    dataset = TensorDataset(torch.from_numpy(x).to(torch.bfloat16), torch.from_numpy(y))
    loader = protect(DataLoader(dataset, batch_size=B), "drop")
    assert len(loader) == 16
    out = list(loader)
    assert isinstance(out[0][0], torch.Tensor) and out[0][0].dtype == torch.bfloat16
    good = np.setdiff1d(np.arange(N), list(BAD))
    np.testing.assert_array_equal(torch.cat([b[1] for b in out]).numpy(), good)
    assert loader.stats.dropped == tuple(sorted(BAD))

    fw = Firewall("replace", replace_value=2.0)
    replaced = list(DataLoader(dataset, batch_size=B, collate_fn=fw.collate_fn()))
    got = torch.cat([b[0] for b in replaced]).float().numpy()
    want = np.where(np.isfinite(x), torch.from_numpy(x).bfloat16().float().numpy(), 2.0)
    np.testing.assert_array_equal(got, want)
    assert fw.stats.replaced == tuple(sorted(BAD))

    import torch.utils.data as tud

    monkeypatch.setattr(tud, "get_worker_info", lambda: object())
    with pytest.raises(InvalidArgumentError, match="num_workers=0"):
        Firewall().collate_fn()([dataset[0], dataset[1]])


# -- tf.data ---------------------------------------------------------------------------------
def test_tf_data_guard_and_graph_mode_functions():
    tf = pytest.importorskip("tensorflow")
    from numstab.data import TFDataGuard

    x, y = (a[:130] for a in _data())  # bad samples 7, 64, 65
    n, bad = 130, (7, 64, 65)
    good = np.setdiff1d(np.arange(n), bad)
    ds = tf.data.Dataset.from_tensor_slices({"x": x, "y": y})

    loader = protect(ds.batch(B), "drop")  # eager iteration, global indices recorded
    out = list(loader)
    assert isinstance(out[0]["x"], tf.Tensor)
    np.testing.assert_array_equal(np.concatenate([b["y"].numpy() for b in out]), good)
    assert loader.stats.dropped == bad

    traced_eagerly = []

    def spy(fn):
        def wrapped(*element):
            traced_eagerly.append(tf.executing_eagerly())
            return fn(*element)

        return wrapped

    g = TFDataGuard()
    kept = [int(e["y"]) for e in ds.filter(spy(g.is_finite))]
    assert kept == list(good) and g.stats()["samples_flagged"] == 3
    # a sample's fields need not agree on any axis: x (D,), a label (1,), a one-hot (3,)
    # (their first axes were read as a batch axis: "Expected every field to hold D samples")
    g = TFDataGuard()
    labels = (y[:, None].astype(np.float32), np.eye(3, dtype=np.float32)[y % 3])
    pairs = tf.data.Dataset.from_tensor_slices((x, labels)).filter(spy(g.is_finite))
    assert [int(e[1][0][0]) for e in pairs] == list(good) and g.stats()["samples_seen"] == n

    g = TFDataGuard()
    batches = list(ds.batch(B).map(spy(g.drop_nonfinite)))
    np.testing.assert_array_equal(np.concatenate([b["y"].numpy() for b in batches]), good)
    assert g.stats() == {"samples_seen": n, "samples_flagged": 3, "values_replaced": 0}

    g = TFDataGuard(replace_value=3.0)
    pairs = tf.data.Dataset.from_tensor_slices((x, y)).batch(B).map(spy(g.replace_nonfinite))
    got = np.concatenate([bx.numpy() for bx, _ in pairs])
    np.testing.assert_array_equal(got, np.where(np.isfinite(x), x, np.float32(3.0)))
    assert g.stats()["values_replaced"] == 3 and g.stats()["samples_flagged"] == 3
    assert traced_eagerly and not any(traced_eagerly)  # graph mode: no py_function


def test_tf_data_guard_checks_complex_fields_in_graph_mode():
    """TensorFlow's ``is_finite`` has no complex kernel: before, a complex field failed to
    trace in ``TFDataGuard`` (and was passed unchecked by ``protect``)."""
    tf = pytest.importorskip("tensorflow")
    from numstab.data import TFDataGuard

    z = np.ones((8, 3), np.complex64)
    z[2, 1], z[5, 0] = complex(np.nan, 0.0), complex(0.0, -np.inf)
    ds = tf.data.Dataset.from_tensor_slices({"z": z, "y": np.arange(8)})
    g = TFDataGuard()
    assert [int(e["y"]) for e in ds.filter(g.is_finite)] == [0, 1, 3, 4, 6, 7]
    (batch,) = ds.batch(8).map(TFDataGuard().drop_nonfinite)
    np.testing.assert_array_equal(batch["y"].numpy(), [0, 1, 3, 4, 6, 7])
    g = TFDataGuard(replace_value=3.0)
    (batch,) = ds.batch(8).map(g.replace_nonfinite)
    np.testing.assert_array_equal(batch["z"].numpy(), np.where(np.isfinite(z), z, 3.0))
    assert g.stats()["values_replaced"] == 2 and g.stats()["samples_flagged"] == 2
    with pytest.raises(InvalidArgumentError, match=r"replace_value finite .*\(float16\)"):
        ds.map(lambda e: {**e, "z": tf.cast(tf.math.real(e["z"]), tf.float16)}).map(
            TFDataGuard(replace_value=1e5).replace_nonfinite
        )  # refused when traced: 1e5 is inf in float16


def test_torch_loader_with_a_complex_field():
    torch = pytest.importorskip("torch")
    z = torch.ones(12, 2, dtype=torch.complex64)
    z[7, 1] = complex(float("nan"), 1.0)
    dataset = torch.utils.data.TensorDataset(z, torch.arange(12))
    loader = protect(torch.utils.data.DataLoader(dataset, batch_size=4), "drop")
    ids = torch.cat([y for _, y in loader])
    assert 7 not in ids.tolist() and len(ids) == 11 and loader.stats.dropped == (7,)


def test_tf_data_drop_nonfinite_other_axes_unbatched_fields_and_parallel_maps():
    """``drop_nonfinite`` along ``batch_axis=1``, over a 3-d field (any non-finite entry in a
    sample's slice drops it), an integer field, a non-batched float field (clean: nothing is
    dropped for it; non-finite: every sample is), in a parallel map whose counters add up."""
    tf = pytest.importorskip("tensorflow")
    from numstab.data import TFDataGuard

    rng = np.random.default_rng(3)
    n_batches, b = 6, 16
    x = rng.standard_normal((n_batches, 2, b, 3), dtype=np.float32)  # batch axis 1 of 2, b, 3
    x[0, 1, 4, 2] = np.nan
    x[3, 0, 0, 0] = np.inf
    x[3, 1, 15, 1] = -np.inf
    labels = np.arange(n_batches * b).reshape(n_batches, 1, b)  # batch axis 1 of 1, b
    scale = np.ones(n_batches, np.float32)
    scale[5] = np.nan  # the whole batch 5 goes
    bad = ~np.isfinite(x).all(axis=(1, 3)) | ~np.isfinite(scale)[:, None]

    g = TFDataGuard(batch_axis=1)
    ds = tf.data.Dataset.from_tensor_slices({"x": x, "y": labels, "scale": scale})
    out = list(ds.map(g.drop_nonfinite, num_parallel_calls=4, deterministic=True))
    for k, batch in enumerate(out):
        keep = ~bad[k]
        np.testing.assert_array_equal(batch["x"].numpy(), x[k][:, keep])
        np.testing.assert_array_equal(batch["y"].numpy(), labels[k][:, keep])
        assert batch["scale"].numpy() == scale[k] or k == 5
    assert g.stats() == {
        "samples_seen": n_batches * b,
        "samples_flagged": int(bad.sum()),
        "values_replaced": 0,
    }
    assert int(bad.sum()) == 3 + b


# -- fast path: host memory read in place ----------------------------------------------------
def _spy_host_views(monkeypatch):
    """Record the arrays the fast path reads with NumPy."""
    from numstab.data import _fast

    seen, host = [], _fast._host

    def spy(a, axis, sizes):
        seen.append(a)
        return host(a, axis, sizes)

    monkeypatch.setattr(_fast, "_host", spy)
    return seen


def _drop_check(make, x, y):
    """Clean batches come back as the same object; a NaN/inf sample is dropped."""
    fw = Firewall("drop")
    clean = make(np.nan_to_num(x[:B], posinf=0.0, neginf=0.0), y[:B])
    assert fw.process(clean) is clean
    out = fw.process(make(x[B : 2 * B], y[B : 2 * B]))  # samples 64 (inf) and 65 (-inf)
    assert fw.stats.dropped == (64, 65)
    return out


def test_fast_path_torch_tensors_keep_the_fused_sum(monkeypatch):
    """torch CPU tensors (contiguous or not, float32, bfloat16, requiring grad) are proved
    clean by the torch sum, not a NumPy read; a NaN/inf sample is still dropped."""
    torch = pytest.importorskip("torch")

    x, y = _data()
    seen = _spy_host_views(monkeypatch)
    make = lambda bx, by: (torch.from_numpy(bx), torch.from_numpy(by))
    out = _drop_check(make, x, y)
    np.testing.assert_array_equal(out[1].numpy(), [i for i in range(B, 2 * B) if i not in BAD])

    def strided(bx, by):  # same values, transposed storage
        t = torch.from_numpy(np.ascontiguousarray(bx.T)).T
        assert not t.is_contiguous()
        return t, torch.from_numpy(by)

    out = _drop_check(strided, x, y)
    np.testing.assert_array_equal(out[0].numpy(), np.delete(x[B : 2 * B], [0, 1], axis=0))

    for t in (torch.from_numpy(x[:4]).bfloat16(), torch.from_numpy(x[:4]).requires_grad_()):
        bad = t.detach().clone()
        bad[2, 0] = float("nan")
        bad.requires_grad_(t.requires_grad)
        fw = Firewall("drop")
        clean = (t, torch.arange(4))
        assert fw.process(clean) is clean and fw.stats.samples_passed == 4
        out = fw.process((bad, torch.arange(4)))
        assert out[0].dtype == t.dtype and out[0].requires_grad == t.requires_grad
        assert out[1].tolist() == [0, 1, 3] and fw.stats.dropped == (6,)
    assert seen == []  # no NumPy read of a torch tensor


def test_fast_path_reads_cpu_tf_eager_tensors_in_place(monkeypatch):
    tf = pytest.importorskip("tensorflow")
    from numstab.backends import load_backend
    from numstab.data._fast import _tf_eager
    from numstab.data._host import _on_host, tf_view

    x, y = _data()
    seen = _spy_host_views(monkeypatch)
    be = load_backend("tensorflow")
    sums = []
    sum_ = be.sum
    monkeypatch.setattr(be, "sum", lambda *a, **k: sums.append(1) or sum_(*a, **k))

    make = lambda bx, by: {"x": tf.constant(bx), "y": tf.constant(by)}
    clean = make(x[:4], y[:4])
    assert Firewall().process(clean) is clean and sums == []  # no TF op for a clean batch
    assert [a.dtype.kind for a in seen] == ["f"] and not seen[0].flags.owndata
    # a dirty batch is counted from the fast path's read of the view (no TF reduction) and
    # dropped by one gather per field (eager tf.boolean_mask cost ~3 ms: ~10 Python-level ops)
    gathers = []
    gather = tf.gather
    monkeypatch.setattr(tf, "gather", lambda *a, **k: gathers.append(1) or gather(*a, **k))
    monkeypatch.setattr(tf, "boolean_mask", None)
    out = _drop_check(make, x, y)
    assert sums == [] and len(gathers) == 2
    assert isinstance(out["x"], tf.Tensor) and out["y"].dtype == tf.int64
    np.testing.assert_array_equal(out["x"].numpy(), np.delete(x[B : 2 * B], [0, 1], axis=0))
    np.testing.assert_array_equal(out["y"].numpy(), np.delete(y[B : 2 * B], [0, 1]))
    monkeypatch.undo()
    seen = _spy_host_views(monkeypatch)
    monkeypatch.setattr(be, "sum", lambda *a, **k: sums.append(1) or sum_(*a, **k))
    t = tf.constant(x[:4])
    assert np.shares_memory(tf_view(t), np.asarray(t))  # a view of the tensor's buffer

    # bfloat16 (no NumPy dtype) keeps the on-device sum, and still finds the NaN
    seen.clear()
    make16 = lambda bx, by: {"x": tf.cast(tf.constant(bx), tf.bfloat16), "y": by}
    clean = make16(x[:4], y[:4])
    assert Firewall().process(clean) is clean and sums
    assert not [a for a in seen if a.dtype.kind == "f"]  # the NumPy labels may be read inline
    out = _drop_check(make16, x, y)
    assert out["x"].dtype == tf.bfloat16
    for other in (tf.constant(["a", "b"]), tf.Variable(x[:4]), tf.constant(x[:4], tf.bfloat16)):
        assert not _tf_eager(other, 0, [])  # strings, variables, bfloat16: the backend path
    assert _on_host("/job:localhost/replica:0/task:0/device:CPU:0")
    assert not _on_host("/job:localhost/replica:0/task:0/device:GPU:0")
    assert not _on_host("/job:worker/replica:0/task:0/device:TPU:0")

    # a tensor off the host (faked: no GPU here) is summed on its device, never read here
    from numstab.data import _host

    monkeypatch.setattr(_host, "_on_host", lambda device: False)
    seen.clear()
    sums.clear()
    clean = make(x[:4], y[:4])
    assert Firewall().process(clean) is clean and sums and seen == []
    _drop_check(make, x, y)


# -- NumPy arrays: per-sample sums, exact counts on the suspects ----------------------------
def _summed_batch(dtype=np.float32, shape=(40, 3, 32, 32)):
    """A batch big enough for the per-sample sums (_host.SUM_MIN_SIZE), with every kind of
    trouble: finite values whose sum overflows, NaN, +inf, -inf, inf + -inf (sum NaN)."""
    x = np.random.default_rng(5).normal(size=shape).astype(dtype)
    big = np.finfo(dtype).max / 4
    x[2] = big  # finite, but its sum overflows: clean
    x[3] = -big
    x[5, 0, 0, 0] = np.nan
    x[7, 1, 2, 3] = np.inf
    x[8, 2, 15, 15] = -np.inf
    x[9, 0, 0, 0], x[9, 2, 1, 1] = np.inf, -np.inf
    x[11] = big  # overflow and a NaN in one sample
    x[11, 1, 1, 1] = np.nan
    x[12, :, 0, 0] = np.nan  # several per sample
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "axis1"])
def test_numpy_counts_match_the_oracle(dtype, layout):
    from numstab.data import _host

    x = _summed_batch(dtype)
    axis = 0
    if layout == "strided":  # same values, non-contiguous
        x = np.asfortranarray(x)
    elif layout == "axis1":  # samples along axis 1 of a C-contiguous array
        x, axis = np.ascontiguousarray(np.swapaxes(x, 0, 1)), 1
    summed = _host._rows(x, axis) is not None
    assert summed == (dtype != np.float16 and layout != "strided")
    nan, inf = _oracle(np.moveaxis(x, axis, 0))
    report = check_batch({"x": x, "y": np.arange(40)}, batch_axis=axis)
    (field,) = report.fields
    assert field.bad_samples == (5, 7, 8, 9, 11, 12) == tuple(np.flatnonzero(nan + inf))
    assert (field.nan_count, field.inf_count) == (nan.sum(), inf.sum()) == (5, 4)
    np.testing.assert_array_equal(field.per_sample[0], nan + inf)
    np.testing.assert_array_equal(field.per_sample[1], nan)
    fw = Firewall("drop", batch_axis=axis)
    out = fw.process({"x": x, "y": np.arange(40)})
    assert fw.stats.dropped == (5, 7, 8, 9, 11, 12)
    rec = {r.position: (r.nan_count, r.inf_count) for r in fw.stats.records}
    assert rec == {5: (1, 0), 7: (0, 1), 8: (0, 1), 9: (0, 2), 11: (1, 0), 12: (3, 0)}
    np.testing.assert_array_equal(out["x"], np.delete(x, list(rec), axis=axis))


def test_overflowing_finite_batch_passes_as_clean():
    """A finite sample whose per-sample sum overflows (values 3e38) is a suspect checked
    exactly, never dropped; the batch passes as the same object."""
    from numstab.data import _fast, _host

    x = np.full((8, 3, 64, 64), 3e38, np.float32)
    with np.errstate(over="ignore"):
        assert _host._rows(x, 0) is not None and not np.isfinite(x.sum(axis=(1, 2, 3))).any()
    batch = {"x": x, "y": np.arange(8)}
    fw = Firewall("drop")
    assert fw.process(batch) is batch and fw.stats.samples_passed == 8
    assert _fast.clean_batch_size(batch, 0) == 8
    assert check_batch(batch).ok
    for value in (np.nan, np.inf, -np.inf):
        bad = x.copy()
        bad[6, 2, 63, 63] = value
        assert _fast.clean_batch_size({"x": bad}, 0) == _fast.SUSPECT
        assert check_batch({"x": bad}).bad_samples == (6,)


@pytest.mark.parametrize(
    "x",
    [
        np.array([1.0, np.nan, 2.0, np.inf, -np.inf], np.float64),  # rank 1
        np.arange(5 * 70000, dtype=np.float32).reshape(5, -1),  # summed, wide rows
        np.ones((70000, 2), np.float32),  # big but narrow rows: isfinite
    ],
    ids=["rank1", "wide", "narrow"],
)
def test_numpy_fast_and_general_paths_agree_on_shapes(x):
    x = x.copy()
    if x.ndim == 2:
        x[1, -1], x[3, 0], x[4, 1] = np.nan, np.inf, -np.inf
    pair = collections.namedtuple("Pair", "x")  # the general path only
    via_dict, via_tuple = Firewall("drop"), Firewall("drop")
    out_d, out_t = via_dict.process({"x": x}), via_tuple.process(pair(x))
    np.testing.assert_array_equal(out_d["x"], out_t.x)
    counts = lambda fw: [(r.index, r.action, r.nan_count, r.inf_count) for r in fw.stats.records]
    assert (
        counts(via_dict)
        == counts(via_tuple)
        == [(1, "dropped", 1, 0)] + [(i, "dropped", 0, 1) for i in (3, 4)]
    )
    assert via_dict.stats.dropped == (1, 3, 4)


def test_cpu_torch_counts_read_in_place_match_the_oracle():
    """A dirty CPU torch batch is counted through its NumPy view (any float16/32/64,
    strided or requiring grad); bfloat16 keeps torch's own count. Same reports."""
    torch = pytest.importorskip("torch")
    from numstab.data._fields import _readable

    t = {d: torch.from_numpy(_summed_batch(d)) for d in (np.float16, np.float32, np.float64)}
    t32 = t[np.float32]
    cases = [*t.values(), t32.clone().requires_grad_(), t32.transpose(2, 3), t32.bfloat16()]
    for value in cases:
        assert (_readable(value) is None) == (value.dtype == torch.bfloat16)
        nan, inf = _oracle(value.detach().double().numpy())
        report = check_batch((value, torch.arange(40)))
        (field,) = report.fields
        assert field.bad_samples == tuple(np.flatnonzero(nan + inf)) == (5, 7, 8, 9, 11, 12)
        assert (field.nan_count, field.inf_count) == (nan.sum(), inf.sum())
        fw = Firewall("drop")
        out = fw.process((value, torch.arange(40)))
        assert out[0].dtype == value.dtype and out[0].requires_grad == value.requires_grad
        assert fw.stats.dropped == field.bad_samples
    assert _readable(np.arange(3)) is None and _readable(torch.arange(3)) is None


def test_a_batch_found_dirty_is_counted_without_a_second_clean_check(monkeypatch):
    from numstab.data import firewall

    def never(*args):
        raise AssertionError("surely_finite called after the fast path found a NaN")

    monkeypatch.setattr(firewall, "surely_finite", never)
    x, y = _data()
    out = list(protect(_batches(x, y), "drop"))
    assert sum(len(b["y"]) for b in out) == N - len(BAD)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "axis1", "small"])
def test_find_is_none_when_clean_else_the_sample_counts(dtype, layout):
    """``_host.find`` (the fast path's check) answers None exactly when every value is
    finite, and otherwise a ``Found`` whose ``counts()`` are those of ``sample_counts``;
    finite values whose sums overflow alone (samples 2 and 3) leave a batch clean."""
    from numstab.data import _host

    x, axis = _summed_batch(dtype), 0
    if layout == "strided":
        x = np.asfortranarray(x)
    elif layout == "axis1":
        x, axis = np.ascontiguousarray(np.swapaxes(x, 0, 1)), 1
    elif layout == "small":  # under SUM_MIN_SIZE: the isfinite route
        x = np.ascontiguousarray(x[:, :, :4, :4])
    found = _host.find(x, axis)
    assert found is not None
    got = found.counts()
    want = _host.sample_counts(x, axis)
    assert len(got) == 2
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.int32
        np.testing.assert_array_equal(g, w)
    overflow_only = np.take(x, [0, 1, 2, 3], axis=axis)
    assert _host.find(overflow_only, axis) is None
    assert not _host.sample_counts(overflow_only, axis)[0].any()


def test_a_dirty_numpy_batch_is_read_once(monkeypatch):
    """The suspect rows the fast path finds are the ones counted: one per-sample sum per
    dirty summed batch, not a second one in the counting step; the records are unchanged."""
    from numstab.data import _host

    calls = []
    suspects = _host._suspects
    monkeypatch.setattr(_host, "_suspects", lambda rows: calls.append(1) or suspects(rows))
    x = _summed_batch()
    fw = Firewall("drop")
    out = fw.process({"x": x, "y": np.arange(40), "z": x[:, :1].copy()})
    assert len(calls) == 1  # "z" is too small for the sums: isfinite
    assert fw.stats.dropped == (5, 7, 8, 9, 11, 12)
    rec = {r.position: (r.nan_count, r.inf_count, r.fields) for r in fw.stats.records}
    assert rec[5] == (2, 0, ("['x']", "['z']")) and rec[7] == (0, 1, ("['x']",))
    np.testing.assert_array_equal(out["y"], np.delete(np.arange(40), list(rec)))


# -- outlier filters --------------------------------------------------------------------------
def test_zscore_state_is_welford_over_accepted_samples():
    rng = np.random.default_rng(2)
    f = ZScoreFilter(warmup=100)
    data = rng.normal(3.0, 2.0, size=(1000, 3))
    data[[500, 700], 1] = 50.0
    flags = np.concatenate([f(data[i : i + 100]) for i in range(0, 1000, 100)])
    assert list(np.flatnonzero(flags & (np.abs(data - 3) > 20).any(1))) == [500, 700]
    accepted = data[~flags]
    assert f.count == len(accepted)
    np.testing.assert_allclose(f.mean, accepted.mean(0), rtol=1e-12)
    np.testing.assert_allclose(f.std, accepted.std(0, ddof=1), rtol=1e-12)
    assert {"count", "mean", "m2"} <= set(f.state_dict())  # settings too (resume)


def test_mad_state_is_the_window_of_accepted_samples():
    rng = np.random.default_rng(3)
    f = MADFilter(window=300, warmup=200)
    data = rng.normal(size=(1000, 2))
    flags = np.concatenate([f(data[i : i + 100]) for i in range(0, 1000, 100)])
    window = data[~flags][-300:]
    median, mad = f.median_and_mad()
    np.testing.assert_allclose(median, np.median(window, 0))
    np.testing.assert_allclose(mad, np.median(np.abs(window - np.median(window, 0)), 0))
    assert not flags[:200].any()  # warm-up flags nothing


def _stream_with_outliers(d, n=60_000, warmup=5000, seed=4):
    """Gaussian features; 1% 10-sigma outliers (one feature) and 0.1% NaN/inf samples."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    kind = rng.random(n)
    outlier = (kind < 0.01) & (np.arange(n) >= warmup)
    nonfinite = (kind > 0.999) & (np.arange(n) >= 0)
    cols = rng.integers(0, d, n)
    x[outlier, cols[outlier]] += 10.0 * rng.choice([-1.0, 1.0], outlier.sum())
    x[nonfinite, cols[nonfinite]] = rng.choice([np.nan, np.inf, -np.inf], nonfinite.sum())
    return x, outlier, nonfinite


@pytest.mark.parametrize(
    ("make", "d"),
    [
        (lambda: ZScoreFilter(threshold=4.5), 8),
        (lambda: MADFilter(), 1),
        (lambda: IsolationForestFilter(), 4),
    ],
    ids=["zscore-4.5-d8", "mad-d1", "isolation_forest-d4"],
)
def test_detection_recall_and_false_positives(make, d):
    x, outlier, nonfinite = _stream_with_outliers(d, n=30_000 if d == 4 else 100_000)
    loader = protect(_batches(x, np.arange(len(x)), size=1000), "drop", outliers=make())
    for _ in loader:
        pass
    stats = loader.stats
    flagged_bad = np.zeros(len(x), bool)
    flagged_bad[list(stats.nonfinite)] = True
    flagged_out = np.zeros(len(x), bool)
    flagged_out[list(stats.outliers)] = True
    assert flagged_bad[nonfinite].all() and not flagged_bad[~nonfinite].any()  # recall 1.0
    clean = ~outlier & ~nonfinite & (np.arange(len(x)) >= 5000)
    assert flagged_out[outlier].mean() >= 0.9
    assert flagged_out[clean].mean() <= 0.001


def gaussian_tail(threshold: float) -> float:
    """P(|z| > threshold) for one standard Gaussian feature (the false-positive rate)."""
    return math.erfc(threshold / math.sqrt(2.0))


def test_zscore_default_threshold_false_positives_follow_the_gaussian_tail():
    """At a per-feature 3 sigma a clean Gaussian feature is flagged 0.27% of the time (0.31%
    measured: learning only accepted samples trims the tails and shrinks std by ~1.3%)."""
    x = np.random.default_rng(5).normal(size=(200_000, 1))
    f = ZScoreFilter(threshold=3.0)  # per-feature, as given (the default is a per-sample rate)
    flags = np.concatenate([f(x[i : i + 1000]) for i in range(0, len(x), 1000)])
    assert 0.8 * gaussian_tail(3.0) <= flags[1000:].mean() <= 1.35 * gaussian_tail(3.0)


def test_bonferroni_threshold_budgets_false_positives_per_sample():
    for d in (1, 8, 64):
        t = bonferroni_threshold(1e-3, d)
        assert 1 - (1 - gaussian_tail(t)) ** d <= 1e-3 < 1 - (1 - gaussian_tail(t - 0.01)) ** d
    # the std of a Gaussian truncated at t, by numerical integration
    z = np.linspace(-3.0, 3.0, 600_001)
    w = np.exp(-(z**2) / 2)
    np.testing.assert_allclose(truncated_std_ratio(3.0), np.sqrt((z**2 * w).sum() / w.sum()), 1e-6)


@pytest.mark.parametrize(
    ("make", "d", "n"),
    [
        (lambda: ZScoreFilter(false_positive_rate=1e-3), 1, 200_000),
        (lambda: ZScoreFilter(false_positive_rate=1e-3), 64, 60_000),
        (lambda: MADFilter(false_positive_rate=1e-3), 8, 100_000),
    ],
    ids=["zscore-d1", "zscore-d64", "mad-d8"],
)
def test_false_positive_rate_holds_per_sample_at_any_d(make, d, n):
    """The rate is a per-sample budget whatever d is. The measured rate is a binomial count
    around it (3 standard errors) plus the estimation noise of mean and std (~15%)."""
    x = np.random.default_rng(d).normal(size=(n, d))
    f = make()
    flags = np.concatenate([f(x[i : i + 1000]) for i in range(0, n, 1000)])[5000:]
    slack = 3 * np.sqrt(1e-3 / len(flags))
    assert 0.85e-3 - slack <= flags.mean() <= 1.15e-3 + slack
    fixed = ZScoreFilter(threshold=bonferroni_threshold(1e-3, 1))  # the d=1 threshold
    if d > 1:
        fixed_flags = np.concatenate([fixed(x[i : i + 1000]) for i in range(0, n, 1000)])
        assert fixed_flags[5000:].mean() > 0.5e-3 * d  # uncorrected: grows with d


def test_threshold_and_false_positive_rate_are_exclusive():
    with pytest.raises(InvalidArgumentError, match="threshold or false_positive_rate"):
        ZScoreFilter(3.0, false_positive_rate=1e-3)
    for bad in (0.0, 1.0, -1e-3, float("nan")):
        with pytest.raises(InvalidArgumentError, match="false_positive_rate"):
            MADFilter(false_positive_rate=bad)
    for default in (ZScoreFilter(), MADFilter()):  # a per-sample budget, no fixed threshold
        assert (default.threshold, default.false_positive_rate) == (None, 5e-4)


def test_outlier_policy_raise_fields_and_callable_features():
    rng = np.random.default_rng(6)
    x = rng.normal(size=(400, 2)).astype(np.float32)
    w = rng.normal(size=(400, 1)).astype(np.float32)
    x[350, 0] = 40.0
    w[360, 0] = 40.0
    batches = [{"x": x[i : i + 50], "w": w[i : i + 50]} for i in range(0, 400, 50)]
    only_w = protect(batches, outliers=ZScoreFilter(6.0, warmup=100), outlier_fields=["['w']"])
    list(only_w)
    assert only_w.stats.outliers == (360,)
    via_fn = protect(
        batches, outliers=ZScoreFilter(6.0, warmup=100), outlier_fields=lambda b: b["x"]
    )
    list(via_fn)
    assert via_fn.stats.outliers == (350,)
    with pytest.raises(OutlierError, match="sample 350") as err:
        list(protect(batches, "raise", outliers=ZScoreFilter(6.0, warmup=100)))
    assert err.value.indices == (350, 360) and err.value.filter == "zscore"
    with pytest.raises(InvalidArgumentError, match="outlier_fields among"):
        list(protect(batches, outliers="zscore", outlier_fields=["['nope']"]))


def test_isolation_forest_without_scikit_learn_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.ensemble", None)
    with pytest.raises(BackendUnavailableError, match=r"numstab\[outliers\]"):
        protect([], outliers="isolation_forest")


def test_import_numstab_data_imports_no_framework():
    code = (
        "import sys, numstab.data\n"
        "print([m for m in ('torch', 'tensorflow', 'jax', 'sklearn') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_guard_is_the_old_name_of_protect():
    import numstab.data as data

    assert data.guard is data.protect


# -- the short ways through a dirty batch (numstab.data._lean) agree with the general path --
def _dirty_stream(seed, kind, axis):
    """Batches of every flat shape the short ways take (and a nested one they leave),
    with NaN/inf appearing in some batches only, in one or two floating fields."""
    rng = np.random.default_rng(seed)
    for k in range(12):
        n = int(rng.integers(1, 9))
        shape = (n, 5) if axis == 0 else (3, n, 2)
        a = rng.normal(size=shape).astype(rng.choice([np.float16, np.float32, np.float64]))
        b = rng.normal(size=shape)
        for x in (a, b):
            if rng.random() < 0.5:  # a dirty field in about half the batches
                idx = tuple(rng.integers(0, s) for s in x.shape)
                x[idx] = rng.choice([np.nan, np.inf, -np.inf])
        if k == 5:
            a[(slice(None),) * axis + (slice(None),)] = np.nan  # every sample
        labels = np.arange(n) if axis == 0 else np.arange(3 * n).reshape(3, n)
        if kind == "dict":
            yield {"a": a, "labels": labels, "b": b}
        elif kind == "list":
            yield [a, labels, b]
        elif kind == "tuple":
            yield (a, b)
        elif kind == "array":
            yield a
        elif kind == "same array twice":
            yield {"a": a, "again": a, "labels": labels}
        else:  # nested: the general path throughout
            yield {"inputs": {"a": a}, "labels": labels}


@pytest.mark.parametrize("kind", ["dict", "list", "tuple", "array", "same array twice", "nested"])
@pytest.mark.parametrize("policy", ["drop", "replace"])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("keep_empty", [False, True])
@pytest.mark.parametrize("sparse_max", [256, 0])
def test_short_ways_match_the_general_path(monkeypatch, kind, policy, axis, keep_empty, sparse_max):
    """``sparse_max`` 0: the records come from the dense counts (a batch full of NaN)."""
    from numstab.data import _lean

    monkeypatch.setattr(_lean, "SPARSE_MAX", sparse_max)

    def run():
        fw = Firewall(policy, batch_axis=axis, keep_empty=keep_empty)
        return [fw.process(b) for b in _dirty_stream(3, kind, axis)], fw.stats

    out, stats = run()
    with monkeypatch.context() as m:
        m.setattr(_lean, "handle_flat", lambda *a: _lean.UNHANDLED)
        m.setattr(_lean, "handle", lambda *a: _lean.UNHANDLED)
        want_out, want = run()
    assert stats.records == want.records and len(want.records) > 3
    assert stats.summary() == want.summary()
    leaves = lambda b: (
        [b] if isinstance(b, np.ndarray) else list(b.values()) if isinstance(b, dict) else list(b)
    )
    for got, expected in zip(out, want_out, strict=True):
        assert type(got) is type(expected)
        if expected is None:
            continue
        if isinstance(expected, dict):
            assert list(got) == list(expected)
        for g, e in zip(leaves(got), leaves(expected), strict=True):
            g, e = (g["a"], e["a"]) if isinstance(e, dict) else (g, e)
            assert g.dtype == e.dtype
            np.testing.assert_array_equal(g, e)


def test_short_way_for_cpu_torch_batches_matches_the_general_path(monkeypatch):
    torch = pytest.importorskip("torch")
    from numstab.data import _lean, firewall

    def run(policy):
        fw = Firewall(policy)
        outs = []
        for b in _dirty_stream(4, "list", 0):
            out = fw.process([torch.from_numpy(x) for x in b])
            outs.append(out and [x.numpy() for x in out])
        return outs, fw.stats

    for policy in ("drop", "replace"):
        with monkeypatch.context() as m:
            if policy == "drop":  # a flat CPU torch batch: no split, one index_select a field
                m.setattr(firewall, "split_batch", lambda *a: pytest.fail("split under drop"))
            out, stats = run(policy)
        with monkeypatch.context() as m:
            m.setattr(_lean, "handle_flat", lambda *a: _lean.UNHANDLED)
            m.setattr(_lean, "handle", lambda *a: _lean.UNHANDLED)
            want_out, want = run(policy)
        assert stats.records == want.records and stats.summary() == want.summary()
        for got, expected in zip(out, want_out, strict=True):
            assert (got is None) == (expected is None)
            for g, e in zip(got or (), expected or (), strict=True):
                np.testing.assert_array_equal(g, e)


def test_short_ways_follow_a_stream_whose_structure_dtype_and_size_change(monkeypatch):
    """One stream whose batches change container, dtype, field count and size (the last
    batch short), with NaN first appearing late: records and outputs as the general path's."""
    from numstab.data import _lean

    rng = np.random.default_rng(11)
    x = rng.normal(size=(40, 3))
    x32 = x.astype(np.float32)
    late = x32.copy()
    late[[2, 5], 1] = [np.nan, -np.inf]
    stream = [
        {"x": x32[:8], "y": np.arange(8)},  # clean
        [x32[8:16], np.arange(8)],  # list now
        {"x": late[:8].astype(np.float64), "y": np.arange(8)},  # float64, dirty
        {"x": late[:8], "y": np.arange(8), "w": late[:8, :1].copy()},  # a third field
        (late[:3],),  # the last batch short, a tuple
    ]

    def run():
        fw = Firewall("drop")
        return [fw.process(b) for b in stream], fw.stats

    out, stats = run()
    with monkeypatch.context() as m:
        m.setattr(_lean, "handle_flat", lambda *a: _lean.UNHANDLED)
        m.setattr(_lean, "handle", lambda *a: _lean.UNHANDLED)
        want_out, want = run()
    assert stats.records == want.records and stats.summary() == want.summary()
    assert stats.dropped == (18, 21, 26, 29, 34) and out[0] is stream[0] and out[1] is stream[1]
    for got, expected in zip(out, want_out, strict=True):
        assert type(got) is type(expected)
        values = (lambda b: list(b.values())) if isinstance(expected, dict) else list
        for g, e in zip(values(got), values(expected), strict=True):
            assert g.dtype == e.dtype
            np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("layout", ["C", "F", "transposed", "axis1"])
@pytest.mark.parametrize("bad", [1, 3])
def test_short_way_locates_one_or_a_few_values_in_any_layout(monkeypatch, layout, bad):
    """One non-finite value is located by ``argmin`` (C order), several by ``nonzero``: in
    every layout the records and output are the general path's, and the dense counts the
    oracle's."""
    from numstab.data import _host, _lean

    rng = np.random.default_rng(bad)
    x = rng.normal(size=(6, 4, 3)).astype(np.float32)
    axis = 1 if layout == "axis1" else 0
    spots = [(1, 2, 0), (4, 0, 2), (4, 3, 1)][:bad]
    for spot, value in zip(spots, [np.nan, np.inf, -np.nan], strict=False):
        x[spot] = value
    if layout == "F":
        x = np.asfortranarray(x)
    elif layout == "transposed":
        x = np.ascontiguousarray(x.transpose(2, 1, 0)).transpose(2, 1, 0)
    finite = np.isfinite(x)
    found = _host.mask_found(x, axis, finite, x.size - np.count_nonzero(finite))
    nan, inf = _oracle(np.moveaxis(x, axis, 0).astype(np.float64))
    np.testing.assert_array_equal(found.counts()[0], nan + inf)
    np.testing.assert_array_equal(found.counts()[1], nan)
    labels = np.arange(x.shape[axis])

    def run():
        fw = Firewall("drop", batch_axis=axis)
        return fw.process({"x": x, "y": labels}), fw.stats

    out, stats = run()
    with monkeypatch.context() as m:
        m.setattr(_lean, "handle_flat", lambda *a: _lean.UNHANDLED)
        m.setattr(_lean, "handle", lambda *a: _lean.UNHANDLED)
        want_out, want = run()
    assert stats.records == want.records and len(stats.records) == len({s[axis] for s in spots})
    for key in ("x", "y"):
        np.testing.assert_array_equal(out[key], want_out[key])


def test_new_record_is_a_sample_record_in_every_way():
    import dataclasses
    import pickle

    from numstab.data.stats import SampleRecord, new_record

    values = (7, 1, 3, 2, "nonfinite", "dropped", ("['x']", "['w']"), 2, 1)
    got, want = new_record(*values), SampleRecord(*values)
    assert type(got) is SampleRecord
    assert got == want and hash(got) == hash(want) and repr(got) == repr(want)
    assert dataclasses.asdict(got) == dataclasses.asdict(want)
    assert list(vars(got)) == [f.name for f in dataclasses.fields(SampleRecord)]
    assert pickle.loads(pickle.dumps(got)) == want
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.index = 0
    assert new_record(*values[:-1], 0) != want


def test_kept_positions_from_the_cached_mask_stay_exact():
    """``_lean._kept`` copies a cached all-true mask per batch size: the cache is never
    written, whatever sizes and flagged sets follow one another."""
    from numstab.data import _lean

    rng = np.random.default_rng(5)
    for n in [256, 3, 256, 1, 40, 256, *range(2, 2 + 2 * _lean._ALL_KEPT_MAX)]:
        for count in (0, 1, 8, 9, n):
            flagged = sorted(rng.choice(n, size=min(count, n), replace=False).tolist())
            want = np.setdiff1d(np.arange(n), flagged)
            np.testing.assert_array_equal(_lean._kept(n, flagged), want)
    assert all(mask.all() for mask in _lean._ALL_KEPT.values())
    assert len(_lean._ALL_KEPT) <= _lean._ALL_KEPT_MAX


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("kind", ["dict", "list", "tuple", "array"])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("policy", ["drop", "replace"])
def test_one_nonfinite_value_records_as_the_general_path(monkeypatch, value, kind, axis, policy):
    """A batch with exactly one NaN/inf value (``_lean._record``'s own lines) against the
    general path: records (NaN vs inf counts, field, position), totals and output; the
    value sits in the second float field, after a clean one."""
    from numstab.data import _lean

    rng = np.random.default_rng(3)
    shape = (5, 4) if axis == 0 else (4, 5)
    a, b = rng.normal(size=shape), rng.normal(size=shape).astype(np.float32)
    b[(3, 2) if axis == 0 else (2, 3)] = value
    labels = np.arange(5)
    batch = {
        "dict": {"a": a, "b": b, "labels": labels},
        "list": [a, b, labels],
        "tuple": (a, b),
        "array": b,
    }[kind]

    def run():
        fw = Firewall(policy, batch_axis=axis)
        fw.process(a if kind == "array" else (a, a))  # a clean batch first
        return fw.process(batch), fw.stats

    out, stats = run()
    with monkeypatch.context() as m:
        m.setattr(_lean, "handle_flat", lambda *a: _lean.UNHANDLED)
        m.setattr(_lean, "handle", lambda *a: _lean.UNHANDLED)
        want_out, want = run()
    assert len(stats.records) == 1 and stats.records == want.records
    assert stats.records[0].nan_count == int(np.isnan(value)) and stats.records[0].position == 3
    assert stats.summary() == want.summary()

    def leaves(o):
        return [o] if isinstance(o, np.ndarray) else list(o.values() if type(o) is dict else o)

    assert type(out) is type(want_out)
    for g, e in zip(leaves(out), leaves(want_out), strict=True):
        assert g.dtype == e.dtype
        np.testing.assert_array_equal(g, e)


def test_torch_leaves_on_the_fast_path_by_dtype():
    """torch children of a batch: floats are summed (a NaN makes the batch a suspect),
    integers and bool hold nothing to read, a complex tensor sends the batch the general way
    (None), and a tensor subclass (a Parameter) is walked as its base type is."""
    torch = pytest.importorskip("torch")
    from numstab.data import _fast

    ints = [torch.zeros(8, dtype=d) for d in (torch.int64, torch.int32, torch.uint8, torch.bool)]
    assert _fast.clean_batch_size([torch.ones(8, 2), *ints], 0) == 8
    assert _fast.clean_batch_size({"h": torch.ones(8, dtype=torch.float16)}, 0) == 8
    nan = torch.ones(8, 2)
    nan[3, 1] = float("nan")
    assert _fast.clean_batch_size([nan, *ints], 0) == _fast.SUSPECT
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        assert _fast.clean_batch_size([nan.to(dtype), *ints], 0) == _fast.SUSPECT
    assert _fast.clean_batch_size([torch.ones(8, dtype=torch.complex64), ints[0]], 0) is None
    parameter = torch.nn.Parameter(torch.ones(8, 2), requires_grad=False)
    assert _fast.clean_batch_size([parameter, ints[0]], 0) == 8
    assert _fast.clean_batch_size([torch.ones(8, 2), torch.zeros(7, dtype=torch.int64)], 0) is None
    batch = [nan, ints[0]]
    out = Firewall("drop").process(batch)
    assert out[0].shape == (7, 2) and out[1].shape == (7,)


# -- TensorFlow ragged and sparse fields (before: listed in ``skipped``, NaN passed) --------
def _composite(kind, dtype="float32"):
    """4 samples, sample 0 holding a NaN and sample 3 an inf, as a ragged tensor (rows) or
    a sparse tensor (``indices[:, 0]``); and the stored values of the good samples 1, 2."""
    tf = pytest.importorskip("tensorflow")
    if kind == "ragged":
        x = tf.ragged.constant([[1.0, np.nan], [2.0], [3.0, 4.0, 5.0], [np.inf]], dtype=dtype)
        return tf, x, [2.0, 3.0, 4.0, 5.0]
    indices = [[0, 1], [1, 0], [2, 0], [2, 2], [3, 1]]
    x = tf.sparse.SparseTensor(indices, tf.constant([np.nan, 2.0, 3.0, 4.0, np.inf], dtype), [4, 3])
    return tf, x, [2.0, 3.0, 4.0]


def _stored(tf, x):
    return (x.flat_values if isinstance(x, tf.RaggedTensor) else x.values).numpy()


@pytest.mark.parametrize("kind", ["ragged", "sparse"])
def test_ragged_and_sparse_float_fields_are_checked(kind):
    tf, x, _ = _composite(kind)
    batch = {"x": x, "ids": tf.ragged.constant([[1, 2], [3], [4], [5, 6]])}
    report = check_batch(batch)
    assert not report.ok and report.bad_samples == (0, 3)
    (field,) = report.fields
    assert (field.path, field.nan_count, field.inf_count) == ("['x']", 1, 1)
    assert report.skipped == ("['ids']",)  # integer ragged: finite by definition
    np.testing.assert_array_equal(nonfinite_per_sample(batch), [1, 0, 0, 1])
    counts = tf.function(nonfinite_per_sample)(batch)  # graph-safe
    np.testing.assert_array_equal(counts, [1, 0, 0, 1])
    clean = {"x": tf.ragged.constant([[1.0], [2.0, 3.0]])}
    assert check_batch(clean).ok and Firewall().process(clean) is clean


@pytest.mark.parametrize("kind", ["ragged", "sparse"])
@pytest.mark.parametrize("policy", ["drop", "replace", "raise"])
def test_ragged_and_sparse_fields_under_each_policy(kind, policy):
    tf, x, good = _composite(kind)
    ids = tf.ragged.constant([[1, 2], [3], [4], [5, 6]])
    fw = Firewall(policy, replace_value=-1.0)
    if policy == "raise":
        with pytest.raises(NonFiniteError, match=r"sample 0 .* field\(s\) \['x'\]"):
            fw.process({"x": x, "ids": ids, "y": tf.range(4)})
        return
    out = fw.process({"x": x, "ids": ids, "y": tf.range(4)})
    assert type(out["x"]) is type(x)
    assert fw.stats.nonfinite == (0, 3)
    if policy == "drop":
        np.testing.assert_array_equal(_stored(tf, out["x"]), good)
        np.testing.assert_array_equal(out["y"].numpy(), [1, 2])
        assert out["ids"].to_list() == [[3], [4]]
        if kind == "sparse":  # re-indexed: samples 1, 2 became 0, 1
            np.testing.assert_array_equal(out["x"].indices.numpy(), [[0, 0], [1, 0], [1, 2]])
            np.testing.assert_array_equal(out["x"].dense_shape.numpy(), [2, 3])
    else:
        want = np.where(np.isfinite(_stored(tf, x)), _stored(tf, x), -1.0)
        np.testing.assert_array_equal(_stored(tf, out["x"]), want)
        assert fw.stats.replaced_values == 2 and out["ids"] is ids


@pytest.mark.parametrize("kind", ["ragged", "sparse"])
def test_ragged_and_sparse_fields_in_tf_data(kind):
    """``protect`` over a dataset iterated eagerly, and ``TFDataGuard`` in graph mode."""
    from numstab.data import TFDataGuard

    tf, x, good = _composite(kind)
    ds = tf.data.Dataset.from_tensor_slices({"x": x, "y": tf.range(4)})
    loader = protect(ds.batch(2), "drop")
    assert [b["y"].numpy().tolist() for b in loader] == [[1], [2]]
    assert loader.stats.dropped == (0, 3)

    eagerly = []

    def spy(fn):
        def wrapped(*element):
            eagerly.append(tf.executing_eagerly())
            return fn(*element)

        return wrapped

    g = TFDataGuard()  # the filter on batches of 2: both hold a non-finite sample
    assert list(tf.data.Dataset.from_tensor_slices(x).batch(2).filter(spy(g.is_finite))) == []
    g = TFDataGuard()  # per-sample elements
    assert len(list(ds.filter(spy(g.is_finite)))) == 2 and g.stats()["samples_flagged"] == 2
    g = TFDataGuard()
    (out,) = ds.batch(4).map(spy(g.drop_nonfinite))
    np.testing.assert_array_equal(_stored(tf, out["x"]), good)
    np.testing.assert_array_equal(out["y"].numpy(), [1, 2])
    assert g.stats() == {"samples_seen": 4, "samples_flagged": 2, "values_replaced": 0}
    g = TFDataGuard(replace_value=7.0)
    (out,) = ds.batch(4).map(spy(g.replace_nonfinite))
    want = np.where(np.isfinite(_stored(tf, x)), _stored(tf, x), 7.0)
    np.testing.assert_array_equal(_stored(tf, out["x"]), want)
    assert g.stats() == {"samples_seen": 4, "samples_flagged": 2, "values_replaced": 2}
    (bad,) = ds.batch(4).map(spy(TFDataGuard().bad_samples))
    np.testing.assert_array_equal(bad.numpy(), [True, False, False, True])
    assert eagerly and not any(eagerly)


def test_ragged_and_sparse_fields_axes_nesting_and_quarantine(tmp_path):
    """A ragged tensor's samples are its rows (another batch_axis raises); a sparse one may
    be split on any axis; nested ragged rows and uniform inner axes count per row; a sparse
    field is quarantined as dense samples, a ragged one raises rather than pass."""
    tf, ragged, _ = _composite("ragged")
    with pytest.raises(InvalidArgumentError, match="batch_axis=0 for the ragged field"):
        check_batch({"x": ragged}, batch_axis=1)
    with pytest.raises(InvalidArgumentError, match="batch_axis=0 for the ragged field"):
        Firewall(batch_axis=1).process({"x": ragged})
    _, sparse, _ = _composite("sparse")
    assert check_batch(sparse, batch_axis=1).bad_samples == (1,)
    kept = Firewall(batch_axis=1).process(sparse)
    np.testing.assert_array_equal(
        tf.sparse.to_dense(kept).numpy(), [[0, 0], [2, 0], [3, 4], [0, 0]]
    )
    nested = tf.ragged.constant([[[1.0], [2.0, np.nan]], [[4.0]], [[np.inf], []]])
    assert check_batch(nested).bad_samples == (0, 2)
    assert Firewall().process(nested).to_list() == [[[4.0]]]
    rows = tf.constant([[1.0, 2.0], [np.nan, 1.0], [3.0, 3.0]])
    uniform = tf.RaggedTensor.from_row_lengths(rows, [1, 0, 2])
    assert check_batch(uniform).bad_samples == (2,)
    fw = Firewall(quarantine_dir=str(tmp_path))
    fw.process({"x": sparse})
    (path,) = fw.stats.quarantine_files
    with np.load(path, allow_pickle=False) as saved:
        assert saved["field_0"].shape == (2, 3)
    refusing = Firewall(quarantine_dir=str(tmp_path))
    with pytest.raises(InvalidArgumentError, match="ragged tensor"):
        refusing.process({"x": ragged})
    assert refusing.stats.records == []  # refused before anything was recorded
