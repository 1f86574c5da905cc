"""The numstab exception tree: every error numstab raises derives from NumstabError.

Each class also derives from the built-in exception a Python user would expect
(``ValueError``, ``TypeError``, ``ImportError``), so existing ``except`` clauses keep working.
"""

from __future__ import annotations


class NumstabError(Exception):
    """Base class of every error raised by numstab."""


class InvalidArgumentError(NumstabError, ValueError):
    """An argument has a bad value, shape or dtype. The message names the argument."""


class UnknownBackendError(NumstabError, ValueError):
    """A backend name that numstab does not know; the message lists the valid names."""


class BackendUnavailableError(NumstabError, ImportError):
    """The selected backend's framework cannot be imported; the message names the pip extra."""


class MixedBackendsError(NumstabError, TypeError):
    """Arrays of two different frameworks were passed to one call."""


class BackendMismatchError(NumstabError, TypeError):
    """Arrays of one framework were passed while another backend was explicitly selected.

    numstab never copies arrays across frameworks silently.
    """
