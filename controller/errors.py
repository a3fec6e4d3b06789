"""Domain errors of the rollout engine, each mapped to one HTTP status by the API.

Every message is one line that says what is wrong (which rollout, which stratum, which rule).
"""

from __future__ import annotations


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
    """The action is invalid in the current state, or another writer changed the same row first."""

    status_code = 409


class Invalid(KernelctlError):
    """The input is malformed or inconsistent (bad reference, report for a foreign rollout, ...)."""

    status_code = 422


# Aliases under the names used in the design notes.
NotFoundError = NotFound
ConflictError = Conflict
InvalidError = Invalid
