"""The ``file:///dir`` store backend: plain files, written durably, committed by appends.

Layout (no resource name, key or publication name is ever used as a path component; they live
inside the state files, so nothing a caller passes can name a path)::

    dir/fenced-store.json               format, format version and mode
    dir/locks/<sha256(resource)>.lock   flock target of the resource's critical section (no data)
    dir/resources/<sha256(resource)>/
        state.json                      the checkpoint: the resource's state at generation ``gen``
        state.log                       the commits since: one line per commit, the whole new state
        records.jsonl                   the journal of store records, one JSON per line
        ops.jsonl                       the journal of op records, one JSON per line
        objects/<epoch:020d>-<uuid hex> immutable published (or staged) bytes
        staging/<object id>.part        an object being written
    dir/trash/<object id>               removed by gc, its blocks not freed yet (see 5.)

A state holds the binding, the floor, keys and values, pointers, superseded publications, the
last record ``seq`` and a generation ``gen`` (+1 per commit), plus the records and op records
of its own commit that are not in the journals yet. A ``state.log`` line is
``<crc32 hex> <gen> <state JSON>\\n``; the current state is the intact line with the largest
``gen``, or ``state.json`` if its ``gen`` is at least as large. A line that is torn (no newline),
damaged or fails its CRC is ignored by everyone: the state before it stays current.

Ordering, and why an acknowledged publish survives ``kill -9`` and power loss:

1. **Stage** (outside the critical section): the bytes go to ``staging/<id>.part`` in one
   write, the file is renamed to ``objects/<id>``, then it is ``fdatasync``-ed while
   ``objects/`` is ``fsync``-ed on the process's helper thread (the two syncs are independent:
   both need only the rename before them, so the device may take both flushes at once; on a
   journaling file system the first one also commits the rename). ``stage`` waits for both:
   when it returns, the complete object and its name are durable. A process killed before the
   rename leaves a ``.part``; one killed after it leaves a complete object no pointer names (the
   rename comes after the last write, so the page cache holds it all). A power failure before
   the syncs may leave an incomplete object, but no pointer to it can exist yet: pointers are
   written in step 2, after the syncs. ``gc`` removes all of these after the grace period.
2. **Commit** (the critical section): ``flock`` the resource's lock file (up to
   ``busy_timeout``, then :class:`Unavailable`), read ``state.log`` and then ``state.json``,
   decide, append **one** line (the whole new state, ``gen + 1``) with a single ``write`` and
   ``fdatasync`` the log. The append is the commit point: a complete line is visible at once, and
   durable before the mutation returns. A writer killed mid-append leaves a torn line that every
   reader ignores and the next writer starts a new line after. Because every line is derived,
   under the lock, from the newest intact state, and a later line's ``fdatasync`` also persists
   every earlier byte of the file, the durable history of states is a prefix of the committed
   one: the floor and the pointers never move back, and a pointer never names an object that is
   not durable (step 1 finished before the line was written).
3. **Checkpoint** (after a commit, when ``state.log`` exceeds :data:`CHECKPOINT_AT` or twice the
   last line, or when a due journal compaction was requested): the records and op records of
   the states not yet checkpointed are appended to ``records.jsonl`` / ``ops.jsonl`` and
   ``fsync``-ed (or the journal is rewritten without pruned entries: temporary file, ``fsync``,
   rename); then the current state, without them, is written to a temporary file, ``fsync``-ed,
   renamed over ``state.json`` at the **same** ``gen`` and the directory is ``fsync``-ed (which
   also makes a rewritten journal's rename durable); only then is ``state.log`` truncated. A
   crash between these steps leaves entries in a journal *and* in a state (readers keep one per
   ``seq`` / op id), or log lines at or below the checkpoint's ``gen`` (ignored: they are in the
   checkpoint and, from the journal step, in the journals). The checkpoint runs after the commit
   is durable, so its failure is only logged; the next commit tries again.
4. **Readers** take no lock and read ``state.log`` *before* ``state.json``: a checkpoint renames
   ``state.json`` before truncating the log, so whatever the interleaving, they see the newest
   state as of their read of the log. ``history`` reads the journal last, for the same reason.
   An opened object stays readable after ``gc`` unlinks it.

5. **gc** renames its victims from ``objects/`` to ``trash/`` under the resource's lock, and
   the process's reaper thread unlinks them after ``gc`` returned: freeing a large file's blocks
   is most of gc's time (about 0.5 ms per MiB here), a rename is not. Readers see the same as
   with an unlink (the name is gone, an opened object stays readable). At interpreter exit the
   reaper gets a few seconds to finish; whatever is left in ``trash/`` (the process exited or
   was killed first) is unlinked by the next ``gc`` of any process. Then, still under the lock,
   one log line forgets the superseded publications whose objects are gone. On a full disk
   that line may not fit: gc then unlinks ``trash/`` itself first and writes the line after, so
   it frees a full disk instead of failing on it (the line only forgets what is gone: a state
   without it is consistent, and the next gc writes it).

**Records** (:attr:`Capability.RECORDS`): installs and accepted mutations travel in their
commit's line (durable with it, no extra sync) and reach ``records.jsonl`` at a checkpoint. A
rejection appends one line to ``records.jsonl`` under the resource's lock, **without** ``fsync``:
a power failure may lose it (never an accepted record); a process crash cannot. ``seq`` counts
per resource: every commit first raises its ``seq`` to the journal's last intact line (read only
if the journal changed since the state last did, see :func:`_journal_mark`), so the largest
``seq`` ever given is always ``max(state seq, last journal line)``. **Op records** travel
the same way to ``ops.jsonl``; a lookup reads the states not yet checkpointed, then
``ops.jsonl`` (only when an ``op_id`` is given). Both journals are compacted at a checkpoint when
they doubled since the last compaction or hold entries past the retention.

**Format 1** (fenced before the commit log): a resource whose ``state.json`` has version 1 has no
log; its records and op records are all in ``state.json``. The first commit to it (or to a new
resource) writes ``state.json`` itself in format 2, by rename, carrying those entries until the
next checkpoint moves them: a format-1 fenced refuses a format-2 state file, so it can never
commit from a stale ``state.json`` while newer commits sit in the log. Opening a format-1 store
rewrites ``fenced-store.json`` as version 2, so an older fenced refuses the whole store.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from fenced.core import mutants
from fenced.core.errors import (
    ConfigurationError,
    CorruptData,
    FencedError,
    OutcomeUnknown,
    Unavailable,
)
from fenced.core.records import Record, RecordKind
from fenced.fence.backend import Capability, Chooser, StoreOptions
from fenced.fence.background import Background, later
from fenced.fence.ops import OpRecord
from fenced.fence.rules import Head, StoredObject, resolve_mode
from fenced.fence.translated import Translated
from fenced.fence.values import Item, Mode, Publication

__all__ = ["FORMAT_VERSION", "FileBackend", "open_file_backend"]

log = logging.getLogger("fenced.store")

FORMAT = "fenced.file-store"
FORMAT_VERSION = 2
STATE_FORMAT = "fenced.file-state"
STATE_VERSION = 2
META = "fenced-store.json"
STATE = "state.json"
LOG = "state.log"
JOURNAL = "records.jsonl"
OPS = "ops.jsonl"
TRASH = "trash"
CHECKPOINT_AT = 64 * 1024
"""Bytes of ``state.log`` (or twice its last line, if more) after which a commit checkpoints."""
_COMPACT_AT = 256 * 1024  # journal bytes before the first compaction
_TAIL = 1024  # bytes first read from the journal's end to find its last record
_OBJECT_ID = re.compile(r"[0-9]{20}-[0-9a-f]{32}")
_RESOURCE_DIR = re.compile(r"[0-9a-f]{64}")
_CONFIG_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR}
_READ_ONLY_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
_DEBRIS = tuple(f"{name}.tmp-" for name in (STATE, JOURNAL, OPS))


def _os_error(error: OSError, what: str) -> FencedError:
    if error.errno in _CONFIG_ERRNOS:
        return ConfigurationError(f"{what}: {error}")
    return Unavailable(f"{what}: {error}; nothing was changed, retry")


class _translated(Translated):
    """``with _translated(what):`` turns an OSError into the fenced error for doing ``what``."""

    __slots__ = ()
    catches = OSError
    translate = staticmethod(_os_error)


def _fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_all(paths: list[str]) -> None:
    """Unlink each of ``paths`` that still exists (another process's gc may be at it too).

    Best effort, one path at a time: a path that cannot be unlinked (not a file, no permission)
    is left for the next gc and does not stop the others.
    """
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as error:
            log.debug("gc: could not unlink %s: %s", path, error)


def _remove(path: str, trash: str | None) -> None:
    """Take a gc victim out of its ``objects/``: renamed into ``trash`` (its blocks are freed
    later), or unlinked at once if ``trash`` is None or the rename finds no space."""
    try:
        if trash is not None:
            try:
                os.rename(path, f"{trash}/{os.path.basename(path)}")
                return
            except OSError as error:
                if error.errno not in _NO_SPACE:
                    raise
        os.unlink(path)
    except FileNotFoundError:
        pass  # another gc took it meanwhile


def _listing(directory: str | None) -> list[str]:
    """The paths of the entries of ``directory`` (none if it is None or cannot be listed)."""
    if directory is None:
        return []
    try:
        return [entry.path for entry in os.scandir(directory)]
    except OSError as error:
        log.debug("gc: could not list %s: %s", directory, error)
        return []


@dataclass(slots=True)
class _Progress:
    """How far a gc got, for the error that stops it part way."""

    removed: int = 0

    def __str__(self) -> str:
        if not self.removed:
            return "gc removed nothing"
        return (
            f"gc removed {self.removed} unreferenced objects before it stopped (the store is "
            "consistent: every other object is as it was)"
        )


def _ensure_dir(path: Path) -> None:
    """Create ``path`` (its parent exists) and make the new entry durable."""
    if path.is_dir():
        return
    try:
        path.mkdir()
    except FileExistsError:
        if not path.is_dir():
            raise
        return
    _fsync_dir(path.parent)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read(path: str) -> bytes:
    """The bytes of ``path`` up to its size when opened (what is appended later may be left)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        chunks = [os.read(fd, size)]  # a buffer of the file's size, not of a fixed maximum
        while (got := sum(map(len, chunks))) < size and (chunk := os.read(fd, size - got)):
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        os.close(fd)


def _write_file(path: str | Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace(path: str, data: bytes) -> None:
    """Replace ``path`` by a synced temporary file; the caller syncs the directory."""
    temporary = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        _write_file(temporary, data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


@functools.lru_cache(maxsize=4096)
def _hash(resource: str) -> str:
    return hashlib.sha256(resource.encode()).hexdigest()


@contextmanager
def _flocked(path: str, timeout: float, then: str) -> Iterator[None]:
    """Hold an exclusive flock on ``path``; poll up to ``timeout`` seconds, then Unavailable.

    ``then``: what the error says about the caller's state, after the reason.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise Unavailable(
                        f"another writer held the lock {path} for over {timeout}s; {then}"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.01)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


# -- states ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _StoredItem:
    value: str  # base64
    epoch: int
    version: int


@dataclass(frozen=True, slots=True)
class _Superseded:
    object_id: str
    name: str
    epoch: int
    published_at: float
    superseded_at: float


@dataclass(slots=True)
class _State:
    """Everything the store holds for one resource at one generation."""

    resource: str
    head: Head = field(default_factory=Head)
    items: dict[str, _StoredItem] = field(default_factory=dict)
    pointers: dict[str, Publication] = field(default_factory=dict)
    superseded: list[_Superseded] = field(default_factory=list)
    seq: int = 0
    """The largest record seq given so far (rejections in the journal may have larger ones)."""
    gen: int = 0
    records: list[Record] = field(default_factory=list)
    """Records of this state's commit(s) that are not in the journal yet, oldest first."""
    ops: dict[str, OpRecord] = field(default_factory=dict)
    """Op records of this state's commit(s) that are not in ``ops.jsonl`` yet."""
    compact_at: int = _COMPACT_AT
    oldest: float | None = None
    """The time of the oldest record in the journal as of the last checkpoint."""
    ops_compact_at: int = _COMPACT_AT
    ops_oldest: float | None = None
    journal_mark: list[int] | None = None
    """(inode, size, mtime_ns) of the journal when ``seq`` last accounted for it."""
    version: int = STATE_VERSION

    def successor(self) -> _State:
        """A copy to change in a transaction: the same data, no entries of its own yet."""
        return _State(
            self.resource,
            self.head,
            dict(self.items),
            dict(self.pointers),
            list(self.superseded),
            self.seq,
            self.gen,
            [],
            {},
            self.compact_at,
            self.oldest,
            self.ops_compact_at,
            self.ops_oldest,
            self.journal_mark,
            STATE_VERSION,
        )

    def to_json(self) -> bytes:
        document = {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "gen": self.gen,
            "resource": self.resource,
            "coordinator_id": self.head.coordinator_id,
            "floor": self.head.floor,
            "items": {k: [i.value, i.epoch, i.version] for k, i in self.items.items()},
            "pointers": {
                n: [p.epoch, p.object_id, p.sha256, p.size, p.published_at]
                for n, p in self.pointers.items()
            },
            "superseded": [
                [s.object_id, s.name, s.epoch, s.published_at, s.superseded_at]
                for s in self.superseded
            ],
            "ops": {o: _op_json(r) for o, r in self.ops.items()},
            "seq": self.seq,
            "records": [_record_json(r) for r in self.records],
            "compact_at": self.compact_at,
            "oldest": self.oldest,
            "ops_compact_at": self.ops_compact_at,
            "ops_oldest": self.ops_oldest,
            "journal_mark": self.journal_mark,
        }
        return json.dumps(document, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> _State:
        """Parse a state (format 1 or 2); any deviation raises ValueError/TypeError/KeyError."""
        doc = json.loads(data)
        version = doc["version"]
        if doc["format"] != STATE_FORMAT or version not in (1, STATE_VERSION) or version is True:
            raise ValueError(f"unknown state format {doc['format']!r} {version!r}")
        resource = _typed(doc["resource"], str)
        floor = doc["floor"]
        coordinator = doc["coordinator_id"]
        head = Head(
            None if coordinator is None else _typed(coordinator, str),
            None if floor is None else _int(floor),
        )
        items = {
            _typed(k, str): _StoredItem(_typed(v, str), _int(e), _int(n))
            for k, (v, e, n) in doc["items"].items()
        }
        pointers = {
            _typed(n, str): Publication(
                resource, n, _int(e), _object_id(o), _typed(s, str), _int(z), _float(t)
            )
            for n, (e, o, s, z, t) in doc["pointers"].items()
        }
        superseded = [
            _Superseded(_object_id(o), _typed(n, str), _int(e), _float(p), _float(t))
            for o, n, e, p, t in doc["superseded"]
        ]
        ops = {_typed(o, str): _op_from(r) for o, r in doc["ops"].items()}
        # Format 1 gained records later, with optional keys.
        records = [_record_from(r, resource) for r in doc.get("records", [])]
        return cls(
            resource,
            head,
            items,
            pointers,
            superseded,
            _int(doc.get("seq", 0)),
            _int(doc["gen"]) if version == STATE_VERSION else 0,
            records,
            ops,
            _int(doc.get("compact_at", _COMPACT_AT)),
            _optional_float(doc.get("oldest")),
            _int(doc.get("ops_compact_at", _COMPACT_AT)),
            _optional_float(doc.get("ops_oldest")),
            _journal_mark_from(doc.get("journal_mark")),
            version,
        )


def _record_json(record: Record) -> dict[str, object]:
    return {
        "seq": record.seq,
        "at": record.at,
        "kind": record.kind.value,
        "epoch": record.epoch,
        "detail": dict(record.detail),
    }


def _record_from(doc: Any, resource: str) -> Record:
    """A record from its JSON form; any deviation raises ValueError/TypeError/KeyError."""
    detail = _typed(doc["detail"], dict)
    return Record(
        _int(doc["seq"]),
        _float(doc["at"]),
        RecordKind(doc["kind"]),
        resource,
        _int(doc["epoch"]),
        None,
        detail,
    )


def _op_json(record: OpRecord) -> list[object]:
    return [record.digest, record.outcome, record.recorded_at]


def _op_from(doc: Any) -> OpRecord:
    digest, outcome, at = doc
    return OpRecord(_typed(digest, str), _typed(outcome, str), _float(at))


def _line(document: object) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode() + b"\n"


# -- the commit log ----------------------------------------------------------------------------


def _log_line(state: _State) -> tuple[bytes, bytes]:
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


def _last_lines(data: bytes, first: int = 0) -> Iterator[bytes]:
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


class _Parsed:
    """Parsed states by their exact bytes: the same bytes always parse to the same state.

    Saves parsing again the state a process has just written or read (every publish reads the
    head before staging and again under the lock). Parsed states are shared: never change one;
    a transaction changes a :meth:`_State.successor`. No lock (nothing to reset in a forked
    child): a race between threads at worst evicts one entry too many.
    """

    _ENTRIES = 64
    _LARGEST = 256 * 1024

    def __init__(self) -> None:
        self._entries: dict[bytes, _State] = {}

    def parse(self, data: bytes) -> _State:
        state = self._entries.get(data)
        if state is None:
            state = _State.from_json(data)
            self.remember(data, state)
        return state

    def remember(self, data: bytes, state: _State) -> None:
        if len(data) > self._LARGEST:
            return
        entries = self._entries
        entries[data] = state
        while len(entries) > self._ENTRIES:  # the oldest go first
            with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                del entries[next(iter(entries))]


class _Loaded:
    """A resource directory as read at one moment: ``state.log`` first, then ``state.json``."""

    def __init__(self, base: _State, log_data: bytes | None, parsed: _Parsed) -> None:
        self.base = base
        """``state.json``: the checkpoint (or a format-1 state, which never has a log)."""
        self.log_exists = log_data is not None
        self.log_size = len(log_data or b"")
        self.log_clean = not log_data or log_data.endswith(b"\n")
        self._log = (log_data or b"") if base.version == STATE_VERSION else b""
        self.current = base
        """The newest state: the last intact log line if its gen is above the checkpoint's."""
        for line in _last_lines(self._log):
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
                [_record_from(r, self.base.resource) for r in doc["records"]],
                {_typed(o, str): _op_from(r) for o, r in doc["ops"].items()},
            )


# -- the journals ------------------------------------------------------------------------------


def _journal_records(path: str, resource: str) -> list[Record]:
    """Every readable record of a journal (a torn or damaged line is skipped)."""
    try:
        data = _read(path)
    except FileNotFoundError:
        return []
    return [r for line in data.split(b"\n") if (r := _parse_record(line, resource)) is not None]


def _parse_record(line: bytes, resource: str) -> Record | None:
    if not line.strip():
        return None
    try:
        return _record_from(json.loads(line), resource)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None  # a line torn by a power failure, or damaged: diagnostics only


def _journal_mark(path: str) -> list[int] | None:
    """(inode, size, mtime_ns) of a journal, None if it does not exist.

    Rejections only ever append (a larger size, a later mtime) and compactions replace the file
    (another inode): a journal with the mark a state recorded has not changed since.
    """
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return [stat.st_ino, stat.st_size, stat.st_mtime_ns]


def _journal_tail(path: str) -> tuple[int, bool]:
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
            for line in _last_lines(data, 1 if start > 0 else 0):
                record = _parse_record(line, "")
                if record is not None:
                    return record.seq, clean
            if start == 0:
                return 0, clean
            window *= 8
    finally:
        os.close(fd)


def _append_lines(path: str, lines: list[bytes], *, sync: bool, clean: bool | None = None) -> None:
    """Append lines (starting a new line after a torn one); ``fsync`` if ``sync``.

    ``clean``: whether the file ends with a newline, if the caller already knows.
    """
    if clean is None:
        clean = _journal_tail(path)[1]
    data = b"".join(lines) if clean else b"".join([b"\n", *lines])
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        _write_all(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _journal_ops(path: str) -> Iterator[tuple[str, OpRecord]]:
    try:
        data = _read(path)
    except FileNotFoundError:
        return
    for line in data.split(b"\n"):
        with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
            doc = json.loads(line)
            yield _typed(doc["op_id"], str), _op_from(doc["op"])


def _find_journal_op(path: str, op_id: str, needle: bytes) -> OpRecord | None:
    """The newest record of ``op_id`` in ``ops.jsonl``; lines without ``needle`` are skipped."""
    try:
        data = _read(path)
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
                    found = _op_from(doc["op"])
    return found


def _encode_op(entry: tuple[str, OpRecord]) -> bytes:
    return _line({"op_id": entry[0], "op": _op_json(entry[1])})


def _encode_record(record: Record) -> bytes:
    return _line(_record_json(record))


_E = TypeVar("_E")


def _to_journal(
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
    if _size(path) + sum(map(len, lines)) > compact_at or (oldest is not None and oldest < before):
        kept = survivors(entries)
        data = b"".join(encode(e) for e in kept)
        _replace(path, data)
        return max(_COMPACT_AT, 2 * len(data)), min(map(at, kept), default=None)
    if lines:
        _append_lines(path, lines, sync=True)
        if oldest is None:
            oldest = min(map(at, entries))
    return compact_at, oldest


def _retained(records: Iterable[Record], since: float, keep: int) -> list[Record]:
    """One record per seq, in seq order: those dated ``since`` or later among ``keep`` newest."""
    unique = {r.seq: r for r in records}
    newest = [unique[seq] for seq in sorted(unique)][-keep:] if keep > 0 else []
    return [r for r in newest if r.at >= since]


_T = TypeVar("_T")


def _typed(value: Any, kind: type[_T]) -> _T:
    if not isinstance(value, kind):
        raise TypeError(f"expected {kind.__name__}, got {value!r}")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"expected an integer, got {value!r}")
    return _typed(value, int)


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _journal_mark_from(value: Any) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 3:
        raise ValueError(f"bad journal mark {value!r}")
    return [_int(v) for v in value]


def _optional_float(value: Any) -> float | None:
    return None if value is None else _float(value)


def _object_id(value: Any) -> str:
    if not isinstance(value, str) or not _OBJECT_ID.fullmatch(value):
        raise ValueError(f"bad object id {value!r}")
    return value


# -- opening -----------------------------------------------------------------------------------


def open_file_backend(path: str, mode: Mode | None, options: StoreOptions) -> FileBackend:
    """Open (or create) the file store in directory ``path``; see the module docstring."""
    root = Path(os.path.abspath(path))
    where = f"file store {str(root)!r}"
    with _translated(f"opening the {where}"):
        try:
            _ensure_dir(root)
        except FileNotFoundError as error:
            raise ConfigurationError(f"{where}: the parent directory does not exist") from error
        except FileExistsError as error:
            raise ConfigurationError(f"{where}: exists and is not a directory") from error
        meta = _read_meta(root, where)
        if meta is None:
            meta = _create_meta(root, where, resolve_mode(None, mode, where))
        stored_mode = _check_meta(meta, where)
        resolved = resolve_mode(stored_mode, mode, where)
        if meta["version"] < FORMAT_VERSION:
            _upgrade_meta(root, meta)
        for sub in ("locks", "resources"):
            _ensure_dir(root / sub)
    return FileBackend(root, resolved, options)


def _read_meta(root: Path, where: str) -> dict[str, Any] | None:
    try:
        data = (root / META).read_bytes()
    except FileNotFoundError:
        return None
    try:
        meta = json.loads(data)
    except ValueError as error:
        raise ConfigurationError(f"{where}: corrupt {META} ({error})") from error
    if not isinstance(meta, dict):
        raise ConfigurationError(f"{where}: corrupt {META}")
    return meta


def _create_meta(root: Path, where: str, mode: Mode) -> dict[str, Any]:
    """Write the metadata file of a new store; another process may win the race."""
    others = [e for e in os.listdir(root) if e != META and not e.startswith(f".{META}.")]
    if others:
        existing = _read_meta(root, where)  # created by a concurrent opener meanwhile?
        if existing is not None:
            return existing
        raise ConfigurationError(
            f"{where} is not a fenced store: the directory is not empty and has no {META}"
        )
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "mode": mode}
    temporary = root / f".{META}.{uuid.uuid4().hex}"
    _write_file(temporary, json.dumps(meta).encode())
    try:
        os.link(temporary, root / META)  # atomic create-if-absent
    except FileExistsError:
        pass
    finally:
        temporary.unlink()
    _fsync_dir(root)
    created = _read_meta(root, where)
    if created is None:
        raise ConfigurationError(f"{where}: {META} vanished while the store was created")
    return created


def _upgrade_meta(root: Path, meta: dict[str, Any]) -> None:
    """Mark a format-1 store as format 2 (atomically), so that an older fenced refuses it.

    Its resources migrate one by one at their next commit (see the module docstring). An opener
    that may not write the directory leaves it as it is: it cannot commit anything either.
    """
    temporary = root / f".{META}.{uuid.uuid4().hex}"
    try:
        _write_file(temporary, json.dumps({**meta, "version": FORMAT_VERSION}).encode())
        os.replace(temporary, root / META)
        _fsync_dir(root)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        if error.errno not in _READ_ONLY_ERRNOS:
            raise


def _check_meta(meta: dict[str, Any], where: str) -> str:
    if meta.get("format") != FORMAT:
        raise ConfigurationError(f"{where} is not a fenced store ({META} has another format)")
    version = meta.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ConfigurationError(f"{where}: corrupt {META} (version {version!r})")
    if version > FORMAT_VERSION:
        raise ConfigurationError(
            f"{where} has format version {version}, newer than this fenced understands "
            f"({FORMAT_VERSION}): upgrade fenced"
        )
    mode = meta.get("mode")
    if not isinstance(mode, str):
        raise ConfigurationError(f"{where}: corrupt {META} (mode {mode!r})")
    return mode


# -- the backend -------------------------------------------------------------------------------


class FileBackend:
    """See the module docstring. Created by :func:`open_file_backend`.

    Resource directories are handled as strings (``rdir``): a publish touches a dozen paths.
    """

    capabilities = frozenset(Capability)

    def __init__(self, root: Path, mode: Mode, options: StoreOptions) -> None:
        self.root = root
        self.url = f"file://{root}"
        self.mode = mode
        self._options = options
        self._busy_timeout = options.busy_timeout
        self._ready: set[str] = set()
        self._parsed = _Parsed()

    def _dir(self, resource: str) -> str:
        return f"{self.root}/resources/{_hash(resource)}"

    def _lock(
        self, digest: str, *, then: str = "nothing was changed, retry"
    ) -> AbstractContextManager[None]:
        """The resource's critical section; ``then``: what a timeout's error says after why."""
        return _flocked(f"{self.root}/locks/{digest}.lock", self._busy_timeout, then)

    def _ensure(self, rdir: str) -> None:
        if rdir not in self._ready:
            for path in (rdir, f"{rdir}/objects", f"{rdir}/staging"):
                _ensure_dir(Path(path))
            self._ready.add(rdir)

    def _load(self, rdir: str, resource: str | None) -> _Loaded | None:
        """The committed state of a resource directory, None if it has none yet."""
        try:
            log_data: bytes | None = _read(f"{rdir}/{LOG}")  # before state.json: see 4.
        except FileNotFoundError:
            log_data = None
        path = f"{rdir}/{STATE}"
        try:
            data = _read(path)
        except FileNotFoundError:
            return None
        try:
            loaded = _Loaded(self._parsed.parse(data), log_data, self._parsed)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise ConfigurationError(f"corrupt state file {path}: {error}") from error
        name = loaded.base.resource
        if _hash(name) != os.path.basename(rdir) or resource not in (None, name):
            raise ConfigurationError(f"corrupt state file {path}: it names {name!r}")
        return loaded

    # -- commits -----------------------------------------------------------------------------

    def _commit(self, tx: _FileTransaction, *, sync: bool = True) -> None:
        """Commit ``tx.state`` as the next generation (see 2. and 3. in the module docstring).

        ``sync=False`` (gc's own commits, which only forget superseded objects it removed):
        the line is not ``fdatasync``-ed; the next synced line or checkpoint makes it durable,
        and a power failure before that loses it harmlessly (the next gc forgets them again).
        """
        rdir, loaded, state = tx.rdir, tx.loaded, tx.state
        self._ensure(rdir)
        tx.sync_seq()
        state.gen = (loaded.current.gen if loaded is not None else 0) + 1
        if loaded is None or loaded.base.version < STATE_VERSION:
            if loaded is not None:  # format 1: its entries move with the next checkpoint
                state.records = [*loaded.base.records, *state.records]
                state.ops = {**loaded.base.ops, **state.ops}
            self._replace_state(rdir, state, fresh_log=True)
            return
        line, body = _log_line(state)
        data = line if loaded.log_clean else b"\n" + line
        fd = os.open(f"{rdir}/{LOG}", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            _write_all(fd, data)  # failing before its newline, the line never counts
            try:
                if sync or not loaded.log_exists:
                    os.fdatasync(fd)
                if not loaded.log_exists:
                    _fsync_dir(rdir)
            except OSError as error:
                raise OutcomeUnknown(
                    f"committing {state.resource!r}: the commit was written but could not be "
                    f"synced ({error}); retry with the same op_id"
                ) from error
        finally:
            os.close(fd)
        self._parsed.remember(body, state)
        size = loaded.log_size + len(data)
        if size > max(CHECKPOINT_AT, 2 * len(line)) or self._compaction_due(tx):
            try:
                self._checkpoint(tx)
            except Exception as error:  # the commit is durable: a failed checkpoint waits
                log.warning("%s: checkpoint deferred: %s", state.resource, error)

    def _replace_state(self, rdir: str, state: _State, *, fresh_log: bool = False) -> None:
        """Rename ``state`` over ``state.json`` and sync the directory.

        ``fresh_log``: also create an empty ``state.log`` first (the first format-2 commit of a
        resource), so that its directory entry is durable with the new state.
        """
        temporary = f"{rdir}/{STATE}.tmp-{uuid.uuid4().hex}"
        body = state.to_json()
        try:
            _write_file(temporary, body)
            if fresh_log:
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                os.close(os.open(f"{rdir}/{LOG}", flags, 0o644))
            os.replace(temporary, f"{rdir}/{STATE}")  # the commit point
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise
        try:
            _fsync_dir(rdir)
        except OSError as error:
            raise OutcomeUnknown(
                f"committing {state.resource!r}: the state was renamed into place but the "
                f"directory could not be synced ({error}); retry with the same op_id"
            ) from error
        self._parsed.remember(body, state)

    def _retention(self, tx: _FileTransaction) -> tuple[float, int, float]:
        """(records before, records kept, op records before): requested, else the options'."""
        now = self._options.clock.wall()
        options = self._options
        before, keep = tx.prune or (now - options.record_retention, options.record_limit)
        ops_before = now - options.op_retention if tx.ops_before is None else tx.ops_before
        return before, keep, ops_before

    def _compaction_due(self, tx: _FileTransaction) -> bool:
        """Whether a requested pruning finds a journal to compact."""
        if tx.prune is None and tx.ops_before is None:
            return False
        before, _, ops_before = self._retention(tx)
        state = tx.state
        return (
            _size(f"{tx.rdir}/{JOURNAL}") > state.compact_at
            or (state.oldest is not None and state.oldest < before)
            or _size(f"{tx.rdir}/{OPS}") > state.ops_compact_at
            or (state.ops_oldest is not None and state.ops_oldest < ops_before)
        )

    def _checkpoint(self, tx: _FileTransaction) -> None:
        """Move the entries of the states since the checkpoint to the journals; checkpoint."""
        assert tx.loaded is not None
        rdir, state = tx.rdir, tx.state
        before, keep, ops_before = self._retention(tx)
        pending = [*tx.loaded.pending(), (state.records, state.ops)]
        records = [r for new, _ in pending for r in new]
        ops = [(o, r) for _, new in pending for o, r in new.items()]
        journal, ops_journal = f"{rdir}/{JOURNAL}", f"{rdir}/{OPS}"

        def records_kept(new: list[Record]) -> list[Record]:
            return _retained([*_journal_records(journal, state.resource), *new], before, keep)

        def ops_kept(new: list[tuple[str, OpRecord]]) -> list[tuple[str, OpRecord]]:
            newest: dict[str, OpRecord] = {}
            for op_id, record in [*_journal_ops(ops_journal), *new]:
                newest.pop(op_id, None)  # keep the order of the newest records
                newest[op_id] = record
            return [(o, r) for o, r in newest.items() if r.recorded_at >= ops_before]

        checkpoint = dataclasses.replace(state, records=[], ops={})
        checkpoint.compact_at, checkpoint.oldest = _to_journal(
            journal,
            records,
            _encode_record,
            records_kept,
            lambda r: r.at,
            (state.compact_at, state.oldest),
            before,
        )
        checkpoint.ops_compact_at, checkpoint.ops_oldest = _to_journal(
            ops_journal,
            ops,
            _encode_op,
            ops_kept,
            lambda entry: entry[1].recorded_at,
            (state.ops_compact_at, state.ops_oldest),
            ops_before,
        )
        checkpoint.journal_mark = _journal_mark(journal)  # seq accounts for all it holds
        self._replace_state(rdir, checkpoint)  # the same gen as the log's last line
        os.truncate(f"{rdir}/{LOG}", 0)

    # -- the critical section --------------------------------------------------------------

    @contextmanager
    def transaction(self, resource: str) -> Iterator[_FileTransaction]:
        digest = _hash(resource)
        rdir = f"{self.root}/resources/{digest}"
        lock = self._lock(digest)
        if mutants.active("check-then-write"):  # seeded defect of `fenced verify --mutants`
            lock = contextlib.nullcontext()  # check and write are no longer one atomic step
        with _translated(f"writing {resource!r}"), lock:
            tx = _FileTransaction(rdir, self._load(rdir, resource), resource)
            yield tx
            if tx.dirty:
                self._commit(tx)

    # -- records ---------------------------------------------------------------------------

    def record_rejection(self, record: Record) -> None:
        """Append ``record`` to the resource's journal under its lock, without fsync."""
        digest = _hash(record.resource)
        rdir = f"{self.root}/resources/{digest}"
        with _translated(f"recording a rejection on {record.resource!r}"), self._lock(digest):
            self._ensure(rdir)
            loaded = self._load(rdir, record.resource)
            journal = f"{rdir}/{JOURNAL}"
            tail, clean = _journal_tail(journal)
            seq = max(loaded.current.seq if loaded is not None else 0, tail) + 1
            numbered = dataclasses.replace(record, seq=seq)
            _append_lines(journal, [_encode_record(numbered)], sync=False, clean=clean)

    def history(self, resource: str, after: int, *, since: float, keep: int) -> list[Record]:
        rdir = self._dir(resource)
        with _translated(f"reading the records of {resource!r}"):
            loaded = self._load(rdir, resource)  # before the journal: see 4.
            try:
                pending = [r for new, _ in loaded.pending() for r in new] if loaded else []
            except (ValueError, TypeError, KeyError, AttributeError) as error:
                raise ConfigurationError(f"corrupt state log in {rdir}: {error}") from error
            journal = _journal_records(f"{rdir}/{JOURNAL}", resource)
        return [r for r in _retained([*journal, *pending], since, keep) if r.seq > after]

    def floors(self) -> dict[str, int]:
        found: dict[str, int] = {}
        with _translated("reading floors"):
            for rdir in sorted(os.listdir(f"{self.root}/resources")):
                path = f"{self.root}/resources/{rdir}"
                if _RESOURCE_DIR.fullmatch(rdir) and os.path.isdir(path):
                    loaded = self._load(path, None)
                    if loaded is not None and loaded.current.head.floor is not None:
                        found[loaded.current.resource] = loaded.current.head.floor
        return found

    # -- reads -----------------------------------------------------------------------------

    def _current(self, resource: str) -> _State:
        with _translated(f"reading {resource!r}"):
            loaded = self._load(self._dir(resource), resource)
        return loaded.current if loaded is not None else _State(resource)

    def head(self, resource: str) -> Head:
        return self._current(resource).head

    def get(self, resource: str, key: str) -> Item | None:
        stored = self._current(resource).items.get(key)
        if stored is None:
            return None
        try:
            value = base64.b64decode(stored.value, validate=True)
        except binascii.Error as error:
            raise ConfigurationError(f"corrupt value of {resource!r} key {key!r}") from error
        return Item(resource, key, value, stored.epoch, stored.version)

    def pointer(self, resource: str, name: str) -> Publication | None:
        return self._current(resource).pointers.get(name)

    def open_current(self, resource: str, name: str) -> tuple[Publication, BinaryIO] | None:
        for _ in range(3):  # the pointer may move between reading it and opening its object
            publication = self.pointer(resource, name)
            if publication is None:
                return None
            path = f"{self._dir(resource)}/objects/{publication.object_id}"
            try:
                return publication, open(path, "rb")  # the caller closes it
            except FileNotFoundError:
                continue
            except OSError as error:
                raise _os_error(error, f"reading {resource!r}") from error
        raise CorruptData(
            f"the pointer of {resource!r} names a missing object: the store is corrupt"
        )

    # -- objects ---------------------------------------------------------------------------

    def stage(self, resource: str, object_id: str, chunks: Iterable[bytes], now: float) -> None:
        """Write, rename into ``objects/``, then sync the object and the directory (see 1.)."""
        rdir = self._dir(resource)
        what = f"staging an object of {resource!r}"
        with _translated(what):
            self._ensure(rdir)
        part = f"{rdir}/staging/{object_id}.part"
        final = f"{rdir}/objects/{object_id}"
        try:
            with _translated(what):
                fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                for chunk in chunks:  # an error reading the data propagates unchanged
                    with _translated(what):
                        _write_all(fd, chunk)
                with _translated(what):
                    os.utime(fd, (now, now))  # gc measures an unpublished object's idle time
                    os.replace(part, final)  # complete: a crash from here leaves debris for gc
                    # The two syncs are independent (both only need the rename before them,
                    # and both must end before the commit): the name's sync runs on the helper
                    # thread meanwhile, so the device can take both cache flushes at once.
                    named = Background(functools.partial(_fsync_dir, f"{rdir}/objects"))
                    try:
                        os.fdatasync(fd)  # the bytes and the size
                    finally:
                        named.wait()  # the name is durable (or this raises)
            finally:
                os.close(fd)
        except BaseException:
            for path in (part, final):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise

    def discard(self, resource: str, object_id: str) -> None:
        with contextlib.suppress(OSError):  # best effort: gc removes it later
            os.unlink(f"{self._dir(resource)}/objects/{object_id}")

    def gc(self, choose: Chooser, cutoff: float) -> int:
        """Remove each resource's victims and forget them; free their space (see 5.).

        Per resource, under its lock: the victims leave ``objects/`` for ``trash/`` (a victim that
        cannot be renamed for lack of space is unlinked at once), the debris of interrupted
        writes is unlinked, then one log line forgets the superseded publications whose objects
        are gone. The blocks in ``trash/`` are freed on the reaper thread after gc returns,
        except on a full disk: if a line cannot be written for lack of space, gc first unlinks
        everything in ``trash/`` itself, then writes the lines it could not write. A line that
        still does not fit is left to a later gc (logged): it only forgets objects that are
        gone, and the store is consistent without it. So gc needs no free space to free space.

        Not one atomic step: failing part way (an I/O error, a lock held for longer than
        ``busy_timeout``), it leaves the objects it removed removed and every other as it was, in
        a consistent store, and its error says how many it removed; a later gc finishes.
        """
        progress = _Progress()
        try:
            return self._gc(choose, cutoff, progress)
        except OSError as error:
            done = f"{progress}; run gc again to finish"
            if error.errno in _CONFIG_ERRNOS:
                raise ConfigurationError(f"collecting garbage: {error}; {done}") from error
            raise Unavailable(f"collecting garbage: {error}; {done}") from error

    def _gc(self, choose: Chooser, cutoff: float, progress: _Progress) -> int:
        trash: str | None = f"{self.root}/{TRASH}"
        try:
            _ensure_dir(self.root / TRASH)
        except OSError as error:
            if error.errno not in _NO_SPACE:
                raise
            trash = None  # no room for the directory: the victims are unlinked at once
        unrecorded: list[str] = []
        try:
            for name in sorted(os.listdir(f"{self.root}/resources")):
                rdir = f"{self.root}/resources/{name}"
                if _RESOURCE_DIR.fullmatch(name) and os.path.isdir(rdir):
                    with self._lock(name, then=f"{progress}; run gc again to finish"):
                        if not self._collect(rdir, choose, cutoff, trash, progress):
                            unrecorded.append(name)
        finally:  # even if gc stops here: what is in trash/ is freed, at once on a full disk
            doomed = _listing(trash)
            if unrecorded:
                _unlink_all(doomed)
            elif doomed:
                later(functools.partial(_unlink_all, doomed))
        for name in unrecorded:  # space first, then the lines that did not fit
            rdir = f"{self.root}/resources/{name}"
            with self._lock(name, then=f"{progress}; run gc again to finish"):
                if not self._collect(rdir, choose, cutoff, None, progress):
                    log.warning(
                        "gc: no space to record the objects removed from %s; the next gc "
                        "records it",
                        rdir,
                    )
        return progress.removed

    def _collect(
        self, rdir: str, choose: Chooser, cutoff: float, trash: str | None, progress: _Progress
    ) -> bool:
        """gc of one resource directory, inside its critical section.

        Victims go to ``trash`` (unlinked at once if it is None or has no room for them).
        Returns False if the line that forgets the removed publications could not be written
        for lack of space (a torn line that every reader ignores may be left).

        Neither the renames to ``trash/`` nor the unlinks need a sync: an object that reappears
        in ``objects/`` or ``trash/`` after a power failure is unreferenced and goes at the next
        gc.
        """
        loaded = self._load(rdir, None)
        state = loaded.current if loaded is not None else None
        current = {p.object_id: p for p in state.pointers.values()} if state else {}
        superseded = {s.object_id: s for s in state.superseded} if state else {}
        objects: list[StoredObject] = []
        for entry in os.scandir(f"{rdir}/objects"):
            if not _OBJECT_ID.fullmatch(entry.name):
                continue
            if (pub := current.get(entry.name)) is not None:
                objects.append(
                    StoredObject(pub.object_id, cutoff, pub.name, pub.epoch, pub.published_at)
                )
            elif (old := superseded.get(entry.name)) is not None:
                objects.append(
                    StoredObject(
                        old.object_id, old.superseded_at, old.name, old.epoch, old.published_at
                    )
                )
            else:
                objects.append(StoredObject(entry.name, entry.stat().st_mtime))
        victims = choose(objects, set(current))
        for object_id in victims:
            _remove(f"{rdir}/objects/{object_id}", trash)
            progress.removed += 1
        for entry in os.scandir(f"{rdir}/staging"):
            if entry.stat().st_mtime < cutoff:
                os.unlink(entry.path)
        for entry in os.scandir(rdir):
            if entry.name.startswith(_DEBRIS):
                os.unlink(entry.path)  # an interrupted commit or checkpoint: we hold the lock
        if loaded is not None and state is not None:
            present = {o.object_id for o in objects} - set(victims)
            kept = [s for s in state.superseded if s.object_id in present]
            if kept != state.superseded:
                tx = _FileTransaction(rdir, loaded, state.resource)
                tx.state.superseded = kept
                try:
                    self._commit(tx, sync=False)
                except OSError as error:
                    if error.errno not in _NO_SPACE:
                        raise
                    return False
        return True

    def close(self) -> None:
        self._ready.clear()


class _FileTransaction:
    """The :class:`~fenced.fence.backend.Transaction` over one loaded state; committed if dirty."""

    def __init__(self, rdir: str, loaded: _Loaded | None, resource: str) -> None:
        self.rdir = rdir
        self.loaded = loaded
        self.state = loaded.current.successor() if loaded is not None else _State(resource)
        self.dirty = False
        self.prune: tuple[float, int] | None = None
        self.ops_before: float | None = None
        self._seq_synced = False

    def sync_seq(self) -> None:
        """Raise ``seq`` past the records that rejections numbered since the last commit."""
        if self._seq_synced:
            return
        self._seq_synced = True
        journal = f"{self.rdir}/{JOURNAL}"
        mark = _journal_mark(journal)
        if mark != self.state.journal_mark:  # read its last record only if it changed
            self.state.seq = max(self.state.seq, _journal_tail(journal)[0])
            self.state.journal_mark = mark

    def append_record(self, record: Record) -> None:
        self.sync_seq()
        self.state.seq += 1
        r = record
        self.state.records.append(
            Record(self.state.seq, r.at, r.kind, r.resource, r.epoch, r.holder, r.detail)
        )
        self.dirty = True

    def prune_records(self, before: float, keep: int) -> None:
        self.prune = (before, keep)  # applied by the next checkpoint (see 3.)

    def head(self) -> Head:
        return self.state.head

    def set_head(self, head: Head) -> None:
        self.state.head = head
        self.dirty = True

    def op(self, op_id: str) -> OpRecord | None:
        if op_id in self.state.ops:
            return self.state.ops[op_id]
        if self.loaded is None:
            return None
        needle = json.dumps(op_id).encode()
        try:
            for _, ops in reversed(list(self.loaded.pending(needle))):
                if op_id in ops:
                    return ops[op_id]
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise ConfigurationError(f"corrupt state log in {self.rdir}: {error}") from error
        return _find_journal_op(f"{self.rdir}/{OPS}", op_id, needle)

    def record_op(self, op_id: str, record: OpRecord) -> None:
        self.state.ops[op_id] = record
        self.dirty = True

    def prune_ops(self, before: float) -> None:
        self.ops_before = before  # expired records are ignored at once, dropped at a checkpoint

    def version_of(self, key: str) -> int | None:
        stored = self.state.items.get(key)
        return None if stored is None else stored.version

    def put_item(self, item: Item) -> None:
        value = base64.b64encode(item.value).decode()
        self.state.items[item.key] = _StoredItem(value, item.epoch, item.version)
        self.dirty = True

    def pointer(self, name: str) -> Publication | None:
        return self.state.pointers.get(name)

    def has_object(self, object_id: str) -> bool:
        return os.path.isfile(f"{self.rdir}/objects/{object_id}")

    def set_pointer(self, publication: Publication, now: float) -> None:
        old = self.state.pointers.get(publication.name)
        if old is not None:
            self.state.superseded.append(
                _Superseded(old.object_id, old.name, old.epoch, old.published_at, now)
            )
        self.state.pointers[publication.name] = publication
        self.dirty = True
