"""Micro-benchmark: SQLiteBackend try_grant + release against raw durable SQLite and fdatasync.

Three loops in one temporary directory (same disk), interleaved round by round (A B C, C B A, …)
after a discarded warm-up round:

``backend``
    ``SQLiteBackend.try_grant`` + ``release`` of one resource: one ``synchronous=FULL`` commit
    (the grant) and one ``NORMAL`` commit (the release) per cycle, records included.
``raw-full``
    ``BEGIN IMMEDIATE; UPDATE; COMMIT`` at ``synchronous=FULL`` in WAL mode: one durable commit,
    the cheapest durable SQLite write there is.
``fdatasync``
    ``pwrite`` of 4 KiB at offset 0 + ``fdatasync``: the disk's limit for one durable commit.

Prints each loop's median rate and the backend's ratio to both baselines. Not a test: no
assertion; the project's full benchmark is ``bench_coordinator.py``.

    .venv/bin/python benchmarks/bench_sqlite_backend_raw.py [--rounds 5] [--seconds 1]
"""

from __future__ import annotations

import argparse
import secrets
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _common import fdatasync_loop

from fenced.coordinator.backend import Granted, GrantRequest
from fenced.coordinator.backends.sqlite._backend import SQLiteBackend


def backend_loop(directory: Path) -> tuple[Callable[[], None], Callable[[], None]]:
    backend = SQLiteBackend(directory / "fenced.db")
    request = GrantRequest("bench/cycle", 30.0, secrets.token_hex(16), "bench:1")

    def cycle() -> None:
        granted = backend.try_grant(request, None)
        assert isinstance(granted, Granted)
        assert backend.release(request.resource, granted.epoch, granted.owner)

    return cycle, backend.close


def raw_full_loop(directory: Path) -> tuple[Callable[[], None], Callable[[], None]]:
    conn = sqlite3.connect(directory / "raw.db", isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v INTEGER NOT NULL)")
    conn.execute("INSERT INTO t VALUES (1, 0)")

    def cycle() -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("UPDATE t SET v = v + 1 WHERE k = 1")
        conn.execute("COMMIT")

    return cycle, conn.close


def rate(cycle: Callable[[], None], seconds: float) -> float:
    count = 0
    started = time.perf_counter()
    deadline = started + seconds
    while True:
        for _ in range(50):
            cycle()
        count += 50
        now = time.perf_counter()
        if now >= deadline:
            return count / (now - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix=".bench-raw-", dir=args.dir) as tmp:
        directory = Path(tmp)
        loops = {
            "backend": backend_loop(directory),
            "raw-full": raw_full_loop(directory),
            "fdatasync": fdatasync_loop(directory),
        }
        names = list(loops)
        rates: dict[str, list[float]] = {name: [] for name in names}
        ratios: dict[str, list[float]] = {"raw-full": [], "fdatasync": []}
        try:
            for round_number in range(args.rounds + 1):
                order = names if round_number % 2 else names[::-1]
                measured = {name: rate(loops[name][0], args.seconds) for name in order}
                if round_number == 0:
                    continue  # warm-up
                for name in names:
                    rates[name].append(measured[name])
                for baseline, values in ratios.items():
                    values.append(measured["backend"] / measured[baseline])
        finally:
            for _, close in loops.values():
                close()
    print(f"{'loop':<10} {'median/s':>9}  rounds")
    for name in names:
        runs = " ".join(f"{value:,.0f}" for value in rates[name])
        print(f"{name:<10} {statistics.median(rates[name]):>9,.0f}  {runs}")
    for baseline, values in ratios.items():
        runs = " ".join(f"{value:.2f}" for value in values)
        print(f"backend / {baseline}: median {statistics.median(values):.2f}  ({runs})")


if __name__ == "__main__":
    main()
