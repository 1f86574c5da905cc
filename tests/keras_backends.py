"""Run one script under each Keras backend, each in its own process (Keras fixes its backend
at import), in parallel; used by the Keras tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

KERAS_BACKENDS = ("tensorflow", "jax", "torch")
ROOT = Path(__file__).resolve().parents[1]


def run_per_keras_backend(
    script: str, backends: tuple[str, ...] = KERAS_BACKENDS
) -> dict[str, tuple[int, str, str]]:
    """backend -> (exit code, stdout, stderr) of ``python -c script``."""
    procs = {}
    for backend in backends:
        env = {
            **os.environ,
            "KERAS_BACKEND": backend,
            "PYTHONPATH": str(ROOT),
            "TF_CPP_MIN_LOG_LEVEL": "3",
        }
        procs[backend] = subprocess.Popen(
            [sys.executable, "-c", script],
            env=env,
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    outputs = {b: p.communicate(timeout=300) for b, p in procs.items()}  # drains the pipes
    return {b: (procs[b].returncode, *outputs[b]) for b in procs}
