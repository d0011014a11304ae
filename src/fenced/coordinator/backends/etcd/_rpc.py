"""etcd's messages that fenced uses, built when this module is imported (no generated code).

``etcd_rpc.proto`` is the subset of etcd's ``api/etcdserverpb/rpc.proto`` and
``api/mvccpb/kv.proto`` that the etcd backend sends and reads: etcd's message names, field
numbers and types, in a package of fenced's own (``fenced.etcd``). ``./dev protos`` compiles it
into ``etcd_rpc.binpb`` (a serialized ``FileDescriptorSet``, shipped with the package) and
``etcd_rpc.pyi`` (the types, for mypy). This module loads that descriptor into a descriptor pool
of its own and makes each message's class with ``message_factory.GetMessageClass``.

Why not protoc's ``etcd_rpc_pb2.py``: generated code carries the protobuf version it was made
with, and protobuf's runtime refuses code that is too old or too new for it — the failure that
made the ``etcd3`` package unusable with today's protobuf. A serialized descriptor has no such
version: this module works with every protobuf from 4.25 to 7.x (tested), and needs no
regeneration when protobuf moves on. The private pool also keeps these messages apart from any
other etcd client's in the same process.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message_factory import GetMessageClass

__all__ = [
    "DESCRIPTOR",
    "AuthenticateRequest",
    "AuthenticateResponse",
    "CompactionRequest",
    "CompactionResponse",
    "Compare",
    "DeleteRangeRequest",
    "DeleteRangeResponse",
    "Event",
    "KeyValue",
    "LeaseGrantRequest",
    "LeaseGrantResponse",
    "LeaseKeepAliveRequest",
    "LeaseKeepAliveResponse",
    "LeaseRevokeRequest",
    "LeaseRevokeResponse",
    "LeaseTimeToLiveRequest",
    "LeaseTimeToLiveResponse",
    "PutRequest",
    "PutResponse",
    "RangeRequest",
    "RangeResponse",
    "RequestOp",
    "ResponseHeader",
    "ResponseOp",
    "StatusRequest",
    "StatusResponse",
    "TxnRequest",
    "TxnResponse",
    "WatchCancelRequest",
    "WatchCreateRequest",
    "WatchProgressRequest",
    "WatchRequest",
    "WatchResponse",
]

_SET = descriptor_pb2.FileDescriptorSet.FromString(
    files(__package__).joinpath("etcd_rpc.binpb").read_bytes()
)
_POOL = descriptor_pool.DescriptorPool()
for _file in _SET.file:
    _POOL.AddSerializedFile(_file.SerializeToString())
DESCRIPTOR: Any = _POOL.FindFileByName("etcd_rpc.proto")


def _message(name: str) -> Any:
    return GetMessageClass(DESCRIPTOR.message_types_by_name[name])


ResponseHeader = _message("ResponseHeader")
KeyValue = _message("KeyValue")
RangeRequest = _message("RangeRequest")
RangeResponse = _message("RangeResponse")
PutRequest = _message("PutRequest")
PutResponse = _message("PutResponse")
DeleteRangeRequest = _message("DeleteRangeRequest")
DeleteRangeResponse = _message("DeleteRangeResponse")
RequestOp = _message("RequestOp")
ResponseOp = _message("ResponseOp")
Compare = _message("Compare")
TxnRequest = _message("TxnRequest")
TxnResponse = _message("TxnResponse")
CompactionRequest = _message("CompactionRequest")
CompactionResponse = _message("CompactionResponse")
LeaseGrantRequest = _message("LeaseGrantRequest")
LeaseGrantResponse = _message("LeaseGrantResponse")
LeaseRevokeRequest = _message("LeaseRevokeRequest")
LeaseRevokeResponse = _message("LeaseRevokeResponse")
LeaseKeepAliveRequest = _message("LeaseKeepAliveRequest")
LeaseKeepAliveResponse = _message("LeaseKeepAliveResponse")
LeaseTimeToLiveRequest = _message("LeaseTimeToLiveRequest")
LeaseTimeToLiveResponse = _message("LeaseTimeToLiveResponse")
StatusRequest = _message("StatusRequest")
StatusResponse = _message("StatusResponse")
AuthenticateRequest = _message("AuthenticateRequest")
AuthenticateResponse = _message("AuthenticateResponse")
Event = _message("Event")
WatchCreateRequest = _message("WatchCreateRequest")
WatchCancelRequest = _message("WatchCancelRequest")
WatchProgressRequest = _message("WatchProgressRequest")
WatchRequest = _message("WatchRequest")
WatchResponse = _message("WatchResponse")
