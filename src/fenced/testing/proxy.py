"""A small TCP proxy on loopback for fault injection (tests and ``fenced verify``).

::

    with TcpProxy("127.0.0.1", server_port) as proxy:   # clients connect to proxy.port
        proxy.delay(0.5)          # every reply (server → client) arrives 0.5 s late
        proxy.blackhole()         # connections stay open, nothing is forwarded either way
        proxy.lose_replies()      # requests are forwarded; the next reply is dropped and the
                                  # connection is cut: "the request was sent, the reply was lost"
        proxy.hold_replies()      # requests are forwarded; nothing comes back until forward()
                                  # delivers it or cut() loses it with the connection
        proxy.cut()               # close every current connection (new ones are accepted)
        proxy.refuse()            # cut, and close new connections at once
        proxy.forward()           # back to normal

Modes apply to existing and new connections at once. During ``blackhole`` nothing is read:
the bytes wait in the kernel's buffers and flow again after :meth:`forward`, as after a network
stall. ``lose_replies`` cuts at the first bytes the server sends after a request, which over
HTTP/2 (gRPC) may be a flow-control or ping frame sent as the request arrives, before the server
has acted on it: the server then sees the connection close while it may still cancel the request.
``hold_replies`` followed by :meth:`cut` loses a reply at a moment the test chooses instead (for
example once the request's effect is visible to another client). Threads and sockets only,
loopback addresses only (anything else is a :class:`ValueError`). Every thread is a daemon;
:meth:`stop` (or leaving the ``with`` block, or ``lifetime`` seconds after start) closes
everything.
"""

from __future__ import annotations

import contextlib
import ipaddress
import select
import socket
import threading
import time
from collections import deque
from typing import Literal

from fenced.testing._lifecycle import StartStop

__all__ = ["Mode", "TcpProxy"]

Mode = Literal["forward", "delay", "blackhole", "lose_replies", "hold_replies", "refuse"]
_TICK = 0.02
_BUFFER = 64 * 1024


def _loopback(host: str) -> str:
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError) as error:
        raise ValueError(f"{host!r} is not a loopback address") from error
    if not address.is_loopback:
        raise ValueError(f"the proxy only works on loopback, not {host!r}")
    return str(address)


class _Pair:
    """One proxied connection: the client's socket and the server's."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.pending: deque[tuple[float, bytes]] = deque()  # delayed replies: (due, data)
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


class TcpProxy(StartStop):
    """Forwards ``127.0.0.1:port`` to ``target_host:target_port``; see the module docstring."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        port: int = 0,
        lifetime: float | None = 600.0,
    ) -> None:
        self.target = (_loopback(target_host), int(target_port))
        self._listen_host = _loopback(listen_host)
        self._requested_port = port
        self.port = 0
        self._lifetime = lifetime
        self._lock = threading.Lock()
        self._mode: Mode = "forward"
        self._delay = 0.0
        self._pairs: set[_Pair] = set()
        self._listener: socket.socket | None = None
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self.connections = 0
        """Connections accepted so far (for tests)."""

    # -- control ------------------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        return self._mode

    def _listening_socket(self) -> socket.socket:
        """A bound socket to listen on (a lab's relay makes it in another namespace)."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self._listen_host, self._requested_port))
        return listener

    def _server_connection(self) -> socket.socket:
        """A new connection to the target (a lab's inward relay makes it in another
        namespace)."""
        return socket.create_connection(self.target, timeout=5)

    def start(self) -> TcpProxy:
        listener = self._listening_socket()
        listener.listen(128)
        listener.settimeout(_TICK * 5)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._spawn(self._accept_loop, "accept")
        if self._lifetime is not None:
            timer = threading.Timer(self._lifetime, self.stop)
            timer.daemon = True
            timer.start()
        return self

    def forward(self) -> None:
        """Forward everything again (delayed replies still in flight are delivered)."""
        self._set("forward")

    def delay(self, seconds: float) -> None:
        """Deliver every reply (server → client) ``seconds`` late; requests go through."""
        if not seconds >= 0:
            raise ValueError("delay must be >= 0")
        self._delay = float(seconds)
        self._set("delay")

    def blackhole(self) -> None:
        """Keep connections open and forward nothing, in either direction."""
        self._set("blackhole")

    def lose_replies(self) -> None:
        """Forward requests; drop the next reply of each connection and then cut it."""
        self._set("lose_replies")

    def hold_replies(self) -> None:
        """Forward requests; read nothing from the server, so no reply (nor any other byte the
        server sends) reaches the client: they wait in the kernel's buffers until
        :meth:`forward` delivers them, or :meth:`cut` closes the connection with them unread
        (the reply is lost after the server acted on the request). Delayed replies not yet
        delivered are held too."""
        self._set("hold_replies")

    def cut(self) -> None:
        """Close every current connection now (both sides see it closed)."""
        with self._lock:
            pairs = list(self._pairs)
            self._pairs.clear()
        for pair in pairs:
            pair.close()

    def refuse(self) -> None:
        """Cut every connection and close new ones as soon as they are accepted."""
        self._set("refuse")
        self.cut()

    def stop(self) -> None:
        """Close the listening socket and every connection. Idempotent."""
        self._stopped.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.close()
        self.cut()

    def _set(self, mode: Mode) -> None:
        with self._lock:
            self._mode = mode

    def _spawn(self, target: object, name: str, *args: object) -> None:
        thread = threading.Thread(
            target=target,  # type: ignore[arg-type]
            args=args,
            name=f"fenced-proxy-{name}:{self.port}",
            daemon=True,
        )
        self._threads.append(thread)
        thread.start()

    # -- threads ------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            listener = self._listener
            if listener is None:
                return
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            if self._mode == "refuse":
                with contextlib.suppress(OSError):
                    client.close()
                continue
            self._spawn(self._connect_and_pump, "conn", client)

    def _connect_and_pump(self, client: socket.socket) -> None:
        while self._mode == "blackhole" and not self._stopped.is_set():
            time.sleep(_TICK)  # the client is connected (to us) and hears nothing
        try:
            server = self._server_connection()
        except OSError:
            with contextlib.suppress(OSError):
                client.close()
            return
        for sock in (client, server):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(True)
        pair = _Pair(client, server)
        with self._lock:
            if self._stopped.is_set():
                pair.close()
                return
            self._pairs.add(pair)
        try:
            self._pump(pair)
        except OSError:
            pass  # cut() or stop() closed the pair while data was in flight
        finally:
            with self._lock:
                self._pairs.discard(pair)
            pair.close()

    def _pump(self, pair: _Pair) -> None:
        while not pair.closed and not self._stopped.is_set():
            mode = self._mode
            now = time.monotonic()
            while (
                pair.pending
                and mode != "hold_replies"
                and (pair.pending[0][0] <= now or mode != "delay")
            ):
                pair.client.sendall(pair.pending.popleft()[1])
            if mode == "blackhole":
                time.sleep(_TICK)
                continue
            watched = [pair.client] if mode == "hold_replies" else [pair.client, pair.server]
            timeout = _TICK
            if pair.pending and mode != "hold_replies":
                timeout = min(timeout, max(pair.pending[0][0] - now, 0.0))
            try:
                readable, _, _ = select.select(watched, [], [], timeout)
            except (OSError, ValueError):
                return
            if self._mode == "blackhole":
                continue
            for sock in readable:
                if sock is pair.server and self._mode == "hold_replies":
                    continue  # held: left unread
                try:
                    data = sock.recv(_BUFFER)
                except OSError:
                    return
                if not data:
                    return
                if sock is pair.client:
                    pair.server.sendall(data)
                elif self._mode == "lose_replies":
                    return  # drop the reply, then the connection
                elif self._mode == "delay":
                    pair.pending.append((time.monotonic() + self._delay, data))
                else:
                    pair.client.sendall(data)

    def __repr__(self) -> str:
        return f"<TcpProxy 127.0.0.1:{self.port} -> {self.target[0]}:{self.target[1]} {self._mode}>"
