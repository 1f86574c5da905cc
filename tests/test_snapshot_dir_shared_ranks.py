"""Data-parallel ranks given the same ``snapshot_dir`` (2 gloo processes on CPU, loopback).

Before, every rank wrote its snapshots there, and each write removed every ``.tmp-*.npz`` of
the folder as a crashed write's, the other rank's file being written included: that rank's
``os.replace`` raised FileNotFoundError and the other rank hung in the guard's all-reduce.
Now (docs/semantics.md §16.5): replicated state (DDP), rank 0 alone writes and every rank
resumes from its files; ``sharded=True``, each rank writes ``rank-<r>/``; ``load_snapshot``
agrees on one step across ranks, or raises on every rank. A write removes only stale
temporary files, never another live process's.

As tests/test_distributed_torch.py, the test spawns this file twice as a script
(``--worker``); each rank runs every scenario and writes its record as JSON, and the test
process imports no torch.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

WORLD = 2
STEPS = 20
TIMEOUT_S = 150


def _listing(d: str) -> list[str]:
    """Every file under ``d``, relative, sorted (temporary files included)."""
    return sorted(
        os.path.relpath(os.path.join(root, n), d) for root, _, names in os.walk(d) for n in names
    )


def _setup(rank: int, sharded: bool, seed: int, d: str):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import numstab as ns

    # replicated: the same model on every rank (DDP broadcasts rank 0's anyway); sharded: each
    # rank its own parameters. Wide layers: each file takes a while to write (the race).
    torch.manual_seed(seed + (rank if sharded else 0))
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    wrapped = model if sharded else DDP(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    guard = ns.TrainingGuard(
        snapshot_every=1,
        keep_on_disk=2,
        snapshot_dir=d,
        loss_spikes=None,
        grad_norm_spikes=None,
    )
    return model, wrapped, opt, guard.for_torch(wrapped, opt, sharded=sharded)


def _train(rank: int, wrapped, opt, tg, steps: int, seen: dict) -> None:
    """``steps`` steps; ``seen[s]``: the parameters after step s (what its snapshot holds)."""
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        opt.zero_grad()
        loss = wrapped(torch.randn(3, 256, generator=gen)).pow(2).mean()
        loss.backward()
        tg.step(loss)
        seen[tg.steps_seen] = [p.detach().clone() for p in wrapped.parameters()]
    tg.flush()
    dist.barrier()  # every rank's files written


def _same(model, params) -> bool:
    import torch

    return all(torch.equal(a, b) for a, b in zip(model.parameters(), params, strict=True))


def _resume(rank: int, sharded: bool, step, seen: dict, d: str) -> dict:
    """A fresh model and guard on every rank, ``load_snapshot(step)``, 3 more steps."""
    import torch.distributed as dist

    model, wrapped, opt, tg = _setup(rank, sharded, 100, d)
    out: dict = {"after_init": _listing(d)}
    try:
        loaded = tg.load_snapshot(step)
    except Exception as exc:
        out["error"] = type(exc).__name__
        dist.barrier()  # both ranks still talk: nobody hung
        return out
    out.update(step=loaded, restored=_same(model, seen[loaded]))
    _train(rank, wrapped, opt, tg, 3, seen)
    out.update(after_more=_listing(d), steps_seen=tg.steps_seen)
    dist.barrier()  # listed on every rank before one goes on (and removes files)
    return out


def _scenario(rank: int, sharded: bool, d: str) -> dict:
    import torch.distributed as dist

    seen: dict = {}
    _, wrapped, opt, tg = _setup(rank, sharded, 0, d)
    _train(rank, wrapped, opt, tg, STEPS, seen)
    out: dict = {"trained": _listing(d)}
    out["resumed_19"] = _resume(rank, sharded, STEPS - 1, seen, d)  # then 20, 21, 22
    out["resumed"] = _resume(rank, sharded, None, seen, d)  # 22, then 23, 24, 25
    if sharded:  # rank 1's newest file lost (a crash): both ranks go back to step 24
        if rank == 1:
            os.unlink(os.path.join(d, "rank-1", "snapshot-000000025.npz"))
        dist.barrier()
        out["resumed_common"] = _resume(rank, sharded, None, seen, d)
        if rank == 1:  # rank 1 has no file at all: every rank raises
            for name in os.listdir(os.path.join(d, "rank-1")):
                os.unlink(os.path.join(d, "rank-1", name))
        dist.barrier()
        out["resumed_none"] = _resume(rank, sharded, None, seen, d)
    return out


def _run(rank: int, world: int, tmp: str) -> dict:
    return {
        "replicated": _scenario(rank, False, os.path.join(tmp, "replicated")),
        "sharded": _scenario(rank, True, os.path.join(tmp, "sharded")),
    }


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    from tests.gloo_ranks import worker_main

    worker_main(_run, WORLD, TIMEOUT_S)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from numstab.guard.snapshots import STALE_AFTER_S, SnapshotDirectory  # noqa: E402
from tests.gloo_ranks import run_ranks  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch")
    return run_ranks(__file__, WORLD, TIMEOUT_S, tmp_path_factory.mktemp("shared"))


def _names(*steps: int, under: str = "") -> list[str]:
    return [os.path.join(under, f"snapshot-{s:09d}.npz") for s in steps]


def test_replicated_ranks_share_one_folder_that_rank_0_writes(ranks):
    for rec in ranks:
        assert rec["replicated"]["trained"] == _names(19, 20)  # no temporary file left


def test_replicated_resume_reads_rank_0_files_on_every_rank(ranks):
    for rec in ranks:
        at_19 = rec["replicated"]["resumed_19"]
        assert at_19["after_init"] == _names(19, 20)  # the earlier run's: no step-0 file
        assert at_19["step"] == 19 and at_19["restored"]
        assert at_19["steps_seen"] == 22 and at_19["after_more"] == _names(21, 22)
        resumed = rec["replicated"]["resumed"]
        assert resumed["after_init"] == _names(21, 22)
        assert resumed["step"] == 22 and resumed["restored"]
        assert resumed["steps_seen"] == 25 and resumed["after_more"] == _names(24, 25)


def test_sharded_ranks_write_their_own_subfolders(ranks):
    both = lambda *steps: _names(*steps, under="rank-0") + _names(*steps, under="rank-1")
    for rec in ranks:
        assert rec["sharded"]["trained"] == both(19, 20)
        at_19, resumed = rec["sharded"]["resumed_19"], rec["sharded"]["resumed"]
        assert at_19["after_init"] == both(19, 20)
        assert at_19["step"] == 19 and at_19["restored"]  # its own parameters
        assert resumed["step"] == 22 and resumed["restored"]
        assert resumed["after_more"] == both(24, 25)


def test_sharded_resume_agrees_on_the_newest_common_step_or_raises_everywhere(ranks):
    for rec in ranks:
        common = rec["sharded"]["resumed_common"]
        assert common["step"] == 24 and common["restored"]  # rank 0 holds 25 too
        assert rec["sharded"]["resumed_none"]["error"] == "InvalidArgumentError"


# -- temporary files: only stale ones are removed ---------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _host() -> str:
    from numstab.guard import snapshots

    return snapshots._host()


@pytest.mark.skipif(os.name == "nt", reason="Windows refuses to delete an open file itself")
def test_a_write_removes_stale_temporary_files_only(tmp_path):
    live = tmp_path / f".tmp-{_host()}-{os.getppid()}-abc123.npz"  # being written
    legacy = tmp_path / ".tmp-x9y8z7.npz"  # an older version's name, fresh
    dead = tmp_path / f".tmp-{_host()}-{_dead_pid()}-abc123.npz"  # a crashed writer
    old = tmp_path / f".tmp-otherhost-{os.getpid()}-def456.npz"  # another machine's, old
    other = tmp_path / ".tmp-other.txt"  # not a temporary of ours
    for f in (live, legacy, dead, old, other):
        f.write_bytes(b"half")
    past = time.time() - STALE_AFTER_S - 60
    os.utime(old, (past, past))
    os.utime(other, (past, past))
    SnapshotDirectory(tmp_path, keep=2).save(1, {"w": np.ones(3, np.float32)})
    assert not dead.exists() and not old.exists()
    assert sorted(os.listdir(tmp_path)) == sorted(
        [live.name, legacy.name, other.name, "snapshot-000000001.npz"]
    )


def test_a_reader_writes_nothing(tmp_path):
    reader = SnapshotDirectory(tmp_path, keep=2, writer=False)
    assert reader.save(3, {"w": np.ones(3, np.float32)}) == str(tmp_path / _names(3)[0])
    assert os.listdir(tmp_path) == []
