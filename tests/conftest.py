"""Unit-test fixtures: every test starts with no backend configured."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


@pytest.fixture(autouse=True)
def clean_backend_config(monkeypatch, tmp_path):
    import numstab

    monkeypatch.delenv("NUMSTAB_BACKEND", raising=False)
    monkeypatch.setenv("NUMSTAB_CONFIG", str(tmp_path / "absent.toml"))
    numstab.set_backend(None)
    yield
    numstab.set_backend(None)
