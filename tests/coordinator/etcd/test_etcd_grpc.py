"""The etcd backend's gRPC transport against real etcd members: the gateway's JSON shapes in and
out, and which failures may have been applied
(``fenced.coordinator.backends.etcd._grpc_transport``)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, json_format
from google.protobuf.message import Message

import fenced
from fenced.coordinator.backends.etcd import _rpc as rpc
from fenced.coordinator.backends.etcd._backend import EtcdBackend
from fenced.coordinator.backends.etcd._client import (
    EtcdRejected,
    MaybeApplied,
    NotApplied,
    Transport,
    b64,
    unb64,
)
from fenced.coordinator.backends.etcd._grpc_transport import GrpcTransport
from fenced.coordinator.backends.etcd._messages import to_json, to_message
from fenced.core._errors import ConfigurationError, Unavailable
from fenced.testing.conformance import wait_for
from fenced.testing.etcd import EtcdCluster
from fenced.testing.proxy import TcpProxy

BACKENDS = Path(fenced.__file__).parent / "coordinator" / "backends" / "etcd"


def _key() -> bytes:
    return f"/grpc-test/{uuid.uuid4().hex[:8]}".encode()


def _put(transport: Transport, key: bytes, value: str) -> dict[str, object]:
    return transport.call("kv/put", {"key": b64(key), "value": b64(value)}, mutating=True)


def _value(transport: Transport, key: bytes) -> bytes | None:
    reply = transport.call("kv/range", {"key": b64(key)}, mutating=False)
    kvs = reply.get("kvs", [])
    return unb64(kvs[0]["value"]) if kvs else None


# -- the gateway's JSON shapes ----------------------------------------------------------------


_REQUESTS: list[tuple[type[Message], dict[str, object]]] = [
    (
        rpc.TxnRequest,
        {
            "compare": [
                {"key": b64("a"), "target": "CREATE", "create_revision": "0", "result": "EQUAL"},
                {"key": b64("b"), "target": "MOD", "mod_revision": "17"},
                {
                    "key": b64("q/"),
                    "range_end": b64("q0"),
                    "target": "CREATE",
                    "create_revision": "9",
                    "result": "GREATER",
                },
            ],
            "success": [
                {"request_put": {"key": b64("a"), "value": b64(b"\x00\xff"), "lease": "42"}},
                {"request_delete_range": {"key": b64("c"), "range_end": b64("d")}},
            ],
            "failure": [
                {
                    "request_range": {
                        "key": b64("q/"),
                        "range_end": b64("q0"),
                        "max_create_revision": "8",
                        "sort_order": "DESCEND",
                        "sort_target": "CREATE",
                        "limit": "1",
                        "keys_only": True,
                    }
                }
            ],
        },
    ),
    (rpc.LeaseGrantRequest, {"TTL": "5"}),
    (rpc.LeaseKeepAliveRequest, {"ID": "7587862099633520000"}),
    (rpc.CompactionRequest, {"revision": "12"}),
    (rpc.StatusRequest, {}),
]


def test_requests_are_the_messages_the_gateway_would_decode() -> None:
    """protobuf's own JSON mapping (what etcd's gateway uses) is the oracle."""
    for cls, body in _REQUESTS:
        assert to_message(cls, body) == json_format.ParseDict(body, cls()), cls.__name__


def test_a_request_built_as_its_message_is_sent_as_it_is() -> None:
    """A body that is the request message already is taken as it is; another message where
    that request was expected is a programming error, never a silent conversion."""
    txn = rpc.TxnRequest(success=[rpc.RequestOp(request_put=rpc.PutRequest(key=b"k"))])
    assert to_message(rpc.TxnRequest, txn) is txn
    with pytest.raises(TypeError, match="a PutRequest where a TxnRequest was expected"):
        to_message(rpc.TxnRequest, rpc.PutRequest(key=b"k"))


def test_replies_read_as_the_gateway_writes_them() -> None:
    header = rpc.ResponseHeader(cluster_id=2**63 + 5, member_id=3, revision=99, raft_term=4)
    kv = rpc.KeyValue(key=b"k", value=b"\x00v", create_revision=5, mod_revision=6, version=2)
    replies: list[Message] = [
        rpc.TxnResponse(
            header=header,
            succeeded=False,
            responses=[
                rpc.ResponseOp(response_range=rpc.RangeResponse(header=header, kvs=[kv], count=1)),
                rpc.ResponseOp(response_range=rpc.RangeResponse(header=header)),
                rpc.ResponseOp(response_put=rpc.PutResponse(header=header)),
            ],
        ),
        rpc.LeaseTimeToLiveResponse(header=header, ID=8, TTL=-1, grantedTTL=3, keys=[b"a", b"b"]),
        rpc.StatusResponse(header=header, leader=2**64 - 1, version="3.4.23", isLearner=False),
    ]
    for reply in replies:
        expected = json_format.MessageToDict(reply, preserving_proto_field_name=True)
        assert to_json(reply) == expected, type(reply).__name__


def test_the_checked_in_messages_are_those_of_the_proto(tmp_path: Path) -> None:
    """``etcd_rpc.binpb``, which ``etcd_rpc`` loads, describes exactly ``etcd_rpc.proto``
    (``./dev protos`` recompiles it)."""
    out = tmp_path / "set.pb"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{BACKENDS}",
            f"--descriptor_set_out={out}",
            "etcd_rpc.proto",
        ],
        check=True,
    )
    compiled = out.read_bytes()
    assert (BACKENDS / "etcd_rpc.binpb").read_bytes() == compiled
    loaded = descriptor_pb2.FileDescriptorProto()
    rpc.DESCRIPTOR.CopyToProto(loaded)  # what the pool holds
    checked_in = descriptor_pb2.FileDescriptorSet.FromString(compiled).file[0]
    for described in (loaded, checked_in):  # (whether a pool's copy has JSON names varies)
        messages = list(described.message_type)
        while messages:
            message = messages.pop()
            messages += message.nested_type
            for field in message.field:
                field.ClearField("json_name")
    assert loaded == checked_in


# -- which failures may have been applied --------------------------------------------------------


def test_a_request_to_a_member_that_never_connects_goes_to_the_next_one(
    etcd_cluster: EtcdCluster,
) -> None:
    """A listener that accepts TCP but never speaks HTTP/2: the call is not started there
    (connecting is bounded by connect_timeout), so even a write moves on to the next endpoint."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    member = etcd_cluster.members[0]
    both = GrpcTransport(
        [("127.0.0.1", silent.getsockname()[1]), ("127.0.0.1", member.client_port)],
        timeout=3,
        connect_timeout=0.2,
    )
    alone = GrpcTransport(
        [("127.0.0.1", silent.getsockname()[1])], timeout=0.5, connect_timeout=0.2
    )
    key = _key()
    try:
        _put(both, key, "written")
        assert _value(both, key) == b"written"
        with pytest.raises(NotApplied, match="cannot connect"):
            _put(alone, _key(), "never")
    finally:
        both.close()
        alone.close()
        silent.close()


def test_a_write_whose_reply_is_lost_may_have_been_applied(etcd_cluster: EtcdCluster) -> None:
    """The proxy forwards the request and cuts the connection instead of the reply (or of a
    frame before it: then etcd may cancel the request): an unknown outcome, never retried.

    A frame the server sends on its own (an HTTP/2 ping or window update) between the read and
    the put is cut too, before the put is sent: then the put cannot connect and is NotApplied,
    truthfully (nothing was sent). That window is wider on a loaded machine, so the scenario is
    tried up to three times; each attempt's outcome is checked, and a lost reply must be seen.
    """
    member = etcd_cluster.members[0]
    direct = GrpcTransport([("127.0.0.1", member.client_port)], timeout=2, connect_timeout=1)
    lost_reply_seen = False
    try:
        for _ in range(3):
            key = _key()
            with TcpProxy("127.0.0.1", member.client_port) as proxy:
                proxied = GrpcTransport([("127.0.0.1", proxy.port)], timeout=1, connect_timeout=0.5)
                try:
                    assert _value(proxied, key) is None  # connected
                    proxy.lose_replies()
                    with pytest.raises((MaybeApplied, NotApplied)) as raised:
                        _put(proxied, key, "maybe")
                    if isinstance(raised.value, NotApplied):  # cut before the put was sent
                        assert _value(direct, key) is None
                        continue
                    assert "reply lost" in str(raised.value)
                    assert proxy.connections == 1  # not sent again, on any connection
                    assert _value(direct, key) in (None, b"maybe")
                    proxy.forward()
                    _put(proxied, key, "again")  # a new connection: the cut one is not reused
                    assert _value(direct, key) == b"again"
                    assert proxy.connections == 2
                    lost_reply_seen = True
                    break
                finally:
                    proxied.close()
    finally:
        direct.close()
    assert lost_reply_seen, "three attempts were all cut before the put was sent"


def test_a_late_reply_is_an_unknown_outcome_and_its_connection_is_replaced(
    etcd_cluster: EtcdCluster,
) -> None:
    """A reply later than the time budget: a write may have been applied (not retried), a read
    is retried until the budget ends. The next request goes out on a new connection, not behind
    the late replies."""
    member = etcd_cluster.members[0]
    key = _key()
    with TcpProxy("127.0.0.1", member.client_port) as proxy:
        proxied = GrpcTransport([("127.0.0.1", proxy.port)], timeout=0.4, connect_timeout=0.3)
        try:

            def connected() -> bool:  # (the first connection's handshake may take longer than
                try:  # the 0.3 s budget on a loaded machine: a CI run saw it)
                    return _value(proxied, key) is None
                except NotApplied:
                    return False

            wait_for(connected, timeout=10, what="a first read through the proxy")
            proxy.delay(1.5)
            with pytest.raises(MaybeApplied, match="DEADLINE_EXCEEDED"):
                _put(proxied, key, "late")
            with pytest.raises(NotApplied):
                _value(proxied, key)
            assert proxy.connections >= 2  # the late one was replaced at once
            proxy.forward()

            def written() -> bool:  # (a connection opened while replies were late may still
                try:  # be waiting for its handshake: that read is refused, the next one works)
                    return _value(proxied, key) == b"late"
                except NotApplied:
                    return False

            wait_for(written, timeout=5, what="the late write")
        finally:
            proxied.close()


def test_etcds_own_refusals_keep_their_meaning(etcd_cluster: EtcdCluster) -> None:
    member = etcd_cluster.members[0]
    transport = GrpcTransport([("127.0.0.1", member.client_port)], timeout=2, connect_timeout=1)
    try:
        with pytest.raises(EtcdRejected, match="lease not found") as lease_error:
            transport.call("lease/revoke", {"ID": "12345"}, mutating=True)
        assert lease_error.value.code == 5  # NOT_FOUND
        head = int(str(_put(transport, _key(), "x")["header"]["revision"]))  # type: ignore[index]
        transport.call("kv/compaction", {"revision": str(head)}, mutating=True)
        with pytest.raises(EtcdRejected, match="compacted") as compacted:
            transport.call("kv/range", {"key": b64("x"), "revision": "1"}, mutating=False)
        assert compacted.value.code == 11  # OUT_OF_RANGE
        assert transport.endpoints == [f"127.0.0.1:{member.client_port}"]
    finally:
        transport.close()
    with pytest.raises(NotApplied, match="closed"):
        _value(transport, b"k")


def test_a_member_without_a_leader_refuses_before_applying(tmp_path: Path) -> None:
    """With the two other members stopped, the last one has no leader: etcd's "no leader"
    (asked for by the ``hasleader`` metadata) means not applied, so a write is Unavailable, never
    an unknown outcome."""
    with EtcdCluster(3, tmp_path / "etcd") as cluster:
        survivor = cluster.members[0]
        url = f"etcd://{survivor.endpoint}?timeout=1.5&connect_timeout=0.5"
        coordinator = fenced.connect(url)
        try:
            coordinator.release(coordinator.acquire("r", ttl=5, wait=0))
            for member in cluster.members[1:]:
                cluster.kill(member)
            transport = GrpcTransport(
                [("127.0.0.1", survivor.client_port)], timeout=1.5, connect_timeout=0.5
            )
            try:
                with pytest.raises(NotApplied, match="no leader"):
                    _write_until_refused(transport)
            finally:
                transport.close()
            with pytest.raises(Unavailable, match="no leader"):
                coordinator.acquire("r", ttl=5, wait=0)
        finally:
            coordinator.close()


def _write_until_refused(transport: Transport) -> None:
    """Write until the member refuses (it notices the lost quorum after its election timeout)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            _put(transport, _key(), "x")
        except MaybeApplied:  # a proposal made before the member noticed: may time out
            continue
        time.sleep(0.05)
    raise AssertionError("the member kept accepting writes without a quorum")


# -- the gateway, on request ----------------------------------------------------------------------


def test_the_gateway_api_serves_the_same_coordinator(etcd_cluster: EtcdCluster) -> None:
    prefix = f"/gw-{uuid.uuid4().hex[:6]}"
    gateway = fenced.connect(etcd_cluster.url(prefix=prefix, api="gateway"))
    grpc_client = fenced.connect(etcd_cluster.url(prefix=prefix))
    try:
        backend = gateway._backend
        assert isinstance(backend, EtcdBackend)
        assert type(backend._transport) is Transport
        assert backend.url.endswith(f"?prefix={prefix}&api=gateway")
        lease = gateway.acquire("r", ttl=5, wait=0)
        assert grpc_client.current("r") is not None
        assert gateway.release(lease)
        again = grpc_client.acquire("r", ttl=5, wait=0)
        assert again.epoch == lease.epoch + 1
        grpc_client.release(again)
        assert [r.epoch for r in gateway.history("r")] == [1, 1, 2, 2]
    finally:
        gateway.close()
        grpc_client.close()
    with pytest.raises(ConfigurationError, match="api must be grpc or gateway"):
        fenced.connect(etcd_cluster.url(api="rest"))


def test_without_grpcio_the_error_says_what_to_install(etcd_cluster: EtcdCluster) -> None:
    """In a process where grpcio cannot be imported, ``etcd://`` is refused with a one-line
    error naming the extra and the way around it, and ``?api=gateway`` works."""
    prefix = f"/nogrpc-{uuid.uuid4().hex[:6]}"
    code = f"""
import sys
sys.modules["grpc"] = None  # as if grpcio were not installed
import fenced
from fenced.core._errors import ConfigurationError
try:
    fenced.connect({etcd_cluster.url(prefix=prefix)!r})
except ConfigurationError as error:
    print("refused:", error)
with fenced.connect({etcd_cluster.url(prefix=prefix, api="gateway")!r}) as coord:
    lease = coord.acquire("r", ttl=5, wait=0)
    print("gateway:", coord.release(lease), "grpc" in sys.modules and sys.modules["grpc"])
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "refused: etcd:// over gRPC needs grpcio: pip install 'fenced[etcd]', or add " in (
        done.stdout
    )
    assert "gateway: True None" in done.stdout
