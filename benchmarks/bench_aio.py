"""fenced.aio against the sync API on the same backends, and against aetcd's Lock on etcd.

Usage::

    .venv/bin/python -m pip install -q --group bench          # aetcd, for the etcd baseline
    flock /tmp/fenced-bench.lock .venv/bin/python benchmarks/bench_aio.py          # ~6 min
    .venv/bin/python benchmarks/bench_aio.py --only cycles --backend embedded
    .venv/bin/python benchmarks/bench_aio.py --only many --seconds-held 10          # shorter

Sections (targets from the asyncio issue; every ratio is measured in the same run, rounds
interleaved):

1. **cycles**: an uncontended ``acquire(wait=0)`` + ``release`` cycle, per backend (embedded
   SQLite in a temp dir, PostgreSQL and a 3-member etcd cluster that the benchmark starts):
   ``fenced.aio`` (one event loop, awaited in a loop) against the sync API; on etcd also
   aetcd's ``Lock`` (a new etcd lease per acquire, on its own loop). Targets: aio ≥ 0.9 × sync on
   every backend; aio ≥ 1.3 × aetcd on etcd.
2. **handoff**: two worker processes take turns on one resource; the release of one to the
   acquire of the other (which was waiting), p50, the sync API against fenced.aio in the same
   two processes, rounds interleaved. Each worker runs one event loop for its whole life (as an
   asyncio service does): a fenced.aio waiter is a task awaiting ``acquire(wait=None)``, woken
   by the backend's notification. Target: the aio p50 within 10 % of the sync p50 per backend.
3. **many**: 1,000 leases (1,000 resources) held in one event loop on the embedded backend,
   ttl 3 s, renewed at ttl/3 by the coordinator's scheduler task for ``--seconds-held`` (60 s):
   losses, renewals, renewal lateness p50/p99/max (against the latest the schedule allows,
   ``ttl/3 × 1.1`` after the previous renewal), threads, CPU. Target: zero losses.
4. **waiters**: 1,000 tasks waiting on 100 resources (10 per resource) in one loop while the
   holders hand over (each grant is released after 1-5 ms): every task is served, each
   resource's grants come in the order its tasks queued (FIFO), threads counted (no thread per
   waiter).
5. **stores**: ``put`` of 100 bytes by the installed holder, looped, on the store of each
   backend (``sqlite:`` in a temp dir, ``postgresql://`` on the benchmark's server): the sync
   ``Store.put`` against ``AsyncStore.put`` awaited on one loop (sqlite: the store's worker
   thread; PostgreSQL: on the loop, greenlets over ``AsyncConnection``), and the threads the
   asyncio store added. No target in the issue; it shows what each design costs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import resource
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _common import fmt_time, median, percentile, print_table, verdict
from _rounds import (
    AcquireRelease,
    Cycle,
    FencedCycle,
    HandoffMessages,
    Round,
    Workers,
    cycle_rounds,
    fenced_lock,
    handoff_rounds,
    print_cycles,
    print_handoffs,
)

import fenced
import fenced.aio
from fenced.aio._keeper import AsyncHeldLease, AsyncLeaseScheduler
from fenced.core._clock import SystemClock
from fenced.core._lease import Lease
from fenced.testing.store_conformance import token

TTL = 3.0
SYNC, AIO, AETCD = "fenced", "fenced.aio", "aetcd Lock"


# -- 1. cycles ----------------------------------------------------------------------------------


class AioCycle(Cycle):
    """``await coord.acquire(R, ttl, wait=0)`` + ``await coord.release(lease)`` on one loop; a
    round is one coroutine looping for the round's seconds (no loop start per cycle)."""

    def __init__(self, url: str, resource: str = "bench/aio-cycle", ttl: float = 30.0) -> None:
        self.name = AIO
        self.what = "fenced.aio acquire(wait=0) + release, awaited on one event loop"
        self._runner = asyncio.Runner()
        self._coord = self._runner.run(_connect(url))
        self._resource = resource
        self._ttl = ttl

    def run_round(self, seconds: float) -> Round:
        return self._runner.run(self._round(seconds))

    async def _round(self, seconds: float) -> Round:
        coord, name, ttl = self._coord, self._resource, self._ttl
        cycles: list[float] = []
        firsts: list[float] = []
        secs: list[float] = []
        clock = time.perf_counter
        start = now = clock()
        end = start + seconds
        while now < end:
            lease = await coord.acquire(name, ttl, 0)
            middle = clock()
            if not await coord.release(lease):
                raise RuntimeError("fenced.aio: release() did not release")
            done = clock()
            firsts.append(middle - now)
            secs.append(done - middle)
            cycles.append(done - now)
            now = done
        return Round(len(cycles) / (now - start), cycles, firsts, secs)

    def close(self) -> None:
        self._runner.run(self._coord.aclose())
        self._runner.close()


async def _connect(url: str) -> fenced.aio.AsyncCoordinator:
    return await fenced.aio.connect(url)


class AetcdCycle(AcquireRelease):
    """aetcd's ``Lock`` (a new etcd lease per acquire), on its own loop, as bench_etcd runs it."""

    def __init__(self, endpoint: str) -> None:
        import aetcd

        self.name = AETCD
        self.what = "aetcd Client.lock(name, ttl=30): acquire + release (gRPC, asyncio)"
        host, port = endpoint.rsplit(":", 1)
        self._loop = asyncio.new_event_loop()
        self._client = aetcd.Client(host=host, port=int(port))
        self._lock: Any = None

    def acquire(self) -> None:
        self._lock = self._client.lock(b"/bench-aio-aetcd/cycle", ttl=30)
        self._loop.run_until_complete(self._lock.acquire(timeout=None))

    def release(self) -> None:
        self._loop.run_until_complete(self._lock.release())

    def close(self) -> None:
        self._loop.run_until_complete(self._client.close())
        self._loop.close()


def bench_cycles(backend: str, url: str, endpoint: str | None, rounds: int, seconds: float) -> None:
    impls: list[Cycle] = [
        FencedCycle(url, SYNC, "fenced acquire(wait=0) + release (sync API)", "bench/sync-cycle"),
        AioCycle(url),
    ]
    if endpoint is not None:
        impls.append(AetcdCycle(endpoint))
    title = f"[cycles] {backend}"
    results = cycle_rounds(impls, rounds, seconds, title)
    print_cycles(results, f"{title}: uncontended cycle", "cycles/s", ("acquire p50", "release p50"))
    ratio = results.ratio(AIO, SYNC)
    print(f"  aio ÷ sync per round: {', '.join(f'{r:.2f}' for r in ratio)}; median "
          f"{median(ratio):.2f} (≥ 0.9: {verdict(median(ratio) >= 0.9)})")  # fmt: skip
    if endpoint is not None:
        versus = results.ratio(AIO, AETCD)
        print(f"  aio ÷ aetcd Lock per round: {', '.join(f'{r:.2f}' for r in versus)}; median "
              f"{median(versus):.2f} (≥ 1.3: {verdict(median(versus) >= 1.3)})")  # fmt: skip


# -- 2. handoff ---------------------------------------------------------------------------------


async def _serve(conn: Connection, url: str) -> None:
    """A worker process: one event loop for its whole life, as an asyncio service has. It obeys
    the messages of ``_rounds.serve`` (``acquire``, ``release``, ``exit``) for the sync lock
    (called as is: it blocks the loop, which has nothing else to do) and for the fenced.aio
    lock (awaited), reading the pipe when the loop says it is readable; the times it sends are
    taken on the loop, right after ``acquire`` returned and right before ``release`` began."""
    sync_lock = fenced_lock(url, TTL)
    leases: dict[str, Lease] = {}
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    loop.add_reader(conn.fileno(), readable.set)
    async with fenced.aio.connect(url) as coord:
        conn.send(("ready",))
        while True:
            while not conn.poll():
                readable.clear()
                await readable.wait()
            message = conn.recv()
            command = message[0]
            if command == "exit":
                break
            name, resource = message[1], message[2]
            if command == "acquire":
                conn.send(("entering",))
                if name == AIO:
                    leases[resource] = await coord.acquire(resource, ttl=TTL, wait=message[3])
                else:
                    sync_lock.acquire(resource, message[3])
                conn.send(("acquired", time.monotonic()))
            elif command == "release":
                before = time.monotonic()
                if name == AIO:
                    if not await coord.release(leases.pop(resource)):
                        raise RuntimeError("fenced.aio: release() did not release")
                else:
                    sync_lock.release(resource)
                conn.send(("released", before, time.monotonic() - before))
    loop.remove_reader(conn.fileno())
    sync_lock.close()


def worker_main(conn: Connection, url: str) -> None:
    asyncio.run(_serve(conn, url))


def bench_handoff(backend: str, url: str, rounds: int, total: int) -> None:
    workers = Workers(2, worker_main, url)
    try:
        messages = {
            name: HandoffMessages(
                hold=("acquire", name, f"bench/handoff-{n}", 10.0),
                wait=("acquire", name, f"bench/handoff-{n}", None),
                release=("release", name, f"bench/handoff-{n}"),
                gap=(0.005, 0.015),
            )
            for n, name in enumerate((SYNC, AIO))
        }
        results = handoff_rounds(workers, messages, rounds, total, f"[handoff] {backend}")
    finally:
        workers.close()
    print_handoffs(results, f"[handoff] {backend}: release → the waiting process's acquire")
    p50 = {name: percentile([x for r in runs for x in r.latencies], 50) for name, runs in
           results.items()}  # fmt: skip
    ratio = p50[AIO] / p50[SYNC]
    print(f"  aio p50 ÷ sync p50 = {ratio:.2f} (within 10 %: {verdict(ratio <= 1.1)})")


# -- 3. many leases in one loop -----------------------------------------------------------------


class TimedOps:
    """The coordinator as the leases' ops, noting when each renewal was called."""

    def __init__(self, coord: fenced.aio.AsyncCoordinator) -> None:
        self.coord = coord
        self.calls: dict[str, list[float]] = {}
        self.failures = 0

    async def renew(self, lease: Lease) -> Lease:
        self.calls.setdefault(lease.resource, []).append(time.monotonic())
        try:
            return await self.coord.renew(lease)
        except Exception:
            self.failures += 1
            raise

    async def release(self, lease: Lease) -> bool:
        return await self.coord.release(lease)

    def report_trouble(self, lease: Lease, error: BaseException) -> None:
        self.coord.report_trouble(lease, error)


async def hold_many(url: str, count: int, seconds: float) -> None:
    async with fenced.aio.connect(url) as coord:
        ops = TimedOps(coord)
        clock = SystemClock()
        scheduler = AsyncLeaseScheduler(clock, name="fenced-leases:bench")
        started = time.monotonic()
        helds = []
        for n in range(count):
            lease = await coord.acquire(f"bench/many-{n}", ttl=TTL, wait=0)
            held = AsyncHeldLease(ops, lease, clock=clock, scheduler=scheduler)
            held.start()
            helds.append(held)
        print(f"{count} leases acquired in {time.monotonic() - started:.1f} s on {coord.url}; "
              f"holding {seconds:g} s", flush=True)  # fmt: skip
        cpu, begun = time.process_time(), time.monotonic()
        most = threading.active_count()
        while time.monotonic() - begun < seconds:
            await asyncio.sleep(0.5)
            most = max(most, threading.active_count())
        used = (time.process_time() - cpu) / (time.monotonic() - begun)
        lost = sum(held.lost.is_set() for held in helds)
        for held in helds:
            await held.stop(release=True)
        await scheduler.aclose()
    allowed = TTL / 3 * 1.1
    lateness = [max(b - a - allowed, 0.0) for calls in ops.calls.values()
                for a, b in itertools.pairwise(calls)]  # fmt: skip
    renewals = sum(len(calls) for calls in ops.calls.values())
    print_table(
        f"[many] {count} leases, ttl {TTL:g} s, held {seconds:g} s in one event loop",
        ["losses", "renewals", "failed", "threads (most)", "late p50", "late p99", "late max",
         "CPU"],
        [[str(lost), str(renewals), str(ops.failures), str(most),
          fmt_time(percentile(lateness, 50)) if lateness else "-",
          fmt_time(percentile(lateness, 99)) if lateness else "-",
          fmt_time(max(lateness)) if lateness else "-", f"{used * 100:.0f} %"]],
    )  # fmt: skip
    print(f"  zero losses: {verdict(lost == 0 and ops.failures == 0)}")


# -- 4. many waiting tasks ------------------------------------------------------------------------


async def many_waiters(url: str, resources: int, per_resource: int) -> None:
    async with fenced.aio.connect(url) as coord:
        queued: dict[str, list[int]] = {}
        served: dict[str, list[int]] = {}
        threads_before = threading.active_count()
        holders = [await coord.acquire(f"bench/waiters-{r}", ttl=30, wait=0)
                   for r in range(resources)]  # fmt: skip

        async def wait_turn(name: str, number: int) -> float:
            asked = time.monotonic()
            lease = await coord.acquire(name, ttl=10, wait=120)
            served.setdefault(name, []).append(number)
            await asyncio.sleep(0.001 + 0.004 * ((number * 7919) % 10) / 10)
            await coord.release(lease)
            return time.monotonic() - asked

        tasks = []
        for turn in range(per_resource):
            for r in range(resources):
                name = f"bench/waiters-{r}"
                number = turn
                queued.setdefault(name, []).append(number)
                tasks.append(asyncio.create_task(wait_turn(name, number)))
                await asyncio.sleep(0)
            await asyncio.sleep(0.05)  # every task of this turn has queued before the next
        await asyncio.sleep(0.5)
        threads_waiting = threading.active_count()
        started = time.monotonic()
        cpu = time.process_time()
        for lease in holders:
            await coord.release(lease)
        waits = await asyncio.gather(*tasks)
        took = time.monotonic() - started
        used = (time.process_time() - cpu) / took
    fifo = all(served.get(name) == order for name, order in queued.items())
    total = resources * per_resource
    print_table(
        f"[waiters] {total} tasks waiting on {resources} resources in one event loop",
        ["served", "FIFO per resource", "threads before / while waiting", "handoffs/s",
         "wait p50", "wait max", "CPU"],
        [[f"{sum(len(v) for v in served.values())} / {total}", "yes" if fifo else "NO",
          f"{threads_before} / {threads_waiting}", f"{total / took:,.0f}",
          fmt_time(percentile(waits, 50)), fmt_time(max(waits)), f"{used * 100:.0f} %"]],
    )  # fmt: skip
    print(f"  every waiter served in FIFO order: {verdict(fifo)}; no thread per waiter: "
          f"{verdict(threads_waiting - threads_before <= 2)}")  # fmt: skip


# -- main -----------------------------------------------------------------------------------------


# -- 5. stores ---------------------------------------------------------------------------------


class SyncPut(Cycle):
    """``store.put(token, "k", 100 bytes)`` by the installed holder, sync."""

    def __init__(self, url: str) -> None:
        self.name = SYNC
        self.what = "fenced Store.put (sync API)"
        self._store = fenced.open_store(url, "monotonic")
        self._store.fence(token(1))

    def step(self) -> tuple[float, float]:
        start = time.perf_counter()
        self._store.put(token(1), "k", VALUE)
        return time.perf_counter() - start, 0.0

    def close(self) -> None:
        self._store.close()


class AioPut(Cycle):
    """``await store.put(...)`` looped inside one event loop (no loop start per put)."""

    def __init__(self, url: str) -> None:
        self.name = AIO
        self.what = "fenced.aio AsyncStore.put, awaited on one event loop"
        self._runner = asyncio.Runner()
        before = threading.active_count()
        self._store = self._runner.run(fenced.aio.open_store(url, "monotonic"))
        self._runner.run(self._store.fence(token(1)))
        self.threads_added = threading.active_count() - before

    def run_round(self, seconds: float) -> Round:
        return self._runner.run(self._round(seconds))

    async def _round(self, seconds: float) -> Round:
        store, clock, puts = self._store, time.perf_counter, []
        start = now = clock()
        while now < start + seconds:
            await store.put(token(1), "k", VALUE)
            done = clock()
            puts.append(done - now)
            now = done
        return Round(len(puts) / (now - start), puts, puts, [0.0] * len(puts))

    def close(self) -> None:
        self._runner.run(self._store.aclose())
        self._runner.close()


VALUE = bytes(100)


def bench_store_puts(kind: str, url: str, rounds: int, seconds: float) -> None:
    aio = AioPut(url)
    results = cycle_rounds([SyncPut(url), aio], rounds, seconds, f"[stores] {kind}")
    print_cycles(results, f"[stores] {kind}: put", "puts/s", ("put p50", "-"))
    ratio = results.ratio(AIO, SYNC)
    print(f"  aio ÷ sync per round: {', '.join(f'{r:.2f}' for r in ratio)}; median "
          f"{median(ratio):.2f}; threads the asyncio store added: {aio.threads_added}")  # fmt: skip


def _backends(
    tmp: Path, wanted: Sequence[str]
) -> list[tuple[str, str, str | None, Callable[[], None]]]:
    """(name, url, etcd endpoint for aetcd, stop) of each wanted backend, servers started."""
    found: list[tuple[str, str, str | None, Callable[[], None]]] = []
    if "embedded" in wanted:
        found.append(("embedded", f"sqlite:{tmp}/coord.db", None, lambda: None))
    if "postgres" in wanted:
        from fenced.testing.postgres import PostgresServer

        os.chmod(tmp, 0o755)  # the server runs as the postgres user
        server = PostgresServer(tmp / "pg", durable=True)
        server.start()
        found.append(("PostgreSQL", server.dsn() + "?schema=bench_aio", None, server.stop))
    if "etcd" in wanted:
        from fenced.testing.etcd import EtcdCluster

        cluster = EtcdCluster(3)
        cluster.__enter__()
        leader = cluster.leader().endpoint
        ordered = [leader] + [e for e in cluster.endpoints if e != leader]
        url = "etcd://" + ",".join(ordered) + "?prefix=/bench-aio"
        found.append(("etcd (3 members)", url, leader, lambda: cluster.__exit__(None, None, None)))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.5, help="seconds per cycle round")
    parser.add_argument("--handoffs", type=int, default=100, help="handoffs per implementation")
    parser.add_argument("--leases", type=int, default=1000)
    parser.add_argument("--seconds-held", type=float, default=60.0)
    parser.add_argument(
        "--only", action="append", choices=["cycles", "handoff", "many", "waiters", "stores"]
    )
    parser.add_argument("--backend", action="append", choices=["embedded", "postgres", "etcd"])
    args = parser.parse_args()
    sections = args.only or ["cycles", "handoff", "many", "waiters", "stores"]
    wanted = args.backend or ["embedded", "postgres", "etcd"]
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit[1], limit[1]))  # 1,000 wake-up sockets
    print(f"fenced {fenced.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix=".bench-aio-", dir=".") as directory:
        tmp = Path(directory).absolute()
        backends = _backends(tmp, wanted) if {"cycles", "handoff", "stores"} & set(sections) else []
        try:
            for name, url, endpoint, _ in backends:
                if "stores" in sections and name == "embedded":
                    bench_store_puts("sqlite:", f"sqlite:{tmp}/store.db", args.rounds, args.seconds)
                if "stores" in sections and name == "PostgreSQL":
                    store_url = url.replace("schema=bench_aio", "schema=bench_aio_store")
                    bench_store_puts("postgresql://", store_url, args.rounds, args.seconds)
                if "cycles" in sections:
                    bench_cycles(name, url, endpoint, args.rounds, args.seconds)
                if "handoff" in sections:
                    bench_handoff(name, url, args.rounds, args.handoffs)
        finally:
            for *_, stop in backends:
                stop()
        if "many" in sections:
            asyncio.run(hold_many(f"sqlite:{tmp}/many.db", args.leases, args.seconds_held))
        if "waiters" in sections:
            asyncio.run(many_waiters(f"sqlite:{tmp}/waiters.db", 100, args.leases // 100))


if __name__ == "__main__":
    main()
