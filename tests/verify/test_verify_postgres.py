"""``fenced verify --coordinator postgresql://… --store postgresql://…``: the practice table of
failure cases against the session's real PostgreSQL server (``tests/support/postgres_fixtures.py``).

The coordinator and both stores (strict and monotonic, each in a schema of its own) live on
the server; every worker process reaches the coordinator through its own TCP proxy, as
``fenced verify`` does for any networked coordinator on loopback. Every case must pass with no
violation of any invariant, except case 6 (restore), which verify never runs against a
coordinator it did not create (*not available*, shown, neither a pass nor a failure). Two short
seeded fault schedules (kills, pauses, wire faults on the proxies) must keep every invariant.
``fenced verify --mutants`` against the PostgreSQL coordinator exits 0: every seeded defect with a
hook there (or in the embedded stores) is caught — ``renew-revives-expired`` and
``pg-grant-read-committed`` among them, variants of the schema's functions that verify creates
as session-local functions, never in the schema — and the other coordinators' are n/a.
"""

from __future__ import annotations

import time
import uuid

import pytest

from fenced.coordinator.backend import Granted, GrantRequest
from fenced.coordinator.backends.postgres._backend import PostgresBackend
from fenced.core._errors import LeaseLost
from fenced.fence._store import open_store
from fenced.testing.postgres import PostgresServer
from fenced.verify._seeded import PG_GRANT_READ_COMMITTED, RENEW_REVIVES_EXPIRED
from fenced.verify._seeded_postgres import SeededPostgresBackend
from fenced.verify._target import Target
from support.verify_networked import assert_mutants_pass, assert_verify_passes


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_cases_pass_on_a_postgres_coordinator_and_stores(
    postgres_server: PostgresServer,
) -> None:
    tag = uuid.uuid4().hex[:10]
    coordinator = postgres_server.url("postgres", schema=f"vc_{tag}")
    strict = postgres_server.url("postgres", schema=f"vs_{tag}")
    monotonic = postgres_server.url("postgres", schema=f"vm_{tag}")
    open_store(strict, mode="strict").close()  # the mode is chosen when a store is created
    open_store(monotonic, mode="monotonic").close()

    target = Target.create(coordinator, (strict, monotonic))
    assert target.stores == {"S": strict, "M": monotonic}
    assert_verify_passes(target, seed=61, schedules=2)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_cases_pass_on_postgres_with_workers_on_the_asyncio_face(
    postgres_server: PostgresServer,
) -> None:
    """``fenced verify --coordinator postgresql://… --store … --api async``."""
    tag = uuid.uuid4().hex[:10]
    coordinator = postgres_server.url("postgres", schema=f"vc_{tag}")
    strict = postgres_server.url("postgres", schema=f"vs_{tag}")
    monotonic = postgres_server.url("postgres", schema=f"vm_{tag}")
    open_store(strict, mode="strict").close()
    open_store(monotonic, mode="monotonic").close()
    target = Target.create(coordinator, (strict, monotonic), api="async")
    assert_verify_passes(target, seed=71, schedules=1)


@pytest.mark.timeout(60)
def test_the_seeded_functions_are_session_local(postgres_server: PostgresServer) -> None:
    """The seeded backend grants through its variant of ``try_grant`` and revives an expired
    lease through its variant of ``renew``; a correct backend on the same schema still refuses
    to: the schema's functions are untouched."""
    url = postgres_server.url("postgres", schema=f"vx_{uuid.uuid4().hex[:10]}")
    both = frozenset({RENEW_REVIVES_EXPIRED, PG_GRANT_READ_COMMITTED})
    with SeededPostgresBackend(url, both) as broken, PostgresBackend(url) as correct:
        lease = broken.try_grant(GrantRequest("r", 0.3, "a" * 32, "a", "rid-a"), None)
        assert isinstance(lease, Granted) and lease.epoch == 1
        time.sleep(0.4)
        assert broken.renew("r", 1, "a" * 32, 0.3) == 0.3  # revived
        time.sleep(0.4)
        with pytest.raises(LeaseLost):
            correct.renew("r", 1, "a" * 32, 0.3)
        again = correct.try_grant(GrantRequest("r", 0.3, "b" * 32, "b", "rid-b"), None)
        assert isinstance(again, Granted) and again.epoch == 2


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_the_seeded_defects_are_caught_or_na_on_postgres(postgres_server: PostgresServer) -> None:
    assert_mutants_pass(
        postgres_server.url("postgres", schema=f"vx_{uuid.uuid4().hex[:10]}"),
        seed=62,
        kind="postgresql",
    )
