"""fenced on PostgreSQL against what PostgreSQL users reach for, on the same durable server.

    .venv/bin/python benchmarks/bench_postgres.py [--rounds N] [--seconds S] [--handoffs N]

One private PostgreSQL 15 cluster with PostgreSQL's durable defaults (fsync on, synchronous
commit) on the repository's disk, on a free loopback port, stopped by PID at the end. Every
figure is compared with baselines measured *in the same run*, interleaved round by round (A, B,
C then C, B, A, …) after one discarded warm-up round (see ../shared/anchors/README.md: only
same-run ratios mean anything on a shared machine).

1. Uncontended acquire+release cycles/s (one client, one resource):
   - ``pg_advisory_lock``/``unlock`` on one connection (neither durable nor fenced);
   - tooz's postgresql driver, emulated: a **new** psycopg connection per acquire, then
     ``pg_advisory_lock``, and ``pg_advisory_unlock`` + close on release (tooz is not installed:
     it drags in oslo.* and psycopg2; its driver does exactly this per acquire);
   - a raw conditional ``UPDATE … SET epoch = $1 WHERE name = $2 AND epoch < $1`` (autocommit,
     synchronous commit) — one durable fenced write, no lease;
   - a hand-written lease row: a conditional ``UPDATE`` to grant (synchronous commit) and one to
     release (``synchronous_commit = off``), each its own round trip, as a lease needs them;
   - the floor: the raw conditional ``UPDATE`` above (synchronous commit) plus one plain
     ``UPDATE`` on a connection whose session runs with ``synchronous_commit = off`` — the
     least any durable, fenced lease cycle can cost (one durable and one asynchronous commit,
     nothing else); its ratio to the advisory-lock cycle says how far the 0.5 target is
     reachable at all on this machine;
   - fenced: ``acquire(ttl=30, wait=0)`` + ``release()`` (a durable grant + a release: one
     statement each, with the record of each change).
2. Store write: fenced ``store.put(token, key, value)`` (strict mode, the token installed) vs the
   raw conditional UPDATE above.
3. Handoff latency: a holder process releases -> a waiter blocked in ``acquire(wait=None)`` in
   another process holds (``time.monotonic`` in both processes); the same with
   ``pg_advisory_lock`` (the waiter blocks inside the server) as the baseline. fenced's release
   grants the waiter in its own (durable) transaction and the waiter learns it from the NOTIFY.

The host's load average is printed before and after: other work on a shared machine moves every
figure (a busy disk slows each durable commit, busy CPUs each round trip); rerun when it is high.

Targets (issue 6): cycle ≥ 0.5 × advisory and ≥ 5 × tooz; handoff p50 ≤ 2 ms; put ≥ 0.7 × the
raw conditional update.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
import uuid
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psycopg
from _common import fmt_ratio, fmt_time, median, percentile, print_table, verdict
from _rounds import (
    AcquireRelease,
    Cycle,
    FencedCycle,
    HandoffMessages,
    HandoffRound,
    Results,
    WorkerLock,
    Workers,
    cycle_rounds,
    fenced_lock,
    handoff_rounds,
    print_cycles,
    print_handoffs,
    serve,
    timed_halves,
)

import fenced
from fenced.coordinator._connect import connect
from fenced.fence._store import Store
from fenced.fence.backend import StoreOptions
from fenced.fence.postgres._store import open_postgres_backend
from fenced.testing.postgres import PostgresServer

TTL = 30.0
ADVISORY = "pg_advisory_lock/unlock"
TOOZ = "tooz-pg (new conn/acquire)"
RAW_UPDATE = "raw conditional UPDATE"
RAW_LEASE = "raw lease row (sync + async)"
FLOOR = "floor: sync UPDATE + async UPDATE"
FENCED = "fenced acquire+release"
PUT = "fenced store.put"
KEY = 4242


# -- implementations of one "cycle" -----------------------------------------------------------


class Advisory(AcquireRelease):
    name = ADVISORY
    what = "psycopg 3, one connection: SELECT pg_advisory_lock / pg_advisory_unlock"

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)

    def acquire(self) -> None:
        self.conn.execute("SELECT pg_advisory_lock(%s)", (KEY,)).fetchone()

    def release(self) -> None:
        self.conn.execute("SELECT pg_advisory_unlock(%s)", (KEY,)).fetchone()

    def close(self) -> None:
        self.conn.close()


class ToozLike(AcquireRelease):
    name = TOOZ
    what = "new connection + pg_advisory_lock(k1, k2); unlock + close (tooz's driver)"

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn: psycopg.Connection[Any] | None = None

    def acquire(self) -> None:
        self.conn = psycopg.connect(self.dsn, autocommit=True)
        self.conn.execute("SELECT pg_advisory_lock(%s, %s)", (KEY, 7)).fetchone()

    def release(self) -> None:
        assert self.conn is not None
        self.conn.execute("SELECT pg_advisory_unlock(%s, %s)", (KEY, 7)).fetchone()
        self.conn.close()
        self.conn = None


class RawUpdate(Cycle):
    name = RAW_UPDATE
    what = "UPDATE fence SET epoch = $1 WHERE name = $2 AND epoch < $1 (sync commit)"

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS raw_fence (name text PRIMARY KEY, epoch bigint)"
        )
        self.conn.execute("INSERT INTO raw_fence VALUES ('r', 0) ON CONFLICT DO NOTHING")
        row = self.conn.execute("SELECT epoch FROM raw_fence WHERE name = 'r'").fetchone()
        self.epoch = int(row[0]) if row else 0

    def _update(self) -> None:
        self.epoch += 1
        cur = self.conn.execute(
            "UPDATE raw_fence SET epoch = %s WHERE name = %s AND epoch < %s",
            (self.epoch, "r", self.epoch),
        )
        if cur.rowcount != 1:
            raise RuntimeError("the raw conditional update was not applied")

    def step(self) -> tuple[float, float]:
        return timed_halves(self._update, lambda: None)

    def close(self) -> None:
        self.conn.close()


class RawLeaseRow(AcquireRelease):
    name = RAW_LEASE
    what = "hand-written lease row: grant UPDATE (sync commit) + release UPDATE (async commit)"

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.cur = psycopg.ClientCursor(self.conn)
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS raw_lease (name text PRIMARY KEY, epoch bigint,"
            " owner text, expires_at timestamptz)"
        )
        self.conn.execute(
            "INSERT INTO raw_lease VALUES ('r', 0, NULL, NULL) ON CONFLICT DO NOTHING"
        )
        self.epoch = 0

    def acquire(self) -> None:
        row = self.conn.execute(
            "UPDATE raw_lease SET epoch = epoch + 1, owner = %s,"
            " expires_at = clock_timestamp() + interval '30 s'"
            " WHERE name = 'r' AND (owner IS NULL OR expires_at <= clock_timestamp())"
            " RETURNING epoch",
            ("me",),
        ).fetchone()
        if row is None:
            raise RuntimeError("the raw lease row was not granted")
        self.epoch = int(row[0])

    def release(self) -> None:
        self.cur.execute(
            "BEGIN; SET LOCAL synchronous_commit = off; UPDATE raw_lease SET owner = NULL"
            " WHERE name = 'r' AND owner = %s AND epoch = %s; COMMIT",
            ("me", self.epoch),
        )

    def close(self) -> None:
        self.conn.close()


class FloorCycle(AcquireRelease):
    name = FLOOR
    what = "raw conditional UPDATE (sync commit) + UPDATE on a synchronous_commit=off session"

    def __init__(self, dsn: str) -> None:
        self.sync = psycopg.connect(dsn, autocommit=True)
        self.lazy = psycopg.connect(dsn, autocommit=True)
        self.lazy.execute("SET synchronous_commit = off")
        self.sync.execute(
            "CREATE TABLE IF NOT EXISTS raw_floor (name text PRIMARY KEY, epoch bigint, owner text)"
        )
        self.sync.execute("INSERT INTO raw_floor VALUES ('r', 0, NULL) ON CONFLICT DO NOTHING")
        row = self.sync.execute("SELECT epoch FROM raw_floor WHERE name = 'r'").fetchone()
        self.epoch = int(row[0]) if row else 0

    def acquire(self) -> None:
        self.epoch += 1
        cur = self.sync.execute(
            "UPDATE raw_floor SET epoch = %s, owner = %s WHERE name = %s AND epoch < %s",
            (self.epoch, "me", "r", self.epoch),
        )
        if cur.rowcount != 1:
            raise RuntimeError("the floor's grant was not applied")

    def release(self) -> None:
        cur = self.lazy.execute(
            "UPDATE raw_floor SET owner = NULL WHERE name = %s AND epoch = %s",
            ("r", self.epoch),
        )
        if cur.rowcount != 1:
            raise RuntimeError("the floor's release was not applied")

    def close(self) -> None:
        self.sync.close()
        self.lazy.close()


class FencedPut(Cycle):
    name = PUT
    what = "store.put(token, 'k', 16 bytes), strict mode, token installed (sync commit)"

    def __init__(self, url: str, coordinator_id: str) -> None:
        from fenced.core._clock import SystemClock

        options = StoreOptions(7 * 24 * 3600.0, 3600.0, 5.0, SystemClock())
        self.store = Store(open_postgres_backend(url, "strict", options), options)
        self.token = fenced.FencingToken(coordinator_id, "bench/put", 1)
        self.store.fence(self.token)

    def step(self) -> tuple[float, float]:
        return timed_halves(
            lambda: self.store.put(self.token, "k", b"0123456789abcdef"), lambda: None
        )

    def close(self) -> None:
        self.store.close()


# -- handoff between processes ----------------------------------------------------------------


def worker_main(conn: Connection, url: str, dsn: str) -> None:
    advisory = psycopg.connect(dsn, autocommit=True)

    def lock(resource: str, wait: float | None) -> None:
        advisory.execute("SELECT pg_advisory_lock(%s)", (KEY + 1,)).fetchone()

    def unlock(resource: str) -> None:
        advisory.execute("SELECT pg_advisory_unlock(%s)", (KEY + 1,)).fetchone()

    serve(conn, {FENCED: fenced_lock(url, TTL), ADVISORY: WorkerLock(lock, unlock, advisory.close)})


def bench_handoff(url: str, dsn: str, rounds: int, total: int) -> dict[str, list[HandoffRound]]:
    messages = {
        name: HandoffMessages(
            hold=("acquire", name, "bench/handoff", None),
            wait=("acquire", name, "bench/handoff", None),
            release=("release", name, "bench/handoff"),
            gap=(0.005, 0.015),  # the waiter is blocked in acquire by now
        )
        for name in (FENCED, ADVISORY)
    }
    workers = Workers(2, worker_main, url, dsn)
    try:
        return handoff_rounds(workers, messages, rounds, total, "[3/3] handoff")
    finally:
        workers.close()


def report_handoff(results: dict[str, list[HandoffRound]]) -> None:
    print_handoffs(
        results, "3. Handoff latency (holder releases -> waiter in another process holds)"
    )


# -- summary ----------------------------------------------------------------------------------


def summary(
    cycles: Results | None,
    puts: Results | None,
    handoff: dict[str, list[HandoffRound]] | None,
) -> None:
    rows: list[list[str]] = []

    def ratio_row(
        results: Results, name: str, base: str, target: float | None, label: str
    ) -> float:
        ratios = results.ratio(name, base)
        rows.append([
            label,
            fmt_ratio(median(ratios)),
            f"{fmt_ratio(min(ratios))} – {fmt_ratio(max(ratios))}",
            "" if target is None else f"≥ {target:g}",
            "" if target is None else verdict(median(ratios) >= target),
        ])  # fmt: skip
        return median(ratios)

    floor = None

    if cycles is not None:
        ratio_row(cycles, FENCED, ADVISORY, 0.5, "fenced cycle / advisory-lock cycle")
        ratio_row(cycles, FENCED, TOOZ, 5.0, "fenced cycle / tooz-pg cycle")
        floor = ratio_row(cycles, FLOOR, ADVISORY, None, "(floor: sync + async UPDATE / advisory)")
        ratio_row(cycles, RAW_LEASE, ADVISORY, None, "(raw lease row / advisory-lock cycle)")
        ratio_row(cycles, FENCED, FLOOR, None, "fenced cycle / floor")
        ratio_row(cycles, FENCED, RAW_LEASE, None, "fenced cycle / raw lease row")
    if puts is not None:
        ratio_row(puts, PUT, RAW_UPDATE, 0.7, "fenced put / raw conditional update")
    if handoff is not None:
        lat = [x for r in handoff[FENCED] for x in r.latencies]
        p50 = percentile(lat, 50)
        rows.append(["fenced handoff p50", fmt_time(p50), "", "≤ 2 ms", verdict(p50 <= 0.002)])
    print_table(
        "Summary (ratios: median of per-round ratios)", ["", "value", "rounds", "target", ""], rows
    )
    if floor is not None:
        reach = "reachable" if floor >= 0.5 else "NOT reachable"
        print(
            f"The floor (one durable + one asynchronous commit, nothing else) runs at {floor:.2f} "
            f"x the advisory-lock cycle: 0.5 x is {reach} on this machine by any durable lease."
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--handoffs", type=int, default=120)
    parser.add_argument(
        "--only", choices=["cycles", "put", "handoff"], action="append", help="repeatable"
    )
    parser.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument(
        "--no-prepare",
        action="store_true",
        help="fenced with ?prepare=off (no prepared statements)",
    )
    args = parser.parse_args(argv)
    sections = set(args.only or ["cycles", "put", "handoff"])
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".bench-pg-", dir=args.dir) as tmp:
        os.chmod(tmp, 0o755)  # the server runs as the postgres user
        server = PostgresServer(Path(tmp) / "pg", durable=True)
        server.start()
        try:
            dsn = server.dsn()
            with psycopg.connect(dsn, autocommit=True) as conn:
                row = conn.execute(
                    "SELECT version(), current_setting('fsync'), "
                    "current_setting('synchronous_commit')"
                ).fetchone()
            assert row is not None
            print(f"fenced {fenced.__version__}, Python {platform.python_version()}, psycopg "
                  f"{psycopg.__version__}, {os.cpu_count()} CPUs")  # fmt: skip
            print(f"{row[0].split(',')[0]}, fsync={row[1]}, synchronous_commit={row[2]}, "
                  f"data in {server.data_dir}")  # fmt: skip
            print(f"load average {_load()}")
            query = f"schema=bench_{uuid.uuid4().hex[:8]}" + (
                "&prepare=off" if args.no_prepare else ""
            )
            url = f"{dsn}?{query}"
            coordinator_id = connect(url).coordinator_id
            cycles = puts = handoff = None
            if "cycles" in sections:
                cycles = cycle_rounds(
                    [
                        Advisory(dsn),
                        ToozLike(dsn),
                        RawUpdate(dsn),
                        RawLeaseRow(dsn),
                        FloorCycle(dsn),
                        FencedCycle(
                            url,
                            FENCED,
                            "fenced.connect(postgresql) acquire(ttl=30, wait=0) + release",
                        ),
                    ],
                    args.rounds,
                    args.seconds,
                    "[1/3] uncontended cycles",
                )
                print_cycles(
                    cycles,
                    "1. Uncontended cycle (1 client, 1 resource; the raw update is one write)",
                    "ops/s",
                    ("acquire p50", "release p50"),
                )
            if "put" in sections:
                puts = cycle_rounds(
                    [RawUpdate(dsn), FencedPut(url, coordinator_id)],
                    args.rounds,
                    args.seconds,
                    "[2/3] durable fenced writes",
                )
                print_cycles(puts, "2. One durable fenced write", "ops/s", ("write p50", "-"))
            if "handoff" in sections:
                handoff = bench_handoff(url, dsn, args.rounds, args.handoffs)
                report_handoff(handoff)
            summary(cycles, puts, handoff)
        finally:
            server.stop("fast", remove=False)
    print(f"\ntotal {time.monotonic() - started:.0f} s, load average {_load()}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
