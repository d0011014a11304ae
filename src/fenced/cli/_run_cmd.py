"""``fenced run RESOURCE [options] -- CMD…``: run a command while holding a lease on RESOURCE.

The command gets ``FENCED_TOKEN``, ``FENCED_RESOURCE``, ``FENCED_EPOCH`` and ``FENCED_URL``; it
runs in its own process group; when the lease is lost its group gets SIGTERM, then SIGKILL after
``--grace`` seconds (see :mod:`fenced.runtime._child`). Exit status: the command's own (128 + N
after a death by signal N) when the lease was held throughout; 75 when the lease was not acquired
within ``--wait``; 76 when it was lost while the command ran; 2 for bad input; 3 when a ``--fence``
store refused the new epoch; 126/127 when the command cannot be started or is not found.

Its options and their checks are shared with ``fenced elect`` (:mod:`fenced.cli._checks`), as
are :func:`open_fence_stores`, :func:`exit_start_failed` and :func:`exit_as_command`.
"""

from __future__ import annotations

import contextlib
from typing import NoReturn

import click

from fenced.cli._app import OneLineUsageCommand, cli, url_option
from fenced.cli._checks import (
    check_command,
    check_store_urls,
    check_supervision,
    supervision_options,
)
from fenced.cli._exitcodes import LEASE_LOST
from fenced.coordinator._connect import connect
from fenced.core._errors import LeaseLost
from fenced.runtime._child import ChildResult, ChildSupervisor, StartFailed
from fenced.runtime._hold import Fenceable

__all__ = ["exit_as_command", "exit_start_failed", "open_fence_stores", "run_command"]


def open_fence_stores(urls: tuple[str, ...], stack: contextlib.ExitStack) -> list[Fenceable]:
    """Open the ``--fence`` stores, closed when ``stack`` closes (shared with ``fenced elect``);
    each is created if missing (the command writes there). Every URL is checked first."""
    if not urls:
        return []
    from fenced.fence import open_store  # noqa: PLC0415 - only needed with --fence

    check_store_urls(urls)
    stores: list[Fenceable] = []
    for url in urls:
        store = open_store(url)
        stack.callback(store.close)
        stores.append(store)
    return stores


def exit_start_failed(ctx: click.Context, error: StartFailed) -> NoReturn:
    """Say why the command could not be started; exit with 126 or 127."""
    click.echo(f"fenced: {error}", err=True)
    ctx.exit(error.exit_status)


def exit_as_command(ctx: click.Context, result: ChildResult, what: str) -> NoReturn:
    """Exit with the command's status; or, if ``what`` (e.g. "lease on R (epoch 7)") was lost
    before its exit was seen, say so and exit with :data:`LEASE_LOST`."""
    if result.lost is not None:
        _report_loss(what, result)
        ctx.exit(LEASE_LOST)
    ctx.exit(result.exit_status)


def _report_loss(what: str, result: ChildResult) -> None:
    """Say in one line that ``what`` was lost while the child ran."""
    assert result.lost is not None
    why = f"({result.lost.reason.value}: {result.lost.detail})"
    sent = " and ".join(sig.name for sig in result.signalled)
    if sent:
        message = (
            f"{what} lost while the command ran {why}; "
            f"sent {sent} to the command, which {result.describe()}"
        )
    else:
        message = (
            f"{what} was lost before the command's exit was seen "
            f"{why}; the command {result.describe()}"
        )
    click.echo(f"fenced: {message}", err=True)


@cli.command(
    "run",
    cls=OneLineUsageCommand,
    short_help="Run a command while holding a lease.",
)
@click.argument("resource")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="-- CMD [ARG]...")
@supervision_options(
    ttl_help="Lease lifetime; renewed every ttl/3 while the command runs.",
    wait_help="How long to wait for the lease; 0 tries once. Not acquired in time: exit 75.",
    holder_help="Holder label shown by status [default: host:pid].",
    fence_help="Install the new epoch at this store before the command starts (repeatable).",
)
@url_option()
@click.pass_context
def run_command(
    ctx: click.Context,
    resource: str,
    command: tuple[str, ...],
    ttl: str,
    wait: str,
    holder: str | None,
    grace: str,
    fence_urls: tuple[str, ...],
    url: str | None,
) -> None:
    """Run CMD while holding a lease on RESOURCE; stop it if the lease is lost.

    \b
    Put -- before the command:  fenced run exports/daily --ttl 30 -- ./export.sh --full
    The command gets FENCED_TOKEN, FENCED_RESOURCE, FENCED_EPOCH and FENCED_URL.

    \b
    Exit status: the command's (128+N if killed by signal N) when the lease was held
    throughout; 75 not acquired within --wait; 76 lease lost while the command ran
    (it got SIGTERM, then SIGKILL after --grace); 2 bad input; 3 a --fence store refused
    the epoch; 126/127 the command could not be executed / was not found.
    """
    # everything is validated before any I/O
    name = check_command(resource, command, "fenced run RESOURCE [OPTIONS] -- CMD [ARGS]...")
    checked = check_supervision(
        ttl=ttl, wait=wait, grace=grace, holder=holder, url=url, fence_urls=fence_urls
    )
    supervisor = ChildSupervisor(command, grace=checked.grace, url=checked.url)
    try:
        supervisor.check_command()
    except StartFailed as error:
        supervisor.close()
        exit_start_failed(ctx, error)

    result: ChildResult | None = None
    epoch = 0
    with contextlib.ExitStack() as stack:
        stack.callback(supervisor.close)
        # the stores first: one that cannot be opened leaves no coordinator created for nothing
        stores = open_fence_stores(checked.fence_urls, stack)
        coord = stack.enter_context(connect(checked.url))
        try:
            with coord.hold(
                name,
                checked.ttl,
                wait=checked.wait,
                fence=stores,
                on_lost=supervisor.on_lost,
                holder=checked.holder,
            ) as held:
                epoch = held.epoch
                result = supervisor.run(held)
        except LeaseLost:
            if result is None:  # lost before the command could start
                raise
            # else: noticed when releasing, after the command's exit; result.lost says whether
            # that was while the command ran
        except StartFailed as error:
            exit_start_failed(ctx, error)
    assert result is not None
    exit_as_command(ctx, result, f"lease on {name} (epoch {epoch})")
