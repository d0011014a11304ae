"""``with`` for the objects that are closed when done: coordinators and their backends, stores,
observers.

:class:`Closing` gives a class with an idempotent ``close()`` the ``with`` statement: entering
yields the object itself, leaving the block (however it ends) closes it. :class:`AsyncClosing`
does the same for ``async with`` and ``aclose()``.
"""

from __future__ import annotations

from typing import Self

__all__ = ["AsyncClosing", "Closing"]


class Closing:
    """``with thing:`` is ``thing`` … ``thing.close()``; ``close`` must be idempotent."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClosing:
    """``async with thing:`` is ``thing`` … ``await thing.aclose()``; ``aclose`` must be
    idempotent (the asyncio face's coordinators, stores and readers)."""

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
