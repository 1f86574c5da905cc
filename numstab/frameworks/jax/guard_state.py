"""The training guard's state (and its decision: ``PackedDecision``) on JAX in few arrays, for
jitted steps on a GPU or TPU.

A ``policy.GuardState`` is 11 arrays. Each is one more buffer in and out of the user's jitted
step (host dispatch time), and XLA:GPU updates most of them in their own tiny kernel: the
bare decision adds ~17 launches to a step. :class:`PackedGuardState` holds the same values
in two arrays, so the next state leaves the step as two concatenations, one kernel each:

    floats  float32 [W_loss + W_norm + 1]  the loss window, the grad-norm window, lr_factor
    ints    int32   [4 + R + 3]            the windows' count and position (loss, then
                                           grad norm), the R bad-step flags, bad_position,
                                           good_since_snapshot, step

Compiled for an H200 (``benchmarks/xla_gpu_kernels.py``), the guarded 4x256 MLP step goes
from 66 kernels to 50, against 49 for the bare step plus the norms and the skip select. On
XLA:CPU the same packing made that step 1-12% slower in three runs of ``benchmarks/guard.py
--quick`` (its kernels run concurrently on the cores, and the concatenations join them), so
the optax guard (``OptaxGuard.init``) and the Keras callback's device mode on JAX pack only a
state that lives on an accelerator (docs/semantics.md §16.12). The values are the same
either way.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from numstab.errors import InvalidArgumentError
from numstab.guard import policy
from numstab.guard.deferred import ROW_COLUMNS, decisions_from_rows
from numstab.guard.spikes import WindowState

Sizes = tuple[int, int, int]  # the loss window, the grad-norm window, rollback_window


@jax.tree_util.register_pytree_node_class
class PackedGuardState:
    """A ``policy.GuardState`` as two arrays (see the module docstring); ``unpack()`` gives
    it back. ``sizes`` (static) is (loss window, grad-norm window, rollback window)."""

    def __init__(self, floats: Any, ints: Any, sizes: Sizes) -> None:
        self.floats, self.ints, self.sizes = floats, ints, sizes

    def tree_flatten(self) -> tuple[tuple[Any, Any], Sizes]:
        return (self.floats, self.ints), self.sizes

    @classmethod
    def tree_unflatten(cls, sizes: Sizes, leaves: Any) -> PackedGuardState:
        return cls(*leaves, sizes)

    @classmethod
    def pack(cls, s: policy.GuardState) -> PackedGuardState:
        loss, norm = s.loss_window, s.grad_norm_window
        floats = jnp.concatenate([loss.values, norm.values, jnp.reshape(s.lr_factor, (1,))])
        counters = [loss.count, loss.position, norm.count, norm.position]
        tail = [s.bad_position, s.good_since_snapshot, s.step]
        ints = jnp.concatenate([jnp.stack(counters), s.bad_flags, jnp.stack(tail)])
        sizes = (loss.values.shape[0], norm.values.shape[0], s.bad_flags.shape[0])
        return cls(floats, ints.astype(jnp.int32), sizes)

    def unpack(self) -> policy.GuardState:
        w_loss, w_norm, r = self.sizes
        f, i = self.floats, self.ints
        return policy.GuardState(
            loss_window=WindowState(f[:w_loss], i[0], i[1]),
            grad_norm_window=WindowState(f[w_loss : w_loss + w_norm], i[2], i[3]),
            bad_flags=i[4 : 4 + r],
            bad_position=i[4 + r],
            good_since_snapshot=i[5 + r],
            lr_factor=f[w_loss + w_norm],
            step=i[6 + r],
        )

    def __getattr__(self, name: str) -> Any:
        """The ``GuardState`` fields read as attributes (``gstate.lr_factor``, ``.step``):
        slices of the two arrays, traced under jit."""
        if name in policy.GuardState._fields:
            return getattr(self.unpack(), name)
        raise AttributeError(name)

    def _replace(self, **fields: Any) -> PackedGuardState:
        """``GuardState._replace``, packed again: ``gstate._replace(lr_factor=...)``."""
        return PackedGuardState.pack(self.unpack()._replace(**fields))

    def __repr__(self) -> str:
        return f"PackedGuardState({self.unpack()!r})"


GuardStateLike = policy.GuardState | PackedGuardState


def unpacked(gstate: GuardStateLike) -> policy.GuardState:
    """``gstate`` as a ``policy.GuardState`` (on the host: one dispatch; traced: slices)."""
    return _unpack(gstate) if isinstance(gstate, PackedGuardState) else gstate


def packed(state: policy.GuardState) -> PackedGuardState:
    """``state`` packed (on the host: one dispatch; traced: two concatenations)."""
    return _pack(state)


def like(gstate: GuardStateLike, state: policy.GuardState) -> GuardStateLike:
    """``state`` in the form of ``gstate``: packed when ``gstate`` is."""
    return packed(state) if isinstance(gstate, PackedGuardState) else state


def choose_packing(name: str, packed: Any, tree: Any) -> bool:
    """Whether to pack: ``packed`` itself (a bool), else (None) :func:`on_accelerator`."""
    if packed is None:
        return on_accelerator(tree)
    if not isinstance(packed, bool):
        raise InvalidArgumentError(
            f"Expected {name} to be None or a bool. Received: {name}={packed!r}"
        )
    return packed


def on_accelerator(tree: Any) -> bool:
    """True when the first array of ``tree`` lives on a device other than a CPU (else on
    JAX's default backend)."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            return any(d.platform != "cpu" for d in leaf.devices())
    return jax.default_backend() != "cpu"


_pack = jax.jit(PackedGuardState.pack)
_unpack = jax.jit(PackedGuardState.unpack)


@jax.tree_util.register_pytree_node_class
class PackedDecision:
    """A ``policy.Decision`` in 3 arrays instead of 10: the float32 ``row``
    (``numstab.guard.deferred.ROW_COLUMNS``, then the layer norms when tracked), the int32
    ``step`` and the bool ``apply``. The row is exact: flags are 0/1, ``reasons`` <= 15, the
    loss, norm and z-scores float32 already. ``apply`` is its own output so that XLA computes
    it once, not inside every select. Each Decision field reads as an attribute (sliced;
    traced under jit); ``unpack()`` gives the ``policy.Decision``."""

    def __init__(self, row: Any, step: Any, apply: Any, tracked: bool) -> None:
        self.row, self.step, self.apply, self.tracked = row, step, apply, tracked

    def tree_flatten(self) -> tuple[tuple[Any, Any, Any], bool]:
        return (self.row, self.step, self.apply), self.tracked

    @classmethod
    def tree_unflatten(cls, tracked: bool, leaves: Any) -> PackedDecision:
        return cls(*leaves, tracked)

    @classmethod
    def pack(cls, d: policy.Decision) -> PackedDecision:
        row = [jnp.stack([jnp.asarray(getattr(d, k), jnp.float32) for k in ROW_COLUMNS])]
        if d.layer_norms is not None:
            row.append(d.layer_norms.astype(jnp.float32))
        return cls(jnp.concatenate(row), d.step, d.apply, d.layer_norms is not None)

    def unpack(self) -> policy.Decision:
        col = {k: self.row[..., j] for j, k in enumerate(ROW_COLUMNS)}
        for flag in ("rollback", "snapshot"):
            col[flag] = col[flag] != 0
        col["apply"], col["reasons"] = self.apply, col["reasons"].astype(jnp.int32)
        layers = self.row[..., len(ROW_COLUMNS) :] if self.tracked else None
        return policy.Decision(**col, step=self.step, layer_norms=layers)

    @property
    def reason_names(self) -> list[str]:
        """``reasons`` as names (reads the value: not inside jit)."""
        return self.unpack().reason_names

    def __getattr__(self, name: str) -> Any:
        if name in policy.Decision._fields:
            return getattr(self.unpack(), name)
        raise AttributeError(name)

    def __repr__(self) -> str:
        return repr(self.unpack())


def host_decision(d: PackedDecision | policy.Decision, i: int | tuple) -> tuple[dict, Any]:
    """Step ``i`` of a decision read as NumPy (``()``: not stacked) as (the host dict the
    runner acts on, its layer norms or None)."""
    if isinstance(d, PackedDecision):
        row = d.row[i]
        host = decisions_from_rows(row[: len(ROW_COLUMNS)], int(d.step[i]))[0]
        return host, (row[len(ROW_COLUMNS) :] if d.tracked else None)
    host = {k: getattr(d, k)[i].item() for k in policy.Decision._fields if k != "layer_norms"}
    for key in ("apply", "rollback", "snapshot"):
        host[key] = bool(host[key])
    return host, (None if d.layer_norms is None else d.layer_norms[i])


def host_decisions(d: PackedDecision | policy.Decision, n: int) -> tuple[list[dict], Any]:
    """The ``n`` steps of stacked decisions read as NumPy: (their host dicts, their layer
    norms or None); a packed block becomes dicts in one pass over its rows."""
    if not isinstance(d, PackedDecision):
        pairs = [host_decision(d, i) for i in range(n)]
        layers = None if pairs[0][1] is None else [layer for _, layer in pairs]
        return [host for host, _ in pairs], layers
    decisions = decisions_from_rows(d.row[:, : len(ROW_COLUMNS)], 0)
    for host, step in zip(decisions, d.step.tolist(), strict=True):
        host["step"] = step
    return decisions, (list(d.row[:, len(ROW_COLUMNS) :]) if d.tracked else None)
