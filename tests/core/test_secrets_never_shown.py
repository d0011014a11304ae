"""A password in a URL is never shown: not in an error, a ``repr``, a log line, nor the output
of ``fenced status --json`` — for every scheme fenced knows and for one it does not.

Every case is a URL carrying the password ``hunter2`` (in the user-info, as ``?password=``, or
in a ``listen_url`` nested inside a PostgreSQL URL), opened with ``fenced.connect`` and
``fenced.open_store``. Most are refused (a bad parameter, a host on a local URL, an unknown
scheme, an unreachable server); the message of each refusal, its ``repr``, and every log record
emitted meanwhile must not contain the password. Where a URL with a password opens (PostgreSQL
with trust authentication, on the session's server), the ``repr`` and ``url`` of the opened
object must not either. The etcd cases need no server: each is refused while its URL is parsed,
or by a refused connection to port 1 within a short ``connect_timeout``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import pytest
from click.testing import CliRunner

import fenced
from fenced.cli._main import cli
from fenced.core._errors import FencedError
from fenced.core._urls import redacted
from fenced.testing.postgres import PostgresServer

SECRET = "hunter2"
NESTED = quote(f"postgresql://app:{SECRET}@db:5432/app", safe="")

BAD_URLS: dict[str, list[object]] = {
    "memory": [
        f"memory://bob:{SECRET}@h/x",
        f"memory://x?password={SECRET}",
    ],
    "sqlite": [
        f"sqlite://bob:{SECRET}@h/x.db",
        f"sqlite:///x.db?password={SECRET}",
        f"sqlite+pysqlite://bob:{SECRET}@h/x.db",
        f"sqlite:~/x.db?password={SECRET}",
    ],
    "file": [
        f"file://bob:{SECRET}@h/x",
        f"file:///x?password={SECRET}",
        f"file:///x#password={SECRET}",
    ],
    "postgresql": [
        f"postgresql://bob:{SECRET}@127.0.0.1:1/db?connect_timeout=1",
        f"postgresql://bob@127.0.0.1:1/db?password={SECRET}&connect_timeout=1",
        f"postgresql://bob:{SECRET}@h/db?schema=Upper",
        f"postgresql://bob:{SECRET}@h/db?no_such_libpq_option=1",
        f"postgresql://bob:{SECRET}@h/db?pool_size=0",
        f"postgresql://bob:{SECRET}@h/db#fragment",
        f"postgresql://h/db?listen_url={NESTED}&no_such_libpq_option=1",
        f"postgresql://h/db?sslpassword={SECRET}&sslmode=nonsense",
        f"postgres://bob:{SECRET}@/db?host=/nonexistent/socket/dir&connect_timeout=1",
    ],
    "postgresql+psycopg": [
        f"postgresql+psycopg://bob:{SECRET}@h/db?timeout=-1",
        f"postgresql+psycopg2://bob:{SECRET}@h/db",
    ],
    "etcd": [
        f"etcd://bob:{SECRET}@127.0.0.1:1/?no_such_parameter=1",
        f"etcd://bob:{SECRET}@127.0.0.1:notaport",
        f"etcd://bob:{SECRET}@127.0.0.1:1/path",
        f"etcd://bob:{SECRET}@127.0.0.1:1/?connect_timeout=0.2&timeout=0.5",
        f"etcd://bob@127.0.0.1:1/?password={SECRET}",
    ],
    "etcds": [
        f"etcds://bob:{SECRET}@127.0.0.1:1/?ca=/nonexistent/ca.pem",
        f"etcds://bob:{SECRET}@127.0.0.1:1/?cert=/nonexistent/cert.pem",
        f"etcds://bob:{SECRET}@127.0.0.1:1/?no_such_parameter=1",
    ],
    "unknown": [
        f"foo://bob:{SECRET}@h/x",
        f"redis://:{SECRET}@h:6379/0",
        f"mysql+pymysql://bob:{SECRET}@h/db",
        f"http://bob:{SECRET}@h:8080",
        f"foo://h/x?password={SECRET}",
        f"bob:{SECRET}@h/db",  # the scheme forgotten
        f"postgresql//bob:{SECRET}@h/db",  # the colon forgotten
        f"postgresql://bob:{SECRET}@h/db".encode(),
        Path(f"postgresql://bob:{SECRET}@h/db"),
    ],
}
CASES = [(scheme, url) for scheme, urls in BAD_URLS.items() for url in urls]
OPENERS: dict[str, Callable[[object], object]] = {
    "connect": fenced.connect,
    "open_store": fenced.open_store,
}


def _shown(error: BaseException) -> str:
    """Everything a user may see of ``error``: its message, its repr, and those of its causes."""
    parts: list[str] = []
    current: BaseException | None = error
    while current is not None and len(parts) < 20:
        parts += [str(current), repr(current)]
        current = current.__cause__ or current.__context__
    return "\n".join(parts)


@pytest.mark.parametrize("opener", sorted(OPENERS))
@pytest.mark.parametrize(
    ("scheme", "url"), CASES, ids=[f"{s}-{i}" for i, (s, _) in enumerate(CASES)]
)
def test_a_refused_url_never_shows_its_password(
    scheme: str,
    url: object,
    opener: str,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # a local URL that did open would land here
    caplog.set_level(logging.DEBUG)
    with pytest.raises(FencedError) as caught:
        opened = OPENERS[opener](url)
        close = getattr(opened, "close", None)
        if close is not None:
            close()
        pytest.fail(f"{scheme}: {redacted(url)} opened")
    shown = _shown(caught.value)
    assert SECRET not in shown, shown
    assert SECRET not in caplog.text, caplog.text


def test_what_opens_without_a_server_shows_no_password(tmp_path: Path) -> None:
    """memory, sqlite and file: their URLs name no credentials, and their reprs say where."""
    (tmp_path / "files").mkdir()
    opened = [
        fenced.connect("memory://secrets_shown"),
        fenced.connect(f"sqlite:{tmp_path}/c.db"),
        fenced.open_store(f"sqlite:{tmp_path}/s.db", mode="strict"),
        fenced.open_store(f"file:{tmp_path}/files", mode="strict"),
    ]
    for thing in opened:
        assert SECRET not in repr(thing)
        thing.close()


def test_an_opened_postgresql_coordinator_and_store_show_no_password(
    postgres_server: PostgresServer,
) -> None:
    """Trust authentication ignores the password: the URL opens, and its password, the one of
    ``?password=`` and that of a nested ``listen_url``, appear nowhere."""
    base = postgres_server.url("postgres", schema="secrets_shown")
    with_password = base.replace("postgres@", f"postgres:{SECRET}@", 1)
    for url in (with_password, f"{base}&password={SECRET}"):
        for scheme in ("postgresql", "postgresql+psycopg"):
            spelled = url.replace("postgresql", scheme, 1)
            with fenced.connect(spelled) as coord, fenced.open_store(spelled) as store:
                for shown in (coord.url, repr(coord), store.url, repr(store)):
                    assert SECRET not in shown, shown
                    assert "***" in shown, shown
    with fenced.connect(f"{with_password}&listen_url={NESTED}") as coord:  # a coordinator's
        for shown in (coord.url, repr(coord)):
            assert SECRET not in shown and "app:***@db" in shown, shown


def test_fenced_status_json_shows_no_password(postgres_server: PostgresServer) -> None:
    url = postgres_server.url("postgres", schema="secrets_status").replace(
        "postgres@", f"postgres:{SECRET}@", 1
    )
    with fenced.connect(url) as coord:
        coord.release(coord.acquire("jobs/secret", ttl=5, wait=0))
    store_url = f"{url}&password={SECRET}"
    fenced.open_store(store_url, mode="strict").close()
    result = CliRunner().invoke(
        cli, ["status", "--json", "--url", url, "--store", store_url], env={"FENCED_URL": None}
    )
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["url"].startswith("postgresql://postgres:***@127.0.0.1:")
    assert SECRET not in result.output
    refused = CliRunner().invoke(cli, ["status", "--json", "--url", f"foo://bob:{SECRET}@h/x"])
    assert refused.exit_code == 2
    assert "foo://bob:***@h/x" in refused.output and SECRET not in refused.output


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("foo://bob:hunter2@h/x", "foo://bob:***@h/x"),
        ("etcd://u:hunter2@a:1,b:2/?prefix=/x", "etcd://u:***@a:1,b:2/?prefix=/x"),
        ("postgresql://h/db?password=hunter2&x=1", "postgresql://h/db?password=***&x=1"),
        ("postgresql://h/db?sslpassword=hunter2", "postgresql://h/db?sslpassword=***"),
        ("postgresql://h/db?pass%77ord=hunter2", "postgresql://h/db?pass%77ord=***"),
        (
            f"postgresql://h/db?listen_url={NESTED}",
            "postgresql://h/db?listen_url=postgresql://app:***@db:5432/app",
        ),
        (  # a nested URL without a secret stays as written
            "postgresql://h/db?listen_url=postgresql%3A%2F%2Fapp%40db",
            "postgresql://h/db?listen_url=postgresql%3A%2F%2Fapp%40db",
        ),
        ("bob:hunter2@h/db", "bob:***@h/db"),
        ("file:///x#password=hunter2", "file:///x#password=***"),
        ("sqlite:///rel/x.db", "sqlite:///rel/x.db"),
        (b"postgresql://bob:hunter2@h", "b'postgresql://bob:***@h'"),
        (None, "None"),
    ],
)
def test_redacted(url: object, expected: str) -> None:
    assert redacted(url) == expected
