"""The history checker of ``fenced verify``: checking a schedule's history against its time.

Usage::

    flock /tmp/fenced-bench.lock .venv/bin/python benchmarks/bench_checker.py      # ~2 min
    .venv/bin/python benchmarks/bench_checker.py --config standard --config storm:8 --schedules 3
    .venv/bin/python benchmarks/bench_checker.py --save /tmp/histories     # keep what it ran
    .venv/bin/python benchmarks/bench_checker.py --histories /tmp/histories   # time kept ones

First it runs real randomized schedules on the embedded backend, exactly as ``fenced verify
--random K --seed S`` does (real worker processes, wire faults, the nemesis with backups and
restores), ``--schedules`` of each ``--config PROFILE[:WORKERS[:SECONDS]]`` (the fault profile of
``--profile``; the number of workers, default: the 2-4 the seed draws; the schedule's duration,
default ``--duration``, 4 s). Then it times the checker alone on each history, ``--reps`` times,
the histories interleaved round by round, and reports medians:

- **check**: ``check_history(read_history(path))``, what a schedule runs after its workers end
  (and what ``fenced.verify.check`` runs on a kept history), against the schedule's duration
  (its working time, without the start-up and drain that the wall time adds). Target of issue
  25: ≤ 10 % for a 4 s schedule;
- **where the time goes**: the same work in its parts: reading the JSON lines, building the
  :class:`~fenced.verify._history.History` (pairing calls, leases, pauses), each group of
  invariants of the checker, and the figures (``count``) with the final sort.

Longer or busier configurations show how the check grows with the history (µs per event). With
``--histories DIR`` it runs nothing and times the ``*.jsonl`` files of ``DIR`` (kept with
``--save``, or with ``fenced verify --keep-history``); the schedule time of a file ``--save`` did
not write is the span of its events' times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import fmt_time, median, print_table, verdict

from fenced.verify._checker import _Checker, check_history
from fenced.verify._history import History
from fenced.verify._recorder import Event, read_history
from fenced.verify._schedule import PROFILES, Schedule, run_schedule
from fenced.verify._target import Target

TARGET = 0.10
"""Check time ÷ schedule time, at most (issue 25)."""
DEFAULT_CONFIGS = ("standard", "standard:8", "storm", "storm:8", "standard:8:30")
INDEX = "bench-checker.json"
"""The file ``--save`` writes beside the histories: what ran, for how long."""


def _figures(checker: _Checker) -> None:
    """The tail of :meth:`_Checker.run`: the figures and the sort of the violations."""
    checker.count()
    checker.report.violations.sort(key=lambda v: (v.at is None, v.at or 0.0))


PARTS: tuple[tuple[str, Callable[[_Checker], object]], ...] = (
    ("grants", _Checker.check_grants),
    ("holders", _Checker.check_holders),
    ("owner ops", _Checker.check_owner_ops),
    ("stores", _Checker.check_stores),
    ("restores", _Checker.check_restores),
    ("diagnostics", _Checker.check_diagnostics),
    ("figures", _figures),
)
"""The checker's groups of invariants, in the order :meth:`_Checker.run` calls them."""
COLUMNS = ("parse", "History", *(name for name, _ in PARTS))


@dataclasses.dataclass
class Sample:
    """One history and its timings."""

    path: Path
    label: str
    workers: int | None
    duration: float
    wall: float | None
    events: int = 0
    violations: int = 0
    checks: list[float] = dataclasses.field(default_factory=list)
    parts: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {name: [] for name in COLUMNS}
    )


def generate(configs: Sequence[str], count: int, seed: int, default: float, out: Path) -> None:
    """Run ``count`` schedules of each config; copy their histories into ``out`` with an index."""
    target = Target.create(None, (), "sync")
    index: dict[str, dict[str, object]] = {}
    workdir = Path(tempfile.mkdtemp(prefix="bench-checker-run-"))
    try:
        for config in configs:
            name, _, rest = config.partition(":")
            workers, _, seconds = rest.partition(":")
            if name not in PROFILES:
                raise SystemExit(f"unknown profile {name!r}; profiles: {', '.join(PROFILES)}")
            duration = float(seconds) if seconds else default
            for number in range(seed, seed + count):
                schedule = Schedule.draw(number, duration, profile=PROFILES[name], restores=True)
                if workers:
                    schedule = dataclasses.replace(schedule, workers=int(workers))
                result = run_schedule(schedule, target, workdir, restores=True)
                label = f"{config} seed {number}"
                file = f"{name}-{schedule.workers}w-{duration:g}s-seed{number}.jsonl"
                shutil.copyfile(result.history, out / file)
                shutil.rmtree(result.history.parent, ignore_errors=True)
                index[file] = {
                    "label": label,
                    "workers": schedule.workers,
                    "duration": duration,
                    "wall": round(result.elapsed, 3),
                    "schedule": schedule.describe(),
                }
                print(f"  ran {schedule.describe()}: {result.elapsed:.1f} s wall, "
                      f"{len(result.report.violations)} violations", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    (out / INDEX).write_text(json.dumps(index, indent=1) + "\n")


def load(directory: Path) -> list[Sample]:
    """The histories of ``directory``, with what the index says about them."""
    index_path = directory / INDEX
    index = json.loads(index_path.read_text()) if index_path.exists() else {}
    samples = []
    listed = [directory / name for name in index if (directory / name).exists()]
    others = sorted(path for path in directory.glob("*.jsonl") if path.name not in index)
    for path in listed + others:
        known = index.get(path.name)
        if known is not None:
            samples.append(Sample(path, known["label"], known["workers"], known["duration"],
                                  known["wall"]))  # fmt: skip
            continue
        times = [float(event["t"]) for event in read_history(path)]
        span = max(times) - min(times) if times else 0.0
        samples.append(Sample(path, path.stem, None, span, None))
    if not samples:
        raise SystemExit(f"no *.jsonl history in {directory}")
    return samples


def measure(sample: Sample) -> None:
    """One repetition: the whole check, then the same work in parts."""
    began = time.perf_counter()
    report = check_history(read_history(sample.path))
    sample.checks.append(time.perf_counter() - began)
    sample.violations = len(report.violations)

    began = time.perf_counter()
    events: list[Event] = read_history(sample.path)
    parsed = time.perf_counter()
    history = History(list(events))
    built = time.perf_counter()
    sample.parts["parse"].append(parsed - began)
    sample.parts["History"].append(built - parsed)
    sample.events = len(events)
    checker = _Checker(history)
    for name, part in PARTS:
        began = time.perf_counter()
        part(checker)
        sample.parts[name].append(time.perf_counter() - began)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def report(samples: Sequence[Sample], reps: int) -> None:
    rows = []
    for sample in samples:
        check = median(sample.checks)
        size = sample.path.stat().st_size
        rows.append([
            sample.label,
            "-" if sample.workers is None else str(sample.workers),
            f"{sample.events:,}",
            f"{size / 1024:,.0f}",
            f"{sample.duration:.3g} s",
            "-" if sample.wall is None else f"{sample.wall:.1f} s",
            fmt_time(check),
            f"{fmt_time(min(sample.checks))}–{fmt_time(max(sample.checks))}",
            f"{check / sample.duration * 100:.3f} %" if sample.duration else "-",
            f"{check / max(sample.events, 1) * 1e6:.1f}",
            str(sample.violations),
        ])  # fmt: skip
    print_table(
        f"1. check time (read + check_history, median of {reps}) against the schedule's time",
        ["history", "workers", "events", "KiB", "schedule", "wall", "check", "min–max",
         "÷ schedule", "µs/event", "violations"],
        rows,
    )  # fmt: skip

    rows = []
    totals = dict.fromkeys(COLUMNS, 0.0)
    for sample in samples:
        medians = {name: median(sample.parts[name]) for name in COLUMNS}
        for name in COLUMNS:
            totals[name] += medians[name]
        rows.append([sample.label, *(ms(medians[name]) for name in COLUMNS),
                     ms(sum(medians.values()))])  # fmt: skip
    whole = sum(totals.values())
    rows.append(["share of all", *(f"{totals[n] / whole * 100:.0f} %" for n in COLUMNS), "100 %"])
    print_table(
        f"2. where the time goes: ms per part (median of {reps})",
        ["history", *COLUMNS, "sum"],
        rows,
    )

    short = [s for s in samples if s.duration and s.duration <= 4.0]
    if short:
        worst = max(short, key=lambda s: median(s.checks) / s.duration)
        ratio = median(worst.checks) / worst.duration
        print(
            f"\nworst check ÷ schedule over the {len(short)} schedules of ≤ 4 s: "
            f"{ratio * 100:.3f} % ({worst.label}, {fmt_time(median(worst.checks))} for "
            f"{worst.events:,} events)  target ≤ {TARGET * 100:.0f} %  {verdict(ratio <= TARGET)}"
        )
    longest = max(samples, key=lambda s: s.events)
    print(f"largest history: {longest.label}, {longest.events:,} events, check "
          f"{fmt_time(median(longest.checks))} = "
          f"{median(longest.checks) / max(longest.duration, 1e-9) * 100:.3f} % of its "
          f"{longest.duration:.3g} s")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--config",
        action="append",
        help="PROFILE[:WORKERS[:SECONDS]] (repeatable; default: "
        + ", ".join(DEFAULT_CONFIGS)
        + ")",
    )
    parser.add_argument("--schedules", type=int, default=2, help="schedules per config (2)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the first schedule (1)")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per schedule (4)")
    parser.add_argument("--reps", type=int, default=30, help="timed checks per history (30)")
    parser.add_argument("--save", type=Path, help="keep the histories (and an index) here")
    parser.add_argument("--histories", type=Path, help="time the histories of DIR; run nothing")
    args = parser.parse_args(argv)
    print(f"fenced verify history checker benchmark: Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, load {_load()}", flush=True)  # fmt: skip
    temporary: Path | None = None
    try:
        if args.histories is not None:
            directory = args.histories
        else:
            if args.save is not None:
                directory = args.save
                directory.mkdir(parents=True, exist_ok=True)
            else:
                directory = temporary = Path(tempfile.mkdtemp(prefix="bench-checker-"))
            began = time.monotonic()
            generate(args.config or DEFAULT_CONFIGS, args.schedules, args.seed, args.duration,
                     directory)  # fmt: skip
            print(f"schedules ran in {time.monotonic() - began:.0f} s; load {_load()}")
        samples = load(directory)
        for sample in samples:  # warm-up, not timed
            whole = check_history(read_history(sample.path)).to_json()
            checker = _Checker(History(read_history(sample.path)))
            for _, part in PARTS:
                part(checker)
            if checker.report.to_json() != whole:
                print(f"warning: the parts of {sample.label} do not give check_history's report "
                      "(has _Checker.run changed? update PARTS)")  # fmt: skip
        for _ in range(args.reps):
            for sample in samples:
                measure(sample)
        report(samples, args.reps)
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    print(f"\nload at the end: {_load()}")


def _load() -> str:
    """The 1, 5 and 15 minute load averages: the machine is shared, say how busy it was."""
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


if __name__ == "__main__":
    main()
