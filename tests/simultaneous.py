"""Processes that do the same thing at the same instant (tests of races between processes)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

__all__ = ["run_together"]

_PRELUDE = """
import os, sys, time
go = sys.argv[1]
while not os.path.exists(go):
    time.sleep(0.0005)
sys.argv[1:] = sys.argv[2:]
"""


def run_together(script: str, args: list[str], count: int, go: Path) -> list[tuple[int, str, str]]:
    """Start ``count`` processes running ``script`` with ``args`` (as ``sys.argv[1:]``), let
    them all import and wait, then start them at once by creating ``go``; return each one's
    (exit code, stdout, stderr)."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _PRELUDE + script, str(go), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    time.sleep(0.5)  # every one has imported what it needs and polls for the go file
    go.touch()
    outputs = [process.communicate(timeout=60) for process in processes]
    return [(p.returncode, out, err) for p, (out, err) in zip(processes, outputs, strict=True)]
