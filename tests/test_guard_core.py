"""numstab.guard without a framework: spike rule (against a transcription of OLMo-core's),
decision and rollback policy, snapshot files (atomicity, no pickle), JSON log, bad arguments."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from numstab.backends import load_backend
from numstab.errors import InvalidArgumentError
from numstab.guard import (
    EventLog,
    SnapshotDirectory,
    SpikeDetector,
    TrainingGuard,
    decode_tree,
    encode_tree,
    load_npz,
    policy,
    read_log,
    reason_names,
)

NP = load_backend("numpy")


def olmo_core_skips(values: list[float], window: int = 128, sigma: float = 6.0) -> list[bool]:
    """OLMo-core's SkipStepOptimizer.get_step_factor (a14de85) for one signal, in plain Python:
    the history keeps the last window + 1 values (current included); statistics over the
    previous ones, unbiased std; active once len(history) >= max(20, window // 2)."""
    history: list[float] = []
    skips = []
    for x in values:
        history.append(x)
        del history[: max(0, len(history) - (window + 1))]
        if len(history) < max(20, window // 2):
            skips.append(False)
            continue
        prev = history[:-1]
        mean = sum(prev) / len(prev)
        std = math.sqrt(sum((p - mean) ** 2 for p in prev) / (len(prev) - 1))
        skips.append(not (x - mean <= sigma * std))
    return skips


def run_detector(det: SpikeDetector, values: list[float]) -> tuple[list[bool], list[float]]:
    state = det.init(NP)
    spikes, zs = [], []
    for x in values:
        x = np.float32(x)
        z, spike = det.score(NP, state, x)
        spikes.append(bool(spike))
        zs.append(float(z))
        state = det.push(NP, state, x, np.bool_(det.record_spikes) | ~spike)
    return spikes, zs


def test_olmo_core_rule_matches_transcription_on_noisy_series_with_spikes():
    rng = np.random.default_rng(0)
    values = list(3.0 + 0.05 * rng.standard_normal(400))
    for i, jump in ((70, 5.0), (150, 0.2), (151, 0.4), (260, -3.0), (300, 4.0)):
        values[i] += jump  # spikes, a small bump, a drop (one-sided: not a spike)
    values = [float(np.float32(x)) for x in values]
    ours, _ = run_detector(SpikeDetector.olmo_core(), values)
    theirs = olmo_core_skips(values)
    assert ours == theirs
    assert ours[70] and ours[300] and not ours[260]  # the series exercised both outcomes
    assert not any(ours[:63])  # warmup: nothing before the 64th value


def test_warmup_two_sided_and_zscore():
    det = SpikeDetector(window=8, sigma=3.0, warmup=5, two_sided=True)
    values = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, -5.0, 1.0]
    spikes, zs = run_detector(det, values)
    assert spikes == [False] * 6 + [True, False]
    prev = np.array(values[:6])
    assert zs[6] == pytest.approx(abs(-5.0 - prev.mean()) / prev.std(ddof=1), rel=1e-5)
    assert zs[:4] == [0.0] * 4  # before warmup


@pytest.mark.parametrize("window", [2, 10, 18, 19, 40, 128])
def test_default_warmup_is_reachable(window):
    """OLMo-core's default warmup, max(20, W // 2), exceeds the W + 1 values a window of
    W < 19 ever holds: such a detector never detected; now it starts at W + 1."""
    det = SpikeDetector(window=window, sigma=6.0)
    assert 3 <= det.effective_warmup <= window + 1
    values = [1.0 + 0.001 * (i % 2) for i in range(2 * window + 20)] + [1e6]
    spikes, _ = run_detector(det, values)
    assert spikes[-1] and not any(spikes[:-1])


def test_non_finite_values_never_enter_the_window():
    det = SpikeDetector(window=16, sigma=6.0, warmup=4)
    state = det.init(NP)
    for x in (1.0, 1.1, float("nan"), 0.9, float("inf"), 1.0):
        state = det.push(NP, state, np.float32(x), np.bool_(True))
    assert int(state.count) == 4
    assert np.isfinite(state.values).all()
    _, spike = det.score(NP, state, np.float32(1.05))
    assert not spike  # OLMo-core would skip every step here (NaN mean)


def test_record_spikes_false_keeps_only_accepted_values():
    det = SpikeDetector(window=16, sigma=3.0, warmup=4, record_spikes=False)
    g = TrainingGuard(loss_spikes=det, grad_norm_spikes=None, rollback_after=16, rollback_window=16)
    state = g.init_state()
    for x in (1.0, 1.1, 0.9, 1.0, 50.0):
        d, state = g.decide(state, np.float32(x), None)
    assert not d.apply and reason_names(d.reasons) == ["loss_spike"]
    assert int(state.loss_window.count) == 4


def decide_many(g: TrainingGuard, losses: list[float]):
    state = g.init_state()
    out = []
    for x in losses:
        d, state = g.decide(state, np.float32(x), np.float32(1.0))
        out.append(d)
    return out, state


def test_policy_skip_rollback_and_snapshot_counts():
    g = TrainingGuard(
        loss_spikes=None,
        grad_norm_spikes=None,
        snapshot_every=3,
        rollback_after=2,
        rollback_window=3,
    )
    nan = float("nan")
    ds, state = decide_many(g, [1, 1, 1, nan, 1, 1, nan, 1, 1, 1, nan, nan])
    assert [bool(d.apply) for d in ds] == [True] * 3 + [False] + [True] * 2 + [False] + [
        True
    ] * 3 + [False] * 2
    # two bad steps within the last three: at step 6 (steps 3 is 3 back: out) no; at 11 yes
    assert [i for i, d in enumerate(ds) if d.rollback] == [11]
    assert [i for i, d in enumerate(ds) if d.snapshot] == [2, 7]  # 3 good steps: 0-2, then 4, 5, 7
    assert reason_names(ds[3].reasons) == ["nonfinite_loss"]
    rolled = policy.rolled_back(g, NP, state, g.init_state())
    assert float(rolled.lr_factor) == 0.5 and int(rolled.bad_flags.sum()) == 0
    assert int(rolled.step) == 12


def test_nonfinite_grad_norm_reason():
    g = TrainingGuard()
    d, _ = g.decide(g.init_state(), np.float32(1.0), np.float32("inf"))
    assert not d.apply and reason_names(d.reasons) == ["nonfinite_grad"]


# -- snapshots ---------------------------------------------------------------------------------


def test_snapshot_codec_round_trips_structures_and_dtypes():
    import ml_dtypes

    tree = {
        "state": {0: {"step": np.float32(3), "m": np.arange(6, dtype=np.float32).reshape(2, 3)}},
        "groups": [
            {
                "lr": 0.1,
                "betas": (0.9, 0.999),
                "params": [0, 1],
                "eps": float("inf"),
                "name": None,
                "flag": True,
            }
        ],
        "bf16": np.array([1.5, -2.0], ml_dtypes.bfloat16),
        "i64": np.array([1, 2], np.int64),
    }
    back = decode_tree(encode_tree(tree))
    assert list(back["state"]) == [0]  # int key kept
    np.testing.assert_array_equal(back["state"][0]["m"], tree["state"][0]["m"])
    assert back["groups"][0]["betas"] == (0.9, 0.999)
    assert back["groups"][0]["eps"] == math.inf
    assert back["bf16"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back["bf16"].astype(np.float32), [1.5, -2.0])
    assert back["i64"].dtype == np.int64


def test_snapshot_refuses_objects_and_pickled_files(tmp_path):
    with pytest.raises(InvalidArgumentError, match="snapshot"):
        encode_tree({"f": object()})
    path = tmp_path / "evil.npz"
    np.savez(
        path,
        **{
            "__meta__": np.frombuffer(b'{"$a": "a0", "dtype": "object"}', np.uint8),
            "a0": np.array([{"x": 1}], dtype=object),
        },
    )
    with pytest.raises(InvalidArgumentError, match="never unpickled"):
        load_npz(path)


def test_snapshot_directory_keeps_newest(tmp_path):
    store = SnapshotDirectory(tmp_path, keep=2)
    for step in (10, 20, 30):
        store.save(step, {"w": np.full(3, step, np.float32)})
    assert store.steps() == [20, 30]
    step, tree = store.load()
    assert step == 30 and tree["w"][0] == 30


def test_crash_mid_write_leaves_previous_snapshot_intact(tmp_path, monkeypatch):
    store = SnapshotDirectory(tmp_path, keep=3)
    store.save(1, {"w": np.ones(1000, np.float32)})
    real_savez = np.savez

    def crashing_savez(f, **arrays):
        real_savez(f, **arrays)
        f.truncate(f.tell() // 2)  # half a file, then the "crash"
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", crashing_savez)
    with pytest.raises(KeyboardInterrupt):
        store.save(2, {"w": np.zeros(1000, np.float32)})
    assert store.steps() == [1]
    step, tree = store.load()
    assert step == 1 and tree["w"].sum() == 1000


def test_process_killed_mid_write_leaves_previous_snapshot_intact(tmp_path):
    """A real crash: the writing process dies (os._exit) after half the bytes."""
    script = textwrap.dedent(f"""
        import os, numpy as np
        from numstab.guard import SnapshotDirectory
        store = SnapshotDirectory({str(tmp_path)!r}, keep=3)
        store.save(1, {{"w": np.ones(100_000, np.float32)}})
        real = np.savez
        def dying(f, **arrays):
            real(f, **arrays); f.truncate(f.tell() // 2); f.flush(); os._exit(9)
        np.savez = dying
        store.save(2, {{"w": np.zeros(100_000, np.float32)}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    assert leftovers  # the torn temporary file is there ...
    store = SnapshotDirectory(tmp_path, keep=3)
    assert store.steps() == [1]  # ... but never under a snapshot name
    assert store.load()[1]["w"].sum() == 100_000
    store.save(3, {"w": np.zeros(3, np.float32)})  # the next write cleans it up
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_sigkill_at_random_moments_leaves_every_snapshot_whole(tmp_path):
    """A writer saving 8 MB snapshots in a loop is SIGKILLed at several moments: every file
    under a snapshot name loads, and holds what its step wrote (its own step everywhere)."""
    script = textwrap.dedent("""
        import sys, numpy as np
        from numstab.guard import SnapshotDirectory
        store = SnapshotDirectory(sys.argv[1], keep=2)
        print("ready", flush=True)
        for step in range(1, 1000):
            store.save(step, {"w": np.full(2_000_000, step, np.float32)})
    """)
    delays = np.random.default_rng(0).uniform(0.05, 0.6, size=5)
    for trial, delay in enumerate(delays):
        directory = tmp_path / f"trial{trial}"
        proc = subprocess.Popen(
            [sys.executable, "-c", script, str(directory)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(float(delay))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        store = SnapshotDirectory(directory, keep=2)
        for step in store.steps():
            tree = load_npz(store.path(step))
            assert tree["w"].shape == (2_000_000,) and (tree["w"] == step).all()


def test_decision_prints_its_reasons_by_name():
    guard = TrainingGuard()
    state = guard.init_state()
    good, state = guard.decide(state, 1.0, 0.5)
    assert repr(good) == "Decision(step 0: apply; loss 1, grad_norm 0.5)"
    bad, _ = guard.decide(state, float("nan"), math.inf)
    assert bad.reason_names == ["nonfinite_loss", "nonfinite_grad"]
    assert str(bad) == (
        "Decision(step 1: skip ['nonfinite_loss', 'nonfinite_grad']; loss nan, grad_norm inf)"
    )


# -- JSON log ----------------------------------------------------------------------------------


def test_event_log_writes_strict_json_lines_and_calls_back(tmp_path):
    seen = []
    log = EventLog(tmp_path / "g.jsonl", seen.append)
    log.emit(
        "skip",
        7,
        reasons=["nonfinite_loss"],
        loss=np.float32("nan"),
        grad_norm=math.inf,
        loss_z=np.float32(2.5),
    )
    log.emit("rollback", 9, to_step=5, lr_factor=0.5, offending_steps=[7, 8, 9])
    lines = (tmp_path / "g.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0], parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    assert first["event"] == "skip" and first["step"] == 7
    assert first["loss"] == "NaN" and first["grad_norm"] == "Infinity"
    assert first["loss_z"] == 2.5 and first["reasons"] == ["nonfinite_loss"]
    assert read_log(tmp_path / "g.jsonl")[1]["offending_steps"] == [7, 8, 9]
    assert seen == read_log(tmp_path / "g.jsonl")


# -- bad arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"snapshot_every": 0}, "snapshot_every >= 1"),
        ({"snapshot_every": 2.5}, "snapshot_every to be an int"),
        ({"rollback_after": 5, "rollback_window": 4}, "rollback_after <= rollback_window"),
        ({"lr_factor": 0.0}, r"lr_factor in \(0, 1\]"),
        ({"lr_factor": 1.5}, r"lr_factor in \(0, 1\]"),
        ({"lr_factor": True}, "lr_factor to be a real number"),
        ({"max_rollbacks": -1}, "max_rollbacks >= 0"),
        ({"loss_spikes": 6.0}, "loss_spikes to be a numstab.guard.SpikeDetector"),
        ({"log_callback": "print"}, "log_callback to be a hashable callable"),
        ({"log_path": 3}, "log_path to be a path"),
        ({"track_layers": 1}, "track_layers to be a bool"),
        (
            {"log_callback": type("Unhashable", (), {"__call__": print, "__hash__": None})()},
            "hashable",
        ),
    ],
)
def test_training_guard_bad_arguments(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        TrainingGuard(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window": 1}, r"window in \[2, 2\*\*31 - 1\]"),
        ({"window": 2**40}, "window in"),  # was a MemoryError allocating the window
        ({"sigma": 0}, r"sigma in \(0, 3.40282e\+38\]"),
        ({"sigma": 1e39}, "sigma in"),  # inf in the float32 windows: no spike ever
        ({"sigma": math.nan}, "sigma in"),
        ({"warmup": 2}, r"warmup in \[3, window \+ 1"),
        ({"window": 8, "warmup": 10}, r"warmup in \[3, window \+ 1 = 9\]"),
        ({"two_sided": "yes"}, "two_sided to be a bool"),
    ],
)
def test_spike_detector_bad_arguments(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        SpikeDetector(**kwargs)


# -- the host runner with a fake framework ---------------------------------------------------------


class FakeAdapter:
    """A 'model' that is one number, and its optimizer's LR; records the restores."""

    def __init__(self):
        self.value, self.lr, self.restored = 0.0, 1.0, []

    def capture(self):
        return (self.value, self.lr)

    def restore(self, payload):
        self.value, self.lr = payload  # the LR comes back with the optimizer state
        self.restored.append(self.value)

    def scale_lr(self, ratio, ratio_now):  # ratio: the LR restore put back
        self.lr *= ratio

    def to_host(self, payload):
        return list(payload)

    def from_host(self, tree):
        return tuple(tree)


def test_runner_rolls_back_further_each_time_then_gives_up(tmp_path):
    from numstab.errors import NonFiniteError
    from numstab.guard import GuardRunner

    g = TrainingGuard(
        loss_spikes=None,
        grad_norm_spikes=None,
        snapshot_every=2,
        keep_snapshots=3,
        rollback_after=2,
        rollback_window=2,
        max_rollbacks=3,
        snapshot_dir=tmp_path,
    )
    fake = FakeAdapter()
    runner = GuardRunner(g, fake, NP, ["w"])
    state = g.init_state()
    runner.snapshot(0, state)

    def feed(loss):
        nonlocal state
        d, state = g.decide(state, np.float32(loss), np.float32(1.0))
        host = {k: (x.item() if hasattr(x, "item") else x) for k, x in d._asdict().items()}
        if host["apply"]:
            fake.value += 1.0  # the "optimizer step"
        state = runner.after_step(host, state)

    for _ in range(4):
        feed(1.0)  # snapshots at 2 (value 2) and 4 (value 4)
    assert runner.ring.steps() == [0, 2, 4]
    feed(math.nan)
    feed(math.nan)  # rollback to the newest snapshot
    assert fake.restored == [4.0] and fake.lr == 0.5
    feed(math.nan)
    feed(math.nan)  # again, with no snapshot since: one further back
    assert fake.restored == [4.0, 2.0] and fake.lr == pytest.approx(0.25)
    assert float(state.lr_factor) == pytest.approx(0.25)
    feed(math.nan)
    feed(math.nan)
    assert fake.restored == [4.0, 2.0, 0.0]
    feed(math.nan)
    with pytest.raises(NonFiniteError, match="3 rollbacks did not stabilise"):
        feed(math.nan)
    events = [e["event"] for e in runner.log.events]
    assert events.count("rollback") == 3 and events[-1] == "give_up"
    # the snapshots also went to disk, atomically, and load back into the adapter
    assert SnapshotDirectory(tmp_path).steps() == [2, 4]
    fake.value = -1.0
    step, loaded = runner.load_from_disk()
    assert step == 4 and fake.value == 4.0 and int(loaded.step) == 4


def test_entry_points_are_named_for_each_framework():
    from numstab.guard import TrainingGuard

    assert TrainingGuard.keras_callback is TrainingGuard.for_keras
    assert callable(TrainingGuard.for_torch) and callable(TrainingGuard.for_optax)


def test_results_before_training_started_raise_typed():
    """The Keras callback makes its runner in on_train_begin: ``cb.history`` before fit raised
    AttributeError ('NoneType' object has no attribute 'history')."""
    from numstab.guard.runner import RunnerResults

    class Unstarted(RunnerResults):
        runner = None

    for name in ("history", "events"):
        with pytest.raises(InvalidArgumentError, match="Unstarted that has started"):
            getattr(Unstarted(), name)


def test_a_loss_of_another_framework_is_a_backend_mismatch():
    """``decide`` passed another framework's array on unconverted: a JAX loss, norm or flag
    in a torch guard raised AttributeError, and so did ``TorchGuard.step`` with a JAX loss.
    A NumPy guard reads any framework's scalar (as a torch scaler's found-inf flag)."""
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    from numstab.errors import BackendMismatchError

    guard = TrainingGuard()
    cases = [
        ("torch", "loss", jnp.asarray(1.0)),
        ("torch", "grad_norm", jnp.asarray(1.0)),
        ("torch", "scaler_overflow", jnp.asarray(True)),
        ("jax", "loss", torch.tensor(1.0)),
    ]
    for be, name, x in cases:
        args = {"loss": 1.0, "grad_norm": None, "scaler_overflow": None, name: x}
        with pytest.raises(BackendMismatchError, match=name):
            guard.decide(guard.init_state(be), args["loss"], args["grad_norm"], be,
                         scaler_overflow=args["scaler_overflow"])  # fmt: skip
    decision, _ = guard.decide(guard.init_state("numpy"), torch.tensor(2.0), jnp.asarray(1.0))
    assert float(decision.loss) == 2.0 and float(decision.grad_norm) == 1.0
    model = torch.nn.Linear(2, 1)
    tg = guard.for_torch(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(1, 2)).sum().backward()
    with pytest.raises(BackendMismatchError, match="loss"):
        tg.step(jnp.asarray(1.0))
