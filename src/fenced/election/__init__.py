"""Leader election with fenced terms: campaign, resign, proclaim, leader, observe.

An election name is a resource name and a term is a lease on it, so the term number *is* the
epoch and the leader's token fences stores exactly like a lease's: once the next leader has
installed its term at a strict store, every write of a demoted leader is rejected there, however
late it arrives. Electing tells a process it *should* lead; the fence decides what it *may* do.

* :mod:`.campaign` — ``coord.campaign(name, value, ttl=…)`` and the :class:`Leadership` it yields
  (``token``, ``term``, ``state``, ``check()``, ``lost``, ``ended``, ``resign()``,
  ``proclaim()``).
* :mod:`.observer` — ``coord.leader(name)`` (:class:`LeaderInfo`) and ``coord.observe(name)`` (an
  :class:`Observer` of :class:`LeaderChange` values: every term once, in order).
* :mod:`.run` — :func:`run_as_leader` (a function, in this thread) and
  :func:`run_command_as_leader` (a supervised child process: ``fenced elect``).
* :mod:`.elector` — :class:`Elector`: campaign, ``on_started(leadership)`` while leader,
  ``on_stopped()`` when the term ends, campaign again until ``stop()``; ``on_new_leader``.

Layering: this package sits *below* :mod:`fenced.coordinator`, beside :mod:`fenced.runtime`,
exactly like ``hold()``: it depends only on :mod:`fenced.core`, :mod:`fenced.runtime` and small
protocols that say what it needs of a coordinator (``hold``, ``history``, ``current``, a backend's
``watch`` and ``proclaim``), and :class:`~fenced.Coordinator` exposes it as
``campaign``/``leader``/``observe`` methods — typed, with no registry and no import cycle.
"""

from fenced.election._campaign import MAX_VALUE_BYTES, Campaign, Leadership, validate_value
from fenced.election._elector import Elector
from fenced.election._observer import (
    LeaderChange,
    LeaderChangeKind,
    LeaderInfo,
    Observer,
    TermTracker,
)
from fenced.election._run import run_as_leader, run_command_as_leader

__all__ = [
    "MAX_VALUE_BYTES",
    "Campaign",
    "Elector",
    "LeaderChange",
    "LeaderChangeKind",
    "LeaderInfo",
    "Leadership",
    "Observer",
    "TermTracker",
    "run_as_leader",
    "run_command_as_leader",
    "validate_value",
]
