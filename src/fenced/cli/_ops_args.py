"""Arguments shared by the operations commands (``status``, ``timeline``, ``metrics``, ``restore``).

Durations (``--window``, ``--since``, ``--flap-window``), instants (``--since``), stores that
must already exist (``--store``, ``--floor-from``), listen addresses, and time formatting.
Every bad value is a one-line :class:`~fenced.ConfigurationError` (exit 2).
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from datetime import datetime

from fenced.core._errors import ConfigurationError
from fenced.fence import Store, open_store

__all__ = [
    "format_instant",
    "format_seconds",
    "open_existing_stores",
    "parse_duration",
    "parse_listen",
    "parse_since",
]

_DURATION = re.compile(r"(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>ms|s|m|h|d|w)?")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, None: 1.0}


def parse_duration(option: str, text: str) -> float:
    """``90``, ``90s``, ``15m``, ``2h``, ``7d``, ``1w``, ``500ms`` → seconds (> 0)."""
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise ConfigurationError(
            f"{option} must be a duration like 90s, 15m, 2h or 7d, got {text!r}"
        )
    seconds = float(match["number"]) * _UNITS[match["unit"]]
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigurationError(f"{option} must be a positive duration, got {text!r}")
    return seconds


def parse_since(option: str, text: str, now: float) -> float:
    """A duration before ``now`` (``2h``) or an ISO 8601 instant (local time unless it says).

    Returns wall-clock seconds.
    """
    with contextlib.suppress(ConfigurationError):
        return now - parse_duration(option, text)
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise ConfigurationError(
            f"{option} must be a duration (2h, 30m) or a time (2024-05-01T10:00), got {text!r}"
        ) from None


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` (every interface) or ``PORT`` (127.0.0.1) → (host, port)."""
    cleaned = text.strip()
    host, colon, port = cleaned.rpartition(":")
    if not colon and cleaned.isdigit():
        host, port = "127.0.0.1", cleaned
    host = host.strip("[]")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigurationError(f"--listen must be HOST:PORT, :PORT or PORT, got {text!r}")
    return (host or "0.0.0.0"), int(port)  # noqa: S104 - ':PORT' asks for every interface


def open_existing_stores(urls: tuple[str, ...] | list[str]) -> list[Store]:
    """Open every store URL, refusing a local store that does not exist (never create one:
    ``open_store(create=False)``).

    The caller closes them. On an error, the stores opened so far are closed.
    """
    stores: list[Store] = []
    try:
        for url in urls:
            stores.append(open_store(url, create=False))
    except BaseException:
        for store in stores:
            store.close()
        raise
    return stores


def format_seconds(value: float | None) -> str:
    """``-``, ``0.250s``, ``12.5s``, ``3m04s``, ``2h05m``, ``3d04h``."""
    if value is None:
        return "-"
    if value < 10:
        return f"{value:.3f}s"
    if value < 60:
        return f"{value:.1f}s"
    minutes, seconds = divmod(int(value), 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def format_instant(at: float | None, reference: float | None = None) -> str:
    """Local time: ``HH:MM:SS.mmm`` on ``reference``'s day, else ``YYYY-MM-DD HH:MM:SS``."""
    if at is None:
        return "-"
    moment = time.localtime(at)
    if reference is not None and time.localtime(reference)[:3] == moment[:3]:
        return time.strftime("%H:%M:%S", moment) + f".{int(at * 1000) % 1000:03d}"
    return time.strftime("%Y-%m-%d %H:%M:%S", moment)
