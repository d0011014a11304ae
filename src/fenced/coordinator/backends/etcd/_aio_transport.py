"""etcd's gRPC API for the asyncio face (``grpc.aio``): :class:`AsyncTransport`.

The same requests, the same failover and the same error classes as the sync
:class:`~._grpc_transport.GrpcTransport`, awaited: both are a :class:`~._client.Cluster` (the
endpoints and their order, the schedule of attempts within one call's budget, the login, what
an etcd rejection means), call etcd's methods with the same serializers
(:func:`~._grpc_transport.multicallable`), send the same metadata
(:func:`~._grpc_transport.call_metadata`: "require leader", the token) and classify a failed
call the same way (:func:`~._grpc_transport.rpc_failure`). Only the waiting differs: a call
suspends the calling task, never a thread.

Failure classification: see :mod:`._grpc_transport` (a call starts only on a channel that
connected within ``connect_timeout``, so a member that is down costs :class:`NotApplied` and the
next endpoint, not an unknown outcome; once started, a lost reply of a mutating request is
:class:`MaybeApplied`). A channel that failed is replaced; the old one is closed by
:meth:`AsyncTransport.sweep` once calls still running on it have had their time. When a
channel cannot connect over TLS, :func:`~._security.diagnose` (the sync probe, run in a
short-lived daemon thread so that the loop does not block) names the cause: :class:`Refused`.

Threads: grpc.aio runs one daemon polling thread per process; this module starts none but that
probe. After :meth:`AsyncTransport.aclose`, calls raise :class:`NotApplied` at once and calls
still running are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from fenced.coordinator.backends.etcd._client import (
    Cluster,
    EtcdError,
    EtcdRejected,
    Json,
    NotApplied,
    _classify,
    _Endpoint,
)
from fenced.coordinator.backends.etcd._grpc_transport import (
    call_metadata,
    channel_options,
    encode_request,
    multicallable,
    rpc_failure,
)
from fenced.coordinator.backends.etcd._messages import METHODS, to_json
from fenced.coordinator.backends.etcd._security import Login, Tls

__all__ = ["AsyncTransport", "cancelling", "in_thread"]

log = logging.getLogger("fenced.coordinator.etcd")

_T = TypeVar("_T")


async def in_thread(function: Callable[..., _T], *args: Any) -> _T:
    """``function(*args)`` in a daemon thread of its own, awaited (for the rare blocking call,
    such as the TLS probe: the loop goes on, and no executor thread outlives it)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()

    def settle(result: _T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result = function(*args)
        except BaseException as error:  # handed to the awaiting task
            outcome: tuple[_T | None, BaseException | None] = (None, error)
        else:
            outcome = (result, None)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name="fenced-etcd-probe", daemon=True).start()
    return await future


class _Channel:
    """One ``grpc.aio`` channel to one endpoint, whether it has connected, its call objects."""

    def __init__(self, endpoint: _Endpoint, tls: Tls | None, credentials: Any) -> None:
        options = channel_options(tls)
        if tls is None:
            self.channel = grpc.aio.insecure_channel(str(endpoint), options=options)
        else:
            self.channel = grpc.aio.secure_channel(str(endpoint), credentials, options=options)
        self.connected = False
        self.calls: dict[str, Any] = {}

    def method(self, path: str) -> Any:
        call = self.calls.get(path)
        if call is None:
            call = self.calls[path] = multicallable(self.channel, path)
        return call

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.channel.close()


class AsyncTransport(Cluster):
    """Requests over etcd's gRPC API with ``grpc.aio``, and its ``Watch`` streams (module
    docstring). Use it from one event loop; one channel (one HTTP/2 connection) per endpoint
    carries every request and the watch stream to it."""

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        *,
        timeout: float,
        connect_timeout: float,
        tls: Tls | None = None,
        login: Login | None = None,
    ) -> None:
        super().__init__(
            endpoints, timeout=timeout, connect_timeout=connect_timeout, tls=tls, login=login
        )
        self._credentials = None if tls is None else tls.grpc_credentials()
        self._channels: dict[_Endpoint, _Channel] = {}
        self._retired: dict[_Channel, float] = {}  # channel: when to close it
        self._token_lock = asyncio.Lock()  # one Authenticate at a time
        self._metadatas: dict[tuple[str | None, bool], grpc.aio.Metadata] = {}

    # -- channels -------------------------------------------------------------------------
    def _channel(self, endpoint: _Endpoint) -> _Channel:
        if self._closed:
            raise NotApplied("the client is closed")
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self._channels[endpoint] = _Channel(endpoint, self.tls, self._credentials)
        return channel

    def _retire(self, endpoint: _Endpoint, channel: _Channel) -> None:
        """Stop using ``channel``; :meth:`sweep` closes it once calls on it had their time."""
        if self._channels.get(endpoint) is channel:
            del self._channels[endpoint]
            self._retired[channel] = time.monotonic() + self.timeout

    async def sweep(self) -> None:
        """Close the retired channels whose calls have had their time (called by the
        backend's keeper task)."""
        now = time.monotonic()
        due = [channel for channel, at in self._retired.items() if at <= now]
        for channel in due:
            del self._retired[channel]
            await channel.close()

    async def _connected(self, endpoint: _Endpoint, timeout: float) -> _Channel:
        """The endpoint's channel, connected within ``connect_timeout`` (else NotApplied, or
        :class:`~._client.Refused` when TLS is why)."""
        channel = self._channel(endpoint)
        if not channel.connected:  # connect first: a call must not wait for a connection
            wait = min(timeout, self.connect_timeout)
            try:
                async with asyncio.timeout(max(wait, 0.0)):
                    await channel.channel.channel_ready()
            except TimeoutError as error:
                self._retire(endpoint, channel)  # the next attempt connects afresh
                refused = await in_thread(self._tls_refused, endpoint, wait)
                if refused is not None:
                    raise refused from error
                raise NotApplied(f"cannot connect within {wait:g}s") from error
            channel.connected = True
        return channel

    async def aclose(self) -> None:
        """Refuse new calls, cancel running ones and close every channel; idempotent."""
        self._closed = True
        channels = [*self._channels.values(), *self._retired]
        self._channels.clear()
        self._retired.clear()
        for channel in channels:
            await channel.close()

    # -- requests -------------------------------------------------------------------------
    async def call(
        self, path: str, body: Json | Message, *, mutating: bool, timeout: float | None = None
    ) -> Json:
        """Send ``body`` to etcd's method for ``path``; the reply as the gateway's JSON (what
        the sync transport's ``call`` returns)."""
        return to_json(await self._attempts(path, body, mutating, timeout))

    async def call_message(
        self, path: str, body: Json | Message, *, mutating: bool, timeout: float | None = None
    ) -> Message:
        """:meth:`call`, with the reply as etcd's message."""
        return await self._attempts(path, body, mutating, timeout)

    async def _attempts(
        self, path: str, body: Json | Message, mutating: bool, timeout: float | None
    ) -> Message:
        """:meth:`_once` at one endpoint after another until one answers or the budget ends
        (:meth:`~._client.Cluster._attempt_order`)."""
        data = encode_request(path, body)
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        if self._login is not None and self._token is None:
            await self._authenticate(deadline)
        last: EtcdError | None = None
        for endpoint in self._attempt_order(deadline):
            if isinstance(endpoint, float):
                await asyncio.sleep(endpoint)
                continue
            try:
                return await self._with_token(endpoint, path, data, deadline, mutating)
            except NotApplied as error:
                last = NotApplied(f"{endpoint}: {error}", error.code)
                self._mark_down(endpoint)
            except EtcdRejected as error:
                refused = self._refused(error)
                if refused is error:
                    raise
                raise refused from error
        if last is None:
            last = NotApplied("no endpoint answered")
        raise NotApplied(f"etcd unavailable after {budget:g}s ({last})", last.code)

    async def _with_token(
        self, endpoint: _Endpoint, path: str, data: Message, deadline: float, mutating: bool
    ) -> Message:
        """:meth:`_once`; if etcd no longer takes the token, a new token and once more."""
        used = self._token
        try:
            return await self._once(endpoint, path, data, deadline - time.monotonic(), mutating)
        except EtcdRejected as error:
            if not self._token_stale(str(error)):
                raise
        log.info("etcd auth token no longer valid; authenticating again")
        await self._authenticate(deadline, stale=used)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NotApplied("the time budget ended while authenticating again")
        return await self._once(endpoint, path, data, remaining, mutating)

    async def _once(
        self, endpoint: _Endpoint, path: str, data: Message, timeout: float, mutating: bool
    ) -> Message:
        """One attempt at one endpoint: the reply, or the classified error."""
        channel = self._channels.get(endpoint)
        if channel is None or not channel.connected:
            channel = await self._connected(endpoint, timeout)
        call = channel.method(path)
        metadata = self._metadata(path)
        try:
            if METHODS[path][3]:  # a stream in etcd's API (keep-alive): one request, one reply
                stream = call(timeout=timeout, metadata=metadata)
                try:
                    await stream.write(data)
                    reply = await stream.read()
                finally:
                    stream.cancel()
                if reply is grpc.aio.EOF:
                    raise _classify(0, f"{endpoint}: the stream ended without a reply", mutating)
            else:
                reply = await call(data, timeout=timeout, metadata=metadata, wait_for_ready=False)
        except grpc.RpcError as error:
            failure, retire = rpc_failure(endpoint, error, mutating)
            if retire:
                self._retire(endpoint, channel)
            raise failure from error
        except asyncio.CancelledError:
            if cancelling():  # the caller's task is cancelled: the step happened or not
                raise
            self._retire(endpoint, channel)  # its channel was closed under the call
            raise _classify(
                0, f"{endpoint}: reply lost: the call was cancelled", mutating
            ) from None
        self._prefer(endpoint)
        message: Message = reply
        return message

    def _metadata(self, path: str) -> grpc.aio.Metadata:
        """:func:`~._grpc_transport.call_metadata` as grpc.aio's own type, made once per token
        (grpc.aio converts any other form on each call)."""
        key = (self._token, path == "auth/authenticate")
        metadata = self._metadatas.get(key)
        if metadata is None:
            if len(self._metadatas) > 4:  # tokens that were replaced
                self._metadatas.clear()
            pairs = call_metadata(self._token, path)
            metadata = self._metadatas[key] = grpc.aio.Metadata(*pairs)
        return metadata

    # -- authentication -------------------------------------------------------------------
    async def _authenticate(self, deadline: float, stale: str | None = None) -> None:
        """Get a token for the login (unless another task replaced ``stale`` meanwhile)."""
        if self._login is None:
            return
        async with self._token_lock:
            if self._token_current(stale):
                return
            data = encode_request("auth/authenticate", self._login_body())
            last: EtcdError = NotApplied("no endpoint answered")
            for endpoint in self._order():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    reply = await self._once(endpoint, "auth/authenticate", data, remaining, False)
                except NotApplied as error:
                    last = error
                    continue
                except EtcdRejected as error:
                    refused = self._refused(error)
                    if refused is error:
                        raise
                    raise refused from error
                self._took_token(str(to_json(reply).get("token", "")), stale)
                return
            raise NotApplied(f"authenticating as {self._login.user!r}: {last}", last.code)

    async def renew_token(self, used: str | None) -> None:
        """After a watch was refused with the token ``used``: get a new one (quietly: the
        watch's next attempt reports what still fails)."""
        if self._login is None:
            return
        with contextlib.suppress(EtcdError):
            await self._authenticate(time.monotonic() + self.timeout, stale=used)

    async def prefer_leader(self, timeout: float = 0.5) -> bool:
        """Send requests to the current etcd leader first (it saves the forwarding hop); True
        if the leader was found (see the sync transport's ``prefer_leader``)."""
        data = encode_request("maintenance/status", {})
        for endpoint in list(self._endpoints):
            try:
                status = to_json(
                    await self._once(endpoint, "maintenance/status", data, timeout, False)
                )
            except EtcdError:
                continue
            member = str(status.get("header", {}).get("member_id", ""))
            if member and member == str(status.get("leader", "")):
                self._prefer(endpoint)
                return True
        return False

    # -- streams --------------------------------------------------------------------------
    async def open_stream(self, path: str, timeout: float) -> tuple[Any, str | None, str]:
        """Start etcd's streaming method ``path`` (``watch``) on the first endpoint whose
        channel connects within ``timeout``: the call (write requests, read replies), the token
        it carries and the endpoint. Raises :class:`NotApplied` if none connects
        (:class:`~._client.Refused` for TLS)."""
        deadline = time.monotonic() + timeout
        if self._login is not None and self._token is None:
            await self._authenticate(deadline)
        last = "no endpoint"
        for endpoint in self._stream_order(deadline):
            try:
                channel = await self._connected(endpoint, deadline - time.monotonic())
            except NotApplied as error:
                last = f"{endpoint}: {error}"
                self._mark_down(endpoint)
                continue
            token = self._token
            call = channel.method(path)(metadata=call_metadata(token))
            return call, token, str(endpoint)
        raise NotApplied(f"cannot open a stream: {last}")


def cancelling() -> bool:
    """Is the current task being cancelled (else a ``CancelledError`` came from a gRPC call
    that was cancelled under it: its channel was closed)?"""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
