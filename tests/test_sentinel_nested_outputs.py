"""torch sentinel (``check_numerics(mode="sentinel")``, docs §14.6): every floating or complex
tensor of every ``nn.Module`` output is recorded, the output read as a tree (§6: nested
tuples, lists and dicts, namedtuples, dataclasses). Before, the hook looked one level into a
tuple, list or dict only: a NaN auxiliary loss in ``(x, {"z_loss": ...})`` or a field of a
dataclass output was missed, while ``locate_nonfinite`` found it."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest

from numstab import NonFiniteError, check_numerics

torch = pytest.importorskip("torch")


@dataclasses.dataclass
class Output:
    hidden: torch.Tensor
    aux: torch.Tensor


class Pair(NamedTuple):
    hidden: torch.Tensor
    extra: list


def _nested(x, bad):
    return (x, {"z_loss": bad})


def _dataclass(x, bad):
    return Output(x, bad)


def _deep(x, bad):
    return [Pair(x, [{"a": x, "b": (x, bad)}])]


class Router(torch.nn.Module):
    """Returns ``x`` and, somewhere in its output's tree, ``log(-1)`` (NaN) or ``log(1)``."""

    def __init__(self, shape, value: float) -> None:
        super().__init__()
        self.shape, self.value = shape, value

    def forward(self, x):
        return self.shape(x, torch.log(torch.full((), self.value)))


class Model(torch.nn.Module):
    def __init__(self, shape, value: float) -> None:
        super().__init__()
        self.router = Router(shape, value)

    def forward(self, x):
        self.router(x)
        return x * 2


class Gen(torch.nn.Module):
    def forward(self, x):
        return (x * i for i in range(3))


SHAPES = [_nested, _dataclass, _deep]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_nan_anywhere_in_a_module_output_is_reported(shape):
    with check_numerics(mode="sentinel") as cn:  # the same tree, finite: clean
        Model(shape, 1.0)(torch.ones(3))
        out = Gen()(torch.ones(2))  # an iterator is not walked: the caller gets every item
        assert len(list(out)) == 3
        cn.check()
    model = Model(shape, -1.0)  # alive at exit, when the record's name is resolved
    with pytest.raises(NonFiniteError) as info, check_numerics(mode="sentinel"):
        model(torch.ones(3))
    e = info.value
    assert (e.framework, e.op, e.phase) == ("torch", "router (Router)", "forward")
