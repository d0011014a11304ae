"""Running a child process under a held lease: what ``fenced run`` (and ``fenced elect``) do.

:class:`ChildSupervisor` starts a command in **its own process group** with the lease in its
environment (``FENCED_TOKEN``, ``FENCED_RESOURCE``, ``FENCED_EPOCH``, ``FENCED_URL``), then
supervises it until it exits:

* **Lease lost** (the ``on_lost`` signal of the :class:`~fenced.runtime._keeper.HeldLease`, or its
  local deadline passing): the whole process group gets ``SIGTERM`` (and ``SIGCONT``, so that a
  stopped child sees it), then ``SIGKILL`` after ``grace`` seconds if the command is still alive.
  Processes of the group that outlive the command get the rest of the grace, then ``SIGKILL``.
  The loss is read from the lease (on the clock of its deadline, which counts host suspend),
  when ``on_lost`` wakes the supervisor and at least every quarter second (so also at the resume
  of a suspended host). The grace is measured on CLOCK_MONOTONIC: time the command could run,
  which a host suspend does not consume.
* **Signals to the supervisor** (with ``handle_signals``, in the main thread): ``SIGHUP``,
  ``SIGINT``, ``SIGQUIT``, ``SIGTERM``, ``SIGUSR1`` and ``SIGUSR2`` are forwarded to the child's
  process group; nothing is escalated (the child decides how to react). ``SIGTSTP`` (Ctrl-Z) is
  forwarded and then the supervisor stops itself, as a shell job would; when continued it
  continues the child. A child that reads from the supervisor's terminal is given the terminal
  (it becomes the terminal's foreground process group) and is continued.

Timeline of a loss (``fenced run`` paused with SIGSTOP, as in a long GC pause)::

    t0  acquire: epoch 7; child starts with FENCED_EPOCH=7
    t1  fenced run is stopped; its renewals stop; the child keeps running (own process group)
    t2  the coordinator expires epoch 7 and grants epoch 8 to another worker
    t3  fenced run continues: the local deadline has passed -> LOST -> SIGTERM to the child's group
    t3+grace  SIGKILL if the child is still alive; run() returns with ``lost`` set

Stopping the child is best effort and comes late by design (at the deadline at the earliest,
after a pause at the end of the pause): between t2 and t3 the old child may still try to write.
**The fence at the store is the guarantee**: its epoch-7 writes are rejected once epoch 8 is
installed there. If the supervisor itself is killed with SIGKILL, nobody signals the child; its
lease expires after the ttl and the stores reject it the same way.

This module depends only on :mod:`fenced.core` and :mod:`fenced.runtime`.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

from fenced.core._errors import ConfigurationError, LeaseLost
from fenced.core._token import FencingToken

__all__ = [
    "DEFAULT_GRACE",
    "FORWARDED_SIGNALS",
    "ChildResult",
    "ChildSupervisor",
    "LeaseSignal",
    "StartFailed",
    "child_environment",
    "describe_returncode",
    "validate_grace",
]

DEFAULT_GRACE = 10.0
"""Seconds between SIGTERM and SIGKILL after a loss (as ``docker stop``)."""
FORWARDED_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
"""Signals the supervisor forwards to the child's process group (with ``handle_signals``)."""

_TICK = 0.25
"""Safety re-check interval of the loop; events (exit, loss, signals) wake it immediately."""
_TICK_WITHOUT_PIDFD = 0.02
"""Without pidfd (old kernels, other systems) the child's exit is noticed by polling."""
_MAX_GRACE = 24 * 3600.0

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class StartFailed(Exception):
    """The command could not be started; nothing ran. ``error`` is the :class:`OSError`.

    ``exit_status`` is what a shell would answer: 127 (not found) or 126 (not executable).
    """

    def __init__(self, argv0: str, error: OSError) -> None:
        self.argv0 = argv0
        self.error = error
        not_found = isinstance(error, FileNotFoundError | NotADirectoryError)
        self.exit_status = 127 if not_found else 126
        what = "command not found" if not_found else "cannot execute"
        super().__init__(f"{argv0}: {what} ({error.strerror or error})")


class LeaseSignal(Protocol):
    """What the supervisor needs of a held lease (:class:`~fenced.runtime._keeper.HeldLease`)."""

    @property
    def token(self) -> FencingToken: ...

    def loss(self) -> LeaseLost | None:
        """Why the lease is lost, or None while it is held (or uncertain)."""
        ...


@dataclass(frozen=True, slots=True)
class ChildResult:
    """How a supervised command ended.

    ``returncode`` follows :mod:`subprocess`: the exit code, or ``-N`` if signal N killed the
    command. ``lost`` is the loss when the lease was lost before the command's exit was seen (its
    last effects were unauthorised; stores reject them), else None: the lease was held
    throughout. ``signalled`` lists the signals the supervisor sent because of the loss;
    ``forwarded`` the signals it forwarded from its own signal handlers.
    """

    argv: tuple[str, ...]
    pid: int
    returncode: int
    lost: LeaseLost | None
    signalled: tuple[signal.Signals, ...] = ()
    forwarded: tuple[signal.Signals, ...] = ()

    @property
    def exit_status(self) -> int:
        """The status a shell would report: the exit code, or 128 + N for a death by signal N."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    @property
    def killed(self) -> bool:
        """True if the supervisor had to escalate to SIGKILL."""
        return signal.SIGKILL in self.signalled

    def describe(self) -> str:
        """A human summary: ``exited with status 3`` or ``was killed by SIGTERM``."""
        return describe_returncode(self.returncode)


def describe_returncode(returncode: int) -> str:
    """``exited with status N`` or ``was killed by SIGNAME`` for a :mod:`subprocess` code."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name}"


def validate_grace(grace: object) -> float:
    """Return ``grace`` (seconds, 0 to one day) as float, or raise :class:`ConfigurationError`."""
    if isinstance(grace, bool) or not isinstance(grace, int | float):
        raise ConfigurationError(f"grace must be a number of seconds, got {grace!r}")
    value = float(grace)
    if not math.isfinite(value) or not 0 <= value <= _MAX_GRACE:
        raise ConfigurationError(f"grace must be between 0 and {_MAX_GRACE:.0f} seconds")
    return value


def child_environment(
    token: FencingToken, url: str | None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The child's environment: ``base`` (default ``os.environ``) plus the lease.

    ``FENCED_TOKEN`` is ``str(token)`` (parse it with ``FencingToken.parse``),
    ``FENCED_RESOURCE`` and ``FENCED_EPOCH`` repeat its resource and epoch, ``FENCED_URL`` is
    the coordinator URL (removed when ``url`` is None, so that an inherited one cannot mislead).
    """
    env = dict(os.environ if base is None else base)
    env["FENCED_TOKEN"] = str(token)
    env["FENCED_RESOURCE"] = token.resource
    env["FENCED_EPOCH"] = str(token.epoch)
    if url is None:
        env.pop("FENCED_URL", None)
    else:
        env["FENCED_URL"] = url
    return env


def _os_error(kind: type[OSError], code: int, filename: str) -> OSError:
    return kind(code, os.strerror(code), filename)


def _kill_group(pgid: int, signum: int) -> bool:
    """Send ``signum`` to process group ``pgid``; False if the group is gone."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def _ignoring_sigttou() -> Iterator[None]:
    """A background process may change the terminal's foreground group only with SIGTTOU ignored."""
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTTOU, previous)


class _Terminal:
    """The supervisor's controlling terminal; the command gets it when it needs to read it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.given_to: int | None = None

    @classmethod
    def find(cls) -> _Terminal | None:
        """The controlling terminal on fd 0, 1 or 2, whether we are in its foreground or not."""
        for fd in (0, 1, 2):
            try:
                if os.isatty(fd):
                    os.tcgetpgrp(fd)  # ENOTTY unless it is our session's controlling terminal
                    return cls(fd)
            except OSError:
                continue
        return None

    def ours(self) -> bool:
        try:
            return os.tcgetpgrp(self.fd) == os.getpgrp()
        except OSError:
            return False

    def give(self, pgid: int) -> None:
        with contextlib.suppress(OSError), _ignoring_sigttou():
            os.tcsetpgrp(self.fd, pgid)
            self.given_to = pgid

    def take_back(self) -> None:
        if self.given_to is None:
            return
        with contextlib.suppress(OSError), _ignoring_sigttou():
            if os.tcgetpgrp(self.fd) == self.given_to:
                os.tcsetpgrp(self.fd, os.getpgrp())
        self.given_to = None


class ChildSupervisor:
    """Runs one command under a held lease; single use.

    Usage (the supervisor must exist before the lease, so that the loss wakes it at once)::

        supervisor = ChildSupervisor(["./export.sh"], grace=10, url=coord.url)
        with coord.hold("exports/daily", ttl=30, wait=None, on_lost=supervisor.on_lost) as held:
            result = supervisor.run(held)

    ``handle_signals`` (default) installs signal handlers for the duration of :meth:`run`
    (forwarding, Ctrl-Z, terminal hand-over; see the module docstring); it requires the main
    thread. Pass False from other threads: loss supervision works the same.

    Invalid ``argv`` or ``grace`` raise :class:`ConfigurationError` at construction.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        grace: float = DEFAULT_GRACE,
        url: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        handle_signals: bool = True,
    ) -> None:
        if isinstance(argv, str | bytes) or not argv:
            raise ConfigurationError("the command must be a non-empty list of arguments")
        if not all(isinstance(arg, str) and "\x00" not in arg for arg in argv):
            raise ConfigurationError("every argument of the command must be a str without NUL")
        self._argv = tuple(argv)
        self._grace = validate_grace(grace)
        self._url = url
        self._env = None if env is None else dict(env)
        self._cwd = cwd
        self._handle_signals = handle_signals
        self._lock = threading.RLock()  # re-entrant: _wake also runs in signal handlers
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._closed = False
        self._used = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._pending: list[signal.Signals] = []
        self._forwarded: list[signal.Signals] = []
        self._terminal: _Terminal | None = None
        self._wants_terminal = False

    @property
    def argv(self) -> tuple[str, ...]:
        return self._argv

    @property
    def grace(self) -> float:
        return self._grace

    def check_command(self) -> None:
        """Raise :class:`StartFailed` now if the command cannot be found or executed.

        A friendly early check (call it before acquiring, so that a typo costs no epoch); the
        authoritative answer is still the start itself in :meth:`run`.
        """
        argv0 = self._argv[0]
        env = os.environ if self._env is None else self._env
        if os.sep in argv0:
            path = os.path.join(os.fspath(self._cwd or "."), argv0)
            if not os.path.exists(path):
                raise StartFailed(argv0, _os_error(FileNotFoundError, errno.ENOENT, argv0))
            if os.path.isdir(path) or not os.access(path, os.X_OK):
                raise StartFailed(argv0, _os_error(PermissionError, errno.EACCES, argv0))
        elif shutil.which(argv0, path=env.get("PATH", os.defpath)) is None:
            raise StartFailed(argv0, _os_error(FileNotFoundError, errno.ENOENT, argv0))

    # -- signals into the supervisor ------------------------------------------------------
    def on_lost(self, error: LeaseLost) -> None:
        """The ``on_lost`` callback to pass to ``hold()``: wakes :meth:`run` at once.

        Thread-safe, never raises; harmless before :meth:`run` and after it returned.
        """
        del error  # run() asks the lease itself, so a late or early call cannot confuse it
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            if self._closed:
                return
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"!")

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass

    def close(self) -> None:
        """Release the supervisor's file descriptors; idempotent (:meth:`run` calls it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)

    # -- running --------------------------------------------------------------------------
    def run(self, lease: LeaseSignal) -> ChildResult:
        """Start the command and supervise it until it exits; return how it ended.

        Raises :class:`LeaseLost` without starting anything if the lease is already lost, and
        :class:`StartFailed` if the command cannot be started (not found, not executable). If
        the supervisor itself fails unexpectedly, the child's group is killed before the error
        propagates: a child is never left running unsupervised by this method.
        """
        if self._used:
            raise RuntimeError("a ChildSupervisor runs one command only")
        self._used = True
        try:
            if self._handle_signals and threading.current_thread() is not threading.main_thread():
                raise ConfigurationError(
                    "signal handling needs the main thread; pass handle_signals=False"
                )
            error = lease.loss()
            if error is not None:
                raise LeaseLost(error.reason, f"{error.detail}; the command was not started")
            with self._signal_handling():
                try:
                    proc = subprocess.Popen(
                        self._argv,
                        env=child_environment(lease.token, self._url, self._env),
                        cwd=self._cwd,
                        process_group=0,
                    )
                except OSError as failure:
                    raise StartFailed(self._argv[0], failure) from failure
                self._proc = proc
                try:
                    for signum in self._pending:
                        self._forward(signum)
                    self._pending.clear()
                    return self._supervise(proc, lease)
                finally:
                    if proc.returncode is None:  # only on an unexpected failure of ours
                        _kill_group(proc.pid, signal.SIGKILL)
                        proc.wait()
                    if self._terminal is not None:
                        self._terminal.take_back()
        finally:
            self.close()

    def _supervise(self, proc: subprocess.Popen[bytes], lease: LeaseSignal) -> ChildResult:
        pgid = proc.pid
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            pidfd = os.pidfd_open(proc.pid)
            poller.register(pidfd, select.POLLIN)
        tick = _TICK if pidfd is not None else _TICK_WITHOUT_PIDFD
        lost: LeaseLost | None = None
        signalled: list[signal.Signals] = []
        kill_at = math.inf
        try:
            while True:
                returncode = proc.poll()
                if returncode is not None:
                    break
                if lost is None:
                    lost = lease.loss()
                    if lost is not None:
                        _kill_group(pgid, signal.SIGTERM)
                        _kill_group(pgid, signal.SIGCONT)
                        signalled.append(signal.SIGTERM)
                        kill_at = time.monotonic() + self._grace
                if (
                    lost is not None
                    and signal.SIGKILL not in signalled
                    and time.monotonic() >= kill_at
                ):
                    _kill_group(pgid, signal.SIGKILL)
                    signalled.append(signal.SIGKILL)
                self._job_control(proc)
                timeout = tick
                if lost is not None and signal.SIGKILL not in signalled:
                    timeout = min(tick, max(kill_at - time.monotonic(), 0.0))
                poller.poll(math.ceil(timeout * 1000))
                self._drain()
        finally:
            if pidfd is not None:
                os.close(pidfd)
        if lost is None:
            lost = lease.loss()  # lost before we noticed the exit: not held throughout
        if signalled:
            self._finish_group(pgid, kill_at, signalled)
        return ChildResult(
            self._argv, proc.pid, returncode, lost, tuple(signalled), tuple(self._forwarded)
        )

    @staticmethod
    def _finish_group(pgid: int, kill_at: float, signalled: list[signal.Signals]) -> None:
        """After a loss: what is left of the group gets the rest of the grace, then SIGKILL."""
        while _kill_group(pgid, 0):
            if time.monotonic() >= kill_at:
                if _kill_group(pgid, signal.SIGKILL) and signal.SIGKILL not in signalled:
                    signalled.append(signal.SIGKILL)
                return
            time.sleep(0.02)

    # -- signal handling (main thread only) -----------------------------------------------
    @contextlib.contextmanager
    def _signal_handling(self) -> Iterator[None]:
        if not self._handle_signals:
            yield
            return
        self._terminal = _Terminal.find()
        wanted: dict[signal.Signals, _Handler] = dict.fromkeys(FORWARDED_SIGNALS, self._on_signal)
        wanted[signal.SIGTSTP] = self._on_stop_request
        if self._terminal is not None:
            wanted[signal.SIGCHLD] = self._on_wake_signal
            wanted[signal.SIGCONT] = self._on_wake_signal
        previous: dict[signal.Signals, _Handler] = {}
        try:
            for signum, handler in wanted.items():
                previous[signum] = signal.signal(signum, handler)
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self._forward(signal.Signals(signum))
        self._wake()

    def _forward(self, signum: signal.Signals) -> None:
        proc = self._proc
        if proc is None:
            self._pending.append(signum)
            return
        if proc.returncode is None and _kill_group(proc.pid, signum):
            self._forwarded.append(signum)

    def _on_wake_signal(self, signum: int, frame: FrameType | None) -> None:
        del signum, frame
        self._wake()

    def _on_stop_request(self, signum: int, frame: FrameType | None) -> None:
        """SIGTSTP (Ctrl-Z while the supervisor has the terminal): the child's group stops too."""
        del signum, frame
        proc = self._proc
        if proc is not None and proc.returncode is None:
            _kill_group(proc.pid, signal.SIGTSTP)
        self._stop_self(proc, give_terminal=False)

    def _stop_self(self, proc: subprocess.Popen[bytes] | None, *, give_terminal: bool) -> None:
        """Stop as a shell job does; once continued, continue the child (and give it the tty)."""
        os.kill(os.getpid(), signal.SIGSTOP)
        if proc is not None and proc.returncode is None:
            if give_terminal and self._terminal is not None and self._terminal.ours():
                self._terminal.give(proc.pid)
            _kill_group(proc.pid, signal.SIGCONT)
        self._wake()

    def _job_control(self, proc: subprocess.Popen[bytes]) -> None:
        """The child stopped on the terminal: hand it over (SIGTTIN/SIGTTOU) or stop too (^Z)."""
        terminal = self._terminal
        if terminal is None:
            return
        if self._wants_terminal and terminal.ours():  # we were continued in the foreground
            self._wants_terminal = False
            terminal.give(proc.pid)
            _kill_group(proc.pid, signal.SIGCONT)
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WSTOPPED | os.WNOHANG)
        except ChildProcessError:
            return
        if info is None or info.si_code != os.CLD_STOPPED:
            return
        if info.si_status in (signal.SIGTTIN, signal.SIGTTOU):
            if terminal.ours():
                terminal.give(proc.pid)
                _kill_group(proc.pid, signal.SIGCONT)
            else:  # we are a background job ourselves: wait until continued in the foreground
                self._wants_terminal = True
        elif info.si_status == signal.SIGTSTP and terminal.given_to is not None:
            terminal.take_back()
            self._stop_self(proc, give_terminal=True)
