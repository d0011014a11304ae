"""The ``http(s)://`` client of ``fenced serve``: its URLs, its idle connections, and the time
it counts a lease from when the grant came back from a long poll."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

import fenced
from fenced.coordinator.backend import Granted, GrantRequest
from fenced.coordinator.backends.http._wire import parse_url
from fenced.server._leases import _grant
from fenced.server._state import ServerState
from fenced.testing.server import ServedCoordinator


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServedCoordinator]:
    with ServedCoordinator(f"sqlite:///{tmp_path / 'fenced.db'}", poll=5.0) as server:
        yield server


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://user:secret@h:1", "carries no credentials"),
        ("http://h:1?password=x", "unknown option 'password'"),
        ("http://h:notaport", "Port could not be cast"),
        ("http://h:1,", "a server address is empty"),
        ("http://h:1?timeout=0", "timeout must be a positive number"),
        ("http://h:1?ca=/x", "are for https:// URLs"),
        ("https://h:1?cert=/x", "cert= and key= go together"),
        ("ftp://h:1", "http\\(s\\)://host:port \\(fenced serve\\)"),
    ],
)
def test_a_bad_url_is_a_configuration_error_that_shows_no_secret(url: str, message: str) -> None:
    with pytest.raises(fenced.ConfigurationError, match=message) as caught:
        fenced.connect(url)
    assert "secret" not in str(caught.value)


def test_several_servers_and_a_prefix() -> None:
    settings = parse_url("https://a:1,[::1]:2/fenced?timeout=3")
    assert settings.bases == ("https://a:1/fenced", "https://[::1]:2/fenced")
    assert settings.options.timeout == 3.0


def test_a_lease_handed_to_a_long_poll_counts_from_no_later_than_its_grant(
    served: ServedCoordinator,
) -> None:
    """The waiter's local deadline is at most (when the grant happened) + ttl - margin: the
    time its poll spent waiting on the server does not lengthen the lease; and at least the
    release's time + ttl - margin less the reply's travel (it is not counted from the poll's
    send time either, which would waste the wait)."""
    holder, waiter = fenced.connect(served.url), fenced.connect(served.url)
    try:
        held = holder.acquire("jobs/handoff", ttl=30, wait=0)
        got: list[fenced.Lease] = []
        thread = threading.Thread(
            target=lambda: got.append(waiter.acquire("jobs/handoff", ttl=4, wait=10))
        )
        thread.start()
        time.sleep(1.0)  # the waiter's long poll has waited a second on the server
        released_at = time.monotonic()
        holder.release(held)
        thread.join(10)
        returned_at = time.monotonic()
        [lease] = got
        usable = lease.ttl * 0.9  # the default safety margin: 10 % of ttl
        assert lease.deadline <= returned_at + usable
        assert lease.deadline >= released_at + usable - 0.5
        waiter.release(lease)
    finally:
        holder.close()
        waiter.close()


def test_an_idle_connection_closed_by_the_server_is_not_a_lost_reply(
    tmp_path: Path,
) -> None:
    """The server closes idle connections after its keep-alive; the client notices before it
    reuses one and opens a new connection, so the next change succeeds (not OutcomeUnknown)."""
    served = ServedCoordinator(f"memory://{uuid.uuid4().hex}")
    served._server.config.timeout_keep_alive = 0.2  # type: ignore[assignment]  # (a float works)
    with served, fenced.connect(served.url) as coordinator:
        lease = coordinator.acquire("jobs/idle", ttl=5, wait=0)
        time.sleep(0.5)  # past the server's keep-alive: it closed the connection
        assert coordinator.release(lease)


def test_a_lease_handed_to_a_waiter_that_ended_before_it_was_taken_is_not_returned(
    served: ServedCoordinator,
) -> None:
    """Found by the release check: a waiter's long poll came back with the lease a release
    handed to it, and the waiter, paused, took it only after that lease had ended and a newer
    epoch had been granted. The client returned the old epoch (with no time left): a grant of
    an epoch older than one already granted. It now asks the server, which says the lease of
    that request id is lost, as an in-process backend does."""
    holder, other, waiter = (fenced.connect(served.url) for _ in range(3))
    try:
        held = holder.acquire("jobs/late-taker", ttl=30, wait=0)
        backend = waiter.backend
        request = GrantRequest("jobs/late-taker", 0.5, "owner-w", "w", uuid.uuid4().hex)
        ticket = backend.enqueue(request)
        holder.release(held)  # handed to the waiter's place
        backend.wait(ticket, 5.0)
        time.sleep(0.6)  # the waiter pauses past the handed lease's ttl
        newer = other.acquire("jobs/late-taker", ttl=5, wait=5)
        assert newer.epoch == held.epoch + 2
        with pytest.raises(fenced.LeaseLost):
            backend.try_grant(request, ticket)
        other.release(newer)
    finally:
        for client in (holder, other, waiter):
            client.close()


def test_the_time_a_poll_waited_ends_when_the_granting_backend_call_began() -> None:
    """``waited`` is what the client adds to its send time before counting ``expires_in``:
    it ends when the backend call that granted (and computed ``expires_in``) began, never when
    the reply is built (the release check saw the event loop resume a poll milliseconds after
    its grant, and the client's deadline came out past the lease's end)."""
    state = cast(ServerState, SimpleNamespace(backend=SimpleNamespace(coordinator_id="c" * 32)))
    granted = Granted(7, "owner", "w", 0.8, 0.79)
    body = _grant(state, "jobs/waited", granted, since=100.0, asked=101.25)
    assert (body.epoch, body.expires_in, body.waited) == (7, 0.79, 1.25)
    assert _grant(state, "jobs/waited", granted).waited == 0.0  # no poll: nothing waited
