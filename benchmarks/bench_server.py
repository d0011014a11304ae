"""``fenced serve`` (HTTP/JSON on uvicorn) against the in-process coordinator and tooz's etcd3gw.

Usage::

    flock /tmp/fenced-bench.lock .venv/bin/python benchmarks/bench_server.py   # ~2.5 min + 60 s
    .venv/bin/python benchmarks/bench_server.py --only cycles --only handoff
    .venv/bin/python benchmarks/bench_server.py --only many --many-seconds 10   # a quick look
    .venv/bin/python benchmarks/bench_server.py --rounds 2 --many-seconds 10 --publishes 1

Every section starts its own server, ``python -m fenced serve --listen 127.0.0.1:0`` as a
process of its own (:class:`fenced.testing.server.ServeProcess`) over the embedded backend
(``sqlite:///DIR/…db``), and stops it by PID; clients are ``fenced.connect("http://…")`` and
``fenced.open_store("http://…/stores/NAME")``. DIR is a temporary directory under ``--dir``
(default: ``benchmarks/``, the repository's disk), removed at the end. The header and the last
line print the load averages: on a shared machine rerun when they are high.

Sections (the implementations run interleaved round by round, in alternating order, after one
discarded warm-up round; ratios are taken per round and their median is reported):

1. **cycles**: uncontended ``acquire(ttl=30, wait=0)`` + ``release()`` back to back, one
   process, one resource, ``--seconds`` per implementation per round:
   - ``fenced HTTP``: through the server (two requests per cycle);
   - ``fenced in-process``: ``fenced.connect("sqlite:///…")`` in this process, its own database
     file in the same directory (one durable commit per cycle, as the server's);
   - ``tooz etcd3gw``: tooz's ``etcd3+http://`` lock on a private etcd (``--etcd-members``, 1
     by default as in the anchors; fsync on) through etcd's JSON gateway: a new etcd lease per
     acquire, a create-if-absent txn, a delete;
   - ``2 × GET /healthz``: two requests of a bare httpx client (keep-alive, TCP_NODELAY) to the
     same server, what two round trips through uvicorn and FastAPI cost with no coordinator
     (no target: where the time goes).

   A second table gives the CPU each cycle costs this process and the server (fenced serve,
   or the etcd member), from ``process_time`` and ``/proc/PID/stat``. Targets: fenced HTTP
   ≥ 0.5 × fenced in-process and ≥ 3 × tooz etcd3gw.
2. **handoff**: two worker processes pass one lease back and forth. The waiter announces itself
   and blocks in ``acquire(wait=None)`` (over HTTP: a long poll that the release answers); the
   holder keeps the lease 10-20 ms more, records ``time.monotonic()`` just before ``release()``,
   the waiter just after its ``acquire()`` returned. Rows: over HTTP, and the in-process
   embedded coordinator in the same processes for comparison. Targets (HTTP): p50 ≤ 3 ms,
   p99 ≤ 15 ms.
3. **many**: ``--many-processes`` client processes (10) hold ``--many-leases`` leases (1,000,
   a resource each, spread evenly), ttl 5 s, for ``--many-seconds`` (60) through one server.
   Each process holds its leases with ``coord.hold(…)`` context managers in one
   ``contextlib.ExitStack``: the coordinator's one scheduler renews each at ttl/3 (±10 %) on up
   to 4 renewal threads per process. The window opens once every lease is held. Figures:
   **losses** (a lease whose ``lost`` was set, or whose ``with`` raised at the exit; target 0),
   renewals in the window and failed ones, the **renewal request** latency p50/p99/max timed in
   the client around ``Coordinator.renew`` (the client's HTTP work included), the **server's
   CPU** over the window (utime + stime of its PID, ``/proc/PID/stat``, as % of one core) and
   the clients' CPU likewise (their ``process_time``), and a **probe**: a thread of this
   process asking ``current()`` every 20 ms over a client of its own, timed (the server's
   latency without the client processes' own queues). No speed target; losses must be zero.
4. **publish**: ``store.publish(token, path)`` of a ``--publish-mib`` (64) MiB file of random
   bytes through the gateway (a server with ``--store files=file:///DIR/store``; the client
   streams the file in 1 MiB chunks, the server streams it to the store) and, for comparison,
   to an in-process ``file:`` store in the same directory; one warm-up publish each, then
   ``--publishes`` (3) rounds. Figures: MiB/s (client's wall time of ``publish``) and the
   server's **RSS growth** per publish, ``VmHWM`` after minus ``VmRSS`` before
   (``/proc/PID/status``; the peak is reset before each publish by writing 5 to
   ``/proc/PID/clear_refs``), the largest over every publish, the warm-up included. Target:
   ≤ 32 MiB.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import platform
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import httpx
from _common import fmt_rate, fmt_ratio, fmt_time, median, percentile, print_table, verdict
from _rounds import (
    AcquireRelease,
    Cycle,
    FencedCycle,
    HandoffMessages,
    HandoffRound,
    Results,
    Round,
    Workers,
    cycle_rounds,
    fenced_lock,
    handoff_rounds,
    interleaved,
    print_cycles,
    print_handoffs,
    round_options,
    run_round,
    serve,
)

import fenced
from fenced.testing.etcd import EtcdCluster
from fenced.testing.server import ServeProcess

HTTP = "fenced HTTP"
LOCAL = "fenced in-process"
TOOZ = "tooz etcd3gw"
HEALTHZ = "2 × GET /healthz"
SECTIONS = ["cycles", "handoff", "many", "publish"]
TTL = 30.0
MANY_TTL = 5.0
MiB = 1 << 20


def loads() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def start_server(directory: Path, name: str, *extra: str) -> ServeProcess:
    """``fenced serve`` over a new embedded database ``DIR/NAME.db``, as a process."""
    server = ServeProcess(f"sqlite:///{directory}/{name}.db", *extra).start()
    assert server.process is not None
    print(f"  fenced serve {server.url} (pid {server.process.pid}) over {name}.db", flush=True)
    return server


def stop_server(server: ServeProcess) -> None:
    try:
        server.terminate(30)
    finally:
        server.kill()


def server_pid(server: ServeProcess) -> int:
    assert server.process is not None
    return server.process.pid


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (every thread), ``/proc/PID/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- 1. cycles ----------------------------------------------------------------------------------


class ToozCycle(AcquireRelease):
    """tooz's etcd3gw lock, as bench_etcd.py's ToozDriver: ``get_lock(name)``,
    ``acquire(blocking=True)`` + ``release()``."""

    name = TOOZ

    def __init__(self, endpoint: str, members: int) -> None:
        from tooz import coordination

        self.what = f"tooz etcd3+http:// lock, {members}-member etcd (new etcd lease per acquire)"
        self._coord = coordination.get_coordinator(
            "etcd3+http://" + endpoint, uuid.uuid4().hex.encode()
        )
        self._coord.start(start_heart=True)
        self._lock = self._coord.get_lock(b"/bench-tooz/cycle")

    def acquire(self) -> None:
        if not self._lock.acquire(blocking=True):
            raise RuntimeError("tooz: not acquired")

    def release(self) -> None:
        if not self._lock.release():
            raise RuntimeError("tooz: release() did not release")

    def close(self) -> None:
        self._coord.stop()


class HealthzCycle(AcquireRelease):
    """Two ``GET /healthz`` of a bare httpx client: two round trips through uvicorn and FastAPI
    that touch no coordinator."""

    name = HEALTHZ
    what = "httpx.Client GET /healthz twice (keep-alive, TCP_NODELAY): the HTTP floor"

    def __init__(self, url: str) -> None:
        transport = httpx.HTTPTransport(
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
        )
        self._client = httpx.Client(base_url=url, transport=transport)

    def _get(self) -> None:
        self._client.get("/healthz").raise_for_status()

    def acquire(self) -> None:
        self._get()

    def release(self) -> None:
        self._get()

    def close(self) -> None:
        self._client.close()


class CpuMeter(Cycle):
    """Another implementation's rounds, noting the CPU each cycle cost this process and the
    server processes ``pids`` (``/proc/PID/stat``): where a cycle's time goes."""

    def __init__(self, inner: Cycle, pids: list[int]) -> None:
        self.name = inner.name
        self.what = inner.what
        self.inner = inner
        self.pids = pids
        self.cpu: list[tuple[float, float]] = []

    def run_round(self, seconds: float) -> Round:
        server, client = sum(map(_cpu_seconds, self.pids)), time.process_time()
        found = run_round(self.inner, seconds)
        count = max(len(found.cycles), 1)
        server = sum(map(_cpu_seconds, self.pids)) - server
        self.cpu.append(((time.process_time() - client) / count, server / count))
        return found

    def close(self) -> None:
        self.inner.close()


def bench_cycles(
    directory: Path, rounds: int, seconds: float, members: int
) -> tuple[Results, list[CpuMeter]]:
    print(f"\n[1/4] cycles: etcd {members}-member cluster for tooz", flush=True)
    server = start_server(directory, "cycles")
    try:
        with EtcdCluster(members) as cluster:
            endpoint = cluster.leader().endpoint
            etcd = [pid for pid in (member.pid for member in cluster.members) if pid is not None]
            fenced_http = [server_pid(server)]
            meters = [
                CpuMeter(
                    FencedCycle(server.url, HTTP, "fenced.connect(http://…) acquire + release"),
                    fenced_http,
                ),
                CpuMeter(
                    FencedCycle(
                        f"sqlite:///{directory}/in-process.db",
                        LOCAL,
                        "fenced.connect(sqlite:///…) in this process, acquire + release",
                    ),
                    [],
                ),
                CpuMeter(ToozCycle(endpoint, members), etcd),
                CpuMeter(HealthzCycle(server.url), fenced_http),
            ]
            results = cycle_rounds(meters, rounds, seconds, "[1/4] uncontended cycles")
    finally:
        stop_server(server)
    return results, meters


def report_cycles(results: Results, meters: list[CpuMeter], members: int) -> list[list[str]]:
    print_cycles(
        results,
        f"1. Uncontended acquire+release cycle (1 client, 1 resource; tooz on a {members}-member "
        "etcd); median of rounds",
        "cycles/s",
        ("acquire p50", "release p50"),
    )
    print_table(
        "CPU per cycle (median of rounds; server: fenced serve, or the etcd members; client and "
        "server use both cores, so the two can add up to more than the cycle)",
        ["implementation", "this process", "server", "mean cycle"],
        [
            [
                meter.name,
                fmt_time(median([c for c, _ in meter.cpu[1:]])),
                fmt_time(median([s for _, s in meter.cpu[1:]])) if meter.pids else "-",
                fmt_time(1 / median(results.rates(meter.name))),
            ]
            for meter in meters
        ],
    )
    summary = []
    for baseline, target in ((LOCAL, 0.5), (TOOZ, 3.0), (HEALTHZ, 0.0)):
        ratios = results.ratio(HTTP, baseline)
        value = median(ratios)
        goal = f"target ≥ {target:g}  {verdict(value >= target)}" if target else "no target"
        print(
            f"{HTTP} / {baseline}: {fmt_ratio(value)} (rounds {fmt_ratio(min(ratios))} – "
            f"{fmt_ratio(max(ratios))}; median of per-round ratios)  {goal}"
        )
        if target:
            summary.append([
                f"cycles/s ÷ {baseline}",
                f"≥ {target:g}",
                f"{fmt_ratio(value)} ({fmt_rate(median(results.rates(HTTP)))} vs "
                f"{fmt_rate(median(results.rates(baseline)))}/s)",
                verdict(value >= target),
            ])  # fmt: skip
    return summary


# -- 2. handoff ---------------------------------------------------------------------------------


def handoff_worker(conn: mpc.Connection, http_url: str, local_url: str) -> None:
    """A worker process: obeys ("acquire" | "release" | "exit", …) messages (``_rounds.serve``)."""
    serve(conn, {HTTP: fenced_lock(http_url, TTL), LOCAL: fenced_lock(local_url, TTL)})


def bench_handoff(directory: Path, rounds: int, total: int) -> dict[str, list[HandoffRound]]:
    print("\n[2/4] handoff", flush=True)
    server = start_server(directory, "handoff")
    try:
        workers = Workers(2, handoff_worker, server.url, f"sqlite:///{directory}/handoff-local.db")
        try:
            messages = {
                name: HandoffMessages(
                    hold=("acquire", name, "bench/handoff", 10.0),
                    wait=("acquire", name, "bench/handoff", None),
                    release=("release", name, "bench/handoff"),
                    gap=(0.010, 0.020),
                )
                for name in (HTTP, LOCAL)
            }
            return handoff_rounds(workers, messages, rounds, total, "[2/4] handoff")
        finally:
            workers.close()
    finally:
        stop_server(server)


def report_handoff(results: dict[str, list[HandoffRound]]) -> list[list[str]]:
    print_handoffs(
        results,
        "2. Handoff (holder's release() called -> waiter's acquire(wait=None) returned; "
        "HTTP: the waiter long-polls)",
    )
    latencies = [x for r in results[HTTP] for x in r.latencies]
    summary = []
    for q, limit in ((50, 3e-3), (99, 15e-3)):
        value = percentile(latencies, q)
        print(
            f"{HTTP} handoff p{q} {fmt_time(value)}: target ≤ {fmt_time(limit)}  "
            f"{verdict(value <= limit)}"
        )
        summary.append(
            [
                f"handoff p{q} over HTTP",
                f"≤ {fmt_time(limit)}",
                fmt_time(value),
                verdict(value <= limit),
            ]
        )
    return summary


# -- 3. many leases -----------------------------------------------------------------------------


def many_worker(conn: mpc.Connection, url: str, first: int, count: int) -> None:
    """Hold ``many/{first}`` … ``many/{first + count - 1}``; says ("held",), then on ("mark",)
    notes its CPU time; on ("stop", t0, t1) sends ("done", renewal durations sent inside
    [t0, t1], failed renewals there, lost leases, CPU seconds since the mark), then releases."""
    coord = fenced.connect(url)
    renewals: list[tuple[float, float]] = []
    failed: list[float] = []
    plain_renew = coord.renew

    def timed_renew(lease: fenced.Lease) -> fenced.Lease:
        sent = time.monotonic()
        try:
            return plain_renew(lease)
        except Exception:
            failed.append(sent)
            raise
        finally:
            renewals.append((sent, time.monotonic() - sent))

    coord.renew = timed_renew  # type: ignore[method-assign]  # hold() renews through coord
    lost = 0
    try:
        with contextlib.ExitStack() as stack:
            held = [
                stack.enter_context(coord.hold(f"many/{i}", MANY_TTL, wait=30.0))
                for i in range(first, first + count)
            ]
            conn.send(("held",))
            cpu = 0.0
            while True:
                message = conn.recv()
                if message[0] == "mark":
                    cpu = time.process_time()
                elif message[0] == "stop":
                    _, t0, t1 = message
                    break
            cpu = time.process_time() - cpu
            lost = sum(1 for h in held if h.lost.is_set() or h.loss() is not None)
    except fenced.LeaseLost:  # raised by the exit of a lost lease's ``with``: counted above
        lost = max(lost, 1)
    window = [took for sent, took in renewals if t0 <= sent <= t1]
    conn.send(("done", window, sum(1 for s in failed if t0 <= s <= t1), lost, cpu))
    coord.close()


class Probe:
    """A thread of this process asking the server ``current("many/0")`` every 20 ms over a
    client of its own, timing each request: the server's latency while it renews, without the
    client processes' own contention."""

    def __init__(self, url: str) -> None:
        self._coord = fenced.connect(url)
        self._stop = threading.Event()
        self.durations: list[float] = []
        self._thread = threading.Thread(target=self._run, name="probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            started = time.monotonic()
            self._coord.current("many/0")
            self.durations.append(time.monotonic() - started)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join(30)
        self._coord.close()
        return self.durations


def bench_many(directory: Path, processes: int, leases: int, seconds: float) -> dict[str, Any]:
    print(
        f"\n[3/4] many: {processes} processes x {leases // processes} leases, ttl "
        f"{MANY_TTL:g} s, {seconds:g} s",
        flush=True,
    )
    server = start_server(directory, "many")
    ctx = mp.get_context("spawn")
    ends: list[tuple[mpc.Connection, Any]] = []
    try:
        share = leases // processes
        started = time.monotonic()
        for number in range(processes):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=many_worker,
                args=(theirs, server.url, number * share, share),
                daemon=True,
            )
            proc.start()
            theirs.close()
            ends.append((mine, proc))
        for conn, _ in ends:
            if not conn.poll(300) or conn.recv() != ("held",):
                raise RuntimeError("a client process did not take its leases")
        print(
            f"  {share * processes} leases held after {time.monotonic() - started:.1f} s; "
            f"holding {seconds:g} s",
            flush=True,
        )
        pid = server_pid(server)
        probe = Probe(server.url)
        for conn, _ in ends:
            conn.send(("mark",))
        t0, cpu0 = time.monotonic(), _cpu_seconds(pid)
        end = t0 + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 10.0))
            print(
                f"  {time.monotonic() - t0:.0f} s, server CPU so far "
                f"{100 * (_cpu_seconds(pid) - cpu0) / (time.monotonic() - t0):.0f} %",
                flush=True,
            )
        t1, cpu1 = time.monotonic(), _cpu_seconds(pid)
        probed = probe.stop()
        for conn, _ in ends:
            conn.send(("stop", t0, t1))
        done = []
        for conn, proc in ends:
            if not conn.poll(120):
                raise RuntimeError("a client process did not report")
            done.append(conn.recv())
            proc.join(30)
    finally:
        for _, proc in ends:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        stop_server(server)
    durations = [took for d in done for took in d[1]]
    return {
        "processes": processes,
        "leases": share * processes,
        "seconds": t1 - t0,
        "renewals": durations,
        "probe": probed,
        "failed": sum(d[2] for d in done),
        "lost": sum(d[3] for d in done),
        "server_cpu": (cpu1 - cpu0) / (t1 - t0),
        "client_cpu": sum(d[4] for d in done) / (t1 - t0),
    }


def report_many(found: dict[str, Any]) -> list[list[str]]:
    durations = found["renewals"]
    expected = found["leases"] / (MANY_TTL / 3) * found["seconds"]
    print_table(
        f"3. {found['processes']} client processes holding {found['leases']:,} leases through "
        f"one server (ttl {MANY_TTL:g} s, renewed at ttl/3), {found['seconds']:.0f} s",
        [
            "losses",
            "renewals (expected)",
            "failed",
            "renew p50",
            "renew p99",
            "renew max",
            "server CPU",
            "clients' CPU",
            "probe p50 / p99",
        ],
        [
            [
                str(found["lost"]),
                f"{len(durations):,} ({expected:,.0f})",
                str(found["failed"]),
                fmt_time(percentile(durations, 50)),
                fmt_time(percentile(durations, 99)),
                fmt_time(max(durations, default=math.nan)),
                f"{100 * found['server_cpu']:.0f} %",
                f"{100 * found['client_cpu']:.0f} %",
                f"{fmt_time(percentile(found['probe'], 50))} / "
                f"{fmt_time(percentile(found['probe'], 99))}",
            ]
        ],
    )
    ok = found["lost"] == 0
    print(
        f"losses {found['lost']}: target 0  {verdict(ok)}; renewal request p99 "
        f"{fmt_time(percentile(durations, 99))} (timed in the clients around renew()), server "
        f"CPU {100 * found['server_cpu']:.0f} % of one core (reported)"
    )
    return [
        [f"losses, {found['leases']:,} leases / {found['processes']} processes, "
         f"{found['seconds']:.0f} s", "0", str(found["lost"]), verdict(ok)],
        ["— renewal request p99 (client-side)", "reported",
         fmt_time(percentile(durations, 99)), ""],
        ["— probe current() p99 (an idle client)", "reported",
         fmt_time(percentile(found["probe"], 99)), ""],
        ["— server CPU (% of one core)", "reported", f"{100 * found['server_cpu']:.0f} %", ""],
    ]  # fmt: skip


# -- 4. publish ---------------------------------------------------------------------------------


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid`` in bytes (``/proc/PID/status``)."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) * 1024
    return found


def reset_peak(pid: int) -> bool:
    """Reset ``pid``'s VmHWM to its current RSS (``clear_refs``: 5); False if refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def random_file(path: Path, size: int) -> Path:
    with path.open("wb") as out:
        for _ in range(size // MiB):
            out.write(os.urandom(MiB))
    return path


def bench_publish(directory: Path, rounds: int, mib: int) -> dict[str, Any]:
    print(f"\n[4/4] publish: {mib} MiB, warm-up + {rounds} rounds", flush=True)
    source = random_file(directory / "publish.bin", mib * MiB)
    server = start_server(directory, "publish", "--store", f"files=file:///{directory}/store")
    pid = server_pid(server)
    coord = fenced.connect(server.url)
    stores = {
        HTTP: fenced.open_store(server.url + "/stores/files"),
        "fenced in-process file:": fenced.open_store(f"file:///{directory}/store-local"),
    }
    speeds: dict[str, list[float]] = {name: [] for name in stores}
    growth: list[int] = []
    peaks_reset = True
    try:
        lease = coord.acquire("bench/publish", ttl=3600, wait=0)
        for store in stores.values():
            store.fence(lease.token)
        start_rss = memory(pid)["VmRSS"]
        for number in range(rounds + 1):
            for name in interleaved(list(stores), number):
                if name == HTTP:
                    peaks_reset = reset_peak(pid) and peaks_reset
                    before = memory(pid)["VmRSS"]
                started = time.perf_counter()
                stores[name].publish(lease.token, source)
                took = time.perf_counter() - started
                if name == HTTP:
                    growth.append(memory(pid)["VmHWM"] - before)
                if number:
                    speeds[name].append(mib / took)
                stores[name].gc(keep=1, grace=0)
            rates = "".join(f"{n} {speeds[n][-1]:.0f} MiB/s, " for n in stores if number)
            print(
                f"  round {number or 'warm-up'}: {rates}"
                f"server RSS growth {growth[-1] / MiB:.1f} MiB",
                flush=True,
            )
        end = memory(pid)
        coord.release(lease)
    finally:
        coord.close()
        for store in stores.values():
            store.close()
        stop_server(server)
    return {
        "mib": mib,
        "speeds": speeds,
        "growth": growth,
        "retained": end["VmRSS"] - start_rss,
        "rss": start_rss,
        "peaks_reset": peaks_reset,
    }


def report_publish(found: dict[str, Any]) -> list[list[str]]:
    speeds: dict[str, list[float]] = found["speeds"]
    names = list(speeds)
    ratios = [a / b for a, b in zip(speeds[names[0]], speeds[names[1]], strict=True)]
    worst = max(found["growth"])
    rows = [
        [
            name,
            f"{median(values):.0f}",
            f"{min(values):.0f} – {max(values):.0f}",
            f"{max(found['growth']) / MiB:.1f} MiB" if name == HTTP else "-",
        ]
        for name, values in speeds.items()
    ]
    print_table(
        f"4. publish of {found['mib']} MiB (a file of random bytes) to a file: store",
        ["implementation", "MiB/s", "rounds min–max", "server RSS growth (max)"],
        rows,
    )
    how = "VmHWM reset before each" if found["peaks_reset"] else "VmHWM NOT reset (clear_refs)"
    each = ", ".join(f"{g / MiB:.1f}" for g in found["growth"])
    print(
        f"server RSS {found['rss'] / MiB:.0f} MiB before; growth per publish (VmHWM after − "
        f"VmRSS before; {how}): {each} MiB (first: warm-up); "
        f"kept after all: {found['retained'] / MiB:.1f} MiB"
    )
    ok = worst <= 32 * MiB
    print(
        f"server RSS growth {worst / MiB:.1f} MiB: target ≤ 32 MiB  {verdict(ok)}; "
        f"{HTTP} / in-process MiB/s {fmt_ratio(median(ratios))} (median of per-round ratios; "
        "no target)"
    )
    return [
        [f"publish {found['mib']} MiB: server RSS growth", "≤ 32 MiB",
         f"{worst / MiB:.1f} MiB ({median(speeds[HTTP]):.0f} MiB/s)", verdict(worst <= 32 * MiB)],
    ]  # fmt: skip


# -- main -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    round_options(parser, seconds=1.5, handoffs=200)
    parser.add_argument(
        "--etcd-members",
        type=int,
        choices=[1, 3],
        default=1,
        help="members of the etcd cluster for tooz (default 1)",
    )
    parser.add_argument("--many-processes", type=int, default=10)
    parser.add_argument("--many-leases", type=int, default=1000)
    parser.add_argument("--many-seconds", type=float, default=60.0)
    parser.add_argument("--publishes", type=int, default=3, help="measured publish rounds")
    parser.add_argument("--publish-mib", type=int, default=64)
    parser.add_argument("--only", action="append", choices=SECTIONS)
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="where the temporary directory goes (default: benchmarks/)",
    )
    args = parser.parse_args()
    sections = args.only or SECTIONS
    print(
        f"fenced {fenced.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load {loads()}",
        flush=True,
    )
    summary: list[list[str]] = []
    with tempfile.TemporaryDirectory(prefix="bench-server-", dir=args.dir) as name:
        directory = Path(name)
        if "cycles" in sections:
            cycles, meters = bench_cycles(directory, args.rounds, args.seconds, args.etcd_members)
            summary += report_cycles(cycles, meters, args.etcd_members)
        if "handoff" in sections:
            handoffs = bench_handoff(directory, args.rounds, args.handoffs)
            summary += report_handoff(handoffs)
        if "many" in sections:
            many = bench_many(directory, args.many_processes, args.many_leases, args.many_seconds)
            summary += report_many(many)
        if "publish" in sections:
            summary += report_publish(bench_publish(directory, args.publishes, args.publish_mib))
    print_table(
        "Summary (targets of issue 23)", ["figure", "target", "measured", "result"], summary
    )
    print(f"\nload {loads()}")


if __name__ == "__main__":
    main()
