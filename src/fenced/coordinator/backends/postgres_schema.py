"""The PostgreSQL coordinator's tables and functions, created and migrated automatically.

Everything lives in one PostgreSQL schema (default ``fenced``; ``?schema=name``). ``meta`` holds
``format``, ``schema_version``, the ``coordinator_id`` (created once, kept forever), the
coordinator-wide ``minimum_epoch`` (restore safety) and ``records_retention`` (seconds).
:data:`MIGRATIONS` lists every schema change in order; :func:`fenced.fence.postgres_conn.migrate`
applies the missing ones in one transaction under a transaction-level advisory lock. To change
the schema, append a :class:`Migration` (``CREATE OR REPLACE`` the functions it changes); never
edit a released one. A schema of a newer version is refused with ``ConfigurationError``.

Every lease operation is one call of one PL/pgSQL function, i.e. one round trip and one
transaction, so the uncontended acquire + release is two round trips. The functions read the
server's clock (``clock_timestamp()``) — the client's clock is never sent — and take the
resource's row lock (``FOR UPDATE``) first, which orders every change and record of a resource.

Tables: ``resources`` (one row per resource: the last granted or reserved epoch and the lease
of that epoch, live iff ``owner IS NOT NULL AND expires_at > clock_timestamp()``), ``requests``
(``request_id`` deduplication, kept 24 h), ``waiters`` (the FIFO queue: ``id`` order is arrival
order; a row is live while its keep-alive lasts), ``watchers`` (who wants NOTIFYs for records),
``records`` (the timeline: grants, releases, expiries, proclamations, restores, holder reports).

Notifications: channel ``fenced_<schema>``, payload ``<waiter id>:<resource>``. A freed resource
notifies only its first live waiter (no herd); ``0:<resource>`` is for watchers, ``0:`` (no
resource) wakes everyone (after a restore).
"""

from __future__ import annotations

from fenced.fence.postgres_conn import Migration

__all__ = ["FORMAT", "MIGRATIONS", "SCHEMA_VERSION", "channel", "migrations"]

FORMAT = "fenced.coordinator"

_TABLES = (
    "CREATE TABLE {s}.meta (key text PRIMARY KEY, value text NOT NULL)",
    """CREATE TABLE {s}.resources (
        name text PRIMARY KEY,
        epoch bigint NOT NULL CHECK (epoch >= 0),
        owner text,
        holder text,
        ttl double precision,
        expires_at timestamptz,
        value text,
        ended text NOT NULL DEFAULT 'none'
    )""",
    """CREATE TABLE {s}.requests (
        request_id text PRIMARY KEY,
        name text NOT NULL,
        epoch bigint NOT NULL,
        owner text NOT NULL,
        holder text NOT NULL,
        ttl double precision NOT NULL,
        created_at timestamptz NOT NULL
    )""",
    "CREATE INDEX requests_by_age ON {s}.requests (created_at)",
    """CREATE TABLE {s}.waiters (
        id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        name text NOT NULL,
        holder text NOT NULL,
        expires_at timestamptz NOT NULL
    )""",
    "CREATE INDEX waiters_by_name ON {s}.waiters (name, id)",
    """CREATE TABLE {s}.watchers (
        id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        name text NOT NULL,
        expires_at timestamptz NOT NULL
    )""",
    "CREATE INDEX watchers_by_name ON {s}.watchers (name)",
    """CREATE TABLE {s}.records (
        seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        at timestamptz NOT NULL,
        kind text NOT NULL,
        resource text NOT NULL,
        epoch bigint NOT NULL,
        holder text,
        detail jsonb NOT NULL DEFAULT '{}',
        logged_at timestamptz NOT NULL DEFAULT clock_timestamp()
    )""",
    "CREATE INDEX records_by_resource ON {s}.records (resource, seq)",
)

_HELPERS = (
    # Wake whoever waits for p_name: its first live waiter if the resource is free (p_free),
    # else (or if nobody queues) its watchers. NOTIFY is sent at commit, and only when someone
    # listens for it: an uncontended cycle never takes PostgreSQL's notification queue lock.
    """CREATE OR REPLACE FUNCTION {s}._wake(p_name text, p_free boolean) RETURNS void
    LANGUAGE plpgsql AS $$
    DECLARE
        v_head bigint;
    BEGIN
        IF p_free THEN
            SELECT w.id INTO v_head FROM {s}.waiters w
            WHERE w.name = p_name AND w.expires_at > clock_timestamp() ORDER BY w.id LIMIT 1;
        END IF;
        IF v_head IS NOT NULL THEN
            PERFORM pg_notify('{c}', v_head::text || ':' || p_name);
        ELSIF EXISTS (SELECT 1 FROM {s}.watchers x
                      WHERE x.name = p_name AND x.expires_at > clock_timestamp()) THEN
            PERFORM pg_notify('{c}', '0:' || p_name);
        END IF;
    END $$""",
    # End the (locked) expired lease of p_name and record its expiry, dated when it happened.
    """CREATE OR REPLACE FUNCTION {s}._expire(
        p_name text, p_epoch bigint, p_holder text, p_at timestamptz) RETURNS void
    LANGUAGE plpgsql AS $$
    BEGIN
        UPDATE {s}.resources r SET owner = NULL, value = NULL, ended = 'expired'
        WHERE r.name = p_name;
        INSERT INTO {s}.records (at, kind, resource, epoch, holder)
        VALUES (p_at, 'expired', p_name, p_epoch, p_holder);
    END $$""",
    # Detect and record every due expiry (of p_name, or of all resources when NULL). A row
    # locked by someone else is skipped: that transaction is deciding about it right now.
    """CREATE OR REPLACE FUNCTION {s}._expire_due(p_name text) RETURNS void
    LANGUAGE plpgsql AS $$
    DECLARE
        r record;
    BEGIN
        FOR r IN SELECT x.name, x.epoch, x.holder, x.expires_at FROM {s}.resources x
                 WHERE (p_name IS NULL OR x.name = p_name)
                   AND x.owner IS NOT NULL AND x.expires_at <= clock_timestamp()
                 FOR UPDATE SKIP LOCKED LOOP
            PERFORM {s}._expire(r.name, r.epoch, r.holder, r.expires_at);
            PERFORM {s}._wake(r.name, true);
        END LOOP;
    END $$""",
    # Durable commit for this transaction even if the server or role runs with it off.
    """CREATE OR REPLACE FUNCTION {s}._durable() RETURNS void
    LANGUAGE plpgsql AS $$
    BEGIN
        IF current_setting('synchronous_commit') = 'off' THEN
            PERFORM set_config('synchronous_commit', 'on', true);
        END IF;
    END $$""",
    # Keep the caller's place in line (re-join at the end if its row was dropped).
    """CREATE OR REPLACE FUNCTION {s}._keep(
        p_name text, p_ticket bigint, p_holder text, p_now timestamptz, p_keepalive double precision)
    RETURNS bigint
    LANGUAGE plpgsql AS $$
    DECLARE
        v_ticket bigint := p_ticket;
    BEGIN
        IF v_ticket IS NULL THEN
            RETURN NULL;
        END IF;
        UPDATE {s}.waiters w SET expires_at = p_now + p_keepalive * interval '1 second'
        WHERE w.id = v_ticket AND w.name = p_name;
        IF NOT FOUND THEN
            INSERT INTO {s}.waiters (name, holder, expires_at)
            VALUES (p_name, p_holder, p_now + p_keepalive * interval '1 second')
            RETURNING id INTO v_ticket;
        END IF;
        RETURN v_ticket;
    END $$""",
)

_OPERATIONS = (
    # One acquire attempt; see PostgresBackend.try_grant. o_status: granted / blocked / lost
    # (a request_id whose lease has ended) / foreign (a request_id used for another resource,
    # whose name is returned in o_holder).
    """CREATE OR REPLACE FUNCTION {s}.try_grant(
        p_name text, p_owner text, p_holder text, p_ttl double precision, p_request_id text,
        p_ticket bigint, p_value text, p_keepalive double precision,
        p_retry_cap double precision)
    RETURNS TABLE (o_status text, o_epoch bigint, o_owner text, o_holder text,
                   o_ttl double precision, o_remaining double precision,
                   o_retry_in double precision, o_ticket bigint)
    LANGUAGE plpgsql AS $$
    DECLARE
        v_now timestamptz;
        v_row {s}.resources%ROWTYPE;
        v_found boolean;
        v_req {s}.requests%ROWTYPE;
        v_minimum bigint;
        v_head record;
        v_mine boolean;
        v_ticket bigint := p_ticket;
        v_epoch bigint;
        v_remaining double precision;
        v_retry double precision;
        v_expired boolean := false;
        v_eps constant double precision := 0.001;
    BEGIN
        -- Conflicts with advance() only: the minimum epoch read below stays valid until commit.
        LOCK TABLE {s}.resources IN ROW EXCLUSIVE MODE;
        LOOP
            v_now := clock_timestamp();
            SELECT * INTO v_row FROM {s}.resources r WHERE r.name = p_name FOR UPDATE;
            v_found := FOUND;
            IF v_found AND v_row.owner IS NOT NULL AND v_row.expires_at <= v_now THEN
                PERFORM {s}._expire(p_name, v_row.epoch, v_row.holder, v_row.expires_at);
                v_row.owner := NULL;
                v_row.ended := 'expired';
                v_expired := true;
            END IF;
            IF p_request_id IS NOT NULL THEN
                SELECT * INTO v_req FROM {s}.requests q WHERE q.request_id = p_request_id;
                IF FOUND THEN
                    PERFORM set_config('synchronous_commit', 'off', true);
                    IF v_req.name <> p_name THEN
                        RETURN QUERY SELECT 'foreign'::text, v_req.epoch, NULL::text, v_req.name,
                            NULL::float8, NULL::float8, NULL::float8, v_ticket;
                        RETURN;
                    END IF;
                    IF v_row.owner IS NULL OR v_row.epoch <> v_req.epoch
                            OR v_row.owner <> v_req.owner THEN
                        IF v_expired THEN
                            PERFORM {s}._wake(p_name, true);
                        END IF;
                        RETURN QUERY SELECT 'lost'::text, v_req.epoch, NULL::text, NULL::text,
                            NULL::float8, NULL::float8, NULL::float8, v_ticket;
                        RETURN;
                    END IF;
                    IF v_ticket IS NOT NULL THEN
                        DELETE FROM {s}.waiters w WHERE w.id = v_ticket;
                    END IF;
                    RETURN QUERY SELECT 'granted'::text, v_req.epoch, v_req.owner, v_req.holder,
                        v_req.ttl, extract(epoch FROM v_row.expires_at - v_now)::float8,
                        NULL::float8, NULL::bigint;
                    RETURN;
                END IF;
            END IF;
            IF v_row.owner IS NOT NULL THEN
                -- blocked by a live lease: retry at its expiry (or at the keep-alive)
                PERFORM set_config('synchronous_commit', 'off', true);
                v_ticket := {s}._keep(p_name, v_ticket, p_holder, v_now, p_keepalive);
                v_remaining := greatest(extract(epoch FROM v_row.expires_at - v_now)::float8, 0);
                v_retry := v_remaining + v_eps;
                IF v_ticket IS NOT NULL THEN
                    v_retry := least(v_retry, p_retry_cap);
                END IF;
                RETURN QUERY SELECT 'blocked'::text, v_row.epoch, NULL::text, v_row.holder,
                    v_row.ttl, v_remaining, v_retry, v_ticket;
                RETURN;
            END IF;
            SELECT m.value::bigint INTO v_minimum FROM {s}.meta m WHERE m.key = 'minimum_epoch';
            v_epoch := greatest(coalesce(v_row.epoch, 0), coalesce(v_minimum, 0));
            v_mine := v_ticket IS NOT NULL AND EXISTS (
                SELECT 1 FROM {s}.waiters w WHERE w.id = v_ticket AND w.name = p_name);
            SELECT w.id, w.expires_at INTO v_head FROM {s}.waiters w
            WHERE w.name = p_name AND w.expires_at > v_now
              AND w.id < CASE WHEN v_mine THEN v_ticket ELSE 9223372036854775807 END
            ORDER BY w.id LIMIT 1;
            IF FOUND THEN
                -- free, but an earlier live waiter is first in line
                PERFORM set_config('synchronous_commit', 'off', true);
                v_ticket := {s}._keep(p_name, v_ticket, p_holder, v_now, p_keepalive);
                IF v_expired THEN
                    PERFORM {s}._wake(p_name, true);
                END IF;
                v_retry := greatest(extract(epoch FROM v_head.expires_at - v_now)::float8, 0)
                    + v_eps;
                IF v_ticket IS NOT NULL THEN
                    v_retry := least(v_retry, p_retry_cap);
                END IF;
                RETURN QUERY SELECT 'blocked'::text, v_epoch, NULL::text, NULL::text,
                    NULL::float8, 0::float8, v_retry, v_ticket;
                RETURN;
            END IF;
            v_epoch := v_epoch + 1;
            IF v_found THEN
                UPDATE {s}.resources r SET epoch = v_epoch, owner = p_owner, holder = p_holder,
                    ttl = p_ttl, expires_at = v_now + p_ttl * interval '1 second',
                    value = p_value, ended = 'none'
                WHERE r.name = p_name;
            ELSE
                INSERT INTO {s}.resources (name, epoch, owner, holder, ttl, expires_at, value)
                VALUES (p_name, v_epoch, p_owner, p_holder, p_ttl,
                        v_now + p_ttl * interval '1 second', p_value)
                ON CONFLICT (name) DO NOTHING;
                IF NOT FOUND THEN
                    CONTINUE;  -- a concurrent first grant created the row: decide again
                END IF;
            END IF;
            INSERT INTO {s}.records (at, kind, resource, epoch, holder, detail)
            VALUES (v_now, 'granted', p_name, v_epoch, p_holder,
                    jsonb_build_object('after', coalesce(v_row.ended, 'none')));
            IF v_ticket IS NOT NULL THEN
                DELETE FROM {s}.waiters w WHERE w.id = v_ticket;
            END IF;
            IF p_request_id IS NOT NULL THEN
                INSERT INTO {s}.requests (request_id, name, epoch, owner, holder, ttl, created_at)
                VALUES (p_request_id, p_name, v_epoch, p_owner, p_holder, p_ttl, v_now);
                IF random() < 0.01 THEN
                    DELETE FROM {s}.requests q WHERE q.request_id IN (
                        SELECT o.request_id FROM {s}.requests o
                        WHERE o.created_at < v_now - interval '24 hours'
                        ORDER BY o.created_at LIMIT 512);
                END IF;
            END IF;
            IF random() < 0.001 THEN
                DELETE FROM {s}.records x WHERE x.seq IN (
                    SELECT o.seq FROM {s}.records o ORDER BY o.seq LIMIT 1000)
                  AND x.at < v_now - (SELECT m.value::float8 FROM {s}.meta m
                                      WHERE m.key = 'records_retention') * interval '1 second';
            END IF;
            PERFORM {s}._wake(p_name, false);
            PERFORM {s}._durable();
            RETURN QUERY SELECT 'granted'::text, v_epoch, p_owner, p_holder, p_ttl, p_ttl,
                NULL::float8, NULL::bigint;
            RETURN;
        END LOOP;
    END $$""",
    """CREATE OR REPLACE FUNCTION {s}.renew(
        p_name text, p_epoch bigint, p_owner text, p_ttl double precision)
    RETURNS double precision
    LANGUAGE plpgsql AS $$
    DECLARE
        v_now timestamptz := clock_timestamp();
        v_row {s}.resources%ROWTYPE;
    BEGIN
        SELECT * INTO v_row FROM {s}.resources r WHERE r.name = p_name FOR UPDATE;
        IF NOT FOUND OR v_row.owner IS NULL THEN
            RETURN NULL;
        END IF;
        IF v_row.expires_at <= v_now THEN
            PERFORM set_config('synchronous_commit', 'off', true);
            PERFORM {s}._expire(p_name, v_row.epoch, v_row.holder, v_row.expires_at);
            PERFORM {s}._wake(p_name, true);
            RETURN NULL;
        END IF;
        IF v_row.epoch <> p_epoch OR v_row.owner <> p_owner THEN
            RETURN NULL;
        END IF;
        UPDATE {s}.resources r SET expires_at = v_now + p_ttl * interval '1 second'
        WHERE r.name = p_name;
        PERFORM {s}._durable();
        RETURN p_ttl;
    END $$""",
    """CREATE OR REPLACE FUNCTION {s}.release(p_name text, p_epoch bigint, p_owner text)
    RETURNS boolean
    LANGUAGE plpgsql AS $$
    DECLARE
        v_now timestamptz := clock_timestamp();
        v_row {s}.resources%ROWTYPE;
    BEGIN
        -- A lost release only delays the next grant until the lease's expiry: no fsync.
        PERFORM set_config('synchronous_commit', 'off', true);
        SELECT * INTO v_row FROM {s}.resources r WHERE r.name = p_name FOR UPDATE;
        IF NOT FOUND OR v_row.owner IS NULL THEN
            RETURN false;
        END IF;
        IF v_row.expires_at <= v_now THEN
            PERFORM {s}._expire(p_name, v_row.epoch, v_row.holder, v_row.expires_at);
            PERFORM {s}._wake(p_name, true);
            RETURN false;
        END IF;
        IF v_row.epoch <> p_epoch OR v_row.owner <> p_owner THEN
            RETURN false;
        END IF;
        UPDATE {s}.resources r SET owner = NULL, value = NULL, ended = 'released'
        WHERE r.name = p_name;
        INSERT INTO {s}.records (at, kind, resource, epoch, holder)
        VALUES (v_now, 'released', p_name, p_epoch, v_row.holder);
        PERFORM {s}._wake(p_name, true);
        RETURN true;
    END $$""",
    """CREATE OR REPLACE FUNCTION {s}.current_lease(p_name text)
    RETURNS TABLE (o_epoch bigint, o_holder text, o_remaining double precision,
                   o_ttl double precision, o_value text)
    LANGUAGE plpgsql AS $$
    DECLARE
        v_now timestamptz := clock_timestamp();
        v_row {s}.resources%ROWTYPE;
    BEGIN
        SELECT * INTO v_row FROM {s}.resources r WHERE r.name = p_name;
        IF NOT FOUND OR v_row.owner IS NULL THEN
            RETURN;
        END IF;
        IF v_row.expires_at <= v_now THEN
            PERFORM set_config('synchronous_commit', 'off', true);
            PERFORM {s}._expire_due(p_name);
            RETURN;
        END IF;
        RETURN QUERY SELECT v_row.epoch, v_row.holder,
            extract(epoch FROM v_row.expires_at - v_now)::float8, v_row.ttl, v_row.value;
    END $$""",
    """CREATE OR REPLACE FUNCTION {s}.proclaim(
        p_name text, p_epoch bigint, p_owner text, p_value text)
    RETURNS boolean
    LANGUAGE plpgsql AS $$
    DECLARE
        v_now timestamptz := clock_timestamp();
        v_row {s}.resources%ROWTYPE;
    BEGIN
        SELECT * INTO v_row FROM {s}.resources r WHERE r.name = p_name FOR UPDATE;
        IF NOT FOUND OR v_row.owner IS NULL THEN
            RETURN false;
        END IF;
        IF v_row.expires_at <= v_now THEN
            PERFORM {s}._expire(p_name, v_row.epoch, v_row.holder, v_row.expires_at);
            PERFORM {s}._wake(p_name, true);
            RETURN false;
        END IF;
        IF v_row.epoch <> p_epoch OR v_row.owner <> p_owner THEN
            RETURN false;
        END IF;
        UPDATE {s}.resources r SET value = p_value WHERE r.name = p_name;
        INSERT INTO {s}.records (at, kind, resource, epoch, holder, detail)
        VALUES (v_now, 'proclaimed', p_name, p_epoch, v_row.holder,
                jsonb_build_object('value', p_value));
        PERFORM {s}._wake(p_name, false);
        PERFORM {s}._durable();
        RETURN true;
    END $$""",
    """CREATE OR REPLACE FUNCTION {s}.report(
        p_name text, p_epoch bigint, p_holder text, p_kind text, p_detail jsonb)
    RETURNS void
    LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        PERFORM 1 FROM {s}.resources r WHERE r.name = p_name FOR UPDATE;
        INSERT INTO {s}.records (at, kind, resource, epoch, holder, detail)
        VALUES (clock_timestamp(), p_kind, p_name, p_epoch, p_holder, p_detail);
        PERFORM {s}._wake(p_name, false);
    END $$""",
    """CREATE OR REPLACE FUNCTION {s}.records_after(p_name text, p_after bigint, p_limit integer)
    RETURNS TABLE (o_seq bigint, o_at double precision, o_kind text, o_resource text,
                   o_epoch bigint, o_holder text, o_detail jsonb, o_age double precision)
    LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        PERFORM {s}._expire_due(p_name);
        RETURN QUERY SELECT x.seq, extract(epoch FROM x.at)::float8, x.kind, x.resource,
            x.epoch, x.holder, x.detail,
            extract(epoch FROM clock_timestamp() - x.logged_at)::float8
        FROM {s}.records x
        WHERE (p_name IS NULL OR x.resource = p_name) AND x.seq > p_after
        ORDER BY x.seq LIMIT p_limit;
    END $$""",
    """CREATE OR REPLACE FUNCTION {s}.enqueue(
        p_name text, p_holder text, p_keepalive double precision)
    RETURNS bigint
    LANGUAGE plpgsql AS $$
    DECLARE
        v_now timestamptz := clock_timestamp();
        v_id bigint;
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        DELETE FROM {s}.waiters w WHERE w.name = p_name AND w.expires_at <= v_now;
        INSERT INTO {s}.waiters (name, holder, expires_at)
        VALUES (p_name, p_holder, v_now + p_keepalive * interval '1 second')
        RETURNING id INTO v_id;
        RETURN v_id;
    END $$""",
    # Leave the queue; if the leaver was first in line and the resource is free, wake the next.
    # The resource row lock orders this with a concurrent release's choice of whom to wake.
    """CREATE OR REPLACE FUNCTION {s}.leave(p_name text, p_ticket bigint)
    RETURNS void
    LANGUAGE plpgsql AS $$
    DECLARE
        v_now timestamptz := clock_timestamp();
        v_row {s}.resources%ROWTYPE;
        v_first boolean;
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        SELECT * INTO v_row FROM {s}.resources r WHERE r.name = p_name FOR UPDATE;
        v_first := NOT EXISTS (SELECT 1 FROM {s}.waiters w WHERE w.name = p_name
                               AND w.expires_at > v_now AND w.id < p_ticket);
        DELETE FROM {s}.waiters w WHERE w.id = p_ticket AND w.name = p_name;
        IF FOUND AND v_first
                AND (v_row.owner IS NULL OR v_row.expires_at <= v_now) THEN
            PERFORM {s}._wake(p_name, true);
        END IF;
    END $$""",
    """CREATE OR REPLACE FUNCTION {s}.watch_start(p_name text, p_keepalive double precision)
    RETURNS bigint
    LANGUAGE plpgsql AS $$
    DECLARE
        v_now timestamptz := clock_timestamp();
        v_id bigint;
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        DELETE FROM {s}.watchers x WHERE x.name = p_name AND x.expires_at <= v_now;
        INSERT INTO {s}.watchers (name, expires_at)
        VALUES (p_name, v_now + p_keepalive * interval '1 second') RETURNING id INTO v_id;
        RETURN v_id;
    END $$""",
    # Refresh a watcher, detect due expiries, and say whether records after p_after exist.
    """CREATE OR REPLACE FUNCTION {s}.watch_poll(
        p_name text, p_after bigint, p_watcher bigint, p_keepalive double precision)
    RETURNS TABLE (o_changed boolean, o_watcher bigint, o_remaining double precision)
    LANGUAGE plpgsql AS $$
    DECLARE
        v_now timestamptz := clock_timestamp();
        v_id bigint := p_watcher;
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        UPDATE {s}.watchers x SET expires_at = v_now + p_keepalive * interval '1 second'
        WHERE x.id = v_id;
        IF NOT FOUND THEN
            INSERT INTO {s}.watchers (name, expires_at)
            VALUES (p_name, v_now + p_keepalive * interval '1 second') RETURNING id INTO v_id;
        END IF;
        PERFORM {s}._expire_due(p_name);
        RETURN QUERY SELECT
            EXISTS (SELECT 1 FROM {s}.records x WHERE x.resource = p_name AND x.seq > p_after),
            v_id,
            (SELECT extract(epoch FROM r.expires_at - clock_timestamp())::float8
             FROM {s}.resources r WHERE r.name = p_name AND r.owner IS NOT NULL);
    END $$""",
    # Restore safety (see fenced.core.restore): one transaction, exclusive against grants.
    """CREATE OR REPLACE FUNCTION {s}.advance(
        p_minimum bigint, p_floors jsonb, p_detail jsonb)
    RETURNS bigint
    LANGUAGE plpgsql AS $$
    DECLARE
        v_now timestamptz := clock_timestamp();
        v_min bigint;
    BEGIN
        LOCK TABLE {s}.resources IN SHARE ROW EXCLUSIVE MODE;
        SELECT greatest(m.value::bigint, p_minimum) INTO v_min
        FROM {s}.meta m WHERE m.key = 'minimum_epoch' FOR UPDATE;
        UPDATE {s}.meta m SET value = v_min::text WHERE m.key = 'minimum_epoch';
        INSERT INTO {s}.resources AS r (name, epoch)
        SELECT f.key, f.value::bigint FROM jsonb_each_text(p_floors) f
        ON CONFLICT (name) DO UPDATE SET epoch = greatest(r.epoch, excluded.epoch);
        UPDATE {s}.resources r SET owner = NULL, value = NULL, ended = 'restored';
        INSERT INTO {s}.records (at, kind, resource, epoch, holder, detail)
        SELECT v_now, 'restored', r.name, greatest(r.epoch, v_min), NULL,
               p_detail || jsonb_build_object('minimum', v_min)
        FROM {s}.resources r ORDER BY r.name COLLATE "C";
        PERFORM pg_notify('{c}', '0:');
        PERFORM {s}._durable();
        RETURN v_min;
    END $$""",
)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "resources and leases, request ids, FIFO waiters, watchers, records; one function per "
        "operation",
        _TABLES + _HELPERS + _OPERATIONS,
    ),
)

SCHEMA_VERSION = MIGRATIONS[-1].version
"""The newest schema this code knows."""


def channel(schema: str) -> str:
    """The NOTIFY channel of the coordinator in ``schema``."""
    return f"fenced_{schema}"


def migrations(schema: str) -> tuple[Migration, ...]:
    """:data:`MIGRATIONS` with the notification channel of ``schema`` filled in."""
    name = channel(schema)
    return tuple(
        Migration(m.version, m.summary, tuple(s.replace("{c}", name) for s in m.statements))
        for m in MIGRATIONS
    )
