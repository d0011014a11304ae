"""The kazoo side both faces share: the client, sending a plan's requests, error translation.

:func:`new_client` builds a :class:`~kazoo.client.KazooClient` that reconnects by itself
(forever, 50 ms to 1 s apart) and asks for the URL's session timeout. :func:`submit` sends one
request of a plan (:mod:`._steps`) without waiting and returns the kazoo asynchronous results
to wait for; :func:`answer` turns their outcome into the plan's answer, or raises:

* :class:`~fenced.Unavailable` — not connected (kazoo SUSPENDED or LOST: the request is not
  sent, never queued), or a read or tick that failed or took longer than the URL's ``timeout``;
* :class:`~fenced.OutcomeUnknown` — a transaction whose reply did not come (connection lost,
  session expired, timeout): it may have been applied;
* :class:`~fenced.ConfigurationError` — ZooKeeper refused for lack of permission (an ACL).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.interfaces import IAsyncResult
from kazoo.protocol.serialization import (
    CheckVersion,
    Create,
    Delete,
    SetData,
    Transaction,
)
from kazoo.protocol.states import KazooState
from kazoo.retry import KazooRetry
from kazoo.security import OPEN_ACL_UNSAFE

from fenced.coordinator.backends.zookeeper._settings import ZkSettings
from fenced.coordinator.backends.zookeeper._steps import (
    Batch,
    Children,
    Get,
    Multi,
    Request,
    SharedState,
    Sync,
    Tick,
)
from fenced.core._errors import ConfigurationError, OutcomeUnknown, Unavailable

__all__ = ["KICK_EVERY", "Pending", "answer", "connected", "kick", "new_client", "submit"]

_LOG = logging.getLogger("fenced.zookeeper")

Pending = list[IAsyncResult]

KICK_EVERY = 0.25
"""Seconds a request may go unanswered before the session sends a :func:`kick` (again every
this many seconds, until the answer or the URL's ``timeout``)."""


def new_client(settings: ZkSettings) -> KazooClient:
    """A client for the URL's ensemble (not started)."""
    client = KazooClient(
        hosts=settings.connect_string(),
        timeout=settings.session_timeout,
        connection_retry=KazooRetry(max_tries=-1, delay=0.05, backoff=1.5, max_delay=1.0),
        logger=_LOG,
    )
    return client


def connected(client: KazooClient, state: SharedState) -> None:
    """Note the session a (re)connection made: its id."""
    client_id = client.client_id
    state.session = int(client_id[0]) if client_id else 0


def _read(client: KazooClient, read: Get | Children | Sync) -> IAsyncResult:
    if isinstance(read, Get):
        return client.get_async(read.path)
    if isinstance(read, Sync):
        return client.sync_async(read.path)
    return client.get_children_async(read.path, include_data=True)


def submit(client: KazooClient, state: SharedState, request: Request) -> Pending:
    """Send ``request`` (see the module docstring); Unavailable when not connected."""
    if client.state != KazooState.CONNECTED:
        raise Unavailable(f"ZooKeeper: not connected ({client.state.lower()})")
    if isinstance(request, Get | Children | Sync):
        return [_read(client, request)]
    if isinstance(request, Batch):
        sent = [_read(client, read) for read in request.reads]
        if request.then is not None:
            sent.append(_commit(client, request.then))
        return sent
    if isinstance(request, Tick):
        return [client.set_async(state.paths.clock, b"", -1)]
    return [_commit(client, request)]


def kick(client: KazooClient, state: SharedState) -> None:
    """Send a read that changes nothing (``exists`` on the root, no watch, answer ignored), so
    that a member holding this session's earlier request answers it.

    ZooKeeper 3.6.0 to 3.8.0 (Debian 12 ships 3.8.0) can leave a request unanswered until the
    next request reaches the member (ZOOKEEPER-4537, a race in its commit processor, fixed in
    3.7.1 and 3.8.1). Without a kick the next request is the session's ping, a third of the
    session timeout later: fenced measured replies held 10 s about once a minute under
    steady load, each answered within a millisecond of a kick.
    """
    if client.state == KazooState.CONNECTED:
        client.exists_async(state.paths.root)


def _commit(client: KazooClient, multi: Multi) -> IAsyncResult:
    """Send ``multi`` as one ZooKeeper transaction. The operations are built as kazoo's
    ``TransactionRequest`` builds them, without its per-operation argument checks, chroot
    handling (fenced's paths are absolute: the client has no chroot) and logging."""
    operations: list[object] = []
    for op in multi.ops:
        kind = op[0]
        if kind == "create":
            flags = (1 if op[3] else 0) | (2 if op[4] else 0)
            operations.append(Create(op[1], op[2], OPEN_ACL_UNSAFE, flags))
        elif kind == "set":
            operations.append(SetData(op[1], op[2], op[3]))
        elif kind == "delete":
            operations.append(Delete(op[1], op[2]))
        else:
            operations.append(CheckVersion(op[1], op[2]))
    result = client.handler.async_result()
    client._call(Transaction(operations), result)
    return result


def _value(result: IAsyncResult) -> Any:
    """The result's value; NoNodeError as an instance (an answer, not an error)."""
    try:
        return result.get_nowait()
    except NoNodeError as missing:
        return missing


def answer(request: Request, pending: Sequence[IAsyncResult], state: SharedState) -> Any:
    """The plan's answer to ``request`` from its completed results (see the module docstring)."""
    try:
        values = [_value(result) for result in pending]
    except BaseException as error:
        raise translate(request, error) from error
    if isinstance(request, Batch):
        return values
    if isinstance(request, Tick):
        stat = values[0]
        if isinstance(stat, NoNodeError):
            raise Unavailable(f"ZooKeeper: {state.paths.clock} is missing")
        state.observe(stat.mtime)
        return stat.mtime
    return values[0]


def translate(request: Request, error: BaseException) -> Exception:
    """A kazoo failure of ``request`` as a fenced error."""
    if isinstance(error, NoAuthError):
        return ConfigurationError(
            "ZooKeeper refused for lack of permission (an ACL on the fenced chroot)"
        )
    what = "no reply" if isinstance(error, KazooTimeoutError) else type(error).__name__
    if isinstance(request, Multi) or (isinstance(request, Batch) and request.then is not None):
        return OutcomeUnknown(f"ZooKeeper: {what} to a transaction; it may have been applied")
    return Unavailable(f"ZooKeeper: {what}")
