"""The bad-input catalogue: every public function and class, every argument.

Each case expects ONE outcome on every backend: a named ``NumstabError`` subclass whose message
names the argument (``bad``), or a documented valid result that the case checks (``Valid``).
Stateful objects are checked unchanged after a rejected call (``unchanged``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import numstab as ns
from numstab import errors
from numstab.clipping import clip_coefficient
from tests.bad_inputs.ctx import Case, Ctx, Valid, bad, unchanged

NAN, INF = float("nan"), float("inf")
F32_MAX = float(np.finfo(np.float32).max)


def _x(c: Ctx, rows: int = 4, classes: int = 5) -> Any:
    return c.a(np.linspace(-1, 1, rows * classes).reshape(rows, classes))


def _y(c: Ctx, rows: int = 4) -> Any:
    return c.a(np.arange(rows) % 5, "int64")


def _finite(result: Any, c: Ctx) -> bool:
    return bool(np.all(np.isfinite(c.np(result))))


# -- scalar hyperparameters: wrong type, NaN, inf, out of range ------------------------------
def _hyper(prefix: str, make: Callable[[Any], Any], name: str, values: dict[str, Any]):
    for label, value in values.items():
        yield Case(f"{prefix}.{name}={label}", lambda c, v=value: make(v), bad(name))


TYPE_NAN_INF = {"str": "1.0", "none": None, "nan": NAN, "inf": INF, "bool": True}
NEGATIVE = {"negative": -1.0}


def hyperparameter_cases() -> Iterator[Case]:
    x_y = lambda c: (_x(c), _y(c))
    ce = lambda **kw: lambda c: ns.cross_entropy(*x_y(c), **kw)
    for name, values in {
        "label_smoothing": {**TYPE_NAN_INF, **NEGATIVE, "above_one": 1.5},
        "z_loss": {**TYPE_NAN_INF, **NEGATIVE},
        "ignore_index": {"float": 1.5, "str": "a", "none": None},
        "reduction": {"unknown": "avg", "none_object": None, "int": 0},
        "axis": {"out_of_range": 5, "float": 1.0},
    }.items():
        for label, value in values.items():
            yield Case(f"cross_entropy.{name}={label}", ce(**{name: value}), bad(name))
    scaler = ns.LossScaler
    for name, values in {
        "init_scale": {**TYPE_NAN_INF, "zero": 0.0, **NEGATIVE},
        "growth_factor": {"str": "2", "nan": NAN, "below_one": 0.5},
        "backoff_factor": {"nan": NAN, "zero": 0.0, "above_one": 1.5},
        "growth_interval": {"zero": 0, "float": 2.5, "str": "10", "past_int32": 2**31},
        "hysteresis": {"zero": 0, "float": 1.5, "past_int32": 2**33},
        "growth_delay_after_overflow": {"negative": -1, "past_int32": 2**40},
        "min_scale": {"nan": NAN, **NEGATIVE},
        "max_scale": {"nan": NAN, "zero": 0.0},
    }.items():
        yield from _hyper("LossScaler", lambda v, n=name: scaler(**{n: v}), name, values)
    for name, values in {
        "alpha": {"nan": NAN, "above_one": 1.5, "str": "0.9"},
        "z_thresh": {"nan": NAN, "zero": 0.0, **NEGATIVE},
        "max_grad_norm": {"nan": NAN, **NEGATIVE},
        "eps": {"nan": NAN, **NEGATIVE},
        "warmup_steps": {"negative": -1, "float": 2.5},
        "mode": {"unknown": "median"},
        "clip_option": {"unknown": "max"},
        "clip_factor": {"nan": NAN, "zero": 0.0},
    }.items():
        yield from _hyper("ZClip", lambda v, n=name: ns.ZClip(**{n: v}), name, values)
    for name, values in {
        "clip_factor": {"nan": NAN, "zero": 0.0, **NEGATIVE, "str": "0.01"},
        "eps": {"nan": NAN, **NEGATIVE},
        "layout": {"unknown": "xy"},
        "axis": {"empty_tuple": (), "empty_list": [], "repeated": (0, 0)},
    }.items():
        yield from _hyper("AGC", lambda v, n=name: ns.AGC(**{n: v}), name, values)
    for name, values in {
        "window": {"zero": 0, "float": 3.5},
        "sigma": {"nan": NAN, "zero": 0.0, "str": "6"},
        "warmup": {"negative": -1},
    }.items():
        yield from _hyper(
            "SpikeDetector", lambda v, n=name: ns.SpikeDetector(**{n: v}), name, values
        )
    for name, values in {
        "snapshot_every": {"zero": 0, "float": 1.5},
        "keep_snapshots": {"zero": 0},
        "rollback_after": {"zero": 0, "above_window": 100},
        "lr_factor": {"nan": NAN, "zero": 0.0, "above_one": 2.0},
        "skip_after_rollback": {"negative": -1},
        "max_rollbacks": {"negative": -1, "float": 1.5},
        "loss_spikes": {"str": "olmo"},
        "track_layers": {"str": "yes"},
    }.items():
        yield from _hyper(
            "TrainingGuard", lambda v, n=name: ns.TrainingGuard(**{n: v}), name, values
        )
    sched = dict(base_lr=1e-3, warmup_steps=10, total_steps=100)
    for name, values in {
        "base_lr": {"nan": NAN, **NEGATIVE, "str": "1e-3"},
        "warmup_steps": {"negative": -1, "above_total": 200},
        "total_steps": {"zero": 0, "float": 10.5},
        "min_lr": {"nan": NAN, **NEGATIVE},
    }.items():
        yield from _hyper(
            "warmup_cosine_schedule",
            lambda v, n=name: ns.warmup_cosine_schedule(**{**sched, n: v}),
            name,
            values,
        )
    for name, values in {"threshold": {"nan": NAN, "zero": 0.0}, "warmup": {"one": 1}}.items():
        yield from _hyper(
            "data.ZScoreFilter", lambda v, n=name: ns.data.ZScoreFilter(**{n: v}), name, values
        )
    yield from _hyper("data.guard", lambda v: ns.data.protect([], v), "policy", {"unknown": "skip"})
    yield from _hyper(
        "data.guard", lambda v: ns.data.protect([], outliers=v), "outliers", {"unknown": "iqr"}
    )


# -- array arguments: dtype, shape, values, empty, mixed frameworks ----------------------------
def array_cases() -> Iterator[Case]:
    yield from [
        Case(
            "cross_entropy.labels=float_ids",
            lambda c: ns.cross_entropy(_x(c), c.a([0.0, 1.0, 2.0, 3.0])),
            bad("labels.dtype=float32"),
        ),
        Case(
            "cross_entropy.labels=str",
            lambda c: ns.cross_entropy(_x(c), ["a", "b", "c", "d"]),
            bad("labels"),
        ),
        Case("cross_entropy.labels=None", lambda c: ns.cross_entropy(_x(c), None), bad("labels")),
        Case(
            "cross_entropy.labels=out_of_range",
            lambda c: ns.cross_entropy(_x(c), c.a([0, 1, 2, 9], "int64")),
            bad("labels"),
        ),
        Case(
            "cross_entropy.labels=negative",
            lambda c: ns.cross_entropy(_x(c), c.a([0, 1, 2, -3], "int64")),
            bad("labels"),
        ),
        Case(
            "cross_entropy.labels=bool",
            lambda c: ns.cross_entropy(_x(c), c.a([True, False, True, False])),
            bad("labels"),
        ),
        Case(
            "cross_entropy.labels=shape",
            lambda c: ns.cross_entropy(_x(c), c.a(np.zeros((4, 2)), "int64")),
            bad("labels"),
        ),
        Case(
            "cross_entropy.labels=probabilities_not_summing",
            lambda c: ns.cross_entropy(_x(c), c.a(np.full((4, 5), 0.5))),
            Valid(
                _finite,
                "probability rows are not normalised (documented, §3): the loss is sum(-t log p)",
            ),
        ),
        Case(
            "cross_entropy.logits=int",
            lambda c: ns.cross_entropy(c.a(np.zeros((4, 5)), "int32"), _y(c)),
            bad("logits"),
        ),
        Case(
            "cross_entropy.logits=scalar",
            lambda c: ns.cross_entropy(c.a(1.0), _y(c)),
            bad("logits"),
        ),
        Case(
            "cross_entropy.logits=str", lambda c: ns.cross_entropy("logits", _y(c)), bad("logits")
        ),
        Case("cross_entropy.logits=None", lambda c: ns.cross_entropy(None, _y(c)), bad("logits")),
        Case(
            "cross_entropy.logits=empty_batch",
            lambda c: ns.cross_entropy(c.a(np.zeros((0, 5))), c.a(np.zeros(0), "int64")),
            Valid(lambda r, c: float(c.np(r)) == 0.0, "mean over no counted row is 0.0 (§4.4)"),
        ),
        Case(
            "cross_entropy.logits=huge",
            lambda c: ns.cross_entropy(c.a(np.full((4, 5), F32_MAX / 2)), _y(c)),
            Valid(_finite, "finite at any finite magnitude"),
        ),
        Case(
            "cross_entropy.logits=tiny",
            lambda c: ns.cross_entropy(c.a(np.full((4, 5), 1e-45)), _y(c)),
            Valid(lambda r, c: abs(float(c.np(r)) - math.log(5)) < 1e-6, "log(K) for equal logits"),
        ),
        Case(
            "cross_entropy.weight=nan",
            lambda c: ns.cross_entropy(_x(c), _y(c), weight=c.a([1.0, NAN, 1.0, 1.0, 1.0])),
            bad("weight"),
        ),
        Case(
            "cross_entropy.weight=inf",
            lambda c: ns.cross_entropy(_x(c), _y(c), weight=c.a([1.0, INF, 1.0, 1.0, 1.0])),
            bad("weight"),
        ),
        Case(
            "cross_entropy.weight=negative",
            lambda c: ns.cross_entropy(_x(c), _y(c), weight=c.a([1.0, -1.0, 1.0, 1.0, 1.0])),
            bad("weight"),
        ),
        Case(
            "cross_entropy.weight=shape",
            lambda c: ns.cross_entropy(_x(c), _y(c), weight=c.a([1.0, 1.0])),
            bad("weight"),
        ),
        Case(
            "cross_entropy.weight=str",
            lambda c: ns.cross_entropy(_x(c), _y(c), weight="balanced"),
            bad("weight"),
        ),
        Case(
            "cross_entropy.mixed_frameworks",
            lambda c: ns.cross_entropy(c.other_first(np.zeros((4, 5))), c.other(np.zeros(4))),
            bad("arrays", errors.MixedBackendsError),
        ),
        Case(
            "cross_entropy.backend=unknown",
            lambda c: ns.cross_entropy(_x(c), _y(c), backend="mxnet"),
            bad("mxnet", errors.UnknownBackendError),
        ),
        Case(
            "log_softmax.x=int", lambda c: ns.log_softmax(c.a(np.zeros((2, 3)), "int32")), bad("x")
        ),
        Case("log_softmax.axis=out_of_range", lambda c: ns.log_softmax(_x(c), axis=3), bad("axis")),
        Case("log_softmax.x=str", lambda c: ns.log_softmax("x"), bad("x")),
        Case("logsumexp.axis=float", lambda c: ns.logsumexp(_x(c), axis=0.5), bad("axis")),
        Case(
            "logsumexp.keepdims=str", lambda c: ns.logsumexp(_x(c), keepdims="yes"), bad("keepdims")
        ),
        Case(
            "logsumexp.x=all_neg_inf",
            lambda c: ns.logsumexp(c.a(np.full((2, 3), -INF))),
            Valid(lambda r, c: bool(np.all(c.np(r) == -INF)), "-inf, as log(0) (§2)"),
        ),
        Case("smooth_labels.alpha=nan", lambda c: ns.smooth_labels(_y(c), NAN, 5), bad("alpha")),
        Case(
            "smooth_labels.alpha=above_one", lambda c: ns.smooth_labels(_y(c), 1.5, 5), bad("alpha")
        ),
        Case(
            "smooth_labels.num_classes=zero",
            lambda c: ns.smooth_labels(_y(c), 0.1, 0),
            bad("num_classes"),
        ),
        Case(
            "smooth_labels.num_classes=too_small",
            lambda c: ns.smooth_labels(_y(c), 0.1, 2),
            bad("labels"),
        ),
        Case(
            "smooth_labels.labels=float_ids",
            lambda c: ns.smooth_labels(c.a([0.0, 1.0]), 0.1, 5),
            bad("labels"),
        ),
        Case(
            "fused_linear_cross_entropy.weight=shape",
            lambda c: ns.fused_linear_cross_entropy(
                c.a(np.zeros((4, 3))), c.a(np.zeros((5, 2))), _y(c)
            ),
            bad("weight"),
        ),
        Case(
            "fused_linear_cross_entropy.chunk_size=zero",
            lambda c: ns.fused_linear_cross_entropy(
                c.a(np.zeros((4, 3))), c.a(np.zeros((5, 3))), _y(c), chunk_size=0
            ),
            bad("chunk_size"),
        ),
        Case(
            "fused_linear_cross_entropy.labels=str",
            lambda c: ns.fused_linear_cross_entropy(
                c.a(np.zeros((4, 3))), c.a(np.zeros((5, 3))), "y"
            ),
            bad("labels"),
        ),
        Case(
            "fused_linear_cross_entropy.bias=shape",
            lambda c: ns.fused_linear_cross_entropy(
                c.a(np.zeros((4, 3))), c.a(np.zeros((5, 3))), _y(c), bias=c.a(np.zeros(2))
            ),
            bad("bias"),
        ),
        Case(
            "fused_linear_cross_entropy.hidden=None",
            lambda c: ns.fused_linear_cross_entropy(None, c.a(np.zeros((5, 3))), _y(c)),
            bad("hidden"),
        ),
        Case(
            "fused_linear_cross_entropy.weight=None",
            lambda c: ns.fused_linear_cross_entropy(c.a(np.zeros((4, 3))), None, _y(c)),
            bad("weight"),
        ),
        Case(
            "fused_linear_cross_entropy.labels=None",
            lambda c: ns.fused_linear_cross_entropy(
                c.a(np.zeros((4, 3))), c.a(np.zeros((5, 3))), None
            ),
            bad("labels"),
        ),
        Case(
            "fused_linear_cross_entropy.ignore_index=beyond_int64",
            lambda c: ns.fused_linear_cross_entropy(
                c.a(np.zeros((4, 3))), c.a(np.zeros((5, 3))), _y(c), ignore_index=-(2**70)
            ),
            Valid(
                lambda r, c: abs(float(c.np(r)) - math.log(5)) < 1e-6,
                "no label can equal it: nothing ignored, log(K) for equal logits (§4.4.4)",
            ),
        ),
        Case(
            "cross_entropy.ignore_index=beyond_int64",
            lambda c: ns.cross_entropy(c.a(np.zeros((4, 5))), _y(c), ignore_index=2**70),
            Valid(
                lambda r, c: abs(float(c.np(r)) - math.log(5)) < 1e-6,
                "no label can equal it: nothing ignored, log(K) for equal logits (§4.4.4)",
            ),
        ),
    ]


class _NotAnArray:
    """Says it holds float32, converts to nothing numeric."""

    dtype = np.dtype(np.float32)
    shape = (2,)


def tree_cases() -> Iterator[Case]:
    g = lambda c: [c.a([3.0, 4.0]), c.a([[0.0]])]
    for fn_name, fn in {
        "global_norm": lambda t, **k: ns.global_norm(t, **k),
        "clip_by_global_norm": lambda t, **k: ns.clip_by_global_norm(t, 1.0, **k),
        "all_finite": lambda t, **k: ns.all_finite(t, **k),
        "find_nonfinite": lambda t, **k: ns.find_nonfinite(t, **k),
        "clip_by_value": lambda t, **k: ns.clip_by_value(t, -1.0, 1.0, **k),
    }.items():
        yield Case(f"{fn_name}.tree=str_leaf", lambda c, f=fn: f([c.a([1.0]), "grad"]), bad("tree"))
        yield Case(  # a dtype attribute but no array (jax.experimental.sparse's BCOO): was
            f"{fn_name}.tree=dtype_but_no_array",  # an object array, skipped by find_nonfinite
            lambda c, f=fn: f([c.a([1.0]), _NotAnArray()]),
            bad("tree"),
        )
        yield Case(
            f"{fn_name}.tree=int_leaf",
            lambda c, f=fn: f([c.a([1.0]), c.a([1], "int32")]),
            Valid(lambda r, c: r == [], "integer leaves cannot be non-finite: skipped (§15)")
            if fn_name == "find_nonfinite"
            else bad("tree"),
        )
        yield Case(
            f"{fn_name}.tree=mixed",
            lambda c, f=fn: f([c.other_first([1.0]), c.other([1.0])]),
            bad("arrays", errors.MixedBackendsError),
        )
    yield from [
        Case(
            "global_norm.tree=empty",
            lambda c: ns.global_norm([], backend=c.name),
            Valid(lambda r, c: float(c.np(r)) == 0.0, "the norm of no leaves is 0 (§5)"),
        ),
        Case("global_norm.norm_type=zero", lambda c: ns.global_norm(g(c), 0.0), bad("norm_type")),
        Case("global_norm.norm_type=str", lambda c: ns.global_norm(g(c), "fro"), bad("norm_type")),
        Case(
            "clip_by_global_norm.max_norm=nan",
            lambda c: ns.clip_by_global_norm(g(c), NAN),
            bad("max_norm"),
        ),
        Case(
            "clip_by_global_norm.max_norm=negative",
            lambda c: ns.clip_by_global_norm(g(c), -1.0),
            bad("max_norm"),
        ),
        Case(
            "clip_by_global_norm.max_norm=zero",
            lambda c: ns.clip_by_global_norm(g(c), 0.0),
            bad("max_norm"),
        ),
        Case(
            "clip_by_global_norm.max_norm=str",
            lambda c: ns.clip_by_global_norm(g(c), "1"),
            bad("max_norm"),
        ),
        Case(
            "clip_by_global_norm.max_norm=inf",
            lambda c: ns.clip_by_global_norm(g(c), INF),
            bad("max_norm"),
        ),
        Case(
            "clip_by_global_norm.max_norm=float32_max",
            lambda c: ns.clip_by_global_norm(g(c), F32_MAX),
            Valid(
                lambda r, c: float(c.np(r[1])) == 5.0 and float(c.np(r[0][0])[0]) == 3.0,
                "no clipping below max_norm; the norm is returned (§7)",
            ),
        ),
        Case(
            "clip_by_global_norm.norm=nan",
            lambda c: ns.clip_by_global_norm(g(c), 1.0, norm=c.a(NAN)),
            Valid(
                lambda r, c: not np.isfinite(c.np(r[1])) and c.np(r[0][0]).tolist() == [3, 4],
                "a non-finite norm is returned and every leaf left untouched (§7.3)",
            ),
        ),
        Case(
            "clip_by_global_norm.norm=vector",
            lambda c: ns.clip_by_global_norm(g(c), 1.0, norm=c.a([5.0, 5.0])),
            bad("norm.shape"),
        ),
        Case(
            "clip_by_global_norm.norm=bool",
            lambda c: ns.clip_by_global_norm(g(c), 1.0, norm=c.a(True)),
            bad("norm.dtype"),
        ),
        Case(
            "clip_by_global_norm.norm=str",
            lambda c: ns.clip_by_global_norm(g(c), 1.0, norm="5"),
            bad("norm"),
        ),
        Case(
            "clip_by_global_norm.norm=negative_number",
            lambda c: ns.clip_by_global_norm(g(c), 1.0, norm=-5.0),
            bad("norm"),
        ),
        Case(
            "clip_coefficient.norm=negative_number",
            lambda c: clip_coefficient(-5.0, 1.0, backend=c.name),
            bad("norm"),
        ),
        Case(
            "clip_by_global_norm.norm=int_one_element",
            lambda c: ns.clip_by_global_norm(g(c), 1.0, norm=c.a([5], "int32")),
            Valid(
                lambda r, c: np.allclose(c.np(r[0][0]), [0.6, 0.8]) and c.np(r[1]).shape == (),
                "a one-element integer norm is a float32 scalar (§7.3)",
            ),
        ),
        Case(
            "clip_coefficient.norm=vector",
            lambda c: clip_coefficient(c.a([5.0, 5.0]), 1.0),
            bad("norm.shape"),
        ),
        Case(
            "clip_by_value.min_value=above_max",
            lambda c: ns.clip_by_value(g(c), 1.0, -1.0),
            bad("min_value"),
        ),
        Case(
            "clip_by_value.max_value=nan",
            lambda c: ns.clip_by_value(g(c), -1.0, NAN),
            bad("max_value"),
        ),
        Case(
            "assert_finite.tree=nan",
            lambda c: ns.assert_finite([c.a([1.0, NAN])]),
            bad("grads", errors.NonFiniteError),
        ),
        Case("assert_finite.name=int", lambda c: ns.assert_finite(g(c), 3), bad("name")),
        Case("assert_finite.name=empty", lambda c: ns.assert_finite(g(c), ""), bad("name")),
        Case(
            "adaptive_grad_clip.params=structure",
            lambda c: ns.adaptive_grad_clip(g(c), [c.a([1.0, 1.0])]),
            bad("params"),
        ),
        Case(
            "adaptive_grad_clip.params=shape",
            lambda c: ns.adaptive_grad_clip([c.a([1.0, 1.0])], [c.a([1.0, 1.0, 1.0])]),
            bad("param shape"),
        ),
        Case(
            "adaptive_grad_clip.layout=unknown",
            lambda c: ns.adaptive_grad_clip(g(c), g(c), layout="abc"),
            bad("layout"),
        ),
    ]


# -- stateful objects: a rejected call leaves the state as it was -------------------------------
def stateful_cases() -> Iterator[Case]:
    def scaler_update(finite: Callable[[Ctx], Any]) -> Callable[[Ctx], Any]:
        def call(c: Ctx) -> Any:
            s = ns.LossScaler(init_scale=1024.0)
            state = s.init(backend=c.name)
            return unchanged(lambda: state, lambda: s.update(state, finite(c)))

        return call

    for label, finite in {
        "str": lambda c: "yes",
        "none": lambda c: None,
        "vector": lambda c: c.a([True, False]),
        "float_array": lambda c: c.a(1.0),
        "int": lambda c: 1,
    }.items():
        yield Case(f"LossScaler.update.finite={label}", scaler_update(finite), bad("finite"))

    def scaler_unscale(grads: Callable[[Ctx], Any], arg: str = "grads"):
        def call(c: Ctx) -> Any:
            s = ns.LossScaler()
            state = s.init(backend=c.name)
            return unchanged(lambda: state, lambda: s.unscale(grads(c), state))

        return call

    yield Case(
        "LossScaler.unscale.grads=str_leaf",
        scaler_unscale(lambda c: [c.a([1.0]), "g"]),
        bad("grads"),
    )
    yield Case(
        "LossScaler.scale.loss=str",
        lambda c: ns.LossScaler().scale("loss", ns.LossScaler().init(backend=c.name)),
        bad("loss"),
    )
    yield Case(
        "LossScaler.update.state=wrong_type",
        lambda c: ns.LossScaler().update({"scale": 1.0}, True),
        bad("state"),
    )

    def zclip(grads: Callable[[Ctx], Any]) -> Callable[[Ctx], Any]:
        def call(c: Ctx) -> Any:
            z = ns.ZClip(warmup_steps=1)
            state = z.init(backend=c.name)
            _, state = z.update([c.a([1.0, 2.0])], state)
            return unchanged(lambda: state, lambda: z.update(grads(c), state))

        return call

    yield Case("ZClip.update.grads=str_leaf", zclip(lambda c: [c.a([1.0]), "g"]), bad("grads"))
    yield Case("ZClip.update.grads=int_leaf", zclip(lambda c: [c.a([1], "int32")]), bad("grads"))

    def guard_decide(loss: Callable[[Ctx], Any], norm: Callable[[Ctx], Any] = lambda c: 1.0):
        def call(c: Ctx) -> Any:
            g = ns.TrainingGuard()
            state = g.init_state(c.name)
            return unchanged(lambda: state, lambda: g.decide(state, loss(c), norm(c), c.name))

        return call

    yield Case(
        "TrainingGuard.decide.loss=vector", guard_decide(lambda c: c.a([1.0, 2.0])), bad("loss")
    )
    yield Case("TrainingGuard.decide.loss=str", guard_decide(lambda c: "1.0"), bad("loss"))
    yield Case("TrainingGuard.decide.loss=none", guard_decide(lambda c: None), bad("loss"))
    yield Case(
        "TrainingGuard.decide.grad_norm=str",
        guard_decide(lambda c: 1.0, lambda c: "1"),
        bad("grad_norm"),
    )
    yield Case(
        "TrainingGuard.decide.grad_norm=vector",
        guard_decide(lambda c: 1.0, lambda c: c.a([1.0, 2.0])),
        bad("grad_norm"),
    )
    yield Case(
        "TrainingGuard.init_state.be=unknown",
        lambda c: ns.TrainingGuard().init_state("nope"),
        bad("'nope'", errors.UnknownBackendError),
    )
    yield Case(
        "TrainingGuard.init_state.be=int",
        lambda c: ns.TrainingGuard().init_state(3),
        bad("3", errors.UnknownBackendError),
    )
    yield Case(
        "TrainingGuard.decide.state=none",
        lambda c: ns.TrainingGuard().decide(None, 1.0, 1.0, c.name),
        bad("state"),
    )
    yield Case(
        "TrainingGuard.decide.state=other_settings",
        lambda c: ns.TrainingGuard().decide(
            ns.TrainingGuard(rollback_window=4, rollback_after=2).init_state(c.name),
            1.0,
            1.0,
            c.name,
        ),
        bad("state.bad_flags"),
    )
    yield Case(
        "TrainingGuard.decide.state=other_backend",
        lambda c: ns.TrainingGuard().decide(
            ns.TrainingGuard().init_state("numpy" if c.name != "numpy" else "jax"), 1.0, 1.0, c.name
        ),
        bad("state.loss_window"),
    )
    yield Case(
        "TrainingGuard.decide.loss=nan",
        guard_decide(lambda c: NAN),
        Valid(
            lambda r, c: not bool(np.asarray(c.np(r[0].apply))), "a NaN loss skips the step (§16)"
        ),
    )

    def firewall(batch: Callable[[Ctx], Any]) -> Callable[[Ctx], Any]:
        def call(c: Ctx) -> Any:
            fw = ns.data.Firewall("drop")
            fw.process({"x": c.a(np.ones((4, 2)))})
            return unchanged(
                lambda: fw.stats.seen if hasattr(fw.stats, "seen") else fw.stats.dropped,
                lambda: fw.process(batch(c)),
            )

        return call

    yield Case(
        "data.Firewall.process.batch=ragged",
        firewall(lambda c: {"x": c.a(np.ones((4, 2))), "y": c.a(np.ones(3))}),
        bad("batch"),
    )
    yield Case("data.Firewall.process.batch=str", firewall(lambda c: "batch"), bad("batch"))
    yield Case(
        "data.check_batch.batch_axis=beyond_rank",
        lambda c: ns.data.check_batch({"x": c.a(np.ones((4, 2)))}, batch_axis=3),
        Valid(lambda r, c: len(r.bad_samples) == 0, "rank <= batch_axis: unbatched (§17.1)"),
    )
    yield Case(
        "data.check_batch.batch_axis=negative",
        lambda c: ns.data.check_batch({"x": c.a(np.ones((4, 2)))}, batch_axis=-1),
        bad("batch_axis"),
    )


def more_api_cases() -> Iterator[Case]:
    """The rest of the public API: filters, presets, schedules, AGC, ZClip.init, guard paths."""
    sched = ns.warmup_cosine_schedule(1e-3, warmup_steps=1, total_steps=10)
    yield from [
        Case(
            "finite_summary.tree=host", lambda c: ns.finite_summary([np.ones(3)]), bad("JAX arrays")
        ),
        Case("data.MADFilter.window=one", lambda c: ns.data.MADFilter(window=1), bad("window")),
        Case(
            "data.Firewall.quarantine_prefix=path",
            lambda c: ns.data.Firewall(quarantine_dir="q", quarantine_prefix="../q"),
            bad("quarantine_prefix"),
        ),
        Case(
            "data.Firewall.quarantine_dir=int",
            lambda c: ns.data.Firewall(quarantine_dir=5),
            bad("quarantine_dir"),
        ),
        Case(
            "data.Firewall.quarantine_dir=file",
            lambda c: ns.data.Firewall(quarantine_dir=__file__),
            bad("quarantine_dir"),
        ),
        Case(
            "data.Firewall.keep_empty=str",
            lambda c: ns.data.Firewall(keep_empty="no"),
            bad("keep_empty"),
        ),
        Case(
            "data.Firewall.outlier_fields=int",
            lambda c: ns.data.Firewall(outliers="zscore", outlier_fields=5),
            bad("outlier_fields"),
        ),
        Case(
            "data.IsolationForestFilter.contamination=above_half",
            lambda c: ns.data.IsolationForestFilter(contamination=0.9),
            bad("contamination"),
        ),
        Case(
            "data.ZScoreFilter.false_positive_rate=one",
            lambda c: ns.data.ZScoreFilter(false_positive_rate=1.0),
            bad("false_positive_rate"),
        ),
        Case("LossScaler.preset.name=unknown", lambda c: ns.LossScaler.preset("apex"), bad("name")),
        Case(
            "LossScaler.from_state_dict.state_dict=foreign",
            lambda c: ns.LossScaler.from_state_dict({"x": 1}),
            bad("state_dict"),
        ),
        Case(
            "LossScaler.for_dtype.dtype=int8",
            lambda c: ns.LossScaler.for_dtype("int8"),
            bad("dtype"),
        ),
        Case("WarmupCosineSchedule.step=negative", lambda c: sched(-1), bad("step")),
        Case("WarmupCosineSchedule.step=str", lambda c: sched("1"), bad("step")),
        Case(
            "resolve_backend.backend=unknown",
            lambda c: ns.resolve_backend(_x(c), backend="x"),
            bad("'x'", errors.UnknownBackendError),
        ),
        Case(
            "AGC.clip.params=shape",
            lambda c: ns.AGC().clip([c.a([1.0, 1.0])], [c.a([1.0, 1.0, 1.0])]),
            bad("param shape"),
        ),
        Case("ZClip.init.params=str", lambda c: ns.ZClip().init("p"), bad("params")),
        Case(
            "data.guard.outlier_policy=unknown",
            lambda c: ns.data.protect([], outlier_policy="skip"),
            bad("outlier_policy"),
        ),
        Case(
            "data.guard.replace_value=nan",
            lambda c: ns.data.protect([], "replace", replace_value=NAN),
            bad("replace_value"),
        ),
        Case(
            "data.guard.batch_axis=negative",
            lambda c: ns.data.protect([], batch_axis=-1),
            bad("batch_axis"),
        ),
        Case(
            "SpikeDetector.two_sided=str",
            lambda c: ns.SpikeDetector(two_sided="yes"),
            bad("two_sided"),
        ),
        Case(
            "TrainingGuard.snapshot_dir=int",
            lambda c: ns.TrainingGuard(snapshot_dir=3),
            bad("snapshot_dir"),
        ),
        Case(
            "TrainingGuard.log_callback=int",
            lambda c: ns.TrainingGuard(log_callback=3),
            bad("log_callback"),
        ),
    ]


def backend_cases() -> Iterator[Case]:
    yield Case(
        "set_backend.name=unknown",
        lambda c: ns.set_backend("mxnet"),
        bad("mxnet", errors.UnknownBackendError),
    )
    yield Case(
        "set_backend.name=int", lambda c: ns.set_backend(3), bad("3", errors.UnknownBackendError)
    )
    yield Case(
        "use_backend.name=unknown",
        lambda c: ns.use_backend("cupy").__enter__(),
        bad("cupy", errors.UnknownBackendError),
    )
    yield Case(
        "use_backend.mismatch", lambda c: _mismatch(c), bad("selected", errors.BackendMismatchError)
    )
    yield Case(
        "check_numerics.mode=unknown",
        lambda c: ns.check_numerics(mode="all", backend=c.name),
        bad("mode"),
    )
    yield Case(
        "check_numerics.nan=str", lambda c: ns.check_numerics(nan="yes", backend=c.name), bad("nan")
    )
    yield Case(
        "check_numerics.backend=int",
        lambda c: ns.check_numerics(backend=3),
        bad("3", errors.UnknownBackendError),
    )
    yield Case(
        "locate_nonfinite.model=str", lambda c: ns.locate_nonfinite("model", _x(c)), bad("model")
    )


def _mismatch(c: Ctx) -> Any:
    other = "tensorflow" if c.name != "tensorflow" else "torch"
    if c.name == "numpy":
        other, arrays = "jax", c.other_first(np.zeros((4, 5)))
    else:
        arrays = _x(c)
    with ns.use_backend(other):
        return ns.logsumexp(arrays)


def _reader_cases(kind: str, tree: Callable[[Ctx], Any], dtype: str, how: str) -> Iterator[Case]:
    """``all_finite`` and ``find_nonfinite`` on ``tree(c)``, whose leaf ``[1]`` of ``dtype``
    holds one NaN element: what only reads finiteness reads it (§3, §15.1)."""
    yield Case(
        f"all_finite.tree={kind}_leaf",
        lambda c: ns.all_finite(tree(c)),
        Valid(lambda r, c: not bool(c.np(r)), f"{how}: its NaN is found (§3)"),
    )
    yield Case(
        f"find_nonfinite.tree={kind}_leaf",
        lambda c: ns.find_nonfinite(tree(c)),
        Valid(
            lambda r, c: [(x.path, x.nan_count, x.dtype) for x in r] == [("[1]", 1, dtype)],
            f"{how}: one record, its own dtype (§15.1)",
        ),
    )


def narrow_float_cases() -> Iterator[Case]:
    """8-bit floats (§3): refused by what computes with them, read upcast by what only
    reads finiteness."""
    g8 = lambda c: [c.a([1.0]), c.float8([1.0, NAN])]
    for fn_name, fn in {
        "global_norm": lambda t: ns.global_norm(t),
        "clip_by_global_norm": lambda t: ns.clip_by_global_norm(t, 1.0),
        "clip_by_value": lambda t: ns.clip_by_value(t, -1.0, 1.0),
        "adaptive_grad_clip": lambda t: ns.adaptive_grad_clip(t, t),
    }.items():
        arg = "grads" if fn_name == "adaptive_grad_clip" else "tree"
        yield Case(f"{fn_name}.tree=float8_leaf", lambda c, f=fn: f(g8(c)), bad(arg))
    yield from _reader_cases("float8", g8, "float8_e4m3fn", "read upcast")
    x8 = lambda c: c.float8(np.linspace(-1, 1, 20).reshape(4, 5))
    yield from [
        Case(
            "cross_entropy.logits=float8", lambda c: ns.cross_entropy(x8(c), _y(c)), bad("logits")
        ),
        Case(
            "cross_entropy.labels=float8_probabilities",
            lambda c: ns.cross_entropy(_x(c), c.float8(np.full((4, 5), 0.25))),
            bad("labels"),
        ),
        Case("logsumexp.x=float8", lambda c: ns.logsumexp(x8(c)), bad("x")),
        Case(
            "smooth_labels.labels=float8",
            lambda c: ns.smooth_labels(c.float8(np.full((4, 5), 0.25)), 0.1),
            bad("labels"),
        ),
        Case(
            "fused_linear_cross_entropy.hidden=float8",
            lambda c: ns.fused_linear_cross_entropy(
                c.float8(np.zeros((4, 3))), c.a(np.zeros((5, 3))), _y(c)
            ),
            bad("hidden"),
        ),
        Case(
            "WarmupCosineSchedule.step=float8",
            lambda c: ns.warmup_cosine_schedule(1.0, warmup_steps=1, total_steps=10)(c.float8(2.0)),
            bad("step"),
        ),
        Case(
            "data.check_batch.batch=float8_field",
            lambda c: ns.data.check_batch({"x": c.float8(np.ones((4, 2)))}),
            bad("['x']"),
        ),
    ]

    def scaler_unscale(c: Ctx) -> Any:
        s = ns.LossScaler()
        state = s.init(backend=c.name)
        return unchanged(lambda: state, lambda: s.unscale(g8(c), state))

    def zclip_update(c: Ctx) -> Any:
        z = ns.ZClip(warmup_steps=1)
        _, state = z.update([c.a([1.0, 2.0])], z.init(backend=c.name))
        return unchanged(lambda: state, lambda: z.update([c.float8([1.0, 2.0])], state))

    def guard_decide(c: Ctx) -> Any:
        g = ns.TrainingGuard()
        state = g.init_state(c.name)
        return unchanged(lambda: state, lambda: g.decide(state, c.float8(1.0), 1.0, c.name))

    yield Case("LossScaler.unscale.grads=float8_leaf", scaler_unscale, bad("grads"))
    yield Case("ZClip.update.grads=float8_leaf", zclip_update, bad("grads"))
    yield Case("TrainingGuard.decide.loss=float8", guard_decide, bad("loss"))


def complex_cases() -> Iterator[Case]:
    """Complex values (§3): refused by what computes with them, but for the global norm and
    the clipping by it (of |z|, as torch and optax); read part by part by what only reads
    finiteness (a complex element is finite when both parts are)."""
    z = lambda c, values: c.a(np.asarray(values, np.complex64))
    gz = lambda c: [c.a([1.0]), z(c, [1 + 1j, complex(0.0, NAN)])]
    for fn_name, fn in {
        "clip_by_value": lambda t: ns.clip_by_value(t, -1.0, 1.0),
        "adaptive_grad_clip": lambda t: ns.adaptive_grad_clip(t, t),
    }.items():
        arg = "grads" if fn_name == "adaptive_grad_clip" else "tree"
        yield Case(f"{fn_name}.tree=complex_leaf", lambda c, f=fn: f(gz(c)), bad(arg))
    yield Case(
        "global_norm.tree=complex_leaf",
        lambda c: ns.global_norm([c.a([1.0]), z(c, [3 + 4j, 0j])]),
        Valid(lambda r, c: abs(float(c.np(r)) - 26**0.5) < 1e-5, "of |z|, as torch (§7.2)"),
    )
    yield Case(
        "clip_by_global_norm.tree=complex_leaf",
        lambda c: ns.clip_by_global_norm(gz(c), 1.0),
        Valid(lambda r, c: np.isnan(float(c.np(r[1]))), "a NaN norm: nothing scaled (§7.3)"),
    )
    yield from _reader_cases("complex", gz, "complex64", "both parts read")
    zx = lambda c: z(c, np.linspace(-1, 1, 20).reshape(4, 5))
    yield from [
        Case(
            "cross_entropy.logits=complex", lambda c: ns.cross_entropy(zx(c), _y(c)), bad("logits")
        ),
        Case("logsumexp.x=complex", lambda c: ns.logsumexp(zx(c)), bad("x")),
        Case(
            "WarmupCosineSchedule.step=complex",
            lambda c: ns.warmup_cosine_schedule(1.0, warmup_steps=1, total_steps=10)(z(c, 2.0)),
            bad("step"),
        ),
        Case(
            "data.check_batch.batch=complex_field",
            lambda c: ns.data.check_batch({"z": z(c, [[1, 2], [3, complex(NAN, 0)]])}),
            Valid(lambda r, c: r.bad_samples == (1,), "checked: sample 1 is bad (§17.1)"),
        ),
    ]

    def scaler_unscale(c: Ctx) -> Any:
        s = ns.LossScaler()
        state = s.init(backend=c.name)
        return unchanged(lambda: state, lambda: s.unscale(gz(c), state))

    def guard_decide(c: Ctx) -> Any:
        g = ns.TrainingGuard()
        state = g.init_state(c.name)
        return unchanged(lambda: state, lambda: g.decide(state, z(c, 1.0), 1.0, c.name))

    yield Case("LossScaler.unscale.grads=complex_leaf", scaler_unscale, bad("grads"))
    yield Case("TrainingGuard.decide.loss=complex", guard_decide, bad("loss"))


# -- loss-scaler state dicts, ZClip states and norms, AGC axes, empty class axes -------------
def _loaded(c: Ctx, config: dict | None = None, **values: Any) -> Any:
    """``LossScaler.from_state_dict`` of a fresh state dict with ``values`` replaced."""
    data = ns.LossScaler().state_dict(ns.LossScaler().init())
    data["config"].update(config or {})
    data["state"].update(values)
    return ns.LossScaler.from_state_dict(data, backend=c.name)


def _zclip_call(call: Callable[[ns.ZClip, Any, Ctx], Any]) -> Callable[[Ctx], Any]:
    def run(c: Ctx) -> Any:
        z = ns.ZClip(warmup_steps=2)
        state = z.init(backend=c.name)
        return unchanged(lambda: state, lambda: call(z, state, c))

    return run


def _host_state_clips(result: Any, c: Ctx) -> bool:
    """A bare ``init()`` (NumPy) state joined the gradients' backend: warmup clip to 1."""
    (grads,), state = result
    return np.allclose(c.np(grads), [0.6, 0.8], atol=1e-6) and int(c.np(state.count)) == 1


def audit_cases() -> Iterator[Case]:
    state_dict = "LossScaler.from_state_dict"
    for label, values, arg in [
        ("growth_tracker=past_int32", {"growth_tracker": 2**40}, "growth_tracker"),
        ("growth_tracker=float", {"growth_tracker": 1.7}, "growth_tracker"),
        ("growth_tracker=str", {"growth_tracker": "x"}, "growth_tracker"),
        ("growth_tracker=nan", {"growth_tracker": NAN}, "growth_tracker"),
        ("scale=str", {"scale": "abc"}, "scale"),
        ("scale=past_float32", {"scale": 1e39}, "scale"),
        ("scale=below_float32", {"scale": 1e-50}, "scale"),
    ]:
        yield Case(f"{state_dict}.{label}", lambda c, kw=values: _loaded(c, **kw), bad(arg))
    yield Case(
        f"{state_dict}.scale=above_max_scale",
        lambda c: _loaded(c, {"init_scale": 8.0, "max_scale": 16.0}, scale=32.0),
        bad("scale"),
    )
    yield Case(
        f"{state_dict}.scale=below_min_scale",
        lambda c: _loaded(c, {"init_scale": 8.0, "min_scale": 4.0}, scale=2.0),
        bad("scale"),
    )
    s = ns.LossScaler()
    yield Case("LossScaler.state_dict.state=none", lambda c: s.state_dict(None), bad("state"))
    yield Case(
        "LossScaler.state_dict.state=dict", lambda c: s.state_dict({"scale": 1.0}), bad("state")
    )
    yield Case(
        "LossScaler.scale.loss=none",
        lambda c: s.scale(None, s.init(backend=c.name)),
        bad("loss"),
    )
    other = lambda c: ns.ZClip(warmup_steps=5).init(backend=c.name)  # another buffer length
    for name, call in {
        "update.state=other_warmup": lambda z, st, c: z.update([c.a([1.0])], other(c)),
        "coefficient.state=other_warmup": lambda z, st, c: z.coefficient(c.a(1.0), other(c)),
        "update.state=none": lambda z, st, c: z.update([c.a([1.0])], None),
        "update.state=empty_tuple": lambda z, st, c: z.update([c.a([1.0])], ()),
        "coefficient.state=none": lambda z, st, c: z.coefficient(c.a(1.0), None),
    }.items():
        yield Case(f"ZClip.{name}", _zclip_call(call), bad("state"))
    for label, norm in {
        "negative_array": lambda c: c.a(-1.0),
        "negative_number": lambda c: -1.0,
        "bool": lambda c: True,
        "complex": lambda c: c.a(1 + 1j, "complex64"),
        "vector": lambda c: c.a([1.0, 2.0]),
        "none": lambda c: None,
    }.items():
        call = lambda z, st, c, n=norm: z.coefficient(n(c), st)
        yield Case(f"ZClip.coefficient.norm={label}", _zclip_call(call), bad("norm"))
    yield Case(
        "ZClip.update.state=host",
        lambda c: ns.ZClip().update([c.a([3.0, 4.0])], ns.ZClip().init()),
        Valid(_host_state_clips, "a host state joins the gradients' backend (§8.5, §13.1)"),
    )
    yield Case(
        "AGC.clip.axis=repeated_after_normalising",
        lambda c: ns.AGC(axis=(0, -2)).clip([c.a(np.ones((2, 3)))], [c.a(np.ones((2, 3)))]),
        bad("axis"),
    )
    yield Case(
        "smooth_labels.labels=no_classes",
        lambda c: ns.smooth_labels(c.a(np.zeros((4, 0))), 0.1),
        bad("labels"),
    )


def all_cases() -> list[Case]:
    cases = [
        *hyperparameter_cases(),
        *array_cases(),
        *tree_cases(),
        *narrow_float_cases(),
        *complex_cases(),
        *stateful_cases(),
        *more_api_cases(),
        *backend_cases(),
        *audit_cases(),
    ]
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    return cases
