"""Conformance suite plumbing: which backends, devices, modes and implementations to run.

- ``NUMSTAB_TEST_BACKENDS=numpy,torch,...`` (default: all four) chooses backends. A backend
  asked for but not importable FAILS the run, so CI cannot silently skip one.
- ``--device cpu|gpu``: gpu runs torch on CUDA, JAX on its GPU, TensorFlow where a GPU build is.
- Every test that takes the ``target`` fixture runs per backend x mode (eager, compiled);
  ``eager_target`` runs per backend, eagerly only. The
  ``impl`` fixture runs native fused kernels and the generic composite path.
"""

from __future__ import annotations

import importlib
import os

import pytest

from conformance_tests.harness import HARNESSES
from numstab.backends import BACKEND_NAMES, load_backend
from numstab.backends._base import FORCE_GENERIC_ENV


def requested_backends() -> list[str]:
    raw = os.environ.get("NUMSTAB_TEST_BACKENDS", ",".join(BACKEND_NAMES))
    names = [n.strip() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in BACKEND_NAMES]
    if unknown:
        raise pytest.UsageError(f"NUMSTAB_TEST_BACKENDS names unknown backends: {unknown}")
    return names


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default="cpu",
        choices=("cpu", "gpu"),
        help="run torch / jax / tensorflow arrays on this device",
    )


def pytest_report_header(config):
    versions = []
    for name in requested_backends():
        try:
            versions.append(f"{name} {importlib.import_module(name).__version__}")
        except ImportError:
            versions.append(f"{name} NOT IMPORTABLE")
    return [f"numstab conformance: device={config.getoption('--device')}; " + ", ".join(versions)]


def pytest_generate_tests(metafunc):
    if "target" in metafunc.fixturenames:
        params = []
        for name in requested_backends():
            modes = ["eager"] + (["compiled"] if HARNESSES[name].can_compile else [])
            params += [f"{name}-{mode}" for mode in modes]
        metafunc.parametrize("target", params, indirect=True)
    if "eager_target" in metafunc.fixturenames:
        params = [f"{name}-eager" for name in requested_backends()]
        metafunc.parametrize("eager_target", params, indirect=True)


_harness_cache: dict[tuple[str, str], object] = {}


def harness_for(name: str, device: str):
    key = (name, device)
    if key not in _harness_cache:
        try:
            _harness_cache[key] = HARNESSES[name](device)
            # Load the backend eagerly, as a user's first eager call would: torch.compile
            # (fullgraph=True) cannot trace the first-use import of a backend module.
            load_backend(name)
        except Exception as exc:  # ImportError, or no such device
            pytest.fail(f"backend {name!r} was requested but cannot run on {device}: {exc}")
    return _harness_cache[key]


class Target:
    """A backend harness plus the execution mode of one test."""

    def __init__(self, harness, mode: str):
        self.h = harness
        self.name = harness.name
        self.compiled = mode == "compiled"


@pytest.fixture
def target(request):
    name, mode = request.param.split("-")
    return Target(harness_for(name, request.config.getoption("--device")), mode)


@pytest.fixture
def eager_target(request):
    """Like ``target``, for checks that only make sense eagerly (argument validation)."""
    name, mode = request.param.split("-")
    return Target(harness_for(name, request.config.getoption("--device")), mode)


@pytest.fixture(params=["native", "generic"])
def impl(request, monkeypatch):
    if request.param == "generic":
        monkeypatch.setenv(FORCE_GENERIC_ENV, "1")
    else:
        monkeypatch.delenv(FORCE_GENERIC_ENV, raising=False)
    return request.param
