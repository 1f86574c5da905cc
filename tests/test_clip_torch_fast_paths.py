"""The torch fast paths of numstab.clipping (``native_dtypes_and_nonempty``, the ``_OneKernel``
facts it hands to the norm and scaling kernels, ``native_clip_factor``) give bit for bit what
the torch backend gives without them, and the same errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numstab  # noqa: E402
from numstab.backends._base import Backend  # noqa: E402
from numstab.clipping import LARGEST_FINITE, SMALLEST_NORMAL, clip_coefficient  # noqa: E402
from numstab.errors import InvalidArgumentError  # noqa: E402
from numstab.frameworks.torch import backend as torch_backend  # noqa: E402
from numstab.tree import leaves_with_paths  # noqa: E402

FAST_PATHS = ("native_dtypes_and_nonempty", "native_clip_factor")


@pytest.fixture
def without_fast_paths(monkeypatch):
    """A context-free switch: call it to remove the torch fast paths for the rest of a test."""

    def remove() -> None:
        for name in FAST_PATHS:
            monkeypatch.delattr(torch_backend.TorchBackend, name)

    return remove


def _bits(x: torch.Tensor) -> np.ndarray:
    """The raw bits of a tensor (NaN payloads and signed zeros included)."""
    x = x.detach().cpu().contiguous()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return x.view(ints[x.element_size()]).numpy()


def _assert_same(a, b) -> None:
    if b is None:
        assert a is None
        return
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
    np.testing.assert_array_equal(_bits(a), _bits(b))


def _trees() -> dict[str, list]:
    gen = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    return {
        "uniform float32": [r(4) for _ in range(50)],
        "under max_norm": [r(3, scale=1e-3) for _ in range(5)],
        "float64": [r(7, dtype=torch.float64) for _ in range(4)],
        "float16 and float32": [r(5, dtype=torch.float16), r(6), r(2, 3, dtype=torch.bfloat16)],
        "float32 and float64": [r(5), r(6, dtype=torch.float64)],
        "empty leaves": [r(4), torch.zeros(0), r(3), torch.zeros(2, 0)],
        "only empty": [torch.zeros(0), torch.zeros(0, 3)],
        "None leaves": [None, r(4), None, r(2, 2)],
        "None and empty": [r(3), None, torch.zeros(0, dtype=torch.float64)],
        "nonfinite": [r(4), torch.tensor([1.0, math.inf]), r(2)],
        "nan": [torch.tensor([math.nan, 1.0]), r(3)],
        "zeros": [torch.zeros(3), torch.zeros(2)],
        "nested": {"a": [r(2), r(3)], "b": (r(4), {"c": r(1)})},
        "empty tree": [],
    }


@pytest.mark.parametrize("name", sorted(_trees()))
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("max_norm", [1.0, 0.37, 1e-30, 1e300])
def test_clip_by_global_norm_matches_the_path_without_fast_paths(
    name, norm_type, max_norm, without_fast_paths
):
    tree = _trees()[name]

    def clip():
        return numstab.clip_by_global_norm(tree, max_norm, norm_type=norm_type, backend="torch")

    fast, fast_norm = clip()
    without_fast_paths()
    slow, slow_norm = clip()
    _assert_same(fast_norm, slow_norm)
    assert type(fast) is type(slow)
    fast_leaves = list(leaves_with_paths(fast))
    slow_leaves = list(leaves_with_paths(slow))
    assert [p for p, _ in fast_leaves] == [p for p, _ in slow_leaves]
    for (_, a), (_, b) in zip(fast_leaves, slow_leaves, strict=True):
        _assert_same(a, b)


@pytest.mark.parametrize("name", sorted(_trees()))
def test_global_norm_and_all_finite_match_the_path_without_fast_paths(name, without_fast_paths):
    tree = _trees()[name]

    def calls() -> list:
        return [
            numstab.global_norm(tree, backend="torch"),
            numstab.global_norm(tree, math.inf, backend="torch"),
            numstab.all_finite(tree, backend="torch"),
        ]

    fast = calls()
    without_fast_paths()
    slow = calls()
    for a, b in zip(fast, slow, strict=True):
        _assert_same(a, b)


def _norms(dtype: torch.dtype) -> list[float]:
    finfo = torch.finfo(dtype)
    rng = np.random.default_rng(1)
    return [
        0.0,
        -0.0,
        finfo.tiny,
        finfo.tiny / 4,
        1.0,
        float(np.nextafter(np.float32(1.0), np.float32(2.0))),
        float(np.nextafter(np.float32(1.0), np.float32(0.0))),
        0.37,
        3.0,
        finfo.max,
        math.inf,
        -math.inf,
        math.nan,
        *(10.0 ** rng.uniform(-30, 30, 20)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clip_coefficient_matches_the_generic_composite(dtype, without_fast_paths):
    rng = np.random.default_rng(2)
    key = str(dtype).removeprefix("torch.")
    max_norms = [
        1.0,
        0.37,
        SMALLEST_NORMAL[key],  # the smallest limit the fast path takes
        LARGEST_FINITE[key],
        1e300,  # beyond float32: clamped to its largest finite
        *(10.0 ** rng.uniform(-30, 30, 40)),
    ]
    norms = torch.tensor(_norms(dtype), dtype=dtype)
    fast = [clip_coefficient(n, m) for m in max_norms for n in norms]
    without_fast_paths()
    slow = [clip_coefficient(n, m) for m in max_norms for n in norms]
    for a, b in zip(fast, slow, strict=True):
        _assert_same(a, b)


def test_clip_coefficient_of_other_norms_takes_the_generic_path():
    """16-bit and integer norms, and a tiny limit, are not the fast path's: it hands them to
    the generic ``Backend.clip_factor``."""
    be = torch_backend.BACKEND
    cases = [
        (torch.tensor(2.0, dtype=torch.float16), 1.0, "float16", False),
        (torch.tensor(2), 1.0, "float32", False),
        (torch.tensor(0.0), 1e-45, "float32", True),
        (torch.tensor(2.0), 1e-45, "float32", True),
    ]
    for args in cases:
        _assert_same(be.native_clip_factor(*args), Backend.clip_factor(be, *args))
    got = clip_coefficient(torch.tensor(4.0, dtype=torch.float16), 1.0)
    assert got.dtype == torch.float16 and got.item() == 0.25


def test_the_facts_are_recorded_only_when_they_hold():
    be = torch_backend.BACKEND
    a, b = torch.ones(2), torch.ones(3)
    names, leaves = be.native_dtypes_and_nonempty([a, b])
    assert names == {"float32"}
    assert type(leaves) is torch_backend._OneKernel and leaves.dtype == torch.float32
    assert leaves.on(torch.device("cpu")) and list(leaves) == [a, b]
    for mixed in ([a, b.double()], [a, torch.ones(0)]):
        names, leaves = be.native_dtypes_and_nonempty(mixed)
        assert type(leaves) is list
    names, leaves = be.native_dtypes_and_nonempty([a, torch.ones(0), b.double()])
    assert names == {"float32", "float64"} and [x.numel() for x in leaves] == [2, 3]


@pytest.mark.parametrize(
    "tree",
    [
        [torch.ones(2), torch.ones(2, dtype=torch.int32)],
        [None, torch.zeros(0), torch.ones(1, dtype=torch.bool)],
        [torch.zeros(0, dtype=torch.int64)],
        {"w": torch.ones(2, dtype=torch.float64), "b": torch.ones(2, dtype=torch.uint8)},
    ],
)
def test_non_floating_leaves_raise_the_same_error(tree, without_fast_paths):
    calls = [
        lambda t: numstab.clip_by_global_norm(t, 1.0),
        numstab.global_norm,
        numstab.all_finite,
    ]
    fast = []
    for call in calls:
        with pytest.raises(InvalidArgumentError) as error:
            call(tree)
        fast.append(str(error.value))
    without_fast_paths()
    for call, message in zip(calls, fast, strict=True):
        with pytest.raises(InvalidArgumentError) as error:
            call(tree)
        assert str(error.value) == message


def test_clipping_under_torch_compile_matches_eager():
    leaves = [torch.randn(4, generator=torch.Generator().manual_seed(3)) * 2 for _ in range(6)]
    compiled = torch.compile(lambda t: numstab.clip_by_global_norm(t, 1.0), backend="eager")
    got, norm = compiled(leaves)
    want, want_norm = numstab.clip_by_global_norm(leaves, 1.0)
    _assert_same(norm, want_norm)
    for a, b in zip(got, want, strict=True):
        _assert_same(a, b)


@pytest.mark.parametrize("forced", ["1", "0"])
def test_force_generic_read_at_call_time_decides_every_kernel(forced, monkeypatch):
    """clip_by_global_norm reads NUMSTAB_FORCE_GENERIC once per call: set, none of the four
    torch fast kernels runs; unset ("0"), all four do."""
    kernels = {*FAST_PATHS, "native_global_norm", "native_scale_leaves"}
    called = _spy_on(kernels, monkeypatch)
    monkeypatch.setenv("NUMSTAB_FORCE_GENERIC", forced)
    leaves = [torch.full((3,), 2.0), torch.full((2,), -1.0)]
    clipped, norm = numstab.clip_by_global_norm(leaves, 1.0)
    eps = torch.finfo(torch.float32).eps
    assert norm.item() == pytest.approx(math.sqrt(14.0), rel=4 * eps)
    for got, leaf in zip(clipped, leaves, strict=True):
        torch.testing.assert_close(got, leaf / math.sqrt(14.0), rtol=8 * eps, atol=0.0)
    assert called == (set() if forced == "1" else kernels)


def _spy_on(kernels: set[str], monkeypatch) -> set[str]:
    """The names of the torch backend's ``kernels`` that run from now on (still running)."""
    called: set[str] = set()
    for name in kernels:
        original = getattr(torch_backend.TorchBackend, name)

        def spy(self, *args, _name=name, _original=original):
            called.add(_name)
            return _original(self, *args)

        monkeypatch.setattr(torch_backend.TorchBackend, name, spy)
    return called


@pytest.mark.parametrize(
    "norm",
    [
        torch.tensor(5.0, dtype=torch.float64),
        torch.tensor(5.0, dtype=torch.float16),
        torch.tensor(0.5),
        torch.tensor(math.nan),
        2.5,
    ],
    ids=["float64", "float16", "under", "nan", "host"],
)
def test_a_given_norm_matches_the_path_without_fast_paths(norm, without_fast_paths):
    """A norm computed elsewhere may differ in dtype from the leaves: the factor's dtype
    then differs from the leaves' and the scaling takes the per-leaf path, as before."""
    leaves = [torch.linspace(-1.0, 2.0, 5), torch.linspace(0.0, 3.0, 4)]
    fast, fast_norm = numstab.clip_by_global_norm(leaves, 1.0, norm=norm)
    without_fast_paths()
    slow, slow_norm = numstab.clip_by_global_norm(leaves, 1.0, norm=norm)
    _assert_same(fast_norm, slow_norm)
    for a, b in zip(fast, slow, strict=True):
        _assert_same(a, b)


@pytest.mark.parametrize("forced", ["1", "0"])
@pytest.mark.parametrize(
    ("call", "kernels"),
    [
        (numstab.global_norm, {"native_dtypes_and_nonempty", "native_global_norm"}),
        (numstab.all_finite, {"native_dtypes_and_nonempty", "native_all_finite"}),
    ],
    ids=["global_norm", "all_finite"],
)
def test_force_generic_decides_global_norm_and_all_finite(call, kernels, forced, monkeypatch):
    called = _spy_on(kernels, monkeypatch)
    monkeypatch.setenv("NUMSTAB_FORCE_GENERIC", forced)
    result = call([torch.full((3,), 2.0), torch.full((2,), -1.0)])
    eps = torch.finfo(torch.float32).eps
    want = True if call is numstab.all_finite else pytest.approx(14.0**0.5, rel=4 * eps)
    assert result.item() == want
    assert called == (set() if forced == "1" else kernels)
