"""The seven cases of ``fenced verify``: each a scripted run of real worker processes.

Every case starts worker processes (``python -m fenced.verify._worker``, command mode), drives
them step by step, injects its fault — a real SIGKILL or SIGSTOP/SIGCONT, or a lost or delayed
reply injected on the worker's wire (:mod:`fenced.verify._faults`) — and returns a
:class:`~fenced.verify._table.Row` of the practice table: the case, the invariant, the component
that enforces it, the failure assumption, the recovery action, and the **observed** result (what
was rejected, by whom, with which epochs). A case passes only if the observed behaviour is the
documented one *and* the history checker finds no violation in the case's recorded history.

1. crash while owning the lease (SIGKILL);
2. long pause past the TTL (SIGSTOP/SIGCONT) with a write in flight;
3. lost renewal response (applied at the coordinator, the reply never arrives);
4. delayed release from an old owner after a new owner acquired;
5. storage timeout after a successful write (the reply is lost; the retry with the same op id
   learns the outcome; nothing is applied twice);
6. restoration of coordinator state from a backup taken before later grants
   (:mod:`fenced.coordinator._restore`; on an embedded coordinator that verify created, otherwise
   the row says "not available" — neither a pass nor a failure, and shown as such);
7. an old write that arrives before the new owner's first write, (a) in a monotonic store
   (accepted: ordered publication only) and (b) in a strict store (rejected: the successor
   installed its epoch when it acquired).
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from fenced.verify._checker import check_history
from fenced.verify._processes import Run, RunFailed, WorkerProcess
from fenced.verify._recorder import Event, read_history
from fenced.verify._schedule import backup_coordinator, collect_final, restore_coordinator
from fenced.verify._table import Row
from fenced.verify._target import Target
from fenced.verify._worker import WorkerConfig

__all__ = ["CASES", "CASE_TTL", "Case", "run_cases"]

CASE_TTL = 1.0
"""Lease ttl of the case workers, in seconds."""


class CaseUnavailable(Exception):
    """The case cannot run on this target (restore: a coordinator verify did not create, or not
    an embedded one); the message says why."""


@dataclass
class Env:
    """What a case script gets: the run, the URLs, the resource, the ttl."""

    run: Run
    coordinator: str
    stores: dict[str, str]
    resource: str
    ttl: float
    mutants: list[str]
    restorable: bool = False
    """True if the coordinator is the case's own (it may be backed up and restored)."""
    api: str = "sync"
    """The face the workers use (``fenced verify --api``)."""
    checks: list[tuple[str, bool]] = field(default_factory=list)

    def worker(self, name: str) -> WorkerProcess:
        """Start a command-mode worker (its strict handoff installs each epoch at store S)."""
        config = WorkerConfig(
            name=name,
            history="",
            coordinator=self.coordinator,
            resource=self.resource,
            stores=self.stores,
            fence=["S"],
            ttl=self.ttl,
            margin=round(self.ttl * 0.15, 4),
            mode="command",
            wait=10 * self.ttl,
            api=self.api,
        )
        return self.run.spawn(config, self.mutants)

    def expect(self, claim: str, ok: bool) -> bool:
        """Record one expectation of the case."""
        self.checks.append((claim, ok))
        return ok

    def hold(self, worker: WorkerProcess) -> int:
        done = worker.call("hold", timeout=30 + 10 * self.ttl)
        if done.get("outcome") != "ok":
            raise RunFailed(f"{worker.name} could not acquire: {done.get('error')}")
        return int(done["epoch"])

    def reply(self, done: Event, op: str) -> Event:
        """The last ``s.reply``/``c.reply`` of ``op`` by ``done``'s worker before ``done``."""
        for event in reversed(self.run.tail.events):
            if event is done:
                continue
            mine = event["w"] == done["w"] and event["ev"].endswith(".reply")
            if mine and event["op"] == op and float(event["t"]) <= float(done["t"]):
                return event
        raise RunFailed(f"no {op} reply of {done['w']} recorded")

    def mark(self) -> int:
        self.run.tail.poll()
        return len(self.run.tail.events)


def _rejection(reply: Event) -> str:
    error = reply.get("error") or reply.get("true_error")
    if "presented" in reply:
        return f"{error} (presented epoch {reply['presented']}, floor {reply['floor']})"
    return str(error)


# -- the cases -------------------------------------------------------------------------------


def crash(env: Env) -> str:
    a, b = env.worker("A"), env.worker("B")
    epoch_a = env.hold(a)
    first = a.call("rmw", store="S")
    env.expect("A's write with its lease was accepted", first.get("outcome") == "ok")
    a.kill()
    killed = time.monotonic()
    epoch_b = env.hold(b)
    waited = time.monotonic() - killed
    second = b.call("rmw", store="S")
    version = env.reply(second, "put").get("version")
    env.expect(f"B got a larger epoch ({epoch_b} > {epoch_a})", epoch_b > epoch_a)
    env.expect("B's write was accepted and extended A's", version == 2)
    return (
        f"A held epoch {epoch_a}, wrote, and was killed (SIGKILL) without releasing; B was "
        f"granted epoch {epoch_b} {waited:.2f}s later, once A's lease had expired at the "
        f"coordinator (ttl {env.ttl:g}s), installed it at S and wrote version {version} on top "
        "of A's write"
    )


def pause(env: Env) -> str:
    a, b = env.worker("A"), env.worker("B")
    epoch_a = env.hold(a)
    a.call("rmw", store="S")
    pending = a.send("rmw", store="S", pause=True)
    a.wait_stopped()
    stopped = time.monotonic()
    epoch_b = env.hold(b)
    took_over = time.monotonic() - stopped
    written = b.call("rmw", store="S")
    a.resume()
    late = a.done(pending)
    reply = env.reply(late, "put")
    checked = a.call("check")
    env.expect("B's write was accepted", written.get("outcome") == "ok")
    env.expect(
        f"A's late write was rejected with StaleToken ({epoch_a} < {epoch_b})",
        late.get("outcome") == "rejected"
        and reply.get("error") == "StaleToken"
        and reply.get("presented") == epoch_a
        and reply.get("floor") == epoch_b,
    )
    env.expect("A's next check() raised LeaseLost", checked.get("outcome") == "lost")
    return (
        f"A (epoch {epoch_a}) was stopped with SIGSTOP after its lease check, its write "
        f"computed but not sent; B acquired epoch {epoch_b} {took_over:.2f}s later, installed it "
        f"at S and wrote; A resumed and sent its write: store S rejected it with "
        f"{_rejection(reply)}; A's next check() raised LeaseLost ({checked.get('state')})"
    )


def _check_until(worker: WorkerProcess, wanted: Callable[[Event], bool], seconds: float) -> Event:
    """The worker's ``check``, asked again every 10 ms for up to ``seconds`` until ``wanted``;
    the last answer either way."""
    answer = worker.call("check")
    until = time.monotonic() + seconds
    while not wanted(answer) and time.monotonic() < until:
        time.sleep(0.01)
        answer = worker.call("check")
    return answer


def lost_renewal(env: Env) -> str:
    a, b = env.worker("A"), env.worker("B")
    epoch_a = env.hold(a)
    a.call("arm", target="coord", call="renew", fault="lose_reply")
    a.call("arm", target="coord", call="renew", fault="unavailable", times=3)
    since = env.mark()
    lost = env.run.wait_for(
        lambda e: e["w"] == "A" and e["ev"] == "c.reply" and e.get("fault") == "lose_reply",
        10 * env.ttl,
        "A's renewal with a lost reply",
        watch=a,
        since=since,
    )
    # A reply is recorded as it arrives; the lease keeper applies it a moment later.
    checked = _check_until(a, lambda c: c.get("state") == "uncertain", 0.2 * env.ttl)
    busy = b.call("acquire_nowait")
    recovered = env.run.wait_for(
        lambda e: e["w"] == "A" and e["ev"] == "c.reply" and e["op"] == "renew" and bool(e["ok"]),
        10 * env.ttl,
        "A's next successful renewal",
        watch=a,
        since=since,
    )
    again = _check_until(a, lambda c: c.get("outcome") == "ok", env.ttl)
    uncertain = checked.get("outcome") == "lost" and checked.get("state") == "uncertain"
    env.expect("the renewal took effect at the coordinator", lost.get("applied") is True)
    env.expect("A, uncertain, refused to start new work", uncertain)
    env.expect(
        f"the coordinator still had A's lease: B's acquire was Busy (epoch {epoch_a})",
        busy.get("outcome") == "busy" and busy.get("epoch") == epoch_a,
    )
    env.expect("A was HELD again after a successful renewal", again.get("outcome") == "ok")
    gap = float(recovered["t"]) - float(lost["t"])
    return (
        f"A's renewal of epoch {epoch_a} was applied by the coordinator but its reply was lost "
        f"(OutcomeUnknown): A's lease went {checked.get('state', '?').upper()} and check() "
        f"refused new work; B's acquire meanwhile was Busy (holder {busy.get('holder')}, epoch "
        f"{busy.get('epoch')}, {float(busy.get('remaining') or 0):.2f}s left); after "
        f"{gap:.2f}s a retry succeeded and A was {str(again.get('state')).upper()} again; its "
        "local deadline never counted from the lost reply (the checker verified every deadline)"
    )


def delayed_release(env: Env) -> str:
    a, b, c = env.worker("A"), env.worker("B"), env.worker("C")
    epoch_a = env.hold(a)
    a.call("arm", target="coord", call="release", fault="delay_request", delay=2.0 * env.ttl)
    leaving = a.send("unhold")
    epoch_b = env.hold(b)
    left = a.done(leaving, timeout=15 + 4 * env.ttl)
    release = env.reply(left, "release")
    granted = env.reply(b.call("check"), "try_grant")
    other = c.call("acquire_nowait")
    still = b.call("check")
    arrived = float(release["t"])
    env.expect(
        "the release arrived after B's grant",
        arrived > float(granted["t"]),
    )
    env.expect("the coordinator refused A's late release", release.get("released") is False)
    env.expect(
        f"B kept its lease: C's acquire was Busy (epoch {epoch_b})",
        other.get("outcome") == "busy" and other.get("epoch") == epoch_b,
    )
    env.expect("B was still HELD", still.get("outcome") == "ok")
    return (
        f"A's release of epoch {epoch_a} was delayed on the wire by {2.0 * env.ttl:g}s; A's "
        f"lease expired and B acquired epoch {epoch_b}; the release reached the coordinator "
        f"{arrived - float(granted['t']):.2f}s after B's grant: the coordinator compared owner "
        f"and epoch and refused it (released={release.get('released')}); C's acquire was Busy "
        f"(holder {other.get('holder')}, epoch {other.get('epoch')}); B still HELD"
    )


def storage_timeout(env: Env) -> str:
    a, b = env.worker("A"), env.worker("B")
    epoch_a = env.hold(a)
    a.call("arm", target="S", call="put", fault="lose_reply")
    first = a.call("rmw", store="S")
    applied = env.reply(first, "put")
    retried = a.call("retry")
    answer = env.reply(retried, "put")
    a.pause()
    epoch_b = env.hold(b)
    b.call("rmw", store="S")
    a.resume()
    late = a.call("retry")
    late_answer = env.reply(late, "put")
    version = applied.get("version")
    env.expect(
        "the first attempt took effect but its caller got OutcomeUnknown",
        first.get("outcome") == "unknown" and applied.get("applied") is True,
    )
    env.expect(
        f"the retry with the same op id returned the recorded outcome (version {version})",
        retried.get("outcome") == "ok" and answer.get("version") == version,
    )
    env.expect(
        "after a newer owner installed its epoch, the retry still returned it (not StaleToken)",
        late.get("outcome") == "ok" and late_answer.get("version") == version,
    )
    return (
        f"A's put with op id (epoch {epoch_a}) was applied by store S as version {version}; its "
        "reply was lost (OutcomeUnknown); A's retry with the same op id returned version "
        f"{answer.get('version')} and applied nothing; A was then paused, B acquired epoch "
        f"{epoch_b}, installed it and wrote; A's second retry still answered version "
        f"{late_answer.get('version') or late_answer.get('error')} "
        "(the op id is looked up before the fence check): the write landed exactly once"
    )


def restore(env: Env) -> str:
    if not env.coordinator.startswith("sqlite:"):
        raise CaseUnavailable(
            f"not available for {env.coordinator.split(':', 1)[0]}: fenced backup/restore "
            "covers the embedded coordinator; restore other coordinators with their own tools "
            "and 'fenced restore --advance' (docs/operations.md)"
        )
    if not env.restorable:
        raise CaseUnavailable(
            "not run on a coordinator given with --coordinator: a restore advances the epochs "
            "of all its resources and ends all its leases; run 'fenced verify' without "
            "--coordinator to verify restore on a coordinator of its own"
        )
    a, b, c = (env.worker(name) for name in "ABC")
    epoch_a = env.hold(a)
    a.call("rmw", store="S")
    a.call("unhold")
    backup = env.run.workdir / "coordinator.backup"
    backup_coordinator(env.run, env.coordinator, backup)
    epoch_b = env.hold(b)
    b.call("rmw", store="S")
    b.call("unhold")
    epoch_c = env.hold(c)
    c.call("rmw", store="S")
    pending = c.send("rmw", store="S", pause=True)
    c.wait_stopped()
    stopped = time.monotonic()
    restore_coordinator(env.run, backup, env.coordinator, epochs=[epoch_c])
    d = env.worker("D")  # a process started after the restore, on the restored coordinator
    epoch_d = env.hold(d)
    written = d.call("rmw", store="S")
    time.sleep(max(0.0, stopped + 1.5 * env.ttl - time.monotonic()))  # C's lease is long gone
    c.resume()
    stale = env.reply(c.done(pending), "put")
    env.expect(f"the grant after the restore is above {epoch_c}", epoch_d > epoch_c)
    env.expect("its write was accepted", written.get("outcome") == "ok")
    env.expect("the pre-restore holder's write was rejected", stale.get("applied") is False)
    return (
        f"granted {epoch_a}, backed up, granted {epoch_b} and {epoch_c} (which wrote), restored "
        f"the backup: the next grant was epoch {epoch_d} (> {epoch_c}) and its write was "
        f"accepted; the pre-restore holder of {epoch_c} was rejected: {_rejection(stale)}"
    )


def _old_write_first(env: Env, store: str) -> tuple[int, int, Event, Event]:
    a, b = env.worker("A"), env.worker("B")
    epoch_a = env.hold(a)
    a.call("rmw", store=store)
    pending = a.send("rmw", store=store, pause=True)
    a.wait_stopped()
    epoch_b = env.hold(b)
    a.resume()
    late = env.reply(a.done(pending), "put")
    first = env.reply(b.call("rmw", store=store), "put")
    return epoch_a, epoch_b, late, first


def old_write_monotonic(env: Env) -> str:
    epoch_a, epoch_b, late, first = _old_write_first(env, "M")
    env.expect("the old write (arriving first) was accepted", late.get("applied") is True)
    env.expect("the new owner's first write was accepted after it", first.get("applied") is True)
    after = env.run.workers["A"].call("rmw", store="M", unchecked=True)
    rejected = env.reply(after, "put")
    env.expect(
        "after the new owner's first write, the old owner's next write was rejected",
        rejected.get("error") == "StaleToken" and rejected.get("floor") == epoch_b,
    )
    return (
        f"monotonic store M: B acquired epoch {epoch_b} (nothing installed at M); A's write with "
        f"epoch {epoch_a}, delayed past A's lease by SIGSTOP, arrived before B's first write and "
        f"was ACCEPTED (largest seen was {epoch_a}: ordered publication, not exclusion); B's "
        f"first write then moved the floor to {epoch_b} and A's next write was rejected: "
        f"{_rejection(rejected)}"
    )


def old_write_strict(env: Env) -> str:
    epoch_a, epoch_b, late, first = _old_write_first(env, "S")
    env.expect(
        f"the old write was rejected although B had not written yet ({epoch_a} < {epoch_b})",
        late.get("error") == "StaleToken" and late.get("floor") == epoch_b,
    )
    env.expect("the new owner's first write was accepted", first.get("applied") is True)
    return (
        f"strict store S: B acquired epoch {epoch_b} and installed it at S before any write; A's "
        f"write with epoch {epoch_a}, delayed past A's lease by SIGSTOP, arrived before B's "
        f"first write and was rejected: {_rejection(late)}; B's first write was accepted"
    )


@dataclass(frozen=True)
class Case:
    """One case: its practice-table text and its script."""

    number: str
    name: str
    invariant: str
    component: str
    assumption: str
    recovery: str
    script: Callable[[Env], str]

    def row(self) -> Row:
        return Row(
            self.number,
            self.name,
            self.invariant,
            self.component,
            self.assumption,
            self.recovery,
        )


CASES: tuple[Case, ...] = (
    Case(
        "1",
        "crash while owning the lease (SIGKILL)",
        "the next owner gets a larger epoch, and only after the dead owner's lease expired",
        "coordinator: expiry by its own clock, durable epoch per grant",
        "the holder dies at any instant and never releases",
        "wait for expiry (ttl); the next owner acquires epoch+1 and installs it",
        crash,
    ),
    Case(
        "2",
        "long pause past the TTL (SIGSTOP) with a write in flight",
        "once a newer epoch is installed, a stale owner's write is rejected",
        "strict store: floor checked atomically with each write",
        "a process can stop for any time between its lease check and its write",
        "the late write fails (StaleToken); check() raises LeaseLost; re-acquire",
        pause,
    ),
    Case(
        "3",
        "lost renewal response",
        "the holder never counts on more lease than granted; UNCERTAIN is never HELD",
        "holder runtime: deadline from the send time, UNCERTAIN state",
        "a renewal is applied but its reply is lost",
        "refuse new work while UNCERTAIN, retry; LOST at the local deadline",
        lost_renewal,
    ),
    Case(
        "4",
        "delayed release from an old owner after a new owner acquired",
        "a release only ends the lease of its own owner and epoch",
        "coordinator: compare owner and epoch, delete, in one statement",
        "a release request can arrive arbitrarily late",
        "none: the late release is refused; the new owner keeps its lease",
        delayed_release,
    ),
    Case(
        "5",
        "storage timeout after a successful write",
        "an op id takes effect at most once; a retry learns the first outcome",
        "store: op-id record in the write's transaction, looked up before the fence",
        "a write is applied but its reply is lost (timeout)",
        "retry with the same op id: the recorded outcome comes back, nothing reapplied",
        storage_timeout,
    ),
    Case(
        "6",
        "restoration of coordinator state from an older backup",
        "after a restore every new epoch is above every epoch issued before it",
        "coordinator restore: epochs advanced past the old state",
        "the coordinator's state is restored from a backup older than its last grants",
        "restore advances every epoch; stale holders are rejected by the stores",
        restore,
    ),
    Case(
        "7a",
        "old write arrives before the new owner's first write (monotonic store)",
        "largest-seen: accepted epochs never decrease (ordered publication only)",
        "monotonic store: largest-seen rule",
        "the new owner has not written or installed its epoch at this store yet",
        "none at the store; use strict mode (install on acquire) for exclusion",
        old_write_monotonic,
    ),
    Case(
        "7b",
        "old write arrives before the new owner's first write (strict store)",
        "install-then-equal: only the installed epoch may write",
        "strict store: floor installed by hold(fence=[store]) at acquire",
        "the new owner has not written yet",
        "the old write is rejected (StaleToken); the successor writes normally",
        old_write_strict,
    ),
)
"""The cases, in table order."""


def run_case(
    case: Case, target: Target, workdir: Path, index: int, mutants: Iterable[str] = ()
) -> tuple[Row, Path]:
    """Run one case in ``workdir``; returns its row and its history file."""
    row = case.row()
    began = time.monotonic()
    rundir = workdir / f"case-{case.number}"
    run = Run(rundir, f"case-{case.number}", proxied=target.proxied)
    env = Env(
        run,
        target.coordinator_url(rundir),
        target.store_urls(rundir, index),
        f"verify/case{case.number}-{secrets.token_hex(3)}",
        CASE_TTL,
        sorted(mutants),
        target.restorable,
        target.api,
    )
    modes = {"S": "strict", "M": "monotonic"}
    run.rec.emit(
        "meta",
        kind="case",
        case=case.number,
        resource=env.resource,
        ttl=env.ttl,
        overrun=target.lease_overrun(env.ttl),
        stores={role: {"url": url, "mode": modes[role]} for role, url in env.stores.items()},
        coordinator=env.coordinator,
        mutants=env.mutants,
        api=env.api,
    )
    failure: str | None = None
    try:
        row.observed = case.script(env)
        for worker in list(run.workers.values()):
            if worker.alive() and not worker.paused:
                worker.send("exit")
        for worker in run.workers.values():
            if worker.wait_exit(15.0) is None:
                worker.kill()
        collect_final(run, env.coordinator, env.stores, env.resource)
    except CaseUnavailable as unavailable:
        row.status, row.observed = "unavailable", str(unavailable)
        run.close()
        row.seconds = time.monotonic() - began
        return row, run.history
    except (RunFailed, Exception) as error:  # a broken case is a failed case, with the reason
        failure = f"{type(error).__name__}: {error}" if not isinstance(error, RunFailed) else None
        row.observed = (row.observed or "") + f"the case did not complete: {error}"
    finally:
        run.close()
    report = check_history(read_history(run.history))
    row.violations = [f"{v.invariant}: {v.message}" for v in report.violations]
    unmet = [claim for claim, ok in env.checks if not ok]
    if unmet:
        row.observed += " | NOT AS EXPECTED: " + "; ".join(unmet)
    complete = "did not complete" not in row.observed and failure is None
    row.status = "pass" if complete and not unmet and report.ok else "fail"
    row.seconds = time.monotonic() - began
    return row, run.history


def run_cases(
    target: Target,
    *,
    mutants: Iterable[str] = (),
    only: Iterable[str] | None = None,
    keep_history: Path | None = None,
    progress: Callable[[Row], None] | None = None,
) -> list[Row]:
    """Run the cases (all, or those numbered in ``only``); returns the rows in table order.

    Histories of failed cases are kept (copied to ``keep_history``, or left in a kept temporary
    directory named in the row); with ``keep_history`` every history is copied there.
    """
    chosen = set(only) if only is not None else None
    rows: list[Row] = []
    workdir = Path(tempfile.mkdtemp(prefix="fenced-verify-cases-"))
    kept: Path | None = keep_history
    try:
        for index, case in enumerate(CASES):
            if chosen is not None and case.number not in chosen:
                continue
            row, history = run_case(case, target, workdir, index, mutants)
            if row.status == "fail" or (keep_history is not None and history.exists()):
                if kept is None:
                    kept = Path(tempfile.mkdtemp(prefix="fenced-verify-failed-"))
                kept.mkdir(parents=True, exist_ok=True)
                if history.exists():
                    shutil.copyfile(history, kept / history.name)
                    if row.status == "fail":
                        row.observed += f" (history kept: {kept / history.name})"
            rows.append(row)
            if progress is not None:
                progress(row)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows
