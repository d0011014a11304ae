"""fenced verify: the checker on synthetic histories, the cases, randomized runs, mutants, CLI.

Layers, cheapest first:

* the checker on hand-written histories: a correct one passes; each invariant's violation is
  reported under that invariant's name (no processes, milliseconds);
* the seven cases of the practice table with real worker processes on the embedded backend (a
  SQLite coordinator; SQLite and file stores, in both roles across the cases);
* a short seeded randomized subset (real processes, SIGSTOP, SIGKILL, lost and delayed replies);
* detection power: where each seeded defect applies (n/a elsewhere, never a failure), and every
  applicable one is caught by the checker within the default budget, from more than one seed;
* the command line: exit status, ``--json``, the replay command and the kept history.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import fenced
import fenced.verify
from fenced.core._clock import ManualClock
from fenced.fence import open_store
from fenced.verify import _seeded as seeded
from fenced.verify._cases import CASES, run_cases
from fenced.verify._checker import INVARIANTS, check_history
from fenced.verify._mutants import CATALOGUE, DEFAULT_BUDGET, MutantResult, hunt
from fenced.verify._recorder import Recorder, read_history
from fenced.verify._schedule import PROFILES, run_random
from fenced.verify._table import plain_mutants, to_json
from fenced.verify._target import Target

R = "verify/test"


class History:
    """A synthetic history: calls with their sends and replies, and the other events."""

    def __init__(self, ttl: float = 1.0) -> None:
        self.events: list[dict[str, Any]] = [
            {
                "t": 0.0,
                "pid": 1,
                "w": "verify",
                "ev": "meta",
                "resource": R,
                "ttl": ttl,
                "stores": {"S": {"mode": "strict"}, "M": {"mode": "monotonic"}},
            }
        ]
        self.ttl = ttl
        self._calls = 0

    def ev(self, t: float, w: str, ev: str, **fields: Any) -> None:
        self.events.append({"t": t, "pid": 1, "w": w, "ev": ev, **fields})

    def call(
        self,
        kind: str,
        w: str,
        op: str,
        t: float,
        send: dict[str, Any],
        reply: dict[str, Any] | None,
        dt: float = 0.001,
    ) -> None:
        self._calls += 1
        call = f"{w}:{kind}{self._calls}"
        self.ev(t, w, f"{kind}.send", call=call, op=op, **send)
        if reply is not None:
            self.ev(t + dt, w, f"{kind}.reply", call=call, op=op, **{"fault": None, **reply})

    def grant(self, w: str, epoch: int, t: float, **reply: Any) -> None:
        fields = {"ok": True, "applied": True, "granted": epoch, "ttl": self.ttl}
        self.call("c", w, "try_grant", t, {"res": R, "ttl": self.ttl}, {**fields, **reply})

    def renew(self, w: str, epoch: int, t: float, applied: bool = True) -> None:
        reply: dict[str, Any] = {"ok": applied, "applied": applied}
        if not applied:
            reply["error"] = "LeaseLost"
        self.call("c", w, "renew", t, {"res": R, "epoch": epoch, "ttl": self.ttl}, reply)

    def release(self, w: str, epoch: int, t: float, released: bool = True) -> None:
        reply = {"ok": True, "applied": released, "released": released}
        self.call("c", w, "release", t, {"res": R, "epoch": epoch}, reply)

    def fence(self, w: str, store: str, epoch: int, t: float) -> None:
        reply = {"ok": True, "applied": True, "floor": epoch}
        self.call("s", w, "fence", t, {"store": store, "res": R, "epoch": epoch}, reply)

    def lease(self, w: str, epoch: int, t: float, deadline: float) -> None:
        self.ev(t, w, "lease", epoch=epoch, deadline=deadline, ttl=self.ttl)

    def check(self, w: str, epoch: int, t: float, deadline: float) -> None:
        self.ev(t, w, "check", epoch=epoch, state="held", deadline=deadline)

    def put(
        self,
        w: str,
        store: str,
        epoch: int,
        op_id: str,
        t: float,
        base_len: int,
        version: int | None = None,
        error: str | None = None,
        dt: float = 0.001,
        **extra: Any,
    ) -> None:
        send = {"store": store, "res": R, "epoch": epoch, "key": "chain", "op_id": op_id}
        send.update(base_len=base_len, retry=0, **extra)
        if error is None:
            reply: dict[str, Any] = {"ok": True, "applied": True, "version": version}
        else:
            reply = {"ok": False, "applied": False, "error": error}
        self.call("s", w, "put", t, send, reply, dt)

    def publish(self, w: str, store: str, epoch: int, op_id: str, t: float, sha: str) -> None:
        send = {"store": store, "res": R, "epoch": epoch, "op_id": op_id, "sha": sha, "retry": 0}
        reply = {"ok": True, "applied": True, "object_id": f"obj-{op_id}", "pub_epoch": epoch}
        self.call("s", w, "publish", t, send, reply)

    def latest(self, w: str, store: str, t: float, epoch: int, object_id: str, sha: str) -> None:
        pointer = {"epoch": epoch, "object_id": object_id, "sha": sha}
        self.ev(t, w, "s.read", t0=t - 0.001, store=store, op="latest", pointer=pointer)

    def final(
        self,
        store: str,
        chain: list[list[Any]],
        version: int,
        pointer: dict[str, Any] | None = None,
    ) -> None:
        self.events = [e for e in self.events if not (e["ev"] == "final" and e["store"] == store)]
        self.ev(9.0, "verify", "final", store=store, chain=chain, version=version, pointer=pointer)

    def records(self, granted: list[int], released: list[int]) -> None:
        self.events = [e for e in self.events if e["ev"] != "records"]
        listed = [{"kind": "granted", "epoch": e} for e in granted]
        listed += [{"kind": "released", "epoch": e} for e in released]
        self.ev(9.1, "verify", "records", source="coordinator", records=listed)


def correct() -> History:
    """A handover: A holds 1 (writes, publishes, renews, releases), B holds 2 and writes."""
    h = History()
    h.grant("A", 1, 0.0)
    h.fence("A", "S", 1, 0.002)
    h.lease("A", 1, 0.004, deadline=0.9)
    h.check("A", 1, 0.1, deadline=0.9)
    h.put("A", "S", 1, "A.1", 0.1001, base_len=0, version=1)
    h.renew("A", 1, 0.3)
    h.check("A", 1, 0.31, deadline=1.2)
    h.put("A", "M", 1, "A.2", 0.3101, base_len=0, version=1)
    h.check("A", 1, 0.35, deadline=1.2)
    h.publish("A", "S", 1, "A.3", 0.3501, sha="sha-a")
    h.release("A", 1, 0.5)
    h.grant("B", 2, 0.6)
    h.fence("B", "S", 2, 0.602)
    h.lease("B", 2, 0.604, deadline=1.5)
    h.check("B", 2, 0.7, deadline=1.5)
    h.put("B", "S", 2, "B.1", 0.7001, base_len=1, version=2)
    h.check("B", 2, 0.8, deadline=1.5)
    h.publish("B", "S", 2, "B.2", 0.8001, sha="sha-b")
    h.latest("A", "S", 1.0, 2, "obj-B.2", "sha-b")
    h.release("B", 2, 1.1)
    h.final("S", [["A.1", 1], ["B.1", 2]], 2, POINTER)
    h.final("M", [["A.2", 1]], 1)
    h.records([1, 2], [1, 2])
    return h


POINTER = {"epoch": 2, "object_id": "obj-B.2", "sha": "sha-b"}


def broken(h: History) -> list[str]:
    return check_history(h.events).invariants()


# -- the checker on synthetic histories -------------------------------------------------------


def test_a_correct_history_passes() -> None:
    report = check_history(correct().events)
    assert report.ok, report.violations
    assert report.stats["grants"] == 2
    assert report.stats["put calls"] == 3


def test_token_unique() -> None:
    h = correct()
    h.grant("C", 2, 2.0)
    assert "token-unique" in broken(h)


def test_token_monotonic() -> None:
    h = correct()
    h.grant("C", 5, 1.5)
    h.release("C", 5, 1.6)
    h.grant("D", 4, 2.0)  # after 5 was granted and released: unique, but lower
    assert "token-monotonic" in broken(h)
    assert "token-unique" not in broken(h)


def test_exclusive_grant_needs_release_or_expiry() -> None:
    h = correct()
    h.events = [e for e in h.events if not (e.get("op") == "release" and e["w"] == "A")]
    h.records([1, 2], [2])
    assert broken(h) == ["exclusive-grant"]


def test_holder_deadline() -> None:
    h = correct()
    h.check("A", 1, 0.4, deadline=1.5)  # 0.3 (last renewal sent) + 1.0 < 1.5
    assert broken(h) == ["holder-deadline"]


def test_stop_at_deadline() -> None:
    h = correct()
    h.check("A", 1, 0.4, deadline=1.2)
    h.put("A", "M", 1, "A.4", 1.3, base_len=1, version=2)  # 0.9 s after its check, no pause
    h.final("M", [["A.2", 1], ["A.4", 1]], 2)
    assert broken(h) == ["stop-at-deadline"]


def test_stop_at_deadline_allows_an_injected_pause() -> None:
    h = correct()
    h.check("A", 1, 0.4, deadline=1.2)
    h.ev(0.41, "verify", "pause", target="A")
    h.ev(1.29, "verify", "resume", target="A")
    h.put("A", "M", 1, "A.4", 1.3, base_len=1, version=2)
    h.final("M", [["A.2", 1], ["A.4", 1]], 2)
    assert broken(h) == []


def test_a_write_held_past_the_deadline_by_a_partition_is_counted() -> None:
    """A write in flight while its worker was cut from the stores, answered after the holder's
    deadline, may have arrived stale: the release check's table counts those."""

    def held(mode: str, answered: float) -> int:
        h = correct()
        h.check("A", 1, 0.4, deadline=1.2)
        h.ev(0.41, "verify", "partition", target="A", mode=mode)
        h.put("A", "M", 1, "A.4", 0.42, base_len=1, error="Unavailable", dt=answered - 0.42)
        h.ev(1.35, "verify", "partition-healed", target="A")
        report = check_history(h.events)
        assert report.invariants() == []
        return report.stats["writes held past the deadline by a partition"]

    assert held("store", answered=1.4) == 1
    assert held("both", answered=1.4) == 1
    assert held("store", answered=0.9) == 0  # answered before the deadline
    assert held("coordinator", answered=1.4) == 0  # the stores were still reachable


def test_stop_at_deadline_allows_a_host_suspend() -> None:
    """A suspend stops every process: a send decided before it and made after it is a pause."""
    h = correct()
    h.check("A", 1, 0.4, deadline=1.2)
    h.ev(1.29, "B", "suspend", t0=0.35, seconds=0.9)  # noticed by another process's recorder
    h.put("A", "M", 1, "A.4", 1.3, base_len=1, version=2)
    h.final("M", [["A.2", 1], ["A.4", 1]], 2)
    assert broken(h) == []
    h.events = [e for e in h.events if e["ev"] != "suspend"]
    assert broken(h) == ["stop-at-deadline"]


def test_the_recorder_records_a_host_suspend(tmp_path: Path) -> None:
    """Events are timed on the deadline clock; when it gained on CLOCK_MONOTONIC since the
    previous event (the host slept), a ``suspend`` span comes first. Time that both clocks count
    is no suspend."""
    clock = ManualClock()
    recorder = Recorder(tmp_path / "h.jsonl", "A", clock=clock)
    recorder.emit("check")
    clock.advance(2)
    recorder.emit("check")
    clock.suspend(30)
    clock.advance(1)
    recorder.emit("s.send")
    recorder.close()
    events = read_history(tmp_path / "h.jsonl")
    assert [(e["ev"], e["t"]) for e in events] == [
        ("check", 1000.0),
        ("check", 1002.0),
        ("suspend", 1033.0),
        ("s.send", 1033.0),
    ]
    assert (events[2]["t0"], events[2]["seconds"]) == (1002.0, 30.0)


def test_largest_seen() -> None:
    h = correct()
    h.check("A", 1, 0.65, deadline=1.2)
    h.put("A", "S", 1, "A.9", 0.65, base_len=1, version=2)  # sent after B's fence(2) was acked
    assert "largest-seen" in broken(h)


def test_largest_seen_in_the_final_chain() -> None:
    h = correct()
    h.final("M", [["A.2", 1], ["B.9", 2], ["A.9", 1]], 3)
    h.check("B", 2, 0.9, deadline=1.5)
    h.put("B", "M", 2, "B.9", 0.9001, base_len=1, version=2)
    h.put("A", "M", 1, "A.9", 0.3201, base_len=2, version=3, unchecked=True)
    assert "largest-seen" in broken(h)


def test_install_then_equal() -> None:
    h = correct()
    h.grant("C", 3, 1.2)
    h.check("C", 3, 1.3, deadline=2.1)
    h.put("C", "S", 3, "C.1", 1.3001, base_len=2, version=3)  # no fence(3) at strict S
    h.final("S", [["A.1", 1], ["B.1", 2], ["C.1", 3]], 3, POINTER)
    h.records([1, 2, 3], [1, 2])
    assert broken(h) == ["install-then-equal"]


def test_chain_integrity_lost_update() -> None:
    h = correct()
    h.final("S", [["B.1", 2]], 2, POINTER)
    assert "chain-integrity" in broken(h)


def test_compare_owner_release() -> None:
    h = correct()
    h.events = [e for e in h.events if not (e.get("op") == "release" and e["w"] == "A")]
    h.release("A", 1, 0.7)  # after B was granted 2: a correct coordinator says False
    assert "compare-owner" in broken(h)


def test_compare_owner_release_of_an_expired_lease_is_refused() -> None:
    h = correct()
    h.events = [e for e in h.events if not (e.get("op") == "release" and e["w"] == "A")]
    h.release("A", 1, 1.35, released=False)
    h.events = [e for e in h.events if e["w"] != "B" and e["ev"] != "s.read"]
    h.final("S", [["A.1", 1]], 1, {"epoch": 1, "object_id": "obj-A.3", "sha": "sha-a"})
    h.records([1], [])
    assert broken(h) == []
    h.release("A", 1, 1.36, released=True)  # the lease had certainly expired at 1.3
    assert broken(h) == ["compare-owner", "diagnostics-match"]


def test_compare_owner_allows_the_coordinators_documented_overrun() -> None:
    """etcd keeps a lease up to ``overrun`` past its ttl (whole-second TTLs, a 500 ms expiry
    tick): a release then still takes effect, and the meta event says how long it may."""
    h = correct()
    h.events = [e for e in h.events if not (e.get("op") == "release" and e["w"] == "A")]
    h.events = [e for e in h.events if e["w"] != "B" and e["ev"] != "s.read"]
    h.final("S", [["A.1", 1]], 1, {"epoch": 1, "object_id": "obj-A.3", "sha": "sha-a"})
    h.release("A", 1, 1.6, released=True)  # 0.3 s after ttl from the last renewal's reply
    h.records([1], [1])
    assert broken(h) == ["compare-owner"]
    h.events[0]["overrun"] = 0.5
    assert broken(h) == []
    h.release("A", 1, 1.9, released=True)  # past the overrun too
    h.records([1], [1, 1])
    assert broken(h) == ["compare-owner"]


def test_diagnostics_match_counts_leases_handed_to_a_waiter_that_left() -> None:
    """A release hands epoch 2 to C's place in the queue; C gives up (Busy) before it sees the
    grant, and its leave releases epoch 2: the coordinator records a grant and a release that
    no try_grant/release of the history made — once per place in the queue, no more."""
    h = correct()
    h.call("c", "C", "enqueue", 0.55, {"res": R, "ttl": 1.0}, {"ok": True, "applied": True})
    h.call("c", "C", "leave", 0.62, {"res": R}, {"ok": True, "applied": True})
    h.events = [e for e in h.events if e["w"] != "B" and e["ev"] != "s.read"]
    h.final("S", [["A.1", 1]], 1, {"epoch": 1, "object_id": "obj-A.3", "sha": "sha-a"})
    h.records([1, 2], [1, 2])
    assert broken(h) == []
    h.records([1, 2, 3], [1, 2, 3])  # a second unexplained lease: one place cannot explain it
    assert broken(h) == ["diagnostics-match"]


def test_a_leave_that_takes_a_handed_lease_is_a_grant_of_the_history() -> None:
    """C's wait ran out as a release handed it epoch 2: its leave (take) returns that lease,
    recorded like a try_grant's grant, and C releases it: every record is explained by a call,
    and the lease is held to what the leave's reply granted."""
    h = correct()
    h.events = [e for e in h.events if e["w"] != "B" and e["ev"] != "s.read"]
    h.final("S", [["A.1", 1]], 1, {"epoch": 1, "object_id": "obj-A.3", "sha": "sha-a"})
    h.call("c", "C", "enqueue", 0.45, {"res": R, "ttl": 1.0}, {"ok": True, "applied": True})
    took = {"ok": True, "applied": True, "granted": 2, "ttl": 1.0, "expires_in": 0.9}
    h.call("c", "C", "leave", 0.62, {"res": R, "ticket": True, "take": True}, took)
    h.lease("C", 2, 0.63, deadline=1.4)
    h.release("C", 2, 0.8)
    h.records([1, 2], [1, 2])
    assert broken(h) == []
    h.records([1, 2, 3], [1, 2])  # a grant no call explains: the place in line was consumed
    assert broken(h) == ["diagnostics-match"]
    h.records([1, 2], [1, 2])
    h.lease("C", 2, 0.64, deadline=1.6)  # counts on more than the 0.9 s the leave granted
    assert broken(h) == ["holder-deadline"]


def test_a_lease_granted_for_less_than_its_ttl_is_held_to_what_was_granted() -> None:
    """A grant whose reply says ``expires_in`` < ttl (a lease handed over by a release was
    running before its new holder asked; an etcd lease taken from the pool) lasts that long:
    the next grant may come after it, and the holder's deadline must not pass it."""
    h = History()
    h.grant("A", 1, 0.0, expires_in=0.8)
    h.lease("A", 1, 0.004, deadline=0.75)
    h.grant("B", 2, 0.85)
    h.lease("B", 2, 0.854, deadline=1.75)
    h.records([1, 2], [])
    assert broken(h) == []
    h.lease("A", 1, 0.005, deadline=0.9)  # counts on more than the 0.8 s granted
    assert broken(h) == ["holder-deadline"]


def _waits(h: History, w: str, t: float) -> None:
    """``w`` is told the resource is busy and takes a place in line at ``t``."""
    blocked = {"ok": True, "applied": False, "blocked": True, "epoch": 1}
    h.call("c", w, "try_grant", t, {"res": R, "ttl": h.ttl, "ticket": False}, blocked)
    h.call("c", w, "enqueue", t + 0.002, {"res": R, "ttl": h.ttl}, {"ok": True, "applied": True})


def _stalled(granted_at: float, **then: Any) -> History:
    """A holds epoch 1 and releases it at 0.5 (replied 0.501); C waits in line from 0.3; C is
    granted epoch 2 at ``granted_at``. The bound: ttl + margin (a fifth of the ttl) = 1.2 s."""
    h = History()
    h.grant("A", 1, 0.0)
    h.lease("A", 1, 0.002, deadline=0.8)
    _waits(h, "C", 0.3)
    h.release("A", 1, 0.5)
    for event in then.get("events", []):
        h.ev(*event[:3], **event[3] if len(event) > 3 else {})
    h.grant("C", 2, granted_at)
    h.lease("C", 2, granted_at + 0.002, deadline=granted_at + 0.8)
    h.records([1, 2], [1])
    return h


def test_grant_progress() -> None:
    """The resource is free from 0.501 and C waits in line: a grant is due by 1.701."""
    assert broken(_stalled(1.6)) == []
    assert broken(_stalled(1.8)) == ["grant-progress"]
    (violation,) = check_history(_stalled(1.8).events).violations
    assert "C waited in line" in violation.message and "1.299s" in violation.message


def test_grant_progress_from_a_certain_expiry() -> None:
    """Without a release, the resource is free once A's lease has certainly expired: the
    reply of its last renewal + the ttl (+ the backend's overrun)."""
    h = History()
    h.grant("A", 1, 0.0)
    h.renew("A", 1, 0.3)  # replied at 0.301: certainly expired at 1.301
    _waits(h, "C", 0.35)
    h.grant("C", 2, 2.45)
    h.records([1, 2], [])
    assert broken(h) == []
    h.events = [e for e in h.events if e["w"] != "C"]
    _waits(h, "C", 0.35)
    h.grant("C", 2, 2.6)
    assert broken(h) == ["grant-progress"]
    h.events[0]["overrun"] = 0.5  # etcd keeps a lease up to that much longer
    assert broken(h) == []


def test_grant_progress_is_not_owed_while_a_fault_explains_the_delay() -> None:
    """Another worker stopped or cut off may hold the place ahead of C (or a lease handed to
    it) until its keep-alive lapses; a request delayed on the wire is late; a worker that is
    stopped, killed or cut off is not waiting."""
    pause = [(0.4, "verify", "pause", {"target": "B"}), (0.9, "verify", "resume", {"target": "B"})]
    assert broken(_stalled(4.5, events=pause)) == []  # B's place may last till 0.9 + 2.5 s
    assert broken(_stalled(4.7, events=pause)) == ["grant-progress"]  # then the bound, 1.2 s
    assert broken(_stalled(4.2, events=[(0.6, "verify", "kill", {"target": "B"})])) == []
    paused_waiter = [(0.4, "verify", "pause", {"target": "C"})]  # never resumed: not waiting
    assert broken(_stalled(5.0, events=paused_waiter)) == []
    cut = [(0.45, "verify", "partition", {"target": "C"})]
    cut += [(1.0, "verify", "partition-healed", {"target": "C"})]
    assert broken(_stalled(3.4, events=cut)) == []
    h = _stalled(2.0)
    late = {"ok": True, "applied": False, "blocked": True, "epoch": 1, "fault": "delay_request"}
    h.call("c", "C", "try_grant", 1.6, {"res": R, "ttl": 1.0, "issued": 0.55}, late)
    assert broken(h) == []  # in flight from 0.55 to 1.601: C's request was late


def test_grant_progress_is_owed_only_to_a_waiter_in_line() -> None:
    """A waiter that left the line (its wait ran out) waits no more; one that gave up without
    leaving (no leave in the history) still holds its place: it still waits."""
    h = History()
    h.grant("A", 1, 0.0)
    _waits(h, "C", 0.3)
    h.release("A", 1, 0.5)
    left = {"ok": True, "applied": True}
    h.call("c", "C", "leave", 0.7, {"res": R, "ticket": True, "take": True}, left)
    h.records([1], [1])
    assert broken(h) == []
    h = _stalled(4.0)
    unavailable = {"ok": False, "applied": False, "error": "Unavailable", "fault": "unavailable"}
    h.call("c", "C", "try_grant", 0.6, {"res": R, "ttl": 1.0, "ticket": True}, unavailable)
    assert broken(h) == ["grant-progress"]  # its acquire failed, and it never left the line


def test_grant_progress_is_owed_only_once_a_place_was_certainly_taken() -> None:
    """An ``enqueue`` whose outcome C never learnt (no reply within the statement timeout, so
    the request may never have arrived) is no place in line: nobody is owed a grant. One that
    took effect makes C wait from when its outcome was learnt (the release check saw a
    PostgreSQL enqueue answered OutcomeUnknown after 13 s, and called the free resource a
    stall)."""
    h = History()
    h.grant("A", 1, 0.0)
    h.release("A", 1, 0.5)
    blocked = {"ok": True, "applied": False, "blocked": True, "epoch": 1}
    h.call("c", "C", "try_grant", 0.3, {"res": R, "ttl": h.ttl, "ticket": False}, blocked)
    unknown = {"ok": False, "applied": None, "error": "OutcomeUnknown"}
    h.call("c", "C", "enqueue", 0.31, {"res": R, "ttl": h.ttl}, unknown, dt=10.0)
    h.ev(12.0, "C", "exit")
    h.records([1], [1])
    assert broken(h) == []
    h = History()
    h.grant("A", 1, 0.0)
    h.release("A", 1, 0.5)
    h.call("c", "C", "try_grant", 0.3, {"res": R, "ttl": h.ttl, "ticket": False}, blocked)
    h.call("c", "C", "enqueue", 0.31, {"res": R, "ttl": h.ttl}, {"ok": True, "applied": True}, 0.6)
    h.ev(3.0, "C", "exit")
    h.records([1], [1])
    (violation,) = check_history(h.events).violations
    assert violation.invariant == "grant-progress"
    assert "2.090s" in violation.message  # from its reply (0.91) to its exit, not from 0.501


def test_op_exactly_once() -> None:
    h = correct()
    h.final("S", [["A.1", 1], ["A.1", 1], ["B.1", 2]], 3, POINTER)
    assert "op-exactly-once" in broken(h)


def test_outcome_honesty() -> None:
    h = correct()
    h.check("B", 2, 0.9, deadline=1.5)
    h.put("B", "S", 2, "B.3", 0.9001, base_len=2, error="StaleToken")
    h.final("S", [["A.1", 1], ["B.1", 2], ["B.3", 2]], 3, POINTER)
    assert broken(h) == ["outcome-honesty"]


def test_pointer_monotonic() -> None:
    h = correct()
    h.latest("B", "S", 1.05, 1, "obj-A.3", "sha-a")  # after epoch 2 was visible
    assert broken(h) == ["pointer-monotonic"]


def test_pointer_sealed() -> None:
    h = correct()
    h.latest("B", "S", 1.05, 2, "obj-nobody", "sha-nobody")
    assert broken(h) == ["pointer-sealed"]


def test_restore_monotonic() -> None:
    h = correct()
    h.ev(1.2, "verify", "backup", t0=1.19)
    h.ev(1.5, "verify", "restore", t0=1.4, available=True, epochs=[10])
    h.grant("C", 5, 1.6)  # above every grant, not above the floor 10 seen before the restore
    h.records([1, 2, 5], [1, 2])
    assert broken(h) == ["restore-monotonic"]


def test_diagnostics_match() -> None:
    h = correct()
    h.records([1], [1, 2])
    assert broken(h) == ["diagnostics-match"]


def test_diagnostics_match_a_renewal_failure_report_of_unknown_outcome_may_be_missing() -> None:
    """Found by a release check: a holder sent its report and was killed before the reply
    (its connection blackholed): the coordinator may or may not have recorded it."""
    h = correct()
    h.call("c", "B", "report", 0.8, {"res": R, "epoch": 2, "kind": "renewal-failed"}, None)
    h.ev(0.81, "verify", "kill", target="B")
    assert "diagnostics-match" not in broken(h)
    h.call(
        "c",
        "B",
        "report",
        0.85,
        {"res": R, "epoch": 2, "kind": "renewal-failed"},
        {"ok": True, "applied": True},
    )
    assert "diagnostics-match" in broken(h)  # one certainly applied, and not recorded


def test_diagnostics_match_a_grant_whose_reply_was_lost_on_a_real_connection_may_be_recorded() -> (
    None
):
    """Found by the release check through fenced serve: a cut connection lost the replies of a
    worker's grant requests (outcome unknown, ``applied`` null); one had granted epoch 3, which
    the coordinator recorded and no reply showed."""

    def with_records(lost_reply: bool) -> list[str]:
        h = correct()
        h.events = [e for e in h.events if e["ev"] != "records"]
        if lost_reply:
            unknown = {"ok": False, "applied": None, "error": "OutcomeUnknown"}
            h.call("c", "C", "try_grant", 1.2, {"res": R, "ttl": h.ttl, "rid": "r-c"}, unknown)
        h.records([1, 2, 3], [1, 2])
        return broken(h)

    assert "diagnostics-match" not in with_records(lost_reply=True)
    assert "diagnostics-match" in with_records(lost_reply=False)


def test_diagnostics_match_a_lease_known_only_from_a_replayed_grant_counts_its_release() -> None:
    """Found by the release check through fenced serve: every reply to C's grant request was
    lost on a cut connection; its retry with the same request id was answered with the grant,
    replayed. C released that lease, and the coordinator recorded the release."""
    h = correct()
    h.events = [e for e in h.events if e["ev"] != "records"]
    unknown = {"ok": False, "applied": None, "error": "OutcomeUnknown"}
    h.call("c", "C", "try_grant", 1.6, {"res": R, "ttl": h.ttl, "rid": "r-c"}, unknown)
    h.grant("C", 3, 1.65, replayed=True, expires_in=0.9)
    h.release("C", 3, 1.8)
    h.records([1, 2, 3], [1, 2, 3])
    assert broken(h) == []


def test_diagnostics_match_a_write_of_unknown_outcome_may_have_been_rejected() -> None:
    """Found by the release check through fenced serve: a write in flight when its worker was
    cut off (and then killed) reached the store after the heal and was rejected as stale; no
    reply ever showed that rejection."""

    def with_rejection(unknown_write: bool) -> list[str]:
        h = correct()
        if unknown_write:
            send = {"store": "S", "res": R, "epoch": 1, "key": "chain", "op_id": "A.9"}
            h.call("s", "A", "put", 0.352, {**send, "base_len": 1, "retry": 0}, None)
        stale = {"kind": "rejected", "epoch": 1, "detail": {"presented": 1, "reason": "stale"}}
        h.ev(9.2, "verify", "records", source="store:S", records=[stale])
        return broken(h)

    assert "diagnostics-match" not in with_rejection(unknown_write=True)
    assert "diagnostics-match" in with_rejection(unknown_write=False)


def test_diagnostics_match_a_renewal_that_fails_after_its_holder_left_needs_no_report() -> None:
    """Found by a run at 8 jobs: a renewal whose request was delayed past its holder's release
    was sent as the worker closed its coordinator, and failed: no holder saw that failure."""
    h = correct()
    h.ev(1.15, "B", "unhold", epoch=2, error=None)
    failed = {"ok": False, "applied": False, "error": "ConfigurationError"}
    h.call("c", "B", "renew", 1.2, {"res": R, "epoch": 2, "ttl": h.ttl}, failed)
    assert "diagnostics-match" not in broken(h)
    h.call("c", "B", "renew", 0.75, {"res": R, "epoch": 2, "ttl": h.ttl}, failed)
    assert "diagnostics-match" in broken(h)  # this one failed while B held epoch 2: unreported


def test_every_invariant_has_a_test() -> None:
    tested = {
        name.removeprefix("test_").replace("_", "-")
        for name in globals()
        if name.startswith("test_")
    }
    missing = [name for name in INVARIANTS if not any(t.startswith(name) for t in tested)]
    assert not missing


# -- small parts ------------------------------------------------------------------------------


def test_recorder_lines_survive_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    recorder = Recorder(path, "w")
    recorder.emit("one", x=1)
    recorder.emit("two")
    recorder.close()
    with open(path, "a") as stream:
        stream.write('{"t": 1, "ev": "torn"')  # a process killed in the middle of a write
    assert [e["ev"] for e in read_history(path)] == ["one", "two"]


def test_mutant_names_are_checked_and_not_public() -> None:
    with pytest.raises(ValueError, match="unknown mutant"):
        seeded.chosen(["no-such-defect"])
    assert {m.name for m in CATALOGUE} == seeded.DEFECTS
    import fenced

    assert not hasattr(fenced, "mutants")


PG = "postgresql://verify@127.0.0.1:5432/fenced"
ONLY_SQLITE = {"release-without-owner", "epoch-reuse"}
ONLY_POSTGRES = {"pg-grant-read-committed"}
ONLY_ETCD = {"etcd-grant-no-revision-compare"}
SQLITE_AND_POSTGRES = {"renew-revives-expired"}
NOT_ON_SQLITE = ONLY_POSTGRES | ONLY_ETCD
NOT_ON_POSTGRES = ONLY_SQLITE | ONLY_ETCD
NOT_ON_ETCD = ONLY_SQLITE | ONLY_POSTGRES | SQLITE_AND_POSTGRES
SERVE = "http://127.0.0.1:8080"
NOT_ON_SERVE = NOT_ON_ETCD | ONLY_ETCD


def _not_applicable(target: Target) -> set[str]:
    return {m.name for m in CATALOGUE if m.not_applicable(target) is not None}


def test_each_defect_declares_where_it_applies() -> None:
    assert _not_applicable(Target()) == NOT_ON_SQLITE
    assert _not_applicable(Target("sqlite:////tmp/x.db")) == NOT_ON_SQLITE
    assert _not_applicable(Target(PG)) == NOT_ON_POSTGRES
    assert _not_applicable(Target("postgres://verify@127.0.0.1:5432/fenced")) == NOT_ON_POSTGRES
    assert _not_applicable(Target("etcd://127.0.0.1:2379,127.0.0.1:22379")) == NOT_ON_ETCD
    assert _not_applicable(Target("etcds://127.0.0.1:2379")) == NOT_ON_ETCD
    # the client's defects apply to every coordinator, fenced serve's too
    assert "waiter-keeps-place" not in _not_applicable(Target("http://127.0.0.1:8080"))
    # check-then-write lives in the file store: n/a only when no role is a file store
    assert _not_applicable(Target(PG, {"S": PG, "M": PG + "2"})) == NOT_ON_POSTGRES | {
        "check-then-write"
    }
    assert _not_applicable(
        Target(None, {"S": "sqlite:////srv/a.db", "M": "sqlite:////srv/b.db"})
    ) == NOT_ON_SQLITE | {"check-then-write"}
    assert _not_applicable(Target(None, {"S": PG})) == NOT_ON_SQLITE  # M: a fresh file store
    assert _not_applicable(Target(None, {"S": "sqlite:////srv/a.db", "M": "file:///m"})) == (
        NOT_ON_SQLITE
    )
    # a store served over HTTP runs its backend in the fenced serve process: no store defect
    served = Target(SERVE, {"S": f"{SERVE}/stores/s", "M": f"{SERVE}/stores/m"})
    store_defects = set(seeded.STORE_DEFECTS)
    assert _not_applicable(served) == NOT_ON_SERVE | store_defects
    (reason,) = {m.not_applicable(served) for m in CATALOGUE if m.name in store_defects}
    assert reason is not None and "fenced serve process" in reason
    # one served role is enough to leave the other seedable
    assert _not_applicable(Target(SERVE, {"S": f"{SERVE}/stores/s"})) == NOT_ON_SERVE


def test_an_inapplicable_defect_is_shown_as_na_and_is_no_failure() -> None:
    (mutant,) = [m for m in CATALOGUE if m.name == "epoch-reuse"]
    result = hunt(mutant, Target("etcd://127.0.0.1:2379"), seed=1)  # nothing runs, no server
    assert result.status == "n/a"
    assert result.schedules == 0
    assert not result.failed
    assert result.not_applicable is not None and "etcd" in result.not_applicable
    (caught_one,) = [m for m in CATALOGUE if m.name == "no-fence-check"]
    caught = MutantResult(caught_one, caught=True, invariants=["largest-seen"], schedules=1)
    missed = MutantResult(caught_one, schedules=8)
    assert (caught.status, caught.failed, missed.status, missed.failed) == (
        "caught",
        False,
        "not caught",
        True,
    )

    text = plain_mutants([caught, result])
    assert "epoch-reuse" in text and "n/a" in text and result.not_applicable in text
    assert text.splitlines()[-1] == "mutants: 1 of 1 caught, 1 n/a (no hook in this target)"
    document = json.loads(to_json("t", None, None, [caught, result], ok=True))
    rows = {row["mutant"]: row for row in document["mutants"]}
    assert rows["epoch-reuse"]["status"] == "n/a"
    assert rows["epoch-reuse"]["caught"] is None
    assert rows["epoch-reuse"]["not_applicable"] == result.not_applicable
    assert rows["no-fence-check"]["status"] == "caught"
    assert rows["no-fence-check"]["caught"] is True


@pytest.mark.timeout(60)
def test_cli_mutants_shows_na_and_exits_0_when_no_defect_applies(tmp_path: Path) -> None:
    strict, monotonic = f"sqlite:///{tmp_path / 's.db'}", f"sqlite:///{tmp_path / 'm.db'}"
    open_store(strict, mode="strict").close()
    open_store(monotonic, mode="monotonic").close()
    done = _fenced(
        *("--mutants", "--mutant", "check-then-write", "--json"),
        *("--store", strict, "--store", monotonic),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads(done.stdout)
    assert document["ok"] is True
    (row,) = document["mutants"]
    assert row["status"] == "n/a"
    assert "file" in row["not_applicable"]

    plain = _fenced(
        *("--mutants", "--mutant", "check-then-write"), *("--store", strict, "--store", monotonic)
    )
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "check-then-write          n/a" in plain.stdout

    refused = _fenced(
        *("--random", "1", "--mutant", "check-then-write"),
        *("--store", strict, "--store", monotonic),
    )
    assert refused.returncode == 2
    assert "--mutant check-then-write does not apply here" in refused.stderr


# -- real processes ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_cases_pass_on_the_embedded_backend() -> None:
    rows = run_cases(Target())
    assert [row.number for row in rows] == [case.number for case in CASES]
    for row in rows:
        assert row.status == "pass", (row.number, row.observed, row.violations)
        assert row.observed


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_short_randomized_run_keeps_every_invariant() -> None:
    summary = run_random(3, 101, Target(), duration=3.0, restores=True)
    failures = [(r.schedule.seed, r.report.violations) for r in summary.failed]
    assert summary.ok, failures
    totals = summary.totals()
    assert totals["operations"] > 0
    assert totals["faults"] > 0
    assert totals["grants"] >= 3


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("profile", sorted({m.profile for m in CATALOGUE}))
def test_the_correct_program_keeps_every_invariant_under_each_mutant_profile(
    profile: str,
) -> None:
    # A profile designed to expose a defect must not expose anything in a correct build:
    # the self-stops inside a store's critical section, the pauses that outlast the lease.
    summary = run_random(1, 900, Target(), duration=3.0, profile=PROFILES[profile])
    assert summary.ok, [(r.schedule.seed, r.report.violations) for r in summary.failed]
    assert summary.totals()["grants"] >= 2


EMBEDDED = [m for m in CATALOGUE if m.not_applicable(Target()) is None]
"""The seeded defects that apply to the embedded coordinator and stores (the others are hunted
against PostgreSQL and etcd: tests/verify/test_verify_postgres.py, test_verify_etcd.py)."""


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed", [500, 7001])
@pytest.mark.parametrize("mutant", EMBEDDED, ids=[m.name for m in EMBEDDED])
def test_every_mutant_is_caught(mutant: Any, seed: int) -> None:
    # The same budget for every defect, and any seed: each one's profile is designed to expose
    # it in (nearly) every schedule (50 seeds of `fenced verify --mutants` are in the docs).
    result = hunt(mutant, Target(), seed=seed, budget=DEFAULT_BUDGET, duration=3.0)
    assert result.caught, f"{mutant.name} survived {result.schedules} schedules"
    assert result.invariants


def _fenced(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fenced", "verify", *args],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_case_json() -> None:
    done = _fenced("--case", "7b", "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["ok"] is True
    (row,) = document["cases"]
    assert row["number"] == "7b"
    assert row["status"] == "pass"
    assert "StaleToken" in row["observed"]
    assert document["random"] is None


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_cli_failing_schedule_prints_seed_replay_and_history(tmp_path: Path) -> None:
    done = _fenced(
        *("--random", "3", "--seed", "77", "--duration", "3"),
        *("--profile", "storm", "--mutant", "epoch-reuse", "--keep-history", str(tmp_path)),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED schedule seed 7" in done.stdout
    assert "replay:  fenced verify --random 1 --seed 7" in done.stdout
    assert "--profile storm --mutant epoch-reuse" in done.stdout
    history = next(line for line in done.stdout.splitlines() if "history:" in line)
    kept = Path(history.split("history:")[1].strip())
    assert kept.exists()
    assert kept.parent == tmp_path


@pytest.mark.timeout(30)
def test_cli_usage_errors() -> None:
    assert _fenced("--random", "0").returncode == 2
    assert _fenced("--mutant", "nonsense", "--random", "1").returncode == 2
    assert _fenced("--case", "9").returncode == 2
    assert _fenced("--coordinator", "memory://x").returncode == 2


@pytest.mark.timeout(60)
def test_case_6_never_restores_a_coordinator_given_by_url(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'mine.db'}"
    (row,) = run_cases(Target.create(url), only=["6"])
    assert row.status == "unavailable"
    assert row.passed is None
    assert "not" in row.observed


# -- the asyncio face ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_cases_pass_with_workers_on_the_asyncio_face() -> None:
    """``fenced verify --api async``: the same cases, the workers' coordinator and stores are
    fenced.aio (renewals by the event loop's scheduler task, AsyncStore on its worker)."""
    rows = fenced.verify.run(api="async")
    assert [row.number for row in rows] == [case.number for case in CASES]
    for row in rows:
        assert row.status == "pass", (row.number, row.observed, row.violations)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_short_randomized_run_on_the_asyncio_face_keeps_every_invariant() -> None:
    summary = run_random(3, 201, Target(api="async"), duration=3.0, restores=True)
    assert summary.ok, [(r.schedule.seed, r.report.violations) for r in summary.failed]
    totals = summary.totals()
    assert totals["faults"] > 0 and totals["grants"] >= 3


@pytest.mark.timeout(30)
def test_cli_api_async_refuses_the_seeded_defects_and_unknown_faces() -> None:
    refused = _fenced("--api", "async", "--mutants")
    assert refused.returncode == 2 and "--api async" in refused.stderr
    assert _fenced("--api", "trio").returncode == 2
    with pytest.raises(fenced.ConfigurationError):
        fenced.verify.run(api="trio")
