"""Pure unit tests of the core: names, tokens, policy, the lease state machine, errors, and the
clocks (with the host clock the embedded backends read from the kernel)."""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fenced.coordinator import _hostclock as hostclock
from fenced.core._clock import RECHECK, ManualClock, SystemClock
from fenced.core._errors import (
    Busy,
    ConfigurationError,
    FencedError,
    ForeignToken,
    InvalidName,
    LeaseLost,
    LossReason,
    NotInstalled,
    Rejected,
    StaleToken,
)
from fenced.core._lease import LeaseState, LeaseTracker
from fenced.core._names import validate_key, validate_publication_name, validate_resource
from fenced.core._policy import LeasePolicy, validate_ttl, validate_wait
from fenced.core._token import MAX_EPOCH, FencingToken

CID = "0123456789abcdef0123456789abcdef"
segment = st.text(alphabet="abcXYZ019._-", min_size=1, max_size=12).filter(
    lambda s: s not in (".", "..")
)
names = st.lists(segment, min_size=1, max_size=5).map("/".join).filter(lambda s: len(s) <= 255)


@given(names, st.integers(min_value=1, max_value=MAX_EPOCH))
def test_token_text_round_trips(resource: str, epoch: int) -> None:
    token = FencingToken(CID, resource, epoch)
    text = str(token)
    assert FencingToken.parse(text) == token
    assert all(c.isalnum() or c in "._/:-" for c in text)  # env var and HTTP header safe


def test_token_text_form_is_versioned() -> None:
    assert str(FencingToken(CID, "exports/daily", 41)) == f"fenced1:{CID}:41:exports/daily"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "garbage",
        f"fenced2:{CID}:41:r",
        f"fenced1:{CID}:041:r",
        f"fenced1:{CID}:0:r",
        f"fenced1:{CID}:-1:r",
        f"fenced1:{CID}:1e3:r",
        f"fenced1:{CID.upper()}:41:r",
        f"fenced1:{CID}:41:",
        f"fenced1:{CID}:41:a/../b",
        f"fenced1:{CID}:{2**63}:r",
    ],
)
def test_malformed_tokens_are_configuration_errors(text: str) -> None:
    with pytest.raises(ConfigurationError):
        FencingToken.parse(text)


def test_tokens_are_ordered_only_within_one_resource() -> None:
    a41, a42 = FencingToken(CID, "a", 41), FencingToken(CID, "a", 42)
    assert a41 < a42 and a42 > a41 and a41 <= a42 and a42 >= a41
    with pytest.raises(TypeError):
        _ = a41 < FencingToken(CID, "b", 42)
    with pytest.raises(TypeError):
        _ = a41 < FencingToken("f" * 32, "a", 42)


@pytest.mark.parametrize("epoch", [0, -1, True, 1.0, "1", 2**63])
def test_token_rejects_bad_epochs(epoch: object) -> None:
    with pytest.raises(ConfigurationError):
        FencingToken(CID, "a", epoch)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name",
    [
        "",
        "/",
        "/a",
        "a/",
        "a//b",
        ".",
        "..",
        "a/./b",
        "a/../b",
        "a b",
        "a\x00b",
        "é",
        "x" * 256,
        "a:b",
    ],
)
def test_invalid_names(name: str) -> None:
    validators = [validate_resource, validate_key]
    if name:  # the empty publication name is the default publication
        validators.append(validate_publication_name)
    for validate in validators:
        with pytest.raises(InvalidName):
            validate(name)


def test_valid_names() -> None:
    assert validate_resource("exports/daily.v2_x-1") == "exports/daily.v2_x-1"
    assert validate_resource("x" * 255)
    assert validate_publication_name("") == ""
    with pytest.raises(InvalidName):
        validate_resource(b"bytes")


@pytest.mark.parametrize("ttl", [0, -1, math.nan, math.inf, True, None, "3", 8 * 24 * 3600])
def test_bad_ttls(ttl: object) -> None:
    with pytest.raises(ConfigurationError):
        validate_ttl(ttl)


def test_waits() -> None:
    assert validate_wait(None) is None
    assert validate_wait(0) == 0.0
    for bad in (-0.1, math.nan, math.inf, True, "1"):
        with pytest.raises(ConfigurationError):
            validate_wait(bad)


def test_policy_margin_defaults_to_a_tenth_and_must_stay_below_ttl() -> None:
    policy = LeasePolicy.create(30)
    assert policy.safety_margin == pytest.approx(3.0)
    assert policy.renew_every == pytest.approx(10.0)
    assert policy.deadline(100.0) == pytest.approx(127.0)
    for margin in (30, 31, -1, math.nan):
        with pytest.raises(ConfigurationError):
            LeasePolicy.create(30, margin)


def test_a_policy_checks_the_type_of_each_setting_not_only_its_value() -> None:
    # 1 and 1.0 are the same ttl; True (== 1, same hash) is refused, and so is a NaN margin.
    assert LeasePolicy.create(1) == LeasePolicy.create(1.0) == LeasePolicy(1.0, 0.1)
    for ttl, margin in ((True, None), (1, True), (1, math.nan), (1, 1), ("1", None)):
        with pytest.raises(ConfigurationError):
            LeasePolicy.create(ttl, margin)


def test_tracker_held_uncertain_lost() -> None:
    tracker = LeaseTracker(deadline=10.0)
    assert tracker.state(0.0) is LeaseState.HELD
    tracker.renewal_failed()
    assert tracker.state(1.0) is LeaseState.UNCERTAIN
    assert tracker.loss(1.0) is None
    tracker.renewed(now=2.0, new_deadline=15.0)
    assert tracker.state(2.0) is LeaseState.HELD and tracker.deadline == 15.0
    assert tracker.state(15.0) is LeaseState.LOST
    loss = tracker.loss(15.0)
    assert loss is not None and loss.reason is LossReason.EXPIRED


def test_tracker_late_renewal_does_not_resurrect() -> None:
    tracker = LeaseTracker(deadline=10.0)
    tracker.renewed(now=10.5, new_deadline=20.0)  # the reply came after the deadline
    assert tracker.state(11.0) is LeaseState.LOST
    assert tracker.deadline == 10.0


def test_tracker_remembers_the_first_loss() -> None:
    tracker = LeaseTracker(deadline=10.0)
    assert tracker.mark_lost(LeaseLost(LossReason.REJECTED))
    assert not tracker.mark_lost(LeaseLost(LossReason.SUPERSEDED))
    loss = tracker.loss(0.0)
    assert loss is not None and loss.reason is LossReason.REJECTED
    tracker.renewed(now=1.0, new_deadline=30.0)
    assert tracker.state(1.0) is LeaseState.LOST


def test_error_tree() -> None:
    assert issubclass(InvalidName, ConfigurationError)
    for cls in (StaleToken, NotInstalled, ForeignToken):
        assert issubclass(cls, Rejected) and issubclass(cls, FencedError)
    error = StaleToken("r", 41, 42)
    assert (error.presented, error.floor) == (41, 42)
    assert "41" in str(error) and "42" in str(error)
    busy = Busy("r", "host:1", 7, 1.5)
    assert (busy.holder, busy.epoch, busy.remaining) == ("host:1", 7, 1.5)
    assert "fence" in str(NotInstalled("r", 43, 42))


def test_the_default_holder_label_is_host_and_pid_and_a_forked_child_gets_its_own() -> None:
    from fenced.coordinator._client import default_holder

    label = default_holder()
    assert label.endswith(f":{os.getpid()}") and default_holder() is label
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.write(writer, default_holder().encode())
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        seen = pipe.read().decode()
    os.waitpid(child, 0)
    assert seen == f"{label.rsplit(':', 1)[0]}:{child}"


# -- clocks ---------------------------------------------------------------------------------------


def test_on_linux_deadlines_are_on_the_boot_clock_which_counts_suspend() -> None:
    clock = SystemClock()
    assert sys.platform.startswith("linux")  # the test hosts; other platforms are tested below
    assert (clock.source, clock.counts_suspend) == ("CLOCK_BOOTTIME", True)
    before = time.clock_gettime(time.CLOCK_BOOTTIME)
    now = clock.now()
    assert before <= now <= time.clock_gettime(time.CLOCK_BOOTTIME)


@pytest.mark.parametrize(
    ("platform", "source", "counts_suspend"),
    [
        ("linux", "CLOCK_BOOTTIME", True),
        ("darwin", "CLOCK_MONOTONIC", True),  # Apple's CLOCK_MONOTONIC counts sleep
        ("freebsd14", "time.monotonic", False),
    ],
)
def test_what_each_platform_reads(
    monkeypatch: pytest.MonkeyPatch, platform: str, source: str, counts_suspend: bool
) -> None:
    monkeypatch.setattr(sys, "platform", platform)
    clock = SystemClock()
    assert (clock.source, clock.counts_suspend) == (source, counts_suspend)
    assert clock.now() <= clock.now()


class _Slept(SystemClock):
    """The real clock plus seconds "spent suspended": now() counts them, CLOCK_MONOTONIC (and so
    every timed wait of Python's) does not."""

    def __init__(self) -> None:
        super().__init__()
        self.suspended = 0.0

    def now(self) -> float:
        return super().now() + self.suspended


def test_a_system_clock_wait_ends_when_a_suspend_passed_its_deadline() -> None:
    """Condition.wait(60) would sleep 60 s of CLOCK_MONOTONIC after the resume; the clock's wait
    re-reads the boot clock every RECHECK seconds and reports the deadline as reached."""
    clock = _Slept()
    cond = threading.Condition()
    results: list[bool] = []
    slept = threading.Event()

    def waiter() -> None:
        with cond:
            until = clock.now() + 60
            while clock.wait(cond, until):
                pass
            results.append(clock.now() >= until)

    def sleeper() -> None:
        clock.sleep(60)
        slept.set()

    threads = [threading.Thread(target=target, daemon=True) for target in (waiter, sleeper)]
    for thread in threads:
        thread.start()
    clock.suspended = 61.0
    for thread in threads:
        thread.join(20 * RECHECK)
    assert results == [True] and slept.is_set()


def test_manual_clock_waits_end_exactly_when_the_test_moves_the_clock() -> None:
    clock = ManualClock()
    cond = threading.Condition()
    woke: list[float] = []
    start = clock.now()

    def waiter() -> None:
        with cond:
            while clock.wait(cond, start + 5):
                pass
        woke.append(clock.now())

    def sleeper() -> None:
        clock.sleep(3)
        woke.append(clock.now())

    threads = [threading.Thread(target=target, daemon=True) for target in (waiter, sleeper)]
    for thread in threads:
        thread.start()
    assert clock.settle(2) == [start + 3, start + 5]
    clock.advance(2.9)
    assert clock.settle(2) == [start + 3, start + 5]  # both woke, found it early, wait again
    assert woke == []
    clock.advance_to(start + 3)
    assert clock.settle(1) == [start + 5]
    threads[1].join(10)
    assert woke == [start + 3]
    clock.suspend(2)  # counts for waits like any move of now()
    threads[0].join(10)
    assert woke == [start + 3, start + 5]
    with pytest.raises(TimeoutError):
        clock.settle(1, timeout=0.01)


def test_manual_clock_suspend_moves_every_reading_but_monotonic() -> None:
    clock = ManualClock(now=50.0, wall=1000.0)
    clock.advance(1)
    clock.suspend(10)
    assert (clock.now(), clock.boottime(), clock.wall(), clock.monotonic()) == (61, 61, 1011, 51)
    clock.jump_wall(-500)
    assert (clock.now(), clock.wall()) == (61, 511)
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match="backwards"):
            clock.advance(bad)
        with pytest.raises(ValueError, match="backwards"):
            clock.suspend(bad)
        with pytest.raises(ValueError, match="sleep"):
            clock.sleep(bad)
    assert clock.wait(threading.Condition(), 61) is False  # the deadline has come: no wait
    clock.advance_to(10)  # in the past: nothing moves
    assert clock.now() == 61


def test_the_host_clock_off_linux(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No CLOCK_BOOTTIME and no /proc: macOS gives the boot id through sysctl and counts sleep
    in CLOCK_MONOTONIC; elsewhere the embedded coordinator refuses to start (one clear error)
    rather than guess a boot id from the wall clock."""
    monkeypatch.delattr(time, "CLOCK_BOOTTIME")
    monkeypatch.setattr(hostclock, "_BOOT_ID", tmp_path / "no-boot-id")
    sysctl = tmp_path / "sysctl"
    sysctl.write_text('#!/bin/sh\n[ "$2" = kern.bootsessionuuid ] && echo 6F1C-BOOT\n')
    sysctl.chmod(0o755)
    monkeypatch.setattr(hostclock, "_SYSCTL", str(sysctl))
    monkeypatch.setattr(sys, "platform", "darwin")
    clock = hostclock.SystemHostClock()
    assert (clock.boot_id(), clock.source) == ("6F1C-BOOT", "CLOCK_MONOTONIC")
    assert clock.boottime() <= time.clock_gettime(time.CLOCK_MONOTONIC)
    monkeypatch.setattr(sys, "platform", "freebsd14")
    with pytest.raises(ConfigurationError, match="boot id on freebsd14"):
        hostclock.SystemHostClock()
