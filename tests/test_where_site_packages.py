"""``NonFiniteError.where`` (docs/semantics.md §14.3): a library installed in site-packages
(transformers) is the user's code, also where site-packages lies inside the standard
library's folder (pyenv, conda, a system Python); the frameworks and their layer libraries
(flax, equinox) are not. Before, every installed package counted as standard library there,
so ``where`` never pointed into ``modeling_t5.py``."""

from __future__ import annotations

import os
import sys
import sysconfig
import types

from numstab.numerics import _where

STDLIB = os.path.join(os.sep, "py", "lib", "python3.11")
SITE = os.path.join(STDLIB, "site-packages")


def _layout(monkeypatch):
    paths = {**sysconfig.get_paths(), "stdlib": STDLIB, "purelib": SITE, "platlib": SITE}
    monkeypatch.setattr(sysconfig, "get_paths", lambda: paths)
    fake_torch = types.ModuleType("torch")
    fake_torch.__file__ = os.path.join(SITE, "torch", "__init__.py")
    monkeypatch.setitem(sys.modules, "torch", fake_torch)


def test_site_packages_inside_the_stdlib_folder(monkeypatch):
    _layout(monkeypatch)
    assert _where.is_user_file(os.path.join(SITE, "transformers", "models", "modeling_t5.py"))
    assert not _where.is_user_file(os.path.join(SITE, "torch", "nn", "functional.py"))
    assert not _where.is_user_file(os.path.join(STDLIB, "json", "__init__.py"))
    assert _where.is_user_file(os.path.join(os.sep, "home", "me", "train.py"))


def test_where_is_the_innermost_library_frame_of_the_user(monkeypatch):
    _layout(monkeypatch)
    frames = [
        (os.path.join(os.sep, "home", "me", "train.py"), 10),
        (os.path.join(SITE, "transformers", "modeling_t5.py"), 321),
        (os.path.join(SITE, "torch", "nn", "functional.py"), 5),
    ]
    assert _where._last_user(frames) == f"{frames[1][0]}:321"
