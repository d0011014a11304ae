"""``fenced keys add|list|revoke --keys FILE``: the API keys of ``fenced serve --keys FILE``.

* ``fenced keys add NAME --keys FILE --role ROLE… --prefix PREFIX…`` makes a key and prints it on
  standard output, once, and nowhere else (the file keeps a salted hash); a note about it goes to
  standard error. ``--role`` (``hold``, ``write``, ``read``, ``admin``; repeatable) and
  ``--prefix`` (repeatable; ``--prefix ''`` for every name) are required: a key's scope is never
  a default. The file is created (mode 0600) if it does not exist.
* ``fenced keys list --keys FILE [--json]``: id, name, roles, prefixes, created, revoked; never a
  hash. In the plain table the prefix ``""`` (every name) is shown as ``""``.
* ``fenced keys revoke ID_OR_NAME --keys FILE``: a server reading the file refuses the key from its
  next request on, without a restart. Revoking a revoked key again changes nothing and exits 0.

Exit codes: 0 done; 1 ``revoke`` found no key with that id or name; 2 bad input (a bad name, role
or prefix, a name a valid key already has, a keys file that does not exist — ``list`` and
``revoke`` never create one —, cannot be read or written, or is malformed; or the ``server``
extra is not installed). Every error is one line on stderr, never a traceback, never the key.
The model and the file format are :mod:`fenced.server._keys` (docs/server.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import click

from fenced.cli._app import FencedGroup, cli, one_line_usage
from fenced.core._errors import ConfigurationError

__all__ = ["JSON_FORMAT", "keys_group"]

JSON_FORMAT = 1
"""Version of the ``--json`` document of ``fenced keys list``; bumped only for incompatible
changes."""
ROLE_NAMES = ("hold", "write", "read", "admin")
"""The roles (:data:`fenced.server._keys.ROLES`; repeated here so that ``--help`` works without
the ``server`` extra)."""
_SERVER_MODULES = {"fastapi", "starlette", "pydantic", "uvicorn"}


def _keys_module() -> ModuleType:
    """:mod:`fenced.server._keys`, or a one-line ConfigurationError if the ``server`` extra is
    missing (importing :mod:`fenced.server` imports FastAPI)."""
    try:
        from fenced.server import _keys  # noqa: PLC0415 - only with the server extra

    except ModuleNotFoundError as error:
        if error.name is not None and error.name.partition(".")[0] in _SERVER_MODULES:
            raise ConfigurationError(
                "fenced keys needs the server extra: pip install 'fenced[server]'"
            ) from None
        raise
    return _keys


class KeysGroup(FencedGroup):
    """The ``fenced keys`` group: fenced errors and usage errors as one line (exit 2), its
    help when given no command."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as error:
            if type(error).__name__ == "NoArgsIsHelpError":  # click 8.2+: show the help
                raise
            raise one_line_usage(error, parent, info_name) from None

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as error:
            raise one_line_usage(error, ctx.parent, ctx.info_name) from None


def _keys_option(command: Any) -> Any:
    return click.option(
        "--keys",
        "keys_file",
        required=True,
        metavar="FILE",
        help="The keys file (the one given to fenced serve --keys).",
    )(command)


@cli.group("keys", cls=KeysGroup, short_help="Manage the API keys of fenced serve.")
def keys_group() -> None:
    """Manage the API keys of fenced serve --keys FILE.

    A key is scoped to roles (hold, write, read, admin; admin implies the others) and to name
    prefixes: it may act only on resources and store keys whose names start with one of them.
    """


@keys_group.command("add", short_help="Make a key; print it once.")
@click.argument("name")
@_keys_option
@click.option(
    "--role",
    "roles",
    multiple=True,
    type=click.Choice(ROLE_NAMES),
    help="A role of the key (repeatable; admin implies the others).",
)
@click.option(
    "--prefix",
    "prefixes",
    multiple=True,
    metavar="PREFIX",
    help="The key may act on names starting with PREFIX (repeatable; '' for every name).",
)
def add_command(
    name: str, keys_file: str, roles: tuple[str, ...], prefixes: tuple[str, ...]
) -> None:
    """Make a key named NAME and add its salted hash to the keys file (created if missing).

    The key is printed on standard output, once: it is stored nowhere and cannot be shown
    again (revoke it and add another if it is lost). For example:

    \b
        fenced keys add ci --keys keys.json --role hold --prefix jobs/
    """
    keys = _keys_module()
    if not roles:
        raise ConfigurationError(f"give the key a role: --role {'|'.join(ROLE_NAMES)}")
    if not prefixes:
        raise ConfigurationError("give the key a name prefix: --prefix PREFIX ('' for every name)")
    made = keys.add_key(Path(keys_file), name, roles, prefixes)
    click.echo(made.key)
    entry = made.entry
    click.echo(
        f"fenced: added API key {entry.id} ({entry.name}) to {keys_file}: roles "
        f"{', '.join(entry.roles)}; prefixes {_prefixes(entry.prefixes)}. It is printed above, "
        "once: store it now.",
        err=True,
    )


def _prefixes(prefixes: tuple[str, ...]) -> str:
    return ",".join(prefix or '""' for prefix in prefixes)


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    table = [headers, *rows]
    widths = [max(len(line[col]) for line in table) for col in range(len(headers))]
    return [
        "  ".join(cell.ljust(widths[col]) for col, cell in enumerate(line)).rstrip()
        for line in table
    ]


@keys_group.command("list", short_help="Show the keys (never a key or a hash).")
@_keys_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (format 1).")
def list_command(keys_file: str, as_json: bool) -> None:
    """Show every key of the keys file: id, name, roles, prefixes, created, revoked.

    The file keeps no key, and this shows no hash. ``--json`` prints
    ``{"format": 1, "file": …, "keys": [{"id", "name", "roles", "prefixes", "created",
    "revoked"}]}``.
    """
    entries = _keys_module().read_keys(Path(keys_file))
    if as_json:
        document = {
            "format": JSON_FORMAT,
            "file": keys_file,
            "keys": [entry.public() for entry in entries],
        }
        click.echo(json.dumps(document, indent=2))
        return
    if not entries:
        click.echo(f"no API keys in {keys_file}")
        return
    rows = [
        [
            entry.id,
            entry.name,
            ",".join(entry.roles),
            _prefixes(entry.prefixes),
            entry.created,
            entry.revoked or "-",
        ]
        for entry in entries
    ]
    for line in _table(["ID", "NAME", "ROLES", "PREFIXES", "CREATED", "REVOKED"], rows):
        click.echo(line)


@keys_group.command("revoke", short_help="Revoke a key by id or name.")
@click.argument("id_or_name", metavar="ID_OR_NAME")
@_keys_option
def revoke_command(id_or_name: str, keys_file: str) -> None:
    """Revoke the key with id ID_OR_NAME, else the valid key named ID_OR_NAME.

    A server using the keys file refuses it from its next request on (no restart). The entry
    stays in the file, marked revoked. Exit 1 if no key has that id or name.
    """
    entry, changed = _keys_module().revoke_key(Path(keys_file), id_or_name)
    if changed:
        click.echo(f"revoked API key {entry.id} ({entry.name})")
    else:
        click.echo(f"API key {entry.id} ({entry.name}) was already revoked at {entry.revoked}")
