"""PostgreSQL over TLS, end to end: the coordinator and a store on ``sslmode=verify-full``
against a TLS server this module starts itself (certificates from
:class:`fenced.testing.tls.Authority`).

What is checked, by the server's own view (``pg_stat_ssl`` joined with ``pg_stat_activity``):
every connection fenced makes is encrypted — pooled, dedicated, the LISTEN connection (also one
given its own ``listen_url``), a store's stream — and a user's pool carries its TLS to the
listener too. Client certificates against a ``hostssl … clientcert=verify-full`` line: accepted
with the certificate, refused without it or with one from another CA. And the failures an
operator meets first — a wrong CA, a certificate for another host name, a server without TLS —
are each a one-line :class:`ConfigurationError` naming the cause, raised at once (well within
the connect timeout), with the password of the URL nowhere in the message.
"""

from __future__ import annotations

import io
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from psycopg_pool import ConnectionPool

import fenced
from fenced.core._errors import ConfigurationError
from fenced.testing.conformance import wait_for
from fenced.testing.postgres import PostgresServer
from fenced.testing.tls import Authority, Issued

R = "jobs/tls"
PASSWORD = "hunter2"  # trust authentication ignores it: only the messages and reprs matter
CERTS_DB = "certs"  # the database whose hba line demands a client certificate


@dataclass(frozen=True)
class TLS:
    """The module's servers and certificates."""

    server: PostgresServer  # ssl=on, certificate for 127.0.0.1; CERTS_DB needs a client cert
    plain: PostgresServer  # no TLS at all
    ca: Authority
    other_ca: Authority  # an unrelated CA: "wrong CA"
    client: Issued  # CN postgres, from ca
    stranger: Issued  # CN postgres, from other_ca

    def url(self, database: str = "postgres", **query: str) -> str:
        """A verify-full URL of ``server`` with a password, as an operator would write it."""
        query = {"sslmode": "verify-full", "sslrootcert": str(self.ca.cert), **query}
        return _with_password(self.server.url(database, **query))


def _with_password(url: str) -> str:
    return url.replace("postgresql://postgres@", f"postgresql://postgres:{PASSWORD}@", 1)


def _schema() -> str:
    return "tls_" + uuid.uuid4().hex[:12]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLS]:
    directory = tmp_path_factory.mktemp("pg-tls")
    ca = Authority(directory / "certs")
    other_ca = Authority(directory / "certs", name="other")
    server = PostgresServer(
        tls=ca.issue("server", hosts=["127.0.0.1"]),
        ca=ca.cert,
        hba=[
            f"hostssl {CERTS_DB} all 127.0.0.1/32 trust clientcert=verify-full",
            f"host {CERTS_DB} all 127.0.0.1/32 reject",
        ],
    )
    plain = PostgresServer()
    try:
        server.start()
        plain.start()
        server.create_database(CERTS_DB)
        yield TLS(
            server,
            plain,
            ca,
            other_ca,
            ca.issue("client", common_name="postgres", client=True),
            other_ca.issue("stranger", common_name="postgres", client=True),
        )
    finally:
        server.stop("immediate")
        plain.stop("immediate")


def _sessions(server: PostgresServer, application: str) -> dict[str, bool]:
    """The server's view: ``application_name`` → ``ssl`` of every session whose name starts with
    ``application`` (fenced's pooled ones are named ``application``, the listener's
    ``application-listen``). Several sessions of one name must agree."""
    seen: dict[str, set[bool]] = {}
    with psycopg.connect(server.admin_dsn(), autocommit=True) as admin:
        rows = admin.execute(
            "SELECT a.application_name, s.ssl FROM pg_stat_activity a"
            " JOIN pg_stat_ssl s USING (pid) WHERE a.application_name LIKE %s",
            (application + "%",),
        ).fetchall()
    for name, ssl in rows:
        seen.setdefault(name, set()).add(bool(ssl))
    assert all(len(values) == 1 for values in seen.values()), seen
    return {name: values.pop() for name, values in seen.items()}


def _handoff(coord: fenced.Coordinator) -> fenced.Lease:
    """A lease, a waiter queued behind it (LISTEN), the release that hands over: the waiter's
    lease (still held)."""
    lease = coord.acquire(R, ttl=30, wait=0)
    got: list[fenced.Lease] = []
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            got.append(coord.acquire(R, ttl=30, wait=20, holder="waiter"))
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=waiter)
    thread.start()
    wait_for(lambda: coord.backend.listener_state == "listening", 20, "the listener")  # type: ignore[attr-defined]
    assert coord.release(lease) is True
    thread.join(20)
    assert errors == [] and len(got) == 1 and got[0].epoch == lease.epoch + 1
    return got[0]


def _store_cycle(store: fenced.Store, lease: fenced.Lease, while_open: Callable[[], None]) -> None:
    """fence, put/get, publish, and ``while_open()`` while a stream of the publication is open."""
    store.fence(lease.token)
    store.put(lease.token, "k", b"over tls")
    item = store.get(R, "k")
    assert item is not None and item.epoch == lease.token.epoch
    store.publish(lease.token, io.BytesIO(b"x" * 100_000))
    with store.open(R) as stream:
        while_open()
        assert stream.read() == b"x" * 100_000


def test_coordinator_and_store_over_verify_full(tls: TLS) -> None:
    app = "tls_" + uuid.uuid4().hex[:8]
    url = tls.url(schema=_schema(), application_name=app)
    with fenced.connect(url) as coord, fenced.open_store(url, mode="strict") as store:
        lease = _handoff(coord)

        def check() -> None:
            sessions = _sessions(tls.server, app)
            assert sessions.get(app) is True and sessions.get(f"{app}-listen") is True, sessions
            assert all(sessions.values()), sessions

        _store_cycle(store, lease, check)
        assert coord.release(lease) is True
        for shown in (coord.url, repr(coord), store.url, repr(store)):
            assert PASSWORD not in shown and "postgres:***@" in shown, shown
    # the same, seen from inside a session
    with psycopg.connect(tls.url().replace(f":{PASSWORD}", "")) as conn:
        row = conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()
        assert row == (True,)


def test_a_listen_url_carries_its_own_tls(tls: TLS) -> None:
    """The pooled connections go in plaintext (``sslmode=disable``), the listener by its
    ``listen_url`` over verify-full: each connection follows its own URL's libpq parameters, and
    the nested URL's password is masked as well."""
    app = "tlsl_" + uuid.uuid4().hex[:8]
    listen = tls.url(application_name=app)
    url = _with_password(
        tls.server.url(
            schema=_schema(),
            sslmode="disable",
            application_name=app,
            listen_url=quote(listen, safe=""),
        )
    )
    with fenced.connect(url) as coord:
        lease = _handoff(coord)
        sessions = _sessions(tls.server, app)
        assert sessions == {app: False, f"{app}-listen": True}, sessions
        assert coord.release(lease) is True
        for shown in (coord.url, repr(coord)):
            assert PASSWORD not in shown and "***" in shown, shown


def test_a_users_pool_over_tls_lends_its_tls_to_the_listener(tls: TLS) -> None:
    app = "tlsp_" + uuid.uuid4().hex[:8]
    conninfo = tls.url(application_name=app)
    pool: ConnectionPool[Any] = ConnectionPool(conninfo, min_size=1, max_size=4, open=True)
    try:
        with fenced.connect(pool, options={"schema": _schema()}) as coord:
            lease = _handoff(coord)
            sessions = _sessions(tls.server, app)
            assert sessions == {app: True}, sessions
            assert coord.release(lease) is True
    finally:
        pool.close()


def test_a_client_certificate_is_accepted_and_required(tls: TLS) -> None:
    schema = _schema()
    with_cert = tls.url(
        CERTS_DB, schema=schema, sslcert=str(tls.client.cert), sslkey=str(tls.client.key)
    )
    with fenced.connect(with_cert) as coord, fenced.open_store(with_cert, mode="strict") as store:
        lease = _handoff(coord)
        _store_cycle(store, lease, lambda: None)
        assert coord.release(lease) is True

    refused = {
        "requires a valid client certificate": tls.url(CERTS_DB, schema=schema),
        "unknown ca": tls.url(
            CERTS_DB,
            schema=schema,
            sslcert=str(tls.stranger.cert),
            sslkey=str(tls.stranger.key),
        ),
        "no encryption": _with_password(tls.server.url(CERTS_DB, sslmode="disable")),
    }
    for cause, url in refused.items():
        _assert_refused(url, cause)


@pytest.mark.parametrize(
    ("case", "cause"),
    [
        ("wrong CA", "certificate verify failed"),
        ("another host's certificate", 'does not match host name "db.example"'),
        ("a server without TLS", "server does not support SSL"),
        ("?password= in the query", "certificate verify failed"),
    ],
)
def test_what_does_not_verify_is_one_line_naming_the_cause(tls: TLS, case: str, cause: str) -> None:
    schema = _schema()
    urls = {
        "wrong CA": tls.url(schema=schema, sslrootcert=str(tls.other_ca.cert)),
        # the server presents its certificate for 127.0.0.1; the client asked for db.example
        "another host's certificate": tls.url(schema=schema, hostaddr="127.0.0.1").replace(
            "@127.0.0.1:", "@db.example:", 1
        ),
        "a server without TLS": _with_password(
            tls.plain.url(schema=schema, sslmode="verify-full", sslrootcert=str(tls.ca.cert))
        ),
        "?password= in the query": tls.server.url(
            schema=schema,
            sslmode="verify-full",
            sslrootcert=str(tls.other_ca.cert),
            password=PASSWORD,
        ),
    }
    _assert_refused(urls[case], cause)


def _assert_refused(url: str, cause: str) -> None:
    """``fenced.connect(url)`` and ``fenced.open_store(url)`` each raise a one-line
    ConfigurationError naming ``cause``, without the password, long before the connect timeout
    (5 s)."""
    openers: list[Callable[[str], fenced.Coordinator | fenced.Store]] = [
        fenced.connect,
        fenced.open_store,
    ]
    for opener in openers:
        started = time.monotonic()
        with pytest.raises(ConfigurationError) as caught:
            opener(url).close()
        elapsed = time.monotonic() - started
        message = str(caught.value)
        assert elapsed < 2.0, (elapsed, message)
        assert "\n" not in message, message
        assert cause.lower() in message.lower(), message
        assert PASSWORD not in message, message


def test_the_server_fixture_refuses_ca_without_tls(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs tls="):
        PostgresServer(ca=Authority(tmp_path).cert)
