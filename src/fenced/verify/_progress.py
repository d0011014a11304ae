"""``grant-progress``: a free resource with a waiter is granted within a bound.

Safety says nothing about liveness: a coordinator that never grants again keeps every other
invariant. This one catches a queue that stalls: whenever the resource is free by the history
and some worker waits in ``acquire``, a grant must follow within :func:`bound` seconds (the
ttl plus the holders' safety margin), unless a fault in the history explains the delay.

What the history says, conservatively (a correct system never fails):

* **free**: outside every lease's possible life. A lease may live from the send of its grant
  (or of a grant of unknown outcome) until its certain end: the reply of a release that took
  effect, else the latest reply among its grant and renewals (that could have taken effect) +
  the time granted + the backend's overrun. A call without a reply reaches until its worker was
  killed, else forever.
* **waiting**: a worker waits from the moment its ``enqueue`` certainly took a place in line
  (when its wrapper learnt that it took effect: before that, or if that was never learnt, the
  request may not have arrived, and nobody waited) until the send of a granted attempt, its
  ``leave``, or its end (a kill, a crash, its exit, a call it never saw answered). An
  ``acquire`` that ends otherwise (it gave up, an error ended it) leaves the queue, so a worker
  whose history shows no ``leave`` still has its place: it still waits.
* **explained** (:func:`excused`): while any worker is stopped or cut off, and for
  :data:`TICKET_LINGER` (or the ttl + overrun, if longer) after: an injected pause (or a host
  suspend), a kill or crash, a wire fault or partition, a restore (each of these can leave a
  place in line, or a lease handed to it, that lapses only after the backend's keep-alive); a
  fault of an etcd member until it healed, and a lease's life after (a new leader restarts
  every lease's countdown); a coordinator call delayed by an injected fault, while it is in
  flight (a waiter whose request is late is first in line all the same).

A stall is a stretch of time in which the resource is free, someone waits, nothing explains it,
and no grant is sent; one longer than the bound is a violation. Without faults a correct
coordinator grants within milliseconds (a release wakes the first waiter, and an expiry is
where its timer fires); the bound leaves room for a lost wake-up (waiters re-check at least
every 0.67 s, etcd's every second) and a busy host.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from fenced.verify._history import Call, History, granted_for

__all__ = ["TICKET_LINGER", "Stall", "bound", "excused", "held", "stalls", "waiting"]

TICKET_LINGER = 2.5
"""Seconds a backend may keep the place of a waiter that stopped keeping it alive: the queue
keep-alive of the embedded and PostgreSQL coordinators and etcd's queue lease (2 s), plus
etcd's 500 ms expiry tick."""

Span = tuple[float, float]


@dataclass(frozen=True)
class Stall:
    """A stretch in which the resource was free, ``waiters`` waited, nothing explains it, and
    no grant was sent."""

    start: float
    end: float
    waiters: tuple[str, ...]

    @property
    def length(self) -> float:
        return self.end - self.start


def bound(history: History) -> float:
    """Seconds within which a free resource with a waiter must be granted: the ttl plus the
    holders' safety margin (the schedule's, else a fifth of the ttl)."""
    margin = history.meta.get("margin")
    return history.ttl + (0.2 * history.ttl if margin is None else float(margin))


def _merged(spans: list[Span]) -> list[Span]:
    merged: list[Span] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _minus(span: Span, merged: list[Span]) -> list[Span]:
    """``span`` without the (merged, sorted) spans ``merged``."""
    left, end = span
    pieces = []
    for a, b in merged:
        if b <= left:
            continue
        if a >= end:
            break
        if a > left:
            pieces.append((left, a))
        left = max(left, b)
    if left < end:
        pieces.append((left, end))
    return pieces


def _deaths(history: History) -> dict[str, list[float]]:
    """Per worker: when it was killed or crashed."""
    found: dict[str, list[float]] = defaultdict(list)
    for event in history.events:
        if event["ev"] == "kill":
            found[str(event["target"])].append(float(event["t"]))
        elif event["ev"] == "crash":
            found[str(event["w"])].append(float(event["t"]))
    return found


def _reach(call: Call, deaths: dict[str, list[float]]) -> float:
    """The latest time ``call`` could have taken effect: its reply, else its worker's death."""
    if call.replied is not None:
        return call.replied
    return min((t for t in deaths.get(call.worker, []) if t >= call.sent), default=math.inf)


def held(history: History) -> list[Span]:
    """The (merged) spans in which some lease may have been live."""
    deaths = _deaths(history)
    ttl, overrun = history.ttl, history.overrun
    starts: dict[int, float] = {}
    extends: dict[int, list[Call]] = defaultdict(list)
    ends: dict[int, list[float]] = defaultdict(list)
    ttls: dict[int, float] = {}
    spans: list[Span] = []
    for call in history.calls:
        if call.op in ("try_grant", "leave"):
            reply = call.reply or {}
            granted = reply.get("granted")
            if granted is not None:
                epoch = int(granted)
                starts[epoch] = min(starts.get(epoch, math.inf), call.sent)
                extends[epoch].append(call)
                ttls[epoch] = float(reply.get("ttl") or call.send.get("ttl") or ttl)
            elif call.op == "try_grant" and call.applied is None:
                # a grant of unknown outcome: a lease nobody may know of
                lasts = float(call.send.get("ttl") or ttl) + overrun
                spans.append((call.sent, _reach(call, deaths) + lasts))
        elif call.op == "renew" and call.epoch is not None and call.applied is not False:
            extends[call.epoch].append(call)
        elif call.op == "release" and call.epoch is not None and call.applied and call.replied:
            ends[call.epoch].append(call.replied)
    for epoch, start in starts.items():
        lasts = ttls[epoch]
        expiry = max(_reach(c, deaths) + granted_for(c.reply, lasts) for c in extends[epoch])
        spans.append((start, min([expiry + overrun, *ends[epoch]])))
    return _merged(spans)


def waiting(history: History) -> dict[str, list[Span]]:
    """Per worker: the spans in which it had a place in line (see the module docstring)."""
    ends: dict[str, list[float]] = defaultdict(list)
    last: dict[str, float] = {}
    for event in history.events:
        last[str(event["w"])] = float(event["t"])
        if event["ev"] in ("kill",):
            ends[str(event["target"])].append(float(event["t"]))
        elif event["ev"] in ("crash", "exit"):
            ends[str(event["w"])].append(float(event["t"]))
    spans: dict[str, list[Span]] = defaultdict(list)
    since: dict[str, float] = {}

    def stop(worker: str, at: float) -> None:
        begun = since.pop(worker, None)
        if begun is not None and at > begun:
            spans[worker].append((begun, at))

    for call in history.calls:
        worker = call.worker
        if call.op not in ("enqueue", "try_grant", "leave"):
            continue
        if worker in since:
            ended = [t for t in ends.get(worker, []) if since[worker] <= t <= call.sent]
            if ended:
                stop(worker, min(ended))
        if call.op == "enqueue":
            if call.applied and call.learned is not None:
                since.setdefault(worker, call.learned)
        elif call.op == "leave" or call.reply is None or call.reply.get("granted") is not None:
            stop(worker, call.sent)
    for worker, begun in list(since.items()):
        later = [t for t in ends.get(worker, []) if t >= begun]
        stop(worker, min(later) if later else last.get(worker, begun))
    return spans


def excused(history: History) -> list[Span]:
    """The (merged) spans in which a fault explains a delay (see the module docstring)."""
    ttl, overrun = history.ttl, history.overrun
    linger = max(TICKET_LINGER, ttl + overrun)
    spans: list[Span] = []
    for stops in history.pauses.values():
        spans += [(a, b + linger) for a, b in stops]
    spans += [(a, b + linger) for a, b in history.suspends]
    spans += [(a, b) for a, b in history.backups]
    cut: dict[tuple[str, str], float] = {}
    heals = {"wire-healed": "wire", "partition-healed": "partition"}
    members = {"member-restart": "member-kill", "member-heal": "member-isolate"}
    for event in history.events:
        kind, t = str(event["ev"]), float(event["t"])
        if kind in ("kill", "crash"):
            spans.append((t, t + linger))
        elif kind == "restore":
            spans.append((float(event.get("t0") or t), t + linger))
        elif kind in ("wire", "partition", "member-kill", "member-isolate"):
            cut.setdefault((kind, str(event.get("target"))), t)
        elif kind in heals or kind in members:
            began = cut.pop((heals.get(kind) or members[kind], str(event.get("target"))), None)
            if began is not None:
                after = linger + (ttl + overrun if kind in members else 0.0)
                spans.append((began, t + after))
    spans += [(began, math.inf) for began in cut.values()]
    for call in history.calls:
        if call.reply is not None and call.reply.get("fault") in ("delay_request", "delay_reply"):
            spans.append((float(call.send.get("issued") or call.sent), float(call.reply["t"])))
    return _merged(spans)


def stalls(history: History) -> list[Stall]:
    """Every stall of the history longer than :func:`bound` (see the module docstring)."""
    if history.ttl <= 0:
        return []
    by_worker = waiting(history)
    busy = _merged(held(history) + excused(history))
    found: list[Stall] = []
    limit = bound(history)
    for start, end in _merged([span for spans in by_worker.values() for span in spans]):
        for a, b in _minus((start, end), busy):
            if b - a > limit:
                who = tuple(
                    sorted(
                        w
                        for w, spans in by_worker.items()
                        if any(x < b and y > a for x, y in spans)
                    )
                )
                found.append(Stall(a, b, who))
    return found
