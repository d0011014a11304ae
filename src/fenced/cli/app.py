"""The ``fenced`` click group and its error handling.

Every fenced error becomes a one-line message on stderr and its documented exit code
(:mod:`fenced.cli.exitcodes`); click's usage errors exit with 2. No traceback reaches the user.
"""

from __future__ import annotations

from typing import Any

import click

from fenced.cli.exitcodes import BAD_INPUT, exit_code_for
from fenced.core.errors import FencedError


class FencedGroup(click.Group):
    """A click group that turns fenced errors into one-line messages and exit codes."""

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
