"""Many real processes on one embedded SQLite coordinator, with real signals.

Workers are ``workers.py`` (next to this module) run with ``sys.executable``; they record
JSON-line events with
``time.monotonic`` (CLOCK_MONOTONIC, shared by all processes on the host) that the test polls
with deadlines. No assertion here is about speed except the takeover bound after a crash, which
DESIGN §2 promises (ttl + one renewal interval + 0.5 s).

A wall-clock jump with an injected clock is covered by
:class:`fenced.testing.conformance.ManualClockConformance` in ``test_conformance_sqlite.py``; the
last test here checks the production clock path (CLOCK_BOOTTIME, no injection) across processes
whose wall clocks disagree by a day.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import fenced
from support.worker_processes import WorkerProcess

pytestmark = pytest.mark.slow

WORKERS = Path(__file__).with_name("workers.py")
R = "jobs/nightly"
STARTUP = 20.0  # seconds a worker may take to start on a loaded 2-core machine


class Worker(WorkerProcess):
    """One worker process of ``workers.py`` on ``R``, its event file and its ready file."""

    def __init__(self, tmp: Path, name: str, mode: str, url: str, *options: str) -> None:
        self.ready = tmp / f"{name}.ready"
        options = ("--resource", R, "--ready", str(self.ready), *options)
        super().__init__(WORKERS, tmp, name, mode, url, *options)

    def wait_event(
        self, kind: str, timeout: float, after: float = 0.0, *, describe: str = ""
    ) -> dict[str, Any]:
        """The first ``kind`` event recorded at or after monotonic ``after``."""
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.events(kind) if e["t"] >= after]
            if found:
                return found[0]
            if self.proc.poll() is not None:
                found = [e for e in self.events(kind) if e["t"] >= after]
                if found:
                    return found[0]
                pytest.fail(
                    f"{self.name} exited ({self.proc.returncode}) before {kind!r}: "
                    f"{self.diagnostics()}"
                )
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{self.name}: no {kind!r} {describe} within {timeout}s: {self.diagnostics()}"
                )
            time.sleep(0.002)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} did not exit within {timeout}s: {self.diagnostics()}")

    def signal(self, signum: int) -> None:
        os.kill(self.proc.pid, signum)

    def diagnostics(self) -> str:
        log = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
        return f"events={self.events()[-10:]!r} log={log!r}"


Spawn = Callable[..., Worker]


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/fenced.db"


@pytest.fixture
def coord(url: str) -> Iterator[fenced.Coordinator]:
    with fenced.connect(url) as coordinator:
        yield coordinator


@pytest.fixture
def spawn(tmp_path: Path, url: str) -> Iterator[Spawn]:
    started: list[Worker] = []

    def start(name: str, mode: str, *options: str) -> Worker:
        worker = Worker(tmp_path, name, mode, url, *options)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()


def wait_ready(workers: list[Worker]) -> None:
    """Wait until every worker has connected (its ready file exists)."""
    deadline = time.monotonic() + STARTUP
    while not all(w.ready.exists() for w in workers):
        for worker in workers:
            if worker.proc.poll() is not None:
                pytest.fail(f"{worker.name} exited early: {worker.diagnostics()}")
        if time.monotonic() > deadline:
            pytest.fail(f"workers did not start within {STARTUP}s")
        time.sleep(0.005)


def test_eight_processes_contending_get_unique_epochs_and_never_overlap(
    spawn: Spawn, coord: fenced.Coordinator, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    workers = [
        spawn(f"w{i}", "contend", "--seconds", "2", "--ttl", "5", "--wait", "10", "--go", str(go))
        for i in range(8)
    ]
    wait_ready(workers)
    go.touch()
    for worker in workers:
        assert worker.wait_exit(30) == 0, worker.diagnostics()

    held = [(w.name, e) for w in workers for e in w.events("held")]
    epochs = sorted(e["epoch"] for _, e in held)
    assert epochs == list(range(1, len(held) + 1))  # unique, gap-free, one per acquire
    assert coord.last_epoch(R) == len(held)
    assert all(e["released"] for _, e in held)  # nobody outlived a 5 s ttl
    assert all(w.events("done") for w in workers)
    # First come, first served: nobody is starved while the others cycle.
    assert all(w.events("held") for w in workers), [len(w.events("held")) for w in workers]

    by_time = sorted(held, key=lambda item: item[1]["acquired"])
    assert [e["epoch"] for _, e in by_time] == epochs  # grants are ordered in time
    # They contended: turns passed from one process to another far more often than the 7 times
    # of processes that ran one after another (each one waited in line behind the others).
    turns = sum(a != b for (a, _), (b, _) in itertools.pairwise(by_time))
    assert turns > len(held) // 2, f"only {turns} turns in {len(held)} grants"
    for (name_a, a), (name_b, b) in itertools.pairwise(by_time):
        assert a["releasing"] <= b["acquired"], (
            f"{name_a} held epoch {a['epoch']} until {a['releasing']:.6f} but {name_b} "
            f"acquired epoch {b['epoch']} at {b['acquired']:.6f}"
        )


def test_waiters_giving_up_while_leases_are_handed_to_them_lose_nothing(
    spawn: Spawn, coord: fenced.Coordinator, tmp_path: Path
) -> None:
    """Releases hand the lease to the head waiter while waiters time out, leave and come back:
    every grant an acquire returned is still live when its holder releases it, no epoch is
    granted twice, and no two holders overlap."""
    go = tmp_path / "go"
    waits = "0,0.001,0.003,0.01,none"
    workers = [
        spawn(f"w{i}", "contend", "--seconds", "2", "--ttl", "5", "--waits", waits, "--go", str(go))
        for i in range(6)
    ]
    wait_ready(workers)
    go.touch()
    for worker in workers:
        assert worker.wait_exit(30) == 0, worker.diagnostics()
    held = sorted((e for w in workers for e in w.events("held")), key=lambda e: e["acquired"])
    assert sum(e["busy"] for w in workers for e in w.events("done")) > 0  # some gave up
    assert all(e["released"] for e in held), [e["epoch"] for e in held if not e["released"]]
    epochs = [e["epoch"] for e in held]
    assert epochs == sorted(set(epochs)) and coord.last_epoch(R) >= len(held)
    for a, b in itertools.pairwise(held):
        assert a["releasing"] <= b["acquired"], (a, b)


@pytest.mark.parametrize("mode", ["hold", "renewloop"])
def test_a_holder_paused_past_its_ttl_is_replaced_and_finds_out(
    spawn: Spawn, coord: fenced.Coordinator, mode: str
) -> None:
    ttl = 1.0
    worker = spawn("paused", mode, "--ttl", str(ttl))
    acquired = worker.wait_event("acquired", STARTUP)
    # Pause it just after a renewal: it is not inside a database transaction then.
    renewed = worker.wait_event("renewed", 5, after=acquired["t"], describe="after acquiring")
    worker.signal(signal.SIGSTOP)
    paused_at = time.monotonic()
    try:
        lease = coord.acquire(R, ttl=30, wait=10, holder="successor")
        assert lease.epoch == acquired["epoch"] + 1
        assert time.monotonic() - renewed["t"] >= ttl * 0.9  # only after the old lease expired
        assert worker.events()[-1]["t"] < paused_at + 0.05  # (it really was paused)
    finally:
        worker.signal(signal.SIGCONT)

    done = worker.wait_event("done", 10)
    assert worker.wait_exit(10) == 0, worker.diagnostics()
    seen = {e["event"]: e for e in worker.events() if e["t"] >= paused_at}
    if mode == "hold":
        assert seen["check-lost"]["reason"] in {"EXPIRED", "REJECTED"}
        assert seen["exit-lost"]["reason"] in {"EXPIRED", "REJECTED"}
        assert len(seen["exit-lost"]["on_lost"]) == 1
    else:
        assert seen["renew-loop-lost"]["reason"] == "EXPIRED"  # its local deadline passed
    assert "renew-lost" in seen
    assert seen["forced-renew-lost"]["reason"] == "REJECTED"  # the coordinator refuses too
    assert seen["release"]["released"] is False
    assert "renew-ok" not in seen and "forced-renew-ok" not in seen and "exit-ok" not in seen

    info = coord.current(R)
    assert info is not None, "the delayed release must leave the new lease alone"
    assert (info.epoch, info.holder) == (lease.epoch, "successor")
    assert done["t"] > paused_at
    assert coord.release(lease)


@pytest.mark.parametrize("mode", ["hold", "ahold"])  # ahold: the asyncio face
def test_a_killed_holder_is_replaced_within_ttl_plus_one_renewal_interval(
    spawn: Spawn, coord: fenced.Coordinator, mode: str
) -> None:
    ttl = 1.0
    worker = spawn("killed", mode, "--ttl", str(ttl))
    acquired = worker.wait_event("acquired", STARTUP)
    worker.wait_event("renewed", 5, after=acquired["t"], describe="after acquiring")
    worker.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    lease = coord.acquire(R, ttl=5, wait=10, holder="successor")
    took = time.monotonic() - killed_at
    assert worker.wait_exit(10) == -signal.SIGKILL
    assert lease.epoch == acquired["epoch"] + 1
    renewal_interval = ttl / 3 * 1.1  # ttl/3 with up to 10 % jitter
    assert took <= ttl + renewal_interval + 0.5, f"takeover took {took:.3f}s"


def test_kill_9_in_acquire_release_loops_never_duplicates_an_epoch(
    spawn: Spawn, coord: fenced.Coordinator
) -> None:
    rng = random.Random(int(time.time()))
    reported: list[list[int]] = []
    for round_number in range(5):
        workers = [
            spawn(f"r{round_number}w{i}", "loop", "--ttl", "0.5", "--wait", "30") for i in range(4)
        ]
        wait_ready(workers)
        started = time.monotonic()
        kills = sorted(((rng.uniform(0.05, 0.6), w) for w in workers), key=lambda k: k[0])
        for at, worker in kills:
            time.sleep(max(0.0, started + at - time.monotonic()))
            worker.signal(signal.SIGKILL)
        for worker in workers:
            assert worker.wait_exit(10) == -signal.SIGKILL, worker.diagnostics()
            reported.append([e["epoch"] for e in worker.events("granted")])

    everything = [epoch for epochs in reported for epoch in epochs]
    assert len(everything) >= 5, "the workers barely ran; the test proved nothing"
    assert len(everything) == len(set(everything)), "an epoch was granted twice"
    for epochs in reported:
        assert epochs == sorted(epochs)
    last = coord.last_epoch(R)
    assert last >= max(everything)
    assert coord.acquire(R, ttl=5, wait=10).epoch == last + 1


@pytest.mark.parametrize("skew", [86400.0, -86400.0])
def test_processes_whose_wall_clocks_disagree_see_the_same_expiry(
    spawn: Spawn, coord: fenced.Coordinator, skew: float
) -> None:
    mine = coord.acquire(R, ttl=30, wait=0, holder="parent")
    worker = spawn("skewed", "skewed", "--skew", str(skew), "--ttl", "1", "--wait", "20")
    seen = worker.wait_event("current", STARTUP)
    info = coord.current(R)
    assert info is not None
    assert seen["epoch"] == mine.epoch
    assert abs(seen["expires_in"] - info.expires_in) < 5  # not a day apart
    assert worker.wait_event("busy", 10)["epoch"] == mine.epoch
    assert coord.release(mine)
    taken = worker.wait_event("acquired", 10)
    assert taken["epoch"] == mine.epoch + 1
    assert worker.wait_exit(10) == 0, worker.diagnostics()
    started = time.monotonic()
    after = coord.acquire(R, ttl=5, wait=10)  # its 1 s lease expires by CLOCK_BOOTTIME
    assert after.epoch == mine.epoch + 2
    assert time.monotonic() - started < 5


# -- the asyncio face, in real processes ----------------------------------------------------------


def test_sync_and_asyncio_processes_contending_share_one_queue_and_never_overlap(
    spawn: Spawn, coord: fenced.Coordinator, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    options = ("--seconds", "2", "--ttl", "5", "--wait", "10", "--go", str(go))
    workers = [spawn(f"w{i}", "contend" if i % 2 else "acontend", *options) for i in range(4)]
    wait_ready(workers)
    go.touch()
    for worker in workers:
        assert worker.wait_exit(30) == 0, worker.diagnostics()
    held = sorted(
        ((w.name, e) for w in workers for e in w.events("held")), key=lambda i: i[1]["acquired"]
    )
    assert [e["epoch"] for _, e in held] == list(range(1, len(held) + 1))
    assert all(w.events("held") for w in workers)  # both faces were served
    for (name_a, a), (name_b, b) in itertools.pairwise(held):
        assert a["releasing"] <= b["acquired"], (name_a, a, name_b, b)


def test_an_asyncio_holder_paused_past_its_ttl_is_replaced_and_its_body_cancelled(
    spawn: Spawn, coord: fenced.Coordinator
) -> None:
    ttl = 1.0
    worker = spawn("paused", "ahold", "--ttl", str(ttl))
    acquired = worker.wait_event("acquired", STARTUP)
    worker.wait_event("renewed", 5, after=acquired["t"], describe="after acquiring")
    worker.signal(signal.SIGSTOP)
    paused_at = time.monotonic()
    try:
        lease = coord.acquire(R, ttl=30, wait=10, holder="successor")
        assert lease.epoch == acquired["epoch"] + 1
    finally:
        worker.signal(signal.SIGCONT)
    resumed_at = time.monotonic()
    cancelled = worker.wait_event("body-cancelled", 5, after=paused_at)
    ended = worker.wait_event("exit-lost", 5, after=paused_at)
    assert worker.wait_exit(10) == 0, worker.diagnostics()
    assert cancelled["lost"] is True
    assert ended["reason"] in {"EXPIRED", "REJECTED"}
    assert len(ended["on_lost"]) == 1
    assert cancelled["t"] - resumed_at < ttl  # at the resume: the deadline had passed
    info = coord.current(R)
    assert info is not None and (info.epoch, info.holder) == (lease.epoch, "successor")
    assert coord.release(lease)


def test_a_killed_asyncio_waiter_does_not_hold_up_the_queue(
    spawn: Spawn, coord: fenced.Coordinator
) -> None:
    lease = coord.acquire(R, ttl=30, wait=0, holder="first")
    doomed = spawn("doomed", "await", "--ttl", "5")
    doomed.wait_event("waiting", STARTUP)
    time.sleep(0.3)  # it has queued (its ticket is ahead of the next waiter)
    behind = spawn("behind", "await", "--ttl", "5")
    behind.wait_event("waiting", STARTUP)
    time.sleep(0.3)
    doomed.signal(signal.SIGKILL)
    assert doomed.wait_exit(10) == -signal.SIGKILL
    released_at = time.monotonic()
    assert coord.release(lease)
    granted = behind.wait_event("acquired", 10)
    assert granted["epoch"] == lease.epoch + 1  # the dead waiter consumed no epoch
    assert granted["t"] - released_at < 1.0  # skipped at once, not after its keep-alive
    assert behind.wait_exit(10) == 0
