"""API keys of ``fenced serve --keys FILE`` (issue 23, item 4).

* The keys file stores salted hashes only (mode 0600, written atomically), and its model refuses
  malformed files with one line naming the file.
* :class:`KeysAuthority.check`: 401 (:class:`NotAuthenticated`) for a missing, malformed, unknown,
  wrong or revoked key, with one message for the last four; 403 (:class:`AccessDenied`) for a
  role or name outside the key's scope; ``admin`` implies every role; a route about every name
  needs the prefix ``""``; a revocation or a new key counts from the next request on; a file
  broken while serving refuses everything (503) until it is fixed.
* End to end through the real server (uvicorn in a thread): problem documents, 401/403/200, a
  revoked key refused without a restart, and the key in no response, file or log line.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import threading
import uuid
from pathlib import Path

import httpx
import pytest

import fenced
from fenced.core._errors import (
    AccessDenied,
    ConfigurationError,
    NotAuthenticated,
    NotFound,
    Unavailable,
)
from fenced.server._keys import (
    ApiKey,
    KeysAuthority,
    NewKey,
    RoleName,
    add_key,
    open_keys,
    read_keys,
    revoke_key,
)
from fenced.testing.server import ServedCoordinator

PROBLEM = "urn:fenced:problem:"


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "keys.json"


def bearer(made: NewKey) -> str:
    return f"Bearer {made.key}"


def other_secret(key: str) -> str:
    """``key`` with another secret of the same shape (same id)."""
    last = "A" if key[-1] != "A" else "B"
    return key[:-1] + last


# -- the file ---------------------------------------------------------------------------------


def test_the_file_keeps_a_salted_hash_never_the_key(path: Path) -> None:
    made = add_key(path, "ci", ["read", "hold"], ["jobs/"], clock=lambda: 1_750_000_000.0)
    assert made.key.startswith(f"fk_{made.entry.id}_") and len(made.key) == 3 + 12 + 1 + 43
    text = path.read_text()
    assert made.key not in text and made.key[16:] not in text  # fk_ID_SECRET: 16 = len("fk_ID_")
    document = json.loads(text)
    assert document["format"] == "fenced-keys" and document["version"] == 1
    [stored] = document["keys"]
    assert stored == {
        "id": made.entry.id,
        "name": "ci",
        "roles": ["hold", "read"],
        "prefixes": ["jobs/"],
        "created": "2025-06-15T15:06:40Z",
        "revoked": None,
        "salt": made.entry.salt.hex(),
        "sha256": made.entry.sha256.hex(),
    }
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_keys(path) == (made.entry,)


def test_two_keys_get_different_ids_salts_and_hashes(path: Path) -> None:
    first = add_key(path, "a", ["read"], [""])
    second = add_key(path, "b", ["read"], [""])
    assert first.key != second.key
    assert first.entry.id != second.entry.id
    assert first.entry.salt != second.entry.salt
    assert [entry.name for entry in read_keys(path)] == ["a", "b"]


def test_writes_are_atomic_and_keep_mode_0600_whatever_the_umask(path: Path) -> None:
    old = os.umask(0o000)
    try:
        add_key(path, "a", ["read"], [""])
        before = path.stat().st_ino
        add_key(path, "b", ["read"], [""])
    finally:
        os.umask(old)
    assert path.stat().st_ino != before  # replaced, never rewritten in place
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["keys.json"]  # no temp, no lock file


@pytest.mark.parametrize(
    ("name", "roles", "prefixes", "says"),
    [
        ("", ["read"], [""], "not allowed"),
        ("has space", ["read"], [""], "not allowed"),
        ("0123456789ab", ["read"], [""], "looks like a key id"),
        ("ci", [], [""], "at least one role"),
        ("ci", ["root"], [""], "unknown role 'root'"),
        ("ci", ["read"], [], "at least one name prefix"),
        ("ci", ["read"], ["jobs/*"], "cannot start a name"),
    ],
)
def test_bad_input_to_add_changes_nothing(
    path: Path, name: str, roles: list[str], prefixes: list[str], says: str
) -> None:
    with pytest.raises(ConfigurationError, match=says):
        add_key(path, name, roles, prefixes)
    assert not path.exists()


def test_a_name_is_unique_among_valid_keys(path: Path) -> None:
    add_key(path, "ci", ["read"], [""])
    before = path.read_bytes()
    with pytest.raises(ConfigurationError, match="already has a valid key named 'ci'"):
        add_key(path, "ci", ["hold"], [""])
    assert path.read_bytes() == before
    revoke_key(path, "ci")
    add_key(path, "ci", ["hold"], [""])  # a revoked key's name may be given again
    assert [(e.name, e.revoked is None) for e in read_keys(path)] == [("ci", False), ("ci", True)]


def test_concurrent_adds_lose_nothing(path: Path) -> None:
    names = [f"k{i}" for i in range(8)]
    threads = [threading.Thread(target=add_key, args=(path, n, ["read"], [""])) for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(entry.name for entry in read_keys(path)) == names


def test_revoke_by_id_or_name_is_idempotent_and_keeps_the_entry(path: Path) -> None:
    a = add_key(path, "a", ["read"], [""])
    add_key(path, "b", ["read"], [""])
    entry, changed = revoke_key(path, a.entry.id, clock=lambda: 1_800_000_000.0)
    assert changed and entry.id == a.entry.id and entry.revoked == "2027-01-15T08:00:00Z"
    before = path.read_bytes()
    assert revoke_key(path, a.entry.id) == (entry, False)
    assert revoke_key(path, "a") == (entry, False)
    assert path.read_bytes() == before
    entry_b, changed_b = revoke_key(path, "b")
    assert changed_b and entry_b.name == "b"
    with pytest.raises(NotFound, match="no key with id or name 'c'"):
        revoke_key(path, "c")
    assert len(read_keys(path)) == 2


def _write_document(path: Path, document: object) -> None:
    path.write_text(json.dumps(document))


def _valid_entry(path: Path) -> dict[str, object]:
    add_key(path, "ci", ["read"], [""])
    entry: dict[str, object] = json.loads(path.read_text())["keys"][0]
    return entry


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda e: "{not json", "not valid JSON"),
        (lambda e: [], "not a 'fenced-keys' document"),
        (lambda e: {"format": "fenced-keys", "version": 2, "keys": []}, "version 2"),
        (lambda e: {"format": "fenced-keys", "version": 1, "keys": {}}, "'keys' must be a list"),
        (lambda e: {"format": "fenced-keys", "version": 1, "keys": [1]}, r"keys\[0\] must be"),
        (lambda e: _keys({**e, "roles": ["root"]}), "unknown role 'root'"),
        (lambda e: _keys({**e, "roles": "read"}), r"keys\[0\]\.roles must be a list"),
        (lambda e: _keys({**e, "sha256": "00"}), "64 lowercase hex digits"),
        (lambda e: _keys({**e, "salt": None}), r"keys\[0\]\.salt must be a str"),
        (lambda e: _keys({k: v for k, v in e.items() if k != "id"}), r"keys\[0\]\.id"),
        (lambda e: _keys({**e, "created": "yesterday"}), "ISO 8601"),
        (lambda e: _keys(e, {**e, "name": "other"}), "appears twice"),
        (lambda e: _keys(e, {**e, "id": "0" * 12}), "two valid keys are named 'ci'"),
    ],
)
def test_a_malformed_file_is_one_line_naming_it(path: Path, change: object, says: str) -> None:
    entry = _valid_entry(path)
    assert callable(change)
    document = change(entry)
    if isinstance(document, str):
        path.write_text(document)
    else:
        _write_document(path, document)
    for read in (read_keys, open_keys):
        with pytest.raises(ConfigurationError, match=says) as caught:
            read(path)
        assert str(path) in str(caught.value) and "\n" not in str(caught.value)
        assert not isinstance(caught.value, AccessDenied)


def _keys(*entries: dict[str, object]) -> dict[str, object]:
    return {"format": "fenced-keys", "version": 1, "keys": list(entries)}


def test_a_missing_file_is_one_line_naming_it(path: Path) -> None:
    for call in (read_keys, open_keys, lambda p: revoke_key(p, "ci")):
        with pytest.raises(ConfigurationError, match="no keys file at") as caught:
            call(path)
        assert str(path) in str(caught.value)
    assert not path.exists()


# -- check ------------------------------------------------------------------------------------


def test_a_missing_malformed_unknown_wrong_or_revoked_key_is_not_authenticated(
    path: Path,
) -> None:
    made = add_key(path, "ci", ["admin"], [""])
    doomed = add_key(path, "old", ["admin"], [""])
    revoke_key(path, "old")
    authority = open_keys(path)
    unknown = "fk_" + "0" * 12 + made.key[15:]
    refusals = {
        None: "an API key is needed",
        "": "an API key is needed",
        made.key: "does not carry a fenced API key",  # no scheme
        f"Basic {made.key}": "does not carry a fenced API key",
        "Bearer fk_x": "does not carry a fenced API key",
        f"Bearer {made.key}x": "does not carry a fenced API key",
        f"Bearer {unknown}": "not valid (unknown, wrong or revoked)",
        f"Bearer {other_secret(made.key)}": "not valid (unknown, wrong or revoked)",
        bearer(doomed): "not valid (unknown, wrong or revoked)",
    }
    for header, says in refusals.items():
        with pytest.raises(NotAuthenticated, match=re.escape(says)) as caught:
            authority.check(header, "read", "jobs/a")
        assert made.key[16:] not in str(caught.value) and doomed.key[16:] not in str(caught.value)
    authority.check(bearer(made), "read", "jobs/a")
    authority.check(f"bearer  {made.key} ", "read", "jobs/a")  # scheme case, spaces


def test_roles_prefixes_and_admin(path: Path) -> None:
    holder = add_key(path, "holder", ["hold", "read"], ["jobs/", "ci/"])
    admin = add_key(path, "admin", ["admin"], ["jobs/"])
    everywhere = add_key(path, "reader", ["read"], [""])
    authority = open_keys(path)

    authority.check(bearer(holder), "hold", "jobs/nightly")
    authority.check(bearer(holder), "read", "ci/x")
    for role in ("hold", "write", "read", "admin"):
        authority.check(bearer(admin), role, "jobs/nightly")
    authority.check(bearer(everywhere), "read", "anything/at/all")
    authority.check(bearer(everywhere), "read", None)

    denied: list[tuple[NewKey, RoleName, str | None, str]] = [
        (holder, "write", "jobs/nightly", "does not have the role 'write'"),
        (holder, "admin", "jobs/nightly", "does not have the role 'admin'"),
        (holder, "hold", "job", "may not act on 'job'"),
        (holder, "hold", "other/jobs/x", "may not act on 'other/jobs/x'"),
        (holder, "read", None, "this request concerns every name"),
        (admin, "read", "ci/x", "limited to names starting with 'jobs/'"),
        (admin, "admin", None, "this request concerns every name"),
        (everywhere, "hold", "x", "does not have the role 'hold'"),
    ]
    for made, role, name, says in denied:
        with pytest.raises(AccessDenied, match=says) as caught:
            authority.check(bearer(made), role, name)
        assert type(caught.value) is AccessDenied  # 403, not 401
        assert made.entry.id in str(caught.value) and made.key[16:] not in str(caught.value)

    assert isinstance(authority, KeysAuthority)
    assert authority.scope(bearer(holder), "read") == ("ci/", "jobs/")
    with pytest.raises(AccessDenied):
        authority.scope(bearer(everywhere), "hold")


def test_a_prefix_is_a_plain_string_prefix(path: Path) -> None:
    made = add_key(path, "ci", ["read"], ["jobs"])
    authority = open_keys(path)
    for name in ("jobs", "jobs/a", "jobs-old"):
        authority.check(bearer(made), "read", name)


def test_changes_count_from_the_next_request_without_a_restart(path: Path) -> None:
    made = add_key(path, "ci", ["hold"], ["jobs/"])
    authority = open_keys(path)
    authority.check(bearer(made), "hold", "jobs/a")
    later = add_key(path, "later", ["read"], [""])
    authority.check(bearer(later), "read", None)
    revoke_key(path, "ci")
    with pytest.raises(NotAuthenticated):
        authority.check(bearer(made), "hold", "jobs/a")
    authority.check(bearer(later), "read", "jobs/a")


def test_a_file_broken_while_serving_refuses_everything_until_fixed(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    made = add_key(path, "ci", ["read"], [""])
    authority = open_keys(path)
    good = path.read_bytes()
    path.write_text("{broken")
    with caplog.at_level(logging.WARNING, logger="fenced.server.keys"):
        for _ in range(3):
            with pytest.raises(Unavailable, match="cannot read its API keys file"):
                authority.check(bearer(made), "read", "x")
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.startswith(f"refusing every request: keys file {path} is not valid JSON")
    # ^ once per change of the file, not once per request
    path.unlink()
    with pytest.raises(Unavailable):
        authority.check(bearer(made), "read", "x")
    path.write_bytes(good)
    authority.check(bearer(made), "read", "x")


def test_the_entry_model_shows_no_secret(path: Path) -> None:
    made = add_key(path, "ci", ["read"], [""])
    public = made.entry.public()
    assert set(public) == {"id", "name", "roles", "prefixes", "created", "revoked"}
    assert isinstance(made.entry, ApiKey)


# -- end to end -------------------------------------------------------------------------------


def _problem(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    document = response.json()
    assert document["type"] == PROBLEM + kind and document["status"] == status
    if status == 401:  # RFC 9110: a 401 names the scheme it wants
        assert response.headers["www-authenticate"] == 'Bearer realm="fenced"'
    detail: str = document["detail"]
    return detail


def test_through_the_real_server(path: Path, caplog: pytest.LogCaptureFixture) -> None:
    holder = add_key(path, "holder", ["hold"], ["jobs/"])
    reader = add_key(path, "reader", ["read"], ["jobs/"])
    watcher = add_key(path, "watcher", ["read"], [""])
    ops = add_key(path, "ops", ["hold"], [""])
    keys = [holder.key, reader.key, watcher.key, ops.key]
    seen: list[str] = []

    def as_(made: NewKey | None) -> dict[str, str]:
        return {} if made is None else {"Authorization": bearer(made)}

    def call(method: str, route: str, made: NewKey | None, **extra: object) -> httpx.Response:
        response = client.request(method, route, headers=as_(made), **extra)  # type: ignore[arg-type]
        seen.append(response.text + str(response.headers))
        return response

    acquire = {"ttl": 30, "wait": 0, "holder": "e2e"}
    with (
        caplog.at_level(logging.DEBUG),
        ServedCoordinator(f"memory://{uuid.uuid4().hex}", keys=path) as served,
        httpx.Client(base_url=served.url, timeout=10) as client,
    ):
        # 401: no key, a key of another server, a wrong secret
        _problem(call("POST", "/v1/leases/jobs/a:acquire", None, json=acquire), 401,
                 "not-authenticated")  # fmt: skip
        stranger = "fk_" + "0" * 12 + holder.key[15:]
        response = client.post(
            "/v1/leases/jobs/a:acquire",
            json=acquire,
            headers={"Authorization": f"Bearer {stranger}"},
        )
        _problem(response, 401, "not-authenticated")
        response = client.post(
            "/v1/leases/jobs/a:acquire",
            json=acquire,
            headers={"Authorization": f"Bearer {other_secret(holder.key)}"},
        )
        _problem(response, 401, "not-authenticated")

        # 403: the wrong role, a name outside the prefixes
        detail = _problem(call("POST", "/v1/leases/jobs/a:acquire", reader, json=acquire), 403,
                          "access-denied")  # fmt: skip
        assert "does not have the role 'hold'" in detail
        detail = _problem(call("POST", "/v1/leases/other/a:acquire", holder, json=acquire), 403,
                          "access-denied")  # fmt: skip
        assert "may not act on 'other/a'" in detail

        # 200 with the right key, and nothing was granted by the refused requests
        granted = call("POST", "/v1/leases/jobs/a:acquire", holder, json=acquire)
        assert granted.status_code == 200, granted.text
        assert granted.json()["epoch"] == 1
        current = call("GET", "/v1/leases/jobs/a", reader)
        assert current.status_code == 200 and current.json()["lease"]["epoch"] == 1
        assert call("GET", "/v1/leases/other/a", watcher).json()["lease"] is None
        assert call("POST", "/v1/leases/other/b:acquire", ops, json=acquire).status_code == 200

        # routes about every name: a key limited to prefixes sees the names under them only
        listed = call("GET", "/v1/leases", watcher)
        assert listed.status_code == 200 and listed.json()["resources"] == ["jobs/a", "other/b"]
        assert call("GET", "/v1/leases", reader).json()["resources"] == ["jobs/a"]
        mine = call("GET", "/v1/records", reader, params={"limit": 1}).json()["records"]
        assert [record["resource"] for record in mine] == ["jobs/a"]
        after = {"limit": 1, "after": mine[0]["seq"]}  # the next full page is other/b's only
        assert call("GET", "/v1/records", reader, params=after).json()["records"] == []
        everyone = call("GET", "/v1/records", watcher).json()["records"]
        assert [record["resource"] for record in everyone] == ["jobs/a", "other/b"]
        _problem(call("GET", "/v1/leases", holder), 403, "access-denied")  # no role read

        # revoked: refused from the next request on, the same server still running
        revoke_key(path, "reader")
        _problem(call("GET", "/v1/leases/jobs/a", reader), 401, "not-authenticated")
        assert call("GET", "/v1/leases/jobs/a", watcher).status_code == 200

    everything = "\n".join(
        [*seen, path.read_text(), *(record.getMessage() for record in caplog.records)]
    )
    for key in keys:
        assert key not in everything and key[16:] not in everything


def test_the_python_client_sends_fenced_api_key(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fenced.connect("http://…")`` sends ``$FENCED_API_KEY`` as its bearer token; without
    it the server's 401 is :class:`NotAuthenticated`, and a key outside its scope is refused
    with :class:`AccessDenied` before anything happens."""
    holder = add_key(path, "holder", ["hold", "read"], ["jobs/"])
    with ServedCoordinator(f"memory://{uuid.uuid4().hex}", keys=path) as served:
        monkeypatch.delenv("FENCED_API_KEY", raising=False)
        with pytest.raises(NotAuthenticated):
            fenced.connect(served.url)
        monkeypatch.setenv("FENCED_API_KEY", holder.key)
        with fenced.connect(served.url) as coordinator:
            lease = coordinator.acquire("jobs/a", ttl=5, wait=0)
            with pytest.raises(AccessDenied):
                coordinator.acquire("other/a", ttl=5, wait=0)
            with pytest.raises(AccessDenied):
                coordinator.current("other/a")
            assert coordinator.release(lease)
