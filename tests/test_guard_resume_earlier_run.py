"""Resuming from the snapshot files of an earlier run (docs/semantics.md §16.5, §16.6), and the
steps after a give-up.

The audit's repro: the new process's first snapshot (its fresh model, at construction) was
written over the earlier run's ``snapshot-000000000.npz``, so ``load_snapshot`` restored the
fresh model; and after a resume the ring still held that first snapshot, so a rollback going
one snapshot further back restored the fresh model. A fresh run in a folder of an earlier
run had its own files pruned at once (older steps than the earlier run's). After a give-up
with ``host_every`` > 1, the steps read after the give-up's one were missing from the
history."""

from __future__ import annotations

import numpy as np
import pytest

from numstab.errors import NonFiniteError
from numstab.guard import SnapshotDirectory, TrainingGuard
from numstab.guard.snapshots import load_npz


def settings(directory=None, **kw):
    """No spike detectors; one bad step rolls back; snapshots after every 2 good steps."""
    base = dict(
        loss_spikes=None,
        grad_norm_spikes=None,
        snapshot_every=2,
        rollback_after=1,
        rollback_window=1,
        max_rollbacks=None,
        snapshot_dir=None if directory is None else str(directory),
    )
    return TrainingGuard(**{**base, **kw})


def files(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("snapshot-"))


def test_a_write_removes_the_files_of_later_steps(tmp_path):
    store = SnapshotDirectory(tmp_path, keep=3)
    for step in (3, 10, 20):
        store.save(step, {"w": np.full(2, step, np.float32)})
    store.save(5, {"w": np.full(2, 5, np.float32)})  # a run that went on from step 3
    assert store.steps() == [3, 5]
    assert store.load()[1]["w"][0] == 5


# -- torch ---------------------------------------------------------------------------------------


def _torch_model(seed):
    torch = pytest.importorskip("torch")
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _torch_steps(tg, model, opt, n, bad=()):
    """``n`` steps, those at the positions in ``bad`` with a NaN loss; then ``flush``."""
    import torch

    for i in range(n):
        opt.zero_grad()
        loss = model(torch.ones(4, 3)).pow(2).mean() * (float("nan") if i in bad else 1.0)
        loss.backward()
        tg.step(loss)
    tg.flush()


def _torch_weights(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_torch_load_snapshot_restores_the_earlier_runs_first_snapshot(tmp_path):
    guard = settings(tmp_path, snapshot_every=100)
    m1, o1 = _torch_model(1)
    init1 = _torch_weights(m1)
    _torch_steps(guard.for_torch(m1, o1), m1, o1, 3)  # then "crashes": only its step-0 file
    m2, o2 = _torch_model(2)
    tg2 = guard.for_torch(m2, o2)
    assert files(tmp_path) == ["snapshot-000000000.npz"]
    assert tg2.load_snapshot() == 0
    assert _same(_torch_weights(m2), init1)
    assert "path" not in tg2.events[0]  # its first snapshot stayed in memory


def test_torch_rollbacks_after_a_resume_never_restore_the_fresh_model(tmp_path):
    guard = settings(tmp_path)
    m1, o1 = _torch_model(1)
    _torch_steps(guard.for_torch(m1, o1), m1, o1, 5)
    assert files(tmp_path) == ["snapshot-000000002.npz", "snapshot-000000004.npz"]
    saved = load_npz(tmp_path / "snapshot-000000004.npz")["payload"]["model"]
    m2, o2 = _torch_model(2)
    fresh = _torch_weights(m2)
    tg2 = guard.for_torch(m2, o2)
    assert tg2.load_snapshot() == 4
    for _ in range(2):  # the second goes "one further back": there is nothing before 4
        _torch_steps(tg2, m2, o2, 1, bad=(0,))
        assert _same(_torch_weights(m2), saved) and not _same(_torch_weights(m2), fresh)
    assert [e["to_step"] for e in tg2.events if e["event"] == "rollback"] == [4, 4]


def test_torch_fresh_run_in_an_earlier_runs_folder_writes_the_newest_file(tmp_path):
    guard = settings(tmp_path)
    m1, o1 = _torch_model(1)
    _torch_steps(guard.for_torch(m1, o1), m1, o1, 7)
    assert files(tmp_path) == ["snapshot-000000004.npz", "snapshot-000000006.npz"]
    m2, o2 = _torch_model(2)
    tg2 = guard.for_torch(m2, o2)  # no load_snapshot: a run of its own
    _torch_steps(tg2, m2, o2, 2)
    mine = _torch_weights(m2)
    _torch_steps(tg2, m2, o2, 1)  # the snapshot due after step 1 is taken as step 2 starts
    assert files(tmp_path) == ["snapshot-000000002.npz"]
    m3, o3 = _torch_model(3)
    assert guard.for_torch(m3, o3).load_snapshot() == 2
    assert _same(_torch_weights(m3), mine)


# -- optax ---------------------------------------------------------------------------------------


def _optax_run(guard, seed):
    """An optax guard over a fresh model; ``steps(n, bad)`` runs n steps."""
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    tx = optax.sgd(0.1)
    og = guard.for_optax()
    state = {}
    params = {"w": jax.random.normal(jax.random.PRNGKey(seed), (3,))}
    state["trees"] = (params, tx.init(params), og.init(params, tx.init(params)))

    @jax.jit
    def train(params, opt_state, gstate, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
        return og.step(tx, params, opt_state, gstate, loss, grads)

    def steps(n, bad=()):
        for i in range(n):
            x = jnp.ones((4, 3)) * (jnp.nan if i in bad else 1.0)
            params, opt_state, gstate, decision = train(*state["trees"], x)
            state["trees"] = (params, opt_state, gstate)
            state["trees"] = og.after_step(decision, *state["trees"])
        state["trees"] = og.flush(*state["trees"])

    return og, state, steps


def test_optax_load_snapshot_restores_the_earlier_runs_first_snapshot(tmp_path):
    guard = settings(tmp_path, snapshot_every=100)
    _, run1, steps1 = _optax_run(guard, 1)
    init1 = np.asarray(run1["trees"][0]["w"])
    steps1(3)
    og2, run2, _ = _optax_run(guard, 2)
    assert files(tmp_path) == ["snapshot-000000000.npz"]
    params, _, _ = og2.load_snapshot(*run2["trees"][:2])
    np.testing.assert_array_equal(np.asarray(params["w"]), init1)


def test_optax_rollbacks_after_a_resume_never_restore_the_fresh_model(tmp_path):
    guard = settings(tmp_path)
    _, _, steps1 = _optax_run(guard, 1)
    steps1(5)
    assert files(tmp_path) == ["snapshot-000000002.npz", "snapshot-000000004.npz"]
    saved = load_npz(tmp_path / "snapshot-000000004.npz")["payload"]["params"][0]
    og2, run2, steps2 = _optax_run(guard, 2)
    fresh = np.asarray(run2["trees"][0]["w"])
    run2["trees"] = og2.load_snapshot(*run2["trees"][:2])
    for _ in range(2):
        steps2(1, bad=(0,))
        w = np.asarray(run2["trees"][0]["w"])
        np.testing.assert_array_equal(w, saved)
        assert not np.array_equal(w, fresh)
    assert [e["to_step"] for e in og2.events if e["event"] == "rollback"] == [4, 4]


def test_optax_records_every_step_read_with_a_give_up():
    """``host_every=2``: the give-up at step 2 is read with step 3, which the history lacked;
    the loop goes on after the error (host mode kept every step already)."""
    og, _, steps = _optax_run(settings(max_rollbacks=0, host_every=2), 1)
    with pytest.raises(NonFiniteError):
        steps(4, bad=(2,))
    steps(2)
    assert og.history.as_arrays()["step"].tolist() == [0, 1, 2, 3, 4, 5]
