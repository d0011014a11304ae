"""Restore-safe epochs. Pure.

After a coordinator's state is restored from a backup, it must never hand out an epoch that a
store could confuse with one issued by the lost, newer state. fenced does not rely on knowing
what that state issued. A restore (or ``fenced restore --advance`` after a restore done behind
fenced's back) raises a coordinator-wide **minimum epoch** to::

    max(every epoch known anywhere (backup, current state, store floors), restore_base(now))

where ``restore_base(now) = floor(unix minutes) << 32``. Every later grant, for every resource
(old or new), gets an epoch above that minimum. The time-based base makes the guarantee hold even
when nothing is known about the lost state: the state before a restore at minute *m* issued
epochs below ``m << 32`` unless it made more than 2**32 grants of one resource per minute since
its own last restore, which no coordinator can. Known epochs (store floors, the state being
replaced) protect against a wall clock that was set back. Epochs stay plain integers below 2**63
until the year 10,000 or so.
"""

from __future__ import annotations

import math

__all__ = ["RESTORE_SHIFT", "restore_base"]

RESTORE_SHIFT = 32


def restore_base(wall_now: float) -> int:
    """The minimum epoch a restore at wall-clock time ``wall_now`` must advance to."""
    return math.floor(wall_now / 60) << RESTORE_SHIFT
