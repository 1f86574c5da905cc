"""Frameworks that fail to import, and first calls that cannot import (each in a fresh
process: what is tested is the state of a process before anything was cached).

- A framework whose import raises ``OSError`` (a broken CUDA install: "libcudnn.so: cannot
  open shared object file") is ``BackendUnavailableError``, as an ``ImportError`` is
  (docs/semantics.md §1.5); before, the raw ``OSError`` escaped.
- ``sys.modules["torch"] = None`` (the usual way to block an import) leaves NumPy calls
  working; before, numstab took the blocked entry for an imported torch and raised
  ``ModuleNotFoundError`` from every call.
- The first numstab call of a process inside ``torch.compile(fullgraph=True)``, on a dict of
  gradients: the tree walk asked the framework hooks for the first time, which imported a
  module inside the trace, and Dynamo refused ``importlib.import_module`` (a graph break:
  ``fullgraph=True`` raised).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def _run(code: str, pythonpath: str | None = None) -> str:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_a_framework_whose_import_raises_oserror_is_unavailable(tmp_path):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise OSError("libtorch_cuda.so: cannot open it")')
    out = _run(
        """
        import numpy as np, numstab
        from numstab.errors import BackendUnavailableError
        try:
            numstab.logsumexp(np.zeros(3), backend="torch")
        except BackendUnavailableError as exc:
            assert "libtorch_cuda.so" in str(exc) and isinstance(exc, ImportError), exc
            print("unavailable")
        """,
        pythonpath=str(tmp_path),
    )
    assert out == "unavailable"


def test_a_blocked_framework_leaves_numpy_calls_working():
    out = _run(
        """
        import sys
        sys.modules["torch"] = sys.modules["tensorflow"] = None
        import numpy as np, numstab
        from numstab.errors import BackendUnavailableError
        assert float(numstab.global_norm({"a": np.ones(4)})) == 2.0
        numstab.find_nonfinite({"a": np.ones(2)})
        try:
            numstab.logsumexp(np.zeros(3), backend="torch")
        except BackendUnavailableError:
            print("ok")
        """
    )
    assert out == "ok"


def test_first_call_of_the_process_inside_torch_compile_fullgraph():
    out = _run(
        """
        import torch, numstab as ns

        scaler = ns.LossScaler(init_scale=4.0)
        state = scaler.init(backend="torch")

        @torch.compile(fullgraph=True)
        def step(grads, state):
            unscaled, finite = scaler.unscale(grads, state)
            clipped, norm = ns.clip_by_global_norm(unscaled, 1.0)
            return clipped, norm, scaler.update(state, finite)

        clipped, norm, state = step({"w": torch.full((4,), 8.0), "b": torch.zeros(2)}, state)
        assert float(norm) == 4.0 and float(state.scale) == 4.0
        torch.testing.assert_close(clipped["w"], torch.full((4,), 0.5))
        print("ok")
        """
    )
    assert out == "ok"
