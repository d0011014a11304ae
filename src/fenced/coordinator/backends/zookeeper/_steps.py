"""The requests a ZooKeeper plan sends, and the state both faces share. Pure (no I/O).

A plan (:mod:`._plans`) is a generator: it yields one request — a read (:class:`Get`,
:class:`Children`), a pipelined :class:`Batch` of reads, a :class:`Multi` (one ZooKeeper
transaction), or a :class:`Tick` (a write whose only purpose is the leader's clock) — and
receives the answer. The sync backend answers with blocking kazoo calls, the asyncio backend
with kazoo's asynchronous results awaited on the event loop: the decisions are written once.

Answers: a read answers ``(data, stat)`` / ``(children, stat)``, or the
:class:`~kazoo.exceptions.NoNodeError` *instance* when the node does not exist; a :class:`Multi`
answers kazoo's list of per-operation results (an exception instance in place of the result of
a failed operation, :class:`~kazoo.exceptions.RolledBackError` for the others); a
:class:`Tick` answers the leader's clock in milliseconds. Whatever else goes wrong is raised by
the driver, translated — :class:`~fenced.Unavailable` when nothing was sent that can change
state (reads, ticks, a request refused before sending), :class:`~fenced.OutcomeUnknown` when a
transaction may have been applied — and thrown into the plan at its ``yield``, so a plan may
note what a failure leaves behind before it lets the error out.

:class:`SharedState` holds what a backend remembers between requests — the coordinator-wide
minimum, each resource's counter and queue versions, the leases it was granted, and the
estimate of the leader's clock. Every remembered value is only a guess that a transaction
checks (by version), never a decision: a stale guess costs one failed transaction and a
re-read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fenced.coordinator.backends.zookeeper._layout import Counter, LeaseDoc, Paths

__all__ = [
    "Batch",
    "Children",
    "Get",
    "Held",
    "Multi",
    "Op",
    "Plan",
    "Request",
    "SharedState",
    "Sync",
    "Tick",
]


@dataclass(frozen=True, slots=True)
class Get:
    path: str


@dataclass(frozen=True, slots=True)
class Children:
    path: str


@dataclass(frozen=True, slots=True)
class Sync:
    """Bring the member this session reads from up to date with the leader: a read sent after
    it sees every transaction committed before the sync began, whichever client sent it
    (ZooKeeper's reads are otherwise only as fresh as the member the session is on)."""

    path: str


Read = Get | Children | Sync


@dataclass(frozen=True, slots=True)
class Batch:
    """Reads sent together (pipelined), optionally followed by a transaction sent right after
    them (ZooKeeper answers a session's requests in order: the reads see the state before it);
    answered as a list, in order, the transaction's results last."""

    reads: tuple[Read, ...]
    then: Multi | None = None


Op = tuple[Any, ...]
"""``("create", path, data, ephemeral, sequence)``, ``("set", path, data, version)``,
``("delete", path, version)`` or ``("check", path, version)``."""


@dataclass(frozen=True, slots=True)
class Multi:
    ops: tuple[Op, ...]


@dataclass(frozen=True, slots=True)
class Tick:
    """Write the clock znode; answered with its new ``mtime`` (the leader's clock, ms)."""


Request = Get | Children | Sync | Batch | Multi | Tick
T = TypeVar("T")
Plan = Generator[Request, Any, T]


@dataclass
class Held:
    """A lease this backend granted or renewed: what its next renewal or release checks."""

    owner: str
    doc: LeaseDoc
    lease_version: int
    counter_version: int
    mtime: int
    """The lease znode's mtime (ms, the leader's clock)."""

    @property
    def expires_ms(self) -> float:
        return self.doc.expires_ms(self.mtime)


@dataclass
class SharedState:
    """What one backend remembers (see the module docstring). Thread-safe by the GIL: every
    update is one assignment of an immutable value."""

    paths: Paths
    coordinator_id: str = ""
    meta: tuple[int, int] | None = None
    """(minimum, version of the meta znode)."""
    counters: dict[str, tuple[Counter, int]] = field(default_factory=dict)
    queues: dict[str, int] = field(default_factory=dict)
    """Resource → the version of its queue znode when it was last seen empty."""
    held: dict[tuple[str, int], Held] = field(default_factory=dict)
    skew_ms: float = 0.0
    """The leader's clock minus this host's wall clock, from the last write's mtime (ms)."""
    session: int = 0
    """The ZooKeeper session id (places in line of an earlier session ended with it)."""
    prune_due: bool = False
    """Records crossed a multiple of the prune interval: :func:`._plans.prune` should run."""
    lost_places: set[tuple[str, bytes]] = field(default_factory=set)
    """(resource, token) of waiter znodes this backend may have left behind (a leave that
    failed, a place whose creation reply was lost): swept before the next step."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def server_now_ms(self) -> float:
        """The estimate of the leader's clock now (ms)."""
        return time.time() * 1000.0 + self.skew_ms

    def observe(self, mtime: int) -> None:
        """Learn the leader's clock from a write committed just now."""
        self.skew_ms = mtime - time.time() * 1000.0

    def forget(self, resource: str) -> None:
        self.counters.pop(resource, None)
        self.queues.pop(resource, None)
