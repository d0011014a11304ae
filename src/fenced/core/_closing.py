"""``with`` for the objects that are closed when done: coordinators and their backends, stores,
observers.

:class:`Closing` gives a class with an idempotent ``close()`` the ``with`` statement: entering
yields the object itself, leaving the block (however it ends) closes it.
"""

from __future__ import annotations

from typing import Self

__all__ = ["Closing"]


class Closing:
    """``with thing:`` is ``thing`` … ``thing.close()``; ``close`` must be idempotent."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
