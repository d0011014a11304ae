"""``fenced verify --random N --jobs J``: schedules in parallel, each isolated, and the progress.

* the same schedules as one at a time, each in a process of its own: results in seed order, of
  the same shape, every invariant kept, nothing left behind;
* the command line: ``--json`` unchanged in shape (and no progress); a failing schedule still
  prints its seed, its replay command and its kept history; bad ``--jobs`` values are one-line
  usage errors (exit 2);
* the progress display: plain lines when standard error is not a terminal, one live line on a
  terminal (rendered into a buffer here, no processes).

Kept cheap: 1.5 s schedules, a handful of them.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from rich.console import Console

from fenced.cli._verify_cmd import RandomProgress, eta
from fenced.core._errors import ConfigurationError
from fenced.verify._report import Report
from fenced.verify._schedule import RandomSummary, Schedule, ScheduleResult, run_random
from fenced.verify._table import to_json
from fenced.verify._target import Target


def _fenced(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fenced", "verify", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_jobs_run_the_same_schedules_isolated_in_seed_order() -> None:
    one = run_random(2, 300, Target(), duration=1.5, restores=True)
    finished: list[int] = []
    two = run_random(
        4,
        300,
        Target(),
        duration=1.5,
        restores=True,
        jobs=2,
        progress=lambda result: finished.append(result.schedule.seed),
    )
    failures = [(r.schedule.seed, r.report.violations) for r in two.failed]
    assert two.ok and one.ok, failures
    assert [r.schedule.seed for r in two.results] == [300, 301, 302, 303]
    assert sorted(finished) == [300, 301, 302, 303]  # each once, in the order they finished
    for alone, parallel in zip(one.results, two.results, strict=False):
        assert parallel.schedule == alone.schedule  # the same draw, whatever J
        assert parallel.history.name == alone.history.name
        assert vars(parallel).keys() == vars(alone).keys()
        assert parallel.stores.keys() == alone.stores.keys() == {"S", "M"}
        assert parallel.elapsed > 0
    # isolated: each schedule had its own directory (stores, coordinator), removed afterwards
    assert len({r.history.parent for r in two.results}) == 4
    assert not any(r.history.parent.exists() for r in two.results)
    assert len({url for r in two.results for url in r.stores.values()}) == 8
    assert two.kept == {}
    assert one.to_json().keys() == two.to_json().keys()
    totals = two.totals()
    assert totals["operations"] > 0 and totals["faults"] > 0 and totals["grants"] >= 4


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_jobs_json_is_unchanged_in_shape() -> None:
    done = _fenced("--random", "2", "--jobs", "2", "--seed", "41", "--duration", "1.5", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads(done.stdout)
    shape = json.loads(to_json("t", None, RandomSummary(41), None, ok=True, replay="r"))
    assert document.keys() == shape.keys()
    assert document["random"].keys() == shape["random"].keys()
    assert document["ok"] is True
    random = document["random"]
    assert (random["seed"], random["schedules"], random["violations"]) == (41, 2, 0)
    assert random["failed"] == []
    assert "schedule 41" not in done.stderr  # no progress with --json


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_a_failing_schedule_under_jobs_prints_seed_replay_and_history(
    tmp_path: Path,
) -> None:
    done = _fenced(
        *("--random", "2", "--jobs", "2", "--seed", "7", "--duration", "1.5"),
        *("--profile", "in-flight", "--mutant", "no-fence-check", "--keep-history", str(tmp_path)),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    failed = [int(seed) for seed in re.findall(r"^FAILED schedule seed (\d+)", done.stdout, re.M)]
    assert failed and set(failed) <= {7, 8}, done.stdout
    assert failed == sorted(failed)  # in seed order, whatever finished first
    for seed in failed:
        replay = f"replay:  fenced verify --random 1 --seed {seed} --duration 1.5 --profile "
        assert replay + "in-flight --mutant no-fence-check\n" in done.stdout
        assert f"history: {tmp_path / f'schedule-{seed}.history.jsonl'}\n" in done.stdout
        assert (tmp_path / f"schedule-{seed}.history.jsonl").exists()
    assert "--jobs" not in done.stdout  # a replay is one schedule
    # standard error is no terminal: plain lines, one per finished schedule
    lines = done.stderr.splitlines()
    assert "(in-flight, 2 at a time)" in lines[0]
    progress = [line for line in lines if line.startswith("  schedule ")]
    assert len(progress) == 2
    assert sorted(line.split(":")[0] for line in progress) == ["  schedule 7", "  schedule 8"]
    assert re.search(r"\[1/2, ETA \d+:\d\d\]$", progress[0])
    assert progress[1].endswith("[2/2]")
    for seed in failed:
        assert any(f"schedule {seed}: VIOLATED (" in line for line in progress)


@pytest.mark.timeout(60)
def test_bad_jobs_values_are_one_line_usage_errors() -> None:
    for args, message in [
        (("--random", "1", "--jobs", "0"), "--jobs needs J >= 1"),
        (("--random", "1", "--jobs", "-3"), "--jobs needs J >= 1"),
        (("--random", "1", "--jobs", "two"), "'two' is not a valid integer"),
        (("--jobs", "2"), "--jobs runs the schedules of --random"),
        (("--mutants", "--jobs", "2"), "--jobs runs the schedules of --random"),
    ]:
        done = _fenced(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stdout == ""
        assert len(done.stderr.splitlines()) == 1, (args, done.stderr)
        assert message in done.stderr, (args, done.stderr)
    with pytest.raises(ConfigurationError, match="--jobs"):
        run_random(1, 1, Target(), jobs=0)


def _result(seed: int, operations: int, faults: int, violations: int = 0) -> ScheduleResult:
    report = Report(stats=Counter(operations=operations, faults=faults))
    for _ in range(violations):
        report.add("largest-seen", "store S accepted a stale write")
    history = Path(f"/nowhere/schedule-{seed}.history.jsonl")
    return ScheduleResult(Schedule.draw(seed, 1.5), report, history, elapsed=2.0)


def test_progress_off_a_terminal_is_one_plain_line_per_schedule() -> None:
    buffer = io.StringIO()
    with RandomProgress(Console(file=buffer, force_terminal=False), total=3, jobs=2) as progress:
        progress(_result(11, 40, 5))
        progress(_result(10, 30, 4, violations=2))
        progress(_result(12, 20, 3))
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 3
    assert re.fullmatch(
        r"  schedule 11: ok \(2\.0s, 40 operations, 5 faults\) \[1/3, ETA \d+:\d\d\]", lines[0]
    )
    assert lines[1].startswith("  schedule 10: VIOLATED (2 violations) (2.0s, 30 operations")
    assert lines[2] == "  schedule 12: ok (2.0s, 20 operations, 3 faults) [3/3]"
    assert "\x1b" not in buffer.getvalue()  # no colours, no cursor movements
    assert (progress.done, progress.violations, progress.totals["operations"]) == (3, 2, 90)


def test_progress_on_a_terminal_is_one_live_line() -> None:
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=140, color_system=None)
    with RandomProgress(console, total=3, jobs=2) as progress:
        progress(_result(11, 40, 5))
        progress(_result(10, 30, 4, violations=2))
        progress(_result(12, 20, 3))
    text = buffer.getvalue()
    assert "schedules" in text and "3/3" in text
    assert "90 operations, 12 faults, 2 violations" in text
    # only the failing schedule gets a line of its own, above the live one
    assert "schedule 10: VIOLATED (2 violations)" in text
    assert "schedule 11: ok" not in text
    final = text.rsplit("\r", 1)[-1]
    assert re.search(r"in \d+:\d\d", final)


def test_eta_reads_minutes_and_hours() -> None:
    assert eta(None) == "ETA -"
    assert eta(0.2) == "ETA 0:00"
    assert eta(75) == "ETA 1:15"
    assert eta(3 * 3600 + 61) == "ETA 3:01:01"
