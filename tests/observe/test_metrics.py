"""Prometheus metrics: the pure model with synthetic records, the collector, the CLI."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import fenced
from fenced.core._errors import ConfigurationError
from fenced.core._records import Record, RecordKind
from fenced.observe.metrics import MetricsModel, register

R = "jobs/metrics"
FENCED = [sys.executable, "-m", "fenced"]
Sample = tuple[str, tuple[tuple[str, str], ...]]


def records(*events: tuple[RecordKind, int, float], resource: str = R) -> list[Record]:
    return [
        Record(seq, at, kind, resource, epoch, "h", {})
        for seq, (kind, epoch, at) in enumerate(events, 1)
    ]


def values(text: str) -> dict[Sample, float]:
    """Every sample of a Prometheus text exposition, by (name, sorted labels)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def model_values(model: MetricsModel, now: float) -> dict[Sample, float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in model.families(now)
        for sample in family.samples
    }


def handovers(count: int, spacing: float, start: float = 1000.0) -> list[Record]:
    """``count`` grant/release pairs, one every ``spacing`` seconds."""
    events = []
    for index in range(count):
        at = start + index * spacing
        events += [(RecordKind.GRANTED, index + 1, at), (RecordKind.RELEASED, index + 1, at + 1)]
    return records(*events)


def test_the_model_counts_changes_ends_failures_and_time_without_owner() -> None:
    model = MetricsModel()
    model.feed_coordinator(
        records(
            (RecordKind.GRANTED, 1, 100.0),
            (RecordKind.RENEWAL_FAILED, 1, 105.0),
            (RecordKind.EXPIRED, 1, 110.0),
            (RecordKind.GRANTED, 2, 112.0),
            (RecordKind.RELEASED, 2, 120.0),
            (RecordKind.RESTORED, 1 << 40, 130.0),  # nothing held: ends nothing
            (RecordKind.GRANTED, (1 << 40) + 1, 140.0),
            (RecordKind.RESTORED, 1 << 41, 150.0),  # ends the held lease
        )
    )
    stale = {"op": "put", "reason": "stale"}
    model.feed_store(
        "sqlite:////srv/s.db",
        [
            Record(1, 111.0, RecordKind.REJECTED, R, 1, None, stale),
            Record(2, 111.5, RecordKind.REJECTED, R, 1, None, stale),
            Record(3, 112.5, RecordKind.REJECTED, R, 9, None, {"reason": "not-installed"}),
            Record(4, 113.0, RecordKind.ACCEPTED, R, 2, None, {}),
        ],
    )
    got = model_values(model, now=160.0)
    r = (("resource", R),)
    assert got[("fenced_ownership_changes_total", r)] == 3
    assert got[("fenced_lease_ends_total", (("how", "expired"), *r))] == 1
    assert got[("fenced_lease_ends_total", (("how", "released"), *r))] == 1
    assert got[("fenced_lease_ends_total", (("how", "restored"), *r))] == 1
    assert got[("fenced_renewal_failures_total", r)] == 1
    stale_key = (("reason", "stale"), ("resource", R), ("store", "sqlite:////srv/s.db"))
    assert got[("fenced_rejected_writes_total", stale_key)] == 2
    # 110-112, 120-140, 150-160
    assert got[("fenced_unowned_seconds_total", r)] == pytest.approx(2 + 20 + 10)
    assert got[("fenced_current_epoch", r)] == float(1 << 41)
    assert (got[("fenced_current_era", r)], got[("fenced_current_epoch_in_era", r)]) == (512, 0)
    assert got[("fenced_held", r)] == 0
    assert got[(("fenced_observe_up"), ())] == 1


def test_flapping_fires_above_the_threshold_only() -> None:
    model = MetricsModel(flap_threshold=3, flap_window=60)
    model.feed_coordinator(handovers(3, spacing=10))  # grants at 1000, 1010, 1020
    assert (model.recent_changes(R, 1021.0), model.flapping(R, 1021.0)) == (3, False)
    model.feed_coordinator(
        [Record(7, 1030.0, RecordKind.GRANTED, R, 4, "h", {})]
    )  # a fourth within a minute
    assert (model.recent_changes(R, 1031.0), model.flapping(R, 1031.0)) == (4, True)
    got = model_values(model, 1031.0)
    assert got[("fenced_flapping", (("resource", R),))] == 1
    assert not model.flapping(R, 1075.0)  # the window moved on: 1020 and 1030 remain


def test_normal_handovers_are_not_flapping() -> None:
    model = MetricsModel()  # defaults: more than 10 changes in 300 s
    model.feed_coordinator(handovers(50, spacing=60))  # a job every minute, for 50 minutes
    end = 1000.0 + 49 * 60 + 2
    assert model.recent_changes(R, end) == 5
    assert not model.flapping(R, end)
    assert model_values(model, end)[("fenced_ownership_changes_total", (("resource", R),))] == 50


def test_bad_flapping_settings_are_configuration_errors() -> None:
    registry = CollectorRegistry()
    with fenced.connect("memory://metrics-bad") as coord:
        options: list[dict[str, Any]] = [
            {"flap_threshold": -1},
            {"flap_threshold": 1.5},
            {"flap_window": 0},
        ]
        for bad in options:
            with pytest.raises(ConfigurationError, match="flap"):
                register(registry, coord, **bad)
    assert list(registry.collect()) == []


def test_the_registry_text_parses_and_values_match(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/fenced.db"
    with (
        fenced.connect(url) as coord,
        fenced.open_store(f"sqlite:///{tmp_path}/s.db") as store,
    ):
        registry = CollectorRegistry()
        collector = register(registry, coord, stores=[store], flap_threshold=1, flap_window=600)
        for holder in ("a", "b"):
            lease = coord.acquire(R, ttl=5, wait=0, holder=holder)
            store.fence(lease.token)
            coord.release(lease)
        with pytest.raises(fenced.StaleToken):
            store.put(fenced.FencingToken(coord.coordinator_id, R, 1), "k", b"v")
        first = values(generate_latest(registry).decode())
        coord.acquire(R, ttl=5, wait=0)
        second = values(generate_latest(registry).decode())  # only the new records are read
    r = (("resource", R),)
    assert first[("fenced_ownership_changes_total", r)] == 2
    assert first[("fenced_flapping", r)] == 1
    assert first[("fenced_held", r)] == 0
    key = (("reason", "stale"), ("resource", R), ("store", store.url))
    assert first[("fenced_rejected_writes_total", key)] == 1
    assert second[("fenced_ownership_changes_total", r)] == 3
    assert second[("fenced_held", r)] == 1 and second[("fenced_current_epoch", r)] == 3
    assert second[("fenced_rejected_writes_total", key)] == 1  # not counted twice
    assert collector.model.resources == [R]


def test_a_failed_read_shows_as_observe_up_0() -> None:
    coord = fenced.connect("memory://metrics-down")
    registry = CollectorRegistry()
    register(registry, coord)
    coord.release(coord.acquire(R, ttl=5, wait=0))
    assert values(generate_latest(registry).decode())[("fenced_observe_up", ())] == 1

    class Broken:
        def history(self, resource: str | None = None, *, after: int = 0) -> list[Record]:
            raise fenced.Unavailable("the coordinator is down")

    down = CollectorRegistry()
    register(down, Broken())
    assert values(generate_latest(down).decode())[("fenced_observe_up", ())] == 0
    coord.close()


# -- the command line ---------------------------------------------------------------------------


@pytest.mark.slow
def test_fenced_metrics_prints_parseable_text(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/fenced.db"
    with fenced.connect(url) as coord:
        for _ in range(4):
            coord.release(coord.acquire(R, ttl=5, wait=0))
    result = subprocess.run(
        [*FENCED, "metrics", "--url", url, "--flap-threshold", "3", "--flap-window", "1h"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    got = values(result.stdout)
    r = (("resource", R),)
    assert got[("fenced_ownership_changes_total", r)] == 4
    assert got[("fenced_lease_ends_total", (("how", "released"), *r))] == 4
    assert got[("fenced_flapping", r)] == 1
    bad = subprocess.run(
        [*FENCED, "metrics", "--url", url, "--listen", "nowhere:port"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_fenced_metrics_listen_serves_until_sigterm(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/fenced.db"
    with fenced.connect(url) as coord:
        coord.acquire(R, ttl=30, wait=0)
    with subprocess.Popen(
        [*FENCED, "metrics", "--url", url, "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) as server:  # fmt: skip
        try:
            assert server.stderr is not None
            line = server.stderr.readline()  # the address line comes first
            match = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
            assert match, line
            deadline = time.monotonic() + 20
            while True:
                try:
                    with urllib.request.urlopen(match.group(0), timeout=5) as response:
                        body = response.read().decode()
                    break
                except OSError:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            got = values(body)
            assert got[("fenced_held", (("resource", R),))] == 1
            os.kill(server.pid, signal.SIGTERM)
            assert server.wait(20) == 0
            assert "stopped serving" in server.stderr.read()
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
