"""``protect`` over single samples and into Keras (docs/semantics.md §17.3):

- an unbatched ``tf.data.Dataset`` (each element one sample) is refused when ``protect`` is
  called, from its ``element_spec``: before, each element was read as a batch of its
  features, and a drop deleted features while the rank-0 label stayed;
- ``GuardedIterable.as_tf_dataset()`` goes straight into ``model.fit``.
"""

from __future__ import annotations

import numpy as np
import pytest

from numstab.data import protect
from numstab.errors import InvalidArgumentError

tf = pytest.importorskip("tensorflow")


def _features(n=4, d=5):
    x = np.arange(n * d, dtype=np.float32).reshape(n, d)
    x[2, 1] = np.inf
    return x


@pytest.mark.parametrize(
    "element",
    [
        lambda x: (x, np.arange(len(x))),
        lambda x: {"x": x, "y": np.arange(len(x))},
        lambda x: (x, np.arange(len(x), dtype=np.float32)),  # a regression target
        lambda x: (x, np.ones((len(x), 1), np.float32)),  # sizes 5 and 1 along axis 0
    ],
)
def test_unbatched_tf_dataset_is_refused_before_any_batch(element):
    ds = tf.data.Dataset.from_tensor_slices(element(_features()))
    with pytest.raises(InvalidArgumentError, match=r"batched tf\.data\.Dataset.*\.batch\("):
        protect(ds)
    out = list(protect(ds.batch(2)))  # batched: sample 2 dropped, labels kept with it
    labels = np.concatenate([np.asarray(b[1] if isinstance(b, tuple) else b["y"]) for b in out])
    assert len(labels) == 3 and all(b[0].shape[-1] == 5 for b in out if isinstance(b, tuple))


def test_unbatched_variable_length_samples_are_refused():
    """A sequence of unknown length beside a rank-0 label, before padded_batch: its steps were
    read as samples, and a NaN step was cut out of the sequence."""
    seqs = [np.array([1.0, np.nan, 3.0, 4.0], np.float32), np.array([5.0, 6.0], np.float32)]
    ds = tf.data.Dataset.from_generator(
        lambda: ((s, np.int64(i)) for i, s in enumerate(seqs)),
        output_signature=(tf.TensorSpec((None,), tf.float32), tf.TensorSpec((), tf.int64)),
    )
    for unbatched in (ds, ds.padded_batch(2).unbatch()):
        with pytest.raises(InvalidArgumentError, match=r"batched tf\.data\.Dataset"):
            protect(unbatched)
    (batch,) = protect(ds.padded_batch(2))  # batched: the first sequence is dropped whole
    assert batch[0].shape == (1, 4) and batch[1].numpy().tolist() == [1]


def test_batched_datasets_with_static_fields_pass():
    """A rank-0 field beside batched ones of unknown batch size (``.batch()``) stays a
    static field (§17.1), as does one beside fields batched along axis 1."""
    x = _features(8)
    ds = tf.data.Dataset.from_tensor_slices({"x": x, "y": np.arange(8)}).batch(4)
    scaled = ds.map(lambda e: {**e, "scale": tf.constant(0.5)})
    out = list(protect(scaled))
    assert [b["x"].shape[0] for b in out] == [3, 4] and float(out[0]["scale"]) == 0.5
    samples = tf.data.Dataset.from_tensor_slices({"x": x, "y": np.arange(8)})
    fixed = samples.batch(4, drop_remainder=True).map(lambda e: {**e, "n": tf.constant(3)})
    assert [b["x"].shape[0] for b in protect(fixed)] == [3, 4]  # static sizes, batched
    per_axis1 = tf.data.Dataset.from_tensor_slices({"x": x.T[None], "s": np.ones(1, np.float32)})
    (batch,) = protect(per_axis1, batch_axis=1)  # "s" beside batch axis 1: static
    assert batch["x"].shape == (5, 7)


def test_a_batch_with_integer_metadata_still_drops_a_sample():
    """A rank-0 integer beside batched fields is a static field (§17.1), here as everywhere:
    a drop of one sample keeps it (a per-sample element cannot be told from such a batch
    outside tf.data, whose element_spec says it)."""
    out = list(protect([{"x": _features(), "y": np.arange(4), "seq_len": 128}]))
    assert out[0]["x"].shape == (3, 5) and out[0]["seq_len"] == 128


def test_static_float_and_whole_element_drop_keep_their_behaviour():
    x = _features()
    out = list(protect([{"x": x, "lr": np.float32(0.1), "y": np.arange(4)}]))
    assert out[0]["x"].shape == (3, 5) and out[0]["lr"] == np.float32(0.1)
    nan_row = np.full(5, np.nan, np.float32)  # every position flagged: the element is skipped
    guarded = protect([(nan_row, 3), (x[0], 1)])
    assert [int(y) for _, y in guarded] == [1]


def _model():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    return model


def test_as_tf_dataset_feeds_keras_fit_with_records():
    pytest.importorskip("keras")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 5)).astype(np.float32)
    x[8:16] = np.nan  # batch 1 all NaN: skipped
    x[20, 3] = np.inf  # one sample of batch 2
    y = rng.integers(0, 3, 32)
    guarded = protect(tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    ds = guarded.as_tf_dataset()
    assert [s.shape.as_list() for s in ds.element_spec] == [[None, 5], [None]]
    model = _model()
    history = model.fit(ds, epochs=2, verbose=0).history["loss"]
    assert np.isfinite(history).all()
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert np.isfinite(model.evaluate(ds, verbose=0))
    stats = guarded.stats
    assert stats.epochs == 3 and stats.samples_seen == 96
    assert stats.batches_skipped == 3 and stats.samples_passed == 3 * 23
    assert stats.dropped == tuple(e * 32 + i for e in range(3) for i in [*range(8, 16), 20])


def test_as_tf_dataset_over_other_iterables_needs_a_signature():
    x = _features(4)
    guarded = protect([(x, np.arange(4))])
    with pytest.raises(InvalidArgumentError, match="output_signature"):
        guarded.as_tf_dataset()
    signature = (tf.TensorSpec([None, 5], tf.float32), tf.TensorSpec([None], tf.int64))
    ((bx, by),) = list(guarded.as_tf_dataset(signature))
    assert bx.shape == (3, 5) and by.numpy().tolist() == [0, 1, 3]


KERAS_SCRIPT = r"""
import numpy as np, tensorflow as tf, keras, numstab as ns
rng = np.random.default_rng(0)
x = rng.normal(size=(32, 5)).astype(np.float32)
x[8:16] = np.nan
x[20, 3] = np.inf
y = rng.integers(0, 3, 32)
guarded = ns.data.protect(tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
history = model.fit(guarded.as_tf_dataset(), epochs=2, verbose=0).history["loss"]
assert np.isfinite(history).all(), history
# JAX and torch Keras read a first batch to build the model and optimizer, in a pass of
# its own over the dataset (tf.data prefetches ahead in it): counted as an epoch here
stats = guarded.stats
assert stats.epochs >= 2 and len(stats.dropped) >= 18, stats.summary()
assert {(r.batch, r.position) for r in stats.records} == {*((1, p) for p in range(8)), (2, 4)}
assert stats.summary()["samples_seen"] > 64  # a global index counts the stream, peek included
print("ok", keras.backend.backend())
"""


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_as_tf_dataset_feeds_fit_on_other_keras_backends(backend):
    pytest.importorskip("keras")
    from tests.keras_backends import run_per_keras_backend

    code, out, err = run_per_keras_backend(KERAS_SCRIPT, (backend,))[backend]
    assert code == 0 and f"ok {backend}" in out, err[-3000:]
