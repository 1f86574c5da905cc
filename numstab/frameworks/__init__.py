"""The one registry of frameworks: what each one is, and where its code lives.

Each framework's code is in its own folder, ``numstab/frameworks/<name>/``, under the same
module names for the same job (``backend.py``: the array primitives; ``numerics.py``:
check-numerics; ``locate.py``; ``guard.py``; ``devices.py``; then its integrations).
Feature packages hold the framework-free logic and reach a framework's code through
:func:`module`; nothing here imports a framework.

Framework-free code that must recognise a framework's values (a torch module, a sparse
TensorFlow gradient, a JAX pytree node) never names the framework: it asks :func:`loaded`
for the hooks that the already-imported frameworks' folders provide, under names that the
feature declares (``numstab.tree``: ``tree.sparse_type``; ``numstab.data``:
``data.batch_leaf``; ...).

Adding a framework: a new folder, one :class:`Framework` entry below, one conformance entry
(docs/architecture.md lists the steps).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any


@dataclasses.dataclass(frozen=True)
class Framework:
    """One framework numstab runs on.

    ``distributions``: what must be installed for its backend; ``extra``: the pip extra that
    installs them; ``array_types``: ``(module, attribute)`` of its array classes, compared
    only once that module is imported; ``aliases``: other names users type for it.
    """

    name: str
    distributions: tuple[str, ...]
    extra: str | None
    array_types: tuple[tuple[str, str], ...] = ()
    aliases: tuple[str, ...] = ()

    def imported(self) -> bool:
        """Whether the process has already imported the framework itself."""
        return sys.modules.get(self.distributions[0]) is not None  # None: an import blocked


#: the array frameworks; NumPy is the readable reference. A Keras 3 variable is no entry: it
#: stands for its Keras backend's tensor (``keras.backend.backend()``), told by the keras
#: folder's ``tree.wrapper_framework`` hook, which ``numstab._dispatch`` asks once keras is
#: imported, and is read through its ``.value``
FRAMEWORKS: dict[str, Framework] = {
    f.name: f
    for f in (
        Framework("numpy", ("numpy",), None, (), ("np",)),
        Framework("torch", ("torch",), "torch", (("torch", "Tensor"),), ("pytorch",)),
        Framework(
            "tensorflow",
            ("tensorflow",),
            "tensorflow",
            (("tensorflow", "Tensor"), ("tensorflow", "Variable")),
            ("tf",),
        ),
        Framework("jax", ("jax", "optax"), "jax", (("jax", "Array"), ("jax.core", "Tracer"))),
    )
}


@dataclasses.dataclass(frozen=True)
class ModelLibrary:
    """A library whose models ``locate_nonfinite`` takes as they are: ``model_type`` is
    ``(module, attribute)`` of its module class; ``code`` is the numstab module (under
    ``numstab.frameworks``) that locates its models; ``runs_on`` the framework that runs
    them (None: that code module's ``runs_on()`` tells, as Keras' backend does)."""

    name: str
    model_type: tuple[str, str]
    code: str
    runs_on: str | None


#: model libraries, in the order a model's type is tested (Keras before torch: a Keras layer
#: on torch is also a torch.nn.Module)
MODEL_LIBRARIES: tuple[ModelLibrary, ...] = (
    ModelLibrary("keras", ("keras", "Layer"), "keras.locate", None),
    ModelLibrary("torch", ("torch.nn", "Module"), "torch.locate", "torch"),
    ModelLibrary("linen", ("flax.linen", "Module"), "jax.locate_linen", "jax"),
    ModelLibrary("nnx", ("flax.nnx", "Module"), "jax.locate_modules", "jax"),
    ModelLibrary("equinox", ("equinox", "Module"), "jax.locate_modules", "jax"),
)

#: other libraries numstab integrates with (reported by ``numstab info``, never imported)
LIBRARIES = ("optax", "jmp", "keras", "flax", "equinox", "transformers", "lightning")


def module(framework: str, name: str) -> ModuleType:
    """``numstab.frameworks.<framework>.<name>``, imported (and its framework with it).
    ``framework`` may also be a folder that is not a backend (``"keras"``)."""
    full_name = f"{__name__}.{framework}.{name}"
    # imported already: no importlib call, which torch.compile cannot trace (fullgraph raises)
    return sys.modules.get(full_name) or importlib.import_module(full_name)


def imported_class(module_name: str, attribute: str) -> type | None:
    """The class ``module_name.attribute`` if that module is already imported, else None:
    a value of a framework's type can only exist once the framework is imported."""
    loaded = sys.modules.get(module_name)
    return None if loaded is None else getattr(loaded, attribute, None)


def model_library(model: Any) -> ModelLibrary | None:
    """The first library whose module class ``model`` is an instance of, or None."""
    for library in MODEL_LIBRARIES:
        cls = imported_class(*library.model_type)
        if cls is not None and isinstance(model, cls):
            return library
    return None


#: the folders that may provide hooks (``loaded``), in the order they are asked, each with
#: the module whose import makes its values possible
HOOK_FOLDERS: tuple[tuple[str, str], ...] = (
    *((f.name, f.distributions[0]) for f in FRAMEWORKS.values()),
    ("keras", "keras"),
)

_imported_folders: set[str] = set()  # the folders whose framework is imported
_hook_cache: dict[tuple[str, str], tuple] = {}
_modules_seen = [0]  # len(sys.modules) at the last look: a framework's import always grows it


def loaded(module_name: str, attribute: str) -> tuple[Any, ...]:
    """``numstab.frameworks.<folder>.<module_name>.<attribute>`` of every folder in
    :data:`HOOK_FOLDERS` whose framework the process has already imported and whose module
    defines it, in that order: ``()`` when none does. Never imports a framework (a value of a
    framework's type exists only once it is imported); answered from a cache, rechecking only
    the frameworks not yet imported, and only after the process imported something."""
    if len(sys.modules) != _modules_seen[0] and len(_imported_folders) < len(HOOK_FOLDERS):
        _note_new_imports()
    key = (module_name, attribute)
    found = _hook_cache.get(key)
    if found is None:
        # inside a torch.compile trace nothing can be imported: the hook modules imported
        # already answer, uncached (an eager call fills the cache with every folder's)
        tracing = _torch_compiling()
        found = tuple(
            getattr(module(folder, module_name), attribute)
            for folder, _ in HOOK_FOLDERS
            if folder in _imported_folders
            and (not tracing or f"{__name__}.{folder}.{module_name}" in sys.modules)
            and _has_hook(folder, module_name, attribute)
        )
        if not tracing:
            _hook_cache[key] = found
    return found


def _torch_compiling() -> bool:
    """Whether torch.compile is tracing this call (torch not imported: no)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def _note_new_imports() -> None:
    _modules_seen[0] = len(sys.modules)
    for folder, framework in HOOK_FOLDERS:
        # a None entry is an import blocked on purpose (sys.modules["torch"] = None)
        if folder not in _imported_folders and sys.modules.get(framework) is not None:
            _imported_folders.add(folder)
            _hook_cache.clear()


def has_module(folder: str, module_name: str) -> bool:
    """Whether ``numstab/frameworks/<folder>/<module_name>.py`` exists (nothing imported but
    the folder's light ``__init__``)."""
    name = f"{__name__}.{folder}.{module_name}"
    return name in sys.modules or importlib.util.find_spec(name) is not None


def _has_hook(folder: str, module_name: str, attribute: str) -> bool:
    return has_module(folder, module_name) and hasattr(module(folder, module_name), attribute)
