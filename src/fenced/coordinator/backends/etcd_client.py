"""A synchronous client for etcd's v3 JSON gateway (``POST /v3/…``), for the etcd backend.

HTTP is httpx's (``httpx.HTTPTransport``: HTTP/1.1 keep-alive pooling, per-request timeouts,
streaming replies); what stays here is what etcd needs on top: endpoint failover within one time
budget, etcd's error answers, and the one distinction a lock service cannot do without — whether
a request that failed may have been applied. Why httpx and the gateway rather than a gRPC
client, and why httpx's transport API rather than ``httpx.Client``: see ``docs/etcd.md``
("Client").

Failure classification (per request)::

    what happened                                         mutating request    read
    ----------------------------------------------------  ------------------  --------------
    httpx.ConnectError, ConnectTimeout, PoolTimeout       next endpoint       next endpoint
    httpx.WriteError, WriteTimeout                        next endpoint       next endpoint
    any other httpx error before the body was sent whole  next endpoint       next endpoint
    etcd: no leader / too many requests / not capable     next endpoint       next endpoint
    etcd: lease not found, compacted, invalid argument    EtcdRejected        EtcdRejected
    httpx.ReadError, ReadTimeout, RemoteProtocolError     MaybeApplied        next endpoint
      (or any other error) after the body was sent whole
    a reply that is not etcd's JSON                       MaybeApplied        next endpoint

"Sent whole" is taken from httpcore's ``trace`` extension (``*.send_request_body.complete``:
every byte of the request was handed to the kernel), not from the exception class: httpcore
swallows a ``WriteError`` while sending and goes on to read a reply that the server may have
sent before closing, so a request cut halfway surfaces as a ``ReadError`` or
``RemoteProtocolError`` too. etcd's gateway decodes a request only once its whole JSON body has
arrived (the last byte is the closing brace), so a request not sent whole was not applied.

Every request carries ``Grpc-Metadata-hasleader: true`` (etcd's "require leader"): a member cut
off from the majority refuses at once with "no leader" instead of letting a proposal hang until
its own request timeout. :class:`NotApplied` is raised when every endpoint refused within the
time budget; callers translate it to :class:`~fenced.Unavailable`, :class:`MaybeApplied` to
:class:`~fenced.OutcomeUnknown`.

Connections: one ``httpx.HTTPTransport`` per :class:`Transport` for requests (keep-alive, pooled
per endpoint, thread-safe; httpcore discards a pooled connection that became readable while idle
— the server closed it or a member restarted — before reuse, so a stale connection does not turn
a request that never reached etcd into an unknown outcome), and one for watches: each
:class:`WatchStream` is one streaming ``/v3/watch`` reply on a connection of its own (etcd's
gateway is HTTP/1.1 and cannot multiplex watches). The endpoints of the URL are connected to
directly (no proxy from the environment).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from fenced.core.errors import ConfigurationError

try:
    import httpx
except ImportError as missing:  # connect()'s contract: a backend without its extra is refused
    raise ConfigurationError(
        f"the etcd backend needs httpx: pip install 'fenced[etcd]' ({missing})"
    ) from missing

__all__ = [
    "KV",
    "EtcdError",
    "EtcdRejected",
    "Event",
    "MaybeApplied",
    "NotApplied",
    "Stream",
    "Transport",
    "WatchStream",
    "b64",
    "unb64",
]

Json = dict[str, Any]
log = logging.getLogger("fenced.coordinator.etcd")

_RETRY_PAUSE = (0.02, 0.05, 0.1, 0.2)
_DOWN_FOR = 1.0  # seconds an endpoint that refused is tried last
# gRPC status codes etcd uses for definite rejections (nothing was applied, retrying won't help)
_DEFINITE = {3, 5, 7, 9, 11, 16}
_NOT_APPLIED_MESSAGES = (
    "no leader",
    "too many requests",
    "not capable",
    "proposal dropped",
    "leader changed",  # etcd 3.4 returns it for reads and lease requests, never after a proposal
    "unhealthy cluster",
)
_HEADERS = {"Content-Type": "application/json", "Grpc-Metadata-hasleader": "true"}
_SOCKET_OPTIONS = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]  # headers, body: two writes
_IDLE_KEPT = 16  # idle keep-alive connections kept for requests
# Plain http:// only (TLS is not supported yet, see docs/etcd.md). httpx gives every transport an
# SSL context; this one has no CA certificate, so it could never make a TLS connection that was
# not verified, and it spares loading certifi's bundle for every client (~50 ms).
_NO_TLS = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


class EtcdError(Exception):
    """Base of this module's errors. ``code`` is etcd's gRPC status code (0 if none)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class NotApplied(EtcdError):
    """The request did not take effect on any endpoint (not sent, or refused before applying)."""


class MaybeApplied(EtcdError):
    """A mutating request was sent and its reply was lost: it may or may not have taken effect."""


class EtcdRejected(EtcdError):
    """etcd answered with a definite error (lease not found, compacted, invalid, permission)."""


def b64(data: bytes | str) -> str:
    """The gateway's encoding of bytes fields."""
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


@dataclass(frozen=True, slots=True)
class KV:
    """One key-value pair as etcd returns it."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_json(cls, data: Json) -> KV:
        return cls(
            unb64(data.get("key")),
            unb64(data.get("value")),
            int(data.get("create_revision", 0)),
            int(data.get("mod_revision", 0)),
            int(data.get("version", 0)),
            int(data.get("lease", 0)),
        )


@dataclass(frozen=True, slots=True)
class Event:
    """One watch event: ``kind`` is ``"PUT"`` or ``"DELETE"``."""

    kind: str
    kv: KV


def _error_of(payload: Json) -> tuple[int, str]:
    error = payload.get("error")
    if isinstance(error, dict):  # the gateway's form for errors inside a stream
        return int(error.get("grpc_code", 0)), str(error.get("message", ""))
    return int(payload.get("code", 0)), str(payload.get("message") or error or "")


def _classify(code: int, message: str, mutating: bool) -> EtcdError:
    if any(marker in message for marker in _NOT_APPLIED_MESSAGES):
        return NotApplied(message, code)
    if code in _DEFINITE:
        return EtcdRejected(message, code)
    if mutating:
        return MaybeApplied(message, code)
    return NotApplied(message, code)


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _http(limits: httpx.Limits) -> httpx.HTTPTransport:
    return httpx.HTTPTransport(verify=_NO_TLS, limits=limits, socket_options=_SOCKET_OPTIONS)


class _Progress:
    """httpcore ``trace`` callback of one request: was its body sent whole?"""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = False

    def __call__(self, event: str, info: Mapping[str, Any]) -> None:
        if event.endswith(".send_request_body.complete"):
            self.sent = True


class _Endpoint:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.down_until = 0.0
        self._base = f"http://{self}/v3/"
        self._urls: dict[str, httpx.URL] = {}

    def url(self, path: str) -> httpx.URL:
        """``/v3/<path>`` on this endpoint, parsed once (httpx's URL parsing is not free)."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(self._base + path)
        return url

    def __str__(self) -> str:
        return f"{self.host}:{self.port}" if ":" not in self.host else f"[{self.host}]:{self.port}"


class Stream:
    """An open streaming reply of the gateway (a watch): its JSON messages as they arrive.

    Read it from one thread; :meth:`shutdown` may be called from any other one to make the
    reader's blocked read end (with an error or the end of the messages); the reader then
    :meth:`close`\\ s it.
    """

    def __init__(self, response: httpx.Response, on_close: Callable[[Stream], None]) -> None:
        self._response = response
        self._on_close = on_close

    def messages(self) -> Iterator[Json]:
        """The newline-separated JSON objects of the reply (httpx errors when it is cut)."""
        for line in self._response.iter_lines():
            if line.strip():
                message = json.loads(line)
                yield message if isinstance(message, dict) else {}

    def shutdown(self) -> None:
        network = self._response.extensions.get("network_stream")
        sock = network.get_extra_info("socket") if network is not None else None
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._response.close()
        self._on_close(self)


class Transport:
    """Requests to the JSON gateway of one etcd cluster, with failover between endpoints.

    ``timeout`` is the budget of one call, retries on other endpoints included;
    ``connect_timeout`` bounds one connection attempt. Thread-safe. After :meth:`close`, calls
    raise :class:`NotApplied` at once, open streams end, and the connections are closed as soon
    as no request is in flight (never under one: a socket closed while it connects would leak).
    """

    def __init__(
        self, endpoints: list[tuple[str, int]], *, timeout: float, connect_timeout: float
    ) -> None:
        if not endpoints:
            raise ValueError("at least one endpoint is needed")
        self._endpoints = [_Endpoint(host, port) for host, port in endpoints]
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._preferred = 0
        self._closed = False
        self._busy = 0  # requests in flight on the connection pools
        self._open: set[Stream] = set()
        self._http = _http(httpx.Limits(max_connections=None, max_keepalive_connections=_IDLE_KEPT))
        self._streams = _http(httpx.Limits(max_connections=None, max_keepalive_connections=0))

    @property
    def endpoints(self) -> list[str]:
        return [str(endpoint) for endpoint in self._endpoints]

    @property
    def closed(self) -> bool:
        return self._closed

    # -- endpoints ------------------------------------------------------------------------
    def _order(self) -> list[_Endpoint]:
        with self._lock:
            start = self._preferred
        count = len(self._endpoints)
        ordered = [self._endpoints[(start + i) % count] for i in range(count)]
        now = time.monotonic()
        return [e for e in ordered if e.down_until <= now] + [
            e for e in ordered if e.down_until > now
        ]

    def _prefer(self, endpoint: _Endpoint) -> None:
        with self._lock:
            self._preferred = self._endpoints.index(endpoint)
            endpoint.down_until = 0.0

    def _mark_down(self, endpoint: _Endpoint) -> None:
        with self._lock:
            endpoint.down_until = time.monotonic() + _DOWN_FOR
            if self._endpoints[self._preferred] is endpoint:
                self._preferred = (self._preferred + 1) % len(self._endpoints)

    # -- the connection pools -------------------------------------------------------------
    def _enter(self) -> None:
        with self._lock:
            if self._closed:
                raise NotApplied("the client is closed")
            self._busy += 1

    def _leave(self) -> None:
        with self._lock:
            self._busy -= 1
            last = self._closed and not self._busy
        if last:
            self._close_pools()

    def _close_pools(self) -> None:
        self._http.close()
        self._streams.close()

    def _forget(self, stream: Stream) -> None:
        with self._lock:
            self._open.discard(stream)

    def close(self) -> None:
        """Refuse new calls, end open streams, close the connections (see the class docstring)."""
        with self._lock:
            self._closed = True
            idle = not self._busy
            streams = list(self._open)
        for stream in streams:
            stream.shutdown()
        if idle:
            self._close_pools()

    # -- requests -------------------------------------------------------------------------
    def call(self, path: str, body: Json, *, mutating: bool, timeout: float | None = None) -> Json:
        """POST ``body`` to ``/v3/<path>``; the decoded reply (see the module docstring)."""
        data = json.dumps(body, separators=(",", ":")).encode()
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        last: EtcdError = NotApplied("no endpoint answered")
        for attempt in range(1_000_000):
            for endpoint in self._order():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                if self._closed:
                    raise NotApplied("the client is closed")
                try:
                    return self._once(endpoint, path, data, remaining, mutating)
                except NotApplied as error:
                    last = NotApplied(f"{endpoint}: {error}", error.code)
                    self._mark_down(endpoint)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(_RETRY_PAUSE[min(attempt, len(_RETRY_PAUSE) - 1)], remaining))
        raise NotApplied(f"etcd unavailable after {budget:g}s ({last})", last.code)

    def _request(
        self, endpoint: _Endpoint, path: str, data: bytes, timeout: float, **extensions: object
    ) -> httpx.Request:
        """A POST of ``data`` to ``/v3/<path>`` with its own limits (``timeout`` extension)."""
        timeouts = httpx.Timeout(timeout, connect=min(timeout, self.connect_timeout))
        return httpx.Request(
            "POST",
            endpoint.url(path),
            headers=_HEADERS,
            content=data,
            extensions={"timeout": timeouts.as_dict(), **extensions},
        )

    def _once(
        self, endpoint: _Endpoint, path: str, data: bytes, timeout: float, mutating: bool
    ) -> Json:
        progress = _Progress()
        request = self._request(endpoint, path, data, timeout, trace=progress)
        self._enter()
        try:
            response = self._http.handle_request(request)
            try:
                raw = response.read()
            finally:
                response.close()
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as error:
            raise NotApplied(f"cannot connect: {_describe(error)}") from error
        except httpx.RequestError as error:
            if not progress.sent:  # WriteError, WriteTimeout, or a read after a failed write
                raise NotApplied(f"request not sent whole: {_describe(error)}") from error
            if mutating:  # ReadError, ReadTimeout, RemoteProtocolError, … after sending
                raise MaybeApplied(f"{endpoint}: reply lost: {_describe(error)}") from error
            raise NotApplied(f"reply lost: {_describe(error)}") from error
        finally:
            self._leave()
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError as error:
            raise _classify(0, f"{endpoint}: unreadable reply: {raw[:200]!r}", mutating) from error
        if not isinstance(payload, dict):
            raise _classify(0, f"{endpoint}: unexpected reply: {raw[:200]!r}", mutating)
        if response.status_code != 200 or "error" in payload:
            code, message = _error_of(payload)
            raise _classify(code, message or f"HTTP {response.status_code}", mutating)
        self._prefer(endpoint)
        result = payload.get("result", payload)  # stream endpoints wrap their reply
        return result if isinstance(result, dict) else {}

    def prefer_leader(self, timeout: float = 0.5) -> bool:
        """Send requests to the current etcd leader first (it saves the forwarding hop).

        Asks each endpoint's ``maintenance/status``; True if the leader was found. Failover
        still moves to other endpoints when the leader stops answering.
        """
        for endpoint in list(self._endpoints):
            try:
                status = self._once(endpoint, "maintenance/status", b"{}", timeout, False)
            except EtcdError:
                continue
            member = str(status.get("header", {}).get("member_id", ""))
            if member and member == str(status.get("leader", "")):
                self._prefer(endpoint)
                return True
        return False

    def open_stream(self, path: str, body: Json, timeout: float) -> Stream:
        """POST a streaming request on a connection of its own; the reply, open for reading.

        Tries the endpoints in turn until one answers 200 within ``timeout`` (connecting,
        sending, and the reply's head: etcd's gateway sends it with the first message), else
        raises :class:`NotApplied`. Once open, the stream has no read timeout: a quiet watch is
        normal. (The read timeout is httpx's ``timeout`` request extension, which httpcore reads
        when the body is first read; ``tests/test_etcd_coordinator.py`` pins that an idle watch
        keeps its connection.)
        """
        data = json.dumps(body, separators=(",", ":")).encode()
        deadline = time.monotonic() + timeout
        last = "no endpoint"
        for endpoint in self._order():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            request = self._request(endpoint, path, data, remaining)
            self._enter()
            try:
                response = self._streams.handle_request(request)  # its body is read as it comes
            except httpx.RequestError as error:
                last = f"{endpoint}: {_describe(error)}"
                self._mark_down(endpoint)
                continue
            finally:
                self._leave()
            if response.status_code != 200:
                try:
                    last = f"{endpoint}: HTTP {response.status_code}: {response.read()[:200]!r}"
                except httpx.RequestError as error:
                    last = f"{endpoint}: HTTP {response.status_code}: {_describe(error)}"
                finally:
                    response.close()
                self._mark_down(endpoint)
                continue
            request.extensions["timeout"]["read"] = None
            stream = Stream(response, self._forget)
            with self._lock:
                if not self._closed:
                    self._open.add(stream)
                    return stream
            stream.close()
            raise NotApplied("the client is closed")
        raise NotApplied(f"cannot open a stream: {last}")


class WatchStream:
    """One etcd watch in a daemon thread, resumed after a broken connection.

    Watches ``[key, range_end)`` from ``start_revision``. ``on_events(events, revision)`` is
    called for every batch of events; ``on_trouble(reason)`` when the watch cannot go on
    exactly (``"compacted"``: the start revision was compacted away, the caller must re-read
    state; ``"down"``: no endpoint accepted the watch for a while — it keeps trying).
    After a broken connection it reconnects (any endpoint) and resumes from the revision after
    the last one it delivered: no event is skipped and none is delivered twice. It ends when
    stopped, after a compaction, or when its transport is closed.

    ``catch_up``: etcd serves a watch whose start revision is not in the future from its
    "unsynced" group, caught up every 100 ms. With ``catch_up`` given, the first watch starts at
    *the current revision* instead (synced at once), and once etcd confirms it at revision H,
    ``catch_up(H)`` is called to cover ``[start_revision, H]`` itself (typically one read at
    revision H); it returns False when that read found a change (``on_trouble("changed")``).
    """

    def __init__(
        self,
        transport: Transport,
        key: bytes,
        range_end: bytes | None,
        start_revision: int,
        on_events: Callable[[list[Event], int], None],
        on_trouble: Callable[[str], None],
        *,
        name: str = "watch",
        catch_up: Callable[[int], bool] | None = None,
    ) -> None:
        self._transport = transport
        self._catch_up = catch_up
        self._key = key
        self._range_end = range_end
        self.revision = start_revision
        """The next revision this watch will deliver."""
        self._on_events = on_events
        self._on_trouble = on_trouble
        self._stopped = threading.Event()
        self.created = threading.Event()
        self._lock = threading.Lock()
        self._stream: Stream | None = None
        self._thread = threading.Thread(target=self._run, name=f"fenced-etcd-{name}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return not self._stopped.is_set() and self._thread.is_alive()

    def stop(self) -> None:
        """Cancel the watch (its connection is closed by its thread); idempotent, does not wait."""
        self._stopped.set()
        with self._lock:  # the thread closes the stream under this lock: never a reused socket
            if self._stream is not None:
                self._stream.shutdown()

    def _run(self) -> None:
        failures = 0
        while not self._stopped.is_set() and not self._transport.closed:
            request: Json = {"key": b64(self._key)}
            if self._catch_up is None:
                request["start_revision"] = str(self.revision)
            if self._range_end is not None:
                request["range_end"] = b64(self._range_end)
            try:
                stream = self._transport.open_stream(
                    "watch", {"create_request": request}, self._transport.connect_timeout * 2
                )
            except NotApplied:
                failures += 1
                if failures == 3:
                    self._on_trouble("down")
                self._stopped.wait(_RETRY_PAUSE[min(failures, len(_RETRY_PAUSE) - 1)])
                continue
            with self._lock:
                if self._stopped.is_set():
                    stream.close()
                    return
                self._stream = stream
            try:
                if self._read(stream):
                    return
                failures = 0
            except Exception as error:  # a cut connection, or stop() shutting it down
                if self._stopped.is_set():
                    return
                log.debug("watch stream broken (%s); resuming at %d", error, self.revision)
                failures += 1
            finally:
                with self._lock:
                    self._stream = None
                    stream.close()
            if not self._stopped.is_set():
                self._stopped.wait(_RETRY_PAUSE[min(failures, len(_RETRY_PAUSE) - 1)])

    def _read(self, stream: Stream) -> bool:
        """Deliver messages until the stream ends; True when the watch must not be resumed."""
        for message in stream.messages():
            if self._stopped.is_set():
                return True
            if "error" in message:
                return False
            result = message.get("result", {})
            if result.get("created"):
                catch_up, self._catch_up = self._catch_up, None
                if catch_up is not None:
                    confirmed = int(result.get("header", {}).get("revision", 0))
                    try:
                        unchanged = confirmed < self.revision or catch_up(confirmed)
                    except Exception:
                        unchanged = False
                    self.revision = max(self.revision, confirmed + 1)
                    if not unchanged:
                        self._on_trouble("changed")
                self.created.set()
            compacted = int(result.get("compact_revision", 0))
            if compacted:
                self._on_trouble("compacted")
                self._stopped.set()
                return True
            if result.get("canceled"):
                return False
            events = [
                Event(str(event.get("type", "PUT")), KV.from_json(event.get("kv", {})))
                for event in result.get("events", [])
            ]
            if events:
                last = events[-1].kv.mod_revision
                self._on_events(events, last)
                self.revision = max(self.revision, last + 1)  # after: "delivered" means handled
        return False
