"""The store conformance suite on ``postgresql://`` (a fresh schema per test), plus what is
specific to PostgreSQL: streaming of large objects, the busy timeout, the URL, schema versions.

The store has every capability but :attr:`Capability.LOCAL_FILES` (it lives in a database, not
under a path), so the suite runs :class:`FencingConformance`, :class:`KeysConformance`,
:class:`PublicationConformance`, :class:`OpIdConformance` and :class:`RecordsConformance`.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from fenced._drivers import postgres as postgres_conn
from fenced.cli._exitcodes import BAD_INPUT
from fenced.cli._main import cli
from fenced.core._clock import SystemClock
from fenced.core._errors import (
    ConfigurationError,
    OutcomeUnknown,
    StaleToken,
    Unavailable,
    VersionConflict,
)
from fenced.fence import Store
from fenced.fence import open_store as fenced_open_store
from fenced.fence._values import Mode
from fenced.fence.backend import StoreOptions
from fenced.fence.postgres import _store as postgres_store
from fenced.fence.postgres import _transaction as postgres_transaction
from fenced.fence.postgres._store import PostgresBackend, open_postgres_backend
from fenced.testing.conformance import wait_for
from fenced.testing.postgres import PostgresServer
from fenced.testing.proxy import TcpProxy
from fenced.testing.store_conformance import (
    FencingConformance,
    KeysConformance,
    OpIdConformance,
    PublicationConformance,
    RecordsConformance,
    token,
)
from support.postgres_stores import postgres_snapshot, store_url
from support.store_damage import (
    DAMAGES,
    assert_no_read_returns_it,
    damage_postgres_object,
    original,
)

__all__ = ["store_url"]  # a fixture from support.postgres_stores, used here


def open_postgres_store(url: str, mode: Mode | None, options: StoreOptions) -> Store:
    """The store ``open_store`` opens for ``url``, with ``options`` as given."""
    return Store(open_postgres_backend(url, mode, options), options)


def _backend(store: Store) -> PostgresBackend:
    backend = store._backend
    assert isinstance(backend, PostgresBackend)
    return backend


def _pool_of(store: Store) -> postgres_conn.Pool:
    """The store's own connection pool (a store opened by URL)."""
    pool = _backend(store)._pool
    assert isinstance(pool, postgres_conn.Pool)
    return pool


def _options(busy_timeout: float = 5.0) -> StoreOptions:
    """Store options as open_store builds them by default (a shorter busy timeout if asked)."""
    return StoreOptions(7 * 24 * 3600.0, 3600.0, busy_timeout, SystemClock())


class TestPostgresStore(
    FencingConformance,
    KeysConformance,
    PublicationConformance,
    OpIdConformance,
    RecordsConformance,
):
    @pytest.fixture
    def make_store(self, store_url: str) -> Iterator[Callable[..., Store]]:
        opened: list[Store] = []

        def make(mode: Mode | None = None, **options: Any) -> Store:
            opened.append(fenced_open_store(store_url, mode, **options))
            return opened[-1]

        yield make
        for store in opened:
            store.close()

    @pytest.fixture
    def snapshot(self) -> Callable[[Store], object]:
        return postgres_snapshot


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    opened = open_postgres_store(store_url, "strict", _options())
    yield opened
    opened.close()


def test_a_large_publication_is_streamed_in_chunks(store: Store, tmp_path: Any) -> None:
    path = tmp_path / "big.bin"
    block = uuid.uuid4().bytes * 4096  # 64 KiB, not compressible as a whole
    with path.open("wb") as out:
        for _ in range(84):  # 5.25 MiB: 5 chunks of 1 MiB and a partial one
            out.write(block)
    store.fence(token(1))
    published = store.publish(token(1), path)
    assert published.size == 84 * len(block)
    with store.open("exports/daily") as stream:
        first = stream.read(10)
        assert first == block[:10]
        assert first + stream.read() == path.read_bytes()
    chunks = postgres_snapshot(store)[4][1]
    assert len(chunks) == 6


@contextlib.contextmanager
def _domain_locked(store_url: str) -> Iterator[None]:
    """Another session holds the store's lock of the domain ``exports/daily`` meanwhile."""
    schema = store_url.split("schema=")[1]
    holder = psycopg.connect(store_url.split("?", maxsplit=1)[0])
    holder.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
        (f"fenced.store.{schema}:exports/daily",),
    )
    try:
        yield
    finally:
        holder.rollback()
        holder.close()


def test_a_writer_blocked_longer_than_the_busy_timeout_is_unavailable(store_url: str) -> None:
    store = open_postgres_store(store_url, "monotonic", _options(busy_timeout=0.2))
    store.put(token(1), "k", b"v")
    with _domain_locked(store_url):
        started = time.monotonic()
        with pytest.raises(Unavailable, match="busy timeout"):
            store.put(token(1), "k", b"w")
        assert time.monotonic() - started < 3
    assert store.put(token(1), "k", b"w").version == 2
    store.close()


def test_a_speculative_write_without_a_reply_in_time_is_outcome_unknown(store_url: str) -> None:
    """The watchdog cuts the connection of store_apply_all (sent through libpq directly) when
    no reply came within ``?timeout=``: the write may have been applied."""
    store = open_postgres_store(store_url + "&timeout=0.3", "monotonic", _options())
    store.put(token(1), "k", b"v")
    store.put(token(1), "k", b"v")  # the next put is speculative
    with _domain_locked(store_url):
        started = time.monotonic()
        with pytest.raises(OutcomeUnknown, match=r"no reply within 0\.3s"):
            store.put(token(1), "k", b"w")
        assert time.monotonic() - started < 3

    def applied() -> bool:  # once the lock is free (the server does not notice the cut meanwhile)
        item = store.get(token(1).resource, "k")
        return item is not None and item.version == 3

    wait_for(applied, 30, "the server to apply the write whose reply was cut")
    assert store.put(token(1), "k", b"w").version == 4
    store.close()


@pytest.mark.parametrize("call", ["get", "put"])
def test_waiting_for_a_connection_comes_out_of_a_store_calls_timeout(
    postgres_server: PostgresServer, call: str
) -> None:
    """The only pooled connection is busy for most of a call's ``?timeout=``, then handed to it
    just as the network starts blackholing: the call ends when its timeout, counted from its
    start, ends — not a whole timeout after it got the connection."""
    timeout = 1.0
    with TcpProxy("127.0.0.1", postgres_server.port) as proxy:
        url = (
            f"postgresql://{postgres_server.user}@127.0.0.1:{proxy.port}/postgres"
            f"?schema=s_{uuid.uuid4().hex[:12]}&pool_size=1&timeout={timeout:g}"
        )
        store = open_postgres_store(url, "monotonic", _options())
        store.put(token(1), "k", b"v")
        pool = _pool_of(store)
        taken = threading.Event()
        failures: list[BaseException] = []

        def busy() -> None:
            try:
                with pool.connection(5):
                    taken.set()
                    wait_for(lambda: pool._waiting > 0, 30, "the call to wait for the pool")
                    time.sleep(timeout * 0.9)  # the fault: the connection stays busy this long
                    proxy.blackhole()
            except BaseException as error:
                failures.append(error)

        other = threading.Thread(target=busy)
        other.start()
        assert taken.wait(10)
        began = time.monotonic()
        with pytest.raises((OutcomeUnknown, Unavailable)):
            if call == "get":
                store.get(token(1).resource, "k")
            else:
                store.put(token(1), "k", b"w")
        took = time.monotonic() - began
        other.join(10)
        proxy.forward()
        store.close()
    assert failures == [] and not other.is_alive()
    assert took < timeout + 0.3, (timeout, took)


def test_concurrent_writers_of_one_domain_serialise(store: Store) -> None:
    """Four threads increment one counter with compare-and-set. Their first attempts are
    forced to collide (none writes before all four have read "no counter yet"): exactly one
    wins, three get VersionConflict and retry, and no increment is lost."""
    store.fence(token(1))
    errors: list[BaseException] = []
    conflicts: list[int] = []
    all_read = threading.Barrier(4)

    def work() -> None:
        first = True
        try:
            for _ in range(20):
                while True:
                    current = store.get("exports/daily", "n")
                    version = 0 if current is None else current.version
                    value = b"1" if current is None else str(int(current.value) + 1).encode()
                    if first:
                        first = False
                        all_read.wait(timeout=30)
                    try:
                        store.put(token(1), "n", value, if_version=version)
                        break
                    except VersionConflict:
                        conflicts.append(version)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert conflicts.count(0) == 3  # the first attempts collided: one won, three retried
    item = store.get("exports/daily", "n")
    assert item is not None and item.value == b"80" and item.version == 80


def test_stale_writes_are_rejected_across_processes_of_the_same_database(
    store: Store, store_url: str
) -> None:
    other = open_postgres_store(store_url, None, _options())
    store.fence(token(41))
    store.put(token(41), "k", b"41")
    other.fence(token(42))
    with pytest.raises(StaleToken):
        store.put(token(41), "k", b"late 41")
    item = other.get("exports/daily", "k")
    assert item is not None and item.value == b"41"
    other.close()


def test_a_newer_schema_version_is_refused(store: Store, store_url: str) -> None:
    schema = store_url.split("schema=")[1]
    with psycopg.connect(store_url.split("?", maxsplit=1)[0], autocommit=True) as conn:
        conn.execute(
            f"UPDATE \"{schema}\".store_meta SET value = '99' WHERE key = 'schema_version'".encode()
        )
    with pytest.raises(ConfigurationError, match="newer fenced"):
        open_postgres_store(store_url, None, _options())


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://127.0.0.1:1/db?schema=Bad-Name",
        "postgresql://127.0.0.1:1/db?schema=x&schema=y",
        "postgresql://127.0.0.1:1/db?nosuchparameter=1",
        "postgresql://127.0.0.1:1/db#fragment",
    ],
)
def test_bad_urls_are_configuration_errors_before_any_io(url: str) -> None:
    with pytest.raises(ConfigurationError):
        open_postgres_store(url, None, _options())


def test_an_unreachable_server_is_unavailable_and_a_wrong_database_a_configuration_error(
    postgres_server: PostgresServer,
) -> None:
    with pytest.raises(Unavailable):
        open_postgres_store("postgresql://127.0.0.1:1/x?connect_timeout=1", None, _options())
    with pytest.raises(ConfigurationError, match="does not exist"):
        open_postgres_store(postgres_server.dsn("no_such_database"), None, _options())


def test_speculative_writes_never_trust_what_this_process_saw_last(store_url: str) -> None:
    """Each process remembers a domain's last state and writes in one round trip on it; the
    server re-checks that state under the lock, so a change made elsewhere is never missed."""
    a = open_postgres_store(store_url, "strict", _options())
    b = open_postgres_store(store_url, None, _options())
    a.fence(token(5))
    a.put(token(5), "k", b"5")  # a now knows: floor 5, k at version 1
    b.fence(token(6))
    with pytest.raises(StaleToken):  # a's cached floor says 5: the server says 6
        a.put(token(5), "k", b"late")
    with pytest.raises(StaleToken):  # a no-op install on a's cache must be confirmed too
        a.fence(token(5))
    assert a.put(token(6), "k", b"6").version == 2  # cached floor said NotInstalled: re-decided
    b.put(token(6), "k", b"b", if_version=2)
    with pytest.raises(VersionConflict):  # a's cached version of k is 2, the server's is 3
        a.put(token(6), "k", b"a", if_version=2)
    first = a.put(token(6), "j", b"x", op_id="op-1")
    assert a.put(token(6), "j", b"x", op_id="op-1") == first  # the op id is found and replayed
    item = b.get("exports/daily", "k")
    assert item is not None and (item.value, item.version) == (b"b", 3)
    a.close()
    b.close()


def _statements(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every statement the store's mutations send from now on (ordinary ones, store_apply_all)."""
    sent: list[bytes] = []
    run, apply = postgres_transaction.PostgresTransaction._run, postgres_conn.execute
    direct = postgres_conn.Statement.run

    def counting_run(tx: Any, statements: list[tuple[bytes, tuple[object, ...]]]) -> Any:
        sent.extend(query for query, _ in statements)
        return run(tx, statements)

    def counting_execute(pool: Any, conn: Any, query: bytes, params: Any) -> Any:
        sent.append(query)
        return apply(pool, conn, query, params)

    def counting_direct(
        statement: postgres_conn.Statement, pool: Any, conn: Any, params: Any
    ) -> Any:
        sent.append(statement.query)  # store_apply_all, through libpq directly
        return direct(statement, pool, conn, params)

    monkeypatch.setattr(postgres_transaction.PostgresTransaction, "_run", counting_run)
    monkeypatch.setattr(postgres_store, "execute", counting_execute)
    monkeypatch.setattr(postgres_conn.Statement, "run", counting_direct)
    return sent


def test_a_speculative_write_and_its_records_are_one_statement(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An accepted put (even one that installs its epoch) is one store_apply_all call that also
    inserts its records, in order, in the same transaction; every 64th write prunes records."""
    options = StoreOptions(7 * 24 * 3600.0, 3600.0, 5.0, SystemClock(), record_limit=3)
    store = open_postgres_store(store_url, "monotonic", options)
    store.put(token(1), "k", b"1")  # learns the domain and k
    sent = _statements(monkeypatch)
    store.put(token(2), "k", b"2", op_id="op-2")  # installs 2: two records
    assert len(sent) == 1 and b"store_apply_all" in sent[0]
    kinds = [
        (r.kind.value, r.epoch, r.detail.get("op_id")) for r in store.history(token(2).resource)
    ]
    assert kinds[-2:] == [("installed", 2, None), ("accepted", 2, "op-2")]
    assert store.put(token(2), "k", b"2", op_id="op-2").version == 2  # replayed, not applied
    sent.clear()  # (a replay is found by the ordinary way, after store_apply_all raised)
    for n in range(70):
        store.put(token(2), "k", str(n).encode())
    assert all(b"store_apply_all" in query for query in sent)
    records = store.history(token(2).resource)  # the record_limit newest
    assert [r.detail["version"] for r in records] == [70, 71, 72]
    schema = store_url.split("schema=")[1]
    with psycopg.connect(store_url.split("?", maxsplit=1)[0], autocommit=True) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{schema}".store_records'.encode()).fetchone()
    assert row is not None and row[0] < 20  # pruned to 3 at the 64th write, by store_apply_all
    store.close()


def test_the_speculative_write_is_prepared_once_and_survives_a_lost_prepared_statement(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """store_apply_all goes through libpq directly, prepared once per connection; a pooler that
    lost it (26000) gets it again unprepared, and prepared statements are off from then on."""
    store = open_postgres_store(store_url, "strict", _options())
    store.fence(token(1))
    for _ in range(3):
        store.put(token(1), "k", b"v")
    backend = _backend(store)
    with backend._pool.connection(1.0) as conn:
        row = conn.execute(
            b"SELECT count(*) FROM pg_prepared_statements WHERE name = %s",
            (backend._apply.name.decode(),),
        ).fetchone()
        assert row is not None and row[0] == 1
        conn.execute(b"DEALLOCATE " + backend._apply.name)  # what a pooler does
    sent = _statements(monkeypatch)
    assert store.put(token(1), "k", b"w").version == 4
    assert len(sent) == 1 and backend._pool.prepare is False
    assert store.put(token(1), "k", b"x").version == 5
    assert store.get(token(1).resource, "k") is not None
    store.close()


def test_a_spare_connection_the_server_ended_is_replaced_before_it_is_lent(
    store_url: str,
) -> None:
    store = open_postgres_store(store_url, "strict", _options())
    store.fence(token(1))
    store.put(token(1), "k", b"v")
    pool = _pool_of(store)
    assert len(pool._spare) == 1  # kept at hand, not returned to psycopg_pool
    pid = pool._spare[0].info.backend_pid
    with psycopg.connect(store_url.split("?", maxsplit=1)[0], autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))

        def ended() -> bool:
            query = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s"
            row = admin.execute(query, (pid,)).fetchone()
            return row is not None and row[0] == 0

        wait_for(ended, 30, f"the server to end session {pid}")
    assert store.put(token(1), "k", b"w").version == 2  # nothing was sent on the dead one
    assert pool._spare and pool._spare[0].info.backend_pid != pid
    store.close()


def test_threads_waiting_for_a_pool_of_one_connection_are_served(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A returned connection goes to a thread waiting for the pool, never to the spares.

    The test holds the only connection until four writers wait for the pool, then returns it.
    A connection kept in the spares would leave them waiting for the pool in vain until their
    budget ran out, and then served by a direct connection: so the pool is made to try a direct
    connection only after the whole budget, and the test asserts none was made."""
    monkeypatch.setattr(postgres_conn, "_PROBE_AFTER", 3600.0)
    store = open_postgres_store(store_url + "&pool_size=1", "strict", _options())
    store.fence(token(1))
    pool = _pool_of(store)
    direct: list[int] = []
    connect = pool._connect

    def counted_connect() -> psycopg.Connection[tuple[Any, ...]]:
        direct.append(threading.get_ident())
        return connect()

    monkeypatch.setattr(pool, "_connect", counted_connect)
    failures: list[BaseException] = []

    def writer(key: str) -> None:
        try:
            for n in range(15):
                store.put(token(1), key, str(n).encode())
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=writer, args=(f"k{i}",)) for i in range(4)]
    with pool.connection(5.0):  # the only connection: every writer waits for the pool
        for thread in threads:
            thread.start()
        wait_for(lambda: pool._waiting == 4, 30, "four writers waiting for the pool")
    for thread in threads:
        thread.join(60)
    assert failures == [] and not any(thread.is_alive() for thread in threads)
    assert direct == []  # every writer was served by the pool
    items = [store.get(token(1).resource, f"k{i}") for i in range(4)]
    assert [None if item is None else item.version for item in items] == [15] * 4
    store.close()


def test_speculative_writes_without_prepared_statements(store_url: str) -> None:
    store = open_postgres_store(store_url + "&prepare=off", "strict", _options())
    store.fence(token(1))
    for n in range(1, 4):
        assert store.put(token(1), "k", str(n).encode()).version == n
    assert [r.detail.get("version") for r in store.history(token(1).resource)] == [None, 1, 2, 3]
    with _backend(store)._pool.connection(1.0) as conn:
        row = conn.execute(b"SELECT count(*) FROM pg_prepared_statements").fetchone()
    assert row is not None and row[0] == 0
    store.close()


def test_records_are_pruned_only_when_due(store_url: str) -> None:
    """store_apply_records deletes what is past the retention or beyond the limit, and
    nothing else (it looks at the oldest and newest record first)."""
    store = open_postgres_store(store_url, "strict", _options())
    schema = store_url.split("schema=")[1]
    s = f'"{schema}"'
    with psycopg.connect(store_url.split("?", maxsplit=1)[0], autocommit=True) as conn:

        def ats(resource: str) -> list[float]:
            rows = conn.execute(
                f"SELECT at FROM {s}.store_records WHERE resource = %s ORDER BY seq".encode(),
                (resource,),
            ).fetchall()
            return [float(row[0]) for row in rows]

        def add(resource: str, *at: float) -> None:
            records = "[" + ",".join(f'[{a},"accepted",1,"{{}}"]' for a in at) + "]"
            conn.execute(
                f"SELECT {s}.store_apply_records(%s, %s, NULL, NULL)".encode(),
                (resource, records),
            )

        def prune(resource: str, before: float, keep: int) -> None:
            conn.execute(
                f"SELECT {s}.store_apply_records(%s, NULL, %s, %s)".encode(),
                (resource, before, keep),
            )

        add("a", 1, 2, 3)
        add("b", 1, 2)
        add("a", 4, 5)
        assert ats("a") == [1, 2, 3, 4, 5]  # in order, several per call
        prune("a", 1, 5)  # nothing due
        assert ats("a") == [1, 2, 3, 4, 5] and ats("b") == [1, 2]
        prune("a", 3, 5)  # past the retention
        assert ats("a") == [3, 4, 5] and ats("b") == [1, 2]
        prune("a", 0, 2)  # beyond the limit
        assert ats("a") == [4, 5] and ats("b") == [1, 2]
        prune("a", 0, 2)  # spans 3 sequence numbers with b's between: still only the limit
        add("a", 6)
        prune("a", 0, 2)
        assert ats("a") == [5, 6]
        prune("b", 10, 5)  # both past the retention
        assert ats("b") == []
        prune("b", 10, 5)  # no records at all
        add("a", 7)
        prune("a", 0, 0)  # a limit of 0 keeps none
        assert ats("a") == []
    store.close()


@pytest.mark.parametrize("damage", DAMAGES)
def test_no_read_returns_a_damaged_object(store_url: str, damage: str) -> None:
    """Chunks that hold 1 MiB of the recorded 5 MiB, a flipped byte or a byte too many: read(),
    a stream from open() before its clean end, and ``fenced read`` (exit 2, one line) refuse."""
    with fenced_open_store(store_url, "monotonic") as store:
        publication = store.publish(token(1), original())
        damage_postgres_object(store_url, publication, damage)
        assert_no_read_returns_it(store, publication, damage)
    result = CliRunner().invoke(cli, ["read", store_url, publication.resource])
    assert result.exit_code == BAD_INPUT
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"fenced: object {publication.object_id} of ")
    assert "is damaged" in line
