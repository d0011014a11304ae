"""Interleaved rounds shared by the benchmarks: cycles in this process, handoffs between two.

* :func:`cycle_rounds` runs every :class:`Cycle` for ``seconds`` a round, the rounds interleaved
  (A, B, C then C, B, A, …) after one discarded warm-up round; :func:`print_cycles` prints them.
* :class:`Workers` are worker processes (spawned) that :func:`serve` messages on a pipe with
  their :class:`WorkerLock` of each implementation; a handoff round (:func:`handoff_rounds`) has
  one hold a lease while the other waits for it, then the other way round;
  :func:`print_handoffs` prints them.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from _common import fmt_rate, fmt_ratio, fmt_time, jain, median, percentile, print_table

import fenced

__all__ = [
    "AcquireRelease",
    "Cycle",
    "FairRound",
    "FencedCycle",
    "HandoffMessages",
    "HandoffRound",
    "Results",
    "Round",
    "WorkerLock",
    "Workers",
    "contend",
    "cycle_rounds",
    "expect",
    "fairness_round",
    "fairness_rounds",
    "fenced_lock",
    "handoff_rounds",
    "interleaved",
    "print_cycles",
    "print_fairness",
    "print_handoffs",
    "serve",
    "timed_halves",
]


def round_options(parser: argparse.ArgumentParser, seconds: float, handoffs: int) -> None:
    """The options every round-based benchmark takes: ``--rounds``, ``--seconds`` (per
    implementation per cycle round) and ``--handoffs`` (per implementation, all rounds)."""
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    parser.add_argument(
        "--seconds",
        type=float,
        default=seconds,
        help=f"seconds per implementation per round for cycles (default {seconds:g})",
    )
    parser.add_argument(
        "--handoffs",
        type=int,
        default=handoffs,
        help=f"handoffs per implementation over all rounds (default {handoffs})",
    )


def interleaved(names: Sequence[str], round_number: int) -> list[str]:
    """A, B, C then C, B, A: every implementation runs early and late equally often."""
    return list(names) if round_number % 2 == 0 else list(reversed(names))


# -- cycles in this process -------------------------------------------------------------------


def timed_halves(first: Callable[[], object], second: Callable[[], object]) -> tuple[float, float]:
    """Run ``first`` then ``second``; return how long each took."""
    t0 = time.perf_counter()
    first()
    t1 = time.perf_counter()
    second()
    return t1 - t0, time.perf_counter() - t1


class Cycle:
    """One thing measured in a loop: ``step()`` is one cycle (acquire+release, or one write)."""

    name = ""
    what = ""

    def step(self) -> tuple[float, float]:
        """Run one cycle; return the durations of its two halves (or (t, 0))."""
        raise NotImplementedError

    def close(self) -> None:
        """Release connections."""


class AcquireRelease(Cycle):
    """A cycle of two halves: ``acquire()`` then ``release()``."""

    def acquire(self) -> None:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def step(self) -> tuple[float, float]:
        return timed_halves(self.acquire, self.release)


class FencedCycle(AcquireRelease):
    """fenced's ``acquire(resource, ttl=ttl, wait=0)`` + ``release``."""

    def __init__(
        self, url: str, name: str, what: str, resource: str = "bench/cycle", ttl: float = 30.0
    ) -> None:
        self.name = name
        self.what = what
        self._coord = fenced.connect(url)
        self._resource = resource
        self._ttl = ttl
        self._lease: fenced.Lease | None = None

    def acquire(self) -> None:
        self._lease = self._coord.acquire(self._resource, ttl=self._ttl, wait=0)

    def release(self) -> None:
        if self._lease is None or not self._coord.release(self._lease):
            raise RuntimeError("fenced: release() did not release")

    def close(self) -> None:
        self._coord.close()


@dataclass
class Round:
    rate: float
    cycles: list[float]
    firsts: list[float]
    seconds: list[float]


def run_round(impl: Cycle, seconds: float) -> Round:
    """Cycles of ``impl`` for ``seconds``; an implementation with a ``run_round(seconds)`` of
    its own (an asyncio one, looping inside its event loop) runs that instead."""
    own = getattr(impl, "run_round", None)
    if own is not None:
        result: Round = own(seconds)
        return result
    cycles: list[float] = []
    firsts: list[float] = []
    secs: list[float] = []
    start = time.perf_counter()
    end = start + seconds
    now = start
    while now < end:
        first, second = impl.step()
        firsts.append(first)
        secs.append(second)
        cycles.append(first + second)
        now = time.perf_counter()
    return Round(len(cycles) / (now - start), cycles, firsts, secs)


@dataclass
class Results:
    rounds: dict[str, list[Round]] = field(default_factory=dict)
    what: dict[str, str] = field(default_factory=dict)

    def rates(self, name: str) -> list[float]:
        return [r.rate for r in self.rounds[name]]

    def ratio(self, name: str, baseline: str) -> list[float]:
        """Per-round ratios (the rounds were interleaved, so each pair shared conditions)."""
        return [a / b for a, b in zip(self.rates(name), self.rates(baseline), strict=True)]


def cycle_rounds(impls: Sequence[Cycle], rounds: int, seconds: float, title: str) -> Results:
    """Warm-up, then ``rounds`` interleaved rounds of ``seconds`` each; closes ``impls``."""
    results = Results({i.name: [] for i in impls}, {i.name: i.what for i in impls})
    by_name = {i.name: i for i in impls}
    print(f"\n{title}: warm-up + {rounds} rounds x {len(impls)} x {seconds} s", flush=True)
    for impl in impls:  # warm-up, discarded
        run_round(impl, min(seconds, 0.3))
    for number in range(rounds):
        for name in interleaved(list(by_name), number):
            results.rounds[name].append(run_round(by_name[name], seconds))
        print(
            f"  round {number + 1}: "
            + ", ".join(f"{n} {fmt_rate(results.rounds[n][-1].rate)}/s" for n in by_name),
            flush=True,
        )
    for impl in impls:
        impl.close()
    return results


def print_cycles(results: Results, title: str, rate: str, halves: tuple[str, str]) -> None:
    """The table of cycle rounds: ``rate`` and ``halves`` name the columns."""
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
            fmt_time(percentile([x for r in rounds for x in r.firsts], 50)),
            fmt_time(percentile([x for r in rounds for x in r.seconds], 50)),
            results.what[name],
        ])  # fmt: skip
    print_table(
        title,
        ["implementation", rate, "rounds min–max", "p50", "p99", *halves, "what"],
        rows,
    )


# -- worker processes and handoffs ------------------------------------------------------------


def expect(conn: Connection, kind: str, timeout: float = 60.0) -> tuple[Any, ...]:
    """The next message of a worker, which must be a ``kind`` one."""
    if not conn.poll(timeout):
        raise RuntimeError(f"a worker sent no {kind!r} within {timeout} s")
    message: tuple[Any, ...] = conn.recv()
    if message[0] != kind:
        raise RuntimeError(f"expected {kind!r} from a worker, got {message!r}")
    return message


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


def fenced_lock(url: str, ttl: float) -> WorkerLock:
    coord = fenced.connect(url)
    leases: dict[str, fenced.Lease] = {}

    def acquire(resource: str, wait: float | None) -> None:
        leases[resource] = coord.acquire(resource, ttl=ttl, wait=wait)

    def release(resource: str) -> None:
        if not coord.release(leases.pop(resource)):
            raise RuntimeError("fenced: release() did not release")

    return WorkerLock(acquire, release, coord.close)


def serve(conn: Connection, locks: dict[str, WorkerLock]) -> None:
    """A worker process's loop: says ``("ready",)``, then obeys ``("acquire", LOCK, resource,
    wait)``, ``("release", LOCK, resource)``, ``("contend", LOCK, resource, start_at, seconds)``
    (see :func:`contend`) and ``("exit",)``, which closes ``locks``."""
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
    """``count`` processes running ``target(conn, *args)``, started with the spawn method (no
    inherited connections or threads); each says ``("ready",)`` first and leaves on
    ``("exit",)``."""

    def __init__(self, count: int, target: Callable[..., None], *args: object) -> None:
        context = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        for _ in range(count):
            parent, child = context.Pipe()
            proc = context.Process(target=target, args=(child, *args), daemon=True)
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


@dataclass
class HandoffRound:
    latencies: list[float]
    releases: list[float]


class HandoffMessages(NamedTuple):
    """What a handoff round sends the workers for one implementation."""

    hold: tuple[Any, ...]
    """The first holder's acquire (answered ``entering`` then ``acquired``)."""
    wait: tuple[Any, ...]
    """The waiter's acquire, which blocks until the holder releases."""
    release: tuple[Any, ...]
    """The holder's release (answered ``released``, with its start and duration)."""
    gap: tuple[float, float]
    """How long (uniformly drawn) the holder keeps the lease after the waiter announced itself:
    long enough for the waiter to be blocked in acquire."""


def handoff_round(
    messages: HandoffMessages, a: Connection, b: Connection, count: int, rng: random.Random
) -> HandoffRound:
    latencies: list[float] = []
    releases: list[float] = []
    holder, waiter = a, b
    holder.send(messages.hold)
    expect(holder, "entering")
    expect(holder, "acquired")
    for _ in range(count):
        waiter.send(messages.wait)
        expect(waiter, "entering")
        time.sleep(rng.uniform(*messages.gap))
        holder.send(messages.release)
        _, released_at, release_took = expect(holder, "released")
        _, acquired_at = expect(waiter, "acquired")
        latencies.append(acquired_at - released_at)
        releases.append(release_took)
        holder, waiter = waiter, holder
    holder.send(messages.release)
    expect(holder, "released")
    return HandoffRound(latencies, releases)


def handoff_rounds(
    workers: Workers,
    messages: dict[str, HandoffMessages],
    rounds: int,
    total: int,
    title: str,
) -> dict[str, list[HandoffRound]]:
    """Warm-up, then ``rounds`` interleaved rounds between the first two workers: ``total``
    handoffs per implementation (the names of ``messages``) in all."""
    per_round = math.ceil(total / rounds)
    names = list(messages)
    results: dict[str, list[HandoffRound]] = {name: [] for name in names}
    rng = random.Random(1)
    a, b = workers.conns[:2]
    print(f"\n{title}: warm-up + {rounds} rounds x {per_round} handoffs", flush=True)
    for name in names:
        handoff_round(messages[name], a, b, 10, rng)
    for round_number in range(rounds):
        for name in interleaved(names, round_number):
            results[name].append(handoff_round(messages[name], a, b, per_round, rng))
        print(
            f"  round {round_number + 1}: "
            + ", ".join(
                f"{n} p50 {fmt_time(percentile(results[n][-1].latencies, 50))}" for n in names
            ),
            flush=True,
        )
    return results


def print_handoffs(results: dict[str, list[HandoffRound]], title: str) -> None:
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
        title,
        ["implementation", "n", "p50", "p90", "p99", "max", "p50 rounds min–max", "release() p50"],
        rows,
    )


# -- fairness: processes contending on one resource -----------------------------------------------
@dataclass
class FairRound:
    """One contention round: grants per process inside the window, and every wait."""

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


def fairness_round(impl: str, workers: Workers, seconds: float, resource: str) -> FairRound:
    """Every worker contends on ``resource`` with ``impl`` for ``seconds``, starting together."""
    start_at = time.monotonic() + 0.2
    for conn in workers.conns:
        conn.send(("contend", impl, resource, start_at, seconds))
    replies = [expect(conn, "contended", timeout=seconds + 120) for conn in workers.conns]
    return FairRound(seconds, [r[1] for r in replies], [w for r in replies for w in r[2]])


def fairness_rounds(
    workers: Workers, names: Sequence[str], rounds: int, seconds: float, resource: str
) -> dict[str, list[FairRound]]:
    """A short warm-up per implementation, then ``rounds`` interleaved rounds, each printed."""
    results: dict[str, list[FairRound]] = {name: [] for name in names}
    print(
        f"\n[3/3] fairness: {len(workers.conns)} processes, warm-up + {rounds} rounds x "
        f"{seconds:g} s",
        flush=True,
    )
    for name in names:
        fairness_round(name, workers, min(seconds, 1.0), resource)
    for number in range(rounds):
        for name in interleaved(names, number):
            results[name].append(fairness_round(name, workers, seconds, resource))
        print(
            f"  round {number + 1}: "
            + ", ".join(
                f"{n} {fmt_rate(results[n][-1].rate)}/s counts {results[n][-1].counts}"
                for n in names
            ),
            flush=True,
        )
    return results


def print_fairness(results: dict[str, list[FairRound]], title: str) -> None:
    """One row per implementation: rates, the worst round's spread, min/mean, Jain, waits."""
    rows = []
    for name, found in results.items():
        rates = [r.rate for r in found]
        worst = min(found, key=lambda r: r.min_share)
        waits = [w for r in found for w in r.waits]
        rows.append([
            name,
            fmt_rate(median(rates)),
            f"{fmt_rate(min(rates))} – {fmt_rate(max(rates))}",
            f"{min(worst.counts):,} / {max(worst.counts):,}",
            fmt_ratio(worst.min_share),
            fmt_ratio(min(r.jain for r in found)),
            fmt_time(percentile(waits, 50)),
            fmt_time(percentile(waits, 99)),
        ])  # fmt: skip
    header = ["implementation", "acquisitions/s", "rounds min–max", "per-process min / max"]
    print_table(title, [*header, "min/mean", "Jain", "wait p50", "wait p99"], rows)
