"""Lease worker processes for the tests of networked coordinators (etcd, ZooKeeper):
``python lease_workers.py MODE --url URL …``.

Each worker writes one JSON line per event (``{"event": …, "t": SystemClock().now(), "pid": …}``)
to ``--out`` with a single ``write``, so the test can poll the file while the worker runs.
``t`` is on the deadline clock (``Clock.now``, CLOCK_BOOTTIME on Linux), the clock of the lease
deadlines recorded beside it: one clock for every process of the host, network namespaces
included.

Modes:

``contend``  until ``--until`` (on the deadline clock): ``with coord.hold(R, fence=[store])``
             then a ``put`` of the key ``owner``; records ``held`` (epoch, store version). A
             grant whose reply was lost (OutcomeUnknown) or that found etcd unavailable is
             retried with the same request_id, as DESIGN §2 prescribes.
``hold``     ``with coord.hold(R)``: records ``held``, then every change of ``held.state`` until
             the lease is lost (or ``--seconds`` pass), then ``done``.
``acquire``  ``coord.acquire(R, wait=--wait)``: records ``granted`` (epoch) or ``failed``; with
             ``--hold`` > 0 it keeps the lease that long, then releases it (``released``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from typing import Any

import fenced
from fenced.core._clock import SystemClock

CLOCK = SystemClock()


class Recorder:
    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, event: str, **fields: Any) -> None:
        record = {"event": event, "t": CLOCK.now(), "pid": os.getpid(), **fields}
        os.write(self._fd, (json.dumps(record) + "\n").encode())


def contend(args: argparse.Namespace, out: Recorder) -> None:
    coord = fenced.connect(args.url)
    store = fenced.open_store(args.store)
    out.emit("ready")
    while CLOCK.now() < args.until:
        request_id = uuid.uuid4().hex
        for _ in range(200):
            try:
                with coord.hold(
                    args.resource, ttl=args.ttl, wait=10, fence=[store], request_id=request_id
                ) as held:
                    version = store.put(held.token, "owner", str(os.getpid()).encode())
                    out.emit("held", epoch=held.epoch, version=version.version)
                    time.sleep(0.002)
                break
            except (fenced.Unavailable, fenced.OutcomeUnknown) as error:
                out.emit("retry", error=type(error).__name__)
                time.sleep(0.02)
            except fenced.FencedError as error:  # LeaseLost, StaleToken, NotInstalled, Busy
                out.emit("error", error=f"{type(error).__name__}: {error}")
                break
    coord.close()
    store.close()


def hold(args: argparse.Namespace, out: Recorder) -> None:
    coord = fenced.connect(args.url)
    try:
        with coord.hold(args.resource, ttl=args.ttl, wait=args.wait) as held:
            out.emit("held", epoch=held.epoch, deadline=held.deadline)
            state = held.state
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                now = held.state
                if now is not state:
                    state = now
                    out.emit("state", state=now.name, deadline=held.deadline)
                if held.lost.is_set():
                    break
                time.sleep(0.005)
    except fenced.LeaseLost as error:
        out.emit("lost", reason=error.reason.name)
    out.emit("done")
    coord.close()


def acquire(args: argparse.Namespace, out: Recorder) -> None:
    # Started while the cluster may be electing a leader (the old one was just cut off): like
    # an application, retry connecting within the wait instead of dying of the first error.
    give_up = time.monotonic() + args.wait
    while True:
        try:
            coord = fenced.connect(args.url)
            break
        except (fenced.Unavailable, fenced.OutcomeUnknown) as error:
            if time.monotonic() >= give_up:
                out.emit("failed", error=f"{type(error).__name__}: {error}")
                return
            time.sleep(0.1)
    out.emit("ready")
    try:
        lease = coord.acquire(args.resource, ttl=args.ttl, wait=args.wait, holder=args.holder)
    except fenced.FencedError as error:
        out.emit("failed", error=f"{type(error).__name__}: {error}")
    else:
        out.emit("granted", epoch=lease.epoch, deadline=lease.deadline)
        if args.hold > 0:
            time.sleep(args.hold)
            out.emit("released", epoch=lease.epoch, released=coord.release(lease))
    coord.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["contend", "hold", "acquire"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--resource", default="exports/daily")
    parser.add_argument("--store", default="")
    parser.add_argument("--ttl", type=float, default=2.0)
    parser.add_argument("--wait", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--until", type=float, default=0.0)
    parser.add_argument("--hold", type=float, default=0.0)
    parser.add_argument("--holder", default=None)
    args = parser.parse_args()
    out = Recorder(args.out)
    {"contend": contend, "hold": hold, "acquire": acquire}[args.mode](args, out)


if __name__ == "__main__":
    main()
