"""A verification worker: one real OS process using the public API as a user would.

Run as ``python -m fenced.verify._worker CONFIG_JSON`` by :mod:`fenced.verify._cases` and
:mod:`fenced.verify._schedule`. The worker connects to the coordinator (through
:class:`~fenced.verify._faults.RecordingBackend`) and opens the stores (through
:class:`~fenced.verify._faults.RecordingStore`), so every call it makes is recorded in the run's
history file with the truth about its effect, and the wire faults of its
:class:`~fenced.verify._faults.FaultPlan` are injected. It emits its own events too:

``start`` / ``exit`` / ``crash``
    the process began (with its active mutants) / ended normally / ended with an unexpected
    exception (recorded, then raised);
``ready``
    random mode: the coordinator and the stores are open, the worker waits for the start
    barrier (opening a networked store may take a while: the schedule's work starts after it);
``lease``
    ``hold()`` returned: ``epoch``, the holder's local ``deadline`` (deadline clock), ``ttl``;
``check``
    ``held.check()`` just before a protected mutation: ``state`` and the ``deadline`` it used;
``lost``
    the ``on_lost`` callback ran (``reason``);
``unhold``
    the ``with`` block ended (``error`` if it ended with one);
``pause``
    the worker is about to stop itself with SIGSTOP (the verify process records ``resume``):
    between a lease check and its send, or (``in_commit``) inside a store's critical section,
    after the store decided a write and before it commits it;
``done``
    a command (command mode) finished, with its result.

Modes: ``random`` runs seeded leases of read-modify-write, publications and reads until the
configured monotonic ``end``; ``command`` reads one JSON command per line on stdin (the case
drivers script it). The protected value of key ``chain`` is a JSON document whose ``chain`` is a
list of ``[op_id, epoch]``: each accepted put appends exactly its own entry to the state it read,
so the final value lists every accepted write in order and the checker can prove there was no
lost update.

Seeded defects come from the configuration's ``mutants`` only: ``fenced verify --mutants``
names them for its own workers, and the worker builds its coordinator and stores with them
(:mod:`fenced.verify._seeded`); the library has no switch for them, and no environment variable
changes anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import sys
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from fenced.coordinator._client import Coordinator
from fenced.core._errors import (
    Busy,
    FencedError,
    LeaseLost,
    OutcomeUnknown,
    Rejected,
    Unavailable,
)
from fenced.fence._store import Store, open_store
from fenced.fence.backend import ORDINARY, Backend, Intent, Transaction
from fenced.runtime._keeper import HeldLease
from fenced.testing.aio_bridge import LoopThread
from fenced.verify import _seeded as seeded
from fenced.verify._aio_worker import (
    BridgedCoordinator,
    BridgedHeld,
    bridged_coordinator,
    bridged_store,
)
from fenced.verify._faults import FaultPlan, RecordingBackend, RecordingStore, error_fields
from fenced.verify._recorder import Recorder

__all__ = ["KEY", "WorkerConfig", "decode_chain", "encode_chain", "main"]

KEY = "chain"
"""The key of the protected value in every store."""
PUBLICATION = ""
"""The publication name the workers publish under."""


@dataclass
class WorkerConfig:
    """What a worker process is told (passed as JSON on its command line)."""

    name: str
    history: str
    coordinator: str
    resource: str
    stores: dict[str, str]
    """Store name (``S``, ``M``) → URL. The store's mode is the one it was created with."""
    fence: list[str]
    """Stores where ``hold()`` installs each new epoch (strict handoff)."""
    ttl: float
    margin: float
    mode: str = "command"
    seed: int = 0
    end: float = 0.0
    """Random mode: the monotonic time at which to stop taking new leases."""
    rates: dict[str, float] = field(default_factory=dict)
    """Random mode: wire fault probability per operation; ``stop``: of a self-stop before a send;
    ``reconcile_stop``: before asking again about a write of unknown outcome (default 3 × stop)."""
    kinds: dict[str, float] = field(default_factory=dict)
    """Random mode: weights of the wire fault kinds (empty: the default weights)."""
    mix: dict[str, float] = field(default_factory=dict)
    """Random mode: weights of ``rmw``, ``publish`` and ``observe`` (empty: 60/25/15)."""
    idle: float = 1.0
    """Random mode: scales the worker's pauses between operations."""
    ops: int = 6
    """Random mode: at most this many operations per lease."""
    pad: int = 0
    """Bytes of padding in every written value (larger values: longer write transactions)."""
    write_stores: list[str] = field(default_factory=list)
    """Random mode: the stores this worker writes to (empty: every store; reads go to all)."""
    commit_stops: float = 0.0
    """Random mode: probability that a write to a store of ``fence`` stops this process inside
    the store's critical section, after the store checked it and before the store commits it,
    for longer than the lease (see :class:`StopInCommit`)."""
    wait: float = 10.0
    go: str = ""
    """Random mode: wait for this file, then read ``end`` from it (a start barrier)."""
    mutants: list[str] = field(default_factory=list)
    """Seeded defects this worker builds its coordinator and stores with
    (:mod:`fenced.verify._seeded`)."""
    api: str = "sync"
    """``async``: the coordinator and stores are the asyncio face (:mod:`._aio_worker`)."""

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        return cls(**json.loads(text))


def decode_chain(value: bytes | None) -> list[list[Any]]:
    """The list of ``[op_id, epoch]`` entries stored as the protected value."""
    if not value:
        return []
    document = json.loads(value)
    chain = document.get("chain") if isinstance(document, dict) else None
    if not isinstance(chain, list):
        raise ValueError("the protected value is not a chain")
    return chain


def encode_chain(chain: list[list[Any]], pad: int = 0) -> bytes:
    """The protected value holding ``chain`` (and ``pad`` bytes of padding)."""
    document: dict[str, Any] = {"chain": chain}
    if pad:
        document["pad"] = "p" * pad
    return json.dumps(document, separators=(",", ":")).encode()


class StopInCommit:
    """A store backend whose transactions can stop this process between check and commit.

    Wraps the backend of one of this worker's stores (the backend contract's ``transaction``
    is the seam; everything else is the backend's own). When :meth:`arm`-ed, the next
    transaction whose body succeeded — the store has checked the token and decided the
    mutation — calls ``stop`` before the backend commits it. A correct store holds its lock
    (or database transaction) across the stop, so a successor's install waits for the commit;
    a store that checks and writes in separate steps lets the successor in between, and the
    stale commit then lands on top of the successor's (seeded defect ``check-then-write``).

    With ``floor-after-write`` seeded in the store, the stop moves to the window between the
    write's commit and the transaction that installs its epoch (:meth:`SeededStore.in_window`):
    a successor's fence lands there on every store kind, locked or not (an ``s3:`` store has no
    lock for the fence to queue behind: a stop before the commit lets the fence in first, and
    the writer's conditional commit then fails honestly).
    """

    def __init__(self, inner: Backend, stop: Callable[[], None]) -> None:
        self._inner = inner
        self._stop = stop
        self._armed = False
        self._in_window = False

    def arm(self, armed: bool = True) -> None:
        """Stop inside the next committed transaction (``False``: do not)."""
        self._armed = armed

    @contextlib.contextmanager
    def transaction(self, resource: str, intent: Intent = ORDINARY) -> Iterator[Transaction]:
        with self._inner.transaction(resource, intent) as tx:
            yield tx
            if not self._in_window:
                self._stop_if_armed()

    def _stop_if_armed(self) -> None:
        if self._armed:
            self._armed = False
            self._stop()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @classmethod
    def install(cls, store: Store, stop: Callable[[], None]) -> StopInCommit:
        """Put a StopInCommit between ``store`` and its backend; returns it."""
        wrapper = cls(store._backend, stop)
        store._backend = cast(Backend, wrapper)
        if isinstance(store, seeded.SeededStore):
            wrapper._in_window = store.in_window(wrapper._stop_if_armed)
        return wrapper


class Worker:
    """One worker process's state: coordinator, stores, the current hold, its recorder."""

    def __init__(self, config: WorkerConfig, recorder: Recorder, defects: frozenset[str]) -> None:
        self.config = config
        self.rec = recorder
        self.rng = random.Random(config.seed)
        kinds = config.kinds or None
        plan = FaultPlan(random.Random(config.seed ^ 0x5EED), config.rates, config.ttl, kinds)
        self.loop = LoopThread() if config.api == "async" else None
        self.coord: Coordinator | BridgedCoordinator
        if self.loop is not None:
            self.coord = bridged_coordinator(config.coordinator, recorder, plan, defects, self.loop)
        else:
            opened = seeded.coordinator_backend(config.coordinator, defects)
            self.coord = seeded.coordinator(RecordingBackend(opened, recorder, plan), defects)
        self.coord_plan = plan
        self.stores: dict[str, RecordingStore] = {}
        self.in_commit: dict[str, StopInCommit] = {}
        """Stores where writes may stop inside the critical section (``commit_stops``)."""
        for name, url in sorted(config.stores.items()):
            store_seed = config.seed ^ zlib.crc32(name.encode())
            store_plan = FaultPlan(random.Random(store_seed), config.rates, config.ttl, kinds)
            store = (
                cast(Store, bridged_store(url, self.loop))
                if self.loop is not None
                else seeded.store(open_store(url), defects)
            )
            if config.commit_stops > 0 and name in config.fence:
                self.in_commit[name] = StopInCommit.install(
                    store, lambda: self._pause_self(in_commit=True)
                )
            self.stores[name] = RecordingStore(store, name, recorder, store_plan)
        self.held: HeldLease | BridgedHeld | None = None
        self._stack: contextlib.ExitStack | None = None
        self._ops = 0
        self.pending: dict[str, Any] | None = None
        """The mutation being sent (until its outcome is known)."""
        self.last: dict[str, Any] | None = None
        """The last mutation sent (``retry`` sends it again)."""

    # -- leases ---------------------------------------------------------------------------------

    def hold(self, wait: float, request_id: str | None = None) -> int:
        """Enter ``coord.hold()``; returns the epoch. Raises what ``hold`` raises."""
        assert self.held is None
        stack = contextlib.ExitStack()
        held: HeldLease | BridgedHeld
        held = cast(
            "HeldLease | BridgedHeld",
            stack.enter_context(
                self.coord.hold(
                    self.config.resource,
                    self.config.ttl,
                    wait=wait,
                    fence=[self.stores[name] for name in self.config.fence],
                    holder=self.config.name,
                    request_id=request_id,
                    safety_margin=self.config.margin,
                    on_lost=lambda error: self.rec.emit(
                        "lost", epoch=held.epoch, reason=error.reason.value
                    ),
                )
            ),
        )
        self.held, self._stack = held, stack
        self.rec.emit("lease", epoch=held.epoch, deadline=held.deadline, ttl=self.config.ttl)
        return held.epoch

    def unhold(self) -> str | None:
        """Leave the ``with`` block (release); returns the error it ended with, if any."""
        stack, held = self._stack, self.held
        self._stack = self.held = None
        if stack is None or held is None:
            return None
        error: str | None = None
        try:
            stack.close()
        except FencedError as failure:
            error = type(failure).__name__
        self.rec.emit("unhold", epoch=held.epoch, error=error)
        return error

    def check(self) -> bool:
        """``held.check()`` before protected work, recorded with the deadline it used."""
        held = self.held
        if held is None:
            return False
        try:
            held.check()
        except LeaseLost as error:
            self.rec.emit(
                "check",
                epoch=held.epoch,
                state=held.state.value,
                deadline=held.deadline,
                reason=error.reason.value,
            )
            return False
        self.rec.emit("check", epoch=held.epoch, state="held", deadline=held.deadline)
        return True

    def _pause_self(self, *, in_commit: bool = False) -> None:
        extra = {"in_commit": True} if in_commit else {}
        self.rec.emit("pause", target=self.config.name, self_stop=True, **extra)
        os.kill(os.getpid(), signal.SIGSTOP)

    # -- protected work -------------------------------------------------------------------------

    def _op_id(self) -> str:
        self._ops += 1
        return f"{self.config.name}.{self._ops}"

    def rmw(
        self,
        store_name: str,
        *,
        pause: bool = False,
        reconcile: bool = True,
        unchecked: bool = False,
    ) -> str:
        """Read-modify-write of the chain in ``store_name``; returns the outcome's name.

        ``ok``, ``lost`` (the check refused), ``rejected`` (a newer owner exists: the lease is
        marked superseded), ``conflict``, ``unavailable`` or ``unknown`` (reconciliation failed
        or was not attempted). ``pause``: stop this process (SIGSTOP) between the lease check
        and the send. ``unchecked``: send without checking the lease first (a write that was
        already in flight; recorded as such).
        """
        held = self.held
        assert held is not None
        store = self.stores[store_name]
        item = store.get(self.config.resource, KEY)
        chain = decode_chain(None if item is None else item.value)
        base_version = 0 if item is None else item.version
        op_id = self._op_id()
        value = encode_chain([*chain, [op_id, held.epoch]], self.config.pad)
        if not unchecked and not self.check():
            return "lost"
        if pause:
            self._pause_self()
        self.pending = {
            "kind": "put",
            "store": store_name,
            "token": held.token,
            "value": value,
            "op_id": op_id,
            "if_version": base_version if store.mode == "monotonic" else None,
            "meta": {"base_version": base_version, "base_len": len(chain)},
        }
        if unchecked:
            self.pending["meta"]["unchecked"] = True
        in_commit = self.in_commit.get(store_name)
        if in_commit is None:
            return self._send(0, reconcile)
        in_commit.arm(self.rng.random() < self.config.commit_stops)
        try:
            return self._send(0, reconcile)
        finally:
            in_commit.arm(False)

    def publish(self, store_name: str, *, pause: bool = False, reconcile: bool = True) -> str:
        """Publish a small object naming its writer; returns the outcome's name (as rmw)."""
        held = self.held
        assert held is not None
        op_id = self._op_id()
        body = {"w": self.config.name, "epoch": held.epoch, "op_id": op_id}
        padding = "x" * self.rng.randint(16, 2048)
        data = json.dumps({**body, "pad": padding}).encode()
        if not self.check():
            return "lost"
        if pause:
            self._pause_self()
        self.pending = {
            "kind": "publish",
            "store": store_name,
            "token": held.token,
            "value": data,
            "op_id": op_id,
            "meta": {},
        }
        return self._send(0, reconcile)

    def retry(self, reconcile: bool = False) -> str:
        """Send the last mutation again with the same op id (reconciliation), whatever became
        of it: the store must answer with the first attempt's outcome if it took effect."""
        self.pending = self.pending or self.last
        if self.pending is None:
            return "nothing"
        return self._send(1, reconcile)

    def _send(self, attempt: int, reconcile: bool) -> str:
        pending = self.pending
        assert pending is not None
        self.last = pending
        store = self.stores[pending["store"]]
        meta = {**pending["meta"], "retry": attempt}
        while True:
            try:
                if pending["kind"] == "put":
                    store.put(
                        pending["token"],
                        KEY,
                        pending["value"],
                        op_id=pending["op_id"],
                        if_version=pending["if_version"],
                        meta=meta,
                    )
                else:
                    store.publish(
                        pending["token"],
                        pending["value"],
                        name=PUBLICATION,
                        op_id=pending["op_id"],
                        meta=meta,
                    )
            except OutcomeUnknown:
                if not reconcile or meta["retry"] >= 3:
                    return "unknown"
                # Did it land? Ask again with the same op id: sometimes at once, sometimes after a
                # pause past the lease, when a newer owner may have taken over (the store must
                # still answer with the first attempt's outcome).
                rates = self.config.rates
                stop = self.rng.random() < rates.get("reconcile_stop", rates.get("stop", 0.0) * 3)
                if stop:
                    self._pause_self()
                else:
                    time.sleep(0.01)
                meta["retry"] += 1
                continue
            except Rejected as error:
                self.pending = None
                if self.held is not None and self.held.token == pending["token"]:
                    self.held.superseded(f"{type(error).__name__} from store {store.name}")
                return "rejected"
            except Unavailable:
                return "unavailable"
            except FencedError as error:  # VersionConflict, IdempotencyConflict
                self.pending = None
                return "conflict" if type(error).__name__ == "VersionConflict" else "error"
            self.pending = None
            return "ok"

    def observe(self, store_name: str) -> None:
        """Read the floor, the publication pointer and the published bytes (all recorded)."""
        store = self.stores[store_name]
        store.floor(self.config.resource)
        store.latest(self.config.resource, PUBLICATION)
        store.read(self.config.resource, PUBLICATION)

    def close(self) -> None:
        with contextlib.suppress(FencedError):
            self.unhold()
        for store in self.stores.values():
            store.store.close()
        self.coord.close()
        if self.loop is not None:
            self.loop.close()

    # -- random mode ----------------------------------------------------------------------------

    def run_random(self) -> None:
        """Seeded leases of protected work until ``config.end`` (see the module docstring)."""
        rng, ttl = self.rng, self.config.ttl
        if self.config.go:
            self.rec.emit("ready")
            self.config.end = _await_go(self.config.go)
        request_id: str | None = None
        while time.monotonic() < self.config.end:
            request_id = request_id or uuid.uuid4().hex
            wait = max(0.0, min(self.config.end - time.monotonic(), 3 * ttl))
            try:
                self.hold(wait, request_id)
            except OutcomeUnknown:
                continue  # the grant may have happened: ask again with the same request id
            except (Busy, LeaseLost, Unavailable, Rejected):
                request_id = None
                time.sleep(rng.uniform(0, ttl / 4))
                continue
            request_id = None
            try:
                self._work()
            finally:
                self.unhold()
            time.sleep(rng.uniform(0, ttl / 4))

    def _work(self) -> None:
        rng, ttl, idle = self.rng, self.config.ttl, self.config.idle
        stores = sorted(self.stores)
        writable = sorted(self.config.write_stores) or stores
        mix = self.config.mix or {"rmw": 0.6, "publish": 0.25, "observe": 0.15}
        actions = sorted(mix)
        weights = [mix[a] for a in actions]
        for _ in range(rng.randint(1, self.config.ops)):
            if time.monotonic() >= self.config.end:
                return
            action = rng.choices(actions, weights=weights)[0]
            store = rng.choice(stores if action == "observe" else writable)
            stop = rng.random() < self.config.rates.get("stop", 0.0)
            if action == "rmw":
                outcome = self.rmw(store, pause=stop)
            elif action == "publish":
                outcome = self.publish(store, pause=stop)
            else:
                self.observe(store)
                outcome = "ok"
            if outcome in ("lost", "rejected"):
                return
            pause = rng.uniform(0, ttl / 8) if rng.random() < 0.95 else rng.uniform(0.3, 0.8) * ttl
            time.sleep(pause * idle)

    # -- command mode ---------------------------------------------------------------------------

    def run_commands(self) -> None:
        """Execute one JSON command per stdin line until ``exit`` or end of input."""
        for line in sys.stdin:
            if not line.strip():
                continue
            command = json.loads(line)
            result: dict[str, Any]
            try:
                result = self._command(command)
            except FencedError as error:
                result = {"outcome": "error", **error_fields(error)}
            self.rec.emit("done", cmd=command.get("id"), op=command.get("op"), **result)
            if command.get("op") == "exit":
                return

    def _command(self, command: dict[str, Any]) -> dict[str, Any]:
        op = command["op"]
        if op == "hold":
            epoch = self.hold(float(command.get("wait", self.config.wait)))
            return {"outcome": "ok", "epoch": epoch}
        if op == "unhold":
            return {"outcome": "ok", "error": self.unhold()}
        if op == "check":
            ok = self.check()
            held = self.held
            state = None if held is None else held.state.value
            return {"outcome": "ok" if ok else "lost", "state": state}
        if op == "rmw":
            return {"outcome": self.rmw(command["store"], **_rmw_flags(command))}
        if op == "publish":
            return {"outcome": self.publish(command["store"], **_flags(command))}
        if op == "retry":
            return {"outcome": self.retry(bool(command.get("reconcile", False)))}
        if op == "observe":
            self.observe(command["store"])
            return {"outcome": "ok"}
        if op == "arm":
            target = command["target"]
            plan = self.coord_plan if target == "coord" else self.stores[target].plan
            plan.arm(
                command["call"],
                command["fault"],
                delay=float(command.get("delay", 0.0)),
                times=int(command.get("times", 1)),
            )
            return {"outcome": "ok"}
        if op == "acquire_nowait":
            try:
                lease = self.coord.acquire(
                    self.config.resource, self.config.ttl, wait=0, holder=self.config.name
                )
            except Busy as busy:
                return {
                    "outcome": "busy",
                    "holder": busy.holder,
                    "epoch": busy.epoch,
                    "remaining": busy.remaining,
                }
            self.coord.release(lease)
            return {"outcome": "granted", "epoch": lease.epoch}
        if op == "sleep":
            time.sleep(float(command["seconds"]))
            return {"outcome": "ok"}
        if op == "exit":
            return {"outcome": "ok"}
        raise ValueError(f"unknown command {op!r}")


def _await_go(path: str, timeout: float = 60.0) -> float:
    """Wait for the start barrier file; returns the monotonic end time written in it."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        with contextlib.suppress(FileNotFoundError, ValueError), open(path) as stream:
            return float(stream.read())
        time.sleep(0.005)
    raise TimeoutError(f"no start signal in {path} after {timeout:.0f}s")


def _flags(command: dict[str, Any]) -> dict[str, bool]:
    return {"pause": bool(command.get("pause")), "reconcile": bool(command.get("reconcile"))}


def _rmw_flags(command: dict[str, Any]) -> dict[str, bool]:
    return {**_flags(command), "unchecked": bool(command.get("unchecked"))}


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m fenced.verify._worker CONFIG_JSON``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fenced.verify._worker CONFIG_JSON", file=sys.stderr)
        return 2
    config = WorkerConfig.from_json(args[0])
    defects = seeded.chosen(config.mutants)
    logging.getLogger("fenced").setLevel(logging.CRITICAL)  # the history says it all
    recorder = Recorder(config.history, config.name)
    recorder.emit("start", mode=config.mode, mutants=sorted(defects), seed=config.seed)
    try:
        worker = _open(config, recorder, defects)
        try:
            if config.mode == "random":
                worker.run_random()
            else:
                worker.run_commands()
        finally:
            worker.close()
    except Exception as error:
        recorder.emit("crash", error=f"{type(error).__name__}: {error}")
        raise
    recorder.emit("exit")
    return 0


def _open(config: WorkerConfig, recorder: Recorder, defects: frozenset[str]) -> Worker:
    """The worker's coordinator and stores; a busy database at start-up is retried."""
    for attempt in range(20):
        try:
            return Worker(config, recorder, defects)
        except Unavailable:
            if attempt == 19:
                raise
            time.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")


if __name__ == "__main__":
    sys.exit(main())
