"""One rule for host data on every backend (§6): it is read as NumPy reads it (Python
floats float64, ints int64), then becomes the framework's array of that dtype; JAX without
x64 has no float64/int64, so finiteness reads take host leaves on the host and scalar
inputs (a loss) take host integers through float64 to float32."""

import numpy as np
import pytest

import numstab as ns
from numstab._dispatch import to_backend
from numstab.backends import load_backend
from numstab.errors import InvalidArgumentError
from numstab.guard import TrainingGuard
from numstab.guard.policy import scalar_input
from numstab.numerics import finite_summary

BACKENDS = {"numpy": np.asarray}
torch = pytest.importorskip("torch")
tf = pytest.importorskip("tensorflow")
jax = pytest.importorskip("jax")
jnp = jax.numpy
BACKENDS.update(torch=torch.as_tensor, tensorflow=tf.constant, jax=jnp.asarray)
NAMES = sorted(BACKENDS)


def _float64_dtype(name: str) -> str:
    """What a host float64 becomes on ``name``: float32 on JAX without x64."""
    return "float32" if name == "jax" and not jax.config.jax_enable_x64 else "float64"


def _leaf(name):
    return BACKENDS[name](np.ones(2, np.float32))


# -- 1a: float64 host values past float32's range are finite ------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("host", [1e300, np.array([1e300]), [1e300, -1e300]])
def test_find_nonfinite_reads_host_leaves_exactly(name, host):
    assert ns.find_nonfinite([_leaf(name), host]) == []
    ns.assert_finite({"a": _leaf(name), "b": host})


@pytest.mark.parametrize("name", NAMES)
def test_find_nonfinite_record_of_a_host_leaf(name):
    bad = BACKENDS[name](np.array([np.nan, 1.0], np.float32))
    records = ns.find_nonfinite([bad, np.array([1e300, np.inf, -2.0])])
    assert [r.path for r in records] == ["[0]", "[1]"]
    assert records[0].nan_count == 1
    host = records[1]
    assert (host.posinf_count, host.dtype, host.shape) == (1, "float64", (3,))
    assert (host.finite_min, host.finite_max) == (-2.0, 1e300)


@pytest.mark.parametrize("name", NAMES)
def test_all_finite_python_float_past_float32(name):
    """A finite host leaf is finite exactly, also beside JAX arrays without x64 (converted,
    1e300 became inf); a non-finite one is not, and a host integer leaf is still refused."""
    assert bool(np.asarray(ns.all_finite([_leaf(name), 1e300])))
    assert bool(np.asarray(ns.all_finite([_leaf(name), np.array([1e300, -1e300])])))
    assert not bool(np.asarray(ns.all_finite([_leaf(name), np.array([1e300, np.nan])])))
    assert not bool(np.asarray(ns.all_finite([_leaf(name), np.array([-np.inf])])))
    with pytest.raises(InvalidArgumentError, match="floating"):
        ns.all_finite([_leaf(name), np.array([1, 2])])


@pytest.mark.parametrize("name", ["numpy", "torch", "tensorflow"])
def test_global_norm_python_float_past_float32(name):
    norm = ns.global_norm([_leaf(name), 1e30])  # float32 squares overflowed: inf
    assert np.asarray(norm).dtype == np.float64
    assert float(np.asarray(norm)) == pytest.approx(1e30)
    assert np.isinf(np.asarray(ns.global_norm([_leaf(name), 1e300])))  # TF raised


def test_finite_summary_reads_host_leaves_exactly():
    sums = np.asarray(finite_summary([jnp.ones(2), np.array([1e300]), 2.0]).sums)
    assert np.isfinite(sums).all()
    sums = np.asarray(finite_summary([jnp.ones(2), np.array([1e300, -np.inf])]).sums)
    assert np.isneginf(sums[1])


# -- 1b: Python lists and floats are float64 (ints int64) on every backend ------------------
@pytest.mark.parametrize("name", NAMES)
def test_python_list_logits_dtype(name):
    labels = BACKENDS[name](np.array([2]))
    loss = ns.cross_entropy([[1.0, 2.0, 3.0]], labels)
    assert np.asarray(loss).dtype == _float64_dtype(name)


@pytest.mark.parametrize("name", NAMES)
def test_python_float_leaf_sets_accumulation_dtype(name):
    assert np.asarray(ns.global_norm([5.0, _leaf(name)])).dtype == _float64_dtype(name)


@pytest.mark.parametrize("name", NAMES)
def test_zclip_python_norm_dtype(name):
    zclip = ns.ZClip(warmup_steps=1)
    coef, _ = zclip.coefficient(5.0, zclip.init(backend=name))
    assert np.asarray(coef).dtype == _float64_dtype(name)
    np.testing.assert_allclose(np.asarray(coef), 1.0 / (5.0 + 1e-6), rtol=1e-6)


@pytest.mark.parametrize("name", ["numpy", "torch", "tensorflow"])
def test_python_ints_are_int64(name):
    be = load_backend(name)
    assert be.dtype_name(to_backend(be, [1, 2])) == "int64"
    assert be.dtype_name(to_backend(be, 1.5)) == "float64"


# -- 1c: host integer losses do not wrap; huge ints raise a typed error ---------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("loss", [np.int64(2**40), 2**40, np.array([2**40], np.int64)])
def test_host_integer_loss_does_not_wrap(name, loss):
    out = scalar_input(load_backend(name), "loss", loss)
    assert load_backend(name).dtype_name(out) == "float32"
    assert float(np.asarray(out)) == 2.0**40


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("field", ["loss", "grad_norm"])
def test_int_past_float64_is_a_typed_error(name, field):
    guard = TrainingGuard()
    state = guard.init_state(name)
    args = {"loss": 1.0, "grad_norm": 1.0, field: 10**400}
    with pytest.raises(InvalidArgumentError, match=rf"{field} to be a number within float64"):
        guard.decide(state, args["loss"], args["grad_norm"], name)


@pytest.mark.parametrize("name", NAMES)
def test_a_norm_past_float64_is_a_typed_error(name):
    """clip_by_global_norm(norm=10**400) raised Python's OverflowError (float(norm))."""
    with pytest.raises(InvalidArgumentError, match="norm to be a number within float64"):
        ns.clip_by_global_norm([_leaf(name)], 1.0, norm=10**400)
