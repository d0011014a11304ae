"""``./dev release-check`` (``python -m fenced.verify._release``): hours of schedules, so CI
only checks its command line and its table; docs/verify.md publishes a real run."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from fenced.verify._release import Progress, Row, table
from fenced.verify._schedule import ScheduleResult


def _release(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "fenced.verify._release", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=100, check=False)


def test_its_options_and_bad_values() -> None:
    shown = _release("--help")
    assert shown.returncode == 0
    options = ("--scale", "--jobs", "--seed", "--duration", "--out", "--no-mutants", "--only")
    for option in (*options, "--keep-history"):
        assert option in shown.stdout
    for name in ("embedded", "postgresql", "etcd", "zookeeper", "serve"):
        assert name in shown.stdout
    unknown = _release("--only", "redis")
    assert unknown.returncode == 2
    assert "invalid choice: 'redis'" in unknown.stderr
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
            "writes held past the deadline by a partition": 4,
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
        "| 30 / 4 | 25 | 0 | 2/2 |"
    )
    assert Row("etcd", "s3:").caught == "not hunted"


def test_its_progress_lines_come_every_twentieth_and_name_each_violation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    progress = Progress("postgresql", 40)

    def finished(seed: int, violations: int) -> None:
        report = SimpleNamespace(violations=[object()] * violations)
        progress(
            cast(
                ScheduleResult, SimpleNamespace(schedule=SimpleNamespace(seed=seed), report=report)
            )
        )

    for seed in range(1, 41):
        finished(seed, 1 if seed == 3 else 0)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "  postgresql: 2/40 schedules, 0 violations, elapsed 0:00, left 0:00"
    assert "  postgresql: seed 3 VIOLATED" in lines
    assert len(lines) == 21  # 20 progress lines and one violation
    assert lines[-1].startswith("  postgresql: 40/40 schedules, 1 violations, elapsed ")
    assert progress.line(90.0) == (
        "postgresql: 40/40 schedules, 1 violations, elapsed 1:30, left 0:00"
    )
    half = Progress("etcd", 10)
    half.done = 5
    assert half.line(150.0).endswith("elapsed 2:30, left 2:30")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_tiny_embedded_run_restores_its_coordinator_and_writes_its_figures(
    tmp_path: Path,
) -> None:
    """Every fault of ``fenced verify --random`` is in the release check: two schedules from
    seed 3 on the embedded coordinator include restores of it (a release run once had none).
    ``--keep-history DIR`` keeps every schedule's history in DIR/NAME/."""
    out = tmp_path / "release.json"
    done = _release(
        *("--scale", "0.001", "--only", "embedded", "--no-mutants", "--seed", "3"),
        *("--out", str(out), "--keep-history", str(tmp_path / "kept")),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads(out.read_text())
    assert document["ok"] is True
    assert document["command"].startswith("./dev release-check --scale 0.001 --only embedded")
    (run,) = document["runs"]
    assert (run["run"], run["schedules"], run["violations"]) == ("embedded", 2, 0)
    assert run["faults"].get("restore", 0) >= 1, run["faults"]
    assert "| embedded | sqlite: and file: (embedded), both modes | 2 |" in done.stdout
    kept = sorted(path.name for path in (tmp_path / "kept" / "embedded").iterdir())
    assert kept == ["schedule-3.history.jsonl", "schedule-4.history.jsonl"]
