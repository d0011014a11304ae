"""fenced's etcd backend against the etcd locks Python users reach for, on one 3-member cluster.

Usage::

    .venv/bin/python benchmarks/bench_etcd.py                 # ~3.5 minutes
    .venv/bin/python benchmarks/bench_etcd.py --rounds 9 --seconds 1
    .venv/bin/python benchmarks/bench_etcd.py --only cycles --only handoff

The benchmark starts its own 3-member etcd cluster (``fenced.testing.etcd.EtcdCluster``: loopback
ports, fsync on as etcd always does, ``--heartbeat-interval 50 --election-timeout 500``) and
stops it by PID at the end. Implementations, all through the same cluster, each on its own key:

- ``fenced``: ``fenced.connect("etcd://…")`` (requests and watches over etcd's gRPC API),
  ``acquire(ttl=30)`` / ``release()``: a fencing
  token, the epoch and the record written in the grant's transaction; a release hands the lease
  to the head waiter in its own transaction (the holder's process watches the line of a key it
  takes a second time, and the waiter's of the key it queues for: the warm-up round covers it);
- ``aetcd Lock``: ``aetcd.Client.lock(name, ttl=30)`` (gRPC): a new etcd lease per acquire, a
  create-if-absent txn, a delete txn; waiters all watch the lock key;
- ``etcd v3lock``: etcd's built-in ``Lock``/``Unlock`` RPC through the JSON gateway with one
  session lease (what ``etcdctl lock`` does); waiters watch their predecessor;
- ``tooz etcd3gw``: ``tooz.coordination.get_coordinator("etcd3+http://…")`` lock: a new lease
  per attempt, retries with a backoff (up to 1 s) instead of watching.

Sections (every section interleaves the implementations round by round, in alternating order,
after one discarded warm-up round; ratios are taken per round, then the median is reported —
5 rounds by default, since on a shared 2-core machine one round in three is often disturbed):

1. **cycles**: uncontended ``acquire`` + ``release`` back to back for ``--seconds`` per round.
   Targets: fenced ≥ 1.2 × aetcd Lock and ≥ 2 × tooz.
2. **handoff**: two processes pass the lock back and forth; the waiter announces itself and
   blocks in acquire, the holder keeps the lock 40-60 ms more (so that every implementation's
   waiter is really blocked, watches established), records ``time.monotonic()`` just before its
   ``release()``; the waiter records it just after its ``acquire()`` returned. Target: fenced
   p50 ≤ 5 ms. One more row, ``fenced gateway`` (``?api=gateway``: requests and watches over
   etcd's JSON gateway), compares the two transports on the path a handoff takes.
3. **fairness**: ``--processes`` processes (8) loop acquire / release on one key for
   ``--fair-seconds``, starting together; only grants inside the window count. Target: every
   fenced process gets ≥ 0.8 × the mean share.
4. **spread**: the same processes, each cycling on a key of its own for ``--fair-seconds``
   (many machines, many resources): total cycles/s and acquisitions that failed. No target;
   nothing but the cluster's capacity should limit it.
5. **api**: fenced's uncontended cycle with its requests over gRPC (the default, the ``fenced``
   row above) and over etcd's JSON gateway (``?api=gateway``), interleaved: cycles/s, and the
   CPU per cycle of the three members (``/proc/PID/stat``) and of this process. No target; it
   shows why the default is gRPC.
6. **tls**: a second 3-member cluster with TLS on both sides (``EtcdCluster(3, tls=True)``:
   ``--client-cert-auth``, peer TLS, the same flags otherwise); the uncontended cycle of fenced
   and aetcd's Lock on the plaintext and on the TLS cluster, interleaved, then the handoff over
   TLS. aetcd has no TLS option, so the benchmark replaces its channel factory with one that
   opens a ``grpc.aio.secure_channel`` (same options). Targets: fenced over TLS ≥ 0.85 × fenced
   plaintext and ≥ 1.2 × aetcd's Lock over TLS; handoff p50 over TLS ≤ 5 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).parent))

from _common import fmt_rate, fmt_ratio, fmt_time, jain, percentile, print_table, verdict

from fenced.coordinator.backends.etcd._client import Transport, b64
from fenced.testing.etcd import EtcdCluster

IMPLS = ["fenced", "aetcd Lock", "etcd v3lock", "tooz etcd3gw"]


# -- drivers: one sync acquire/release API per implementation -----------------------------------


class Driver(Protocol):
    def acquire(self) -> None: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Target:
    """A cluster as the drivers reach it: its client endpoints (the leader first) and, for a TLS
    cluster, the CA and the client certificate and key (paths)."""

    endpoints: list[str]
    tls: tuple[str, str, str] | None = None

    def fenced_url(self, prefix: str, api: str = "grpc") -> str:
        query = f"?prefix={prefix}&api={api}"
        if self.tls is None:
            return "etcd://" + ",".join(self.endpoints) + query
        ca, cert, key = self.tls
        return "etcds://" + ",".join(self.endpoints) + query + f"&ca={ca}&cert={cert}&key={key}"


class FencedDriver:
    def __init__(self, target: Target, key: str, api: str = "grpc") -> None:
        import fenced

        self._coord = fenced.connect(target.fenced_url("/bench-fenced", api))
        self._key = key
        self._lease: Any = None

    def acquire(self) -> None:
        self._lease = self._coord.acquire(self._key, ttl=30, wait=None)

    def release(self) -> None:
        self._coord.release(self._lease)

    def close(self) -> None:
        self._coord.close()


def _aetcd_over_tls(target: Target) -> None:
    """Make aetcd open a TLS channel to ``target``'s members: aetcd has no TLS option (it calls
    ``grpc.aio.insecure_channel``), so its channel factory is replaced by one that opens a
    ``grpc.aio.secure_channel`` with the same options for these endpoints (others stay plain)."""
    import aetcd.rpc
    import grpc

    assert target.tls is not None
    ca, cert, key = (Path(path).read_bytes() for path in target.tls)
    credentials = grpc.ssl_channel_credentials(ca, key, cert)
    plain = aetcd.rpc.insecure_channel
    secured = set(target.endpoints)

    def channel(where: str, options: Any = None) -> Any:
        if where in secured:
            return grpc.aio.secure_channel(where, credentials, options=options)
        return plain(where, options=options)

    aetcd.rpc.insecure_channel = channel


class AetcdDriver:
    def __init__(self, target: Target, key: str) -> None:
        import aetcd

        if target.tls is not None:
            _aetcd_over_tls(target)
        host, port = target.endpoints[0].rsplit(":", 1)
        self._loop = asyncio.new_event_loop()
        self._client = aetcd.Client(host=host, port=int(port))
        self._key = ("/bench-aetcd/" + key).encode()
        self._lock: Any = None

    def acquire(self) -> None:
        self._lock = self._client.lock(self._key, ttl=30)
        self._loop.run_until_complete(self._lock.acquire(timeout=None))

    def release(self) -> None:
        self._loop.run_until_complete(self._lock.release())

    def close(self) -> None:
        self._loop.run_until_complete(self._client.close())
        self._loop.close()


class V3LockDriver:
    """etcd's Lock RPC via the gateway, one session lease kept for the whole run (TTL 60)."""

    def __init__(self, target: Target, key: str) -> None:
        hosts = [(e.rsplit(":", 1)[0], int(e.rsplit(":", 1)[1])) for e in target.endpoints]
        self._http = Transport(hosts[:1], timeout=30, connect_timeout=1)
        self._lease = self._http.call("lease/grant", {"TTL": "60"}, mutating=True)["ID"]
        self._name = b64("/bench-v3lock/" + key)
        self._held = ""

    def acquire(self) -> None:
        reply = self._http.call(
            "lock/lock", {"name": self._name, "lease": self._lease}, mutating=True
        )
        self._held = reply["key"]

    def release(self) -> None:
        self._http.call("lock/unlock", {"key": self._held}, mutating=True)

    def close(self) -> None:
        self._http.call("lease/revoke", {"ID": self._lease}, mutating=True)
        self._http.close()


class ToozDriver:
    def __init__(self, target: Target, key: str) -> None:
        from tooz import coordination

        self._coord = coordination.get_coordinator(
            "etcd3+http://" + target.endpoints[0], uuid.uuid4().hex.encode()
        )
        self._coord.start(start_heart=True)
        self._lock = self._coord.get_lock(("/bench-tooz/" + key).encode())

    def acquire(self) -> None:
        self._lock.acquire(blocking=True)

    def release(self) -> None:
        self._lock.release()

    def close(self) -> None:
        self._coord.stop()


def _fenced_gateway(target: Target, key: str) -> Driver:
    return FencedDriver(target, key, "gateway")


DRIVERS: dict[str, Callable[[Target, str], Driver]] = {
    "fenced": FencedDriver,
    "fenced gateway": _fenced_gateway,
    "aetcd Lock": AetcdDriver,
    "etcd v3lock": V3LockDriver,
    "tooz etcd3gw": ToozDriver,
}


# -- 1. cycles ----------------------------------------------------------------------------------


def cycles(driver: Driver, seconds: float) -> list[float]:
    durations: list[float] = []
    end = time.perf_counter() + seconds
    while True:
        started = time.perf_counter()
        if started >= end:
            return durations
        driver.acquire()
        driver.release()
        durations.append(time.perf_counter() - started)


def cycle_rounds(
    drivers: dict[str, Driver], rounds: int, seconds: float, title: str
) -> dict[str, list[float]]:
    """The uncontended cycle of every driver, ``rounds`` interleaved rounds after a warm-up; the
    table is printed with ``title``, the drivers are closed; each one's cycles/s per round."""
    rates: dict[str, list[float]] = {name: [] for name in drivers}
    samples: dict[str, list[float]] = {name: [] for name in drivers}
    for number in range(rounds + 1):
        for name in list(drivers) if number % 2 == 0 else list(drivers)[::-1]:
            durations = cycles(drivers[name], seconds if number else min(seconds, 0.5))
            if number:
                rates[name].append(len(durations) / sum(durations))
                samples[name] += durations
    for driver in drivers.values():
        driver.close()
    print_table(
        title,
        ["implementation", "cycles/s", "rounds min–max", "cycle p50", "cycle p99"],
        [
            [
                name,
                fmt_rate(statistics.median(rates[name])),
                f"{fmt_rate(min(rates[name]))} – {fmt_rate(max(rates[name]))}",
                fmt_time(percentile(samples[name], 50)),
                fmt_time(percentile(samples[name], 99)),
            ]
            for name in drivers
        ],
    )
    return rates


def bench_cycles(target: Target, impls: list[str], rounds: int, seconds: float) -> None:
    print(f"\n[cycles] warm-up + {rounds} rounds x {seconds:g} s per implementation", flush=True)
    rates = cycle_rounds(
        {name: DRIVERS[name](target, "cycle") for name in impls},
        rounds,
        seconds,
        "1. Uncontended acquire+release cycle (one process, one key)",
    )

    if "fenced" in impls:
        goals = (("aetcd Lock", 1.2), ("tooz etcd3gw", 2.0), ("etcd v3lock", 0.0))
        print_ratios(rates, [("fenced", other, goal) for other, goal in goals if other in impls])


def print_ratios(rates: dict[str, list[float]], pairs: list[tuple[str, str, float]]) -> None:
    """For each (mine, other, goal): the median of the per-round ratios mine / other, against
    the goal (0: no goal)."""
    for mine, other, goal_ratio in pairs:
        value = statistics.median(a / b for a, b in zip(rates[mine], rates[other], strict=True))
        goal = f"target ≥ {goal_ratio:g}: {verdict(value >= goal_ratio)}" if goal_ratio else "info"
        print(f"{mine} / {other}: {fmt_ratio(value)} (median of per-round ratios; {goal})")


# -- 2. handoff ---------------------------------------------------------------------------------


def _handoff_worker(name: str, target: Target, key: str, conn: mpc.Connection, role: str) -> None:
    driver = DRIVERS[name](target, key)
    rng = random.Random()
    while True:
        command = conn.recv()
        if command == "stop":
            break
        if role == "holder":
            if command == "acquire":
                driver.acquire()
                conn.send("held")
            elif command == "release":
                time.sleep(rng.uniform(0.04, 0.06))
                released = time.monotonic()
                driver.release()
                conn.send(released)
        else:  # waiter
            conn.send("ready")
            driver.acquire()
            got = time.monotonic()
            driver.release()
            conn.send(got)
    driver.close()


def bench_handoff(
    target: Target, impls: list[str], rounds: int, per_round: int, title: str = ""
) -> None:
    ctx = mp.get_context("spawn")
    latencies: dict[str, list[float]] = {name: [] for name in impls}
    round_p50: dict[str, list[float]] = {name: [] for name in impls}
    pairs = {}
    for name in impls:
        key = "handoff-" + uuid.uuid4().hex[:6]
        ends = []
        for role in ("holder", "waiter"):
            mine, theirs = ctx.Pipe()
            process = ctx.Process(
                target=_handoff_worker, args=(name, target, key, theirs, role), daemon=True
            )
            process.start()
            ends.append((mine, process))
        pairs[name] = ends
    print(f"\n[handoff{title}] warm-up + {rounds} rounds x {per_round} handoffs", flush=True)
    for number in range(rounds + 1):
        order = impls if number % 2 == 0 else impls[::-1]
        for name in order:
            (holder, _), (waiter, _) = pairs[name]
            count = per_round if number else 3
            if name == "tooz etcd3gw":
                count = max(2, count // 8)  # ~1 s each
            found = []
            for _ in range(count):
                holder.send("acquire")
                assert holder.recv() == "held"
                waiter.send("go")
                assert waiter.recv() == "ready"
                holder.send("release")
                released = holder.recv()
                got = waiter.recv()
                found.append(got - released)
            if number:
                latencies[name] += found
                round_p50[name].append(statistics.median(found))
    for ends in pairs.values():
        for conn, process in ends:
            conn.send("stop")
            process.join(10)
    rows = []
    for name in impls:
        values = latencies[name]
        rows.append(
            [
                name,
                str(len(values)),
                fmt_time(percentile(values, 50)),
                fmt_time(percentile(values, 90)),
                fmt_time(percentile(values, 99)),
                f"{fmt_time(min(round_p50[name]))} – {fmt_time(max(round_p50[name]))}",
            ]
        )
    print_table(
        f"2. Handoff{title} (holder's release() called -> blocked waiter's acquire() returned)",
        ["implementation", "n", "p50", "p90", "p99", "round p50 min–max"],
        rows,
    )
    if "fenced" in impls:
        p50 = percentile(latencies["fenced"], 50)
        print(f"fenced handoff p50 {fmt_time(p50)}: target ≤ 5 ms {verdict(p50 <= 5e-3)}")


# -- 3. fairness --------------------------------------------------------------------------------


def _fair_worker(
    name: str, target: Target, key: str, start: float, seconds: float, conn: mpc.Connection
) -> None:
    """Cycle on ``key`` from ``start`` for ``seconds``; send (acquisitions, failed acquires)."""
    driver = DRIVERS[name](target, key)
    conn.send("ready")
    while time.monotonic() < start:
        time.sleep(0.001)
    count = failed = 0
    end = start + seconds
    while time.monotonic() < end:
        try:
            driver.acquire()
        except Exception:  # counted: a lock that gives up under load is part of the figure
            failed += 1
            continue
        if time.monotonic() < end:
            count += 1
        driver.release()
    conn.send((count, failed))
    driver.close()


def _run_workers(
    name: str, target: Target, keys: list[str], seconds: float
) -> list[tuple[int, int]]:
    """One process per key (the same key several times: they contend); their results."""
    ctx = mp.get_context("spawn")
    start = time.monotonic() + 3.0 + 0.3 * len(keys)
    ends = []
    for key in keys:
        mine, theirs = ctx.Pipe()
        process = ctx.Process(
            target=_fair_worker, args=(name, target, key, start, seconds, theirs), daemon=True
        )
        process.start()
        ends.append((mine, process))
    for conn, _ in ends:
        assert conn.recv() == "ready"
    results = []
    for conn, process in ends:
        results.append(conn.recv() if conn.poll(seconds + 60) else (0, 0))
        process.join(10)
    return results


def bench_fairness(
    target: Target, impls: list[str], rounds: int, processes: int, seconds: float
) -> None:
    results: dict[str, list[list[int]]] = {name: [] for name in impls}
    print(f"\n[fairness] {rounds} rounds x {processes} processes x {seconds:g} s", flush=True)
    for number in range(rounds):
        order = impls if number % 2 == 0 else impls[::-1]
        for name in order:
            key = "fair-" + uuid.uuid4().hex[:6]
            found = _run_workers(name, target, [key] * processes, seconds)
            results[name].append([count for count, _ in found])
    rows = []
    for name in impls:
        worst = min(results[name], key=lambda c: min(c) / max(statistics.mean(c), 1e-9))
        rates = [sum(c) / seconds for c in results[name]]
        mean = statistics.mean(worst)
        rows.append(
            [
                name,
                fmt_rate(statistics.median(rates)),
                f"{min(worst)} / {max(worst)}",
                fmt_ratio(min(worst) / mean if mean else math.nan),
                fmt_ratio(jain([float(c) for c in worst])),
            ]
        )
    print_table(
        f"3. Fairness ({processes} processes, one key, {seconds:g} s; worst round)",
        ["implementation", "acquisitions/s", "per-process min / max", "min/mean", "Jain"],
        rows,
    )
    if "fenced" in impls:
        share = min(min(c) / statistics.mean(c) for c in results["fenced"])
        print(f"fenced min/mean share {fmt_ratio(share)}: target ≥ 0.8 {verdict(share >= 0.8)}")


def bench_spread(target: Target, impls: list[str], processes: int, seconds: float) -> None:
    """Processes that each cycle on a key of their own: nothing should make them conflict."""
    print(f"\n[spread] {processes} processes x {seconds:g} s, one key each", flush=True)
    rows = []
    for name in impls:
        base = "spread-" + uuid.uuid4().hex[:6]
        found = _run_workers(name, target, [f"{base}-{i}" for i in range(processes)], seconds)
        counts = [count for count, _ in found]
        rows.append(
            [
                name,
                fmt_rate(sum(counts) / seconds),
                f"{min(counts)} / {max(counts)}",
                str(sum(failed for _, failed in found)),
            ]
        )
    print_table(
        f"4. Spread ({processes} processes, a key each, {seconds:g} s; no target)",
        ["implementation", "cycles/s", "per-process min / max", "failed acquires"],
        rows,
    )


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes so far (``/proc/PID/stat``)."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return ticks / os.sysconf("SC_CLK_TCK")


def bench_api(target: Target, pids: list[int], rounds: int, seconds: float) -> None:
    """fenced's uncontended cycle with its requests over gRPC (the default) and over etcd's JSON
    gateway (``?api=gateway``): throughput, and the CPU each cycle costs the three members and
    this client process (why the default is gRPC: docs/etcd.md, "Client")."""
    apis = ["grpc", "gateway"]
    drivers = {api: FencedDriver(target, "api-" + api, api) for api in apis}
    found: dict[str, list[tuple[float, float, float]]] = {api: [] for api in apis}
    print(f"\n[api] warm-up + {rounds} rounds x {seconds:g} s per API", flush=True)
    for number in range(rounds + 1):
        for api in apis if number % 2 == 0 else apis[::-1]:
            members, client = _cpu_seconds(pids), time.process_time()
            durations = cycles(drivers[api], seconds if number else min(seconds, 0.5))
            count = len(durations)
            if number and count:
                found[api].append(
                    (
                        count / sum(durations),
                        (_cpu_seconds(pids) - members) / count,
                        (time.process_time() - client) / count,
                    )
                )
    for driver in drivers.values():
        driver.close()
    rows = [
        [
            api,
            fmt_rate(statistics.median(f[0] for f in found[api])),
            fmt_time(statistics.median(f[1] for f in found[api])),
            fmt_time(statistics.median(f[2] for f in found[api])),
        ]
        for api in apis
    ]
    print_table(
        "5. fenced's requests over gRPC vs over the JSON gateway (uncontended cycle; no target)",
        ["api", "cycles/s", "members' CPU / cycle", "client CPU / cycle"],
        rows,
    )
    per_round = [g[0] / w[0] for g, w in zip(found["grpc"], found["gateway"], strict=True)]
    print(f"grpc / gateway: {fmt_ratio(statistics.median(per_round))} (median of per-round ratios)")


def bench_tls(plain: Target, tls: Target, rounds: int, seconds: float, handoffs: int) -> None:
    """The uncontended cycle on the plaintext cluster and on the TLS cluster side by side (fenced
    and aetcd's Lock on each, rounds interleaved), then the handoff over TLS."""
    runs: dict[str, Driver] = {
        "fenced": FencedDriver(plain, "tls-cycle"),
        "fenced TLS": FencedDriver(tls, "tls-cycle"),
        "aetcd Lock": AetcdDriver(plain, "tls-cycle"),
        "aetcd Lock TLS": AetcdDriver(tls, "tls-cycle"),
    }
    print(f"\n[tls] warm-up + {rounds} rounds x {seconds:g} s, plaintext and TLS", flush=True)
    rates = cycle_rounds(
        runs,
        rounds,
        seconds,
        "6. Uncontended cycle, plaintext cluster vs TLS cluster (client certificates)",
    )
    print_ratios(
        rates,
        [
            ("fenced TLS", "fenced", 0.85),
            ("fenced TLS", "aetcd Lock TLS", 1.2),
            ("aetcd Lock TLS", "aetcd Lock", 0.0),
        ],
    )
    bench_handoff(tls, ["fenced", "aetcd Lock"], rounds, handoffs, title=" over TLS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--handoffs", type=int, default=20, help="handoffs per round")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--fair-seconds", type=float, default=4.0)
    parser.add_argument("--fair-rounds", type=int, default=1)
    parser.add_argument(
        "--only",
        action="append",
        choices=["cycles", "handoff", "fairness", "spread", "api", "tls"],
    )
    parser.add_argument("--impl", action="append", choices=IMPLS)
    args = parser.parse_args()
    sections = args.only or ["cycles", "handoff", "fairness", "spread", "api", "tls"]
    impls = args.impl or IMPLS
    with EtcdCluster(3) as cluster:
        endpoints = cluster.endpoints
        leader = cluster.leader()
        # single-endpoint clients talk to the leader, as fenced (which finds it) does
        ordered = [leader.endpoint] + [e for e in endpoints if e != leader.endpoint]
        print(f"etcd 3-member cluster {','.join(endpoints)}; leader {leader.endpoint}")
        target = Target(ordered)
        if "cycles" in sections:
            bench_cycles(target, impls, args.rounds, args.seconds)
        if "handoff" in sections:
            # fenced gateway: watches (and requests) over the JSON gateway, for comparison
            extra = ["fenced gateway"] if "fenced" in impls else []
            bench_handoff(target, impls + extra, args.rounds, args.handoffs)
        if "fairness" in sections:
            bench_fairness(target, impls, args.fair_rounds, args.processes, args.fair_seconds)
        if "spread" in sections:
            bench_spread(target, impls, args.processes, args.fair_seconds)
        if "api" in sections:
            pids = [pid for pid in (member.pid for member in cluster.members) if pid is not None]
            bench_api(target, pids, args.rounds, args.seconds)
        if "tls" in sections:
            with EtcdCluster(3, tls=True) as secured:
                first = secured.leader().endpoint
                tls = Target(
                    [first] + [e for e in secured.endpoints if e != first],
                    tuple(  # type: ignore[arg-type]
                        str(path)
                        for path in (
                            secured.authority.cert,
                            secured.client.cert,
                            secured.client.key,
                        )
                    ),
                )
                print(f"etcd 3-member TLS cluster {','.join(tls.endpoints)}", flush=True)
                bench_tls(target, tls, args.rounds, args.seconds, args.handoffs)


if __name__ == "__main__":
    main()
