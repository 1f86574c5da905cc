"""Count device-to-host reads: the CPU stand-in for ``torch.cuda.set_sync_debug_mode``.

On a GPU every read of a device value by Python (``.item()``, ``bool(t)``, ``np.asarray``)
waits for the device. On CPU nothing waits, so such reads are counted instead, by wrapping the
Python entry points each framework funnels them through:

* torch: ``Tensor.item / tolist / numpy / cpu / __bool__ / __float__ / __int__ / __index__``
  (``np.asarray(t)`` goes through ``Tensor.__array__``, hence ``numpy``);
* JAX: ``ArrayImpl._value`` (behind ``device_get``, ``float``, ``bool``, ``tolist``),
  counted when the array has no host copy cached yet;
* TensorFlow: ``_EagerTensorBase._numpy`` (behind ``.numpy()``, ``bool``, ``float``);
* JAX and TensorFlow on CPU also hand ``np.asarray`` / ``np.array`` their memory through the
  buffer protocol, which no method sees: those two NumPy functions are wrapped too.

A read nested in another counted read counts once. Reads made inside a framework's C++ code
are not seen; reads from Python, numstab's and the user's, are. For benchmarks only: each
wrapper costs a Python call.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

TORCH_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


class ReadCounter:
    """``count``: host reads seen while the counter was active."""

    def __init__(self) -> None:
        self.count = 0
        self._depth = 0

    def wrap(self, fn: Callable, counts: Callable[..., bool] = lambda *_: True) -> Callable:
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self._depth == 0 and args and counts(args[0]):
                self.count += 1
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted


_INHERITED = object()
Patch = tuple[Any, str, Callable[[ReadCounter, Any], Any]]


def _patches(framework: str) -> list[Patch]:
    """(owner, attribute, make_replacement(counter, original)) per counted entry point."""
    if framework == "torch":
        import torch

        return [(torch.Tensor, name, lambda c, m: c.wrap(m)) for name in TORCH_READS]
    if framework == "jax":
        from jax._src.array import ArrayImpl

        def value(counter: ReadCounter, prop: property) -> property:
            return property(counter.wrap(prop.fget, lambda a: a._npy_value is None))

        return [(ArrayImpl, "_value", value), *_numpy_patches(ArrayImpl)]
    if framework == "tensorflow":
        from tensorflow.python.framework.ops import _EagerTensorBase

        return [
            (_EagerTensorBase, "_numpy", lambda c, m: c.wrap(m)),
            *_numpy_patches(_EagerTensorBase),
        ]
    raise KeyError(f"no host-read counter for {framework!r}")


def _numpy_patches(array_type: type) -> list[Patch]:
    def make(counter: ReadCounter, fn: Callable) -> Callable:
        return counter.wrap(fn, lambda x: isinstance(x, array_type))

    return [(np, "asarray", make), (np, "array", make)]


@contextlib.contextmanager
def counting(framework: str) -> Iterator[ReadCounter]:
    """Count the host reads of ``framework`` made inside the ``with`` block."""
    counter = ReadCounter()
    patches = _patches(framework)
    own = [(owner, name, vars(owner).get(name, _INHERITED)) for owner, name, _ in patches]
    try:
        for owner, name, make in patches:
            # the raw attribute (a property stays a property), inherited ones included
            raw = next(vars(k)[name] for k in getattr(owner, "__mro__", [owner]) if name in vars(k))
            setattr(owner, name, make(counter, raw))
        yield counter
    finally:
        for owner, name, original in own:
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


class _RecordedSyncs:
    """``count``: the CUDA synchronisations torch reported so far."""

    def __init__(self, recorded: list) -> None:
        self._recorded = recorded

    @property
    def count(self) -> int:
        return sum("synchronizing CUDA operation" in str(w.message) for w in self._recorded)


@contextlib.contextmanager
def counting_cuda_syncs() -> Iterator[_RecordedSyncs]:
    """Count torch's host synchronisations with the GPU inside the ``with`` block, as
    ``torch.cuda.set_sync_debug_mode("warn")`` reports them: the C++ ones too (``.item()``,
    ``nonzero``, a blocking copy to the host), which ``counting`` cannot see."""
    import warnings

    import torch

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")  # every sync, not one warning per call site
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield _RecordedSyncs(recorded)
        finally:
            torch.cuda.set_sync_debug_mode(0)
