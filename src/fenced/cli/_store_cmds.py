"""Store commands: ``fenced fence|put|publish|get|latest|read|gc STORE …``.

A ``fenced run`` child in any language writes to fenced stores with these: the token comes from
``--token`` or ``$FENCED_TOKEN`` (``fenced run`` sets it), the resource from the token. Exit
codes: 0 done; 1 ``get``/``latest``/``read`` found nothing; 2 bad input (malformed token, invalid
key or name, unreadable file, bad URL, a store that does not exist for ``get``, ``latest``,
``read`` and ``gc``, which never create one) or a corrupt store (``read`` of a publication whose
bytes do not match its recorded size and SHA-256); 3 the store rejected the token (stale, not
installed, foreign); 4 ``--if-version`` or ``--op-id`` conflict; 69 the store was busy, retry; 74
the outcome of a commit is unknown, retry with the same ``--op-id``. Every error is one line on
stderr, never a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, NoReturn, TypeVar, cast

import click

from fenced.cli._app import ENVIRONMENT, OneLineUsageCommand, cli
from fenced.cli._checks import parse_seconds
from fenced.cli._exitcodes import NOT_FOUND
from fenced.core._errors import ConfigurationError
from fenced.core._token import FencingToken
from fenced.fence import Store, open_store
from fenced.fence._source import CHUNK_SIZE
from fenced.fence._store import MAX_VALUE_BYTES
from fenced.fence._values import MODES, Mode

_F = TypeVar("_F", bound=Callable[..., Any])


def _store_argument(command: _F) -> _F:
    command = click.option(
        "--mode",
        type=click.Choice(MODES),
        default=None,
        help="Mode of a store created by this command [default: strict]; must match an "
        "existing store's.",
    )(command)
    return click.argument("store_url", metavar="STORE")(command)


def _token_options(command: _F) -> _F:
    command = click.option(
        "--resource",
        default=None,
        help="Refuse unless the token is for this resource (a safety check).",
    )(command)
    return click.option(
        "--token",
        "token_text",
        envvar=ENVIRONMENT["--token"],
        show_envvar=True,
        metavar="TOKEN",
        default=None,
        help="The fencing token (fenced run sets FENCED_TOKEN for its child).",
    )(command)


def _json_option(command: _F) -> _F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON.")(command)


def _token(text: str | None, resource: str | None) -> FencingToken:
    if not text:
        raise ConfigurationError(
            "no fencing token: pass --token or set FENCED_TOKEN (fenced run sets it for its child)"
        )
    token = FencingToken.parse(text)
    if resource is not None and resource != token.resource:
        raise ConfigurationError(
            f"the token is for resource {token.resource!r}, not {resource!r} (--resource)"
        )
    return token


def _open(url: str, mode: str | None, *, create: bool = True) -> Store:
    """The store at ``url``; ``create=False`` (the readers, and gc) never creates one."""
    return open_store(url, cast(Mode | None, mode), create=create)  # click.Choice checked mode


def _input(file: str) -> IO[bytes]:
    """The binary stream of FILE — a file, a pipe or FIFO (bash's ``<(cmd)`` is
    ``/dev/fd/63``), a device — or standard input for ``-``. One that cannot be read is a
    ConfigurationError that says why (before any store is opened)."""
    if file == "-":
        return sys.stdin.buffer
    try:
        return open(file, "rb")  # the caller closes it
    except FileNotFoundError:
        raise ConfigurationError(f"no such file: {file}") from None
    except IsADirectoryError:
        raise ConfigurationError(f"{file} is a directory, not a file to read") from None
    except OSError as error:
        raise ConfigurationError(f"cannot read {file}: {error.strerror or error}") from None


def _publish_data(file: str, stack: contextlib.ExitStack) -> IO[bytes] | Path:
    """What ``publish`` reads: a regular file by its path, anything else (standard input, a
    pipe, a FIFO) as a stream, closed with ``stack``."""
    if file != "-" and Path(file).is_file():
        return Path(file)
    stream = _input(file)
    if file != "-":
        stack.callback(stream.close)
    return stream


def _echo(value: object, as_json: bool) -> None:
    if value is None:
        click.echo("null" if as_json else "")
        return
    assert dataclasses.is_dataclass(value) and not isinstance(value, type)
    fields = dataclasses.asdict(value)
    if as_json:
        click.echo(json.dumps(fields, sort_keys=True))
    else:
        click.echo(" ".join(f"{k}={v}" for k, v in fields.items()))


def _not_found(message: str) -> NoReturn:
    click.echo(f"fenced: {message}", err=True)
    raise click.exceptions.Exit(NOT_FOUND)


@cli.command("fence", cls=OneLineUsageCommand, short_help="Install the token's epoch at STORE.")
@_store_argument
@_token_options
def fence_command(
    store_url: str, mode: str | None, token_text: str | None, resource: str | None
) -> None:
    """Install the token's epoch as the floor of its resource at STORE; print the floor.

    From then on every operation with a lower epoch is rejected (exit 3 if the floor is already
    higher). Idempotent.
    """
    token = _token(token_text, resource)
    with _open(store_url, mode) as store:
        click.echo(store.fence(token))


@cli.command("put", cls=OneLineUsageCommand, short_help="Write a key of the token's resource.")
@_store_argument
@click.argument("key")
@click.argument("file", default="-", required=False, metavar="[FILE|-]")
@_token_options
@click.option("--op-id", default=None, help="Operation id: a retry returns the first outcome.")
@click.option(
    "--if-version",
    type=int,
    default=None,
    help="Write only if KEY is at this version (0: only if it does not exist); else exit 4.",
)
@_json_option
def put_command(
    store_url: str,
    mode: str | None,
    key: str,
    file: str,
    token_text: str | None,
    resource: str | None,
    op_id: str | None,
    if_version: int | None,
    as_json: bool,
) -> None:
    """Write the bytes of FILE (or standard input) as KEY of the token's resource at STORE."""
    token = _token(token_text, resource)
    source = _input(file)
    try:
        value = source.read(MAX_VALUE_BYTES + 1)  # the store refuses more, with a clear message
    finally:
        if file != "-":
            source.close()
    with _open(store_url, mode) as store:
        _echo(store.put(token, key, value, op_id=op_id, if_version=if_version), as_json)


@cli.command(
    "publish", cls=OneLineUsageCommand, short_help="Publish a file for the token's resource."
)
@_store_argument
@click.argument("file", default="-", required=False, metavar="[FILE|-]")
@_token_options
@click.option("--name", default="", help="Publication name [default: the default one].")
@click.option("--op-id", default=None, help="Operation id: a retry returns the first outcome.")
@_json_option
def publish_command(
    store_url: str,
    mode: str | None,
    file: str,
    token_text: str | None,
    resource: str | None,
    name: str,
    op_id: str | None,
    as_json: bool,
) -> None:
    """Publish FILE (or standard input, streamed) as the token's resource at STORE.

    The bytes are staged durably first; the visible pointer moves only if the token is current.
    """
    token = _token(token_text, resource)
    with contextlib.ExitStack() as stack:
        data = _publish_data(file, stack)  # a FILE that cannot be read opens no store
        store = stack.enter_context(_open(store_url, mode))
        _echo(store.publish(token, data, name=name, op_id=op_id), as_json)


@cli.command("get", cls=OneLineUsageCommand, short_help="Print the value of a key.")
@_store_argument
@click.argument("resource")
@click.argument("key")
def get_command(store_url: str, mode: str | None, resource: str, key: str) -> None:
    """Write the value of KEY of RESOURCE at STORE to standard output, as bytes (exit 1: none)."""
    with _open(store_url, mode, create=False) as store:
        item = store.get(resource, key)
    if item is None:
        _not_found(f"no key {key!r} in {resource!r}")
    out = sys.stdout.buffer
    out.write(item.value)
    out.flush()


@cli.command("latest", cls=OneLineUsageCommand, short_help="Show the current publication.")
@_store_argument
@click.argument("resource")
@click.option("--name", default="", help="Publication name [default: the default one].")
@_json_option
def latest_command(
    store_url: str, mode: str | None, resource: str, name: str, as_json: bool
) -> None:
    """Show the current publication of RESOURCE at STORE (exit 1 if nothing is published)."""
    with _open(store_url, mode, create=False) as store:
        publication = store.latest(resource, name)
    if publication is None:
        if as_json:
            click.echo("null")
        _not_found(f"nothing is published for {resource!r}" + (f" as {name!r}" if name else ""))
    _echo(publication, as_json)


@cli.command("read", cls=OneLineUsageCommand, short_help="Print the current publication.")
@_store_argument
@click.argument("resource")
@click.option("--name", default="", help="Publication name [default: the default one].")
def read_command(store_url: str, mode: str | None, resource: str, name: str) -> None:
    """Write the bytes of the current publication of RESOURCE at STORE to standard output.

    The bytes are checked against the publication's recorded size and SHA-256 as they are
    copied: damaged data ends the command with exit 2 and one line on stderr (what it had written
    by then is not the publication).
    """
    with _open(store_url, mode, create=False) as store:
        try:
            stream = store.open(resource, name)
        except LookupError as error:
            _not_found(str(error))
        with stream:
            out = sys.stdout.buffer
            shutil.copyfileobj(stream, out, CHUNK_SIZE)
            out.flush()


@cli.command("gc", cls=OneLineUsageCommand, short_help="Remove unreferenced objects.")
@_store_argument
@click.option(
    "--keep",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Keep this many newest publications per resource and name.",
)
@click.option(
    "--grace",
    default=None,
    metavar="SECONDS",
    help="Keep objects unreferenced for less than this [default: 3600].",
)
def gc_command(store_url: str, mode: str | None, keep: int, grace: str | None) -> None:
    """Remove objects no pointer needs any more (after the grace period); print how many."""
    seconds = None if grace is None else parse_seconds("--grace", grace)
    with _open(store_url, mode, create=False) as store:
        click.echo(store.gc(keep=keep, grace=seconds))
