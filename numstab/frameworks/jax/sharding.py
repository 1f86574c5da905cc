"""What numstab's JAX code needs to know about sharding: the manual axes a value varies over
inside ``shard_map`` (and the cast that makes it vary over more, whose transpose is a psum),
and the PartitionSpec of a value on a mesh with Explicit axes."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

_EXPLICIT = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)  # jax >= 0.5
typeof = getattr(jax, "typeof", None) or jax.core.get_aval  # an abstract value (old jax: get_aval)


def varying(x: Any) -> frozenset:
    """The manual axes (``shard_map``) that ``x`` (an array or an abstract value) varies over."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(getattr(manual, "varying", ()) or ())
    return frozenset(getattr(aval, "vma", None) or ())


def pvary(x: jax.Array, axes: frozenset) -> jax.Array:
    """``x`` cast to vary over ``axes`` too (its transpose is a psum over them)."""
    if not axes:
        return x
    axes = tuple(sorted(axes, key=str))
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)


def explicit_spec(x: Any) -> P | None:
    """``x``'s PartitionSpec when its mesh has Explicit axes (sharding in the type), else None."""
    if _EXPLICIT is None:
        return None
    sharding = getattr(x, "sharding", None) if isinstance(x, jax.ShapeDtypeStruct) else None
    if sharding is None:
        try:
            sharding = typeof(x).sharding
        except (TypeError, AttributeError):
            return None
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or _EXPLICIT not in getattr(mesh, "axis_types", ()):
        return None
    return sharding.spec


def unsharded_along(x: jax.Array, axis: int) -> jax.Array:
    """``x`` with ``axis`` replicated (an all-gather) when an Explicit mesh axis shards it:
    slicing or compressing a sharded axis to a size the mesh does not divide is undefined."""
    spec = explicit_spec(x)
    if spec is None or axis >= len(spec) or spec[axis] is None:
        return x
    return jax.sharding.reshard(x, P(*spec[:axis], None, *spec[axis + 1 :]))
