"""A partition scheduler whose demoted leader cannot assign anything: election with fenced terms.

Several scheduler processes campaign for ``scheduler/partitions``; the leader assigns each
partition of a topic to a worker by writing ``partition/NN -> worker`` into a **strict** store,
with its term's fencing token. ``campaign(..., fence=[store])`` installs every new term at the
store before the new leader does anything, so from then on the store rejects every write of an
older term — including the writes of a leader that was paused in the middle of its round and
does not know yet that it was demoted.

Run the story (a few seconds, temporary files only; exit status 0 when it came out right)::

    python examples/partition_scheduler.py --demo

or run schedulers yourself, each in its own terminal (stop one with Ctrl-C or SIGSTOP)::

    python examples/partition_scheduler.py --name A --url sqlite:////tmp/s/coord.db \
        --store sqlite:////tmp/s/assignments.db
    python examples/partition_scheduler.py --name B --url sqlite:////tmp/s/coord.db \
        --store sqlite:////tmp/s/assignments.db
    fenced leader scheduler/partitions --watch --url sqlite:////tmp/s/coord.db

Only the public API of ``fenced`` is used.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import fenced

ELECTION = "scheduler/partitions"
PARTITIONS = 8
WORKERS = ("worker-a", "worker-b", "worker-c")


# -- one scheduler process -----------------------------------------------------------------


def say(event: str, **fields: Any) -> None:
    """One JSON line on stdout: what the demo driver (or you) reads."""
    print(json.dumps({"event": event, **fields}), flush=True)


def plan(leader: str, round_number: int) -> dict[int, str]:
    """Which worker gets which partition (a stand-in for real balancing)."""
    shift = round_number + sum(map(ord, leader))
    return {p: WORKERS[(p + shift) % len(WORKERS)] for p in range(PARTITIONS)}


def schedule(args: argparse.Namespace) -> int:
    """Campaign, then assign partitions every ``--interval`` seconds while leading."""
    coord = fenced.connect(args.url)
    store = fenced.open_store(args.store, "strict")
    say("campaigning", name=args.name)

    def lost(error: fenced.LeaseLost) -> None:
        say("lost", name=args.name, reason=error.reason.value)

    try:
        with coord.campaign(
            ELECTION, args.name, ttl=args.ttl, fence=[store], holder=args.name, on_lost=lost
        ) as leadership:
            say("elected", name=args.name, term=leadership.term)
            round_number = 0
            while True:
                leadership.check()  # LeaseLost once demoted: stop assigning
                assignments = plan(args.name, round_number)
                say("planned", name=args.name, term=leadership.term, round=round_number)
                if round_number == args.pause_at_round:  # the demo: a long GC pause, right here
                    os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(args.think)  # a pause here is the dangerous window
                try:
                    for partition, worker in assignments.items():
                        store.put(leadership.token, f"partition/{partition:02d}", worker.encode())
                except fenced.StaleToken as error:
                    say("rejected", name=args.name, term=leadership.term, floor=error.floor)
                    leadership.superseded(str(error))
                    return 0  # a newer leader exists: step down (the with block says why)
                say("assigned", name=args.name, term=leadership.term, round=round_number)
                round_number += 1
                time.sleep(args.interval)
    except fenced.LeaseLost as error:
        say("stepped-down", name=args.name, reason=error.reason.value)
        return 0
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the with block released the term
        say("stopped", name=args.name)
        return 0
    finally:
        store.close()
        coord.close()


# -- the demo ------------------------------------------------------------------------------


class Scheduler:
    """A scheduler process started by the demo, and the JSON lines it printed."""

    def __init__(self, name: str, coordinator: str, store: str, ttl: float, *options: str) -> None:
        self.name = name
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        argv = [sys.executable, __file__, "--name", name, "--url", coordinator, "--store", store]
        argv += ["--ttl", str(ttl), "--think", "0.1", "--interval", "0.1", *options]
        self.log = Path(coordinator.removeprefix("sqlite:///")).with_name(f"{name}.log")
        with self.log.open("w") as log:  # the library's warnings (lost, rejected) go here
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def wait_for(self, event: str, timeout: float = 20.0) -> dict[str, Any]:
        """The next ``event`` line of this scheduler (the ones before it are kept in seen)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise TimeoutError(f"scheduler {self.name} never said {event!r}") from None
            self.seen.append(line)
            if line["event"] == event:
                return line

    def stop(self) -> None:
        """Let it finish if it is finishing anyway, else interrupt it (it releases its term)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            try:
                self.proc.wait(0.5)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()


def demo(ttl: float) -> int:
    started = time.monotonic()

    def tell(text: str) -> None:
        print(f"[{time.monotonic() - started:5.2f}s] {text}", flush=True)

    with tempfile.TemporaryDirectory(prefix="partition-scheduler-") as tmp:
        coordinator = f"sqlite:///{Path(tmp) / 'coordinator.db'}"
        store_url = f"sqlite:///{Path(tmp) / 'assignments.db'}"
        coord = fenced.connect(coordinator)
        terms: list[fenced.LeaderChange] = []
        observer = coord.observe(ELECTION)

        def narrate() -> None:
            for change in observer:
                terms.append(change)
                what = f"value {change.value}" if change.reason is None else change.reason
                tell(f"observer: {change.kind.value} term {change.term} ({what})")

        threading.Thread(target=narrate, daemon=True).start()
        a = Scheduler("A", coordinator, store_url, ttl, "--pause-at-round", "1")
        b: Scheduler | None = None
        try:
            elected_a = a.wait_for("elected")
            tell(f"A is the leader: term {elected_a['term']}")
            a.wait_for("assigned")
            tell(f"A assigned {PARTITIONS} partitions with term {elected_a['term']}")
            b = Scheduler("B", coordinator, store_url, ttl)
            b.wait_for("campaigning")
            tell("B campaigns and waits in the queue")
            a.wait_for("planned")
            tell("A has planned its next round and pauses (SIGSTOP) before assigning it")
            elected_b = b.wait_for("elected")
            tell(
                f"A's term expired; B is elected: term {elected_b['term']}, installed at the store"
            )
            b.wait_for("assigned")
            tell(f"B assigned {PARTITIONS} partitions with term {elected_b['term']}")
            os.kill(a.proc.pid, signal.SIGCONT)
            tell("A is continued: it carries on with its round, unaware")
            rejected = a.wait_for("rejected")
            tell(f"the store rejected A's assignment (term {rejected['term']}): stale token")
            a.wait_for("stepped-down")
            tell("A learns it lost the leadership (LeaseLost) and steps down")
        except TimeoutError:
            for scheduler in (a, b):
                if scheduler is not None:
                    print(f"--- scheduler {scheduler.name}: {scheduler.seen}", file=sys.stderr)
                    print(scheduler.log.read_text(), file=sys.stderr)
            raise
        finally:
            for scheduler in (a, b):
                if scheduler is not None:
                    scheduler.stop()
            observer.close()
        store = fenced.open_store(store_url)
        owners = {p: store.get(ELECTION, f"partition/{p:02d}") for p in range(PARTITIONS)}
        store.close()
        coord.close()
        epochs = {item.epoch for item in owners.values() if item is not None}
        elected = [c.term for c in terms if c.kind is fenced.LeaderChangeKind.ELECTED]
        checks = {
            "B's term is newer than A's": elected_b["term"] > elected_a["term"],
            "A's late assignment was rejected": rejected["term"] == elected_a["term"],
            "every partition is assigned by B's term": epochs == {elected_b["term"]},
            "the observer saw A's term, then B's": elected[:2]
            == [elected_a["term"], elected_b["term"]],
        }
    print()
    for what, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
    return 0 if all(checks.values()) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", action="store_true", help="tell the whole story and check it")
    parser.add_argument("--name", help="this scheduler's name (advertised as its value)")
    parser.add_argument("--url", help="coordinator URL, e.g. sqlite:////tmp/s/coord.db")
    parser.add_argument("--store", help="strict store URL, e.g. sqlite:////tmp/s/assignments.db")
    parser.add_argument("--ttl", type=float, default=1.0, help="term lifetime in seconds")
    parser.add_argument("--think", type=float, default=0.4, help="seconds spent planning")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between rounds")
    parser.add_argument(
        "--pause-at-round",
        type=int,
        default=-1,
        help="stop this process (SIGSTOP) after planning round N",
    )
    args = parser.parse_args()
    if args.demo:
        return demo(args.ttl)
    if not (args.name and args.url and args.store):
        parser.error("--name, --url and --store are required (or --demo)")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop as Ctrl-C does
    return schedule(args)


if __name__ == "__main__":
    sys.exit(main())
