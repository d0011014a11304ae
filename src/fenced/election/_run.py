"""Running work only while leader: a function in this thread, or a command in a child process.

:func:`run_as_leader` campaigns, calls ``fn(leadership)`` once elected, and ends the term when
``fn`` returns. Python cannot stop a thread from the outside, so losing the term is a *signal*
``fn`` receives: ``leadership.lost`` and ``leadership.ended`` are set, and ``leadership.check()``
raises :class:`~fenced.LeaseLost` at ``fn``'s next check. ``fn`` should check between steps and
pass ``leadership.token`` with every write; **the fence at the store is the guarantee** for the
steps it had already started.

:func:`run_command_as_leader` does the same for a command (what ``fenced elect`` runs): it starts
the command once elected, with ``FENCED_TOKEN``, ``FENCED_RESOURCE`` (the election name),
``FENCED_EPOCH`` (the term) and ``FENCED_URL``, and on loss sends its process group SIGTERM, then
SIGKILL after ``grace`` (:class:`~fenced.runtime._child.ChildSupervisor`).

Timeline of a loss while ``fn`` runs::

    t0  elected: term 7; fn(leadership) starts
    t1  renewals fail (coordinator unreachable): state UNCERTAIN, check() raises (UNCERTAIN)
    t2  local deadline: LOST; leadership.lost and .ended set; on_lost(reason) called
    t3  fn's next check() raises LeaseLost; run_as_leader re-raises it after releasing;
        if fn returns normally instead, run_as_leader raises LeaseLost all the same
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, TypeVar

from fenced.core._errors import LeaseLost
from fenced.election._campaign import Campaign, Leadership
from fenced.runtime._child import DEFAULT_GRACE, ChildResult, ChildSupervisor
from fenced.runtime._hold import Fenceable
from fenced.runtime._keeper import OnLost

__all__ = ["Campaigner", "run_as_leader", "run_command_as_leader"]

T = TypeVar("T")


class Campaigner(Protocol):
    """Anything with ``campaign`` (a :class:`~fenced.Coordinator`)."""

    @property
    def url(self) -> str: ...

    def campaign(
        self,
        name: str,
        value: str,
        ttl: float,
        *,
        wait: float | None = None,
        fence: Iterable[Fenceable] = (),
        on_lost: OnLost | None = None,
        holder: str | None = None,
        safety_margin: float | None = None,
    ) -> Campaign: ...


def run_as_leader(
    coord: Campaigner,
    name: str,
    fn: Callable[[Leadership], T],
    *,
    value: str,
    ttl: float,
    wait: float | None = None,
    fence: Iterable[Fenceable] = (),
    on_lost: OnLost | None = None,
    holder: str | None = None,
    safety_margin: float | None = None,
) -> T:
    """Wait to be elected leader of ``name``, run ``fn(leadership)`` in this thread, step down.

    Returns what ``fn`` returns, after releasing the term (the next candidate is elected at
    once). Raises :class:`~fenced.Busy` if not elected within ``wait`` (``fn`` never ran);
    :class:`~fenced.LeaseLost` if the term was lost while ``fn`` ran, even if ``fn`` returned
    normally (its last steps were not authorised; stores fenced them); ``fn``'s own exception
    otherwise. ``fn`` may call ``leadership.resign()`` to step down early. Parameters are
    those of ``coord.campaign``, validated before any I/O.
    """
    with coord.campaign(
        name,
        value,
        ttl,
        wait=wait,
        fence=fence,
        on_lost=on_lost,
        holder=holder,
        safety_margin=safety_margin,
    ) as leadership:
        return fn(leadership)


def run_command_as_leader(
    coord: Campaigner,
    name: str,
    argv: Sequence[str],
    *,
    value: str,
    ttl: float,
    wait: float | None = None,
    grace: float = DEFAULT_GRACE,
    fence: Iterable[Fenceable] = (),
    holder: str | None = None,
    env: Mapping[str, str] | None = None,
    handle_signals: bool = True,
    on_elected: Callable[[Leadership], object] | None = None,
    url: str | None = None,
) -> ChildResult:
    """Wait to be elected leader of ``name``, run ``argv`` as a supervised child, step down.

    The command is looked up first (:class:`~fenced.runtime._child.StartFailed`, before any
    campaign: a typo costs no term). Once elected (and the term installed at ``fence``),
    ``on_elected(leadership)`` is called, then the command starts with the term in its
    environment; on loss its process group gets SIGTERM, then SIGKILL after ``grace`` seconds.
    Returns the :class:`~fenced.runtime._child.ChildResult`: ``result.lost`` is the loss if the
    term was lost before the command's exit was seen, else None. Raises
    :class:`~fenced.Busy` if not elected within ``wait``. ``handle_signals`` (main thread only)
    forwards the supervisor's signals to the command, as ``fenced run`` does. ``url`` is the
    command's ``FENCED_URL`` (default ``coord.url``, which masks a password: pass the URL the
    coordinator was opened with when the command must connect to it).
    """
    supervisor = ChildSupervisor(
        argv,
        grace=grace,
        url=coord.url if url is None else url,
        env=env,
        handle_signals=handle_signals,
    )
    result: ChildResult | None = None
    try:
        supervisor.check_command()
        with coord.campaign(
            name, value, ttl, wait=wait, fence=fence, on_lost=supervisor.on_lost, holder=holder
        ) as leadership:
            if on_elected is not None:
                on_elected(leadership)
            result = supervisor.run(leadership)
    except LeaseLost:
        if result is None:  # lost before the command could start
            raise
        # else: noticed when stepping down, after the command's exit; result.lost says whether
        # that was while the command ran
    finally:
        supervisor.close()
    assert result is not None
    return result
