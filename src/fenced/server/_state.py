"""What every route of one server shares: the backend, the kept places, the bounds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends
from starlette.requests import Request

from fenced.aio._store import AsyncStore
from fenced.coordinator.aio_backend import AsyncCoordinatorBackend
from fenced.server._auth import Authority
from fenced.server._places import Places

__all__ = ["ServerState", "State", "state_of"]


@dataclass
class ServerState:
    backend: AsyncCoordinatorBackend
    places: Places
    url: str
    """The coordinator's URL (resolved) as given to the server."""
    poll: float
    """The longest one request waits on the server (a lease, a record), seconds."""
    authority: Authority | None = None
    """The keys file (``--keys``); None: every request is allowed (loopback only)."""
    stores: dict[str, AsyncStore] = field(default_factory=dict)
    """The stores of ``--store NAME=URL``, opened at start, by name."""


async def state_of(request: Request) -> ServerState:
    """The state of the app serving ``request`` (a FastAPI dependency)."""
    state: ServerState = request.app.state.fenced
    return state


State = Annotated[ServerState, Depends(state_of)]
"""A route's parameter ``state: State``: the state of the app serving the request."""
