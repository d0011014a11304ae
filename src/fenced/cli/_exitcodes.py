"""Exit codes of the ``fenced`` command (documented in docs/cli.md; a contract)."""

from __future__ import annotations

from fenced.core._errors import (
    Busy,
    ConfigurationError,
    FencedError,
    IdempotencyConflict,
    LeaseLost,
    NotFound,
    OutcomeUnknown,
    Rejected,
    Unavailable,
)

__all__ = [
    "BAD_INPUT",
    "CONFLICT",
    "INTERNAL_ERROR",
    "LEASE_LOST",
    "NOT_ACQUIRED",
    "NOT_FOUND",
    "OK",
    "OUTCOME_UNKNOWN",
    "REJECTED",
    "UNAVAILABLE",
    "exit_code_for",
]

OK = 0
NOT_FOUND = 1
"""Nothing found: ``get``, ``latest`` or ``read`` of something never written (like grep)."""
BAD_INPUT = 2
"""Bad usage or bad input (invalid name, malformed token, bad URL, bad ttl, …), a corrupt store."""
REJECTED = 3
"""A store rejected the operation: stale token, not installed, or foreign token."""
CONFLICT = 4
"""A compare-and-set or op_id conflict: nothing was applied."""
UNAVAILABLE = 69
"""The coordinator or store could not be reached; nothing happened; retry is safe."""
INTERNAL_ERROR = 70
"""An unexpected failure (a bug in fenced): reported with a one-line message."""
OUTCOME_UNKNOWN = 74
"""The request was sent but the outcome is unknown; retry with the same op id."""
NOT_ACQUIRED = 75
"""The lease was not acquired within --wait."""
LEASE_LOST = 76
"""The lease was lost while the child ran (the child was signalled)."""


def exit_code_for(error: FencedError) -> int:
    """Map a fenced error to its documented exit code."""
    if isinstance(error, NotFound):
        return NOT_FOUND
    if isinstance(error, ConfigurationError):
        return BAD_INPUT
    if isinstance(error, Rejected):
        return REJECTED
    if isinstance(error, Busy):
        return NOT_ACQUIRED
    if isinstance(error, LeaseLost):
        return LEASE_LOST
    if isinstance(error, Unavailable):
        return UNAVAILABLE
    if isinstance(error, OutcomeUnknown):
        return OUTCOME_UNKNOWN
    if isinstance(error, IdempotencyConflict) or type(error).__name__ == "VersionConflict":
        return CONFLICT
    return INTERNAL_ERROR
