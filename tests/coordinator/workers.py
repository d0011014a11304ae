"""Worker processes for test_processes.py: ``python workers.py MODE [options]``.

Each worker connects to the coordinator URL itself and records what happened as JSON lines
(``{"event": ..., "t": time.monotonic(), ...}``) appended to ``--out`` with one ``write`` each,
so the test can poll the file while the worker runs, pause it or kill it. ``time.monotonic`` is
CLOCK_MONOTONIC, shared by every process on the host, so times from different workers compare.

Modes:

``contend``   after a start barrier, loop acquire(wait) / release for ``--seconds``; one
              ``held`` record per grant with the [acquired, releasing) interval.
``hold``      ``with coord.hold(...)``; records every background renewal; once ``check()``
              raises (after a SIGSTOP past the ttl and a SIGCONT) records what ``check``,
              ``renew``, ``release`` and leaving the ``with`` block said.
``renewloop`` the same with a plain acquire and a renew loop in the main thread.
``loop``      acquire / release forever; each granted epoch is written and fsynced first.
``acontend``, ``ahold``, ``await``: the asyncio face (``contend``; a hold whose body sleeps
              until the loss cancels it; one waiting acquire).
``skewed``    with ``time.time`` stepped by ``--skew`` seconds (as NTP or an operator would):
              reads the parent's lease, tries to take it, waits for its release, then takes
              the resource with ``--ttl`` and exits without releasing.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import fenced
import fenced.aio


class Recorder:
    """Appends one JSON line per event; each line is written with a single ``write``."""

    def __init__(self, path: str, *, durable: bool = False) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._durable = durable

    def emit(self, event: str, **fields: Any) -> None:
        record = {"event": event, "t": time.monotonic(), "pid": os.getpid(), **fields}
        os.write(self._fd, (json.dumps(record) + "\n").encode())
        if self._durable:
            os.fsync(self._fd)


def _reason(error: fenced.LeaseLost) -> str:
    return error.reason.name


def contend(args: argparse.Namespace, out: Recorder) -> None:
    coord = fenced.connect(args.url)
    Path(args.ready).touch()
    while not Path(args.go).exists():
        time.sleep(0.001)
    end = time.monotonic() + args.seconds
    busy = 0
    # --waits: each acquire picks one of these patiences ("none": forever), so that waiters
    # give up while leases are being handed to them.
    waits = [None if w == "none" else float(w) for w in args.waits.split(",") if w]
    while time.monotonic() < end:
        wait = random.choice(waits) if waits else args.wait
        try:
            lease = coord.acquire(args.resource, ttl=args.ttl, wait=wait, holder=args.holder)
        except fenced.Busy:
            busy += 1
            continue
        acquired = time.monotonic()
        time.sleep(random.uniform(0, 0.001))  # the critical section
        releasing = time.monotonic()
        released = coord.release(lease)
        out.emit(
            "held", epoch=lease.epoch, acquired=acquired, releasing=releasing, released=released
        )
    out.emit("done", busy=busy)
    coord.close()


def _after_loss(coord: fenced.Coordinator, lease: fenced.Lease, out: Recorder) -> None:
    """What a resumed holder that lost its lease sees from renew() and release()."""
    try:
        coord.renew(lease)
        out.emit("renew-ok")
    except fenced.LeaseLost as error:
        out.emit("renew-lost", reason=_reason(error))
    # Pretend the local deadline had not passed: the coordinator itself must refuse.
    try:
        coord.renew(dataclasses.replace(lease, deadline=math.inf))
        out.emit("forced-renew-ok")
    except fenced.LeaseLost as error:
        out.emit("forced-renew-lost", reason=_reason(error))
    out.emit("release", released=coord.release(lease))


def hold(args: argparse.Namespace, out: Recorder) -> None:
    coord = fenced.connect(args.url)
    losses: list[str] = []
    try:
        with coord.hold(
            args.resource,
            ttl=args.ttl,
            wait=args.wait,
            holder=args.holder,
            on_lost=lambda error: losses.append(error.reason.name),
        ) as held:
            out.emit("acquired", epoch=held.epoch)
            last = held.lease
            while True:
                if held.lease is not last:
                    last = held.lease
                    out.emit("renewed", epoch=held.epoch)
                try:
                    held.check()
                except fenced.LeaseLost as error:
                    out.emit("check-lost", reason=_reason(error))
                    break
                time.sleep(0.001)
            _after_loss(coord, held.lease, out)
        out.emit("exit-ok")
    except fenced.LeaseLost as error:
        out.emit("exit-lost", reason=_reason(error), on_lost=losses)
    out.emit("done")
    coord.close()


def renewloop(args: argparse.Namespace, out: Recorder) -> None:
    coord = fenced.connect(args.url)
    lease = coord.acquire(args.resource, ttl=args.ttl, wait=args.wait, holder=args.holder)
    out.emit("acquired", epoch=lease.epoch)
    while True:
        time.sleep(args.ttl / 4)
        try:
            lease = coord.renew(lease)
        except fenced.LeaseLost as error:
            out.emit("renew-loop-lost", reason=_reason(error))
            break
        out.emit("renewed", epoch=lease.epoch)
    _after_loss(coord, lease, out)
    out.emit("done")
    coord.close()


def loop(args: argparse.Namespace, out: Recorder) -> None:
    coord = fenced.connect(args.url)
    Path(args.ready).touch()
    while True:
        lease = coord.acquire(args.resource, ttl=args.ttl, wait=args.wait, holder=args.holder)
        out.emit("granted", epoch=lease.epoch)  # durable before anything else happens
        coord.release(lease)


def skewed(args: argparse.Namespace, out: Recorder) -> None:
    real_time = time.time
    time.time = lambda: real_time() + args.skew
    coord = fenced.connect(args.url)
    info = coord.current(args.resource)
    out.emit(
        "current",
        epoch=None if info is None else info.epoch,
        expires_in=None if info is None else info.expires_in,
    )
    try:
        coord.acquire(args.resource, ttl=args.ttl, wait=0, holder=args.holder)
        out.emit("acquired-while-held")
    except fenced.Busy as error:
        out.emit("busy", epoch=error.epoch, remaining=error.remaining)
    lease = coord.acquire(args.resource, ttl=args.ttl, wait=args.wait, holder=args.holder)
    out.emit("acquired", epoch=lease.epoch)
    coord.close()  # no release: the lease must expire after ttl on the coordinator's clock


def acontend(args: argparse.Namespace, out: Recorder) -> None:
    """``contend`` on the asyncio face: the same records, every call awaited."""

    async def run() -> None:
        async with fenced.aio.connect(args.url) as coord:
            Path(args.ready).touch()
            while not Path(args.go).exists():
                await asyncio.sleep(0.001)
            end = time.monotonic() + args.seconds
            busy = 0
            while time.monotonic() < end:
                try:
                    lease = await coord.acquire(
                        args.resource, ttl=args.ttl, wait=args.wait, holder=args.holder
                    )
                except fenced.Busy:
                    busy += 1
                    continue
                acquired = time.monotonic()
                await asyncio.sleep(random.uniform(0, 0.001))  # the critical section
                releasing = time.monotonic()
                released = await coord.release(lease)
                out.emit(
                    "held",
                    epoch=lease.epoch,
                    acquired=acquired,
                    releasing=releasing,
                    released=released,
                )
            out.emit("done", busy=busy)

    asyncio.run(run())


def ahold(args: argparse.Namespace, out: Recorder) -> None:
    """``async with coord.hold(...)`` whose body waits in ``asyncio.sleep(3600)`` (a renewal
    watcher task records each renewal); records how the body and the block end."""

    async def run() -> None:
        losses: list[str] = []
        async with fenced.aio.connect(args.url) as coord:
            try:
                async with coord.hold(
                    args.resource,
                    ttl=args.ttl,
                    wait=args.wait,
                    holder=args.holder,
                    on_lost=lambda error: losses.append(error.reason.name),
                ) as held:
                    out.emit("acquired", epoch=held.epoch)

                    async def renewals() -> None:
                        last = held.lease
                        while True:
                            await asyncio.sleep(0.001)
                            if held.lease is not last:
                                last = held.lease
                                out.emit("renewed", epoch=held.epoch)

                    watcher = asyncio.create_task(renewals())
                    try:
                        await asyncio.sleep(3600)
                    except asyncio.CancelledError:
                        out.emit("body-cancelled", lost=held.lost.is_set())
                        raise
                    finally:
                        watcher.cancel()
                out.emit("exit-ok")
            except fenced.LeaseLost as error:
                out.emit("exit-lost", reason=_reason(error), on_lost=losses)
        out.emit("done")

    asyncio.run(run())


def await_turn(args: argparse.Namespace, out: Recorder) -> None:
    """Wait (``wait=None``) on the asyncio face; record the grant, hold it 0.1 s, release."""

    async def run() -> None:
        async with fenced.aio.connect(args.url) as coord:
            out.emit("waiting")
            lease = await coord.acquire(args.resource, ttl=args.ttl, wait=None, holder=args.holder)
            out.emit("acquired", epoch=lease.epoch)
            await asyncio.sleep(0.1)
            await coord.release(lease)
        out.emit("done")

    asyncio.run(run())


MODES = {
    "acontend": acontend,
    "ahold": ahold,
    "await": await_turn,
    "contend": contend,
    "hold": hold,
    "renewloop": renewloop,
    "loop": loop,
    "skewed": skewed,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=sorted(MODES))
    parser.add_argument("--url", required=True)
    parser.add_argument("--resource", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--holder", default=None)
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--wait", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--waits", default="")
    parser.add_argument("--ready", default="")
    parser.add_argument("--go", default="")
    parser.add_argument("--skew", type=float, default=0.0)
    args = parser.parse_args()
    out = Recorder(args.out, durable=args.mode == "loop")
    MODES[args.mode](args, out)


if __name__ == "__main__":
    main()
