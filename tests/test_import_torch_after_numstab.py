"""``import numstab`` before ``import torch`` (isort's order), then a first numstab call inside
``torch.compile(fullgraph=True)``. Before, that call loaded the torch backend inside the trace,
which Dynamo refuses (``Attempted to call function marked as skipped``: ``import_module``), and
``tests/test_torch_compile_dynamic_floats.py`` passed only after another test had loaded it.
Now the backend loads right after ``import torch``. Each case runs in a fresh process."""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")


def _run(body: str) -> None:
    code = textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_first_call_inside_a_full_graph_compile_works():
    _run(
        """
        import sys
        import numstab as ns
        assert "torch" not in sys.modules  # importing numstab still imports no framework
        import torch

        assert "numstab.frameworks.torch.backend" in sys.modules
        assert not [f for f in sys.meta_path if getattr(f, "name", None) == "torch"]
        assert "exec_module" not in vars(torch.__spec__.loader)  # the loader is as it was
        grads = [torch.linspace(-3.0, 2.0, 10), torch.linspace(0.5, 4.0, 5)]
        fn = lambda g: ns.clip_by_global_norm(g, 1.0)[1]
        compiled = torch.compile(fn, fullgraph=True, backend="eager")
        assert torch.equal(compiled(grads), fn(grads))
        """
    )


def test_a_backend_that_fails_to_load_does_not_fail_import_torch():
    _run(
        """
        import numstab.backends

        def broken(name):
            raise RuntimeError("broken backend")

        numstab.backends.load_backend = broken
        import torch  # the failure is left for the first use, which raises as before

        assert torch.ones(2).sum().item() == 2.0
        """
    )


def test_torch_imported_first_installs_no_finder():
    _run(
        """
        import sys
        import torch
        import numstab

        assert "numstab.frameworks.torch.backend" in sys.modules
        assert not [f for f in sys.meta_path if getattr(f, "name", None) == "torch"]
        """
    )


def test_a_find_spec_before_the_import_leaves_the_finder_for_it():
    """transformers, accelerate and Lightning ask ``find_spec("torch")`` before importing it:
    the finder must wait for the real import (it left at that question, and the backend was
    not loaded)."""
    _run(
        """
        import importlib.util
        import sys
        import numstab as ns

        for _ in range(2):
            assert importlib.util.find_spec("torch") is not None
        assert "torch" not in sys.modules
        import torch

        assert "numstab.frameworks.torch.backend" in sys.modules
        assert not [f for f in sys.meta_path if getattr(f, "name", None) == "torch"]
        grads = [torch.linspace(-3.0, 2.0, 10)]
        compiled = torch.compile(lambda g: ns.global_norm(g), fullgraph=True, backend="eager")
        assert torch.equal(compiled(grads), ns.global_norm(grads))
        """
    )
