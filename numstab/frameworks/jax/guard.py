"""The training guard in a functional optax loop: the decision inside ``jit``, actions outside.

    og = TrainingGuard(snapshot_every=100).for_optax()
    gstate = og.init(params, opt_state)          # the guard state (a pytree); first snapshot

    @jax.jit
    def train_step(params, opt_state, gstate, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return og.step(tx, params, opt_state, gstate, loss, grads)

    for batch in batches:
        if og.skip_batch():
            continue
        params, opt_state, gstate, decision = train_step(params, opt_state, gstate, batch)
        params, opt_state, gstate = og.after_step(decision, params, opt_state, gstate)

``step`` (traced, no host sync): per-leaf gradient norms and the global norm, the decision of
``numstab.guard.policy`` on the jax backend, then ``tx.update`` and ``optax.apply_updates``
kept only when the step is good (a select: a skipped step leaves params and optimizer state
exactly as they were, its count included). The updates are multiplied by
``gstate.lr_factor``: for any optimizer whose update is linear in the learning rate (every
optax optimizer ending in ``scale_by_learning_rate``: sgd, adam, adamw, lion, ...) that is
the learning rate times the factor, without recompiling.

``after_step`` (host): one ``jax.device_get`` of the decision, then history, log, snapshots
(copies of params and optimizer state, so donated buffers are safe) and rollbacks, which
return the restored params and optimizer state. With ``TrainingGuard(host_every=k)``, k > 1,
``after_step`` only keeps the decision (no read) and acts on the k kept decisions every k
steps, in one stacked transfer; ``flush`` does it at the end (docs/semantics.md §16.12).

The decision leaves the jitted step packed (:class:`PackedDecision`: 3 arrays, not 10),
since every leaf out of a jitted call costs host dispatch time, and ``after_step`` keeps or
reads 3 buffers per step. The guard state is a ``policy.GuardState`` (11 arrays) for
parameters on a CPU, and a ``PackedGuardState`` (2 arrays, ``numstab.frameworks.jax.
guard_state``) for parameters on an accelerator, where it saves a step 16 kernel launches;
``init(..., packed=...)`` chooses. Every function here takes either form and keeps it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax

from numstab import _validate as v
from numstab.backends import load_backend
from numstab.errors import InvalidArgumentError
from numstab.frameworks.jax.guard_state import (
    GuardStateLike,
    PackedDecision,
    choose_packing,
    like,
    unpacked,
)
from numstab.frameworks.jax.guard_state import packed as packed_state
from numstab.frameworks.jax.optax import LossScaledState, loss_scaled_states
from numstab.guard import policy
from numstab.guard.deferred import ROW_COLUMNS, decisions_from_rows
from numstab.guard.runner import GuardRunner, check_fits, check_payload

if TYPE_CHECKING:
    from numstab.guard.guard import TrainingGuard
from numstab.guard.monitor import layer_norms


class OptaxGuard:
    """A :class:`TrainingGuard` for a functional optax loop; see the module docstring."""

    def __init__(self, guard: TrainingGuard) -> None:
        self.guard = guard
        self._jax = load_backend("jax")
        self.runner: GuardRunner | None = None
        self._current: tuple[Any, Any] | None = None
        self._pending: list[PackedDecision] = []

    def init(self, params: Any, opt_state: Any, packed: bool | None = None) -> GuardStateLike:
        """The initial guard state (a pytree of jax arrays); takes the first snapshot.

        ``packed``: the state as a ``PackedGuardState`` (2 arrays) rather than a
        ``policy.GuardState`` (11); default: packed when ``params`` live on an accelerator.
        """
        _check_trees(params=params, opt_state=opt_state)
        pack = choose_packing("packed", packed, params)  # (rejected before anything changes)
        names = [
            jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)
        ]
        state = policy.init_state(self.guard, self._jax)
        self.runner = GuardRunner(self.guard, self, self._jax, names)
        self._current = (params, opt_state)
        self.runner.snapshot(0, copy_tree(state))  # the snapshot's own buffers: see _kept
        self._packed = pack
        return packed_state(state) if pack else state

    # -- traced --------------------------------------------------------------------------------
    def check(
        self, gstate: GuardStateLike, loss: jax.Array, grads: Any
    ) -> tuple[PackedDecision, GuardStateLike]:
        """The decision on this step and the next guard state (pure; jit-friendly)."""
        return check(self.guard, gstate, loss, grads)

    def step(
        self,
        tx: optax.GradientTransformation,
        params: Any,
        opt_state: Any,
        gstate: GuardStateLike,
        loss: jax.Array,
        grads: Any,
    ) -> tuple[Any, Any, GuardStateLike, PackedDecision]:
        """``check``, then the optimizer step, kept only if it is good (a select)."""
        return guarded_step(self.guard, tx, params, opt_state, gstate, loss, grads)

    # -- host ------------------------------------------------------------------------------------
    def skip_batch(self) -> bool:
        """True while the batches right after a rollback are skipped (logged)."""
        runner = self._require()
        return runner.consume_skip_batch(self._steps_seen)

    def after_step(
        self, decision: PackedDecision, params: Any, opt_state: Any, gstate: GuardStateLike
    ) -> tuple[Any, Any, GuardStateLike]:
        """Act on the decision: log, snapshot, roll back. Returns (params, opt_state,
        gstate), restored from the last good snapshot after a rollback."""
        runner = self._require()
        if not isinstance(decision, (PackedDecision, policy.Decision)):
            raise InvalidArgumentError(
                f"Expected the decision that guarded_step or check returned. Received: "
                f"decision of type {type(decision).__name__}"
            )
        if jnp.ndim(decision.step) != 0:
            raise InvalidArgumentError(
                "Expected one step's decision: the guard acts between steps (snapshots, "
                "rollbacks), so steps stacked by jax.lax.scan cannot be guarded after the "
                "fact; scan over the batches of one step, or call step and after_step per "
                f"step. Received: a decision of shape {jnp.shape(decision.step)}"
            )
        if self.guard.host_every > 1:  # keep the decision on the device; read k at a time
            if isinstance(decision, policy.Decision):  # one form to stack (check's, unpack())
                decision = PackedDecision.pack(decision)
            self._pending.append(decision)
            self._current = (params, opt_state)
            self._steps_seen += 1
            if len(self._pending) >= self.guard.host_every:
                return self.flush(params, opt_state, gstate)
            return params, opt_state, gstate
        host, layers = _host_decision(jax.device_get(decision), ())  # one transfer
        self._current = (params, opt_state)
        self._steps_seen = host["step"] + 1
        acts = host["rollback"] or host["snapshot"]  # the only uses of the state
        state = _kept(unpacked(gstate)) if acts else None
        state = runner.after_step(host, state, layers, load_backend("numpy"))  # type: ignore[arg-type]
        params, opt_state = self._current
        return params, opt_state, like(gstate, _kept(state)) if host["rollback"] else gstate

    def flush(
        self, params: Any, opt_state: Any, gstate: GuardStateLike
    ) -> tuple[Any, Any, GuardStateLike]:
        """``host_every`` > 1: read the decisions kept since the last read (one stacked
        transfer) and act on them, oldest first: history, log, the first rollback among them,
        a snapshot that fell due (taken now). Returns (params, opt_state, gstate), restored
        after a rollback. Call it at the end of training too."""
        runner = self._require()
        pending, self._pending = self._pending, []
        if not pending:
            return params, opt_state, gstate
        stacked = jax.device_get(stack_trees(pending))  # one dispatch, then one transfer
        decisions, layers = _host_decisions(stacked, len(pending))
        self._steps_seen = decisions[-1]["step"] + 1
        self._current = (params, opt_state)
        rolled = runner.after_steps(
            decisions,
            layers,
            load_backend("numpy"),
            lambda: _kept(unpacked(gstate)),
            self._steps_seen,
        )
        params, opt_state = self._current
        return params, opt_state, gstate if rolled is None else like(gstate, _kept(rolled))

    @property
    def history(self) -> Any:
        return self._require().history

    @property
    def events(self) -> list[dict[str, Any]]:
        return self._require().log.events

    def load_snapshot(
        self, params: Any, opt_state: Any, step: int | None = None
    ) -> tuple[Any, Any, GuardStateLike]:
        """Restore from the newest (or ``step``) snapshot file; ``params`` and ``opt_state``
        give the tree structure. Returns (params, opt_state, gstate), gstate in the form
        ``init`` chose."""
        runner = self._require()
        previous, self._current = self._current, (params, opt_state)  # the structure to load
        try:
            step, gstate = runner.load_from_disk(step)
        except BaseException:
            self._current = previous  # a rejected file changes nothing
            raise
        self._steps_seen = step
        self._pending = []
        return (*self._current, packed_state(gstate) if self._packed else _kept(gstate))

    def _require(self) -> GuardRunner:
        if self.runner is None:
            raise InvalidArgumentError("Expected OptaxGuard.init(params, opt_state) first")
        return self.runner

    _steps_seen = 0
    _packed = False

    # -- the Adapter protocol of GuardRunner -------------------------------------------------------
    def capture(self) -> tuple[Any, Any]:
        return copy_tree(self._current)

    def restore(self, payload: tuple[Any, Any]) -> None:
        self._current = copy_tree(payload)

    def scale_lr(self, ratio: float) -> None:
        """Nothing to do: the factor lives in the guard state and scales the updates."""

    def to_host(self, payload: tuple[Any, Any]) -> dict[str, Any]:
        params, opt_state = jax.device_get(payload)
        return {"params": jax.tree.leaves(params), "opt_state": jax.tree.leaves(opt_state)}

    def from_host(self, tree: dict[str, Any]) -> tuple[Any, Any]:
        """The saved leaves in the structure of the current ``params`` and ``opt_state``,
        after checking their number and shapes (``check_fits``: before, JAX's "Too many
        leaves for PyTreeDef", or other shapes loaded silently)."""
        check_payload(tree, ("params", "opt_state"), "optax")
        out = []
        for name, current in zip(("params", "opt_state"), self._current, strict=True):
            paths, treedef = jax.tree_util.tree_flatten_with_path(current)
            names = [name + jax.tree_util.keystr(path) for path, _ in paths]
            saved = list(tree[name])
            check_fits(
                name,
                [
                    (names[i] if i < len(names) else f"{name} leaf {i}", x)
                    for i, x in enumerate(saved)
                ],
                [(n, jnp.shape(x)) for n, (_, x) in zip(names, paths, strict=True)],
            )
            out.append(jax.tree.unflatten(treedef, [jnp.asarray(x) for x in saved]))
        return out[0], out[1]


def _kept(state: policy.GuardState) -> policy.GuardState:
    """A copy of a guard state in new buffers, between the snapshots and the loop: a snapshot
    kept the loop's own arrays, and a rollback handed the snapshot's back, so a jitted step
    that donates ``gstate`` deleted them (XLA's "buffer has been deleted or donated" at the
    next rollback). On snapshot and rollback steps only."""
    return copy_tree(state)


def _check_trees(**trees: Any) -> None:
    """Every leaf of each tree is an array or a number (what the snapshots copy under jit);
    ``InvalidArgumentError`` naming the tree and the leaf otherwise."""
    for name, tree in trees.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if not (hasattr(leaf, "dtype") or isinstance(leaf, (bool, int, float, complex))):
                raise InvalidArgumentError(
                    f"Expected {name} to be a pytree of arrays. Received: a leaf of type "
                    f"{type(leaf).__name__} at {name}{jax.tree_util.keystr(path)}"
                )


@jax.jit
def copy_tree(tree: Any) -> Any:
    """A copy of every array of ``tree`` in new buffers (safe to donate the originals), in
    one dispatch: one eager copy per leaf took about 1.0 ms per snapshot of a 4x256 MLP with
    Adam (31 leaves) on CPU, this 0.55-0.75 ms (also the Keras guard's undo copy on JAX)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


@jax.jit
def stack_trees(decisions: list[Any]) -> Any:
    """The decisions (or rows) of several steps as one of stacked arrays, in one dispatch
    (compiled once per number of steps; eagerly ``jnp.stack`` dispatches once per array)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *decisions)


def _host_decision(d: PackedDecision | policy.Decision, i: int | tuple) -> tuple[dict, Any]:
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


def _host_decisions(d: PackedDecision | policy.Decision, n: int) -> tuple[list[dict], Any]:
    """The ``n`` steps of stacked decisions read as NumPy: (their host dicts, their layer
    norms or None); a packed block becomes dicts in one pass over its rows."""
    if not isinstance(d, PackedDecision):
        pairs = [_host_decision(d, i) for i in range(n)]
        layers = None if pairs[0][1] is None else [layer for _, layer in pairs]
        return [host for host, _ in pairs], layers
    decisions = decisions_from_rows(d.row[:, : len(ROW_COLUMNS)], 0)
    for host, step in zip(decisions, d.step.tolist(), strict=True):
        host["step"] = step
    return decisions, (list(d.row[:, len(ROW_COLUMNS) :]) if d.tracked else None)


# -- the traced functions, usable with the (hashable) TrainingGuard as a static jit argument --


def check(
    guard: TrainingGuard, gstate: GuardStateLike, loss: jax.Array, grads: Any
) -> tuple[PackedDecision, GuardStateLike]:
    """Per-leaf and global gradient norms, then the decision of ``numstab.guard.policy``
    (packed); the next state in the form of ``gstate``."""
    decision, state = _check(guard, gstate, loss, grads)
    return PackedDecision.pack(decision), like(gstate, state)


def _check(
    guard: TrainingGuard,
    gstate: GuardStateLike,
    loss: jax.Array,
    grads: Any,
    scale: jax.Array | None = None,
    scaler_overflow: jax.Array | None = None,
) -> tuple[policy.Decision, policy.GuardState]:
    """``check``; ``scale``: the loss scale the gradients carry (the norms are those of the
    unscaled gradients, in float32: scaled ones overflowed the sum of squares far sooner);
    ``scaler_overflow``: the scaler found them non-finite (``policy.decide``)."""
    leaves = jax.tree.leaves(grads)
    for i, leaf in enumerate(leaves):
        dtype = getattr(leaf, "dtype", None)
        name = dtype.name if dtype is not None else type(leaf).__name__
        if not (v.is_floating(name) or v.is_complex(name)):  # complex: |z|
            raise InvalidArgumentError(
                f"Expected floating-point gradients ({v.FLOAT_DTYPES} or complex). Received: "
                f"leaf {i} with dtype={name}"
            )
    be = load_backend("jax")
    state = unpacked(gstate)
    policy.check_state(guard, be, state, "gstate")
    loss = policy.scalar_input(be, "loss", loss)
    if scale is not None:  # fused into the norms' reductions under jit
        inverse = 1.0 / scale
        leaves = [x.astype(jnp.promote_types(x.dtype, jnp.float32)) * inverse for x in leaves]
    norms, total = layer_norms(be, leaves)
    decision, state = policy.decide(guard, be, state, loss, total, scaler_overflow=scaler_overflow)
    if guard.track_layers:
        decision = decision._replace(layer_norms=norms)
    return decision, state


def guarded_step(
    guard: TrainingGuard,
    tx: optax.GradientTransformation,
    params: Any,
    opt_state: Any,
    gstate: GuardStateLike,
    loss: jax.Array,
    grads: Any,
) -> tuple[Any, Any, GuardStateLike, PackedDecision]:
    """``check``, then ``tx.update`` (updates times ``gstate.lr_factor``) and
    ``optax.apply_updates``, kept only when the step is good; otherwise params and opt_state
    are returned as they were. Returns (params, opt_state, gstate, decision), gstate in the
    form it came in.

    With a ``loss_scaled`` transformation (a ``LossScaledState`` in ``opt_state``) the
    gradients are scaled: their norms are taken unscaled, an overflow is the scaler's (not
    counted toward a rollback), and on it the scaler's own state (the scale backing off) is
    kept where everything else stays as it was: before, the guard put the old scale back, so
    the scaler never backed off and every later step overflowed."""
    updates, new_opt = tx.update(grads, opt_state, params)
    scaled = loss_scaled_states(opt_state)
    scale, overflow = None, None
    if scaled:  # the scaler's own verdict: its new state's last_finite
        scale = scaled[0].loss_scale.scale if len(scaled) == 1 else None
        overflow = ~jnp.all(jnp.stack([n.last_finite for n in loss_scaled_states(new_opt)]))
    decision, state = _check(guard, gstate, loss, grads, scale, overflow)
    factor = state.lr_factor
    updates = jax.tree.map(lambda u: u * factor.astype(u.dtype), updates)
    new_params = optax.apply_updates(params, updates)

    def pick(new: Any, old: Any) -> Any:  # old exactly where the step is bad
        return jnp.where(decision.apply, new, old).astype(jnp.result_type(new))

    # a select, not a lax.cond: it fuses into the update's own elementwise kernels, where a
    # cond copies every buffer (3-6% of a small step on CPU). Every leaf's update so waits
    # for ``apply``, a reduction over all the gradients, as in any guard that can skip a
    # step (benchmarks/guard.py's floor "norms + skip select"); computing the updates
    # before it (lax.optimization_barrier) then selecting measured no faster on XLA:CPU.
    def pick_state(new: Any, old: Any) -> Any:
        if not isinstance(new, LossScaledState):
            return pick(new, old)
        # the scaler's bookkeeping: new where it decided (its own skip of an overflow too)
        keep = decision.apply | ~new.last_finite
        own = jax.tree.map(
            lambda n, o: jnp.where(keep, n, o).astype(jnp.result_type(n)),
            new._replace(inner_state=None),
            old._replace(inner_state=None),
        )
        return own._replace(inner_state=jax.tree.map(pick, new.inner_state, old.inner_state))

    params = jax.tree.map(pick, new_params, params)
    opt_state = jax.tree.map(
        pick_state, new_opt, opt_state, is_leaf=lambda x: isinstance(x, LossScaledState)
    )
    return params, opt_state, like(gstate, state), PackedDecision.pack(decision)
