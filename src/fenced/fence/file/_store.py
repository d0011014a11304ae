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
   takes most of gc's time, a rename does not. Readers see the same as
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
if the journal changed since the state last did, see
:func:`~fenced.fence.file._journal.journal_mark`), so the largest ``seq`` ever given is always
``max(state seq, last journal line)``. **Op records** travel the same way to ``ops.jsonl``; a
lookup reads the states not yet checkpointed, then ``ops.jsonl`` (only when an ``op_id`` is
given). Both journals are compacted at a checkpoint when they doubled since the last compaction
or hold entries past the retention.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import logging
import os
import uuid
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import BinaryIO

from fenced._drivers.permissions import PRIVATE_DIRECTORY
from fenced.core._errors import ConfigurationError, CorruptData, OutcomeUnknown
from fenced.core._records import Record
from fenced.core._urls import url_of_path
from fenced.fence._ops import OpRecord
from fenced.fence._rules import Head, resolve_mode
from fenced.fence._values import Item, Mode, Publication
from fenced.fence.backend import ORDINARY, Capability, Chooser, FastPath, Intent, StoreOptions
from fenced.fence.file._files import (
    ensure_dir,
    file_size,
    fsync_dir,
    open_creating,
    os_error,
    read_whole,
    translated,
    write_all,
    write_file,
)
from fenced.fence.file._gc import collect_garbage
from fenced.fence.file._journal import (
    append_lines,
    encode_op,
    encode_record,
    journal_mark,
    journal_ops,
    journal_records,
    journal_tail,
    retained,
    to_journal,
)
from fenced.fence.file._layout import (
    JOURNAL,
    LOG,
    META,
    OPS,
    RESOURCE_DIR,
    STATE,
    resource_digest,
)
from fenced.fence.file._lock import flocked
from fenced.fence.file._meta import FORMAT_VERSION, check_meta, create_meta, read_meta
from fenced.fence.file._objects import write_object
from fenced.fence.file._state import State
from fenced.fence.file._statelog import Loaded, ParsedStates, log_line
from fenced.fence.file._transaction import FileTransaction

__all__ = [
    "CHECKPOINT_AT",
    "FORMAT_VERSION",
    "JOURNAL",
    "LOG",
    "OPS",
    "STATE",
    "FileBackend",
    "open_file_backend",
]

log = logging.getLogger("fenced.store")

CHECKPOINT_AT = 64 * 1024
"""Bytes of ``state.log`` (or twice its last line, if more) after which a commit checkpoints."""


def open_file_backend(path: str, mode: Mode | None, options: StoreOptions) -> FileBackend:
    """Open (or create, unless ``options.create`` is False) the file store in directory
    ``path``; see the module docstring."""
    root = Path(os.path.abspath(path))
    where = f"file store {str(root)!r}"
    with translated(f"opening the {where}"):
        if not options.create and not root.exists():
            raise ConfigurationError(f"no fenced store at {root}: it does not exist")
        try:
            ensure_dir(root, PRIVATE_DIRECTORY)  # made by fenced: 0700, as the coordinator's
        except FileNotFoundError as error:
            parent = root.parent
            why = (
                f"the parent directory does not exist ({parent})"
                if not parent.is_dir()
                else f"{parent} refused a new directory ({error.strerror})"
            )
            raise ConfigurationError(f"the {where} cannot be created: {why}") from error
        except FileExistsError as error:
            raise ConfigurationError(f"{where}: exists and is not a directory") from error
        meta = read_meta(root, where)
        if meta is None and not options.create:
            raise ConfigurationError(f"no fenced store at {root}: it has no {META}")
        if meta is None:
            meta = create_meta(root, where, resolve_mode(None, mode, where))
        stored_mode = check_meta(meta, where)
        resolved = resolve_mode(stored_mode, mode, where)
        for sub in ("locks", "resources"):
            ensure_dir(root / sub)
    return FileBackend(root, resolved, options)


# -- the backend -------------------------------------------------------------------------------


class FileBackend:
    """See the module docstring. Created by :func:`open_file_backend`.

    A resource's directory is passed around as a string path (``rdir``). :meth:`lock`,
    :meth:`load` and :meth:`commit` are also what gc (:mod:`fenced.fence.file._gc`) works with.
    """

    capabilities = frozenset(Capability)
    fast_paths: frozenset[FastPath] = frozenset()

    def __init__(self, root: Path, mode: Mode, options: StoreOptions) -> None:
        self.root = root
        self.url = url_of_path("file", str(root))
        self.mode = mode
        self._options = options
        self._busy_timeout = options.busy_timeout
        self._ready: set[str] = set()
        self._parsed = ParsedStates()

    def _dir(self, resource: str) -> str:
        return f"{self.root}/resources/{resource_digest(resource)}"

    def lock(
        self, digest: str, *, then: str = "nothing was changed, retry"
    ) -> AbstractContextManager[None]:
        """The resource's critical section; ``then``: what a timeout's error says after why."""
        return flocked(f"{self.root}/locks/{digest}.lock", self._busy_timeout, then)

    def _ensure(self, rdir: str) -> None:
        if rdir not in self._ready:
            for path in (rdir, f"{rdir}/objects", f"{rdir}/staging"):
                ensure_dir(Path(path))
            self._ready.add(rdir)

    def load(self, rdir: str, resource: str | None) -> Loaded | None:
        """The committed state of a resource directory, None if it has none yet."""
        try:
            log_data: bytes | None = read_whole(f"{rdir}/{LOG}")  # before state.json: see 4.
        except FileNotFoundError:
            log_data = None
        path = f"{rdir}/{STATE}"
        try:
            data = read_whole(path)
        except FileNotFoundError:
            return None
        try:
            loaded = Loaded(self._parsed.parse(data), log_data, self._parsed)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise ConfigurationError(f"corrupt state file {path}: {error}") from error
        name = loaded.base.resource
        if resource_digest(name) != os.path.basename(rdir) or resource not in (None, name):
            raise ConfigurationError(f"corrupt state file {path}: it names {name!r}")
        return loaded

    # -- commits -----------------------------------------------------------------------------

    def commit(self, tx: FileTransaction, *, sync: bool = True) -> None:
        """Commit ``tx.state`` as the next generation (see 2. and 3. in the module docstring).

        ``sync=False`` (gc's own commits, which only forget superseded objects it removed):
        the line is not ``fdatasync``-ed; the next synced line or checkpoint makes it durable,
        and a power failure before that loses it harmlessly (the next gc forgets them again).
        """
        rdir, loaded, state = tx.rdir, tx.loaded, tx.state
        self._ensure(rdir)
        tx.sync_seq()
        state.gen = (loaded.current.gen if loaded is not None else 0) + 1
        if loaded is None:  # the resource's first commit
            self._replace_state(rdir, state, fresh_log=True)
            return
        line, body = log_line(state)
        data = line if loaded.log_clean else b"\n" + line
        fd = open_creating(f"{rdir}/{LOG}", os.O_WRONLY | os.O_APPEND)
        try:
            write_all(fd, data)  # failing before its newline, the line never counts
            try:
                if sync or not loaded.log_exists:
                    os.fdatasync(fd)
                if not loaded.log_exists:
                    fsync_dir(rdir)
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

    def _replace_state(self, rdir: str, state: State, *, fresh_log: bool = False) -> None:
        """Rename ``state`` over ``state.json`` and sync the directory.

        ``fresh_log``: also create an empty ``state.log`` first (the first commit of a resource),
        so that its directory entry is durable with the new state.
        """
        temporary = f"{rdir}/{STATE}.tmp-{uuid.uuid4().hex}"
        body = state.to_json()
        try:
            write_file(temporary, body)
            if fresh_log:
                os.close(open_creating(f"{rdir}/{LOG}", os.O_WRONLY | os.O_TRUNC))
            os.replace(temporary, f"{rdir}/{STATE}")  # the commit point
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise
        try:
            fsync_dir(rdir)
        except OSError as error:
            raise OutcomeUnknown(
                f"committing {state.resource!r}: the state was renamed into place but the "
                f"directory could not be synced ({error}); retry with the same op_id"
            ) from error
        self._parsed.remember(body, state)

    def _retention(self, tx: FileTransaction) -> tuple[float, int, float]:
        """(records before, records kept, op records before): requested, else the options'."""
        now = self._options.clock.wall()
        options = self._options
        before, keep = tx.prune or (now - options.record_retention, options.record_limit)
        ops_before = now - options.op_retention if tx.ops_before is None else tx.ops_before
        return before, keep, ops_before

    def _compaction_due(self, tx: FileTransaction) -> bool:
        """Whether a requested pruning finds a journal to compact."""
        if tx.prune is None and tx.ops_before is None:
            return False
        before, _, ops_before = self._retention(tx)
        state = tx.state
        return (
            file_size(f"{tx.rdir}/{JOURNAL}") > state.compact_at
            or (state.oldest is not None and state.oldest < before)
            or file_size(f"{tx.rdir}/{OPS}") > state.ops_compact_at
            or (state.ops_oldest is not None and state.ops_oldest < ops_before)
        )

    def _checkpoint(self, tx: FileTransaction) -> None:
        """Move the entries of the states since the checkpoint to the journals; checkpoint."""
        assert tx.loaded is not None
        rdir, state = tx.rdir, tx.state
        before, keep, ops_before = self._retention(tx)
        pending = [*tx.loaded.pending(), (state.records, state.ops)]
        records = [r for new, _ in pending for r in new]
        ops = [(o, r) for _, new in pending for o, r in new.items()]
        journal, ops_journal = f"{rdir}/{JOURNAL}", f"{rdir}/{OPS}"

        def records_kept(new: list[Record]) -> list[Record]:
            return retained([*journal_records(journal, state.resource), *new], before, keep)

        def ops_kept(new: list[tuple[str, OpRecord]]) -> list[tuple[str, OpRecord]]:
            newest: dict[str, OpRecord] = {}
            for op_id, record in [*journal_ops(ops_journal), *new]:
                newest.pop(op_id, None)  # keep the order of the newest records
                newest[op_id] = record
            return [(o, r) for o, r in newest.items() if r.recorded_at >= ops_before]

        checkpoint = dataclasses.replace(state, records=[], ops={})
        checkpoint.compact_at, checkpoint.oldest = to_journal(
            journal,
            records,
            encode_record,
            records_kept,
            lambda r: r.at,
            (state.compact_at, state.oldest),
            before,
        )
        checkpoint.ops_compact_at, checkpoint.ops_oldest = to_journal(
            ops_journal,
            ops,
            encode_op,
            ops_kept,
            lambda entry: entry[1].recorded_at,
            (state.ops_compact_at, state.ops_oldest),
            ops_before,
        )
        checkpoint.journal_mark = journal_mark(journal)  # seq accounts for all it holds
        self._replace_state(rdir, checkpoint)  # the same gen as the log's last line
        os.truncate(f"{rdir}/{LOG}", 0)

    # -- the critical section --------------------------------------------------------------

    @contextmanager
    def transaction(self, resource: str, intent: Intent = ORDINARY) -> Iterator[FileTransaction]:
        digest = resource_digest(resource)
        rdir = f"{self.root}/resources/{digest}"
        with translated(f"writing {resource!r}"), self.lock(digest):
            tx = FileTransaction(rdir, self.load(rdir, resource), resource)
            yield tx
            if tx.dirty:
                self.commit(tx)

    # -- records ---------------------------------------------------------------------------

    def record_rejection(self, record: Record) -> None:
        """Append ``record`` to the resource's journal under its lock, without fsync."""
        digest = resource_digest(record.resource)
        rdir = f"{self.root}/resources/{digest}"
        with translated(f"recording a rejection on {record.resource!r}"), self.lock(digest):
            self._ensure(rdir)
            loaded = self.load(rdir, record.resource)
            journal = f"{rdir}/{JOURNAL}"
            tail, clean = journal_tail(journal)
            seq = max(loaded.current.seq if loaded is not None else 0, tail) + 1
            numbered = dataclasses.replace(record, seq=seq)
            append_lines(journal, [encode_record(numbered)], sync=False, clean=clean)

    def history(self, resource: str, after: int, *, since: float, keep: int) -> list[Record]:
        rdir = self._dir(resource)
        with translated(f"reading the records of {resource!r}"):
            loaded = self.load(rdir, resource)  # before the journal: see 4.
            try:
                pending = [r for new, _ in loaded.pending() for r in new] if loaded else []
            except (ValueError, TypeError, KeyError, AttributeError) as error:
                raise ConfigurationError(f"corrupt state log in {rdir}: {error}") from error
            journal = journal_records(f"{rdir}/{JOURNAL}", resource)
        return [r for r in retained([*journal, *pending], since, keep) if r.seq > after]

    def floors(self) -> dict[str, int]:
        found: dict[str, int] = {}
        with translated("reading floors"):
            for rdir in sorted(os.listdir(f"{self.root}/resources")):
                path = f"{self.root}/resources/{rdir}"
                if RESOURCE_DIR.fullmatch(rdir) and os.path.isdir(path):
                    loaded = self.load(path, None)
                    if loaded is not None and loaded.current.head.floor is not None:
                        found[loaded.current.resource] = loaded.current.head.floor
        return found

    # -- reads -----------------------------------------------------------------------------

    def _current(self, resource: str) -> State:
        with translated(f"reading {resource!r}"):
            loaded = self.load(self._dir(resource), resource)
        return loaded.current if loaded is not None else State(resource)

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
                raise os_error(error, f"reading {resource!r}") from error
        raise CorruptData(
            f"the pointer of {resource!r} names a missing object: the store is corrupt"
        )

    # -- objects ---------------------------------------------------------------------------

    def stage(self, resource: str, object_id: str, chunks: Iterable[bytes], now: float) -> None:
        """Write the object durably before any commit can name it (see 1.)."""
        rdir = self._dir(resource)
        what = f"staging an object of {resource!r}"
        with translated(what):
            self._ensure(rdir)
        write_object(rdir, object_id, chunks, now, what)

    def discard(self, resource: str, object_id: str) -> None:
        with contextlib.suppress(OSError):  # best effort: gc removes it later
            os.unlink(f"{self._dir(resource)}/objects/{object_id}")

    def gc(self, choose: Chooser, cutoff: float) -> int:
        """Remove each resource's victims and forget them; free their space: see
        :func:`~fenced.fence.file._gc.collect_garbage`."""
        return collect_garbage(self, choose, cutoff)

    def close(self) -> None:
        self._ready.clear()
