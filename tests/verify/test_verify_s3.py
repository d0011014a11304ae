"""``fenced verify --store s3://…``: a seeded fault schedule with both stores on S3 (the session's
Ceph RGW; a fresh key prefix each): the strict role and the monotonic role, each the mode its
store was created in. Real worker processes (kills, pauses, lost and delayed replies, a restore
of the embedded coordinator) find the keys in the environment they inherit; every invariant
must hold. Each schedule uses a fresh resource name, so one store serves every schedule.

Opening an ``s3://`` store takes a moment (boto3, the conditional-write probe): the schedule's
work starts only once every worker has opened its stores (its ``ready`` event), so the work is
not spent opening them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fenced.fence import open_store
from fenced.verify import _seeded as seeded
from fenced.verify._mutants import CATALOGUE, hunt
from fenced.verify._recorder import read_history
from fenced.verify._target import Target
from support.s3_stores import s3_bucket, s3_url

__all__ = ["s3_bucket", "s3_url"]  # fixtures from support.s3_stores, used here


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_seeded_schedule_keeps_every_invariant_on_s3_stores_in_both_modes(
    s3_url: str, tmp_path: Path
) -> None:
    base, _, options = s3_url.partition("?")
    strict, monotonic = f"{base}/strict?{options}", f"{base}/monotonic?{options}"
    open_store(monotonic, mode="monotonic").close()  # the mode is chosen when it is created
    # the strict one is created by verify itself (a new store is created strict)
    done = subprocess.run(
        [sys.executable, "-m", "fenced", "verify", "--random", "1", "--seed", "4",
         "--duration", "2.5", "--store", strict, "--store", monotonic, "--json",
         "--keep-history", str(tmp_path)],
        capture_output=True, text=True, timeout=150, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads(done.stdout)
    assert document["ok"] is True
    random = document["random"]
    assert (random["schedules"], random["violations"]) == (1, 0), random
    assert random["operations"] > 0 and random["totals"]["grants"] >= 1, random

    (history,) = tmp_path.glob("*.history.jsonl")
    events = read_history(history)
    (meta,) = [e for e in events if e["ev"] == "meta"]
    assert meta["stores"] == {
        "S": {"url": strict, "mode": "strict"},
        "M": {"url": monotonic, "mode": "monotonic"},
    }
    workers = {e["w"] for e in events if e["ev"] == "start"}
    assert {e["w"] for e in events if e["ev"] == "ready"} == workers  # none crashed opening
    finals = {e["store"]: e for e in events if e["ev"] == "final"}
    assert finals["S"]["floor"] is not None  # every holder installed its epoch at S
    applied = {e["call"] for e in events if e["ev"] == "s.reply" and e.get("applied")}
    sends = [e for e in events if e["ev"] == "s.send" and e["op"] in ("put", "publish")]
    written = {e["store"] for e in sends if e["call"] in applied}
    assert written == {"S", "M"}, written  # both modes took writes


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_floor_after_write_is_caught_on_s3_stores(s3_url: str) -> None:
    """An ``s3:`` store has no lock for a successor's fence to queue behind: the defect's
    profile stops the writer between its write's commit and its install, where the fence
    lands (a stop before the commit lets the fence in first, and the commit then fails its
    condition honestly: the defect escaped a release check that way)."""
    (mutant,) = [m for m in CATALOGUE if m.name == seeded.FLOOR_AFTER_WRITE]
    base, _, options = s3_url.partition("?")
    stores = (f"{base}/faw-strict?{options}", f"{base}/faw-monotonic?{options}")
    open_store(stores[1], mode="monotonic").close()
    result = hunt(mutant, Target.create(None, stores), seed=11, budget=4, duration=3)
    assert result.caught, f"floor-after-write survived {result.schedules} schedules on s3:"
    assert "outcome-honesty" in result.invariants, result.messages
