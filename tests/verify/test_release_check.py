"""``./dev release-check`` (``python -m fenced.verify._release``): hours of schedules, so CI
only checks its command line and its table; docs/verify.md publishes a real run."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

from fenced.verify._release import Row, table


def _release(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "fenced.verify._release", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_its_options_and_bad_values() -> None:
    shown = _release("--help")
    assert shown.returncode == 0
    for option in ("--scale", "--jobs", "--seed", "--duration", "--out", "--no-mutants"):
        assert option in shown.stdout
    refused = _release("--scale", "0")
    assert refused.returncode == 2
    assert "--scale must be positive" in refused.stderr


def test_the_table_has_one_line_per_run() -> None:
    row = Row("postgresql", "postgresql: strict and monotonic", schedules=1000)
    row.stats = Counter(
        {
            "operations": 91234,
            "fault partition": 12,
            "fault pause": 40,
            "mutations sent after a pause": 30,
            "stale writes rejected": 25,
        }
    )
    row.mutants = {
        "no-fence-check": "caught",
        "epoch-reuse": "n/a",
        "deadline-from-reply": "caught",
    }
    lines = table([row]).splitlines()
    assert lines[2] == (
        "| postgresql | postgresql: strict and monotonic | 1,000 | 91,234 | partition 12, pause 40 "
        "| 30 | 25 | 0 | 2/2 |"
    )
    assert Row("etcd", "s3:").caught == "not hunted"
