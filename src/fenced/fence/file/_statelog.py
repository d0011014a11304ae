"""The commit log of a resource (``state.log``) and its replay over the checkpoint
(``state.json``).

A log line is ``<crc32 hex> <gen> <state JSON>\\n``, the whole state after one commit. The
current state is the intact line with the largest ``gen``, or ``state.json`` if its ``gen`` is at
least as large. A line that is torn (no newline), damaged or fails its CRC is ignored: the state
before it stays current. :class:`Loaded` is one resource directory as read at one moment, the
log first; a line that parses but names another resource or generation raises ValueError.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Iterator

from fenced.core._records import Record
from fenced.fence._ops import OpRecord
from fenced.fence.file._state import State, op_from, record_from, typed


def log_line(state: State) -> tuple[bytes, bytes]:
    """The log line of ``state``, and the state JSON inside it."""
    body = state.to_json()
    payload = b"%d %s" % (state.gen, body)
    return b"%08x %s\n" % (zlib.crc32(payload), payload), body


def _intact(line: bytes) -> tuple[int, bytes] | None:
    """(gen, state JSON) of a complete log line whose CRC matches, else None."""
    crc, _, payload = line.partition(b" ")
    gen, _, body = payload.partition(b" ")
    try:
        if len(crc) != 8 or int(crc, 16) != zlib.crc32(payload):
            return None
        return int(gen), body
    except ValueError:
        return None


def last_lines(data: bytes, first: int = 0) -> Iterator[bytes]:
    """The complete lines of ``data`` (those ending with a newline), last first.

    ``first``: where the first complete line may start (a line cut by a partial read is skipped).
    """
    end = data.rfind(b"\n")
    while end >= first:
        start = data.rfind(b"\n", 0, end) + 1
        if start == 0 and first > 0:
            return
        yield data[start:end]
        end = start - 1


class ParsedStates:
    """Parsed states by their exact bytes: the same bytes always parse to the same state.

    Saves parsing again the state a process has just written or read (every publish reads the
    head before staging and again under the lock). Parsed states are shared: never change one;
    a transaction changes a :meth:`State.successor`. No lock (nothing to reset in a forked
    child): a race between threads at worst evicts one entry too many.
    """

    _ENTRIES = 64
    _LARGEST = 256 * 1024

    def __init__(self) -> None:
        self._entries: dict[bytes, State] = {}

    def parse(self, data: bytes) -> State:
        state = self._entries.get(data)
        if state is None:
            state = State.from_json(data)
            self.remember(data, state)
        return state

    def remember(self, data: bytes, state: State) -> None:
        if len(data) > self._LARGEST:
            return
        entries = self._entries
        entries[data] = state
        while len(entries) > self._ENTRIES:  # the oldest go first
            with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                del entries[next(iter(entries))]


class Loaded:
    """A resource directory as read at one moment: ``state.log`` first, then ``state.json``."""

    def __init__(self, base: State, log_data: bytes | None, parsed: ParsedStates) -> None:
        self.base = base
        """``state.json``: the checkpoint."""
        self.log_exists = log_data is not None
        self.log_size = len(log_data or b"")
        self.log_clean = not log_data or log_data.endswith(b"\n")
        self._log = log_data or b""
        self.current = base
        """The newest state: the last intact log line if its gen is above the checkpoint's."""
        for line in last_lines(self._log):
            entry = _intact(line)
            if entry is not None:
                if entry[0] > base.gen:
                    self.current = parsed.parse(entry[1])
                    if self.current.gen != entry[0] or self.current.resource != base.resource:
                        raise ValueError(f"the log line of generation {entry[0]} is not its own")
                break

    def pending(
        self, needle: bytes | None = None
    ) -> Iterator[tuple[list[Record], dict[str, OpRecord]]]:
        """The records and op records that may not be in the journals yet, oldest first.

        ``needle``: skip log lines that do not contain these bytes (the base's are always given).
        """
        yield self.base.records, self.base.ops
        for line in self._log.split(b"\n")[:-1]:
            if needle is not None and needle not in line:
                continue
            entry = _intact(line)
            if entry is None or entry[0] <= self.base.gen:
                continue
            if entry[0] == self.current.gen:
                yield self.current.records, self.current.ops
                continue
            doc = json.loads(entry[1])
            if doc["resource"] != self.base.resource:
                raise ValueError(f"the log line of generation {entry[0]} is not its own")
            yield (
                [record_from(r, self.base.resource) for r in doc["records"]],
                {typed(o, str): op_from(r) for o, r in doc["ops"].items()},
            )


# -- the journals ------------------------------------------------------------------------------
