"""A thread for tests that keeps what its target returned or raised, and when it finished."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ResultThread"]


class ResultThread(threading.Thread):
    """A daemon thread that keeps its target's result or exception; ``finished_at`` is when the
    target returned or raised (``time.monotonic()``)."""

    def __init__(self, target: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._fn = target
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished_at = 0.0

    def run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as error:
            self.error = error
        self.finished_at = time.monotonic()
