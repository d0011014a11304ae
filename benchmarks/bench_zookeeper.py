"""fenced's ZooKeeper backend against kazoo's own ``Lock`` recipe, on one 3-member ensemble.

Usage::

    .venv/bin/python benchmarks/bench_zookeeper.py                 # ~100 s
    .venv/bin/python benchmarks/bench_zookeeper.py --rounds 9 --seconds 2
    .venv/bin/python benchmarks/bench_zookeeper.py --only cycles --only handoff
    .venv/bin/python benchmarks/bench_zookeeper.py --member leader  # every client on the leader
    .venv/bin/python benchmarks/bench_zookeeper.py --records 0      # a new coordinator's log

The benchmark starts its own 3-member ensemble (``fenced.testing.zookeeper.ZooKeeperEnsemble(3)``:
Debian's ZooKeeper 3.8 on loopback ports, ``tickTime=200``, data in a temporary directory under
``/tmp``) and stops it by PID at the end. **Durability**: the harness configures every member
with ``forceSync=no`` (the header prints the setting read from ``zoo.cfg``), so a member
acknowledges a proposal once it has *written* it to its transaction log, without ``fsync``: a
commit costs a quorum round (the leader and one follower) and CPU, no disk flush. A production
ensemble runs ZooKeeper's default, ``forceSync=yes``, where every write waits for a flush too.
Both implementations run on the same ensemble, so the ratios compare like with like, but the
absolute figures are those of a non-durable ensemble whose three JVMs share the VM's two cores
with the clients.

Every client (fenced's and kazoo's, in this process and in the workers) connects to the same
member: a follower by default (what two clients in three get from a random host list; a
follower forwards every write to the leader and serves reads itself), or the leader with
``--member leader``. The figures depend on which, so it is fixed and printed.

Implementations, each on paths of its own, each through a ``KazooClient`` of its own (session
timeout 10 s):

- ``fenced``: ``fenced.connect("zk://MEMBER/bench-fenced?session_timeout=10&timeout=5")``,
  ``acquire(R, ttl=30, wait=0)`` / ``release(lease)``: a fencing token (the epoch in the
  resource's counter znode), the lease as an ephemeral znode and a record, written in one
  transaction; the release is a second transaction;
- ``kazoo Lock``: ``client.Lock("/bench-kazoo/R", identifier)`` created **once** and reused for
  every acquire (kazoo's documented pattern: ``lock = zk.Lock(path, id)``, then ``with lock:``):
  an ephemeral sequential znode per acquire, the children read to find its predecessor, a
  delete to release; no token, no record;
- ``kazoo Lock (new)`` (cycles only, no target): a new ``client.Lock`` per acquire (what
  ``with zk.Lock(path, id):`` in a loop does);
- ``floor: 2 transactions`` (cycles only, no target): fenced's two transactions, the same
  operations on the same kinds of znodes with documents of the same size (fenced's encoders),
  sent with plain kazoo and nothing else (no pruning, no client-side bookkeeping): what any
  lease with a fencing token and a record per change written this way costs at least.

A reused kazoo ``Lock`` reads the lock's children before it creates its znode (kazoo sets
``create_tried`` on the first acquire and never clears it, so every later acquire first looks for
a znode of its own left by a lost reply); a new one checks that the path exists instead. Both
send 4 requests per cycle, 2 of them writes.

fenced keeps the last 10,000 records (``RECORDS_KEPT``) and, every 1,000 records, lists its
record log and deletes the oldest 1,000 inside the call whose record crossed the boundary. Before
any section the benchmark fills the log to ``--records`` records (default 10,000: the steady
state of a coordinator in use) of another resource, so that pruning costs what it costs in use.

Sections (each interleaves the implementations round by round, in alternating order, after one
discarded warm-up round, plus 1 s of untimed cycles each before the cycle rounds so that the
members' JIT has seen every implementation's requests; ratios are taken per round, and their
median is reported):

1. **cycles**: uncontended ``acquire`` + ``release`` back to back for ``--seconds`` per round.
   Target: fenced ≥ 1.2 × kazoo's (reused) ``Lock``. A second table counts the requests of
   every cycle (each client's ``KazooClient._call``), per half, and the cycles that sent
   anything else (fenced: the prunes), with the CPU per cycle of the three members
   (``/proc/PID/stat``) and of this process.
2. **handoff**: two worker processes pass the lock back and forth; the waiter announces itself
   and blocks in acquire (fenced: ``acquire(R, ttl=30, wait=10)``; kazoo:
   ``Lock.acquire(timeout=10)``), the holder keeps the lock 40-60 ms more (the waiter is blocked
   and its watch set), records ``time.monotonic()`` just before its ``release()``; the waiter
   records it just after its ``acquire()`` returned. p50/p90/p99 of the difference, ``--handoffs``
   per implementation over all rounds. Target: fenced p50 ≤ 5 ms.
3. **fairness**: ``--processes`` worker processes (8) loop acquire (fenced ``wait=None``, kazoo's
   blocking acquire) / empty critical section / release on one resource for ``--fair-seconds``,
   starting together; only grants inside the window count; ``--fair-rounds`` rounds. Target:
   every fenced process gets ≥ 0.8 × the mean share, in every round.

The workers log every request they send and when its reply arrived; a last table shows, per
blocked acquire of the handoff, the requests sent after the wake-up grouped by round trip, the
time from the first of them to ``acquire()`` returning and how much of it the client spent
between a reply and its next request; and per contended acquisition, the requests of the
acquire and release (writes among them).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import math
import os
import platform
import re
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import kazoo
from _common import fmt_rate, fmt_ratio, fmt_time, median, percentile, print_table, verdict
from _rounds import (
    Cycle,
    FairRound,
    HandoffMessages,
    HandoffRound,
    Results,
    Round,
    WorkerLock,
    Workers,
    cycle_rounds,
    fairness_rounds,
    handoff_rounds,
    print_cycles,
    print_fairness,
    print_handoffs,
    round_options,
    serve,
)
from _rounds import run_round as plain_round
from kazoo.client import KazooClient

import fenced
from fenced.coordinator.backends.zookeeper._layout import (
    Counter,
    LeaseDoc,
    Paths,
    encode_meta,
    encode_record,
)
from fenced.coordinator.backends.zookeeper._plans import RECORDS_KEPT
from fenced.core._records import RecordKind
from fenced.testing.zookeeper import ZooKeeperEnsemble

TTL = 30.0
SESSION = 10.0  # seconds: the session timeout of every client, fenced's and kazoo's
FENCED = "fenced"
KAZOO = "kazoo Lock"
KAZOO_NEW = "kazoo Lock (new)"
FLOOR = "floor: 2 transactions"
R_CYCLE = "bench/cycle"
R_HANDOFF = "bench/handoff"
R_FAIR = "bench/fair"
WRITES = frozenset({"Create", "Create2", "Delete", "SetData", "Transaction", "Reconfig"})
GAP = (0.040, 0.060)  # how long the holder keeps the lock after the waiter announced itself
PREWARM = 1.0  # seconds of untimed cycles per implementation before the cycle rounds
CHROOT = "/bench-fenced"


def fenced_url(endpoint: str) -> str:
    return f"zk://{endpoint}{CHROOT}?session_timeout={SESSION:g}&timeout=5"


def kazoo_client(endpoint: str) -> KazooClient:
    client = KazooClient(hosts=endpoint, timeout=SESSION)
    client.start(timeout=10)
    return client


def kazoo_path(resource: str) -> str:
    return "/bench-kazoo/" + resource.replace("/", "-")


# -- requests sent --------------------------------------------------------------------------

Event = tuple[float, bool, str]
"""``(time.monotonic(), is_reply, kazoo's request class name)``."""


class RequestLog:
    """Every request a ``KazooClient`` queues (its ``_call``), by kazoo's request class name:
    ``Transaction`` (one ``multi``), ``Create``, ``Delete``, ``GetChildren``, ``Exists``, …
    Pipelined requests count one each (several requests, one round trip). With ``replies``,
    also when each reply arrived (kazoo's connection thread sets the request's result)."""

    def __init__(self, client: Any, replies: bool = False) -> None:
        self.events: list[Event] = []
        events, now, call = self.events, time.monotonic, client._call

        def counted(request: Any, async_object: Any) -> Any:
            name = type(request).__name__
            events.append((now(), False, name))
            if replies:
                for method in ("set", "set_exception"):
                    setattr(async_object, method, replied(name, getattr(async_object, method)))
            return call(request, async_object)

        def replied(name: str, original: Callable[..., None]) -> Callable[..., None]:
            def done(*args: Any) -> None:
                events.append((now(), True, name))
                original(*args)

            return done

        client._call = counted


Shape = tuple[tuple[str, ...], tuple[str, ...]]
"""The requests of one cycle: (acquire's, release's)."""


@dataclass
class Shapes:
    """Every cycle's requests (its :data:`Shape`) and duration."""

    cycles: dict[Shape, list[float]] = field(default_factory=lambda: collections.defaultdict(list))

    def total(self) -> int:
        return sum(len(durations) for durations in self.cycles.values())

    def per_cycle(self, writes_only: bool = False) -> float:
        sent = sum(
            len(durations) * sum(1 for r in (*a, *b) if not writes_only or r in WRITES)
            for (a, b), durations in self.cycles.items()
        )
        return sent / self.total() if self.total() else math.nan

    def common(self) -> Shape:
        return max(self.cycles, key=lambda shape: len(self.cycles[shape]))


class CountedCycle(Cycle):
    """An acquire+release cycle whose requests are logged per half (see :class:`Shapes`)."""

    log: RequestLog

    def __init__(self, pids: list[int]) -> None:
        self.shapes = Shapes()
        self.pids = pids
        self.cpu: list[tuple[float, float]] = []
        """Per round: (the members' CPU, this process's CPU) per cycle, in seconds."""

    def run_round(self, seconds: float) -> Round:
        """:func:`_rounds.run_round`'s loop, with the CPU it cost the members and the client."""
        members, client = cpu_seconds(self.pids), time.process_time()
        found = plain_round(_Steps(self.step), seconds)
        if found.cycles:
            self.cpu.append(
                (
                    (cpu_seconds(self.pids) - members) / len(found.cycles),
                    (time.process_time() - client) / len(found.cycles),
                )
            )
        return found

    def acquire(self) -> None:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def step(self) -> tuple[float, float]:
        events = self.log.events
        events.clear()
        t0 = time.perf_counter()
        self.acquire()
        t1 = time.perf_counter()
        mark = len(events)
        self.release()
        t2 = time.perf_counter()
        names = [name for _, _, name in events]
        self.shapes.cycles[(tuple(names[:mark]), tuple(names[mark:]))].append(t2 - t0)
        return t1 - t0, t2 - t1


class _Steps(Cycle):
    def __init__(self, step: Callable[[], tuple[float, float]]) -> None:
        self.step = step  # type: ignore[method-assign]


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes so far (``/proc/PID/stat``)."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return ticks / os.sysconf("SC_CLK_TCK")


class FencedZk(CountedCycle):
    name = FENCED
    what = "fenced.connect(zk://…) acquire(ttl=30, wait=0) + release"

    def __init__(self, endpoint: str, pids: list[int]) -> None:
        super().__init__(pids)
        self._coord = fenced.connect(fenced_url(endpoint))
        self.log = RequestLog(self._coord.backend._client)  # type: ignore[attr-defined]
        self._lease: fenced.Lease | None = None

    def acquire(self) -> None:
        self._lease = self._coord.acquire(R_CYCLE, ttl=TTL, wait=0)

    def release(self) -> None:
        if self._lease is None or not self._coord.release(self._lease):
            raise RuntimeError("fenced: release() did not release")

    def close(self) -> None:
        self._coord.close()


class KazooLock(CountedCycle):
    name = KAZOO
    what = "lock = client.Lock(path, id) once; lock.acquire() + lock.release()"

    def __init__(self, endpoint: str, path: str, pids: list[int]) -> None:
        super().__init__(pids)
        self._client = kazoo_client(endpoint)
        self.log = RequestLog(self._client)
        self._path = path
        self._lock = self._client.Lock(path, "bench")

    def acquire(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("kazoo: the uncontended lock was busy")

    def release(self) -> None:
        self._lock.release()

    def close(self) -> None:
        self._client.stop()
        self._client.close()


class KazooNewLock(KazooLock):
    name = KAZOO_NEW
    what = "client.Lock(path, id).acquire() + release(): a new Lock per acquire"

    def acquire(self) -> None:
        self._lock = self._client.Lock(self._path, "bench")
        super().acquire()


class FloorCycle(CountedCycle):
    """fenced's two transactions of an uncontended cycle, the same operations on the same kind
    of znodes with documents of the same size (fenced's own encoders), sent with plain kazoo
    and nothing else: no reads, no pruning, no lease bookkeeping in the client."""

    name = FLOOR
    what = "fenced's 2 transactions (same ops, same bytes) sent with plain kazoo"

    def __init__(self, endpoint: str, pids: list[int]) -> None:
        super().__init__(pids)
        self._client = client = kazoo_client(endpoint)
        self.log = RequestLog(client)
        self._paths = paths = Paths("/bench-floor")
        self._holder, self._owner = f"{platform.node()}:{os.getpid()}", uuid.uuid4().hex
        for path in (paths.log, paths.queue(R_CYCLE), paths.resources):
            client.ensure_path(path)
        client.create(paths.meta, encode_meta(uuid.uuid4().hex, 0))
        client.create(paths.counter(R_CYCLE), Counter().encode())
        self._epoch = self._version = 0

    def _commit(self, transaction: Any) -> None:
        results = transaction.commit()
        if any(isinstance(result, Exception) for result in results):
            raise RuntimeError(f"the floor's transaction failed: {results}")
        self._version += 1

    def acquire(self) -> None:
        paths, holder = self._paths, self._holder
        self._epoch += 1
        granted = Counter(self._epoch, holder, "live").encode()
        lease = LeaseDoc(self._epoch, self._owner, holder, TTL).encode()
        record = encode_record(
            RecordKind.GRANTED, self._epoch, holder, {"after": "released"}, time.time()
        )
        transaction = self._client.transaction()
        transaction.check(paths.meta, 0)
        transaction.check(paths.queue(R_CYCLE), 0)
        transaction.set_data(paths.counter(R_CYCLE), granted, self._version)
        transaction.create(paths.lease(R_CYCLE), lease, ephemeral=True)
        transaction.create(paths.record_prefix(R_CYCLE), record, sequence=True)
        self._commit(transaction)

    def release(self) -> None:
        paths, holder = self._paths, self._holder
        ended = Counter(self._epoch, holder, "released").encode()
        record = encode_record(RecordKind.RELEASED, self._epoch, holder, {}, time.time())
        transaction = self._client.transaction()
        transaction.delete(paths.lease(R_CYCLE), 0)
        transaction.set_data(paths.counter(R_CYCLE), ended, self._version)
        transaction.create(paths.record_prefix(R_CYCLE), record, sequence=True)
        self._commit(transaction)

    def close(self) -> None:
        self._client.stop()
        self._client.close()


def preload_records(endpoint: str, count: int) -> None:
    """Bring fenced's record log to ``count`` records (of another resource), as a coordinator
    that has run for a while has it: it keeps :data:`RECORDS_KEPT` and prunes the oldest 1,000
    every 1,000 records, inside the call whose record crosses the boundary."""
    fenced.connect(fenced_url(endpoint)).close()  # the state under the chroot exists
    client = kazoo_client(endpoint)
    try:
        started = time.monotonic()
        data = encode_record(RecordKind.GRANTED, 1, "bench-preload", {"after": "none"}, time.time())
        prefix = Paths(CHROOT).record_prefix("bench/preload")
        for first in range(0, count, 1000):
            pending = [
                client.create_async(prefix, data, sequence=True)
                for _ in range(min(1000, count - first))
            ]
            for result in pending:
                result.get(timeout=30)
        print(f"fenced's record log preloaded with {count:,} records in "
              f"{time.monotonic() - started:.1f} s")  # fmt: skip
    finally:
        client.stop()
        client.close()


def bench_cycles(endpoint: str, pids: list[int], rounds: int, seconds: float) -> Results:
    impls: list[CountedCycle] = [
        FencedZk(endpoint, pids),
        KazooLock(endpoint, kazoo_path(R_CYCLE), pids),
        KazooNewLock(endpoint, kazoo_path(R_CYCLE + "-new"), pids),
        FloorCycle(endpoint, pids),
    ]
    for impl in impls:  # the members' JIT warms up on each one's requests (cycle_rounds: 0.3 s)
        plain_round(impl, PREWARM)
    results = cycle_rounds(impls, rounds, seconds, "[1/3] uncontended cycles")
    print_cycles(
        results,
        "1. Uncontended acquire+release cycle (1 client, 1 resource)",
        "cycles/s",
        ("acquire p50", "release p50"),
    )
    rows = []
    for impl in impls:
        shapes = impl.shapes
        acquire, release = common = shapes.common()
        others = [d for shape, ds in shapes.cycles.items() if shape != common for d in ds]
        rows.append([
            impl.name,
            f"{shapes.per_cycle():.2f}",
            f"{shapes.per_cycle(writes_only=True):.2f}",
            ", ".join(acquire) or "-",
            ", ".join(release) or "-",
            f"{len(shapes.cycles[common]) / shapes.total():.1%}",
            f"{len(others)}: {fmt_time(median(others))}" if others else "-",
            fmt_time(median([members for members, _ in impl.cpu])),
            fmt_time(median([client for _, client in impl.cpu])),
        ])  # fmt: skip
    print_table(
        "Requests per cycle (every request sent, warm-ups included; the most common cycle shown) "
        "and CPU per cycle (median of rounds)",
        [
            "implementation",
            "requests",
            "writes",
            "acquire sends",
            "release sends",
            "share",
            "other cycles: n, p50",
            "members' CPU",
            "client CPU",
        ],
        rows,
    )
    return results


# -- worker processes: handoff and fairness -------------------------------------------------


class Recorded:
    """A worker's lock whose every call is logged with the requests it sent and their replies
    (timed); written to ``DIR/NAME-PID.json`` when the worker exits, for :func:`traced`."""

    def __init__(self, name: str, lock: WorkerLock, log: RequestLog, directory: str) -> None:
        self.calls: list[tuple[str, str, float, list[Event]]] = []
        self._path = Path(directory) / f"{name}-{os.getpid()}.json"

        def timed(kind: str, call: Callable[[], None], resource: str) -> None:
            log.events.clear()
            started = time.monotonic()
            call()
            took = time.monotonic() - started
            events = [(at - started, reply, what) for at, reply, what in log.events]
            self.calls.append((kind, resource, took, events))

        def acquire(resource: str, wait: float | None) -> None:
            timed("acquire", lambda: lock.acquire(resource, wait), resource)

        def release(resource: str) -> None:
            timed("release", lambda: lock.release(resource), resource)

        def close() -> None:
            lock.close()
            self._path.write_text(json.dumps(self.calls))

        self.lock = WorkerLock(acquire, release, close)


def fenced_worker_lock(endpoint: str, directory: str) -> WorkerLock:
    coord = fenced.connect(fenced_url(endpoint))
    log = RequestLog(coord.backend._client, replies=True)  # type: ignore[attr-defined]
    leases: dict[str, fenced.Lease] = {}

    def acquire(resource: str, wait: float | None) -> None:
        leases[resource] = coord.acquire(resource, ttl=TTL, wait=wait)

    def release(resource: str) -> None:
        if not coord.release(leases.pop(resource)):
            raise RuntimeError("fenced: release() did not release")

    return Recorded(FENCED, WorkerLock(acquire, release, coord.close), log, directory).lock


def kazoo_worker_lock(endpoint: str, directory: str) -> WorkerLock:
    """kazoo's Lock in a worker: one client, one reused ``Lock`` per resource."""
    client = kazoo_client(endpoint)
    log = RequestLog(client, replies=True)
    locks: dict[str, Any] = {}

    def acquire(resource: str, wait: float | None) -> None:
        lock = locks.get(resource)
        if lock is None:
            lock = locks[resource] = client.Lock(kazoo_path(resource), f"pid-{os.getpid()}")
        ok = lock.acquire(blocking=False) if wait == 0 else lock.acquire(timeout=wait)
        if not ok:
            raise RuntimeError("kazoo: not acquired")

    def release(resource: str) -> None:
        locks[resource].release()

    def close() -> None:
        client.stop()
        client.close()

    return Recorded(KAZOO, WorkerLock(acquire, release, close), log, directory).lock


def worker_main(conn: Connection, endpoint: str, directory: str) -> None:
    """A worker process: obeys ("acquire" | "release" | "contend" | "exit", …) messages."""
    serve(
        conn,
        {
            FENCED: fenced_worker_lock(endpoint, directory),
            KAZOO: kazoo_worker_lock(endpoint, directory),
        },
    )


def bench_handoff(workers: Workers, rounds: int, total: int) -> dict[str, list[HandoffRound]]:
    messages = {
        name: HandoffMessages(
            hold=("acquire", name, R_HANDOFF, 10.0),
            wait=("acquire", name, R_HANDOFF, 10.0),
            release=("release", name, R_HANDOFF),
            gap=GAP,
        )
        for name in (FENCED, KAZOO)
    }
    results = handoff_rounds(workers, messages, rounds, total, "[2/3] handoff")
    print_handoffs(
        results,
        "2. Handoff latency (holder's release() called -> blocked waiter's acquire() returned)",
    )
    return results


def bench_fairness(workers: Workers, rounds: int, seconds: float) -> dict[str, list[FairRound]]:
    results = fairness_rounds(workers, [FENCED, KAZOO], rounds, seconds, R_FAIR)
    print_fairness(
        results,
        f"3. Contention ({len(workers.conns)} processes, one resource, {seconds:g} s; worst "
        "round shown for min/max, min/mean and Jain)",
    )
    return results


# -- what the workers sent ------------------------------------------------------------------


def _after_wake(events: list[Event]) -> list[Event] | None:
    """The events after the longest pause of a call, if it is a blocked wait (≥ 20 ms)."""
    ordered = sorted(events)
    pauses = [(b[0] - a[0], i + 1) for i, (a, b) in enumerate(itertools.pairwise(ordered))]
    if not pauses or max(pauses)[0] < 0.020:
        return None
    return ordered[max(pauses)[1] :]


def _round_trips(events: list[Event]) -> list[list[str]]:
    """Requests grouped by round trip: a request sent after a reply starts a new one."""
    trips: list[list[str]] = []
    replied = True
    for _, reply, name in sorted(events):
        if reply:
            replied = True
        elif replied:
            trips.append([name])
            replied = False
        else:
            trips[-1].append(name)
    return trips


def _client_time(events: list[Event], took: float) -> float:
    """How long the client worked between replies and its next request, and from the last
    reply until the call returned (the rest of the span it waited on the ensemble)."""
    spent = 0.0
    last_reply: float | None = None
    for at, reply, _ in sorted(events):
        if reply:
            last_reply = at
        elif last_reply is not None:
            spent += at - last_reply
            last_reply = None
    return spent + (took - last_reply if last_reply is not None else 0.0)


def traced(directory: Path, handoff: bool, fairness: bool) -> None:
    """What the workers' calls sent (see :class:`Recorded`): per blocked acquire of the handoff,
    the requests after the wake-up, grouped by round trip, the time from the first of them to
    ``acquire()`` returning and the part of it the client worked (:func:`_client_time`); per
    contended acquisition, the requests of acquire + release."""
    rows = []
    sequences = []
    for name in (FENCED, KAZOO):
        calls = [
            call
            for path in sorted(directory.glob(f"{name}-*.json"))
            for call in json.loads(path.read_text())
        ]
        row = [name]
        if handoff:
            blocked = [
                (took, events, woke)
                for kind, resource, took, events in calls
                if kind == "acquire" and resource == R_HANDOFF
                if (woke := _after_wake([tuple(e) for e in events])) is not None
            ]
            releases = [
                events for kind, resource, _, events in calls
                if kind == "release" and resource == R_HANDOFF
            ]  # fmt: skip
            trips = [_round_trips(woke) for _, _, woke in blocked]
            shapes = collections.Counter(" → ".join("+".join(t) for t in trip) for trip in trips)
            common, n = shapes.most_common(1)[0] if shapes else ("-", 0)
            sequences.append(f"{name}, after the wake-up ({n} of {len(trips)}): {common}")
            row += [
                f"{median([sum(not e[1] for e in events) for _, events, _ in blocked]):g}",
                f"{median([len(t) for t in trips]):g}",
                f"{median([sum(len(x) for x in t) for t in trips]):g}",
                fmt_time(median([took - woke[0][0] for took, _, woke in blocked])),
                fmt_time(median([_client_time(woke, took) for took, _, woke in blocked])),
                f"{median([sum(not e[1] for e in events) for events in releases]):g}",
            ]
        if fairness:
            contended = [
                (kind, events) for kind, resource, _, events in calls if resource == R_FAIR
            ]
            acquisitions = sum(kind == "acquire" for kind, _ in contended)
            sent = [e[2] for _, events in contended for e in events if not e[1]]
            row += [
                f"{len(sent) / acquisitions:.1f}" if acquisitions else "-",
                f"{sum(s in WRITES for s in sent) / acquisitions:.1f}" if acquisitions else "-",
            ]
        rows.append(row)
    header = ["implementation"]
    if handoff:
        header += [
            "blocked acquire: requests",
            "after wake-up: round trips",
            "requests",
            "time",
            "in the client",
            "release: requests",
        ]
    if fairness:
        header += ["contended acquire+release: requests", "writes"]
    print_table(
        "Requests in the worker processes (medians; counted from each client's kazoo calls)",
        header,
        rows,
    )
    for line in sequences:
        print(line)


# -- summary --------------------------------------------------------------------------------
# -- summary --------------------------------------------------------------------------------


def summary(
    cycles: Results | None,
    handoff: dict[str, list[HandoffRound]] | None,
    fairness: dict[str, list[FairRound]] | None,
) -> None:
    rows: list[list[str]] = []
    if cycles is not None:
        for mine, baseline, target in (
            (FENCED, KAZOO, 1.2),
            (FENCED, KAZOO_NEW, 0.0),
            (FENCED, FLOOR, 0.0),
            (FLOOR, KAZOO, 0.0),
        ):
            ratios = cycles.ratio(mine, baseline)
            value = median(ratios)
            rows.append([
                f"cycles/s ÷ {baseline}" if mine == FENCED else f"({mine} ÷ {baseline})",
                fmt_rate(median(cycles.rates(mine))),
                fmt_rate(median(cycles.rates(baseline))),
                f"≥ {target:g}" if target else "(no target)",
                f"{fmt_ratio(value)} ({fmt_ratio(min(ratios))} – {fmt_ratio(max(ratios))})",
                verdict(value >= target) if target else "",
            ])  # fmt: skip
    if handoff is not None:
        ours = [x for r in handoff[FENCED] for x in r.latencies]
        theirs = [x for r in handoff[KAZOO] for x in r.latencies]
        for q in (50, 90):
            value = percentile(ours, q)
            rows.append([
                f"handoff p{q}",
                fmt_time(value),
                fmt_time(percentile(theirs, q)),
                "≤ 5 ms" if q == 50 else "(no target)",
                fmt_time(value),
                verdict(value <= 5e-3) if q == 50 else "",
            ])  # fmt: skip
    if fairness is not None:
        share = min(r.min_share for r in fairness[FENCED])
        rows.append([
            f"{len(fairness[FENCED][0].counts)}-process min/mean share (worst round)",
            fmt_ratio(share),
            fmt_ratio(min(r.min_share for r in fairness[KAZOO])),
            "≥ 0.8",
            fmt_ratio(share),
            verdict(share >= 0.8),
        ])  # fmt: skip
        rows.append([
            "contended acquisitions/s",
            fmt_rate(median([r.rate for r in fairness[FENCED]])),
            fmt_rate(median([r.rate for r in fairness[KAZOO]])),
            "(no target)",
            "",
            "",
        ])  # fmt: skip
    print_table(
        f"Summary (baseline: {KAZOO} unless named; a ratio is the median of the per-round "
        "ratios of interleaved runs, min–max in brackets)",
        ["metric", "fenced", "baseline", "target", "measured", "result"],
        rows,
    )


def describe(ensemble: ZooKeeperEnsemble, member: int, leader: int) -> None:
    srvr = ensemble.four_letter(member, "srvr") or ""
    found = re.search(r"Zookeeper version: ([^,-]+)", srvr)
    config = ensemble.member(member).config_path.read_text()
    force_sync = re.search(r"^forceSync=(\S+)", config, re.MULTILINE)
    print(
        f"fenced {fenced.__version__}, Python {platform.python_version()}, kazoo "
        f"{kazoo.__version__}, ZooKeeper "
        f"{found.group(1) if found else '?'}, {os.cpu_count()} CPUs, load average {_load()}"
    )
    print(
        f"ensemble {ensemble.connect_string()} (tickTime={ensemble.tick_ms}, forceSync="
        f"{force_sync.group(1) if force_sync else 'yes (default)'}); leader m{leader + 1}; "
        f"every client on m{member + 1} ({ensemble.member(member).endpoint}, "
        f"{'the leader' if member == leader else 'a follower'})"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    round_options(parser, seconds=1.5, handoffs=150)
    parser.add_argument("--processes", type=int, default=8, help="contending processes")
    parser.add_argument(
        "--fair-seconds", type=float, default=5.0, help="seconds per contention run (default 5)"
    )
    parser.add_argument(
        "--fair-rounds", type=int, default=3, help="contention rounds per implementation"
    )
    parser.add_argument(
        "--member",
        choices=["follower", "leader"],
        default="follower",
        help="the member every client connects to (default: a follower)",
    )
    parser.add_argument(
        "--records",
        type=int,
        default=RECORDS_KEPT,
        help=f"records in fenced's log before the run (default {RECORDS_KEPT:,}, what fenced "
        "keeps: the steady state of a coordinator in use; 0: a new coordinator)",
    )
    parser.add_argument(
        "--only",
        choices=["cycles", "handoff", "fairness"],
        action="append",
        help="run only these sections (repeatable)",
    )
    args = parser.parse_args(argv)
    if min(args.rounds, args.handoffs, args.fair_rounds) < 1 or args.seconds <= 0:
        parser.error("--rounds, --handoffs, --fair-rounds and --seconds must be positive")
    if args.records < 0:
        parser.error("--records must not be negative")
    if args.processes < 2:
        parser.error("--processes must be at least 2")
    sections = set(args.only or ["cycles", "handoff", "fairness"])
    started = time.monotonic()
    with ZooKeeperEnsemble(3) as ensemble:
        leader = ensemble.leader()
        member = leader if args.member == "leader" else min(set(ensemble.members) - {leader})
        endpoint = ensemble.member(member).endpoint
        describe(ensemble, member, leader)
        if args.records:
            preload_records(endpoint, args.records)
        cycles = handoff = fairness = None
        if "cycles" in sections:
            pids = [pid for pid in map(ensemble.pid, ensemble.members) if pid is not None]
            cycles = bench_cycles(endpoint, pids, args.rounds, args.seconds)
        if sections & {"handoff", "fairness"}:
            count = args.processes if "fairness" in sections else 2
            with tempfile.TemporaryDirectory(prefix="bench-zookeeper-") as calls:
                workers = Workers(count, worker_main, endpoint, calls)
                try:
                    if "handoff" in sections:
                        handoff = bench_handoff(workers, args.rounds, args.handoffs)
                    if "fairness" in sections:
                        fairness = bench_fairness(workers, args.fair_rounds, args.fair_seconds)
                finally:
                    workers.close()
                traced(Path(calls), handoff is not None, fairness is not None)
        summary(cycles, handoff, fairness)
        if ensemble.leader() != leader:
            print(f"WARNING: the leader changed during the run (m{leader + 1} before)")
    print(f"\ntotal {time.monotonic() - started:.0f} s, load average {_load()}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
