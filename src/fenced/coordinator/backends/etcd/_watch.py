"""One etcd watch kept going in a daemon thread, over either transport.

:class:`WatchStream` opens etcd's ``Watch`` through :meth:`Transport.open_stream` (a gRPC stream,
or a streaming reply of the JSON gateway), delivers every batch of events once, in order, and
after a broken stream resumes on any endpoint from the revision after the last one delivered.
An expired auth token is renewed before the watch is opened again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from fenced.coordinator.backends.etcd._client import (
    KV,
    RETRY_PAUSE,
    Event,
    NotApplied,
    OpenStream,
    Transport,
    b64,
    error_of,
)
from fenced.coordinator.backends.etcd._messages import Json

__all__ = ["WatchStream"]

log = logging.getLogger("fenced.coordinator.etcd")


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
        self._stream: OpenStream | None = None
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
                self._stopped.wait(RETRY_PAUSE[min(failures, len(RETRY_PAUSE) - 1)])
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
                self._transport.stale_token(str(error), stream.token)
                failures += 1
            finally:
                with self._lock:
                    self._stream = None
                    stream.close()
            if not self._stopped.is_set():
                self._stopped.wait(RETRY_PAUSE[min(failures, len(RETRY_PAUSE) - 1)])

    def _read(self, stream: OpenStream) -> bool:
        """Deliver messages until the stream ends; True when the watch must not be resumed."""
        for message in stream.messages():
            if self._stopped.is_set():
                return True
            if "error" in message:
                self._transport.stale_token(error_of(message)[1], stream.token)
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
