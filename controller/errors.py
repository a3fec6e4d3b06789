"""Domain errors of the rollout engine, each mapped to one HTTP status by the API.

Every message is one line that says what is wrong (which rollout, which stratum, which rule).
"""

from __future__ import annotations

import math
import random


class KernelctlError(Exception):
    """Base class of domain errors; ``status_code`` is the HTTP status the API answers with."""

    status_code = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class NotFound(KernelctlError):
    """The named thing (bundle, rollout, node, stratum) does not exist."""

    status_code = 404


class Conflict(KernelctlError):
    """The action is invalid in the current state (or, as :class:`ConcurrentWrite`, lost a race)."""

    status_code = 409


class Invalid(KernelctlError):
    """The input is malformed or inconsistent (bad reference, report for a foreign rollout, ...)."""

    status_code = 422


class ConcurrentWrite(Conflict):
    """Another writer (the judge's tick, another operator) changed the same rollout first: nothing was
    changed, and the same action on fresh state may succeed (the API retries it)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} was changed by another writer at the same time; re-read it and retry")


class Overloaded(KernelctlError):
    """Too many writes wait already: the client retries after ``retry_after`` seconds (503 + Retry-After)."""

    status_code = 503

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    @classmethod
    def busy(cls, message: str) -> Overloaded:
        """Refused for load: the client is told 1-5 s, spread so that the retries do not arrive together."""
        return cls(message, round(1.0 + 4.0 * random.random(), 1))

    @property
    def retry_after_header(self) -> str:
        """The ``Retry-After`` value: whole seconds, at least 1."""
        return str(max(1, math.ceil(self.retry_after)))


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message for a one-line log entry (its type name when it has none);
    database drivers' messages run over several lines."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
