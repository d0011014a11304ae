"""``fenced verify``: evidence, with real processes and real faults, that stale owners are harmless.

Nothing in the library imports this package; the command line does (``fenced verify``, see
docs/verify.md), and so can a program or a test suite, through this module's public face:

* :func:`run` — the practice table: runs the cases against a coordinator and stores and returns
  one :class:`Row` per case, with its status (what ``fenced verify`` prints);
* :func:`check` — the history checker on a kept history file, returning a :class:`Report` whose
  violations (:class:`Violation`) each name one of :data:`INVARIANTS`.

The randomized schedules and the seeded defects are the command's (``fenced verify --random N``,
``--mutants``, with ``--json`` for tools). The modules below are internal:

* :mod:`.cases` — the practice table: seven scripted cases (crash, pause, lost renewal reply,
  delayed release, storage timeout, restore, old write before the new owner's first write);
* :mod:`.schedule` and :mod:`.nemesis` — randomized mode: seeded fault schedules of several
  workers while a nemesis pauses, kills and restores, timed around TTL boundaries (backup and
  restore, also for case 6, with :mod:`fenced.coordinator._restore`);
* :mod:`.worker`, :mod:`.faults`, :mod:`.processes` — the worker processes, the in-process wire
  faults and the recording of every call, the signals;
* :mod:`.recorder` — one history file per run, CLOCK_MONOTONIC timestamps;
* :mod:`.history`, :mod:`.checker`, :mod:`.report` — a recorded history read into calls and
  leases, the invariants verified on it, and the verdict;
* :mod:`.mutants` — seeded defects the checker must catch (detection power), which
  :mod:`.seeded` builds at seams of the library for the workers (the library has no switch);
* :mod:`.table` — the rows, plain-text and JSON rendering (the command line adds rich tables);
  :mod:`.target` — what runs where.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from fenced.core._errors import ConfigurationError
from fenced.verify._checker import check_history
from fenced.verify._recorder import read_history
from fenced.verify._report import INVARIANTS, Report, Violation
from fenced.verify._table import Row, Status
from fenced.verify._target import Target

__all__ = ["INVARIANTS", "Report", "Row", "Status", "Violation", "check", "run"]


def _names(value: str | Iterable[str], what: str) -> tuple[str, ...]:
    """A str is one item (not its characters); anything else must be an iterable of str."""
    items = (value,) if isinstance(value, str) else tuple(value)
    for item in items:
        if not isinstance(item, str):
            raise ConfigurationError(f"{what} takes strings, not {type(item).__name__}")
    return items


def run(
    coordinator: str | None = None,
    stores: str | Iterable[str] = (),
    *,
    cases: str | Iterable[str] | None = None,
    keep_history: str | os.PathLike[str] | None = None,
    progress: Callable[[Row], None] | None = None,
    api: str = "sync",
) -> list[Row]:
    """Run the cases of the practice table, as ``fenced verify`` does; return their rows.

    The parameters mirror the command's options: ``coordinator`` is a coordinator URL
    (``--coordinator``; None: a fresh embedded SQLite coordinator per case, in a temporary
    directory), ``stores`` the URLs of stores to verify in the role of their mode (``--store``:
    at most one strict and one monotonic; the other role gets a temporary store), ``cases`` the
    case numbers to run (``--case``: ``"1"`` … ``"6"``, ``"7a"``, ``"7b"``; None runs them all),
    ``keep_history`` a directory to copy every history file to (``--keep-history``; the
    histories of failed cases are always kept, and the row says where). A single string is one
    URL or one case number. ``progress`` is called with each row as soon as its case ends.
    ``api="async"`` runs the workers on the asyncio face (:mod:`fenced.aio`; ``--api async``).

    Each case starts real worker processes (``python -m fenced.verify._worker``) and sends them
    real signals; the call takes a few seconds per case. It returns the rows in table order;
    ``row.status`` is ``"pass"``, ``"fail"`` or ``"unavailable"`` (the case cannot run on this
    target, e.g. case 6 against a coordinator verify did not create: neither a pass nor a
    failure). A failed case is a row, never an exception.

    Raises :class:`~fenced.ConfigurationError` before anything runs for an unknown or empty
    case selection, an unusable URL (``memory://`` cannot be shared by processes), or two stores
    of the same mode; :class:`~fenced.Unavailable` if a coordinator or store cannot be reached.
    """
    # Imported here: the worker processes run ``python -m fenced.verify._worker``, which imports
    # this package first; importing the cases (and so the worker module) here at import time
    # would load the worker module twice in every worker.
    from fenced.verify._cases import CASES, run_cases  # noqa: PLC0415

    chosen = None if cases is None else _names(cases, "cases")
    numbers = [case.number for case in CASES]
    if chosen is not None:
        if not chosen:
            raise ConfigurationError("no case selected; cases=None runs every case")
        for number in chosen:
            if number not in numbers:
                raise ConfigurationError(f"unknown case {number!r}; cases: {', '.join(numbers)}")
    target = Target.create(coordinator, _names(stores, "stores"), api)
    return run_cases(
        target,
        only=chosen,
        keep_history=None if keep_history is None else Path(keep_history),
        progress=progress,
    )


def check(history: str | os.PathLike[str]) -> Report:
    """Check a kept history file (``--keep-history``, or the path a failed run printed) against
    every invariant again; the report's ``ok`` is True when nothing was violated.

    A torn last line (a killed process) is dropped; a missing file raises ``FileNotFoundError``.
    """
    return check_history(read_history(history))
