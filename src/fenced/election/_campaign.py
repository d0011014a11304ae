"""Campaigning for leadership: a term is a lease on the election name, so its number is an epoch.

``with coord.campaign(name, value, ttl=…) as leadership`` waits until this candidate is elected and
yields a :class:`Leadership`. An election name is a resource name; a term is a lease on it (granted
through :meth:`~fenced.Coordinator.hold`), so:

* **the term number is the lease's epoch**: strictly increasing over every term ever granted for
  that name, across resignations, expiries, crashes, restarts and restores;
* **the leadership's token fences stores exactly like a lease's**: with ``fence=[store]`` the new
  term is installed at every store before the body runs (strict handoff), and from then on those
  stores reject every write of an older term;
* **candidates queue first come, first served** (the lease waiting queue, woken by the backend's
  notifications); a candidate that gives up (``wait`` ran out: :class:`~fenced.Busy`) leaves the
  queue, so it never delays the candidates behind it;
* **losing is a signal, not a flag**: like a held lease, ``leadership.lost`` is set and
  ``on_lost`` is called once, with the reason, as soon as the term is lost (renewals refused or
  failing until the local deadline, at the latest at that deadline); ``check()`` raises
  :class:`~fenced.LeaseLost` unless the term is HELD (UNCERTAIN included); a body that outlives
  its term ends with ``LeaseLost``, never silently;
* ``resign()`` releases the term at once, so the next candidate is elected without waiting for an
  expiry; ``proclaim(value)`` changes the advertised value, same term (the coordinator checks
  owner and term atomically with the change, and records it for observers).

Timeline of a demoted leader (a long GC pause)::

    t0  A is elected: term 7; installs 7 at the store (floor 7); A writes with term 7
    t1  A is paused; its renewals stop
    t2  term 7 expires at the coordinator; B, first in the queue, is elected: term 8;
        B installs 8 at the store (floor 8) before its body runs
    t3  A resumes and writes with term 7: the store rejects it (StaleToken); A's next check()
        raises LeaseLost, ``lost`` is set, on_lost runs

Between t2 and t3 A still *believes* it leads: nothing can tell a paused process anything.
Cancelling its work is best effort; **the fence at the store is the guarantee**.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

from fenced.core._errors import ConfigurationError, LeaseLost, LossReason
from fenced.core._lease import Lease, LeaseState
from fenced.core._token import FencingToken
from fenced.runtime._hold import Hold
from fenced.runtime._keeper import HeldLease, HeldView, OnLost

__all__ = [
    "MAX_VALUE_BYTES",
    "Campaign",
    "Leadership",
    "Proclaimer",
    "TermView",
    "validate_value",
]

MAX_VALUE_BYTES = 4096
"""The largest advertised value, in UTF-8 bytes (an address, a URL, a small JSON document)."""


def validate_value(value: object) -> str:
    """Return ``value`` if it can be advertised, else raise :class:`ConfigurationError`.

    A value is a ``str`` of at most :data:`MAX_VALUE_BYTES` UTF-8 bytes without NUL (which some
    backends cannot store). The empty string is allowed.
    """
    if not isinstance(value, str):
        raise ConfigurationError(f"an election value must be a str, got {type(value).__name__}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ConfigurationError("an election value must be valid Unicode text") from None
    if size > MAX_VALUE_BYTES:
        raise ConfigurationError(
            f"an election value must be at most {MAX_VALUE_BYTES} bytes, got {size}"
        )
    if "\x00" in value:
        raise ConfigurationError("an election value must not contain NUL characters")
    return value


class Proclaimer(Protocol):
    """What a leadership needs to advertise a new value (a coordinator backend has it)."""

    def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None: ...


class TermView:
    """What a leader reads of its term, on either face (:class:`Leadership`,
    :class:`fenced.aio.AsyncLeadership`): ``name``, ``term``, ``token``, ``value``, ``state``,
    ``loss()``, ``check()``. Subclasses keep ``_held`` (the held lease), ``_lock``, ``_value``
    and ``_resigned``."""

    _held: HeldView
    _lock: threading.Lock
    _value: str
    _resigned: LeaseLost | None

    @property
    def name(self) -> str:
        """The election name (the resource the term is a lease on)."""
        return self._held.resource

    @property
    def resource(self) -> str:
        return self._held.resource

    @property
    def term(self) -> int:
        """The term number: the epoch of the lease, strictly increasing per election."""
        return self._held.epoch

    @property
    def epoch(self) -> int:
        return self._held.epoch

    @property
    def token(self) -> FencingToken:
        """The fencing token of this term: pass it with every write to a store."""
        return self._held.token

    @property
    def holder(self) -> str:
        return self._held.lease.holder

    @property
    def lease(self) -> Lease:
        """The underlying lease as last renewed."""
        return self._held.lease

    @property
    def value(self) -> str:
        """The value this leader advertises (the last successful ``proclaim``)."""
        with self._lock:
            return self._value

    @property
    def deadline(self) -> float:
        """The local deadline of the term, on the deadline clock (``Clock.now``)."""
        return self._held.deadline

    @property
    def resigned(self) -> bool:
        """True once ``resign`` was called."""
        with self._lock:
            return self._resigned is not None

    @property
    def state(self) -> LeaseState:
        """HELD, UNCERTAIN or LOST at this instant (LOST after ``resign``)."""
        if self.resigned:
            return LeaseState.LOST
        return self._held.state

    def loss(self) -> LeaseLost | None:
        """Why the term is over (RELEASED after ``resign``), or None while HELD/UNCERTAIN."""
        with self._lock:
            resigned = self._resigned
        return resigned if resigned is not None else self._held.loss()

    def check(self) -> None:
        """Raise :class:`~fenced.LeaseLost` unless this process is the leader right now."""
        with self._lock:
            resigned = self._resigned
        if resigned is not None:
            raise LeaseLost(resigned.reason, resigned.detail)
        self._held.check()

    def superseded(self, detail: str = "a store reported a newer term") -> None:
        """Tell the runtime a store saw a newer term: the leadership is LOST (SUPERSEDED)."""
        self._held.superseded(detail)

    def _advertised(self, value: str) -> tuple[str, Lease]:
        """Check a proclamation before any I/O: the value, and the lease to proclaim with."""
        advertised = validate_value(value)
        error = self.loss()
        if error is not None:
            raise LeaseLost(error.reason, f"cannot proclaim: {error.detail}")
        return advertised, self._held.lease

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} term {self.term} {self.state.value}>"


class Leadership(TermView):
    """One term of leadership: a held lease on the election name, plus its advertised value.

    It behaves like :class:`~fenced.HeldLease` (``token``, ``epoch``, ``state``, ``check()``,
    ``lost``, ``loss()``) with ``term`` = ``epoch``, and adds ``value``, :meth:`proclaim`,
    :meth:`resign` and ``ended``. Thread-safe.

    Signals, and when each is given:

    ``lost``
        set once the term is **lost** (expired, refused by the coordinator, superseded at a
        store), together with the ``on_lost(reason)`` callback. Not set by a resignation:
        stepping down is not a loss.
    ``ended``
        set once the term is **over for this process, for any reason**: lost, resigned, or the
        ``with`` block exited. Wait on it in worker threads that must stop with the leadership.
    ``check()``
        raises :class:`~fenced.LeaseLost` unless the term is HELD right now: reason UNCERTAIN
        while a renewal is failing, RELEASED after :meth:`resign`, else why it was lost.
    """

    _held: HeldLease

    def __init__(
        self,
        held: HeldLease,
        proclaimer: Proclaimer,
        value: str,
        *,
        ended: threading.Event | None = None,
    ) -> None:
        self._held = held
        self._proclaimer = proclaimer
        self._value = value
        self._lock = threading.Lock()
        self._resigned: LeaseLost | None = None
        self.ended = ended if ended is not None else threading.Event()
        """Set once the leadership is over for this process: lost, resigned or block exited."""

    @property
    def lost(self) -> threading.Event:
        """Set once the term is lost (never cleared; a resignation does not set it)."""
        return self._held.lost

    # -- what the leader does -------------------------------------------------------------
    def proclaim(self, value: str) -> None:
        """Advertise ``value`` instead of the current one, in the same term.

        The coordinator replaces the value only if this term is still this owner's, atomically,
        and records it: observers see a PROCLAIMED change with the same term, and
        ``coord.leader(name)`` shows the new value. Raises :class:`ConfigurationError` for a bad
        value (before any I/O); :class:`~fenced.LeaseLost` if the term is over (resigned, lost,
        or the coordinator says it is no longer ours; the loss signal itself comes with the next
        renewal); :class:`~fenced.Unavailable` / :class:`~fenced.OutcomeUnknown` if the
        coordinator could not be reached or did not answer: retrying is safe.
        """
        advertised, lease = self._advertised(value)
        self._proclaimer.proclaim(lease.resource, lease.epoch, lease.owner, advertised)
        with self._lock:
            self._value = advertised

    def resign(self) -> bool:
        """Step down now: stop renewing and release the term, so the next candidate is elected.

        The release wakes the next queued candidate by the backend's notification: the handoff
        takes one round trip, not an expiry. Returns True if the term was released now; False if
        it had already ended (lost, or resigned before) or the release could not be delivered
        (the term then ends at its expiry, and the next term's token fences the stores). Either
        way, from the return on, ``state`` is LOST, ``check()`` raises ``LeaseLost(RELEASED)``
        and ``ended`` is set; ``lost`` is not set and ``on_lost`` is not called (stepping down
        is not a loss).
        Idempotent; the ``with`` block then ends without releasing again.
        """
        with self._lock:
            if self._resigned is not None:
                return False
            self._resigned = LeaseLost(LossReason.RELEASED, "the leader resigned")
        try:
            return self._held.stop(release=True)
        finally:
            self.ended.set()


class Campaign:
    """The context manager returned by ``Coordinator.campaign``; single use.

    ``__enter__`` blocks until elected (or raises :class:`~fenced.Busy` after ``wait``), installs
    the term at the ``fence`` stores, starts renewing, and returns the :class:`Leadership`.
    ``__exit__`` stops renewing and releases the term (unless :meth:`Leadership.resign` did
    already); if the term was lost while the body ran and the body raised nothing, it raises
    :class:`~fenced.LeaseLost`. An exception from the body is never masked.
    """

    def __init__(
        self,
        hold: Callable[[OnLost], Hold],
        proclaimer: Proclaimer,
        value: str,
        *,
        on_lost: OnLost | None = None,
    ) -> None:
        if on_lost is not None and not callable(on_lost):
            raise ConfigurationError("on_lost must be callable")
        self._on_lost = on_lost
        self._ended = threading.Event()
        self._hold = hold(self._signal_loss)
        self._proclaimer = proclaimer
        self._value = value
        self._held: HeldLease | None = None
        self._leadership: Leadership | None = None

    def _signal_loss(self, error: LeaseLost) -> None:
        self._ended.set()
        if self._on_lost is not None:
            self._on_lost(error)

    def __enter__(self) -> Leadership:
        if self._leadership is not None:
            raise RuntimeError("a campaign() context manager can be entered only once")
        held = self._hold.__enter__()
        self._held = held
        self._leadership = Leadership(held, self._proclaimer, self._value, ended=self._ended)
        return self._leadership

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        leadership, held = self._leadership, self._held
        if leadership is None or held is None:
            return
        try:
            if not leadership.resigned:
                self._hold.__exit__(exc_type, exc, tb)
            elif exc_type is None and held.lost.is_set():  # lost first, resigned afterwards
                loss = held.loss() or LeaseLost(LossReason.EXPIRED, "the term was lost")
                raise LeaseLost(loss.reason, f"the body outlived its term: {loss.detail}")
        finally:
            self._ended.set()
