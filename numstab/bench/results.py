"""results.json: created, saved atomically after every run, loaded for --resume / --compare."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

from numstab.bench.errors import OutputFolderError, ResultsFileError

SCHEMA = "numstab-bench/1"
FILENAME = "results.json"


def prepare_folder(out: Path) -> Path:
    """Create ``out`` and prove it writable now, before any run is spent."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise OutputFolderError(
            f"Expected --out to be a folder that can be created and written. "
            f"Received: --out={str(out)!r} ({exc.strerror or exc})"
        ) from exc
    return out


def new_results(command: list[str], settings: dict[str, Any], plan: list[str]) -> dict[str, Any]:
    import numstab

    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command,
        "settings": settings,
        "environment": {
            "numstab": numstab.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "affinity_cpus": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else None,
            "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "plan": plan,
        "frameworks": {},
        "runs": {},
        "errors": {},
        "complete": False,
    }


def save(results: dict[str, Any], out: Path) -> None:
    """Write results.json via a temporary file and an atomic rename: never half a file."""
    tmp = out / (FILENAME + ".tmp")
    try:
        tmp.write_text(json.dumps(results, indent=1, allow_nan=False))
        os.replace(tmp, out / FILENAME)
    except OSError as exc:
        raise OutputFolderError(f"Could not write {out / FILENAME}: {exc}") from exc


def load(path: Path) -> dict[str, Any]:
    """A results.json (or the folder holding one), checked to be a numstab bench result."""
    path = Path(path)
    if path.is_dir():
        path = path / FILENAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ResultsFileError(f"No results file at {str(path)!r}") from exc
    except (OSError, ValueError) as exc:
        raise ResultsFileError(f"Could not read {str(path)!r} as JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ResultsFileError(
            f"Expected a numstab bench results.json (schema {SCHEMA!r}). Received: {str(path)!r}"
        )
    return data
