"""The practice table's rows, and verification results as plain text and JSON.

:class:`Row` is one row of the practice table (what :func:`fenced.verify.run` returns). Two
forms here, chosen by the caller (the command line adds a rich table for wide terminals):

* **plain text** (:func:`plain_cases`, :func:`plain_random`, :func:`plain_mutants`), stable and
  grep-able, for logs and CI; the practice table (and, with :func:`mutant_blocks`, the seeded
  defects) as one block per row at a given width, also for narrow terminals;
* **JSON** (:func:`to_json`): a stable document (keys ``ok``, ``target``, ``cases``,
  ``random``, ``mutants``; absent parts are null) for tools.

Nothing here needs rich or click: the library side of ``fenced verify`` runs without the ``cli``
extra.
"""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from fenced.verify._mutants import MutantResult
    from fenced.verify._schedule import RandomSummary

__all__ = [
    "FIELDS",
    "PLAIN_WIDTH",
    "STATUS",
    "Row",
    "Status",
    "cases_summary",
    "caught_by",
    "caught_text",
    "mutant_blocks",
    "mutants_summary",
    "plain_cases",
    "plain_mutants",
    "plain_random",
    "to_json",
]

Status = Literal["pass", "fail", "unavailable"]
"""A case's outcome: ``unavailable`` means it could not run on this target (neither way)."""


@dataclass
class Row:
    """One row of the practice table: a case, what it claims, and what was observed.

    ``status`` is ``"pass"`` only if the observed behaviour was the documented one *and* the
    history checker found no violation in the case's history (then ``violations`` is empty).
    """

    number: str
    """The case number: ``"1"`` … ``"6"``, ``"7a"``, ``"7b"``."""
    case: str
    """What happens in the case (the fault)."""
    invariant: str
    """What must hold."""
    component: str
    """The component that enforces the invariant."""
    assumption: str
    """The failure assumption: what may go wrong."""
    recovery: str
    """The recovery action."""
    observed: str = ""
    """What the run observed: what was rejected, by whom, with which epochs."""
    status: Status = "fail"
    violations: list[str] = field(default_factory=list)
    """The history checker's violations, each ``"invariant: message"``."""
    seconds: float = 0.0
    """How long the case ran."""

    @property
    def passed(self) -> bool | None:
        """True / False; None when the case could not run here (not available)."""
        return None if self.status == "unavailable" else self.status == "pass"

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "case": self.case,
            "invariant": self.invariant,
            "enforcing_component": self.component,
            "failure_assumption": self.assumption,
            "recovery_action": self.recovery,
            "observed": self.observed,
            "status": self.status,
            "passed": self.passed,
            "violations": self.violations,
            "seconds": round(self.seconds, 2),
        }


FIELDS = (
    ("invariant", "invariant"),
    ("enforced by", "component"),
    ("failure assumption", "assumption"),
    ("recovery", "recovery"),
    ("observed", "observed"),
)
"""The practice table's text columns after the case: (label, :class:`Row` attribute)."""
STATUS = {"pass": "PASS", "fail": "FAIL", "unavailable": "NOT AVAILABLE"}
PLAIN_WIDTH = 100
"""Line width of the plain-text form (a terminal's own width when shown on one)."""
_LABEL = 20
"""Width of a block line's ``label:`` column (the longest label and its colon, plus a space)."""
_NARROWEST = 40


def _wrap(label: str, text: str, width: int) -> list[str]:
    indent = " " * (_LABEL + 2)
    lines = textwrap.wrap(
        text,
        width=width,
        initial_indent=f"  {label + ':':<{_LABEL}}",
        subsequent_indent=indent,
        break_on_hyphens=False,
        break_long_words=False,
    )
    return lines or [f"  {label}:"]


def plain_cases(rows: Sequence[Row], width: int = PLAIN_WIDTH) -> str:
    """The practice table as plain text: one block per case, lines of at most ``width``
    characters (a word longer than a line, such as a path, keeps its line to itself).

    A block is a header (number, case, result) and one ``label: value`` line per field."""
    width = max(width, _NARROWEST)
    out: list[str] = []
    for row in rows:
        status = STATUS[row.status]
        head = textwrap.wrap(
            f"{row.number:<3} {row.case}",
            width=width - len(status) - 1,
            subsequent_indent="    ",
            break_on_hyphens=False,
        )
        head[0] = f"{head[0]:<{width - len(status) - 1}} {status}"
        out += head
        for label, attribute in FIELDS:
            out += _wrap(label, getattr(row, attribute), width)
        for violation in row.violations:
            out += _wrap("VIOLATION", violation, width)
        out.append("")
    out.append(cases_summary(rows))
    return "\n".join(out)


def cases_summary(rows: Sequence[Row]) -> str:
    """One line: how many cases passed, failed, or could not run."""
    passed = sum(1 for r in rows if r.status == "pass")
    failed = sum(1 for r in rows if r.status == "fail")
    unavailable = sum(1 for r in rows if r.status == "unavailable")
    summary = f"cases: {passed} passed, {failed} failed"
    if unavailable:
        summary += f", {unavailable} not available (see the row)"
    return summary


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
        f"proxy cuts {totals['fault wire']}{_network_faults(totals)}), "
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


def _network_faults(totals: Counter[str]) -> str:
    """The partitions and member faults of a run, where there were any."""
    kinds = (
        ("partitions", "fault partition"),
        ("member kills", "fault member-kill"),
        ("member isolations", "fault member-isolate"),
    )
    return "".join(f", {label} {totals[key]}" for label, key in kinds if totals[key])


def caught_text(result: MutantResult) -> str:
    """``yes``, ``NO`` or ``n/a``: the detection-power table's "caught" cell."""
    return {"caught": "yes", "not caught": "NO", "n/a": "n/a"}[result.status]


def caught_by(result: MutantResult) -> str:
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
            f"{result.mutant.name:<26}{caught_text(result):<8}{caught_by(result)[:37]:<38}"
            f"{result.schedules:>10}  {result.seed if result.seed is not None else '-'}"
        )
    out.append(mutants_summary(results))
    return "\n".join(out)


def mutant_blocks(results: Sequence[MutantResult], width: int = PLAIN_WIDTH) -> str:
    """The detection-power table as one block per seeded defect, lines of at most ``width``
    characters (for a terminal too narrow for its columns)."""
    width = max(width, _NARROWEST)
    out: list[str] = []
    for result in results:
        caught = f"caught: {caught_text(result)}"
        out.append(f"{result.mutant.name:<{width - len(caught) - 1}} {caught}")
        out += _wrap("defect", result.mutant.defect, width)
        out += _wrap("profile", result.mutant.profile, width)
        if result.not_applicable is not None:
            out += _wrap("not applicable", result.not_applicable, width)
        else:
            out += _wrap("caught by", caught_by(result), width)
            seed = "-" if result.seed is None else result.seed
            out += _wrap("schedules", f"{result.schedules} (seed {seed})", width)
        out.append("")
    out.append(mutants_summary(results))
    return "\n".join(out)


def mutants_summary(results: Sequence[MutantResult]) -> str:
    """One line: how many applicable defects were caught, how many did not apply."""
    caught = sum(1 for r in results if r.status == "caught")
    applicable = sum(1 for r in results if r.status != "n/a")
    summary = f"mutants: {caught} of {applicable} caught"
    if applicable < len(results):
        summary += f", {len(results) - applicable} n/a (no hook in this target)"
    return summary


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
