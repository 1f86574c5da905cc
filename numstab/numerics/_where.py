"""Find the user's ``file:line`` in a traceback or stack, skipping framework and numstab frames."""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import traceback
from types import TracebackType

from numstab.numerics._ops import strip_ansi

#: frameworks and their layer libraries (flax, equinox: the JAX counterparts of ``torch.nn``
#: and Keras layers, so ``where`` is the user's model line that called the layer, as with
#: torch), numstab itself and the test runner; any other installed library (transformers'
#: model files) is the user's code
_INTERNAL_PACKAGES = (
    "torch", "jax", "jaxlib", "tensorflow", "keras", "tf_keras", "numpy", "optax", "numstab",
    "flax", "equinox", "pytest", "_pytest", "pluggy", "absl", "functorch",
)  # fmt: skip


def _internal_roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the internal packages' folders and the standard library's, the site-packages folders).
    Under pyenv or conda, site-packages lies inside the standard library's folder: what is
    installed there (transformers) is the user's code unless it is an internal package."""
    paths = sysconfig.get_paths()
    site = {paths["purelib"], paths["platlib"]}
    roots = {paths["stdlib"]}
    for name in _INTERNAL_PACKAGES:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            roots.add(os.path.dirname(os.path.abspath(path)))
    return tuple(root + os.sep for root in roots), tuple(root + os.sep for root in site)


def is_user_file(
    filename: str, roots: tuple[tuple[str, ...], tuple[str, ...]] | None = None
) -> bool:
    if filename.startswith("<"):
        return False
    internal, site = _internal_roots() if roots is None else roots
    path = os.path.abspath(filename)
    if path.startswith(site):  # an installed library: internal only if one of the packages
        return not path.startswith(tuple(r for r in internal if r.startswith(site)))
    return not path.startswith(internal)


def _last_user(frames: list[tuple[str, int]]) -> str | None:
    roots = _internal_roots()
    for filename, line in reversed(frames):
        if is_user_file(filename, roots):
            return f"{filename}:{line}"
    return None


def from_traceback(tb: TracebackType | None) -> str | None:
    """The innermost user frame of an exception's traceback."""
    return _last_user([(f.filename, f.lineno or 0) for f in traceback.extract_tb(tb)])


def from_stack() -> str | None:
    """The innermost user frame of the current call stack."""
    return _last_user([(f.filename, f.lineno or 0) for f in traceback.extract_stack()])


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def from_text(text: str) -> str | None:
    """The last user ``File "...", line N`` of a traceback printed as text (ANSI colour
    codes stripped first)."""
    found = _FILE_LINE.finditer(strip_ansi(text))
    return _last_user([(m.group(1), int(m.group(2))) for m in found])
