"""Protected resources: stores that check fencing tokens atomically with every change.

* :func:`open_store` — a :class:`Store` by URL (``sqlite:///path``, ``file:///dir``): ``fence``,
  ``put``/``get``, ``publish``/``latest``/``read``/``open``, ``gc``, ``floor``.
* :func:`guard` — the same check inside the caller's own SQL transaction.

This package depends on :mod:`fenced.core` only: a store sees nothing but tokens, so it can live
in another process or service than the coordinator.
"""

from fenced.fence.backend import Capability
from fenced.fence.guard import guard
from fenced.fence.store import Store, open_store
from fenced.fence.values import Item, Mode, Publication, Version

__all__ = [
    "Capability",
    "Item",
    "Mode",
    "Publication",
    "Store",
    "Version",
    "guard",
    "open_store",
]
