"""Run the application on uvicorn: bind, TLS, graceful shutdown.

SIGTERM or SIGINT: the server stops accepting connections, every request waiting on the server
(a long poll of ``:acquire`` or ``:watch``) ends at once with ``503 unavailable`` and
``Retry-After`` (a waiter's kept place is left: it polls again, here after a restart or at
another server), the other requests in flight finish (up to ``grace`` seconds), then the
backend is closed. Leases are not released: they are the clients', and live on their ttl.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import socket
import ssl
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import FastAPI

from fenced.coordinator._connect import open_backend, resolve_url
from fenced.core._errors import ConfigurationError
from fenced.fence._store import open_store
from fenced.server._app import DEFAULT_KEEP, DEFAULT_POLL, create_app

__all__ = ["DEFAULT_LISTEN", "FencedServer", "bind", "parse_listen", "serve", "server_for"]

log = logging.getLogger("fenced.server")

DEFAULT_LISTEN = "127.0.0.1:8470"
KEEP_ALIVE = 65
"""Seconds an idle client connection is kept open."""
GRACE = 10.0
"""Seconds the requests in flight get to finish after SIGTERM."""


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as (host, port); ConfigurationError otherwise."""
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ConfigurationError(f"--listen wants HOST:PORT (port 0-65535), got {listen!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port_text)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(listen: str, *, keys: bool) -> socket.socket:
    """A listening socket on ``listen``. Without API keys only a loopback address is allowed:
    an open coordinator on a network would let anyone take any lease."""
    host, port = parse_listen(listen)
    if not keys and not _is_loopback(host):
        raise ConfigurationError(
            f"fenced serve listens on {host} only with API keys (--keys FILE); without them "
            "it serves loopback addresses only (127.0.0.1, ::1, localhost)"
        )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    # accepted sockets whose proto says TCP; with Nagle on, the body of a reply on a kept-alive
    # connection waits for the client's delayed ACK (40 ms a request on Linux).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ConfigurationError(f"cannot listen on {listen}: {error.strerror}") from error
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class FencedServer(uvicorn.Server):
    """uvicorn's server, whose exit signal also ends the requests waiting on the server."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exit = asyncio.Event()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._exit = asyncio.Event()
        await super().serve(sockets)

    async def main_loop(self) -> None:
        """uvicorn's loop (a tick every 0.1 s: the Date header, the exit flag), which also
        wakes at once when the stop is asked for (:meth:`stop`, a signal) instead of at the
        next tick."""
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    await self._exit.wait()
            should_exit = await self.on_tick(counter)

    def stop(self) -> None:
        """Start the graceful stop from any thread (what SIGTERM does)."""
        self.handle_exit(signal.SIGTERM, None)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGTERM/SIGINT start the graceful stop (in the main thread; elsewhere the caller
        stops the server). Unlike uvicorn's own, the signal is not raised again once the
        server has stopped: a graceful stop ends the process with status 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGTERM, signal.SIGINT)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        state = getattr(self._app.state, "fenced", None)
        if self._loop is not None:
            if state is not None:
                self._loop.call_soon_threadsafe(state.places.interrupt)
            self._loop.call_soon_threadsafe(self._exit.set)


def server_for(
    app: FastAPI,
    *,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    tls_client_ca: Path | None = None,
    log_level: str = "warning",
) -> FencedServer:
    """A uvicorn server for ``app`` (run it with ``serve(sockets=[bind(...)])``)."""
    if (tls_cert is None) != (tls_key is None):
        raise ConfigurationError("--tls-cert and --tls-key go together")
    if tls_client_ca is not None and tls_cert is None:
        raise ConfigurationError("--tls-client-ca needs --tls-cert and --tls-key")
    for path in (tls_cert, tls_key, tls_client_ca):
        if path is not None and not path.is_file():
            raise ConfigurationError(f"{path}: no such file")
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,  # a request line may carry names; keys are never logged either way
        lifespan="on",
        # httptools (C, llhttp) parses requests when installed (the server extra installs it):
        # ~20 % less server CPU per lease cycle than the pure-Python h11; h11 otherwise.
        http="auto",
        # Holders renew every ttl/3: keep their connections between renewals (uvicorn's 5 s
        # default would reconnect, with a TLS handshake, at every renewal of a 30 s lease).
        timeout_keep_alive=KEEP_ALIVE,
        timeout_graceful_shutdown=int(GRACE),
        ssl_certfile=None if tls_cert is None else str(tls_cert),
        ssl_keyfile=None if tls_key is None else str(tls_key),
        ssl_ca_certs=None if tls_client_ca is None else str(tls_client_ca),
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls_client_ca is not None else ssl.CERT_NONE,
        server_header=False,
    )
    return FencedServer(config, app)


def preflight(url: str | None, stores: Mapping[str, str]) -> None:
    """Open and close the coordinator and each store once, synchronously, so that a bad URL,
    an unreachable server or a refused password is one clear error before the server listens
    (the app opens its own asyncio connections when it starts)."""
    backend = open_backend(resolve_url(url))
    backend.close()
    for store_url in stores.values():
        open_store(store_url).close()


def serve(
    url: str | None = None,
    *,
    listen: str = DEFAULT_LISTEN,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    tls_client_ca: Path | None = None,
    poll: float = DEFAULT_POLL,
    keep: float = DEFAULT_KEEP,
    stores: Mapping[str, str] | None = None,
    keys: Path | None = None,
) -> None:
    """Serve the coordinator at ``url`` and ``stores`` on ``listen`` until SIGTERM/SIGINT
    (module docstring). Prints the address it listens on (the port chosen when ``listen`` ends
    in ``:0``). Raises :class:`~fenced.ConfigurationError` before listening for bad options."""
    app = create_app(url, poll=poll, keep=keep, stores=stores, keys=keys)
    server = server_for(app, tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca)
    sock = bind(listen, keys=keys is not None)
    try:
        preflight(url, stores or {})
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls_cert is not None else "http"
    shown = f"[{host}]" if ":" in host else host
    print(f"fenced serve: listening on {scheme}://{shown}:{port}", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    if not server.started:
        raise ConfigurationError("fenced serve could not start (see the log above)")
