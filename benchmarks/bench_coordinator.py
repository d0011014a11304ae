"""The embedded coordinator against the raw durable-commit limits and redis-py's Lock.

    .venv/bin/python benchmarks/bench_coordinator.py [--rounds N] [--seconds S]

Three measurements, each side by side with its baselines *in the same run*, interleaved round by
round (A, B, B, A, …) after one discarded warm-up round (see ../shared/anchors/README.md for why
only same-run ratios mean anything on a shared machine):

1. uncontended acquire+release cycles/s (one client, one resource) — fenced vs a 4 KiB
   pwrite+fdatasync loop, a raw SQLite ``BEGIN IMMEDIATE; UPDATE; COMMIT`` at synchronous=FULL in
   WAL mode, a raw SQLite lease row (acquire + release, two FULL commits) and redis-py's Lock;
2. handoff latency: a holder process releases -> a waiter blocked in acquire in another process
   holds (time.monotonic in both processes, same host);
3. fairness: 8 processes contend for one resource (acquire with wait=None, empty critical section,
   release) — total rate, per-process shares, Jain's index.

Everything runs in a temporary directory on the same disk as this repository (``--dir``) and
against a private redis-server on a free loopback port, stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import platform
import random
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import redis
from _common import (
    RedisServer,
    fmt_rate,
    fmt_ratio,
    fmt_time,
    jain,
    median,
    percentile,
    print_table,
    verdict,
)

import fenced

R_CYCLE = "bench/cycle"
R_HANDOFF = "bench/handoff"
R_FAIR = "bench/fair"
TTL = 30.0

FENCED = "fenced"
REDIS = "redis-py Lock"
FDATASYNC = "4 KiB pwrite+fdatasync"
SQLITE_UPDATE = "SQLite UPDATE (WAL, FULL)"
SQLITE_LEASE = "SQLite lease row (2 FULL commits)"


# -- 1. uncontended cycles, in this process ---------------------------------------------------
class CycleImpl(Protocol):
    name: str
    what: str

    def acquire(self) -> None: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


class FencedCycle:
    name = FENCED
    what = "fenced.connect(sqlite) acquire(ttl=30, wait=0) + release"

    def __init__(self, url: str) -> None:
        self._coord = fenced.connect(url)
        self._lease: fenced.Lease | None = None

    def acquire(self) -> None:
        self._lease = self._coord.acquire(R_CYCLE, ttl=TTL, wait=0)

    def release(self) -> None:
        if self._lease is None or not self._coord.release(self._lease):
            raise RuntimeError("fenced: release() did not release")

    def close(self) -> None:
        self._coord.close()


class RedisCycle:
    name = REDIS
    what = "redis.Redis().lock(name, timeout=30): acquire(blocking=False) + release"

    def __init__(self, port: int) -> None:
        self._client = redis.Redis(host="127.0.0.1", port=port)
        self._lock = self._client.lock("bench:cycle", timeout=TTL)

    def acquire(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("redis-py: the uncontended lock was busy")

    def release(self) -> None:
        self._lock.release()

    def close(self) -> None:
        self._client.close()


class FdatasyncCycle:
    name = FDATASYNC
    what = "os.pwrite 4 KiB at offset 0 + os.fdatasync: the limit for one durable commit"

    def __init__(self, directory: Path) -> None:
        self._fd = os.open(directory / "fdatasync.bin", os.O_RDWR | os.O_CREAT, 0o644)
        self._block = os.urandom(4096)
        os.pwrite(self._fd, self._block, 0)
        os.fsync(self._fd)

    def acquire(self) -> None:
        os.pwrite(self._fd, self._block, 0)
        os.fdatasync(self._fd)

    def release(self) -> None:
        pass

    def close(self) -> None:
        os.close(self._fd)


def _raw_sqlite(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    return conn


class SQLiteUpdateCycle:
    name = SQLITE_UPDATE
    what = "BEGIN IMMEDIATE; UPDATE one row; COMMIT (one durable commit per cycle)"

    def __init__(self, directory: Path) -> None:
        self._conn = _raw_sqlite(directory / "raw-update.db")
        self._conn.execute("CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v INTEGER)")
        self._conn.execute("INSERT OR IGNORE INTO t VALUES (1, 0)")

    def acquire(self) -> None:
        self._conn.execute("BEGIN IMMEDIATE")
        self._conn.execute("UPDATE t SET v = v + 1 WHERE k = 1")
        self._conn.execute("COMMIT")

    def release(self) -> None:
        pass

    def close(self) -> None:
        self._conn.close()


class SQLiteLeaseCycle:
    name = SQLITE_LEASE
    what = "raw lease row: acquire and release are one FULL commit each (no fencing API)"

    def __init__(self, directory: Path) -> None:
        self._conn = _raw_sqlite(directory / "raw-lease.db")
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS leases "
            "(name TEXT PRIMARY KEY, epoch INTEGER, owner TEXT, expires REAL)"
        )
        self._conn.execute("INSERT OR IGNORE INTO leases VALUES ('r', 0, NULL, 0)")
        self._owner = ""

    def acquire(self) -> None:
        self._owner = os.urandom(16).hex()
        now = time.clock_gettime(time.CLOCK_BOOTTIME)
        self._conn.execute("BEGIN IMMEDIATE")
        cursor = self._conn.execute(
            "UPDATE leases SET epoch = epoch + 1, owner = ?, expires = ? "
            "WHERE name = 'r' AND (owner IS NULL OR expires <= ?)",
            (self._owner, now + TTL, now),
        )
        self._conn.execute("COMMIT")
        if cursor.rowcount != 1:
            raise RuntimeError("raw lease row: busy")

    def release(self) -> None:
        self._conn.execute("BEGIN IMMEDIATE")
        self._conn.execute(
            "UPDATE leases SET owner = NULL WHERE name = 'r' AND owner = ?", (self._owner,)
        )
        self._conn.execute("COMMIT")

    def close(self) -> None:
        self._conn.close()


@dataclass
class CycleRound:
    rate: float
    cycles: list[float]
    acquires: list[float]
    releases: list[float]


def run_cycles(impl: CycleImpl, seconds: float) -> CycleRound:
    clock = time.perf_counter
    cycles: list[float] = []
    acquires: list[float] = []
    releases: list[float] = []
    start = t0 = clock()
    end = start + seconds
    while t0 < end:
        impl.acquire()
        t1 = clock()
        impl.release()
        t2 = clock()
        acquires.append(t1 - t0)
        releases.append(t2 - t1)
        cycles.append(t2 - t0)
        t0 = t2
    return CycleRound(len(cycles) / (t0 - start), cycles, acquires, releases)


def interleaved(names: Sequence[str], round_number: int) -> list[str]:
    """A, B, C then C, B, A: every implementation runs early and late equally often."""
    return list(names) if round_number % 2 == 0 else list(reversed(names))


@dataclass
class CycleResults:
    rounds: dict[str, list[CycleRound]] = field(default_factory=dict)
    what: dict[str, str] = field(default_factory=dict)

    def rates(self, name: str) -> list[float]:
        return [r.rate for r in self.rounds[name]]

    def ratio(self, name: str, baseline: str) -> list[float]:
        """Per-round ratios (the rounds were interleaved, so each pair shared conditions)."""
        return [a / b for a, b in zip(self.rates(name), self.rates(baseline), strict=True)]


def bench_cycles(
    directory: Path, url: str, redis_port: int, rounds: int, seconds: float
) -> CycleResults:
    impls: list[CycleImpl] = [
        FencedCycle(url),
        RedisCycle(redis_port),
        FdatasyncCycle(directory),
        SQLiteUpdateCycle(directory),
        SQLiteLeaseCycle(directory),
    ]
    by_name = {impl.name: impl for impl in impls}
    results = CycleResults(
        {impl.name: [] for impl in impls}, {impl.name: impl.what for impl in impls}
    )
    print(
        f"\n[1/3] uncontended cycles: warm-up + {rounds} rounds x {len(impls)} x {seconds} s",
        flush=True,
    )
    for impl in impls:  # warm-up, discarded
        run_cycles(impl, min(seconds, 0.3))
    for round_number in range(rounds):
        for name in interleaved(list(by_name), round_number):
            results.rounds[name].append(run_cycles(by_name[name], seconds))
        print(
            f"  round {round_number + 1}: "
            + ", ".join(f"{n} {fmt_rate(results.rounds[n][-1].rate)}/s" for n in by_name),
            flush=True,
        )
    for impl in impls:
        impl.close()
    return results


def report_cycles(results: CycleResults) -> None:
    rows = []
    for name, rounds in results.rounds.items():
        rates = [r.rate for r in rounds]
        cycles = [x for r in rounds for x in r.cycles]
        rows.append([
            name,
            fmt_rate(median(rates)),
            f"{fmt_rate(min(rates))} – {fmt_rate(max(rates))}",
            fmt_time(percentile(cycles, 50)),
            fmt_time(percentile(cycles, 99)),
            fmt_time(percentile([x for r in rounds for x in r.acquires], 50)),
            fmt_time(percentile([x for r in rounds for x in r.releases], 50)),
            results.what[name],
        ])  # fmt: skip
    print_table(
        "1. Uncontended acquire+release cycle (1 client, 1 resource); median of rounds",
        [
            "implementation",
            "cycles/s",
            "rounds min–max",
            "p50",
            "p99",
            "acquire p50",
            "release p50",
            "what",
        ],
        rows,
    )
    for baseline, target in ((REDIS, 1.0), (FDATASYNC, 0.5)):
        ratios = results.ratio(FENCED, baseline)
        print(
            f"fenced / {baseline}: {fmt_ratio(median(ratios))} "
            f"(rounds {fmt_ratio(min(ratios))} – {fmt_ratio(max(ratios))})  "
            f"target ≥ {target:.1f}  {verdict(median(ratios) >= target)}"
        )


# -- worker processes for 2. and 3. -----------------------------------------------------------
class WorkerLock:
    """One implementation's lock as used by a worker process, per resource."""

    def __init__(
        self,
        acquire: Callable[[str, float | None], None],
        release: Callable[[str], None],
        close: Callable[[], None],
    ) -> None:
        self.acquire = acquire
        self.release = release
        self.close = close


def _fenced_lock(url: str) -> WorkerLock:
    coord = fenced.connect(url)
    leases: dict[str, fenced.Lease] = {}

    def acquire(resource: str, wait: float | None) -> None:
        leases[resource] = coord.acquire(resource, ttl=TTL, wait=wait)

    def release(resource: str) -> None:
        if not coord.release(leases.pop(resource)):
            raise RuntimeError("fenced: release() did not release")

    return WorkerLock(acquire, release, coord.close)


def _redis_lock(port: int) -> WorkerLock:
    client = redis.Redis(host="127.0.0.1", port=port)
    locks: dict[str, Any] = {}

    def acquire(resource: str, wait: float | None) -> None:
        lock = locks.setdefault(resource, client.lock(f"bench:{resource}", timeout=TTL))
        if wait == 0:
            ok = lock.acquire(blocking=False)
        else:
            ok = lock.acquire(blocking=True, blocking_timeout=wait)  # default poll: 0.1 s
        if not ok:
            raise RuntimeError("redis-py: not acquired")

    def release(resource: str) -> None:
        locks[resource].release()

    return WorkerLock(acquire, release, client.close)


def worker_main(conn: Connection, url: str, redis_port: int) -> None:
    """A worker process: obeys ("acquire" | "release" | "contend" | "exit", …) messages."""
    locks = {FENCED: _fenced_lock(url), REDIS: _redis_lock(redis_port)}
    conn.send(("ready",))
    while True:
        message = conn.recv()
        command = message[0]
        if command == "exit":
            break
        lock = locks[message[1]]
        if command == "acquire":
            _, _, resource, wait = message
            conn.send(("entering",))
            lock.acquire(resource, wait)
            conn.send(("acquired", time.monotonic()))
        elif command == "release":
            resource = message[2]
            before = time.monotonic()
            lock.release(resource)
            conn.send(("released", before, time.monotonic() - before))
        elif command == "contend":
            _, _, resource, start_at, seconds = message
            conn.send(("contended", *contend(lock, resource, start_at, seconds)))
    for lock in locks.values():
        lock.close()


def contend(
    lock: WorkerLock, resource: str, start_at: float, seconds: float
) -> tuple[int, list[float]]:
    """Acquire (wait=None) / release in a loop; count grants inside [start_at, +seconds)."""
    time.sleep(max(0.0, start_at - time.monotonic()))
    end = start_at + seconds
    count = 0
    waits: list[float] = []
    while True:
        asked = time.monotonic()
        if asked >= end:
            break
        lock.acquire(resource, None)
        got = time.monotonic()
        if got < end:
            count += 1
            waits.append(got - asked)
        lock.release(resource)
    return count, waits


class Workers:
    """Worker processes started with the spawn method (no inherited connections or threads)."""

    def __init__(self, count: int, url: str, redis_port: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        for _ in range(count):
            parent, child = context.Pipe()
            proc = context.Process(target=worker_main, args=(child, url, redis_port), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            expect(conn, "ready", timeout=60)

    def close(self) -> None:
        for conn in self.conns:
            conn.send(("exit",))
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def expect(conn: Connection, kind: str, timeout: float = 60.0) -> tuple[Any, ...]:
    if not conn.poll(timeout):
        raise RuntimeError(f"a worker sent no {kind!r} within {timeout} s")
    message: tuple[Any, ...] = conn.recv()
    if message[0] != kind:
        raise RuntimeError(f"expected {kind!r} from a worker, got {message!r}")
    return message


# -- 2. handoff latency -----------------------------------------------------------------------
@dataclass
class HandoffRound:
    latencies: list[float]
    releases: list[float]


# How long the holder keeps the lease after the waiter announced itself: long enough for the
# waiter to be blocked in acquire(); for redis-py a uniform spread over its 100 ms poll so that
# the release falls at a random phase of the waiter's sleep.
GAPS = {FENCED: (0.005, 0.015), REDIS: (0.010, 0.110)}


def handoff_round(
    impl: str, a: Connection, b: Connection, count: int, rng: random.Random
) -> HandoffRound:
    latencies: list[float] = []
    releases: list[float] = []
    holder, waiter = a, b
    holder.send(("acquire", impl, R_HANDOFF, 10.0))
    expect(holder, "entering")
    expect(holder, "acquired")
    for _ in range(count):
        waiter.send(("acquire", impl, R_HANDOFF, None))
        expect(waiter, "entering")
        time.sleep(rng.uniform(*GAPS[impl]))
        holder.send(("release", impl, R_HANDOFF))
        _, released_at, release_took = expect(holder, "released")
        _, acquired_at = expect(waiter, "acquired")
        latencies.append(acquired_at - released_at)
        releases.append(release_took)
        holder, waiter = waiter, holder
    holder.send(("release", impl, R_HANDOFF))
    expect(holder, "released")
    return HandoffRound(latencies, releases)


def bench_handoff(workers: Workers, rounds: int, total: int) -> dict[str, list[HandoffRound]]:
    per_round = math.ceil(total / rounds)
    names = [FENCED, REDIS]
    results: dict[str, list[HandoffRound]] = {name: [] for name in names}
    rng = random.Random(1)
    a, b = workers.conns[:2]
    print(f"\n[2/3] handoff: warm-up + {rounds} rounds x {per_round} handoffs", flush=True)
    for name in names:
        handoff_round(name, a, b, 10, rng)
    for round_number in range(rounds):
        for name in interleaved(names, round_number):
            results[name].append(handoff_round(name, a, b, per_round, rng))
        print(
            f"  round {round_number + 1}: "
            + ", ".join(
                f"{n} p50 {fmt_time(percentile(results[n][-1].latencies, 50))}" for n in names
            ),
            flush=True,
        )
    return results


def report_handoff(results: dict[str, list[HandoffRound]]) -> None:
    rows = []
    for name, rounds in results.items():
        lat = [x for r in rounds for x in r.latencies]
        p50s = [percentile(r.latencies, 50) for r in rounds]
        rows.append([
            name,
            str(len(lat)),
            fmt_time(percentile(lat, 50)),
            fmt_time(percentile(lat, 90)),
            fmt_time(percentile(lat, 99)),
            fmt_time(max(lat)),
            f"{fmt_time(min(p50s))} – {fmt_time(max(p50s))}",
            fmt_time(percentile([x for r in rounds for x in r.releases], 50)),
        ])  # fmt: skip
    print_table(
        "2. Handoff latency (holder's release() called -> blocked waiter's acquire() returned)",
        ["implementation", "n", "p50", "p90", "p99", "max", "p50 rounds min–max", "release() p50"],
        rows,
    )
    lat = [x for r in results[FENCED] for x in r.latencies]
    p50, p99 = percentile(lat, 50), percentile(lat, 99)
    print(
        f"fenced handoff p50 {fmt_time(p50)} target ≤ 1 ms {verdict(p50 <= 1e-3)}; "
        f"p99 {fmt_time(p99)} target ≤ 5 ms {verdict(p99 <= 5e-3)}"
    )


# -- 3. fairness ------------------------------------------------------------------------------
@dataclass
class FairRound:
    seconds: float
    counts: list[int]
    waits: list[float]

    @property
    def rate(self) -> float:
        return sum(self.counts) / self.seconds

    @property
    def min_share(self) -> float:
        """The least-served process's count over the mean count."""
        mean = sum(self.counts) / len(self.counts)
        return min(self.counts) / mean if mean else math.nan

    @property
    def jain(self) -> float:
        return jain([float(c) for c in self.counts])


def fairness_round(impl: str, workers: Workers, seconds: float) -> FairRound:
    start_at = time.monotonic() + 0.2
    for conn in workers.conns:
        conn.send(("contend", impl, R_FAIR, start_at, seconds))
    replies = [expect(conn, "contended", timeout=seconds + 120) for conn in workers.conns]
    return FairRound(seconds, [r[1] for r in replies], [w for r in replies for w in r[2]])


def bench_fairness(workers: Workers, rounds: int, seconds: float) -> dict[str, list[FairRound]]:
    names = [FENCED, REDIS]
    results: dict[str, list[FairRound]] = {name: [] for name in names}
    print(
        f"\n[3/3] fairness: {len(workers.conns)} processes, warm-up + {rounds} rounds x "
        f"{seconds} s",
        flush=True,
    )
    for name in names:
        fairness_round(name, workers, min(seconds, 1.0))
    for round_number in range(rounds):
        for name in interleaved(names, round_number):
            results[name].append(fairness_round(name, workers, seconds))
        print(
            f"  round {round_number + 1}: "
            + ", ".join(
                f"{n} {fmt_rate(results[n][-1].rate)}/s counts {results[n][-1].counts}"
                for n in names
            ),
            flush=True,
        )
    return results


def report_fairness(results: dict[str, list[FairRound]]) -> None:
    rows = []
    for name, rounds in results.items():
        rates = [r.rate for r in rounds]
        worst = min(rounds, key=lambda r: r.min_share)
        waits = [w for r in rounds for w in r.waits]
        rows.append([
            name,
            fmt_rate(median(rates)),
            f"{fmt_rate(min(rates))} – {fmt_rate(max(rates))}",
            f"{min(worst.counts):,} / {max(worst.counts):,}",
            fmt_ratio(worst.min_share),
            fmt_ratio(min(r.jain for r in rounds)),
            fmt_time(percentile(waits, 50)),
            fmt_time(percentile(waits, 99)),
        ])  # fmt: skip
    print_table(
        f"3. Contention ({len(next(iter(results.values()))[0].counts)} processes, one resource; "
        "worst round shown for min/max, min/mean and Jain)",
        [
            "implementation",
            "acquisitions/s",
            "rounds min–max",
            "per-process min / max",
            "min/mean",
            "Jain",
            "wait p50",
            "wait p99",
        ],
        rows,
    )
    worst_share = min(r.min_share for r in results[FENCED])
    print(
        f"fenced: every process ≥ 0.8 × mean share: worst {fmt_ratio(worst_share)} "
        f"{verdict(worst_share >= 0.8)}"
    )


# -- summary ----------------------------------------------------------------------------------
def report_summary(
    cycles: CycleResults | None,
    handoff: dict[str, list[HandoffRound]] | None,
    fairness: dict[str, list[FairRound]] | None,
) -> None:
    rows: list[list[str]] = []
    if cycles is not None:
        fenced_rate = median(cycles.rates(FENCED))
        for baseline, target in ((REDIS, 1.0), (FDATASYNC, 0.5)):
            ratio = median(cycles.ratio(FENCED, baseline))
            rows.append(
                [
                    f"cycles/s vs {baseline}",
                    fmt_rate(fenced_rate),
                    fmt_rate(median(cycles.rates(baseline))),
                    f"≥ {target:.1f} × baseline",
                    f"{ratio:.2f} ×",
                    verdict(ratio >= target),
                ]
            )
    if handoff is not None:
        mine = [x for r in handoff[FENCED] for x in r.latencies]
        theirs = [x for r in handoff[REDIS] for x in r.latencies]
        for q, limit in ((50, 1e-3), (99, 5e-3)):
            value = percentile(mine, q)
            rows.append(
                [
                    f"handoff p{q}",
                    fmt_time(value),
                    fmt_time(percentile(theirs, q)),
                    f"≤ {fmt_time(limit)}",
                    fmt_time(value),
                    verdict(value <= limit),
                ]
            )
    if fairness is not None:
        share = min(r.min_share for r in fairness[FENCED])
        rows.append(
            [
                "8-process min/mean share",
                fmt_ratio(share),
                fmt_ratio(min(r.min_share for r in fairness[REDIS])),
                "≥ 0.80",
                fmt_ratio(share),
                verdict(share >= 0.8),
            ]
        )
        rows.append(
            [
                "8-process acquisitions/s",
                fmt_rate(median([r.rate for r in fairness[FENCED]])),
                fmt_rate(median([r.rate for r in fairness[REDIS]])),
                "(no target)",
                "",
                "",
            ]
        )
    print_table(
        "Summary (baseline: redis-py Lock unless named; a ratio is the median of the per-round "
        "ratios of interleaved runs, not the ratio of the medians)",
        ["metric", "fenced", "baseline", "target", "measured", "result"],
        rows,
    )


def describe_environment(directory: Path) -> None:
    try:
        redis_version = subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True, check=False
        ).stdout.split()[2]
    except (OSError, IndexError):
        redis_version = "?"
    same_disk = directory.stat().st_dev == Path(__file__).resolve().stat().st_dev
    print(
        f"fenced {fenced.__version__}, Python {platform.python_version()}, SQLite "
        f"{sqlite3.sqlite_version}, redis-py {redis.__version__}, redis-server {redis_version}, "
        f"{os.cpu_count()} CPUs"
    )
    print(
        f"directory {directory} ({'same' if same_disk else 'NOT the same'} disk as the repository)"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    parser.add_argument(
        "--seconds",
        type=float,
        default=1.0,
        help="seconds per implementation per round for cycles (default 1)",
    )
    parser.add_argument(
        "--handoffs",
        type=int,
        default=120,
        help="handoffs per implementation over all rounds (default 120)",
    )
    parser.add_argument(
        "--fair-seconds", type=float, default=5.0, help="seconds per contention run (default 5)"
    )
    parser.add_argument("--processes", type=int, default=8, help="contending processes")
    parser.add_argument(
        "--only",
        choices=["cycles", "handoff", "fairness"],
        action="append",
        help="run only these sections (repeatable)",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="where to create the temporary directory (default: next to this "
        "script, i.e. on the repository's disk)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0 or args.handoffs < 1 or args.processes < 2:
        parser.error("--rounds, --seconds, --handoffs must be positive, --processes ≥ 2")
    sections = set(args.only or ["cycles", "handoff", "fairness"])

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".bench-", dir=args.dir) as tmp:
        directory = Path(tmp)
        describe_environment(directory)
        url = f"sqlite:///{directory}/fenced.db"
        with RedisServer(directory / "redis") as server:
            cycles = handoff = fairness = None
            if "cycles" in sections:
                cycles = bench_cycles(directory, url, server.port, args.rounds, args.seconds)
                report_cycles(cycles)
            if sections & {"handoff", "fairness"}:
                workers = Workers(args.processes, url, server.port)
                try:
                    if "handoff" in sections:
                        handoff = bench_handoff(workers, args.rounds, args.handoffs)
                        report_handoff(handoff)
                    if "fairness" in sections:
                        fairness = bench_fairness(workers, args.rounds, args.fair_seconds)
                        report_fairness(fairness)
                finally:
                    workers.close()
            report_summary(cycles, handoff, fairness)
    print(f"\ntotal {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
