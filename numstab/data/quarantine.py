"""Write flagged samples to disk as ``.npz`` (no pickle), atomically (temp file, fsync,
rename: ``numstab.guard.snapshots.write_npz_atomic``).

One file per batch with flagged samples: ``{prefix}-e{epoch:04d}-b{batch:06d}{tag}.npz``
(``tag`` is empty in the main process; in a torch DataLoader worker it is
``-w{worker:02d}-p{pid}-{8 hex digits}``, unique per worker process, so workers that number
their batches alike never write the same file) holding

- ``index``, ``position`` (int64): global stream indices and positions in the batch;
- ``reason`` (str): ``"nonfinite"`` or ``"outlier"`` per sample;
- ``paths`` (str): the field paths, in order; ``field_<i>``: the flagged samples' values of
  path ``i`` (batch axis first; bfloat16 saved as float32; strings as str arrays).

Every array is plain (no object dtype): ``np.load(path, allow_pickle=False)`` reads it.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import numpy as np

from numstab.data._fields import Batch
from numstab.errors import InvalidArgumentError
from numstab.guard.snapshots import write_npz_atomic


def check_destination(directory: Any, prefix: Any) -> str | None:
    """``directory`` as a str path (None: no quarantine), after checking that it is a path
    (str, bytes, ``os.PathLike``) that is not an existing file, and that ``prefix`` is a
    non-empty file-name prefix: no path separator, so no file lands outside ``directory``."""
    if (
        not isinstance(prefix, str)
        or not prefix
        or prefix in (".", "..")
        or any(sep and sep in prefix for sep in (os.sep, os.altsep))
    ):
        raise InvalidArgumentError(
            "Expected quarantine_prefix to be a non-empty file-name prefix without a path "
            f"separator. Received: quarantine_prefix={prefix!r}"
        )
    if directory is None:
        return None
    if not isinstance(directory, str | bytes | os.PathLike):
        raise InvalidArgumentError(
            f"Expected quarantine_dir to be a path (str or os.PathLike) or None. Received: "
            f"quarantine_dir={directory!r}"
        )
    directory = os.fsdecode(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise InvalidArgumentError(
            f"Expected quarantine_dir to be a directory. Received: quarantine_dir="
            f"{directory!r}, an existing file"
        )
    return directory


def check_fields(parts: Batch) -> None:
    """``InvalidArgumentError`` for a batched ragged field, before anything is recorded: its
    samples have no fixed size, so no plain array holds them (a sparse field is saved
    dense)."""
    for field in parts.fields:
        ops = field.composite
        if field.batched and ops is not None and not ops.fixed_size(field.value):
            raise InvalidArgumentError(
                f"Expected fields with fixed-size samples under quarantine_dir (the files hold "
                f"plain arrays). Received: a ragged tensor at {field.label}; quarantine "
                "without it, or pad it first"
            )


def write(
    directory: str,
    prefix: str,
    epoch: int,
    batch_number: int,
    parts: Batch,
    batch_axis: int,
    positions: np.ndarray,
    indices: np.ndarray,
    reasons: list[str],
    tag: str = "",
) -> str:
    arrays: dict[str, np.ndarray] = {
        "index": np.asarray(indices, dtype=np.int64),
        "position": np.asarray(positions, dtype=np.int64),
        "reason": np.asarray(reasons, dtype=str),
    }
    paths = []
    for field in parts.fields:
        if not field.batched:
            continue
        if field.backend is None:  # a per-sample list of str / bytes
            values = np.asarray([field.value[i] for i in positions])
        else:
            values = np.moveaxis(field.backend.to_numpy(field.value), batch_axis, 0)[positions]
        arrays[f"field_{len(paths)}"] = np.ascontiguousarray(values)
        paths.append(field.label)
    arrays["paths"] = np.asarray(paths, dtype=str)
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, f"{prefix}-e{epoch:04d}-b{batch_number:06d}{tag}.npz")
    write_npz_atomic(target, arrays)
    return target


def worker_tag(worker: int) -> str:
    """The file-name tag of a DataLoader worker process: ``-w{worker:02d}-p{pid}-{uuid}``
    (8 hex digits of a random uuid: a pid may be reused by a later epoch's worker)."""
    return f"-w{worker:02d}-p{os.getpid()}-{uuid.uuid4().hex[:8]}"
