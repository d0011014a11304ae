"""Stores under real processes: concurrent publishers paused and killed, lost replies.

The workers are functions of this module, run as
``python tests/fence/test_store_processes.py ROLE …``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import fenced.fence
from fenced.core._errors import IdempotencyConflict, StaleToken, Unavailable
from fenced.core._token import FencingToken
from fenced.fence import Store, open_store
from fenced.testing.conformance import wait_for
from fenced.testing.store_conformance import R, store_location, token

SRC = str(Path(fenced.fence.__file__).resolve().parents[2])
PUBLISHERS = 8
pytestmark = pytest.mark.slow


# -- workers (run in child processes) ------------------------------------------------------------


def publisher(url: str, index: int, stop: str, log: str) -> None:
    """Publish with epochs ≡ index+1 (mod 8), each above the floor; log every attempt."""
    rng = random.Random(index)
    epoch = index + 1
    with open_store(url) as store, open(log, "a") as out:
        while not os.path.exists(stop):
            nonce = rng.getrandbits(64)
            size = 1_100_000 if rng.random() < 0.05 else rng.randrange(1, 64_000)
            data = f"{epoch} {nonce}\n".encode() + rng.randbytes(size)
            record = {"epoch": epoch, "nonce": nonce, "sha256": hashlib.sha256(data).hexdigest()}
            try:
                record["object_id"] = store.publish(token(epoch), data).object_id
            except (StaleToken, Unavailable) as error:
                record["rejected"] = type(error).__name__
            out.write(json.dumps(record) + "\n")
            out.flush()
            floor = store.floor(R) or epoch
            epoch += PUBLISHERS * (max(floor - epoch, 0) // PUBLISHERS + 1)  # my next epoch above


def reader(url: str, stop: str, log: str) -> None:
    """Sample latest() and open() until told to stop; log each sample as a JSON line."""
    with open_store(url) as store, open(log, "a") as out:
        while not os.path.exists(stop):
            latest = store.latest(R)
            if latest is None:
                time.sleep(0.001)
                continue
            with store.open(R) as stream:
                data = stream.read()
            epoch, nonce = data.split(b"\n", 1)[0].split()
            sample = {
                "latest_epoch": latest.epoch,
                "latest_object": latest.object_id,
                "latest_sha256": latest.sha256,
                "open_epoch": int(epoch),
                "open_nonce": int(nonce),
                "open_sha256": hashlib.sha256(data).hexdigest(),
            }
            out.write(json.dumps(sample) + "\n")
            out.flush()


def killable(url: str, workdir: str) -> None:
    """Publish ever newer epochs (the host's monotonic clock), half from files, until killed."""
    rng = random.Random()
    with open_store(url) as store:
        (Path(workdir) / f"{os.getpid()}.started").touch()
        while True:
            data = rng.randbytes(rng.randrange(200_000, 1_500_000))
            source: bytes | Path = data
            if rng.random() < 0.5:
                source = Path(workdir) / f"{os.getpid()}.bin"
                source.write_bytes(data)
            with contextlib.suppress(StaleToken, Unavailable):
                store.publish(token(time.monotonic_ns()), source)


def put_then_die(url: str, text: str) -> None:
    """Write with an op id, then die before anyone hears the reply (a lost reply)."""
    store = open_store(url)
    store.put(FencingToken.parse(text), "k", b"written once", op_id="op-1")
    os.kill(os.getpid(), signal.SIGKILL)


def publish_then_die(url: str, text: str) -> None:
    store = open_store(url)
    store.publish(FencingToken.parse(text), b"the export", op_id="publish-1")
    os.kill(os.getpid(), signal.SIGKILL)


WORKERS: dict[str, Callable[..., None]] = {
    "publisher": lambda url, i, stop, log: publisher(url, int(i), stop, log),
    "reader": reader,
    "killable": killable,
    "put_then_die": put_then_die,
    "publish_then_die": publish_then_die,
}


# -- helpers -------------------------------------------------------------------------------------


def spawn(*args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, __file__, *args], env=env)


def lines(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def stop_all(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
        process.wait(timeout=30)


@pytest.fixture(params=["sqlite", "file"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/fenced.db"
    else:
        yield f"file://{tmp_path}/store"


def objects_left(store: Store) -> set[str]:
    """The object ids physically present in a local store."""
    location = store_location(store)
    if store.url.startswith("sqlite:"):
        conn = sqlite3.connect(location)
        try:
            objects = {row[0] for row in conn.execute("SELECT object_id FROM objects")}
            chunk_owners = {row[0] for row in conn.execute("SELECT object_id FROM chunks")}
            assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        finally:
            conn.close()
        assert chunk_owners <= objects  # no orphan chunks after gc
        return objects
    (rdir,) = (location / "resources").iterdir()
    assert list((rdir / "staging").iterdir()) == []
    return {path.name for path in (rdir / "objects").iterdir()}


# -- tests ---------------------------------------------------------------------------------------


def test_paused_publishers_never_make_the_visible_export_go_back(url: str, tmp_path: Path) -> None:
    open_store(url, "monotonic").close()
    stop = tmp_path / "stop"
    logs = [tmp_path / f"publisher-{i}.jsonl" for i in range(PUBLISHERS)]
    samples = tmp_path / "reader.jsonl"
    publishers = [spawn("publisher", url, str(i), str(stop), str(logs[i])) for i in range(8)]
    readers = [spawn("reader", url, str(stop), str(samples))]
    try:
        wait_for(lambda: len(lines(samples)) >= 5, 30, "the reader's first samples")
        rng = random.Random(7)
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:  # random SIGSTOP/SIGCONT pauses of the publishers
            victim = rng.choice(publishers)
            os.kill(victim.pid, signal.SIGSTOP)
            time.sleep(rng.uniform(0.01, 0.15))
            os.kill(victim.pid, signal.SIGCONT)
        stop.touch()
        for process in publishers + readers:
            process.wait(timeout=30)
    finally:
        stop.touch()
        stop_all(publishers + readers)
    assert [p.returncode for p in publishers + readers] == [0] * (PUBLISHERS + 1)

    attempts = [record for log in logs for record in lines(log)]
    accepted = {r["nonce"]: r for r in attempts if "object_id" in r}
    by_object = {r["object_id"]: r for r in accepted.values()}
    assert accepted and len(accepted) < len(attempts)  # some lost the race: StaleToken
    observed = lines(samples)
    assert len(observed) >= 20
    sequence: list[int] = []
    for sample in observed:
        published = by_object[sample["latest_object"]]  # only accepted objects are ever visible
        assert (published["epoch"], published["sha256"]) == (
            sample["latest_epoch"],
            sample["latest_sha256"],
        )
        opened = accepted[sample["open_nonce"]]  # the bytes read back are complete and accepted
        assert (opened["epoch"], opened["sha256"]) == (sample["open_epoch"], sample["open_sha256"])
        sequence += [int(str(sample["latest_epoch"])), int(str(sample["open_epoch"]))]
    assert sequence == sorted(sequence)  # the observed epoch never decreases
    with open_store(url) as store:
        final = store.latest(R)
        assert final is not None
        assert final.epoch == max(int(str(r["epoch"])) for r in accepted.values())
        assert hashlib.sha256(store.read(R)).hexdigest() == final.sha256


def test_publishers_killed_at_random_instants_leave_a_complete_pointer(
    url: str, tmp_path: Path
) -> None:
    open_store(url, "monotonic").close()
    rng = random.Random(11)
    running = [spawn("killable", url, str(tmp_path)) for _ in range(3)]
    kills = 0
    try:
        with open_store(url) as observer:
            wait_for(lambda: observer.latest(R) is not None, 30, "a first publication")
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline or kills < 8:
            victim = running.pop(rng.randrange(len(running)))
            started = tmp_path / f"{victim.pid}.started"
            wait_for(started.exists, 30, "the victim to start publishing")
            time.sleep(rng.uniform(0.0, 0.25))
            victim.kill()  # SIGKILL at a random instant: staging, committing, anywhere
            victim.wait(timeout=30)
            kills += 1
            running.append(spawn("killable", url, str(tmp_path)))
    finally:
        stop_all(running)
    assert kills >= 8
    with open_store(url) as store:
        latest = store.latest(R)
        assert latest is not None  # something was published between the kills
        data = store.read(R)  # checks size and SHA-256 against the pointer
        with store.open(R) as stream:
            assert hashlib.sha256(stream.read()).hexdigest() == latest.sha256
        assert (len(data), hashlib.sha256(data).hexdigest()) == (latest.size, latest.sha256)
        newer = store.publish(token(time.monotonic_ns()), b"after the crashes")  # still usable
        assert store.latest(R) == newer
        time.sleep(0.01)
        store.gc(keep=1, grace=0)  # removes objects of killed publishers and their debris
        assert objects_left(store) == {newer.object_id}
        assert store.read(R) == b"after the crashes"


def test_a_lost_reply_is_answered_by_the_op_id_and_the_write_lands_once(url: str) -> None:
    with open_store(url) as store:
        store.fence(token(1))
        child = spawn("put_then_die", url, str(token(1)))
        assert child.wait(timeout=30) == -signal.SIGKILL  # the caller never got a reply
        store.fence(token(2))  # a successor installed meanwhile
        retry = store.put(token(1), "k", b"written once", op_id="op-1")
        assert (retry.epoch, retry.version) == (1, 1)
        item = store.get(R, "k")
        assert item is not None and (item.value, item.version, item.epoch) == (
            b"written once",
            1,
            1,
        )
        with pytest.raises(IdempotencyConflict):
            store.put(token(1), "k", b"something else", op_id="op-1")
        with pytest.raises(StaleToken):  # without the op id, 1 is simply stale now
            store.put(token(1), "k", b"written once")


def test_a_lost_publish_reply_is_answered_by_the_op_id(url: str) -> None:
    with open_store(url) as store:
        store.fence(token(1))
        child = spawn("publish_then_die", url, str(token(1)))
        assert child.wait(timeout=30) == -signal.SIGKILL
        published = store.latest(R)
        assert published is not None
        retry = store.publish(token(1), b"the export", op_id="publish-1")
        assert retry == published
        assert store.latest(R) == published
        assert objects_left(store) == {published.object_id}  # the retry staged nothing lasting


if __name__ == "__main__":
    WORKERS[sys.argv[1]](*sys.argv[2:])
