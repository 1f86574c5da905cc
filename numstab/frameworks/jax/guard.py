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
return the restored params and optimizer state.

State the optimizer does not update (BatchNorm statistics: Flax ``batch_stats``, NNX
``BatchStat``, Equinox ``eqx.nn.State``) is ``extra``: given to ``init``, it is snapshotted
and restored with params, and ``after_step``/``flush``/``load_snapshot`` take it and return
it fourth; inside the step, ``select(decision, new, old)`` keeps its old value on a skip.

With ``TrainingGuard(host_every=k)``, k > 1, ``after_step`` only keeps the decision (no
read) and acts on the k kept decisions every k steps, in one stacked transfer; ``flush``
does it at the end (docs/semantics.md §16.12).

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

from numstab.backends import load_backend
from numstab.errors import InvalidArgumentError
from numstab.frameworks.jax import guard_files
from numstab.frameworks.jax.guard_state import (
    GuardStateLike,
    PackedDecision,
    choose_packing,
    host_decision,
    host_decisions,
    like,
    unpacked,
)
from numstab.frameworks.jax.guard_state import packed as packed_state
from numstab.frameworks.jax.guard_tree import (
    apply_updates,
    check_norms_named,
    gradient_leaves,
    layer_names,
    select,
)
from numstab.frameworks.jax.guard_tree import where as _where
from numstab.frameworks.jax.optax import LossScaledState, loss_scaled_states
from numstab.frameworks.jax.tree_checks import check_values, checked_update
from numstab.guard import policy
from numstab.guard.runner import GuardRunner

if TYPE_CHECKING:
    from numstab.guard.guard import TrainingGuard
from numstab.guard.monitor import layer_norms


class OptaxGuard:
    """A :class:`TrainingGuard` for a functional optax loop; see the module docstring."""

    def __init__(self, guard: TrainingGuard) -> None:
        self.guard = guard
        self._jax = load_backend("jax")
        self.runner: GuardRunner | None = None
        self._current: tuple[Any, Any, Any] | None = None  # params, opt_state, extra
        self._pending: list[PackedDecision] = []
        self._has_extra = False
        self._unchecked = False  # the trees of the first after_step/flush since init

    def init(
        self, params: Any, opt_state: Any, packed: bool | None = None, *, extra: Any = None
    ) -> GuardStateLike:
        """The initial guard state (a pytree of jax arrays); takes the first snapshot.

        ``packed``: the state as a ``PackedGuardState`` (2 arrays) rather than a
        ``policy.GuardState`` (11); default: packed when ``params`` live on an accelerator.
        ``extra``: model state outside params and optimizer (BatchNorm statistics), kept in
        the snapshots; ``after_step``, ``flush`` and ``load_snapshot`` then take it too.
        """
        _check_trees(params=params, opt_state=opt_state, extra=extra)
        pack = choose_packing("packed", packed, params)  # (rejected before anything changes)
        names = layer_names(params)  # of the leaves that have gradients: floating ones
        state = policy.init_state(self.guard, self._jax)
        self.runner = GuardRunner(self.guard, self, self._jax, names)
        self._current, self._has_extra = (params, opt_state, extra), extra is not None
        self.runner.snapshot(0, copy_tree(state))  # the snapshot's own buffers: see _kept
        self._packed, self._unchecked = pack, True
        return packed_state(state) if pack else state

    # -- traced --------------------------------------------------------------------------------
    def check(
        self, gstate: GuardStateLike, loss: jax.Array, grads: Any, params: Any = None
    ) -> tuple[PackedDecision, GuardStateLike]:
        """The decision on this step and the next guard state (pure; jit-friendly);
        ``params``: a None gradient at floating leaves counts as norm 0 for each."""
        return check(self.guard, gstate, loss, grads, params)

    def step(
        self,
        tx: optax.GradientTransformation,
        params: Any,
        opt_state: Any,
        gstate: GuardStateLike,
        loss: jax.Array,
        grads: Any,
        /,
        **extra_args: Any,
    ) -> tuple[Any, Any, GuardStateLike, PackedDecision]:
        """``check``, then the optimizer step, kept only if it is good (a select);
        ``extra_args`` go to ``tx.update`` (``guarded_step``)."""
        return guarded_step(self.guard, tx, params, opt_state, gstate, loss, grads, **extra_args)

    @staticmethod
    def select(decision: PackedDecision | policy.Decision, new: Any, old: Any) -> Any:
        """``new`` where the step is applied, ``old`` where it is skipped (traced): for state
        the forward pass writes (BatchNorm statistics), so a skipped NaN batch leaves it.
        NNX: ``old`` as ``nnx.as_pure(nnx.state(...))`` (``guard_tree.select``)."""
        return select(decision, new, old)

    # -- host ------------------------------------------------------------------------------------
    def skip_batch(self) -> bool:
        """True while the batches right after a rollback are skipped (logged)."""
        runner = self._require()
        return runner.consume_skip_batch(self._steps_seen)

    def after_step(
        self,
        decision: PackedDecision,
        params: Any,
        opt_state: Any,
        gstate: GuardStateLike,
        *,
        extra: Any = None,
    ) -> tuple[Any, ...]:
        """Act on the decision: log, snapshot, roll back. Returns (params, opt_state,
        gstate), and ``extra`` fourth when ``init`` was given one, restored from the last good
        snapshot after a rollback."""
        runner = self._require()
        self._check_extra(extra)
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
        if self._unchecked:  # the first call; later ones where they are snapshotted
            self._check_given(params, opt_state, extra)
        if self.guard.host_every > 1:  # keep the decision on the device; read k at a time
            if isinstance(decision, policy.Decision):  # one form to stack (check's, unpack())
                decision = PackedDecision.pack(decision)
            pending = [*self._pending, decision]
            if len(pending) >= self.guard.host_every:  # kept only once its trees pass
                return self._flush(pending, params, opt_state, gstate, extra)
            self._pending, self._current = pending, (params, opt_state, extra)
            self._steps_seen += 1
            return self._out(gstate)
        host, layers = host_decision(jax.device_get(decision), ())  # one transfer
        check_norms_named(None if layers is None else len(layers), runner.history.names)
        if host["snapshot"]:  # the trees' one use (a rollback returns the snapshot's)
            self._check_given(params, opt_state, extra)
        acts = host["rollback"] or host["snapshot"]  # the only uses of the state
        self._current = (params, opt_state, extra)
        self._steps_seen = host["step"] + 1
        state = _kept(unpacked(gstate)) if acts else None
        state = runner.after_step(host, state, layers, load_backend("numpy"))  # type: ignore[arg-type]
        return self._out(like(gstate, _kept(state)) if host["rollback"] else gstate)

    def flush(
        self, params: Any, opt_state: Any, gstate: GuardStateLike, *, extra: Any = None
    ) -> tuple[Any, ...]:
        """``host_every`` > 1: read the decisions kept since the last read (one stacked
        transfer) and act on them, oldest first: history, log, the first rollback among them,
        a snapshot that fell due (taken now). Returns (params, opt_state, gstate) and
        ``extra`` as ``after_step`` does, restored after a rollback. Call it at the end of
        training too."""
        self._require()
        self._check_extra(extra)
        return self._flush(self._pending, params, opt_state, gstate, extra)

    def _flush(self, pending: list, params: Any, opt_state: Any, gstate: Any, extra: Any) -> tuple:
        runner = self._require()  # nothing is kept before the trees pass: a retry is clean
        if not pending:
            self._current = (params, opt_state, extra)
            return self._out(gstate)
        stacked = jax.device_get(stack_trees(pending))  # one dispatch, then one transfer
        decisions, layers = host_decisions(stacked, len(pending))
        check_norms_named(None if layers is None else len(layers[0]), runner.history.names)
        if self._unchecked or any(d["snapshot"] for d in decisions):
            self._check_given(params, opt_state, extra)  # before anything changes
        self._pending, self._current = [], (params, opt_state, extra)
        self._steps_seen = decisions[-1]["step"] + 1
        rolled = runner.after_steps(
            decisions,
            layers,
            load_backend("numpy"),
            lambda: _kept(unpacked(gstate)),
            self._steps_seen,
        )
        return self._out(gstate if rolled is None else like(gstate, _kept(rolled)))

    @property
    def history(self) -> Any:
        return self._require().history

    @property
    def events(self) -> list[dict[str, Any]]:
        return self._require().log.events

    def load_snapshot(
        self, params: Any, opt_state: Any, step: int | None = None, *, extra: Any = None
    ) -> tuple[Any, ...]:
        """Restore from the newest (or ``step``) snapshot file; ``params``, ``opt_state``
        (and ``extra``) give the tree structure. Returns (params, opt_state, gstate), gstate
        in the form ``init`` chose, and ``extra`` as ``after_step`` does."""
        runner = self._require()
        self._check_extra(extra)
        previous, self._current = self._current, (params, opt_state, extra)  # the structure
        try:
            step, gstate = runner.load_from_disk(step)
        except BaseException:
            self._current = previous  # a rejected file changes nothing
            raise
        self._steps_seen = step
        self._pending = []
        return self._out(packed_state(gstate) if self._packed else _kept(gstate))

    def _require(self) -> GuardRunner:
        if self.runner is None:
            raise InvalidArgumentError("Expected OptaxGuard.init(params, opt_state) first")
        return self.runner

    def _check_extra(self, extra: Any) -> None:
        """``extra`` given exactly when ``init`` was given one (it sets the return arity)."""
        if (extra is not None) != self._has_extra:
            raise InvalidArgumentError(
                "Expected extra= in every call when init was given extra=, and only then. "
                f"Received: init {'with' if self._has_extra else 'without'} extra, this call "
                f"{'with' if extra is not None else 'without'}"
            )

    def _check_given(self, params: Any, opt_state: Any, extra: Any) -> None:
        """The trees handed to ``after_step``/``flush`` checked as ``init`` checks its own
        (``_check_trees``): on the first call after ``init`` and on every call that snapshots
        them (their one use), not on the others (a walk of every leaf, ~20 us for 31 leaves,
        would cost the device mode's step 30 times its ~0.65 us). Before, a whole Equinox
        module was kept silently and failed the first snapshot with a raw TypeError."""
        _check_trees(params=params, opt_state=opt_state, extra=extra)
        self._unchecked = False

    def _out(self, gstate: GuardStateLike) -> tuple[Any, ...]:
        """(params, opt_state, gstate), and extra when ``init`` had one (after a rollback:
        the restored ones)."""
        params, opt_state, extra = self._current  # type: ignore[misc]
        out = (params, opt_state, gstate, extra)
        return out if self._has_extra else out[:3]

    _steps_seen = 0
    _packed = False

    # -- the Adapter protocol of GuardRunner -------------------------------------------------------
    def capture(self) -> tuple[Any, Any, Any]:
        return copy_tree(self._current)

    def restore(self, payload: tuple[Any, Any, Any]) -> None:
        self._current = copy_tree(payload)

    def scale_lr(self, ratio: float, ratio_now: float) -> None:
        """Nothing to do: the factor lives in the guard state and scales the updates."""

    def to_host(self, payload: tuple[Any, Any, Any]) -> dict[str, Any]:
        return guard_files.to_host(self._payload_names(), payload)

    def from_host(self, tree: dict[str, Any]) -> tuple[Any, Any, Any]:
        params, opt_state, *extra = guard_files.from_host(
            tree, self._payload_names(), self._current
        )
        return params, opt_state, (extra[0] if extra else None)

    def _payload_names(self) -> tuple[str, ...]:
        return ("params", "opt_state", "extra") if self._has_extra else ("params", "opt_state")


def _kept(state: policy.GuardState) -> policy.GuardState:
    """A copy of a guard state in new buffers, between the snapshots and the loop: a snapshot
    kept the loop's own arrays, and a rollback handed the snapshot's back, so a jitted step
    that donates ``gstate`` deleted them (XLA's "buffer has been deleted or donated" at the
    next rollback). On snapshot and rollback steps only."""
    return copy_tree(state)


def _check_trees(**trees: Any) -> None:
    """Every leaf of each tree is a value ``jax.jit`` takes (``check_values``: what the
    snapshots copy under jit; not any object with a ``dtype``, as a linen Module's field)."""
    check_values(trees.items())


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


# -- the traced functions, usable with the (hashable) TrainingGuard as a static jit argument --


def check(
    guard: TrainingGuard, gstate: GuardStateLike, loss: jax.Array, grads: Any, params: Any = None
) -> tuple[PackedDecision, GuardStateLike]:
    """Per-leaf and global gradient norms, then the decision of ``numstab.guard.policy``
    (packed); the next state in the form of ``gstate``. ``params``: as ``_check``'s."""
    decision, state = _check(guard, gstate, loss, grads, params=params)
    return PackedDecision.pack(decision), like(gstate, state)


def _check(
    guard: TrainingGuard,
    gstate: GuardStateLike,
    loss: jax.Array,
    grads: Any,
    scale: jax.Array | None = None,
    scaler_overflow: jax.Array | None = None,
    params: Any = None,
) -> tuple[policy.Decision, policy.GuardState]:
    """``check``; ``scale``: the loss scale the gradients carry (the norms are those of the
    unscaled gradients, in float32: scaled ones overflowed the sum of squares far sooner);
    ``scaler_overflow``: the scaler found them non-finite (``policy.decide``); ``params``: a
    None gradient at floating leaves counts as norm 0 for each (``gradient_leaves``)."""
    leaves = gradient_leaves(grads, params)  # floating or complex (|z|), else refused
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
    /,
    **extra_args: Any,
) -> tuple[Any, Any, GuardStateLike, PackedDecision]:
    """``check``, then ``tx.update`` (updates times ``gstate.lr_factor``) and
    ``optax.apply_updates``, kept only when the step is good; otherwise params and opt_state
    are returned as they were. Returns (params, opt_state, gstate, decision), gstate in the
    form it came in. ``extra_args`` (keyword only: ``value=loss`` for
    ``optax.contrib.reduce_on_plateau``, a line search's ``value``/``grad``/``value_fn``) go
    to ``tx.update`` as ``checked_update`` passes them. A None update (Equinox's None
    gradient of an integer array) leaves its leaf as it is (``guard_tree.apply_updates``).

    With a ``loss_scaled`` transformation (a ``LossScaledState`` in ``opt_state``) the
    gradients are scaled: their norms are taken unscaled, an overflow is the scaler's (not
    counted toward a rollback), and on it the scaler's own state (the scale backing off) is
    kept where everything else stays as it was: before, the guard put the old scale back, so
    the scaler never backed off and every later step overflowed.

    ``tx``, the trees and the gradients' structure are checked as it is traced (no cost in
    the compiled step): ``InvalidArgumentError`` where optax or JAX raised their own."""
    _check_trees(params=params, opt_state=opt_state)
    updates, new_opt = checked_update(tx, grads, opt_state, params, **extra_args)
    scaled = loss_scaled_states(opt_state)
    scale, overflow = None, None
    if scaled:  # the scaler's own verdict: its new state's last_finite
        scale = scaled[0].loss_scale.scale if len(scaled) == 1 else None
        overflow = ~jnp.all(jnp.stack([n.last_finite for n in loss_scaled_states(new_opt)]))
    decision, state = _check(guard, gstate, loss, grads, scale, overflow, params)
    factor = state.lr_factor
    updates = jax.tree.map(lambda u: u * factor.astype(u.dtype), updates)
    new_params = apply_updates(params, updates)

    def pick(new: Any, old: Any) -> Any:  # old exactly where the step is bad
        return _where(decision.apply, new, old)

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
            lambda n, o: _where(keep, n, o),
            new._replace(inner_state=None),
            old._replace(inner_state=None),
        )
        return own._replace(inner_state=jax.tree.map(pick, new.inner_state, old.inner_state))

    params = jax.tree.map(pick, new_params, params)
    opt_state = jax.tree.map(
        pick_state, new_opt, opt_state, is_leaf=lambda x: isinstance(x, LossScaledState)
    )
    return params, opt_state, like(gstate, state), PackedDecision.pack(decision)
