"""The file store's commit log, checkpoints and journals under ``kill -9``, with real processes.

The workers are functions of this module, run as
``python tests/fence/file/test_store_file_crashes.py ROLE …``.
They shrink :data:`fenced.fence.file._store.CHECKPOINT_AT` so that a kill often lands in a
checkpoint, and acknowledge each write (one line in a file) only after the store returned it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

import fenced.fence
from fenced.core._clock import SystemClock
from fenced.core._records import RecordKind
from fenced.fence import Store, open_store
from fenced.fence.file import _journal as file_journal
from fenced.fence.file import _store as file_store
from fenced.testing.conformance import wait_for
from fenced.testing.store_conformance import R, token

SRC = str(Path(fenced.fence.__file__).resolve().parents[2])
pytestmark = pytest.mark.slow


def export(epoch: int, size: int) -> bytes:
    """The bytes published with ``epoch``: the parent can build them again for a retry."""
    return f"{epoch}\n".encode() + random.Random(epoch).randbytes(size)


# -- workers (run in child processes) ------------------------------------------------------------


def publish_loop(url: str, acks: str, checkpoint_at: str) -> None:
    """Publish ever newer epochs, half with op ids, gc now and then; acknowledge each publish."""
    file_store.CHECKPOINT_AT = int(checkpoint_at)
    rng = random.Random()
    fd = os.open(acks, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with open_store(url) as store:
        for number in range(10**9):
            epoch = (store.floor(R) or 0) + 1
            size = rng.randrange(1, 300_000)
            op_id = f"publish-{epoch}" if rng.random() < 0.5 else None
            published = store.publish(token(epoch), export(epoch, size), op_id=op_id)
            ack = {"epoch": epoch, "size": size, "op_id": op_id, "object_id": published.object_id}
            os.write(fd, json.dumps(ack).encode() + b"\n")  # only now is it acknowledged
            if number % 5 == 4:
                store.gc(keep=1, grace=0)


def die_at(url: str, point: str, checkpoint_at: str) -> None:
    """Write until the store reaches ``point`` a few times, then be killed there (SIGKILL)."""
    file_store.CHECKPOINT_AT = int(checkpoint_at)
    vars(file_journal)["COMPACT_AT"] = 2048  # compactions too
    real_replace, real_truncate = os.replace, os.truncate
    # The names the store's commit and checkpoint call (bound in its module at import).
    real_to_journal, real_write_all = vars(file_store)["to_journal"], vars(file_store)["write_all"]
    reached = iter(range(4, 0, -1))

    def die() -> None:
        if next(reached) == 1:  # the 4th time: after several acknowledged writes
            os.kill(os.getpid(), signal.SIGKILL)

    def replace(source: Any, target: Any) -> None:
        if point == "compacting" and ".jsonl.tmp-" in str(source):
            die()  # the rewritten journal is synced, not renamed
        real_replace(source, target)
        if point == "checkpoint-renamed" and str(target).endswith("/state.json"):
            die()  # the checkpoint is in place, the log is not truncated yet

    def truncate(path: Any, length: int) -> None:
        real_truncate(path, length)
        if point == "truncated":
            die()

    def to_journal(*args: Any) -> Any:
        result = real_to_journal(*args)
        if point == "journal-synced":
            die()  # the records are in the journal and still in the log
        return result

    def write_all(fd: int, data: bytes) -> None:
        if point == "torn-commit" and data.endswith(b"}\n") and b' {"format":' in data[:40]:
            real_write_all(fd, data[: len(data) // 2])
            die()  # half a log line
            real_write_all(fd, data[len(data) // 2 :])
            return
        real_write_all(fd, data)

    os.replace, os.truncate = replace, truncate  # type: ignore[assignment]
    vars(file_store).update(to_journal=to_journal, write_all=write_all)
    with open_store(url, record_limit=30) as store:
        for number in range(1, 10**9):
            epoch = (store.floor(R) or 0) + 1
            store.publish(token(epoch), export(epoch, 100), op_id=f"publish-{epoch}")
            store.put(token(epoch), "k", b"%d" % number, op_id=f"put-{number}")
            print(number, flush=True)  # acknowledged: both writes returned


WORKERS: dict[str, Callable[..., None]] = {"publish_loop": publish_loop, "die_at": die_at}


# -- helpers -------------------------------------------------------------------------------------


def spawn(*args: str, stdout: int | None = None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, __file__, *args], env=env, stdout=stdout)


def acknowledged(path: Path) -> list[dict[str, Any]]:
    """The complete acknowledgement lines (a kill may tear the last one: not acknowledged)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_bytes().split(b"\n")[:-1]]


def progressed(path: Path, count: int) -> bool:
    return len(acknowledged(path)) >= count


def check_publications(store: Store, acks: list[dict[str, Any]]) -> int:
    """The current publication is the last acknowledged one, or the one in flight after it."""
    latest = store.latest(R)
    assert latest is not None
    last = acks[-1]
    assert last["epoch"] <= latest.epoch <= last["epoch"] + 1
    if latest.epoch == last["epoch"]:
        assert latest.object_id == last["object_id"]
    data = store.read(R)  # checks size and SHA-256 against the pointer
    assert data.startswith(b"%d\n" % latest.epoch)
    with_op_id = [ack for ack in acks if ack["op_id"]]
    if with_op_id:  # its op record survived the kills and checkpoints: a retry replays it
        ack = with_op_id[-1]
        again = store.publish(
            token(ack["epoch"]), export(ack["epoch"], ack["size"]), op_id=ack["op_id"]
        )
        assert (again.epoch, again.object_id) == (ack["epoch"], ack["object_id"])
    return latest.epoch


class HourLater(SystemClock):
    """The system clock, its wall time an hour ahead: gc's cutoff then lies after every time
    the store recorded or a file was stamped with (a superseded publication, staged debris)."""

    def wall(self) -> float:
        return super().wall() + 3600.0


def check_debris_goes(url: str, rdir: Path) -> None:
    """A gc run an hour later, with a grace of a minute, leaves the current object alone."""
    with open_store(url, clock=HourLater()) as store:
        store.gc(keep=1, grace=60)
        latest = store.latest(R)
    assert latest is not None
    assert [p.name for p in (rdir / "objects").iterdir()] == [latest.object_id]
    assert list((rdir / "staging").iterdir()) == []
    assert not [p for p in rdir.iterdir() if ".tmp-" in p.name]


# -- tests ---------------------------------------------------------------------------------------


def test_kill_9_in_publish_loops_never_loses_an_acknowledged_publish(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    open_store(url, "monotonic").close()
    acks_path = tmp_path / "acks.jsonl"
    rng = random.Random(3)
    seen: list[int] = []  # the epochs this observer saw, in order
    with open_store(url) as observer:
        for _ in range(12):
            target = len(acknowledged(acks_path)) + 3
            child = spawn("publish_loop", url, str(acks_path), "8192")
            try:
                wait_for(partial(progressed, acks_path, target), 60, "a few publishes")
                deadline = time.monotonic() + rng.uniform(0.0, 0.4)
                while time.monotonic() < deadline:  # readers meanwhile see no step back
                    latest = observer.latest(R)
                    assert latest is not None
                    seen.append(latest.epoch)
                child.kill()  # SIGKILL: staging, committing, checkpointing, anywhere
            finally:
                child.kill()
                child.wait(timeout=30)
            seen.append(check_publications(observer, acknowledged(acks_path)))
        assert seen == sorted(seen)
        acks = acknowledged(acks_path)
        history = observer.history(R)
        seqs = [r.seq for r in history]
        assert seqs == sorted(set(seqs))
        accepted = {r.detail.get("object_id") for r in history if r.kind is RecordKind.ACCEPTED}
        assert {ack["object_id"] for ack in acks} <= accepted  # records are as durable
        (rdir,) = (tmp_path / "store" / "resources").iterdir()
        check_debris_goes(url, rdir)


@pytest.mark.parametrize(
    "point", ["journal-synced", "compacting", "checkpoint-renamed", "truncated", "torn-commit"]
)
def test_a_writer_killed_inside_a_checkpoint_or_a_commit_leaves_a_readable_store(
    tmp_path: Path, point: str
) -> None:
    url = f"file://{tmp_path}/store"
    open_store(url, "monotonic").close()
    child = spawn("die_at", url, point, "4096", stdout=subprocess.PIPE)
    output, _ = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL
    done = [int(line) for line in output.split()]
    assert done, "killed before its first acknowledged write"
    with open_store(url, record_limit=30) as store:
        item = store.get(R, "k")  # the last acknowledged put, or the one in flight
        assert item is not None and int(item.value) in (done[-1], done[-1] + 1)
        epoch = store.floor(R)
        assert epoch is not None and epoch in (done[-1], done[-1] + 1)
        assert store.put(token(done[-1]), "k", b"%d" % done[-1], op_id=f"put-{done[-1]}") == (
            fenced.Version(R, "k", done[-1], done[-1])
        )
        seqs = [r.seq for r in store.history(R)]  # each write's records: kept once, no gap
        assert 3 * done[-1] <= seqs[-1] <= 3 * done[-1] + 3  # an install, two accepted
        assert seqs == list(range(max(1, seqs[-1] - 29), seqs[-1] + 1))
        for number in range(1, 60):  # the store goes on, through more checkpoints
            store.put(token(epoch), "k", b"again %d" % number)
        assert store.read(R).startswith(b"%d\n" % epoch)
        after = [r.seq for r in store.history(R)]
        assert after == list(range(seqs[-1] + 30, seqs[-1] + 60))
        (rdir,) = (tmp_path / "store" / "resources").iterdir()
        check_debris_goes(url, rdir)


if __name__ == "__main__":
    WORKERS[sys.argv[1]](*sys.argv[2:])
