"""Pure unit tests of the core: names, tokens, policy, the lease state machine, errors."""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fenced.core.errors import (
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
from fenced.core.lease import LeaseState, LeaseTracker
from fenced.core.names import validate_key, validate_publication_name, validate_resource
from fenced.core.policy import LeasePolicy, validate_ttl, validate_wait
from fenced.core.token import MAX_EPOCH, FencingToken

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


def test_a_remembered_policy_never_lets_a_bad_setting_through() -> None:
    # Policies are remembered by (type, value): after 1 and 1.0 were accepted, True (== 1,
    # same hash) is still refused, and so is a NaN margin (never equal to itself).
    assert LeasePolicy.create(1) == LeasePolicy.create(1.0) == LeasePolicy(1.0, 0.1)
    assert LeasePolicy.create(1, 0.5) is LeasePolicy.create(1, 0.5)
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
    from fenced.coordinator.client import default_holder

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
