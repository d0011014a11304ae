"""Rendering of verification results: the practice table, randomized runs, mutants.

Three forms, chosen by the caller:

* a **rich** table on a terminal (:func:`print_rich`);
* **plain text** otherwise (:func:`plain_cases`, :func:`plain_random`, :func:`plain_mutants`):
  one block per row, stable and grep-able, for logs and CI;
* **JSON** (:func:`to_json`): a stable document (keys ``ok``, ``target``, ``cases``,
  ``random``, ``mutants``; absent parts are null) for tools.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fenced.verify.cases import Row
from fenced.verify.schedule import RandomSummary

if TYPE_CHECKING:
    from rich.console import Console

    from fenced.verify.mutants import MutantResult

__all__ = [
    "STATUS",
    "plain_cases",
    "plain_mutants",
    "plain_random",
    "print_rich",
    "to_json",
]

STATUS = {"pass": "PASS", "fail": "FAIL", "unavailable": "NOT AVAILABLE"}
_WIDTH = 100


def _wrap(label: str, text: str) -> list[str]:
    lines = textwrap.wrap(
        text,
        width=_WIDTH,
        initial_indent=f"    {label:<13}",
        subsequent_indent=" " * 17,
        break_on_hyphens=False,
    )
    return lines or [f"    {label}"]


def plain_cases(rows: Sequence[Row]) -> str:
    """The practice table as plain text: one block per case."""
    out: list[str] = []
    for row in rows:
        head = f"{row.number:<3} {row.case}"
        out.append(f"{head:<{_WIDTH - 14}} {STATUS[row.status]:>13}")
        out += _wrap("invariant", row.invariant)
        out += _wrap("enforced by", row.component)
        out += _wrap("assumption", row.assumption)
        out += _wrap("recovery", row.recovery)
        out += _wrap("observed", row.observed)
        for violation in row.violations:
            out += _wrap("VIOLATION", violation)
        out.append("")
    passed = sum(1 for r in rows if r.status == "pass")
    failed = sum(1 for r in rows if r.status == "fail")
    unavailable = sum(1 for r in rows if r.status == "unavailable")
    summary = f"cases: {passed} passed, {failed} failed"
    if unavailable:
        summary += f", {unavailable} not available (see the row)"
    out.append(summary)
    return "\n".join(out)


def plain_random(summary: RandomSummary, replay: str) -> str:
    """The outcome of a randomized run as plain text (with a replay command per failure)."""
    totals = summary.totals()
    out = [
        f"randomized: {len(summary.results)} schedules from seed {summary.seed}, "
        f"{sum(len(r.report.violations) for r in summary.results)} violations",
        f"  operations {totals['operations']}, grants {totals['grants']}, "
        f"faults {totals['faults']} (pauses {totals['fault pause']}, kills "
        f"{totals['fault kill']}, lost replies {totals['fault lose_reply']}, delayed replies "
        f"{totals['fault delay_reply']}, delayed requests {totals['fault delay_request']}, "
        f"unavailable {totals['fault unavailable']}, restores {totals['fault restore']}, "
        f"proxy cuts {totals['fault wire']}), "
        f"stale writes rejected {totals['stale writes rejected']}",
    ]
    for result in summary.failed:
        seed = result.schedule.seed
        out.append(f"FAILED schedule {result.schedule.describe()}")
        for violation in result.report.violations[:20]:
            out.append(f"  {violation.invariant}: {violation.message}")
        if len(result.report.violations) > 20:
            out.append(f"  … and {len(result.report.violations) - 20} more")
        out.append(f"  replay:  {replay.format(seed=seed)}")
        out.append(f"  history: {summary.kept.get(seed, result.history)}")
    notes = sorted({n for r in summary.results for n in r.report.notes})
    out += [f"  note: {note}" for note in notes]
    return "\n".join(out)


def _caught(result: MutantResult) -> str:
    return {"caught": "yes", "not caught": "NO", "n/a": "n/a"}[result.status]


def _by(result: MutantResult) -> str:
    """The invariants that caught it, or why the defect does not apply."""
    if result.not_applicable is not None:
        return result.not_applicable
    return ", ".join(result.invariants) or "-"


def plain_mutants(results: Sequence[MutantResult]) -> str:
    """The detection-power table as plain text (an inapplicable defect: ``n/a`` and why)."""
    out = [f"{'mutant':<26}{'caught':<8}{'by invariant':<38}{'schedules':>10}  seed"]
    for result in results:
        if result.not_applicable is not None:
            out.append(f"{result.mutant.name:<26}{'n/a':<8}{result.not_applicable}")
            continue
        out.append(
            f"{result.mutant.name:<26}{_caught(result):<8}{_by(result)[:37]:<38}"
            f"{result.schedules:>10}  {result.seed if result.seed is not None else '-'}"
        )
    caught = sum(1 for r in results if r.status == "caught")
    applicable = sum(1 for r in results if r.status != "n/a")
    summary = f"mutants: {caught} of {applicable} caught"
    if applicable < len(results):
        summary += f", {len(results) - applicable} n/a (no hook in this target)"
    out.append(summary)
    return "\n".join(out)


def print_rich(
    console: Console,
    rows: Sequence[Row] | None,
    summary: RandomSummary | None,
    mutants: Sequence[MutantResult] | None,
    replay: str,
) -> None:
    """Print the results as rich tables (for a terminal)."""
    from rich.markup import escape  # noqa: PLC0415 - only the terminal form needs rich
    from rich.table import Table  # noqa: PLC0415

    colours = {"pass": "green", "fail": "bold red", "unavailable": "yellow"}
    if rows is not None:
        table = Table(title="fenced verify: the practice table", show_lines=True, expand=True)
        for name, ratio in (
            ("#", 0),
            ("case", 3),
            ("invariant", 3),
            ("enforced by", 3),
            ("failure assumption", 3),
            ("recovery", 3),
            ("observed", 6),
            ("result", 0),
        ):
            table.add_column(name, ratio=ratio or None, overflow="fold")
        for row in rows:
            observed = escape(row.observed)
            if row.violations:
                observed += "\n[bold red]" + escape("\n".join(row.violations)) + "[/]"
            table.add_row(
                row.number,
                escape(row.case),
                escape(row.invariant),
                escape(row.component),
                escape(row.assumption),
                escape(row.recovery),
                observed,
                f"[{colours[row.status]}]{STATUS[row.status]}[/]",
            )
        console.print(table)
        console.print(escape(plain_cases(rows).splitlines()[-1]))
    if summary is not None:
        console.print(escape(plain_random(summary, replay)))
    if mutants is not None:
        table = Table(title="detection power: seeded defects")
        for name in ("mutant", "defect", "profile", "caught", "by invariant", "schedules"):
            table.add_column(name, overflow="fold")
        for result in mutants:
            colour = {"caught": "green", "not caught": "bold red", "n/a": "yellow"}[result.status]
            table.add_row(
                result.mutant.name,
                escape(result.mutant.defect),
                result.mutant.profile,
                f"[{colour}]{_caught(result)}[/]",
                escape(_by(result)),
                "-" if result.not_applicable is not None else str(result.schedules),
            )
        console.print(table)


def to_json(
    target: str,
    rows: Sequence[Row] | None,
    summary: RandomSummary | None,
    mutants: Sequence[MutantResult] | None,
    ok: bool,
    replay: str | None = None,
) -> str:
    """The stable JSON document of a ``fenced verify`` run."""
    document: dict[str, Any] = {
        "ok": ok,
        "target": target,
        "cases": None if rows is None else [row.to_json() for row in rows],
        "random": None if summary is None else summary.to_json(replay),
        "mutants": None if mutants is None else [m.to_json() for m in mutants],
    }
    return json.dumps(document, indent=2)
