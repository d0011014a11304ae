"""Member faults: randomized schedules against a 3-member etcd cluster that verify started itself
(:class:`~fenced.verify._members.ManagedEtcd`, its members in a network lab of their own).

Besides its usual faults, the nemesis kills members (SIGKILL, restarted on their data directory)
and isolates them from their peers (nftables): seeds 1-3 isolate a follower (the minority side),
kill the leader and isolate the leader (the majority elects another). The faults are counted in
the report, every invariant holds, and afterwards no namespace, nftables rule or etcd process of
the run is left. A cluster given by URL is never struck, and verify says so.

Root only (CI runs as root); a test fails, never skips, without it.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from fenced.testing.netlab import PREFIX, lab_namespaces, unavailable
from fenced.verify._members import ManagedEtcd
from fenced.verify._recorder import read_history
from fenced.verify._schedule import run_random
from fenced.verify._table import plain_random
from fenced.verify._target import Target


@pytest.fixture(autouse=True)
def _root() -> None:
    why = unavailable()
    if why is not None:
        pytest.fail(f"the lab cannot be built: {why} (run the test suite as root, as CI does)")


def _root_network() -> tuple[str, str]:
    """This namespace's links and nftables rules (verify must leave them as they were)."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True)
    rules = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True, check=True)
    names = sorted(line.split(":")[1].strip() for line in links.stdout.splitlines())
    return " ".join(names), rules.stdout


def _processes_using(directory: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and directory in (entry / "cmdline").read_text():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_member_kills_and_isolation_keep_every_invariant(tmp_path: Path) -> None:
    before = _root_network()
    with ManagedEtcd() as etcd:
        assert etcd.cluster is not None
        directory = str(etcd.cluster.directory)
        target = Target.create(etcd.url(f"/vm-{uuid.uuid4().hex[:8]}"), members=etcd.control)
        assert target.member_faults == ("member-kill", "member-isolate")
        assert "member faults on verify's own etcd cluster" in target.describe()
        summary = run_random(3, 1, target, duration=4.0, keep_history=tmp_path)
    assert summary.ok, [(r.schedule.seed, r.report.violations) for r in summary.failed]
    totals = summary.totals()
    assert totals["fault member-kill"] >= 1, dict(totals)
    assert totals["fault member-isolate"] >= 1, dict(totals)
    assert totals["faults"] >= totals["fault member-kill"] + totals["fault member-isolate"]
    assert totals["grants"] >= 3
    line = plain_random(summary, "replay {seed}").splitlines()[1]
    assert f"member kills {totals['fault member-kill']}" in line

    events = [e for path in sorted(tmp_path.iterdir()) for e in read_history(path)]
    struck = [e for e in events if e["ev"] in ("member-kill", "member-isolate")]
    assert {e["role"] for e in struck} <= {"leader", "follower"}
    assert not any(e.get("elsewhere") for e in events)  # one schedule at a time
    healed = [e for e in events if e["ev"] in ("member-restart", "member-heal")]
    assert [e["by"] for e in healed] == ["nemesis"] * len(struck)  # each by its schedule
    meta = [e for e in events if e["ev"] == "meta"]
    assert all(e["failover"] > 0 and e["overrun"] > e["failover"] for e in meta)

    assert [n for n in lab_namespaces() if n.startswith(f"{PREFIX}{os.getpid()}-")] == []
    assert _root_network() == before
    assert _processes_using(directory) == []


def test_a_cluster_given_by_url_is_never_struck() -> None:
    target = Target("etcd://127.0.0.1:2379,127.0.0.1:22379")
    assert target.member_faults == ()
    assert target.failover(0.6, 0.9) == 0.0
    assert target.describe().endswith(
        "; no member faults (verify kills and isolates only members it started)"
    )
    assert "member faults" not in Target("postgresql://u@127.0.0.1:5432/db").describe()
