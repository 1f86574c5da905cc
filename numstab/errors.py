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


class NonFiniteError(NumstabError, FloatingPointError):
    """A NaN or inf was found where finite values were required.

    Attributes (``None`` where the framework cannot tell): ``framework``, ``op`` (the op's name
    as the framework gives it), ``op_kind`` (a normalised name: ``log``, ``sqrt``, ``div``,
    ``exp``, ``matmul``, ...), ``phase`` (``"forward"`` or ``"backward"``), ``where`` (the
    user's ``file:line``), ``nan_count``, ``inf_count`` and ``paths`` (offending tree paths).
    The framework's own exception, when there is one, is the ``__cause__``.
    """

    def __init__(
        self,
        message: str,
        *,
        framework: str | None = None,
        op: str | None = None,
        op_kind: str | None = None,
        phase: str | None = None,
        where: str | None = None,
        nan_count: int | None = None,
        inf_count: int | None = None,
        paths: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.framework = framework
        self.op = op
        self.op_kind = op_kind
        self.phase = phase
        self.where = where
        self.nan_count = nan_count
        self.inf_count = inf_count
        self.paths = tuple(paths)


# -- data firewall --
class OutlierError(NumstabError, ValueError):
    """A data sample was flagged as an outlier by a ``numstab.data`` filter under
    ``policy="raise"``. Attributes: ``filter`` (its name), ``paths`` (the fields it looked
    at) and ``indices`` (global sample indices in the guarded stream)."""

    def __init__(
        self,
        message: str,
        *,
        filter: str | None = None,
        paths: tuple[str, ...] = (),
        indices: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.filter = filter
        self.paths = tuple(paths)
        self.indices = tuple(indices)
