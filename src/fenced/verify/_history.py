"""A recorded history read into the terms the invariants speak of: calls, grants, leases, pauses.

:class:`History` reads the events of one history file (:func:`fenced.verify._recorder.read_history`)
of one resource: it pairs every send with its reply into a :class:`Call`, collects every
:class:`Grant` and, per epoch, the :class:`Lease` the history shows, and the spans in which a worker
was (or may have been) stopped. It judges nothing; :mod:`fenced.verify._checker` does. An event it
does not know is ignored; a reply without its send is dropped; a send without a reply (the worker
died first) is a call of unknown outcome.

Vocabulary of the events (written by :mod:`.worker`, :mod:`.faults`, :mod:`.processes` and the
drivers; ``t`` is the deadline clock, CLOCK_BOOTTIME on Linux, in the emitting process)::

    meta       resource, ttl, stores {name: {mode, url}}, overrun (failover included), failover
               (first event of a run)
    c.send     call, op (try_grant|renew|release|report|enqueue|leave), res, epoch, ttl, rid,
               ticket (try_grant: made with a place in the queue), take (leave)
    c.reply    call, ok, applied (true/false/null), granted (try_grant, or a leave that took a
               lease handed to it), error, message, fault, delay, applied_at
    s.send     call, store, op (fence|put|publish), epoch, op_id, key, base_len, sha, retry
    s.reply    call, ok, applied, version, object_id, pub_epoch, error, message, presented,
               floor, fault
    s.read     store, op (get|latest|read), t0, version, pointer, sha, error, message
    lease      epoch, deadline, ttl        check  epoch, state, deadline
    pause      target                      resume target          kill  target
    suspend    t0, seconds: the host slept between t0 and t (seen by the recorder of one process)
    wire       target, mode (a proxy cut)  crash  error (a worker died of an exception)
    partition  target, mode (coordinator | store | both | loss: nftables rules in its lab host)
    partition-healed  target (its rules removed)
    member-kill, member-isolate   target (an etcd member), role (leader | follower), length:
               a member fault of verify's own cluster, in place; member-restart, member-heal
               end it (meta's failover: how much a leader change may lengthen a lease);
               elsewhere: true for a fault another schedule sharing the cluster made
    backup     t0 (start): the coordinator was backed up; a later restore puts this state back
    restore    t0 (start) … the event's t is its end, available, epochs
    final      store, chain, version, pointer, read_sha             (after every worker ended)
    records    source (coordinator | store:NAME), records [...]     (diagnostics, when they exist)

Clocks: every ``t`` (and ``t0``, ``issued``, ``applied_at``, and the holders' deadlines) is read
on one clock of one host, the clock of the holders' deadlines, which counts a suspend of the host
(CLOCK_BOOTTIME on Linux; see :mod:`fenced.core._clock`). The embedded coordinator expires leases
on that same clock; the servers of the other backends on their own clocks, which the checker
assumes run no faster than it (a PostgreSQL server's clock counts a suspend of its host too, an
etcd server's lease timers do not: its leases then only end later, which no rule minds). A host
suspend stops every process at once: the recorder sees the deadline clock gain on CLOCK_MONOTONIC
and records a ``suspend`` span, which the checker treats as a pause of every worker. What it
still assumes: all the processes of a run are on one host, on a platform whose deadline clock
counts suspend (``SystemClock.counts_suspend``); elsewhere a suspend looks like time that never
passed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from fenced.verify._recorder import Event

__all__ = ["Call", "Grant", "History", "Lease", "granted_for"]


def granted_for(reply: Event | None, ttl: float) -> float:
    """How long the coordinator said a grant or renewal lasts: ``ttl``, or less if its reply's
    ``expires_in`` / ``remaining`` says so."""
    told = None if reply is None else reply.get("expires_in", reply.get("remaining"))
    return ttl if told is None else min(ttl, float(told))


@dataclass
class Call:
    """A recorded call: its send and (unless the worker died first) its reply."""

    send: Event
    reply: Event | None = None

    @property
    def worker(self) -> str:
        """The worker that made the call (``w`` in the events)."""
        return str(self.send["w"])

    @property
    def op(self) -> str:
        return str(self.send["op"])

    @property
    def sent(self) -> float:
        return float(self.send["t"])

    @property
    def replied(self) -> float | None:
        return None if self.reply is None else float(self.reply["t"])

    @property
    def learned(self) -> float | None:
        """When the wrapper learned the outcome (before an injected reply delay)."""
        if self.reply is None:
            return None
        return float(self.reply.get("applied_at") or self.reply["t"])

    @property
    def applied(self) -> bool | None:
        """True: took effect; False: certainly did not; None: unknown."""
        if self.reply is None:
            return None
        value = self.reply.get("applied")
        return None if value is None else bool(value)

    @property
    def told(self) -> str | None:
        """The error the caller was told (None: a normal reply)."""
        if self.reply is None or self.reply.get("ok"):
            return None
        return str(self.reply.get("error"))

    @property
    def epoch(self) -> int | None:
        value = self.send.get("epoch")
        return None if value is None else int(value)


@dataclass
class Grant:
    """A reply that granted ``epoch`` to the caller of ``call`` (a replayed reply included)."""

    epoch: int
    call: Call
    ttl: float


@dataclass
class Lease:
    """What the history says about one epoch's lease."""

    epoch: int
    grant: Grant
    definite: list[float] = field(default_factory=list)
    """The earliest expiry each call that certainly extended it promised (the grant, applied
    renewals): its send time + the time the coordinator granted (the ttl, or less when the
    reply said so: a lease handed over by a release was running before its holder asked)."""
    maybe: list[Call] = field(default_factory=list)
    """Calls that may have extended it (certainly or possibly applied)."""
    releases: list[Call] = field(default_factory=list)
    """Release calls that took or may have taken effect."""


class History:
    """The events of one history, sorted by time, and what they say about calls and leases."""

    def __init__(self, events: list[Event]) -> None:
        self.events = sorted(events, key=lambda e: float(e["t"]))
        self.meta: Event = next((e for e in events if e["ev"] == "meta"), {})
        self.ttl = float(self.meta.get("ttl", 0) or 0)
        # How much longer than its ttl the coordinator may keep a lease live after the send time
        # of its grant or last renewal (etcd rounds TTLs up to whole seconds, at least its
        # minimum, and expires leases on a 500 ms tick): 0 for backends that expire exactly.
        self.overrun = float(self.meta.get("overrun", 0) or 0)
        self.calls: list[Call] = []
        by_id: dict[str, Call] = {}
        self.by_id = by_id
        """Every call by its ``call`` field."""
        for event in self.events:
            if event["ev"] in ("c.send", "s.send"):
                call = Call(event)
                by_id[str(event["call"])] = call
                self.calls.append(call)
            elif event["ev"] in ("c.reply", "s.reply"):
                found = by_id.get(str(event["call"]))
                if found is not None:
                    found.reply = event
        self.killed = {str(e["target"]) for e in self.events if e["ev"] == "kill"}
        self.pauses = self._pauses()
        self.store_cuts = self._store_cuts()
        self.suspends = [
            (float(e.get("t0") or e["t"]), float(e["t"]))
            for e in self.events
            if e["ev"] == "suspend"
        ]
        self.backups = [
            (float(e.get("t0") or e["t"]), float(e["t"]))
            for e in self.events
            if e["ev"] == "backup"
        ]
        self.restores = [
            e
            for e in self.events
            if e["ev"] == "restore" and e.get("available") and not e.get("error")
        ]
        self.grants: list[Grant] = []
        self.unknown_grants = 0
        self.leases: dict[int, Lease] = {}
        self._collect_leases()

    def _pauses(self) -> dict[str, list[tuple[float, float]]]:
        """Per worker: the intervals it was (or may have been) stopped by an injected pause."""
        spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
        started: dict[str, float] = {}
        for event in self.events:
            if event["ev"] == "pause":
                started.setdefault(str(event["target"]), float(event["t"]))
            elif event["ev"] in ("resume", "kill"):
                target = str(event["target"])
                if target in started:
                    spans[target].append((started.pop(target), float(event["t"])))
        for target, begin in started.items():
            spans[target].append((begin, float("inf")))
        return spans

    def _store_cuts(self) -> dict[str, list[tuple[float, float]]]:
        """Per worker: the intervals a real partition cut it from the stores (modes store,
        both, loss), until healed (or the end of the run)."""
        spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
        started: dict[str, float] = {}
        for event in self.events:
            if event["ev"] == "partition" and event.get("mode") in ("store", "both", "loss"):
                started.setdefault(str(event["target"]), float(event["t"]))
            elif event["ev"] == "partition-healed" and str(event["target"]) in started:
                target = str(event["target"])
                spans[target].append((started.pop(target), float(event["t"])))
        for target, begin in started.items():
            spans[target].append((begin, float("inf")))
        return spans

    def cut_in_flight(self, call: Call, after: float) -> bool:
        """``call`` was in flight (sent, not yet answered) while its worker was cut from the
        stores, and was answered (or never) after ``after``: it may have arrived then."""
        end = call.replied if call.replied is not None else float("inf")
        if end <= after:
            return False
        return any(
            begin < end and healed > call.sent
            for begin, healed in self.store_cuts.get(call.worker, ())
        )

    def paused_between(self, worker: str, begin: float, end: float) -> bool:
        """True if ``worker`` was (or may have been) stopped between ``begin`` and ``end``: an
        injected pause, or a suspend of the host, which stops every process."""
        spans = [*self.pauses.get(worker, []), *self.suspends]
        return any(a <= end and b >= begin for a, b in spans)

    def _collect_leases(self) -> None:
        """Fill :attr:`grants`, :attr:`unknown_grants` and :attr:`leases` from the calls."""
        for call in self.calls:
            if call.op not in ("try_grant", "leave"):
                continue
            reply = call.reply
            granted = None if reply is None else reply.get("granted")
            if reply is None or granted is None:
                # No reply, or one of unknown outcome (a real connection lost after the request
                # went out): it may have granted an epoch the history never shows.
                self.unknown_grants += call.op == "try_grant" and call.applied is None
                continue
            ttl = float(reply.get("ttl") or call.send.get("ttl") or self.ttl)
            grant = Grant(int(granted), call, ttl)
            self.grants.append(grant)
            lease = self.leases.get(grant.epoch)
            if reply.get("replayed") and lease is not None:
                continue
            if lease is None:  # (from a replay when every earlier reply was lost: it expires
                # no earlier than the replay's send + its expires_in, no later than its reply's
                # time + ttl, as a first grant)
                lease = self.leases[grant.epoch] = Lease(grant.epoch, grant)
                lease.definite.append(call.sent + granted_for(call.reply, ttl))
                lease.maybe.append(call)
        for call in self.calls:
            epoch = call.epoch
            if call.op not in ("renew", "release") or epoch is None or epoch not in self.leases:
                continue
            lease = self.leases[epoch]
            if call.applied is False:
                continue
            if call.op == "renew":
                lease.maybe.append(call)
                if call.applied:
                    lease.definite.append(call.sent + granted_for(call.reply, lease.grant.ttl))
            else:
                lease.releases.append(call)

    def restored_away(self, call: Call) -> bool | None:
        """Was ``call``'s effect lost by a restore (made after the backup that was restored)?

        False: it is in the coordinator's state; True: a restore replaced it; None: unknown
        (the call straddles a backup or a restore).
        """
        end = call.replied if call.replied is not None else float("inf")
        for restore in self.restores:
            restored_at = float(restore["t"])
            taken = [b for b in self.backups if b[1] < restored_at]
            if not taken:
                continue
            snapshot_from, snapshot_to = taken[-1]  # the snapshot was taken in between
            if end < snapshot_from or call.sent > restored_at:
                continue
            if call.sent >= snapshot_to and end <= float(restore.get("t0") or restored_at):
                return True
            return None
        return False
