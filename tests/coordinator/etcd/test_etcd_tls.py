"""etcd over mutual TLS with users: ``etcds://`` against a 3-member cluster started here.

The cluster (module fixture) runs TLS on client and peer connections with
``--client-cert-auth`` and ``--peer-client-cert-auth``, certificates from a CA made in the test
(``fenced.testing.tls``), authentication enabled (``root`` plus a ``fenced`` user whose role may
read and write only under ``/tls``) and auth tokens that expire after 1 s of disuse
(``--auth-token-ttl 1``): every test here also exercises getting a new token.

What is checked: the coordinator conformance suite passes over TLS with a user, on gRPC and on
the gateway (``?api=gateway``); a lease held across many token expiries is never lost; a member
restarted with a rotated server certificate (same CA) is reconnected to without losing a held
lease; a wrong CA, an expired server certificate, a server name mismatch, a missing client
certificate, a plaintext URL against the TLS cluster and ``etcds://`` against a plaintext member
each fail fast with one line naming the cause; a wrong password, a user without permission on the
prefix and a missing user each get a ConfigurationError naming the cause; passwords never appear
in errors, ``repr`` or the URL fenced shows; ``fenced verify`` passes over TLS with a user; the
least-privilege commands of docs/etcd.md, run as written on a fresh cluster, are enough for a
worker on ``/fenced`` and refuse it elsewhere.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import fenced
from fenced import Coordinator
from fenced.coordinator.backends.etcd._backend import EtcdBackend
from fenced.core._errors import ConfigurationError, Unavailable
from fenced.testing._threads import ResultThread
from fenced.testing.conformance import CoordinatorConformance, wait_for
from fenced.testing.etcd import EtcdCluster
from fenced.testing.tls import Authority
from fenced.verify._target import Target
from support.verify_networked import assert_verify_passes

PASSWORD = "hunter2-Secret"
ROOT_PASSWORD = "root-Secret-9"
R = "exports/tls"


@pytest.fixture(scope="module")
def tls_cluster() -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(3, tls=True, extra_args=("--auth-token-ttl", "1", "--bcrypt-cost", "4"))
    with cluster:
        cluster.enable_auth(ROOT_PASSWORD)
        cluster.add_user("fenced", PASSWORD, "/tls")
        cluster.add_user("nobody", PASSWORD, "/elsewhere")
        yield cluster


def _prefix() -> str:
    return "/tls/t" + uuid.uuid4().hex[:10]


def _url(cluster: EtcdCluster, **params: object) -> str:
    return cluster.url(prefix=_prefix(), user=f"fenced:{PASSWORD}", timeout=2, **params)


class TestEtcdOverTlsWithAUser(CoordinatorConformance):
    @pytest.fixture
    def url(self, tls_cluster: EtcdCluster) -> str:
        return _url(tls_cluster)


class TestEtcdGatewayOverTlsWithAUser(CoordinatorConformance):
    @pytest.fixture
    def url(self, tls_cluster: EtcdCluster) -> str:
        return _url(tls_cluster, api="gateway")


def _refreshes(coord: Coordinator) -> int:
    backend = coord.backend
    assert isinstance(backend, EtcdBackend)
    return backend._transport.token_refreshes


@pytest.mark.parametrize("api", ["grpc", "gateway"])
def test_a_lease_held_across_token_expiries_is_never_lost(
    tls_cluster: EtcdCluster, api: str
) -> None:
    with fenced.connect(_url(tls_cluster, api=api)) as coord:
        with coord.hold(R, ttl=4, wait=0) as held:
            start = _refreshes(coord)
            # tokens die after 1 s unused; keep-alives come every 0.8 s, renewals every ~1.3 s,
            # so some find their token expired: the lease must stay held throughout
            wait_for(lambda: _refreshes(coord) >= start + 2, 15, "tokens to expire and renew")
            held.check()  # raises unless HELD
            assert not held.lost.is_set()
            info = coord.current(R)
            assert info is not None and info.epoch == held.token.epoch
        assert coord.history(R)[-1].kind.name == "RELEASED"


def test_a_member_restarted_with_a_rotated_certificate_is_reconnected(
    tls_cluster: EtcdCluster,
) -> None:
    with fenced.connect(_url(tls_cluster)) as coord:
        with coord.hold(R, ttl=6, wait=0) as held:
            for member in list(tls_cluster.members):
                old = member.certificate.cert.read_bytes()
                tls_cluster.rotate_certificate(member)
                assert member.certificate.cert.read_bytes() != old
                tls_cluster.wait_ready()
            lease = coord.acquire("exports/after-rotation", ttl=5, wait=0)
            coord.release(lease)
            info = coord.current(R)
            assert info is not None and info.epoch == held.token.epoch
            held.check()
            assert not held.lost.is_set()
        assert coord.history(R)[-1].kind.name == "RELEASED"


def _refused(url: str, *, kind: type[Exception] = ConfigurationError) -> str:
    started = time.monotonic()
    with pytest.raises(kind) as caught:
        fenced.connect(url).close()
    assert time.monotonic() - started < 4  # fails at once: no wait for the budget, no hang
    message = str(caught.value)
    assert "\n" not in message and PASSWORD not in message
    return message


def test_tls_faults_are_one_line_naming_the_cause(tls_cluster: EtcdCluster, tmp_path: Path) -> None:
    other = Authority(tmp_path, "other-ca")
    message = _refused(_url(tls_cluster, ca=other.cert))
    assert "unable to get local issuer certificate" in message
    message = _refused(_url(tls_cluster, server_name="somebody.else.test"))
    assert "Hostname mismatch" in message and "somebody.else.test" in message
    message = _refused(_url(tls_cluster, cert=None, key=None))
    assert "wants a client certificate" in message
    stranger = other.issue("stranger", common_name="fenced", client=True)
    message = _refused(_url(tls_cluster, cert=stranger.cert, key=stranger.key))
    assert "refused the client certificate" in message
    # a certificate issued to a name: right with server_name, the address alone is refused
    named = tls_cluster.members[0]
    url = tls_cluster.url(
        prefix=_prefix(), user=f"fenced:{PASSWORD}", server_name=f"{named.name}.etcd.test"
    ).replace(",".join(tls_cluster.endpoints), named.endpoint)
    with fenced.connect(url) as coord:
        coord.release(coord.acquire(R, ttl=2, wait=0))


def test_an_expired_server_certificate_is_named(tmp_path: Path) -> None:
    with EtcdCluster(1, tls=True) as cluster:
        member = cluster.members[0]
        cluster.kill(member, 15)
        member.certificate = cluster.authority.issue(
            "expired-server", hosts=[member.host], client=True, expired=True
        )
        cluster._spawn(member, "existing")
        wait_for(lambda: _listening(member.host, member.client_port), 10, "the member")
        message = _refused(cluster.url(prefix=_prefix()))
        assert "certificate has expired" in message


def _listening(host: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((host, port), timeout=0.2).close()
    except OSError:
        return False
    return True


def test_plaintext_and_tls_mixed_up_fail_with_one_line(
    tls_cluster: EtcdCluster, etcd_cluster: EtcdCluster
) -> None:
    message = _refused(etcd_cluster.url(prefix=_prefix()).replace("etcd://", "etcds://"))
    assert "does not speak TLS" in message
    plain = tls_cluster.url(prefix=_prefix(), ca=None, cert=None, key=None)
    plain = plain.replace("etcds://", "etcd://") + "&connect_timeout=0.5&timeout=1"
    message = _refused(plain, kind=Unavailable)
    assert "etcd" in message


def test_users_that_cannot_work_get_one_line_naming_why(tls_cluster: EtcdCluster) -> None:
    message = _refused(tls_cluster.url(prefix=_prefix(), user="fenced:wrong-password"))
    assert "user name or password" in message and "wrong-password" not in message
    message = _refused(tls_cluster.url(prefix=_prefix(), user=f"nobody:{PASSWORD}"))
    assert "permission denied" in message and "'nobody'" in message
    assert "readwrite" in message and "/tls/" in message
    # without a user, etcd takes the client certificate's name (fenced, a user without a role
    # on /other): refused, naming the certificate's user
    message = _refused(tls_cluster.url(prefix="/other"))
    assert "permission denied" in message and "client certificate" in message


def test_the_password_comes_from_the_environment_and_is_never_shown(
    tls_cluster: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FENCED_ETCD_PASSWORD", PASSWORD)
    with fenced.connect(tls_cluster.url(prefix=_prefix(), user="fenced")) as coord:
        lease = coord.acquire(R, ttl=2, wait=0)
        coord.release(lease)
        shown = f"{coord!r} {coord.backend!r} {coord.backend.url}"
        assert PASSWORD not in shown and "fenced@" in shown
    monkeypatch.delenv("FENCED_ETCD_PASSWORD")
    with pytest.raises(ConfigurationError, match="FENCED_ETCD_PASSWORD"):
        fenced.connect(tls_cluster.url(prefix=_prefix(), user="fenced"))
    with pytest.raises(ConfigurationError) as caught:
        fenced.connect(f"etcd://fenced:{PASSWORD}@127.0.0.1:1?ca=/x.pem")
    assert PASSWORD not in str(caught.value) and "etcds://" in str(caught.value)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_verify_passes_over_tls_with_a_user(tls_cluster: EtcdCluster) -> None:
    target = Target.create(tls_cluster.url(prefix=_prefix(), user=f"fenced:{PASSWORD}"))
    assert_verify_passes(target, seed=211, schedules=1)


DOC = Path(__file__).resolve().parents[3] / "docs" / "etcd.md"


def _documented_commands() -> list[list[str]]:
    """The ``etcdctl`` commands of docs/etcd.md's "Least privilege" block, as argument lists."""
    section = DOC.read_text().split("### Least privilege", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].split() for line in block.splitlines()]
    assert all(command[0] == "etcdctl" for command in commands if command)
    return [command[1:] for command in commands if command]


def _queued(cluster: EtcdCluster) -> bool:
    """Whether a waiter's key is under /fenced/queue/ (read as root)."""
    return "/fenced/queue/" in cluster.etcdctl_run(
        "get", "/fenced/queue/", "--prefix", "--keys-only"
    )


def test_the_documented_least_privilege_commands_are_enough_and_no_more() -> None:
    """docs/etcd.md's commands, run as written on a fresh TLS cluster (the password given on
    the command line instead of at the prompt; a root user first, as its comment says): the
    user works on /fenced (conformance-sized cycle, a waiter handed the lease), and is refused
    on another prefix with one line naming the permission."""
    with EtcdCluster(1, tls=True, extra_args=("--bcrypt-cost", "4")) as cluster:
        cluster.etcdctl_run("user", "add", f"root:{ROOT_PASSWORD}")
        cluster.etcdctl_run("user", "grant-role", "root", "root")
        commands = _documented_commands()
        assert ["auth", "enable"] in commands and ["user", "add", "fenced"] in commands
        for command in commands:
            password = [f"--new-user-password={PASSWORD}"] if command[:2] == ["user", "add"] else []
            cluster.etcdctl_run(*command, *password)
            if command == ["auth", "enable"]:
                cluster.root_password = ROOT_PASSWORD
        url = cluster.url(prefix="/fenced", user=f"fenced:{PASSWORD}", timeout=2)
        with fenced.connect(url) as coord, fenced.connect(url) as other:
            lease = coord.acquire(R, ttl=2, wait=0)
            coord.renew(lease)
            waiter = ResultThread(lambda: other.acquire(R, ttl=2, wait=10))
            waiter.start()
            wait_for(lambda: _queued(cluster), what="the waiter's key in the line")
            coord.release(lease)
            waiter.join(10)
            assert waiter.error is None and waiter.result.epoch == lease.epoch + 1
            other.release(waiter.result)
            kinds = [record.kind.name for record in coord.history(R)]
            assert kinds[-1] == "RELEASED" and kinds.count("GRANTED") == 2
        message = _refused(cluster.url(prefix="/elsewhere", user=f"fenced:{PASSWORD}"))
        assert "permission denied" in message and "readwrite" in message
