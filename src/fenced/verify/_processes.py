"""Worker processes of a verification run, and the signals sent to them.

:class:`Run` owns one run's directory and history file; it starts worker processes
(``python -m fenced.verify._worker``) — each behind its own TCP proxies when the coordinator is
networked (:attr:`~fenced.verify._target.Target.proxied`) — waits for their events by tailing
the history, and sends
the real signals: SIGSTOP/SIGCONT (a pause, recorded as ``pause``/``resume`` events around the
signals, so the recorded pause contains the real one) and SIGKILL (recorded as ``kill``).
Every worker still running when the run closes is killed; nothing outlives a run.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

from fenced.testing.netlab import NetLab
from fenced.testing.proxy import TcpProxy
from fenced.verify._recorder import Event, HistoryTail, Recorder
from fenced.verify._target import endpoints, store_endpoint, with_endpoints, with_store_endpoint
from fenced.verify._worker import WorkerConfig

__all__ = ["STARTUP_TIMEOUT", "Run", "RunFailed", "WorkerProcess"]

STARTUP_TIMEOUT = 30.0
"""Seconds a worker process may take to start on a loaded machine."""


class RunFailed(Exception):
    """A scripted run did not come out as expected (the message says where)."""


class WorkerProcess:
    """One worker process: its command pipe (command mode), its signals, its stderr file."""

    def __init__(
        self,
        run: Run,
        config: WorkerConfig,
        mutants: Iterable[str],
        proxies: list[TcpProxy] | None = None,
        *,
        host: int | None = None,
        coordinator_relays: tuple[str, ...] = (),
        store_relays: tuple[str, ...] = (),
    ) -> None:
        self.run = run
        self.proxies = proxies or []
        """This worker's own TCP proxies to the coordinator (networked coordinators)."""
        self.host = host
        """Its host in the run's network lab (None: it runs in this namespace)."""
        self.coordinator_relays = coordinator_relays
        """The lab's relays that carry its connections to the coordinator."""
        self.store_relays = store_relays
        """The lab's relays that carry its connections to networked stores."""
        self.name = config.name
        self.config = config
        self.stderr_path = run.workdir / f"{config.name}.stderr"
        config.mutants = sorted(mutants)  # switched on by the worker itself, from its config
        command = config.mode == "command"
        with self.stderr_path.open("wb") as stderr:
            argv = [sys.executable, "-m", "fenced.verify._worker", config.to_json()]
            if host is not None and run.lab is not None:
                argv = run.lab.command(host, argv)  # ip netns exec: the same process, inside
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if command else subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        self._stdin: IO[bytes] | None = self.proc.stdin
        self._ids = itertools.count(1)
        self.paused = False
        self.killed = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    # -- commands ---------------------------------------------------------------------------------

    def send(self, op: str, **fields: Any) -> str:
        """Send a command; returns its id (the ``done`` event carries it as ``cmd``)."""
        if self._stdin is None:
            raise RunFailed(f"{self.name} takes no commands")
        cmd = f"{self.name}/{next(self._ids)}"
        line = json.dumps({"id": cmd, "op": op, **fields}) + "\n"
        try:
            self._stdin.write(line.encode())
            self._stdin.flush()
        except BrokenPipeError as error:
            raise RunFailed(f"{self.name} has exited: {self.stderr_tail()}") from error
        return cmd

    def done(self, cmd: str, timeout: float = 15.0) -> Event:
        """Wait for the ``done`` event of command ``cmd``."""
        return self.run.wait_for(
            lambda e: e["ev"] == "done" and e.get("cmd") == cmd,
            timeout,
            f"{self.name} to finish {cmd}",
            watch=self,
        )

    def call(self, op: str, timeout: float = 15.0, **fields: Any) -> Event:
        """Send a command and wait for its ``done`` event."""
        return self.done(self.send(op, **fields), timeout)

    # -- signals ----------------------------------------------------------------------------------

    def pause(self) -> None:
        """SIGSTOP, recorded as a ``pause`` event written before the signal."""
        if not self.alive() or self.paused:
            return
        self.run.rec.emit("pause", target=self.name, pid=self.pid)
        os.kill(self.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT, recorded as a ``resume`` event written after the signal."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
        self.paused = False
        self.run.rec.emit("resume", target=self.name, pid=self.pid)

    def kill(self) -> None:
        """SIGKILL (and reap), recorded as a ``kill`` event."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
                os.kill(self.pid, signal.SIGCONT)
            self.proc.wait()
            self.killed = True
            self.run.rec.emit("kill", target=self.name, pid=self.pid)
        self.paused = False
        self._close_pipe()

    def stopped(self) -> bool:
        """True if the process is stopped now (by SIGSTOP); does not consume the report."""
        if not self.alive():
            return False
        try:
            info = os.waitid(os.P_PID, self.pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        return info is not None and info.si_code == os.CLD_STOPPED

    def wait_stopped(self, timeout: float = 15.0) -> None:
        """Wait until the process is stopped (it stopped itself with SIGSTOP)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = os.waitid(os.P_PID, self.pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
            if info is not None and info.si_code == os.CLD_STOPPED:
                os.waitid(os.P_PID, self.pid, os.WSTOPPED | os.WNOHANG)  # consume it
                self.paused = True
                return
            if not self.alive():
                raise RunFailed(f"{self.name} exited instead of stopping: {self.stderr_tail()}")
            time.sleep(0.002)
        raise RunFailed(f"{self.name} did not stop within {timeout:.0f}s")

    def wait_exit(self, timeout: float) -> int | None:
        """Wait for the process to exit; None if it did not within ``timeout``."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if not self.alive():
                self._close_pipe()

    def _close_pipe(self) -> None:
        if self._stdin is not None:
            with contextlib.suppress(OSError):
                self._stdin.close()
            self._stdin = None

    def stderr_tail(self, lines: int = 8) -> str:
        try:
            text = self.stderr_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])


class Run:
    """One run: its directory, its history file, the verify process's recorder, its workers."""

    def __init__(
        self, workdir: Path, name: str, *, proxied: bool = False, lab: NetLab | None = None
    ) -> None:
        self.workdir = workdir
        self.proxied = proxied
        self.lab = lab
        """The network lab the workers run in (real partitions), if any."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.history = workdir / f"{name}.history.jsonl"
        self.rec = Recorder(self.history, "verify")
        self.tail = HistoryTail(self.history)
        self.workers: dict[str, WorkerProcess] = {}

    def spawn(self, config: WorkerConfig, mutants: Iterable[str] = ()) -> WorkerProcess:
        """Start a worker process for ``config`` (its history is this run's)."""
        config.history = str(self.history)
        proxies: list[TcpProxy] = []
        if self.lab is not None:
            return self._spawn_in_lab(self.lab, config, mutants)
        if self.proxied:
            for host, port in endpoints(config.coordinator):
                proxies.append(TcpProxy(host, port, lifetime=None).start())
            replaced = [("127.0.0.1", proxy.port) for proxy in proxies]
            config.coordinator = with_endpoints(config.coordinator, replaced)
        worker = WorkerProcess(self, config, mutants, proxies)
        self.workers[config.name] = worker
        return worker

    def _spawn_in_lab(
        self, lab: NetLab, config: WorkerConfig, mutants: Iterable[str]
    ) -> WorkerProcess:
        """A worker in a new host of ``lab``, reaching the coordinator and every networked store
        through relays of its own (which also carry the wire faults)."""
        host = lab.add_host()
        coordinator: list[str] = []
        for index, (address, port) in enumerate(endpoints(config.coordinator)):
            coordinator.append(f"{config.name}/coordinator/{index}")
            lab.add_relay(coordinator[-1], address, port)
        config.coordinator = with_endpoints(
            config.coordinator, [lab.address(r) for r in coordinator]
        )
        stores: list[str] = []
        config.stores = dict(config.stores)  # this worker's own: the run's stay as they are
        for role, url in sorted(config.stores.items()):
            found = store_endpoint(url)
            if found is not None:
                stores.append(f"{config.name}/store/{role}")
                lab.add_relay(stores[-1], *found)
                config.stores[role] = with_store_endpoint(url, lab.address(stores[-1]))
        worker = WorkerProcess(
            self,
            config,
            mutants,
            [lab.relay(r) for r in coordinator],
            host=host,
            coordinator_relays=tuple(coordinator),
            store_relays=tuple(stores),
        )
        self.workers[config.name] = worker
        return worker

    def wait_for(
        self,
        predicate: Callable[[Event], bool],
        timeout: float,
        what: str,
        *,
        watch: WorkerProcess | None = None,
        since: int = 0,
    ) -> Event:
        """The first recorded event matching ``predicate`` among those from index ``since`` on
        (seen so far or still to come; ``len(run.tail.events)`` marks "from now on")."""
        deadline = time.monotonic() + timeout
        checked = since
        while True:
            self.tail.poll()
            events = self.tail.events
            for event in events[checked:]:
                if predicate(event):
                    return event
            checked = len(events)
            if watch is not None and not watch.alive():
                self.tail.poll()
                for event in self.tail.events[checked:]:
                    if predicate(event):
                        return event
                raise RunFailed(
                    f"{watch.name} exited ({watch.proc.returncode}) while waiting for {what}: "
                    f"{watch.stderr_tail()}"
                )
            if time.monotonic() > deadline:
                raise RunFailed(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.003)

    def close(self) -> None:
        """Kill every worker still running; stop the proxies; close the recorder."""
        for worker in self.workers.values():
            if worker.alive():
                worker.kill()
            for proxy in worker.proxies:
                proxy.stop()
        self.rec.close()
