"""Processes that do the same thing at the same instant (tests of races between processes)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

__all__ = ["run_together"]

STARTUP = 60.0
"""Seconds the processes may take to start and import, on a loaded 2-core machine."""

# Imported before the start, outside the race: a cold ``import fenced`` takes ~150 ms, ten times
# the work these tests race on, and would spread the processes' starts over more than that.
PREPARE = "import fenced\nimport fenced.coordinator.backends.sqlite._backend\n"

_PRELUDE = """
import os, sys, time
go, ready = sys.argv[1], sys.argv[2]
{prepare}
open(ready, "x").close()
while not os.path.exists(go):
    time.sleep(0.0005)
sys.argv[1:] = sys.argv[3:]
"""


def run_together(
    script: str, args: list[str], count: int, go: Path, *, prepare: str = PREPARE
) -> list[tuple[int, str, str]]:
    """Start ``count`` processes running ``script`` with ``args`` (as ``sys.argv[1:]``); each
    runs ``prepare`` first, then says it is ready (a file) and waits for ``go``. Once every one
    is ready, create ``go`` (they all start at once) and return each one's (exit code, stdout,
    stderr). A process that exits before it is ready fails the caller with its stderr."""
    prelude = _PRELUDE.format(prepare=prepare)
    ready = [go.with_name(f"{go.name}.ready{i}") for i in range(count)]
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", prelude + script, str(go), str(mark), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for mark in ready
    ]
    deadline = time.monotonic() + STARTUP
    try:
        while not all(mark.exists() for mark in ready):
            for process in processes:
                if process.poll() is not None:
                    _, err = process.communicate()
                    raise AssertionError(f"a process exited before it was ready: {err}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the processes were not ready within {STARTUP}s")
            time.sleep(0.005)
    except BaseException:
        for process in processes:
            process.kill()
            process.communicate()
        raise
    go.touch()
    outputs = [process.communicate(timeout=60) for process in processes]
    return [(p.returncode, out, err) for p, (out, err) in zip(processes, outputs, strict=True)]
