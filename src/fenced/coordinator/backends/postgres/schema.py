"""The PostgreSQL coordinator's tables and functions, created and migrated automatically.

Everything lives in one PostgreSQL schema (default ``fenced``; ``?schema=name``). ``meta`` holds
``format``, ``schema_version``, the ``coordinator_id`` (created once, kept forever), the
coordinator-wide ``minimum_epoch`` (restore safety) and ``records_retention`` (seconds).
:data:`MIGRATIONS` lists every schema change in order; :func:`fenced._drivers.postgres.migrate`
applies the missing ones in one transaction under a transaction-level advisory lock. To change
the schema, append a :class:`Migration` (``CREATE OR REPLACE`` the functions it changes); never
edit a released one. A schema of a newer version is refused with ``ConfigurationError``.

Every lease operation is one round trip and one transaction: one call of one PL/pgSQL
function, or, for the uncontended grant and release, one statement of the client's
(``_FAST_GRANT`` and ``_FAST_RELEASE`` in :mod:`fenced.coordinator.backends.postgres.backend`) that
falls back to the function within the same statement. Both read the server's clock
(``clock_timestamp()``) — the client's clock is never sent — and lock the resource's row before
they change anything, which orders every change and record of a resource.

Tables: ``resources`` (one row per resource: the last granted or reserved epoch — never below
the minimum epoch once granted (schema version 3) — and the lease of that epoch, live iff
``owner IS NOT NULL AND expires_at > clock_timestamp()``; ``ended`` says how the last lease that
ended did), ``requests`` (``request_id`` deduplication, kept 24 h), ``waiters`` (the FIFO queue:
``id`` order is arrival order; a row is live while its keep-alive lasts; since version 3 it also
holds what a releaser needs to grant the waiter directly: owner, ttl, value, the key of the
waiter's listen lock and when it last kept its place), ``watchers`` (who wants NOTIFYs for
records), ``records`` (the timeline: grants, releases, expiries, proclamations, restores, holder
reports).

Notifications: channel ``fenced_<schema>``, payload ``<waiter id>:<resource>`` (wake up and try)
or ``<waiter id>:<resource>:<epoch>:<seconds>`` (the releaser granted you ``epoch``, that many
seconds after your last keep-alive). A freed resource is granted to, or wakes, only its first live
waiter (no herd); ``0:<resource>`` is for watchers, ``0:`` (no resource) wakes everyone (after a
restore).
"""

from __future__ import annotations

from fenced._drivers.postgres import Migration

__all__ = ["FORMAT", "LISTEN_LOCK_CLASS", "MIGRATIONS", "SCHEMA_VERSION", "channel", "migrations"]

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
        p_name text, p_ticket bigint, p_holder text, p_now timestamptz,
        p_keepalive double precision)
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
    # whose name is returned in o_holder). The uncontended grant runs four statements.
    """CREATE OR REPLACE FUNCTION {s}.try_grant(
        p_name text, p_owner text, p_holder text, p_ttl double precision, p_request_id text,
        p_ticket bigint, p_value text, p_keepalive double precision,
        p_retry_cap double precision,
        OUT o_status text, OUT o_epoch bigint, OUT o_owner text, OUT o_holder text,
        OUT o_ttl double precision, OUT o_remaining double precision,
        OUT o_retry_in double precision, OUT o_ticket bigint)
    LANGUAGE plpgsql AS $$
    DECLARE
        v_now timestamptz;
        v_row {s}.resources%ROWTYPE;
        v_found boolean;
        v_req {s}.requests%ROWTYPE;
        v_minimum bigint;
        v_head bigint;
        v_head_expires timestamptz;
        v_watched boolean;
        v_epoch bigint;
        v_count integer;
        v_expired boolean := false;
        v_ignored text;
        v_eps constant double precision := 0.001;
    BEGIN
        o_ticket := p_ticket;
        -- Conflicts with advance() only: the minimum epoch read below stays valid until commit.
        LOCK TABLE {s}.resources IN ROW EXCLUSIVE MODE;
        LOOP
            v_now := clock_timestamp();
            SELECT r.*, (SELECT m.value::bigint FROM {s}.meta m WHERE m.key = 'minimum_epoch')
            INTO v_row.name, v_row.epoch, v_row.owner, v_row.holder, v_row.ttl,
                 v_row.expires_at, v_row.value, v_row.ended, v_minimum
            FROM {s}.resources r WHERE r.name = p_name FOR UPDATE OF r;
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
                    v_ignored := set_config('synchronous_commit', 'off', true);
                    o_epoch := v_req.epoch;
                    IF v_req.name <> p_name THEN
                        o_status := 'foreign';
                        o_holder := v_req.name;
                        RETURN;
                    END IF;
                    IF v_row.owner IS NULL OR v_row.epoch <> v_req.epoch
                            OR v_row.owner <> v_req.owner THEN
                        IF v_expired THEN
                            PERFORM {s}._wake(p_name, true);
                        END IF;
                        o_status := 'lost';
                        RETURN;
                    END IF;
                    IF p_ticket IS NOT NULL THEN
                        DELETE FROM {s}.waiters w WHERE w.id = p_ticket;
                    END IF;
                    o_status := 'granted';
                    o_owner := v_req.owner;
                    o_holder := v_req.holder;
                    o_ttl := v_req.ttl;
                    o_remaining := extract(epoch FROM v_row.expires_at - v_now);
                    o_ticket := NULL;
                    RETURN;
                END IF;
            END IF;
            IF v_row.owner = p_owner THEN
                -- this very request was granted already (its reply was lost): the same lease
                IF p_ticket IS NOT NULL THEN
                    DELETE FROM {s}.waiters w WHERE w.id = p_ticket;
                END IF;
                o_status := 'granted';
                o_epoch := v_row.epoch;
                o_owner := v_row.owner;
                o_holder := v_row.holder;
                o_ttl := v_row.ttl;
                o_remaining := extract(epoch FROM v_row.expires_at - v_now);
                o_ticket := NULL;
                RETURN;
            END IF;
            IF v_row.owner IS NOT NULL THEN
                -- blocked by a live lease: retry at its expiry (or at the keep-alive)
                v_ignored := set_config('synchronous_commit', 'off', true);
                o_ticket := {s}._keep(p_name, p_ticket, p_holder, v_now, p_keepalive);
                o_status := 'blocked';
                o_epoch := v_row.epoch;
                o_holder := v_row.holder;
                o_ttl := v_row.ttl;
                o_remaining := greatest(extract(epoch FROM v_row.expires_at - v_now), 0);
                o_retry_in := o_remaining + v_eps;
                IF o_ticket IS NOT NULL THEN
                    o_retry_in := least(o_retry_in, p_retry_cap);
                END IF;
                RETURN;
            END IF;
            IF NOT v_found THEN
                SELECT m.value::bigint INTO v_minimum FROM {s}.meta m
                WHERE m.key = 'minimum_epoch';
            END IF;
            v_epoch := greatest(coalesce(v_row.epoch, 0), coalesce(v_minimum, 0));
            -- the first live waiter ahead of the caller (if any), and whether anyone watches
            SELECT h.id, h.expires_at,
                   EXISTS (SELECT 1 FROM {s}.watchers x
                           WHERE x.name = p_name AND x.expires_at > v_now)
            INTO v_head, v_head_expires, v_watched
            FROM (SELECT 1) AS one LEFT JOIN LATERAL (
                SELECT w.id, w.expires_at FROM {s}.waiters w
                WHERE w.name = p_name AND w.expires_at > v_now
                  AND w.id < CASE
                      WHEN p_ticket IS NULL THEN 9223372036854775807
                      WHEN EXISTS (SELECT 1 FROM {s}.waiters m
                                   WHERE m.id = p_ticket AND m.name = p_name) THEN p_ticket
                      ELSE 9223372036854775807 END
                ORDER BY w.id LIMIT 1) AS h ON true;
            IF v_head IS NOT NULL THEN
                -- free, but an earlier live waiter is first in line
                v_ignored := set_config('synchronous_commit', 'off', true);
                o_ticket := {s}._keep(p_name, p_ticket, p_holder, v_now, p_keepalive);
                IF v_expired THEN
                    PERFORM pg_notify('{c}', v_head::text || ':' || p_name);
                END IF;
                o_status := 'blocked';
                o_epoch := v_epoch;
                o_remaining := 0;
                o_retry_in := greatest(extract(epoch FROM v_head_expires - v_now), 0) + v_eps;
                IF o_ticket IS NOT NULL THEN
                    o_retry_in := least(o_retry_in, p_retry_cap);
                END IF;
                RETURN;
            END IF;
            v_epoch := v_epoch + 1;
            IF v_found THEN
                WITH u AS (
                    UPDATE {s}.resources r SET epoch = v_epoch, owner = p_owner,
                        holder = p_holder, ttl = p_ttl,
                        expires_at = v_now + p_ttl * interval '1 second',
                        value = p_value, ended = 'none'
                    WHERE r.name = p_name RETURNING r.name)
                INSERT INTO {s}.records (at, kind, resource, epoch, holder, detail)
                SELECT v_now, 'granted', u.name, v_epoch, p_holder,
                       jsonb_build_object('after', v_row.ended)
                FROM u;
            ELSE
                WITH u AS (
                    INSERT INTO {s}.resources (name, epoch, owner, holder, ttl, expires_at, value)
                    VALUES (p_name, v_epoch, p_owner, p_holder, p_ttl,
                            v_now + p_ttl * interval '1 second', p_value)
                    ON CONFLICT (name) DO NOTHING RETURNING name)
                INSERT INTO {s}.records (at, kind, resource, epoch, holder, detail)
                SELECT v_now, 'granted', u.name, v_epoch, p_holder, '{"after": "none"}'::jsonb
                FROM u;
                GET DIAGNOSTICS v_count = ROW_COUNT;
                IF v_count = 0 THEN
                    CONTINUE;  -- a concurrent first grant created the row: decide again
                END IF;
            END IF;
            IF p_ticket IS NOT NULL THEN
                DELETE FROM {s}.waiters w WHERE w.id = p_ticket;
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
            IF v_watched THEN
                PERFORM pg_notify('{c}', '0:' || p_name);
            END IF;
            IF current_setting('synchronous_commit') = 'off' THEN
                v_ignored := set_config('synchronous_commit', 'on', true);  -- durable grants
            END IF;
            o_status := 'granted';
            o_epoch := v_epoch;
            o_owner := p_owner;
            o_holder := p_holder;
            o_ttl := p_ttl;
            o_remaining := p_ttl;
            o_ticket := NULL;
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
        v_ignored text;
    BEGIN
        UPDATE {s}.resources r SET expires_at = v_now + p_ttl * interval '1 second'
        WHERE r.name = p_name AND r.epoch = p_epoch AND r.owner = p_owner
          AND r.expires_at > v_now;
        IF FOUND THEN
            IF current_setting('synchronous_commit') = 'off' THEN
                v_ignored := set_config('synchronous_commit', 'on', true);
            END IF;
            RETURN p_ttl;
        END IF;
        -- not renewed: record the expiry if that is why
        v_ignored := set_config('synchronous_commit', 'off', true);
        SELECT * INTO v_row FROM {s}.resources r WHERE r.name = p_name FOR UPDATE;
        IF FOUND AND v_row.owner IS NOT NULL AND v_row.expires_at <= clock_timestamp() THEN
            PERFORM {s}._expire(p_name, v_row.epoch, v_row.holder, v_row.expires_at);
            PERFORM {s}._wake(p_name, true);
        END IF;
        RETURN NULL;
    END $$""",
    # A lost release only delays the next grant until the lease's expiry: no fsync. The
    # successful release is one statement (end the lease, record it, find whom to wake).
    """CREATE OR REPLACE FUNCTION {s}.release(p_name text, p_epoch bigint, p_owner text)
    RETURNS boolean
    LANGUAGE plpgsql AS $$
    DECLARE
        v_now timestamptz := clock_timestamp();
        v_row {s}.resources%ROWTYPE;
        v_released boolean;
        v_head bigint;
        v_watched boolean;
        v_ignored text;
    BEGIN
        v_ignored := set_config('synchronous_commit', 'off', true);
        WITH u AS (
            UPDATE {s}.resources r SET owner = NULL, value = NULL, ended = 'released'
            WHERE r.name = p_name AND r.epoch = p_epoch AND r.owner = p_owner
              AND r.expires_at > v_now
            RETURNING r.holder),
        rec AS (
            INSERT INTO {s}.records (at, kind, resource, epoch, holder)
            SELECT v_now, 'released', p_name, p_epoch, u.holder FROM u RETURNING 1)
        SELECT EXISTS (SELECT 1 FROM rec),
               (SELECT w.id FROM {s}.waiters w
                WHERE w.name = p_name AND w.expires_at > v_now ORDER BY w.id LIMIT 1),
               EXISTS (SELECT 1 FROM {s}.watchers x
                       WHERE x.name = p_name AND x.expires_at > v_now)
        INTO v_released, v_head, v_watched;
        IF v_released THEN
            IF v_head IS NOT NULL THEN
                PERFORM pg_notify('{c}', v_head::text || ':' || p_name);
            ELSIF v_watched THEN
                PERFORM pg_notify('{c}', '0:' || p_name);
            END IF;
            RETURN true;
        END IF;
        SELECT * INTO v_row FROM {s}.resources r WHERE r.name = p_name FOR UPDATE;
        IF FOUND AND v_row.owner IS NOT NULL AND v_row.expires_at <= clock_timestamp() THEN
            PERFORM {s}._expire(p_name, v_row.epoch, v_row.holder, v_row.expires_at);
            PERFORM {s}._wake(p_name, true);
        END IF;
        RETURN false;
    END $$""",
    """CREATE OR REPLACE FUNCTION {s}.current_lease(p_name text,
        OUT o_epoch bigint, OUT o_holder text, OUT o_remaining double precision,
        OUT o_ttl double precision, OUT o_value text)
    LANGUAGE plpgsql AS $$
    DECLARE
        v_now timestamptz := clock_timestamp();
        v_row {s}.resources%ROWTYPE;
        v_ignored text;
    BEGIN
        SELECT * INTO v_row FROM {s}.resources r WHERE r.name = p_name;
        IF NOT FOUND OR v_row.owner IS NULL THEN
            RETURN;
        END IF;
        IF v_row.expires_at <= v_now THEN
            v_ignored := set_config('synchronous_commit', 'off', true);
            PERFORM {s}._expire_due(p_name);
            RETURN;
        END IF;
        o_epoch := v_row.epoch;
        o_holder := v_row.holder;
        o_remaining := extract(epoch FROM v_row.expires_at - v_now);
        o_ttl := v_row.ttl;
        o_value := v_row.value;
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


def _edited(text: str, edits: tuple[tuple[str, str, int], ...]) -> str:
    """``text`` with each ``(before, after, count)`` replaced; ``before`` must occur ``count``
    times (a later migration is derived from a released one's text, which never changes)."""
    for before, after, count in edits:
        assert text.count(before) == count, before
        text = text.replace(before, after)
    return text


def _granted_with_value(try_grant: str) -> str:
    """``try_grant`` whose granted record also carries ``value`` when the request has one."""
    with_value = (
        " || CASE WHEN p_value IS NULL THEN '{}'::jsonb"
        " ELSE jsonb_build_object('value', p_value) END"
    )
    return _edited(
        try_grant,
        (
            (
                "jsonb_build_object('after', v_row.ended)\n",
                f"jsonb_build_object('after', v_row.ended){with_value}\n",
                1,
            ),
            (
                """'{"after": "none"}'::jsonb\n""",
                f"""'{{"after": "none"}}'::jsonb{with_value}\n""",
                1,
            ),
        ),
    )


LISTEN_LOCK_CLASS = 0x66656E63
"""The first key of the session advisory lock each listening connection holds while it lives
(``pg_advisory_lock(LISTEN_LOCK_CLASS, its listen key)``): a releaser that can take that lock
knows the waiter's listener, hence the waiter, is gone."""

_HANDOFF = (
    """ALTER TABLE {s}.waiters ADD COLUMN owner text, ADD COLUMN ttl double precision,
        ADD COLUMN value text, ADD COLUMN listen_key integer,
        ADD COLUMN refreshed_at timestamptz""",
    # The (locked) resource p_name has just become free (p_after: why): grant it to its first
    # live waiter if that one can take it without a round trip (it gave its owner and holds
    # its listen lock), durably, and NOTIFY it '<id>:<name>:<epoch>:<seconds since its last
    # keep-alive>'. A waiter whose listen lock is free is gone: its row is dropped and the next
    # one is considered. Otherwise wake the first live waiter (it grants itself) or, if nobody
    # waits, the watchers. True if granted (the caller's transaction then commits durably).
    """CREATE OR REPLACE FUNCTION {s}._handoff(p_name text, p_now timestamptz, p_after text)
    RETURNS boolean
    LANGUAGE plpgsql AS $$
    DECLARE
        v_w {s}.waiters%ROWTYPE;
        v_epoch bigint;
    BEGIN
        LOOP
            SELECT * INTO v_w FROM {s}.waiters w
            WHERE w.name = p_name AND w.expires_at > p_now ORDER BY w.id LIMIT 1;
            IF NOT FOUND THEN
                PERFORM {s}._wake(p_name, false);
                RETURN false;
            ELSIF v_w.owner IS NULL OR v_w.listen_key IS NULL THEN
                PERFORM pg_notify('{c}', v_w.id::text || ':' || p_name);
                RETURN false;
            END IF;
            EXIT WHEN NOT pg_try_advisory_xact_lock({k}, v_w.listen_key);
            DELETE FROM {s}.waiters w WHERE w.id = v_w.id;
        END LOOP;
        WITH g AS (
            UPDATE {s}.resources r SET epoch = greatest(r.epoch, coalesce(
                    (SELECT m.value::bigint FROM {s}.meta m WHERE m.key = 'minimum_epoch'), 0)) + 1,
                owner = v_w.owner, holder = v_w.holder, ttl = v_w.ttl,
                expires_at = p_now + v_w.ttl * interval '1 second', value = v_w.value,
                ended = 'none'
            WHERE r.name = p_name RETURNING r.epoch),
        rec AS (
            INSERT INTO {s}.records (at, kind, resource, epoch, holder, detail)
            SELECT p_now, 'granted', p_name, g.epoch, v_w.holder,
                   jsonb_build_object('after', p_after)
                   || CASE WHEN v_w.value IS NULL THEN '{}'::jsonb
                           ELSE jsonb_build_object('value', v_w.value) END
            FROM g),
        gone AS (DELETE FROM {s}.waiters w WHERE w.id = v_w.id)
        SELECT g.epoch INTO v_epoch FROM g;
        PERFORM pg_notify('{c}', v_w.id::text || ':' || p_name || ':' || v_epoch::text || ':'
                || coalesce(extract(epoch FROM p_now - v_w.refreshed_at)::float8, 0)::text),
            CASE WHEN EXISTS (SELECT 1 FROM {s}.watchers x
                              WHERE x.name = p_name AND x.expires_at > p_now)
                 THEN pg_notify('{c}', '0:' || p_name) END,
            CASE WHEN current_setting('synchronous_commit') = 'off'
                 THEN set_config('synchronous_commit', 'on', true) END;
        RETURN true;
    END $$""",
)


def _shipped(name: str) -> str:
    """The released text (schema version 1) of the function ``name``."""
    (text,) = (s for s in _HELPERS + _OPERATIONS if f"FUNCTION {{s}}.{name}(" in s)
    return text


_WAITER = "p_owner text, p_ttl double precision, p_value text, p_listen_key integer"
"""What a waiter's row keeps so that a releaser can grant it (``_handoff``)."""


def _keep_for_handoff() -> str:
    """``_keep`` (keep the caller's place in line, re-join at the end if its row was dropped)
    that also keeps what ``_handoff`` needs. Ticket 0 never exists: it inserts a new row."""
    return _edited(
        _shipped("_keep"),
        (
            (
                "p_keepalive double precision)\n",
                f"p_keepalive double precision, {_WAITER})\n",
                1,
            ),
            (
                "SET expires_at = p_now + p_keepalive * interval '1 second'\n",
                "SET expires_at = p_now + p_keepalive * interval '1 second',\n"
                "            refreshed_at = p_now, listen_key = p_listen_key\n",
                1,
            ),
            (
                "(name, holder, expires_at)\n",
                "(name, holder, expires_at, owner, ttl, value, listen_key, refreshed_at)\n",
                1,
            ),
            (
                "VALUES (p_name, p_holder, p_now + p_keepalive * interval '1 second')\n",
                "VALUES (p_name, p_holder, p_now + p_keepalive * interval '1 second', p_owner,\n"
                "                    p_ttl, p_value, p_listen_key, p_now)\n",
                1,
            ),
        ),
    )


def _enqueue_for_handoff() -> str:
    """``enqueue`` whose row keeps what ``_handoff`` needs (a new function: one more argument
    list; the released one stays for a running older fenced)."""
    return _edited(
        _shipped("enqueue"),
        (
            (
                "p_keepalive double precision)\n",
                f"p_keepalive double precision,\n        {_WAITER})\n",
                1,
            ),
            (
                "INSERT INTO {s}.waiters (name, holder, expires_at)\n"
                "        VALUES (p_name, p_holder, v_now + p_keepalive * interval '1 second')\n"
                "        RETURNING id INTO v_id;\n",
                "v_id := {s}._keep(p_name, 0, p_holder, v_now, p_keepalive, p_owner, p_ttl,"
                " p_value,\n                          p_listen_key);\n",
                1,
            ),
        ),
    )


def _release_with_handoff() -> str:
    """``release`` that hands the resource to the first waiter (``_handoff``) instead of waking
    it, and commits without waiting for the disk only when it granted nothing."""
    return _edited(
        _shipped("release"),
        (
            ("        v_ignored := set_config('synchronous_commit', 'off', true);\n", "", 1),
            (
                """            IF v_head IS NOT NULL THEN
                PERFORM pg_notify('{c}', v_head::text || ':' || p_name);
            ELSIF v_watched THEN
                PERFORM pg_notify('{c}', '0:' || p_name);
            END IF;
""",
                """            IF v_head IS NOT NULL OR v_watched THEN
                IF {s}._handoff(p_name, v_now, 'released') THEN
                    RETURN true;  -- it granted the resource: a durable commit
                END IF;
            END IF;
            v_ignored := set_config('synchronous_commit', 'off', true);
""",
                1,
            ),
            (
                "        SELECT * INTO v_row",
                "        v_ignored := set_config('synchronous_commit', 'off', true);\n"
                "        SELECT * INTO v_row",
                1,
            ),
        ),
    )


def _leave_with_handoff() -> str:
    """``leave`` (a new function: it takes the leaver's owner) that, when the leaver's row is
    gone because a releaser granted it the resource (its acquire gave up before it learnt
    so), ends that lease and passes the resource on."""
    return _edited(
        _shipped("leave"),
        (
            ("p_ticket bigint)\n", "p_ticket bigint, p_owner text)\n", 1),
            ("        PERFORM set_config('synchronous_commit', 'off', true);\n", "", 1),
            (
                """        IF FOUND AND v_first
                AND (v_row.owner IS NULL OR v_row.expires_at <= v_now) THEN
            PERFORM {s}._wake(p_name, true);
        END IF;
""",
                """        IF FOUND THEN
            IF v_first AND (v_row.owner IS NULL OR v_row.expires_at <= v_now) THEN
                PERFORM {s}._wake(p_name, true);
            END IF;
        ELSIF v_row.owner = p_owner AND v_row.expires_at > v_now THEN
            UPDATE {s}.resources r SET owner = NULL, value = NULL, ended = 'released'
            WHERE r.name = p_name;
            INSERT INTO {s}.records (at, kind, resource, epoch, holder)
            VALUES (v_now, 'released', p_name, v_row.epoch, v_row.holder);
            IF {s}._handoff(p_name, v_now, 'released') THEN
                RETURN;  -- passed on: a durable commit
            END IF;
        END IF;
        PERFORM set_config('synchronous_commit', 'off', true);
""",
                1,
            ),
        ),
    )


def _try_grant_with_handoff(try_grant: str) -> str:
    """``try_grant`` that keeps what a releaser needs to grant a waiter directly (its owner,
    ttl, value and listen key) and prunes when the caller says so (``p_prune``)."""
    keep = "{s}._keep(p_name, p_ticket, p_holder, v_now, p_keepalive)"
    return _edited(
        try_grant,
        (
            (
                "p_retry_cap double precision,\n",
                "p_retry_cap double precision, p_listen_key integer, p_prune boolean,\n",
                1,
            ),
            (keep, keep[:-1] + ", p_owner, p_ttl, p_value, p_listen_key)", 2),
            ("IF random() < 0.01 THEN", "IF p_prune THEN", 1),
            ("IF random() < 0.001 THEN", "IF p_prune THEN", 1),
        ),
    )


def _advance_raising_epochs(advance: str) -> str:
    """``advance`` that also raises every granted resource's epoch to the new minimum, so that a
    grant that locked the resource's row never needs the minimum (the fast path)."""
    return _edited(
        advance,
        (
            (
                "SET owner = NULL, value = NULL, ended = 'restored';",
                "SET owner = NULL, value = NULL, ended = 'restored',\n"
                "            epoch = CASE WHEN r.epoch > 0 THEN greatest(r.epoch, v_min)"
                " ELSE 0 END;",
                1,
            ),
        ),
    )


def _try_grant_pruning_cheaply(try_grant: str) -> str:
    """``try_grant`` whose record pruning first looks at the oldest record only (one index
    probe) and deletes among the oldest 1000 only if that one is past the retention: the
    version-3 prune read the 1000 oldest records on every pruning grant even when none was due
    (about 11 ms on a table of 10,000 records, on 1 grant in 200)."""
    cutoff = (
        "v_now - (SELECT m.value::float8 FROM {s}.meta m\n"
        "                                      WHERE m.key = 'records_retention') "
        "* interval '1 second'"
    )
    return _edited(
        try_grant,
        (
            (
                "DELETE FROM {s}.records x WHERE x.seq IN (\n"
                "                    SELECT o.seq FROM {s}.records o ORDER BY o.seq LIMIT 1000)\n"
                f"                  AND x.at < {cutoff};",
                "IF (SELECT f.at FROM {s}.records f ORDER BY f.seq LIMIT 1)\n"
                f"                    < {cutoff} THEN\n"
                "                DELETE FROM {s}.records x WHERE x.seq IN (\n"
                "                    SELECT o.seq FROM {s}.records o ORDER BY o.seq LIMIT 1000)\n"
                f"                  AND x.at < {cutoff};\n"
                "                END IF;",
                1,
            ),
        ),
    )


def _advance_recording_expiries(advance: str) -> str:
    """``advance`` that first records every expiry that is due (waiting for row locks, so none
    is skipped), as every reader does: a lease that expired before a restore ends ``expired``,
    then ``restored``, whether or not anyone looked in between."""
    return _edited(
        advance,
        (
            ("        v_min bigint;\n", "        v_min bigint;\n        v_due record;\n", 1),
            (
                "        LOCK TABLE {s}.resources IN SHARE ROW EXCLUSIVE MODE;\n",
                "        LOCK TABLE {s}.resources IN SHARE ROW EXCLUSIVE MODE;\n"
                "        FOR v_due IN SELECT x.name, x.epoch, x.holder, x.expires_at\n"
                "                     FROM {s}.resources x\n"
                "                     WHERE x.owner IS NOT NULL AND x.expires_at <= v_now\n"
                "                     ORDER BY x.name FOR UPDATE LOOP\n"
                "            PERFORM {s}._expire(v_due.name, v_due.epoch, v_due.holder,"
                " v_due.expires_at);\n"
                "        END LOOP;\n",
                1,
            ),
        ),
    )


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "resources and leases, request ids, FIFO waiters, watchers, records; one function per "
        "operation",
        _TABLES + _HELPERS + _OPERATIONS,
    ),
    Migration(
        2,
        "granted records carry the election value (like every other backend)",
        (_granted_with_value(_OPERATIONS[0]),),
    ),
    Migration(
        3,
        "a release hands the resource to its first live waiter in the same transaction; the "
        "epoch of every granted resource is at least the minimum epoch",
        (
            *_HANDOFF,
            _keep_for_handoff(),
            _enqueue_for_handoff(),
            _release_with_handoff(),
            _leave_with_handoff(),
            _try_grant_with_handoff(_granted_with_value(_shipped("try_grant"))),
            _advance_raising_epochs(_shipped("advance")),
            "UPDATE {s}.resources r SET epoch = greatest(r.epoch, (SELECT m.value::bigint"
            " FROM {s}.meta m WHERE m.key = 'minimum_epoch')) WHERE r.epoch > 0",
        ),
    ),
    Migration(
        4,
        "pruning records reads the oldest record first (no scan of 1000 records when none is due)",
        (
            _try_grant_pruning_cheaply(
                _try_grant_with_handoff(_granted_with_value(_shipped("try_grant")))
            ),
        ),
    ),
    Migration(
        5,
        "advance records the expiries that are due before it records the restore",
        (_advance_recording_expiries(_advance_raising_epochs(_shipped("advance"))),),
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
        Migration(
            m.version,
            m.summary,
            tuple(
                s.replace("{c}", name).replace("{k}", str(LISTEN_LOCK_CLASS)) for s in m.statements
            ),
        )
        for m in MIGRATIONS
    )
