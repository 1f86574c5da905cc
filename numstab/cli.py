"""The ``numstab`` console command. ``numstab info`` reports frameworks, devices and the
active backend with the source that selected it; ``numstab --version`` prints the version."""

from __future__ import annotations

import argparse
import os
import platform
import sys

import numstab
from numstab import frameworks
from numstab.backends import load_backend
from numstab.errors import NumstabError


def _devices(name: str) -> str:
    """Devices the framework sees (importing it: ``info`` is a diagnostic, not a hot path)."""
    return ", ".join(frameworks.module(name, "devices").devices())


def info(out=None, *, devices: bool = False) -> int:
    """Versions from the installed distributions (nothing imported, well under a second);
    with ``devices``, each framework is imported to list the devices it sees."""
    out = out or sys.stdout
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    print(f"numstab {numstab.__version__} on Python {platform.python_version()}", file=out)
    available = numstab.available_backends()
    print("backends:", file=out)
    for name, framework in frameworks.FRAMEWORKS.items():
        if name not in available:
            print(
                f"  {name:<11} not installed (pip install 'numstab[{framework.extra}]')", file=out
            )
            continue
        if devices or name == "numpy":
            try:
                load_backend(name)
                where = _devices(name)
            except (NumstabError, ImportError, RuntimeError) as exc:
                where = f"failed to load: {exc}"
        else:
            where = "not probed (numstab info --devices imports the framework)"
        print(f"  {name:<11} {available[name]:<12} devices: {where}", file=out)
    found = {lib: _library_version(lib) for lib in frameworks.LIBRARIES}
    listed = ", ".join(f"{lib} {v}" for lib, v in found.items() if v) or "none"
    print(f"libraries: {listed}", file=out)
    choice = numstab.backend_choice()
    print(f"active backend: {choice.name} (from {choice.source})", file=out)
    if choice.name == "auto":
        print("  'auto' detects the framework from the arrays passed to each call", file=out)
    return 0


def _library_version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def version() -> str:
    """The installed distribution's version; ``numstab.__version__`` when numstab runs from a
    source tree that is not installed."""
    return _library_version("numstab") or numstab.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="numstab", description=numstab.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"numstab {version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    info_parser = commands.add_parser(
        "info", help="frameworks, versions, devices and the active backend"
    )
    info_parser.add_argument(
        "--devices", action="store_true", help="import each framework to list its devices"
    )
    from numstab.bench import command as bench_command

    bench_command.add_arguments(
        commands.add_parser(
            "bench",
            help="the AMP stability benchmark: one model trained in torch, jax and tensorflow",
            description="Train one small transformer LM in every installed framework, in fp32, "
            "bf16 and fp16, with and without remedies and faults; write results.json, "
            "report.md and plots.",
        )
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            return info(devices=args.devices)
        if args.command == "bench":
            command = ["numstab", *(sys.argv[1:] if argv is None else argv)]
            return bench_command.main(args, command)
    except NumstabError as exc:
        print(f"numstab: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
