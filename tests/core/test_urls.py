"""The one URL parser (:mod:`fenced.core._urls`): every accepted spelling, what it means, and a
one-line error naming the accepted spellings for everything else. Pure: no file is touched.

``sqlite:`` follows SQLAlchemy (three slashes relative, four absolute), ``file:`` RFC 8089,
``postgresql+psycopg`` is SQLAlchemy's driver suffix for the driver fenced uses.
"""

from __future__ import annotations

import pytest

from fenced.core._errors import ConfigurationError
from fenced.core._urls import LocalURL, parse_local, path_from_url, scheme_of, url_of_path


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        # sqlite: SQLAlchemy's rule
        ("sqlite:///rel/path.db", LocalURL("sqlite", "rel/path.db", "/rel/path.db")),
        ("sqlite:///app.db", LocalURL("sqlite", "app.db", "/app.db")),
        ("sqlite:////abs/path.db", LocalURL("sqlite", "/abs/path.db")),
        ("sqlite://///abs/path.db", LocalURL("sqlite", "/abs/path.db")),
        ("sqlite:rel/path.db", LocalURL("sqlite", "rel/path.db")),
        ("sqlite:.fenced/fenced.db", LocalURL("sqlite", ".fenced/fenced.db")),
        ("sqlite:/abs/path.db", LocalURL("sqlite", "/abs/path.db")),  # kept: absolute
        ("SQLite:////abs/x.db", LocalURL("sqlite", "/abs/x.db")),
        ("sqlite:////a%20b/c%23d.db", LocalURL("sqlite", "/a b/c#d.db")),
        ("sqlite:///a%20b.db", LocalURL("sqlite", "a b.db", "/a b.db")),
        ("sqlite:///%2Fabs.db", LocalURL("sqlite", "/abs.db")),  # absolute: nothing to guard
        # file: RFC 8089
        ("file:///abs/dir", LocalURL("file", "/abs/dir")),
        ("file://localhost/abs/dir", LocalURL("file", "/abs/dir")),
        ("file:/abs/dir", LocalURL("file", "/abs/dir")),
        ("file:////abs/dir", LocalURL("file", "/abs/dir")),
        ("file:rel/dir", LocalURL("file", "rel/dir")),
    ],
)
def test_local_spellings(url: str, expected: LocalURL) -> None:
    assert parse_local(url) == expected
    assert path_from_url(url, expected.scheme) == expected.path


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sqlite://", "names no database file"),
        ("sqlite:///", "names no database file"),
        ("sqlite:", "names no database file"),
        ("sqlite:///:memory:", "no in-memory SQLite database"),
        ("sqlite://host/x.db", "names host 'host'"),
        ("sqlite://localhost/x.db", "names host 'localhost'"),  # SQLAlchemy has no host either
        ("sqlite:///x.db?mode=ro", "no query string"),
        ("sqlite:////x.db#frag", "no query string or fragment"),
        ("sqlite:///~/x.db", "'~' is not expanded"),
        ("sqlite:~/x.db", "'~' is not expanded"),
        ("sqlite:///a%00b", "NUL"),
        ("file://host/dir", "names host 'host'"),
        ("file:", "names no directory"),
        ("file:///", "names no directory"),
        ("file:///d?x=1", "no query string"),
        ("file:~/d", "'~' is not expanded"),
    ],
)
def test_bad_local_urls_name_the_accepted_spellings(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as caught:
        parse_local(url)
    text = str(caught.value)
    assert "\n" not in text
    if url.lower().startswith("sqlite"):
        assert "sqlite:////absolute/path.db" in text or "sqlite:////home" in text
    else:
        assert "file:///absolute/dir" in text or "file:///home" in text


def test_the_scheme_must_be_the_expected_one() -> None:
    with pytest.raises(ConfigurationError, match="expected a sqlite: URL"):
        parse_local("file:///d", "sqlite")
    with pytest.raises(ConfigurationError, match="expected a sqlite: or file: URL"):
        parse_local("postgresql://h/db")


@pytest.mark.parametrize(
    ("url", "scheme"),
    [
        ("postgresql://u@h/db", "postgresql"),
        ("postgresql+psycopg://u@h/db", "postgresql"),
        ("POSTGRESQL+PSYCOPG://u@h/db", "postgresql"),
        ("postgres://u@h/db", "postgres"),
        ("postgres+psycopg://u@h/db", "postgres"),
        ("etcd://h:2379", "etcd"),
        ("memory://x", "memory"),
        ("sqlite:x.db", "sqlite"),
    ],
)
def test_scheme_of_drops_the_accepted_driver_suffix(url: str, scheme: str) -> None:
    assert scheme_of(url) == scheme


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgresql+psycopg2://h/db", "psycopg 3; write postgresql\\+psycopg:// or postgresql://"),
        ("postgres+asyncpg://h/db", "psycopg 3; write postgres\\+psycopg:// or postgres://"),
        ("sqlite+pysqlite:///x.db", "sqlite: URLs take no driver suffix"),
        ("etcd+grpc://h:2379", "etcd: URLs take no driver suffix"),
        ("no-scheme", "not a URL"),
        (":x", "not a URL"),
    ],
)
def test_other_driver_suffixes_and_schemeless_text_are_refused(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        scheme_of(url)


@pytest.mark.parametrize("path", ["/abs/x.db", "/a b/c#d?e.db", "/ü/x", "//double/x"])
def test_url_of_path_round_trips(path: str) -> None:
    for scheme in ("sqlite", "file"):
        url = url_of_path(scheme, path)
        assert parse_local(url) == LocalURL(scheme, "/" + path.lstrip("/"))
    assert url_of_path("sqlite", "/abs/x.db") == "sqlite:////abs/x.db"
    assert url_of_path("file", "/abs/d") == "file:///abs/d"


def test_url_of_path_needs_an_absolute_path() -> None:
    with pytest.raises(ConfigurationError, match="absolute"):
        url_of_path("sqlite", "rel.db")
