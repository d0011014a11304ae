"""``fenced verify --coordinator http://… --store http://…/stores/NAME``: the practice table and
seeded fault schedules through ``fenced serve`` (a real server process over the embedded
coordinator and a served strict store). Each worker reaches the server through its own TCP
proxy, so the nemesis cuts, delays and blackholes real HTTP connections."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fenced.testing.server import ServeProcess
from fenced.verify._target import Target
from support.verify_networked import assert_verify_passes


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServeProcess]:
    store = f"main=sqlite:///{tmp_path / 'store.db'}"
    with ServeProcess(f"sqlite:///{tmp_path / 'fenced.db'}", "--store", store) as process:
        yield process


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_cases_and_random_schedules_pass_through_fenced_serve(served: ServeProcess) -> None:
    target = Target.create(served.url, (served.url + "/stores/main",))
    assert target.stores == {"S": served.url + "/stores/main"}
    assert_verify_passes(target, seed=103, schedules=2)
