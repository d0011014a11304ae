"""Worker processes for the operations tests: ``python ops_workers.py MODE URL [options]``.

``holder``  ``with coord.hold(RESOURCE, fence=[STORE])`` as ``--holder``; writes key ``k`` once,
            touches ``--ready``, waits for ``--go`` (the test SIGSTOPs it meanwhile, past the
            ttl, and continues it after a successor took over), writes again, and reports the
            outcome of that late write to ``--out`` as JSON; it then waits until its own loss
            is recorded by the coordinator, so the test can count on the record.
``loop``    acquire / release ``RESOURCE`` until ``--go`` disappears; appends every granted
            epoch to ``--out`` (one line, one ``write``, after the grant returned).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import fenced
from fenced.core._records import RecordKind


def holder(args: argparse.Namespace) -> None:
    coord = fenced.connect(args.url)
    store = fenced.open_store(args.store)
    outcome: dict[str, object] = {}
    try:
        with coord.hold(
            args.resource, ttl=args.ttl, wait=0, fence=[store], holder=args.holder
        ) as held:
            store.put(held.token, "k", f"{args.holder} first".encode())
            outcome["epoch"] = held.epoch
            Path(args.ready).touch()
            while not Path(args.go).exists():
                time.sleep(0.005)
            try:
                store.put(held.token, "k", f"{args.holder} late".encode())
                outcome["late_write"] = "accepted"
            except fenced.StaleToken as error:
                outcome["late_write"] = f"stale {error.presented} {error.floor}"
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                lost = [
                    r
                    for r in coord.history(args.resource)
                    if r.kind is RecordKind.LOST and r.epoch == held.epoch
                ]
                if lost:
                    break
                time.sleep(0.01)
    except fenced.LeaseLost as error:
        outcome["exit"] = error.reason.value
    Path(args.out).write_text(json.dumps(outcome))
    store.close()
    coord.close()


def loop(args: argparse.Namespace) -> None:
    coord = fenced.connect(args.url)
    fd = os.open(args.out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    Path(args.ready).touch()
    while Path(args.go).exists():
        lease = coord.acquire(args.resource, ttl=5, wait=None, holder=args.holder)
        os.write(fd, f"{lease.epoch}\n".encode())
        coord.release(lease)
    os.close(fd)
    coord.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["holder", "loop"])
    parser.add_argument("url")
    parser.add_argument("--resource", default="jobs/ops")
    parser.add_argument("--store", default="")
    parser.add_argument("--holder", default="worker")
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--ready", required=True)
    parser.add_argument("--go", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    {"holder": holder, "loop": loop}[args.mode](args)


if __name__ == "__main__":
    main()
