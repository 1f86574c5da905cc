"""Unit-test fixtures: every test starts with no backend configured; ``impl`` is shared
with conformance_tests."""

from __future__ import annotations

import os

import pytest

# ``impl``: native fused kernels, then the generic composite path (the conformance suite's
# fixture, one definition for both suites)
from conformance_tests.conftest import impl  # noqa: F401

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


@pytest.fixture(autouse=True)
def clean_backend_config(monkeypatch, tmp_path):
    import numstab

    monkeypatch.delenv("NUMSTAB_BACKEND", raising=False)
    monkeypatch.setenv("NUMSTAB_CONFIG", str(tmp_path / "absent.toml"))
    numstab.set_backend(None)
    yield
    numstab.set_backend(None)
