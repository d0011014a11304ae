"""Helpers of the tests that run ``fenced`` as a user does, each command in its own process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["DEADLINE", "FENCED", "fenced_cmd", "one_line_error", "wait_for"]

DEADLINE = 20.0
"""Seconds any awaited condition may take on a loaded 2-core machine."""
FENCED = [sys.executable, "-m", "fenced"]


def fenced_cmd(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``fenced ARGS…`` to its end; ``env`` defaults to this one without ``FENCED_*``
    variables (a test says which settings it means)."""
    if env is None:
        env = {key: value for key, value in os.environ.items() if not key.startswith("FENCED_")}
    return subprocess.run(
        [*FENCED, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
        check=False,
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The one line ``fenced: …`` that ``result`` wrote on stderr (asserting there is one)."""
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fenced: ")
    return lines[0]


def wait_for(condition: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    """Poll ``condition`` until it holds; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
