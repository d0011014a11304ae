"""The ``fenced`` click group and its error handling.

Every fenced error becomes a one-line message on stderr and its documented exit code
(:mod:`fenced.cli._exitcodes`); click's usage errors exit with 2; Ctrl-C (SIGINT reaching fenced
itself, e.g. while it waits for a lease) exits with 130. No traceback reaches the user.

Settings a team configures once come from ``FENCED_*`` environment variables, declared here so
that every command reads the same ones (:data:`ENVIRONMENT`, documented in docs/cli.md); an
option given on the command line always wins over its variable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from fenced.cli._exitcodes import BAD_INPUT, exit_code_for
from fenced.core._errors import ConfigurationError, FencedError

__all__ = [
    "ENVIRONMENT",
    "FencedGroup",
    "OneLineUsageCommand",
    "cli",
    "one_line",
    "one_line_usage",
    "stores_option",
    "url_option",
]

_F = TypeVar("_F", bound=Callable[..., Any])
_INTERRUPTED = 128 + 2  # SIGINT: the shell's convention (docs/cli.md), not a table code

ENVIRONMENT = {"--url": "FENCED_URL", "--store": "FENCED_STORE", "--token": "FENCED_TOKEN"}
"""Option → environment variable read when the option is not given (shown in ``--help``).

Connection settings: ``--url`` of every command that uses a coordinator (not ``demo``, which
always starts from a temporary database, nor ``verify``, whose cases restore and damage the
coordinator they are given), and ``--store`` of ``status``, ``timeline`` and ``metrics``
(several stores separated by spaces). ``--token`` of the store commands is set by ``fenced run``
for its child. Per-invocation values (``--ttl``, ``--wait``, ``--holder``, ``--fence``) have no
variable: they belong to the job, not to the machine."""


def url_option(*aliases: str) -> Callable[[_F], _F]:
    """The coordinator option ``--url URL`` (and ``aliases``), from ``$FENCED_URL`` when not
    given; without either, :func:`fenced.connect`'s embedded default."""
    return click.option(
        "--url",
        *aliases,
        "url",
        metavar="URL",
        envvar=ENVIRONMENT["--url"],
        show_envvar=True,
        help="Coordinator URL [default: sqlite:.fenced/fenced.db].",
    )


def stores_option(text: str) -> Callable[[_F], _F]:
    """The repeatable ``--store STORE`` option (``text`` is its help), from ``$FENCED_STORE``
    (space-separated URLs) when not given."""
    return click.option(
        "--store",
        "store_urls",
        multiple=True,
        metavar="STORE",
        envvar=ENVIRONMENT["--store"],
        show_envvar=True,
        help=text,
    )


class OneLineUsageCommand(click.Command):
    """A click command whose usage errors are one line (``fenced: …``) with exit code 2.

    Click's own format (usage, hint, blank line, error) is turned into a
    :class:`ConfigurationError`, which the ``fenced`` group prints as one line.
    """

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
            raise one_line_usage(error, parent, info_name) from None


def one_line_usage(
    error: click.UsageError, parent: click.Context | None, info_name: str | None
) -> ConfigurationError:
    """A usage error as one line naming the command the way a user types it (``fenced keys
    add``, whatever the program was invoked as): the ConfigurationError the group prints."""
    names = [info_name] if info_name else []
    while parent is not None and parent.parent is not None:  # the root is "fenced"
        names.insert(0, parent.info_name or "")
        parent = parent.parent
    where = " ".join(["fenced", *names])
    message = error.format_message().rstrip(".")
    return ConfigurationError(f"{message} (see '{where} --help')")


class FencedGroup(click.Group):
    """A click group that turns fenced errors into one-line messages and exit codes.

    Its commands are :class:`OneLineUsageCommand`s: usage errors are one line too.
    """

    command_class = OneLineUsageCommand

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except FencedError as error:
            click.echo(f"fenced: {one_line(str(error))}", err=True)
            ctx.exit(exit_code_for(error))
        except OSError as error:
            text = f"{error.strerror or error}: {error.filename or ''}".rstrip(": ")
            click.echo(f"fenced: {one_line(text)}", err=True)
            ctx.exit(BAD_INPUT)
        except KeyboardInterrupt:  # Ctrl-C while waiting: not click's "Aborted!" with exit 1
            click.echo("fenced: interrupted", err=True)
            ctx.exit(_INTERRUPTED)


def one_line(text: str) -> str:
    """``text`` on one line: line breaks and other control characters (from a driver's
    message, or bytes of a damaged file quoted in it) become single spaces."""
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())


@click.group(cls=FencedGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fenced")
def cli() -> None:
    """fenced: leases with fencing tokens, and stores that reject stale owners."""
