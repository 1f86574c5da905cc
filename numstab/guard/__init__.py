"""The training guard: survive a NaN or a loss spike instead of dying of it.

``TrainingGuard`` holds the settings; ``guard.for_torch(model, optimizer)``,
``guard.for_optax()`` and ``guard.keras_callback()`` give the framework integrations, each
imported (with its framework) only when asked for. Importing this package imports no
framework and not even NumPy.
"""

from numstab.guard.events import EventLog, read_log
from numstab.guard.guard import TrainingGuard
from numstab.guard.monitor import NormHistory, layer_norms
from numstab.guard.policy import REASONS, Decision, GuardState, reason_names
from numstab.guard.runner import GuardRunner
from numstab.guard.snapshots import (
    SnapshotDirectory,
    SnapshotRing,
    decode_tree,
    encode_tree,
    load_npz,
    write_npz_atomic,
)
from numstab.guard.spikes import SpikeDetector, WindowState

__all__ = [
    "REASONS",
    "Decision",
    "EventLog",
    "GuardRunner",
    "GuardState",
    "NormHistory",
    "SnapshotDirectory",
    "SnapshotRing",
    "SpikeDetector",
    "TrainingGuard",
    "WindowState",
    "decode_tree",
    "encode_tree",
    "layer_norms",
    "load_npz",
    "read_log",
    "reason_names",
    "write_npz_atomic",
]
