"""Flatten and rebuild nests of arrays, whatever framework built them.

Containers: dict (any Mapping subclass whose constructor takes pairs, and defaultdict), list,
tuple, namedtuple, dataclass instances, and — when JAX is loaded — any registered JAX pytree
node (flax / equinox / optax states; a dataclass JAX knows, such as an Equinox module, as JAX
flattens it, without its static fields). Everything else is a leaf; ``None`` leaves (a torch
parameter without a gradient) are kept in place and skipped by the numerical functions.

Paths are spelled like ``jax.tree_util.keystr``: ``['opt_state'][0].mu['w']``.
"""

from __future__ import annotations

import collections
import dataclasses
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

from numstab import frameworks
from numstab.errors import InvalidArgumentError

Leaf = Any


class TreeDef(NamedTuple):
    """How to rebuild one node: ``rebuild(children)``; ``children`` are TreeDefs or None (leaf)."""

    rebuild: Callable[[list], Any] | None
    children: tuple


LEAF = TreeDef(None, ())


def _is_namedtuple(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(type(node), "_fields")


def _children(
    node: Any, sparse_as_dense: bool = False
) -> tuple[list[tuple[str, Any]], Callable[[list], Any]] | None:
    """(path suffix, child) pairs and a rebuild function, or None for a leaf."""
    if hasattr(node, "dtype") or node is None:  # an array of any framework, or a scalar
        return _sparse_children(node, sparse_as_dense)
    if isinstance(node, Mapping):
        if type(node) is not dict and type(node).__module__ != "collections":
            # a library's mapping that JAX knows (flax's State, FrozenDict): JAX's own
            # flatten rebuilds it faithfully, where cls(pairs) may not (State nests dicts)
            registered = _jax_children(node)
            if registered is not None:
                return registered
        keys = list(node)
        return [(f"[{k!r}]", node[k]) for k in keys], _mapping_rebuild(node, keys)
    if _is_namedtuple(node):
        return [(f".{f}", getattr(node, f)) for f in node._fields], lambda vs: type(node)(*vs)
    if isinstance(node, (list, tuple)):
        cls = type(node)
        return [(f"[{i}]", c) for i, c in enumerate(node)], lambda vs: cls(vs)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        # a dataclass JAX knows (an Equinox module, a flax struct): its own flatten, which
        # leaves static fields out (an MLP's int sizes were leaves: "integer gradients")
        registered = _jax_children(node)
        if registered is not None:
            return registered
        names = [f.name for f in dataclasses.fields(node) if f.init]
        return [(f".{n}", getattr(node, n)) for n in names], lambda vs: dataclasses.replace(
            node, **dict(zip(names, vs, strict=True))
        )
    return _jax_children(node)


def _mapping_rebuild(node: Mapping, keys: list) -> Callable[[list], Any]:
    """A mapping of ``node``'s type with ``keys`` and new values: ``cls(pairs)``, but for a
    ``defaultdict`` (torch's ``optimizer.state``), whose default factory comes first, as
    JAX's pytree keeps it, and for the mappings built from one mapping (``ChainMap``: one
    map of the values it showed; ``MappingProxyType``)."""
    cls = type(node)
    if isinstance(node, collections.defaultdict):
        factory = node.default_factory
        build = lambda pairs: cls(factory, pairs)
    elif cls in _FROM_ONE_MAPPING:
        build = lambda pairs: cls(dict(pairs))
    else:
        build = cls

    def rebuild(values: list) -> Any:
        try:
            return build(zip(keys, values, strict=True))
        except (TypeError, ValueError) as e:  # a Mapping whose constructor takes no pairs
            raise InvalidArgumentError(
                f"Cannot rebuild a {cls.__qualname__} from (key, value) pairs ({e}): pass a dict"
            ) from e

    return rebuild


#: mapping types whose constructor takes a mapping, not pairs (``ChainMap(zip)`` made a
#: ChainMap over a zip object, ``MappingProxyType(zip)`` raised TypeError, ``Counter(zip)``
#: counted the pairs)
_FROM_ONE_MAPPING = (collections.ChainMap, types.MappingProxyType, collections.Counter)


def _sparse_children(node: Any, dense: bool):
    """A sparse gradient (``tf.IndexedSlices``: an embedding's) as a node with one dense child,
    its rows with repeated indices summed, so that norms, finiteness and clipping are the
    dense gradient's and the rebuilt gradient stays sparse; with ``dense``, the dense
    gradient itself. A ragged or sparse tensor likewise, its child the stored values (a
    framework's ``tree.sparse_children``). None for anything else."""
    for children in frameworks.loaded("tree", "sparse_children"):
        split = children(node, dense)
        if split is not None:
            return split
    return None


def _all_plain_leaves(nodes: list | tuple) -> bool:
    """True when every child is a leaf by ``_children``'s first test and none is sparse
    (a framework's ``tree.sparse_type``: a tuple of types): asked once per distinct type
    (``set(map(type, ...))``: 5 us for 200 tensors, against 17 for ``hasattr`` on each)."""
    sparse = frameworks.loaded("tree", "sparse_type")
    for kind in set(map(type, nodes)):  # a loop: a generator per call measured 0.25 us more
        if kind is _NONE:
            continue
        if not hasattr(kind, "dtype"):
            return False
        for framework_types in sparse:
            if kind in framework_types:
                return False
    return True


_NONE = type(None)


def _jax_children(node: Any):
    """A registered pytree node's children (a framework's ``tree.registered_children``)."""
    for children in frameworks.loaded("tree", "registered_children"):
        return children(node)
    return None


def flatten(tree: Any, *, sparse_as_dense: bool = False) -> tuple[list[Leaf], TreeDef]:
    """Leaves in a deterministic order (containers' own order), and how to rebuild.
    ``tf.IndexedSlices`` give one leaf, their deduplicated rows (rebuilt sparse), or with
    ``sparse_as_dense`` the dense gradient (rebuilt dense); ``tf.RaggedTensor`` and
    ``tf.SparseTensor`` one leaf, their stored values (rebuilt with the same layout)."""
    leaves: list[Leaf] = []
    return leaves, _flatten(tree, leaves, sparse_as_dense)


def flatten_with_paths(
    tree: Any, *, sparse_as_dense: bool = False
) -> tuple[list[tuple[str, Leaf]], TreeDef]:
    """``flatten`` with each leaf's path (as ``leaves_with_paths`` spells it), in one walk:
    a sparse gradient is converted once, not once per question."""
    leaves: list[Leaf] = []
    paths: list[str] = []
    treedef = _flatten(tree, leaves, sparse_as_dense, paths, "")
    return list(zip(paths, leaves, strict=True)), treedef


def _flatten(
    node: Any, leaves: list, dense: bool, paths: list | None = None, prefix: str = ""
) -> TreeDef:
    if type(node) in (list, tuple) and _all_plain_leaves(node):
        # the common gradient list (every child a leaf by _children's first test): what the
        # generic path below builds, without two calls per leaf
        leaves.extend(node)
        if paths is not None:
            paths.extend(f"{prefix}[{i}]" for i in range(len(node)))
        return TreeDef(type(node), (LEAF,) * len(node))  # rebuild: list(vs) or tuple(vs)
    split = _children(node, dense)
    if split is None:
        leaves.append(node)
        if paths is not None:
            paths.append(prefix)
        return LEAF
    pairs, rebuild = split
    if paths is None:
        return TreeDef(rebuild, tuple(_flatten(child, leaves, dense) for _, child in pairs))
    children = (_flatten(c, leaves, dense, paths, prefix + suffix) for suffix, c in pairs)
    return TreeDef(rebuild, tuple(children))


def unflatten(treedef: TreeDef, leaves: list[Leaf]) -> Any:
    """Rebuild the tree that ``flatten`` described, with new leaves."""
    flat = treedef.rebuild in _FLAT and isinstance(leaves, (list, tuple))
    if flat and len(leaves) == len(treedef.children):
        return treedef.rebuild(leaves)  # flatten's flat list or tuple: no call per leaf
    it = iter(leaves)
    out = _unflatten(treedef, it)
    if next(it, _END) is not _END:
        raise ValueError("unflatten received more leaves than the tree holds")
    return out


_END = object()
#: the ``rebuild`` of flatten's flat lists and tuples (every child a leaf); nothing else uses
#: a bare type as ``rebuild``
_FLAT = (list, tuple)


def _unflatten(treedef: TreeDef, it: Iterator) -> Any:
    if treedef.rebuild is None:
        return next(it)
    return treedef.rebuild([_unflatten(child, it) for child in treedef.children])


def leaves_with_paths(
    tree: Any, prefix: str = "", *, sparse_as_dense: bool = False
) -> Iterator[tuple[str, Leaf]]:
    """(path, leaf) for every leaf, paths spelled like jax.tree_util.keystr; a
    ``tf.IndexedSlices`` keeps its own path (see ``flatten``)."""
    split = _children(tree, sparse_as_dense)
    if split is None:
        yield prefix, tree
        return
    for suffix, child in split[0]:
        yield from leaves_with_paths(child, prefix + suffix, sparse_as_dense=sparse_as_dense)
