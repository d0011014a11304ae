"""etcd's messages (``etcd_rpc.proto``) and the JSON form etcd's gateway gives them.

:data:`METHODS` maps each gateway path fenced uses (``kv/txn``, …) to etcd's gRPC method, its
request and reply messages. :func:`to_message` and :func:`to_json` convert between a message and
the gateway's JSON (bytes as base64, 64-bit integers as strings, enums by name, fields at their
default left out), exactly as protobuf's own ``json_format`` does (the tests hold them to it).
"""

from __future__ import annotations

import base64
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from fenced.coordinator.backends.etcd import _rpc as rpc

__all__ = ["METHODS", "Json", "to_json", "to_message"]

Json = dict[str, Any]

METHODS: dict[str, tuple[str, type[Message], type[Message], bool]] = {
    "kv/range": ("/etcdserverpb.KV/Range", rpc.RangeRequest, rpc.RangeResponse, False),
    "kv/put": ("/etcdserverpb.KV/Put", rpc.PutRequest, rpc.PutResponse, False),
    "kv/deleterange": (
        "/etcdserverpb.KV/DeleteRange",
        rpc.DeleteRangeRequest,
        rpc.DeleteRangeResponse,
        False,
    ),
    "kv/txn": ("/etcdserverpb.KV/Txn", rpc.TxnRequest, rpc.TxnResponse, False),
    "kv/compaction": (
        "/etcdserverpb.KV/Compact",
        rpc.CompactionRequest,
        rpc.CompactionResponse,
        False,
    ),
    "lease/grant": (
        "/etcdserverpb.Lease/LeaseGrant",
        rpc.LeaseGrantRequest,
        rpc.LeaseGrantResponse,
        False,
    ),
    "lease/revoke": (
        "/etcdserverpb.Lease/LeaseRevoke",
        rpc.LeaseRevokeRequest,
        rpc.LeaseRevokeResponse,
        False,
    ),
    "lease/timetolive": (
        "/etcdserverpb.Lease/LeaseTimeToLive",
        rpc.LeaseTimeToLiveRequest,
        rpc.LeaseTimeToLiveResponse,
        False,
    ),
    "lease/keepalive": (  # a stream in etcd's API: one request, its first reply
        "/etcdserverpb.Lease/LeaseKeepAlive",
        rpc.LeaseKeepAliveRequest,
        rpc.LeaseKeepAliveResponse,
        True,
    ),
    "auth/authenticate": (
        "/etcdserverpb.Auth/Authenticate",
        rpc.AuthenticateRequest,
        rpc.AuthenticateResponse,
        False,
    ),
    "watch": ("/etcdserverpb.Watch/Watch", rpc.WatchRequest, rpc.WatchResponse, True),
    "maintenance/status": (
        "/etcdserverpb.Maintenance/Status",
        rpc.StatusRequest,
        rpc.StatusResponse,
        False,
    ),
}
"""Gateway path → gRPC method, request and reply messages, and whether it is a stream."""


# -- JSON <-> messages ----------------------------------------------------------------------------

_INTEGERS = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_UINT32,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_SINT32,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)
_MESSAGE, _ENUM, _BYTES, _INTEGER, _OTHER = range(5)
_Plan = dict[str, tuple[int, Any, bool]]
_plans: dict[type[Message], _Plan] = {}


def _repeated(field: Any) -> bool:
    """Is ``field`` repeated? (``is_repeated`` in newer protobuf, ``label`` in older ones: 7.x
    has no ``label``.)"""
    repeated = getattr(field, "is_repeated", None)
    if repeated is None:
        return bool(field.label == FieldDescriptor.LABEL_REPEATED)
    return bool(repeated)


def _kind(field: Any) -> int:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return _MESSAGE
    if field.type == FieldDescriptor.TYPE_ENUM:
        return _ENUM
    if field.type == FieldDescriptor.TYPE_BYTES:
        return _BYTES
    return _INTEGER if field.type in _INTEGERS else _OTHER


def _plan(cls: type[Message]) -> _Plan:
    """Per field name of ``cls``: its kind, its message class or enum descriptor, whether it is
    repeated (worked out once per class, for both directions)."""
    plan = _plans.get(cls)
    if plan is None:
        plan = {}
        field: Any
        for field in cls.DESCRIPTOR.fields:
            kind = _kind(field)
            arg: Any = None
            if kind == _MESSAGE:
                arg = GetMessageClass(field.message_type)
            elif kind == _ENUM:
                arg = field.enum_type
            plan[field.name] = (kind, arg, _repeated(field))
        _plans[cls] = plan
    return plan


def _from_json(kind: int, arg: Any, value: Any) -> Any:
    if kind == _MESSAGE:
        return value if isinstance(value, Message) else to_message(arg, value)
    if kind == _BYTES:
        return base64.b64decode(value)
    if kind == _INTEGER:
        return int(value)
    if kind == _ENUM:
        return arg.values_by_name[value].number if isinstance(value, str) else int(value)
    return value


def to_message(cls: type[Message], body: Json | Message, *, strict: bool = True) -> Message:
    """The message ``cls`` that the gateway would decode from ``body`` (its JSON form); a value
    (or a ``body``) that is a message already is taken as it is.

    ``strict``: a field ``cls`` does not have raises ``KeyError`` (in a request: a programming
    error, the gateway would refuse it too); not strict, it is left out (a reply of a newer etcd
    through the gateway)."""
    if isinstance(body, Message):
        if not isinstance(body, cls):
            raise TypeError(f"a {type(body).__name__} where a {cls.__name__} was expected")
        return body
    plan = _plan(cls)
    fields: dict[str, Any] = {}
    for name, value in body.items():
        found = plan.get(name)
        if found is None:
            if strict:
                raise KeyError(f"{cls.__name__} has no field {name!r}")
            continue
        kind, arg, repeated = found
        if repeated:
            fields[name] = [_from_json(kind, arg, item) for item in value]
        else:
            fields[name] = _from_json(kind, arg, value)
    return cls(**fields)


def _to_json(kind: int, arg: Any, value: Any) -> Any:
    if kind == _MESSAGE:
        return to_json(value)
    if kind == _BYTES:
        return base64.b64encode(value).decode("ascii")
    if kind == _INTEGER:
        return str(value)
    if kind == _ENUM:
        return arg.values_by_number[value].name
    return value


def to_json(message: Message) -> Json:
    """``message`` as the gateway would send it: fields set to their default are left out."""
    plan = _plan(type(message))
    out: Json = {}
    for field, value in message.ListFields():
        kind, arg, repeated = plan[field.name]
        if repeated:
            out[field.name] = [_to_json(kind, arg, item) for item in value]
        else:
            out[field.name] = _to_json(kind, arg, value)
    return out
