"""TrainingGuard(host_every=k): the steady step stays on the device. A NaN batch in the middle
is still skipped (torch: found_inf for fused optimizers, backup-and-undo for any other; optax:
lax.cond), the event is logged with its step when the host reads, the run ends as the
per-step host mode ends it, and a steady step makes no host read (benchmarks/_host_reads)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from numstab.errors import InvalidArgumentError
from numstab.guard import SpikeDetector, TrainingGuard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from _host_reads import counting

from tests.torch_guard_loop import regression_data, train_guarded


def test_host_every_is_validated():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(InvalidArgumentError, match="host_every"):
            TrainingGuard(host_every=bad)
    assert TrainingGuard().host_every == 1


# -- torch -------------------------------------------------------------------------------------
def _torch():
    return pytest.importorskip("torch")


def _train(guard, optim="adam", nan_steps=(), steps=60, spike_steps=()):
    torch = _torch()
    torch.set_num_threads(1)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if optim == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.05, fused=optim == "fused")
    tg = guard.for_torch(model, opt)
    train_guarded(torch, tg, model, opt, steps, nan_steps, spike_steps)
    return model, opt, tg


def _events(tg, kinds=("skip", "rollback", "give_up", "skip_batch")):
    return [
        (e["event"], e["step"], tuple(e.get("reasons", ())))
        for e in tg.events
        if e["event"] in kinds
    ]


@pytest.mark.parametrize("optim", ["adam", "fused", "sgd"])
def test_torch_nan_batch_is_skipped_and_logged_as_in_host_mode(optim):
    torch = _torch()
    nan = (0, 23, 40)  # step 0: the optimizer's state does not exist yet
    host = _train(TrainingGuard(snapshot_every=1000), optim, nan)
    dev = _train(TrainingGuard(snapshot_every=1000, host_every=8), optim, nan)
    assert _events(dev[2]) == _events(host[2])
    assert [s for _, s, _ in _events(dev[2])] == [0, 23, 40]
    assert _events(dev[2])[1][2] == ("nonfinite_loss", "nonfinite_grad")
    for a, b in zip(host[0].parameters(), dev[0].parameters(), strict=True):
        assert torch.equal(a, b)  # the undone step left no trace
    for p, q in zip(host[0].parameters(), dev[0].parameters(), strict=True):
        assert host[1].state[p].keys() == dev[1].state[q].keys()
        for k, v in host[1].state[p].items():
            assert torch.equal(v, dev[1].state[q][k]), k
    h, d = host[2].history.as_arrays(), dev[2].history.as_arrays()
    np.testing.assert_array_equal(h["applied"], d["applied"])
    np.testing.assert_array_equal(h["step"], d["step"])
    np.testing.assert_allclose(h["grad_norm"], d["grad_norm"], rtol=1e-6)
    assert d["layer_norms"].shape == (60, 4)


def test_torch_device_mode_runs_eagerly_where_it_cannot_compile(monkeypatch):
    """No C++ compiler (or an op inductor rejects): one RuntimeWarning, the same code run
    eagerly, the same weights, optimizer state and events as the compiled run."""
    torch = _torch()
    from numstab.frameworks.torch import guard_compiled

    nan = (0, 23, 40)
    compiled = _train(TrainingGuard(snapshot_every=1000, host_every=8), "adam", nan)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(guard_compiled, "_CACHE", {})
    monkeypatch.setattr(guard_compiled, "_WARNED", [])
    monkeypatch.setattr(torch._inductor, "compile", no_compiler)
    with pytest.warns(RuntimeWarning, match="runs eagerly") as caught:
        eager = _train(TrainingGuard(snapshot_every=1000, host_every=8), "adam", nan)
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert set(guard_compiled._CACHE.values()) == {None}  # every piece ran eagerly
    assert _events(eager[2]) == _events(compiled[2])
    for a, b in zip(compiled[0].parameters(), eager[0].parameters(), strict=True):
        assert torch.equal(a, b)
    for p, q in zip(compiled[0].parameters(), eager[0].parameters(), strict=True):
        for k, v in compiled[1].state[p].items():
            assert torch.equal(v, eager[1].state[q][k]), k


def test_torch_spikes_and_rollback_in_device_mode():
    torch = _torch()
    guard = TrainingGuard(
        snapshot_every=10,
        rollback_after=2,
        loss_spikes=SpikeDetector(window=16, sigma=4.0, warmup=8),
        host_every=5,
    )
    model, opt, tg = _train(guard, "adam", nan_steps=(31, 32), spike_steps=(45,), steps=60)
    events = _events(tg)
    assert ("skip", 31, ("nonfinite_loss", "nonfinite_grad")) in events
    rollbacks = [e for e in tg.events if e["event"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["step"] == 32
    assert rollbacks[0]["offending_steps"] == [31, 32]
    assert any(s == 45 and "loss_spike" in r for _, s, r in events)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    snaps = [e["step"] for e in tg.events if e["event"] == "snapshot"]
    assert snaps[0] == 0 and len(snaps) >= 4


def test_torch_steady_steps_make_no_host_read():
    torch = _torch()
    for optim in ("fused", "sgd"):
        model, opt, tg = _train(TrainingGuard(host_every=1000), optim, steps=3)
        x, y = torch.randn(32, 8), torch.randn(32, 1)
        with counting("torch") as reads:
            for _ in range(10):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                applied = tg.step(torch.nn.functional.mse_loss(model(x), y).detach())
        assert reads.count == 0, optim
        assert bool(applied) is True and "LazyApplied" in repr(applied)
        with counting("torch") as reads:
            tg.flush()
        assert reads.count >= 1 and len(tg.history) == 13


def test_device_decisions_equal_the_policy():
    """DevicePolicy (policy.decide compiled, on a torch state) against policy.decide on
    NumPy, on a series with spikes, NaN and inf, with a two-sided detector and a disabled
    one, across reads of the rows ring; and the state it ends with."""
    torch = _torch()
    from numstab.backends import load_backend
    from numstab.frameworks.torch.guard_compiled import DevicePolicy
    from numstab.guard import policy
    from numstab.guard.deferred import decisions_from_rows

    rng = np.random.default_rng(0)
    loss = (1 + 0.1 * rng.standard_normal(200)).astype(np.float32)
    norm = (5 + rng.standard_normal(200)).astype(np.float32)
    loss[[30, 90, 91, 92]] = [50.0, np.nan, np.inf, np.nan]  # 3 bad in a row: a rollback
    loss[150:] += 3.0  # a level shift: learned, since spikes enter the window
    norm[[60, 120]] = [np.inf, 100.0]
    norm[121] = -40.0  # a drop: a spike for the two-sided detector
    eps = float(np.finfo(np.float32).eps)
    for guard in (
        TrainingGuard(
            loss_spikes=SpikeDetector(window=24, sigma=4.0),
            grad_norm_spikes=SpikeDetector(window=16, sigma=3.0, two_sided=True, warmup=5),
            rollback_after=3,
            rollback_window=8,
            snapshot_every=7,
        ),
        TrainingGuard(
            grad_norm_spikes=None,
            loss_spikes=SpikeDetector(window=8, sigma=3.0, warmup=6, record_spikes=False),
        ),
    ):
        be = load_backend("numpy")
        state = guard.init_state(be)
        dec = DevicePolicy(guard, torch.device("cpu"), 16)
        expected, got = [], []
        for i in range(len(loss)):
            d, state = policy.decide(guard, be, state, loss[i], norm[i])
            expected.append(d)
            apply, found_inf = dec.decide(torch.tensor([loss[i], norm[i]]))
            assert bool(apply) == bool(d.apply) and float(found_inf) == float(not d.apply)
            if i % 16 == 15:  # a read of the ring every 16 steps, as host_every=16 does
                got += decisions_from_rows(dec.read_rows(i - 15, 16), i - 15)
        for key in ("apply", "rollback", "snapshot", "reasons", "step"):
            assert [g[key] for g in got] == [e._asdict()[key].item() for e in expected[:192]]
        assert sum(not g["apply"] for g in got) >= 3
        assert any(g["rollback"] for g in got) == (guard.rollback_after == 3)
        for key in ("loss", "grad_norm", "loss_z", "grad_norm_z"):
            np.testing.assert_allclose(
                [g[key] for g in got],
                [float(e._asdict()[key]) for e in expected[:192]],
                rtol=64 * eps,
                atol=64 * eps,
            )

        def flat(st):
            return [x for leaf in st for x in (leaf if isinstance(leaf, tuple) else (leaf,))]

        for mine, ref in zip(flat(dec.state()), flat(state), strict=True):
            np.testing.assert_array_equal(mine, ref)


# -- optax -------------------------------------------------------------------------------------
def test_optax_nan_batch_is_skipped_and_logged_and_steady_steps_read_nothing():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")
    from numstab.frameworks.jax.guard import guarded_step

    tx = optax.adam(0.05)
    x = jax.random.normal(jax.random.PRNGKey(0), (32, 8))
    y = x @ jax.random.normal(jax.random.PRNGKey(1), (8, 1))

    def loss_fn(p, xb):
        return jnp.mean((jnp.tanh(xb @ p["w1"]) @ p["w2"] - y) ** 2)

    @jax.jit
    def step(guard, params, opt_state, gstate, xb):
        loss, grads = jax.value_and_grad(loss_fn)(params, xb)
        return guarded_step(guard, tx, params, opt_state, gstate, loss, grads)

    step = jax.jit(step.__wrapped__, static_argnums=0)
    p0 = {"w1": 0.3 * jnp.ones((8, 16)), "w2": 0.1 * jnp.ones((16, 1))}

    def run(guard, steps=40, nan_steps=(17, 18, 19), count_at=()):
        og = guard.for_optax()
        params, opt_state = p0, tx.init(p0)
        gstate = og.init(params, opt_state)
        reads = []
        for i in range(steps):
            xb = x.at[0, 0].set(jnp.nan) if i in nan_steps else x
            if og.skip_batch():
                continue
            with counting("jax") as counter:
                params, opt_state, gstate, d = step(guard, params, opt_state, gstate, xb)
                params, opt_state, gstate = og.after_step(d, params, opt_state, gstate)
            if i in count_at:
                reads.append(counter.count)
        if guard.host_every > 1:
            params, opt_state, gstate = og.flush(params, opt_state, gstate)
        return params, og, reads

    kw = {"snapshot_every": 1000, "rollback_after": 3}
    hp, ho, _ = run(TrainingGuard(**kw))
    dp, do, reads = run(TrainingGuard(host_every=8, **kw), count_at=range(20, 30))
    assert _events(do) == _events(ho)
    assert [s for e, s, _ in _events(do) if e == "skip"] == [17, 18, 19]
    assert [e["step"] for e in do.events if e["event"] == "rollback"] == [19]
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(dp))
    np.testing.assert_array_equal(
        ho.history.as_arrays()["applied"], do.history.as_arrays()["applied"]
    )
    # steps 20..29: a read at the step that completes each 8 (steps 23 and 31 of the count)
    assert sorted(reads)[:8] == [0] * 8 and max(reads) >= 1
    # without a rollback among them, the runs end equal
    hp, ho, _ = run(TrainingGuard(**kw), nan_steps=(12,))
    dp, do, _ = run(TrainingGuard(host_every=8, **kw), nan_steps=(12,))
    assert _events(do) == _events(ho) == [("skip", 12, ("nonfinite_loss", "nonfinite_grad"))]
    for a, b in zip(jax.tree.leaves(hp), jax.tree.leaves(dp), strict=True):
        np.testing.assert_array_equal(a, b)


# -- Keras (TensorFlow backend) --------------------------------------------------------------
def test_keras_nan_batch_is_undone_and_logged_and_steady_batches_read_nothing():
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("the device-side callback is TensorFlow's")
    from numstab.frameworks.keras.guard_device import DeviceGuardCallback

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    x[100, 0] = np.nan  # batch 3 of each epoch (batch size 32)
    x[250, 0] = np.nan  # the last batch: checked before the validation resets the metrics

    def fit(guard, epochs=2, data=(x, y)):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]
        )
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        callbacks = [] if guard is None else [guard.keras_callback()]
        with counting("tensorflow") as reads:
            h = model.fit(
                *data,
                validation_data=(x[:64] * 0, y[:64]),
                batch_size=32,
                epochs=epochs,
                shuffle=False,
                verbose=0,
                callbacks=callbacks,
            )
        return model, (callbacks or [None])[0], h, reads.count

    kw = {"snapshot_every": 1000, "rollback_after": 2, "rollback_window": 4}  # no rollback
    host_model, host_cb, host_h, _ = fit(TrainingGuard(**kw))
    model, cb, h, _ = fit(TrainingGuard(host_every=5, **kw))
    assert isinstance(cb, DeviceGuardCallback)
    assert _events(cb) == _events(host_cb)
    assert [s for _, s, _ in _events(cb)] == [3, 7, 11, 15]
    # Keras took the epoch's logs before the last batch's check: the callback mends them
    assert h.history == host_h.history and np.isfinite(h.history["loss"]).all()
    for a, b in zip(model.get_weights(), host_model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(cb.history) == 16
    clean = (np.nan_to_num(x), y)

    def steady_reads(guard):  # the reads of 16 more batches: start and end cancel out
        return fit(guard, epochs=3, data=clean)[3] - fit(guard, epochs=1, data=clean)[3]

    assert steady_reads(TrainingGuard(host_every=100)) <= steady_reads(None)


def test_torch_device_mode_resumes_from_disk(tmp_path):
    torch = _torch()
    guard = TrainingGuard(snapshot_every=10, snapshot_dir=tmp_path, host_every=4)
    _, _, tg = _train(guard, "adam", nan_steps=(12,), steps=30)
    saved = [e["step"] for e in tg.events if e["event"] == "snapshot"]
    assert saved[0] == 0 and len(saved) >= 3
    torch.manual_seed(5)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.05)
    tg2 = guard.for_torch(fresh, fresh_opt)
    before = [p.detach().clone() for p in fresh.parameters()]
    assert tg2.load_snapshot() == saved[-1] == tg2.steps_seen
    assert not any(torch.equal(a, b) for a, b in zip(before, fresh.parameters(), strict=True))
    X, Y = regression_data(torch)
    fresh_opt.zero_grad()
    loss = torch.nn.functional.mse_loss(fresh(X[:32]), Y[:32])
    loss.backward()
    assert bool(tg2.step(loss)) is True
    tg2.flush()
    assert tg2.history.as_arrays()["step"].tolist() == [saved[-1]]
