"""The history checker: verifies a recorded run against the invariants of fenced.

Input: the events of one history file (:func:`fenced.verify._recorder.read_history`) of one
resource, read by :class:`~fenced.verify._history.History` (which documents the events and the
clock their times are read on). Output: a :class:`~fenced.verify._report.Report` with every
violation (each names one of :data:`INVARIANTS`; a single one fails the run) and the run's figures
(operations, faults, stale writes rejected).

Reasoning about time is conservative in both directions, so that a correct system never fails:
a call took effect somewhere between its ``send`` (written when the request is forwarded) and
its reply; a call whose outcome the wrapper could not know (``applied`` null, or no reply because
the worker was killed) may or may not have taken effect, and the checker assumes whichever is
more lenient for the rule at hand.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from fenced.verify import _progress as progress
from fenced.verify._history import Call, Grant, History, granted_for
from fenced.verify._recorder import Event
from fenced.verify._report import INVARIANTS, Report, Violation

__all__ = [
    "INVARIANTS",
    "REJECTIONS",
    "SCHEDULING_TOLERANCE",
    "Report",
    "Violation",
    "check_history",
]

SCHEDULING_TOLERANCE = 0.05
"""Seconds between a worker's lease check and its send that the OS scheduler may add without an
injected pause (the send-after-deadline rule allows this much; a longer gap needs a pause)."""
REJECTIONS = frozenset({"StaleToken", "NotInstalled", "ForeignToken"})
"""Errors that say a store rejected stale (or foreign) authority."""
_DEFINITE = REJECTIONS | {"Unavailable", "VersionConflict", "IdempotencyConflict", "Busy"}
_EPS = 0.002
"""Seconds of slack in each comparison of a recorded time with a deadline or an expiry: a
violation is reported only when the gap is larger."""


def _first_try(send: Event) -> bool:
    """A first attempt sent after a lease check (not a reconciliation, not marked unchecked)."""
    return not send.get("retry") and not send.get("unchecked")


class _Checker:
    """Checks every invariant on one :class:`History` and collects the verdict in a report."""

    def __init__(self, history: History) -> None:
        self.history = history
        self.report = Report()

    # -- the coordinator ------------------------------------------------------------------------

    def check_grants(self) -> None:
        firsts = [
            g for g in self.history.grants if not g.call.reply or not g.call.reply.get("replayed")
        ]
        by_epoch: dict[int, list[Grant]] = defaultdict(list)
        for grant in firsts:
            by_epoch[grant.epoch].append(grant)
        for epoch, grants in sorted(by_epoch.items()):
            if len(grants) > 1:
                who = ", ".join(f"{g.call.worker} at {g.call.sent:.3f}" for g in grants)
                self.report.add("token-unique", f"epoch {epoch} was granted {len(grants)} times: "
                                f"to {who}", grants[1].call.sent)  # fmt: skip
        # Real-time order: a grant sent after another one's reply must have a larger epoch.
        done = sorted((g.call.replied or 0.0, g.epoch, g.call.worker) for g in firsts)
        ends = [d[0] for d in done]
        best: list[tuple[int, str]] = []
        for _, epoch, worker in done:
            best.append(max(best[-1], (epoch, worker)) if best else (epoch, worker))
        for grant in firsts:
            index = bisect.bisect_left(ends, grant.call.sent) - 1
            if index >= 0 and best[index][0] >= grant.epoch:
                earlier, worker = best[index]
                self.report.add(
                    "token-monotonic",
                    f"{grant.call.worker} was granted epoch {grant.epoch} after {worker}'s grant "
                    f"of epoch {earlier} had completed",
                    grant.call.sent,
                )
        self._check_exclusive(firsts)

    def _check_exclusive(self, firsts: list[Grant]) -> None:
        epochs = sorted(self.history.leases)
        for grant in firsts:
            index = bisect.bisect_left(epochs, grant.epoch) - 1
            if index < 0:
                continue
            previous = self.history.leases[epochs[index]]
            if previous.epoch != grant.epoch - 1 and self.history.unknown_grants:
                continue  # an epoch in between may have been granted to a killed worker
            granted_by = grant.call.replied
            assert granted_by is not None
            if any(r.sent <= granted_by for r in previous.releases):
                continue
            if any(previous.grant.call.sent <= e["t"] <= granted_by for e in self.history.restores):
                continue
            expiry = max(previous.definite)
            if granted_by < expiry - _EPS:
                self.report.add(
                    "exclusive-grant",
                    f"epoch {grant.epoch} was granted to {grant.call.worker} "
                    f"{expiry - granted_by:.3f}s before epoch {previous.epoch} "
                    f"({previous.grant.call.worker}) could have expired, and it was not released",
                    granted_by,
                )

    def check_holders(self) -> None:
        """holder-deadline and stop-at-deadline."""
        # Per (worker, epoch): (send time, send time + the time granted) of each possibly
        # applied acquire/renew, by send time.
        bases: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
        for grant in self.history.grants:
            end = grant.call.sent + granted_for(grant.call.reply, grant.ttl)
            bases[(grant.call.worker, grant.epoch)].append((grant.call.sent, end))
        ttls = {lease.epoch: lease.grant.ttl for lease in self.history.leases.values()}
        for call in self.history.calls:
            if call.op == "renew" and call.applied is not False and call.epoch is not None:
                ttl = ttls.get(call.epoch, float(call.send.get("ttl") or self.history.ttl))
                end = call.sent + granted_for(call.reply, ttl)
                bases[(call.worker, call.epoch)].append((call.sent, end))
        for times in bases.values():
            times.sort()
        last_check: dict[str, Event] = {}
        for event in self.history.events:
            kind = event["ev"]
            if kind in ("lease", "check") and event.get("deadline") is not None:
                worker, epoch = str(event["w"]), int(event["epoch"])
                based = bases.get((worker, epoch), [])
                index = bisect.bisect_right(based, (float(event["t"]), math.inf)) - 1
                deadline = float(event["deadline"])
                if index < 0:
                    self.report.add(
                        "holder-deadline",
                        f"{worker} reports a deadline for epoch {epoch} without any grant",
                        event["t"],
                    )
                elif deadline > based[index][1] + _EPS:
                    sent, end = based[index]
                    self.report.add(
                        "holder-deadline",
                        f"{worker}'s local deadline for epoch {epoch} is "
                        f"{deadline - end:.3f}s later than the last applied request's send "
                        f"time + the time granted ({end - sent:g}s)",
                        event["t"],
                    )
                if kind == "check":
                    last_check[worker] = event
            elif kind == "s.send" and event["op"] in ("put", "publish") and _first_try(event):
                self._check_send(event, last_check.get(str(event["w"])))

    def _check_send(self, send: Event, check: Event | None) -> None:
        worker, epoch = str(send["w"]), int(send["epoch"])
        t = float(send.get("issued") or send["t"])  # when the worker sent it (before wire delays)
        if check is None or int(check["epoch"]) != epoch or check.get("state") != "held":
            self.report.add(
                "stop-at-deadline",
                f"{worker} sent a {send['op']} with epoch {epoch} without a HELD check first",
                t,
            )
            return
        deadline, checked = float(check["deadline"]), float(check["t"])
        call = self.history.by_id.get(str(send["call"]))
        if call is not None and self.history.cut_in_flight(call, deadline):
            self.report.stats["writes held past the deadline by a partition"] += 1
        if t <= deadline + _EPS or t - checked <= SCHEDULING_TOLERANCE:
            return
        if self.history.paused_between(worker, checked, t):
            self.report.stats["mutations sent after a pause"] += 1
            return
        self.report.add(
            "stop-at-deadline",
            f"{worker} sent a {send['op']} with epoch {epoch} {t - deadline:.3f}s after its "
            "local deadline, with no injected pause or host suspend since its check",
            t,
        )

    def check_owner_ops(self) -> None:
        """compare-owner: releases and renewals only of the live lease."""
        granted_at = sorted((g.call.replied or 0.0, g.epoch) for g in self.history.grants)
        ends = [g[0] for g in granted_at]
        newest: list[int] = []
        for _, epoch in granted_at:
            newest.append(max(newest[-1], epoch) if newest else epoch)
        for call in self.history.calls:
            if call.op not in ("renew", "release") or not call.applied or call.epoch is None:
                continue
            index = bisect.bisect_left(ends, call.sent) - 1
            if index >= 0 and newest[index] > call.epoch:
                self.report.add(
                    "compare-owner",
                    f"{call.worker}'s {call.op} of epoch {call.epoch} took effect after epoch "
                    f"{newest[index]} had been granted",
                    call.sent,
                )
                continue
            lease = self.history.leases.get(call.epoch)
            if lease is None:
                continue
            before = [c for c in lease.maybe if c is not call and c.sent < call.sent]
            if not before or any(c.replied is None for c in before):
                continue
            latest = max(c.replied or 0.0 for c in before) + lease.grant.ttl + self.history.overrun
            if call.sent > latest + _EPS:
                self.report.add(
                    "compare-owner",
                    f"{call.worker}'s {call.op} of epoch {call.epoch} took effect "
                    f"{call.sent - latest:.3f}s after that lease had certainly expired",
                    call.sent,
                )

    def check_progress(self) -> None:
        """grant-progress: a free resource with a waiter is granted within the bound, unless a
        fault explains the delay (:mod:`fenced.verify._progress`)."""
        limit = progress.bound(self.history)
        for stall in progress.stalls(self.history):
            self.report.add(
                "grant-progress",
                f"the resource was free for {stall.length:.3f}s while {', '.join(stall.waiters)} "
                f"waited in line, and nothing was granted (bound: ttl + margin = {limit:.3f}s; "
                "no pause, kill, cut or delayed request explains it)",
                stall.start,
            )

    # -- the stores -----------------------------------------------------------------------------

    def check_stores(self) -> None:
        stores: dict[str, dict[str, Any]] = dict(self.history.meta.get("stores") or {})
        for name in sorted(stores):
            self._check_store(name, str(stores[name].get("mode", "strict")))

    def _check_store(self, name: str, mode: str) -> None:
        calls = [c for c in self.history.calls if c.send.get("store") == name]
        acks: list[tuple[float, int, str]] = []
        by_op: dict[str, list[Call]] = defaultdict(list)
        fences: list[Call] = []
        for call in calls:
            if call.op == "fence":
                fences.append(call)
            else:
                by_op[str(call.send["op_id"])].append(call)
            if call.applied and call.learned is not None and call.epoch is not None:
                acks.append((call.learned, call.epoch, f"{call.worker}'s {call.op}"))
        acks.sort()
        ack_times = [a[0] for a in acks]
        finals = [e for e in self.history.events if e["ev"] == "final" and e.get("store") == name]
        highest: list[tuple[int, str]] = []
        for _, epoch, what in acks:
            highest.append(max(highest[-1], (epoch, what)) if highest else (epoch, what))
        floors = [e for e in self.history.events if e["ev"] == "s.read" and e.get("store") == name]
        for event in floors + finals:
            if event.get("op", "floor") != "floor" or event.get("floor") is None:
                continue
            started = float(event.get("t0") or event["t"])
            index = bisect.bisect_left(ack_times, started) - 1
            if index >= 0 and highest[index][0] > int(event["floor"]):
                seen, what = highest[index]
                self.report.add(
                    "largest-seen",
                    f"{event['w']} read floor {event['floor']} from store {name} after it had "
                    f"acknowledged epoch {seen} ({what}): its floor went backwards",
                    started,
                )
        for call in calls:  # a rejection reports the floor: it must not be below an ack
            floor = None if call.reply is None else call.reply.get("floor")
            if floor is None or call.applied is not False:
                continue
            index = bisect.bisect_left(ack_times, call.sent) - 1
            if index >= 0 and highest[index][0] > int(floor):
                seen, what = highest[index]
                self.report.add(
                    "largest-seen",
                    f"store {name} rejected {call.worker}'s {call.op} with floor {floor} after it "
                    f"had acknowledged epoch {seen} ({what}): its floor went backwards",
                    call.sent,
                )
        final = finals[-1] if finals else None
        chain: list[list[Any]] = list((final or {}).get("chain") or [])
        in_chain = {str(entry[0]) for entry in chain}
        for op_id, attempts in by_op.items():
            accepted = any(c.applied for c in attempts) or op_id in in_chain
            if not accepted:
                continue
            first = min(attempts, key=lambda c: c.sent)
            epoch = int(first.send["epoch"])
            index = bisect.bisect_left(ack_times, first.sent) - 1
            if index >= 0 and highest[index][0] > epoch:
                seen, what = highest[index]
                self.report.add(
                    "largest-seen",
                    f"store {name} ({mode}) accepted {first.worker}'s {first.op} {op_id} with "
                    f"epoch {epoch} although it had acknowledged epoch {seen} ({what}) before it "
                    "was sent",
                    first.sent,
                )
            if mode == "strict":
                last = max(c.replied or c.sent for c in attempts)
                installed = any(
                    f.epoch == epoch and f.applied is not False and f.sent <= last for f in fences
                )
                if not installed:
                    self.report.add(
                        "install-then-equal",
                        f"strict store {name} accepted {first.op} {op_id} with epoch {epoch}, "
                        "which was never installed",
                        first.sent,
                    )
        if mode == "strict":
            self._check_fences(name, fences, acks)
        self._check_outcomes(name, by_op, in_chain)
        if final is not None:
            self._check_chain(name, final, by_op)
        self._check_pointer(name, by_op, final)

    def _check_fences(
        self, name: str, fences: list[Call], acks: list[tuple[float, int, str]]
    ) -> None:
        for fence in fences:
            if not fence.applied or fence.epoch is None:
                continue
            higher = [a for a in acks if a[0] < fence.sent and a[1] > fence.epoch]
            if higher:
                self.report.add(
                    "largest-seen",
                    f"store {name} installed epoch {fence.epoch} for {fence.worker} after it had "
                    f"acknowledged epoch {higher[0][1]} ({higher[0][2]})",
                    fence.sent,
                )

    def _check_outcomes(self, name: str, by_op: dict[str, list[Call]], in_chain: set[str]) -> None:
        """outcome-honesty and op-exactly-once (publications) for one store."""
        for op_id, attempts in by_op.items():
            took_effect = op_id in in_chain or any(c.applied for c in attempts)
            for call in attempts:
                told = call.told
                if took_effect and told in _DEFINITE and call.reply is not None:
                    if call.reply.get("fault") in ("unavailable", "lose_reply"):
                        continue  # injected: the caller was told what the wire said
                    if told == "Unavailable" and len(attempts) > 1:
                        continue  # "this attempt did nothing": true of a retry
                    self.report.add(
                        "outcome-honesty",
                        f"store {name} told {call.worker} that {call.op} {op_id} failed ({told}), "
                        "but it took effect",
                        call.replied,
                    )
            objects = {
                str(c.reply.get("object_id"))
                for c in attempts
                if c.reply is not None and c.applied and c.reply.get("object_id")
            }
            if len(objects) > 1:
                self.report.add(
                    "op-exactly-once",
                    f"publication {op_id} took effect {len(objects)} times on store {name}",
                )

    def _check_chain(self, name: str, final: Event, by_op: dict[str, list[Call]]) -> None:
        chain: list[list[Any]] = list(final.get("chain") or [])
        version = int(final.get("version") or 0)
        seen: Counter[str] = Counter(str(entry[0]) for entry in chain)
        for op_id, count in seen.items():
            if count > 1:
                self.report.add(
                    "op-exactly-once", f"write {op_id} appears {count} times in store {name}"
                )
        if len(chain) != version:
            self.report.add(
                "chain-integrity",
                f"store {name} accepted {version} writes but its final state holds {len(chain)}: "
                f"{version - len(chain)} accepted write(s) lost",
            )
        positions = {str(entry[0]): index for index, entry in enumerate(chain, start=1)}
        previous = 0
        for index, (op_id, epoch) in enumerate(chain, start=1):
            sends = [c for c in by_op.get(str(op_id), []) if c.op == "put"]
            if not sends:
                self.report.add(
                    "chain-integrity", f"store {name} holds write {op_id} that nobody sent"
                )
                continue
            send = sends[0].send
            if int(send["epoch"]) != int(epoch):
                self.report.add(
                    "chain-integrity",
                    f"store {name} holds write {op_id} with epoch {epoch}, sent with "
                    f"{send['epoch']}",
                )
            if int(send.get("base_len", -1)) != index - 1:
                self.report.add(
                    "chain-integrity",
                    f"write {op_id} ({sends[0].worker}, epoch {epoch}) read a state of "
                    f"{send.get('base_len')} writes but was accepted as write {index} of store "
                    f"{name}: it did not extend the previously accepted state (lost update)",
                    sends[0].sent,
                )
            if int(epoch) < previous:
                self.report.add(
                    "largest-seen",
                    f"store {name} accepted write {op_id} with epoch {epoch} after a write with "
                    f"epoch {previous}",
                )
            previous = max(previous, int(epoch))
        for op_id, attempts in by_op.items():
            for call in attempts:
                if call.op != "put" or call.reply is None or call.reply.get("version") is None:
                    continue
                if not call.applied:
                    continue
                position = positions.get(op_id)
                if position != int(call.reply["version"]):
                    where = "is missing" if position is None else f"is write {position}"
                    self.report.add(
                        "chain-integrity",
                        f"{call.worker}'s write {op_id} was acknowledged as version "
                        f"{call.reply['version']} of store {name}, but {where} in its final "
                        "state (lost update)",
                        call.replied,
                    )

    def _check_pointer(self, name: str, by_op: dict[str, list[Call]], final: Event | None) -> None:
        publishes = [c for calls in by_op.values() for c in calls if c.op == "publish"]
        by_object: dict[str, Call] = {}
        by_sha: dict[str, list[Call]] = defaultdict(list)
        for call in publishes:
            by_sha[str(call.send.get("sha"))].append(call)
            if call.reply is not None and call.reply.get("object_id"):
                by_object[str(call.reply["object_id"])] = call
        floors: list[tuple[float, int, str]] = []
        for call in publishes:
            if call.reply is not None and call.reply.get("ok") and call.applied:
                floors.append(
                    (float(call.reply["t"]), int(call.send["epoch"]), f"{call.worker}'s ack")
                )
        observations: list[tuple[float, float, int | None, str]] = []
        reads = [e for e in self.history.events if e["ev"] == "s.read" and e.get("store") == name]
        if final is not None and "pointer" in final:
            reads.append({**final, "op": "latest", "t0": final["t"]})
        for event in reads:
            t0, t1 = float(event.get("t0") or event["t"]), float(event["t"])
            if event["op"] == "latest":
                pointer = event.get("pointer")
                if pointer is None:
                    observations.append((t0, t1, None, f"{event['w']} saw no pointer"))
                    continue
                source = by_object.get(str(pointer["object_id"])) or next(
                    iter(by_sha.get(str(pointer["sha"]), [])), None
                )
                if source is None or int(source.send["epoch"]) != int(pointer["epoch"]):
                    self.report.add(
                        "pointer-sealed",
                        f"{event['w']} saw the pointer of store {name} at object "
                        f"{pointer['object_id']} (epoch {pointer['epoch']}), which no publication "
                        "with that epoch created",
                        t1,
                    )
                    continue
                observations.append((t0, t1, int(pointer["epoch"]), f"{event['w']}'s latest"))
            elif event["op"] == "read":
                if event.get("error"):
                    self.report.add(
                        "pointer-sealed",
                        f"{event['w']} could not read the publication of store {name}: "
                        f"{event['error']}",
                        t1,
                    )
                    continue
                if event.get("sha") is None:
                    observations.append((t0, t1, None, f"{event['w']} read nothing"))
                    continue
                sources = by_sha.get(str(event["sha"]))
                if not sources:
                    self.report.add(
                        "pointer-sealed",
                        f"{event['w']} read bytes from store {name} that no publication sent",
                        t1,
                    )
                    continue
                epoch = int(sources[0].send["epoch"])
                observations.append((t0, t1, epoch, f"{event['w']}'s read"))
        points = sorted(floors + [(t1, e, what) for _, t1, e, what in observations if e])
        times = [p[0] for p in points]
        best: list[tuple[int, str]] = []
        for _, epoch, what in points:
            best.append(max(best[-1], (epoch, what)) if best else (epoch, what))
        for t0, _, shown_epoch, what in observations:
            index = bisect.bisect_left(times, t0) - 1
            if index >= 0 and (shown_epoch is None or shown_epoch < best[index][0]):
                shown = "nothing" if shown_epoch is None else f"epoch {shown_epoch}"
                self.report.add(
                    "pointer-monotonic",
                    f"{what} of store {name} showed {shown} after epoch {best[index][0]} had been "
                    f"visible ({best[index][1]})",
                    t0,
                )

    # -- restores and diagnostics ---------------------------------------------------------------

    def check_restores(self) -> None:
        for restore in self.history.restores:
            t0 = float(restore.get("t0") or restore["t"])
            before = [g.epoch for g in self.history.grants if (g.call.replied or 0.0) < t0]
            seen = [c.epoch for c in self.history.calls if c.epoch is not None and c.sent < t0]
            known = max(before + seen + [int(x) for x in restore.get("epochs", [])], default=0)
            for grant in self.history.grants:
                if grant.call.sent > float(restore["t"]) and grant.epoch <= known:
                    self.report.add(
                        "restore-monotonic",
                        f"after the restore, {grant.call.worker} was granted epoch {grant.epoch}, "
                        f"not above epoch {known} known before it",
                        grant.call.sent,
                    )

    def check_diagnostics(self) -> None:
        records = [e for e in self.history.events if e["ev"] == "records"]
        if not records:
            self.report.notes.append("no diagnostic records in this history: not compared")
        for event in records:
            source = str(event.get("source"))
            if event.get("unavailable"):
                self.report.notes.append(f"{source} records: {event['unavailable']}")
                continue
            listed: list[dict[str, Any]] = list(event.get("records") or [])
            if source == "coordinator":
                self._match_coordinator(listed)
            elif source.startswith("store:"):
                self._match_store(source[len("store:") :], listed)

    def _match_coordinator(self, records: list[dict[str, Any]]) -> None:
        def mismatch(what: str, recorded: Counter[int], history: Counter[int], slack: int) -> None:
            missing = history - recorded
            extra = recorded - history
            if missing or sum(extra.values()) > slack:
                self.report.add(
                    "diagnostics-match",
                    f"the coordinator's {what} records (epochs {sorted(recorded.elements())}) do "
                    f"not match the history (epochs {sorted(history.elements())})",
                )

        kinds: dict[str, Counter[int]] = defaultdict(Counter)
        for record in records:
            kinds[str(record["kind"])][int(record["epoch"])] += 1
        # A release may grant the lease to the head waiter in its name (a hand-off); a waiter
        # that gives up before it sees that grant releases it when it leaves the queue. So each
        # place in the queue that no seen grant consumed may account for one grant, and each
        # leave for one release, that the history shows no call for.
        queued = sum(1 for call in self.history.calls if call.op == "enqueue")
        consumed = sum(
            1
            for grant in self.history.grants
            if grant.call.send.get("ticket") and not (grant.call.reply or {}).get("replayed")
        )
        leaves = sum(1 for call in self.history.calls if call.op == "leave")
        grants: Counter[int] = Counter()
        slack = self.history.unknown_grants + max(0, queued - consumed)
        for lease in self.history.leases.values():
            fate = self.history.restored_away(lease.grant.call)
            grants[lease.epoch] += fate is False
            slack += fate is None
        mismatch("granted", kinds["granted"], grants, slack)
        releases: Counter[int] = Counter()
        slack = leaves
        for lease in self.history.leases.values():
            for release in lease.releases:
                fate = self.history.restored_away(release)
                releases[lease.epoch] += bool(release.applied) and fate is False
                slack += not release.applied or fate is None
        mismatch("released", kinds["released"], releases, slack)
        reports: Counter[int] = Counter()
        sent: Counter[int] = Counter()
        failures: Counter[int] = Counter()
        # A renewal in flight when its holder left the block (a delayed request sent after the
        # release, failing because the worker closed its coordinator) is seen by no holder.
        left = {
            (str(e["w"]), int(e["epoch"])): float(e["t"])
            for e in self.history.events
            if e["ev"] == "unhold"
        }
        slack = 0
        for call in self.history.calls:
            if call.op == "report" and call.send.get("kind") == "renewal-failed":
                fate = self.history.restored_away(call)
                sent[int(call.send["epoch"])] += 1
                if call.applied is None or fate is None:  # recorded or not: both are right
                    slack += 1
                else:
                    reports[int(call.send["epoch"])] += bool(call.applied) and fate is False
            elif (
                call.op == "renew"
                and call.told not in (None, "LeaseLost")
                and call.epoch
                and (call.replied or 0.0) < left.get((call.worker, call.epoch), float("inf"))
            ):
                failures[call.epoch] += 1
        mismatch("renewal-failed", kinds["renewal-failed"], reports, slack)
        short = failures - sent
        if short and not self.history.killed:
            self.report.add(
                "diagnostics-match",
                f"renewal failures seen by holders were not all reported (epochs "
                f"{sorted(short.elements())})",
            )

    def _match_store(self, name: str, records: list[dict[str, Any]]) -> None:
        recorded: Counter[int] = Counter()
        for record in records:
            if record.get("kind") == "rejected":
                detail = record.get("detail") or {}
                recorded[int(detail.get("presented", record.get("epoch", 0)))] += 1
        history: Counter[int] = Counter()
        # Writes of unknown outcome (no reply, or a lost one) may each have been rejected: a
        # write held by a partition arrives after its sender was killed.
        unknown: Counter[int] = Counter()
        for call in self.history.calls:
            if call.send.get("store") != name or call.epoch is None:
                continue
            if call.applied is None and call.op in ("put", "publish"):
                unknown[call.epoch] += 1
            if call.reply is None:
                continue
            error = call.reply.get("true_error") or call.reply.get("error")
            if call.applied is False and error in REJECTIONS:
                history[call.epoch] += 1
        missing, extra = history - recorded, recorded - history - unknown
        if extra or (missing and not self.history.killed):
            self.report.add(
                "diagnostics-match",
                f"store {name}'s rejected-write records (presented epochs "
                f"{sorted(recorded.elements())}) do not match the rejections in the history "
                f"({sorted(history.elements())})",
            )

    # -- figures --------------------------------------------------------------------------------

    def count(self) -> None:
        stats = self.report.stats
        for call in self.history.calls:
            stats[f"{call.op} calls"] += 1
            stats["operations"] += 1
            if call.reply is None:
                continue
            fault = call.reply.get("fault")
            if fault:
                stats[f"fault {fault}"] += 1
                stats["faults"] += 1
            error = call.reply.get("true_error") or call.reply.get("error")
            if call.op in ("put", "publish") and call.applied is False and error in REJECTIONS:
                stats["stale writes rejected"] += 1
        for event in self.history.events:
            if event["ev"] == "crash":
                stats["worker crashes"] += 1
                self.report.notes.append(f"worker {event['w']} crashed: {event.get('error')}")
            if event["ev"] == "s.read":
                stats["operations"] += 1
                stats["reads"] += 1
            elif event["ev"] in ("pause", "kill", "wire", "partition") or (
                event["ev"] == "restore" and event.get("available")
            ):
                stats[f"fault {event['ev']}"] += 1
                stats["faults"] += 1
        stats["grants"] = len(self.history.leases)

    def run(self) -> Report:
        self.check_grants()
        self.check_holders()
        self.check_owner_ops()
        self.check_progress()
        self.check_stores()
        self.check_restores()
        self.check_diagnostics()
        self.count()
        self.report.violations.sort(key=lambda v: (v.at is None, v.at or 0.0))
        return self.report


def check_history(events: Iterable[Event]) -> Report:
    """Check one history (the events of one run on one resource); see the module docstring."""
    return _Checker(History(list(events))).run()
