"""One framework's runs in their own process: ``python -m numstab.bench.worker`` reads a JSON
job on stdin and reports events as JSON lines on stdout (prefix ``@@bench ``).

Events: ``ready`` (versions, device), ``fatal`` (the framework cannot run: nothing ran),
``step`` (run key, step index), ``run`` (run key, its record), ``run_error`` (run key,
message: that run crashed, the next runs still go). One compiled step per precision is
reused by every run of that precision.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from typing import Any

PREFIX = "@@bench "


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(PREFIX + json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def limit_threads(threads: int, fast_compile: bool) -> None:
    """Before any framework is imported: ``threads`` intra-op threads in every framework
    (the same for all, so timings compare; 1 by default, robust on a shared machine)."""
    n = str(threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TF_NUM_INTRAOP_THREADS"):
        os.environ[var] = n
    os.environ["TF_NUM_INTEROP_THREADS"] = "1"
    flags = [os.environ.get("XLA_FLAGS", "")]
    if threads == 1:
        flags.append("--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    if fast_compile:  # the CI preset: XLA's LLVM passes off, compiles 2-3x faster
        flags.append("--xla_backend_optimization_level=0")
    os.environ["XLA_FLAGS"] = " ".join(f for f in flags if f)


def main() -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    job = json.load(sys.stdin)
    from numstab.bench.errors import FrameworkSetupError
    from numstab.bench.spec import Preset, RunSpec
    from numstab.bench.train import make_step, train_run

    preset = Preset(**{**job["preset"], "grid": tuple(map(tuple, job["preset"]["grid"]))})
    limit_threads(job["threads"], preset.fast_compile)
    try:
        fw = importlib.import_module(f"numstab.bench.fw_{job['framework']}")
        fw.setup(job["device"])
    except (ImportError, FrameworkSetupError) as exc:
        emit("fatal", message=f"{type(exc).__name__}: {exc}")
        return 0
    emit("ready", versions=fw.versions(), device=fw.device_name())
    steps: dict[str, Any] = {}
    for key in job["runs"]:
        spec = RunSpec.from_key(key)
        emit("start", key=key)
        try:
            if spec.precision not in steps:
                steps[spec.precision] = fw.compile(make_step(fw, preset, spec.precision))
            record = train_run(
                fw,
                preset,
                spec,
                steps[spec.precision],
                lambda i, k=key: emit("step", key=k, step=i),
            )
        except Exception as exc:  # one crashed run is reported; the others still run
            emit(
                "run_error",
                key=key,
                message=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(limit=-3),
            )
            continue
        emit("run", key=key, record=record)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
