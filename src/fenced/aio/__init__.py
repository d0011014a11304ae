"""fenced for asyncio programs: the whole API, awaited (docs/asyncio.md).

* ``coord = await fenced.aio.connect(url)`` (or ``async with fenced.aio.connect(url) as
  coord``): an :class:`AsyncCoordinator` with ``acquire``, ``renew``, ``release``, ``current``,
  ``history``, ``async with coord.hold(...)`` (renewed by a task of the loop; the loss cancels
  the body), ``async with coord.campaign(...)``, ``async for change in coord.observe(name)``.
* ``store = await fenced.aio.open_store(url)``: an :class:`AsyncStore` with ``fence``, ``put``,
  ``get``, ``publish`` (bytes, a file, or an async iterator of bytes), ``latest``, ``read``,
  ``gc``.
* ``await fenced.aio.guard(connection, token)`` inside a psycopg or SQLAlchemy
  ``AsyncConnection``'s transaction.

Same names, parameters, exceptions and guarantees as the sync face (:mod:`fenced`): both are
thin shells around one set of decisions (:mod:`fenced.coordinator._requests`, the lease state
machine, the store rules). Exceptions are the sync face's classes (``fenced.Busy``,
``fenced.LeaseLost``, ...).
"""

from fenced.aio._connect import connect
from fenced.aio._coordinator import AsyncCoordinator
from fenced.aio._election import AsyncCampaign, AsyncLeadership, AsyncObserver
from fenced.aio._guard import guard
from fenced.aio._hold import AsyncHold
from fenced.aio._keeper import AsyncHeldLease
from fenced.aio._store import AsyncStore, open_store

__all__ = [
    "AsyncCampaign",
    "AsyncCoordinator",
    "AsyncHeldLease",
    "AsyncHold",
    "AsyncLeadership",
    "AsyncObserver",
    "AsyncStore",
    "connect",
    "guard",
    "open_store",
]
