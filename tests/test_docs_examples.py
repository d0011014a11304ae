"""Every ```python block in the README and docs/ runs, as a user would run it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.cli_processes import run_python

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _examples() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for number, match in enumerate(BLOCK.finditer(doc.read_text()), 1):
            found.append((f"{doc.relative_to(ROOT)}#{number}", match.group(1)))
    return found


EXAMPLES = _examples()


def test_the_readme_has_a_runnable_example() -> None:
    assert any(name.startswith("README.md") for name, _ in EXAMPLES)


@pytest.mark.parametrize(("name", "code"), EXAMPLES, ids=[name for name, _ in EXAMPLES])
def test_example_runs(name: str, code: str, tmp_path: Path) -> None:
    result = run_python(code, tmp_path)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout}\n{result.stderr}"


def test_the_choosing_guide_shows_its_advice_in_code_that_runs() -> None:
    """docs/choosing.md's advice is made practical by examples, each run by the test above."""
    code = "\n".join(code for name, code in EXAMPLES if name.startswith("docs/choosing.md#"))
    for advice in (
        "PRIMARY KEY",
        "fenced.guard(",
        "if_version=",
        "monotonic",
        "op_id=",
        "verify.run(",
    ):
        assert advice in code, advice
