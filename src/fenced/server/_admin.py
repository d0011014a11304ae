"""``/v1/coordinator:advance``: the restore step that must run on the coordinator itself.

:meth:`~fenced.coordinator.backend.CoordinatorBackend.advance` is part of the sync backend
contract only (``fenced restore`` is a rare, operator-run step), so the route opens the sync
backend of the server's own URL on a worker thread, advances, and closes it. Role ``admin``.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from fenced.coordinator._connect import open_backend
from fenced.core._names import validate_resource
from fenced.server._auth import require
from fenced.server._models import AdvanceBody, Advanced
from fenced.server._state import State

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["admin"])


@router.post(
    "/coordinator:advance",
    response_model=Advanced,
    dependencies=[require("admin")],
    summary="Raise every later epoch above a restored state's",
)
async def advance(body: AdvanceBody, state: State) -> Advanced:
    """No later grant gets an epoch ≤ ``minimum`` (nor ≤ ``floors[resource]``); every live
    lease ends. One atomic step of the backend; retrying it is harmless (it never lowers)."""
    for resource in body.floors:
        validate_resource(resource)

    def run() -> int:
        backend = open_backend(state.url, create=False)
        try:
            return backend.advance(body.minimum, dict(body.floors), dict(body.detail))
        finally:
            backend.close()

    return Advanced(minimum=await asyncio.to_thread(run))
