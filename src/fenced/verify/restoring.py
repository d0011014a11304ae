"""Backup and restore of the coordinator, as verification uses them (case 6 and the nemesis).

Restore belongs to the operations work (``fenced.coordinator.restore``, DESIGN §6). Until that
module exists, :func:`restore_support` returns None and case 6 says "not available" (it neither
passes nor fails the run); the nemesis skips its restores. Once it exists, it must work: a
module without the expected functions, or a restore that raises, fails case 6 and is reported
— verification never passes silently.

Expected API (checked by name and called with keyword arguments)::

    backup(url: str, dest: pathlib.Path) -> object          # a consistent online copy
    restore(url: str, src: pathlib.Path, *, force: bool) -> object
                                                            # put it back, advance every epoch

Verification restores **while worker processes run** (``force=True``: the restore module
otherwise refuses while any process has the coordinator open): that is the fault being
injected. Processes that had the database open keep working on the replaced file; whatever they
do there is invisible to the restored coordinator, so the case and the nemesis start fresh
worker processes after a restore, and only keep a pre-restore holder that is stopped with a
write in flight (case 6), whose write the stores must reject.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
from collections.abc import Callable, Iterator
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
        with _quiet():
            _call(self.backup_fn, {"url": url, "dest": dest})

    def restore(self, src: Path, url: str) -> None:
        arguments: dict[str, Any] = {"src": src, "url": url}
        if "force" in inspect.signature(self.restore_fn).parameters:
            arguments["force"] = True
        with _quiet():
            _call(self.restore_fn, arguments)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The restore module logs a warning per restore: expected here, so not shown."""
    logger = logging.getLogger("fenced.coordinator")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


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
