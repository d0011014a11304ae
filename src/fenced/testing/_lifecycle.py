"""``with`` for the throwaway servers of :mod:`fenced.testing` (and of the benchmarks).

:class:`StartStop` gives a class with ``start()`` and an idempotent ``stop()`` the ``with``
statement: entering starts it, leaving stops it, and a start that fails part-way is stopped
before the error goes on (nothing it began is left running).
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["StartStop"]


class StartStop:
    """``with thing:`` is ``thing.start()`` … ``thing._stop_at_exit()`` (``stop()`` unless the
    class says otherwise); ``stop`` must be idempotent and safe after a failed start."""

    def start(self) -> object:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def _stop_at_exit(self) -> None:
        """How leaving the ``with`` block (or a failed start in it) stops this."""
        self.stop()

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self._stop_at_exit()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop_at_exit()
