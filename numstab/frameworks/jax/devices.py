"""The devices JAX sees (imports JAX)."""

from __future__ import annotations


def devices() -> list[str]:
    import jax

    return [str(d) for d in jax.devices()]
