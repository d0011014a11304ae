"""Sync code run by the event loop: :func:`greenlet_spawn` and :func:`await_only`.

The asyncio face of a store whose driver has an asyncio interface (psycopg's
``AsyncConnection``) runs the *same* sync code as the sync face: the store's decisions, the
backend's statements and transactions. :func:`greenlet_spawn` runs a sync function in a
greenlet of the task that awaits it; wherever that function (or anything it calls) needs I/O,
:func:`await_only` hands the awaitable to the task, which awaits it on the loop and switches
back with its result or its exception. No thread is involved and the sync code does not know:
it is SQLAlchemy's asyncio design (``sqlalchemy.util.greenlet_spawn``), here for fenced's own
drivers.

Guarantees and limits: the function runs on the loop's thread between its awaits, so a step
that does not await blocks the loop as any callback would (keep them short: no blocking I/O);
an exception raised by an awaitable is raised inside the sync code at its ``await_only``, an
exception the function raises is raised by :func:`greenlet_spawn`. :func:`await_only` outside a
function run by :func:`greenlet_spawn` raises :class:`RuntimeError` (the awaitable is closed,
never left pending). Two greenlets must not share a non-reentrant lock across an
``await_only`` (the second would block the loop's thread): callers serialise their use of a
connection (see :class:`fenced.aio.AsyncStore`).
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import greenlet

__all__ = ["await_only", "greenlet_spawn", "in_green"]

T = TypeVar("T")


class _Green(greenlet.greenlet):  # type: ignore[misc]
    """A greenlet started by :func:`greenlet_spawn`; ``driver`` is the task's greenlet."""

    def __init__(self, fn: Callable[..., Any], driver: greenlet.greenlet) -> None:
        super().__init__(fn, driver)
        self.driver = driver


def in_green() -> bool:
    """Whether the caller runs inside :func:`greenlet_spawn` (so :func:`await_only` works)."""
    return isinstance(greenlet.getcurrent(), _Green)


def await_only(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` from sync code run by :func:`greenlet_spawn`; its result, or raise
    its exception (see the module docstring)."""
    current = greenlet.getcurrent()
    if not isinstance(current, _Green):
        close = getattr(awaitable, "close", None)
        if close is not None:
            close()
        raise RuntimeError("await_only() outside greenlet_spawn(): no event loop task to await it")
    return cast(T, current.driver.switch(awaitable))


async def greenlet_spawn(fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """Run ``fn(*args, **kwargs)`` in a greenlet, awaiting for it each awaitable it passes to
    :func:`await_only`; return its result or raise its exception."""
    context = _Green(fn, greenlet.getcurrent())
    result: Any = context.switch(*args, **kwargs)
    while not context.dead:
        try:
            value = await result
        except BaseException:  # handed to the sync code, which may handle it
            result = context.throw(*sys.exc_info())
        else:
            result = context.switch(value)
    return cast(T, result)
