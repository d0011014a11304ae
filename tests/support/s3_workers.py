"""Child processes of ``tests/fence/s3/test_s3_faults.py``, in the argument form of
:class:`support.worker_processes.WorkerProcess`:
``python s3_workers.py MODE --url URL --out EVENTS --holder NAME [options]``.

Each appends JSON-line events (one ``write`` each, ``event`` and ``t``: ``time.monotonic``) to
``--out`` so the test can read them while the worker runs, and kill it (``kill -9``) at any
moment. The AWS credentials come from the environment the test gives the child.

``publish``    fence ``--epoch`` (event ``fenced``), then publish the file ``--path`` with it
               (event ``published``): the test kills it during the upload.
``stage``      event ``ready``; once ``--go`` exists, publish ``--size`` bytes with ``--epoch`` and
               an op id (no head read before the staging PUT; event ``published``): the test
               holds the replies of its proxy and kills it once the object is staged.
``rss``        fence epoch 1, publish a small warm-up, measure ``VmRSS`` (baseline), reset the
               peak (``/proc/self/clear_refs``), publish the file ``--path``, read ``VmHWM``
               (peak): event ``rss`` with both, in KiB.
``increment``  event ``ready``; once ``--go`` exists, add 1 to the integer in key ``--key`` with
               ``put(..., if_version=v)`` until ``--count`` puts succeeded (event ``put`` each
               with its version and value; a VersionConflict or Unavailable reads again), then
               event ``done`` with the number of conflicts.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from fenced import FencingToken, Unavailable, VersionConflict, open_store

RESOURCE = "exports/daily"
COORDINATOR = "c1" * 16
"""The coordinator of :func:`fenced.testing.store_conformance.token` (not imported: it needs
pytest, which a worker has no use for)."""


def token(epoch: int) -> FencingToken:
    return FencingToken(COORDINATOR, RESOURCE, epoch)


class Events:
    """The worker's event file (appended with one ``write`` per event)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __call__(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "t": time.monotonic(), **fields}) + "\n"
        os.write(self._fd, line.encode())


def wait_for_file(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.001)


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` figure (``VmRSS``, ``VmHWM``) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def publish(args: argparse.Namespace, event: Events) -> None:
    with open_store(args.url) as store:
        store.fence(token(args.epoch))
        event("fenced")
        published = store.publish(token(args.epoch), Path(args.path))
        event("published", object_id=published.object_id)


def stage(args: argparse.Namespace, event: Events) -> None:
    with open_store(args.url) as store:
        event("ready")
        wait_for_file(args.go)
        data = os.urandom(args.size)
        published = store.publish(token(args.epoch), data, op_id=f"{args.holder}-publish")
        event("published", object_id=published.object_id)


def rss(args: argparse.Namespace, event: Events) -> None:
    with open_store(args.url) as store:
        store.fence(token(1))
        store.publish(token(1), os.urandom(64 * 1024), name="warm-up")
        baseline = status_kib("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux ≥ 4.0)
            reset = True
        except OSError:
            reset = False  # the peak then counts from the start: an overestimate only
        began = time.monotonic()
        published = store.publish(token(1), Path(args.path))
        seconds = time.monotonic() - began
        event(
            "rss",
            baseline_kib=baseline,
            peak_kib=status_kib("VmHWM"),
            after_kib=status_kib("VmRSS"),
            reset=reset,
            size=published.size,
            seconds=seconds,
        )


def increment(args: argparse.Namespace, event: Events) -> None:
    conflicts = 0
    with open_store(args.url) as store:
        event("ready")
        wait_for_file(args.go)
        done = 0
        while done < args.count:
            item = store.get(RESOURCE, args.key)
            version = 0 if item is None else item.version
            value = 0 if item is None else int(item.value)
            try:
                written = store.put(token(1), args.key, str(value + 1).encode(), if_version=version)
            except (VersionConflict, Unavailable):
                conflicts += 1
                continue
            done += 1
            event("put", version=written.version, value=value + 1)
        event("done", conflicts=conflicts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["publish", "stage", "rss", "increment"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--holder", default="worker")
    parser.add_argument("--epoch", type=int, default=1)
    parser.add_argument("--path", default="")
    parser.add_argument("--size", type=int, default=1000)
    parser.add_argument("--go", default="")
    parser.add_argument("--key", default="counter")
    parser.add_argument("--count", type=int, default=1)
    args = parser.parse_args()
    worker = {"publish": publish, "stage": stage, "rss": rss, "increment": increment}[args.mode]
    worker(args, Events(args.out))


if __name__ == "__main__":
    main()
