"""The ZooKeeper coordinator, sync face: ``fenced.connect("zk://host:port[,…][/chroot]")``.

Every step is a plan of :mod:`._plans` (the decisions, written once for both faces) run here
with blocking waits on kazoo's asynchronous results, each bounded by the URL's ``timeout``.
Waiting (:meth:`ZooKeeperBackend.wait`) watches one znode — the waiter's predecessor in the
queue, or the lease when the waiter is first — so a release or an expiry wakes exactly one
waiter (no herd). :meth:`~ZooKeeperBackend.watch` watches the records' directory.

The client's connection states (kazoo's) and the lease states: while kazoo is SUSPENDED
(connection lost, session maybe alive) every step raises :class:`~fenced.Unavailable` at once,
so the holder's renewals fail and its lease is UNCERTAIN; when the session is LOST, ZooKeeper
has deleted its ephemeral znodes — its leases and its places in queues — and the next renewal
raises :class:`~fenced.LeaseLost`. After a reconnection, a renewal re-reads what it must: its
transaction checks that the resource's counter is at the version of the grant (no grant since)
and the lease znode at the version of the last renewal (the same znode, of the same owner);
when either differs it reads both and renews only a lease of its epoch and owner that has not
expired by the leader's clock. See docs/zookeeper.md.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.states import KazooState

from fenced.coordinator.backend import (
    CAP_RECORDS,
    CAP_REQUEST_ID,
    CAP_WAIT_NOTIFY,
    Blocked,
    Granted,
    GrantRequest,
    Ticket,
    owned_ticket,
)
from fenced.coordinator.backends.zookeeper import _plans as plans
from fenced.coordinator.backends.zookeeper._driver import (
    KICK_EVERY,
    answer,
    connected,
    kick,
    new_client,
    submit,
    translate,
)
from fenced.coordinator.backends.zookeeper._layout import Paths
from fenced.coordinator.backends.zookeeper._settings import parse_zk_url
from fenced.coordinator.backends.zookeeper._steps import Plan, Request, SharedState
from fenced.core._errors import FencedError, Unavailable
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind
from fenced.core._urls import redacted

__all__ = ["ZooKeeperBackend"]

T = TypeVar("T")


class ZooKeeperBackend:
    """The coordinator backend on a ZooKeeper ensemble (see the module docstring)."""

    capabilities = frozenset({CAP_WAIT_NOTIFY, CAP_REQUEST_ID, CAP_RECORDS})

    def __init__(self, url: str, *, create: bool = True) -> None:
        self._settings = settings = parse_zk_url(url)
        self.url = settings.display()
        self._timeout = settings.timeout
        self._client = new_client(settings)
        self._changed = threading.Condition()
        self._busy: set[str] = set()  # background runs in flight (see _in_background)
        self._client.add_listener(self._on_state)
        try:
            self._client.start(timeout=settings.connect_timeout)
        except KazooTimeoutError as error:
            self._stop()
            raise Unavailable(
                f"ZooKeeper: no session with {redacted(url)} within {settings.connect_timeout:g} s"
            ) from error
        self._state = SharedState(Paths(settings.chroot))
        connected(self._client, self._state)
        try:
            self._run(plans.open_state(self._state, create, self.url))
        except BaseException:
            self._stop()
            raise
        self.coordinator_id = self._state.coordinator_id

    def __repr__(self) -> str:
        return f"ZooKeeperBackend({self.url!r})"

    def _on_state(self, state: str) -> bool:
        """kazoo's connection listener (its thread): wake every waiter; a LOST session took
        its ephemeral znodes (places in line) with it, and what this client knew of its leases
        is read afresh."""
        if not hasattr(self, "_state"):
            pass
        elif state == KazooState.LOST:
            self._state.held.clear()
        elif state == KazooState.CONNECTED:
            connected(self._client, self._state)
            if self._state.lost_places:  # not on kazoo's thread: the sweep waits for replies
                self._in_background("sweep", plans.sweep)
        with self._changed:
            self._changed.notify_all()
        return False

    def _in_background(self, name: str, plan: Callable[[SharedState], Plan[None]]) -> None:
        """Run ``plan`` on a short-lived thread of its own (at most one of each ``name``);
        its failures are left for a later run."""
        with self._changed:
            if name in self._busy:
                return
            self._busy.add(name)

        def run() -> None:
            try:
                with contextlib.suppress(FencedError):
                    self._run(plan(self._state), sweep=False)
            finally:
                with self._changed:
                    self._busy.discard(name)

        threading.Thread(target=run, name=f"fenced-zk-{name}", daemon=True).start()

    def _run(self, plan: Plan[T], sweep: bool = True) -> T:
        """Run ``plan`` to its end, each request waited for at most the URL's timeout (places
        left behind in queues are swept first)."""
        if sweep and self._state.lost_places:
            with contextlib.suppress(FencedError):
                self._run(plans.sweep(self._state), sweep=False)
        try:
            request = next(plan)
            while True:
                try:
                    reply = self._answer(request)
                except FencedError as error:
                    request = plan.throw(error)
                else:
                    request = plan.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        finally:
            plan.close()
            if self._state.prune_due:
                self._in_background("prune", plans.prune)

    def _answer(self, request: Request) -> object:
        pending = submit(self._client, self._state, request)
        deadline = time.monotonic() + self._timeout
        for result in pending:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    result.wait(min(left, KICK_EVERY))
                except Exception as error:
                    raise translate(request, error) from error
                if result.ready():
                    break
                kick(self._client, self._state)
            if not result.ready():
                raise translate(request, KazooTimeoutError())
        return answer(request, pending, self._state)

    def _notify(self, _event: object) -> None:
        with self._changed:
            self._changed.notify_all()

    def _wait_for(self, path: str, timeout: float, children: bool = False) -> bool:
        """Until ``path`` changes (is deleted; for ``children``: gains or loses a child), the
        connection changes, or ``timeout`` passes. True when the znode's watch fired (or it
        was gone already)."""
        fired = threading.Event()

        def fire(_event: object) -> None:
            fired.set()
            self._notify(None)

        try:
            if children:
                self._client.get_children_async(path, watch=fire).get(timeout=self._timeout)
            elif self._client.exists_async(path, watch=fire).get(timeout=self._timeout) is None:
                return True
        except Exception:  # not connected: wait for the connection to change
            fired.clear()
        with self._changed:
            self._changed.wait_for(fired.is_set, timeout=max(0.0, timeout))
        return fired.is_set()

    # -- the contract ---------------------------------------------------------------------

    def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        mine = owned_ticket(self, ticket, request.resource, plans.ZkTicket)
        return self._run(plans.try_grant(self._state, request, mine, self))

    def enqueue(self, request: GrantRequest) -> Ticket:
        return self._run(plans.enqueue(self._state, request, self))

    def wait(self, ticket: Ticket, timeout: float) -> None:
        """Until the ticket may be granted (its predecessor is gone and, when first, the lease
        is deleted or due to expire), the connection changes, or ``timeout`` passes. A waiter
        whose predecessor leaves watches its new predecessor, or the lease, without returning:
        only the head of the queue is woken by a release."""
        mine = owned_ticket(self, ticket, ticket.resource, plans.ZkTicket)
        assert mine is not None
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                wake = self._run(plans.wake_path(self._state, mine))
            except Unavailable:
                with self._changed:
                    self._changed.wait(timeout=min(left, 0.25))
                return
            if wake is None:
                return
            path, due = wake
            fired = self._wait_for(path, left if due is None else min(left, due))
            if path == self._state.paths.lease(mine.resource):
                mine.head_woken = fired  # deleted: the next try_grant tries the handoff
                return  # the lease is gone (or due): try at once
            if not fired:
                return

    def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        """Delete the waiter's znode. Nothing is handed to a waiter here: always None."""
        mine = owned_ticket(self, ticket, ticket.resource, plans.ZkTicket)
        assert mine is not None
        self._run(plans.leave(self._state, mine))
        return None

    def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        return self._run(plans.renew(self._state, resource, epoch, owner, ttl))

    def release(self, resource: str, epoch: int, owner: str) -> bool:
        return self._run(plans.release(self._state, resource, epoch, owner))

    def current(self, resource: str) -> LeaseInfo | None:
        return self._run(plans.current(self._state, resource))

    def last_epoch(self, resource: str) -> int:
        return self._run(plans.last_epoch(self._state, resource))

    def resources(self) -> list[str]:
        return self._run(plans.resources(self._state))

    def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        self._run(plans.proclaim(self._state, resource, epoch, owner, value))

    def records(self, resource: str | None, after: int = 0, limit: int = 1000) -> list[Record]:
        return self._run(plans.records(self._state, resource, after, limit))

    def report(
        self,
        resource: str,
        epoch: int,
        holder: str,
        kind: RecordKind,
        detail: dict[str, object],
    ) -> None:
        self._run(plans.report(self._state, resource, epoch, holder, kind, detail))

    def watch(self, resource: str, after: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            newest, due = self._run(plans.newest_seq(self._state, resource))
            left = deadline - time.monotonic()
            if newest > after or left <= 0:
                return
            self._wait_for(
                self._state.paths.log, left if due is None else min(left, due + 0.01), True
            )

    def advance(self, minimum: int, floors: dict[str, int], detail: dict[str, object]) -> int:
        return self._run(plans.advance(self._state, minimum, floors, detail))

    def close(self) -> None:
        self._stop()

    def _stop(self) -> None:
        try:
            self._client.stop()
            self._client.close()
        except Exception:  # noqa: S110 - closing is best effort
            pass
