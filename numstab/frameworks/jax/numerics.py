"""JAX machinery for ``check_numerics``.

- ``mode="op"``: ``jax_debug_nans`` (``nan``) and ``jax_debug_infs`` (``inf``), the native
  switches, restored on exit. Eager, every primitive is checked; under ``jit`` the outputs are
  checked and, on a hit, JAX reruns the function de-optimized, op by op, to name the primitive.
  Under ``jit`` JAX checks only the *outputs* of the compiled function, so a NaN that does not
  reach an output (``jit(grad(f))`` where ``f`` takes ``log`` of a negative number whose
  gradient is finite) is not reported. numstab keeps this rule rather than setting
  ``jax_disable_jit``: with jit disabled, the ``-inf`` constants inside ``jax.nn.softmax``'s
  custom JVP are staged as arrays and ``jax_debug_infs`` reports them (measured). Traceback
  filtering is turned off inside the context so that the phase and the user's line can be read
  from the traceback.
- ``mode="sentinel"``: nothing is switched on; ``watch`` records a jitted per-leaf sum
  (float32 or wider) without a host sync, or records as it is a ``FiniteSummary`` that
  ``finite_summary`` computed inside the user's jitted step (``leaf_sums`` here).
"""

from __future__ import annotations

import contextlib
import re
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from numstab.errors import NonFiniteError
from numstab.numerics import _where
from numstab.numerics._ops import floating_point_match, op_error

_OPTIONS = ("jax_debug_nans", "jax_debug_infs", "jax_traceback_filtering")
_MESSAGE = re.compile(r"invalid value \((nan|inf)\) encountered in (\S+)")
#: primitives reported under another name, with their kind (``op_error``'s ``kind``): JAX's
#: ``stage`` (``jax.lax.stage``) lifts a value into the trace; eagerly it is the transfer of
#: a host value (a NumPy array, a Python scalar: ``jnp.asarray(x)``) to the device, the one
#: place JAX checks it, so a ``-inf`` mask built with NumPy was reported as ``op="stage"``,
#: ``op_kind=None``. Named as the public API that does it, of kind ``cast`` (torch's
#: ``_to_copy``, its transfer, is one too)
_RENAMED = {"stage": ("device_put", "cast")}
#: what JAX raises when a jitted call's output holds NaN/inf and the de-optimized rerun finds
#: no primitive that made it: ``('jit(<lambda>)', 'inf'). Because ...``
_JIT_MESSAGE = re.compile(r"^\('([^']+)', '(nan|inf)'\)")


class Arm:
    """JAX's part of one active ``check_numerics`` context."""

    def __init__(self, settings, recorder) -> None:
        self.settings = settings
        self._previous: dict[str, Any] | None = None

    def enter(self) -> None:
        if self.settings.mode != "op":
            return
        self._previous = {name: getattr(jax.config, name) for name in _OPTIONS}
        # both False: checks off inside
        _set_checks(self.settings.nan, self.settings.inf)
        if self.settings.nan or self.settings.inf:
            jax.config.update("jax_traceback_filtering", "off")

    def exit(self) -> None:
        if self._previous is not None:
            previous = self._previous
            _set_checks(previous["jax_debug_nans"], previous["jax_debug_infs"])
            jax.config.update("jax_traceback_filtering", previous["jax_traceback_filtering"])
            self._previous = None

    def convert(self, exc: BaseException) -> NonFiniteError | None:
        groups = floating_point_match(exc, _MESSAGE)
        if groups is None:
            # a jitted call's output held the value, and its de-optimized rerun named no
            # primitive (an inf or NaN that came in through the arguments): the call is named
            groups = floating_point_match(exc, _JIT_MESSAGE)
            if groups is None:
                return None
            groups = groups[::-1]
        value, primitive = groups
        phase, where = _phase_and_where(exc, primitive)
        op, kind = _RENAMED.get(primitive, (primitive, None))
        return op_error(
            "jax",
            op,
            produced="NaN" if value == "nan" else "inf",
            phase=phase,
            where=where,
            detail=f"jax: {exc}",  # JAX's own name stays here
            kind=kind,
        )


def _phase_and_where(exc: BaseException, op: str) -> tuple[str, str | None]:
    """The phase from the traceback: a frame of JAX's ``backward_pass`` (transpose), or a
    JVP rule computing a derivative coefficient, means backward. Inward of the innermost
    ``*jvp*`` frame of ``ad.py``, past the rule plumbing (``call_wrapped``, ``*_jvp`` rules),
    a rule computing the primal reaches ``bind`` or the op's own function (``sub`` for
    ``_sub_jvp`` under ``linearize``); anything else (a ``defjvp`` lambda) is a coefficient.
    The user's line comes from the failing equation's source info (backward pass) or the
    traceback."""
    backward, where = False, None
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    jvp_at = None
    for i, frame in enumerate(frames):
        name, filename = frame.f_code.co_name, frame.f_code.co_filename
        if name.startswith("backward_pass"):
            backward = True
            eqn = frame.f_locals.get("eqn")
            if eqn is not None:
                where = _eqn_where(eqn) or where
        if "jvp" in name and filename.endswith("ad.py"):
            jvp_at = i
    if jvp_at is not None:
        inner = (f.f_code.co_name for f in frames[jvp_at + 1 :])
        rule = next((n for n in inner if n != "call_wrapped" and "jvp" not in n), "bind")
        backward = backward or rule not in ("bind", op)
    phase = "backward" if backward else "forward"
    return phase, where or _where.from_traceback(exc.__traceback__)


def _eqn_where(eqn: Any) -> str | None:
    source_info_util = sys.modules.get("jax._src.source_info_util")
    try:
        frame = source_info_util.user_frame(eqn.source_info.traceback)
    except Exception:  # private API: best effort
        return None
    if frame is None or not _where.is_user_file(frame.file_name):
        return None
    return f"{frame.file_name}:{frame.start_line}"


def _leaf_sum(x: jax.Array) -> jax.Array:
    """The sum in float32 (float64 stays); complex: real part plus imaginary part. 8-bit
    floats are summed in float32 too (JAX promotes them to nothing implicitly)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        s = jnp.sum(x)
        s = s.real + s.imag
    else:
        s = jnp.sum(x, dtype=jnp.float64 if x.dtype == jnp.float64 else jnp.float32)
    return s if s.dtype == jnp.float64 else s.astype(jnp.float32)


@jax.jit
def _summary(leaves: list) -> jax.Array:
    """Per-leaf sums: NaN and inf propagate through a sum, which is one fused pass (a finite
    leaf whose sum overflows reads as inf)."""
    return jnp.stack([_leaf_sum(x) for x in leaves])


def _floating(leaves: list) -> list:
    return [x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact) and x.size]


def summarize(leaves: list) -> Any:
    leaves = _floating(leaves)
    return _summary(leaves) if leaves else None


@contextlib.contextmanager
def quiet():
    """``jax_debug_nans`` / ``jax_debug_infs`` off (in this thread) while ``watch`` computes
    its own summaries: a NaN is reported under the watched name, not as a ``reduce_sum``
    fault, and a finite leaf whose sum overflows is not reported at once."""
    if not (jax.config.jax_debug_nans or jax.config.jax_debug_infs):
        yield
        return
    with jax.debug_nans(False), jax.debug_infs(False):
        yield


def leaf_sums(leaves: list) -> jax.Array:
    """``finite_summary``'s array, traceable: per-leaf sums, empty when no leaf is floating."""
    leaves = _floating([jnp.asarray(x) for x in leaves])
    return _summary(leaves) if leaves else jnp.zeros((0,), jnp.float32)


def read_summaries(summaries: list) -> list[tuple[bool, bool]]:
    """(has_nan, has_inf) per summary; all summaries are fetched in one ``device_get``."""
    out = []
    for s in jax.device_get([s for s in summaries if s is not None]):
        out.append((bool(np.isnan(s).any()), bool(np.isinf(s).any())))
    it = iter(out)
    return [(False, False) if s is None else next(it) for s in summaries]


def _set_checks(nan: bool, inf: bool) -> None:
    """Set jax_debug_nans / jax_debug_infs. When a check turns on, clear JAX's caches: seen on
    jax 0.10.2, an op dispatched while the check was off (same shapes) skips it afterwards
    through JAX's C++ dispatch cache. Cost: the ops run next compile again."""
    turned_on = (nan and not jax.config.jax_debug_nans) or (inf and not jax.config.jax_debug_infs)
    jax.config.update("jax_debug_nans", nan)
    jax.config.update("jax_debug_infs", inf)
    if turned_on:
        jax.clear_caches()
