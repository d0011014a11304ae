"""The restore base: the minimum epoch, from the wall clock, that a restore advances to. Pure.

After a coordinator's state is restored from a backup, it must never hand out an epoch that a
store could confuse with one issued by the lost, newer state. fenced does not rely on knowing
what that state issued. A restore (or ``fenced restore --advance`` after a restore done behind
fenced's back) raises a coordinator-wide **minimum epoch** to::

    max(every epoch known anywhere (backup, current state, store floors), restore_base(now))

where ``restore_base`` reads the wall-clock millisecond ``t`` (:func:`restore_tick`) as::

    restore_base = (t // 60_000) << 32  |  (t % 60_000) << 16

that is the minute in the high bits (the *era*, ``epoch >> 32``) and the millisecond within the
minute above 16 free bits. The base grows by at least ``2**16`` per millisecond, and a restore
completes only once the wall clock reads a later millisecond than the one its base came from
(:mod:`fenced.coordinator._restore` waits for it). Hence, if the wall clock does not step back
between two restores, the later one's base is above every epoch the state installed by the
earlier one issued, unless that state granted one resource ``2**16`` times in one millisecond,
which no coordinator can (each grant is a durable transaction). This holds however soon the
second restore follows the first and whatever the clock's resolution (a coarse clock only makes
the restore wait longer). Known epochs (store floors, the state being replaced) protect against
a wall clock that was set back. Epochs stay plain integers below ``2**63`` until about the year
6,000.
"""

from __future__ import annotations

import math

__all__ = ["RESTORE_SHIFT", "TICKS_PER_ERA", "TICK_SHIFT", "restore_base", "restore_tick"]

RESTORE_SHIFT = 32
"""``epoch >> RESTORE_SHIFT`` is the era: the Unix minute of the restore that set the base."""
TICK_SHIFT = 16
"""The free low bits below each millisecond: fewer than ``2**16`` grants of one resource per ms."""
TICKS_PER_ERA = 60_000
"""Milliseconds per era (a minute); ``TICKS_PER_ERA << TICK_SHIFT`` is below ``1 << 32``."""


def restore_tick(wall_now: float) -> int:
    """The wall-clock millisecond (since the Unix epoch) that a restore's base comes from."""
    return math.floor(wall_now * 1000)


def restore_base(wall_now: float) -> int:
    """The minimum epoch a restore at wall-clock time ``wall_now`` (seconds) must advance to.

    Strictly increasing in the millisecond :func:`restore_tick`, by at least ``2**16`` per
    millisecond; ``restore_base(60 * m) == m << 32`` (the start of minute ``m``).
    """
    era, tick = divmod(restore_tick(wall_now), TICKS_PER_ERA)
    return (era << RESTORE_SHIFT) | (tick << TICK_SHIFT)
