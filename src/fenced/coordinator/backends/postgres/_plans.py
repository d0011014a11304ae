"""What the sync and the asyncio PostgreSQL backends share: the statement each operation sends
(a :class:`~._statements.Call`), what its answer means, the tickets, and every step of queueing
and waiting that needs no I/O. No I/O here.

:class:`~._backend.PostgresBackend` (threads) and :class:`~._aio.AsyncPostgresBackend`
(asyncio) are both :class:`Face` s: they build every call and read every answer here, and
differ only in how they send a call and wait (a thread that blocks, a task that awaits).
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from psycopg.types.json import Jsonb

from fenced._drivers.postgres import DEFAULT_OP_TIMEOUT, ParsedURL, parse_url
from fenced.coordinator.backend import (
    CAP_RECORDS,
    CAP_REQUEST_ID,
    CAP_WAIT_NOTIFY,
    Blocked,
    Granted,
    GrantRequest,
    Ticket,
    owned_ticket,
)
from fenced.coordinator.backends.postgres._listener import RECHECK, Listening, Waiting
from fenced.coordinator.backends.postgres._statements import Call, DirectStatement, Rows, Statements
from fenced.core._clock import Clock, SystemClock
from fenced.core._errors import (
    ConfigurationError,
    LeaseLost,
    LossReason,
    OutcomeUnknown,
    Unavailable,
)
from fenced.core._lease import LeaseInfo
from fenced.core._names import validate_resource
from fenced.core._records import Record, RecordKind
from fenced.core._token import MAX_EPOCH

__all__ = [
    "CAPABILITIES",
    "GAP_SETTLE",
    "QUEUE_KEEPALIVE",
    "URL_KEYS",
    "WATCH_KEEPALIVE",
    "Face",
    "QueueTicket",
    "Settings",
    "advance_call",
    "current_call",
    "dumps",
    "enqueue_call",
    "grant_answer",
    "grant_call",
    "handoff_grant",
    "last_epoch_call",
    "lease_info",
    "leave_call",
    "probe_call",
    "proclaim_call",
    "proclaimed",
    "records_call",
    "records_of",
    "release_call",
    "renew_call",
    "renewed",
    "report_call",
    "settings",
    "taken",
    "unwatch_call",
    "watch_pause",
    "watch_poll_call",
    "watch_start_call",
]

log = logging.getLogger("fenced.coordinator.postgres")

QUEUE_KEEPALIVE = 2.0
"""Seconds a waiter keeps its place after its last ``try_grant`` (a dead waiter is skipped)."""
GAP_SETTLE = 2.0
"""Seconds after which a gap in ``records(None, …)`` is taken as a rolled-back transaction."""
WATCH_KEEPALIVE = 6.0
"""Seconds a watcher's row lives after its last refresh (refreshed every third of that)."""
URL_KEYS = ("listen_url", "listen", "pool_size", "timeout", "prepare")
"""fenced's query parameters of a coordinator URL besides ``schema`` (the module docstring)."""
CAPABILITIES = frozenset({CAP_WAIT_NOTIFY, CAP_REQUEST_ID, CAP_RECORDS})
_PRUNE_CHANCE = 0.005
"""The share of grants that also prune (the ``try_grant`` function): up to 1000 records past
``records_retention`` and 512 request ids older than 24 h, more than a grant ever adds."""


# -- the URL ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Settings:
    """fenced's URL parameters of the coordinator (``timeout``, ``listen``, ``listen_url``)."""

    op_timeout: float
    """Seconds an operation waits for its reply (``?timeout=``)."""
    listen_enabled: bool
    """False with ``?listen=off``."""
    listen_conninfo: str | None
    """libpq's conninfo of ``?listen_url=`` (a direct connection for LISTEN), else None."""
    connect_budget: float
    """Seconds an operation waits for a connection."""


def settings(parsed: ParsedURL) -> Settings:
    """The :class:`Settings` of ``parsed``; :class:`~fenced.ConfigurationError` for a bad value."""
    op_timeout = parsed.option_float("timeout", DEFAULT_OP_TIMEOUT, minimum=0.01)
    listen = parsed.options.get("listen_url")
    listen_enabled = parsed.option_flag("listen", True)
    return Settings(
        op_timeout,
        listen_enabled,
        None if listen is None else parse_url(listen, ()).conninfo,
        min(parsed.connect_timeout, op_timeout),
    )


# -- leases: the calls and their answers ------------------------------------------------------


def grant_call(
    direct: Mapping[str, DirectStatement],
    request: GrantRequest,
    waiter_id: int | None,
    listen_key: Callable[[GrantRequest], int | None],
) -> Call:
    """The hot statement of an acquire attempt: ``_FAST_GRANT`` without a ticket
    (``waiter_id``) or request_id, else the ``try_grant`` function (which also prunes, by
    chance). ``listen_key`` is asked only for the latter. Idempotent: the owner secret
    identifies this request's grant."""
    prune = random.random() < _PRUNE_CHANCE
    fast = waiter_id is None and request.request_id is None and not prune
    name = "grant" if fast else "grant_queued"
    params = direct[name].bind(
        name=request.resource,
        owner=request.owner,
        holder=request.holder,
        ttl=float(request.ttl),
        value=request.value,
        keepalive=QUEUE_KEEPALIVE,
        retry_cap=QUEUE_KEEPALIVE / 3,
        request_id=request.request_id,
        ticket=waiter_id,
        listen_key=None if fast else listen_key(request),
        prune=prune,
    )
    return (f"acquiring {request.resource}", name, params, True, None, True)


def grant_answer(request: GrantRequest, row: Sequence[Any]) -> tuple[Granted | Blocked, int | None]:
    """The answer of an acquire attempt's row, and the waiter id a blocked ticket has now
    (None: unchanged). Raises ``LeaseLost(REJECTED)`` for a request_id whose grant ended,
    ``ConfigurationError`` for a request_id used for another resource."""
    status, epoch, owner, holder, ttl, remaining, retry_in, new_ticket = row
    if status == "granted":
        return Granted(int(epoch), str(owner), str(holder), float(ttl), float(remaining)), None
    if status == "lost":
        raise LeaseLost(LossReason.REJECTED, "the lease granted for this request_id has ended")
    if status == "foreign":
        raise ConfigurationError(
            f"this request_id was already used to acquire {holder}, not {request.resource}"
        )
    blocked = Blocked(
        None if holder is None else str(holder),
        int(epoch),
        float(remaining or 0.0),
        None if retry_in is None else float(retry_in),
    )
    return blocked, None if new_ticket is None else int(new_ticket)


def handoff_grant(
    handoff: tuple[int, float],
    request: GrantRequest,
    *,
    ticket_owner: str,
    seen_epoch: int,
    elapsed: float,
) -> Granted | None:
    """The lease a releaser handed to a ticket (``handoff``: epoch and seconds from the ticket's
    last keep-alive to the grant), or None (see :meth:`Face._handed_over`).
    ``elapsed``: seconds since the ticket's last request was sent."""
    epoch, since_keep = handoff
    if epoch <= seen_epoch or request.owner != ticket_owner:
        return None  # stale: a later answer of the server already knew a newer epoch
    left = request.ttl - elapsed + min(since_keep, elapsed)
    if left < request.ttl / 2:
        return None
    return Granted(epoch, request.owner, request.holder, request.ttl, left)


def renew_call(resource: str, epoch: int, owner: str, ttl: float) -> Call:
    """``renew``: durable; gives up after a third of ``ttl`` (at least 0.2 s) so that a hung
    connection makes the lease UNCERTAIN (OutcomeUnknown), not silently HELD."""
    params = (resource, epoch, owner, float(ttl))
    return (f"renewing {resource}", "renew", params, True, max(ttl / 3, 0.2), False)


def renewed(rows: Rows, resource: str, epoch: int) -> float:
    """The answer of ``renew`` (the remaining time); LeaseLost if the lease was not live."""
    remaining = rows[0][0]
    if remaining is None:
        raise LeaseLost(
            LossReason.REJECTED,
            f"the coordinator has no live lease of {resource} at epoch {epoch} for this owner",
        )
    return float(remaining)


def release_call(
    direct: Mapping[str, DirectStatement], resource: str, epoch: int, owner: str
) -> Call:
    """The release (``_FAST_RELEASE``); its answer's first value: True if the lease ended."""
    params = direct["release"].bind(name=resource, epoch=epoch, owner=owner)
    return (f"releasing {resource}", "release", params, True, None, False)


def proclaim_call(resource: str, epoch: int, owner: str, value: str) -> Call:
    params = (resource, epoch, owner, value)
    return (f"proclaiming on {resource}", "proclaim", params, True, None, False)


def proclaimed(rows: Rows, resource: str, epoch: int) -> None:
    """The answer of ``proclaim``: LeaseLost if the lease was not this owner's live one."""
    if not rows[0][0]:
        raise LeaseLost(LossReason.REJECTED, f"{resource} epoch {epoch} is no longer this owner's")


def current_call(resource: str) -> Call:
    return (f"reading {resource}", "current", (resource,), False, None, False)


def lease_info(rows: Rows, resource: str, coordinator_id: str) -> LeaseInfo | None:
    """The answer of ``current``."""
    if not rows or rows[0][0] is None:
        return None
    epoch, holder, remaining, ttl, value = rows[0]
    return LeaseInfo(
        resource,
        int(epoch),
        str(holder),
        float(remaining),
        float(ttl),
        coordinator_id,
        None if value is None else str(value),
    )


def last_epoch_call(resource: str) -> Call:
    """``last_epoch``; its answer's first value is the epoch (None: 0)."""
    return ("reading epochs", "last_epoch", (resource,), False, None, False)


RESOURCES_CALL: Call = ("listing resources", "resources", (), False, None, False)
"""``resources``: one name a row."""


def advance_call(minimum: int, floors: dict[str, int], detail: dict[str, object]) -> Call:
    """``advance`` with its checked parameters; ConfigurationError for a bad epoch or name."""
    for value in (minimum, *floors.values()):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_EPOCH:
            raise ConfigurationError(f"epochs must be integers in 0..{MAX_EPOCH}, got {value!r}")
    for name in floors:
        validate_resource(name)
    params = (minimum, Jsonb({k: str(v) for k, v in floors.items()}), Jsonb(detail, dumps=dumps))
    return ("advancing epochs", "advance", params, True, None, False)


# -- records ----------------------------------------------------------------------------------


def records_call(resource: str | None, after: int, limit: int) -> Call:
    params = (resource, max(int(after), 0), int(limit))
    return ("reading records", "records", params, False, None, False)


def records_of(rows: Rows, resource: str | None, after: int) -> list[Record]:
    """The answer of ``records``: for all resources, up to the first gap in ``seq`` younger
    than :data:`GAP_SETTLE` (see the sync backend's module docstring)."""
    found: list[Record] = []
    expected = max(int(after), 0) + 1
    for seq, at, kind, name, epoch, holder, detail, age in rows:
        if resource is None and seq > expected and age < GAP_SETTLE:
            break  # a younger gap: its transaction may still commit (module docstring)
        found.append(
            Record(
                int(seq),
                float(at),
                RecordKind(kind),
                str(name),
                int(epoch),
                None if holder is None else str(holder),
                dict(detail or {}),
            )
        )
        expected = int(seq) + 1
    return found


def report_call(
    resource: str, epoch: int, holder: str, kind: RecordKind, detail: dict[str, object]
) -> Call:
    params = (resource, epoch, holder, kind.value, Jsonb(detail, dumps=dumps))
    return (f"recording {kind.value} of {resource}", "report", params, True, None, False)


def dumps(value: object) -> str:
    """JSON of a record's ``detail`` (compact; anything unknown as its ``str``)."""
    return json.dumps(value, default=str, separators=(",", ":"))


def watch_start_call(resource: str) -> Call:
    """A watcher's row (its answer's first value is its id)."""
    return (f"watching {resource}", "watch_start", (resource, WATCH_KEEPALIVE), True, None, False)


def watch_poll_call(resource: str, after: int, watcher: int) -> Call:
    """Keep the watcher's row alive and check for a record after ``after``; one row:
    ``(changed, watcher id, seconds left of the live lease or None)``. Idempotent."""
    params = (resource, max(int(after), 0), watcher, WATCH_KEEPALIVE)
    return (f"watching {resource}", "watch_poll", params, True, None, True)


def unwatch_call(resource: str, watcher: int, timeout: float | None = None) -> Call:
    return (f"watching {resource}", "unwatch", (watcher,), True, timeout, False)


def watch_pause(
    changed: object, remaining: float | None, deadline: float, healthy: bool
) -> float | None:
    """Seconds a watcher waits for a notification before it polls again, or None (return: the
    resource ``changed`` or the ``deadline`` passed): at most a third of
    :data:`WATCH_KEEPALIVE` (its row's keep-alive), until the live lease's expiry
    (``remaining``: to detect and record it), :data:`RECHECK` unless the listener is
    ``healthy``."""
    if changed:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        return None
    pause = min(left, WATCH_KEEPALIVE / 3)
    if remaining is not None:
        pause = min(pause, max(float(remaining), 0.0) + 0.001)
    if not healthy:
        pause = min(pause, RECHECK)
    return pause


# -- queueing ---------------------------------------------------------------------------------


def probe_call(channel: str, nonce: str) -> Call:
    """The listener's probe NOTIFY."""
    return ("probing notifications", "probe", (channel, f"probe:{nonce}"), True, None, False)


def enqueue_call(request: GrantRequest, listen_key: int | None) -> Call:
    """A place at the end of the queue (its answer's first value is the waiter id); offers
    ``listen_key`` to releasers. Idempotent."""
    params = (
        request.resource,
        request.holder,
        QUEUE_KEEPALIVE,
        request.owner,
        float(request.ttl),
        request.value,
        listen_key,
    )
    return (f"queueing for {request.resource}", "enqueue", params, True, None, True)


def leave_call(ticket: QueueTicket[Any], take: bool) -> Call:
    """``leave``, or ``leave_taking`` (the lease a releaser handed to the ticket, see
    :func:`taken`). Idempotent."""
    name = "leave_taking" if take else "leave"
    params = (ticket.resource, ticket.waiter_id, ticket.owner)
    return (f"leaving the queue of {ticket.resource}", name, params, True, None, True)


def taken(rows: Rows, owner: str) -> Granted | None:
    """The answer of ``leave_taking``: the lease handed to the leaving ticket, if any."""
    if not rows:
        return None
    epoch, holder, ttl, remaining = rows[0]
    return Granted(int(epoch), owner, str(holder), float(ttl), float(remaining))


_S = TypeVar("_S", bound=Waiting[Any])


class QueueTicket(Generic[_S]):
    """A place in one resource's queue: a ``waiters`` row plus the waiter's subscription.

    Used by one thread or task at a time. It ends when granted or left; ``wait`` on an ended
    ticket returns at once. ``sent_at`` is when the last request that kept the row alive was
    sent (on the deadline clock, ``Clock.now``), ``seen_epoch`` the largest epoch a blocked
    answer reported: a grant handed over by a releaser is newer than that, and came after that
    send.
    """

    __slots__ = (
        "_backend",
        "_sub",
        "ended",
        "owner",
        "resource",
        "seen_epoch",
        "sent_at",
        "waiter_id",
    )

    def __init__(
        self, backend: object, resource: str, waiter_id: int, owner: str, sent_at: float
    ) -> None:
        self._backend = backend
        self.resource = resource
        self.waiter_id = waiter_id
        self.owner = owner
        self.sent_at = sent_at
        self.seen_epoch = 0
        self.ended = False
        self._sub: _S | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.resource!r}, waiter_id={self.waiter_id})"


# -- what both backends do without I/O --------------------------------------------------------

_T = TypeVar("_T", bound=QueueTicket[Any])
_L = TypeVar("_L", bound=Listening[Any])


class Face(Generic[_T, _L]):
    """The state and the I/O-free steps of a PostgreSQL backend, sync or asyncio: tickets, the
    listener, handoffs, the bookkeeping of an acquire attempt's answer.

    A subclass sets :attr:`_ticket_type`, makes its listener (:meth:`_new_listener`) and sends
    the calls (through its ``statements``).
    """

    _ticket_type: type[_T]
    coordinator_id: str

    def __init__(self, statements: Statements[Any], *, listen_enabled: bool) -> None:
        self.url = statements.url
        self.schema = statements.schema
        self.capabilities = CAPABILITIES
        self._direct = statements.direct
        self._channel = statements.channel
        self._listen_enabled = listen_enabled
        self._clock: Clock = SystemClock()  # the deadline clock: counts a suspended host
        self._listener_obj: _L | None = None
        self._listener_lock = threading.Lock()
        self._tickets: set[_T] = set()
        self._tickets_lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError(f"{self!r} is closed")

    # -- the listener -------------------------------------------------------------------------

    def _new_listener(self) -> _L:
        raise NotImplementedError

    def _listener(self) -> _L:
        """This process's listener (made, not started, on first use)."""
        with self._listener_lock:
            listener = self._listener_obj
            if listener is None or listener.inherited:
                listener = self._listener_obj = self._new_listener()
            return listener

    def _detach_listener(self) -> _L | None:
        """The listener, no longer this backend's (to be closed)."""
        with self._listener_lock:
            listener, self._listener_obj = self._listener_obj, None
        return listener

    @property
    def listener_state(self) -> str:
        """``idle`` / ``starting`` / ``listening`` / ``unreliable`` / ``down`` / ``off``."""
        listener = self._listener_obj
        return "idle" if listener is None else listener.state

    # -- acquiring ----------------------------------------------------------------------------

    def _attempt(
        self, request: GrantRequest, ticket: Ticket | None
    ) -> tuple[_T | None, Granted | Call]:
        """The caller's ticket (None: none) and either the lease a releaser handed to it
        (:class:`Granted`, no round trip) or the :class:`Call` of the attempt."""
        mine = self._own_ticket(ticket, request.resource)
        if mine is not None and (handed := self._handed_over(mine, request)) is not None:
            return mine, handed
        waiter_id = None if mine is None else mine.waiter_id
        return mine, grant_call(self._direct, request, waiter_id, self._handoff_key)

    def _answered(
        self, request: GrantRequest, mine: _T | None, sent: float, rows: Rows
    ) -> Granted | Blocked:
        """The answer of an acquire attempt sent at ``sent``: a grant ends the ticket; a
        blocked ticket remembers the send, the epoch it was told and its new waiter id."""
        answer, new_ticket = grant_answer(request, rows[0])
        if isinstance(answer, Granted):
            if mine is not None:
                self._end_ticket(mine)
            return answer
        if mine is not None:
            mine.sent_at = sent
            mine.seen_epoch = max(mine.seen_epoch, answer.epoch)
            if new_ticket is not None and new_ticket != mine.waiter_id:
                mine.waiter_id = new_ticket
                if mine._sub is not None:
                    self._listener().update(mine._sub, mine.waiter_id)
        return answer

    def _handed_over(self, mine: _T, request: GrantRequest) -> Granted | None:
        """The grant a releaser handed to ``mine`` (announced by NOTIFY), or None.

        The grant was made after the server answered the ticket's last request (which reported
        only older epochs), ``since_keep`` seconds (server clock) after that request kept the
        row alive; that request was sent at ``mine.sent_at``. So the lease expires no earlier
        than ``sent_at + since_keep + ttl`` here, and ``expires_in`` counts from that. A grant
        that arrives with less than half its ttl left is left to a round trip (which returns
        it with its exact expiry if it still lives).
        """
        sub = mine._sub
        handoff = None if sub is None else sub.handoff
        if sub is None or handoff is None:
            return None
        sub.handoff = None
        granted = handoff_grant(
            handoff,
            request,
            ticket_owner=mine.owner,
            seen_epoch=mine.seen_epoch,
            elapsed=self._clock.now() - mine.sent_at,
        )
        if granted is not None:
            self._end_ticket(mine)
        return granted

    def _handoff_key(self, request: GrantRequest) -> int | None:
        """The listen key a queued ``request`` offers to releasers (None: wake it instead).

        Requests with a ``request_id`` grant themselves: their id must be recorded with the
        grant, which a releaser does not do.
        """
        if request.request_id is not None:
            return None
        return self._listener().handoff_key

    # -- tickets ------------------------------------------------------------------------------

    def _queued(self, request: GrantRequest, rows: Rows, sent: float, listener: _L) -> _T:
        """The ticket of ``enqueue``'s answer, subscribed to ``listener``."""
        ticket = self._ticket_type(self, request.resource, int(rows[0][0]), request.owner, sent)
        ticket._sub = listener.subscribe(request.resource, ticket.waiter_id)
        with self._tickets_lock:
            self._tickets.add(ticket)
        return ticket

    def _waiting(self, ticket: Ticket, timeout: float) -> tuple[Any, float]:
        """What ``wait`` waits on: the ticket's subscription (None for an ended ticket: return
        at once) and for how long (at most :data:`RECHECK` while the listener is not proven)."""
        mine = self._own_ticket(ticket, ticket.resource)
        assert mine is not None
        if mine.ended or mine._sub is None:
            return None, 0.0
        if not self._listener().healthy:
            timeout = min(timeout, RECHECK)
        return mine._sub, timeout

    def _leaving(self, ticket: Ticket) -> _T | None:
        """The ticket ``leave`` sends for (None: it has ended, nothing to do)."""
        mine = self._own_ticket(ticket, ticket.resource)
        assert mine is not None
        return None if mine.ended else mine

    @contextlib.contextmanager
    def _left(self, mine: _T) -> Iterator[None]:
        """Around ``leave``'s statement: the ticket ends whatever happens; Unavailable and
        OutcomeUnknown are only logged (best effort: a row left behind lapses after
        :data:`QUEUE_KEEPALIVE`, a lease handed to it expires)."""
        try:
            yield
        except (Unavailable, OutcomeUnknown) as error:
            log.debug("leaving the queue of %s: %s", mine.resource, error)
        finally:
            self._end_ticket(mine)

    def _own_ticket(self, ticket: Ticket | None, resource: str) -> _T | None:
        return owned_ticket(self, ticket, resource, self._ticket_type)

    def _end_ticket(self, ticket: _T) -> None:
        ticket.ended = True
        sub = ticket._sub
        if sub is not None:
            listener = self._listener_obj
            if listener is not None:
                listener.unsubscribe(sub)
            sub.event.set()
        with self._tickets_lock:
            self._tickets.discard(ticket)

    def _open_tickets(self) -> list[_T]:
        with self._tickets_lock:
            return list(self._tickets)
