"""Backend selection: precedence, detection, contexts across threads and tasks, errors."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading

import numpy as np
import pytest

import numstab as ns
from numstab import backends
from numstab._dispatch import detect
from numstab.frameworks import FRAMEWORKS

X = np.zeros((2, 3), np.float32)
Y = np.array([0, 2])


def _backend_of_result(**kwargs):
    return ns.resolve_backend(X, **kwargs).name


def test_auto_detects_numpy_for_host_data():
    assert ns.get_backend() == "auto"
    assert ns.backend_choice().source == "default"
    assert _backend_of_result() == "numpy"


def test_precedence_argument_context_global_env_config(monkeypatch, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('backend = "jax"\n')
    monkeypatch.setenv("NUMSTAB_CONFIG", str(config))
    assert ns.backend_choice() == ("jax", f"config file {config}")
    monkeypatch.setenv("NUMSTAB_BACKEND", "TF")
    assert ns.backend_choice() == ("tensorflow", "NUMSTAB_BACKEND environment variable")
    ns.set_backend("pytorch")
    assert ns.backend_choice() == ("torch", "set_backend()")
    with ns.use_backend("numpy"):
        assert ns.backend_choice() == ("numpy", "use_backend() context")
        with ns.use_backend("jax"):
            assert ns.get_backend() == "jax"
        assert ns.get_backend() == "numpy"
        assert ns.backend_choice("tf") == ("tensorflow", "backend= argument")
    assert ns.get_backend() == "torch"
    ns.set_backend("auto")
    assert ns.get_backend() == "auto"
    assert ns.backend_choice().source == "set_backend()"


def test_environment_reads_follow_every_change_to_os_environ(monkeypatch):
    """numstab's per-call environment reads (``numstab._env.EnvVar``) answer what
    ``os.environ.get`` answers after every way of changing the environment in Python,
    including values that need decoding, and through the public functions that read them."""
    from numstab._env import EnvVar
    from numstab.backends._native import generic_forced

    var = EnvVar("NUMSTAB_TEST_VARIABLE")
    monkeypatch.delenv(var.name, raising=False)
    assert var.get() is None
    for value in ("1", "", "caf\u00e9 \u2603"):
        monkeypatch.setenv(var.name, value)
        assert var.get() == os.environ.get(var.name) == value
    os.environ[var.name] = "direct"
    assert var.get() == "direct"
    del os.environ[var.name]
    assert var.get() is None

    monkeypatch.setenv("NUMSTAB_BACKEND", "jax")
    assert ns.backend_choice().name == "jax"
    monkeypatch.delenv("NUMSTAB_BACKEND")
    assert ns.backend_choice().source != "NUMSTAB_BACKEND environment variable"
    monkeypatch.setenv("NUMSTAB_FORCE_GENERIC", "1")
    assert generic_forced()
    monkeypatch.setenv("NUMSTAB_FORCE_GENERIC", "0")
    assert not generic_forced()
    monkeypatch.delenv("NUMSTAB_FORCE_GENERIC")
    assert not generic_forced()


def test_use_backend_is_isolated_per_thread_and_task():
    seen = {}

    def worker():
        seen["thread"] = ns.get_backend()

    async def task(name):
        with ns.use_backend(name):
            await asyncio.sleep(0.01)
            return ns.get_backend()

    async def main():
        return await asyncio.gather(task("jax"), task("torch"), task("numpy"))

    with ns.use_backend("tensorflow"):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert asyncio.run(main()) == ["jax", "torch", "numpy"]
        assert ns.get_backend() == "tensorflow"
    assert seen["thread"] == "auto"


def test_use_backend_object_is_reusable_and_reentrant():
    """One ``use_backend`` object in several ``with`` blocks, nested too, as torch.no_grad():
    the generator context manager raised a raw AttributeError on its second ``with``."""
    cm = ns.use_backend("numpy")
    with cm as name:
        assert name == "numpy" and ns.get_backend() == "numpy"
    assert ns.get_backend() == "auto"
    with cm:
        with ns.use_backend("torch"), cm:
            assert ns.get_backend() == "numpy"
        assert ns.get_backend() == "numpy"
    assert ns.get_backend() == "auto"

    @cm  # a decorator too, as before
    def selected():
        return ns.get_backend()

    assert selected() == selected() == "numpy"


def test_unknown_backend_lists_valid_names(monkeypatch):
    with pytest.raises(ns.UnknownBackendError, match=r"'numpy', 'torch', 'tensorflow', 'jax'"):
        ns.set_backend("mxnet")
    monkeypatch.setenv("NUMSTAB_BACKEND", "caffe")
    with pytest.raises(ns.UnknownBackendError, match="caffe"):
        ns.cross_entropy(X, Y)
    assert issubclass(ns.UnknownBackendError, ns.NumstabError)


def test_unknown_backend_says_where_the_name_was_read(monkeypatch, tmp_path, capsys):
    from numstab import cli

    monkeypatch.setenv("NUMSTAB_BACKEND", "caffe")
    with pytest.raises(ns.UnknownBackendError, match="read from the NUMSTAB_BACKEND environment"):
        ns.cross_entropy(X, Y)
    monkeypatch.delenv("NUMSTAB_BACKEND")
    config = tmp_path / "numstab.toml"
    config.write_text('backend = "cupy"\n')
    monkeypatch.setenv("NUMSTAB_CONFIG", str(config))
    with pytest.raises(ns.UnknownBackendError, match=f"read from the config file {config}"):
        ns.get_backend()
    assert cli.main(["info"]) == 2
    assert f"config file {config}" in capsys.readouterr().err


def test_selection_stays_per_context_under_concurrent_threads_and_tasks():
    """Eight threads, each running asyncio tasks that select different backends and yield to
    each other mid-block: every read sees its own context's choice."""
    names = ["numpy", "torch", "jax", "tensorflow"]
    barrier = threading.Barrier(8)
    errors = []

    async def task(name):
        with ns.use_backend(name):
            for _ in range(20):
                await asyncio.sleep(0)
                if ns.get_backend() != name:
                    errors.append((name, ns.get_backend()))
        return ns.get_backend()

    def thread_main(i):
        mine = names[i % 4]
        with ns.use_backend(mine):
            barrier.wait()

            async def main():
                return await asyncio.gather(*(task(n) for n in names))

            inner = asyncio.run(main())
            if inner != [mine] * 4 or ns.get_backend() != mine:
                errors.append((mine, inner, ns.get_backend()))

    threads = [threading.Thread(target=thread_main, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert ns.get_backend() == "auto"


def test_bad_config_file_is_a_clear_error(monkeypatch, tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("backend = 3\n")
    monkeypatch.setenv("NUMSTAB_CONFIG", str(config))
    with pytest.raises(ns.InvalidArgumentError, match="Expected a string for 'backend'"):
        ns.get_backend()


def test_unavailable_backend_names_the_pip_extra(monkeypatch):
    missing = dataclasses.replace(FRAMEWORKS["torch"], name="numstab_no_such_module")
    monkeypatch.setitem(FRAMEWORKS, "torch", missing)
    monkeypatch.delitem(backends._loaded, "torch", raising=False)
    with pytest.raises(ns.BackendUnavailableError, match=r"pip install 'numstab\[torch\]'"):
        ns.cross_entropy(X, Y, backend="torch")


def test_host_data_adopts_the_selected_backend():
    torch = pytest.importorskip("torch")
    out = ns.cross_entropy(X, Y, backend="torch")
    assert isinstance(out, torch.Tensor)
    with ns.use_backend("torch"):
        assert isinstance(ns.log_softmax([[1.0, 2.0]]), torch.Tensor)
    assert isinstance(ns.cross_entropy(torch.zeros(2, 3), Y), torch.Tensor)  # numpy labels


def test_mixed_frameworks_raise():
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    with pytest.raises(ns.MixedBackendsError, match="torch and jax"):
        ns.cross_entropy(torch.zeros(2, 3), jnp.array([0, 1]))


def test_explicit_backend_never_copies_across_frameworks():
    torch = pytest.importorskip("torch")
    with pytest.raises(ns.BackendMismatchError, match=r"'jax' was selected by backend= argument"):
        ns.cross_entropy(torch.zeros(2, 3), torch.tensor([0, 1]), backend="jax")
    ns.set_backend("numpy")
    with pytest.raises(ns.BackendMismatchError, match="set_backend"):
        ns.logsumexp(torch.zeros(3))


def test_detects_tracers_variables_and_devices():
    jax = pytest.importorskip("jax")
    tf = pytest.importorskip("tensorflow")
    torch = pytest.importorskip("torch")
    assert detect(torch.zeros(1, device="meta")) == "torch"
    assert detect(torch.nn.Parameter(torch.zeros(1))) == "torch"
    assert detect(tf.Variable([1.0])) == "tensorflow"
    assert detect(np.zeros(1), 3.0, [1, 2]) is None

    @jax.jit
    def traced(x):
        assert detect(x) == "jax"
        return ns.logsumexp(x)

    assert float(traced(jax.numpy.zeros(4))) == pytest.approx(np.log(4.0))

    @tf.function
    def graph(x):
        assert detect(x) == "tensorflow"
        return ns.logsumexp(x)

    assert float(graph(tf.zeros(4))) == pytest.approx(np.log(4.0))


def test_available_backends_reports_versions():
    found = ns.available_backends()
    assert found["numpy"] == np.__version__
    for name in found:
        assert name in backends.BACKEND_NAMES


def test_info_command_reports_the_active_backend_and_source(monkeypatch, capsys):
    from numstab import cli

    monkeypatch.setenv("NUMSTAB_BACKEND", "numpy")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "active backend: numpy (from NUMSTAB_BACKEND environment variable)" in out
    assert "numpy " in out and "devices: cpu" in out


def test_info_imports_no_framework_unless_devices_are_asked():
    import subprocess
    import sys

    code = (
        "import sys, time; t = time.perf_counter(); from numstab import cli; cli.main(['info']);"
        "print('imported', [m for m in ('torch', 'jax', 'tensorflow', 'flax', 'transformers')"
        " if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "imported []" in out.stdout, out.stdout
    assert "libraries:" in out.stdout and "not probed" in out.stdout


def test_info_command_reports_bad_configuration(monkeypatch, capsys):
    from numstab import cli

    monkeypatch.setenv("NUMSTAB_BACKEND", "nope")
    assert cli.main(["info"]) == 2
    assert "Unknown backend 'nope'" in capsys.readouterr().err


def test_version_option_prints_the_installed_version(capsys):
    import importlib.metadata

    from numstab import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"numstab {importlib.metadata.version('numstab')}\n"


def test_version_without_installed_metadata_is_the_module_version(monkeypatch, capsys):
    import importlib.metadata

    from numstab import cli

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out == f"numstab {ns.__version__}\n"
