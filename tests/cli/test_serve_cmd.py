"""``fenced serve``: bad options are one line and exit 2 before anything listens."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from fenced.cli._main import cli


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--listen", "0.0.0.0:0"], "listens on 0.0.0.0 only with API keys"),
        (["--listen", "nowhere"], "--listen wants HOST:PORT"),
        (["--store", "x"], "--store wants NAME=URL"),
        (["--store", "a b=sqlite:x.db"], "--store NAME must be"),
        (["--store", "a=sqlite:x.db", "--store", "a=sqlite:y.db"], "--store a= is given twice"),
        (["--url", "redis://h"], "unknown coordinator URL scheme"),
        (["--tls-cert", "cert.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert"),
        (["--keys", "missing.json"], "missing.json"),
        (["--poll", "0"], "--poll"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(
    args: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["serve", "--url", "memory://serve-cmd", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fenced: ") and message in lines[0], lines
    assert not list(tmp_path.iterdir())  # nothing created
