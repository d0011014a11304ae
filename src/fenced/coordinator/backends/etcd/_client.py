"""A synchronous client for etcd's v3 JSON gateway (``POST /v3/…``), for the etcd backend.

HTTP is Python's own ``http.client`` (CPython's maintained HTTP/1.1 client: request framing,
status line and header parsing, ``Content-Length`` and chunked replies). What stays here is what
etcd needs on top: a small pool of keep-alive connections per endpoint, endpoint failover within
one time budget, etcd's error answers, and the one distinction a lock service cannot do without —
whether a request that failed may have been applied. Why ``http.client`` and the gateway rather
than httpx, urllib3 or a gRPC client: see ``docs/etcd.md`` ("Client").

Failure classification (per request)::

    what happened                                         mutating request    read
    ----------------------------------------------------  ------------------  --------------
    connecting failed or timed out                        next endpoint       next endpoint
    sending failed (the request was not sent whole)       next endpoint       next endpoint
    etcd: no leader / too many requests / not capable     next endpoint       next endpoint
    etcd: lease not found, compacted, invalid argument    EtcdRejected        EtcdRejected
    reading the reply failed, timed out, or it was cut    MaybeApplied        next endpoint
      (after the request was sent whole)
    a reply that is not etcd's JSON                       MaybeApplied        next endpoint

"Sent whole": ``HTTPConnection.request`` returned, i.e. ``socket.sendall`` handed every byte of
the head and the body to the kernel; an error raised by it means the body did not get out whole.
etcd's gateway decodes a request only once its whole JSON body has arrived (the last byte is the
closing brace), so a request not sent whole was not applied.

Every request carries ``Grpc-Metadata-hasleader: true`` (etcd's "require leader"): a member cut
off from the majority refuses at once with "no leader" instead of letting a proposal hang until
its own request timeout. :class:`NotApplied` is raised when every endpoint refused within the
time budget; callers translate it to :class:`~fenced.Unavailable`, :class:`MaybeApplied` to
:class:`~fenced.OutcomeUnknown`.

Connections: per endpoint, a pool of idle keep-alive ``http.client.HTTPConnection`` objects (at
most :data:`_IDLE_KEPT`, one request at a time each; ``TCP_NODELAY``, set by ``http.client``). A
pooled connection that became readable while idle — the server closed it, or a member restarted
— is discarded before reuse (as httpcore and urllib3 do), so a stale connection does not turn a
request that never reached etcd into an unknown outcome. Each watch (:class:`Stream`) is one
streaming ``/v3/watch`` reply on a connection of its own (etcd's gateway is HTTP/1.1 and cannot
multiplex watches). The endpoints of the URL are connected to directly (no proxy).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message

from fenced.coordinator.backends.etcd._messages import METHODS, Json, to_json, to_message

__all__ = [
    "KV",
    "EtcdError",
    "EtcdRejected",
    "Event",
    "Json",
    "MaybeApplied",
    "NotApplied",
    "Stream",
    "Transport",
    "WatchStream",
    "b64",
    "unb64",
]

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
_compact_json = json.JSONEncoder(separators=(",", ":"), default=to_json).encode
"""A request body as compact JSON (``json.dumps(…, separators=(",", ":"))``); a message in a
body is written as the gateway's JSON of it."""
_IDLE_KEPT = 16  # idle keep-alive connections kept per endpoint
_READ_CHUNK = 65536
# http.client writes a request's head and its body with two send()s: corked, they leave in one
# segment (one wake-up of the member instead of two; Linux's TCP_CORK, elsewhere two segments)
_CORK = getattr(socket, "TCP_CORK", None)
# what http.client and the socket raise while connecting, sending or reading (HTTPException:
# a malformed status line or header, an incomplete body, a closed connection)
_HTTP_ERRORS = (OSError, http.client.HTTPException, ValueError)


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
    def from_message(cls, kv: Any) -> KV:
        """From etcd's ``KeyValue`` message."""
        return cls(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease)

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


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _readable(sock: socket.socket) -> bool:
    """Has an idle connection something to read (data, or the peer's FIN or reset)?"""
    try:
        poller = select.poll()
    except AttributeError:  # pragma: no cover - no poll() (Windows)
        return bool(select.select([sock], [], [], 0)[0])
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class _Endpoint:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.down_until = 0.0
        self.idle: list[http.client.HTTPConnection] = []  # under the transport's lock

    def __str__(self) -> str:
        return f"{self.host}:{self.port}" if ":" not in self.host else f"[{self.host}]:{self.port}"


def _close(conn: http.client.HTTPConnection) -> None:
    with contextlib.suppress(Exception):
        conn.close()


class Stream:
    """An open streaming reply of the gateway (a watch): its JSON messages as they arrive.

    Read it from one thread; :meth:`shutdown` may be called from any other one to make the
    reader's blocked read end (with an error or the end of the messages); the reader then
    :meth:`close`\\ s it.
    """

    def __init__(
        self,
        conn: http.client.HTTPConnection,
        sock: socket.socket,
        response: http.client.HTTPResponse,
        on_close: Callable[[Stream], None],
    ) -> None:
        self._conn = conn
        self._sock = sock
        self._response = response
        self._on_close = on_close

    def messages(self) -> Iterator[Json]:
        """The newline-separated JSON objects of the reply (``OSError``, ``http.client``'s
        errors or ``ValueError`` when it is cut)."""
        pending = b""
        while True:
            data = self._response.read1(_READ_CHUNK)  # whatever arrived (de-chunked)
            if not data:
                return
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip():
                    message = json.loads(line)
                    yield message if isinstance(message, dict) else {}

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._response.close()
        _close(self._conn)
        with contextlib.suppress(OSError):
            self._sock.close()
        self._on_close(self)


class Transport:
    """Requests to the JSON gateway of one etcd cluster, with failover between endpoints.

    ``timeout`` is the budget of one call, retries on other endpoints included;
    ``connect_timeout`` bounds one connection attempt. Thread-safe. After :meth:`close`, calls
    raise :class:`NotApplied` at once, open streams end, idle connections are closed, and a
    connection in use is closed when its request ends.
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
        self._open: set[Stream] = set()

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

    # -- connections ----------------------------------------------------------------------
    def _connect(self, endpoint: _Endpoint, timeout: float) -> http.client.HTTPConnection:
        """A new connection to ``endpoint`` (:class:`NotApplied` if it cannot be made)."""
        conn = http.client.HTTPConnection(
            endpoint.host, endpoint.port, timeout=min(timeout, self.connect_timeout)
        )
        try:
            conn.connect()  # sets TCP_NODELAY
        except _HTTP_ERRORS as error:
            _close(conn)
            raise NotApplied(f"cannot connect: {_describe(error)}") from error
        return conn

    def _checkout(self, endpoint: _Endpoint, timeout: float) -> http.client.HTTPConnection:
        """An idle pooled connection to ``endpoint`` that the server did not close, or a new one."""
        while True:
            with self._lock:
                if self._closed:
                    raise NotApplied("the client is closed")
                conn = endpoint.idle.pop() if endpoint.idle else None
            if conn is None:
                return self._connect(endpoint, timeout)
            sock = conn.sock
            if sock is not None and not _readable(sock):
                return conn
            _close(conn)  # closed by the server while idle (or unexpected bytes): never reuse

    def _checkin(self, endpoint: _Endpoint, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and conn.sock is not None and len(endpoint.idle) < _IDLE_KEPT:
                endpoint.idle.append(conn)
                return
        _close(conn)

    def close(self) -> None:
        """Refuse new calls, end open streams, close the connections (see the class docstring)."""
        with self._lock:
            self._closed = True
            streams = list(self._open)
            idle = [conn for endpoint in self._endpoints for conn in endpoint.idle]
            for endpoint in self._endpoints:
                endpoint.idle.clear()
        for stream in streams:
            stream.shutdown()
        for conn in idle:
            _close(conn)

    def _forget(self, stream: Stream) -> None:
        with self._lock:
            self._open.discard(stream)

    # -- requests -------------------------------------------------------------------------
    def call(self, path: str, body: Json, *, mutating: bool, timeout: float | None = None) -> Json:
        """POST ``body`` to ``/v3/<path>``; the decoded reply (see the module docstring)."""
        return self._reply_json(self._attempts(path, body, mutating, timeout))

    def call_message(
        self, path: str, body: Json | Message, *, mutating: bool, timeout: float | None = None
    ) -> Message:
        """:meth:`call`, with the reply as etcd's message (:data:`~.messages.METHODS`).

        ``body`` may hold messages where the gateway's JSON has objects (ops, compares), or be
        the request message itself."""
        return self._reply_message(path, self._attempts(path, body, mutating, timeout))

    def _reply_json(self, reply: Any) -> Json:
        """What :meth:`_once` returned, as the gateway's JSON (here: it is that already)."""
        result: Json = reply
        return result

    def _reply_message(self, path: str, reply: Any) -> Message:
        """What :meth:`_once` returned, as the reply message of ``path``."""
        return to_message(METHODS[path][2], reply, strict=False)

    def _attempts(
        self, path: str, body: Json | Message, mutating: bool, timeout: float | None
    ) -> Any:
        """:meth:`_once` at one endpoint after another until one answers or the budget ends."""
        data = self._encode(path, body)
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

    def _encode(self, path: str, body: Json | Message) -> Any:
        """``body`` as :meth:`_once` sends it (here: compact JSON; a message as the gateway's
        JSON of it)."""
        del path
        return _compact_json(body).encode()

    def _once(
        self, endpoint: _Endpoint, path: str, data: Any, timeout: float, mutating: bool
    ) -> Any:
        """One attempt at one endpoint: the reply, or the classified error (module docstring)."""
        conn = self._checkout(endpoint, timeout)
        kept = False
        try:
            sock = conn.sock
            if sock is not None:
                sock.settimeout(timeout)  # sending and reading this reply
            try:
                if _CORK is not None and sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, _CORK, 1)
                    conn.request("POST", "/v3/" + path, data, _HEADERS)
                    sock.setsockopt(socket.IPPROTO_TCP, _CORK, 0)  # sends what is queued
                else:
                    conn.request("POST", "/v3/" + path, data, _HEADERS)
            except _HTTP_ERRORS as error:  # not handed to the kernel whole: not applied
                raise NotApplied(f"request not sent whole: {_describe(error)}") from error
            try:
                response = conn.getresponse()
                raw = response.read()
            except _HTTP_ERRORS as error:  # sent whole; reply lost, cut, late or malformed
                if mutating:
                    raise MaybeApplied(f"{endpoint}: reply lost: {_describe(error)}") from error
                raise NotApplied(f"reply lost: {_describe(error)}") from error
            status = response.status
            kept = not response.will_close
        finally:
            if kept:
                self._checkin(endpoint, conn)
            else:
                _close(conn)
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError as error:
            raise _classify(0, f"{endpoint}: unreadable reply: {raw[:200]!r}", mutating) from error
        if not isinstance(payload, dict):
            raise _classify(0, f"{endpoint}: unexpected reply: {raw[:200]!r}", mutating)
        if status != 200 or "error" in payload:
            code, message = _error_of(payload)
            raise _classify(code, message or f"HTTP {status}", mutating)
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
                status = self._reply_json(
                    self._once(
                        endpoint, "maintenance/status", self._encode("maintenance/status", {}),
                        timeout, False,
                    )
                )  # fmt: skip
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
        normal (``tests/coordinator/etcd/test_etcd_coordinator.py`` pins that an idle watch keeps
        its connection).
        """
        data = _compact_json(body).encode()
        deadline = time.monotonic() + timeout
        last = "no endpoint"
        for endpoint in self._order():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if self._closed:
                raise NotApplied("the client is closed")
            try:
                conn = self._connect(endpoint, remaining)
            except NotApplied as error:
                last = f"{endpoint}: {error}"
                self._mark_down(endpoint)
                continue
            sock = conn.sock
            assert sock is not None  # connected
            try:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                conn.request("POST", "/v3/" + path, data, _HEADERS)
                response = conn.getresponse()  # the head comes with the first message
                if response.status != 200:
                    last = f"{endpoint}: HTTP {response.status}: {response.read(200)!r}"
                    raise NotApplied(last)
                sock.settimeout(None)
            except (NotApplied, *_HTTP_ERRORS) as error:
                if not isinstance(error, NotApplied):
                    last = f"{endpoint}: {_describe(error)}"
                _close(conn)
                with contextlib.suppress(OSError):
                    sock.close()
                self._mark_down(endpoint)
                continue
            stream = Stream(conn, sock, response, self._forget)
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
