"""The error tree's builtin bases: code written for the standard library catches fenced errors.

``Busy`` is a ``TimeoutError``, ``Unavailable`` a ``ConnectionError``, ``ConfigurationError`` (and
its subclasses) a ``ValueError``, ``NotFound`` a ``LookupError``; each keeps its place in the
fenced tree, ``OutcomeUnknown`` has no builtin base, and the command line maps each error to the
exit code it had. The last tests raise each error for real: a held lease on an embedded
coordinator, a PostgreSQL URL at a closed loopback port, an unknown URL scheme.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import fenced
from fenced.cli import _exitcodes as exitcodes
from fenced.cli._app import FencedGroup
from fenced.core import _errors as errors

# -- the classes ---------------------------------------------------------------------------------

BUILTIN_BASE = {
    errors.Busy: TimeoutError,
    errors.Unavailable: ConnectionError,
    errors.ConfigurationError: ValueError,
    errors.InvalidName: ValueError,
    errors.CorruptData: ValueError,
    errors.NotFound: LookupError,
}

FENCED_PARENT = {  # the tree in the module docstring of fenced.core._errors
    errors.ConfigurationError: errors.FencedError,
    errors.InvalidName: errors.ConfigurationError,
    errors.CorruptData: errors.ConfigurationError,
    errors.AccessDenied: errors.ConfigurationError,
    errors.NotAuthenticated: errors.AccessDenied,
    errors.Busy: errors.FencedError,
    errors.LeaseLost: errors.FencedError,
    errors.Rejected: errors.FencedError,
    errors.StaleToken: errors.Rejected,
    errors.NotInstalled: errors.Rejected,
    errors.ForeignToken: errors.Rejected,
    errors.NotFound: errors.FencedError,
    errors.IdempotencyConflict: errors.FencedError,
    errors.VersionConflict: errors.FencedError,
    errors.Unavailable: errors.FencedError,
    errors.OutcomeUnknown: errors.FencedError,
}


def _fenced_ancestors(cls: type) -> list[type]:
    return [base for base in cls.__mro__ if issubclass(base, errors.FencedError)]


def test_every_error_class_of_the_module_is_in_the_tree() -> None:
    classes = {
        getattr(errors, name)
        for name in errors.__all__
        if isinstance(getattr(errors, name), type)
        and issubclass(getattr(errors, name), BaseException)
    }
    assert classes == {errors.FencedError, *FENCED_PARENT}


@pytest.mark.parametrize("cls", list(FENCED_PARENT), ids=lambda cls: cls.__name__)
def test_each_class_keeps_its_fenced_parent(cls: type) -> None:
    ancestors = _fenced_ancestors(cls)
    assert ancestors[1] is FENCED_PARENT[cls]
    assert ancestors[-1] is errors.FencedError
    assert getattr(fenced, cls.__name__) is cls  # importable from fenced, the same class


@pytest.mark.parametrize("cls", list(BUILTIN_BASE), ids=lambda cls: cls.__name__)
def test_builtin_bases(cls: type) -> None:
    assert issubclass(cls, BUILTIN_BASE[cls])
    assert issubclass(cls, errors.FencedError)


def test_the_builtin_bases_as_a_user_writes_them() -> None:
    assert issubclass(fenced.Busy, TimeoutError) and issubclass(fenced.Busy, OSError)
    assert issubclass(fenced.Unavailable, ConnectionError)
    assert issubclass(fenced.Unavailable, OSError)
    assert issubclass(fenced.ConfigurationError, ValueError)
    assert issubclass(fenced.InvalidName, ValueError)
    assert issubclass(fenced.CorruptData, ValueError)
    assert issubclass(fenced.NotFound, LookupError)


def test_outcome_unknown_has_no_builtin_base() -> None:
    """Generic retry code catches ConnectionError/TimeoutError and retries without the op id;
    an unknown outcome must be reconciled, so it is caught by its own name only."""
    assert errors.OutcomeUnknown.__bases__ == (errors.FencedError,)
    for builtin in (OSError, ConnectionError, TimeoutError, ValueError, LookupError):
        assert not issubclass(errors.OutcomeUnknown, builtin)


@pytest.mark.parametrize(
    "cls",
    [
        errors.LeaseLost,
        errors.Rejected,
        errors.StaleToken,
        errors.NotInstalled,
        errors.ForeignToken,
        errors.IdempotencyConflict,
        errors.VersionConflict,
    ],
    ids=lambda cls: cls.__name__,
)
def test_the_other_classes_gained_no_builtin_base(cls: type) -> None:
    for builtin in (OSError, ValueError, LookupError):
        assert not issubclass(cls, builtin)


def test_os_error_bases_change_neither_message_nor_attributes() -> None:
    busy = errors.Busy("r", "host:1", 7, 1.5)
    assert str(busy) == "r is busy: held by 'host:1' at epoch 7, 1.500s remaining"
    assert busy.args == (str(busy),)
    assert (busy.resource, busy.holder, busy.epoch, busy.remaining) == ("r", "host:1", 7, 1.5)
    assert (busy.errno, busy.strerror, busy.filename) == (None, None, None)
    unavailable = errors.Unavailable("etcd: no leader; nothing was changed, retry")
    assert str(unavailable) == "etcd: no leader; nothing was changed, retry"
    assert unavailable.errno is None


# -- the command line: the same exit code for each error ----------------------------------------

EXIT_CODE = {
    errors.ConfigurationError("bad"): exitcodes.BAD_INPUT,
    errors.InvalidName("bad name"): exitcodes.BAD_INPUT,
    errors.CorruptData("damaged"): exitcodes.BAD_INPUT,
    errors.NotFound("nothing"): exitcodes.NOT_FOUND,
    errors.StaleToken("r", 1, 2): exitcodes.REJECTED,
    errors.Busy("r", "h", 3, 1.0): exitcodes.NOT_ACQUIRED,
    errors.LeaseLost(errors.LossReason.EXPIRED): exitcodes.LEASE_LOST,
    errors.Unavailable("down"): exitcodes.UNAVAILABLE,
    errors.OutcomeUnknown("lost reply"): exitcodes.OUTCOME_UNKNOWN,
    errors.IdempotencyConflict("other content"): exitcodes.CONFLICT,
    errors.VersionConflict("r", "k", 1, 2): exitcodes.CONFLICT,
}


@pytest.mark.parametrize("error", list(EXIT_CODE), ids=lambda error: type(error).__name__)
def test_the_fenced_command_maps_each_error_to_its_exit_code(error: errors.FencedError) -> None:
    """Busy and Unavailable are OSErrors now: the group's FencedError clause comes first, so
    they keep their codes (75, 69) instead of the OSError clause's 2."""

    @click.group(cls=FencedGroup)
    def group() -> None:
        pass

    @group.command()
    def fail() -> None:
        raise error

    result = CliRunner().invoke(group, ["fail"])
    assert result.exit_code == EXIT_CODE[error]
    assert result.output == f"fenced: {error}\n"


# -- raised for real, caught by the builtin class ----------------------------------------------


@pytest.fixture
def coord(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[fenced.Coordinator]:
    monkeypatch.chdir(tmp_path)
    with fenced.connect("sqlite:fenced.db") as opened:
        yield opened


def test_a_held_resource_is_caught_as_timeout_error(coord: fenced.Coordinator) -> None:
    held = coord.acquire("jobs/report", ttl=30, wait=0)
    try:
        coord.acquire("jobs/report", ttl=30, wait=0.1)
    except TimeoutError as error:
        assert isinstance(error, fenced.Busy)
        info = coord.current("jobs/report")
        assert info is not None and (error.holder, error.epoch) == (info.holder, held.epoch)
    else:
        pytest.fail("a held resource was acquired")
    finally:
        coord.release(held)


def test_a_bad_name_is_caught_as_value_error(coord: fenced.Coordinator) -> None:
    with pytest.raises(ValueError) as caught:
        coord.acquire("", ttl=30, wait=0)
    assert isinstance(caught.value, fenced.InvalidName)


@pytest.mark.parametrize("url", ["bogus://x", "postgresql+nope://127.0.0.1/x"])
def test_an_unknown_coordinator_url_is_caught_as_value_error(url: str) -> None:
    try:
        fenced.connect(url)
    except ValueError as error:
        assert isinstance(error, fenced.ConfigurationError)
    else:
        pytest.fail(f"{url} was accepted")


def test_an_unknown_store_url_is_caught_as_value_error() -> None:
    with pytest.raises(ValueError) as caught:
        fenced.open_store("bogus://x")
    assert isinstance(caught.value, fenced.ConfigurationError)


@pytest.fixture
def closed_port() -> int:
    """A loopback port nobody listens on (bound, then closed: a connect is refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_an_unreachable_postgresql_coordinator_is_caught_as_connection_error(
    closed_port: int,
) -> None:
    url = f"postgresql://fenced@127.0.0.1:{closed_port}/fenced?connect_timeout=1"
    try:
        fenced.connect(url).close()
    except ConnectionError as error:
        assert isinstance(error, fenced.Unavailable)
        assert "nothing was changed" in str(error)
    else:
        pytest.fail("connected to a closed port")


def test_an_unreachable_postgresql_store_is_caught_as_connection_error(closed_port: int) -> None:
    url = f"postgresql://fenced@127.0.0.1:{closed_port}/fenced?connect_timeout=1"
    with pytest.raises(ConnectionError) as caught:
        fenced.open_store(url).close()
    assert isinstance(caught.value, fenced.Unavailable)
