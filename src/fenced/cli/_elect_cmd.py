"""``fenced elect NAME --value V -- CMD…`` and ``fenced leader NAME [--watch] [--json]``.

``fenced elect`` is ``fenced run`` for an election: it queues as a candidate (first come, first
served), and once elected runs the command with the term in its environment (``FENCED_TOKEN``,
``FENCED_RESOURCE`` = the election name, ``FENCED_EPOCH`` = the term, ``FENCED_URL``). The
command runs only while this process leads: on loss its process group gets SIGTERM, then SIGKILL
after ``--grace``. Exit status as ``fenced run``: the command's own when the term was held
throughout (128 + N after a death by signal N); 75 not elected within ``--wait``; 76 the term
was lost while the command ran; 2 bad input; 3 a ``--fence`` store refused the term; 126/127
the command cannot be started / was not found.

``fenced leader`` prints the current leader (holder, value, term, remaining time) or ``no
leader`` (exit 1, like grep); ``--watch`` streams every change of leadership, one line (or one
JSON object) per change, every term exactly once and in order, until interrupted.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys

import click

from fenced.cli._app import OneLineUsageCommand, cli, url_option
from fenced.cli._checks import check_command, check_supervision, supervision_options
from fenced.cli._exitcodes import NOT_FOUND
from fenced.cli._run_cmd import exit_as_command, exit_start_failed, open_fence_stores
from fenced.coordinator._connect import connect, resolve_url
from fenced.core._names import validate_resource
from fenced.election import LeaderChange, LeaderChangeKind, LeaderInfo
from fenced.election._campaign import validate_value
from fenced.election._run import run_command_as_leader
from fenced.runtime._child import StartFailed

__all__ = ["JSON_FORMAT", "elect_command", "leader_command"]

JSON_FORMAT = 1
"""Version of the ``--json`` output of ``fenced leader``; bumped only for incompatible changes."""


@cli.command(
    "elect",
    cls=OneLineUsageCommand,
    short_help="Run a command only while elected leader.",
)
@click.argument("name")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="-- CMD [ARG]...")
@click.option(
    "--value",
    required=True,
    metavar="VALUE",
    help="The value this candidate advertises while it leads (an address, a URL...).",
)
@supervision_options(
    ttl_help="Term lifetime; renewed every ttl/3 while the command runs.",
    wait_help="How long to wait to be elected. Not elected in time: exit 75.",
    holder_help="Holder label shown by leader [default: host:pid].",
    fence_help="Install the new term at this store before the command starts (repeatable).",
)
@url_option()
@click.pass_context
def elect_command(
    ctx: click.Context,
    name: str,
    command: tuple[str, ...],
    value: str,
    ttl: str,
    wait: str,
    holder: str | None,
    grace: str,
    fence_urls: tuple[str, ...],
    url: str | None,
) -> None:
    """Wait to be elected leader of NAME, then run CMD while leading; stop it on loss.

    \b
    Put -- before the command:  fenced elect scheduler --value "$HOSTNAME:8080" -- ./scheduler
    The command gets FENCED_TOKEN, FENCED_RESOURCE (NAME), FENCED_EPOCH (the term), FENCED_URL.

    \b
    Exit status: the command's (128+N if killed by signal N) when the term was held
    throughout; 75 not elected within --wait; 76 leadership lost while the command ran
    (it got SIGTERM, then SIGKILL after --grace); 2 bad input; 3 a --fence store refused
    the term; 126/127 the command could not be executed / was not found.
    """
    election = check_command(
        name, command, "fenced elect NAME --value VALUE [OPTIONS] -- CMD [ARGS]..."
    )
    advertised = validate_value(value)
    checked = check_supervision(
        ttl=ttl, wait=wait, grace=grace, holder=holder, url=url, fence_urls=fence_urls
    )
    terms: list[int] = []
    with contextlib.ExitStack() as stack:
        stores = open_fence_stores(
            checked.fence_urls, stack
        )  # before the coordinator, as fenced run
        coord = stack.enter_context(connect(checked.url))
        try:
            result = run_command_as_leader(
                coord,
                election,
                command,
                value=advertised,
                ttl=checked.ttl,
                wait=checked.wait,
                grace=checked.grace,
                fence=stores,
                holder=checked.holder,
                on_elected=lambda leadership: terms.append(leadership.term),
                url=checked.url,  # absolute, password kept: the command connects with it
            )
        except StartFailed as error:
            exit_start_failed(ctx, error)
    exit_as_command(ctx, result, f"leadership of {election} (term {terms[0] if terms else 0})")


def _shown(value: str | None) -> str:
    if value is None:
        return "-"
    if value and value.isprintable() and " " not in value:
        return value
    return json.dumps(value)


def _when(at: float) -> str:
    moment = datetime.datetime.fromtimestamp(at, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def render_leader(name: str, info: LeaderInfo | None) -> str:
    """One human line: the leader of ``name`` with its term, value and remaining time."""
    if info is None:
        return f"{name}  no leader"
    return (
        f"{name}  term {info.term}  holder {info.holder}  value {_shown(info.value)}  "
        f"expires in {max(info.expires_in, 0.0):.1f}s"
    )


def render_change(change: LeaderChange) -> str:
    """One human line per change: time, kind, term, holder, value (and why a term ended)."""
    line = (
        f"{_when(change.at)}  {change.kind.value:<10}  {change.name}  term {change.term}  "
        f"holder {change.holder or '-'}  value {_shown(change.value)}"
    )
    if change.kind is LeaderChangeKind.ENDED:
        line += f"  ({change.reason})"
    return line


def _emit(line: str) -> None:
    """Print one line at once (a pipe reader sees each change as it happens)."""
    try:
        click.echo(line)
        sys.stdout.flush()
    except BrokenPipeError:  # `fenced leader --watch | head -1`: the reader is gone, so are we
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(0) from None


@cli.command(
    "leader",
    cls=OneLineUsageCommand,
    short_help="Show the leader of an election, or watch its changes.",
)
@click.argument("name")
@click.option("--watch", is_flag=True, help="Stream every change of leadership until interrupted.")
@click.option("--json", "as_json", is_flag=True, help="JSON output (format 1).")
@url_option()
@click.pass_context
def leader_command(
    ctx: click.Context, name: str, watch: bool, as_json: bool, url: str | None
) -> None:
    """Print the leader of election NAME: holder, value, term and remaining time.

    \b
    Exit status: 0 there is a leader; 1 no leader; 2 bad input.
    With --watch: the current leader first (if any), then one line per change
    (elected, proclaimed, ended), every term exactly once and in order, until
    interrupted. --json prints one JSON object (per change with --watch).
    """
    election = validate_resource(name)
    with connect(resolve_url(url), create=False) as coord:  # a read creates nothing
        if not watch:
            info = coord.leader(election)
            if as_json:
                leader = None if info is None else info.to_json()
                document = {"format": JSON_FORMAT, "name": election, "leader": leader}
                click.echo(json.dumps(document))
            else:
                click.echo(render_leader(election, info))
            ctx.exit(0 if info is not None else NOT_FOUND)
        with coord.observe(election) as observer:
            for change in observer:
                if as_json:
                    _emit(json.dumps({"format": JSON_FORMAT, **change.to_json()}))
                else:
                    _emit(render_change(change))
