"""``fenced verify``: prove, with real processes and real faults, that stale owners are harmless.

Thin face of :mod:`fenced.verify`: parses options, runs the cases (:func:`fenced.verify.run`,
as a program would), the randomized schedules or the mutants, renders the result, and exits 0
only if everything held (1 otherwise; 2 for bad usage).

Rendering: ``--json`` is one stable document; plain text (one block per case) when standard
output is not a terminal; on a terminal, rich tables — except the practice table on a terminal
narrower than :func:`table_widths` needs, which gets the plain blocks at the terminal's width
(eight columns squeezed into 80 characters would wrap every cell to a few letters).

Progress goes to standard error (none with ``--json``): a line per case, per schedule, per
seeded defect; for ``--random`` on a terminal, one live line instead (:class:`RandomProgress`).
"""

from __future__ import annotations

import contextlib
import secrets
import shlex
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
)
from rich.table import Table
from rich.text import Text

import fenced.verify
from fenced.cli._app import OneLineUsageCommand, cli
from fenced.cli._checks import parse_seconds
from fenced.core._errors import ConfigurationError
from fenced.verify._cases import CASES
from fenced.verify._mutants import (
    CATALOGUE,
    DEFAULT_BUDGET,
    MUTANT_DURATION,
    MutantResult,
    run_mutants,
)
from fenced.verify._schedule import (
    DEFAULT_DURATION,
    PROFILES,
    RandomSummary,
    ScheduleResult,
    run_random,
)
from fenced.verify._table import (
    FIELDS,
    STATUS,
    Row,
    cases_summary,
    caught_by,
    caught_text,
    mutant_blocks,
    plain_cases,
    plain_mutants,
    plain_random,
    to_json,
)
from fenced.verify._target import Target

__all__ = [
    "COLUMN_WIDTH",
    "FAILED",
    "RandomProgress",
    "eta",
    "print_rich",
    "table_widths",
    "verify_command",
]

FAILED = 1
"""Exit status when a case failed, a schedule broke an invariant or an applicable mutant was not
caught."""


def _replay(
    duration: float,
    coordinator: str | None,
    stores: tuple[str, ...],
    profile: str,
    mutants: tuple[str, ...],
    api: str = "sync",
) -> str:
    """The command that replays one schedule (``{seed}`` is filled in per failure)."""
    parts = ["fenced", "verify", "--random", "1", "--seed", "{seed}", "--duration", f"{duration:g}"]
    if coordinator:
        parts += ["--coordinator", shlex.quote(coordinator)]
    for store in stores:
        parts += ["--store", shlex.quote(store)]
    if profile != "standard":
        parts += ["--profile", profile]
    for mutant in mutants:
        parts += ["--mutant", mutant]
    if api != "sync":
        parts += ["--api", api]
    return " ".join(parts)


COLUMN_WIDTH = 20
"""The narrowest a text column of the rich practice table may be: every word of the cases' fixed
texts fits in it (tests/verify check), and a cell keeps a few words per line."""
_COLOURS = {"pass": "green", "fail": "bold red", "unavailable": "yellow"}


def table_widths(rows: Sequence[Row], width: int) -> list[int] | None:
    """The widths of the practice table's columns (#, case, the five fields, result) on a
    console ``width`` characters wide, or None when a text column would be narrower than
    :data:`COLUMN_WIDTH` (then the caller prints one block per case instead).

    The six text columns share what the number, the result, the borders and the padding leave
    (observed also gets the remainder); a result is wrapped at its space."""
    columns = 2 + len(FIELDS) + 1
    number = max([1, *(len(row.number) for row in rows)])
    result = max([6, *(len(word) for row in rows for word in STATUS[row.status].split())])
    free = width - (3 * columns + 1) - number - result  # 1 border + 2 padding per column
    share = free // (columns - 2)
    if share < COLUMN_WIDTH:
        return None
    return [number, *[share] * (columns - 3), free - (columns - 3) * share, result]


def _print_cases(console: Console, rows: Sequence[Row]) -> None:
    widths = table_widths(rows, console.width)
    if widths is None:  # a narrow terminal: the blocks, at its width
        console.print(escape(plain_cases(rows, width=console.width)), soft_wrap=True)
        return
    table = Table(title="fenced verify: the practice table", show_lines=True)
    names = ["#", "case", *(label for label, _ in FIELDS), "result"]
    for name, column_width in zip(names, widths, strict=True):
        table.add_column(name, width=column_width, overflow="fold")
    for row in rows:
        observed = escape(row.observed)
        if row.violations:
            observed += "\n[bold red]" + escape("\n".join(row.violations)) + "[/]"
        table.add_row(
            row.number,
            escape(row.case),
            *(escape(getattr(row, attribute)) for _, attribute in FIELDS[:-1]),
            observed,
            f"[{_COLOURS[row.status]}]{STATUS[row.status]}[/]",
        )
    console.print(table)
    console.print(escape(cases_summary(rows)))


def print_rich(
    console: Console,
    rows: Sequence[Row] | None,
    summary: RandomSummary | None,
    mutants: Sequence[MutantResult] | None,
    replay: str,
) -> None:
    """Print the results on a terminal: rich tables, or one block per case (per seeded defect)
    when the terminal is too narrow for the table's columns (:func:`table_widths`)."""
    if rows is not None:
        _print_cases(console, rows)
    if summary is not None:
        console.print(escape(plain_random(summary, replay)))
    if mutants is not None:
        _print_mutants(console, mutants)


def _print_mutants(console: Console, mutants: Sequence[MutantResult]) -> None:
    names = ("mutant", "defect", "profile", "caught", "by invariant", "schedules")
    fixed = [
        max([len(names[0]), *(len(r.mutant.name) for r in mutants)]),
        max([len(names[2]), *(len(r.mutant.profile) for r in mutants)]),
        len(names[3]),
        len(names[5]),
    ]
    if console.width - (3 * len(names) + 1) - sum(fixed) < 2 * COLUMN_WIDTH:
        console.print(escape(mutant_blocks(mutants, width=console.width)), soft_wrap=True)
        return
    table = Table(title="detection power: seeded defects")
    for name in names:  # names and figures whole; the two texts wrap at their words
        table.add_column(name, no_wrap=name not in ("defect", "by invariant"), overflow="fold")
    for result in mutants:
        colour = {"caught": "green", "not caught": "bold red", "n/a": "yellow"}[result.status]
        table.add_row(
            result.mutant.name,
            escape(result.mutant.defect),
            result.mutant.profile,
            f"[{colour}]{caught_text(result)}[/]",
            escape(caught_by(result)),
            "-" if result.not_applicable is not None else str(result.schedules),
        )
    console.print(table)


def _hunted(result: MutantResult) -> str:
    if result.not_applicable is not None:
        return f"n/a ({result.not_applicable})"
    outcome = "caught" if result.caught else "NOT caught"
    return f"{outcome} after {result.schedules} schedule(s)"


def _echo_progress(enabled: bool, text: str) -> None:
    if enabled:
        click.echo(text, err=True)


def eta(seconds: float | None) -> str:
    """``ETA m:ss`` (``h:mm:ss``), or ``ETA -`` when nothing is known yet."""
    return "ETA -" if seconds is None else f"ETA {_clock(seconds)}"


def _clock(seconds: float) -> str:
    minutes, left = divmod(max(0, round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{left:02d}" if hours else f"{minutes}:{left:02d}"


class _EtaColumn(ProgressColumn):
    def __init__(self, progress: RandomProgress) -> None:
        super().__init__()
        self.progress = progress

    def render(self, task: Task) -> Text:
        if self.progress.done >= self.progress.total:
            return Text(f"in {_clock(task.finished_time or task.elapsed or 0.0)}")
        return Text(eta(self.progress.seconds_left()))


class RandomProgress:
    """The progress of ``--random`` (``total`` schedules, ``jobs`` at a time) on ``console``
    (standard error).

    On a terminal: one live line — schedules done/total, operations, faults and violations so
    far, ETA — with each failing schedule printed above it as it finishes. Otherwise (a log, a
    pipe): one plain line per finished schedule, in the order they finish (with ``jobs``, not
    the seeds' order), ending with the count and the ETA. Use it as a context manager (the live
    line is drawn between enter and exit) and call it with each finished schedule.

    The ETA is the pace so far (schedules finished per second) applied to the schedules left;
    until the first ``jobs`` have finished, the pace is ``jobs`` per mean schedule time.
    """

    def __init__(self, console: Console, total: int, jobs: int = 1) -> None:
        self.console = console
        self.total = total
        self.jobs = max(1, min(jobs, total))
        self.done = 0
        self.violations = 0
        self.totals: Counter[str] = Counter()
        self.started = time.monotonic()
        self._seconds = 0.0  # the schedules' own times, summed
        self._end: float | None = None  # when the last one should finish (time.monotonic)
        self._live: Progress | None = None
        if console.is_terminal:
            self._live = Progress(
                TextColumn("schedules"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TextColumn("{task.description}"),
                _EtaColumn(self),
                console=console,
            )
            self._task = self._live.add_task(self._figures(), total=total)

    def __enter__(self) -> RandomProgress:
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._live is not None:
            self._live.stop()

    def seconds_left(self) -> float | None:
        """Seconds until the last schedule should finish (None before the first finished)."""
        return None if self._end is None else max(0.0, self._end - time.monotonic())

    def _figures(self) -> str:
        colour = "bold red" if self.violations else "green"
        return (
            f"{self.totals['operations']} operations, {self.totals['faults']} faults, "
            f"[{colour}]{self.violations} violations[/]"
        )

    def line(self, result: ScheduleResult) -> str:
        """The plain line of a finished schedule (counted already)."""
        stats = result.report.stats
        outcome = "ok" if result.ok else f"VIOLATED ({len(result.report.violations)} violations)"
        where = f"{self.done}/{self.total}"
        if self.done < self.total:
            where += f", {eta(self.seconds_left())}"
        return (
            f"  schedule {result.schedule.seed}: {outcome} ({result.elapsed:.1f}s, "
            f"{stats['operations']} operations, {stats['faults']} faults) [{where}]"
        )

    def __call__(self, result: ScheduleResult) -> None:
        self.done += 1
        self.violations += len(result.report.violations)
        self.totals.update(result.report.stats)
        self._seconds += result.elapsed
        now = time.monotonic()
        if self.done >= self.jobs:
            pace = self.done / max(now - self.started, 1e-3)
        else:
            pace = self.jobs / max(self._seconds / self.done, 1e-3)
        self._end = now + (self.total - self.done) / pace
        if self._live is None:
            self.console.out(self.line(result), highlight=False)
            return
        if not result.ok:
            self._live.console.print(escape(self.line(result)), highlight=False, soft_wrap=True)
        self._live.update(self._task, completed=self.done, description=self._figures())


@cli.command("verify", cls=OneLineUsageCommand, short_help="Prove that stale owners are rejected.")
@click.option("--coordinator", metavar="URL", help="Coordinator to verify [default: embedded].")
@click.option(
    "--store",
    "stores",
    metavar="URL",
    multiple=True,
    help="A store to verify, in the role of its mode (repeatable) [default: temporary].",
)
@click.option(
    "--api",
    type=click.Choice(["sync", "async"]),
    default="sync",
    show_default=True,
    help="The face the worker processes use: fenced (sync) or fenced.aio (async).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option("--random", "count", type=int, metavar="N", help="Run N seeded fault schedules.")
@click.option("--seed", type=int, metavar="S", help="Seed of the first schedule [default: random].")
@click.option(
    "--jobs",
    type=int,
    metavar="J",
    help="With --random: run J schedules at a time, each isolated [default: 1].",
)
@click.option(
    "--duration",
    metavar="SECONDS",
    help=f"Work per schedule [default: {DEFAULT_DURATION:g}; mutants {MUTANT_DURATION:g}].",
)
@click.option("--mutants", "hunt", is_flag=True, help="Show that the checker catches seeded bugs.")
@click.option(
    "--mutant",
    "mutant_names",
    type=click.Choice([mutant.name for mutant in CATALOGUE]),
    metavar="NAME",
    multiple=True,
    help="With --random: run with this seeded defect; with --mutants: hunt only these "
    "(the names: docs/verify.md).",
)
@click.option(
    "--profile",
    type=click.Choice(sorted(PROFILES)),
    default="standard",
    show_default=True,
    help="Fault profile of --random.",
)
@click.option(
    "--budget",
    type=int,
    default=DEFAULT_BUDGET,
    show_default=True,
    metavar="N",
    help="Schedules a mutant may survive before it counts as not caught.",
)
@click.option(
    "--case",
    "only",
    type=click.Choice([case.number for case in CASES]),
    metavar="N",
    multiple=True,
    help="Run only these cases (repeatable): 1-6, 7a, 7b.",
)
@click.option(
    "--keep-history",
    metavar="DIR",
    type=click.Path(file_okay=False, path_type=Path),
    help="Copy every history file here (failing ones are always kept).",
)
@click.pass_context
def verify_command(
    ctx: click.Context,
    coordinator: str | None,
    stores: tuple[str, ...],
    api: str,
    as_json: bool,
    count: int | None,
    seed: int | None,
    jobs: int | None,
    duration: str | None,
    hunt: bool,
    mutant_names: tuple[str, ...],
    profile: str,
    budget: int,
    only: tuple[str, ...],
    keep_history: Path | None,
) -> None:
    """Run, with real processes, SIGKILL, SIGSTOP and lost or delayed replies, the cases of the
    practice table (default), N seeded fault schedules checked against every invariant
    (--random N; --jobs J runs J at a time, each isolated), or the seeded defects the checker
    must catch (--mutants).

    Exit status 0 when every case passed (a case that cannot run on this target says so and
    counts neither way), every schedule kept every invariant and every mutant was caught (a
    mutant without a hook in the target's coordinator or stores is n/a and counts neither way);
    1 otherwise. A failing schedule prints its seed, the command that replays it and the kept
    history file.
    """
    if count is not None and count < 1:
        raise ConfigurationError("--random needs N >= 1")
    if jobs is not None and jobs < 1:
        raise ConfigurationError("--jobs needs J >= 1")
    if jobs is not None and count is None:
        raise ConfigurationError("--jobs runs the schedules of --random: use it with --random N")
    if budget < 1:
        raise ConfigurationError("--budget needs N >= 1")
    if mutant_names and count is None and not hunt:
        raise ConfigurationError("--mutant needs --random or --mutants")
    if only and (count is not None or hunt):
        raise ConfigurationError(
            "--case selects cases of the practice table, not with --random or --mutants"
        )
    seconds = None if duration is None else parse_seconds("--duration", duration)
    if seconds is not None and not seconds > 0:
        raise ConfigurationError("--duration must be > 0")
    if api == "async" and (hunt or mutant_names):
        raise ConfigurationError(
            "--api async runs no seeded defects (they are built into the sync face): "
            "use --mutants and --mutant without it"
        )
    target = Target.create(coordinator, stores, api)
    for mutant in CATALOGUE if count is not None else ():
        why = mutant.not_applicable(target) if mutant.name in mutant_names else None
        if why is not None:  # --random would run the correct program under the defect's name
            raise ConfigurationError(f"--mutant {mutant.name} does not apply here: {why}")
    first_seed = seed if seed is not None else secrets.randbelow(1_000_000)
    chatty = not as_json
    rows: list[Row] | None = None
    summary: RandomSummary | None = None
    hunted: list[MutantResult] | None = None
    replay = _replay(seconds or DEFAULT_DURATION, coordinator, stores, profile, mutant_names, api)

    if count is None and not hunt:
        _echo_progress(chatty, f"fenced verify: {target.describe()}")
        rows = fenced.verify.run(
            coordinator,
            stores,
            cases=only or None,
            keep_history=keep_history,
            api=api,
            progress=lambda row: _echo_progress(
                chatty, f"  case {row.number}: {row.status} ({row.seconds:.1f}s)"
            ),
        )
    if count is not None:
        at_once = f", {jobs} at a time" if jobs is not None and jobs > 1 else ""
        _echo_progress(
            chatty,
            f"fenced verify: {count} schedules from seed {first_seed} ({profile}{at_once}); "
            f"{target.describe()}",
        )
        console = Console(stderr=True, highlight=False)
        progress = RandomProgress(console, count, jobs or 1) if chatty else None
        with progress or contextlib.nullcontext():
            summary = run_random(
                count,
                first_seed,
                target,
                duration=seconds or DEFAULT_DURATION,
                profile=PROFILES[profile],
                mutants=mutant_names,
                keep_history=keep_history,
                restores=True,
                progress=progress,
                jobs=jobs or 1,
            )
    if hunt:
        _echo_progress(chatty, f"fenced verify --mutants: seed {first_seed}, budget {budget}")
        hunted = run_mutants(
            target,
            seed=first_seed,
            names=mutant_names or None,
            budget=budget,
            duration=seconds or MUTANT_DURATION,
            keep_history=keep_history,
            progress=lambda r: _echo_progress(chatty, f"  {r.mutant.name}: {_hunted(r)}"),
        )

    ok = (
        (rows is None or all(row.status != "fail" for row in rows))
        and (summary is None or summary.ok)
        and (hunted is None or not any(r.failed for r in hunted))
    )
    if as_json:
        click.echo(to_json(target.describe(), rows, summary, hunted, ok, replay))
    elif sys.stdout.isatty():
        print_rich(Console(highlight=False), rows, summary, hunted, replay)
    else:
        parts = []
        if rows is not None:
            parts.append(plain_cases(rows))
        if summary is not None:
            parts.append(plain_random(summary, replay))
        if hunted is not None:
            parts.append(plain_mutants(hunted))
        click.echo("\n\n".join(parts))
    ctx.exit(0 if ok else FAILED)
