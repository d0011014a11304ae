"""The nemesis of randomized verification: seeded pauses, kills and restores of real processes.

A :class:`NemesisPlan` is drawn from the schedule's seed before the run starts: at which offsets
it strikes, with what, for how long. Timing is biased to land around TTL boundaries, where
fencing matters:

* **pauses** (SIGSTOP … SIGCONT) last 0.3-0.8 × ttl (the lease survives), 0.8-1.2 × ttl (it
  expires or survives by a hair, depending on where the renewal cycle stood), or 1.2-2.5 × ttl
  (it expires and a successor takes over while the paused process has work in flight);
  the victim is the current lease holder in 85 % of the strikes (such a strike is skipped when
  nobody holds the lease or the holder is already stopped); besides, workers stop
  themselves between a lease check and the write that follows (at a seeded rate) and the
  nemesis resumes them after a pause that usually (under an ``outlast`` profile: always)
  outlasts the lease: a write in flight; and, under a profile with ``commit_stops``, inside a
  store's critical section (between its check and its commit), resumed after a pause that
  always outlasts the lease. The lease these pauses outlast is the one the coordinator keeps:
  ttl plus the backend's documented overrun (etcd rounds TTLs up);
* **kills** (SIGKILL) of a worker, which is replaced by a fresh process (a new name);
* **restores** of the embedded coordinator (with :mod:`fenced.coordinator._restore`): a backup
  is taken while the workers run (at 15-35 % of the schedule); a restore strike kills every
  worker, puts the backup back and starts fresh workers on the restored coordinator (processes
  that kept the database open would go on working on the replaced file; case 6 covers a
  pre-restore holder's late write): the stores keep the floors of the lost state, and every
  later grant must be above them;
* **coordinator restarts**: the embedded SQLite coordinator has no process to restart: its
  state is a file every worker opens, and killing a worker in the middle of a grant *is* the
  crash of the coordinator code (SQLite's atomic commit is what survives it). For networked
  coordinators, restarting the server is possible only for a server verify started itself
  (see :mod:`fenced.verify._target`); a server given by URL is never touched.

**Partitions** (in a network lab, :mod:`fenced.testing.netlab`: each worker on a host of its
own, reaching the coordinator and every networked store through relays): half of the wire
strikes instead cut the victim's host with nftables rules, from the coordinator only (it still
reaches the stores), from the stores only (it still renews), from everything, or drop 30 % of
what it receives, for a TTL-biased time, then heal. A partition is recorded only once its rules
are in place.

**Member faults** (only against an etcd cluster verify started itself, see
:mod:`fenced.verify._members`): a member — the leader or a follower, half and half — is killed
(SIGKILL) and restarted on its data directory, or isolated from its peers by nftables rules, for
1.5-3 × ttl, then healed. One such fault at a time on the whole cluster (schedules of ``--jobs``
share it): a strike that finds the cluster busy or settling is tried again 0.3 s later, until
the schedule ends. Recorded (``member-kill``, ``member-isolate``) once the fault is in place;
after the run, the faults other schedules made meanwhile are recorded too (``elsewhere``).

Wire faults (lost and delayed replies, unavailability) are injected inside each worker by its
:class:`~fenced.verify._faults.FaultPlan`, seeded from the same schedule seed. With a networked
coordinator on loopback, a quarter of the strikes are **wire** strikes on the real connection:
the victim's own TCP proxy delays every reply, blackholes the connection or drops replies
(request delivered, reply lost, connection cut) for a TTL-biased time.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from fenced.verify._members import MEMBER_FAULTS, MEMBER_HEALS, SETTLE, MemberControl
from fenced.verify._processes import Run, WorkerProcess

__all__ = ["Action", "Nemesis", "NemesisPlan", "pause_length"]

ActionKind = Literal[
    "pause",
    "kill",
    "backup",
    "restore",
    "restart",
    "wire",
    "partition",
    "member-kill",
    "member-isolate",
]
WIRE_MODES = ("delay", "blackhole", "lose_replies")
PARTITION_MODES = ("coordinator", "store", "both", "loss")
"""What a partition cuts the victim's host from: the coordinator only (it still reaches the
stores), the networked stores only (it still renews), everything, or 30 % of what it receives."""
PARTITION_LOSS = 30
MEMBER_RETRY = 0.3
"""Seconds after which a member strike that found the cluster busy is tried again."""


def pause_length(
    rng: random.Random, ttl: float, *, in_flight: bool = False, outlast: bool = False
) -> float:
    """A pause length biased around the TTL boundary (see the module docstring).

    ``in_flight``: the worker stopped itself between its lease check and its write; then
    three quarters of the pauses outlast the lease, so that a successor can take over and
    install its epoch before the stale write arrives. ``outlast``: every pause outlasts the
    lease by at least half a ttl (a successor is granted and installs during the pause).
    """
    roll = rng.random()
    if outlast:
        return ttl * rng.uniform(1.5, 2.2)
    if in_flight:
        return ttl * (rng.uniform(0.3, 0.9) if roll < 0.25 else rng.uniform(1.1, 2.2))
    if roll < 0.2:
        return ttl * rng.uniform(0.3, 0.8)
    if roll < 0.6:
        return ttl * rng.uniform(0.8, 1.2)
    return ttl * rng.uniform(1.2, 2.5)


@dataclass(frozen=True, slots=True)
class Action:
    """One strike: at ``at`` seconds after the start, ``kind``, lasting ``length`` (pauses)."""

    at: float
    kind: ActionKind
    length: float = 0.0
    prefer_holder: bool = True
    """Strike the lease holder (a member fault: the etcd leader)."""
    pick: float = 0.0
    """A uniform number that picks the victim among the candidates (seeded)."""


@dataclass
class NemesisPlan:
    """The seeded strikes of one schedule."""

    actions: list[Action] = field(default_factory=list)
    seed: int = 0
    """Seeds the lengths of the pauses that workers start themselves (before a send)."""
    members: tuple[str, ...] = ()
    """The member faults drawn from (empty: none; see :mod:`fenced.verify._members`)."""
    horizon: float = math.inf
    """The schedule's duration: a member strike is not tried again after it."""

    @classmethod
    def draw(
        cls,
        rng: random.Random,
        *,
        duration: float,
        ttl: float,
        gap: float = 2.0,
        kills: float = 0.15,
        long_pauses: bool = False,
        restores: bool = False,
        restarts: bool = False,
        wire: bool = False,
        partitions: bool = False,
        members: tuple[str, ...] = (),
    ) -> NemesisPlan:
        """Strikes every ``gap`` × ttl on average (exponential gaps) over ``duration`` seconds
        (``gap`` infinite: none);
        a share ``kills`` of them kill, 10 % restore (if ``restores``: after a backup taken at
        15-35 % of the duration), 5 % restart (if ``restarts``), the others pause.

        ``members``: the member faults possible (``member-kill``, ``member-isolate``); then,
        besides, one member strike at 10-50 % of the duration (more if the duration leaves room
        after the cluster settled), on the leader or a follower, for 1.5-3 × ttl."""
        actions: list[Action] = []
        if restores:
            actions.append(Action(rng.uniform(0.15, 0.35) * duration, "backup"))
        at = rng.uniform(0.2, 0.6) * ttl if math.isfinite(gap) else math.inf
        while at < duration:
            roll = rng.random()
            kind: ActionKind = "pause"
            if roll < kills:
                kind = "kill"
            elif roll < kills + 0.1 and restores and actions and at > actions[0].at:
                kind = "restore"
            elif roll < kills + 0.15 and restarts:
                kind = "restart"
            elif roll < kills + 0.4 and wire:
                kind = "wire"
                if partitions and rng.random() < 0.5:
                    kind = "partition"
            length = 0.0
            if kind in ("pause", "wire", "partition"):
                length = pause_length(rng, ttl, in_flight=long_pauses)
            actions.append(Action(at, kind, length, rng.random() < 0.85, rng.random()))
            at += rng.expovariate(1 / (gap * ttl))
        if members and math.isfinite(gap):
            at = rng.uniform(0.1, 0.5) * duration
            while at < duration:
                isolate = rng.random() >= 0.5 and "member-isolate" in members
                member: ActionKind = "member-isolate" if isolate else "member-kill"
                length = ttl * rng.uniform(1.5, 3.0)
                actions.append(Action(at, member, length, rng.random() < 0.5, rng.random()))
                at += length + SETTLE + rng.uniform(0.0, 0.5) * duration
        actions.sort(key=lambda action: action.at)
        return cls(actions, rng.getrandbits(32), members, duration)


class Nemesis:
    """Executes a :class:`NemesisPlan` against the workers of a run.

    ``slots`` maps a slot number to the worker process currently in it; ``respawn(slot)``
    replaces a killed worker; ``restore()`` and ``restart()`` (optional) act on the coordinator;
    ``overrun`` is how much longer than ttl the coordinator may keep a lease; ``outlast``: every
    self-stop outlasts it; ``members``: the service of member faults (an etcd cluster verify
    started; the plan's member strikes are skipped without it).
    Paused workers are resumed by :meth:`tick` when their pause is over, and by :meth:`calm`.
    """

    def __init__(
        self,
        run: Run,
        plan: NemesisPlan,
        ttl: float,
        slots: dict[int, WorkerProcess],
        respawn: Callable[[int], WorkerProcess],
        *,
        backup: Callable[[], None] | None = None,
        restore: Callable[[], None] | None = None,
        restart: Callable[[], None] | None = None,
        overrun: float = 0.0,
        outlast: bool = False,
        members: MemberControl | None = None,
    ) -> None:
        self.run = run
        self.ttl = ttl
        self.lease = ttl + overrun
        """How long the coordinator may keep a lease (ttl + its overrun): self-stops outlast
        this, not only the ttl."""
        self.outlast = outlast
        """Every self-stop outlasts the lease (not only three quarters of them)."""
        self.pending = list(plan.actions)
        self.slots = slots
        self._respawn = respawn
        self._backup = backup
        self._restore = restore
        self._restart = restart
        self._resume_at: dict[str, float] = {}
        self._rng = random.Random(plan.seed)
        self._seen = 0
        self._holding: list[str] = []
        self._heal_at: dict[str, float] = {}
        self._partitioned: set[str] = set()
        self._members = members
        self._member_fault: tuple[int, str, str, float] | None = None
        """The member fault this nemesis made and has not healed: id, kind, member, heal time."""
        self._horizon = plan.horizon
        self._since = run.rec.now()
        self.started = time.monotonic()

    def _holder(self) -> str | None:
        """The worker that most recently reported a lease and has not left it since."""
        self._self_stops(time.monotonic())
        return self._holding[-1] if self._holding else None

    def _victim(self, action: Action) -> tuple[int, WorkerProcess] | None:
        live = [(s, w) for s, w in sorted(self.slots.items()) if w.alive() and not w.paused]
        if not live:
            return None
        if action.prefer_holder:  # the holder, or nobody: pausing a waiter only stalls the run
            holder = self._holder()
            return next(((s, w) for s, w in live if w.name == holder), None)
        return live[min(int(action.pick * len(live)), len(live) - 1)]

    def _worker(self, name: str) -> WorkerProcess | None:
        return self.run.workers.get(name)

    def _self_stops(self, now: float) -> None:
        """Workers that stopped themselves just before a send: resume them after a pause."""
        self.run.tail.poll()
        events = self.run.tail.events
        for event in events[self._seen :]:
            worker_name = str(event["w"])
            if event["ev"] == "lease":
                self._holding.append(worker_name)
            elif event["ev"] in ("unhold", "exit") and worker_name in self._holding:
                self._holding.remove(worker_name)
            elif event["ev"] == "kill" and str(event["target"]) in self._holding:
                self._holding.remove(str(event["target"]))
            if event["ev"] == "pause" and event.get("self_stop"):
                worker = self._worker(str(event["w"]))
                if worker is not None:
                    worker.paused = True
                    outlast = self.outlast or bool(event.get("in_commit"))
                    length = pause_length(self._rng, self.lease, in_flight=True, outlast=outlast)
                    self._resume_at[worker.name] = now + length
        self._seen = len(events)

    def tick(self) -> float:
        """Do what is due now; returns how long the caller may sleep before the next tick."""
        now = time.monotonic()
        self._self_stops(now)
        self._heal(now)
        for name, when in list(self._resume_at.items()):
            worker = self._worker(name)
            if worker is None or not worker.alive():
                del self._resume_at[name]
            elif when <= now and worker.stopped():
                del self._resume_at[name]
                worker.resume()
        while self.pending and self.started + self.pending[0].at <= now:
            action = self.pending.pop(0)
            self._strike(action, now)
        upcoming = [self.started + a.at for a in self.pending[:1]]
        upcoming += list(self._resume_at.values()) + list(self._heal_at.values())
        upcoming += [self._member_fault[3]] if self._member_fault is not None else []
        return max(0.0, min(upcoming, default=now + 0.05) - time.monotonic())

    def _strike(self, action: Action, now: float) -> None:
        if action.kind == "backup":
            if self._backup is not None:
                self._backup()
            return
        if action.kind == "restore":
            if self._restore is not None:
                # Every worker dies with the old state (processes that kept the database open
                # would go on working on the replaced file, invisible to the restored one);
                # fresh workers start on the restored coordinator.
                for worker in self.slots.values():
                    worker.kill()
                self._restore()
                for slot in sorted(self.slots):
                    self.slots[slot] = self._respawn(slot)
            return
        if action.kind == "restart":
            if self._restart is not None:
                self._restart()
            return
        if action.kind in MEMBER_FAULTS:
            self._strike_member(action, now)
            return
        chosen = self._victim(action)
        if chosen is None:
            return
        slot, worker = chosen
        if action.kind == "pause":
            worker.pause()
            self._resume_at[worker.name] = now + action.length
        elif action.kind == "wire":
            self._cut(worker, action, now)
        elif action.kind == "partition":
            self._partition(worker, action, now)
        else:
            worker.kill()
            self.slots[slot] = self._respawn(slot)

    def _cut(self, worker: WorkerProcess, action: Action, now: float) -> None:
        """A wire fault on the worker's own proxies to the coordinator, for ``length``."""
        if not worker.proxies or worker.name in self._heal_at:
            return
        mode = WIRE_MODES[min(int(action.pick * 3), 2)]
        delay = round(self.ttl * (0.2 + action.pick), 3)
        for proxy in worker.proxies:
            if mode == "delay":
                proxy.delay(delay)
            elif mode == "blackhole":
                proxy.blackhole()
            else:
                proxy.lose_replies()
        self.run.rec.emit("wire", target=worker.name, mode=mode, delay=delay)
        self._heal_at[worker.name] = now + action.length

    def _partition(self, worker: WorkerProcess, action: Action, now: float) -> None:
        """A real partition of the worker's host in the run's lab, for ``length``."""
        lab = self.run.lab
        if lab is None or worker.host is None or worker.name in self._heal_at:
            return
        mode = PARTITION_MODES[min(int(action.pick * len(PARTITION_MODES)), 3)]
        if mode == "store" and not worker.store_relays:
            mode = "both"  # its stores are local: only the coordinator can be cut off
        try:
            if mode == "coordinator":
                lab.cut(worker.host, *worker.coordinator_relays)
            elif mode == "store":
                lab.cut(worker.host, *worker.store_relays)
            elif mode == "both":
                lab.cut(worker.host)
            else:
                lab.loss(worker.host, PARTITION_LOSS)
        except RuntimeError:  # not made, so not recorded (the heal removes any half-made rule)
            lab.heal(worker.host)
            return
        self.run.rec.emit("partition", target=worker.name, mode=mode)
        self._partitioned.add(worker.name)
        self._heal_at[worker.name] = now + action.length

    def _strike_member(self, action: Action, now: float) -> None:
        """A member fault (through the cluster's service), recorded once it is in place; tried
        again :data:`MEMBER_RETRY` seconds later if the cluster is busy or settling."""
        if self._members is None or self._member_fault is not None:
            return
        try:
            fault = self._members.strike(
                action.kind,
                leader=action.prefer_holder,
                pick=action.pick,
                length=action.length,
                by=str(self.run.history),
            )
        except (OSError, RuntimeError, ValueError) as error:
            self.run.rec.emit("member-error", kind=action.kind, error=repr(error))
            return
        if "refused" in fault:
            later = now - self.started + MEMBER_RETRY
            if later + action.length / 2 < self._horizon:  # half of it fits in the schedule
                self.pending.append(replace(action, at=later))
                self.pending.sort(key=lambda pending: pending.at)
            return
        member = str(fault["member"])
        self.run.rec.emit(
            action.kind,
            target=member,
            role=fault["role"],
            member_pid=fault.get("pid"),
            length=round(action.length, 3),
        )
        self._member_fault = (int(fault["id"]), action.kind, member, now + action.length)

    def _heal_member(self, now: float) -> None:
        if self._member_fault is None or self._members is None:
            return
        fault, kind, member, when = self._member_fault
        if when > now:
            return
        self._member_fault = None
        try:
            healed = self._members.heal(fault)
        except (OSError, RuntimeError, ValueError) as error:  # the service heals it itself
            self.run.rec.emit(MEMBER_HEALS[kind], target=member, error=repr(error))
            return
        by = "nemesis" if healed.get("healed") else "service"  # (its grace ran out first)
        self.run.rec.emit(MEMBER_HEALS[kind], target=member, member_pid=healed.get("pid"), by=by)

    def record_elsewhere(self) -> None:
        """Record the member faults other schedules made while this one ran (``elsewhere``:
        they share the cluster, and these explain delays here too), at the times they were in
        place and healed. After :meth:`calm`."""
        if self._members is None:
            return
        try:
            faults = self._members.elsewhere(self._since, str(self.run.history))
        except (OSError, RuntimeError, ValueError) as error:
            self.run.rec.emit("member-error", error=repr(error))
            return
        pid = os.getpid()
        for fault in faults:
            kind, member = str(fault["kind"]), str(fault["member"])
            event = {"pid": pid, "w": "verify", "target": member, "elsewhere": True}
            self.run.rec.write({"t": fault["t"], **event, "ev": kind, "role": fault["role"]})
            if fault["healed"] is not None:
                self.run.rec.write({"t": fault["healed"], **event, "ev": MEMBER_HEALS[kind]})

    def _heal(self, now: float) -> None:
        self._heal_member(now)
        for name, when in list(self._heal_at.items()):
            worker = self._worker(name)
            if worker is None or when <= now:
                del self._heal_at[name]
                if name in self._partitioned:
                    self._partitioned.discard(name)
                    if worker is not None and worker.host is not None and self.run.lab:
                        self.run.lab.heal(worker.host)
                    self.run.rec.emit("partition-healed", target=name)
                    continue
                for proxy in [] if worker is None else worker.proxies:
                    proxy.forward()
                self.run.rec.emit("wire-healed", target=name)

    def calm(self, deadline: float) -> None:
        """Stop striking; resume every paused worker until all have exited or ``deadline``.

        A worker that stops itself during the drain is resumed at once. Workers still running
        at the deadline are killed.
        """
        self.pending.clear()
        self._resume_at.clear()
        self._heal(float("inf"))
        while time.monotonic() < deadline:
            self._self_stops(time.monotonic())
            live = [w for w in self.run.workers.values() if w.alive()]
            if not live:
                return
            for worker in live:
                if worker.paused or worker.stopped():
                    worker.resume()
            time.sleep(0.005)
        for worker in self.run.workers.values():
            worker.kill()
