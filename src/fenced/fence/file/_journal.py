"""The journals of a resource: ``records.jsonl`` (store records) and ``ops.jsonl`` (op records).

One JSON document per line. Readers skip a torn or damaged line; writers start a new line after
one. Entries reach a journal at a checkpoint (:func:`to_journal`, synced) or, for rejections,
by an unsynced append; a journal is compacted (rewritten through a synced temporary file and a
rename) when it doubled since its last compaction or holds entries past the retention. The same
entry may be in a journal and in a state not yet checkpointed: readers keep one per ``seq`` (or
op id).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from fenced.core._records import Record
from fenced.fence._ops import OpRecord
from fenced.fence.file._files import (
    file_size,
    open_creating,
    read_whole,
    replace_file,
    write_all,
)
from fenced.fence.file._state import (
    COMPACT_AT,
    json_line,
    op_from,
    op_json,
    record_from,
    record_json,
    typed,
)
from fenced.fence.file._statelog import last_lines

_TAIL = 1024  # bytes first read from the journal's end to find its last record


def journal_records(path: str, resource: str) -> list[Record]:
    """Every readable record of a journal (a torn or damaged line is skipped)."""
    try:
        data = read_whole(path)
    except FileNotFoundError:
        return []
    return [r for line in data.split(b"\n") if (r := _parse_record(line, resource)) is not None]


def _parse_record(line: bytes, resource: str) -> Record | None:
    if not line.strip():
        return None
    try:
        return record_from(json.loads(line), resource)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None  # a line torn by a power failure, or damaged: diagnostics only


def journal_mark(path: str) -> list[int] | None:
    """(inode, size, mtime_ns) of a journal, None if it does not exist.

    Rejections only ever append (a larger size, a later mtime) and compactions replace the file
    (another inode): a journal with the mark a state recorded has not changed since.
    """
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return [stat.st_ino, stat.st_size, stat.st_mtime_ns]


def journal_tail(path: str) -> tuple[int, bool]:
    """The seq of the journal's last intact record, and whether the journal ends with a newline.

    That seq is the journal's largest: rejections append ever larger ones, and everything else
    written to the journal (checkpoints, compactions) is at most the state's ``seq``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0, True
    try:
        size = os.fstat(fd).st_size
        window = _TAIL
        while True:
            start = max(0, size - window)
            data = os.pread(fd, size - start, start)
            clean = not data or data.endswith(b"\n")
            for line in last_lines(data, 1 if start > 0 else 0):
                record = _parse_record(line, "")
                if record is not None:
                    return record.seq, clean
            if start == 0:
                return 0, clean
            window *= 8
    finally:
        os.close(fd)


def append_lines(path: str, lines: list[bytes], *, sync: bool, clean: bool | None = None) -> None:
    """Append lines (starting a new line after a torn one); ``fsync`` if ``sync``.

    ``clean``: whether the file ends with a newline, if the caller already knows.
    """
    if clean is None:
        clean = journal_tail(path)[1]
    data = b"".join(lines) if clean else b"".join([b"\n", *lines])
    fd = open_creating(path, os.O_WRONLY | os.O_APPEND)
    try:
        write_all(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def journal_ops(path: str) -> Iterator[tuple[str, OpRecord]]:
    try:
        data = read_whole(path)
    except FileNotFoundError:
        return
    for line in data.split(b"\n"):
        with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
            doc = json.loads(line)
            yield typed(doc["op_id"], str), op_from(doc["op"])


def find_journal_op(path: str, op_id: str, needle: bytes) -> OpRecord | None:
    """The newest record of ``op_id`` in ``ops.jsonl``; lines without ``needle`` are skipped."""
    try:
        data = read_whole(path)
    except FileNotFoundError:
        return None
    if needle not in data:
        return None
    found = None
    for line in data.split(b"\n"):
        if needle in line:
            with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
                doc = json.loads(line)
                if doc["op_id"] == op_id:
                    found = op_from(doc["op"])
    return found


def encode_op(entry: tuple[str, OpRecord]) -> bytes:
    return json_line({"op_id": entry[0], "op": op_json(entry[1])})


def encode_record(record: Record) -> bytes:
    return json_line(record_json(record))


_E = TypeVar("_E")


def to_journal(
    path: str,
    entries: list[_E],
    encode: Callable[[_E], bytes],
    survivors: Callable[[list[_E]], list[_E]],
    at: Callable[[_E], float],
    bounds: tuple[int, float | None],
    before: float,
) -> tuple[int, float | None]:
    """Move ``entries`` to a journal (synced); returns its new (compact_at, oldest).

    The journal is rewritten with ``survivors(old + new)`` instead when it has grown past
    ``compact_at`` or its oldest entry is older than ``before``; the caller syncs the directory.
    """
    compact_at, oldest = bounds
    lines = [encode(e) for e in entries]
    if file_size(path) + sum(map(len, lines)) > compact_at or (
        oldest is not None and oldest < before
    ):
        kept = survivors(entries)
        data = b"".join(encode(e) for e in kept)
        replace_file(path, data)
        return max(COMPACT_AT, 2 * len(data)), min(map(at, kept), default=None)
    if lines:
        append_lines(path, lines, sync=True)
        if oldest is None:
            oldest = min(map(at, entries))
    return compact_at, oldest


def retained(records: Iterable[Record], since: float, keep: int) -> list[Record]:
    """One record per seq, in seq order: those dated ``since`` or later among ``keep`` newest."""
    unique = {r.seq: r for r in records}
    newest = [unique[seq] for seq in sorted(unique)][-keep:] if keep > 0 else []
    return [r for r in newest if r.at >= since]
