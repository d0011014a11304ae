"""Worker processes of the multi-process tests and the JSON-lines event files they append to.

A worker program (``tests/coordinator/workers.py``, ``tests/election/election_workers.py``, …)
appends one JSON object per line with one ``write`` each, so a test may read the file while the
worker runs, pause it or kill it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["WorkerProcess", "read_events"]


def read_events(path: Path) -> list[dict[str, Any]]:
    """The events in ``path`` so far (none before the file exists)."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    # A killed process may leave a partial last line; the complete ones are all there is.
    return [json.loads(line) for line in lines if line.endswith("}")]


class WorkerProcess:
    """``python PROGRAM MODE --url URL --out TMP/NAME.events --holder NAME OPTIONS…``, its output
    in ``TMP/NAME.log``."""

    def __init__(
        self, program: Path, tmp: Path, name: str, mode: str, url: str, *options: str
    ) -> None:
        self.name = name
        self.out = tmp / f"{name}.events"
        self.log = tmp / f"{name}.log"
        argv = [sys.executable, str(program), mode, "--url", url, "--out", str(self.out)]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [*argv, "--holder", name, *options], stdout=log, stderr=subprocess.STDOUT
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Its events so far (of ``kind`` only, if given)."""
        return [e for e in read_events(self.out) if kind is None or e["event"] == kind]

    def kill(self) -> None:
        """SIGKILL, then SIGCONT (a paused process dies without running again), and reap it."""
        if self.proc.poll() is None:
            for signum in (signal.SIGKILL, signal.SIGCONT):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signum)
        self.proc.wait(10)
