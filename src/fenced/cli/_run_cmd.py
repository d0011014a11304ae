"""``fenced run RESOURCE [options] -- CMD…``: run a command while holding a lease on RESOURCE.

The command gets ``FENCED_TOKEN``, ``FENCED_RESOURCE``, ``FENCED_EPOCH`` and ``FENCED_URL``; it
runs in its own process group; when the lease is lost its group gets SIGTERM, then SIGKILL after
``--grace`` seconds (see :mod:`fenced.runtime._child`). Exit status: the command's own (128 + N
after a death by signal N) when the lease was held throughout; 75 when the lease was not acquired
within ``--wait``; 76 when it was lost while the command ran; 2 for bad input; 3 when a ``--fence``
store refused the new epoch; 126/127 when the command cannot be started or is not found.

Also home of :func:`parse_seconds`, shared by the commands of this package.
"""

from __future__ import annotations

import contextlib
import math

import click

from fenced.cli._app import OneLineUsageCommand, cli, url_option
from fenced.cli._exitcodes import LEASE_LOST
from fenced.coordinator._connect import absolute_url, connect, resolve_url
from fenced.core._errors import ConfigurationError, LeaseLost
from fenced.core._names import validate_resource
from fenced.core._policy import validate_holder, validate_ttl, validate_wait
from fenced.runtime._child import (
    DEFAULT_GRACE,
    ChildResult,
    ChildSupervisor,
    StartFailed,
    validate_grace,
)
from fenced.runtime._hold import Fenceable

__all__ = [
    "DEFAULT_TTL",
    "check_store_urls",
    "open_fence_stores",
    "parse_seconds",
    "report_loss",
    "run_command",
]

DEFAULT_TTL = 30.0
"""Default ``--ttl`` of ``fenced run`` in seconds."""

_FOREVER = ("forever", "inf", "infinity", "none")


def parse_seconds(option: str, text: str, *, forever: bool = False) -> float | None:
    """Parse a number of seconds given on the command line; None for "forever" if allowed.

    Raises :class:`ConfigurationError` naming ``option`` for anything else (a one-line message).
    """
    cleaned = text.strip().lower()
    if forever and cleaned in _FOREVER:
        return None
    try:
        value = float(cleaned)
    except ValueError:
        hint = " or 'forever'" if forever else ""
        raise ConfigurationError(
            f"{option} must be a number of seconds{hint}, got {text!r}"
        ) from None
    if forever and value == math.inf:
        return None
    if not math.isfinite(value):
        raise ConfigurationError(f"{option} must be a finite number of seconds, got {text!r}")
    return value


def check_store_urls(urls: tuple[str, ...]) -> None:
    """Refuse a malformed ``--fence`` URL before anything is opened or created (ConfigurationError;
    reads at most file headers)."""
    if urls:
        from fenced.fence._registry import check_url  # noqa: PLC0415 - only needed with --fence

        for url in urls:
            check_url(url)


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


def report_loss(what: str, result: ChildResult) -> None:
    """Say in one line that ``what`` (e.g. "lease on R (epoch 7)") was lost while the child ran."""
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
@click.option(
    "--ttl",
    default=f"{DEFAULT_TTL:g}",
    show_default=True,
    metavar="SECONDS",
    help="Lease lifetime; renewed every ttl/3 while the command runs.",
)
@click.option(
    "--wait",
    default="forever",
    show_default=True,
    metavar="SECONDS|forever",
    help="How long to wait for the lease; 0 tries once. Not acquired in time: exit 75.",
)
@click.option("--holder", metavar="LABEL", help="Holder label shown by status [default: host:pid].")
@click.option(
    "--grace",
    default=f"{DEFAULT_GRACE:g}",
    show_default=True,
    metavar="SECONDS",
    help="After a loss: seconds between SIGTERM and SIGKILL.",
)
@click.option(
    "--fence",
    "fence_urls",
    multiple=True,
    metavar="STORE_URL",
    help="Install the new epoch at this store before the command starts (repeatable).",
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
    name = validate_resource(resource)
    if not command:
        raise ConfigurationError(
            "missing command (usage: fenced run RESOURCE [OPTIONS] -- CMD [ARGS]...)"
        )
    ttl_value = validate_ttl(parse_seconds("--ttl", ttl))
    wait_value = validate_wait(parse_seconds("--wait", wait, forever=True))
    grace_value = validate_grace(parse_seconds("--grace", grace))
    label = None if holder is None else validate_holder(holder)
    # absolute: the command's FENCED_URL names this coordinator wherever the command cds to
    coordinator_url = absolute_url(resolve_url(url))
    check_store_urls(fence_urls)
    supervisor = ChildSupervisor(command, grace=grace_value, url=coordinator_url)
    try:
        supervisor.check_command()
    except StartFailed as error:
        supervisor.close()
        click.echo(f"fenced: {error}", err=True)
        ctx.exit(error.exit_status)

    result: ChildResult | None = None
    epoch = 0
    with contextlib.ExitStack() as stack:
        stack.callback(supervisor.close)
        # the stores first: one that cannot be opened leaves no coordinator created for nothing
        stores = open_fence_stores(fence_urls, stack)
        coord = stack.enter_context(connect(coordinator_url))
        try:
            with coord.hold(
                name,
                ttl_value,
                wait=wait_value,
                fence=stores,
                on_lost=supervisor.on_lost,
                holder=label,
            ) as held:
                epoch = held.epoch
                result = supervisor.run(held)
        except LeaseLost:
            if result is None:  # lost before the command could start
                raise
            # else: noticed when releasing, after the command's exit; result.lost says whether
            # that was while the command ran
        except StartFailed as error:
            click.echo(f"fenced: {error}", err=True)
            ctx.exit(error.exit_status)
    assert result is not None
    if result.lost is not None:
        report_loss(f"lease on {name} (epoch {epoch})", result)
        ctx.exit(LEASE_LOST)
    ctx.exit(result.exit_status)
