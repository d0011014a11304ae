"""Randomized verification: seeded fault schedules of real worker processes, checked afterwards.

One schedule (:class:`Schedule`, drawn entirely from its seed): 2-4 worker processes take leases
on one fresh resource and do read-modify-writes of the chain value and publications in a strict
and a monotonic store, for ``duration`` seconds, while

* each worker's :class:`~fenced.verify._faults.FaultPlan` loses and delays replies and makes
  calls unavailable (coordinator: grants, renewals, releases; stores: installs, writes,
  publications), at seeded rates;
* the :class:`~fenced.verify._nemesis.Nemesis` pauses, kills (and replaces) workers and, if
  asked to and verify created the coordinator, backs it up and restores it, with timing biased
  around TTL boundaries.

Every worker records every call into the one history file; afterwards the verify process
records the final state of both stores and the coordinator's (and stores') diagnostic records,
and :func:`~fenced.verify._checker.check_history` judges the history.

Schedule ``i`` of ``--random N --seed S`` has seed ``S + i``; ``fenced verify --random 1 --seed
S+i`` replays it: the same workers, TTL, fault rates and nemesis plan. The interleaving of real
processes is not reproducible exactly; a replay reproduces the *schedule*, and the kept history
file documents the run that failed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import pickle
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from fenced.coordinator import _restore as restoring
from fenced.coordinator._connect import connect
from fenced.core._errors import ConfigurationError, OutcomeUnknown, Unavailable
from fenced.fence._store import open_store
from fenced.testing.netlab import NetLab
from fenced.verify._checker import Report, check_history
from fenced.verify._members import count_member_faults
from fenced.verify._nemesis import Nemesis, NemesisPlan
from fenced.verify._processes import Run, RunFailed, WorkerProcess
from fenced.verify._recorder import Event, read_history
from fenced.verify._target import Target
from fenced.verify._worker import KEY, PUBLICATION, WorkerConfig, decode_chain

__all__ = [
    "DEFAULT_DURATION",
    "PROFILES",
    "Profile",
    "RandomSummary",
    "Schedule",
    "ScheduleResult",
    "backup_coordinator",
    "collect_final",
    "restore_coordinator",
    "run_random",
    "run_schedule",
]

DEFAULT_DURATION = 4.0
"""Seconds of work per schedule (plus start-up and drain)."""
_T = TypeVar("_T")
PATIENCE = 20.0
"""Seconds verify keeps asking an etcd cluster under member faults for what it needs itself (the
lease overrun, the final records): another schedule's fault may have it electing a leader."""
BASE_RATES = {
    "try_grant": 0.1,
    "renew": 0.2,
    "release": 0.25,
    "fence": 0.05,
    "put": 0.1,
    "publish": 0.1,
    "stop": 0.12,
}
"""Mean probability of a wire fault per call, by operation (scaled per schedule); ``stop``: of a
worker stopping itself with SIGSTOP between its lease check and its send (resumed by the nemesis
after a TTL-biased pause). A profile may add ``reconcile_stop``: of a worker stopping itself
before it asks again about a write of unknown outcome (default: 3 × ``stop``)."""


@dataclass(frozen=True)
class Profile:
    """The fault mix of a schedule: rates, kinds, nemesis tempo, workload.

    ``standard`` is the mix of ``--random``. The focused profiles make one kind of fault
    frequent; ``fenced verify --mutants`` runs each seeded defect under the profile that
    exposes it (see :mod:`fenced.verify._mutants`). A profile changes what happens, never what
    the checker verifies.
    """

    name: str = "standard"
    rates: dict[str, float] = field(default_factory=lambda: dict(BASE_RATES))
    vary: bool = True
    """Scale the rates by a seeded factor in 0.5-1.5 per schedule (capped at 0.9); a profile
    designed to expose one defect keeps the rates it was designed with."""
    kinds: dict[str, float] = field(default_factory=dict)
    """Weights of the wire fault kinds (empty: the default weights of the fault plan)."""
    strike_gap: float = 2.0
    """Mean time between nemesis strikes, in ttl (``math.inf``: the nemesis does not strike;
    it still resumes the workers that stop themselves)."""
    kills: float = 0.15
    """Share of the strikes that kill (the rest pause)."""
    mix: dict[str, float] = field(default_factory=dict)
    idle: float = 1.0
    """Scales the workers' pauses between operations."""
    ops: int = 6
    """At most this many operations per lease."""
    stores: tuple[str, str] | None = None
    """The embedded store kinds of the strict and the monotonic role (None: alternate)."""
    pad: int = 0
    """Bytes of padding per written value (longer write transactions)."""
    long_pauses: bool = False
    """Nemesis pauses mostly outlast the lease (as the pauses of writes in flight do)."""
    outlast: bool = False
    """Every pause a worker starts itself (before a send, or while reconciling a write of
    unknown outcome) outlasts the lease, so that a successor is granted and installs or writes
    its epoch before the stale request arrives (otherwise a quarter of them are shorter)."""
    write_stores: tuple[str, ...] = ()
    """The stores (``S``, ``M``) the workers write to (empty: both). ``("S",)``: only the
    strict store, where every successor installs its epoch, so that every stale write meets a
    newer epoch (a monotonic store sees the successor's epoch only if the successor happened to
    write there first)."""
    commit_stops: float = 0.0
    """Probability that a write to the strict store stops its worker inside the store's
    critical section (checked, not yet committed) for longer than the lease, so that a
    successor is granted and installs its epoch meanwhile (see
    :class:`~fenced.verify._worker.StopInCommit`)."""

    def describe(self) -> str:
        return self.name


def _rates(**overrides: float) -> dict[str, float]:
    return {**BASE_RATES, **overrides}


PROFILES: dict[str, Profile] = {
    profile.name: profile
    for profile in (
        Profile(),
        Profile(
            "in-flight",
            _rates(try_grant=0.0, fence=0.0, put=0.0, publish=0.0, stop=0.8),
            vary=False,
            strike_gap=math.inf,
            mix={"rmw": 0.85, "observe": 0.15},
            outlast=True,
            write_stores=("S",),
        ),
        Profile(
            "storm",
            _rates(stop=0.0),
            strike_gap=0.4,
            kills=0.02,
            idle=0.1,
            ops=40,
            stores=("file", "file"),
            pad=256 * 1024,
            long_pauses=True,
            mix={"rmw": 0.6, "publish": 0.1, "observe": 0.3},
        ),
        Profile(
            "in-commit",
            {op: 0.0 for op in BASE_RATES},
            vary=False,
            strike_gap=math.inf,
            stores=("file", "file"),
            commit_stops=0.8,
            mix={"rmw": 0.85, "observe": 0.15},
            write_stores=("S",),
        ),
        Profile(
            "reply-delays",
            _rates(try_grant=0.9, renew=0.6, stop=0.0),
            vary=False,
            kinds={"delay_reply": 1.0},
            strike_gap=math.inf,
        ),
        Profile(
            "renewal-failures",
            _rates(renew=0.8, stop=0.0),
            vary=False,
            kinds={"unavailable": 1.0, "lose_reply": 1.0},
            strike_gap=math.inf,
            idle=2.0,
            ops=16,  # leases that last through several renewals
        ),
        Profile(
            "late-releases",
            {**{op: 0.0 for op in BASE_RATES}, "release": 1.0},
            vary=False,
            kinds={"delay_request": 1.0},
            strike_gap=1.5,
            kills=0.0,
            long_pauses=True,
        ),
        Profile("expiries", vary=False, strike_gap=1.5, kills=0.3, long_pauses=True),
        Profile(
            "lost-writes",
            # A retry's reply is lost as often as the first one's: 0.4 loses all three retries
            # of a reconciliation (hiding its answer) in 6 % of them.
            _rates(try_grant=0.0, fence=0.0, put=0.4, publish=0.4, stop=0.0, reconcile_stop=1.0),
            vary=False,
            kinds={"lose_reply": 1.0},
            strike_gap=math.inf,
            outlast=True,
            write_stores=("S",),
        ),
        Profile(
            "publications",
            _rates(try_grant=0.0, fence=0.0, put=0.0, publish=0.0, stop=0.7),
            vary=False,
            strike_gap=math.inf,
            mix={"publish": 0.8, "observe": 0.2},
            outlast=True,
            write_stores=("S",),
        ),
        Profile(
            "late-renewals",
            # Renewals that reach the coordinator after their lease expired (delayed; and retried
            # until the deadline: holders check rarely, so a failed renewal does not end the
            # lease at once), and waiters that are late or out of the line then (one that takes
            # the resource first makes the late renewal moot).
            {**{op: 0.0 for op in BASE_RATES}, "renew": 1.0, "try_grant": 0.8},
            vary=False,
            kinds={"delay_request": 1.0, "unavailable": 1.0},
            strike_gap=math.inf,
            idle=20.0,
            ops=16,
        ),
        # Short leases and fresh processes: grants by workers whose view of the resource is
        # stale (another worker was granted and released it since they last read it).
        Profile("handovers", vary=False, strike_gap=1.5, kills=0.3, ops=2),
        Profile(
            "lapses",
            # Every lease lapses (its renewals and its release fail): every waiter is told to
            # retry at the expiry, and they all try to take the resource at once.
            {**{op: 0.0 for op in BASE_RATES}, "renew": 1.0, "release": 1.0},
            vary=False,
            kinds={"unavailable": 1.0},
            strike_gap=math.inf,
        ),
        Profile(
            "give-ups",
            # Half the grant attempts fail: the waiter gives up (and must leave the line).
            {**{op: 0.0 for op in BASE_RATES}, "try_grant": 0.5},
            vary=False,
            kinds={"unavailable": 1.0},
            strike_gap=math.inf,
        ),
    )
}
"""Every fault profile by name."""


@dataclass(frozen=True)
class Schedule:
    """One seeded schedule (see the module docstring)."""

    seed: int
    duration: float
    workers: int
    ttl: float
    margin: float
    rates: dict[str, float]
    nemesis: NemesisPlan
    profile: Profile = field(default_factory=Profile)

    @classmethod
    def draw(
        cls,
        seed: int,
        duration: float = DEFAULT_DURATION,
        *,
        profile: Profile | None = None,
        restores: bool = False,
        restarts: bool = False,
        wire: bool = False,
        partitions: bool = False,
        members: tuple[str, ...] = (),
    ) -> Schedule:
        """The schedule of ``seed``: everything it does is drawn from ``random.Random(seed)``.

        ``members``: the member faults possible (an etcd cluster verify started itself,
        :attr:`Target.member_faults <fenced.verify._target.Target.member_faults>`)."""
        profile = profile or PROFILES["standard"]
        rng = random.Random(seed)
        ttl = rng.choice((0.6, 0.8, 1.0))
        scale = rng.uniform(0.5, 1.5) if profile.vary else 1.0
        cap = 0.9 if profile.vary else 1.0
        rates = {op: round(min(rate * scale, cap), 4) for op, rate in profile.rates.items()}
        plan = NemesisPlan.draw(
            rng,
            duration=duration,
            ttl=ttl,
            gap=profile.strike_gap,
            kills=profile.kills,
            long_pauses=profile.long_pauses,
            restores=restores,
            restarts=restarts,
            wire=wire,
            partitions=partitions,
            members=members,
        )
        workers = rng.randint(2, 4)
        return cls(seed, duration, workers, ttl, round(ttl * 0.2, 4), rates, plan, profile)

    def describe(self) -> str:
        kinds = Counter(a.kind for a in self.nemesis.actions)
        strikes = ", ".join(f"{n} {k}s" for k, n in sorted(kinds.items())) or "no strikes"
        return (
            f"seed {self.seed} ({self.profile.name}): {self.workers} workers, ttl {self.ttl:g}s, "
            f"{self.duration:g}s, {strikes}"
        )


@dataclass
class ScheduleResult:
    """What one schedule did and what the checker said."""

    schedule: Schedule
    report: Report
    history: Path
    elapsed: float
    stores: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.report.ok


def collect_final(
    run: Run, coordinator: str, stores: dict[str, str], resource: str, *, patience: float = 0.0
) -> None:
    """Record the final state of every store and the diagnostic records (after the workers).

    ``patience``: seconds to keep asking a coordinator that is unavailable (an etcd cluster
    whose member another schedule has struck)."""
    for role, url in sorted(stores.items()):
        with open_store(url) as store:
            item = store.get(resource, KEY)
            chain = decode_chain(None if item is None else item.value)
            latest = store.latest(resource, PUBLICATION)
            pointer = None
            if latest is not None:
                pointer = {"epoch": latest.epoch, "object_id": latest.object_id}
                pointer["sha"] = hashlib.sha256(store.read(resource, PUBLICATION)).hexdigest()
            run.rec.emit(
                "final",
                store=role,
                chain=chain,
                version=0 if item is None else item.version,
                pointer=pointer,
                floor=store.floor(resource),
            )
            try:
                records = [r.to_json() for r in store.history(resource)]
            except (ConfigurationError, AttributeError) as error:
                run.rec.emit("records", source=f"store:{role}", unavailable=str(error))
            else:
                run.rec.emit("records", source=f"store:{role}", records=records)

    def read() -> list[dict[str, Any]]:
        with connect(coordinator) as coord:
            return [r.to_json() for r in coord.history(resource)]

    try:
        coordinator_records = _patiently(read, patience)
    except (ConfigurationError, NotImplementedError) as error:
        run.rec.emit("records", source="coordinator", unavailable=str(error))
    else:
        run.rec.emit("records", source="coordinator", records=coordinator_records)


def _patiently(call: Callable[[], _T], patience: float) -> _T:
    """``call()``, called again after an ``Unavailable`` or ``OutcomeUnknown`` for up to
    ``patience`` seconds (a read, or a lease taken and given back: nothing is changed twice)."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return call()
        except (Unavailable, OutcomeUnknown):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def backup_coordinator(run: Run, coordinator: str, dest: Path) -> None:
    """Back up the embedded ``coordinator`` into ``dest`` while the workers run, recorded as a
    ``backup`` event (:func:`fenced.coordinator._restore.backup`)."""
    t0 = run.rec.now()
    with _restore_warnings_hidden():
        restoring.backup(coordinator, dest)
    run.rec.emit("backup", t0=t0)


def restore_coordinator(run: Run, src: Path, coordinator: str, **detail: Any) -> None:
    """Put the backup ``src`` back as ``coordinator``, recorded as a ``restore`` event (with
    ``detail``); a restore that raises is recorded with its error and the error propagates.

    Verification restores **while worker processes run** (``force=True``: a restore otherwise
    refuses while any process has the coordinator open): that is the fault injected. Processes
    that had the database open keep working on the replaced file, invisible to the restored
    coordinator, so callers start fresh workers afterwards and keep only a pre-restore holder
    that is stopped with a write in flight, whose write the stores must reject.
    """
    t0 = run.rec.now()
    try:
        with _restore_warnings_hidden():
            restoring.restore(coordinator, src, force=True)
    except Exception as error:
        run.rec.emit("restore", t0=t0, available=False, error=repr(error))
        raise
    run.rec.emit("restore", t0=t0, available=True, **detail)


@contextlib.contextmanager
def _restore_warnings_hidden() -> Iterator[None]:
    """Hide the warning a restore logs (``fenced.coordinator``): expected here, not news."""
    logger = logging.getLogger("fenced.coordinator")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_schedule(
    schedule: Schedule,
    target: Target,
    workdir: Path,
    *,
    mutants: Iterable[str] = (),
    restores: bool = False,
) -> ScheduleResult:
    """Run ``schedule`` with real processes in ``workdir``; check its history.

    ``restores``: the nemesis backs up and restores the coordinator (only one that
    :attr:`~fenced.verify._target.Target.restorable` allows).
    """
    chosen = sorted(mutants)
    began = time.monotonic()
    rundir = workdir / f"schedule-{schedule.seed}"
    run = Run(rundir, f"schedule-{schedule.seed}", proxied=target.proxied)
    coordinator = target.coordinator_url(rundir)
    stores = target.store_urls(rundir, schedule.seed, schedule.profile.stores)
    resource = f"verify/s{schedule.seed}-{secrets.token_hex(3)}"
    modes = {"S": "strict", "M": "monotonic"}
    patience = PATIENCE if target.members is not None else 0.0
    overrun = _patiently(lambda: target.lease_overrun(schedule.ttl), patience)
    # A leader change restarts the countdown of every etcd lease (member faults change leaders;
    # every schedule of the run shares the cluster, its faults included): the checker's overrun.
    failover = target.failover(schedule.ttl, overrun) if schedule.nemesis.members else 0.0
    run.rec.emit(
        "meta",
        kind="schedule",
        seed=schedule.seed,
        resource=resource,
        ttl=schedule.ttl,
        overrun=round(overrun + failover, 3),
        failover=failover,
        margin=schedule.margin,
        workers=schedule.workers,
        rates=schedule.rates,
        profile=schedule.profile.name,
        mutants=chosen,
        stores={role: {"url": url, "mode": modes[role]} for role, url in stores.items()},
        coordinator=coordinator,
        api=target.api,
    )
    go = rundir / "go"
    incarnations: Counter[int] = Counter()

    def spawn(slot: int) -> WorkerProcess:
        incarnation = incarnations[slot]
        incarnations[slot] += 1
        name = f"w{slot}" + (f".{incarnation}" if incarnation else "")
        config = WorkerConfig(
            name=name,
            history="",
            coordinator=coordinator,
            resource=resource,
            stores=stores,
            fence=["S"],
            ttl=schedule.ttl,
            margin=schedule.margin,
            mode="random",
            seed=schedule.seed * 1000 + slot * 10 + incarnation,
            go=str(go),
            rates=schedule.rates,
            kinds=schedule.profile.kinds,
            mix=schedule.profile.mix,
            idle=schedule.profile.idle,
            ops=schedule.profile.ops,
            pad=schedule.profile.pad,
            write_stores=list(schedule.profile.write_stores),
            commit_stops=schedule.profile.commit_stops,
            api=target.api,
        )
        return run.spawn(config, chosen)

    backup_now: Callable[[], None] | None = None
    restore_now: Callable[[], None] | None = None
    if restores and target.restorable:
        backup_path = rundir / "coordinator.backup"

        def backup_now() -> None:
            backup_coordinator(run, coordinator, backup_path)

        def restore_now() -> None:
            restore_coordinator(run, backup_path, coordinator)

    try:
        if any(action.kind == "partition" for action in schedule.nemesis.actions):
            run.lab = NetLab().start()  # each worker on a host of its own, servers by relays
        slots = {slot: spawn(slot) for slot in range(schedule.workers)}
        waiting = {worker.name for worker in slots.values()}

        def all_ready(event: Event) -> bool:
            # ready: its coordinator and stores are open (a networked store's open may take
            # seconds, which must not come out of the schedule's duration); crash: it never will
            if event["ev"] in ("ready", "crash"):
                waiting.discard(str(event["w"]))
            return not waiting

        run.wait_for(all_ready, 60.0, "the workers to open their coordinator and stores")
        nemesis = Nemesis(
            run,
            schedule.nemesis,
            schedule.ttl,
            slots,
            spawn,
            backup=backup_now,
            restore=restore_now,
            overrun=overrun,
            outlast=schedule.profile.outlast,
            members=target.members if schedule.nemesis.members else None,
        )
        end = nemesis.started + schedule.duration
        temporary = go.with_suffix(".tmp")
        temporary.write_text(repr(end))
        temporary.rename(go)
        while (now := time.monotonic()) < end:
            time.sleep(max(0.001, min(nemesis.tick(), end - now, 0.05)))
        nemesis.calm(time.monotonic() + 6 * schedule.ttl + 10.0)
        nemesis.record_elsewhere()
        collect_final(run, coordinator, stores, resource, patience=patience)
    finally:
        run.close()
        if run.lab is not None:
            run.lab.stop()
    events = read_history(run.history)
    report = check_history(events)
    count_member_faults(events, report.stats)
    return ScheduleResult(schedule, report, run.history, time.monotonic() - began, stores)


@dataclass
class RandomSummary:
    """The outcome of ``--random N --seed S``."""

    seed: int
    results: list[ScheduleResult] = field(default_factory=list)
    kept: dict[int, Path] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failed(self) -> list[ScheduleResult]:
        return [r for r in self.results if not r.ok]

    def totals(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for result in self.results:
            total.update(result.report.stats)
        return total

    def to_json(self, replay: str | None = None) -> dict[str, Any]:
        """The JSON form; ``replay`` is the replay command template (``{seed}`` filled in)."""
        totals = self.totals()
        return {
            "seed": self.seed,
            "schedules": len(self.results),
            "violations": sum(len(r.report.violations) for r in self.results),
            "ok": self.ok,
            "operations": totals["operations"],
            "faults": totals["faults"],
            "stale_writes_rejected": totals["stale writes rejected"],
            "totals": dict(sorted(totals.items())),
            "failed": [
                {
                    "seed": r.schedule.seed,
                    "violations": [v.to_json() for v in r.report.violations],
                    "history": str(self.kept.get(r.schedule.seed, r.history)),
                    "replay": None if replay is None else replay.format(seed=r.schedule.seed),
                }
                for r in self.failed
            ],
        }


def run_random(
    count: int,
    seed: int,
    target: Target,
    *,
    duration: float = DEFAULT_DURATION,
    profile: Profile | None = None,
    mutants: Iterable[str] = (),
    keep_history: Path | None = None,
    restores: bool = False,
    stop_on_failure: bool = False,
    progress: Callable[[ScheduleResult], None] | None = None,
    jobs: int = 1,
) -> RandomSummary:
    """Run schedules ``seed`` … ``seed + count - 1``; keep the history of every failing one.

    Failing histories are copied to ``keep_history`` (or kept in a directory that is not
    removed); with ``keep_history`` every history is copied there. ``restores``: as in
    :func:`run_schedule`.

    ``jobs``: how many schedules run at once. With more than one, each schedule runs in a
    process of its own (:func:`_run_parallel`), isolated from the others as one after another
    would be: its own directory, embedded coordinator and stores (or fresh resource names on
    a networked target), TCP proxies and nemesis. The results are in seed order whatever
    ``jobs``; ``progress`` is called as each schedule finishes. ``stop_on_failure``: no
    schedule starts after one failed; those already running finish and are reported.
    """
    if count < 1:
        raise ConfigurationError("--random needs at least 1 schedule")
    if jobs < 1:
        raise ConfigurationError("--jobs needs J >= 1")
    summary = RandomSummary(seed)
    chosen = list(mutants)
    workdir = Path(tempfile.mkdtemp(prefix="fenced-verify-"))
    failures_dir: Path | None = keep_history

    def draw(index: int) -> Schedule:
        return Schedule.draw(
            seed + index,
            duration,
            profile=profile,
            restores=restores and target.restorable,
            wire=target.proxied,
            partitions=target.partitions,
            members=target.member_faults,
        )

    def finished(result: ScheduleResult) -> None:
        """Keep its history if it failed (or every one is kept), drop its directory."""
        nonlocal failures_dir
        if keep_history is not None or not result.ok:
            if failures_dir is None:
                failures_dir = Path(tempfile.mkdtemp(prefix="fenced-verify-failed-"))
            failures_dir.mkdir(parents=True, exist_ok=True)
            kept = failures_dir / result.history.name
            shutil.copyfile(result.history, kept)
            summary.kept[result.schedule.seed] = kept
        shutil.rmtree(result.history.parent, ignore_errors=True)
        if progress is not None:
            progress(result)

    try:
        if jobs == 1:
            for index in range(count):
                result = run_schedule(
                    draw(index), target, workdir, mutants=chosen, restores=restores
                )
                summary.results.append(result)
                finished(result)
                if stop_on_failure and not result.ok:
                    break
        else:
            summary.results = _run_parallel(
                [draw(index) for index in range(count)],
                target,
                workdir,
                jobs=jobs,
                mutants=chosen,
                restores=restores,
                stop_on_failure=stop_on_failure,
                finished=finished,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return summary


def _run_parallel(
    schedules: list[Schedule],
    target: Target,
    workdir: Path,
    *,
    jobs: int,
    mutants: list[str],
    restores: bool,
    stop_on_failure: bool,
    finished: Callable[[ScheduleResult], None],
) -> list[ScheduleResult]:
    """Run ``schedules`` at most ``jobs`` at a time, each in a process of its own
    (:class:`_Job`); the results in the order of ``schedules``. ``finished`` is called (in this
    process) as each one finishes.

    Nothing a schedule uses is shared with another one running at the same time: its
    directory (``schedule-<seed>`` under ``workdir``) holds its history, embedded coordinator
    and stores; its resource name is fresh; its workers' TCP proxies listen on ports of their
    own and run in its process, as do its nemesis (which signals only its own workers) and the
    logger that a restore quietens. If one fails to run (an exception), the others are
    interrupted (they kill their workers) and the exception is raised here.
    """
    results: dict[int, ScheduleResult] = {}
    running: dict[int, _Job] = {}
    launched = 0
    stopping = False
    setup = _fenced_logging()
    try:
        while running or (launched < len(schedules) and not stopping):
            while launched < len(schedules) and not stopping and len(running) < jobs:
                job = _Job(schedules[launched], target, workdir, mutants, restores, setup)
                running[launched] = job
                launched += 1
            ended = [index for index, job in sorted(running.items()) if job.ended()]
            if not ended:
                time.sleep(0.05)
            for index in ended:
                result = running.pop(index).result()
                results[index] = result
                finished(result)
                stopping = stopping or (stop_on_failure and not result.ok)
    finally:
        for job in running.values():
            job.interrupt()
        for job in running.values():
            job.wait_stopped()
    return [results[index] for index in sorted(results)]


class _Job:
    """One schedule run by :func:`run_schedule` in a fresh Python process of its own
    (``python -c`` :func:`_job_main`): its arguments and its result (a :class:`ScheduleResult`
    or the exception it raised) go through two files of its ``.job`` directory.

    A fresh process (not forked from this one, whose threads — a progress display's — must not
    be copied; not :mod:`multiprocessing`, which would import the caller's main module again)
    starts like the worker processes do: ``sys.executable`` finds fenced. It leads a session
    of its own, with its workers: Ctrl-C or Ctrl-Z at the terminal reach this process only,
    which interrupts it (:meth:`interrupt`: it kills its workers); if it does not end,
    :meth:`wait_stopped` kills its whole process group.
    """

    def __init__(
        self,
        schedule: Schedule,
        target: Target,
        workdir: Path,
        mutants: list[str],
        restores: bool,
        setup: _LoggerSetup,
    ) -> None:
        self.seed = schedule.seed
        self.dir = workdir / f"schedule-{schedule.seed}.job"
        self.dir.mkdir()
        arguments = (schedule, target, workdir, mutants, restores, setup)
        (self.dir / "in").write_bytes(pickle.dumps(arguments))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _JOB_MAIN, str(self.dir)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )

    def ended(self) -> bool:
        return self.proc.poll() is not None

    def result(self) -> ScheduleResult:
        """Its result; raises what :func:`run_schedule` raised, or :class:`RunFailed` if the
        process ended without a result."""
        try:
            outcome = pickle.loads((self.dir / "out").read_bytes())  # noqa: S301 - see _job_main
        except (OSError, EOFError, pickle.UnpicklingError) as error:
            raise RunFailed(
                f"the process of schedule {self.seed} ended ({self.proc.returncode}) "
                f"without a result: {error}"
            ) from None
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
        if isinstance(outcome, BaseException):
            raise outcome
        assert isinstance(outcome, ScheduleResult)
        return outcome

    def interrupt(self) -> None:
        """SIGINT: the schedule stops and kills its workers (:func:`_interrupted`)."""
        if not self.ended():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)

    def wait_stopped(self, timeout: float = 60.0) -> None:
        """Wait for it to end; after ``timeout``, SIGKILL it and its workers."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


_JOB_MAIN = "from fenced.verify._schedule import _job_main; _job_main()"

_LoggerSetup = list[tuple[str, int, bool, list[str | None]]]


def _fenced_logging() -> _LoggerSetup:
    """How this process logs fenced's records: each configured ``fenced`` logger's name,
    level, propagation and the formats of its handlers that write to stderr (the command line
    prints warnings as ``fenced: …`` lines and quietens some loggers)."""
    loggers = logging.Logger.manager.loggerDict
    setup: _LoggerSetup = []
    for name in ["fenced", *sorted(name for name in loggers if name.startswith("fenced."))]:
        logger = loggers.get(name)
        if not isinstance(logger, logging.Logger):
            continue  # never used, or a placeholder: nothing configured
        formats = [
            None if handler.formatter is None else handler.formatter._fmt
            for handler in logger.handlers
            if isinstance(handler, logging.StreamHandler)
            and handler.stream
            in (sys.stderr, sys.__stderr__)  # (a live display replaces sys.stderr)
        ]
        setup.append((name, logger.level, logger.propagate, formats))
    return setup


def _job_main() -> None:
    """The process of a :class:`_Job`: run its schedule, write its outcome."""
    jobdir = Path(sys.argv[1])
    # written by _Job, read by _job_main and back, in a directory of mkdtemp's (mode 0700)
    arguments = pickle.loads((jobdir / "in").read_bytes())  # noqa: S301
    schedule, target, workdir, mutants, restores, setup = arguments
    for name, level, propagate, formats in setup:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.propagate = propagate
        for fmt in formats:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter(fmt))
            logger.addHandler(handler)
    signal.signal(signal.SIGINT, _interrupted)
    outcome: ScheduleResult | Exception
    try:
        outcome = run_schedule(schedule, target, workdir, mutants=mutants, restores=restores)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as error:
        error.add_note(f"in the process of schedule {schedule.seed}:\n{traceback.format_exc()}")
        outcome = error
    try:
        data = pickle.dumps(outcome)
    except Exception:
        data = pickle.dumps(RunFailed(f"schedule {schedule.seed}: {outcome!r}"))
    temporary = jobdir / "out.tmp"
    temporary.write_bytes(data)
    temporary.rename(jobdir / "out")


def _interrupted(signum: int, frame: FrameType | None) -> None:
    """The first SIGINT (from :meth:`_Job.interrupt`) stops the schedule, whose ``finally``
    kills its workers; later ones must not interrupt that."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt
