"""The file store's :class:`~fenced.fence.backend.Transaction`: changes to one loaded state.

A :class:`FileTransaction` changes a copy (:meth:`~fenced.fence.file._state.State.successor`) of
the resource's current state; the backend commits it, inside the resource's critical section,
only if it changed something (``dirty``). Prunings it asks for are applied by the next
checkpoint. A state log it cannot parse is a :class:`~fenced.ConfigurationError`.
"""

from __future__ import annotations

import base64
import json
import os

from fenced.core._errors import ConfigurationError
from fenced.core._records import Record
from fenced.fence._ops import OpRecord
from fenced.fence._rules import Head
from fenced.fence._values import Item, Publication
from fenced.fence.file._journal import find_journal_op, journal_mark, journal_tail
from fenced.fence.file._layout import JOURNAL, OPS
from fenced.fence.file._state import State, StoredItem, Superseded
from fenced.fence.file._statelog import Loaded


class FileTransaction:
    """The :class:`~fenced.fence.backend.Transaction` over one loaded state; committed if dirty."""

    def __init__(self, rdir: str, loaded: Loaded | None, resource: str) -> None:
        self.rdir = rdir
        self.loaded = loaded
        self.state = loaded.current.successor() if loaded is not None else State(resource)
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
        mark = journal_mark(journal)
        if mark != self.state.journal_mark:  # read its last record only if it changed
            self.state.seq = max(self.state.seq, journal_tail(journal)[0])
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
        self.prune = (before, keep)  # applied by the next checkpoint

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
        return find_journal_op(f"{self.rdir}/{OPS}", op_id, needle)

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
        self.state.items[item.key] = StoredItem(value, item.epoch, item.version)
        self.dirty = True

    def pointer(self, name: str) -> Publication | None:
        return self.state.pointers.get(name)

    def has_object(self, object_id: str) -> bool:
        return os.path.isfile(f"{self.rdir}/objects/{object_id}")

    def set_pointer(self, publication: Publication, now: float) -> None:
        old = self.state.pointers.get(publication.name)
        if old is not None:
            self.state.superseded.append(
                Superseded(old.object_id, old.name, old.epoch, old.published_at, now)
            )
        self.state.pointers[publication.name] = publication
        self.dirty = True
