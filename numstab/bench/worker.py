"""One framework's runs in their own process: ``python -m numstab.bench.worker`` reads a JSON
job on stdin and reports events as JSON lines on stdout (prefix ``@@bench ``).

Events: ``ready`` (versions, device), ``fatal`` (the framework cannot run: nothing ran),
``step`` (run key, step index), ``run`` (run key, its record), ``run_error`` (run key,
message: that run crashed, the next runs still go), ``run_skipped`` (run key, reason: the
native stack's library is missing). numstab's stack reuses one compiled step per
(precision, qk_norm, z_loss); the native stacks cache what they can (see native_*.py).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

from numstab import frameworks

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


def _native_module(framework: str) -> Any:
    """numstab/frameworks/<framework>/bench_native.py, or why it cannot be imported (e.g. jmp
    missing)."""
    try:
        return frameworks.module(framework, "bench_native")
    except ImportError as exc:
        return f"the native {framework} stack needs {exc.name or exc}: {exc}"


def main() -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    job = json.load(sys.stdin)
    from numstab.bench.errors import FrameworkSetupError
    from numstab.bench.spec import RunSpec, preset_from_dict
    from numstab.bench.train import numstab_session, train_run

    preset = preset_from_dict(job["preset"])
    limit_threads(job["threads"], preset.fast_compile)
    try:
        fw = frameworks.module(job["framework"], "bench")
        fw.setup(job["device"])
    except (ImportError, FrameworkSetupError) as exc:
        emit("fatal", message=f"{type(exc).__name__}: {exc}")
        return 0
    emit("ready", versions=fw.versions(), device=fw.device_name())
    cache: dict[Any, Any] = {}
    for key in job["runs"]:
        spec = RunSpec.from_key(key)
        emit("start", key=key)
        try:
            if spec.stack == "native":
                native = _native_module(job["framework"])
                if isinstance(native, str):
                    emit("run_skipped", key=key, message=native)
                    continue
                session = native.session(fw, preset, spec, cache)
            else:
                session = numstab_session(fw, preset, spec, cache)
            record = train_run(
                fw, preset, spec, session, lambda i, k=key: emit("step", key=k, step=i)
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
