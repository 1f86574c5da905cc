"""What numstab's tree functions need from torch: modules and state dicts as named leaves,
the layout of sparse gradients, and the containers of torch libraries (a transformers
``Cache``), which are never imported here."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from numstab.errors import InvalidArgumentError


def named_leaves(tree: Any) -> list[tuple[str, Any]] | None:
    """A module's ``named_parameters`` then floating ``named_buffers``; a state dict (a
    non-empty mapping of str to tensors, a ``None`` among them skipped: a dict of grads by
    name with a frozen parameter's) as its items, a transformers ``Cache`` among them
    as its tensors under the key (a Hugging Face ``ModelOutput``: ``"logits"``,
    ``"cache.layers[0].keys"``, as ``"logits"`` without the cache); None for anything else, a
    Keras layer on Keras' torch backend included (a ``torch.nn.Module`` too: the Keras hook
    names its variables by their Keras paths, as on the other backends)."""
    if isinstance(tree, torch.nn.Module) and not _is_keras_layer(tree):
        buffers = [(n, b) for n, b in tree.named_buffers() if b.is_floating_point()]
        return list(tree.named_parameters()) + buffers
    if not isinstance(tree, Mapping) or len(tree) == 0:
        return None
    items = [(k, x) for k, x in tree.items() if x is not None]
    if not all(isinstance(k, str) for k in tree):
        return None
    if all(isinstance(x, torch.Tensor) for _, x in items):
        return items  # an all-None mapping: no leaves either way
    if all(isinstance(x, torch.Tensor) or _is_cache(x) for _, x in items):
        from numstab.tree import leaves_with_paths

        return [pair for k, x in items for pair in leaves_with_paths(x, k)]
    return None


def _is_keras_layer(module: torch.nn.Module) -> bool:
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(module, keras.Layer)


def sparse_layout(leaf: Any) -> Any | None:
    """The layout of a tensor that is not strided (``torch.sparse_coo``, ...), else None."""
    if isinstance(leaf, torch.Tensor) and leaf.layout != torch.strided:
        return leaf.layout
    return None


def node_children(cls: type) -> Callable | None:
    """``numstab.tree``'s hook for a type no container rule knows: a transformers ``Cache``
    (what a Hugging Face model returns as its ``cache`` / ``past_key_values``) opens to its
    tensors (``_cache_children``); None for any other type. Asked once per type."""
    cache = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    if isinstance(cache, type) and issubclass(cls, cache):
        return _cache_children
    return None


def _is_cache(value: Any) -> bool:
    return node_children(type(value)) is not None


#: a transformers cache layer's tensors, by their public names: ``keys`` and ``values`` (every
#: attention layer; ``None`` before its first update), a sparse-attention layer's
#: ``indexer_keys``, a linear-attention layer's ``conv_states`` and ``recurrent_states``
#: (dicts by state index)
_CACHE_STATES = ("keys", "values", "indexer_keys", "conv_states", "recurrent_states")


def _cache_children(cache: Any) -> tuple[list[tuple[str, Any]], Callable[[list], Any]]:
    """``.layers[i].keys``, ``.layers[i].values`` (and the other ``_CACHE_STATES`` a layer
    holds), layer by layer; an ``EncoderDecoderCache``: its two caches. Read, not rebuilt."""
    parts = ("self_attention_cache", "cross_attention_cache")
    if all(hasattr(cache, p) for p in parts):
        pairs = [(f".{p}", getattr(cache, p)) for p in parts]
    else:
        pairs = [
            (f".layers[{i}].{name}", state)
            for i, layer in enumerate(getattr(cache, "layers", None) or ())
            for name in _CACHE_STATES
            if isinstance(state := getattr(layer, name, None), (torch.Tensor, dict))
        ]
    return pairs, functools.partial(_not_rebuilt, type(cache))


def _not_rebuilt(cls: type, values: list) -> Any:
    raise InvalidArgumentError(
        "Expected a tree that numstab can rebuild. Received: a transformers "
        f"{cls.__name__}, whose tensors numstab reads (find_nonfinite, assert_finite, "
        "watch) but does not rebuild into a cache: pass its tensors, or the model's output "
        "without it (use_cache=False)"
    )
