"""fenced's ``s3://`` store against plain boto3 on the same Ceph RGW.

Usage::

    flock /tmp/fenced-bench.lock .venv/bin/python benchmarks/bench_s3.py        # ~2.5 min
    .venv/bin/python benchmarks/bench_s3.py --only small --rounds 7 --seconds 2
    .venv/bin/python benchmarks/bench_s3.py --only large --large-rounds 3

The benchmark starts a private Ceph RGW (:class:`fenced.testing.rgw.RgwServer`: a monitor, one
memstore OSD of ``--memstore-mib`` and radosgw on 127.0.0.1; ``apt-get install ceph-mon ceph-osd
radosgw ceph-common``), creates one bucket, and stops the daemons by PID at the end. fenced's
store is ``s3://BUCKET/bench?endpoint=…`` (strict, the token installed once; the credentials
through the ``AWS_*`` variables, as a user's); the baseline is a plain boto3 client of the same
server (``RgwServer.client()``: boto3's defaults, path-style addressing). Temporary files go to
a directory under ``--dir`` (default: ``benchmarks/``, the repository's disk), removed at the
end. The header and the last line print the load averages: on a shared machine rerun when they
are high.

Sections (within a section the implementations run interleaved, round by round in alternating
order, after one discarded warm-up round; ratios are taken per round and their median is
reported with the rounds' min–max):

1. **open**: ``fenced.open_store(url)`` of the existing store (``HeadBucket``, the store's
   identity object, the conditional-write probe) and ``close()``, against a new boto3 client +
   ``head_bucket``, and the part of it that creates the store's two boto3 clients
   (``fenced._drivers.s3.clients``); ``--opens`` each, alternating; the median. No target.
2. **small**: ``--seconds`` per implementation per round, back to back, after 140 ``put`` s
   that bring the resource's state to its steady size (128 records). Every table also gives
   the HTTP requests per operation (counted on the clients, ``before-send``), this process's CPU
   per operation and the CPU of the RGW daemons (radosgw, OSD, monitor: ``/proc/PID/stat``).

   a. ``publish`` of 1 MiB (bytes) against ``put_object`` of the same bytes to one key. Between
      rounds, untimed, ``store.gc(keep=1, grace=0)`` removes what the round superseded. The
      **floor** line is what any stage-then-commit publish must send: the same ``put_object``
      then one conditional ``PUT`` (``If-Match``) of a body as large as the resource's state;
      one more line adds a ``GET`` of that body first (a publish that reads the state once).
      Target ≥ 0.6 × ``put_object``.
   b. ``put`` of 1 KiB (inline in the state; two values alternated) against ``put_object`` of
      1 KiB; floor: the conditional ``PUT`` of the state-sized body alone. Target ≥ 0.5 ×.
   c. ``latest`` and ``read`` of the 1 MiB publication against ``get_object`` of 1 MiB and of
      1 KiB (read whole). No target.
3. **large**: ``publish(token, path)`` of a ``--large-mib`` (256) MiB file of random bytes
   against boto3's managed ``upload_file`` of the same file (default ``TransferConfig``: 8 MiB
   parts, 10 threads) to one key; one operation per implementation per round
   (``--large-rounds``), after a warm-up of each. After each operation, untimed, the superseded
   object is removed (``store.gc(keep=1, grace=0)``; ``delete_object``) and RGW's garbage
   collector is run (``radosgw-admin gc process --include-all``) so that memstore does not fill.
   Figures: MiB/s, CPU of this process and of the RGW daemons per operation, and this process's
   peak RSS growth (``VmHWM`` reset before each). Target ≥ 0.9 × ``upload_file``.
4. **rss**: a child process (spawned: nothing inherited but the environment) opens the store,
   publishes 1 KiB (to load the code), resets its peak RSS, then publishes a ``--rss-mib``
   (1,024) MiB file. Figure: ``VmHWM`` after − ``VmRSS`` before. Limit ≤ 64 MiB.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing
import os
import platform
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import boto3
from _common import fmt_rate, fmt_ratio, fmt_time, median, percentile, print_table, verdict

import fenced
from fenced import FencingToken
from fenced._drivers import s3 as s3_driver
from fenced.fence.s3 import _objects
from fenced.testing.rgw import RgwServer

MiB = 1024 * 1024
TOKEN = FencingToken("b" * 32, "bench/s3", 1)
EXPORT = os.urandom(MiB)
SMALL = (os.urandom(1024), os.urandom(1024))  # alternated, as in bench_store.py
SECTIONS = ("open", "small", "large", "rss")
SERVER = ("rgw", "osd", "mon")
PREFILL = 140
"""Puts before the small operations: a state keeps up to 128 records, then moves half out."""


# -- measuring ----------------------------------------------------------------------------------


class Requests:
    """Counts the HTTP requests (``before-send``) of the clients it watches, by label."""

    def __init__(self) -> None:
        self.label = ""
        self.counts: Counter[str] = Counter()

    def watch(self, *clients: Any) -> None:
        for client in clients:
            client.meta.events.register("before-send.s3", self._sent)

    def _sent(self, **_: Any) -> None:
        self.counts[self.label] += 1


REQUESTS = Requests()


def store_clients(store: fenced.Store) -> tuple[Any, Any]:
    """The two boto3 clients of an ``s3://`` store (reads, commits)."""
    backend: Any = store._backend  # a benchmark looks inside
    return backend.reads, backend.commits


def server_cpu(server: RgwServer) -> float:
    """CPU seconds (user + system) the RGW daemons have used so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for name, pid in server.pids.items():
        if name in SERVER:
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def memory(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and VmHWM of ``pid`` in bytes (``/proc/PID/status``)."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) * 1024
    return found


def reset_peak(pid: int | str = "self") -> bool:
    """Reset VmHWM to the current RSS (``clear_refs``: 5); False if refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@dataclass
class Impl:
    name: str
    what: str
    op: Callable[[], object]
    between: Callable[[], object] = lambda: None
    """Run after each round, untimed (clean-up)."""


@dataclass
class Sample:
    """One round (or one operation) of one implementation."""

    ops: int
    wall: float
    cpu: float
    server_cpu: float
    requests: int
    latencies: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.ops / self.wall


def sample(impl: Impl, server: RgwServer, seconds: float) -> Sample:
    """Operations of ``impl`` back to back for ``seconds`` (at least one)."""
    clock = time.perf_counter
    REQUESTS.label = impl.name
    sent = REQUESTS.counts[impl.name]
    cpu, busy = time.process_time(), server_cpu(server)
    latencies: list[float] = []
    start = t0 = clock()
    end = start + seconds
    while True:
        impl.op()
        t1 = clock()
        latencies.append(t1 - t0)
        t0 = t1
        if t1 >= end:
            break
    result = Sample(
        len(latencies),
        t0 - start,
        time.process_time() - cpu,
        server_cpu(server) - busy,
        REQUESTS.counts[impl.name] - sent,
        latencies,
    )
    REQUESTS.label = ""
    impl.between()
    return result


def rounds(
    title: str, impls: Sequence[Impl], server: RgwServer, count: int, seconds: float
) -> dict[str, list[Sample]]:
    """A warm-up round, then ``count`` interleaved rounds of ``seconds`` per implementation."""
    print(f"\n{title}: warm-up + {count} rounds x {len(impls)} x {seconds:g} s", flush=True)
    for impl in impls:
        sample(impl, server, min(seconds, 0.5))
    found: dict[str, list[Sample]] = {impl.name: [] for impl in impls}
    for number in range(count):
        for impl in impls if number % 2 == 0 else reversed(impls):
            found[impl.name].append(sample(impl, server, seconds))
        print(
            f"  round {number + 1}: "
            + ", ".join(f"{name} {fmt_rate(s[-1].rate)}/s" for name, s in found.items()),
            flush=True,
        )
    return found


def per_op(samples: Sequence[Sample], what: Callable[[Sample], float]) -> float:
    return sum(what(s) for s in samples) / sum(s.ops for s in samples)


def print_rounds(title: str, impls: Sequence[Impl], found: dict[str, list[Sample]]) -> None:
    rows = []
    for impl in impls:
        samples = found[impl.name]
        rates = [s.rate for s in samples]
        latencies = [x for s in samples for x in s.latencies]
        rows.append([
            impl.name,
            fmt_rate(median(rates)),
            f"{fmt_rate(min(rates))} – {fmt_rate(max(rates))}",
            fmt_time(percentile(latencies, 50)),
            fmt_time(percentile(latencies, 99)),
            f"{per_op(samples, lambda s: s.requests):.2f}",
            fmt_time(per_op(samples, lambda s: s.cpu)),
            fmt_time(per_op(samples, lambda s: s.server_cpu)),
            impl.what,
        ])  # fmt: skip
    print_table(
        f"{title} (median of rounds)",
        ["implementation", "ops/s", "rounds min–max", "p50", "p99", "requests/op",
         "client CPU/op", "RGW CPU/op", "what"],
        rows,
    )  # fmt: skip


def ratios(found: dict[str, list[Sample]], name: str, baseline: str) -> list[float]:
    return [a.rate / b.rate for a, b in zip(found[name], found[baseline], strict=True)]


def ratio_line(
    found: dict[str, list[Sample]], name: str, baseline: str, target: float | None = None
) -> tuple[float, str]:
    """Print ``name`` ÷ ``baseline`` (median of per-round ratios); return it and its text."""
    values = ratios(found, name, baseline)
    text = (
        f"{fmt_ratio(median(values))} (rounds {fmt_ratio(min(values))} – {fmt_ratio(max(values))})"
    )
    suffix = "" if target is None else f"  target ≥ {target}  {verdict(median(values) >= target)}"
    print(f"{name} ÷ {baseline}: {text}{suffix}")
    return median(values), text


# -- 1. open -----------------------------------------------------------------------------------


def bench_open(server: RgwServer, url: str, bucket: str, count: int) -> list[list[str]]:
    print(f"\n1. open: warm-up + {count} x 3, alternating", flush=True)
    location = s3_driver.parse_url(url)

    def open_fenced() -> None:
        fenced.open_store(url).close()

    def fenced_clients() -> None:
        made = s3_driver.clients(location)
        made.reads.close()
        made.commits.close()

    def open_boto3() -> None:
        client = boto3.client("s3", endpoint_url=server.endpoint)
        client.head_bucket(Bucket=bucket)
        client.close()

    impls = {
        "fenced open_store": open_fenced,
        "  of it: its 2 boto3 clients": fenced_clients,
        "boto3 client + head_bucket": open_boto3,
    }
    times: dict[str, list[float]] = {name: [] for name in impls}
    for op in impls.values():
        op()  # warm-up
    for number in range(count):
        for name in list(impls) if number % 2 == 0 else list(reversed(impls)):
            started = time.perf_counter()
            impls[name]()
            times[name].append(time.perf_counter() - started)
    requests = {"fenced open_store": _open_requests(url), "  of it: its 2 boto3 clients": 0}
    rows = [
        [name, fmt_time(median(values)), f"{fmt_time(min(values))} – {fmt_time(max(values))}",
         str(requests.get(name, 1))]
        for name, values in times.items()
    ]  # fmt: skip
    print_table("1. opening (median)", ["implementation", "time", "min – max", "requests"], rows)
    fenced_time, clients_time, boto3_time = (median(values) for values in times.values())
    return [["open_store of an existing store", "reported",
             f"{fmt_time(fenced_time)} ({requests['fenced open_store']} requests; its 2 clients "
             f"{fmt_time(clients_time)}; boto3 client + head_bucket {fmt_time(boto3_time)})",
             ""]]  # fmt: skip


def _open_requests(url: str) -> int:
    """The requests ``open_store`` sends: counted on every boto3 client created meanwhile."""
    sent = Counter[str]()
    original = boto3.session.Session.client

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        client = original(self, *args, **kwargs)
        client.meta.events.register("before-send.s3", lambda **_: sent.update(["open"]))
        return client

    boto3.session.Session.client = counted
    try:
        fenced.open_store(url).close()
    finally:
        boto3.session.Session.client = original
    return sent["open"]


# -- 2. small operations -----------------------------------------------------------------------


def state_size(store: fenced.Store, resource: str) -> int:
    backend: Any = store._backend
    return len(backend.read_object(backend.key("state", resource), "reading the state") or b"")


class ConditionalPut:
    """The floor of a commit: a ``PUT`` with ``If-Match`` the previous ETag (unquoted: RGW's
    quirk) of a body of ``size`` bytes, on the baseline's client."""

    def __init__(self, client: Any, bucket: str, key: str, size: int) -> None:
        self._client, self._bucket, self._key = client, bucket, key
        self._body = b"x" * size
        self._etag = client.put_object(Bucket=bucket, Key=key, Body=self._body)["ETag"]

    def __call__(self) -> None:
        reply = self._client.put_object(
            Bucket=self._bucket, Key=self._key, Body=self._body, IfMatch=self._etag.strip('"')
        )
        self._etag = reply["ETag"]


def bench_small(
    server: RgwServer, store: fenced.Store, client: Any, bucket: str, count: int, seconds: float
) -> list[list[str]]:
    summary: list[list[str]] = []
    resource = TOKEN.resource
    for number in range(PREFILL):  # its records saturated: the state at its steady size
        store.put(TOKEN, "config", SMALL[number % 2])
    store.publish(TOKEN, EXPORT)
    size = state_size(store, resource)
    print(f"\nthe state of {resource}: {size:,} bytes after {PREFILL} puts", flush=True)

    # a. publish 1 MiB
    commit = ConditionalPut(client, bucket, "plain/state-publish", size)

    def floor_publish() -> None:
        client.put_object(Bucket=bucket, Key="plain/export", Body=EXPORT)
        commit()

    def read_then_floor() -> None:
        client.get_object(Bucket=bucket, Key="plain/state-publish")["Body"].read()
        floor_publish()

    impls = [
        Impl("fenced publish", "store.publish(token, 1 MiB)", lambda: store.publish(TOKEN, EXPORT),
             lambda: store.gc(keep=1, grace=0)),
        Impl("boto3 put_object", "client.put_object(1 MiB) to one key",
             lambda: client.put_object(Bucket=bucket, Key="plain/export", Body=EXPORT)),
        Impl("floor: put_object + cond. PUT", "the same, then If-Match PUT of a state-sized body",
             floor_publish),
        Impl("GET + put_object + cond. PUT", "the floor after a GET of the state-sized object",
             read_then_floor),
    ]  # fmt: skip
    found = rounds("2a. publish 1 MiB", impls, server, count, seconds)
    print_rounds("2a. publish 1 MiB", impls, found)
    value, text = ratio_line(found, impls[0].name, impls[1].name, 0.6)
    for impl in impls[2:]:
        ratio_line(found, impl.name, impls[1].name)
    print(f"the state of {resource}: {state_size(store, resource):,} bytes now (after gc)")
    summary.append(["publish 1 MiB ÷ boto3 put_object", "≥ 0.6", text, verdict(value >= 0.6)])

    # b. put 1 KiB
    turns = itertools.count()
    commit = ConditionalPut(client, bucket, "plain/state-put", size)
    impls = [
        Impl("fenced put", "store.put(token, key, 1 KiB): inline in the state",
             lambda: store.put(TOKEN, "config", SMALL[next(turns) % 2])),
        Impl("boto3 put_object", "client.put_object(1 KiB) to one key",
             lambda: client.put_object(Bucket=bucket, Key="plain/config",
                                       Body=SMALL[next(turns) % 2])),
        Impl("floor: cond. PUT", "If-Match PUT of a state-sized body", commit),
    ]  # fmt: skip
    found = rounds("2b. put 1 KiB", impls, server, count, seconds)
    print_rounds("2b. put 1 KiB", impls, found)
    value, text = ratio_line(found, impls[0].name, impls[1].name, 0.5)
    ratio_line(found, impls[2].name, impls[1].name)
    summary.append(["put 1 KiB ÷ boto3 put_object", "≥ 0.5", text, verdict(value >= 0.5)])

    # c. reads
    client.put_object(Bucket=bucket, Key="plain/export", Body=EXPORT)
    client.put_object(Bucket=bucket, Key="plain/config", Body=SMALL[0])

    def get(key: str) -> bytes:
        return bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())

    impls = [
        Impl("fenced read", "store.read(resource): 1 MiB, SHA-256 checked",
             lambda: store.read(resource)),
        Impl("boto3 get_object 1 MiB", "client.get_object(…)['Body'].read()",
             lambda: get("plain/export")),
        Impl("fenced latest", "store.latest(resource)", lambda: store.latest(resource)),
        Impl("boto3 get_object 1 KiB", "the same, 1 KiB", lambda: get("plain/config")),
    ]  # fmt: skip
    found = rounds("2c. reads", impls, server, count, seconds)
    print_rounds("2c. reads", impls, found)
    _, text = ratio_line(found, impls[0].name, impls[1].name)
    summary.append(["read 1 MiB ÷ boto3 get_object", "reported", text, ""])
    _, text = ratio_line(found, impls[2].name, impls[3].name)
    summary.append(["latest ÷ boto3 get_object of 1 KiB", "reported", text, ""])
    return summary


# -- 3. large publish --------------------------------------------------------------------------


def random_file(path: Path, size: int) -> Path:
    """``size`` bytes: a 16 MiB random block repeated (RGW does not compress or deduplicate)."""
    block = os.urandom(16 * MiB)
    with path.open("wb") as out:
        for start in range(0, size, len(block)):
            out.write(block[: size - start])
    return path


@dataclass
class Large:
    rate: float
    cpu: float
    server_cpu: float
    growth: int
    requests: int


def bench_large(
    server: RgwServer,
    store: fenced.Store,
    client: Any,
    bucket: str,
    directory: Path,
    count: int,
    mib: int,
) -> list[list[str]]:
    print(f"\n3. publish {mib} MiB from a file: warm-up + {count} rounds x 2", flush=True)
    source = random_file(directory / "large.bin", mib * MiB)
    impls: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "fenced publish": (
            lambda: store.publish(TOKEN, source, name="large"),
            lambda: store.gc(keep=1, grace=0),
        ),
        "boto3 upload_file": (
            lambda: client.upload_file(str(source), bucket, "plain/large"),
            lambda: client.delete_object(Bucket=bucket, Key="plain/large"),
        ),
    }
    found: dict[str, list[Large]] = {name: [] for name in impls}
    reset = True
    for number in range(count + 1):
        for name in list(impls) if number % 2 == 0 else list(reversed(impls)):
            op, clean = impls[name]
            reset = reset_peak() and reset
            before = memory()["VmRSS"]
            REQUESTS.label = name
            sent = REQUESTS.counts[name]
            cpu, busy = time.process_time(), server_cpu(server)
            started = time.perf_counter()
            op()
            took = time.perf_counter() - started
            measured = Large(
                mib / took,
                time.process_time() - cpu,
                server_cpu(server) - busy,
                memory()["VmHWM"] - before,
                REQUESTS.counts[name] - sent,
            )
            REQUESTS.label = ""
            clean()
            server.radosgw_admin("gc", "process", "--include-all")
            if number:
                found[name].append(measured)
        if number:
            print(
                f"  round {number}: "
                + ", ".join(f"{n} {v[-1].rate:.0f} MiB/s" for n, v in found.items()),
                flush=True,
            )
    source.unlink()
    rows = [
        [
            name,
            f"{median([s.rate for s in values]):.0f}",
            f"{min(s.rate for s in values):.0f} – {max(s.rate for s in values):.0f}",
            f"{median([s.requests for s in values]):.0f}",
            f"{median([s.cpu for s in values]):.2f} s",
            f"{median([s.server_cpu for s in values]):.2f} s",
            f"{max(s.growth for s in values) / MiB:.0f} MiB",
        ]
        for name, values in found.items()
    ]
    print_table(
        f"3. publish {mib} MiB from a file (median of rounds)",
        ["implementation", "MiB/s", "rounds min–max", "requests", "client CPU", "RGW CPU",
         "peak RSS growth (max)"],
        rows,
    )  # fmt: skip
    per_round = [
        a.rate / b.rate
        for a, b in zip(found["fenced publish"], found["boto3 upload_file"], strict=True)
    ]
    value = median(per_round)
    text = f"{fmt_ratio(value)} (rounds {fmt_ratio(min(per_round))} – {fmt_ratio(max(per_round))})"
    print(
        f"fenced publish ÷ boto3 upload_file: {text}  target ≥ 0.9  {verdict(value >= 0.9)}"
        + ("" if reset else "  (VmHWM was NOT reset: clear_refs refused)")
    )
    print(
        f"  fenced: {_objects.PART_BYTES // MiB} MiB parts, {_objects.PARTS_IN_FLIGHT} in flight; "
        "upload_file: 8 MiB parts, 10 threads"
    )
    return [[f"publish {mib} MiB from a file ÷ boto3 upload_file", "≥ 0.9", text,
             verdict(value >= 0.9)]]  # fmt: skip


# -- 4. RSS of a 1 GiB publish -----------------------------------------------------------------


def rss_child(conn: Connection, url: str, path: str) -> None:
    """In a spawned process: publish 1 KiB, reset the peak, publish ``path``; send the figures."""
    store = fenced.open_store(url)
    store.publish(TOKEN, b"x" * 1024, name="rss")
    reset = reset_peak()
    before = memory()["VmRSS"]
    started = time.perf_counter()
    store.publish(TOKEN, Path(path), name="rss")
    took = time.perf_counter() - started
    after = memory()
    store.close()
    conn.send((reset, before, after["VmHWM"], after["VmRSS"], took))


def bench_rss(
    server: RgwServer, store: fenced.Store, url: str, directory: Path, mib: int
) -> list[list[str]]:
    print(f"\n4. RSS of a {mib} MiB publish from a file, in a child process", flush=True)
    source = random_file(directory / "rss.bin", mib * MiB)
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=rss_child, args=(child, url, str(source)), daemon=True)
    process.start()
    child.close()
    try:
        if not parent.poll(600):
            raise RuntimeError("the child process did not finish its publish in 600 s")
        reset, before, peak, after, took = parent.recv()
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join(5)
    source.unlink()
    store.gc(keep=1, grace=0)
    server.radosgw_admin("gc", "process", "--include-all")
    growth = peak - before
    ok = growth <= 64 * MiB
    print_table(
        f"4. a {mib} MiB publish from a file in a fresh process",
        ["RSS before", "peak (VmHWM)", "growth", "RSS after", "MiB/s", "parts"],
        [[f"{before / MiB:.0f} MiB", f"{peak / MiB:.0f} MiB", f"{growth / MiB:.1f} MiB",
          f"{after / MiB:.0f} MiB", f"{mib / took:.0f}",
          f"{_objects.PART_BYTES // MiB} MiB x {_objects.PARTS_IN_FLIGHT} in flight"]],
    )  # fmt: skip
    print(
        f"RSS growth {growth / MiB:.1f} MiB: limit ≤ 64 MiB  {verdict(ok)}"
        + ("" if reset else "  (VmHWM was NOT reset: clear_refs refused)")
    )
    return [[f"publish {mib} MiB from a file: RSS growth", "≤ 64 MiB",
             f"{growth / MiB:.1f} MiB ({mib / took:.0f} MiB/s)", verdict(ok)]]  # fmt: skip


# -- main ----------------------------------------------------------------------------------------


def loads() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    parser.add_argument(
        "--seconds", type=float, default=1.5, help="seconds per implementation per round (1.5)"
    )
    parser.add_argument("--opens", type=int, default=10, help="open_store timings (default 10)")
    parser.add_argument("--large-rounds", type=int, default=5, help="large rounds (default 5)")
    parser.add_argument("--large-mib", type=int, default=256, help="large file (default 256)")
    parser.add_argument("--rss-mib", type=int, default=1024, help="rss file (default 1024)")
    parser.add_argument(
        "--memstore-mib", type=int, default=3072, help="the OSD's memstore (default 3072)"
    )
    parser.add_argument("--only", action="append", choices=SECTIONS)
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="where the temporary directory goes (default: benchmarks/)",
    )
    args = parser.parse_args(argv)
    sections = args.only or SECTIONS
    print(
        f"fenced {fenced.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load {loads()}",
        flush=True,
    )
    summary: list[list[str]] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-s3-", dir=args.dir) as name,
        RgwServer(memstore_bytes=args.memstore_mib * MiB) as server,
    ):
        directory = Path(name)
        os.environ.update(server.environment())
        bucket = server.create_bucket()
        url = f"s3://{bucket}/bench?endpoint={server.endpoint}"
        started = time.perf_counter()
        store = fenced.open_store(url, "strict")
        print(
            f"RGW started in {server.started_in:.1f} s at {server.endpoint}; open_store "
            f"(creating the store) {fmt_time(time.perf_counter() - started)}",
            flush=True,
        )
        store.fence(TOKEN)
        client = server.client()
        REQUESTS.watch(client, *store_clients(store))
        try:
            if "open" in sections:
                summary += bench_open(server, url, bucket, args.opens)
            if "small" in sections:
                summary += bench_small(server, store, client, bucket, args.rounds, args.seconds)
            if "large" in sections:
                summary += bench_large(
                    server, store, client, bucket, directory, args.large_rounds, args.large_mib
                )
            if "rss" in sections:
                summary += bench_rss(server, store, url, directory, args.rss_mib)
        finally:
            store.close()
            client.close()
    print_table(
        "Summary (targets of issue 24; same-run ratios)",
        ["figure", "target", "measured", "result"],
        summary,
    )
    print(f"\nload {loads()}")


if __name__ == "__main__":
    main()
