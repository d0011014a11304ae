"""The PostgreSQL coordinator's tables and functions, created and migrated automatically.

Everything lives in one PostgreSQL schema (default ``fenced``; ``?schema=name``). ``meta`` holds
``format``, ``schema_version``, the ``coordinator_id`` (created once, kept forever), the
coordinator-wide ``minimum_epoch`` (restore safety) and ``records_retention`` (seconds).
:data:`MIGRATIONS` lists the schema's versions in order (one, the initial format, before the
first release); :func:`fenced._drivers.postgres.migrate` creates the schema, or applies the
missing versions, in one transaction under a transaction-level advisory lock. A later change
appends a :class:`~fenced._drivers.migrations.Migration` (``CREATE OR REPLACE`` the functions
it changes); a released one is never edited. A schema of a newer version, or tables of another
format, are refused with ``ConfigurationError`` and left untouched.

Every lease operation is one round trip and one transaction: one call of one PL/pgSQL
function, or, for the uncontended grant and release, one statement of the client's that falls
back to the function within the same statement (``_FAST_GRANT`` and ``_FAST_RELEASE`` in
:mod:`fenced.coordinator.backends.postgres._statements`). Both read the server's clock
(``clock_timestamp()``) — the client's clock is never sent — and lock the resource's row before
they change anything, which orders every change and record of a resource.

Tables: ``resources`` (one row per resource: the last granted or reserved epoch — never below
the minimum epoch once granted — and the lease of that epoch, live iff
``owner IS NOT NULL AND expires_at > clock_timestamp()``; ``ended`` says how the last lease that
ended did), ``requests`` (``request_id`` deduplication, kept 24 h), ``waiters`` (the FIFO queue:
``id`` order is arrival order; a row is live while its keep-alive lasts; it also
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

from fenced._drivers.migrations import Migration

__all__ = ["FORMAT", "LISTEN_LOCK_CLASS", "MIGRATIONS", "SCHEMA_VERSION", "channel", "migrations"]

FORMAT = "fenced.coordinator"


def _sql(template: str, **fragments: str) -> str:
    """``template`` with each ``{name}`` of ``fragments`` replaced by that piece of SQL, its
    further lines indented as the line of the marker. The placeholders ``{s}`` (the schema),
    ``{c}`` (the channel) and ``{k}`` (the listen lock class) stay, filled in later."""
    assert not fragments.keys() & {"s", "c", "k"}
    lines = []
    for line in template.split("\n"):
        indent = line[: len(line) - len(line.lstrip())]
        filled = line
        for name, text in fragments.items():
            filled = filled.replace("{" + name + "}", text.replace("\n", "\n" + indent))
        lines.append(filled)
    return "\n".join(lines)


# Pieces of SQL that several functions share: one definition of each condition and step. They
# are part of migration 1: once it is released, a later migration that changes one writes its
# own text instead of editing them.


def _live_waiters(now: str) -> str:
    """The waiters of ``p_name`` whose keep-alive lasts past ``now`` (alias ``w``)."""
    return _sql("{s}.waiters w WHERE w.name = p_name AND w.expires_at > {now}", now=now)


def _live_watchers(now: str) -> str:
    """The watchers of ``p_name`` whose keep-alive lasts past ``now`` (alias ``x``)."""
    return _sql("{s}.watchers x WHERE x.name = p_name AND x.expires_at > {now}", now=now)


def _end_lease(kind: str, epoch: str, holder: str, at: str) -> str:
    """End the (locked) lease of ``p_name`` as ``kind`` (released, expired) and record that."""
    return _sql(
        """UPDATE {s}.resources r SET owner = NULL, value = NULL, ended = '{kind}'
WHERE r.name = p_name;
INSERT INTO {s}.records (at, kind, resource, epoch, holder)
VALUES ({at}, '{kind}', p_name, {epoch}, {holder});""",
        kind=kind,
        epoch=epoch,
        holder=holder,
        at=at,
    )


def _expire_and_wake(name: str, row: str) -> str:
    """End the expired lease of ``name`` (``row`` holds its locked resource row) and wake its
    first live waiter (or its watchers)."""
    return _sql(
        """PERFORM {s}._expire({name}, {row}.epoch, {row}.holder, {row}.expires_at);
PERFORM {s}._wake({name}, true);""",
        name=name,
        row=row,
    )


def _granted_detail(after: str, value: str) -> str:
    """The ``detail`` of a grant record: how the previous lease ended, and the value if any."""
    return _sql(
        """jsonb_build_object('after', {after})
|| CASE WHEN {value} IS NULL THEN '{}'::jsonb
        ELSE jsonb_build_object('value', {value}) END""",
        after=after,
        value=value,
    )


# Not renewed, not released: lock the row and record the expiry if that is why.
_EXPIRE_IF_DUE = _sql(
    """SELECT * INTO v_row FROM {s}.resources r WHERE r.name = p_name FOR UPDATE;
IF FOUND AND v_row.owner IS NOT NULL AND v_row.expires_at <= clock_timestamp() THEN
    {expire}
END IF;""",
    expire=_expire_and_wake("p_name", "v_row"),
)

# A durable commit for this transaction even if the server or role runs with it off.
_DURABLE = """IF current_setting('synchronous_commit') = 'off' THEN
    v_ignored := set_config('synchronous_commit', 'on', true);
END IF;"""

_NEW_WATCHER = """INSERT INTO {s}.watchers (name, expires_at)
VALUES (p_name, v_now + p_keepalive * interval '1 second') RETURNING id INTO v_id;"""

# Records older than this are past the retention.
_RETENTION_CUTOFF = (
    "v_now - (SELECT m.value::float8 FROM {s}.meta m WHERE m.key = 'records_retention')"
    " * interval '1 second'"
)


def _granted_again(row: str) -> str:
    """try_grant's answer for a lease granted to this very request already (``row``: the
    request or the resource, which agree): the same lease; the caller leaves the queue."""
    return _sql(
        """IF p_ticket IS NOT NULL THEN
    DELETE FROM {s}.waiters w WHERE w.id = p_ticket;
END IF;
o_status := 'granted';
o_owner := {row}.owner;
o_holder := {row}.holder;
o_ttl := {row}.ttl;
o_remaining := extract(epoch FROM v_row.expires_at - v_now);
o_ticket := NULL;
RETURN;""",
        row=row,
    )


def _blocked(epoch: str, remaining: str, retry_in: str) -> str:
    """try_grant's answer for a caller that must wait: it keeps (or takes) its place in line;
    a queued caller retries at the latest at the cap."""
    return _sql(
        """v_ignored := set_config('synchronous_commit', 'off', true);
o_ticket := {s}._keep(p_name, p_ticket, p_holder, v_now, p_keepalive,
                      p_owner, p_ttl, p_value, p_listen_key);
o_status := 'blocked';
o_epoch := {epoch};
o_remaining := {remaining};
o_retry_in := {retry_in};
IF o_ticket IS NOT NULL THEN
    o_retry_in := least(o_retry_in, p_retry_cap);
END IF;
RETURN;""",
        epoch=epoch,
        remaining=remaining,
        retry_in=retry_in,
    )


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
        expires_at timestamptz NOT NULL,
        owner text,
        ttl double precision,
        value text,
        listen_key integer,
        refreshed_at timestamptz
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
    _sql(
        """CREATE OR REPLACE FUNCTION {s}._wake(p_name text, p_free boolean) RETURNS void
    LANGUAGE plpgsql AS $$
    DECLARE
        v_head bigint;
    BEGIN
        IF p_free THEN
            SELECT w.id INTO v_head FROM {waiters} ORDER BY w.id LIMIT 1;
        END IF;
        IF v_head IS NOT NULL THEN
            PERFORM pg_notify('{c}', v_head::text || ':' || p_name);
        ELSIF EXISTS (SELECT 1 FROM {watchers}) THEN
            PERFORM pg_notify('{c}', '0:' || p_name);
        END IF;
    END $$""",
        waiters=_live_waiters("clock_timestamp()"),
        watchers=_live_watchers("clock_timestamp()"),
    ),
    # End the (locked) expired lease of p_name and record its expiry, dated when it happened.
    _sql(
        """CREATE OR REPLACE FUNCTION {s}._expire(
        p_name text, p_epoch bigint, p_holder text, p_at timestamptz) RETURNS void
    LANGUAGE plpgsql AS $$
    BEGIN
        {end}
    END $$""",
        end=_end_lease("expired", "p_epoch", "p_holder", "p_at"),
    ),
    # Detect and record every due expiry (of p_name, or of all resources when NULL). A row
    # locked by someone else is skipped: that transaction is deciding about it right now.
    _sql(
        """CREATE OR REPLACE FUNCTION {s}._expire_due(p_name text) RETURNS void
    LANGUAGE plpgsql AS $$
    DECLARE
        r record;
    BEGIN
        FOR r IN SELECT x.name, x.epoch, x.holder, x.expires_at FROM {s}.resources x
                 WHERE (p_name IS NULL OR x.name = p_name)
                   AND x.owner IS NOT NULL AND x.expires_at <= clock_timestamp()
                 FOR UPDATE SKIP LOCKED LOOP
            {expire}
        END LOOP;
    END $$""",
        expire=_expire_and_wake("r.name", "r"),
    ),
    # Durable commit for this transaction even if the server or role runs with it off.
    _sql(
        """CREATE OR REPLACE FUNCTION {s}._durable() RETURNS void
    LANGUAGE plpgsql AS $$
    DECLARE
        v_ignored text;
    BEGIN
        {durable}
    END $$""",
        durable=_DURABLE,
    ),
    # The (locked) resource p_name has just become free (p_after: why): grant it to its first
    # live waiter if that one can take it without a round trip (it gave its owner and holds
    # its listen lock), durably, and NOTIFY it '<id>:<name>:<epoch>:<seconds since its last
    # keep-alive>'. A waiter whose listen lock is free is gone: its row is dropped and the next
    # one is considered. Otherwise wake the first live waiter (it grants itself) or, if nobody
    # waits, the watchers. True if granted (the caller's transaction then commits durably).
    _sql(
        """CREATE OR REPLACE FUNCTION {s}._handoff(p_name text, p_now timestamptz, p_after text)
    RETURNS boolean
    LANGUAGE plpgsql AS $$
    DECLARE
        v_w {s}.waiters%ROWTYPE;
        v_epoch bigint;
    BEGIN
        LOOP
            SELECT * INTO v_w FROM {waiters} ORDER BY w.id LIMIT 1;
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
                   {detail}
            FROM g),
        gone AS (DELETE FROM {s}.waiters w WHERE w.id = v_w.id)
        SELECT g.epoch INTO v_epoch FROM g;
        PERFORM pg_notify('{c}', v_w.id::text || ':' || p_name || ':' || v_epoch::text || ':'
                || coalesce(extract(epoch FROM p_now - v_w.refreshed_at)::float8, 0)::text),
            CASE WHEN EXISTS (SELECT 1 FROM {watchers})
                 THEN pg_notify('{c}', '0:' || p_name) END,
            CASE WHEN current_setting('synchronous_commit') = 'off'
                 THEN set_config('synchronous_commit', 'on', true) END;
        RETURN true;
    END $$""",
        waiters=_live_waiters("p_now"),
        watchers=_live_watchers("p_now"),
        detail=_granted_detail("p_after", "v_w.value"),
    ),
    # Keep the caller's place in line (re-join at the end if its row was dropped; ticket 0
    # never exists, so it inserts a new row), with what _handoff needs to grant it directly.
    """CREATE OR REPLACE FUNCTION {s}._keep(
        p_name text, p_ticket bigint, p_holder text, p_now timestamptz,
        p_keepalive double precision,
        p_owner text, p_ttl double precision, p_value text, p_listen_key integer)
    RETURNS bigint
    LANGUAGE plpgsql AS $$
    DECLARE
        v_ticket bigint := p_ticket;
    BEGIN
        IF v_ticket IS NULL THEN
            RETURN NULL;
        END IF;
        UPDATE {s}.waiters w SET expires_at = p_now + p_keepalive * interval '1 second',
            refreshed_at = p_now, listen_key = p_listen_key
        WHERE w.id = v_ticket AND w.name = p_name;
        IF NOT FOUND THEN
            INSERT INTO {s}.waiters
                (name, holder, expires_at, owner, ttl, value, listen_key, refreshed_at)
            VALUES (p_name, p_holder, p_now + p_keepalive * interval '1 second', p_owner,
                    p_ttl, p_value, p_listen_key, p_now)
            RETURNING id INTO v_ticket;
        END IF;
        RETURN v_ticket;
    END $$""",
)

_OPERATIONS = (
    # One acquire attempt; see PostgresBackend.try_grant. o_status: granted / blocked / lost
    # (a request_id whose lease has ended) / foreign (a request_id used for another resource,
    # whose name is returned in o_holder). A waiting caller keeps what a releaser needs to
    # grant it directly (owner, ttl, value, listen key). Records past the retention are pruned
    # when the caller says so (p_prune), looking first at the oldest record only.
    _sql(
        """CREATE OR REPLACE FUNCTION {s}.try_grant(
        p_name text, p_owner text, p_holder text, p_ttl double precision, p_request_id text,
        p_ticket bigint, p_value text, p_keepalive double precision,
        p_retry_cap double precision, p_listen_key integer, p_prune boolean,
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
                    {granted_again_request}
                END IF;
            END IF;
            IF v_row.owner = p_owner THEN
                -- this very request was granted already (its reply was lost): the same lease
                o_epoch := v_row.epoch;
                {granted_again_owner}
            END IF;
            IF v_row.owner IS NOT NULL THEN
                -- blocked by a live lease: retry at its expiry (or at the keep-alive)
                o_holder := v_row.holder;
                o_ttl := v_row.ttl;
                {blocked_by_lease}
            END IF;
            IF NOT v_found THEN
                SELECT m.value::bigint INTO v_minimum FROM {s}.meta m
                WHERE m.key = 'minimum_epoch';
            END IF;
            v_epoch := greatest(coalesce(v_row.epoch, 0), coalesce(v_minimum, 0));
            -- the first live waiter ahead of the caller (if any), and whether anyone watches
            SELECT h.id, h.expires_at, EXISTS (SELECT 1 FROM {watchers})
            INTO v_head, v_head_expires, v_watched
            FROM (SELECT 1) AS one LEFT JOIN LATERAL (
                SELECT w.id, w.expires_at FROM {waiters}
                  AND w.id < CASE
                      WHEN p_ticket IS NULL THEN 9223372036854775807
                      WHEN EXISTS (SELECT 1 FROM {s}.waiters m
                                   WHERE m.id = p_ticket AND m.name = p_name) THEN p_ticket
                      ELSE 9223372036854775807 END
                ORDER BY w.id LIMIT 1) AS h ON true;
            IF v_head IS NOT NULL THEN
                -- free, but an earlier live waiter is first in line
                IF v_expired THEN
                    PERFORM pg_notify('{c}', v_head::text || ':' || p_name);
                END IF;
                {blocked_by_waiter}
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
                       {detail_after_ended}
                FROM u;
            ELSE
                WITH u AS (
                    INSERT INTO {s}.resources (name, epoch, owner, holder, ttl, expires_at, value)
                    VALUES (p_name, v_epoch, p_owner, p_holder, p_ttl,
                            v_now + p_ttl * interval '1 second', p_value)
                    ON CONFLICT (name) DO NOTHING RETURNING name)
                INSERT INTO {s}.records (at, kind, resource, epoch, holder, detail)
                SELECT v_now, 'granted', u.name, v_epoch, p_holder,
                       {detail_first}
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
                IF p_prune THEN
                    DELETE FROM {s}.requests q WHERE q.request_id IN (
                        SELECT o.request_id FROM {s}.requests o
                        WHERE o.created_at < v_now - interval '24 hours'
                        ORDER BY o.created_at LIMIT 512);
                END IF;
            END IF;
            IF p_prune THEN
                IF (SELECT f.at FROM {s}.records f ORDER BY f.seq LIMIT 1) < {cutoff} THEN
                    DELETE FROM {s}.records x WHERE x.seq IN (
                        SELECT o.seq FROM {s}.records o ORDER BY o.seq LIMIT 1000)
                      AND x.at < {cutoff};
                END IF;
            END IF;
            IF v_watched THEN
                PERFORM pg_notify('{c}', '0:' || p_name);
            END IF;
            -- a durable grant
            {durable}
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
        granted_again_request=_granted_again("v_req"),
        granted_again_owner=_granted_again("v_row"),
        blocked_by_lease=_blocked(
            "v_row.epoch",
            "greatest(extract(epoch FROM v_row.expires_at - v_now), 0)",
            "o_remaining + v_eps",
        ),
        blocked_by_waiter=_blocked(
            "v_epoch", "0", "greatest(extract(epoch FROM v_head_expires - v_now), 0) + v_eps"
        ),
        watchers=_live_watchers("v_now"),
        waiters=_live_waiters("v_now"),
        detail_after_ended=_granted_detail("v_row.ended", "p_value"),
        detail_first=_granted_detail("'none'", "p_value"),
        cutoff=_RETENTION_CUTOFF,
        durable=_DURABLE,
    ),
    _sql(
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
            {durable}
            RETURN p_ttl;
        END IF;
        -- not renewed: record the expiry if that is why
        v_ignored := set_config('synchronous_commit', 'off', true);
        {expire_if_due}
        RETURN NULL;
    END $$""",
        durable=_DURABLE,
        expire_if_due=_EXPIRE_IF_DUE,
    ),
    # A lost release only delays the next grant until the lease's expiry: no fsync. The
    # successful release is one statement (end the lease, record it, hand the resource to the
    # first waiter with _handoff); it commits without waiting for the disk only when it
    # granted nothing.
    _sql(
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
        WITH u AS (
            UPDATE {s}.resources r SET owner = NULL, value = NULL, ended = 'released'
            WHERE r.name = p_name AND r.epoch = p_epoch AND r.owner = p_owner
              AND r.expires_at > v_now
            RETURNING r.holder),
        rec AS (
            INSERT INTO {s}.records (at, kind, resource, epoch, holder)
            SELECT v_now, 'released', p_name, p_epoch, u.holder FROM u RETURNING 1)
        SELECT EXISTS (SELECT 1 FROM rec),
               (SELECT w.id FROM {waiters} ORDER BY w.id LIMIT 1),
               EXISTS (SELECT 1 FROM {watchers})
        INTO v_released, v_head, v_watched;
        IF v_released THEN
            IF v_head IS NOT NULL OR v_watched THEN
                IF {s}._handoff(p_name, v_now, 'released') THEN
                    RETURN true;  -- it granted the resource: a durable commit
                END IF;
            END IF;
            v_ignored := set_config('synchronous_commit', 'off', true);
            RETURN true;
        END IF;
        v_ignored := set_config('synchronous_commit', 'off', true);
        {expire_if_due}
        RETURN false;
    END $$""",
        waiters=_live_waiters("v_now"),
        watchers=_live_watchers("v_now"),
        expire_if_due=_EXPIRE_IF_DUE,
    ),
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
    _sql(
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
            {expire}
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
        expire=_expire_and_wake("p_name", "v_row"),
    ),
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
        p_name text, p_holder text, p_keepalive double precision,
        p_owner text, p_ttl double precision, p_value text, p_listen_key integer)
    RETURNS bigint
    LANGUAGE plpgsql AS $$
    DECLARE
        v_now timestamptz := clock_timestamp();
        v_id bigint;
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        DELETE FROM {s}.waiters w WHERE w.name = p_name AND w.expires_at <= v_now;
        v_id := {s}._keep(p_name, 0, p_holder, v_now, p_keepalive, p_owner, p_ttl, p_value,
                          p_listen_key);
        RETURN v_id;
    END $$""",
    # Leave the queue; if the leaver was first in line and the resource is free, wake the next.
    # The resource row lock orders this with a concurrent release's choice of whom to wake.
    # A leaver whose row is gone because a releaser granted it the resource (its acquire gave
    # up before it learnt so) ends that lease (p_owner) and passes the resource on.
    _sql(
        """CREATE OR REPLACE FUNCTION {s}.leave(p_name text, p_ticket bigint, p_owner text)
    RETURNS void
    LANGUAGE plpgsql AS $$
    DECLARE
        v_now timestamptz := clock_timestamp();
        v_row {s}.resources%ROWTYPE;
        v_first boolean;
    BEGIN
        SELECT * INTO v_row FROM {s}.resources r WHERE r.name = p_name FOR UPDATE;
        v_first := NOT EXISTS (SELECT 1 FROM {waiters} AND w.id < p_ticket);
        DELETE FROM {s}.waiters w WHERE w.id = p_ticket AND w.name = p_name;
        IF FOUND THEN
            IF v_first AND (v_row.owner IS NULL OR v_row.expires_at <= v_now) THEN
                PERFORM {s}._wake(p_name, true);
            END IF;
        ELSIF v_row.owner = p_owner AND v_row.expires_at > v_now THEN
            {end}
            IF {s}._handoff(p_name, v_now, 'released') THEN
                RETURN;  -- passed on: a durable commit
            END IF;
        END IF;
        PERFORM set_config('synchronous_commit', 'off', true);
    END $$""",
        waiters=_live_waiters("v_now"),
        end=_end_lease("released", "v_row.epoch", "v_row.holder", "v_now"),
    ),
    _sql(
        """CREATE OR REPLACE FUNCTION {s}.watch_start(p_name text, p_keepalive double precision)
    RETURNS bigint
    LANGUAGE plpgsql AS $$
    DECLARE
        v_now timestamptz := clock_timestamp();
        v_id bigint;
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        DELETE FROM {s}.watchers x WHERE x.name = p_name AND x.expires_at <= v_now;
        {new_watcher}
        RETURN v_id;
    END $$""",
        new_watcher=_NEW_WATCHER,
    ),
    # Refresh a watcher, detect due expiries, and say whether records after p_after exist.
    _sql(
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
            {new_watcher}
        END IF;
        PERFORM {s}._expire_due(p_name);
        RETURN QUERY SELECT
            EXISTS (SELECT 1 FROM {s}.records x WHERE x.resource = p_name AND x.seq > p_after),
            v_id,
            (SELECT extract(epoch FROM r.expires_at - clock_timestamp())::float8
             FROM {s}.resources r WHERE r.name = p_name AND r.owner IS NOT NULL);
    END $$""",
        new_watcher=_NEW_WATCHER,
    ),
    # Restore safety (see fenced.core._restore_base): one transaction, exclusive against grants. It
    # records every due expiry first, then raises every granted resource's epoch to the new
    # minimum (a grant that locked the row never needs the minimum) and records the restore.
    """CREATE OR REPLACE FUNCTION {s}.advance(
        p_minimum bigint, p_floors jsonb, p_detail jsonb)
    RETURNS bigint
    LANGUAGE plpgsql AS $$
    DECLARE
        v_now timestamptz := clock_timestamp();
        v_min bigint;
        v_due record;
    BEGIN
        LOCK TABLE {s}.resources IN SHARE ROW EXCLUSIVE MODE;
        FOR v_due IN SELECT x.name, x.epoch, x.holder, x.expires_at
                     FROM {s}.resources x
                     WHERE x.owner IS NOT NULL AND x.expires_at <= v_now
                     ORDER BY x.name FOR UPDATE LOOP
            PERFORM {s}._expire(v_due.name, v_due.epoch, v_due.holder, v_due.expires_at);
        END LOOP;
        SELECT greatest(m.value::bigint, p_minimum) INTO v_min
        FROM {s}.meta m WHERE m.key = 'minimum_epoch' FOR UPDATE;
        UPDATE {s}.meta m SET value = v_min::text WHERE m.key = 'minimum_epoch';
        INSERT INTO {s}.resources AS r (name, epoch)
        SELECT f.key, f.value::bigint FROM jsonb_each_text(p_floors) f
        ON CONFLICT (name) DO UPDATE SET epoch = greatest(r.epoch, excluded.epoch);
        UPDATE {s}.resources r SET owner = NULL, value = NULL, ended = 'restored',
            epoch = CASE WHEN r.epoch > 0 THEN greatest(r.epoch, v_min) ELSE 0 END;
        INSERT INTO {s}.records (at, kind, resource, epoch, holder, detail)
        SELECT v_now, 'restored', r.name, greatest(r.epoch, v_min), NULL,
               p_detail || jsonb_build_object('minimum', v_min)
        FROM {s}.resources r ORDER BY r.name COLLATE "C";
        PERFORM pg_notify('{c}', '0:');
        PERFORM {s}._durable();
        RETURN v_min;
    END $$""",
)

# A waiter that gives up (acquire's wait ran out) and takes the lease a releaser handed it
# meanwhile instead of releasing it: under the resource row lock (which every hand-off takes
# first), either its row is still queued or the lease is not its own — then it is ``leave`` —
# or the handed lease is returned. So no epoch is consumed by a waiter that gives up.
_LEAVE_TAKING = (
    """CREATE OR REPLACE FUNCTION {s}.leave_taking(p_name text, p_ticket bigint, p_owner text)
    RETURNS TABLE (o_epoch bigint, o_holder text, o_ttl double precision,
                   o_remaining double precision)
    LANGUAGE plpgsql AS $$
    DECLARE
        v_row {s}.resources%ROWTYPE;
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        SELECT * INTO v_row FROM {s}.resources r WHERE r.name = p_name FOR UPDATE;
        IF EXISTS (SELECT 1 FROM {s}.waiters w WHERE w.id = p_ticket AND w.name = p_name)
                OR v_row.owner IS DISTINCT FROM p_owner
                OR v_row.expires_at <= clock_timestamp() THEN
            PERFORM {s}.leave(p_name, p_ticket, p_owner);
            RETURN;
        END IF;
        RETURN QUERY SELECT v_row.epoch, v_row.holder, v_row.ttl,
            extract(epoch FROM v_row.expires_at - clock_timestamp())::float8;
    END $$""",
)


LISTEN_LOCK_CLASS = 0x66656E63
"""The first key of the session advisory lock each listening connection holds while it lives
(``pg_advisory_lock(LISTEN_LOCK_CLASS, its listen key)``): a releaser that can take that lock
knows the waiter's listener, hence the waiter, is gone."""

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "resources and leases, request ids, FIFO waiters a releaser grants directly, watchers, "
        "records; one function per operation",
        _TABLES + _HELPERS + _OPERATIONS + _LEAVE_TAKING,
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
