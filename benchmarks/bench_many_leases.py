"""Many leases held in one process with the sync API: losses, threads, renewal lateness.

Usage::

    .venv/bin/python benchmarks/bench_many_leases.py                   # 1,000 leases, 60 s
    .venv/bin/python benchmarks/bench_many_leases.py --leases 200 --seconds 10
    .venv/bin/python benchmarks/bench_many_leases.py --url postgresql://…   # another backend

One process acquires ``--leases`` resources on one coordinator (the embedded default in a temp
directory unless ``--url``), ``ttl`` 3 s, and holds them for ``--seconds`` while the
coordinator's scheduler renews each every ttl/3 (±10 %). Each renewal goes through a thin
wrapper of the coordinator that notes when it was called, so the figures are:

- **losses**: leases whose ``lost`` was set (target: 0);
- **threads**: the process's threads at the end, and the most seen while holding (target: ≤ 8);
- **renewal lateness**: for each renewal after the first, how much later than the latest
  schedule allowed (``ttl/3 × 1.1`` after the previous one was handed over) it was called, p50 /
  p99 / max (no target: reported);
- **CPU**: the process's CPU time over the hold, as a percentage of one core.

Each lease is a :class:`fenced.runtime._keeper.HeldLease` on one shared
:class:`fenced.runtime._scheduler.LeaseScheduler`, as ``coord.hold`` makes them; the wrapper
stands between the lease and the coordinator only to time the calls.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import fmt_time, percentile, print_table, verdict

import fenced
from fenced.coordinator._client import Coordinator
from fenced.core._clock import SystemClock
from fenced.core._lease import Lease
from fenced.runtime._keeper import HeldLease
from fenced.runtime._scheduler import LeaseScheduler

TTL = 3.0


class Timed:
    """The coordinator as the leases' LeaseOps, noting when each renewal was called."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self.calls: dict[str, list[float]] = {}
        self.failures = 0

    def renew(self, lease: Lease) -> Lease:
        self.calls.setdefault(lease.resource, []).append(time.monotonic())
        try:
            return self.coord.renew(lease)
        except Exception:
            self.failures += 1
            raise

    def release(self, lease: Lease) -> bool:
        return self.coord.release(lease)

    def report_trouble(self, lease: Lease, error: BaseException) -> None:
        self.coord.report_trouble(lease, error)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--leases", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--url", help="coordinator URL (default: embedded, in a temp directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        url = args.url or f"sqlite:{directory}/coord.db"
        clock = SystemClock()
        with fenced.connect(url) as coord:
            ops = Timed(coord)
            scheduler = LeaseScheduler(clock, name="fenced-leases:bench")
            started = time.monotonic()
            helds = []
            for n in range(args.leases):
                lease = coord.acquire(f"bench/many-{n}", ttl=TTL, wait=0)
                held = HeldLease(ops, lease, clock=clock, scheduler=scheduler)
                held.start()
                helds.append(held)
            print(
                f"{args.leases} leases acquired in {time.monotonic() - started:.1f} s on "
                f"{coord.url}; holding {args.seconds:g} s",
                flush=True,
            )
            cpu, begun = time.process_time(), time.monotonic()
            most = threading.active_count()
            while time.monotonic() - begun < args.seconds:
                time.sleep(0.5)
                most = max(most, threading.active_count())
            used = (time.process_time() - cpu) / (time.monotonic() - begun)
            threads = threading.active_count()
            lost = sum(held.lost.is_set() for held in helds)
            for held in helds:
                held.stop(release=True)
            scheduler.close()
    allowed = TTL / 3 * 1.1
    lateness = [
        max(b - a - allowed, 0.0)
        for calls in ops.calls.values()
        for a, b in itertools.pairwise(calls)
    ]
    renewals = sum(len(calls) for calls in ops.calls.values())
    print_table(
        f"{args.leases} leases, ttl {TTL:g} s, held {args.seconds:g} s in one process (sync API)",
        ["losses", "renewals", "failed", "threads (end / most)", "late p50", "late p99",
         "late max", "CPU"],
        [[
            str(lost),
            str(renewals),
            str(ops.failures),
            f"{threads} / {most}",
            fmt_time(percentile(lateness, 50)) if lateness else "-",
            fmt_time(percentile(lateness, 99)) if lateness else "-",
            fmt_time(max(lateness)) if lateness else "-",
            f"{used * 100:.0f} %",
        ]],
    )  # fmt: skip
    print(f"zero losses: {verdict(lost == 0)}; at most 8 threads: {verdict(most <= 8)}")


if __name__ == "__main__":
    main()
