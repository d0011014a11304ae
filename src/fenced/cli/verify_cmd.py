"""``fenced verify``: prove, with real processes and real faults, that stale owners are harmless.

Thin face of :mod:`fenced.verify`: parses options, runs the cases, the randomized schedules or
the mutants, renders the result (rich on a terminal, plain text otherwise, ``--json`` stable),
and exits 0 only if everything held (1 otherwise; 2 for bad usage).
"""

from __future__ import annotations

import secrets
import shlex
import sys
from pathlib import Path

import click

from fenced.cli.app import OneLineUsageCommand, cli
from fenced.cli.run_cmd import parse_seconds
from fenced.core.errors import ConfigurationError
from fenced.verify.cases import CASES, Row, run_cases
from fenced.verify.mutants import (
    CATALOGUE,
    DEFAULT_BUDGET,
    MUTANT_DURATION,
    MutantResult,
    run_mutants,
)
from fenced.verify.restoring import RestoreUnusable, restore_support
from fenced.verify.schedule import DEFAULT_DURATION, PROFILES, RandomSummary, run_random
from fenced.verify.table import plain_cases, plain_mutants, plain_random, print_rich, to_json
from fenced.verify.target import Target

__all__ = ["FAILED", "verify_command"]

FAILED = 1
"""Exit status when a case failed, a schedule broke an invariant or an applicable mutant was not
caught."""


def _replay(
    duration: float,
    coordinator: str | None,
    stores: tuple[str, ...],
    profile: str,
    mutants: tuple[str, ...],
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
    return " ".join(parts)


def _hunted(result: MutantResult) -> str:
    if result.not_applicable is not None:
        return f"n/a ({result.not_applicable})"
    outcome = "caught" if result.caught else "NOT caught"
    return f"{outcome} after {result.schedules} schedule(s)"


def _echo_progress(enabled: bool, text: str) -> None:
    if enabled:
        click.echo(text, err=True)


@cli.command("verify", cls=OneLineUsageCommand, short_help="Prove that stale owners are rejected.")
@click.option("--coordinator", metavar="URL", help="Coordinator to verify [default: embedded].")
@click.option(
    "--store",
    "stores",
    metavar="URL",
    multiple=True,
    help="A store to verify, in the role of its mode (repeatable) [default: temporary].",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option("--random", "count", type=int, metavar="N", help="Run N seeded fault schedules.")
@click.option("--seed", type=int, metavar="S", help="Seed of the first schedule [default: random].")
@click.option(
    "--duration",
    metavar="SECONDS",
    help=f"Work per schedule [default: {DEFAULT_DURATION:g}; mutants {MUTANT_DURATION:g}].",
)
@click.option("--mutants", "hunt", is_flag=True, help="Show that the checker catches seeded bugs.")
@click.option(
    "--mutant",
    "mutant_names",
    metavar="NAME",
    multiple=True,
    help="With --random: run with this seeded defect; with --mutants: hunt only these.",
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
@click.option("--case", "only", metavar="N", multiple=True, help="Run only these cases (1-7b).")
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
    as_json: bool,
    count: int | None,
    seed: int | None,
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
    (--random N), or the seeded defects the checker must catch (--mutants).

    Exit status 0 when every case passed (a case whose feature has not landed says so and
    counts neither way), every schedule kept every invariant and every mutant was caught (a
    mutant without a hook in the target's coordinator or stores is n/a and counts neither way);
    1 otherwise. A failing schedule prints its seed, the command that replays it and the kept
    history file.
    """
    if count is not None and count < 1:
        raise ConfigurationError("--random needs N >= 1")
    if budget < 1:
        raise ConfigurationError("--budget needs N >= 1")
    if mutant_names and count is None and not hunt:
        raise ConfigurationError("--mutant needs --random or --mutants")
    numbers = {case.number for case in CASES}
    for number in only:
        if number not in numbers:
            listed = ", ".join(sorted(numbers))
            raise ConfigurationError(f"unknown case {number!r}; cases: {listed}")
    known = {m.name for m in CATALOGUE}
    for name in mutant_names:
        if name not in known:
            raise ConfigurationError(f"unknown mutant {name!r}; known: {', '.join(sorted(known))}")
    seconds = None if duration is None else parse_seconds("--duration", duration)
    if seconds is not None and not seconds > 0:
        raise ConfigurationError("--duration must be > 0")
    target = Target.create(coordinator, stores)
    for mutant in CATALOGUE if count is not None else ():
        why = mutant.not_applicable(target) if mutant.name in mutant_names else None
        if why is not None:  # --random would run the correct program under the defect's name
            raise ConfigurationError(f"--mutant {mutant.name} does not apply here: {why}")
    first_seed = seed if seed is not None else secrets.randbelow(1_000_000)
    chatty = not as_json
    rows: list[Row] | None = None
    summary: RandomSummary | None = None
    hunted: list[MutantResult] | None = None
    replay = _replay(seconds or DEFAULT_DURATION, coordinator, stores, profile, mutant_names)

    if count is None and not hunt:
        _echo_progress(chatty, f"fenced verify: {target.describe()}")
        rows = run_cases(
            target,
            only=only or None,
            keep_history=keep_history,
            progress=lambda row: _echo_progress(
                chatty, f"  case {row.number}: {row.status} ({row.seconds:.1f}s)"
            ),
        )
    if count is not None:
        try:
            restore = restore_support()
        except RestoreUnusable as error:
            raise ConfigurationError(str(error)) from error
        _echo_progress(
            chatty,
            f"fenced verify: {count} schedules from seed {first_seed} ({profile}); "
            f"{target.describe()}",
        )
        summary = run_random(
            count,
            first_seed,
            target,
            duration=seconds or DEFAULT_DURATION,
            profile=PROFILES[profile],
            mutants=mutant_names,
            keep_history=keep_history,
            restore=restore,
            progress=lambda r: _echo_progress(
                chatty,
                f"  schedule {r.schedule.seed}: {'ok' if r.ok else 'VIOLATED'} "
                f"({r.elapsed:.1f}s, {r.report.stats['operations']} operations)",
            ),
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
        from rich.console import Console  # noqa: PLC0415 - only the terminal form needs rich

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
