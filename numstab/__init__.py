"""numstab: one API for numerical stability in training, on torch, TensorFlow, JAX and NumPy.

Importing numstab imports no deep-learning framework; a backend's framework is imported the
first time that backend is used.
"""

from numstab._config import backend_choice, set_backend, use_backend
from numstab._dispatch import resolve_backend
from numstab.adaptive_clipping import ZClip, ZClipState
from numstab.agc import AGC, adaptive_grad_clip
from numstab.backends import available_backends, preload_imported_frameworks
from numstab.clipping import all_finite, clip_by_global_norm, clip_by_value, global_norm
from numstab.errors import (
    BackendMismatchError,
    BackendUnavailableError,
    InvalidArgumentError,
    MixedBackendsError,
    NonFiniteError,
    NumstabError,
    OutlierError,
    UnknownBackendError,
)
from numstab.fused_cross_entropy import fused_linear_cross_entropy
from numstab.guard import SpikeDetector, TrainingGuard
from numstab.locate import LocateReport, locate_nonfinite
from numstab.loss_scale import LossScaler, LossScaleState
from numstab.losses import cross_entropy, log_softmax, logsumexp, smooth_labels
from numstab.nonfinite import NonFiniteRecord, assert_finite, find_nonfinite
from numstab.numerics import CheckNumerics, FiniteSummary, check_numerics, finite_summary
from numstab.schedules import WarmupCosineSchedule, warmup_cosine_schedule

__version__ = "0.1.0"

preload_imported_frameworks()


def __getattr__(name: str):
    # numstab.data imports NumPy: loaded on first use, so that importing numstab does not
    if name == "data":
        import importlib

        return importlib.import_module("numstab.data")
    raise AttributeError(f"module 'numstab' has no attribute {name!r}")


def get_backend() -> str:
    """The configured backend name ("auto" means: detected from each call's arrays)."""
    return backend_choice().name


__all__ = [
    "AGC",
    "BackendMismatchError",
    "BackendUnavailableError",
    "CheckNumerics",
    "FiniteSummary",
    "InvalidArgumentError",
    "LocateReport",
    "LossScaleState",
    "LossScaler",
    "MixedBackendsError",
    "NonFiniteError",
    "NonFiniteRecord",
    "NumstabError",
    "OutlierError",
    "SpikeDetector",
    "TrainingGuard",
    "UnknownBackendError",
    "WarmupCosineSchedule",
    "ZClip",
    "ZClipState",
    "__version__",
    "adaptive_grad_clip",
    "all_finite",
    "assert_finite",
    "available_backends",
    "backend_choice",
    "check_numerics",
    "clip_by_global_norm",
    "clip_by_value",
    "cross_entropy",
    "find_nonfinite",
    "finite_summary",
    "fused_linear_cross_entropy",
    "get_backend",
    "global_norm",
    "locate_nonfinite",
    "log_softmax",
    "logsumexp",
    "resolve_backend",
    "set_backend",
    "smooth_labels",
    "use_backend",
    "warmup_cosine_schedule",
]
