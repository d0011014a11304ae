"""fenced's exceptions as RFC 9457 problem details, and back. Pure: no I/O.

The ``fenced serve`` API answers every failure with a problem document (``application/
problem+json``) whose ``type`` names the exception class, stable across versions; its HTTP
client (:mod:`fenced.coordinator.backends.http`) turns the document back into the same class,
with the same attributes, so that code written against an in-process coordinator or store
catches the same exceptions over HTTP. The table :data:`PROBLEMS` is the one source of both
directions and of the documented status codes (docs/server.md, "Errors").

A document carries ``type``, ``title``, ``status``, ``detail`` (the exception's message) and the
exception's attributes as extension members (``resource``, ``holder``, ``epoch``, …).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fenced.core._errors import (
    AccessDenied,
    Busy,
    ConfigurationError,
    CorruptData,
    FencedError,
    ForeignToken,
    IdempotencyConflict,
    InvalidName,
    LeaseLost,
    LossReason,
    NotAuthenticated,
    NotFound,
    NotInstalled,
    OutcomeUnknown,
    StaleToken,
    Unavailable,
    VersionConflict,
)

__all__ = [
    "PROBLEMS",
    "PROBLEM_PREFIX",
    "Problem",
    "error_of_problem",
    "problem_of_error",
]

PROBLEM_PREFIX = "urn:fenced:problem:"
"""Every ``type`` fenced answers with starts with this (``urn:fenced:problem:busy``, …)."""

Json = dict[str, object]


@dataclass(frozen=True, slots=True)
class Problem:
    """One problem type: its ``type`` suffix, HTTP status, title and exception class."""

    name: str
    status: int
    title: str
    error: type[FencedError]

    @property
    def type(self) -> str:
        """The ``type`` URI of the documents of this problem."""
        return PROBLEM_PREFIX + self.name


PROBLEMS: tuple[Problem, ...] = (
    # Most specific classes first: problem_of_error takes the first class that matches.
    Problem("busy", 409, "The lease is held by another owner", Busy),
    Problem("lease-lost", 410, "The lease is no longer held", LeaseLost),
    Problem("stale-token", 409, "A newer owner exists: the token is below the floor", StaleToken),
    Problem("not-installed", 409, "The token's epoch was never installed", NotInstalled),
    Problem("foreign-token", 409, "The token comes from another coordinator", ForeignToken),
    Problem("version-conflict", 412, "The key is not at the expected version", VersionConflict),
    Problem(
        "idempotency-conflict",
        422,
        "The operation id was used for other content",
        IdempotencyConflict,
    ),
    Problem("not-authenticated", 401, "An API key is needed", NotAuthenticated),
    Problem("access-denied", 403, "The API key may not do this", AccessDenied),
    Problem("not-found", 404, "Nothing is stored under that name", NotFound),
    Problem("invalid-name", 400, "The name is not allowed", InvalidName),
    Problem("corrupt-data", 500, "Stored data does not match its record", CorruptData),
    Problem("configuration-error", 400, "The request is not valid", ConfigurationError),
    Problem(
        "invalid-request", 422, "The request does not match the API's schema", ConfigurationError
    ),
    Problem("unavailable", 503, "The backend is unavailable; nothing happened", Unavailable),
    Problem(
        "outcome-unknown",
        504,
        "The backend's reply was lost; the outcome is unknown",
        OutcomeUnknown,
    ),
)
"""Every problem type, with its status (docs/server.md, "Errors")."""

_BY_TYPE = {problem.type: problem for problem in PROBLEMS}


def problem_of_error(error: FencedError) -> tuple[int, Json]:
    """The status and problem document of ``error`` (its class's entry of :data:`PROBLEMS`)."""
    problem = next((p for p in PROBLEMS if isinstance(error, p.error)), None)
    if problem is None:  # a FencedError without its own type: the closest honest answer
        problem = _BY_TYPE[PROBLEM_PREFIX + "configuration-error"]
    document: Json = {
        "type": problem.type,
        "title": problem.title,
        "status": problem.status,
        "detail": str(error),
    }
    document.update(_members(error))
    return problem.status, document


def _members(error: FencedError) -> Json:
    if isinstance(error, Busy):
        return {
            "resource": error.resource,
            "holder": error.holder,
            "epoch": error.epoch,
            "remaining": error.remaining,
        }
    if isinstance(error, LeaseLost):
        return {"reason": error.reason.value, "reason_detail": error.detail}
    if isinstance(error, StaleToken | NotInstalled):
        return {"resource": error.resource, "presented": error.presented, "floor": error.floor}
    if isinstance(error, ForeignToken):
        return {
            "resource": error.resource,
            "presented": error.presented,
            "bound": error.bound,
            "floor": error.floor,
        }
    if isinstance(error, VersionConflict):
        return {
            "resource": error.resource,
            "key": error.key,
            "expected": error.expected,
            "actual": error.actual,
        }
    return {}


def error_of_problem(status: int, document: Mapping[str, object]) -> FencedError:
    """The exception a problem document stands for (the inverse of :func:`problem_of_error`).

    A document that is not one of fenced's (another ``type``, missing members) becomes
    :class:`Unavailable` for a 5xx status and :class:`ConfigurationError` otherwise, with the
    status and detail in its message: a client never guesses a more specific class.
    """
    problem = _BY_TYPE.get(str(document.get("type", "")))
    detail = str(document.get("detail") or document.get("title") or f"HTTP {status}")
    if problem is None:
        if status >= 500:
            return Unavailable(f"HTTP {status}: {detail}")
        return ConfigurationError(f"HTTP {status}: {detail}")
    try:
        return _BUILDERS.get(problem.error, _plain(problem.error))(document, detail)
    except (KeyError, TypeError, ValueError):
        return problem.error(detail)


def _plain(error: type[FencedError]) -> Callable[[Mapping[str, object], str], FencedError]:
    return lambda _, detail: error(detail)


def _str(document: Mapping[str, object], name: str) -> str:
    value = document[name]
    if not isinstance(value, str):
        raise TypeError(name)
    return value


def _int(document: Mapping[str, object], name: str) -> int:
    value = document[name]
    if type(value) is not int:
        raise TypeError(name)
    return value


def _number(document: Mapping[str, object], name: str) -> float:
    value = document[name]
    if type(value) not in (int, float) or not math.isfinite(value):  # type: ignore[arg-type]
        raise TypeError(name)
    return float(value)  # type: ignore[arg-type]


def _busy(document: Mapping[str, object], _: str) -> FencedError:
    holder = document.get("holder")
    return Busy(
        _str(document, "resource"),
        holder if isinstance(holder, str) else None,
        _int(document, "epoch"),
        _number(document, "remaining"),
    )


def _lost(document: Mapping[str, object], _: str) -> FencedError:
    return LeaseLost(LossReason(_str(document, "reason")), str(document.get("reason_detail", "")))


def _stale(document: Mapping[str, object], _: str) -> FencedError:
    return StaleToken(
        _str(document, "resource"), _int(document, "presented"), _int(document, "floor")
    )


def _not_installed(document: Mapping[str, object], _: str) -> FencedError:
    return NotInstalled(
        _str(document, "resource"), _int(document, "presented"), _int(document, "floor")
    )


def _foreign(document: Mapping[str, object], _: str) -> FencedError:
    floor = document.get("floor")
    return ForeignToken(
        _str(document, "resource"),
        _str(document, "presented"),
        _str(document, "bound"),
        floor if type(floor) is int else None,
    )


def _version(document: Mapping[str, object], _: str) -> FencedError:
    return VersionConflict(
        _str(document, "resource"),
        _str(document, "key"),
        _int(document, "expected"),
        _int(document, "actual"),
    )


_BUILDERS: dict[type[FencedError], Callable[[Mapping[str, object], str], FencedError]] = {
    Busy: _busy,
    LeaseLost: _lost,
    StaleToken: _stale,
    NotInstalled: _not_installed,
    ForeignToken: _foreign,
    VersionConflict: _version,
}
