"""The layout's rules (docs/architecture.md): one registry of frameworks, one folder each,
every Backend primitive implemented, every native kernel with a generic version, small
modules and functions, no import cycle."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from numstab import frameworks
from numstab.backends import BACKEND_NAMES, load_backend
from numstab.backends._base import Backend

PACKAGE = Path(__file__).resolve().parents[1] / "numstab"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80
PER_FRAMEWORK = ("backend", "numerics", "devices")


def _installed(name: str) -> bool:
    return all(importlib.util.find_spec(d) for d in frameworks.FRAMEWORKS[name].distributions)


def test_the_registry_is_the_list_of_backends():
    assert tuple(frameworks.FRAMEWORKS) == BACKEND_NAMES
    folders = {p.name for p in (PACKAGE / "frameworks").iterdir() if (p / "__init__.py").exists()}
    assert set(frameworks.FRAMEWORKS) <= folders
    for name in frameworks.FRAMEWORKS:
        for module in PER_FRAMEWORK:
            assert (PACKAGE / "frameworks" / name / f"{module}.py").exists(), (name, module)
    for library in frameworks.MODEL_LIBRARIES:
        path = PACKAGE / "frameworks" / (library.code.replace(".", "/") + ".py")
        assert "def locate_model(" in path.read_text() or "locate_model =" in path.read_text()


def test_conformance_has_one_harness_per_framework():
    from conformance_tests.harness import HARNESSES

    assert set(HARNESSES) == set(frameworks.FRAMEWORKS)


@pytest.mark.parametrize("name", list(frameworks.FRAMEWORKS))
def test_every_backend_implements_every_primitive(name):
    if not _installed(name):
        pytest.skip(f"{name} is not installed")
    backend = load_backend(name)
    assert isinstance(backend, Backend)
    assert not type(backend).__abstractmethods__
    assert Backend.__abstractmethods__  # the base declares what a backend must provide


@pytest.mark.parametrize("name", list(frameworks.FRAMEWORKS))
def test_every_native_kernel_has_a_generic_version(name):
    if not _installed(name):
        pytest.skip(f"{name} is not installed")
    backend = type(load_backend(name))
    natives = [a for a in dir(backend) if a.startswith("native_")]
    for native in natives:
        generic = native.removeprefix("native_")
        assert callable(getattr(Backend, generic, None)), f"{name}.{native} has no generic"
        assert generic not in Backend.__abstractmethods__, f"{generic} is a primitive"


@pytest.mark.parametrize("name", list(frameworks.FRAMEWORKS))
def test_softmax_nll_grad_generic_agrees_with_native(name):
    """The one native kernel whose generic version came late (TensorFlow's fused
    SparseSoftmaxCrossEntropyWithLogits): both give (lse - x[y], softmax - onehot)."""
    if not _installed(name):
        pytest.skip(f"{name} is not installed")
    be = load_backend(name)
    rng = np.random.default_rng(0)
    x = rng.normal(0, 3, (5, 7)).astype(np.float32)
    y = np.array([0, 6, 3, 3, 1])
    nll, grad = Backend.softmax_nll_grad(be, be.asarray(x), be.asarray(y, be.index_dtype))
    x64 = x.astype(np.float64)
    lse = np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1)) + x64.max(1)
    onehot = np.eye(7)[y]
    tol = 8 * np.finfo(np.float32).eps * 7  # a few float32 roundings per element, K terms
    np.testing.assert_allclose(be.to_numpy(nll), lse - x64[np.arange(5), y], atol=tol * 10)
    np.testing.assert_allclose(be.to_numpy(grad), np.exp(x64 - lse[:, None]) - onehot, atol=tol)
    if hasattr(be, "native_softmax_nll_grad"):
        n2, g2 = be.native_softmax_nll_grad(be.asarray(x), be.asarray(y, be.index_dtype))
        np.testing.assert_allclose(be.to_numpy(n2), be.to_numpy(nll), atol=tol * 10)
        np.testing.assert_allclose(be.to_numpy(g2), be.to_numpy(grad), atol=tol)


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_over_450_lines():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in _sources()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, long


def test_no_function_over_80_lines():
    long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.name}"] = size
    assert not long, long


FRAMEWORK_MODULES = {
    "torch", "tensorflow", "tf", "jax", "jaxlib", "keras", "optax", "flax", "equinox", "jmp",
    "transformers", "lightning", "accelerate",
}  # fmt: skip


def _framework_uses(source: str) -> list[str]:
    """Where ``source`` touches a framework's objects: an import of it, a ``sys.modules``
    look-up of it, or a name bound to it. Names as strings (registry keys, messages) are
    fine: they are how the registry is asked."""
    found = []

    def is_framework(name: str) -> bool:
        return name.split(".")[0] in FRAMEWORK_MODULES

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if is_framework(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and is_framework(node.module):
            found.append(f"from {node.module} import")
        elif (
            isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and is_framework(node.id)
        ):
            found.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, (ast.Subscript, ast.Call)) and "sys.modules" in ast.unparse(node):
            keys = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant)]
            if any(isinstance(k, str) and is_framework(k) for k in keys):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_framework_objects_are_touched_only_in_their_folders():
    """Outside ``numstab/frameworks/`` code reaches a framework only through the registry
    (``frameworks.module``, ``frameworks.loaded``), never its modules or types."""
    sample = 'import sys\nimport torch\nt = sys.modules.get("jax")\nx = keras.Layer\nkey = "tf"\n'
    assert sorted(_framework_uses(sample)) == [
        "import torch",
        "line 3: sys.modules.get('jax')",
        "line 4: keras",
    ]
    home = PACKAGE / "frameworks"
    uses = {
        str(p.relative_to(PACKAGE)): found
        for p in _sources()
        if home not in p.parents and (found := _framework_uses(p.read_text()))
    }
    assert not uses, uses


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The numstab modules ``path`` imports, anywhere in it (functions included), except
    under ``if TYPE_CHECKING:``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                for alias in child.names:
                    full = f"{child.module}.{alias.name}"
                    found.add(full if full in modules else child.module)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle():
    paths = {_module_name(p): p for p in _sources()}
    graph = {name: _imports(path, name, set(paths)) for name, path in paths.items()}
    assert not _cycles(graph)
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # it can fail


@pytest.mark.parametrize(
    ("public", "home"),
    [
        ("numstab.integrations.optax", "numstab.frameworks.jax.optax"),
        ("numstab.integrations.keras", "numstab.frameworks.keras.loss_scaling"),
        ("numstab.integrations.keras_clipping", "numstab.frameworks.keras.clipping"),
        ("numstab.integrations.keras_losses", "numstab.frameworks.keras.losses"),
        ("numstab.integrations.keras_schedules", "numstab.frameworks.keras.schedules"),
        ("numstab.integrations.transformers", "numstab.frameworks.torch.transformers"),
        ("numstab.integrations.lightning", "numstab.frameworks.torch.lightning"),
        ("numstab.locate.jax", "numstab.frameworks.jax.locate"),
    ],
)
def test_old_import_paths_are_the_moved_modules(public, home):
    top = home.split(".")[2]
    needed = {"keras": "keras", "torch": "torch", "jax": "jax"}[top]
    pytest.importorskip(needed)
    if public.endswith(("transformers", "lightning")):
        pytest.importorskip(public.rpartition(".")[2])
    assert importlib.import_module(public) is importlib.import_module(home)
    assert sys.modules[public] is sys.modules[home]


def test_torch_integration_exports_its_public_names():
    pytest.importorskip("torch")
    from numstab.integrations import torch as integration

    for name in integration.__all__:
        assert callable(getattr(integration, name))
    assert {"GradScaler", "clip_grad_norm_", "ZClip", "agc_"} <= set(integration.__all__)
