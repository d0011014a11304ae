"""Validation of safety settings. Pure. Bad settings fail at the call with ConfigurationError.

There is no "never expires": every lease has a finite ``ttl`` of at least :data:`MIN_TTL` (0.1 s)
and at most :data:`MAX_TTL` (one week). The local deadline of a
lease is ``time when the request was sent + ttl - safety_margin``, on the deadline clock
(``Clock.now``, CLOCK_BOOTTIME on Linux); the default margin is 10 % of the ttl and must stay
below the ttl. ``wait`` is ``None`` (forever) or a finite number of seconds ≥ 0 (0 tries once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fenced.core._errors import ConfigurationError

__all__ = [
    "DEFAULT_MARGIN_FRACTION",
    "MAX_TTL",
    "MIN_TTL",
    "LeasePolicy",
    "validate_holder",
    "validate_ttl",
    "validate_wait",
]

DEFAULT_MARGIN_FRACTION = 0.1
MIN_TTL = 0.1
"""The shortest ttl (seconds). A lease must outlive its own grant: the reply, the fence installs
of ``hold(fence=…)`` and the first renewal (at ttl/3) all happen within it. Below 0.1 s a grant
would mostly consume an epoch for a lease already lost when it arrives (a commit with fsync, or
one network round trip, takes milliseconds to tens of milliseconds)."""
MAX_TTL = 7 * 24 * 3600.0
"""The longest ttl (seconds): one week. There is no "never expires"."""
MAX_HOLDER_LEN = 200


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(f"{name} must be a number of seconds, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ConfigurationError(f"{name} must be finite, got {value!r}")
    return number


def validate_ttl(ttl: object) -> float:
    """Return ``ttl`` as float if :data:`MIN_TTL` ≤ ttl ≤ :data:`MAX_TTL`, else raise
    :class:`ConfigurationError` (before any I/O: a refused ttl consumes no epoch)."""
    value = _number("ttl", ttl)
    if value <= 0:
        raise ConfigurationError(f"ttl must be > 0 seconds, got {ttl!r}")
    if value < MIN_TTL:
        raise ConfigurationError(f"ttl must be at least {MIN_TTL:g} seconds, got {ttl!r}")
    if value > MAX_TTL:
        raise ConfigurationError(f"ttl must be at most {MAX_TTL:.0f} seconds, got {ttl!r}")
    return value


def validate_wait(wait: object) -> float | None:
    """Return ``wait`` (None = forever, 0 = try once) or raise :class:`ConfigurationError`."""
    if wait is None:
        return None
    value = _number("wait", wait)
    if value < 0:
        raise ConfigurationError(f"wait must be >= 0 seconds or None, got {wait!r}")
    return value


def validate_holder(holder: object) -> str:
    """Return a holder label (printable, 1–200 chars) or raise :class:`ConfigurationError`."""
    if not isinstance(holder, str) or not holder or len(holder) > MAX_HOLDER_LEN:
        raise ConfigurationError(f"holder must be a label of 1-{MAX_HOLDER_LEN} characters")
    if not holder.isprintable():
        raise ConfigurationError(f"holder label {holder!r} contains non-printable characters")
    return holder


@dataclass(frozen=True, slots=True)
class LeasePolicy:
    """Validated timing of one lease: ``ttl``, ``safety_margin`` and the renewal interval."""

    ttl: float
    safety_margin: float

    @classmethod
    def create(cls, ttl: object, safety_margin: object = None) -> LeasePolicy:
        """Validate and build; the default margin is 10 % of ``ttl``."""
        value = validate_ttl(ttl)
        if safety_margin is None:
            margin = value * DEFAULT_MARGIN_FRACTION
        else:
            margin = _number("safety_margin", safety_margin)
            if margin < 0:
                raise ConfigurationError(f"safety_margin must be >= 0, got {safety_margin!r}")
            if margin >= value:
                raise ConfigurationError(
                    f"safety_margin ({margin}s) must be smaller than ttl ({value}s)"
                )
        return cls(value, margin)

    @property
    def renew_every(self) -> float:
        """Nominal renewal interval: a third of the ttl (the runtime adds jitter)."""
        return self.ttl / 3

    def deadline(self, sent_at: float) -> float:
        """Local deadline for a request sent at ``sent_at`` on the deadline clock (``Clock.now``,
        CLOCK_BOOTTIME on Linux)."""
        return sent_at + self.ttl - self.safety_margin
