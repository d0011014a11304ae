"""Timelines: the pure merge of records, a scripted multi-process scenario, and the CLI.

The scenario (real processes, a real SIGSTOP): A holds the lease and writes, is paused past its
ttl, B takes over and writes, A resumes and its late write is rejected, B releases, nobody holds
the resource for a while, C acquires it. Its timeline and metrics are asserted exactly: counts
exact, durations within one renewal tick (ttl/3).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fenced
from fenced.core._records import Record, RecordKind
from fenced.observe.metrics import FencedCollector
from fenced.observe.timeline import Timeline, build_timeline, read_timeline

R = "jobs/ops"
STORE = "sqlite:////stores/s.db"
TTL = 1.0
TICK = TTL / 3 * 1.1  # one renewal interval, jitter included
STARTUP = 20.0
WORKERS = Path(__file__).parents[1] / "support" / "ops_workers.py"
FENCED = [sys.executable, "-m", "fenced"]


class Log:
    """Synthetic coordinator records: ``log.add(kind, epoch, at, holder, **detail)``."""

    def __init__(self, resource: str = R) -> None:
        self.resource = resource
        self.records: list[Record] = []

    def add(
        self, kind: RecordKind, epoch: int, at: float, holder: str | None = None, **detail: Any
    ) -> Log:
        self.records.append(
            Record(len(self.records) + 1, at, kind, self.resource, epoch, holder, detail)
        )
        return self


def rejected(seq: int, at: float, epoch: int, floor: int, reason: str = "stale") -> Record:
    detail = {"op": "put", "key": "k", "reason": reason, "presented": epoch, "floor": floor}
    return Record(seq, at, RecordKind.REJECTED, R, epoch, None, detail)


def summary(view: Timeline) -> list[tuple[int, str | None, float | None, float | None, str]]:
    return [(i.epoch, i.holder, i.start, i.end, i.ended) for i in view.intervals]


# -- pure ----------------------------------------------------------------------------------------


def test_intervals_end_as_the_records_say() -> None:
    log = (
        Log()
        .add(RecordKind.GRANTED, 1, 100.0, "a")
        .add(RecordKind.RELEASED, 1, 110.0, "a")
        .add(RecordKind.GRANTED, 2, 115.0, "b")
        .add(RecordKind.EXPIRED, 2, 130.0, "b")
        .add(RecordKind.GRANTED, 3, 130.5, "c")
        .add(RecordKind.GRANTED, 4, 140.0, "d")  # 3's end was never recorded
        .add(RecordKind.RESTORED, 1 << 40, 150.0, None, reason="restore")
        .add(RecordKind.GRANTED, (1 << 40) + 1, 160.0, "e")
    )
    view = build_timeline(R, log.records, now=170.0)
    assert summary(view) == [
        (1, "a", 100.0, 110.0, "released"),
        (2, "b", 115.0, 130.0, "expired"),
        (3, "c", 130.5, 140.0, "superseded"),
        (4, "d", 140.0, 150.0, "restored"),
        ((1 << 40) + 1, "e", 160.0, None, "held"),
    ]
    assert [(g.after_epoch, g.start, g.end) for g in view.gaps] == [
        (1, 110.0, 115.0),
        (2, 130.0, 130.5),
        (4, 150.0, 160.0),
    ]
    assert view.current is not None and view.current.holder == "e"
    assert [e.kind for e in view.events] == ["restored"]
    f = view.figures
    assert (f.since, f.until, f.ownership_changes, f.expiries) == (100.0, 170.0, 5, 1)
    assert f.time_without_owner == pytest.approx(5.0 + 0.5 + 10.0)


def test_an_open_gap_lasts_until_now_and_the_window_clips_figures() -> None:
    log = (
        Log()
        .add(RecordKind.GRANTED, 1, 100.0, "a")
        .add(RecordKind.RELEASED, 1, 110.0, "a")
        .add(RecordKind.GRANTED, 2, 200.0, "b")
        .add(RecordKind.EXPIRED, 2, 210.0, "b")
    )
    view = build_timeline(R, log.records, now=250.0, since=150.0)
    assert summary(view) == [(2, "b", 200.0, 210.0, "expired")]  # 1 ended before the window
    assert [(g.start, g.end) for g in view.gaps] == [(110.0, 200.0), (210.0, None)]
    assert view.gaps[-1].duration(250.0) == 40.0
    f = view.figures
    assert (f.ownership_changes, f.expiries) == (1, 1)
    assert f.time_without_owner == pytest.approx(50.0 + 40.0)  # 150-200 and 210-250


def test_trouble_is_attached_to_its_epoch() -> None:
    log = (
        Log()
        .add(RecordKind.GRANTED, 1, 100.0, "a")
        .add(RecordKind.RENEWAL_FAILED, 1, 101.0, "a", error="Unavailable: x")
        .add(RecordKind.RENEWAL_FAILED, 1, 102.0, "a", error="Unavailable: x")
        .add(RecordKind.EXPIRED, 1, 103.0, "a")
        .add(RecordKind.GRANTED, 2, 104.0, "b")
        .add(RecordKind.LOST, 1, 105.0, "a", reason="expired")
    )
    stores = {
        "file:///s": [
            Record(1, 100.5, RecordKind.ACCEPTED, R, 1, None, {"op": "put", "key": "k"}),
            rejected(2, 106.0, 1, 2),
            rejected(3, 107.0, 9, 2, "not-installed"),
            Record(4, 104.5, RecordKind.INSTALLED, R, 2, None, {"op": "fence"}),
            Record(5, 108.0, RecordKind.REJECTED, "other", 1, None, {}),  # another resource
        ]
    }
    view = build_timeline(R, log.records, stores, now=110.0)
    first = view.intervals[0]
    assert (first.renewal_failures, first.lost, first.accepted_writes) == (2, "expired", 1)
    assert [(r.epoch, r.floor, r.reason, r.holder, r.key) for r in view.rejections] == [
        (1, 2, "stale", "a", "k"),
        (9, 2, "not-installed", None, "k"),
    ]
    assert [(e.kind, e.source) for e in view.events] == [
        ("renewal-failed", "coordinator"),
        ("renewal-failed", "coordinator"),
        ("installed", "file:///s"),
        ("lost", "coordinator"),
    ]
    f = view.figures
    assert (f.rejected_writes, dict(f.rejected_by_reason), f.renewal_failures) == (
        2,
        {"stale": 1, "not-installed": 1},
        2,
    )


def test_records_of_other_resources_and_pruned_grants() -> None:
    log = Log().add(RecordKind.RELEASED, 7, 100.0, "a")  # its grant was pruned
    log.records.append(Record(2, 101.0, RecordKind.GRANTED, "other", 1, "x", {}))
    log.add(RecordKind.GRANTED, 8, 102.0, "b")
    view = build_timeline(R, log.records, now=103.0)
    assert summary(view) == [(7, "a", None, 100.0, "released"), (8, "b", 102.0, None, "held")]
    assert view.intervals[0].duration(103.0) is None
    assert build_timeline(R, [], now=5.0).figures.ownership_changes == 0


def test_the_json_document_has_a_stable_shape() -> None:
    log = Log().add(RecordKind.GRANTED, 1, 100.0, "a").add(RecordKind.RELEASED, 1, 101.0, "a")
    document = build_timeline(R, log.records, {"s": [rejected(1, 102.0, 1, 2)]}, now=103.0)
    shape = json.loads(json.dumps(document.to_json()))
    assert set(shape) == {
        "format", "resource", "since", "until", "intervals", "gaps", "rejections", "events",
        "figures",
    }  # fmt: skip
    assert shape["format"] == 1
    assert set(shape["intervals"][0]) == {
        "epoch", "holder", "start", "end", "ended", "duration", "renewal_failures", "lost",
        "accepted_writes",
    }  # fmt: skip
    assert shape["gaps"] == [
        {"start": 101.0, "end": None, "duration": 2.0, "after_epoch": 1, "waiting": None}
    ]
    assert shape["rejections"] == [
        {"at": 102.0, "store": "s", "epoch": 1, "floor": 2, "reason": "stale", "op": "put",
         "key": "k", "name": None, "holder": "a"}
    ]  # fmt: skip
    assert set(shape["figures"]) == {
        "since", "until", "window", "ownership_changes", "time_without_owner",
        "rejected_writes", "rejected_by_reason", "renewal_failures", "expiries",
    }  # fmt: skip


# -- the scripted scenario --------------------------------------------------------------------


def wait_for_path(path: Path, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + STARTUP
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"the worker exited early:\n{log.read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {path}:\n{log.read_text()}")
        time.sleep(0.01)


@pytest.fixture
def paused_takeover(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Run the scenario; yield what was measured while it ran (the coordinator stays open)."""
    url = f"sqlite:///{tmp_path}/fenced.db"
    store_url = f"sqlite:///{tmp_path}/store.db"
    fenced.open_store(store_url).close()  # a strict store
    ready, go, out, log = (tmp_path / n for n in ("a.ready", "a.go", "a.out", "a.log"))
    with log.open("wb") as stream:
        worker = subprocess.Popen(
            [sys.executable, str(WORKERS), "holder", url, "--resource", R, "--store", store_url,
             "--holder", "A", "--ttl", str(TTL), "--ready", str(ready), "--go", str(go),
             "--out", str(out)],
            stdout=stream, stderr=subprocess.STDOUT,
        )  # fmt: skip
    coord = fenced.connect(url)
    store = fenced.open_store(store_url)
    try:
        wait_for_path(ready, worker, log)
        stopped = time.time()
        os.kill(worker.pid, signal.SIGSTOP)
        with coord.hold(R, ttl=TTL, wait=None, fence=[store], holder="B") as b:
            store.put(b.token, "k", b"B")
            go.touch()
            os.kill(worker.pid, signal.SIGCONT)
            assert worker.wait(STARTUP) == 0, log.read_text()
            releasing = time.time()
        released = time.time()
        time.sleep(3 * TICK)  # the gap without an owner
        regrant = time.time()
        coord.acquire(R, ttl=30, wait=0, holder="C")
        measured = {
            "coord": coord,
            "store": store,
            "url": url,
            "store_url": store_url,
            "stopped": stopped,
            "releasing": releasing,
            "released": released,
            "regrant": regrant,
            "a": json.loads(out.read_text()),
        }
        yield measured
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGCONT)
            worker.kill()
            worker.wait()
        store.close()
        coord.close()


@pytest.mark.slow
def test_the_timeline_and_metrics_of_a_paused_takeover(paused_takeover: dict[str, Any]) -> None:
    m = paused_takeover
    assert m["a"] == {"epoch": 1, "late_write": "stale 1 2", "exit": "expired"}
    coord, store = m["coord"], m["store"]
    now = time.time()
    view = read_timeline(coord, R, [store], now=now)

    a, b, c = view.intervals
    assert [(i.epoch, i.holder, i.ended) for i in view.intervals] == [
        (1, "A", "expired"),
        (2, "B", "released"),
        (3, "C", "held"),
    ]
    assert a.start is not None and a.end is not None and b.start is not None
    assert b.end is not None and c.start is not None
    # A's lease expired ttl after its last renewal, which was at most one tick before the stop.
    assert m["stopped"] + TTL - TICK - 0.05 <= a.end <= m["stopped"] + TTL + 0.05
    assert 0 <= b.start - a.end <= TICK  # B took over at the expiry
    assert m["releasing"] - 0.05 <= b.end <= m["released"] + 0.05
    assert abs(c.start - m["regrant"]) <= TICK
    assert (a.lost, a.renewal_failures, a.accepted_writes) == ("expired", 0, 1)
    assert (b.lost, b.renewal_failures, b.accepted_writes) == (None, 0, 1)

    long_gaps = [g for g in view.gaps if g.duration(now) > TICK]
    assert [(g.after_epoch, g.end) for g in long_gaps] == [(2, c.start)]
    assert abs(long_gaps[0].duration(now) - (m["regrant"] - m["released"])) <= TICK
    assert {g.after_epoch for g in view.gaps} <= {1, 2}

    (late,) = view.rejections
    assert (late.store, late.epoch, late.floor, late.reason, late.op, late.key, late.holder) == (
        store.url, 1, 2, "stale", "put", "k", "A",
    )  # fmt: skip
    assert [(e.kind, e.epoch, e.source) for e in view.events] == [
        ("installed", 1, store.url),
        ("installed", 2, store.url),
        ("lost", 1, "coordinator"),
    ]
    f = view.figures
    assert (f.ownership_changes, f.rejected_writes, f.renewal_failures, f.expiries) == (3, 1, 0, 1)
    assert dict(f.rejected_by_reason) == {"stale": 1}
    unowned = (b.start - a.end) + (c.start - b.end)
    assert f.time_without_owner == pytest.approx(unowned, abs=1e-6)
    assert abs(f.time_without_owner - (m["regrant"] - m["released"])) <= TICK

    # The metrics tell the same story.
    collector = FencedCollector(coord, [store], wall=lambda: now)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in collector.collect()
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"resource": R, **labels}.items())))]

    assert value("fenced_ownership_changes_total") == 3
    assert value("fenced_lease_ends_total", how="released") == 1
    assert value("fenced_lease_ends_total", how="expired") == 1
    assert value("fenced_lease_ends_total", how="restored") == 0
    assert value("fenced_renewal_failures_total") == 0
    assert value("fenced_rejected_writes_total", store=store.url, reason="stale") == 1
    assert value("fenced_unowned_seconds_total") == pytest.approx(unowned, abs=1e-3)
    assert (value("fenced_current_epoch"), value("fenced_held")) == (3, 1)
    assert (value("fenced_recent_ownership_changes"), value("fenced_flapping")) == (3, 0)

    # And so does the command line.
    result = subprocess.run(
        [*FENCED, "timeline", R, "--url", m["url"], "--store", m["store_url"], "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert [(i["epoch"], i["holder"], i["ended"]) for i in document["intervals"]] == [
        (1, "A", "expired"),
        (2, "B", "released"),
        (3, "C", "held"),
    ]
    assert [(r["epoch"], r["floor"], r["reason"]) for r in document["rejections"]] == [
        (1, 2, "stale")
    ]
    assert document["coordinator_id"] == coord.coordinator_id
    plain = subprocess.run(
        [*FENCED, "timeline", R, "--url", m["url"], "--store", m["store_url"]],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    for expected in ("expired", "released", "held", "(no owner)", "stale", "3 ownership change"):
        assert expected in plain.stdout


# -- the command line: status figures and bad input --------------------------------------------


def fenced_cmd(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FENCED_URL"}
    return subprocess.run(
        [*FENCED, *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )


@pytest.mark.slow
def test_status_shows_the_figures_of_the_window(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/fenced.db"
    store_url = f"sqlite:///{tmp_path}/store.db"
    with fenced.connect(url) as coord, fenced.open_store(store_url) as store:
        for _ in range(3):
            lease = coord.acquire(R, ttl=5, wait=0, holder="w")
            store.fence(lease.token)
            coord.release(lease)
        with pytest.raises(fenced.StaleToken):
            store.put(fenced.FencingToken(coord.coordinator_id, R, 1), "k", b"late")
    result = fenced_cmd("status", "--url", url, "--store", store_url, "--json", "--window", "10m")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert (document["window"], document["stores"]) == (600.0, [store_url])
    (row,) = document["resources"]
    figures = row["figures"]
    assert (figures["ownership_changes"], figures["rejected_writes"]) == (3, 1)
    assert figures["rejected_by_reason"] == {"stale": 1}
    assert 0 < figures["time_without_owner"] < 600
    plain = fenced_cmd("status", "--url", url, "--store", store_url, "--window", "2h")
    assert plain.returncode == 0, plain.stderr
    header, line = plain.stdout.splitlines()
    assert header.split()[-3:] == ["CHANGES/2h", "UNOWNED/2h", "REJECTED/2h"]
    assert line.split()[-3] == "3" and line.split()[-1] == "1"


@pytest.mark.parametrize(
    "args",
    [
        ["timeline", "../bad"],
        ["timeline", "jobs/x", "--since", "yesterday-ish"],
        ["timeline", "jobs/x", "--store", "sqlite:////nonexistent/dir/s.db"],
        ["timeline", "jobs/x", "--url", "nope://x"],
        ["status", "--window", "0"],
        ["status", "--window", "soon"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], tmp_path: Path) -> None:
    result = fenced_cmd(
        *args, *([] if "--url" in args else ["--url", f"sqlite:///{tmp_path}/c.db"])
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("fenced: ")
    assert not (tmp_path / "nonexistent").exists()
