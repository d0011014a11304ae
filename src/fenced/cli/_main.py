"""The ``fenced`` command: imports every command module, then runs the group.

Each command module registers its commands on :data:`fenced.cli._app.cli` when imported; add one
import line here per module. The console script and ``python -m fenced`` enter through
:func:`fenced.__main__.main`, which first checks that the ``cli`` extra (click, rich) is
installed: this package imports them freely, the rest of fenced never does.
"""

from __future__ import annotations

import logging
import sys

import click

from fenced.cli import (  # noqa: F401 - importing a command module registers its commands
    _demo,
    _elect_cmd,
    _keys_cmd,
    _ops_cmds,
    _run_cmd,
    _serve_cmd,
    _status_cmd,
    _store_cmds,
    _verify_cmd,
)
from fenced.cli._app import cli
from fenced.cli._exitcodes import INTERNAL_ERROR

__all__ = ["cli", "main"]


def _log_to_stderr() -> None:
    """Warnings of the library (lease lost, renewal failed) as ``fenced: …`` lines on stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("fenced: %(message)s"))
    root = logging.getLogger("fenced")
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    root.propagate = False
    # A command reports a store's rejection as its own one-line error, and fenced run / elect
    # report a loss in their own line (with what happened to the command): do not say it twice.
    logging.getLogger("fenced.store").setLevel(logging.ERROR)
    logging.getLogger("fenced.runtime.loss").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> None:
    """Run the command line; never lets a traceback reach the user."""
    _log_to_stderr()
    try:
        cli.main(args=argv, prog_name="fenced", standalone_mode=True)
    except KeyboardInterrupt:
        click.echo("fenced: interrupted", err=True)
        sys.exit(130)
    except Exception as error:  # a bug: one line, distinct exit code
        click.echo(f"fenced: internal error: {type(error).__name__}: {error}", err=True)
        sys.exit(INTERNAL_ERROR)
