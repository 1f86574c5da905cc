"""Whether a framework can run on a GPU here, asked before a ``--device gpu`` benchmark starts,
so that a machine without one gets a one-line error and exit status 2 (as ``overhead.py``
and ``loss_scaling_torch.py`` give), not a traceback from deep inside the first step.

``python benchmarks/_device.py torch jax`` asks in a fresh process (prints one line per
framework that cannot, exits 1 if any): ``memory.py`` uses it so that its own process
neither imports the frameworks nor lets JAX take the GPU's memory before its workers start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable


def gpu_missing(framework: str) -> str | None:
    """Why ``framework`` cannot run on a GPU in this process, in one line; None if it can."""
    if framework == "torch":
        import torch

        if not torch.cuda.is_available():
            return (
                f"torch {torch.__version__} sees no CUDA device "
                "(torch.cuda.is_available() is False)"
            )
    elif framework == "jax":
        import jax

        try:
            jax.devices("gpu")
        except RuntimeError as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return f"jax {jax.__version__} has no GPU platform ({reason})"
    elif framework == "tensorflow":
        import tensorflow as tf

        if not tf.config.list_physical_devices("GPU"):
            return f"tensorflow {tf.__version__} sees no GPU"
    return None


def gpu_missing_in_subprocess(frameworks: Iterable[str]) -> list[str]:
    """``gpu_missing`` of each framework, asked in one fresh process (JAX without
    preallocation); the lines of those that cannot."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *frameworks],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 and not lines:  # the check itself failed: its last line
        lines = [(done.stderr.strip().splitlines() or ["the GPU check failed"])[-1]]
    return lines


if __name__ == "__main__":
    missing = [why for name in sys.argv[1:] if (why := gpu_missing(name))]
    print("\n".join(missing))
    sys.exit(1 if missing else 0)
