"""Fenced stores against the plain durable writes they are built from.

    .venv/bin/python benchmarks/bench_store.py [--rounds N] [--seconds S] [--dir DIR]

Two measurements, each side by side with its baseline *in the same run*, interleaved round by
round (A, B, then B, A, …) after one discarded warm-up round (see ../shared/anchors/README.md for
why only same-run ratios mean anything on a shared machine):

1. ``put`` with a token on ``sqlite:`` (strict mode, epoch installed once) vs a raw SQLite
   upsert of the same 256 bytes (``BEGIN IMMEDIATE; INSERT … ON CONFLICT DO UPDATE; COMMIT``),
   both in WAL mode with ``synchronous=FULL`` in the same directory — target ≥ 0.7×. Both
   alternate between two values: SQLite skips an overwrite with identical bytes, which would
   turn the baseline into a commit that writes (and syncs) nothing;
2. ``publish`` of 1 MiB to ``file:///`` (with ``gc(keep=1, grace=0)`` every 8 publishes, inside
   the timed loop, so old exports do not pile up) vs a plain write + fsync + rename + directory
   fsync of the same bytes — target ≥ 0.7×. Two more lines show the floors of the two ways to
   stage the bytes durably and then commit a small state: the same plain replace followed by a
   durable *replace* of a 1 KiB file (temporary file, fsync, rename, directory fsync: the file
   store's format 1), or by a 1 KiB *append* + ``fdatasync`` to a log (its format 2, whose log
   is truncated now and then, here every 64 appends).

Every publish leaves the store as it found it (gc removes what it superseded, the log is
checkpointed), so the rounds measure a steady state: a rate that falls round after round means
something grows.

Ratios are computed per round (the pair of a round shared the machine's conditions), then the
median of the rounds is reported with its min–max. Nothing here fails a build.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from _common import fmt_rate, fmt_ratio, fmt_time, median, percentile, print_table, verdict

from fenced import FencingToken, open_store

TOKEN = FencingToken("b" * 32, "bench/store", 1)
VALUES = (os.urandom(256), os.urandom(256))  # alternated: SQLite skips an identical overwrite
EXPORT = os.urandom(1024 * 1024)
TARGET = 0.7


@dataclass
class Impl:
    name: str
    what: str
    op: Callable[[], object]
    between_rounds: Callable[[], object] = lambda: None


def raw_sqlite(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, timeout=5)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE IF NOT EXISTS kv(key TEXT PRIMARY KEY, value BLOB NOT NULL)")
    return conn


def put_impls(directory: Path) -> list[Impl]:
    store = open_store(f"sqlite:///{directory}/fenced.db")
    store.fence(TOKEN)
    conn = raw_sqlite(directory / "raw.db")
    turns = itertools.count()

    def put() -> None:
        store.put(TOKEN, "config", VALUES[next(turns) % 2])

    def upsert() -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "INSERT INTO kv(key, value) VALUES (?, ?)"
            " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            ("config", VALUES[next(turns) % 2]),
        )
        conn.execute("COMMIT")

    return [
        Impl("fenced put", "store.put(token, key, 256 B), sqlite:, strict", put),
        Impl("raw SQLite upsert", "BEGIN IMMEDIATE; INSERT…ON CONFLICT; COMMIT", upsert),
    ]


def _replace_durably(directory: Path, name: str, data: bytes) -> None:
    """Write ``data`` to a temporary file, fsync, rename over ``name``, fsync the directory."""
    temporary = directory / f"{name}.{os.getpid()}.tmp"
    with open(temporary, "wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, directory / name)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_impls(directory: Path) -> list[Impl]:
    store = open_store(f"file://{directory}/store")
    store.fence(TOKEN)
    plain = directory / "plain"
    plain.mkdir()
    floor = directory / "floor"
    floor.mkdir()
    state = os.urandom(1024)
    published = itertools.count(1)

    def publish() -> None:
        store.publish(TOKEN, EXPORT)
        if next(published) % 8 == 0:  # steady state: old exports do not pile up on the disk
            store.gc(keep=1, grace=0)

    def two_replaces() -> None:
        _replace_durably(floor, "export", EXPORT)
        _replace_durably(floor, "state", state)

    log = os.open(floor / "state.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    appended = itertools.count(1)

    def replace_then_append() -> None:
        _replace_durably(floor, "export", EXPORT)
        if next(appended) % 64 == 0:
            os.ftruncate(log, 0)
        os.write(log, state)
        os.fdatasync(log)

    return [
        Impl("fenced publish", "store.publish(token, 1 MiB), file:///; gc every 8", publish),
        Impl(
            "write+fsync+rename",
            "tmp write, fsync, rename, dir fsync (1 MiB)",
            lambda: _replace_durably(plain, "export", EXPORT),
        ),
        Impl(
            "the same + 1 KiB replace",
            "then the same for a 1 KiB state file: a stage-then-replace commit",
            two_replaces,
        ),
        Impl(
            "the same + 1 KiB append",
            "then append 1 KiB to a log + fdatasync: a stage-then-append commit",
            replace_then_append,
        ),
    ]


def run(impl: Impl, seconds: float) -> list[float]:
    """Latencies of back-to-back operations for ``seconds``."""
    clock = time.perf_counter
    latencies: list[float] = []
    end = clock() + seconds
    t0 = clock()
    while t0 < end:
        impl.op()
        t1 = clock()
        latencies.append(t1 - t0)
        t0 = t1
    impl.between_rounds()
    return latencies


def bench(title: str, impls: list[Impl], rounds: int, seconds: float) -> None:
    print(f"\n{title}: warm-up + {rounds} rounds x {len(impls)} x {seconds} s", flush=True)
    for impl in impls:
        run(impl, min(seconds, 0.3))  # warm-up, discarded
    rates: dict[str, list[float]] = {impl.name: [] for impl in impls}
    latencies: dict[str, list[float]] = {impl.name: [] for impl in impls}
    for number in range(rounds):
        for impl in impls if number % 2 == 0 else reversed(impls):
            measured = run(impl, seconds)
            rates[impl.name].append(len(measured) / sum(measured))
            latencies[impl.name].extend(measured)
        print(
            f"  round {number + 1}: "
            + ", ".join(f"{name} {fmt_rate(r[-1])}/s" for name, r in rates.items()),
            flush=True,
        )
    rows = [
        [
            impl.name,
            fmt_rate(median(rates[impl.name])),
            f"{fmt_rate(min(rates[impl.name]))} – {fmt_rate(max(rates[impl.name]))}",
            fmt_time(percentile(latencies[impl.name], 50)),
            fmt_time(percentile(latencies[impl.name], 99)),
            impl.what,
        ]
        for impl in impls
    ]
    print_table(
        f"{title} (median of rounds)",
        ["implementation", "ops/s", "rounds min–max", "p50", "p99", "what"],
        rows,
    )
    baseline = impls[1].name
    for impl in impls[:1] + impls[2:]:
        ratios = [a / b for a, b in zip(rates[impl.name], rates[baseline], strict=True)]
        print(
            f"{impl.name} / {baseline}: {fmt_ratio(median(ratios))} "
            f"(rounds {fmt_ratio(min(ratios))} – {fmt_ratio(max(ratios))})"
            + (
                f"  target ≥ {TARGET}  {verdict(median(ratios) >= TARGET)}"
                if impl is impls[0]
                else ""
            )
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    parser.add_argument("--seconds", type=float, default=1.0, help="seconds per round (1)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="where the temporary directory goes (default: benchmarks/, the repository's disk)",
    )
    args = parser.parse_args(argv)
    directory = Path(tempfile.mkdtemp(prefix="bench-store-", dir=args.dir))
    print(f"fenced store benchmark: Python {platform.python_version()}, "
          f"SQLite {sqlite3.sqlite_version}, {os.cpu_count()} CPUs, in {directory}, "
          f"load {_load()}")  # fmt: skip
    try:
        (directory / "put").mkdir()
        (directory / "publish").mkdir()
        bench("1. put, sqlite:", put_impls(directory / "put"), args.rounds, args.seconds)
        bench(
            "2. publish 1 MiB, file:///",
            publish_impls(directory / "publish"),
            args.rounds,
            args.seconds,
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"\nload at the end: {_load()}")


def _load() -> str:
    """The 1, 5 and 15 minute load averages: the machine is shared, say how busy it was."""
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


if __name__ == "__main__":
    main()
