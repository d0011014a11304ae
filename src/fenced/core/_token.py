"""The fencing token: ``(coordinator id, resource, epoch)``. Pure value, no I/O.

Text form (version 1)::

    fenced1:<coordinator id: 32 lowercase hex>:<epoch: decimal, no leading zero>:<resource>

Every character is in ``[A-Za-z0-9._/:-]``, so the text is safe in an environment variable and in
an HTTP header, and ``FencingToken.parse(str(t)) == t``. The resource comes last because it may
contain ``/``; it cannot contain ``:``.

Tokens are ordered only within one resource of one coordinator: comparing tokens of different
resources or coordinators raises :class:`TypeError`, because their epochs say nothing about each
other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fenced.core._errors import ConfigurationError
from fenced.core._names import validate_resource

__all__ = ["MAX_EPOCH", "TOKEN_PREFIX", "FencingToken", "validate_coordinator_id", "validate_epoch"]

TOKEN_PREFIX = "fenced1"  # noqa: S105 (a format tag, not a secret)
MAX_EPOCH = 2**63 - 1
"""Epochs fit a signed 64-bit integer (SQLite INTEGER, PostgreSQL bigint)."""
_COORDINATOR_ID = re.compile(r"[0-9a-f]{32}")
_EPOCH = re.compile(r"[1-9][0-9]{0,18}")


def validate_coordinator_id(value: object) -> str:
    """Return ``value`` if it is a coordinator id (32 lowercase hex digits), else raise."""
    if not isinstance(value, str) or not _COORDINATOR_ID.fullmatch(value):
        raise ConfigurationError(f"coordinator id must be 32 lowercase hex digits, got {value!r}")
    return value


def validate_epoch(value: object) -> int:
    """Return ``value`` if it is an epoch (an int in 1..2**63-1, not a bool), else raise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"epoch must be an integer, got {value!r}")
    if not 1 <= value <= MAX_EPOCH:
        raise ConfigurationError(f"epoch must be between 1 and {MAX_EPOCH}, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class FencingToken:
    """Proof of a grant: the protected resource compares its ``epoch`` with the floor it has seen.

    Construction validates every field (:class:`ConfigurationError`, :class:`InvalidName`).
    """

    coordinator_id: str
    resource: str
    epoch: int

    def __post_init__(self) -> None:
        validate_coordinator_id(self.coordinator_id)
        validate_resource(self.resource)
        validate_epoch(self.epoch)

    @classmethod
    def _of_checked(cls, coordinator_id: str, resource: str, epoch: object) -> FencingToken:
        """A token whose coordinator id and resource the caller has already validated (a
        coordinator's own grant): only the epoch is checked. Internal: not for outside values."""
        token = object.__new__(cls)
        object.__setattr__(token, "coordinator_id", coordinator_id)
        object.__setattr__(token, "resource", resource)
        object.__setattr__(token, "epoch", validate_epoch(epoch))
        return token

    def __str__(self) -> str:
        return f"{TOKEN_PREFIX}:{self.coordinator_id}:{self.epoch}:{self.resource}"

    @classmethod
    def parse(cls, text: str) -> FencingToken:
        """Parse the text form; a malformed token raises :class:`ConfigurationError`."""
        if not isinstance(text, str):
            raise ConfigurationError(f"a fencing token is text, not {type(text).__name__}")
        parts = text.strip().split(":", 3)
        if len(parts) != 4 or parts[0] != TOKEN_PREFIX:
            shown = text if len(text) <= 80 else text[:77] + "..."
            raise ConfigurationError(
                f"malformed fencing token {shown!r}: expected "
                f"'{TOKEN_PREFIX}:<coordinator>:<epoch>:<resource>'"
            )
        _, coordinator_id, epoch_text, resource = parts
        if not _EPOCH.fullmatch(epoch_text):
            raise ConfigurationError(f"malformed fencing token: bad epoch {epoch_text!r}")
        return cls(coordinator_id, resource, int(epoch_text))

    def _comparable(self, other: object) -> FencingToken:
        if not isinstance(other, FencingToken):
            raise TypeError(f"cannot compare a FencingToken with {type(other).__name__}")
        if other.resource != self.resource or other.coordinator_id != self.coordinator_id:
            raise TypeError(
                "fencing tokens are ordered only within one resource of one coordinator"
            )
        return other

    def __lt__(self, other: object) -> bool:
        return self.epoch < self._comparable(other).epoch

    def __le__(self, other: object) -> bool:
        return self.epoch <= self._comparable(other).epoch

    def __gt__(self, other: object) -> bool:
        return self.epoch > self._comparable(other).epoch

    def __ge__(self, other: object) -> bool:
        return self.epoch >= self._comparable(other).epoch
