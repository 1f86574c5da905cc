"""Backend configuration read from outside: a config file that is not UTF-8, and blank values
of ``NUMSTAB_BACKEND`` and the config file's ``backend`` key (they count as unset)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import numstab as ns

NOT_UTF8 = b'backend = "torch\xff"\n'


def test_config_file_that_is_not_utf8_does_not_break_the_import(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_bytes(NOT_UTF8)
    code = (
        "import numstab\n"
        "for call in (numstab.backend_choice, lambda: numstab.logsumexp([1.0, 2.0])):\n"
        "    try:\n"
        "        call()\n"
        "    except numstab.InvalidArgumentError as exc:\n"
        "        print('InvalidArgumentError:', exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMSTAB_BACKEND"}
    env["NUMSTAB_CONFIG"] = str(config)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout
    for line in lines:
        assert line.startswith(f"InvalidArgumentError: Cannot read numstab config file {config}")
        assert "utf-8" in line


def test_config_file_that_is_not_utf8_is_an_invalid_argument(monkeypatch, tmp_path):
    config = tmp_path / "bad.toml"
    config.write_bytes(NOT_UTF8)
    monkeypatch.setenv("NUMSTAB_CONFIG", str(config))
    with pytest.raises(ns.InvalidArgumentError, match="Cannot read numstab config file"):
        ns.get_backend()
    ns.set_backend("numpy")  # a higher level set: the file is not looked at
    assert ns.get_backend() == "numpy"


@pytest.mark.parametrize("blank", [" ", "  \t", "\n"])
def test_blank_environment_variable_counts_as_unset(monkeypatch, tmp_path, blank):
    monkeypatch.setenv("NUMSTAB_BACKEND", blank)
    assert ns.backend_choice() == ("auto", "default")
    config = tmp_path / "config.toml"
    config.write_text('backend = "jax"\n')
    monkeypatch.setenv("NUMSTAB_CONFIG", str(config))
    assert ns.backend_choice() == ("jax", f"config file {config}")


@pytest.mark.parametrize("blank", ["", "  ", "\\t "])
def test_blank_config_file_value_counts_as_unset(monkeypatch, tmp_path, blank):
    config = tmp_path / "config.toml"
    config.write_text(f'backend = "{blank}"\n')
    monkeypatch.setenv("NUMSTAB_CONFIG", str(config))
    assert ns.backend_choice() == ("auto", "default")
    assert ns.get_backend() == "auto"
