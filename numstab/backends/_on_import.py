"""Load numstab's torch (or TensorFlow) backend right after ``import torch`` (``import
tensorflow``) when numstab was imported first.

``torch.compile`` cannot trace an import: Dynamo skips ``importlib.import_module`` (a graph
break, an error under ``fullgraph=True``). numstab loads a backend on first use, so a first
numstab call inside a compiled function failed whenever ``import numstab`` ran before ``import
torch``, which is isort's order. Inside ``tf.function`` the import runs, but AutoGraph warns
that it "could not transform <function _gcd_import>" at every such first call.

``import numstab`` loads the backends of frameworks already imported
(``preload_imported_frameworks``); for one imported later, ``load_after_import`` puts a finder
on ``sys.meta_path`` that, for that one name, lets the other finders find it and wraps that
loader's ``exec_module`` so that ``then`` runs once the module has run. Every other import
passes it by (a string comparison). It leaves ``sys.meta_path`` once the module has run (not
at a mere ``find_spec``) and restores the loader, so it acts once. JAX needs none of this: its
tracer runs Python imports quietly.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from collections.abc import Callable
from typing import Any


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for ``name``, hands back the spec the other finders give, its
    loader made to call ``then`` after executing the module. A spec found but never loaded
    (``importlib.util.find_spec("torch")``, as transformers, accelerate and Lightning ask
    before importing) leaves the finder in place for the real import."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        if sys.modules.get(fullname) is not None:  # imported without this finder's loader
            self.remove()
            return None
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is not None and spec.loader is not None:
            _call_after_exec(spec.loader, self)
        return spec

    def remove(self) -> None:
        with contextlib.suppress(ValueError):  # another thread's import removed it first
            sys.meta_path.remove(self)

    def loaded(self) -> None:
        """The module has run: leave ``sys.meta_path`` and call ``then`` (whose failure never
        fails the import: the backend then loads at first use, as before)."""
        self.remove()
        with contextlib.suppress(Exception):
            self.then()


def _call_after_exec(loader: Any, finder: _AfterImport) -> None:
    """Shadow ``loader.exec_module`` with one that runs it, removes itself and tells
    ``finder``. A loader that takes no instance attribute is left as it is."""
    run = getattr(loader, "exec_module", None)
    if run is None:
        return

    def exec_module(module: Any) -> None:
        with contextlib.suppress(AttributeError):
            del loader.exec_module
        run(module)
        finder.loaded()

    with contextlib.suppress(AttributeError, TypeError):
        loader.exec_module = exec_module


def load_after_import(name: str, then: Callable[[], None]) -> None:
    """Call ``then`` right after the module ``name`` is imported, unless it is already (or a
    finder for it is already waiting)."""
    if sys.modules.get(name) is None and not any(
        isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _AfterImport(name, then))
