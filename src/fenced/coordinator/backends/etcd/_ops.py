"""The pieces of an etcd transaction, built as etcd's own messages, and what a reply holds.

Compares and puts/gets/deletes (:func:`_cmp`, :func:`_put`, :func:`_get`, :func:`_delete`), the
key-values of a range reply (:func:`_kvs`, :func:`_first`), the decoding of our own values
(:func:`_int_value`, :func:`_owner`, :func:`_handoff`), and :func:`_translated`, which turns a
transport's error into the fenced error: :class:`~fenced.Unavailable` when nothing was applied,
:class:`~fenced.OutcomeUnknown` when a mutating request may have been, and
:class:`~fenced.ConfigurationError` for a permission error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from fenced.coordinator.backends.etcd import _rpc as rpc
from fenced.coordinator.backends.etcd._client import (
    KV,
    EtcdRejected,
    MaybeApplied,
    NotApplied,
    Refused,
)
from fenced.coordinator.backends.etcd._keys import LeaseValue, QueueValue, prefix_end
from fenced.core._errors import ConfigurationError, OutcomeUnknown, Unavailable

_TARGET_FIELD = {
    "CREATE": "create_revision",
    "MOD": "mod_revision",
    "VERSION": "version",
    "LEASE": "lease",
}
_Op = rpc.RequestOp  # a transaction's operation, built as etcd's message (no JSON on the way)


def _cmp(
    key: bytes, target: str, value: int, result: str = "EQUAL", range_end: bytes | None = None
) -> rpc.Compare:
    compare = rpc.Compare(key=key, target=target, result=result, range_end=range_end or b"")
    setattr(compare, _TARGET_FIELD[target], value)
    return compare


def _put(key: bytes, value: bytes, lease: int = 0) -> _Op:
    return _Op(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def _get(key: bytes, range_end: bytes | None = None, **options: Any) -> _Op:
    return _Op(request_range=rpc.RangeRequest(key=key, range_end=range_end or b"", **options))


def _delete(key: bytes, range_end: bytes | None = None) -> _Op:
    return _Op(request_delete_range=rpc.DeleteRangeRequest(key=key, range_end=range_end or b""))


def _waiter_ahead(queue: bytes, rev: int) -> _Op:
    """The read of the key of the waiter just ahead of the one whose key was created at
    ``rev`` in the line ``queue`` (none: that waiter is the head)."""
    return _get(
        queue,
        prefix_end(queue),
        max_create_revision=rev - 1,
        sort_order="DESCEND",
        sort_target="CREATE",
        limit=1,
        keys_only=True,
    )


def _kvs(response: rpc.ResponseOp) -> list[KV]:
    return [KV.from_message(kv) for kv in response.response_range.kvs]


def _first(response: rpc.ResponseOp) -> KV | None:
    found = _kvs(response)
    return found[0] if found else None


@contextlib.contextmanager
def _translated(what: str) -> Iterator[None]:
    """Raise the fenced error for a transport's error inside (``what``: the operation, for the
    message); an :class:`EtcdRejected` other than a permission error passes unchanged."""
    try:
        yield
    except NotApplied as error:
        raise Unavailable(f"etcd: {what}: {error}") from error
    except MaybeApplied as error:
        raise OutcomeUnknown(f"etcd: {what}: {error}") from error
    except Refused as error:
        raise ConfigurationError(f"etcd refused {what}: {error}") from error
    except EtcdRejected as error:
        if error.code in (7, 16):
            raise ConfigurationError(f"etcd refused {what}: {error}") from error
        raise


def _int_value(kv: KV | None) -> tuple[int, int]:
    """``(mod_revision, value)`` of a decimal key such as the minimum (``(0, 0)`` when absent)."""
    if kv is None:
        return 0, 0
    try:
        return kv.mod_revision, int(kv.value)
    except ValueError as error:
        raise ConfigurationError(f"unreadable number in etcd: {kv.value[:50]!r}") from error


def _owner(lease_kv: KV) -> str:
    """The owner secret of a lease key's grant."""
    return LeaseValue.decode(lease_kv.value).owner


def _handoff(queued: KV) -> bool:
    """Can a release hand the lease to the waiter of this queue key?"""
    try:
        return QueueValue.decode(queued.value).handoff
    except (ConfigurationError, TypeError, ValueError):
        return False  # not a value of ours: that waiter takes the lease itself
