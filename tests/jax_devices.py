"""The environment of a child process that needs several JAX CPU devices (used by the tests
that run sharded JAX code in their own process: ``--xla_force_host_platform_device_count``
only takes effect before jax is imported)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_devices_env(count: int = 4) -> dict[str, str]:
    """``os.environ`` with ``count`` JAX CPU devices, this checkout first on ``PYTHONPATH``
    and TensorFlow's logs quiet. The device count goes FIRST in ``XLA_FLAGS`` and replaces
    any inherited one: XLA stops reading the flags at the first token that is not one (a
    stray ``name=value``), so a flag appended after such a token was silently ignored and
    the child saw one device (seen with ``XLA_FLAGS="... intra_op_parallelism_threads=1"``)."""
    flag = "--xla_force_host_platform_device_count"
    inherited = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(flag)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    env["XLA_FLAGS"] = " ".join([f"{flag}={count}", *inherited])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env
