"""One context manager that turns a driver's exceptions into fenced errors."""

from __future__ import annotations

from typing import Any, ClassVar

from fenced.core._errors import FencedError

__all__ = ["Translated"]


class Translated:
    """``with Sub(what):`` re-raises an exception of ``Sub.catches`` raised in the block as
    ``Sub.translate(error, what)`` (``raise … from``, so the driver's error stays the cause);
    anything else passes through unchanged, and so does every :class:`~fenced.FencedError`
    (an :class:`~fenced.Unavailable` is also an ``OSError``: it is translated already).

    A store subclasses it once (``catches`` and ``translate``) and enters one around each
    statement or system call.
    """

    __slots__ = ("_what",)
    catches: ClassVar[type[BaseException]] = BaseException

    def __init__(self, what: str) -> None:
        self._what = what

    @staticmethod
    def translate(error: Any, what: str) -> BaseException:
        """The fenced error for ``error`` while doing ``what`` (subclasses say which)."""
        raise NotImplementedError

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        if isinstance(error, self.catches) and not isinstance(error, FencedError):
            raise self.translate(error, self._what) from error
