"""``fenced.Elector``: campaign, on_started while leader, on_stopped at the end, campaign again.

In-process tests run on the reference backend (``memory://``) and the embedded SQLite backend;
the multi-process test (kill -9 and SIGSTOP of the leader, stop(), on_new_leader in every
process) runs on every shared backend: SQLite, and the session's PostgreSQL and etcd servers.
Waits poll for an event with a deadline; nothing asserts a speed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
from test_election import NAME, SHARED_BACKENDS, TTL, Proc, _url_for

import fenced
from fenced.coordinator._client import Coordinator
from fenced.coordinator._connect import open_backend
from fenced.testing.faults import FaultyBackend
from support.cli_processes import DEADLINE, wait_for


def coordinator_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if backend == "sqlite":  # an absolute path, whatever the number of slashes means
        return f"sqlite:{tmp_path / 'coordinator.db'}"
    return _url_for(backend, request, tmp_path)


@pytest.fixture(params=["memory", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return coordinator_url(str(request.param), request, tmp_path)


class Journal:
    """What the callbacks of one or more electors did, in order, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.entries: list[tuple[str, str, int]] = []  # (event, elector, term)

    def add(self, event: str, who: str, term: int = 0) -> None:
        with self._lock:
            self.entries.append((event, who, term))

    def of(self, event: str, who: str | None = None) -> list[int]:
        with self._lock:
            return [t for e, w, t in self.entries if e == event and who in (None, w)]


class Runner:
    """An elector whose ``run()`` is in a thread; keeps what ``run()`` raised."""

    def __init__(self, elector: fenced.Elector) -> None:
        self.elector = elector
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.elector.run()
        except BaseException as error:
            self.error = error

    def join(self) -> None:
        self.thread.join(DEADLINE)
        assert not self.thread.is_alive(), "run() did not return"


def elector(
    coord: fenced.Coordinator,
    journal: Journal,
    who: str,
    on_started: Callable[[fenced.Leadership], object] | None = None,
    *,
    ttl: float = 5.0,
    fence: Iterable[fenced.Store] = (),
) -> fenced.Elector:
    """An elector whose callbacks write to ``journal``; on_started waits for the term's end."""

    def started(leadership: fenced.Leadership) -> object:
        journal.add("started", who, leadership.term)
        if on_started is not None:
            return on_started(leadership)
        return leadership.ended.wait()

    return fenced.Elector(
        coord,
        NAME,
        started,
        value=who,
        ttl=ttl,
        holder=who,
        fence=fence,
        on_stopped=lambda: journal.add("stopped", who),
        on_new_leader=lambda change: journal.add("new-leader", who, change.term),
    )


@pytest.fixture
def coords(url: str) -> Iterator[Callable[[], fenced.Coordinator]]:
    opened: list[fenced.Coordinator] = []

    def make() -> fenced.Coordinator:
        opened.append(fenced.connect(url))
        return opened[-1]

    yield make
    for coord in opened:
        coord.close()


# -- in-process ----------------------------------------------------------------------------


def test_stop_resigns_calls_on_stopped_once_and_the_next_elector_leads(
    coords: Callable[[], fenced.Coordinator], tmp_path: Path
) -> None:
    journal = Journal()
    store = fenced.open_store(f"sqlite:{tmp_path / 'store.db'}")
    witness = coords()
    changes = witness.observe(NAME)
    a = Runner(elector(coords(), journal, "a", fence=[store]))
    wait_for(lambda: journal.of("started", "a"), "a to lead")
    b = Runner(elector(coords(), journal, "b", fence=[store]))
    wait_for(lambda: journal.of("new-leader", "b"), "b to see a's term")
    leadership = a.elector.leadership
    assert leadership is not None and leadership.term == 1
    store.put(leadership.token, "k", b"a")  # the term's token fences the store

    assert a.elector.stop() is True
    assert journal.of("stopped", "a") == [0]  # on_stopped ran once, before stop() returned
    assert a.elector.leadership is None and not leadership.lost.is_set()
    a.join()
    assert a.error is None
    seen_by_a = journal.of("new-leader", "a")  # term 2 too, if it came before run() returned
    wait_for(lambda: journal.of("started", "b"), "b to lead")
    assert journal.of("started", "b") == [2]
    ended = changes.get(DEADLINE), changes.get(DEADLINE)
    assert [(c.kind.value, c.term, c.reason) for c in ended if c is not None] == [
        ("elected", 1, None),
        ("ended", 1, "released"),  # resigned: handed over without waiting for an expiry
    ]
    with pytest.raises(fenced.StaleToken):  # b installed term 2 before its on_started ran
        store.put(leadership.token, "k", b"late")

    assert b.elector.stop() is True
    b.join()
    assert b.error is None
    assert journal.of("stopped") == [0, 0]  # once per term
    assert journal.of("new-leader", "b") == [1, 2]  # every leader, its own term included
    assert journal.of("new-leader", "a") == seen_by_a  # none after a's run() returned
    assert seen_by_a in ([1], [1, 2])
    with pytest.raises(RuntimeError):
        a.elector.run()  # single use
    changes.close()
    store.close()


def test_on_started_raising_ends_the_term_and_run_reraises_after_on_stopped(
    coords: Callable[[], fenced.Coordinator],
) -> None:
    journal = Journal()
    coord = coords()

    def fail(leadership: fenced.Leadership) -> None:
        raise ValueError(f"bug in term {leadership.term}")

    with pytest.raises(ValueError, match="bug in term 1"):
        elector(coord, journal, "a", fail).run()
    assert [e for e, _, _ in journal.entries if e != "new-leader"] == ["started", "stopped"]
    assert coord.leader(NAME) is None  # resigned: released, not left to expire


def test_lease_lost_or_stale_token_from_on_started_ends_the_term_and_it_campaigns_again(
    coords: Callable[[], fenced.Coordinator], tmp_path: Path
) -> None:
    journal = Journal()
    coord = coords()
    terms: list[fenced.Leadership] = []

    def demoted(leadership: fenced.Leadership) -> None:
        terms.append(leadership)
        if leadership.term == 1:
            leadership.resign()
            leadership.check()  # raises LeaseLost(RELEASED): the usual way out of a lost term
        if leadership.term == 2:  # a store has seen a newer term: this write raises StaleToken
            newer = fenced.FencingToken(coord.coordinator_id, NAME, 9)
            with fenced.open_store(f"sqlite:{tmp_path / 'store.db'}") as store:
                store.fence(newer)
                store.put(leadership.token, "k", b"demoted")
        leadership.ended.wait()

    runner = Runner(elector(coord, journal, "a", demoted))
    wait_for(lambda: journal.of("started") == [1, 2, 3], "a third term")
    assert runner.elector.stop() is True
    runner.join()
    assert runner.error is None
    assert journal.of("stopped") == [0, 0, 0]
    loss = terms[1].loss()
    assert terms[1].lost.is_set() and loss is not None
    assert loss.reason is fenced.LossReason.SUPERSEDED


def test_a_lost_term_calls_on_stopped_at_once_and_no_new_term_starts_before_on_started_returns(
    url: str, coords: Callable[[], fenced.Coordinator]
) -> None:
    backend = FaultyBackend(open_backend(url))
    coord = Coordinator(backend)
    witness = coords()
    journal = Journal()
    running = [0, 0]  # on_started running now, the most ever at once

    def lead(leadership: fenced.Leadership) -> None:
        running[0] += 1
        running[1] = max(running)
        try:
            if leadership.term == 1:
                backend.arm("renew", "unavailable", times=None)  # the coordinator is unreachable
                assert leadership.lost.wait(DEADLINE), "the loss was not signalled"
                # on_stopped does not wait for on_started to return
                wait_for(lambda: journal.of("stopped"), "on_stopped while on_started runs")
                wait_for(lambda: witness.leader(NAME) is None, "term 1 to expire")
                backend.disarm()
                # the elector could be elected now, but not while this on_started runs
                give_up = time.monotonic() + 0.5
                while time.monotonic() < give_up:
                    assert witness.last_epoch(NAME) == 1
                    time.sleep(0.02)
            else:
                leadership.ended.wait()
        finally:
            running[0] -= 1

    runner = Runner(elector(coord, journal, "a", lead, ttl=TTL["memory"]))
    try:
        wait_for(lambda: journal.of("started") == [1, 2], "the next term")
        assert runner.elector.stop() is True
        runner.join()
        assert runner.error is None
        assert journal.of("stopped") == [0, 0]
        assert running[1] == 1
    finally:
        coord.close()


def test_stop_while_campaigning_ends_run_without_a_term(
    url: str, coords: Callable[[], fenced.Coordinator]
) -> None:
    journal = Journal()
    with coords().campaign(NAME, "holder", ttl=30) as leadership:
        queued = FaultyBackend(open_backend(url))  # no fault: counts the calls
        coord = Coordinator(queued)
        try:
            runner = Runner(elector(coord, journal, "b"))
            wait_for(lambda: queued.answered.get("enqueue", 0) >= 1, "b to queue")
            wait_for(lambda: journal.of("new-leader", "b") == [1], "b to see the leader")
            assert runner.elector.stop() is True  # within a campaign slice
            runner.join()
            assert runner.error is None
            assert journal.of("started") == [] and journal.of("stopped") == []
            assert runner.elector.stop() is True  # idempotent
        finally:
            coord.close()
        assert leadership.state is fenced.LeaseState.HELD


def test_stop_before_run_and_bad_parameters(coords: Callable[[], fenced.Coordinator]) -> None:
    coord = coords()
    early = elector(coord, Journal(), "a")
    assert early.stop() is True
    early.run()  # returns at once: stopped for good
    assert coord.last_epoch(NAME) == 0
    with pytest.raises(fenced.ConfigurationError):
        fenced.Elector(coord, NAME, "not callable", value="v", ttl=5)  # type: ignore[arg-type]
    with pytest.raises(fenced.ConfigurationError):
        fenced.Elector(coord, NAME, print, value="v", ttl=5, on_stopped=3)  # type: ignore[arg-type]
    with pytest.raises(fenced.ConfigurationError):
        fenced.Elector(coord, NAME, print, value="v", ttl=0)
    with pytest.raises(fenced.ConfigurationError):
        fenced.Elector(coord, NAME, print, value=7, ttl=5)  # type: ignore[arg-type]
    with pytest.raises(fenced.InvalidName):
        fenced.Elector(coord, "bad//name", print, value="v", ttl=5)
    assert coord.last_epoch(NAME) == 0


# -- real processes ------------------------------------------------------------------------


@pytest.fixture(params=SHARED_BACKENDS)
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return coordinator_url(str(request.param), request, tmp_path)


@pytest.mark.slow
def test_elector_processes_through_kill_pause_and_stop(
    shared_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    ttl = max(TTL.values())  # etcd's whole-second ttl, for every backend alike
    store_url = f"sqlite:{tmp_path / 'store.db'}"
    options = ["--ttl", str(ttl), "--store", store_url]
    procs = [Proc(tmp_path, f"e{i}", "elector", shared_url, *options) for i in range(3)]
    for proc in procs:
        request.addfinalizer(proc.kill)
    wait_for(lambda: all(p.first("ready") for p in procs), "3 electors to start")

    def leader_after(term: int) -> tuple[Proc, int]:
        found: list[tuple[Proc, int]] = []

        def elected() -> bool:
            found[:] = [
                (p, e["term"]) for p in procs for e in p.events("started") if e["term"] > term
            ]
            return bool(found)

        wait_for(elected, f"an on_started with a term above {term}")
        assert len(found) == 1, f"two leaders at once: {found}"
        leader, new_term = found[0]

        def answers() -> list[str]:
            return [w["answer"] for w in leader.events("wrote") if w["term"] == new_term]

        wait_for(answers, f"{leader.name}'s write")
        assert answers() == ["accepted"]  # the new term's writes are accepted
        return found[0]

    def saw(proc: Proc, term: int) -> None:
        def seen() -> bool:
            return any(e["term"] == term for e in proc.events("new-leader"))

        wait_for(seen, f"{proc.name}'s on_new_leader of term {term}")

    def token(proc: Proc, term: int) -> fenced.FencingToken:
        (started,) = [e for e in proc.events("started") if e["term"] == term]
        return fenced.FencingToken.parse(started["token"])

    with fenced.connect(shared_url) as coord, fenced.open_store(store_url) as store:
        changes = coord.observe(NAME)

        # 1. kill -9 of the leader: another process's on_started runs with a larger term
        first, term1 = leader_after(0)
        first.kill()
        second, term2 = leader_after(term1)
        with pytest.raises(fenced.StaleToken):  # the crashed leader's writes are rejected
            store.put(token(first, term1), "leader", b"zombie")

        # 2. SIGSTOP of the leader past its ttl: a new leader; on SIGCONT the old one's
        #    on_stopped runs (its term was lost) and its late write is rejected
        os.kill(second.pid, signal.SIGSTOP)
        third, term3 = leader_after(term2)
        assert third is not second
        os.kill(second.pid, signal.SIGCONT)
        wait_for(lambda: second.first("stopped"), "the resumed leader's on_stopped")
        assert [(e["term"], e["lost"]) for e in second.events("stopped")] == [(term2, True)]
        wait_for(lambda: second.first("stale-write"), "the resumed leader's late write")
        assert second.first("stale-write")["answer"] == "StaleToken"  # type: ignore[index]

        # 3. stop() of the leader: on_stopped once, then stop() returns; the handover is a
        #    release, and the resumed old leader, campaigning again, is elected
        saw(third, term3)  # before it stops observing
        (tmp_path / f"{third.name}.stop").touch()
        wait_for(lambda: third.first("run-returned"), f"{third.name}'s run() to return")
        stopped = third.events("stopped")
        assert [(e["term"], e["lost"]) for e in stopped] == [(term3, False)]
        assert third.first("stop-returned")["stopped"] is True  # type: ignore[index]
        assert stopped[0]["t"] <= third.first("stop-returned")["t"]  # type: ignore[index]
        fourth, term4 = leader_after(term3)
        assert fourth is second  # it campaigned again after its lost term

        saw(second, term4)
        (tmp_path / f"{second.name}.stop").touch()
        wait_for(lambda: second.first("run-returned"), f"{second.name}'s run() to return")

        terms = [term1, term2, term3, term4]
        assert terms == sorted(set(terms))
        seen: list[tuple[str, int, str | None]] = []
        while len(seen) < 8:
            change = changes.get(DEADLINE)
            assert change is not None, f"only {seen} came"
            seen.append((change.kind.value, change.term, change.reason))
        assert seen == [
            ("elected", term1, None),
            ("ended", term1, "expired"),
            ("elected", term2, None),
            ("ended", term2, "expired"),
            ("elected", term3, None),
            ("ended", term3, "released"),
            ("elected", term4, None),
            ("ended", term4, "released"),
        ]
        changes.close()

    # on_new_leader saw every leader once, in order, in every process that lived through them
    # (the third stopped observing when its run() returned: term 4 may have come before that)
    leaders = [(term1, first.name), (term2, second.name), (term3, third.name)]
    leaders.append((term4, second.name))

    def new_leaders(proc: Proc) -> list[tuple[int, str]]:
        return [(e["term"], e["holder"]) for e in proc.events("new-leader")]

    assert new_leaders(second) == leaders
    assert new_leaders(third) in (leaders[:3], leaders)
    for proc in (second, third):  # on_stopped ran exactly once per term that started
        started = sorted(e["term"] for e in proc.events("started"))
        assert sorted(e["term"] for e in proc.events("stopped")) == started
