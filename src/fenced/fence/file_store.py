"""The ``file:///dir`` store backend: plain files, written durably, committed by atomic renames.

Layout (no resource name, key or publication name is ever used as a path component; they live
inside the state files, so nothing a caller passes can name a path)::

    dir/fenced-store.json               format, format version and mode (written once, atomically)
    dir/locks/<sha256(resource)>.lock   flock target of the resource's critical section (no data)
    dir/resources/<sha256(resource)>/
        state.json                      binding, floor, keys and values, pointers, op records,
                                        the newest store records (not yet in the journal)
        records.jsonl                   the journal of older store records, one JSON per line
        objects/<epoch:020d>-<uuid hex> immutable published (or staged) bytes
        staging/<object id>.part        an object being written

* **Critical section**: ``flock`` on the resource's lock file (waiting up to ``busy_timeout``,
  then :class:`Unavailable`), read ``state.json``, decide, write the new state to a temporary
  file, ``fsync`` it, ``rename`` it over ``state.json`` (the commit point), ``fsync`` the
  directory. A process killed at any instant leaves the old or the new state, never a mix.
* **Objects**: written to ``staging/`` and ``fsync``-ed, then renamed into ``objects/``, all
  before the critical section that may point at them. The ``objects/`` directory is ``fsync``-ed
  by the commit that first points at a new object, after the new state file is synced and
  before it is renamed into place: the object is durable before any pointer to it can be. (On
  ext4 this costs nothing: the state file's ``fsync`` already committed the object's rename;
  syncing the directory at staging time instead costs one more journal commit per publish.)
  A killed publisher leaves a ``.part`` file or an unreferenced object; ``gc`` removes both
  after the grace period.
* **Reads** need no lock: ``state.json`` is always a complete file, and an opened object stays
  readable after ``gc`` unlinks it.
* The whole state of a resource is rewritten at every mutation: keep values small and keys few
  per resource (use ``sqlite:///`` for many keys), publish large data.
* **Records** (:attr:`Capability.RECORDS`): an install or accepted mutation appends its record
  to ``state.json``'s pending list, so it commits (durably) with the mutation. Once
  :data:`FLUSH_AT` pending records have accumulated, a commit first appends the already
  committed ones to ``records.jsonl`` and ``fsync``-s it (one extra sync per ``FLUSH_AT``
  mutations), then writes the state without them; a crash in between leaves a record in both
  places, and readers keep one per ``seq``. A rejection appends one line to ``records.jsonl``
  under the resource's lock, **without** ``fsync``: a power failure may lose it (never an
  accepted record); a process crash cannot. ``seq`` counts per resource. The journal is
  compacted (rewritten without pruned records, synced, renamed) when it has doubled since the
  last compaction or holds records past the retention.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from fenced.core import mutants
from fenced.core.errors import ConfigurationError, FencedError, OutcomeUnknown, Unavailable
from fenced.core.records import Record, RecordKind
from fenced.fence.backend import Capability, Chooser, StoreOptions
from fenced.fence.ops import OpRecord
from fenced.fence.rules import Head, StoredObject, resolve_mode
from fenced.fence.values import Item, Mode, Publication

__all__ = ["FORMAT_VERSION", "FileBackend", "open_file_backend"]

FORMAT = "fenced.file-store"
FORMAT_VERSION = 1
META = "fenced-store.json"
STATE = "state.json"
JOURNAL = "records.jsonl"
FLUSH_AT = 32
"""Pending records in ``state.json`` that make the next commit move them to the journal."""
_COMPACT_AT = 256 * 1024  # journal bytes before the first compaction
_TAIL = 64 * 1024  # bytes read from the journal's end to find its largest seq
_OBJECT_ID = re.compile(r"[0-9]{20}-[0-9a-f]{32}")
_RESOURCE_DIR = re.compile(r"[0-9a-f]{64}")
_CONFIG_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR}


def _os_error(error: OSError, what: str) -> FencedError:
    if error.errno in _CONFIG_ERRNOS:
        return ConfigurationError(f"{what}: {error}")
    return Unavailable(f"{what}: {error}; nothing was changed, retry")


@contextmanager
def _translated(what: str) -> Iterator[None]:
    try:
        yield
    except OSError as error:
        raise _os_error(error, what) from error


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "xb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())


def _hash(resource: str) -> str:
    return hashlib.sha256(resource.encode()).hexdigest()


@contextmanager
def _flocked(path: Path, timeout: float) -> Iterator[None]:
    """Hold an exclusive flock on ``path``; poll up to ``timeout`` seconds, then Unavailable."""
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
                        f"another writer held the lock {path} for over {timeout}s; "
                        "nothing was changed, retry"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.01)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


# -- the state file ----------------------------------------------------------------------------


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
    """Everything the store holds for one resource (``state.json``)."""

    resource: str
    head: Head = field(default_factory=Head)
    items: dict[str, _StoredItem] = field(default_factory=dict)
    pointers: dict[str, Publication] = field(default_factory=dict)
    superseded: list[_Superseded] = field(default_factory=list)
    ops: dict[str, OpRecord] = field(default_factory=dict)
    seq: int = 0
    """The largest record seq this state assigned (the journal may hold larger ones)."""
    records: list[Record] = field(default_factory=list)
    """Committed records not yet moved to the journal, oldest first."""
    compact_at: int = _COMPACT_AT
    oldest: float | None = None
    """The time of the oldest record in the journal as of the last flush or compaction."""

    def to_json(self) -> bytes:
        document = {
            "format": "fenced.file-state",
            "version": FORMAT_VERSION,
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
            "ops": {o: [r.digest, r.outcome, r.recorded_at] for o, r in self.ops.items()},
            "seq": self.seq,
            "records": [_record_json(r) for r in self.records],
            "compact_at": self.compact_at,
            "oldest": self.oldest,
        }
        return json.dumps(document, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> _State:
        """Parse a state file; any deviation raises ValueError/TypeError/KeyError."""
        doc = json.loads(data)
        if doc["format"] != "fenced.file-state" or doc["version"] != FORMAT_VERSION:
            raise ValueError(f"unknown state format {doc['format']!r} {doc['version']!r}")
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
        ops = {
            _typed(o, str): OpRecord(_typed(d, str), _typed(x, str), _float(t))
            for o, (d, x, t) in doc["ops"].items()
        }
        # Records came with a later fenced of the same format version: optional keys.
        records = [_record_from(r, resource) for r in doc.get("records", [])]
        oldest = doc.get("oldest")
        return cls(
            resource,
            head,
            items,
            pointers,
            superseded,
            ops,
            _int(doc.get("seq", 0)),
            records,
            _int(doc.get("compact_at", _COMPACT_AT)),
            None if oldest is None else _float(oldest),
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


def _journal_records(path: Path, resource: str) -> list[Record]:
    """Every readable record of a journal (a torn or damaged line is skipped)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return _parse_lines(data, resource)


def _parse_lines(data: bytes, resource: str) -> list[Record]:
    found = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            found.append(_record_from(json.loads(line), resource))
        except (ValueError, TypeError, KeyError, AttributeError):
            continue  # a line torn by a power failure, or damaged: diagnostics only
    return found


def _journal_tail(path: Path) -> tuple[int, bool]:
    """The largest seq among the journal's last lines, and whether it ends with a newline."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0, True
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0, True
        start = max(0, size - _TAIL)
        data = os.pread(fd, size - start, start)
    finally:
        os.close(fd)
    records = _parse_lines(data, "")
    if not records and start > 0:  # no complete line in the tail: read it all (never expected)
        records = _journal_records(path, "")
    return max((r.seq for r in records), default=0), data.endswith(b"\n")


def _append_lines(
    path: Path, records: list[Record], *, sync: bool, clean: bool | None = None
) -> None:
    """Append records as JSON lines (starting a new line after a torn one); fsync if ``sync``.

    ``clean``: whether the journal ends with a newline, if the caller already knows.
    """
    if clean is None:
        clean = _journal_tail(path)[1]
    text = "".join(json.dumps(_record_json(r), separators=(",", ":")) + "\n" for r in records)
    data = text.encode() if clean else b"\n" + text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


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
    """See the module docstring. Created by :func:`open_file_backend`."""

    capabilities = frozenset(Capability)

    def __init__(self, root: Path, mode: Mode, options: StoreOptions) -> None:
        self.root = root
        self.url = f"file://{root}"
        self.mode = mode
        self._busy_timeout = options.busy_timeout
        self._ready: set[Path] = set()

    def _dir(self, resource: str) -> Path:
        return self.root / "resources" / _hash(resource)

    def _lock(self, digest: str) -> AbstractContextManager[None]:
        return _flocked(self.root / "locks" / f"{digest}.lock", self._busy_timeout)

    def _ensure(self, rdir: Path) -> None:
        if rdir not in self._ready:
            for path in (rdir, rdir / "objects", rdir / "staging"):
                _ensure_dir(path)
            self._ready.add(rdir)

    def _load(self, rdir: Path, resource: str | None) -> _State | None:
        """The committed state of a resource directory, None if it has none yet."""
        path = rdir / STATE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            state = _State.from_json(data)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise ConfigurationError(f"corrupt state file {path}: {error}") from error
        if _hash(state.resource) != rdir.name or resource not in (None, state.resource):
            raise ConfigurationError(f"corrupt state file {path}: it names {state.resource!r}")
        return state

    def _save(
        self,
        rdir: Path,
        state: _State,
        *,
        new_objects: bool = False,
        committed: int = 0,
        prune: tuple[float, int] | None = None,
    ) -> None:
        """Commit ``state``; ``new_objects``: it points at objects staged since the last sync.

        ``committed``: how many of ``state.records`` were committed before (they may move to
        the journal now); ``prune``: (before, keep) retention, applied when the journal is
        compacted.
        """
        self._ensure(rdir)
        temporary = rdir / f"{STATE}.tmp-{uuid.uuid4().hex}"
        with _translated(f"writing {state.resource!r}"):
            self._move_records(rdir, state, committed, prune)
            try:
                _write_file(temporary, state.to_json())
                if new_objects:
                    _fsync_dir(rdir / "objects")  # the objects before the pointer to them
                os.replace(temporary, rdir / STATE)  # the commit point
            except BaseException:
                temporary.unlink(missing_ok=True)
                raise
        try:
            _fsync_dir(rdir)
        except OSError as error:
            raise OutcomeUnknown(
                f"committing {state.resource!r}: the state was renamed into place but the "
                f"directory could not be synced ({error}); retry with the same op_id"
            ) from error

    def _move_records(
        self, rdir: Path, state: _State, committed: int, prune: tuple[float, int] | None
    ) -> None:
        """Move committed pending records to the journal (synced); compact it if due."""
        journal = rdir / JOURNAL
        if committed and len(state.records) >= FLUSH_AT:
            moved, state.records = state.records[:committed], state.records[committed:]
            _append_lines(journal, moved, sync=True)
            if state.oldest is None:
                state.oldest = moved[0].at
        if prune is None:
            return
        before, keep = prune
        try:
            size = journal.stat().st_size
        except FileNotFoundError:
            return
        if size > state.compact_at or (state.oldest is not None and state.oldest < before):
            kept = _retained(_journal_records(journal, state.resource), before, keep)
            temporary = rdir / f"{JOURNAL}.tmp-{uuid.uuid4().hex}"
            data = "".join(
                json.dumps(_record_json(r), separators=(",", ":")) + "\n" for r in kept
            ).encode()
            try:
                _write_file(temporary, data)
                os.replace(temporary, journal)  # the directory is synced by the state's commit
            except BaseException:
                temporary.unlink(missing_ok=True)
                raise
            state.compact_at = max(_COMPACT_AT, 2 * len(data))
            state.oldest = kept[0].at if kept else None

    # -- the critical section --------------------------------------------------------------

    @contextmanager
    def transaction(self, resource: str) -> Iterator[_FileTransaction]:
        digest = _hash(resource)
        rdir = self.root / "resources" / digest
        lock = self._lock(digest)
        if mutants.active("check-then-write"):  # seeded defect of `fenced verify --mutants`
            lock = contextlib.nullcontext()  # check and write are no longer one atomic step
        with _translated(f"writing {resource!r}"), lock:
            tx = _FileTransaction(self._load(rdir, resource) or _State(resource), rdir)
            yield tx
            if tx.dirty:
                self._save(
                    rdir,
                    tx.state,
                    new_objects=tx.new_objects,
                    committed=tx.committed_records,
                    prune=tx.prune,
                )

    # -- records ---------------------------------------------------------------------------

    def record_rejection(self, record: Record) -> None:
        """Append ``record`` to the resource's journal under its lock, without fsync."""
        digest = _hash(record.resource)
        rdir = self.root / "resources" / digest
        with _translated(f"recording a rejection on {record.resource!r}"), self._lock(digest):
            self._ensure(rdir)
            state = self._load(rdir, record.resource) or _State(record.resource)
            journal = rdir / JOURNAL
            tail, clean = _journal_tail(journal)
            seq = max(state.seq, tail) + 1
            _append_lines(journal, [dataclasses.replace(record, seq=seq)], sync=False, clean=clean)

    def history(self, resource: str, after: int, *, since: float, keep: int) -> list[Record]:
        rdir = self._dir(resource)
        with _translated(f"reading the records of {resource!r}"):
            state = self._load(rdir, resource)  # before the journal: a flush may run meanwhile
            journal = _journal_records(rdir / JOURNAL, resource)
        pending = state.records if state is not None else []
        return [r for r in _retained([*journal, *pending], since, keep) if r.seq > after]

    def floors(self) -> dict[str, int]:
        found: dict[str, int] = {}
        with _translated("reading floors"):
            for rdir in sorted((self.root / "resources").iterdir()):
                if _RESOURCE_DIR.fullmatch(rdir.name) and rdir.is_dir():
                    state = self._load(rdir, None)
                    if state is not None and state.head.floor is not None:
                        found[state.resource] = state.head.floor
        return found

    # -- reads -----------------------------------------------------------------------------

    def _read(self, resource: str) -> _State:
        with _translated(f"reading {resource!r}"):
            return self._load(self._dir(resource), resource) or _State(resource)

    def head(self, resource: str) -> Head:
        return self._read(resource).head

    def get(self, resource: str, key: str) -> Item | None:
        stored = self._read(resource).items.get(key)
        if stored is None:
            return None
        try:
            value = base64.b64decode(stored.value, validate=True)
        except binascii.Error as error:
            raise ConfigurationError(f"corrupt value of {resource!r} key {key!r}") from error
        return Item(resource, key, value, stored.epoch, stored.version)

    def pointer(self, resource: str, name: str) -> Publication | None:
        return self._read(resource).pointers.get(name)

    def open_current(self, resource: str, name: str) -> tuple[Publication, BinaryIO] | None:
        for _ in range(3):  # the pointer may move between reading it and opening its object
            publication = self.pointer(resource, name)
            if publication is None:
                return None
            path = self._dir(resource) / "objects" / publication.object_id
            try:
                return publication, open(path, "rb")  # the caller closes it
            except FileNotFoundError:
                continue
            except OSError as error:
                raise _os_error(error, f"reading {resource!r}") from error
        raise ConfigurationError(
            f"the pointer of {resource!r} names a missing object: the store is corrupt"
        )

    # -- objects ---------------------------------------------------------------------------

    def stage(self, resource: str, object_id: str, chunks: Iterable[bytes], now: float) -> None:
        rdir = self._dir(resource)
        what = f"staging an object of {resource!r}"
        with _translated(what):
            self._ensure(rdir)
        part = rdir / "staging" / f"{object_id}.part"
        try:
            with _translated(what):
                stream = open(part, "xb")  # noqa: SIM115 - closed below
            with stream:
                for chunk in chunks:  # an error reading the data propagates unchanged
                    with _translated(what):
                        stream.write(chunk)
                with _translated(what):
                    stream.flush()
                    os.fsync(stream.fileno())
            with _translated(what):
                os.utime(part, (now, now))
                os.replace(part, rdir / "objects" / object_id)  # synced by the commit
        except BaseException:
            part.unlink(missing_ok=True)
            raise

    def discard(self, resource: str, object_id: str) -> None:
        with contextlib.suppress(OSError):  # best effort: gc removes it later
            (self._dir(resource) / "objects" / object_id).unlink(missing_ok=True)

    def gc(self, choose: Chooser, cutoff: float) -> int:
        removed = 0
        with _translated("collecting garbage"):
            for rdir in sorted((self.root / "resources").iterdir()):
                if _RESOURCE_DIR.fullmatch(rdir.name) and rdir.is_dir():
                    with self._lock(rdir.name):
                        removed += self._collect(rdir, choose, cutoff)
        return removed

    def _collect(self, rdir: Path, choose: Chooser, cutoff: float) -> int:
        """gc of one resource directory, inside its critical section."""
        state = self._load(rdir, None)
        current = {p.object_id: p for p in state.pointers.values()} if state else {}
        superseded = {s.object_id: s for s in state.superseded} if state else {}
        objects: list[StoredObject] = []
        for entry in os.scandir(rdir / "objects"):
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
            (rdir / "objects" / object_id).unlink(missing_ok=True)
        for entry in os.scandir(rdir / "staging"):
            if entry.stat().st_mtime < cutoff:
                os.unlink(entry.path)
        for entry in os.scandir(rdir):
            if entry.name.startswith((f"{STATE}.tmp-", f"{JOURNAL}.tmp-")):
                os.unlink(entry.path)  # an interrupted commit: we hold the lock
        _fsync_dir(rdir / "objects")
        if state is not None:
            present = {o.object_id for o in objects} - set(victims)
            kept = [s for s in state.superseded if s.object_id in present]
            if kept != state.superseded:
                state.superseded = kept
                self._save(rdir, state)
        return len(victims)

    def close(self) -> None:
        self._ready.clear()


class _FileTransaction:
    """The :class:`~fenced.fence.backend.Transaction` over one loaded state; saved if dirty."""

    def __init__(self, state: _State, rdir: Path) -> None:
        self.state = state
        self.dirty = False
        self.new_objects = False
        self.committed_records = len(state.records)
        self.prune: tuple[float, int] | None = None
        self._rdir = rdir
        self._seq_checked = False

    def append_record(self, record: Record) -> None:
        if not self._seq_checked:  # rejections may have numbered records in the journal
            self.state.seq = max(self.state.seq, _journal_tail(self._rdir / JOURNAL)[0])
            self._seq_checked = True
        self.state.seq += 1
        self.state.records.append(dataclasses.replace(record, seq=self.state.seq))
        self.dirty = True

    def prune_records(self, before: float, keep: int) -> None:
        self.prune = (before, keep)

    def head(self) -> Head:
        return self.state.head

    def set_head(self, head: Head) -> None:
        self.state.head = head
        self.dirty = True

    def op(self, op_id: str) -> OpRecord | None:
        return self.state.ops.get(op_id)

    def record_op(self, op_id: str, record: OpRecord) -> None:
        self.state.ops[op_id] = record
        self.dirty = True

    def prune_ops(self, before: float) -> None:
        expired = [o for o, r in self.state.ops.items() if r.recorded_at < before]
        for op_id in expired:
            del self.state.ops[op_id]
        self.dirty = self.dirty or bool(expired)

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
        return (self._rdir / "objects" / object_id).is_file()

    def set_pointer(self, publication: Publication, now: float) -> None:
        old = self.state.pointers.get(publication.name)
        if old is not None:
            self.state.superseded.append(
                _Superseded(old.object_id, old.name, old.epoch, old.published_at, now)
            )
        self.state.pointers[publication.name] = publication
        self.dirty = self.new_objects = True
