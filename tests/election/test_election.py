"""Leader election with fenced terms (DESIGN §2, issue 8), on every coordinator backend.

Backends: the ``url`` fixture runs a test on ``memory://`` (in-process reference), embedded SQLite
and — **only if their test fixtures exist in the tree when this module is imported** —
PostgreSQL (``support/postgres_fixtures.py``), etcd (``support/etcd_fixtures.py``) and ZooKeeper
(``support/zookeeper_fixtures.py``). Those fixture
modules start real servers for the session; the backends joined the tree at different times, so
this module picks them up as soon as their fixtures land instead of failing before they exist.
Once present, a server that cannot start fails these tests loudly (nothing skips).
``shared_url`` is the same without ``memory://``, which cannot be shared between processes: the
multi-process tests (real candidates, SIGKILL, SIGSTOP, observers in other processes) use it.

Multi-process tests run ``tests/election/election_workers.py`` and poll its JSON-line events with
deadlines. The only time bounds asserted are DESIGN's takeover bound after a crash or a pause
(ttl + one renewal interval + 0.5 s) and a generous 1 s for a resignation's handoff (the measured
median is printed: run with ``-s`` to see it).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import fenced
from fenced.coordinator._client import Coordinator
from fenced.coordinator._connect import open_backend
from fenced.coordinator.backends.memory._backend import MemoryBackend
from fenced.core._clock import ManualClock
from fenced.core._records import Record, RecordKind
from fenced.election import LeaderChange, Observer, TermTracker
from fenced.testing._threads import ResultThread
from fenced.testing.faults import FaultyBackend
from support.cli_processes import DEADLINE, FENCED, Start, fenced_cmd, wait_for
from support.worker_processes import WorkerProcess

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKERS = HERE / "election_workers.py"
NAME = "scheduler/leader"

SHARED_BACKENDS = ["sqlite", "postgresql", "etcd", "zookeeper"]  # support/*_fixtures.py
ALL_BACKENDS = ["memory", *SHARED_BACKENDS]

# etcd leases have a granularity of one second (a lease of ttl T lasts up to ceil(T) + 0.5 s after
# its last keep-alive), so etcd gets a whole-second ttl; the others get one second as well.
TTL = {"memory": 1.0, "sqlite": 1.0, "postgresql": 1.0, "etcd": 2.0, "zookeeper": 1.0}


def _url_for(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if backend == "memory":
        name = uuid.uuid4().hex
        request.addfinalizer(lambda: MemoryBackend.forget(name))
        return f"memory://{name}"
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'coordinator.db'}"
    if backend == "postgresql":
        server = request.getfixturevalue("postgres_server")
        return str(server.url("postgres", schema="t_" + uuid.uuid4().hex[:12]))
    if backend == "zookeeper":
        ensemble = request.getfixturevalue("zk_ensemble")
        chroot = "/t" + uuid.uuid4().hex[:12]
        return str(ensemble.url(chroot, session_timeout=2, timeout=2))
    cluster = request.getfixturevalue("etcd_cluster")
    return str(cluster.url(prefix="/t" + uuid.uuid4().hex[:12], timeout=2))


@pytest.fixture(params=ALL_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return _url_for(backend, request, tmp_path)


@pytest.fixture(params=SHARED_BACKENDS)
def shared_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def shared_url(shared_backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return _url_for(shared_backend, request, tmp_path)


@pytest.fixture
def connect_all() -> Iterator[Callable[[str], Coordinator]]:
    """``fenced.connect(url)``; every coordinator is closed at the end of the test."""
    opened: list[Coordinator] = []

    def make(url: str) -> Coordinator:
        opened.append(fenced.connect(url))
        return opened[-1]

    yield make
    for coord in opened:
        coord.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[fenced.Store]:
    opened = fenced.open_store(f"sqlite:///{tmp_path / 'store.db'}")
    yield opened
    opened.close()


def changes_of(observer: Observer, count: int, timeout: float = DEADLINE) -> list[LeaderChange]:
    got: list[LeaderChange] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        change = observer.get(deadline - time.monotonic())
        if change is None:
            raise AssertionError(f"only {len(got)} of {count} changes came: {got}")
        got.append(change)
    return got


def summary(changes: list[LeaderChange]) -> list[tuple[str, int, str | None]]:
    return [(c.kind.value, c.term, c.reason) for c in changes]


# -- in-process, on every backend ----------------------------------------------------------


def test_a_term_is_a_fenced_lease_with_a_value(
    url: str, connect_all: Callable[[str], Coordinator], store: fenced.Store
) -> None:
    coord = connect_all(url)
    assert coord.leader(NAME) is None
    with coord.campaign(NAME, "10.0.0.7:8080", ttl=5, fence=[store], holder="a") as leadership:
        assert leadership.state is fenced.LeaseState.HELD
        leadership.check()
        assert leadership.term == leadership.epoch == leadership.token.epoch == 1
        assert leadership.token.resource == NAME and leadership.name == NAME
        assert store.floor(NAME) == 1  # installed before the body ran
        info = coord.leader(NAME)
        assert info is not None
        assert (info.name, info.term, info.holder, info.value) == (NAME, 1, "a", "10.0.0.7:8080")
        assert 0 < info.expires_in <= 5
        store.put(leadership.token, "plan", b"v1")
    assert coord.leader(NAME) is None
    with coord.campaign(NAME, "10.0.0.8:8080", ttl=5, fence=[store]) as second:
        assert second.term == 2
    with pytest.raises(fenced.StaleToken):  # the demoted term's writes are rejected
        store.put(leadership.token, "plan", b"late")
    with pytest.raises(fenced.LeaseLost):
        leadership.check()


def test_a_candidate_that_gives_up_leaves_the_queue(
    url: str, backend: str, connect_all: Callable[[str], Coordinator]
) -> None:
    """The order is forced: the quitter is in line, then the patient candidate behind it, and
    only then does the quitter give up (its wait runs on a manual clock that the test moves)."""
    first = connect_all(url)
    in_line = [FaultyBackend(open_backend(url)) for _ in range(2)]  # no fault: witnesses

    def queued(backend: FaultyBackend) -> Callable[[], bool]:
        return lambda: backend.answered.get("enqueue", 0) >= 1  # it has its place in line

    clock = ManualClock()
    quitter = Coordinator(in_line[0], clock=clock)
    patient = Coordinator(in_line[1])
    try:
        with first.campaign(NAME, "first", ttl=TTL[backend] * 5) as leader:
            gave_up = ResultThread(
                lambda: quitter.campaign(NAME, "quitter", ttl=5, wait=0.5).__enter__()
            )
            gave_up.start()
            wait_for(queued(in_line[0]), "the quitter to queue")
            waiting = ResultThread(lambda: patient.campaign(NAME, "patient", ttl=5).__enter__())
            waiting.start()
            wait_for(queued(in_line[1]), "the patient candidate to queue")
            assert gave_up.is_alive(), gave_up.error  # in line ahead of it until the clock moves
            clock.advance(1.0)  # past the quitter's wait: it gives up at its next wake-up
            gave_up.join(DEADLINE)
            assert isinstance(gave_up.error, fenced.Busy), gave_up.error
            assert waiting.is_alive(), waiting.error  # still waiting for the leader
            resigned_at = time.monotonic()
            assert leader.resign()
            waiting.join(DEADLINE)
            assert not waiting.is_alive() and waiting.error is None
            elected_in = time.monotonic() - resigned_at
        successor: fenced.Leadership = waiting.result
        assert successor.term == leader.term + 1  # the quitter got no term
        assert elected_in < 1.0, f"the next candidate waited {elected_in:.3f}s behind a quitter"
        assert patient.leader(NAME) is not None and patient.leader(NAME).value == "patient"  # type: ignore[union-attr]
        successor.resign()
    finally:
        quitter.close()
        patient.close()


def test_proclaim_changes_the_value_seen_by_observers_not_the_term(
    url: str, connect_all: Callable[[str], Coordinator]
) -> None:
    coord, watcher = connect_all(url), connect_all(url)
    observer = watcher.observe(NAME)
    with coord.campaign(NAME, "v1", ttl=5) as leadership:
        leadership.proclaim("v2")
        assert leadership.value == "v2"
        info = watcher.leader(NAME)
        assert info is not None and (info.term, info.value) == (leadership.term, "v2")
        with pytest.raises(fenced.ConfigurationError):
            leadership.proclaim("nul\x00")
        leadership.resign()
        with pytest.raises(fenced.LeaseLost):
            leadership.proclaim("v3")
    changes = changes_of(observer, 3)
    assert summary(changes) == [
        ("elected", 1, None),
        ("proclaimed", 1, None),
        ("ended", 1, "released"),
    ]
    assert changes[1].value == "v2" and changes[2].value == "v2"
    observer.close()


def test_observe_delivers_every_term_once_even_short_ones(
    url: str, backend: str, connect_all: Callable[[str], Coordinator]
) -> None:
    coord, watcher = connect_all(url), connect_all(url)
    with coord.campaign(NAME, "before", ttl=30) as before:
        observer = watcher.observe(NAME)  # starts with the live term
        before.resign()
    for number in range(3):  # terms granted and ended before the observer reads anything
        with coord.campaign(NAME, f"quick-{number}", ttl=30) as quick:
            quick.resign()
    expiring = coord.acquire(NAME, ttl=TTL[backend], wait=0, value="expiring")
    wait_for(lambda: coord.current(NAME) is None, "the expiry")
    changes = changes_of(observer, 10)
    assert summary(changes) == [
        ("elected", 1, None),
        ("ended", 1, "released"),
        ("elected", 2, None),
        ("ended", 2, "released"),
        ("elected", 3, None),
        ("ended", 3, "released"),
        ("elected", 4, None),
        ("ended", 4, "released"),
        ("elected", expiring.epoch, None),
        ("ended", expiring.epoch, "expired"),
    ]
    assert changes[0].value == "before"  # the live term, read when observe() was called
    with coord.campaign(NAME, "sentinel", ttl=30) as sentinel:  # happens after all of the above
        # the very next change is the sentinel's: nothing more, and no duplicate, came before it
        assert summary(changes_of(observer, 1)) == [("elected", sentinel.term, None)]
    observer.close()


def test_resign_is_not_a_loss_and_the_block_ends_quietly(
    url: str, connect_all: Callable[[str], Coordinator]
) -> None:
    coord = connect_all(url)
    reasons: list[fenced.LeaseLost] = []
    with coord.campaign(NAME, "v", ttl=5, on_lost=reasons.append) as leadership:
        assert not leadership.ended.is_set()
        assert leadership.resign() is True
        assert leadership.resign() is False  # idempotent
        assert leadership.state is fenced.LeaseState.LOST
        assert leadership.ended.is_set() and not leadership.lost.is_set()
        with pytest.raises(fenced.LeaseLost) as lost:
            leadership.check()
        assert lost.value.reason is fenced.LossReason.RELEASED
        assert coord.leader(NAME) is None
    assert reasons == []


# -- in-process, on the reference backend --------------------------------------------------


@pytest.fixture
def memory_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return _url_for("memory", request, tmp_path)


def test_bad_parameters_fail_before_any_io(memory_url: str) -> None:
    coord = fenced.connect(memory_url)
    for value in (None, 7, "x" * 5000, "nul\x00", "\udc80"):
        with pytest.raises(fenced.ConfigurationError):
            coord.campaign(NAME, value, ttl=5)  # type: ignore[arg-type]
    with pytest.raises(fenced.ConfigurationError):
        coord.campaign(NAME, "v", ttl=0)
    with pytest.raises(fenced.ConfigurationError):
        coord.campaign(NAME, "v", ttl=5, wait=-1)
    with pytest.raises(fenced.ConfigurationError):
        coord.campaign(NAME, "v", ttl=5, on_lost="no")  # type: ignore[arg-type]
    with pytest.raises(fenced.InvalidName):
        coord.campaign("bad//name", "v", ttl=5)
    with pytest.raises(fenced.InvalidName):
        coord.observe("../up")
    with pytest.raises(fenced.InvalidName):
        coord.leader("")
    assert coord.last_epoch(NAME) == 0


def test_run_as_leader_returns_what_fn_returns_and_steps_down(memory_url: str) -> None:
    coord = fenced.connect(memory_url)
    seen: list[int] = []

    def work(leadership: fenced.Leadership) -> str:
        leadership.check()
        seen.append(leadership.term)
        assert coord.leader(NAME) is not None
        return "done"

    assert fenced.run_as_leader(coord, NAME, work, value="v", ttl=5) == "done"
    assert seen == [1] and coord.leader(NAME) is None


def test_run_as_leader_signals_loss_to_fn_and_raises(memory_url: str) -> None:
    backend = FaultyBackend(open_backend(memory_url))
    coord = Coordinator(backend)
    reasons: list[fenced.LeaseLost] = []

    def work(leadership: fenced.Leadership) -> str:
        backend.arm("renew", "unavailable", times=None)  # the coordinator becomes unreachable
        assert leadership.ended.wait(DEADLINE), "the loss was not signalled"
        assert leadership.lost.is_set()
        with pytest.raises(fenced.LeaseLost):
            leadership.check()
        return "finished anyway"

    with pytest.raises(fenced.LeaseLost):
        fenced.run_as_leader(coord, NAME, work, value="v", ttl=0.6, on_lost=reasons.append)
    assert [r.reason for r in reasons] == [fenced.LossReason.EXPIRED]


def test_the_observer_rides_out_an_outage_without_loss_or_repeat(memory_url: str) -> None:
    backend = FaultyBackend(open_backend(memory_url))
    observer = Coordinator(backend).observe(NAME)
    coord = fenced.connect(memory_url)
    backend.arm("records", "unavailable", times=4)
    backend.arm("watch", "unavailable", times=2)
    for _ in range(2):
        with coord.campaign(NAME, "v", ttl=5) as leadership:
            leadership.resign()
    changes = changes_of(observer, 4)
    assert summary(changes) == [
        ("elected", 1, None),
        ("ended", 1, "released"),
        ("elected", 2, None),
        ("ended", 2, "released"),
    ]
    assert backend.calls["records"] >= 5
    with coord.campaign(NAME, "sentinel", ttl=5) as sentinel:
        # the very next change is the sentinel's: no repeat of the terms above came before it
        assert summary(changes_of(observer, 1)) == [("elected", sentinel.term, None)]
    assert sentinel.term == 3


def test_a_restore_ends_the_term_for_observers(memory_url: str) -> None:
    coord = fenced.connect(memory_url)
    observer = coord.observe(NAME)
    with pytest.raises(fenced.LeaseLost), coord.campaign(NAME, "old", ttl=1) as leadership:
        coord.backend.advance(1000, {}, {"why": "test"})
        assert leadership.lost.wait(DEADLINE)  # the next renewal is refused
    with coord.campaign(NAME, "new", ttl=5) as after:
        assert after.term == 1001
    assert summary(changes_of(observer, 4)) == [
        ("elected", 1, None),
        ("ended", 1, "restored"),
        ("elected", 1001, None),
        ("ended", 1001, "released"),
    ]


def _record(seq: int, kind: RecordKind, epoch: int, **detail: object) -> Record:
    return Record(seq, 0.0, kind, NAME, epoch, "h", detail)


class _HandedOverDuringTheRecheck:
    """Records of one election in which term 1 is released and term 2 granted exactly between
    an observer's read that found nothing new and its re-check of the last epoch."""

    def __init__(self) -> None:
        self.records = [_record(1, RecordKind.GRANTED, 1)]

    def current(self, resource: str) -> None:
        return None

    def last_epoch(self, resource: str) -> int:
        if len(self.records) == 1:
            self.records += [_record(2, RecordKind.RELEASED, 1), _record(3, RecordKind.GRANTED, 2)]
        return max(record.epoch for record in self.records)

    def history(self, resource: str | None = None, *, after: int = 0) -> list[Record]:
        return [record for record in self.records if record.seq > after]

    def watch(self, resource: str, after: int, timeout: float) -> None:
        time.sleep(min(timeout, 0.01))


def test_a_term_granted_during_the_observers_recheck_is_not_taken_for_a_restore() -> None:
    """The re-check that looks for a renumbered history (the last epoch is above every term
    seen) first reads on from its position: a handoff that committed just before it is new
    history, and the live term ends as released, not replaced."""
    ops = _HandedOverDuringTheRecheck()
    observer = Observer(ops, ops, NAME, recheck=0.0)
    changes = [observer.get(DEADLINE) for _ in range(3)]
    assert summary([c for c in changes if c is not None]) == [
        ("elected", 1, None),
        ("ended", 1, "released"),
        ("elected", 2, None),
    ]


def test_term_tracker_is_idempotent_by_term_when_a_history_is_read_again() -> None:
    tracker = TermTracker(NAME)
    history = [
        _record(1, RecordKind.GRANTED, 1),
        _record(2, RecordKind.PROCLAIMED, 1, value="v"),
        _record(3, RecordKind.EXPIRED, 1),
        _record(4, RecordKind.GRANTED, 2, value="recorded"),
    ]
    first = [change for record in history for change in tracker.feed(record)]
    assert summary(first) == [
        ("elected", 1, None),
        ("proclaimed", 1, None),
        ("ended", 1, "expired"),
        ("elected", 2, None),
    ]
    assert first[-1].value == "recorded"  # a backend that records the value at the grant
    assert [
        tracker.feed(record) for record in history if record.kind is not RecordKind.PROCLAIMED
    ] == [
        [],
        [],
        [],
    ]
    # a renumbered history after a restore: RESTORED ends the live term, a newer one follows
    restored = [_record(1, RecordKind.RESTORED, 50), _record(2, RecordKind.GRANTED, 51)]
    after = [change for record in restored for change in tracker.feed(record)]
    assert summary(after) == [("ended", 2, "restored"), ("elected", 51, None)]
    # a grant whose predecessor's end was never seen ends it first
    replaced = tracker.feed(_record(3, RecordKind.GRANTED, 52))
    assert summary(replaced) == [("ended", 51, "replaced"), ("elected", 52, None)]


# -- real processes ------------------------------------------------------------------------


class Proc(WorkerProcess):
    """One worker process (``tests/election/election_workers.py``) for ``NAME``, its event file,
    and its control files in ``tmp``."""

    def __init__(self, tmp: Path, name: str, mode: str, url: str, *options: str) -> None:
        options = ("--name", NAME, "--control", str(tmp), *options)
        super().__init__(WORKERS, tmp, name, mode, url, *options)

    def first(self, kind: str) -> dict[str, Any] | None:
        found = self.events(kind)
        return found[0] if found else None


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.kill()


def takeover_bound(ttl: float) -> float:
    """DESIGN: a new leader within ttl + one renewal interval (ttl/3, +10 % jitter) + 0.5 s."""
    return ttl + ttl / 3 * 1.1 + 0.5


@pytest.mark.slow
def test_five_candidate_processes_kill_pause_proclaim_resign(
    shared_url: str, shared_backend: str, tmp_path: Path, procs: list[Proc]
) -> None:
    ttl = TTL[shared_backend]
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    observers = [Proc(tmp_path, f"observer{i}", "observer", shared_url) for i in range(2)]
    procs.extend(observers)
    wait_for(lambda: all(o.first("ready") for o in observers), "the observers to start")
    candidates = []
    for i in range(5):
        options = ["--value", f"10.0.0.{i}:80", "--ttl", str(ttl), "--store", store_url]
        candidates.append(Proc(tmp_path, f"c{i}", "candidate", shared_url, *options))
    procs.extend(candidates)
    wait_for(lambda: all(c.first("campaigning") for c in candidates), "5 candidates to queue")

    def wrote(leader: Proc) -> Callable[[], bool]:
        def accepted() -> bool:
            write = leader.first("wrote")
            assert write is None or write["answer"] == "accepted", write
            return write is not None

        return accepted

    def leader_of(term_above: int) -> tuple[Proc, dict[str, Any]]:
        found: list[tuple[Proc, dict[str, Any]]] = []

        def elected() -> bool:
            found[:] = [
                (c, e) for c in candidates for e in c.events("elected") if e["term"] > term_above
            ]
            return bool(found)

        wait_for(elected, f"a leader with a term above {term_above}")
        assert len(found) == 1, f"two leaders at once: {found}"
        return found[0]

    store = fenced.open_store(store_url)
    try:
        # 1. crash: kill -9 of the leader
        first, elected1 = leader_of(0)
        wait_for(wrote(first), "the first leader's write")
        killed_at = time.monotonic()
        first.kill()
        second, elected2 = leader_of(elected1["term"])
        assert elected2["t"] - killed_at <= takeover_bound(ttl), "took over too late after kill"
        wait_for(wrote(second), "the second leader's write")
        with pytest.raises(fenced.StaleToken):  # the crashed leader's writes are rejected
            store.put(fenced.FencingToken.parse(elected1["token"]), "leader", b"zombie")

        # 2. pause: SIGSTOP of the leader, then SIGCONT once the next one has installed
        os.kill(second.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        third, elected3 = leader_of(elected2["term"])
        assert elected3["t"] - stopped_at <= takeover_bound(ttl), "took over too late after pause"
        wait_for(wrote(third), "the third leader's write")
        os.kill(second.pid, signal.SIGCONT)
        wait_for(lambda: second.first("stale-write"), "the resumed leader to learn it lost")
        lost = second.first("lost")
        assert lost is not None and lost["term"] == elected2["term"]
        assert second.first("stale-write")["answer"] == "StaleToken"  # type: ignore[index]

        # 3. proclaim: a new value, same term
        (tmp_path / f"{third.name}.proclaim").write_text("10.0.0.99:80")
        wait_for(lambda: third.first("proclaimed"), "the proclamation")
        with fenced.connect(shared_url) as coord:
            info = coord.leader(NAME)
        assert info is not None and (info.term, info.value) == (elected3["term"], "10.0.0.99:80")

        # 4. resign: the next candidate in the queue is elected promptly
        (tmp_path / f"{third.name}.resign").touch()
        fourth, elected4 = leader_of(elected3["term"])
        resigning = third.first("resigning")
        assert resigning is not None
        assert elected4["t"] - resigning["t"] < 1.0, "the resignation's handoff was slow"
    finally:
        store.close()

    terms = [elected1["term"], elected2["term"], elected3["term"], elected4["term"]]
    assert terms == sorted(set(terms)), f"terms must strictly increase: {terms}"
    assert len({first.name, second.name, third.name, fourth.name}) == 4

    # 5. observers in other processes saw every term, once, in order; the proclamation too
    def saw_last_term(observer: Proc) -> Callable[[], bool]:
        return lambda: any(c["term"] == terms[-1] for c in observer.events("change"))

    for o in observers:
        wait_for(saw_last_term(o), f"{o.name} to see term {terms[-1]}")
        changes = o.events("change")
        elected = [(c["term"], c["holder"]) for c in changes if c["kind"] == "elected"]
        assert elected == [
            (terms[0], first.name),
            (terms[1], second.name),
            (terms[2], third.name),
            (terms[3], fourth.name),
        ]
        proclaimed = [(c["term"], c["value"]) for c in changes if c["kind"] == "proclaimed"]
        assert proclaimed == [(terms[2], "10.0.0.99:80")]
        ended = [(c["term"], c["reason"]) for c in changes if c["kind"] == "ended"]
        assert ended == [(terms[0], "expired"), (terms[1], "expired"), (terms[2], "released")]


@pytest.mark.slow
def test_resign_hands_over_to_the_next_candidate_promptly(
    shared_url: str, shared_backend: str, tmp_path: Path, procs: list[Proc]
) -> None:
    go = tmp_path / "go"
    options = ["--ttl", "10", "--rounds", "3", "--lead", "0.05", "--go", str(go)]
    candidates = [
        Proc(tmp_path, f"c{i}", "candidate", shared_url, "--value", f"v{i}", *options)
        for i in range(5)
    ]
    procs.extend(candidates)
    wait_for(lambda: all(c.first("ready") for c in candidates), "5 candidates to start")
    go.touch()
    wait_for(lambda: all(c.first("done") for c in candidates), "15 terms", timeout=60)
    elected = {e["term"]: e for c in candidates for e in c.events("elected")}
    resigning = {e["term"]: e for c in candidates for e in c.events("resigning")}
    terms = sorted(elected)
    assert terms == list(range(terms[0], terms[0] + 15))
    handoffs = [elected[term]["t"] - resigning[term - 1]["t"] for term in terms[1:]]
    median = statistics.median(handoffs)
    print(
        f"\nresign handoff on {shared_backend}: p50 {median * 1000:.1f} ms, "
        f"max {max(handoffs) * 1000:.1f} ms over {len(handoffs)} handoffs"
    )
    assert max(handoffs) < 1.0, f"a handoff took {max(handoffs):.3f}s"


# -- the command line ----------------------------------------------------------------------


def _waiting(url: str) -> list[str]:
    """The holders queued for NAME in an embedded coordinator (``sqlite:////abs/path``)."""
    conn = sqlite3.connect(f"file:{url.removeprefix('sqlite:///')}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT holder FROM waiters WHERE name = ? ORDER BY id", (NAME,))
        return [str(holder) for (holder,) in rows]
    finally:
        conn.close()


@pytest.mark.slow
def test_fenced_elect_and_fenced_leader(tmp_path: Path, start_fenced: Start) -> None:
    url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    go = tmp_path / "go"
    child = (
        "import os, pathlib, sys, time\n"
        "out = pathlib.Path(sys.argv[1])\n"
        "part = out.with_name(out.name + '.part')  # renamed whole: never seen half-written\n"
        "part.write_text(os.environ['FENCED_TOKEN'] + ' ' + os.environ['FENCED_EPOCH'])\n"
        "os.replace(part, out)\n"
        "give_up = time.monotonic() + 60  # never outlive a failed test for long\n"
        "while not pathlib.Path(sys.argv[2]).exists() and time.monotonic() < give_up:\n"
        "    time.sleep(0.01)\n"
        "sys.exit(int(sys.argv[3]))\n"
    )
    assert fenced_cmd("leader", NAME, "--url", url).returncode == 2  # reads create nothing
    fenced.connect(url).close()
    assert fenced_cmd("leader", NAME, "--url", url).returncode == 1
    watch = start_fenced("leader", NAME, "--watch", "--json", "--url", url)
    first = start_fenced(
        "elect",
        NAME,
        "--value",
        "a:1",
        "--ttl",
        "5",
        "--url",
        url,
        "--holder",
        "A",
        "--",
        sys.executable,
        "-c",
        child,
        str(tmp_path / "a.out"),
        str(go),
        "7",
    )
    wait_for((tmp_path / "a.out").exists, "the first child")
    token, epoch = (tmp_path / "a.out").read_text().split()
    assert fenced.FencingToken.parse(token).epoch == int(epoch) == 1
    shown = fenced_cmd("leader", NAME, "--json", "--url", url)
    assert shown.returncode == 0, shown.stderr
    document = json.loads(shown.stdout)
    assert document["format"] == 1
    assert document["leader"]["holder"] == "A" and document["leader"]["value"] == "a:1"
    assert document["leader"]["term"] == 1 and 0 < document["leader"]["expires_in"] <= 5
    human = fenced_cmd("leader", NAME, "--url", url)
    assert "term 1" in human.stdout and "holder A" in human.stdout and "a:1" in human.stdout

    second = start_fenced(
        "elect",
        NAME,
        "--value",
        "b:2",
        "--ttl",
        "5",
        "--url",
        url,
        "--holder",
        "B",
        "--",
        sys.executable,
        "-c",
        child,
        str(tmp_path / "b.out"),
        str(go),
        "0",
    )
    wait_for(lambda: _waiting(url) == ["B"], "B to queue behind A")
    assert not (tmp_path / "b.out").exists()  # B waits: its command runs only once it leads
    go.touch()  # both children exit once started: the first with 7, then the second with 0
    assert first.wait(DEADLINE) == 7  # the child's own status
    assert second.wait(DEADLINE) == 0
    assert (tmp_path / "b.out").read_text().split()[1] == "2"

    lines: list[dict[str, Any]] = []
    assert watch.stdout is not None
    while len(lines) < 4:
        lines.append(json.loads(watch.stdout.readline()))
    assert [(line["kind"], line["term"], line["holder"]) for line in lines] == [
        ("elected", 1, "A"),
        ("ended", 1, "A"),
        ("elected", 2, "B"),
        ("ended", 2, "B"),
    ]
    assert all(line["format"] == 1 and line["name"] == NAME for line in lines)


@pytest.mark.slow
def test_fenced_elect_exits_76_when_leadership_is_lost(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    started = tmp_path / "started"
    child = f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(60)"
    options = ["--value", "v", "--ttl", "1", "--grace", "1", "--url", url]
    elect = subprocess.Popen(
        [*FENCED, "elect", NAME, *options, "--", sys.executable, "-c", child],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with fenced.connect(url) as coord:
            wait_for(started.exists, "the command to start")
            elect.send_signal(signal.SIGSTOP)
            wait_for(lambda: coord.leader(NAME) is None, "the term to expire")
            taken = coord.acquire(NAME, ttl=30, wait=0)  # the next leader
            elect.send_signal(signal.SIGCONT)
            _, stderr = elect.communicate(timeout=DEADLINE)
        assert elect.returncode == 76, stderr
        assert "leadership of scheduler/leader (term 1) lost while the command ran" in stderr
        assert "sent SIGTERM to the command" in stderr
        assert taken.epoch == 2
    finally:
        if elect.poll() is None:
            elect.kill()
            elect.communicate()


@pytest.mark.slow
def test_fenced_elect_bad_input_exits_2(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    for args in (
        ["elect", NAME, "--url", url, "--", "true"],  # no --value
        ["elect", NAME, "--value", "v", "--url", url],  # no command
        ["elect", "bad//name", "--value", "v", "--url", url, "--", "true"],
        ["elect", NAME, "--value", "v", "--ttl", "0", "--url", url, "--", "true"],
        ["leader", "bad//name", "--url", url],
    ):
        result = fenced_cmd(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.startswith("fenced: ") and len(result.stderr.splitlines()) == 1


# -- the example ---------------------------------------------------------------------------


@pytest.mark.slow
def test_the_partition_scheduler_example_tells_its_story() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "partition_scheduler.py"), "--demo"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rejected" in result.stdout
