"""A small synchronous client for etcd's v3 JSON gateway (``POST /v3/…``), for the etcd backend.

Why not a gRPC client: see ``docs/etcd.md`` ("Client"). In short, on a 3-member cluster a raft
write costs the same through the gateway as through gRPC, while plain HTTP/1.1 on the standard
library lets this module know exactly *which phase* of a request failed — and that is what
decides between :class:`~fenced.Unavailable` and :class:`~fenced.OutcomeUnknown`.

Failure classification (per request)::

    phase / answer                                       mutating request     read
    ---------------------------------------------------  -------------------  -----------------
    connect fails (refused, unreachable, timeout)        next endpoint        next endpoint
    sending fails (the server cannot have a whole body)  next endpoint        next endpoint
    etcd: no leader / too many requests / not capable    next endpoint        next endpoint
    etcd: lease not found, compacted, invalid argument   EtcdRejected         EtcdRejected
    reply lost, cut, timed out, or any other error       MaybeApplied         next endpoint

Every request carries ``Grpc-Metadata-hasleader: true`` (etcd's "require leader"): a member cut
off from the majority refuses at once with "no leader" instead of letting a proposal hang until
its own request timeout. :class:`NotApplied` is raised when every endpoint refused within the
time budget; callers translate it to :class:`~fenced.Unavailable`, :class:`MaybeApplied` to
:class:`~fenced.OutcomeUnknown`.

Connections are HTTP/1.1 keep-alive, pooled per endpoint, one request at a time each
(thread-safe). A pooled connection that became readable while idle (the server closed it or a
member restarted) is discarded before reuse, so that a stale connection does not turn a request
that never reached etcd into an unknown outcome. :class:`WatchStream` is one ``/v3/watch``
stream on a dedicated connection: etcd's gateway is HTTP/1.1 and cannot multiplex watches.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "KV",
    "EtcdError",
    "EtcdRejected",
    "Event",
    "MaybeApplied",
    "NotApplied",
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


def _parse_endpoint(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


class ProtocolError(Exception):
    """The server's reply is not the HTTP/1.1 this client speaks (treated like a lost reply)."""


class Connection:
    """One HTTP/1.1 keep-alive connection to the gateway: POST with a JSON body, nothing else.

    A deliberately small client: one ``sendall`` per request (no Nagle/delayed-ACK stall), the
    status line and the headers it needs (``Content-Length``, ``Transfer-Encoding: chunked``,
    ``Connection: close``), and chunked bodies read whole or chunk by chunk (watch streams).
    Measured on this project's machine it costs a quarter of ``http.client``'s CPU per request.
    Errors: :class:`OSError` (including timeouts) and :class:`ProtocolError`.
    """

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host = host
        self.sock: socket.socket | None = socket.create_connection((host, port), timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reader = self.sock.makefile("rb")
        self.will_close = False

    def settimeout(self, timeout: float | None) -> None:
        if self.sock is not None:
            self.sock.settimeout(timeout)

    def send(self, path: str, body: bytes) -> None:
        if self.sock is None:
            raise OSError("connection closed")
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Content-Type: application/json\r\nGrpc-Metadata-hasleader: true\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        self.sock.sendall(head.encode("latin-1") + body)

    def _line(self) -> bytes:
        line = self._reader.readline(65537)
        if not line:
            raise ProtocolError("the server closed the connection")
        return line

    def read_head(self) -> tuple[int, bool, int]:
        """``(status, chunked, content_length)`` of the next response (-1: until close)."""
        status_line = self._line().split(None, 2)
        if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1."):
            raise ProtocolError(f"not an HTTP/1.1 reply: {status_line!r}")
        status = int(status_line[1])
        chunked, length = False, -1
        while True:
            line = self._line()
            if line in (b"\r\n", b"\n"):
                break
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection" and b"close" in value.lower():
                self.will_close = True
        if not chunked and length < 0:
            self.will_close = True
        return status, chunked, length

    def chunks(self) -> Iterator[bytes]:
        """The chunks of a chunked body, as they arrive (ends after the last chunk)."""
        while True:
            size = int(self._line().split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while self._line() not in (b"\r\n", b"\n"):
                    pass
                return
            data = self._reader.read(size)
            if len(data) < size:
                raise ProtocolError("the server closed the connection inside a chunk")
            self._line()
            yield data

    def read_body(self, chunked: bool, length: int) -> bytes:
        if chunked:
            return b"".join(self.chunks())
        if length < 0:
            return self._reader.read()
        data = self._reader.read(length)
        if len(data) < length:
            raise ProtocolError("the server closed the connection inside a reply")
        return data

    def usable(self) -> bool:
        """False if an idle keep-alive connection was closed (or sent something) meanwhile."""
        if self.sock is None or self.will_close:
            return False
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def shutdown(self) -> None:
        """Unblock a reader in another thread (then :meth:`close`)."""
        with contextlib.suppress(OSError):
            if self.sock is not None:
                self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                self._reader.close()
            with contextlib.suppress(OSError):
                sock.close()


class _Endpoint:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.idle: list[Connection] = []
        self.down_until = 0.0

    def __str__(self) -> str:
        return f"{self.host}:{self.port}" if ":" not in self.host else f"[{self.host}]:{self.port}"


class Transport:
    """Requests to the JSON gateway of one etcd cluster, with failover between endpoints.

    ``timeout`` is the budget of one call, retries on other endpoints included;
    ``connect_timeout`` bounds one connection attempt. Thread-safe.
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

    @property
    def endpoints(self) -> list[str]:
        return [str(endpoint) for endpoint in self._endpoints]

    # -- connections ----------------------------------------------------------------------
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
            idle, endpoint.idle = endpoint.idle, []
        for conn in idle:
            conn.close()

    def _checkout(self, endpoint: _Endpoint, timeout: float) -> Connection:
        while True:
            with self._lock:
                if self._closed:
                    raise NotApplied("the client is closed")
                conn = endpoint.idle.pop() if endpoint.idle else None
            if conn is None:
                break
            if conn.usable():
                return conn
            conn.close()
        return self.connect(endpoint, timeout)

    def connect(self, endpoint: _Endpoint, timeout: float) -> Connection:
        """A new connection to ``endpoint`` (raises OSError when that fails)."""
        return Connection(endpoint.host, endpoint.port, min(timeout, self.connect_timeout))

    def _checkin(self, endpoint: _Endpoint, conn: Connection) -> None:
        with self._lock:
            if not self._closed and len(endpoint.idle) < 16:
                endpoint.idle.append(conn)
                return
        conn.close()

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

    def _once(
        self, endpoint: _Endpoint, path: str, data: bytes, timeout: float, mutating: bool
    ) -> Json:
        try:
            conn = self._checkout(endpoint, timeout)
        except OSError as error:
            raise NotApplied(f"cannot connect: {error}") from error
        try:
            conn.settimeout(timeout)
            conn.send("/v3/" + path, data)
        except OSError as error:
            conn.close()
            raise NotApplied(f"request not sent: {error}") from error
        try:
            status, chunked, length = conn.read_head()
            raw = conn.read_body(chunked, length)
        except (OSError, ProtocolError, ValueError) as error:
            conn.close()
            if mutating:
                raise MaybeApplied(f"{endpoint}: reply lost: {error}") from error
            raise NotApplied(f"reply lost: {error}") from error
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError as error:
            conn.close()
            raise _classify(0, f"{endpoint}: unreadable reply: {raw[:200]!r}", mutating) from error
        if conn.will_close:
            conn.close()
        else:
            self._checkin(endpoint, conn)
        if status != 200 or (isinstance(payload, dict) and "error" in payload):
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
                status = self._once(endpoint, "maintenance/status", b"{}", timeout, False)
            except EtcdError:
                continue
            member = str(status.get("header", {}).get("member_id", ""))
            if member and member == str(status.get("leader", "")):
                self._prefer(endpoint)
                return True
        return False

    def open_stream(self, path: str, body: Json, timeout: float) -> Connection:
        """Send a streaming request on a new connection; its reply is chunked, read by the caller.

        Raises :class:`NotApplied` when no endpoint accepts it within ``timeout``.
        """
        data = json.dumps(body, separators=(",", ":")).encode()
        deadline = time.monotonic() + timeout
        last: Exception = NotApplied("no endpoint")
        for endpoint in self._order():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                conn = self.connect(endpoint, remaining)
            except OSError as error:
                last = error
                self._mark_down(endpoint)
                continue
            try:
                conn.settimeout(remaining)
                conn.send("/v3/" + path, data)
                status, chunked, length = conn.read_head()
                if status != 200 or not chunked:
                    raw = conn.read_body(chunked, length)
                    raise ProtocolError(f"HTTP {status}: {raw[:200]!r}")
            except (OSError, ProtocolError, ValueError) as error:
                conn.close()
                last = error
                self._mark_down(endpoint)
                continue
            conn.settimeout(None)
            return conn
        raise NotApplied(f"cannot open a stream: {last}")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = [conn for endpoint in self._endpoints for conn in endpoint.idle]
            for endpoint in self._endpoints:
                endpoint.idle = []
        for conn in idle:
            conn.close()


def _lines(conn: Connection) -> Iterator[bytes]:
    """The newline-separated messages of a streaming gateway reply."""
    buffer = b""
    for chunk in conn.chunks():
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield line
    if buffer.strip():
        yield buffer


class WatchStream:
    """One etcd watch in a daemon thread, resumed after a broken connection.

    Watches ``[key, range_end)`` from ``start_revision``. ``on_events(events, revision)`` is
    called for every batch of events; ``on_trouble(reason)`` when the watch cannot go on
    exactly (``"compacted"``: the start revision was compacted away, the caller must re-read
    state; ``"down"``: no endpoint accepted the watch for a while — it keeps trying).
    After a broken connection it reconnects (any endpoint) and resumes from the revision after
    the last one it delivered: no event is skipped and none is delivered twice.

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
        self._conn: Connection | None = None
        self._thread = threading.Thread(target=self._run, name=f"fenced-etcd-{name}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return not self._stopped.is_set() and self._thread.is_alive()

    def stop(self) -> None:
        """Cancel the watch (closes its connection); idempotent, does not wait."""
        self._stopped.set()
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.shutdown()
            conn.close()

    def _run(self) -> None:
        failures = 0
        while not self._stopped.is_set():
            request: Json = {"key": b64(self._key)}
            if self._catch_up is None:
                request["start_revision"] = str(self.revision)
            if self._range_end is not None:
                request["range_end"] = b64(self._range_end)
            try:
                conn = self._transport.open_stream(
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
                    conn.close()
                    return
                self._conn = conn
            try:
                if self._read(conn):
                    return
                failures = 0
            except Exception as error:  # a cut connection, or stop() closing it under us
                if self._stopped.is_set():
                    return
                log.debug("watch stream broken (%s); resuming at %d", error, self.revision)
                failures += 1
            finally:
                with self._lock:
                    self._conn = None
                conn.close()
            if not self._stopped.is_set():
                self._stopped.wait(_RETRY_PAUSE[min(failures, len(_RETRY_PAUSE) - 1)])

    def _read(self, conn: Connection) -> bool:
        """Deliver messages until the stream ends; True when the watch must not be resumed."""
        for line in _lines(conn):
            if self._stopped.is_set():
                return True
            message = json.loads(line)
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
