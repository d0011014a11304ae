"""Where fencing is enforced: stores that check fencing tokens atomically with every change.

**To fence a store** is to install a token there: the store's floor for the token's resource
becomes the token's epoch (never lower), and from then on the store rejects every change made
with an older epoch (:class:`~fenced.StaleToken`). That is the one meaning of the word in
fenced: :meth:`Store.fence` installs one token, ``hold(fence=[store, …])`` and ``fenced run
--fence STORE`` fence the listed stores with each new lease before the holder's work starts,
and this package is the side that enforces it.

* :func:`open_store` — a :class:`Store` by URL (``sqlite:////abs/path.db``, ``file:///dir``,
  ``postgresql://``): ``fence``, ``put``/``get``, ``publish``/``latest``/``read``/``open``,
  ``gc``, ``floor``.
* :func:`guard` — the same check inside the caller's own SQL transaction.
* Inside: :mod:`.rules` (every decision a store makes, pure), :mod:`.store` (the
  :class:`Store` over the narrow :mod:`.backend` contract), :mod:`.registry` (store kinds by URL
  scheme), one package per store kind (:mod:`.sqlite`, :mod:`.file`, :mod:`.postgres`).

This package depends on :mod:`fenced.core` (and the private driver plumbing) only: a store sees
nothing but tokens, so it can live in another process or service than the coordinator.
"""

from typing import Any

from fenced.fence._guard import guard
from fenced.fence._store import Store, open_store
from fenced.fence._values import Item, Mode, Publication, Version
from fenced.fence.backend import Capability


def install_postgres_guard(connection: Any, *, schema: str | None = None) -> None:
    """Create the objects :func:`guard` needs in a PostgreSQL database, as an owner, once.

    Same as the first ``guard`` call does when the role may ``CREATE``; needs the ``postgres``
    extra. Raises what psycopg raises when the role may not create them.
    """
    from fenced.fence.postgres import _guard  # noqa: PLC0415 - psycopg only when asked

    if schema is None:
        _guard.install(connection)
    else:
        _guard.install(connection, schema=schema)


__all__ = [
    "Capability",
    "Item",
    "Mode",
    "Publication",
    "Store",
    "Version",
    "guard",
    "install_postgres_guard",
    "open_store",
]
