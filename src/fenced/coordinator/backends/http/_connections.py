"""Kept-alive connections of the sync client, on the standard library's ``http.client``.

Why not httpx here: a lease cycle is two small requests, and httpx spends about 320 µs of CPU on
each in this process against about 90 µs for ``http.client`` (benchmarks/RESULTS.md, "fenced
serve"); the asyncio client keeps httpx's ``AsyncClient``. Connections are pooled per server and
shared by threads (a holder's keeper thread renews while the main thread works): a request takes
an idle connection or opens one, and gives it back after a complete reply.

Failures are told apart by where they happen: no connection (refused, timed out, TLS refused)
means nothing was sent (:func:`~._transport.unreachable`); a failure after the request was
written means it may have arrived (:func:`~._transport.lost`). A kept connection that the server
closed while idle (its keep-alive timeout) is noticed before it is used — it is readable at end
of file — and replaced, so an idle client never mistakes the server's housekeeping for a lost
reply.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Mapping

from fenced.coordinator.backends.http._transport import lost, unreachable
from fenced.coordinator.backends.http._wire import Call

__all__ = ["Connections"]

_IDLE_PER_SERVER = 16
"""Idle connections kept per server (more are closed after use)."""


class Connections:
    """The pool (module docstring). Thread-safe."""

    def __init__(self, headers: Mapping[str, str], context: ssl.SSLContext | None) -> None:
        self._headers = {**headers, "Content-Type": "application/json"}
        self._context = context
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def request(self, base: str, call: Call, timeout: float) -> tuple[int, bytes]:
        """``call`` to the server at ``base``: (status, body). Raises the FencedError a
        transport failure stands for."""
        parts = urllib.parse.urlsplit(base)
        conn = self._take(base, parts, timeout, call)
        target = parts.path + call.path  # already quoted (_wire)
        if call.params:
            target += "?" + urllib.parse.urlencode(dict(call.params))
        body = None if call.body is None else json.dumps(call.body).encode()
        try:
            conn.request(call.method, target, body, self._headers)
            reply = conn.getresponse()
            content = reply.read()
        except (OSError, http.client.HTTPException) as error:
            conn.close()
            raise lost(call, error) from error
        if reply.will_close:
            conn.close()
        else:
            self._give(base, conn)
        return reply.status, content

    def _take(
        self, base: str, parts: urllib.parse.SplitResult, timeout: float, call: Call
    ) -> http.client.HTTPConnection:
        with self._lock:
            idle = self._idle.get(base, [])
            while idle:
                kept = idle.pop()
                if kept.sock is not None and not _closed_by_peer(kept.sock):
                    kept.sock.settimeout(timeout)
                    return kept
                kept.close()
        host, port = parts.hostname or "", parts.port
        if parts.scheme == "https":
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, port, timeout=timeout, context=self._context
            )
        else:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.connect()
        except OSError as error:
            conn.close()
            raise unreachable(call, base, error) from error
        assert conn.sock is not None
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _give(self, base: str, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(base, [])
            if self._closed or len(idle) >= _IDLE_PER_SERVER:
                conn.close()
            else:
                idle.append(conn)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for idle in self._idle.values():
                for conn in idle:
                    conn.close()
            self._idle.clear()


def _closed_by_peer(sock: socket.socket) -> bool:
    """True if an idle connection's socket is readable: the server closed it (or sent what no
    request asked for); either way it cannot carry the next request."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)
