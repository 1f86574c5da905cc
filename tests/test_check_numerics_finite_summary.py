"""finite_summary: finiteness summaries computed inside a jitted JAX step, watched outside.

A NaN or inf in any floating leaf summarised inside ``jax.jit`` must raise ``NonFiniteError``
at ``check()`` or at exit, naming the first watched name that held it; clean steps raise
nothing; bad input raises ``InvalidArgumentError``.
"""

from __future__ import annotations

import numpy as np
import pytest

from numstab.errors import InvalidArgumentError, NonFiniteError, NumstabError
from numstab.numerics import check_numerics
from numstab.numerics.summary import FiniteSummary, finite_summary

jax = pytest.importorskip("jax")
jnp = jax.numpy

NAN, INF = float("nan"), float("inf")


def _loss(p):
    # sqrt(sum(w*w)) at w = 0 is 0 (finite) but its gradient is 0/0: NaN only in grads["w"]
    return jnp.sqrt(jnp.sum(p["w"] * p["w"])) + jnp.sum(p["b"] ** 2)


@jax.jit
def _step(p):
    loss, grads = jax.value_and_grad(_loss)(p)
    new = jax.tree_util.tree_map(lambda a, g: a - 0.1 * g, p, grads)
    count = jnp.arange(2)  # an integer leaf: skipped
    return new, loss, (finite_summary(loss), finite_summary((grads, count)))


def _params(w):
    return {"w": jnp.asarray(w, jnp.float32), "b": jnp.ones(3, jnp.float32)}


def test_nan_in_grads_summarised_in_jit_raises_at_check_with_the_name():
    with check_numerics(mode="sentinel", backend="jax") as cn:
        _, loss, (loss_ok, grads_ok) = _step(_params([0.0, 0.0]))
        assert np.isfinite(float(loss))
        assert isinstance(grads_ok, FiniteSummary)
        assert grads_ok.sums.shape == (2,)  # w and b; the integer leaf is skipped
        cn.watch(loss_ok, "loss")
        cn.watch(grads_ok, "grads")
        with pytest.raises(NonFiniteError) as info:
            cn.check()
        err = info.value
        assert (err.framework, err.op, err.phase, err.paths) == ("jax", "grads", None, ("grads",))
        assert "NaN" in str(err) and "grads" in str(err)
        assert err.where is not None and err.where.startswith(__file__)
        cn.check()  # the record was cleared


def test_raises_at_exit_and_names_the_first_watched_name():
    with (
        pytest.raises(NonFiniteError) as info,
        check_numerics(mode="sentinel", backend="jax") as cn,
    ):
        cn.watch(finite_summary({"a": jnp.ones(2)}), "clean")
        cn.watch(finite_summary([jnp.array([1.0, INF])]), "first")
        cn.watch(finite_summary(jnp.array([NAN])), "second")
    assert info.value.op == "first"
    assert info.value.paths == ("first", "second")
    assert "inf" in str(info.value)


def test_clean_step_raises_nothing_and_summaries_match_eager():
    p = _params([1.0, 2.0])
    with check_numerics(mode="sentinel", backend="jax") as cn:
        for _ in range(3):
            p, _, (loss_ok, grads_ok) = _step(p)
            cn.watch(loss_ok, "loss")
            cn.watch(grads_ok, "grads")
            cn.check()
    grads = jax.grad(_loss)(_params([1.0, 2.0]))
    eager = finite_summary(grads).sums
    jitted = jax.jit(finite_summary)(grads).sums
    np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(eager), [6.0, 3 / np.sqrt(5)], rtol=1e-6)  # b, w


def test_summary_is_recorded_as_it_is():
    """+inf and -inf in two leaves stay two infs (summed again, they would read as NaN)."""
    both = finite_summary({"a": jnp.array([INF]), "b": jnp.array([-INF])})
    with pytest.raises(NonFiniteError) as info, check_numerics(mode="sentinel") as cn:
        cn.watch(both, "both")
    assert "found inf first" in str(info.value)
    with pytest.raises(NonFiniteError) as info, check_numerics(mode="sentinel") as cn:
        cn.watch([both], "nested")  # an ordinary tree: its sums are summed again
    assert "found NaN first" in str(info.value)


def test_flags_select_what_counts():
    inf_only = finite_summary(jnp.array([INF, 1.0]))
    with check_numerics(mode="sentinel", backend="jax", inf=False) as cn:
        cn.watch(inf_only, "x")  # inf not checked: clean
    with pytest.raises(NonFiniteError), check_numerics(mode="sentinel", backend="jax") as cn:
        cn.watch(inf_only, "x")


def test_low_precision_and_complex_leaves():
    big = jnp.full(4, 60000.0, jnp.float16)  # finite; its float16 sum would overflow
    with check_numerics(mode="sentinel", backend="jax") as cn:
        cn.watch(jax.jit(finite_summary)({"h": big, "bf": big.astype(jnp.bfloat16)}), "x")
    assert finite_summary(big).sums.dtype == jnp.float32
    for bad in (
        jnp.array([1.0, INF], jnp.bfloat16),
        jnp.array([1.0, NAN], jnp.float16),
        jnp.array([1 + 0j, complex(1.0, NAN)], jnp.complex64),
    ):
        with pytest.raises(NonFiniteError), check_numerics(mode="sentinel", backend="jax") as cn:
            cn.watch(jax.jit(finite_summary)(bad), str(bad.dtype))


def test_summary_fetched_to_the_host_is_still_checked():
    host = jax.device_get(finite_summary(jnp.array([NAN])))
    assert isinstance(host, FiniteSummary) and isinstance(host.sums, np.ndarray)
    with pytest.raises(NonFiniteError) as info, check_numerics(mode="sentinel") as cn:
        cn.watch(host, "host")
    assert info.value.op == "host"


def test_bad_input():
    for tree in ({}, [None], np.ones(2), {"a": 1.0}):
        with pytest.raises(InvalidArgumentError, match="Expected a tree of JAX arrays"):
            finite_summary(tree)
    with check_numerics(mode="sentinel", backend="jax") as cn:
        for sums in ("x", None, jnp.ones((2, 2)), jnp.arange(3)):
            with pytest.raises(InvalidArgumentError, match=r"Expected FiniteSummary\.sums"):
                cn.watch(FiniteSummary(sums), "s")
        with pytest.raises(InvalidArgumentError, match="return finite_summary"):
            jax.jit(lambda x: cn.watch(finite_summary(x), "x"))(jnp.ones(2))
        with pytest.raises(InvalidArgumentError, match="return finite_summary"):
            jax.jit(lambda x: cn.watch(x, "x"))(jnp.ones(2))
    with pytest.raises(NumstabError, match="active check_numerics"):
        check_numerics(mode="sentinel").watch(finite_summary(jnp.ones(2)), "x")


def test_host_leaves_next_to_jax_arrays():
    """Converted and summarised; a string or an object leaf raised JAX's raw TypeError
    (``Value 'abc' with dtype <U3 is not a valid JAX array type``): now, as in watch and
    find_nonfinite, InvalidArgumentError, eagerly and under jit."""
    mixed = [jnp.ones(2), np.array([NAN]), 1.5, np.float32(INF), 3]
    sums = np.asarray(finite_summary(mixed).sums)
    assert sums.shape == (4,)  # the integer leaf is skipped
    assert np.isnan(sums[1]) and sums[2] == 1.5 and np.isinf(sums[3])
    for leaf in ("abc", np.array(["a", "b"]), object()):
        with pytest.raises(InvalidArgumentError, match="Expected tree leaves to be an array"):
            finite_summary([jnp.ones(2), leaf])
        with pytest.raises(InvalidArgumentError, match="Expected tree leaves to be an array"):
            jax.jit(lambda x, leaf=leaf: finite_summary([x, leaf]))(jnp.ones(2))


def test_watch_reads_host_leaves_next_to_jax_arrays():
    """A Python float leaf raised a raw AttributeError (``'float' object has no attribute
    'dtype'``); an ml_dtypes float8 NumPy leaf was missed on NumPy and torch."""
    ml_dtypes = pytest.importorskip("ml_dtypes")

    for leaf in (NAN, np.array([1.0, NAN], ml_dtypes.float8_e4m3fn), [1.0, INF]):
        cn = check_numerics(mode="sentinel", backend="jax")
        with pytest.raises(NonFiniteError) as info, cn:
            cn.watch({"a": jnp.ones(2), "b": leaf}, "grads")
        assert info.value.op == "grads" and info.value.framework == "jax"
    with check_numerics(mode="sentinel", backend="numpy") as cn, pytest.raises(NonFiniteError):
        cn.watch(np.array([NAN], ml_dtypes.float8_e5m2), "f8")
        cn.check()


def test_other_frameworks_are_rejected():
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidArgumentError, match="Received: tree with Tensor"):
        finite_summary({"g": torch.ones(2)})
