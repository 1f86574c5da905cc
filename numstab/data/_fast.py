"""The fast path for the common case: a clean batch of plain containers and arrays.

``clean_batch_size`` walks dicts, lists and tuples directly (no field objects) and proves
every floating leaf finite. NumPy arrays, and zero-copy NumPy views of CPU-resident
float16/32/64 TensorFlow eager tensors (``_tf_eager``: a TF op costs far more than the read),
are read in place by ``_host.find`` (its small route inline), exact either way:
``count_nonzero(isfinite(x))`` for small arrays, per-sample sums (one read, no temporary)
with an exact re-check of the rows whose sum is not finite for C-contiguous float32/float64
arrays of at least 2**16 values and 256 per sample; a dirty array's non-finite values are
located from that same check and handed to the caller (``counted``, ``_host.Found``). torch
tensors, on any device, take one fused sum per field and one host sync per batch
(measured cheaper than ``.numpy()`` + ``isfinite`` on a CPU tensor fresh from a
DataLoader: 9.5 vs 18.7 us median at 256 x 32); other TensorFlow tensors (GPU, bfloat16)
and JAX arrays one fused sum per field through their backend, on their device (a finite
sum implies finite terms; see ``_fields.surely_finite``). It answers ``SUSPECT`` when a
floating leaf is not provably finite (the caller then counts at once), and None when it
meets anything else (namedtuples, dataclasses, NumPy bfloat16, mismatched batch sizes): the
caller then takes the general path, which decides, so both paths give the same result.

What it costs, per loader, against the bare loader and its measured floors:
``benchmarks/data_firewall.py`` and ``docs/performance.md`` §4 (the measurements that shaped
this path are in the git history of this docstring).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from numstab import frameworks
from numstab._dispatch import framework_of
from numstab._validate import compute_dtype, is_floating, is_integer
from numstab.backends import load_backend
from numstab.data._fields import composite_ops
from numstab.data._host import SUM_MIN_SIZE, all_finite, find, mask_found, tf_types, tf_view


class _Unknown(Exception):
    """Something the fast path does not handle: the general path decides."""


class _Suspect(Exception):
    """A floating leaf not provably finite (a NaN/inf, or a framework sum that overflowed);
    ``args``: the NumPy array and its non-finite values (``_host.Found``), when known."""


#: ``clean_batch_size``'s answer for a batch with a leaf not provably finite: the caller can
#: go straight to counting (a second "is it clean?" pass would only repeat the answer).
SUSPECT = -1


def clean_batch_size(batch: Any, batch_axis: int, counted: list | None = None) -> int | None:
    """The batch size if every floating leaf is provably finite, ``SUSPECT`` if one is not,
    None for anything else ("look closer"). With ``SUSPECT``, ``counted`` (if given) gets
    ``(leaf, _host.Found)`` for each batched NumPy array, or TensorFlow tensor read through
    its NumPy view, found dirty: for the caller to reuse, by identity.

    The common batch, a dict, list or tuple of NumPy arrays or plain tensors, is read in one
    loop: an array by ``isfinite`` (``_host.find`` for big ones), a tensor by its framework's
    hook (``data.batch_leaf``), anything else through ``_walk``. A dirty array does not stop
    the reading: ``counted`` then holds every dirty NumPy child, and the others are clean
    (``_lean.handle_flat`` relies on it)."""
    cls = type(batch)
    if cls is dict:
        children = batch.values()
    elif (cls is list or cls is tuple) and batch and type(batch[0]) not in _TEXT:
        children = batch  # (a list of strings is one per-sample field: ``_walk`` knows it)
    else:
        children = (batch,)
    size = -1
    sums = sizes = dirty = None
    try:
        for leaf in children:
            if type(leaf) is _ndarray and leaf.ndim > batch_axis:
                n = len(leaf) if batch_axis == 0 else leaf.shape[batch_axis]
                if n != size:
                    if size >= 0:
                        return None
                    size = n
                dtype = leaf.dtype  # common ones by identity (builtins are singletons)
                if dtype is _F32 or dtype is _F64 or (dtype is not _I64 and dtype.kind == "f"):
                    values = leaf.size
                    if values < SUM_MIN_SIZE:  # ``find``'s small route, inline
                        finite = _isfinite(leaf)
                        bad = values - _count_nonzero(finite)
                        if not bad:
                            continue
                        found = mask_found(leaf, batch_axis, finite, bad)
                    else:
                        found = find(leaf, batch_axis)
                        if found is None:
                            continue
                    dirty = dirty or []  # noted, and the other children still read
                    dirty.append((leaf, found))
                elif dtype is not _I64 and dtype.kind not in "iub":
                    return None
                continue
            if sums is None:
                hooks, sums, sizes = frameworks.loaded("data", "batch_leaf"), [], []
            for leaf_type, check in hooks:  # a framework's plain tensor: straight to its hook
                if type(leaf) is leaf_type:
                    if not check(leaf, batch_axis, sums, sizes):
                        return None
                    break
            else:  # a nested container, a tensor subclass, anything else
                _walk(leaf, batch_axis, hooks, sums, sizes)
        if sizes:
            if size >= 0:
                sizes.append(size)
            if sizes.count(sizes[0]) != len(sizes):
                return None
            size = sizes[0]
        if size < 0:
            return None
        if dirty:
            if counted is not None:
                counted += dirty
            return SUSPECT
        # torch's leaves: one fused sum per field, one sync; a finite total proves finite
        # terms (NaN/inf propagate), an overflowing one only sends the batch the long way
        if sums and not math.isfinite(sum(sums[1:], sums[0]).item()):
            return SUSPECT
    except _Suspect as suspect:
        if counted is not None:
            counted += dirty or ()
            if suspect.args:
                counted.append(suspect.args)
        return SUSPECT
    except (_Unknown, RuntimeError):  # RuntimeError: torch sums on different devices
        return None
    return size


_TEXT = (str, bytes)
_F32, _F64, _I64 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int64)
_isfinite, _count_nonzero, _ndarray = np.isfinite, np.count_nonzero, np.ndarray
_STATIC = (str, bytes, int, float, bool, type(None))


def _host(a: np.ndarray, axis: int, sizes: list) -> None:
    """A NumPy array (or zero-copy view): its size, and proof that it is finite; if it is
    not, ``_Suspect`` carries its non-finite values (``_host.find``) when it is batched."""
    kind = a.dtype.kind
    if a.ndim > axis:
        sizes.append(a.shape[axis])
        if kind == "f":
            found = find(a, axis)
            if found is not None:
                raise _Suspect(a, found)
            return
    elif kind == "f":
        if not all_finite(a):
            raise _Suspect
        return
    if kind not in "iub":
        raise _Unknown


def _walk(node: Any, axis: int, leaf_hooks: tuple, sums: list, sizes: list) -> None:
    """Every leaf of ``node``: sizes into ``sizes``, fused sums (``leaf_hooks``: a framework's
    ``data.batch_leaf``, ``(type, check)``) into ``sums``; ``_Suspect``/``_Unknown`` raised."""
    cls = type(node)
    if cls is np.ndarray:
        _host(node, axis, sizes)
    elif cls is dict:
        for child in node.values():
            _walk(child, axis, leaf_hooks, sums, sizes)
    elif cls is list or cls is tuple:
        first = type(node[0]) if node else None
        if (first is str or first is bytes) and all(
            type(c) is str or type(c) is bytes for c in node
        ):
            if axis == 0:  # a per-sample list of strings
                sizes.append(len(node))
            return
        for child in node:
            _walk(child, axis, leaf_hooks, sums, sizes)
    elif cls in _STATIC:
        return
    else:
        for leaf_type, check in leaf_hooks:
            if isinstance(node, leaf_type):
                if not check(node, axis, sums, sizes):
                    raise _Unknown
                return
        if hasattr(node, "dtype") and hasattr(node, "shape"):
            _other_framework(node, axis, sums, sizes)
        else:
            raise _Unknown


def _other_framework(node: Any, axis: int, sums: list, sizes: list) -> None:
    """TensorFlow and JAX arrays through their backend: one fused sum each, read at once.
    TensorFlow eager tensors go through ``_tf_eager`` first (no TF op where possible).
    Ragged and sparse tensors (``_fields.composite_ops``) sum their stored values, and
    integer ones only give their size (token ids: nothing to read)."""
    framework, values = framework_of(node), node
    if framework == "host":  # NumPy scalars, bfloat16 ndarrays: the general path
        ops = composite_ops(node)
        if ops is None or (axis and not ops.splits_at(node, axis)):
            raise _Unknown  # (a ragged tensor's batch axis is 0: the general path raises)
        framework, values = ops.framework, ops.values(node)
    elif framework == "tensorflow" and _tf_eager(node, axis, sizes):
        return
    be = load_backend(framework)
    shape, dtype = be.shape(node), be.dtype_name(values)
    if len(shape) > axis:
        if shape[axis] is None:
            raise _Unknown
        sizes.append(shape[axis])
    if is_floating(dtype):
        acc = compute_dtype(dtype)
        total = float(be.to_numpy(be.sum(values if dtype == acc else be.cast(values, acc))))
        if not math.isfinite(total):
            raise _Suspect
    elif not (is_integer(dtype) or dtype == "bool"):
        raise _Unknown


def _tf_eager(node: Any, axis: int, sizes: list) -> bool:
    """Handle an eager tensor without a TF op when possible (True): integer and bool ones
    only give their size, float16/32/64 ones in host memory are read in place
    (``_host.tf_view``). A dirty one's ``Found`` is handed on under the tensor itself."""
    eager, _, exact = tf_types()
    if type(node) is not eager:
        return False
    dtype = node._datatype_enum()  # an int; ``.dtype`` costs a Python DType hash
    if dtype in exact:
        shape = node.shape
        if len(shape) > axis:
            sizes.append(shape[axis])
        return True
    view = tf_view(node)  # None unless a float16/32/64 tensor in host memory
    if view is None:
        return False
    try:
        _host(view, axis, sizes)
    except _Suspect as found:
        raise (_Suspect(node, found.args[1]) if found.args else found) from None
    return True
