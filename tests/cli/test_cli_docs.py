"""docs/cli.md against the code: the exit codes, the environment variables, shell completion and
the choices of ``fenced verify``.

* The exit code table of docs/cli.md lists exactly the codes of :mod:`fenced.cli._exitcodes`, by
  number and name, and each row's meaning contains the headline of the constant's docstring.
* Every exit status the documents (docs/*.md, README.md) mention — ``exits 2``, ``Exit codes:
  0 …; **1** …``, ``| 75 | … |`` in a status table — is in that table (or is a shell
  convention: 126, 127, 128 + N, 130), and is not described with the words of another code
  (``**70** outcome unknown`` when 70 is ``INTERNAL_ERROR``).
* The environment variable table of docs/cli.md is :data:`fenced.cli._app.ENVIRONMENT`, each
  listed command reads the variable (and shows it in ``--help``), no other command does; a
  command run with ``FENCED_URL`` / ``FENCED_STORE`` set uses them, and the option wins.
* ``_FENCED_COMPLETE`` prints the bash, zsh and fish scripts and completes commands and choices,
  through the installed ``fenced`` console script.
* ``fenced verify --case`` and ``--mutant`` accept only the real names: a wrong one exits 2 with
  one line listing them.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

from fenced.cli import _exitcodes as exitcodes
from fenced.cli._app import ENVIRONMENT
from fenced.cli._exitcodes import BAD_INPUT
from fenced.cli._main import cli
from fenced.coordinator._connect import DEFAULT_URL, connect
from fenced.core._urls import url_of_path
from fenced.fence._store import open_store
from fenced.verify._cases import CASES
from fenced.verify._mutants import CATALOGUE

ROOT = Path(__file__).resolve().parents[2]
CLI_MD = ROOT / "docs" / "cli.md"
DOCUMENTS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]

SHELL_CONVENTIONS = {126, 127, 128, 130}
"""Statuses of ``fenced run`` that follow the shell, outside the table: cannot execute, not
found, 128 + N killed by signal N, 130 interrupted."""

KEYWORDS = {
    "OK": ("success",),
    "NOT_FOUND": ("nothing found", "found nothing", "no leader", "there is none"),
    "BAD_INPUT": ("bad input", "bad usage", "malformed", "invalid"),
    "REJECTED": ("rejected", "stale"),
    "CONFLICT": ("conflict",),
    "UNAVAILABLE": ("unavailable", "busy", "could not be reached"),
    "INTERNAL_ERROR": ("internal", "a bug"),
    "OUTCOME_UNKNOWN": ("outcome unknown", "outcome is unknown"),
    "NOT_ACQUIRED": ("not acquired", "not elected"),
    "LEASE_LOST": ("was lost", "lease lost", "leadership lost"),
}
"""Words that describe one code only: a mention of status N described with another code's words
(and none of N's own) is a stale or wrong statement."""


def normalized(text: str) -> str:
    text = text.lower().replace("`", "").replace("*", "").replace("_", " ")
    return re.sub(r"\s+", " ", text).strip()


def section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the first markdown table in ``text``, as stripped cells."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def documented_codes() -> dict[int, tuple[str, str]]:
    """docs/cli.md's exit code table: status → (name, meaning)."""
    rows = table_rows(section(CLI_MD.read_text(), "Exit codes of every command"))
    assert rows, "docs/cli.md has no exit code table"
    return {int(status): (name.strip("`"), meaning) for status, name, meaning in rows}


def module_codes() -> dict[str, tuple[int, str]]:
    """The constants of fenced/cli/_exitcodes.py: name → (value, docstring or "")."""
    tree = ast.parse(Path(exitcodes.__file__).read_text())
    found: dict[str, tuple[int, str]] = {}
    body = tree.body
    for statement, following in zip(body, [*body[1:], None], strict=True):
        if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1):
            continue
        target = statement.targets[0]
        if not (isinstance(target, ast.Name) and isinstance(statement.value, ast.Constant)):
            continue
        if not isinstance(statement.value.value, int):
            continue
        doc = ""
        if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
            doc = str(following.value.value)
        found[target.id] = (statement.value.value, doc)
    return found


def test_the_exit_code_table_is_the_module() -> None:
    documented = documented_codes()
    constants = module_codes()
    assert {name for name, (value, _) in constants.items()} == set(exitcodes.__all__) - {
        "exit_code_for"
    }
    assert {status: name for status, (name, _) in documented.items()} == {
        value: name for name, (value, _) in constants.items()
    }
    for name, (value, _) in constants.items():
        assert getattr(exitcodes, name) == value


@pytest.mark.parametrize("name", sorted(set(exitcodes.__all__) - {"exit_code_for", "OK"}))
def test_each_documented_meaning_is_the_constants(name: str) -> None:
    value, doc = module_codes()[name]
    headline = normalized(re.split(r"[:;.(]", doc, maxsplit=1)[0])
    assert headline, f"{name} has no docstring"
    documented_name, meaning = documented_codes()[value]
    assert documented_name == name
    assert headline in normalized(meaning), (name, headline, meaning)


def test_the_keywords_name_every_code() -> None:
    names = {name for name, _ in documented_codes().values()}
    assert set(KEYWORDS) == names, f"give KEYWORDS words for {sorted(names - set(KEYWORDS))}"
    for status, (name, meaning) in documented_codes().items():
        if status != exitcodes.OK:
            assert any(word in normalized(meaning) for word in KEYWORDS[name]), name


_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_EXIT = re.compile(r"\bexit(?:s|ed)?(?: with| codes?| status(?:es)?)?:? +(?=\**\d)", re.I)
_NUMBER = r"\**(\d+)\**(?![\w%×/+-]|\.\d|\s*(?:%|×|s\b|ms\b|MiB\b))"
_FIRST = re.compile(_NUMBER)
_LISTED = re.compile(r"(?:[,;:]|\bor|\band) +" + _NUMBER)
"""A status after the first one of an ``exit`` phrase follows a separator: ``0, or 2 for …;
**69** busy``, ``exits with 2, 3 or 75`` (not ``step 1``)."""
_SENTENCE_END = re.compile(r"\.(?=\s+[A-Z`*\[]|\s*$)")
_TICKS = re.compile(r"`[^`]*`")
_BLOCK = re.compile(r"\n\s*\n|\n(?=\s*(?:[-*]|\d+\.) )")
"""Paragraphs and list items: a sentence never runs into the next item."""


def _blank_code_spans(text: str) -> str:
    return _TICKS.sub(lambda m: "`" + "x" * (len(m.group()) - 2) + "`", text)


def mentions(text: str) -> list[tuple[int, str]]:
    """Every (status, description) a document gives: rows of tables whose first column is a
    status, and the numbers of a sentence from its ``exit …`` phrase on."""
    found: list[tuple[int, str]] = []
    for paragraph in _BLOCK.split(_FENCE.sub("", text)):
        lines = paragraph.strip().splitlines()
        if lines and lines[0].startswith("|"):
            if lines[0].strip("| ").split("|")[0].strip().lower() in ("status", "exit status"):
                for cells in table_rows(paragraph):
                    if re.fullmatch(r"[\d /]+", cells[0]):
                        found += [(int(n), " ".join(cells[1:])) for n in cells[0].split("/")]
            continue
        flat = " ".join(line.strip() for line in lines)
        masked = _blank_code_spans(flat)
        for phrase in _EXIT.finditer(masked):
            end = _SENTENCE_END.search(masked, phrase.end())
            stop = end.start() if end else len(masked)
            first = _FIRST.match(masked, phrase.end(), stop)
            if first is None:
                continue
            numbers = [first, *_LISTED.finditer(masked, first.end(), stop)]
            ends = [number.start(1) for number in numbers[1:]] + [stop]
            for number, until in zip(numbers, ends, strict=True):
                clause = flat[number.end(1) : until].lstrip("*").split(";")[0]
                found.append((int(number.group(1)), clause))
    return found


def test_every_exit_status_mentioned_in_the_documents_is_the_tables() -> None:
    documented = documented_codes()
    problems = []
    count = 0
    for document in DOCUMENTS:
        for status, clause in mentions(document.read_text()):
            count += 1
            where = f"{document.relative_to(ROOT)}: exit {status} {clause.strip()!r}"
            if status in SHELL_CONVENTIONS:
                continue
            if status not in documented:
                problems.append(f"{where}: not in docs/cli.md's exit code table")
                continue
            name = documented[status][0]
            words = normalized(clause)
            own = any(word in words for word in KEYWORDS.get(name, ()))
            others = [n for n, ws in KEYWORDS.items() if n != name and any(w in words for w in ws)]
            if others and not own:
                problems.append(f"{where}: described as {', '.join(others)}, but it is {name}")
    assert not problems, "\n".join(problems)
    assert count > 30  # the scan sees the documents' exit statuses (about 50 today)


def test_the_scan_finds_a_wrong_exit_status() -> None:
    text = "Exit codes: 0 done; **69** busy, retry; **70** outcome unknown, retry.\n"
    assert mentions(text) == [(0, " done"), (69, " busy, retry"), (70, " outcome unknown, retry")]
    assert mentions("It exits 75 when busy (see `exit 3`).") == [(75, " when busy (see `exit 3`)")]


# -- environment variables -------------------------------------------------------------------------


def documented_environment() -> dict[str, tuple[str, set[str]]]:
    """docs/cli.md's environment table: option → (variable, commands)."""
    rows = table_rows(section(CLI_MD.read_text(), "Environment variables"))
    return {
        option.strip("`"): (variable.split()[0].strip("`"), set(re.findall(r"`([a-z]+)`", used)))
        for option, variable, used in rows
    }


def test_the_environment_table_is_the_code() -> None:
    documented = documented_environment()
    assert {option: variable for option, (variable, _) in documented.items()} == ENVIRONMENT
    for option, variable in ENVIRONMENT.items():
        reading = set()
        for name, command in cli.commands.items():
            for param in command.params:
                if isinstance(param, click.Option) and option in param.opts and param.envvar:
                    assert param.envvar == variable and param.show_envvar, (name, option)
                    reading.add(name)
        assert reading == documented[option][1], option


def test_help_shows_the_variables() -> None:
    result = CliRunner().invoke(cli, ["status", "--help"], terminal_width=200)
    assert result.exit_code == 0
    assert "[env var: FENCED_URL]" in result.stdout
    assert "[env var: FENCED_STORE]" in result.stdout


def status_json(*args: str, env: dict[str, str]) -> dict[str, object]:
    result = CliRunner().invoke(cli, ["status", "--json", *args], env=env)
    assert result.exit_code == 0, result.output
    document: dict[str, object] = json.loads(result.stdout)
    return document


def granted(document: dict[str, object]) -> set[str]:
    resources = document["resources"]
    assert isinstance(resources, list)
    return {entry["resource"] for entry in resources}


def test_fenced_url_picks_the_coordinator_and_url_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    urls = {"": DEFAULT_URL}
    for name in ("a", "b"):
        urls[name] = url_of_path("sqlite", str(tmp_path / f"{name}.db"))
    for name, url in urls.items():
        with connect(url) as coord:
            coord.release(coord.acquire(f"env/{name or 'default'}", ttl=30, wait=0))
    env = {"FENCED_URL": urls["a"], "FENCED_STORE": ""}
    assert granted(status_json(env=env)) == {"env/a"}
    assert granted(status_json("--url", urls["b"], env=env)) == {"env/b"}
    assert granted(status_json(env={**env, "FENCED_URL": ""})) == {"env/default"}  # empty: unset


def test_fenced_store_picks_the_stores_and_store_wins(tmp_path: Path) -> None:
    stores = [url_of_path("sqlite", str(tmp_path / f"s{n}.db")) for n in (1, 2, 3)]
    for url in stores:
        open_store(url).close()
    coordinator = url_of_path("sqlite", str(tmp_path / "fenced.db"))
    connect(coordinator).close()
    env = {"FENCED_URL": coordinator, "FENCED_STORE": f"{stores[0]} {stores[1]}"}
    assert status_json(env=env)["stores"] == stores[:2]
    assert status_json("--store", stores[2], env=env)["stores"] == stores[2:]


# -- shell completion ------------------------------------------------------------------------------


def console_script() -> str:
    """The installed ``fenced`` command next to this interpreter (what a user's shell runs)."""
    found = shutil.which("fenced", path=str(Path(sys.executable).parent))
    assert found is not None, f"no fenced console script next to {sys.executable}"
    return found


def complete(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [console_script()],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_the_completion_script_is_printed(shell: str) -> None:
    result = complete(_FENCED_COMPLETE=f"{shell}_source")
    assert result.returncode == 0, result.stderr
    assert "_fenced_completion" in result.stdout
    assert f"_FENCED_COMPLETE={shell}_complete" in result.stdout


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        ("fenced sta", {"status"}),
        ("fenced re", {"read", "rebind", "restore"}),
        ("fenced verify --case 7", {"7a", "7b"}),
        ("fenced verify --mutant epoch", {"epoch-reuse"}),
    ],
)
def test_completion_completes_commands_and_choices(words: str, expected: set[str]) -> None:
    result = complete(
        _FENCED_COMPLETE="bash_complete",
        COMP_WORDS=words,
        COMP_CWORD=str(len(words.split()) - 1),
    )
    assert result.returncode == 0, result.stderr
    assert {line.split(",", 1)[1] for line in result.stdout.splitlines()} == expected


# -- verify's choices ------------------------------------------------------------------------------


def one_line_error(result: Result) -> str:
    assert result.exit_code == BAD_INPUT, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fenced: "), result.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("option", "names"),
    [
        ("--case", [case.number for case in CASES]),
        ("--mutant", [mutant.name for mutant in CATALOGUE]),
    ],
)
def test_a_wrong_verify_name_lists_the_choices(option: str, names: list[str]) -> None:
    message = one_line_error(CliRunner().invoke(cli, ["verify", option, "nope", "--random", "1"]))
    assert "'nope'" in message
    for name in names:
        assert f"'{name}'" in message
