"""The page at ``/`` in a real headless Chromium (Debian's ``chromium``, driven by playwright):
it follows grants, a handover, a release and a rejected stale write within a second each.

The screenshot is kept as a test artefact: ``$FENCED_TEST_ARTIFACTS/page.png`` when that
variable names a directory, else ``page.png`` in the test's pytest temporary directory.
A missing ``/usr/bin/chromium`` fails the test (it never skips).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, sync_playwright

import fenced
from fenced.server._auth import Role
from fenced.testing.server import ServedCoordinator

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
WITHIN = 1.0
"""Seconds the page has to show a change."""


@pytest.fixture
def page() -> Iterator[Page]:
    assert CHROMIUM.exists(), f"{CHROMIUM} is missing: apt-get install -y chromium"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            yield browser.new_page(viewport={"width": 1100, "height": 420})
        finally:
            browser.close()


def artefact(tmp_path: Path, name: str) -> Path:
    where = os.environ.get("FENCED_TEST_ARTIFACTS")
    folder = Path(where) if where else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def shows(page: Page, resource: str, **expected: str) -> float:
    """Seconds until the row of ``resource`` has the ``data-*`` values ``expected``."""
    began = time.monotonic()
    condition = " && ".join(f"row.dataset.{k} === {v!r}" for k, v in expected.items())
    page.wait_for_function(
        f"() => {{ const row = document.querySelector('tr[data-resource=\"{resource}\"]');"
        f" return row !== null && {condition}; }}",
        timeout=WITHIN * 1000,
        polling=20,
    )
    return time.monotonic() - began


def test_page_follows_leases_live(page: Page, tmp_path: Path) -> None:
    store_url = f"file://{tmp_path / 'store'}"
    store = fenced.open_store(store_url)
    with ServedCoordinator(
        f"memory://{uuid.uuid4().hex}", poll=2.0, stores={"files": store_url}
    ) as served:
        coordinator = fenced.connect(served.url)
        try:
            page.goto(served.url + "/")
            page.wait_for_selector("#status[data-state='live']", timeout=5000)
            assert page.is_visible("#empty")

            first = coordinator.acquire("jobs/a", 30, 0, holder="alpha")
            shows(page, "jobs/a", state="held", holder="alpha", epoch="1")
            coordinator.acquire("jobs/b", 30, 0, holder="gamma")
            shows(page, "jobs/b", state="held", holder="gamma", epoch="1")

            taken: list[fenced.Lease] = []
            waiter = threading.Thread(
                target=lambda: taken.append(coordinator.acquire("jobs/a", 30, 5, holder="beta"))
            )
            waiter.start()
            time.sleep(0.1)  # let beta queue (either way the page must show the handover)
            coordinator.release(first)
            waiter.join(10)
            (second,) = taken
            shows(page, "jobs/a", state="held", holder="beta", epoch="2")

            store.fence(second.token)
            with pytest.raises(fenced.StaleToken):
                store.put(first.token, "report", b"late write from alpha")
            # store rejections are read every STORE_REFRESH (1 s): allow that on top
            began = time.monotonic()
            page.wait_for_function(
                "() => document.querySelector('tr[data-resource=\"jobs/a\"]')"
                "?.dataset.rejected === '1'",
                timeout=(WITHIN + 1.0) * 1000,
                polling=20,
            )
            assert time.monotonic() - began < WITHIN + 1.0

            time.sleep(0.3)  # some time holding, for the drawing
            coordinator.release(second)
            shows(page, "jobs/a", state="free", holder="", epoch="2")

            bars = page.locator("tr[data-resource='jobs/a'] rect.epoch")
            assert bars.count() == 2
            assert [bars.nth(i).get_attribute("data-holder") for i in range(2)] == [
                "alpha",
                "beta",
            ]
            assert page.locator("tr[data-resource='jobs/a'] rect.rejected").count() == 1
            page.wait_for_selector("tr[data-resource='jobs/a'] rect.gap", timeout=2000)
            time.sleep(0.4)  # a visible stretch without an owner in the picture
            shot = artefact(tmp_path, "page.png")
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 1000
            print(f"screenshot: {shot}")
        finally:
            coordinator.close()
            store.close()


def test_page_files_and_headers() -> None:
    with ServedCoordinator(f"memory://{uuid.uuid4().hex}", poll=2.0) as served:
        index = httpx.get(served.url + "/", timeout=5)
        assert index.status_code == 200
        assert index.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in index.headers["content-security-policy"]
        assert "/page/page.js" in index.text
        script = httpx.get(served.url + "/page/page.js", timeout=5)
        assert script.status_code == 200
        assert script.headers["content-type"].startswith("text/javascript")
        assert httpx.get(served.url + "/page/../_page.py", timeout=5).status_code == 404
        assert httpx.get(served.url + "/page/secret.txt", timeout=5).status_code == 404


class OneKey:
    """A stand-in for a keys file: ``Bearer s3cret`` may read ``jobs/``, nothing else."""

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, str, str | None]] = []

    def check(self, authorization: str | None, role: Role, name: str | None) -> None:
        self.seen.append((authorization, role, name))
        if authorization != "Bearer s3cret":
            raise fenced.NotAuthenticated("an API key is needed")
        if role != "read" or name is None or not name.startswith("jobs/"):
            raise fenced.AccessDenied("not this key")


def test_page_asks_for_a_key_and_sends_it_as_a_bearer_token(page: Page) -> None:
    with ServedCoordinator(f"memory://{uuid.uuid4().hex}", poll=2.0) as served:
        authority = OneKey()
        coordinator = fenced.connect(served.url)
        try:
            coordinator.acquire("jobs/k", 30, 0, holder="keyed")
            served.app.state.fenced.authority = authority
            page.goto(served.url + "/?prefix=jobs/")  # the page itself needs no key
            page.wait_for_selector("#status[data-state='key']", timeout=5000)
            assert page.is_visible("#key-form")
            page.fill("#key", "s3cret")
            page.click("#key-form button")
            page.wait_for_selector("#status[data-state='live']", timeout=5000)
            shows(page, "jobs/k", state="held", holder="keyed", epoch="1")
            assert ("Bearer s3cret", "read", "jobs/") in authority.seen
            assert "s3cret" not in page.url
        finally:
            served.app.state.fenced.authority = None
            coordinator.close()
