"""Tests that run torch code on several gloo processes on CPU (loopback): the launcher and the
worker's process-group boilerplate, in one place.

A test file runs itself as a script, one process per rank (``FILE --worker RANK PORT DIR``);
its ``__main__`` block calls ``worker_main``, which joins the group, calls the file's
``run(rank, world, dir)``, and writes the record as ``DIR/<rank>.json``. The test process
calls ``run_ranks(__file__, ...)`` and gets the records; it imports no torch (its imports cost
seconds of the two CPUs the workers need). Nothing here imports torch at module level.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

NO_GLOO = 3  # a worker's exit code: torch.distributed has no gloo backend
ROOT = Path(__file__).resolve().parents[1]


def worker_main(
    run: Callable[[int, int, str], dict],
    world: int,
    timeout_s: float,
    after: Callable[[int, str], dict] | None = None,
) -> None:
    """The ``--worker RANK PORT DIR`` entry: ``run(rank, world, DIR)`` inside the group, a
    barrier (no rank tears down while another still talks to it), then ``after(rank, DIR)``
    (merged into the record) outside it. Ends the process with ``os._exit``: gloo's background
    threads, destroyed joinable at interpreter teardown, abort about one exit in ten on this
    torch ("terminate called without an active exception") after the record is written; the
    record, not the teardown, is under test."""
    rank, port, out = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    code = _worker(run, after, rank, port, out, world, timeout_s)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _worker(run, after, rank: int, port: int, out: str, world: int, timeout_s: float) -> int:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        return NO_GLOO
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=max(timeout_s - 10, 10)),
    )
    try:
        record = run(rank, world, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if after is not None:
        record.update(after(rank, out))
    Path(out, f"{rank}.json").write_text(json.dumps(record))
    return 0


def run_ranks(script: str, world: int, timeout_s: float, folder: Path) -> list[Any]:
    """Run ``script --worker r PORT folder`` for every rank r and return their records (a
    hang fails after ``timeout_s``; no gloo skips the test; a failed rank fails it, with its
    log)."""
    import pytest

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("NUMSTAB_BACKEND", None)
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, script, "--worker", str(r), str(port), str(folder)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if procs[0].returncode == NO_GLOO:
        pytest.skip("torch.distributed has no gloo backend")
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-3000:]}"
    return [json.loads((folder / f"{r}.json").read_text()) for r in range(world)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
