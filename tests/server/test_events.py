"""``GET /v1/events``: lease changes as Server-Sent Events, against the real server in a thread."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

import fenced
from fenced.server._auth import Role
from fenced.testing.server import ServedCoordinator


@dataclass
class Event:
    kind: str
    data: dict[str, object]
    id: str | None


@dataclass
class Listener:
    """Reads one event stream in a thread; ``events`` grows as they arrive."""

    url: str
    headers: dict[str, str] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)
    status: int = 0
    error: BaseException | None = None

    def start(self) -> Listener:
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        try:
            with httpx.stream("GET", self.url, headers=self.headers, timeout=30) as response:
                self.status = response.status_code
                kind, data, ident = "message", "", None
                for line in response.iter_lines():
                    if line.startswith(":"):
                        self.comments.append(line)
                    elif line.startswith("event: "):
                        kind = line[7:]
                    elif line.startswith("data: "):
                        data += line[6:]
                    elif line.startswith("id: "):
                        ident = line[4:]
                    elif line == "" and data:
                        self.events.append(Event(kind, json.loads(data), ident))
                        kind, data, ident = "message", "", None
        except BaseException as error:  # reported by the test
            self.error = error
        finally:
            self.ended.set()

    def wait_for(self, done: Callable[[list[Event]], bool], timeout: float = 5.0) -> list[Event]:
        deadline = time.monotonic() + timeout
        while not done(list(self.events)):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; events so far: {self.events} ({self.error!r})")
            time.sleep(0.01)
        return list(self.events)


def changes(events: list[Event]) -> list[tuple[str, str, int, str | None]]:
    """(kind, resource, epoch, holder) of the record events."""
    found = []
    for e in events:
        if e.kind not in ("ready", "rejected"):
            holder = e.data["holder"]
            assert holder is None or isinstance(holder, str)
            found.append((e.kind, str(e.data["resource"]), int(str(e.data["epoch"])), holder))
    return found


@pytest.fixture
def served() -> Iterator[ServedCoordinator]:
    with ServedCoordinator(f"memory://{uuid.uuid4().hex}", poll=2.0) as server:
        yield server


def test_acquire_release_handover_in_order_then_resume(served: ServedCoordinator) -> None:
    listener = Listener(f"{served.url}/v1/events?prefix=jobs/").start()
    listener.wait_for(lambda events: any(e.kind == "ready" for e in events))
    assert listener.status == 200
    coordinator = fenced.connect(served.url)
    try:
        first = coordinator.acquire("jobs/a", 30, 0, holder="alpha")
        coordinator.acquire("other/x", 30, 0, holder="elsewhere")  # outside the prefix
        taken: list[fenced.Lease] = []
        waiter = threading.Thread(
            target=lambda: taken.append(coordinator.acquire("jobs/a", 30, 5, holder="beta"))
        )
        waiter.start()
        coordinator.release(first)
        waiter.join(10)
        (second,) = taken
        coordinator.release(second)
        expected = [
            ("granted", "jobs/a", 1, "alpha"),
            ("released", "jobs/a", 1, "alpha"),
            ("granted", "jobs/a", 2, "beta"),
            ("released", "jobs/a", 2, "beta"),
        ]
        events = listener.wait_for(lambda events: len(changes(events)) >= 4, timeout=2)
        assert changes(events) == expected
        live = [e for e in events if e.kind != "ready"]
        seqs = [int(str(e.id)) for e in live]
        assert seqs == sorted(seqs) and [e.data["seq"] for e in live] == seqs

        # a reconnect with the first event's id gets exactly the rest, then "ready"
        resumed = Listener(
            f"{served.url}/v1/events?prefix=jobs/", {"Last-Event-ID": str(live[0].id)}
        ).start()
        again = resumed.wait_for(lambda events: any(e.kind == "ready" for e in events))
        assert changes(again) == expected[1:]
        assert [e.id for e in again if e.kind != "ready"] == [e.id for e in live[1:]]
        # ``after`` as a query parameter means the same
        after = Listener(f"{served.url}/v1/events?prefix=jobs/&after={live[2].id}").start()
        tail = after.wait_for(lambda events: any(e.kind == "ready" for e in events))
        assert changes(tail) == expected[3:]
        # a stream of every resource sees the other one too
        every = Listener(f"{served.url}/v1/events").start()
        every.wait_for(lambda events: ("granted", "other/x", 1, "elsewhere") in changes(events))
    finally:
        coordinator.close()


def test_expiry_is_an_event(served: ServedCoordinator) -> None:
    listener = Listener(f"{served.url}/v1/events?prefix=short").start()
    listener.wait_for(lambda events: any(e.kind == "ready" for e in events))
    coordinator = fenced.connect(served.url)
    try:
        coordinator.acquire("short", 0.3, 0, holder="brief", safety_margin=0.1)
        events = listener.wait_for(lambda events: len(changes(events)) >= 2, timeout=3)
        assert changes(events)[:2] == [
            ("granted", "short", 1, "brief"),
            ("expired", "short", 1, "brief"),
        ]
    finally:
        coordinator.close()


def test_streams_end_at_shutdown() -> None:
    server = ServedCoordinator(f"memory://{uuid.uuid4().hex}", poll=2.0).start()
    listener = Listener(f"{server.url}/v1/events").start()
    try:
        listener.wait_for(lambda events: any(e.kind == "ready" for e in events))
        began = time.monotonic()
        server.stop()
        assert listener.ended.wait(5)
        assert time.monotonic() - began < 5
        assert listener.error is None  # a complete response, not a broken connection
    finally:
        server.stop()


def test_bad_requests_are_problems(served: ServedCoordinator) -> None:
    bad_prefix = httpx.get(f"{served.url}/v1/events?prefix=a%20b", timeout=5)
    assert bad_prefix.status_code in (400, 422)
    assert bad_prefix.headers["content-type"].startswith("application/problem+json")
    bad_id = httpx.get(f"{served.url}/v1/events", headers={"Last-Event-ID": "x"}, timeout=5)
    assert bad_id.status_code in (400, 422)


def test_rejected_stale_writes_from_the_servers_stores(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    store = fenced.open_store(url)
    name = uuid.uuid4().hex
    with ServedCoordinator(f"memory://{name}", poll=2.0, stores={"files": url}) as served:
        coordinator = fenced.connect(served.url)
        try:
            old = coordinator.acquire("jobs/w", 30, 0, holder="old")
            coordinator.release(old)
            new = coordinator.acquire("jobs/w", 30, 0, holder="new")
            store.fence(new.token)
            with pytest.raises(fenced.StaleToken):
                store.put(old.token, "k", b"late")
            listener = Listener(f"{served.url}/v1/events?prefix=jobs/").start()
            events = listener.wait_for(lambda events: any(e.kind == "rejected" for e in events))
            (rejected,) = [e for e in events if e.kind == "rejected"]
            assert rejected.id is None
            assert rejected.data["store"] == "files"
            assert rejected.data["resource"] == "jobs/w" and rejected.data["epoch"] == 1
        finally:
            coordinator.close()
            store.close()


class ReadJobs:
    """A stand-in for a keys file: ``Bearer k`` may read ``jobs/``, nothing else."""

    def check(self, authorization: str | None, role: Role, name: str | None) -> None:
        if authorization != "Bearer k":
            raise fenced.NotAuthenticated("an API key is needed")
        if role != "read" or name is None or not name.startswith("jobs/"):
            raise fenced.AccessDenied("not this key")


def test_the_stream_needs_read_on_its_prefix(served: ServedCoordinator) -> None:
    served.app.state.fenced.authority = ReadJobs()
    url = f"{served.url}/v1/events"
    assert httpx.get(url + "?prefix=jobs/", timeout=5).status_code == 401
    denied = httpx.get(url, headers={"Authorization": "Bearer k"}, timeout=5)
    assert denied.status_code == 403
    assert denied.headers["content-type"].startswith("application/problem+json")
    allowed = Listener(url + "?prefix=jobs/", {"Authorization": "Bearer k"}).start()
    allowed.wait_for(lambda events: any(e.kind == "ready" for e in events))
    assert allowed.status == 200
