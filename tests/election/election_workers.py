"""Processes for test_election.py and test_elector.py: ``python election_workers.py MODE …``.

Each process connects to the coordinator URL itself and appends what happened as JSON lines
(``{"event": ..., "t": time.monotonic(), ...}``, one ``write`` each) to ``--out``, so the test can
poll the file while the process runs, pause it or kill it. ``time.monotonic`` is CLOCK_MONOTONIC,
shared by every process on the host, so times from different processes compare.

Modes:

``candidate``  once ``--go`` exists (if given), campaign for ``--name`` (``--rounds`` times;
               0 = until killed; again after an Unavailable). Once elected: one write to the
               strict ``--store`` with the term's token, then ``check()`` every 20 ms; proclaims
               the content of ``CONTROL/HOLDER.proclaim`` once it appears; resigns when
               ``CONTROL/HOLDER.resign`` appears or after ``--lead`` seconds. When ``check()``
               raises (a SIGSTOP past the ttl, then SIGCONT), records the loss, tries one more
               write with the lost term's token (as a paused process would), records the
               store's answer, and exits.
``observer``   ``coord.observe(--name)``: one ``change`` line per change.
``elector``    a :class:`fenced.Elector` for ``--name`` (``--store`` as its fence). Each
               callback records a line: ``started`` (term, token), ``wrote`` (one write with the
               term's token), ``stopped`` (the term, and whether it was lost), ``new-leader``
               (term, holder). ``on_started`` waits for ``leadership.ended``; when the term
               was lost (a SIGSTOP past the ttl, then SIGCONT) it tries one more write with the
               lost term's token and records the store's answer (``stale-write``) first.
               ``CONTROL/HOLDER.stop`` appearing makes a control thread call ``elector.stop()``
               (``stop-returned``); ``run-returned`` comes last.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import fenced


class Recorder:
    """Appends one JSON line per event; each line is written with a single ``write``."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, event: str, **fields: Any) -> None:
        record = {"event": event, "t": time.monotonic(), "pid": os.getpid(), **fields}
        os.write(self._fd, (json.dumps(record) + "\n").encode())


def _write(store: fenced.Store | None, token: fenced.FencingToken, holder: str) -> str:
    if store is None:
        return "no-store"
    try:
        store.put(token, "leader", holder.encode())
    except fenced.Rejected as error:
        return type(error).__name__
    return "accepted"


def lead(
    args: argparse.Namespace,
    out: Recorder,
    leadership: fenced.Leadership,
    store: fenced.Store | None,
) -> bool:
    """Lead until resigning (True) or losing (False)."""
    control = Path(args.control)
    elected_at = time.monotonic()
    # One write per term, finished before the test may pause us: a process paused inside a
    # SQLite write transaction would hold the store file's lock (and block the next leader's
    # install) until it is continued, which is SQLite's behaviour and not what this tests.
    out.emit("wrote", term=leadership.term, answer=_write(store, leadership.token, args.holder))
    proclaimed = False
    while True:
        if (control / f"{args.holder}.resign").exists() or (
            args.lead is not None and time.monotonic() - elected_at >= args.lead
        ):
            out.emit("resigning", term=leadership.term)
            released = leadership.resign()
            out.emit("resigned", term=leadership.term, released=released)
            return True
        proclaim = control / f"{args.holder}.proclaim"
        if not proclaimed and proclaim.exists():
            value = proclaim.read_text()
            leadership.proclaim(value)
            proclaimed = True
            out.emit("proclaimed", term=leadership.term, value=value)
        try:
            leadership.check()
        except fenced.LeaseLost as error:
            out.emit("lost", term=leadership.term, reason=error.reason.name)
            answer = _write(store, leadership.token, args.holder)  # as a paused process would
            out.emit("stale-write", term=leadership.term, answer=answer)
            return False
        time.sleep(0.02)


def candidate(args: argparse.Namespace, out: Recorder) -> None:
    coord = fenced.connect(args.url)
    store = fenced.open_store(args.store) if args.store else None
    fence = [store] if store is not None else []
    out.emit("ready")
    while args.go and not Path(args.go).exists():
        time.sleep(0.005)
    rounds = 0
    while args.rounds == 0 or rounds < args.rounds:
        rounds += 1
        out.emit("campaigning")
        try:
            with coord.campaign(
                args.name, args.value, args.ttl, fence=fence, holder=args.holder
            ) as leadership:
                out.emit(
                    "elected", term=leadership.term, token=str(leadership.token), value=args.value
                )
                if not lead(args, out, leadership, store):
                    break
        except fenced.LeaseLost as error:
            out.emit("exited-lost", reason=error.reason.name)
            break
        except fenced.Unavailable as error:  # the coordinator or a store: campaign again
            out.emit("campaign-failed", error=str(error))
            rounds -= 1
            time.sleep(0.05)
    out.emit("done")


def elector(args: argparse.Namespace, out: Recorder) -> None:
    coord = fenced.connect(args.url)
    store = fenced.open_store(args.store) if args.store else None
    terms: list[fenced.Leadership] = []

    def on_started(leadership: fenced.Leadership) -> None:
        terms.append(leadership)
        out.emit("started", term=leadership.term, token=str(leadership.token))
        out.emit("wrote", term=leadership.term, answer=_write(store, leadership.token, args.holder))
        leadership.ended.wait()  # lost (set at the local deadline at the latest) or stopped
        if leadership.lost.is_set():
            out.emit("lost", term=leadership.term)
            answer = _write(store, leadership.token, args.holder)  # as a paused process would
            out.emit("stale-write", term=leadership.term, answer=answer)

    def on_stopped() -> None:
        out.emit("stopped", term=terms[-1].term, lost=terms[-1].lost.is_set())

    def on_new_leader(change: fenced.LeaderChange) -> None:
        out.emit("new-leader", term=change.term, holder=change.holder)

    elector = fenced.Elector(
        coord,
        args.name,
        on_started,
        value=args.value,
        ttl=args.ttl,
        on_stopped=on_stopped,
        on_new_leader=on_new_leader,
        fence=[store] if store is not None else [],
        holder=args.holder,
    )

    def control() -> None:
        while not (Path(args.control) / f"{args.holder}.stop").exists():
            time.sleep(0.01)
        out.emit("stop-returned", stopped=elector.stop())

    controller = threading.Thread(target=control, daemon=True)
    controller.start()
    out.emit("ready")
    elector.run()
    controller.join(10)  # run() returned because of the stop: let stop() record its return
    out.emit("run-returned")


def observer(args: argparse.Namespace, out: Recorder) -> None:
    coord = fenced.connect(args.url)
    with coord.observe(args.name) as changes:
        out.emit("ready")
        for change in changes:
            out.emit("change", **change.to_json())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["candidate", "observer", "elector"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--holder", default="")
    parser.add_argument("--value", default="")
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--store", default="")
    parser.add_argument("--control", default=".")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--lead", type=float, default=None)
    parser.add_argument("--go", default="", help="wait for this file before campaigning")
    args = parser.parse_args()
    out = Recorder(args.out)
    {"candidate": candidate, "observer": observer, "elector": elector}[args.mode](args, out)


if __name__ == "__main__":
    main()
