"""Checking the arguments that several commands share, before any I/O.

:func:`parse_seconds` reads a number of seconds given on the command line (every command with a
duration option). The commands that run a command under a lease or a term (``fenced run``,
``fenced elect``) take the same options (:func:`supervision_options`) and check them the same
way (:func:`check_command`, :func:`check_supervision`). A bad value raises
:class:`ConfigurationError` (exit 2) with a one-line message naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from fenced.coordinator._connect import absolute_url, resolve_url
from fenced.core._errors import ConfigurationError
from fenced.core._names import validate_resource
from fenced.core._policy import validate_holder, validate_ttl, validate_wait
from fenced.runtime._child import DEFAULT_GRACE, validate_grace

__all__ = [
    "DEFAULT_TTL",
    "Supervision",
    "check_command",
    "check_store_urls",
    "check_supervision",
    "parse_seconds",
    "supervision_options",
    "ttl_option",
]

_F = TypeVar("_F", bound=Callable[..., Any])

DEFAULT_TTL = 30.0
"""Default ``--ttl`` of ``fenced run`` and ``fenced elect`` in seconds."""

_FOREVER = ("forever", "inf", "infinity", "none")


def parse_seconds(option: str, text: str, *, forever: bool = False) -> float | None:
    """Parse a number of seconds given on the command line; None for "forever" if allowed.

    Raises :class:`ConfigurationError` naming ``option`` for anything else (a one-line message).
    """
    cleaned = text.strip().lower()
    if forever and cleaned in _FOREVER:
        return None
    try:
        value = float(cleaned)
    except ValueError:
        hint = " or 'forever'" if forever else ""
        raise ConfigurationError(
            f"{option} must be a number of seconds{hint}, got {text!r}"
        ) from None
    if forever and value == math.inf:
        return None
    if not math.isfinite(value):
        raise ConfigurationError(f"{option} must be a finite number of seconds, got {text!r}")
    return value


def check_store_urls(urls: tuple[str, ...]) -> None:
    """Refuse a malformed ``--fence`` URL before anything is opened or created (ConfigurationError;
    reads at most file headers)."""
    if urls:
        from fenced.fence._registry import check_url  # noqa: PLC0415 - only needed with --fence

        for url in urls:
            check_url(url)


def ttl_option(default: float, text: str) -> Callable[[_F], _F]:
    """The ``--ttl SECONDS`` option (``text`` is its help), read with :func:`parse_seconds`."""
    return click.option(
        "--ttl",
        default=f"{default:g}",
        show_default=True,
        metavar="SECONDS",
        help=text,
    )


def supervision_options(
    *, ttl_help: str, wait_help: str, holder_help: str, fence_help: str
) -> Callable[[_F], _F]:
    """``--ttl``, ``--wait``, ``--holder``, ``--grace`` and ``--fence``, in this order, of a
    command that runs a command under a lease or a term (the ``*_help`` texts are their help)."""
    options = [
        ttl_option(DEFAULT_TTL, ttl_help),
        click.option(
            "--wait",
            default="forever",
            show_default=True,
            metavar="SECONDS|forever",
            help=wait_help,
        ),
        click.option("--holder", metavar="LABEL", help=holder_help),
        click.option(
            "--grace",
            default=f"{DEFAULT_GRACE:g}",
            show_default=True,
            metavar="SECONDS",
            help="After a loss: seconds between SIGTERM and SIGKILL.",
        ),
        click.option(
            "--fence",
            "fence_urls",
            multiple=True,
            metavar="STORE_URL",
            help=fence_help,
        ),
    ]

    def decorate(function: _F) -> _F:
        for option in reversed(options):  # the first option listed first in --help
            function = option(function)
        return function

    return decorate


def check_command(resource: str, command: tuple[str, ...], usage: str) -> str:
    """Return the checked ``resource`` (or election name); refuse an empty ``command``, naming
    ``usage`` (e.g. ``fenced run RESOURCE [OPTIONS] -- CMD [ARGS]...``)."""
    name = validate_resource(resource)
    if not command:
        raise ConfigurationError(f"missing command (usage: {usage})")
    return name


@dataclass(frozen=True)
class Supervision:
    """The checked :func:`supervision_options` and coordinator URL of one command."""

    ttl: float
    wait: float | None
    grace: float
    holder: str | None
    url: str
    """Absolute (password kept): the command's ``FENCED_URL`` names this coordinator wherever
    the command cds to."""
    fence_urls: tuple[str, ...]


def check_supervision(
    *,
    ttl: str,
    wait: str,
    grace: str,
    holder: str | None,
    url: str | None,
    fence_urls: tuple[str, ...],
) -> Supervision:
    """Check the :func:`supervision_options` and ``--url`` before anything is opened or created."""
    ttl_value = validate_ttl(parse_seconds("--ttl", ttl))
    wait_value = validate_wait(parse_seconds("--wait", wait, forever=True))
    grace_value = validate_grace(parse_seconds("--grace", grace))
    label = None if holder is None else validate_holder(holder)
    coordinator_url = absolute_url(resolve_url(url))
    check_store_urls(fence_urls)
    return Supervision(ttl_value, wait_value, grace_value, label, coordinator_url, fence_urls)
