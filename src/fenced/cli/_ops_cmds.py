"""Operations commands: ``fenced timeline``, ``metrics``, ``backup``, ``restore`` and ``rebind``.

Thin faces over :mod:`fenced.observe` and :mod:`fenced.coordinator._restore`: they parse, call the
library and render (a rich table on a terminal, plain aligned text otherwise, ``--json`` for one
stable document; shapes in docs/operations.md). Bad input is one line on stderr and exit 2.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from types import FrameType
from typing import Any

import click

from fenced.cli._app import OneLineUsageCommand, cli, stores_option, url_option
from fenced.cli._ops_args import (
    format_instant,
    format_seconds,
    open_existing_stores,
    parse_duration,
    parse_listen,
    parse_since,
)
from fenced.cli._status_cmd import display_url
from fenced.coordinator import _rebind as rebinding
from fenced.coordinator import _restore as restoring
from fenced.coordinator._connect import connect
from fenced.core._errors import ConfigurationError
from fenced.core._names import validate_resource
from fenced.fence import Store
from fenced.observe.timeline import Timeline, read_timeline

__all__ = [
    "backup_command",
    "metrics_command",
    "rebind_command",
    "render_timeline",
    "restore_command",
    "timeline_command",
]


@contextmanager
def _stores(urls: Sequence[str]) -> Iterator[list[Store]]:
    stores = open_existing_stores(list(urls))
    try:
        yield stores
    finally:
        for store in stores:
            store.close()


# -- timeline -----------------------------------------------------------------------------------


def _plain_table(headers: list[str], rows: list[list[str]], numeric: set[int]) -> list[str]:
    table = [headers, *rows]
    widths = [max(len(line[col]) for line in table) for col in range(len(headers))]
    return [
        "  ".join(
            cell.rjust(widths[col]) if col in numeric else cell.ljust(widths[col])
            for col, cell in enumerate(line)
        ).rstrip()
        for line in table
    ]


def _ownership_rows(view: Timeline) -> list[list[str]]:
    """Intervals and gaps, in time order, as table rows."""
    now = view.until
    entries: list[tuple[float, int, list[str]]] = []
    for interval in view.intervals:
        notes = []
        if interval.renewal_failures:
            notes.append(f"{interval.renewal_failures} renewal failure(s)")
        if interval.lost:
            notes.append(f"holder saw it lost ({interval.lost})")
        if interval.accepted_writes:
            notes.append(f"{interval.accepted_writes} write(s) accepted")
        entries.append(
            (
                interval.start if interval.start is not None else -1.0,
                0,
                [
                    str(interval.epoch),
                    interval.holder or "?",
                    format_instant(interval.start, now),
                    format_instant(interval.end, now) if interval.end is not None else "now",
                    format_seconds(interval.duration(now)),
                    interval.ended,
                    "; ".join(notes),
                ],
            )
        )
    for gap in view.gaps:
        entries.append(
            (
                gap.start,
                1,
                [
                    "-",
                    "(no owner)",
                    format_instant(gap.start, now),
                    format_instant(gap.end, now) if gap.end is not None else "now",
                    format_seconds(gap.duration(now)),
                    "",
                    "",
                ],
            )
        )
    return [cells for _, _, cells in sorted(entries, key=lambda e: (e[0], e[1]))]


_OWNERSHIP = ["EPOCH", "HOLDER", "FROM", "TO", "DURATION", "ENDED", "NOTES"]
_REJECTIONS = ["AT", "STORE", "OP", "TARGET", "EPOCH", "FLOOR", "REASON", "HOLDER"]
_EVENTS = ["AT", "KIND", "EPOCH", "HOLDER", "SOURCE", "DETAIL"]


def _rejection_rows(view: Timeline) -> list[list[str]]:
    return [
        [
            format_instant(r.at, view.until),
            display_url(r.store),
            r.op,
            r.key if r.key is not None else (repr(r.name) if r.name is not None else "-"),
            str(r.epoch),
            "-" if r.floor is None else str(r.floor),
            r.reason,
            r.holder or "?",
        ]
        for r in view.rejections
    ]


def _event_rows(view: Timeline) -> list[list[str]]:
    return [
        [
            format_instant(e.at, view.until),
            e.kind,
            str(e.epoch),
            e.holder or "-",
            e.source if e.source == "coordinator" else display_url(e.source),
            ", ".join(f"{k}={v}" for k, v in e.detail.items()),
        ]
        for e in view.events
    ]


def _figures_line(view: Timeline) -> str:
    f = view.figures
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(f.rejected_by_reason.items()))
    return (
        f"{f.ownership_changes} ownership change(s), {format_seconds(f.time_without_owner)} "
        f"without owner, {f.rejected_writes} rejected write(s)"
        + (f" ({reasons})" if reasons else "")
        + f", {f.renewal_failures} renewal failure(s), {f.expiries} expiry(ies)"
        + f" in {format_seconds(f.until - f.since)}"
    )


def render_timeline(view: Timeline, url: str) -> str:
    """The plain-text rendering of a timeline (what ``fenced timeline`` prints off a terminal)."""
    lines = [
        f"{view.resource} at {url}, from {format_instant(view.since, view.until)} "
        f"to {format_instant(view.until, view.until)}",
        "",
    ]
    ownership = _ownership_rows(view)
    if ownership:
        lines += _plain_table(_OWNERSHIP, ownership, {0, 4})
    else:
        lines.append("no ownership records in this window")
    if view.rejections:
        lines += ["", "rejected writes:", *_plain_table(_REJECTIONS, _rejection_rows(view), {4, 5})]
    if view.events:
        lines += ["", "events:", *_plain_table(_EVENTS, _event_rows(view), {2})]
    lines += ["", _figures_line(view)]
    return "\n".join(lines)


def _rich_timeline(view: Timeline, url: str) -> None:
    from rich.console import Console  # noqa: PLC0415 - only on a terminal
    from rich.table import Table  # noqa: PLC0415

    console = Console(highlight=False)

    def table(title: str, headers: list[str], rows: list[list[str]], numeric: set[int]) -> None:
        shown = Table(title=title, title_justify="left")
        for col, header in enumerate(headers):
            shown.add_column(
                header.title(), justify="right" if col in numeric else "left", overflow="fold"
            )
        for row in rows:
            style = "dim" if row[0] == "-" and headers is _OWNERSHIP else None
            shown.add_row(*row, style=style)
        console.print(shown)

    since = format_instant(view.since, view.until)
    title = f"{view.resource} · {url} · from {since} to {format_instant(view.until, view.until)}"
    ownership = _ownership_rows(view)
    if ownership:
        table(title, _OWNERSHIP, ownership, {0, 4})
    else:
        console.print(f"{title}\nno ownership records in this window")
    if view.rejections:
        table("Rejected writes", _REJECTIONS, _rejection_rows(view), {4, 5})
    if view.events:
        table("Events", _EVENTS, _event_rows(view), {2})
    console.print(_figures_line(view))


@cli.command("timeline", cls=OneLineUsageCommand, short_help="Show who owned a resource when.")
@click.argument("resource")
@click.option("--since", metavar="WHEN", help="Start: a duration ago (2h, 30m) or a time.")
@stores_option("Merge the records of this store (accepted and rejected writes); repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (format 1).")
@url_option()
def timeline_command(
    resource: str, since: str | None, store_urls: tuple[str, ...], as_json: bool, url: str | None
) -> None:
    """Show RESOURCE's ownership intervals (epoch, holder, from, to, how each ended), the gaps
    without an owner, renewal failures, restores and the writes the --store stores rejected.

    Built from the coordinator's and the stores' retained records; read-only.
    """
    name = validate_resource(resource)
    now = time.time()
    start = None if since is None else parse_since("--since", since, now)
    with _stores(store_urls) as stores, connect(url, create=False) as coord:
        view = read_timeline(coord, name, stores, since=start, now=now)
        shown_url = display_url(coord.url)
        coordinator_id = coord.coordinator_id
    if as_json:
        document = {**view.to_json(), "url": shown_url, "coordinator_id": coordinator_id}
        click.echo(json.dumps(document, indent=2))
    elif sys.stdout.isatty():
        _rich_timeline(view, shown_url)
    else:
        click.echo(render_timeline(view, shown_url))


# -- metrics ------------------------------------------------------------------------------------


@cli.command("metrics", cls=OneLineUsageCommand, short_help="Print or serve Prometheus metrics.")
@stores_option("Count the writes this store rejected; repeatable.")
@click.option("--listen", metavar="ADDR", help="Serve /metrics on HOST:PORT, :PORT or PORT.")
@click.option(
    "--flap-threshold",
    type=int,
    default=None,
    help="fenced_flapping is 1 above this many ownership changes in the window [default: 10].",
)
@click.option("--flap-window", metavar="DURATION", help="The flap window [default: 5m].")
@url_option()
def metrics_command(
    store_urls: tuple[str, ...],
    listen: str | None,
    flap_threshold: int | None,
    flap_window: str | None,
    url: str | None,
) -> None:
    """Print fenced's Prometheus metrics once (text format), or serve them with --listen.

    With --listen the metrics are served at /metrics until SIGINT or SIGTERM; every scrape reads
    the records added since the previous one. Needs the metrics extra (prometheus_client).
    """
    address = None if listen is None else parse_listen(listen)
    try:
        from prometheus_client import CollectorRegistry, generate_latest  # noqa: PLC0415

        from fenced.observe import metrics  # noqa: PLC0415
    except ImportError as error:
        raise ConfigurationError(
            f"fenced metrics needs prometheus_client: pip install 'fenced[metrics]' ({error})"
        ) from error
    options: dict[str, Any] = {}
    if flap_threshold is not None:
        options["flap_threshold"] = flap_threshold
    if flap_window is not None:
        options["flap_window"] = parse_duration("--flap-window", flap_window)
    with _stores(store_urls) as stores, connect(url, create=False) as coord:
        registry = CollectorRegistry()
        metrics.register(registry, coord, stores=stores, **options)
        if address is None:
            click.echo(generate_latest(registry).decode(), nl=False)
            return
        _serve(registry, address)


def _serve(registry: Any, address: tuple[str, int]) -> None:
    """Serve ``registry`` at ``address`` until SIGINT or SIGTERM."""
    from http.server import ThreadingHTTPServer  # noqa: PLC0415

    from prometheus_client.exposition import MetricsHandler  # noqa: PLC0415

    try:
        server = ThreadingHTTPServer(address, MetricsHandler.factory(registry))
    except OSError as error:
        raise ConfigurationError(
            f"cannot listen on {address[0]}:{address[1]}: {error.strerror}"
        ) from error
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    with ExitStack() as stack:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous = signal.signal(signum, on_signal)
            stack.callback(signal.signal, signum, previous)
        stack.callback(server.server_close)
        thread = threading.Thread(target=server.serve_forever, name="fenced-metrics", daemon=True)
        thread.start()
        host, port = server.server_address[:2]
        shown = f"[{host!s}]" if ":" in str(host) else str(host)
        click.echo(f"fenced: serving metrics on http://{shown}:{port}/metrics", err=True)
        while not stop.wait(3600):
            pass
        server.shutdown()
        thread.join(timeout=5)
    click.echo("fenced: stopped serving metrics", err=True)


# -- backup and restore -------------------------------------------------------------------------


@cli.command("backup", cls=OneLineUsageCommand, short_help="Copy the coordinator's state.")
@click.argument("dest", metavar="DEST")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@url_option()
def backup_command(dest: str, as_json: bool, url: str | None) -> None:
    """Write a consistent online copy of the embedded (sqlite:) coordinator to DEST.

    Safe while leases are granted and released. DEST is a file (replaced atomically) or a
    directory (the copy is named fenced-<coordinator id>.db), never the live database or its
    -wal, -shm or -journal file (by any path or link). Restore it with 'fenced restore'.
    """
    info = restoring.backup(url, dest)
    if as_json:
        click.echo(json.dumps(info.to_json(), sort_keys=True))
        return
    click.echo(
        f"backed up {display_url(info.url)} to {info.path}: coordinator {info.coordinator_id}, "
        f"{info.resources} resource(s), largest epoch {info.largest_epoch}"
    )


@cli.command("restore", cls=OneLineUsageCommand, short_help="Restore the coordinator, safely.")
@click.argument("src", metavar="[SRC]", required=False)
@click.option(
    "--advance",
    "advance_only",
    is_flag=True,
    help="Only advance the epochs (after a restore done outside fenced); no SRC.",
)
@click.option(
    "--floor-from",
    "floor_urls",
    multiple=True,
    metavar="STORE",
    help="Also advance past this store's floors; repeatable.",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@url_option()
def restore_command(
    src: str | None,
    advance_only: bool,
    floor_urls: tuple[str, ...],
    yes: bool,
    as_json: bool,
    url: str | None,
) -> None:
    """Restore the embedded coordinator from the backup SRC, or (--advance) make a coordinator
    restored by other means safe: every later epoch goes above anything it may have issued.

    Stop every process that uses the coordinator first. Every live lease is ended, and each
    resource's history gets a 'restored' record. See docs/operations.md.
    """
    if advance_only == (src is not None):
        raise ConfigurationError(
            "give either SRC (a backup to restore) or --advance (see 'fenced restore --help')"
        )
    if not yes:
        what = "advance every epoch of" if advance_only else f"replace the state with {src} in"
        if not sys.stdin.isatty():
            raise ConfigurationError(f"this would {what} the coordinator; pass --yes to confirm")
        click.confirm(f"This ends every lease and will {what} the coordinator. Go on?", abort=True)
    with _stores(floor_urls) as stores:
        if src is None:
            report = restoring.advance(url, stores=stores)
        else:
            report = restoring.restore(url, src, stores=stores)
    if as_json:
        click.echo(json.dumps(report.to_json(), sort_keys=True))
        return
    done = "advanced the epochs of" if src is None else f"restored {src} as"
    click.echo(
        f"{done} {display_url(report.url)} (coordinator {report.coordinator_id}); every later "
        f"epoch is above {report.minimum}"
    )


# -- rebind -------------------------------------------------------------------------------------


@cli.command("rebind", cls=OneLineUsageCommand, short_help="Bind a store to a new coordinator.")
@click.argument("store_url", metavar="STORE")
@click.option(
    "--resource",
    "resources",
    multiple=True,
    metavar="R",
    help="Rebind only this resource; repeatable [default: every resource of STORE].",
)
@click.option(
    "--from",
    "previous",
    metavar="ID",
    help="The id of the lost coordinator: rebind only resources bound to it.",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@url_option("--coordinator")
def rebind_command(
    store_url: str,
    resources: tuple[str, ...],
    previous: str | None,
    yes: bool,
    as_json: bool,
    url: str | None,
) -> None:
    """Bind STORE's resources, now bound to a coordinator that was lost without a backup, to
    the coordinator at --url, keeping every floor; each gets a 'rebound' record.

    Run 'fenced restore --advance --floor-from STORE' on the new coordinator first (rebind
    refuses otherwise), with every worker stopped. Tokens of the old coordinator are refused by
    STORE from then on. See docs/operations.md, "Lost coordinator without a backup".
    """
    names = [validate_resource(name) for name in resources]
    if not yes:
        what = f"bind the resources of {display_url(store_url)} to the coordinator"
        if not sys.stdin.isatty():
            raise ConfigurationError(f"this would {what}; pass --yes to confirm")
        click.confirm(
            f"This will {what}; the old coordinator's tokens are refused from then on. Go on?",
            abort=True,
        )
    # the new coordinator may be created here: rebind then refuses, naming the advance step
    with _stores([store_url]) as stores, connect(url) as coord:
        report = rebinding.rebind(stores[0], coord, resources=names or None, previous=previous)
    if as_json:
        click.echo(json.dumps(report.to_json(), sort_keys=True))
        return
    store = display_url(report.store)
    if not report.rebound:
        click.echo(f"nothing to rebind at {store}: no resource is bound to another coordinator")
        return
    floors = ", ".join(f"{name} {floor}" for name, floor in report.rebound.items())
    click.echo(
        f"rebound {len(report.rebound)} resource(s) of {store} from coordinator "
        f"{', '.join(report.previous)} to {report.coordinator_id} at {display_url(report.url)} "
        f"(floors kept: {floors})"
    )
