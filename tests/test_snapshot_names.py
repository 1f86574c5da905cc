"""Snapshot files on disk: only the names the writer gives (``snapshot-<step>.npz``, the step
zero-padded to 9 digits) are snapshots; any other ``snapshot-*.npz`` is ignored, never loaded
nor pruned. And the ``snapshot`` event has ``path`` only when written to disk (§16.7)."""

import os

import numpy as np
import pytest

from numstab.guard.snapshots import SnapshotDirectory


def _tree(step):
    return {"w": np.full(2, float(step), np.float32)}


@pytest.mark.parametrize("stray", ["snapshot-7.npz", "snapshot-0000000007.npz", "snapshot-07.npz"])
def test_stray_names_are_neither_listed_loaded_nor_pruned(tmp_path, stray):
    disk = SnapshotDirectory(tmp_path, keep=2)
    (tmp_path / stray).write_bytes(b"not a snapshot")
    for step in (1, 2, 3):
        disk.save(step, _tree(step))
    assert disk.steps() == [2, 3]
    assert sorted(os.listdir(tmp_path)) == sorted(
        [stray, "snapshot-000000002.npz", "snapshot-000000003.npz"]
    )
    step, tree = disk.load()
    assert step == 3 and tree["w"].tolist() == [3.0, 3.0]
    # a step past 9 digits keeps the writer's (unpadded) name, and is a snapshot
    disk.save(1_000_000_000, _tree(4))
    assert disk.steps() == [3, 1_000_000_000]
    assert disk.load()[0] == 1_000_000_000
    assert (tmp_path / stray).exists()


def test_torch_guard_keeps_its_snapshots_next_to_a_stray_file(tmp_path):
    """The audit's repro (F1): ``keep_on_disk=2`` kept one real snapshot, and
    ``load_snapshot`` raised a raw FileNotFoundError."""
    torch = pytest.importorskip("torch")
    from numstab import TrainingGuard

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = TrainingGuard(
        loss_spikes=None,
        grad_norm_spikes=None,
        snapshot_every=1,
        keep_on_disk=2,
        snapshot_dir=tmp_path,
    )
    tg = guard.for_torch(model, opt)
    (tmp_path / "snapshot-7.npz").write_bytes(b"not a snapshot")
    for _ in range(3):
        opt.zero_grad()
        loss = model(torch.ones(4, 2)).pow(2).mean()
        loss.backward()
        tg.step(loss)
    tg.flush()
    real = sorted(n for n in os.listdir(tmp_path) if n != "snapshot-7.npz")
    assert real == ["snapshot-000000002.npz", "snapshot-000000003.npz"]
    assert (tmp_path / "snapshot-7.npz").exists()
    tg.load_snapshot()


def test_snapshot_event_has_path_only_when_written(tmp_path):
    torch = pytest.importorskip("torch")
    from numstab import TrainingGuard

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    memory = TrainingGuard().for_torch(model, opt)
    assert memory.events[0]["event"] == "snapshot"
    assert "path" not in memory.events[0]
    disk = TrainingGuard(snapshot_dir=tmp_path).for_torch(model, opt)
    assert disk.events[0]["path"] == os.path.join(str(tmp_path), "snapshot-000000000.npz")
