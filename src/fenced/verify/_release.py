"""The release check: ``./dev release-check`` (``python -m fenced.verify._release``). Hours, not CI.

It starts its own servers (a PostgreSQL, a Ceph RGW, a 3-member ZooKeeper ensemble and a
``fenced serve`` from :mod:`fenced.testing`, on loopback, and a 3-member etcd cluster,
:class:`~fenced.verify._members.ManagedEtcd`, whose members run in a network lab of their own;
all stopped by PID), then runs, at ``--scale 1``:

==================================================  =========  ================================
run                                                 schedules  stores
==================================================  =========  ================================
embedded SQLite coordinator                         2,000      embedded ``sqlite:`` and
                                                               ``file:``, both modes
PostgreSQL coordinator                              1,000      ``postgresql:`` strict and
                                                               monotonic
etcd (3 members, member kills and partitions)       500        ``s3:`` (RGW) strict and
                                                               monotonic
ZooKeeper (3 members)                               500        ``postgresql:`` strict and
                                                               monotonic
``fenced serve`` (over an embedded coordinator)     500        ``http:`` (served ``sqlite:``)
                                                               strict and monotonic
==================================================  =========  ================================

(``--only NAME``, repeatable: only those runs; names ``embedded``, ``postgresql``, ``etcd``,
``zookeeper``, ``serve``.)

each with ``--jobs`` schedules at a time and every fault ``fenced verify --random`` injects
(restores of the embedded coordinator; real network partitions against the networked
coordinators when run as root; against etcd also member faults: kills and restarts of the
leader or a follower and, as root, isolation of one from its peers), then hunts every seeded
defect on every coordinator (``--mutants``; defects without a seam there are n/a). It prints a
progress line every twentieth of a run, and one Markdown table (the one docs/verify.md
publishes: schedules, operations, faults by kind, stale writes sent after a pause or held past
the deadline by a partition, stale writes rejected, violations, defects caught) and writes the
figures as JSON to ``--out``. A failing schedule's history is kept (its path printed);
``--keep-history DIR`` keeps every one, in ``DIR/NAME/``.
Exit 0 only if there was no violation and every applicable defect was caught.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fenced.core._urls import url_of_path
from fenced.fence._store import open_store
from fenced.fence._values import Mode
from fenced.testing.postgres import PostgresServer
from fenced.testing.rgw import RgwServer
from fenced.testing.server import ServeProcess
from fenced.testing.zookeeper import ZooKeeperEnsemble
from fenced.verify._members import ManagedEtcd
from fenced.verify._mutants import run_mutants
from fenced.verify._schedule import ScheduleResult, run_random
from fenced.verify._target import Target

__all__ = ["Progress", "Row", "main"]

FULL = {"embedded": 2000, "postgresql": 1000, "etcd": 500, "zookeeper": 500, "serve": 500}
"""Schedules per coordinator at ``--scale 1``."""


@dataclass
class Row:
    """One run of the table."""

    name: str
    stores: str
    label: str = ""
    """The coordinator as the table shows it (default: ``name``)."""
    schedules: int = 0
    seconds: float = 0.0
    stats: Counter[str] = field(default_factory=Counter)
    violations: int = 0
    mutants: dict[str, str] = field(default_factory=dict)
    """Mutant → caught / not caught / n/a."""

    @property
    def caught(self) -> str:
        applicable = [s for s in self.mutants.values() if s != "n/a"]
        if not applicable:
            return "not hunted"
        return f"{applicable.count('caught')}/{len(applicable)}"

    def faults(self) -> str:
        kinds = sorted(k for k in self.stats if k.startswith("fault "))
        return ", ".join(f"{k[6:]} {self.stats[k]:,}" for k in kinds)

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.name,
            "coordinator": self.label or self.name,
            "stores": self.stores,
            "schedules": self.schedules,
            "seconds": round(self.seconds, 1),
            "operations": self.stats["operations"],
            "faults": dict(
                sorted((k[6:], v) for k, v in self.stats.items() if k.startswith("fault "))
            ),
            "writes_after_a_pause": self.stats["mutations sent after a pause"],
            "writes_held_by_a_partition": self.stats[HELD],
            "stale_writes_rejected": self.stats["stale writes rejected"],
            "violations": self.violations,
            "mutants": self.mutants,
        }


def _commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parent,
    )
    return done.stdout.strip() or "unknown"


HELD = "writes held past the deadline by a partition"
"""The checker's figure: writes in flight while their worker was cut from the stores, answered
(or never) after the holder's deadline: they may have arrived stale."""

MODES: tuple[Mode, Mode] = ("strict", "monotonic")


def _targets(stack: ExitStack, only: frozenset[str]) -> Iterator[tuple[str, str, Target]]:
    """The targets named in ``only``, in :data:`FULL`'s order, each with its servers started
    when it comes up (the PostgreSQL server once, for the first run that needs it)."""
    name = uuid.uuid4().hex[:8]
    postgres: PostgresServer | None = None

    def postgres_stores(role: str) -> tuple[str, str]:
        nonlocal postgres
        if postgres is None:
            postgres = stack.enter_context(PostgresServer())
        urls = (
            postgres.url("postgres", schema=f"release_{role}s_{name}"),
            postgres.url("postgres", schema=f"release_{role}m_{name}"),
        )
        _create(urls)
        return urls

    if "embedded" in only:
        yield "embedded", "sqlite: and file: (embedded), both modes", Target.create(None)
    if "postgresql" in only:
        stores = postgres_stores("p")
        assert postgres is not None
        coordinator = postgres.url("postgres", schema=f"release_c_{name}")
        yield "postgresql", "postgresql: strict and monotonic", Target.create(coordinator, stores)
    if "etcd" in only:
        etcd = stack.enter_context(ManagedEtcd(size=3))
        rgw = stack.enter_context(RgwServer())
        os.environ.update(rgw.environment())  # the AWS chain of this process and its workers
        bucket = rgw.create_bucket()
        s3 = tuple(f"s3://{bucket}/release-{role}?endpoint={rgw.endpoint}" for role in "sm")
        _create(s3)
        yield (
            "etcd",
            "s3: (Ceph RGW) strict and monotonic",
            Target.create(etcd.url(f"/release-{name}"), s3, members=etcd.control),
        )
    if "zookeeper" in only:
        stores = postgres_stores("z")
        ensemble = stack.enter_context(ZooKeeperEnsemble(3))
        url = ensemble.url(f"/release-{name}", session_timeout=2, timeout=2)
        yield "zookeeper", "postgresql: strict and monotonic", Target.create(url, stores)
    if "serve" in only:
        files = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fenced-release-")))
        served = tuple(url_of_path("sqlite", str(files / f"{role}.db")) for role in "sm")
        _create(served)
        server = stack.enter_context(
            ServeProcess(
                url_of_path("sqlite", str(files / "coordinator.db")),
                *("--store", f"s={served[0]}", "--store", f"m={served[1]}"),
            )
        )
        yield (
            "serve",
            "http: (served sqlite:) strict and monotonic",
            Target.create(server.url, (f"{server.url}/stores/s", f"{server.url}/stores/m")),
        )


def _create(stores: tuple[str, ...]) -> None:
    """Create the strict and the monotonic store (a store's mode is chosen at its creation)."""
    for url, mode in zip(stores, MODES, strict=True):
        open_store(url, mode).close()


def _label(name: str, target: Target) -> str:
    """The coordinator cell: etcd's says which member faults struck it."""
    kinds = target.member_faults
    if name == "zookeeper":
        return "zookeeper (3 members)"
    if not kinds:
        return name
    faults = "member kills and partitions" if "member-isolate" in kinds else "member kills"
    return f"{name} (3 members, {faults})"


class Progress:
    """Plain progress lines of one run: at every twentieth of ``total`` schedules (and at the
    last), what is done, the violations so far and the time left at the pace so far; a
    failing schedule's seed at once."""

    def __init__(self, name: str, total: int) -> None:
        self.name = name
        self.total = total
        self.done = 0
        self.violations = 0
        self.started = time.monotonic()
        self._step = max(1, total // 20)

    def __call__(self, result: ScheduleResult) -> None:
        self.done += 1
        found = len(result.report.violations)
        self.violations += found
        if found:
            print(f"  {self.name}: seed {result.schedule.seed} VIOLATED", flush=True)
        if self.done % self._step and self.done < self.total:
            return
        print(f"  {self.line(time.monotonic() - self.started)}", flush=True)

    def line(self, elapsed: float) -> str:
        """``name: done/total schedules, N violations, elapsed m:ss, left m:ss``."""
        left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        return (
            f"{self.name}: {self.done}/{self.total} schedules, {self.violations} violations, "
            f"elapsed {_clock(elapsed)}, left {_clock(left)}"
        )


def _clock(seconds: float) -> str:
    minutes, left = divmod(max(0, round(seconds)), 60)
    return f"{minutes}:{left:02d}"


def table(rows: list[Row]) -> str:
    """The Markdown table of ``rows``."""
    lines = [
        "| coordinator | stores | schedules | operations | faults by kind | stale writes sent "
        "after a pause / held past the deadline by a partition | stale writes rejected | "
        "violations | defects caught |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.label or row.name} | {row.stores} | {row.schedules:,} | "
            f"{row.stats['operations']:,} | "
            f"{row.faults()} | {row.stats['mutations sent after a pause']:,} / "
            f"{row.stats[HELD]:,} | "
            f"{row.stats['stale writes rejected']:,} | {row.violations} | {row.caught} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev release-check", description=__doc__)
    parser.add_argument("--scale", type=float, default=1.0, help="share of the full counts")
    parser.add_argument("--jobs", type=int, default=2, help="schedules at a time")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=Path("release-check.json"))
    parser.add_argument(
        "--only",
        action="append",
        choices=list(FULL),
        help="run only this coordinator's schedules (repeatable; default: all)",
    )
    parser.add_argument(
        "--no-mutants", action="store_true", help="skip the hunt of the seeded defects"
    )
    parser.add_argument(
        "--keep-history",
        type=Path,
        metavar="DIR",
        help="copy every schedule's history to DIR/NAME/ (failing ones are kept in any case)",
    )
    args = parser.parse_args(argv)
    if not args.scale > 0 or args.jobs < 1:
        parser.error("--scale must be positive and --jobs at least 1")
    started = datetime.datetime.now(datetime.UTC)
    rows: list[Row] = []
    with ExitStack() as stack:
        for name, stores, target in _targets(stack, frozenset(args.only or FULL)):
            count = max(1, round(FULL[name] * args.scale))
            row = Row(name, stores, _label(name, target))
            print(f"{name}: {count} schedules ({target.describe()})", flush=True)
            began = time.monotonic()
            summary = run_random(
                count,
                args.seed,
                target,
                duration=args.duration,
                jobs=args.jobs,
                progress=Progress(name, count),
                restores=True,  # of the embedded coordinator (the only one verify restores)
                keep_history=None if args.keep_history is None else args.keep_history / name,
            )
            row.schedules = len(summary.results)
            row.stats = summary.totals()
            row.violations = sum(len(r.report.violations) for r in summary.results)
            for failed in summary.failed:
                seed = failed.schedule.seed
                print(f"  FAILED seed {seed}: history {summary.kept.get(seed)}", flush=True)
            if not args.no_mutants:
                print(f"{name}: hunting the seeded defects", flush=True)
                for result in run_mutants(target, seed=args.seed):
                    row.mutants[result.mutant.name] = result.status
            row.seconds = time.monotonic() - began
            rows.append(row)
            print(table(rows[-1:]), flush=True)
    ok = all(row.violations == 0 for row in rows) and all(
        status != "not caught" for row in rows for status in row.mutants.values()
    )
    command = " ".join(["./dev release-check", *(argv if argv is not None else sys.argv[1:])])
    date, commit = started.strftime("%Y-%m-%d"), _commit()
    document = {
        "date": date,
        "commit": commit,
        "command": command,
        "ok": ok,
        "runs": [row.to_json() for row in rows],
    }
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\n{date}, commit {commit}, `{command}`:\n")
    print(table(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
