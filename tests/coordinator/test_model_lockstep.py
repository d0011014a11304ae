"""One model, every backend in lockstep: the lease rules checked by random operations.

The lease rules are written five times — in Python (the memory backend), SQL (SQLite), PL/pgSQL
(PostgreSQL), etcd transaction compares and ZooKeeper transactions. The memory backend is the
executable model (:mod:`fenced.coordinator.backends.memory._backend`). Each test here drives the
model and one real backend (SQLite embedded; PostgreSQL, a 3-member etcd cluster and a 3-member
ZooKeeper ensemble started by the test session) with the same random operations at the backend
contract (:mod:`fenced.coordinator.backend`): acquire with and without a ``request_id`` (fresh,
replayed, replayed for another resource), renew, release and proclaim by the owner, by a wrong
owner and with a stale or a later epoch, ``current``, ``last_epoch``, ``resources``, ``records``
(with ``after`` and ``limit``), ``advance`` (the minimum epoch and per-resource floors of a
restore), and clock steps. Every answer is compared (return values and exception classes), and so
is every record.

Time. SQLite takes an injected host clock: one :class:`ManualClock` drives the model and the
backend, so every expiry is decided at the same instant (also exactly at the boundary, and across a
"reboot"), and remaining times are compared exactly. PostgreSQL, etcd and ZooKeeper decide expiry
by server time, so the model's clock follows real time, and the test never asks a question whose
answer real time could make ambiguous: each live lease has a window from the earliest instant the
backend may end it (the send time of its grant or renewal plus the remaining time the backend
reported) to the latest (PostgreSQL and ZooKeeper: the reply time plus the ttl; etcd: the lease is
seen gone, etcd rounding the ttl up to whole seconds and expiring leases on a 500 ms tick), and the
model's expiry lies inside it. An operation that depends on a lease and would start within
:data:`BUDGET` of its window first waits — real time passes, a "clock step" — until both sides have
ended it. An operation that overran its budget into a window cannot be judged: if (only if) its
answers then differ, the example is discarded (``reject``), not failed.

Left out, and why: waiting (``enqueue``/``wait``/``leave``), because PostgreSQL, SQLite and etcd
hand a released lease to the head waiter inside the release while the model leaves it to the
waiter's next ``try_grant`` (the Coordinator hides that difference; the conformance suites test
waiting on every backend); ``report`` (holder diagnostics, best effort: their order relative to
an expiry nobody has noticed yet is not specified); ``renew`` with a ttl other than the lease's
own (the Coordinator never sends one; etcd cannot honour it: an etcd lease keeps its TTL).
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pytest
from hypothesis import Phase, reject, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fenced.coordinator._connect import open_backend
from fenced.coordinator.backend import Blocked, CoordinatorBackend, Granted, GrantRequest
from fenced.coordinator.backends.etcd._backend import EtcdBackend
from fenced.coordinator.backends.memory._backend import MemoryBackend
from fenced.coordinator.backends.sqlite._backend import SQLiteBackend
from fenced.core._clock import ManualClock, SystemClock
from fenced.core._errors import (
    ConfigurationError,
    FencedError,
    LeaseLost,
    OutcomeUnknown,
    Unavailable,
)
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind
from fenced.testing.etcd import EtcdCluster
from fenced.testing.postgres import PostgresServer
from fenced.testing.zookeeper import ZooKeeperEnsemble

RESOURCES = ("jobs/a", "jobs/b")
FLOORED = "jobs/floored"  # only ever given a floor by advance (until someone acquires it)
NAMES = (*RESOURCES, FLOORED)
HOLDERS = st.sampled_from(("h1", "h2"))
CLIENTS = st.integers(0, 1)  # two clients (backend instances) of one coordinator state
RECENT = st.sampled_from((0, 0, 1, 2, 5))  # which grant: 0 is the latest, 5 an old one
TTLS = (0.5, 1.0)
BUDGET = 0.2
"""Seconds an operation on a networked backend is allowed before it may meet an expiry."""
_EPS = 1e-9

# Outcomes that must each have come up in some example, or the test proves little. Under the
# manual clock every run is the same, so all of them are required; under real time the outcome
# of a call may change from run to run (was the lease still live?), so only the frequent ones.
MUST_SEE = (
    "granted",
    "blocked",
    "replayed",
    "replay-ended",
    "replay-elsewhere",
    "renewed",
    "renew-rejected",
    "released",
    "release-refused",
    "proclaimed",
    "proclaim-rejected",
    "advanced",
    "expired",
)
MUST_SEE_IN_REAL_TIME = ("granted", "blocked", "renewed", "advanced", "expired")


# -- time -----------------------------------------------------------------------------------------


@dataclass
class Span:
    """When one operation ran (seconds on the deadline clock, ``SystemClock.now``) and whether it
    overran into an expiry."""

    began: float = 0.0
    ended: float = 0.0
    ambiguous: bool = False


class Time(Protocol):
    """How time passes for the model and the backend under test."""

    exact: bool

    def begin(self, scope: Iterable[str] | None) -> Span:
        """Before an operation on ``scope`` (None: every resource)."""
        ...

    def end(self, span: Span, scope: Iterable[str] | None) -> None:
        """After it."""
        ...

    def live(self, resource: str, epoch: int, ttl: float, span: Span, reported: float) -> None:
        """Both granted or renewed this lease in ``span``; the backend said ``reported`` left."""
        ...

    def gone(self, resource: str | None) -> None:
        """Both ended the lease of ``resource`` (None: every lease)."""
        ...

    def settle(self) -> None:
        """Let real time pass until every live lease has expired on both sides."""
        ...


class ExactTime:
    """One ManualClock is the host clock of both the model and the backend."""

    exact = True

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock

    def begin(self, scope: Iterable[str] | None) -> Span:
        return Span()

    def end(self, span: Span, scope: Iterable[str] | None) -> None:
        pass

    def live(self, resource: str, epoch: int, ttl: float, span: Span, reported: float) -> None:
        pass

    def gone(self, resource: str | None) -> None:
        pass

    def settle(self) -> None:
        self.clock.advance(max(TTLS))


@dataclass
class _Window:
    """Where the expiry of one live lease may fall (seconds on the deadline clock)."""

    epoch: int
    earliest: float  # the backend ends it no earlier
    model: float  # the model ends it exactly then
    latest: float  # the backend has ended it by then (etcd: a deadline to see it gone)


class RealTime:
    """The model's clock follows real time; operations keep out of the expiry windows."""

    exact = False

    def __init__(
        self,
        model_clock: ManualClock,
        overrun: Callable[[float], float],
        gone: Callable[[str, int], bool] | None,
    ) -> None:
        self._clock = model_clock
        self._real = SystemClock().now  # counts a suspended host, as the servers' clocks do
        self._start = self._real()
        self._base = model_clock.now()
        self._overrun = overrun
        self._gone = gone
        self._windows: dict[str, _Window] = {}

    def _relevant(self, scope: Iterable[str] | None) -> list[tuple[str, _Window]]:
        names = None if scope is None else set(scope)
        return [(n, w) for n, w in self._windows.items() if names is None or n in names]

    def begin(self, scope: Iterable[str] | None) -> Span:
        for name, window in self._relevant(scope):
            if self._real() + BUDGET >= window.earliest:
                self._wait_out(name, window)
        now = self._real()
        self._clock.advance(max(0.0, self._base + (now - self._start) - self._clock.now()))
        return Span(began=now)

    def end(self, span: Span, scope: Iterable[str] | None) -> None:
        span.ended = self._real()
        span.ambiguous = any(w.earliest <= span.ended for _, w in self._relevant(scope))

    def live(self, resource: str, epoch: int, ttl: float, span: Span, reported: float) -> None:
        self._windows[resource] = _Window(
            epoch,
            earliest=span.began + min(ttl, reported),
            model=span.began + ttl,
            latest=span.ended + ttl + self._overrun(ttl) + 0.02,
        )

    def gone(self, resource: str | None) -> None:
        if resource is None:
            self._windows.clear()
        else:
            self._windows.pop(resource, None)

    def settle(self) -> None:
        for name, window in list(self._windows.items()):
            self._wait_out(name, window)

    def _wait_out(self, name: str, window: _Window) -> None:
        """Real time passes (a clock step) until the model's expiry and the backend's are past:
        PostgreSQL's by its server clock (the latest instant is exact), etcd's when seen."""
        pause = max(window.model, window.latest if self._gone is None else 0.0) - self._real()
        if pause > 0:
            time.sleep(pause + 0.001)
        if self._gone is not None:
            deadline = window.latest + 5.0
            while not self._gone(name, window.epoch):
                if self._real() > deadline:
                    raise AssertionError(f"{name} epoch {window.epoch} still live 5 s past its ttl")
                time.sleep(0.02)
        del self._windows[name]


# -- answers --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """What one side answered: a value or a fenced error."""

    value: object = None
    error: FencedError | None = None

    def __repr__(self) -> str:
        return repr(self.error) if self.error is not None else repr(self.value)


def _ask(call: Callable[[], object]) -> Answer:
    try:
        return Answer(call())
    except FencedError as error:
        return Answer(error=error)


def _record(record: Record) -> tuple[object, ...]:
    # Left out: ``seq`` (each backend numbers its own way: etcd from revisions, the SQL backends
    # from one sequence, and SQLite writes a release's record at the next read, so the order
    # across resources differs) and ``at`` (wall-clock time for display: an expiry is dated when
    # it happened by SQLite and PostgreSQL, when it was noticed by the model and etcd).
    return (record.kind, record.resource, record.epoch, record.holder, dict(record.detail))


def _increasing(records: list[Record]) -> bool:
    return all(a.seq < b.seq for a, b in itertools.pairwise(records))


def _shape(answer: Answer) -> object:
    """The part of an answer every backend gives exactly as the model does.

    Left out: remaining times (checked by :func:`_times`), ``Blocked.retry_in`` beyond whether
    there is one (a hint: SQL backends add a millisecond to try just after the expiry), the
    coordinator id (each backend's own, checked against it).
    """
    if answer.error is not None:
        return (type(answer.error), getattr(answer.error, "reason", None))
    value = answer.value
    if isinstance(value, Granted):
        return ("granted", value.epoch, value.owner, value.holder, value.ttl)
    if isinstance(value, Blocked):
        return ("blocked", value.holder, value.epoch, value.retry_in is None)
    if isinstance(value, LeaseInfo):
        return ("lease", value.resource, value.epoch, value.holder, value.ttl, value.value)
    if isinstance(value, list) and all(isinstance(r, Record) for r in value):
        return [_record(r) for r in value]
    if isinstance(value, dict):
        return {name: [_record(r) for r in records] for name, records in value.items()}
    if isinstance(value, float):
        return "a remaining time"  # renew's answer
    return value


def _times(answer: Answer, ttl: float) -> list[tuple[float, float]]:
    """The remaining times in an answer, each with its upper bound (a lease's ttl; a renewal's
    answer is capped at the ttl first, as the Coordinator does: etcd answers its whole-second
    TTL)."""
    value = answer.value
    if isinstance(value, Granted | LeaseInfo):
        return [(value.expires_in, value.ttl)]
    if isinstance(value, Blocked):
        return [(value.remaining, max(TTLS))]
    if isinstance(value, float):
        return [(min(value, ttl), ttl)]
    return []


# -- the machine ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grant:
    """A lease both sides granted (with the owner secret the test chose)."""

    resource: str
    epoch: int
    owner: str = field(repr=False)
    ttl: float
    request_id: str | None


@dataclass
class Sides:
    """The model and the backend under test (two clients of one state), fresh per example."""

    model: MemoryBackend
    clients: list[CoordinatorBackend]
    time: Time
    close: Callable[[], None]


class Lockstep(RuleBasedStateMachine):
    """Drives the model and a backend with the same operations; every answer must agree."""

    def __init__(self, make: Callable[[], Sides], seen: Counter[str]) -> None:
        super().__init__()
        sides = make()
        self.model = sides.model
        self.clients = sides.clients
        self.time = sides.time
        self._close = sides.close
        self._seen = seen
        self._owners = itertools.count(1)
        self._grants: list[Grant] = []  # every lease both sides granted, oldest first
        self._calls = 0  # operations so far
        self._last: dict[str, int] = {}  # when each step that ends every lease last came

    def _rare(self, step: str) -> bool:
        """Whether ``step``, which ends every lease, may come now: not twice within 8 calls
        (more often would leave few live leases to renew, release and replay)."""
        return self._calls - self._last.get(step, -8) >= 8

    def _came(self, step: str) -> None:
        self._last[step] = self._calls

    def teardown(self) -> None:
        self._close()

    # -- plumbing ---------------------------------------------------------------------------
    def _both(
        self,
        what: str,
        scope: Iterable[str] | None,
        model: Callable[[], object],
        real: Callable[[], object],
        ttl: float = max(TTLS),
    ) -> tuple[Answer, Answer, Span]:
        """Ask the backend, then the model (its clock stands at the start of the call); check
        that they agree."""
        self._calls += 1
        span = self.time.begin(scope)
        theirs = _ask(real)
        self.time.end(span, scope)
        if isinstance(theirs.error, Unavailable | OutcomeUnknown):
            # The backend could not answer (e.g. a renewal's timeout on a loaded machine): the
            # state is not known any more, and nothing can be compared. Counted: see _run.
            self._seen["undecided"] += 1
            reject()
        ours = _ask(model)
        problem = self._disagreement(ours, theirs, ttl)
        if problem:
            if span.ambiguous:
                self._seen["undecided"] += 1
                reject()  # the call overran into an expiry: real time decided, not the rules
            raise AssertionError(
                f"{what}: {problem}\n  the model: {ours!r}\n  the backend: {theirs!r}"
                f"\n  compared: {_shape(ours)!r}\n       and: {_shape(theirs)!r}"
            )
        return ours, theirs, span

    def _disagreement(self, ours: Answer, theirs: Answer, ttl: float) -> str:
        if _shape(ours) != _shape(theirs):
            return "different answers"
        if isinstance(theirs.value, LeaseInfo):
            backend = self.clients[0]
            if theirs.value.coordinator_id != backend.coordinator_id:
                return "a coordinator id that is not the backend's"
        mine, real = _times(ours, ttl), _times(theirs, ttl)
        if self.time.exact:
            if any(abs(a - b) > _EPS for (a, _), (b, _) in zip(mine, real, strict=True)):
                return "different remaining times on the same clock"
        elif not all(0.0 <= t <= bound + _EPS for t, bound in real):
            return "a remaining time below 0 or above the ttl"
        retry_in = theirs.value.retry_in if isinstance(theirs.value, Blocked) else None
        if retry_in is not None and retry_in < 0:
            return "a negative retry_in"
        return ""

    # -- leases -----------------------------------------------------------------------------
    def _acquire(
        self,
        resource: str,
        holder: str,
        ttl: float,
        request_id: str | None,
        value: str | None,
        client: int,
    ) -> None:
        owner = f"{next(self._owners):032x}"  # fresh per acquire, as the Coordinator's
        request = GrantRequest(resource, ttl, owner, holder, request_id, value)
        # A request_id may name a grant of any resource: such a call depends on every lease.
        scope = None if request_id is not None else (resource,)
        _, theirs, span = self._both(
            f"try_grant({request})",
            scope,
            lambda: self.model.try_grant(request, None),
            lambda: self.clients[client].try_grant(request, None),
            ttl,
        )
        granted = theirs.value
        if isinstance(theirs.error, LeaseLost):
            self._seen["replay-ended"] += 1
        elif theirs.error is not None:
            self._seen["replay-elsewhere"] += 1
        elif isinstance(granted, Blocked):
            self._seen["blocked"] += 1
        elif isinstance(granted, Granted) and granted.owner != owner:
            self._seen["replayed"] += 1
        elif isinstance(granted, Granted):
            self._seen["granted"] += 1
            self.time.live(resource, granted.epoch, ttl, span, granted.expires_in)
            self._grants.append(Grant(resource, granted.epoch, owner, ttl, request_id))

    @rule(
        resource=st.sampled_from(RESOURCES),
        holder=HOLDERS,
        ttl=st.sampled_from(TTLS),
        value=st.one_of(st.none(), st.just("10.0.0.7:80")),
        client=CLIENTS,
    )
    def acquire(
        self, resource: str, holder: str, ttl: float, value: str | None, client: int
    ) -> None:
        self._acquire(resource, holder, ttl, None, value, client)

    @rule(
        resource=st.sampled_from(NAMES),
        holder=HOLDERS,
        ttl=st.sampled_from(TTLS),
        request_id=st.sampled_from(("rid-1", "rid-2", "rid-3")),
        client=CLIENTS,
    )
    def acquire_with_request_id(
        self, resource: str, holder: str, ttl: float, request_id: str, client: int
    ) -> None:
        """A fresh request_id, or one used before (for this resource or another)."""
        self._acquire(resource, holder, ttl, request_id, None, client)

    def _grant(self, recent: int) -> Grant:
        """The ``recent``-th latest grant (0: the latest; the latest ones are more often live)."""
        return self._grants[max(-len(self._grants), -1 - recent)]

    @precondition(lambda self: self._grants)
    @rule(recent=RECENT, holder=HOLDERS, client=CLIENTS)
    def retry(self, recent: int, holder: str, client: int) -> None:
        """A grant's request sent again, as after a lost reply: with its request_id, or with
        ``rid-none`` for a grant made without one (an id that such retries share)."""
        grant = self._grant(recent)
        request_id = grant.request_id or "rid-none"
        self._acquire(grant.resource, holder, grant.ttl, request_id, None, client)

    @staticmethod
    def _as(grant: Grant, variant: str) -> tuple[int, str]:
        """The epoch and owner a call presents: the grant's own, or a forged or stale one."""
        if variant == "wrong-owner":
            return grant.epoch, "f" * 32
        if variant == "older-epoch":
            return grant.epoch - 1, grant.owner
        if variant == "newer-epoch":
            return grant.epoch + 1, grant.owner
        return grant.epoch, grant.owner

    VARIANTS = st.sampled_from(("own",) * 4 + ("wrong-owner", "older-epoch", "newer-epoch"))

    def _as_holder(
        self,
        op: str,
        recent: int,
        variant: str,
        client: int,
        call: Callable[[CoordinatorBackend, Grant, int, str], object],
        *others: object,
    ) -> tuple[Grant, int, Answer, Span]:
        """``call(side, grant, epoch, owner)`` on both sides (:meth:`_both`) for the
        ``recent``-th latest grant, with its own epoch and owner or a forged or stale pair
        (``variant``); ``op`` and ``others`` (the call's other arguments) name it in a failure.
        Returns the grant, the epoch presented, the backend's answer and the call's span."""
        grant = self._grant(recent)
        epoch, owner = self._as(grant, variant)
        shown = ", ".join([grant.resource, str(epoch), variant, *map(repr, others)])
        _, theirs, span = self._both(
            f"{op}({shown})",
            (grant.resource,),
            lambda: call(self.model, grant, epoch, owner),
            lambda: call(self.clients[client], grant, epoch, owner),
            grant.ttl,  # the bound of a renewal's answer (the other answers hold no time)
        )
        return grant, epoch, theirs, span

    @precondition(lambda self: self._grants)
    @rule(recent=RECENT, variant=VARIANTS, client=CLIENTS)
    def renew(self, recent: int, variant: str, client: int) -> None:
        grant, epoch, theirs, span = self._as_holder(
            "renew",
            recent,
            variant,
            client,
            lambda side, grant, epoch, owner: side.renew(grant.resource, epoch, owner, grant.ttl),
        )
        if isinstance(theirs.value, float):
            self._seen["renewed"] += 1
            self.time.live(grant.resource, epoch, grant.ttl, span, theirs.value)
        else:
            self._seen["renew-rejected"] += 1

    @precondition(lambda self: self._grants)
    @rule(recent=RECENT, variant=VARIANTS, client=CLIENTS)
    def release(self, recent: int, variant: str, client: int) -> None:
        grant, _, theirs, _ = self._as_holder(
            "release",
            recent,
            variant,
            client,
            lambda side, grant, epoch, owner: side.release(grant.resource, epoch, owner),
        )
        if theirs.value is True:
            self._seen["released"] += 1
            self.time.gone(grant.resource)
        else:
            self._seen["release-refused"] += 1

    @precondition(lambda self: self._grants)
    @rule(
        recent=RECENT,
        variant=VARIANTS,
        value=st.sampled_from(("10.0.0.8:80", "10.0.0.9:80")),
        client=CLIENTS,
    )
    def proclaim(self, recent: int, variant: str, value: str, client: int) -> None:
        _, _, theirs, _ = self._as_holder(
            "proclaim",
            recent,
            variant,
            client,
            lambda side, grant, epoch, owner: side.proclaim(grant.resource, epoch, owner, value),
            value,
        )
        self._seen["proclaimed" if theirs.error is None else "proclaim-rejected"] += 1

    @rule(resource=st.sampled_from(NAMES), client=CLIENTS)
    def current(self, resource: str, client: int) -> None:
        self._both(
            f"current({resource})",
            (resource,),
            lambda: self.model.current(resource),
            lambda: self.clients[client].current(resource),
        )

    @rule(
        resource=st.one_of(st.none(), st.sampled_from(NAMES)),
        skip=st.integers(0, 6),
        limit=st.sampled_from((1, 2, 1000)),
        client=CLIENTS,
    )
    def records(self, resource: str | None, skip: int, limit: int, client: int) -> None:
        """Records of one resource from the ``skip``-th on (``after`` = that record's own seq on
        each side), at most ``limit``; or every record, compared resource by resource."""

        def read(backend: CoordinatorBackend) -> object:
            everything = backend.records(resource)
            assert _increasing(everything), everything
            if resource is None:
                return {n: [r for r in everything if r.resource == n] for n in NAMES}
            taken = min(skip, len(everything))
            after = everything[taken - 1].seq if taken else 0
            tail = backend.records(resource, after, limit)
            assert _increasing(tail), tail
            return {"all": everything, "after": tail}

        ours, _, _ = self._both(
            f"records({resource}, skip={skip}, limit={limit})",
            None if resource is None else (resource,),
            lambda: read(self.model),
            lambda: read(self.clients[client]),
        )
        assert isinstance(ours.value, dict)
        found = [r for records in ours.value.values() for r in records]
        if any(r.kind is RecordKind.EXPIRED for r in found):
            self._seen["expired"] += 1

    @precondition(lambda self: self._rare("advance"))
    @rule(
        minimum=st.sampled_from((0, 4, 20)),
        floors=st.dictionaries(st.sampled_from(NAMES), st.integers(1, 30), max_size=2),
        downtime=st.booleans(),
        client=CLIENTS,
    )
    def advance(self, minimum: int, floors: dict[str, int], downtime: bool, client: int) -> None:
        """A restore's step: raise the minimum epoch and floors, end every lease. With
        ``downtime``, every lease expired before (nobody saw it: as after an outage)."""
        if downtime:
            self.time.settle()
        detail: dict[str, object] = {"why": "lockstep"}
        self._both(
            f"advance({minimum}, {floors})",
            None,
            lambda: self.model.advance(minimum, floors, detail),
            lambda: self.clients[client].advance(minimum, floors, detail),
        )
        self._seen["advanced"] += 1
        self.time.gone(None)
        self._came("advance")

    @invariant()
    def epochs_agree(self) -> None:
        """``last_epoch`` of every resource and ``resources()``: they never depend on time."""
        backend = self.clients[0]
        for name in NAMES:
            assert backend.last_epoch(name) == self.model.last_epoch(name), name
        assert backend.resources() == self.model.resources()

    # -- clock steps ------------------------------------------------------------------------
    @precondition(lambda self: self.time.exact)
    @rule(seconds=st.sampled_from((0.25, 0.5, 1.0)))
    def step(self, seconds: float) -> None:
        """The shared manual clock moves (to an expiry instant exactly, often)."""
        assert isinstance(self.time, ExactTime)
        self.time.clock.advance(seconds)

    @precondition(lambda self: self.time.exact and self._rare("reboot"))
    @rule()
    def reboot(self) -> None:
        """The host "reboots": the boot id changes, so every lease has ended."""
        assert isinstance(self.time, ExactTime)
        self.time.clock.reboot()
        self._came("reboot")

    @precondition(lambda self: not self.time.exact)
    @rule(seconds=st.sampled_from((0.05, 0.2)))
    def pause(self, seconds: float) -> None:
        """Real time passes (well inside a ttl, but it adds up)."""
        time.sleep(seconds)

    @precondition(lambda self: self._rare("expire"))
    @rule()
    def expire_everything(self) -> None:
        """Time passes until every live lease has expired on both sides."""
        self.time.settle()
        self._came("expire")


# -- the sides, per backend -----------------------------------------------------------------------


def _model(clock: ManualClock) -> tuple[MemoryBackend, str]:
    name = uuid.uuid4().hex
    return MemoryBackend(name, host_clock=clock), name


def _closer(model_name: str, clients: list[CoordinatorBackend]) -> Callable[[], None]:
    def close() -> None:
        for client in clients:
            client.close()
        MemoryBackend.forget(model_name)

    return close


def _run(
    make: Callable[[], Sides], examples: int, steps: int, *, shrink: bool, must: Iterable[str]
) -> None:
    """Run ``examples`` random programs of up to ``steps`` steps, each on fresh state. Without
    ``shrink``, a failure is reported as found (a networked backend's steps take real time)."""
    seen: Counter[str] = Counter()
    phases = (Phase.explicit, Phase.generate, *((Phase.shrink,) if shrink else ()))

    class OnTheseSides(Lockstep):
        def __init__(self) -> None:
            super().__init__(make, seen)

    run_state_machine_as_test(
        OnTheseSides,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,  # steps wait for real expiries
            derandomize=True,  # the same examples in every run (CI is reproducible)
            database=None,
            phases=phases,
        ),
    )
    assert seen["undecided"] <= examples // 5, f"too many calls could not be judged: {dict(seen)}"
    missing = [kind for kind in must if not seen[kind]]
    assert not missing, f"the examples never exercised {missing} (seen: {dict(seen)})"


@pytest.fixture
def sqlite_sides(tmp_path: Path) -> Iterator[Callable[[], Sides]]:
    numbers = itertools.count()

    def make() -> Sides:
        clock = ManualClock()
        path = tmp_path / f"lockstep-{next(numbers)}.db"
        clients: list[CoordinatorBackend] = [
            SQLiteBackend(path, host_clock=clock),
            SQLiteBackend(path, host_clock=clock),
        ]
        model, name = _model(clock)
        return Sides(model, clients, ExactTime(clock), _closer(name, clients))

    yield make


def test_sqlite_answers_like_the_model(sqlite_sides: Callable[[], Sides]) -> None:
    _run(sqlite_sides, examples=100, steps=40, shrink=True, must=MUST_SEE)


def test_postgres_answers_like_the_model(postgres_server: PostgresServer) -> None:
    def make() -> Sides:
        url = postgres_server.url("postgres", schema="lockstep_" + uuid.uuid4().hex[:10])
        clients = [open_backend(url), open_backend(url)]
        model_clock = ManualClock()
        model, name = _model(model_clock)
        # The server's clock decides: a lease ends between send time + ttl and reply time + ttl.
        timing = RealTime(model_clock, overrun=lambda ttl: 0.0, gone=None)
        return Sides(model, clients, timing, _closer(name, clients))

    _run(make, examples=25, steps=30, shrink=False, must=MUST_SEE_IN_REAL_TIME)


def test_etcd_answers_like_the_model(etcd_cluster: EtcdCluster) -> None:
    overruns: dict[float, float] = {}

    def make() -> Sides:
        url = etcd_cluster.url(prefix="/lockstep" + uuid.uuid4().hex[:10], timeout=2)
        first, second = EtcdBackend(url), EtcdBackend(url)
        clients: list[CoordinatorBackend] = [first, second]
        model_clock = ManualClock()
        model, name = _model(model_clock)

        def overrun(ttl: float) -> float:
            if ttl not in overruns:
                overruns[ttl] = first.lease_overrun(ttl)
            return overruns[ttl]

        def gone(resource: str, epoch: int) -> bool:
            info = first.current(resource)  # a read: it records nothing
            return info is None or info.epoch != epoch

        timing = RealTime(model_clock, overrun=overrun, gone=gone)
        return Sides(model, clients, timing, _closer(name, clients))

    _run(make, examples=18, steps=30, shrink=False, must=MUST_SEE_IN_REAL_TIME)


def test_zookeeper_answers_like_the_model(zk_ensemble: ZooKeeperEnsemble) -> None:
    def make() -> Sides:
        # a session longer than every ttl drawn: the lease is the ttl's, as in the model
        url = zk_ensemble.url("/lockstep" + uuid.uuid4().hex[:10], session_timeout=30, timeout=2)
        clients = [open_backend(url), open_backend(url)]
        model_clock = ManualClock()
        model, name = _model(model_clock)
        # The leader's clock decides: a lease ends at the mtime of its grant or renewal + ttl,
        # between send time + ttl and reply time + ttl.
        timing = RealTime(model_clock, overrun=lambda ttl: 0.0, gone=None)
        return Sides(model, clients, timing, _closer(name, clients))

    _run(make, examples=18, steps=30, shrink=False, must=MUST_SEE_IN_REAL_TIME)


# -- what the lockstep runs found ------------------------------------------------------------------


@pytest.fixture(params=["memory", "sqlite", "postgres", "etcd", "zookeeper"])
def any_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CoordinatorBackend]:
    kind = request.param
    if kind == "memory":
        name = uuid.uuid4().hex
        yield MemoryBackend(name)
        MemoryBackend.forget(name)
        return
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path}/fenced.db"
    elif kind == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        url = server.url("postgres", schema="lockstep_" + uuid.uuid4().hex[:10])
    elif kind == "zookeeper":
        ensemble: ZooKeeperEnsemble = request.getfixturevalue("zk_ensemble")
        url = ensemble.url("/lockstep" + uuid.uuid4().hex[:10])
    else:
        cluster: EtcdCluster = request.getfixturevalue("etcd_cluster")
        url = cluster.url(prefix="/lockstep" + uuid.uuid4().hex[:10], timeout=2)
    backend = open_backend(url)
    yield backend
    backend.close()


def test_a_request_id_replayed_for_another_resource_grants_nothing(
    any_backend: CoordinatorBackend,
) -> None:
    """The memory backend and etcd answered such a retry with the grant of the first resource:
    a token of the second resource at an epoch nobody was granted (a forged token)."""
    first = GrantRequest("jobs/a", 5.0, "1" * 32, "h1", "rid-1")
    granted = any_backend.try_grant(first, None)
    assert isinstance(granted, Granted) and granted.epoch == 1
    elsewhere = GrantRequest("jobs/b", 5.0, "2" * 32, "h2", "rid-1")
    with pytest.raises(ConfigurationError, match="jobs/a, not jobs/b"):
        any_backend.try_grant(elsewhere, None)
    assert any_backend.current("jobs/b") is None
    assert any_backend.last_epoch("jobs/b") == 0
    again = any_backend.try_grant(GrantRequest("jobs/a", 5.0, "3" * 32, "h1", "rid-1"), None)
    assert isinstance(again, Granted) and (again.epoch, again.owner) == (1, "1" * 32)
