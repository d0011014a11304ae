"""Stores through ``fenced serve``: the store conformance suites on an ``http://`` store (the
client in this process, the real application on uvicorn in a thread, over a ``sqlite:`` store),
and what only the HTTP face does: streamed publish, ETags and conditional requests, malformed
headers, a lost reply.

Each test gets a fresh server (function scope). The server's store is created in the mode of the
test's first ``make_store`` call before the server starts, since a store's mode is chosen when it
is created and the server opens it with the mode it has.
"""

from __future__ import annotations

import asyncio
import io
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, cast

import httpx
import pytest

import fenced.aio
from fenced.coordinator.backends.memory._backend import MemoryBackend
from fenced.core._clock import ManualClock
from fenced.core._errors import (
    ConfigurationError,
    NotFound,
    OutcomeUnknown,
    StaleToken,
    Unavailable,
)
from fenced.fence import Store, open_store
from fenced.fence._values import Mode
from fenced.testing.proxy import TcpProxy
from fenced.testing.server import ServedCoordinator
from fenced.testing.store_conformance import (
    FencingConformance,
    KeysConformance,
    MakeStore,
    OpIdConformance,
    PublicationConformance,
    R,
    RecordsConformance,
    sqlite_snapshot,
    token,
)

PROBLEM = "application/problem+json"


class _Served:
    """One test's server, started at the first ``make_store`` with that call's mode."""

    def __init__(self, tmp_path: Path) -> None:
        self.store_url = f"sqlite:///{tmp_path}/s.db"
        self.memory = uuid.uuid4().hex
        self.server: ServedCoordinator | None = None
        self.opened: list[Store] = []

    def url(self, mode: Mode | None = None) -> str:
        if self.server is None:
            if mode is not None:
                open_store(self.store_url, mode).close()
            self.server = ServedCoordinator(
                f"memory://{self.memory}", stores={"main": self.store_url}
            ).start()
        return self.server.url + "/stores/main"

    def make(self, mode: Mode | None = None, **options: Any) -> Store:
        url = self.url(mode)
        self.opened.append(open_store(url, mode, **options))
        return self.opened[-1]

    def snapshot(self, _: Store) -> object:
        """The server's ``sqlite:`` store's rows (its records left out)."""
        return sqlite_snapshot(cast(Store, _Located(self.store_url)))

    def close(self) -> None:
        for store in self.opened:
            store.close()
        if self.server is not None:
            self.server.stop()
        MemoryBackend.forget(self.memory)


class _Located:
    def __init__(self, url: str) -> None:
        self.url = url


@pytest.fixture
def served(tmp_path: Path) -> Iterator[_Served]:
    serving = _Served(tmp_path)
    yield serving
    serving.close()


class TestHttpStore(
    FencingConformance,
    KeysConformance,
    PublicationConformance,
    OpIdConformance,
    RecordsConformance,
):
    """Every conformance class but LocalFilesConformance: an ``http:`` store's client has no
    local files (the capability is not declared, so the class does not apply)."""

    @pytest.fixture
    def make_store(self, served: _Served) -> MakeStore:
        return served.make

    @pytest.fixture
    def snapshot(self, served: _Served) -> Callable[[Store], object]:
        return served.snapshot

    # Three tests pass a ManualClock or a retention to open_store: those are the server's own
    # settings (fenced serve --store NAME=URL). Over HTTP they are refused loudly instead, which
    # these replacements check; the behaviour they test is the server's store's, tested in-process.

    def test_gc_keeps_current_and_newest_and_waits_for_the_grace_period(
        self, make_store: MakeStore
    ) -> None:
        with pytest.raises(ConfigurationError, match="server's clock"):
            make_store("monotonic", clock=ManualClock())
        with pytest.raises(ConfigurationError, match="gc_grace"):
            make_store("monotonic", gc_grace=60)

    def test_records_expire_after_the_retention(self, make_store: MakeStore) -> None:
        with pytest.raises(ConfigurationError, match="op_retention"):
            make_store("monotonic", op_retention=60)

    def test_retention_by_count_and_by_age(self, make_store: MakeStore) -> None:
        with pytest.raises(ConfigurationError, match="record_limit"):
            make_store("strict", record_limit=10)
        with pytest.raises(ConfigurationError, match="record_retention"):
            make_store("strict", record_retention=100)


# -- what only the HTTP face does --------------------------------------------------------------


def _api(served: _Served) -> str:
    assert served.server is not None
    return served.server.url + "/v1/stores/main"


def test_an_unknown_store_is_a_404_problem_and_a_configuration_error(served: _Served) -> None:
    url = served.url()
    with pytest.raises(ConfigurationError, match="no store named 'other'"):
        open_store(url.replace("/stores/main", "/stores/other"))
    reply = httpx.get(_api(served).replace("/main", "/other") + "/items/r:k")
    assert reply.status_code == 404
    assert reply.headers["content-type"] == PROBLEM
    assert reply.json()["type"] == "urn:fenced:problem:not-found"
    assert "missing" not in reply.json()
    listing = httpx.get(served.server.url + "/v1/stores" if served.server else "").json()
    assert listing == {"stores": [{"name": "main", "mode": "strict", "capabilities": listing[
        "stores"][0]["capabilities"]}]}  # fmt: skip
    assert "sqlite" not in str(listing)  # the store's URL stays on the server


def test_malformed_or_foreign_token_headers_are_400_and_change_nothing(served: _Served) -> None:
    store = served.make("strict")
    store.fence(token(1))
    before = served.snapshot(store)
    api = _api(served)
    bad_headers: list[dict[str, str]] = [
        {},
        {"Fenced-Token": "garbage"},
        {"Fenced-Token": str(token(1))[:-3]},
        {"Fenced-Token": str(token(1, "other"))},  # a token for another resource
        {"Fenced-Token": "x" * 5000},
    ]
    attempts = [
        *[(method, path, headers) for headers in bad_headers for method, path in (
            ("PUT", f"/items/{R}:k"), ("PUT", f"/publications/{R}"),
            ("POST", f"/resources/{R}:fence"))],
        ("PUT", f"/items/{R}:k", {"Fenced-Token": str(token(1)), "If-Match": "not-a-version"}),
        ("PUT", f"/items/{R}:k", {"Fenced-Token": str(token(1)), "If-None-Match": '"3"'}),
        *[(method, path, {"Fenced-Token": str(token(1)), "Idempotency-Key": '"unterminated'})
          for method, path in (("PUT", f"/items/{R}:k"), ("PUT", f"/publications/{R}"))],
    ]  # fmt: skip
    for method, path, headers in attempts:
        reply = httpx.request(method, api + path, headers=headers, content=b"data")
        assert 400 <= reply.status_code < 500, (method, path, headers, reply.text)
        assert reply.headers["content-type"] == PROBLEM
        assert reply.json()["status"] == reply.status_code
    for path in (f"/items/{R}:../k", f"/items/{R}:a:b", f"/publications/{R}:a//b"):
        reply = httpx.put(api + path, headers={"Fenced-Token": str(token(1))}, content=b"x")
        assert reply.status_code == 400 and reply.json()["type"].endswith("invalid-name")
    assert served.snapshot(store) == before
    assert store.get(R, "k") is None and store.latest(R) is None


def test_items_carry_etags_and_answer_conditional_requests(served: _Served) -> None:
    store = served.make("monotonic")
    api = _api(served)
    headers = {"Fenced-Token": str(token(3)), "If-None-Match": "*"}
    created = httpx.put(api + f"/items/{R}:conf/main", headers=headers, content=b"one")
    assert created.status_code == 200 and created.headers["etag"] == '"1"'
    assert created.json() == {"resource": R, "key": "conf/main", "epoch": 3, "version": 1}
    again = httpx.put(api + f"/items/{R}:conf/main", headers=headers, content=b"two")
    assert again.status_code == 412 and again.json()["type"].endswith("version-conflict")
    headers = {"Fenced-Token": str(token(3)), "If-Match": '"1"'}
    assert httpx.put(api + f"/items/{R}:conf/main", headers=headers, content=b"two").is_success
    got = httpx.get(api + f"/items/{R}:conf/main")
    assert (got.content, got.headers["etag"], got.headers["fenced-epoch"]) == (b"two", '"2"', "3")
    cached = httpx.get(api + f"/items/{R}:conf/main", headers={"If-None-Match": '"2"'})
    assert cached.status_code == 304 and cached.content == b""
    stale = httpx.get(api + f"/items/{R}:conf/main", headers={"If-None-Match": '"1"'})
    assert stale.status_code == 200 and stale.content == b"two"
    missing = httpx.get(api + f"/items/{R}:nope")
    assert missing.status_code == 404 and missing.json()["missing"] == "item"
    item = store.get(R, "conf/main")
    assert item is not None and (item.value, item.version, item.epoch) == (b"two", 2, 3)


def test_publications_carry_etags_digests_and_answer_conditional_requests(
    served: _Served,
) -> None:
    store = served.make("monotonic")
    published = store.publish(token(2), b"export", name="daily/csv")
    api = _api(served)
    got = httpx.get(api + f"/publications/{R}:daily/csv")
    assert got.content == b"export"
    assert got.headers["etag"] == f'"{published.object_id}"'
    assert got.headers["content-length"] == "6"
    assert got.headers["repr-digest"].startswith("sha-256=:")
    head = httpx.head(api + f"/publications/{R}:daily/csv")
    assert head.status_code == 200 and head.headers["etag"] == got.headers["etag"]
    cached = httpx.get(
        api + f"/publications/{R}:daily/csv", headers={"If-None-Match": got.headers["etag"]}
    )
    assert cached.status_code == 304 and cached.content == b""
    newer = store.publish(token(3), b"export 2", name="daily/csv")
    fresh = httpx.get(
        api + f"/publications/{R}:daily/csv", headers={"If-None-Match": got.headers["etag"]}
    )
    assert fresh.status_code == 200 and fresh.content == b"export 2"
    assert fresh.headers["etag"] == f'"{newer.object_id}"'
    pointer = httpx.get(api + f"/pointers/{R}:daily/csv").json()
    assert pointer["object_id"] == newer.object_id and pointer["epoch"] == 3
    assert httpx.get(api + f"/publications/{R}").json()["missing"] == "publication"


def test_a_stale_publish_is_refused_with_its_problem_and_changes_nothing(
    served: _Served,
) -> None:
    store = served.make("strict")
    store.fence(token(5))
    store.publish(token(5), b"by 5")
    before = served.snapshot(store)
    with pytest.raises(StaleToken) as caught:
        store.publish(token(4), io.BytesIO(bytes(3 * 1024 * 1024)))
    assert (caught.value.presented, caught.value.floor) == (4, 5)
    assert served.snapshot(store) == before
    assert store.read(R) == b"by 5"


class _Zeros(io.RawIOBase):
    """``size`` zero bytes as a stream; calls ``sample`` at every read."""

    def __init__(self, size: int, sample: Callable[[], None]) -> None:
        super().__init__()
        self._left = size
        self._sample = sample

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._sample()
        target = memoryview(buffer).cast("B")
        size = min(len(target), self._left)
        target[:size] = bytes(size)
        self._left -= size
        return size


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_a_64_mib_publish_is_streamed_not_buffered(tmp_path: Path) -> None:
    """Client and server run in this process: the resident memory, sampled as the data is
    read, grows far less than the 64 MiB sent (neither side holds the body whole)."""
    name = uuid.uuid4().hex
    size = 64 * 1024 * 1024
    stores = {"files": f"file://{tmp_path}/files"}
    with (
        ServedCoordinator(f"memory://{name}", stores=stores) as s,
        open_store(s.url + "/stores/files") as store,
    ):
        store.fence(token(1))
        store.publish(token(1), b"warm up")
        baseline = _rss()
        peak = [baseline]
        stream = _Zeros(size, lambda: peak.append(_rss()))
        published = store.publish(token(1), cast(IO[bytes], stream))
        assert published.size == size
        assert max(peak) - baseline < 32 * 1024 * 1024, (max(peak) - baseline) / 2**20
        with store.open(R) as reading:
            total = 0
            while chunk := reading.read(4 * 1024 * 1024):
                total += len(chunk)
        assert total == size
    MemoryBackend.forget(name)


def test_a_lost_reply_is_outcome_unknown_and_the_retry_applies_nothing(served: _Served) -> None:
    url = served.url("monotonic")
    assert served.server is not None
    port = int(served.server.url.rsplit(":", 1)[1])
    with (
        TcpProxy("127.0.0.1", port) as proxy,
        open_store(url.replace(f":{port}/", f":{proxy.port}/")) as store,
    ):
        proxy.lose_replies()
        with pytest.raises(OutcomeUnknown):
            store.put(token(1), "k", b"v", op_id="write-1")
        proxy.forward()
        assert store.put(token(1), "k", b"v", op_id="write-1").version == 1
        item = store.get(R, "k")
        assert item is not None and item.version == 1  # applied once
        proxy.refuse()
        with pytest.raises(Unavailable):
            store.get(R, "k")


def test_the_asyncio_face_opens_an_http_store(served: _Served) -> None:
    url = served.url("monotonic")

    async def main() -> None:
        async with await fenced.aio.open_store(url) as store:
            await store.put(token(1), "k", b"v")
            item = await store.get(R, "k")
            assert item is not None and item.value == b"v"

            async def chunks() -> Any:
                for _ in range(3):
                    yield b"x" * 1000

            assert (await store.publish(token(1), chunks())).size == 3000
            with pytest.raises(NotFound):
                await store.read(R, "absent")

    asyncio.run(main())


def test_op_ids_beyond_ascii_travel_as_display_strings(served: _Served) -> None:
    store = served.make("monotonic")
    first = store.put(token(1), "k", b"v", op_id='écrire "1"')
    assert store.put(token(1), "k", b"v", op_id='écrire "1"') == first
    api = _api(served)
    bare = httpx.put(
        api + f"/items/{R}:k", headers={"Fenced-Token": str(token(1)), "Idempotency-Key": "plain"},
        content=b"w",
    )  # fmt: skip
    assert bare.json()["version"] == 2
    replay = httpx.put(
        api + f"/items/{R}:k",
        headers={"Fenced-Token": str(token(1)), "Idempotency-Key": '"plain"'},
        content=b"w",
    )
    assert replay.json()["version"] == 2
