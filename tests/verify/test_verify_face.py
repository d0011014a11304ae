"""fenced verify's public Python face, and its output on narrow and wide terminals.

* ``fenced.verify.run`` returns the rows of the practice table with their status, refuses bad
  selections before anything runs, and ``fenced.verify.check`` re-checks a kept history;
* importing ``fenced.verify`` loads neither rich nor the worker module (the workers run
  ``python -m fenced.verify._worker``, which imports the package first);
* on a real terminal (a pseudo-terminal) of 80 columns the practice table is one block per case
  whose fields read back whole; on a wide one it is a table in which no word is cut.
"""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

import fenced
import fenced.verify
from fenced.cli._verify_cmd import COLUMN_WIDTH, print_rich, table_widths
from fenced.verify._cases import CASES
from fenced.verify._table import FIELDS, STATUS, Row, plain_cases

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _rows() -> list[Row]:
    """Every case's row with a long observed text (as a real run has)."""
    rows = [case.row() for case in CASES]
    statuses: list[fenced.verify.Status] = ["pass", "fail", "unavailable"] * 3
    for row, status in zip(rows, statuses, strict=False):
        row.status = status
        row.observed = (
            f"case {row.number}: A (epoch 1) was paused past its lease; B acquired epoch 2 and "
            "installed it at the strict store; A's late write was rejected: StaleToken "
            "(presented epoch 1, floor 2)"
        )
    return rows


def _blocks(text: str) -> dict[str, dict[str, str]]:
    """Read the block layout back: {case number: {label: the field's text, lines joined}}."""
    blocks: dict[str, dict[str, str]] = {}
    fields: dict[str, str] = {}
    label = ""
    for line in text.splitlines():
        head = re.match(r"^(\d[ab]?) +\S", line)
        if head:
            fields = blocks.setdefault(head.group(1), {})
            fields["header"] = line
            label = ""
            continue
        field = re.match(r"^  ([a-zA-Z ]+): +(.*)$", line)
        if field and not line.startswith("   "):
            label = field.group(1)
            fields[label] = field.group(2)
        elif line.startswith(" " * 22) and label:
            fields[label] += " " + line.strip()
    return blocks


def _assert_blocks(text: str, rows: list[Row], width: int) -> None:
    assert "│" not in text and "┃" not in text  # no table
    blocks = _blocks(text)
    assert sorted(blocks) == sorted(row.number for row in rows)
    for row in rows:
        block = blocks[row.number]
        assert block["header"].endswith(STATUS[row.status]), block["header"]
        for label, attribute in FIELDS:
            assert block[label] == getattr(row, attribute), (row.number, label)
    for line in text.splitlines():  # a word longer than a line (a path) keeps a line to itself
        assert len(line) <= width or len(line[22:].split()) == 1, line


def _table_words_whole(text: str, rows: list[Row]) -> None:
    assert "┃ invariant" in text  # the table
    for row in rows:
        for _, attribute in FIELDS:
            for word in getattr(row, attribute).split():
                assert word in text, (row.number, attribute, word)


# -- the rendering ------------------------------------------------------------------------------


def test_every_word_of_the_cases_fits_a_table_column() -> None:
    """The rich table never has to cut a word of the cases' own texts."""
    for case in CASES:
        for text in (case.name, case.invariant, case.component, case.assumption, case.recovery):
            assert max(len(word) for word in text.split()) <= COLUMN_WIDTH, text
    for label, _ in FIELDS:
        assert len(label) <= COLUMN_WIDTH


def test_the_table_needs_every_text_column_at_its_narrowest_width() -> None:
    rows = _rows()
    assert table_widths(rows, 80) is None
    assert table_widths(rows, 120) is None
    widths = table_widths(rows, 200)
    assert widths is not None
    assert sum(widths) + 3 * len(widths) + 1 == 200
    assert min(widths[1:-1]) >= COLUMN_WIDTH
    narrowest = next(w for w in range(80, 300) if table_widths(rows, w) is not None)
    widths = table_widths(rows, narrowest)
    assert widths is not None and min(widths[1:-1]) == COLUMN_WIDTH


@pytest.mark.parametrize("width", [60, 80, 100])
def test_plain_blocks_fit_the_width_and_read_back_whole(width: int) -> None:
    rows = _rows()
    _assert_blocks(plain_cases(rows, width=width), rows, width)


@pytest.mark.parametrize("width", [80, 150])
def test_a_narrow_terminal_gets_one_block_per_case(width: int) -> None:
    rows = _rows()
    out = io.StringIO()
    print_rich(Console(file=out, width=width, color_system=None), rows, None, None, "")
    _assert_blocks(out.getvalue(), rows, width)


def test_a_wide_terminal_gets_the_table_with_no_word_cut() -> None:
    rows = _rows()
    out = io.StringIO()
    print_rich(Console(file=out, width=200, color_system=None), rows, None, None, "")
    text = out.getvalue()
    _table_words_whole(text, rows)
    assert max(len(line) for line in text.splitlines()) <= 200


def _on_a_terminal(columns: int, *args: str) -> tuple[int, str]:
    """Run ``fenced verify ARGS`` with its standard output on a pseudo-terminal."""
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1"}
    env.pop("FORCE_COLOR", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "fenced", "verify", *args],
        stdout=slave,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    os.close(slave)
    output = bytearray()
    try:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not chunk:
                break
            output += chunk
    finally:
        os.close(master)
    code = process.wait(timeout=60)
    return code, ANSI.sub("", output.decode()).replace("\r\n", "\n")


@pytest.mark.timeout(60)
def test_the_command_on_an_80_column_terminal_prints_blocks(tmp_path: Path) -> None:
    coordinator = f"sqlite:///{tmp_path / 'coordinator.db'}"  # case 6 cannot run: fast
    code, text = _on_a_terminal(80, "--case", "6", "--coordinator", coordinator)
    assert code == 0, text
    (row,) = fenced.verify.run(coordinator, cases="6")
    _assert_blocks(text.split("\ncases:")[0], [row], 80)
    assert "cases: 0 passed, 0 failed, 1 not available" in text


@pytest.mark.timeout(60)
def test_the_command_on_a_wide_terminal_prints_the_table(tmp_path: Path) -> None:
    coordinator = f"sqlite:///{tmp_path / 'coordinator.db'}"
    code, text = _on_a_terminal(200, "--case", "6", "--coordinator", coordinator)
    assert code == 0, text
    (row,) = fenced.verify.run(coordinator, cases="6")
    _table_words_whole(text, [row])
    assert any(line.startswith("│ 6 ") and "│ NOT" in line for line in text.splitlines())


# -- the Python face ----------------------------------------------------------------------------


def test_the_public_names_of_fenced_verify() -> None:
    assert set(fenced.verify.__all__) == {
        "INVARIANTS",
        "Report",
        "Row",
        "Status",
        "Violation",
        "check",
        "run",
    }


def test_importing_fenced_verify_loads_neither_rich_nor_the_worker() -> None:
    code = (
        "import sys, fenced.verify\n"
        "assert 'fenced.verify._worker' not in sys.modules, 'worker'\n"
        "assert 'rich' not in sys.modules and 'click' not in sys.modules, 'cli'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_run_returns_the_rows_with_their_status(tmp_path: Path) -> None:
    seen: list[str] = []
    kept = tmp_path / "histories"
    rows = fenced.verify.run(
        cases=["7b", "7a"],
        keep_history=kept,
        progress=lambda row: seen.append(row.number),
    )
    assert [row.number for row in rows] == ["7a", "7b"] == seen  # table order
    for row in rows:
        assert isinstance(row, fenced.verify.Row)
        assert row.status == "pass" and row.passed is True, (row.observed, row.violations)
        assert row.violations == []
    assert "was ACCEPTED" in rows[0].observed  # monotonic: the old write is accepted
    assert "StaleToken" in rows[1].observed  # strict: rejected
    histories = sorted(kept.iterdir())
    assert len(histories) == 2
    for history in histories:
        report = fenced.verify.check(history)
        assert isinstance(report, fenced.verify.Report)
        assert report.ok, report.violations
        assert report.stats["operations"] > 0


def test_a_case_that_cannot_run_is_a_row_neither_passed_nor_failed(tmp_path: Path) -> None:
    (row,) = fenced.verify.run(f"sqlite:///{tmp_path / 'mine.db'}", cases="6")
    assert row.status == "unavailable"
    assert row.passed is None
    assert "--coordinator" in row.observed


def test_run_refuses_bad_input_before_anything_runs(tmp_path: Path) -> None:
    ran: list[Row] = []
    strict = f"sqlite:///{tmp_path / 'a.db'}"
    also_strict = f"sqlite:///{tmp_path / 'b.db'}"
    bad = [
        ({"cases": ["9"]}, "unknown case '9'"),
        ({"cases": []}, "no case selected"),
        ({"coordinator": "memory://x"}, "memory://"),
        ({"stores": [strict, also_strict]}, "two --store URLs of the same mode"),
        ({"cases": [7]}, "cases takes strings"),
    ]
    for arguments, message in bad:
        with pytest.raises(fenced.ConfigurationError, match=re.escape(message)):
            fenced.verify.run(**arguments, progress=ran.append)  # type: ignore[arg-type]
    assert ran == []


def test_check_of_a_missing_history_raises() -> None:
    with pytest.raises(FileNotFoundError):
        fenced.verify.check("/nonexistent/fenced-verify.history.jsonl")
