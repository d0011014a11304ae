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
import os
import platform
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import redis
from _common import (
    RedisServer,
    fmt_rate,
    fmt_ratio,
    fmt_time,
    median,
    percentile,
    print_table,
    verdict,
)
from _rounds import (
    AcquireRelease,
    Cycle,
    FairRound,
    FencedCycle,
    HandoffMessages,
    HandoffRound,
    Results,
    WorkerLock,
    Workers,
    cycle_rounds,
    fairness_rounds,
    fenced_lock,
    handoff_rounds,
    print_cycles,
    print_fairness,
    print_handoffs,
    round_options,
    serve,
)

import fenced

R_HANDOFF = "bench/handoff"
R_FAIR = "bench/fair"
TTL = 30.0

FENCED = "fenced"
REDIS = "redis-py Lock"
FDATASYNC = "4 KiB pwrite+fdatasync"
SQLITE_UPDATE = "SQLite UPDATE (WAL, FULL)"
SQLITE_LEASE = "SQLite lease row (2 FULL commits)"


# -- 1. uncontended cycles, in this process ---------------------------------------------------
class RedisCycle(AcquireRelease):
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


class FdatasyncCycle(AcquireRelease):
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


class SQLiteUpdateCycle(AcquireRelease):
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


class SQLiteLeaseCycle(AcquireRelease):
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


def bench_cycles(
    directory: Path, url: str, redis_port: int, rounds: int, seconds: float
) -> Results:
    impls: list[Cycle] = [
        FencedCycle(url, FENCED, "fenced.connect(sqlite) acquire(ttl=30, wait=0) + release"),
        RedisCycle(redis_port),
        FdatasyncCycle(directory),
        SQLiteUpdateCycle(directory),
        SQLiteLeaseCycle(directory),
    ]
    return cycle_rounds(impls, rounds, seconds, "[1/3] uncontended cycles")


def report_cycles(results: Results) -> None:
    print_cycles(
        results,
        "1. Uncontended acquire+release cycle (1 client, 1 resource); median of rounds",
        "cycles/s",
        ("acquire p50", "release p50"),
    )
    for baseline, target in ((REDIS, 1.0), (FDATASYNC, 0.5)):
        ratios = results.ratio(FENCED, baseline)
        print(
            f"fenced / {baseline}: {fmt_ratio(median(ratios))} "
            f"(rounds {fmt_ratio(min(ratios))} – {fmt_ratio(max(ratios))})  "
            f"target ≥ {target:.1f}  {verdict(median(ratios) >= target)}"
        )


# -- worker processes for 2. and 3. -----------------------------------------------------------
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
    serve(conn, {FENCED: fenced_lock(url, TTL), REDIS: _redis_lock(redis_port)})


# -- 2. handoff latency -----------------------------------------------------------------------
# How long the holder keeps the lease after the waiter announced itself: long enough for the
# waiter to be blocked in acquire(); for redis-py a uniform spread over its 100 ms poll so that
# the release falls at a random phase of the waiter's sleep.
GAPS = {FENCED: (0.005, 0.015), REDIS: (0.010, 0.110)}


def bench_handoff(workers: Workers, rounds: int, total: int) -> dict[str, list[HandoffRound]]:
    messages = {
        name: HandoffMessages(
            hold=("acquire", name, R_HANDOFF, 10.0),
            wait=("acquire", name, R_HANDOFF, None),
            release=("release", name, R_HANDOFF),
            gap=GAPS[name],
        )
        for name in (FENCED, REDIS)
    }
    return handoff_rounds(workers, messages, rounds, total, "[2/3] handoff")


def report_handoff(results: dict[str, list[HandoffRound]]) -> None:
    print_handoffs(
        results,
        "2. Handoff latency (holder's release() called -> blocked waiter's acquire() returned)",
    )
    lat = [x for r in results[FENCED] for x in r.latencies]
    p50, p99 = percentile(lat, 50), percentile(lat, 99)
    print(
        f"fenced handoff p50 {fmt_time(p50)} target ≤ 1 ms {verdict(p50 <= 1e-3)}; "
        f"p99 {fmt_time(p99)} target ≤ 5 ms {verdict(p99 <= 5e-3)}"
    )


# -- 3. fairness ------------------------------------------------------------------------------
def bench_fairness(workers: Workers, rounds: int, seconds: float) -> dict[str, list[FairRound]]:
    return fairness_rounds(workers, [FENCED, REDIS], rounds, seconds, R_FAIR)


def report_fairness(results: dict[str, list[FairRound]]) -> None:
    print_fairness(
        results,
        f"3. Contention ({len(next(iter(results.values()))[0].counts)} processes, one resource; "
        "worst round shown for min/max, min/mean and Jain)",
    )
    worst_share = min(r.min_share for r in results[FENCED])
    print(
        f"fenced: every process ≥ 0.8 × mean share: worst {fmt_ratio(worst_share)} "
        f"{verdict(worst_share >= 0.8)}"
    )


# -- summary ----------------------------------------------------------------------------------
def report_summary(
    cycles: Results | None,
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
    round_options(parser, seconds=1.0, handoffs=120)
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
                workers = Workers(args.processes, worker_main, url, server.port)
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
