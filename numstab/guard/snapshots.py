"""Snapshots of training state: an in-memory ring, and ``.npz`` files written atomically.

On disk a snapshot is one ``.npz`` holding plain arrays ``a0, a1, ...`` and ``__meta__``, the
UTF-8 JSON of the tree's structure (dicts with any scalar keys, lists, tuples, Python scalars,
non-finite floats, and the arrays' dtypes). It is read with ``np.load(allow_pickle=False)``:
nothing is ever unpickled, and a file holding object arrays is refused. bfloat16 arrays are
stored as their uint16 bits and restored with ``ml_dtypes``.

Atomicity: the file is written to ``.tmp-<host>-<pid>-<random>.npz`` in the same directory,
flushed and fsynced, then ``os.replace``-d onto its final name (atomic on POSIX and Windows),
and the directory is fsynced. A crash at any point leaves either the previous snapshots only,
or the new complete one; stray ``.tmp-*`` files are ignored, and the next write removes the
stale ones only (``_stale``): never another live process's file being written (another rank
of a job sharing the folder).
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import re
import socket
import tempfile
import time
import zipfile
from typing import Any, NamedTuple

from numstab import _validate as v
from numstab.errors import InvalidArgumentError

META_KEY = "__meta__"
_NAME = re.compile(r"^snapshot-(\d+)\.npz$")
# a temporary file: ``.tmp-<host>-<pid>-<random>.npz`` (``.tmp-<random>.npz`` before)
_TMP = re.compile(r"^\.tmp-(?:([A-Za-z0-9._]+)-(\d+)-)?[a-z0-9_]+\.npz$")
STALE_AFTER_S = 3600.0  # a temporary file untouched this long is a crashed write's


class Snapshot(NamedTuple):
    """One in-memory snapshot: the step it was taken after, the framework's payload (model,
    optimizer...), the guard state at that time, and the LR factor then in effect."""

    step: int
    payload: Any
    guard_state: Any
    lr_factor: float


class SnapshotRing:
    """The last ``keep`` snapshots, newest last."""

    def __init__(self, keep: int) -> None:
        self._ring: collections.deque[Snapshot] = collections.deque(maxlen=keep)

    def __len__(self) -> int:
        return len(self._ring)

    def add(self, snapshot: Snapshot) -> None:
        self._ring.append(snapshot)

    def latest(self) -> Snapshot | None:
        return self._ring[-1] if self._ring else None

    def drop_latest(self) -> None:
        """Forget the newest snapshot unless it is the only one (go one further back)."""
        if len(self._ring) > 1:
            self._ring.pop()

    def steps(self) -> list[int]:
        return [s.step for s in self._ring]

    def clear(self) -> None:
        self._ring.clear()


# -- tree <-> arrays + JSON ----------------------------------------------------------------------


def encode_tree(tree: Any) -> dict[str, Any]:
    """``{"a0": ndarray, ..., "__meta__": uint8 JSON}`` for a tree of NumPy arrays/scalars,
    dicts, lists, tuples and Python scalars. Anything else raises InvalidArgumentError."""
    import numpy as np

    arrays: dict[str, Any] = {}
    meta = _encode(tree, arrays, "tree")
    arrays[META_KEY] = np.frombuffer(json.dumps(meta).encode("utf-8"), np.uint8)
    return arrays


def _encode(node: Any, arrays: dict[str, Any], where: str) -> Any:
    import numpy as np

    if isinstance(node, (np.ndarray, np.generic)):
        arr = np.asarray(node)
        dtype = arr.dtype.name
        if dtype == "bfloat16":
            arr = arr.view(np.uint16)
        elif arr.dtype.hasobject or dtype.startswith(("void", "str", "bytes")):
            raise InvalidArgumentError(
                f"Expected numeric arrays in a snapshot. Received: {where} with dtype={dtype}"
            )
        key = f"a{len(arrays)}"
        arrays[key] = arr
        return {"$a": key, "dtype": dtype}
    if node is None or isinstance(node, (bool, int, str)):
        return node
    if isinstance(node, float):
        return node if math.isfinite(node) else {"$f": repr(node)}
    if isinstance(node, dict):
        return {
            "$d": [
                [_encode(k, arrays, where), _encode(x, arrays, f"{where}[{k!r}]")]
                for k, x in node.items()
            ]
        }
    if isinstance(node, list):
        return [_encode(x, arrays, f"{where}[{i}]") for i, x in enumerate(node)]
    if isinstance(node, tuple):
        return {"$t": [_encode(x, arrays, f"{where}[{i}]") for i, x in enumerate(node)]}
    raise InvalidArgumentError(
        f"Expected arrays, dicts, lists, tuples or Python scalars in a snapshot. Received: "
        f"{where} of type {type(node).__name__}"
    )


def decode_tree(arrays: Any) -> Any:
    """The tree :func:`encode_tree` stored (``arrays``: a mapping such as ``np.load``'s)."""
    if META_KEY not in arrays:
        raise InvalidArgumentError("Not a numstab snapshot: the file holds no __meta__ entry")
    meta = json.loads(bytes(arrays[META_KEY]).decode("utf-8"))
    return _decode(meta, arrays)


def _decode(node: Any, arrays: Any) -> Any:
    if isinstance(node, list):
        return [_decode(x, arrays) for x in node]
    if not isinstance(node, dict):
        return node
    if "$a" in node:
        arr = arrays[node["$a"]]
        if node["dtype"] == "bfloat16":
            import ml_dtypes

            arr = arr.view(ml_dtypes.bfloat16)
        return arr
    if "$f" in node:
        return float(node["$f"])
    if "$t" in node:
        return tuple(_decode(x, arrays) for x in node["$t"])
    return {_decode(k, arrays): _decode(x, arrays) for k, x in node["$d"]}


# -- files ---------------------------------------------------------------------------------------


def write_npz_atomic(path: str | os.PathLike, arrays: dict[str, Any]) -> None:
    """Write ``arrays`` to ``path`` so that ``path`` is either untouched or complete."""
    import numpy as np

    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    prefix = f".tmp-{_host()}-{os.getpid()}-"
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".npz", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)


def _host() -> str:
    """This machine's name as it goes into a temporary file's name (``[A-Za-z0-9._]``)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine runs (POSIX: signal 0). On Windows False:
    ``os.kill`` would end it there, and the OS refuses to delete a file a process still has
    open, so removing a live writer's file fails harmlessly."""
    if os.name == "nt":
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's live process
        return True
    return True


def _stale(path: str) -> bool:
    """Whether the temporary file at ``path`` is a crashed write's, never a write in flight:
    written by a process of this machine that no longer runs, or untouched for
    ``STALE_AFTER_S`` (another machine's, sharing the folder; a name without host and pid,
    of an older version; a pid reused since). Another name, or a file gone: False."""
    m = _TMP.match(os.path.basename(path))
    if m is None:
        return False
    host, pid = m.group(1), m.group(2)
    if host == _host() and pid is not None and not _alive(int(pid)):
        return True
    try:
        return time.time() - os.stat(path).st_mtime > STALE_AFTER_S
    except OSError:
        return False


def _fsync_directory(directory: str) -> None:
    with contextlib.suppress(OSError):  # not possible on every platform (Windows)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_npz(path: str | os.PathLike) -> Any:
    """The tree stored at ``path``; never unpickles (object arrays raise)."""
    import numpy as np

    try:
        with np.load(os.fspath(path), allow_pickle=False) as data:
            return decode_tree({k: data[k] for k in data.files})
    except (ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        # pickled or object arrays ("... when allow_pickle=False"), a truncated or foreign
        # file (BadZipFile, EOFError, a missing __meta__)
        raise InvalidArgumentError(
            "Expected a numstab snapshot file (an .npz of plain arrays and its __meta__; "
            f"never unpickled). Received: {os.fspath(path)} ({type(exc).__name__}: {exc})"
        ) from None


def _name(step: int) -> str:
    """The file name the writer gives the snapshot of ``step`` (zero-padded to 9 digits)."""
    return f"snapshot-{step:09d}.npz"


class SnapshotDirectory:
    """``snapshot-<step>.npz`` files in ``directory`` (the step zero-padded to 9 digits), the
    newest ``keep`` kept; writing a step removes the files of later steps (``save``).

    ``writer=False``: a reader of files another process writes (a rank other than 0 of a
    data-parallel group whose ranks hold the same state): ``save`` writes and removes
    nothing, and returns the path the writer gives the step; ``steps``/``load`` read."""

    def __init__(self, directory: str | os.PathLike, keep: int = 2, *, writer: bool = True) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise InvalidArgumentError(
                f"Expected snapshot_dir to be a path. Received: snapshot_dir={directory!r}"
            )
        self.directory = os.fspath(directory)
        self.keep = keep
        self.writer = writer
        os.makedirs(self.directory, exist_ok=True)

    def path(self, step: int) -> str:
        return os.path.join(self.directory, _name(step))

    def steps(self) -> list[int]:
        """Steps of the complete snapshot files, oldest first. Only the names the writer
        produces (the step zero-padded to 9 digits) count: temporary files and any other
        ``snapshot-*.npz`` (say ``snapshot-7.npz``) are ignored, never loaded nor pruned."""
        found = (_NAME.match(name) for name in os.listdir(self.directory))
        return sorted(int(m.group(1)) for m in found if m and m.group(0) == _name(int(m.group(1))))

    def save(self, step: int, tree: Any) -> str:
        """Write the snapshot of ``step`` (atomically), then remove every file of a later
        step and all but the newest ``keep`` of the others. A later step's file is of a
        trajectory the writer does not continue (an earlier run's, in a folder it did not
        resume from; or the steps after an older file it resumed from): kept, it stayed the
        newest file, the one a resume loads, and the pruning removed the file just written.
        Stale temporary files (crashed writes, ``_stale``) go too; another process's file
        being written stays. Not a ``writer``: nothing is written nor removed."""
        path = self.path(step)
        if not self.writer:
            return path
        write_npz_atomic(path, encode_tree(tree))
        steps = self.steps()
        earlier = [s for s in steps if s <= step]
        for old in [s for s in steps if s > step] + earlier[: -self.keep]:
            with contextlib.suppress(OSError):
                os.unlink(self.path(old))
        for name in os.listdir(self.directory):  # leftovers of crashed writes
            if _stale(os.path.join(self.directory, name)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.directory, name))
        return path

    def load(self, step: int | None = None) -> tuple[int, Any]:
        """``(step, tree)`` of the snapshot at ``step``, by default the newest."""
        steps = self.steps()
        if not steps:
            raise InvalidArgumentError(f"Expected a snapshot in {self.directory}. Found none.")
        if step is None:
            step = steps[-1]
        elif v.check_int("step", step) not in steps:
            raise InvalidArgumentError(
                f"Expected step to be one of the snapshots in {self.directory}: {steps}. "
                f"Received: step={step!r}"
            )
        return step, load_npz(self.path(step))
