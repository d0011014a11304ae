"""The ``fenced`` click group and its error handling.

Every fenced error becomes a one-line message on stderr and its documented exit code
(:mod:`fenced.cli.exitcodes`); click's usage errors exit with 2. No traceback reaches the user.
"""

from __future__ import annotations

from typing import Any

import click

from fenced.cli.exitcodes import BAD_INPUT, exit_code_for
from fenced.core.errors import ConfigurationError, FencedError


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
            where = f"fenced {info_name}" if info_name else "fenced"
            message = error.format_message().rstrip(".")
            raise ConfigurationError(f"{message} (see '{where} --help')") from None


class FencedGroup(click.Group):
    """A click group that turns fenced errors into one-line messages and exit codes.

    Its commands are :class:`OneLineUsageCommand`s: usage errors are one line too.
    """

    command_class = OneLineUsageCommand

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except FencedError as error:
            click.echo(f"fenced: {error}", err=True)
            ctx.exit(exit_code_for(error))
        except OSError as error:
            click.echo(
                f"fenced: {error.strerror or error}: {error.filename or ''}".rstrip(": "), err=True
            )
            ctx.exit(BAD_INPUT)


@click.group(cls=FencedGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fenced")
def cli() -> None:
    """fenced: leases with fencing tokens, and stores that reject stale owners."""
