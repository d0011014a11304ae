"""``fenced run`` with real processes and real signals on an embedded SQLite coordinator.

Every command runs as ``python -m fenced`` in its own process. Waits poll for a condition with a
deadline; nothing asserts speed.
"""

from __future__ import annotations

import json
import math
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import fenced
from fenced.runtime._child import ChildSupervisor, StartFailed
from support.cli_processes import (
    DEADLINE,
    FENCED,
    Start,
    fenced_cmd,
    one_line_error,
    wait_for,
)

pytestmark = pytest.mark.slow

R = "jobs/nightly"


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'fenced.db'}"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is not alive for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def last_epoch(url: str, resource: str = R) -> int:
    with fenced.connect(url) as coord:
        return coord.last_epoch(resource)


PRINT_ENV = (
    "import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
    "if k.startswith('FENCED_')}))"
)


# -- the token and the exit status ---------------------------------------------------------


def test_the_child_gets_the_token_in_its_environment(url: str) -> None:
    envs = []
    for _ in range(2):
        result = fenced_cmd("run", R, "--url", url, "--", sys.executable, "-c", PRINT_ENV)
        assert result.returncode == 0, result.stderr
        envs.append(json.loads(result.stdout))
    with fenced.connect(url) as coord:
        coordinator_id = coord.coordinator_id
    for expected_epoch, env in enumerate(envs, 1):
        token = fenced.FencingToken.parse(env["FENCED_TOKEN"])
        assert token == fenced.FencingToken(coordinator_id, R, expected_epoch)
        assert env["FENCED_RESOURCE"] == R == token.resource
        assert env["FENCED_EPOCH"] == str(expected_epoch)
        assert env["FENCED_URL"] == url


def test_the_url_defaults_to_fenced_url_and_the_lease_is_released(url: str) -> None:
    env = {**os.environ, "FENCED_URL": url}
    result = fenced_cmd("run", R, "--", sys.executable, "-c", PRINT_ENV, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["FENCED_URL"] == url
    with fenced.connect(url) as coord:
        assert coord.current(R) is None
        assert coord.last_epoch(R) == 1


@pytest.mark.parametrize("code", [0, 3, 17])
def test_the_exit_code_of_the_command_is_passed_on(url: str, code: int) -> None:
    result = fenced_cmd("run", R, "--url", url, "--", "sh", "-c", f"exit {code}")
    assert result.returncode == code
    assert result.stderr == ""


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGKILL, 137)])
def test_a_death_by_signal_is_128_plus_the_signal(url: str, sig: int, status: int) -> None:
    result = fenced_cmd("run", R, "--url", url, "--", "sh", "-c", f"kill -{int(sig)} $$")
    assert result.returncode == status


def test_a_command_that_cannot_start_costs_no_epoch(url: str, tmp_path: Path) -> None:
    not_executable = tmp_path / "script.sh"
    not_executable.write_text("#!/bin/sh\n")
    missing = fenced_cmd("run", R, "--url", url, "--", "no-such-command-fenced")
    assert missing.returncode == 127
    assert "command not found" in one_line_error(missing)
    denied = fenced_cmd("run", R, "--url", url, "--", str(not_executable))
    assert denied.returncode == 126
    one_line_error(denied)
    assert last_epoch(url) == 0


# -- not acquired, bad input ---------------------------------------------------------------


def test_not_acquired_within_wait_exits_75(url: str, tmp_path: Path, start_fenced: Start) -> None:
    started = tmp_path / "started"
    holder = start_fenced(
        "run", R, "--url", url, "--holder", "the-holder", "--", "sh", "-c",
        f"touch {started}; exec sleep 60",
    )  # fmt: skip
    try:
        wait_for(started.exists, "the holder's command to start")
        for wait in ("0", "0.3"):
            result = fenced_cmd("run", R, "--url", url, "--wait", wait, "--", "true")
            assert result.returncode == 75
            line = one_line_error(result)
            assert "busy" in line
            assert "the-holder" in line
    finally:
        holder.send_signal(signal.SIGTERM)  # forwarded: sleep dies of SIGTERM
        holder.communicate(timeout=DEADLINE)
        assert holder.returncode == 143
    assert last_epoch(url) == 1


@pytest.mark.parametrize(
    "args",
    [
        ["run", "bad name", "--", "true"],
        ["run", "a//b", "--", "true"],
        ["run", R, "--ttl", "abc", "--", "true"],
        ["run", R, "--ttl", "0", "--", "true"],
        ["run", R, "--ttl", "-1", "--", "true"],
        ["run", R, "--ttl", "nan", "--", "true"],
        ["run", R, "--wait", "-1", "--", "true"],
        ["run", R, "--grace", "soon", "--", "true"],
        ["run", R, "--holder", "", "--", "true"],
        ["run", R],
        ["run", R, "--"],
        ["run"],
        ["run", R, "--no-such-option", "--", "true"],
        ["run", R, "--url", "nope://x", "--", "true"],
        ["run", R, "--fence", "nope:///x", "--", "true"],
    ],
    ids=lambda args: " ".join(args[1:]) or "nothing",
)
def test_bad_input_is_one_line_and_exit_2(url: str, args: list[str]) -> None:
    env = {**os.environ, "FENCED_URL": url}
    result = fenced_cmd(*args, env=env)
    assert result.returncode == 2, result.stderr
    one_line_error(result)
    assert result.stdout == ""
    assert last_epoch(url) == 0


# -- loss of the lease ---------------------------------------------------------------------

TRAP_TERM = "echo $$ > {pid}; trap 'echo TERM >> {log}; exit 0' TERM; while :; do sleep 0.05; done"
IGNORE_TERM = "echo $$ > {pid}; trap '' TERM; while :; do sleep 0.05; done"


def _lose_lease_while_running(
    url: str, tmp_path: Path, start: Start, script: str, grace: str
) -> tuple[subprocess.Popen[str], int]:
    """Start ``fenced run`` with ``script``; pause it past its ttl; let B take over; continue it.

    Returns the continued ``fenced run`` process and its child's pid.
    """
    pid_file = tmp_path / "child.pid"
    a = start(
        "run", R, "--url", url, "--ttl", "1", "--grace", grace, "--",
        "sh", "-c", script.format(pid=pid_file, log=tmp_path / "term.log"),
    )  # fmt: skip
    wait_for(lambda: pid_file.exists() and pid_file.read_text().strip() != "", "the child")
    child = int(pid_file.read_text())
    os.kill(a.pid, signal.SIGSTOP)
    try:
        # B waits until A's lease expired at the coordinator, then runs and releases
        b = fenced_cmd(
            "run", R, "--url", url, "--wait", str(DEADLINE), "--", "sh", "-c",
            'test "$FENCED_EPOCH" = 2',
        )  # fmt: skip
        assert b.returncode == 0, b.stderr
        assert alive(child), "the child of the stopped fenced run keeps running"
        assert a.poll() is None
    finally:
        os.kill(a.pid, signal.SIGCONT)
    return a, child


def test_a_lost_lease_terminates_the_command_and_exits_76(
    url: str, tmp_path: Path, start_fenced: Start
) -> None:
    a, child = _lose_lease_while_running(url, tmp_path, start_fenced, TRAP_TERM, grace="10")
    _, stderr = a.communicate(timeout=DEADLINE)
    assert a.returncode == 76
    assert (tmp_path / "term.log").read_text().splitlines() == ["TERM"]
    assert "lost" in stderr
    assert "SIGTERM" in stderr
    assert "SIGKILL" not in stderr
    assert "Traceback" not in stderr
    assert not alive(child)
    assert last_epoch(url) == 2


def test_a_command_that_ignores_sigterm_gets_sigkill_after_grace(
    url: str, tmp_path: Path, start_fenced: Start
) -> None:
    a, child = _lose_lease_while_running(url, tmp_path, start_fenced, IGNORE_TERM, grace="0.5")
    _, stderr = a.communicate(timeout=DEADLINE)
    assert a.returncode == 76
    assert "SIGKILL" in stderr
    wait_for(lambda: not alive(child), "the child to be gone")


# -- signals to fenced run -----------------------------------------------------------------


def test_sigterm_to_fenced_run_is_forwarded_to_the_command(
    url: str, tmp_path: Path, start_fenced: Start
) -> None:
    pid_file = tmp_path / "child.pid"
    a = start_fenced(
        "run", R, "--url", url, "--", "sh", "-c",
        TRAP_TERM.format(pid=pid_file, log=tmp_path / "term.log"),
    )  # fmt: skip
    wait_for(lambda: pid_file.exists() and pid_file.read_text().strip() != "", "the child")
    a.send_signal(signal.SIGTERM)
    a.communicate(timeout=DEADLINE)
    assert a.returncode == 0  # the command trapped TERM and exited 0
    assert (tmp_path / "term.log").read_text().splitlines() == ["TERM"]
    with fenced.connect(url) as coord:
        assert coord.current(R) is None  # released


def test_sigint_to_fenced_run_is_forwarded_to_the_command(
    url: str, tmp_path: Path, start_fenced: Start
) -> None:
    started = tmp_path / "started"
    a = start_fenced("run", R, "--url", url, "--", "sh", "-c", f"touch {started}; exec sleep 60")
    wait_for(started.exists, "the child")
    a.send_signal(signal.SIGINT)
    a.communicate(timeout=DEADLINE)
    assert a.returncode == 130


# -- --fence -------------------------------------------------------------------------------

PUBLISH = (
    "import os, sys, fenced\n"
    "store = fenced.open_store(sys.argv[1])\n"
    "token = fenced.FencingToken.parse(os.environ['FENCED_TOKEN'])\n"
    "try:\n"
    "    store.publish(token, b'epoch ' + str(token.epoch).encode())\n"
    "except fenced.Rejected as error:\n"
    "    print(type(error).__name__)\n"
    "    sys.exit(3)\n"
)


def test_fence_installs_the_epoch_before_the_command_starts(url: str, tmp_path: Path) -> None:
    store_url = f"file://{tmp_path / 'store'}"
    fenced.open_store(store_url, mode="strict").close()
    first = fenced_cmd(
        "run", R, "--url", url, "--fence", store_url, "--",
        sys.executable, "-c", PUBLISH, store_url,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    # without --fence, a strict store refuses the next epoch: nobody installed it
    unfenced = fenced_cmd("run", R, "--url", url, "--", sys.executable, "-c", PUBLISH, store_url)
    assert unfenced.returncode == 3
    assert unfenced.stdout.strip() == "NotInstalled"
    fenced_again = fenced_cmd(
        "run", R, "--url", url, "--fence", store_url, "--",
        sys.executable, "-c", PUBLISH, store_url,
    )  # fmt: skip
    assert fenced_again.returncode == 0, fenced_again.stderr
    with fenced.open_store(store_url) as store:
        latest = store.latest(R)
        assert latest is not None
        assert latest.epoch == 3
        assert store.read(R) == b"epoch 3"


def test_a_store_with_a_higher_floor_refuses_with_exit_3(url: str, tmp_path: Path) -> None:
    store_url = f"file://{tmp_path / 'store'}"
    with fenced.connect(url) as coord:
        coordinator_id = coord.coordinator_id
    with fenced.open_store(store_url) as store:  # as if the coordinator had been restored
        store.fence(fenced.FencingToken(coordinator_id, R, 5))
    result = fenced_cmd("run", R, "--url", url, "--fence", store_url, "--", "true")
    assert result.returncode == 3
    assert "Traceback" not in result.stderr
    with fenced.connect(url) as coord:
        assert coord.current(R) is None  # released again


# -- a terminal ----------------------------------------------------------------------------


def _read_until(fd: int, marker: bytes, timeout: float = DEADLINE) -> bytes:
    buffer = b""
    deadline = time.monotonic() + timeout
    while marker not in buffer:
        if time.monotonic() > deadline:
            if marker == b"\0":
                return buffer
            raise AssertionError(f"timed out waiting for {marker!r}; got {buffer!r}")
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            try:
                chunk = os.read(fd, 1024)
            except OSError:
                break
            if not chunk:
                break
            buffer += chunk
    return buffer


def test_a_command_on_a_terminal_can_read_it_and_ctrl_z_stops_both(url: str) -> None:
    script = "echo ready; read x; echo got:$x; read y; echo after:$y; exit 5"
    pid, fd = pty.fork()
    if pid == 0:  # the child: fenced run on the terminal, in its foreground
        try:
            os.execv(sys.executable, [*FENCED, "run", R, "--url", url, "--", "sh", "-c", script])
        finally:
            os._exit(127)
    try:
        _read_until(fd, b"ready")
        os.write(fd, b"hello\n")  # the command reads the terminal: it is handed over
        _read_until(fd, b"got:hello")
        os.write(fd, b"\x1a")  # Ctrl-Z: the command stops, then fenced run stops itself

        def stopped() -> bool:
            waited, status = os.waitpid(pid, os.WUNTRACED | os.WNOHANG)
            if waited == pid and not os.WIFSTOPPED(status):
                rest = _read_until(fd, b"\0", timeout=0.5)
                raise AssertionError(f"fenced run ended (status {status:#x}) instead: {rest!r}")
            return waited == pid

        wait_for(stopped, "fenced run to stop")
        os.kill(pid, signal.SIGCONT)  # as `fg` would (the terminal is fenced run's again)
        os.write(fd, b"world\n")
        _read_until(fd, b"after:world")
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status)
        assert os.WEXITSTATUS(status) == 5
    finally:
        os.close(fd)
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


# -- the supervisor itself, in-process (fenced.runtime._child) ------------------------------


class FakeLease:
    """A LeaseSignal whose loss the test decides."""

    def __init__(self) -> None:
        self.token = fenced.FencingToken("0" * 32, R, 7)
        self.error: fenced.LeaseLost | None = None

    def loss(self) -> fenced.LeaseLost | None:
        return self.error

    def lose(self, supervisor: ChildSupervisor) -> None:
        self.error = fenced.LeaseLost(fenced.LossReason.REJECTED, "taken over")
        supervisor.on_lost(self.error)


def test_supervisor_rejects_bad_settings() -> None:
    with pytest.raises(fenced.ConfigurationError):
        ChildSupervisor([])
    with pytest.raises(fenced.ConfigurationError):
        ChildSupervisor("true")
    with pytest.raises(fenced.ConfigurationError):
        ChildSupervisor(["true"], grace=-1)
    with pytest.raises(fenced.ConfigurationError):
        ChildSupervisor(["true"], grace=math.nan)


def test_supervisor_starts_nothing_when_the_lease_is_already_lost(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    lease = FakeLease()
    supervisor = ChildSupervisor(["touch", str(marker)], handle_signals=False)
    lease.error = fenced.LeaseLost(fenced.LossReason.EXPIRED, "too late")
    with pytest.raises(fenced.LeaseLost):
        supervisor.run(lease)
    assert not marker.exists()


def test_supervisor_passes_the_lease_and_the_status() -> None:
    lease = FakeLease()
    supervisor = ChildSupervisor(
        ["sh", "-c", 'test "$FENCED_TOKEN" = "$EXPECTED" && test -z "$FENCED_URL" && exit 9'],
        env={"PATH": os.environ["PATH"], "EXPECTED": str(lease.token), "FENCED_URL": "stale"},
        handle_signals=False,
    )
    result = supervisor.run(lease)
    assert result.returncode == 9
    assert result.exit_status == 9
    assert result.lost is None
    assert result.signalled == ()


def test_supervisor_escalates_to_sigkill_after_grace_on_loss(tmp_path: Path) -> None:
    lease = FakeLease()
    started = tmp_path / "started"
    supervisor = ChildSupervisor(
        ["sh", "-c", f"trap '' TERM; touch {started}; while :; do sleep 0.05; done"],
        grace=0.3,
        handle_signals=False,
    )

    def lose_it() -> None:
        wait_for(started.exists, "the child")
        lease.lose(supervisor)

    threading.Thread(target=lose_it, daemon=True).start()
    result = supervisor.run(lease)
    assert result.lost is lease.error
    assert result.signalled == (signal.SIGTERM, signal.SIGKILL)
    assert result.killed
    assert result.exit_status == 128 + signal.SIGKILL
    assert "SIGKILL" in result.describe()


def test_supervisor_reports_a_command_that_cannot_start() -> None:
    supervisor = ChildSupervisor(["no-such-command-fenced"], handle_signals=False)
    with pytest.raises(StartFailed) as failure:
        supervisor.check_command()
    assert failure.value.exit_status == 127
    with pytest.raises(StartFailed):
        supervisor.run(FakeLease())
