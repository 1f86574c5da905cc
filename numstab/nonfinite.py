"""Which leaves of a tree hold NaN or inf, where, and how many: ``find_nonfinite``,
``assert_finite``.

Two passes: one finiteness flag per leaf on the device (``Backend.leaf_finite``: the same
work as the per-leaf ``isfinite(x).all()`` a user writes, without a host read per leaf),
read to the host once; then counts and the finite range for the offending leaves only.
Both functions read values on the host: they are eager-only and raise
``InvalidArgumentError`` under jit / tf.function / torch.compile (use ``numstab.all_finite``
there).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from numstab import _validate as v
from numstab import frameworks
from numstab._dispatch import HOST, framework_of, host_array, resolve_backend, to_backend
from numstab._finite_reads import holds_nonfinite, read_as
from numstab._layouts import dense_only
from numstab.backends import load_backend
from numstab.backends._base import Backend, native_op
from numstab.errors import InvalidArgumentError, NonFiniteError
from numstab.tree import leaves_with_paths

Tree = Any

#: dtypes whose counts and ranges are read as they are (narrower floats: in float32)
_WIDE = ("float64", "float128")


@dataclasses.dataclass(frozen=True)
class NonFiniteRecord:
    """One leaf holding NaN or inf. ``finite_min`` / ``finite_max`` are over its finite
    elements (None when it has none)."""

    path: str
    nan_count: int
    posinf_count: int
    neginf_count: int
    shape: tuple[int, ...]
    dtype: str
    finite_min: float | None
    finite_max: float | None

    @property
    def inf_count(self) -> int:
        return self.posinf_count + self.neginf_count

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        span = (
            "no finite values"
            if self.finite_min is None
            else f"finite range [{self.finite_min:.6g}, {self.finite_max:.6g}]"
        )
        return (
            f"{self.path or '<root>'}: {self.nan_count} nan, {self.posinf_count} +inf, "
            f"{self.neginf_count} -inf of {self.size} ({self.dtype}{list(self.shape)}); {span}"
        )


def named_leaves(tree: Tree) -> list[tuple[str, Any]]:
    """(path, leaf) pairs. A torch module gives ``named_parameters`` then floating
    ``named_buffers`` ("layers.3.attn.q_proj.weight"); a flat dict of str -> torch.Tensor (a
    state dict) gives its keys; a Keras layer or model gives its variables' ``.path``
    ("dense/kernel"); anything else follows ``numstab.tree`` ("['opt_state'][0].mu['w']")."""
    for named in frameworks.loaded("tree", "named_leaves"):
        found = named(tree)
        if found is not None:
            return found
    unwrappers = frameworks.loaded("tree", "unwrap")
    pairs = leaves_with_paths(tree)
    for unwrap in unwrappers:
        pairs = [(path, unwrap(leaf)) for path, leaf in pairs]
    return pairs


@dense_only
def find_nonfinite(tree: Tree, *, backend: str | None = None) -> list[NonFiniteRecord]:
    """One ``NonFiniteRecord`` per leaf holding NaN or +-inf, in leaf order; ``[]`` if none.

    Integer, bool, empty and ``None`` leaves cannot be non-finite and are skipped, and so are
    float6/float4 leaves (formats without NaN or inf); float8 leaves are read upcast to
    float32 (exact; ``numstab._finite_reads``), their records keep their dtype. A complex
    element counts once: NaN when a part is NaN, else +inf when a part is +inf, else -inf
    when a part is -inf; its range is over the parts of the finite elements. Host
    sync: one read of a per-leaf flag vector, then one read of the counts and one of the
    ranges of the offending leaves. Eager only (``InvalidArgumentError`` while tracing).
    """
    be, named, reads = _floating_leaves(tree, backend)
    if not named:
        return []
    found: dict[int, NonFiniteRecord] = {}
    for group_be, group in _by_backend(be, reads):  # host leaves: read on the host, exactly
        bad = [group[i] for i in _nonfinite_indices(group_be, [reads[i] for i in group])]
        if bad:
            records = _records(group_be, [named[i] for i in bad], [reads[i] for i in bad])
            found.update(zip(bad, records, strict=True))
    return [found[i] for i in sorted(found)]


def _by_backend(be: Backend, reads: list) -> list[tuple[Backend, list[int]]]:
    """The indices of ``reads`` by the backend that reads them: host (NumPy) leaves by the
    NumPy backend, the rest by ``be`` (one group when all are of one kind)."""
    if be.name == "numpy":
        return [(be, list(range(len(reads))))]
    host = [i for i, x in enumerate(reads) if framework_of(x) == HOST]
    if not host:
        return [(be, list(range(len(reads))))]
    rest = [i for i, x in enumerate(reads) if framework_of(x) != HOST]
    return [(load_backend("numpy"), host)] + ([(be, rest)] if rest else [])


def assert_finite(tree: Tree, name: str = "grads", *, backend: str | None = None) -> None:
    """Raise ``NonFiniteError`` naming every offending leaf of ``tree`` (a host sync).

    The error's ``paths``, ``nan_count`` and ``inf_count`` sum over the leaves, and
    ``records`` holds the ``NonFiniteRecord`` list. Eager only, like ``find_nonfinite``.
    """
    if not isinstance(name, str) or not name.strip():
        raise InvalidArgumentError(
            f"Expected name to be a non-empty str (it starts the message). Received: name={name!r}"
        )
    if isinstance(tree, Iterator):  # read twice below: an iterator once, as a list
        tree = list(tree)
    records = find_nonfinite(tree, backend=backend)
    if not records:
        return
    shown = "; ".join(str(r) for r in records[:10])
    more = f"; and {len(records) - 10} more" if len(records) > 10 else ""
    err = NonFiniteError(
        f"{name} holds non-finite values in {len(records)} leaf(s): {shown}{more}",
        framework=_framework_name(tree, backend),
        nan_count=sum(r.nan_count for r in records),
        inf_count=sum(r.inf_count for r in records),
        paths=tuple(r.path for r in records),
    )
    err.records = records
    raise err


def _framework_name(tree: Tree, backend: str | None) -> str:
    be, _, _ = _floating_leaves(tree, backend)
    return be.name


def _floating_leaves(
    tree: Tree, backend: str | None
) -> tuple[Backend, list[tuple[str, Any]], list[Any]]:
    """(backend, (path, leaf) of every non-empty leaf that can hold NaN or inf, and the
    arrays to read for them: ``numstab._finite_reads.read_as`` of each leaf)."""
    named = [(p, x) for p, x in named_leaves(tree) if x is not None]
    be = resolve_backend(*(x for _, x in named), backend=backend)
    out, reads = [], []
    host_be = load_backend("numpy")
    for path, leaf in named:
        # host data is read on the host as NumPy reads it (float64 1e300 is finite; JAX
        # without x64 would make it float32 inf): no framework copy is made of it
        on_host = framework_of(leaf) == HOST
        leaf_be = host_be if on_host else be
        leaf = host_array(leaf, "tree leaves") if on_host else to_backend(be, leaf)
        if leaf_be.is_tracing(leaf):
            raise InvalidArgumentError(
                "Expected concrete arrays: find_nonfinite and assert_finite read values on "
                "the host and cannot run under jax.jit, tf.function or torch.compile (use "
                f"numstab.all_finite there). Received: a traced leaf at {path or '<root>'}"
            )
        dtype = leaf_be.dtype_name(leaf)
        if (v.is_floating(dtype) or holds_nonfinite(dtype)) and leaf_be.size(leaf, dtype) != 0:
            out.append((path, leaf))
            reads.append(read_as(leaf_be, leaf, dtype))
    return be, out, reads


def _nonfinite_indices(be: Backend, leaves: list) -> list[int]:
    """Indices of the leaves holding NaN or inf: one finiteness flag per leaf, computed on
    the device (the backend's cheapest pass), read to the host once."""
    with be.float_errors_ignored():
        flags = be.to_numpy(native_op(be, "leaf_finite")(leaves))
    return [i for i, ok in enumerate(flags.reshape(-1).tolist()) if not ok]


def _elements(be: Backend, leaf: Any, read: Any) -> tuple[Any, Any, Any]:
    """(one real value per element of ``leaf`` with its class: NaN, +inf, -inf or finite;
    the values its finite range is taken over; and their finiteness), in float32, or
    float64 and wider where the leaf is. A complex element (``read`` is its (real, imag)
    pairs) is NaN when a part is NaN, else +inf when a part is +inf, else -inf when a part
    is -inf, and its range is over the parts of the finite elements."""
    dtype = be.dtype_name(read)
    x = read if dtype in _WIDE else be.cast(read, "float32")
    if not v.is_complex(be.dtype_name(leaf)):
        finite = be.isfinite(x)
        return x, x, finite
    inf = float("inf")
    nan = be.count(x != x, -1, "int32") > 0
    pos = be.count(x == inf, -1, "int32") > 0
    neg = be.count(x == -inf, -1, "int32") > 0
    zero = be.asarray(0.0, be.dtype_name(x), like=x)
    classes = be.where(nan, float("nan"), be.where(pos, inf, be.where(neg, -inf, zero)))
    finite = be.isfinite(classes)
    return classes, x, be.reshape(finite, (*be.shape(finite), 1))


def _records(be: Backend, named: list[tuple[str, Any]], reads: list) -> list[NonFiniteRecord]:
    counts, ranges = [], []
    inf = float("inf")
    wide = "float64" if any(be.dtype_name(x) in _WIDE for x in reads) else "float32"
    with be.float_errors_ignored():
        for (_, leaf), read in zip(named, reads, strict=True):
            classes, values, finite = _elements(be, leaf, read)
            n_finite = be.count(be.isfinite(classes), None, be.index_dtype)
            n_pos = be.count(classes == inf, None, be.index_dtype)
            n_neg = be.count(classes == -inf, None, be.index_dtype)
            counts.append(be.stack([n_finite, n_pos, n_neg]))
            high = be.max(be.where(finite, values, -inf))
            low = -be.max(be.where(finite, -values, -inf))
            ranges.append(be.stack([be.cast(low, wide), be.cast(high, wide)]))
        counts_h = be.to_numpy(be.stack(counts)).tolist()
        ranges_h = be.to_numpy(be.stack(ranges)).tolist()
    out = []
    for (path, leaf), (n_finite, n_pos, n_neg), (low, high) in zip(
        named, counts_h, ranges_h, strict=True
    ):
        shape = tuple(int(d) for d in be.shape(be.elements(leaf)))  # nested: flat
        size = math.prod(shape)
        has_finite = n_finite > 0
        out.append(
            NonFiniteRecord(
                path=path,
                nan_count=int(size - n_finite - n_pos - n_neg),
                posinf_count=int(n_pos),
                neginf_count=int(n_neg),
                shape=shape,
                dtype=be.dtype_name(leaf),
                finite_min=float(low) if has_finite else None,
                finite_max=float(high) if has_finite else None,
            )
        )
    return out
