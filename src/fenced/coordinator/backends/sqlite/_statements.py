"""The SQL statements of the embedded coordinator.

Every statement that grants, releases, renews, hands off, queues or records is here, written
against the schema of :mod:`.schema`; :mod:`.backend` and :mod:`.waiting` run them. Parameters
are named: ``:now`` and ``:boot`` are the host clock's boot time and boot id, read by the caller
right before the statement (``SQLiteBackend._params``); a lease is live iff :data:`_LIVE`.
"""

from __future__ import annotations

NO_TICKET = 2**63 - 1
"""A waiter id behind every queued waiter."""
_NO_TICKET = NO_TICKET

_PRUNE_RECORDS = (
    "DELETE FROM records WHERE seq IN (SELECT seq FROM records ORDER BY seq LIMIT :batch) "
    "AND seq < (SELECT max(seq) FROM records) "
    "AND (seq <= (SELECT max(seq) FROM records) - :keep OR at < :oldest)"
)

_LIVE = "owner IS NOT NULL AND boot_id = :boot AND expires_at > :now"
# Epochs reserved in another boot may have been granted without fsync and lost in a crash:
# grants then start above them (see the module doc).
_LOST_RESERVATION = "iif(resources.reserved_boot IS NOT :boot, resources.reserved, 0)"
_LIVE_WAITER = "boot_id = :boot AND expires_at > :now"
_MINIMUM = "(SELECT epoch FROM minimum_epoch WHERE id = 1)"

# No live waiter ahead of :ticket (0: no ticket, behind everyone).
_NONE_AHEAD = f"""NOT EXISTS (
    SELECT 1 FROM waiters WHERE name = :name AND {_LIVE_WAITER} AND id < coalesce(
        (SELECT id FROM waiters WHERE id = :ticket AND name = :name), {_NO_TICKET}))"""
# What a grant writes into the resource's row (both grant statements): the next epoch and the
# caller's lease.
_TAKE = f"""epoch = max(epoch, {_MINIMUM}, {_LOST_RESERVATION}) + 1, owner = :owner,
    holder = :holder,
    ttl = :ttl, expires_at = :now + :ttl, boot_id = :boot, value = :value, granted_at = :wall,
    ended = NULL, ended_at = NULL, end_recorded = 1"""
_FREE = (
    "NOT (resources.owner IS NOT NULL AND resources.boot_id = :boot "
    "AND resources.expires_at > :now)"
)
# Grant if no live lease and nobody ahead. The record_first_grant / record_grant triggers write
# the records. A new row starts with its ``watched`` flag (see _WATCHED_ON); the statements that
# change a lease return the flag.
_GRANT = f"""
INSERT INTO resources (name, epoch, owner, holder, ttl, expires_at, boot_id, value, granted_at,
                       ended, ended_at, end_recorded, watched)
SELECT :name, {_MINIMUM} + 1, :owner, :holder, :ttl, :now + :ttl, :boot, :value, :wall,
       NULL, NULL, 1, EXISTS (SELECT 1 FROM watchers WHERE name = :name)
WHERE {_NONE_AHEAD}
ON CONFLICT (name) DO UPDATE SET {_TAKE}
WHERE {_FREE}
RETURNING epoch, watched
"""
# The same grant of a resource whose row exists (every grant but its first): a plain UPDATE
# (no insert attempt, one b-tree seek). No row → no grant, and the caller falls back to _GRANT.
_GRANT_KNOWN = f"""
UPDATE resources SET {_TAKE}
WHERE name = :name AND {_FREE} AND {_NONE_AHEAD}
RETURNING epoch, watched
"""
_FIRST_WAITER = f"FROM waiters WHERE name = :name AND {_LIVE_WAITER} ORDER BY id LIMIT 1"
# The head waiter comes back with the answer (and whether the lease can be handed to it): it
# is served without another round trip.
_RELEASE = f"""
UPDATE resources SET owner = NULL, ended = 'released', ended_at = :wall, end_recorded = 0
WHERE name = :name AND epoch = :epoch AND owner = :owner AND {_LIVE}
RETURNING watched, (SELECT json_array(id, addr, netns, owner IS NOT NULL) {_FIRST_WAITER})
"""
# ``resources.watched``: whether ``watchers`` may have a row for the resource, kept with the
# watchers (set with an insert, cleared with the delete of the last one) so that a grant and a
# release read a column instead of running a subquery. A row of ``watchers``
# deleted without clearing the flag (an expired one purged by another watch) only costs one
# read of ``watchers`` by the next change, which then clears it.
_WATCHED_ON = "UPDATE resources SET watched = 1 WHERE name = :name AND NOT watched"
_WATCHED_OFF = (
    "UPDATE resources SET watched = 0 WHERE name = :name AND watched "
    "AND NOT EXISTS (SELECT 1 FROM watchers WHERE name = :name)"
)
# Grant the free resource to its head waiter :head in that waiter's name (its queued request),
# if :head is still live and first in line. Unless :durable (the commit will be fsynced), only
# within the epochs reserved durably in this boot. The record_grant trigger writes the records.
_HAND_OFF = f"""
UPDATE resources SET epoch = max(resources.epoch, {_MINIMUM}, {_LOST_RESERVATION}) + 1,
    owner = w.owner,
    holder = w.holder, ttl = w.ttl, expires_at = :now + w.ttl, boot_id = :boot, value = w.value,
    granted_at = :wall, ended = NULL, ended_at = NULL, end_recorded = 1
FROM (SELECT owner, holder, ttl, value FROM waiters
      WHERE id = :head AND name = :name AND owner IS NOT NULL AND {_LIVE_WAITER}) AS w
WHERE resources.name = :name
    AND NOT (resources.owner IS NOT NULL AND resources.boot_id = :boot
             AND resources.expires_at > :now)
    AND NOT EXISTS (SELECT 1 FROM waiters WHERE name = :name AND {_LIVE_WAITER} AND id < :head)
    AND (:durable OR (resources.reserved_boot IS :boot
                      AND max(resources.epoch, {_MINIMUM}) + 1 <= resources.reserved))
RETURNING epoch
"""
_QUEUE_LENGTH = f"(SELECT count(*) FROM waiters WHERE name = :name AND {_LIVE_WAITER})"
# How far the epochs reserved for hand-offs reach (:ahead beyond the last epoch and the queue).
_COVERAGE = f"""
SELECT r.reserved_boot IS :boot AND r.reserved >= max(r.epoch, {_MINIMUM}) + {_QUEUE_LENGTH} + 1
FROM resources AS r WHERE r.name = :name
"""
# Reserve epochs for the queue (durably: run in a durable transaction). A reservation of another
# boot must first be passed by a grant (which starts above it, see _LOST_RESERVATION): until
# then nothing is reserved and hand-offs are fsynced.
_RESERVE = f"""
UPDATE resources SET
    reserved = max(reserved, max(epoch, {_MINIMUM}) + {_QUEUE_LENGTH} + :ahead),
    reserved_boot = :boot
WHERE name = :name AND (reserved_boot IS :boot OR epoch >= reserved)
"""
_RENEW = f"""
UPDATE resources SET ttl = :ttl, expires_at = :now + :ttl
WHERE name = :name AND epoch = :epoch AND owner = :owner AND {_LIVE} RETURNING 1
"""
_PROCLAIM = f"""
UPDATE resources SET value = :value
WHERE name = :name AND epoch = :epoch AND owner = :owner AND {_LIVE} RETURNING holder
"""
# A resource's state as a caller in line sees it (one row even for an unknown name).
_STATE = f"""
SELECT coalesce(r.epoch, 0), r.holder, r.expires_at,
       r.owner IS NOT NULL AND r.boot_id = :boot AND r.expires_at > :now, {_MINIMUM},
       (SELECT expires_at FROM waiters WHERE id = :ticket AND name = :name), r.owner IS :owner
FROM (SELECT 1) LEFT JOIN resources AS r ON r.name = :name
"""
_LEASE = (
    f"SELECT epoch, holder, ttl, expires_at, value FROM resources WHERE name = :name AND {_LIVE}"
)
# A hand-off a datagram announced, confirmed: the live lease of this epoch in the waiter's name.
_HANDED = (
    "SELECT expires_at FROM resources "
    f"WHERE name = :name AND epoch = :epoch AND owner = :owner AND {_LIVE}"
)
_HEAD = f"""
SELECT id, addr, netns, expires_at FROM waiters
WHERE name = :name AND {_LIVE_WAITER} AND id < :before ORDER BY id LIMIT 1
"""
# The first live waiter ahead of :ticket (of anyone, if :ticket has no row).
_HEAD_AHEAD = f"""
SELECT id, addr, netns, expires_at FROM waiters
WHERE name = :name AND {_LIVE_WAITER} AND id < coalesce(
    (SELECT id FROM waiters WHERE id = :ticket AND name = :name), {_NO_TICKET})
ORDER BY id LIMIT 1
"""
_ENQUEUE = """
INSERT INTO waiters (name, addr, netns, pid, holder, expires_at, boot_id, owner, ttl, value)
VALUES (:name, :addr, :netns, :pid, :holder, :now + :keepalive, :boot, :owner, :ttl, :value)
RETURNING id
"""
_KEEP_ALIVE = """
UPDATE waiters SET expires_at = :now + :keepalive, boot_id = :boot
WHERE id = :ticket AND name = :name RETURNING id
"""
_DROP_EXPIRED_WAITERS = f"DELETE FROM waiters WHERE name = :name AND NOT ({_LIVE_WAITER})"
_RECORD = (
    "INSERT INTO records (at, kind, resource, epoch, holder, detail) VALUES (?, ?, ?, ?, ?, ?)"
)
# Lease ends not recorded yet: unnoticed expiries, and releases (see the module doc).
_ONE_OR_ALL = "(:name IS NULL OR name = :name)"
_UNSETTLED = f"""
SELECT name FROM resources
WHERE {_ONE_OR_ALL} AND (NOT end_recorded OR (owner IS NOT NULL AND NOT ({_LIVE})))
"""
_END_EXPIRED = f"""
UPDATE resources SET owner = NULL, ended = 'expired', end_recorded = 0,
    ended_at = CASE WHEN boot_id = :boot THEN :wall - max(0.0, :now - expires_at) ELSE :wall END
WHERE {_ONE_OR_ALL} AND owner IS NOT NULL AND NOT ({_LIVE})
"""
# The record_end trigger writes the records.
_RECORD_ENDS = f"UPDATE resources SET end_recorded = 1 WHERE {_ONE_OR_ALL} AND NOT end_recorded"
