"""etcd's gRPC API for the etcd backend's requests (``grpcio``), with the gateway's JSON shapes.

:class:`GrpcTransport` is a :class:`~fenced.coordinator.backends.etcd._client.Transport` whose
single requests (range, txn, put, lease grant/revoke/keep-alive/time-to-live, status) go to
etcd's gRPC API instead of its JSON gateway (a gRPC client inside each member that re-encodes
every request and reply; see ``docs/etcd.md``, "Client"), and so do watches (:meth:`open_stream`:
etcd's ``Watch`` stream, one per watch, multiplexed on the endpoint's one HTTP/2 connection):
one transport, one TLS setup and one login for everything. Failover between endpoints, the time
budget, the login and the errors are the inherited ones. :meth:`~Transport.call` takes and
returns the gateway's JSON (bytes as base64, 64-bit integers as strings, enums by name:
:mod:`.messages`);
:meth:`~Transport.call_message` returns etcd's reply message as it came, and both accept
messages inside the body or a body that is the request message (the backend sends its
transactions as ``TxnRequest`` messages).

Failure classification (per attempt at one endpoint)::

    what happened                                         mutating request    read
    ----------------------------------------------------  ------------------  --------------
    no connection within connect_timeout (never sent)     next endpoint       next endpoint
    gRPC: "failed to connect to all addresses" (the call  next endpoint       next endpoint
      was refused by the channel, never sent)
    etcd: no leader / too many requests / not capable     next endpoint       next endpoint
    etcd: lease not found, compacted, invalid argument    EtcdRejected        EtcdRejected
    any other failure once the call was started: dead-    MaybeApplied        next endpoint
      line, connection lost, cancelled, a bad reply

A call is started only on a channel that has connected; a new channel is first connected within
``connect_timeout``, so a member that is down or cut off costs a :class:`NotApplied` and the next
endpoint, not an unknown outcome. (A connected channel whose connection the member closed while
idle reconnects by itself; if it cannot, grpc refuses the call before sending it.) After a
failure that was not etcd's own answer, and after a connect timeout, the endpoint's channel is
replaced (the old one is closed once calls still running on it have had their time): a
connection that stopped answering is not used again, as the HTTP client never reuses a
connection whose reply was lost. Each channel has
subchannels of its own (``grpc.use_local_subchannel_pool``), so a replacement really reconnects.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf.message import Message

from fenced.coordinator.backends.etcd._client import (
    EtcdError,
    Json,
    NotApplied,
    OpenStream,
    Transport,
    _classify,
    _Endpoint,
)
from fenced.coordinator.backends.etcd._messages import METHODS, to_json, to_message
from fenced.coordinator.backends.etcd._security import Tls

__all__ = [
    "GrpcTransport",
    "call_metadata",
    "channel_options",
    "encode_request",
    "multicallable",
    "rpc_failure",
]

_METADATA = (("hasleader", "true"),)  # etcd's "require leader" (the gateway's Grpc-Metadata-)
_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),  # a replaced channel makes a connection of its own
    ("grpc.enable_http_proxy", 0),  # the endpoints are connected to directly, as over HTTP
    ("grpc.max_receive_message_length", -1),  # etcd bounds its replies itself
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),  # a restarted member is found again within 1 s
]
_NOT_SENT = "failed to connect to all addresses"  # the channel refused the call: never sent
_ETCD_ANSWERS = ("etcdserver:", "mvcc:", "auth:")  # how etcd's own errors begin


# -- what the sync and the asyncio transports share ----------------------------------------------


def channel_options(tls: Tls | None) -> list[tuple[str, Any]]:
    """The options of a channel to one endpoint (``grpc.Channel`` or ``grpc.aio.Channel``)."""
    options: list[tuple[str, Any]] = list(_OPTIONS)
    if tls is not None and tls.server_name:  # check the certificate against this name
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def multicallable(channel: Any, path: str) -> Any:
    """The call object of etcd's method for ``path`` (:data:`~._messages.METHODS`) on
    ``channel``, sync or asyncio: etcd's messages serialized as they are."""
    method, request, reply, streaming = METHODS[path]
    make = channel.stream_stream if streaming else channel.unary_unary
    return make(
        method,
        request_serializer=request.SerializeToString,
        response_deserializer=reply.FromString,
    )


def encode_request(path: str, body: Json | Message) -> Message:
    """``body`` (the gateway's JSON, or a message) as etcd's request message for ``path``."""
    method = METHODS.get(path)
    if method is None:
        raise ValueError(f"etcd: no gRPC method for {path!r}")
    return to_message(method[1], body)


def call_metadata(token: str | None, path: str = "") -> tuple[tuple[str, str], ...]:
    """A call's metadata: etcd's "require leader" flag, and the auth token if there is one."""
    if token is None or path == "auth/authenticate":
        return _METADATA
    return (*_METADATA, ("token", token))


def rpc_failure(endpoint: object, error: Any, mutating: bool) -> tuple[EtcdError, bool]:
    """What a failed gRPC call (``grpc.RpcError``, or grpc.aio's ``AioRpcError``) means (the
    module docstring's table), and whether the channel must be replaced (the connection
    failed, not etcd)."""
    status = error.code()
    details = str(error.details() or status.name)
    retire = False
    if not details.startswith(_ETCD_ANSWERS):  # the connection failed, not etcd
        retire = True
        if _NOT_SENT in details:
            return NotApplied(f"{endpoint}: {details}", status.value[0]), retire
        details = f"{endpoint}: reply lost: {status.name}: {details}"
    return _classify(int(status.value[0]), details, mutating), retire


# -- transport ------------------------------------------------------------------------------------


class _Channel:
    """One gRPC channel to one endpoint, whether it has connected yet, its call objects.

    (No connectivity subscription: grpc's polling thread would then notice a request to connect
    only at its next 0.2 s tick.)"""

    def __init__(self, endpoint: _Endpoint, tls: Tls | None, credentials: Any) -> None:
        options = channel_options(tls)
        if tls is None:
            self.channel = grpc.insecure_channel(str(endpoint), options=options)
        else:
            self.channel = grpc.secure_channel(str(endpoint), credentials, options=options)
        self.connected = False
        self.calls: dict[str, Callable[..., Any]] = {}

    def method(self, path: str) -> Callable[..., Any]:
        call = self.calls.get(path)
        if call is None:
            call = self.calls[path] = multicallable(self.channel, path)
        return call

    def close(self) -> None:
        self.channel.close()


class GrpcTransport(Transport):
    """Single requests over etcd's gRPC API, watches over its gateway (module docstring).

    Thread-safe; one channel (one HTTP/2 connection) per endpoint carries every request of the
    process to it. After :meth:`close`, calls raise :class:`NotApplied` at once and calls still
    running are cancelled.
    """

    def __init__(self, endpoints: list[tuple[str, int]], **settings: Any) -> None:
        super().__init__(endpoints, **settings)
        self._credentials = None if self.tls is None else self.tls.grpc_credentials()
        self._channels: dict[_Endpoint, _Channel] = {}
        self._retired: set[_Channel] = set()

    def _channel(self, endpoint: _Endpoint) -> _Channel:
        with self._lock:
            if self._closed:
                raise NotApplied("the client is closed")
            channel = self._channels.get(endpoint)
            if channel is None:
                channel = self._channels[endpoint] = _Channel(endpoint, self.tls, self._credentials)
            return channel

    def _retire(self, endpoint: _Endpoint, channel: _Channel) -> None:
        """Stop using ``channel``; close it once calls running on it have had their time."""
        with self._lock:
            if self._channels.get(endpoint) is not channel:
                return
            del self._channels[endpoint]
            self._retired.add(channel)
        timer = threading.Timer(self.timeout, self._close_retired, (channel,))
        timer.daemon = True
        timer.start()

    def _close_retired(self, channel: _Channel) -> None:
        with self._lock:
            self._retired.discard(channel)
        channel.close()

    def close(self) -> None:
        """Refuse new calls, cancel running ones, close the channels and the watch streams."""
        super().close()
        with self._lock:
            channels = [*self._channels.values(), *self._retired]
            self._channels.clear()
            self._retired.clear()
        for channel in channels:
            channel.close()

    def _encode(self, path: str, body: Json | Message) -> Any:
        return encode_request(path, body)

    def _connected(self, endpoint: _Endpoint, timeout: float) -> _Channel:
        """The endpoint's channel, connected within ``connect_timeout`` (else NotApplied, or
        :class:`Refused` when TLS is why)."""
        channel = self._channel(endpoint)
        if not channel.connected:  # connect first: a call must not wait for a connection
            wait = min(timeout, self.connect_timeout)
            ready = grpc.channel_ready_future(channel.channel)
            try:
                ready.result(timeout=wait)
            except grpc.FutureTimeoutError as error:
                ready.cancel()
                self._retire(endpoint, channel)  # the next attempt connects afresh
                refused = self._tls_refused(endpoint, wait)
                if refused is not None:
                    raise refused from error
                raise NotApplied(f"cannot connect within {wait:g}s") from error
            channel.connected = True
        return channel

    def _metadata(self, path: str = "") -> tuple[tuple[str, str], ...]:
        return call_metadata(self._token, path)

    def _once(
        self, endpoint: _Endpoint, path: str, data: Any, timeout: float, mutating: bool
    ) -> Message:
        channel = self._connected(endpoint, timeout)
        call = channel.method(path)
        metadata = self._metadata(path)
        try:
            if METHODS[path][3]:
                replies = call(iter((data,)), timeout=timeout, metadata=metadata)
                try:
                    reply = next(replies, None)
                finally:
                    replies.cancel()
                if reply is None:
                    raise _classify(0, f"{endpoint}: the stream ended without a reply", mutating)
            else:
                reply = call(data, timeout=timeout, metadata=metadata, wait_for_ready=False)
        except grpc.RpcError as error:
            raise self._failed(endpoint, channel, error, mutating) from error
        self._prefer(endpoint)
        message: Message = reply
        return message

    def _reply_json(self, reply: Any) -> Json:
        return to_json(reply)

    def _reply_message(self, path: str, reply: Any) -> Message:
        del path
        result: Message = reply
        return result

    def _failed(
        self, endpoint: _Endpoint, channel: _Channel, error: grpc.RpcError, mutating: bool
    ) -> EtcdError:
        failure, retire = rpc_failure(endpoint, error, mutating)
        if retire:
            self._retire(endpoint, channel)
        return failure

    def open_stream(self, path: str, body: Json, timeout: float) -> OpenStream:
        """Start etcd's ``Watch`` stream with ``body`` (a ``WatchRequest`` as the gateway's JSON)
        on the first endpoint whose channel connects within ``timeout``; its replies come as
        the gateway's JSON (``{"result": …}``), so :class:`WatchStream` reads either transport.
        Raises :class:`NotApplied` if no endpoint connects (:class:`Refused` for TLS)."""
        request = to_message(METHODS[path][1], body)
        last = "no endpoint"
        for endpoint, deadline in self._stream_endpoints(timeout):
            try:
                channel = self._connected(endpoint, deadline - time.monotonic())
            except NotApplied as error:
                last = f"{endpoint}: {error}"
                self._mark_down(endpoint)
                continue
            return self._adopt(
                _GrpcStream(
                    channel.method(path), request, self._token, self._metadata(), self._forget
                )
            )
        raise NotApplied(f"cannot open a stream: {last}")


class _GrpcStream:
    """One ``Watch`` call: its request side stays open (etcd ends a watch whose client closed
    its half) until :meth:`close`; :meth:`messages` yields each reply as the gateway's JSON and
    raises ``grpc.RpcError`` when the stream breaks or :meth:`shutdown` cancels it."""

    def __init__(
        self,
        method: Callable[..., Any],
        request: Message,
        token: str | None,
        metadata: tuple[tuple[str, str], ...],
        on_close: Callable[[OpenStream], None],
    ) -> None:
        self.token = token
        self._done = threading.Event()
        self._on_close = on_close
        self._call = method(self._requests(request), metadata=metadata)

    def _requests(self, request: Message) -> Iterator[Message]:
        yield request
        self._done.wait()

    def messages(self) -> Iterator[Json]:
        for reply in self._call:
            yield {"result": to_json(reply)}

    def shutdown(self) -> None:
        self._call.cancel()

    def close(self) -> None:
        self._done.set()
        self._call.cancel()
        self._on_close(self)
