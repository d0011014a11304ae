"""The public test kit of fenced: a manual clock, fault wrappers and conformance suites.

* :class:`fenced.core._clock.ManualClock` (re-exported here): time that moves only when told.
* :mod:`fenced.testing.faults`: :class:`FaultyBackend` wraps any coordinator backend and injects
  unavailability, lost replies (the request is applied, the reply never arrives) and delays.
* :mod:`fenced.testing.conformance`: the coordinator conformance suite every backend runs.
* :mod:`fenced.testing.store_conformance`: the store conformance suite every store runs.
"""

from fenced.core._clock import ManualClock

__all__ = ["ManualClock"]
