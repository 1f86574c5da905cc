"""A dataclass node is rebuilt as a copy with its ``init=True`` fields replaced (§6 rule 4):
``__init__`` / ``__post_init__`` do not run again, so ``init=False`` fields keep the input's
values (``dataclasses.replace`` reset them) and an ``InitVar`` is no error (``replace``
raised ``ValueError: InitVar 'k' must be specified with replace()``). ``init=False`` fields
are not leaves, as ``jax.tree_util.register_dataclass`` takes only ``init=True`` fields as
data."""

import dataclasses

import numpy as np
import pytest

import numstab as ns
from numstab.errors import InvalidArgumentError
from numstab.tree import flatten, unflatten

ARRAYS = {"numpy": np.asarray}
try:
    import torch

    ARRAYS["torch"] = torch.as_tensor
except ImportError:  # pragma: no cover - torch is optional
    pass


def _host(x):
    return np.asarray(x.detach() if hasattr(x, "detach") else x)


@dataclasses.dataclass
class Grads:
    w: object
    ema: object = dataclasses.field(init=False)
    calls: int = dataclasses.field(init=False, default=0)

    def __post_init__(self):
        self.ema = np.zeros(2, np.float32)
        self.calls += 1


@dataclasses.dataclass
class WithInitVar:
    w: object
    k: dataclasses.InitVar[int]

    def __post_init__(self, k):
        self.scale = k  # state made by the InitVar: kept by the copy


@dataclasses.dataclass(frozen=True)
class Frozen:
    w: object
    tag: str = dataclasses.field(init=False, default="")


@dataclasses.dataclass(slots=True)
class Slotted:
    w: object
    b: object


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenSlotted:
    w: object
    step: int = dataclasses.field(init=False, default=0)


def _grads(asarray):
    g = Grads(asarray(np.array([3.0, 4.0], np.float32)))
    g.ema = asarray(np.array([7.0, 7.0], np.float32))
    return g


@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_init_false_fields_kept_and_post_init_not_rerun(name):
    g = _grads(ARRAYS[name])
    out = ns.clip_by_value(g, -3.5, 3.5)
    assert isinstance(out, Grads) and out is not g
    np.testing.assert_array_equal(_host(out.w), [3.0, 3.5])  # clamping is exact
    np.testing.assert_array_equal(_host(out.ema), [7.0, 7.0])  # was [0, 0]
    assert out.ema is g.ema and out.calls == 1  # __post_init__ ran once, for g
    np.testing.assert_array_equal(_host(g.w), [3.0, 4.0])  # the input is not changed


@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_init_false_array_field_is_not_a_leaf(name):
    g = _grads(ARRAYS[name])
    leaves, treedef = flatten(g)
    assert len(leaves) == 1 and leaves[0] is g.w
    _, norm = ns.clip_by_global_norm(g, 100.0)
    assert float(_host(norm)) == pytest.approx(5.0, rel=1e-6)  # |(3, 4)|, ema left out
    rebuilt = unflatten(treedef, [ARRAYS[name](np.ones(2, np.float32))])
    np.testing.assert_array_equal(_host(rebuilt.ema), [7.0, 7.0])


@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_initvar_dataclass_is_rebuilt(name):
    tree = WithInitVar(ARRAYS[name](np.array([3.0], np.float32)), 5)
    clipped = ns.clip_by_value(tree, -1.0, 1.0)
    assert isinstance(clipped, WithInitVar) and clipped.scale == 5
    np.testing.assert_array_equal(_host(clipped.w), [1.0])
    scaled, norm = ns.clip_by_global_norm({"g": tree}, 1.0)
    assert float(_host(norm)) == pytest.approx(3.0, rel=1e-6)
    # 3 * (1 / 3) in float32: within a few ulps of 1
    np.testing.assert_allclose(_host(scaled["g"].w), [1.0], rtol=4 * np.finfo(np.float32).eps)
    assert scaled["g"].scale == 5


@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_frozen_and_slotted_dataclasses(name):
    frozen = Frozen(ARRAYS[name](np.array([-9.0], np.float32)))
    object.__setattr__(frozen, "tag", "set after init")
    out = ns.clip_by_value(frozen, -2.0, 2.0)
    assert isinstance(out, Frozen) and out.tag == "set after init"
    np.testing.assert_array_equal(_host(out.w), [-2.0])
    with pytest.raises(dataclasses.FrozenInstanceError):  # still frozen
        out.w = None
    slotted = Slotted(ARRAYS[name](np.array([9.0], np.float32)), None)
    out = ns.clip_by_value(slotted, -2.0, 2.0)
    assert isinstance(out, Slotted) and out.b is None
    np.testing.assert_array_equal(_host(out.w), [2.0])
    both = FrozenSlotted(ARRAYS[name](np.array([9.0], np.float32)))
    object.__setattr__(both, "step", 7)
    out = ns.clip_by_value(both, -2.0, 2.0)
    assert isinstance(out, FrozenSlotted) and out.step == 7
    np.testing.assert_array_equal(_host(out.w), [2.0])


@dataclasses.dataclass
class NoCopy:
    w: object

    def __copy__(self):
        raise TypeError("cannot copy NoCopy")


def test_uncopyable_dataclass_raises_invalid_argument():
    with pytest.raises(InvalidArgumentError, match=r"dataclass NoCopy .*cannot copy NoCopy"):
        ns.clip_by_value(NoCopy(np.array([3.0])), -1.0, 1.0)
