"""Backup and restore of the coordinator, as verification uses them (case 6 and the nemesis).

Restore belongs to the operations work (``fenced.coordinator.restore``, DESIGN §6). Until that
module exists, :func:`restore_support` returns None and case 6 says "not available" (it neither
passes nor fails the run); the nemesis skips its restores. Once it exists, it must work: a
module without the expected functions, or a restore that raises, fails case 6 and is reported
— verification never passes silently.

Expected API (checked by name and called with keyword arguments)::

    backup(url: str, dest: pathlib.Path) -> object          # a consistent online copy
    restore(src: pathlib.Path, url: str) -> object          # put it back, advance every epoch
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["MODULE", "RestoreSupport", "RestoreUnusable", "restore_support"]

MODULE = "fenced.coordinator.restore"


class RestoreUnusable(Exception):
    """The restore module exists but verification cannot use it (API not as expected)."""


@dataclass(frozen=True)
class RestoreSupport:
    """The backup and restore functions of :data:`MODULE`."""

    backup_fn: Callable[..., Any]
    restore_fn: Callable[..., Any]

    def backup(self, url: str, dest: Path) -> None:
        _call(self.backup_fn, {"url": url, "dest": dest})

    def restore(self, src: Path, url: str) -> None:
        _call(self.restore_fn, {"src": src, "url": url})


def _call(function: Callable[..., Any], arguments: dict[str, Any]) -> None:
    """Call ``function`` with ``arguments`` matched to its parameters by name or position."""
    parameters = list(inspect.signature(function).parameters.values())
    names = {p.name for p in parameters}
    if set(arguments) <= names:
        function(**arguments)
        return
    positional = [p for p in parameters if p.default is inspect.Parameter.empty]
    if len(positional) != len(arguments):
        raise RestoreUnusable(
            f"{MODULE}.{getattr(function, '__name__', function)} takes "
            f"({', '.join(p.name for p in parameters)}); verification expects "
            f"({', '.join(arguments)})"
        )
    function(*arguments.values())


def restore_support() -> RestoreSupport | None:
    """The restore functions, or None while :data:`MODULE` does not exist.

    Raises :class:`RestoreUnusable` if the module exists without ``backup`` and ``restore``.
    """
    try:
        module = importlib.import_module(MODULE)
    except ModuleNotFoundError as error:
        if error.name == MODULE:
            return None
        raise
    backup_fn = getattr(module, "backup", None)
    restore_fn = getattr(module, "restore", None)
    if not callable(backup_fn) or not callable(restore_fn):
        raise RestoreUnusable(f"{MODULE} exists but has no backup() and restore() functions")
    return RestoreSupport(backup_fn, restore_fn)
