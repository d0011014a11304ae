"""Shared helpers of the benchmarks: percentiles, formatting, tables, a throwaway redis-server."""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from fenced.testing._lifecycle import StartStop
from fenced.testing.postgres import free_port

__all__ = [
    "RedisServer",
    "fdatasync_loop",
    "fmt_rate",
    "fmt_ratio",
    "fmt_time",
    "jain",
    "median",
    "percentile",
    "print_table",
    "verdict",
]


def fdatasync_loop(directory: Path) -> tuple[Callable[[], None], Callable[[], None]]:
    """The durable-commit baseline: one cycle overwrites 4 KiB at offset 0 of a file in
    ``directory`` and fdatasyncs it. Returns (cycle, close)."""
    fd = os.open(directory / "sync.bin", os.O_RDWR | os.O_CREAT, 0o600)
    block = b"\0" * 4096
    os.pwrite(fd, block, 0)
    os.fsync(fd)

    def cycle() -> None:
        os.pwrite(fd, block, 0)
        os.fdatasync(fd)

    return cycle, lambda: os.close(fd)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def jain(shares: Sequence[float]) -> float:
    """Jain's fairness index: 1.0 when all shares are equal, 1/n when one process gets all."""
    total = sum(shares)
    squares = sum(x * x for x in shares)
    return total * total / (len(shares) * squares) if squares else math.nan


def fmt_time(seconds: float) -> str:
    """A duration with a unit that keeps 3-4 significant digits."""
    if math.isnan(seconds):
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs" if seconds < 1e-5 else f"{seconds * 1e6:.0f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_rate(per_second: float) -> str:
    if math.isnan(per_second):
        return "-"
    return f"{per_second:,.0f}" if per_second >= 100 else f"{per_second:.1f}"


def fmt_ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print a left-aligned text table (first column) with right-aligned figures."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        parts = [
            str(cell).ljust(width) if i == 0 or i == len(cells) - 1 else str(cell).rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    print()
    print(title)
    print(line(header))
    print("  ".join("-" * width for width in widths))
    for row in rows:
        print(line(row))


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer(StartStop):
    """A private ``redis-server`` on a free loopback port in ``directory``, stopped by PID.

    No persistence (``save ""``, no AOF): what redis-py's Lock users typically run against.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit(
                "redis-server is not installed: apt-get install -y --no-install-recommends "
                "redis-server (it does not start a service; the benchmark starts its own)"
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        log = (self.directory / "redis.log").open("wb")
        self._proc = subprocess.Popen(
            [
                binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self.directory),
                "--save", "",
                "--appendonly", "no",
                "--daemonize", "no",
                "--protected-mode", "yes",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout
        while not _ping(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                text = (self.directory / "redis.log").read_text(errors="replace")
                raise RuntimeError(f"redis-server did not start on port {self.port}:\n{text}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)
