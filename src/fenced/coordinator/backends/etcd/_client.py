"""A synchronous client for etcd's v3 JSON gateway (``POST /v3/…``), for the etcd backend with
``?api=gateway``, and what both transports share: endpoint order and failover within one time
budget, TLS settings, user login and token renewal, error classes, open streams. The default
transport, :class:`~._grpc_transport.GrpcTransport`, subclasses :class:`Transport`.

HTTP is Python's own ``http.client`` (CPython's maintained HTTP/1.1 client: request framing,
status line and header parsing, ``Content-Length`` and chunked replies). What stays here is what
etcd needs on top: a small pool of keep-alive connections per endpoint, etcd's error answers, and
the one distinction a lock service cannot do without — whether a request that failed may have
been applied. Why gRPC by default: ``docs/etcd.md`` ("Client").

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
import itertools
import json
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from google.protobuf.message import Message

from fenced.coordinator.backends.etcd._messages import METHODS, Json, to_json, to_message
from fenced.coordinator.backends.etcd._security import Login, Tls, diagnose

__all__ = [
    "KV",
    "RETRY_PAUSE",
    "Cluster",
    "EtcdError",
    "EtcdRejected",
    "Event",
    "Json",
    "MaybeApplied",
    "NotApplied",
    "OpenStream",
    "Refused",
    "Stream",
    "Transport",
    "b64",
    "error_of",
    "unb64",
]

log = logging.getLogger("fenced.coordinator.etcd")

RETRY_PAUSE = (0.02, 0.05, 0.1, 0.2)
"""Pauses between retries of a request, and between attempts to reopen a watch."""
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


class Refused(EtcdError):
    """The cluster refuses who this client is or how it connects: a wrong password, no user
    where etcd wants one, a permission missing on the prefix, a TLS certificate refused either
    way. Nothing was applied; a retry cannot help (callers raise ``ConfigurationError``)."""


_TOKEN_STALE = ("invalid auth token", "revision of auth store is old")
"""etcd's answers to a token it no longer takes (it expired, or the user changed): get a new
one and send the request again (etcd checks the token before it applies anything)."""
_LOGIN_REFUSED = {
    "authentication failed": "etcd refused the user name or password",
    "authentication is not enabled": (
        "a user was given but the cluster has authentication disabled; remove it from the URL"
    ),
    "user name is empty": (
        "the cluster has authentication enabled: give a user (etcd://user:password@…) or a "
        "client certificate whose common name is an etcd user"
    ),
}


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


def error_of(payload: Json) -> tuple[int, str]:
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


class _HTTPSConnection(http.client.HTTPSConnection):
    """HTTPS whose certificate is checked against ``server_name`` when given (a certificate
    issued to a name while the URL has an address), else against the host."""

    def __init__(
        self,
        host: str,
        port: int,
        context: ssl.SSLContext,
        server_name: str | None,
        *,
        timeout: float,
    ) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._tls_context = context
        self._server_name = server_name or host

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)  # TCP, TCP_NODELAY
        assert self.sock is not None
        self.sock = self._tls_context.wrap_socket(self.sock, server_hostname=self._server_name)


def _close(conn: http.client.HTTPConnection) -> None:
    with contextlib.suppress(Exception):
        conn.close()


class OpenStream(Protocol):
    """A watch's open reply, whichever transport carries it (see :class:`Stream`)."""

    token: str | None
    """The auth token the watch was opened with."""

    def messages(self) -> Iterator[Json]: ...

    def shutdown(self) -> None: ...

    def close(self) -> None: ...


_S = TypeVar("_S", bound=OpenStream)


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
        on_close: Callable[[OpenStream], None],
    ) -> None:
        self._conn = conn
        self._sock = sock
        self._response = response
        self._on_close = on_close
        self.token: str | None = None

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


class Cluster:
    """What every transport to one etcd cluster keeps, whatever carries its requests (this
    module's HTTP, :mod:`._grpc_transport`'s gRPC, :mod:`._aio_transport`'s ``grpc.aio``): the
    endpoints and their order of preference (the last one that answered first, one that refused
    tried last for :data:`_DOWN_FOR` seconds), the time budgets, TLS and login settings, the
    current auth token, and the decisions about them: the schedule of attempts within one
    call's budget (:meth:`_attempt_order`), what an etcd rejection about identity or permission
    means (:meth:`_refused`), whether an error says the token went stale
    (:meth:`_token_stale`), and why TLS fails (:meth:`_tls_refused`). No I/O but
    :meth:`_tls_refused`'s probe."""

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        *,
        timeout: float,
        connect_timeout: float,
        tls: Tls | None = None,
        login: Login | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one endpoint is needed")
        self._endpoints = [_Endpoint(host, port) for host, port in endpoints]
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.tls = tls
        self._login = login
        self._token: str | None = None  # etcd's auth token for login (refreshed when stale)
        self.token_refreshes = 0
        """How many times a token etcd no longer took was replaced (for tests and metrics)."""
        self.permission_hint = "the etcd user needs readwrite permission on fenced's key prefix"
        """Added to etcd's "permission denied" (the backend names the user and the prefix)."""
        self._lock = threading.Lock()
        self._preferred = 0
        self._closed = False

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

    def _attempt_order(self, deadline: float) -> Iterator[_Endpoint | float]:
        """The attempts of one call until ``deadline``: each endpoint in the order of
        preference, then a pause (a float: seconds to sleep, from :data:`RETRY_PAUSE`), then
        every endpoint again, … It ends when the budget is spent, and raises
        :class:`NotApplied` once the client is closed. The caller tries each endpoint yielded
        (marking it down when it refuses) and stops at the first answer."""
        for attempt in itertools.count():
            for endpoint in self._order():
                if deadline - time.monotonic() <= 0:
                    break
                if self._closed:
                    raise NotApplied("the client is closed")
                yield endpoint
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            yield min(RETRY_PAUSE[min(attempt, len(RETRY_PAUSE) - 1)], remaining)

    def _stream_order(self, deadline: float) -> Iterator[_Endpoint]:
        """The endpoints to try, in order, for opening a stream until ``deadline``; raises
        :class:`NotApplied` once the client is closed."""
        for endpoint in self._order():
            if deadline - time.monotonic() <= 0:
                return
            if self._closed:
                raise NotApplied("the client is closed")
            yield endpoint

    # -- identity -------------------------------------------------------------------------
    def _tls_refused(self, endpoint: _Endpoint, timeout: float) -> Refused | None:
        """:class:`Refused` naming why TLS to ``endpoint`` fails, or None (not TLS's doing).
        Blocks for up to ``timeout`` + 0.2 s (a probe, :func:`~._security.diagnose`)."""
        if self.tls is None:
            return None
        cause = diagnose(self.tls, endpoint.host, endpoint.port, timeout)
        return None if cause is None else Refused(f"{endpoint}: {cause}")

    def _refused(self, error: EtcdRejected) -> EtcdError:
        """The :class:`Refused` an etcd rejection about identity or permission means, else
        ``error`` itself."""
        message = str(error)
        for marker, meaning in _LOGIN_REFUSED.items():
            if marker in message:
                who = "" if self._login is None else f" (user {self._login.user!r})"
                return Refused(f"{meaning}{who}: {message}", error.code)
        if "permission denied" in message:
            return Refused(f"{message}: {self.permission_hint}", error.code)
        return error

    def _token_stale(self, message: str) -> bool:
        """Does etcd's ``message`` say that it no longer takes our token (get a new one and
        send again: etcd checks the token before it applies anything)?"""
        return self._login is not None and any(marker in message for marker in _TOKEN_STALE)

    def _login_body(self) -> Json:
        """The ``Authenticate`` request of the login (only called with a login)."""
        login = self._login
        assert login is not None
        return {"name": login.user, "password": login.password}

    def _token_current(self, stale: str | None) -> bool:
        """Has a token replaced ``stale`` meanwhile (another caller authenticated)?"""
        return self._token is not None and self._token != stale

    def _took_token(self, token: str, stale: str | None) -> None:
        """``Authenticate`` answered ``token`` (``stale``: the token it replaces, if any)."""
        self._token = token or None
        if stale is not None:
            self.token_refreshes += 1


class Transport(Cluster):
    """Requests to the JSON gateway of one etcd cluster, with failover between endpoints.

    ``timeout`` is the budget of one call, retries on other endpoints included;
    ``connect_timeout`` bounds one connection attempt. Thread-safe. After :meth:`close`, calls
    raise :class:`NotApplied` at once, open streams end, idle connections are closed, and a
    connection in use is closed when its request ends.
    """

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
        self._ssl = None if tls is None else tls.ssl_context()
        self._token_lock = threading.Lock()  # one Authenticate at a time
        self._open: set[OpenStream] = set()

    # -- connections ----------------------------------------------------------------------
    def _connect(self, endpoint: _Endpoint, timeout: float) -> http.client.HTTPConnection:
        """A new connection to ``endpoint`` (:class:`NotApplied` if it cannot be made,
        :class:`Refused` if TLS refuses it)."""
        wait = min(timeout, self.connect_timeout)
        conn: http.client.HTTPConnection
        if self._ssl is None or self.tls is None:
            conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=wait)
        else:
            conn = _HTTPSConnection(
                endpoint.host, endpoint.port, self._ssl, self.tls.server_name, timeout=wait
            )
        try:
            conn.connect()  # sets TCP_NODELAY
        except ssl.SSLError as error:
            _close(conn)
            raise self._tls_refused(endpoint, wait) or NotApplied(
                f"cannot connect: {_describe(error)}"
            ) from error
        except _HTTP_ERRORS as error:
            _close(conn)
            raise NotApplied(f"cannot connect: {_describe(error)}") from error
        return conn

    # -- authentication ---------------------------------------------------------------------
    def _auth_headers(self) -> dict[str, str]:
        token = self._token
        return _HEADERS if token is None else {**_HEADERS, "Authorization": token}

    def _authenticate(self, deadline: float, stale: str | None = None) -> None:
        """Get a token for the login (unless another thread replaced ``stale`` meanwhile)."""
        login = self._login
        if login is None:
            return
        with self._token_lock:
            if self._token_current(stale):
                return
            data = self._encode("auth/authenticate", self._login_body())
            last: EtcdError = NotApplied("no endpoint answered")
            for endpoint in self._order():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    reply = self._reply_json(
                        self._once(endpoint, "auth/authenticate", data, remaining, False)
                    )
                except NotApplied as error:
                    last = error
                    continue
                except EtcdRejected as error:
                    refused = self._refused(error)
                    if refused is error:
                        raise
                    raise refused from error
                self._took_token(str(reply.get("token", "")), stale)
                return
            raise NotApplied(f"authenticating as {login.user!r}: {last}", last.code)

    def stale_token(self, message: str, used: str | None) -> None:
        """After a watch ended with ``message``: if etcd no longer takes the token ``used``,
        get a new one (quietly: the watch's next attempt reports what still fails)."""
        if not self._token_stale(message):
            return
        with contextlib.suppress(EtcdError):
            self._authenticate(time.monotonic() + self.timeout, stale=used)

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

    def _forget(self, stream: OpenStream) -> None:
        with self._lock:
            self._open.discard(stream)

    def _stream_endpoints(self, timeout: float) -> Iterator[tuple[_Endpoint, float]]:
        """For opening a stream: each endpoint in the order of preference with the deadline
        ``timeout`` from now, while time is left (authenticated first if the URL names a user).
        Raises :class:`NotApplied` once the client is closed."""
        deadline = time.monotonic() + timeout
        if self._login is not None and self._token is None:
            self._authenticate(deadline)
        for endpoint in self._stream_order(deadline):
            yield endpoint, deadline

    def _adopt(self, stream: _S) -> _S:
        """``stream``, now counted among the open streams that :meth:`close` ends; closed and
        ``NotApplied`` if the client was closed meanwhile."""
        with self._lock:
            if not self._closed:
                self._open.add(stream)
                return stream
        stream.close()
        raise NotApplied("the client is closed")

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
        if self._login is not None and self._token is None:
            self._authenticate(deadline)
        last: EtcdError = NotApplied("no endpoint answered")
        for endpoint in self._attempt_order(deadline):
            if isinstance(endpoint, float):
                time.sleep(endpoint)
                continue
            try:
                return self._with_token(endpoint, path, data, deadline, mutating)
            except NotApplied as error:
                last = NotApplied(f"{endpoint}: {error}", error.code)
                self._mark_down(endpoint)
            except EtcdRejected as error:
                refused = self._refused(error)
                if refused is error:
                    raise
                raise refused from error
        raise NotApplied(f"etcd unavailable after {budget:g}s ({last})", last.code)

    def _with_token(
        self, endpoint: _Endpoint, path: str, data: Any, deadline: float, mutating: bool
    ) -> Any:
        """:meth:`_once`; if etcd no longer takes the token, a new token and once more."""
        used = self._token
        try:
            return self._once(endpoint, path, data, deadline - time.monotonic(), mutating)
        except EtcdRejected as error:
            if not self._token_stale(str(error)):
                raise
        log.info("etcd auth token no longer valid; authenticating again")
        self._authenticate(deadline, stale=used)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NotApplied("the time budget ended while authenticating again")
        return self._once(endpoint, path, data, remaining, mutating)

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
                    conn.request("POST", "/v3/" + path, data, self._request_headers(path))
                    sock.setsockopt(socket.IPPROTO_TCP, _CORK, 0)  # sends what is queued
                else:
                    conn.request("POST", "/v3/" + path, data, self._request_headers(path))
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
        if status == 400 and b"CommonName" in raw:  # etcd's gateway under --client-cert-auth
            raise Refused(
                f"{endpoint}: etcd's JSON gateway refuses client certificates that carry a "
                "common name: use api=grpc, or a certificate without one and a user:password"
            )
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError as error:
            raise _classify(0, f"{endpoint}: unreadable reply: {raw[:200]!r}", mutating) from error
        if not isinstance(payload, dict):
            raise _classify(0, f"{endpoint}: unexpected reply: {raw[:200]!r}", mutating)
        if status != 200 or "error" in payload:
            code, message = error_of(payload)
            raise _classify(code, message or f"HTTP {status}", mutating)
        self._prefer(endpoint)
        result = payload.get("result", payload)  # stream endpoints wrap their reply
        return result if isinstance(result, dict) else {}

    def _request_headers(self, path: str) -> dict[str, str]:
        return _HEADERS if path == "auth/authenticate" else self._auth_headers()

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

    def open_stream(self, path: str, body: Json, timeout: float) -> OpenStream:
        """POST a streaming request on a connection of its own; the reply, open for reading.

        Tries the endpoints in turn until one answers 200 within ``timeout`` (connecting,
        sending, and the reply's head: etcd's gateway sends it with the first message), else
        raises :class:`NotApplied`. Once open, the stream has no read timeout: a quiet watch is
        normal (``tests/coordinator/etcd/test_etcd_coordinator.py`` pins that an idle watch keeps
        its connection).
        """
        data = _compact_json(body).encode()
        last = "no endpoint"
        for endpoint, deadline in self._stream_endpoints(timeout):
            try:
                conn = self._connect(endpoint, deadline - time.monotonic())
            except NotApplied as error:
                last = f"{endpoint}: {error}"
                self._mark_down(endpoint)
                continue
            sock = conn.sock
            assert sock is not None  # connected
            try:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                conn.request("POST", "/v3/" + path, data, self._auth_headers())
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
            stream.token = self._token
            return self._adopt(stream)
        raise NotApplied(f"cannot open a stream: {last}")
