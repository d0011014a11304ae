"""Cross-process wake-ups on one host: Linux abstract-namespace Unix datagram sockets.

A waiter binds a :class:`WakeSocket` to a random abstract address (``"\\0fenced-<16 hex>"``),
publishes the address in the database, and blocks in :meth:`WakeSocket.wait`. Whoever frees the
resource sends one datagram to that address with :meth:`Waker.wake` after its commit. Abstract
addresses live in the kernel, not in the file system: nothing is left behind when a process dies,
and a dead waiter's address refuses datagrams at once, so the sender learns that the waiter is
gone (:attr:`Delivery.DEAD`) and can skip it.

Guarantees and limits:

- Every datagram is a hint, never evidence: any process on the host (of any user) can send one
  to an abstract address it knows or guesses. The woken waiter still asks the database. Lost,
  duplicate, late or forged datagrams cost at most one extra database round; they never break
  mutual exclusion. A datagram may carry a message (at most :data:`MAX_MESSAGE` bytes): the
  embedded backend sends the epoch of a lease it handed to the waiter, which the waiter confirms
  in the database before it believes it. No message carries a secret.
- A sender never blocks: when a waiter's receive buffer is full (it is stopped and many wakes are
  queued) the datagram is dropped and the waiter, which already has one pending, loses nothing.
- Abstract addresses are per network namespace. A waiter in another namespace (a container that
  shares the database file through a volume) cannot be reached: :meth:`Waker.wake` reports
  :attr:`Delivery.UNREACHABLE` and that waiter relies on its ``retry_in`` timer. It is never
  mistaken for a dead one, because the waiter row records its namespace (:data:`NETNS`).
- Linux only (abstract namespace). On other systems :class:`WakeSocket` raises ``OSError``.
"""

from __future__ import annotations

import enum
import errno
import math
import os
import secrets
import select
import socket

__all__ = ["MAX_MESSAGE", "NETNS", "Delivery", "WakeSocket", "Waker"]


def _netns() -> str:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


NETNS = _netns()
"""This process's network namespace (``"net:[4026531840]"``), or ``""`` if unknown."""

_PREFIX = "fenced-"
_WAKE = b"w"
MAX_MESSAGE = 256
"""The largest datagram a :class:`WakeSocket` reads whole (longer ones are cut)."""
_DEAD = frozenset({errno.ECONNREFUSED, errno.ENOENT})
_FULL = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS})


class Delivery(enum.Enum):
    """What happened to one wake-up datagram."""

    DELIVERED = "delivered"
    """Queued at the waiter's socket (or its buffer was already full of wake-ups)."""
    DEAD = "dead"
    """Nobody is bound to the address: the waiting process or its ticket is gone."""
    UNREACHABLE = "unreachable"
    """The waiter lives in another network namespace; it wakes by its own timer."""


class WakeSocket:
    """One waiter's receiving socket, bound to a fresh random abstract address.

    ``address`` is the printable name (without the leading NUL) to publish for senders. Not
    thread-safe: one thread waits on it at a time. Close it when the ticket ends.
    """

    __slots__ = ("_poll", "_sock", "address", "messages")

    def __init__(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            while True:
                address = _PREFIX + secrets.token_hex(8)
                try:
                    sock.bind("\0" + address)
                    break
                except OSError as error:
                    if error.errno != errno.EADDRINUSE:
                        raise
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.address = address
        self.messages: list[bytes] = []
        """Datagrams other than a plain wake-up received by :meth:`wait`, oldest first; the
        reader takes them out."""
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)

    def wait(self, timeout: float) -> bool:
        """Block until a datagram arrives or ``timeout`` seconds pass; True if woken.

        Every datagram already queued is consumed, so one wake-up ends one wait; those that
        carry a message are appended to :attr:`messages`. Returns at once (False) when the
        socket is closed. A signal handler that raises interrupts the wait.
        """
        if self._sock.fileno() < 0:
            return False
        woken = bool(self._poll.poll(max(0, math.ceil(timeout * 1000))))
        if woken:
            self._drain()
        return woken

    def fileno(self) -> int:
        """The socket's descriptor (-1 once closed): an event loop waits on it for reading."""
        return self._sock.fileno()

    def drain(self) -> None:
        """Consume every datagram queued now, as :meth:`wait` does when woken."""
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                datagram = self._sock.recv(MAX_MESSAGE, socket.MSG_DONTWAIT)
            except OSError:  # empty (EAGAIN), or closed by another thread meanwhile
                return
            if datagram != _WAKE:
                self.messages.append(datagram)

    def close(self) -> None:
        """Release the address (senders then see the waiter as gone); idempotent.

        A thread blocked in :meth:`wait` is not woken by this; send it a datagram first.
        """
        self._sock.close()

    @property
    def closed(self) -> bool:
        return self._sock.fileno() < 0


class Waker:
    """The sending side: one unbound, non-blocking datagram socket, safe to share by threads."""

    __slots__ = ("_sock",)

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.setblocking(False)

    def wake(self, address: str, netns: str, message: bytes = _WAKE) -> Delivery:
        """Send one wake-up datagram to ``address`` (as stored by a waiter in ``netns``),
        carrying ``message`` if given (at most :data:`MAX_MESSAGE` bytes).

        Never blocks; a full receive buffer drops the datagram (a message too: the waiter then
        learns what it said from the database). ``DEAD`` means nobody is bound there any more
        (safe to forget the waiter); ``UNREACHABLE`` means the waiter cannot be reached from here
        (it may be alive). Other socket errors propagate as ``OSError``.
        """
        if netns != NETNS:
            return Delivery.UNREACHABLE
        try:
            self._sock.sendto(message, "\0" + address)
        except OSError as error:
            if error.errno in _DEAD:
                return Delivery.DEAD
            if error.errno in _FULL:
                return Delivery.DELIVERED
            raise
        return Delivery.DELIVERED

    def close(self) -> None:
        """Close the sending socket; idempotent."""
        self._sock.close()
