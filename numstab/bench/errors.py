"""The benchmark's own errors (all are numstab errors)."""

from __future__ import annotations

from numstab.errors import NumstabError


class FrameworkSetupError(NumstabError, RuntimeError):
    """A framework cannot run the benchmark here (e.g. ``--device gpu`` without a GPU)."""


class OutputFolderError(NumstabError, OSError):
    """The report folder cannot be created or written."""


class ResultsFileError(NumstabError, ValueError):
    """A results.json that cannot be read or is not a numstab bench result."""
