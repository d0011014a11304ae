"""``fenced status [RESOURCE…] [--window D] [--store URL…] [--json] [--url URL]``: who holds
what, at which epoch, and how ownership went lately.

A reader: it creates nothing (a missing database or store is an error, exit 2). It asks the
coordinator for each resource's live lease and its last granted epoch, and computes from the
records (:mod:`fenced.observe.timeline`) the figures of the last ``--window`` (default 1 h):
ownership changes, time without owner, and writes the ``--store`` stores rejected. Its one
write: the embedded coordinator records lease ends not recorded yet before its records are read;
when that fails (a full disk) the state is shown all the same, with a warning on stderr. With
no RESOURCE it lists every resource the coordinator has ever granted. Human output is a table
(a rich table on a terminal, plain aligned columns otherwise); ``--json`` prints one stable
document (format 1, documented in docs/cli.md and docs/operations.md).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import click

from fenced.cli._app import OneLineUsageCommand, cli, stores_option, url_option
from fenced.cli._ops_args import format_seconds, open_existing_stores, parse_duration
from fenced.coordinator._client import Coordinator
from fenced.coordinator._connect import connect
from fenced.core._names import validate_resource
from fenced.core._urls import redacted
from fenced.observe.timeline import Figures, StoreRecordSource, read_timeline

__all__ = [
    "DEFAULT_WINDOW",
    "JSON_FORMAT",
    "ResourceStatus",
    "display_url",
    "read_status",
    "status_command",
]

JSON_FORMAT = 1
"""Version of the ``--json`` document; bumped only for incompatible changes."""
DEFAULT_WINDOW = 3600.0
"""Seconds of history the figures cover unless ``--window`` says otherwise."""


@dataclass(frozen=True, slots=True)
class ResourceStatus:
    """One row: the live lease (if any) and the last epoch ever granted for ``resource``.

    ``holder``, ``epoch``, ``expires_in`` and ``ttl`` are None when nobody holds the resource.
    ``expires_in`` is the remaining time by the coordinator's clock when it answered.
    ``figures``: what happened in the window (None if not computed).
    """

    resource: str
    holder: str | None
    epoch: int | None
    expires_in: float | None
    ttl: float | None
    last_epoch: int
    figures: Figures | None = None

    @property
    def held(self) -> bool:
        return self.epoch is not None

    def as_json(self) -> dict[str, Any]:
        return {
            "resource": self.resource,
            "held": self.held,
            "holder": self.holder,
            "epoch": self.epoch,
            "expires_in": None if self.expires_in is None else round(self.expires_in, 3),
            "ttl": self.ttl,
            "last_epoch": self.last_epoch,
            "figures": None if self.figures is None else self.figures.to_json(),
        }


def read_status(
    coord: Coordinator,
    resources: list[str],
    *,
    stores: Sequence[StoreRecordSource] = (),
    window: float | None = None,
    now: float | None = None,
) -> list[ResourceStatus]:
    """The status of ``resources`` (all known ones if empty), in the given or sorted order.

    The live lease is read before the last epoch, so ``last_epoch >= epoch`` always holds even
    if a grant happens in between. With ``window`` (seconds), each row carries the figures of
    the ``window`` seconds before ``now`` (default: the current time), from the coordinator's
    records and those of ``stores``.
    """
    names = resources or coord.resources()
    moment = time.time() if now is None else now
    rows = []
    for name in names:
        info = coord.current(name)
        last = coord.last_epoch(name)
        figures = None
        if window is not None:
            view = read_timeline(coord, name, stores, since=moment - window, now=moment)
            figures = view.figures
        if info is None:
            rows.append(ResourceStatus(name, None, None, None, None, last, figures))
        else:
            rows.append(
                ResourceStatus(
                    name,
                    info.holder,
                    info.epoch,
                    info.expires_in,
                    info.ttl,
                    max(last, info.epoch),
                    figures,
                )
            )
    return rows


def display_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (safe to print)."""
    return redacted(url)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _cells(row: ResourceStatus, with_stores: bool) -> list[str]:
    figures = row.figures
    return [
        row.resource,
        row.holder if row.holder is not None else "-",
        str(row.epoch) if row.epoch is not None else "-",
        _seconds(row.expires_in),
        str(row.last_epoch),
        "-" if figures is None else str(figures.ownership_changes),
        "-" if figures is None else format_seconds(figures.time_without_owner),
        "-" if figures is None or not with_stores else str(figures.rejected_writes),
    ]


_HEADERS = ["RESOURCE", "HOLDER", "EPOCH", "REMAINING", "LAST EPOCH"]
_FIGURES = ["CHANGES", "UNOWNED", "REJECTED"]
_NUMERIC = {2, 3, 4, 5, 6, 7}


def _span(seconds: float) -> str:
    """``1h``, ``30m``, ``90s``, ``2d``: a window for column headers."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _headers(window: float) -> list[str]:
    return [*_HEADERS, *(f"{name}/{_span(window)}" for name in _FIGURES)]


def _plain(rows: list[ResourceStatus], window: float, with_stores: bool) -> str:
    headers = _headers(window)
    table = [headers, *(_cells(row, with_stores) for row in rows)]
    widths = [max(len(line[col]) for line in table) for col in range(len(headers))]
    lines = []
    for line in table:
        cells = [
            cell.rjust(widths[col]) if col in _NUMERIC else cell.ljust(widths[col])
            for col, cell in enumerate(line)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _rich(rows: list[ResourceStatus], url: str, window: float, with_stores: bool) -> None:
    from rich.console import Console  # noqa: PLC0415 - only on a terminal
    from rich.table import Table  # noqa: PLC0415

    table = Table(title=f"fenced status · {url}", title_justify="left")
    for col, header in enumerate(_headers(window)):
        table.add_column(header.title(), justify="right" if col in _NUMERIC else "left")
    for row in rows:
        style = None if row.held else "dim"
        table.add_row(*_cells(row, with_stores), style=style)
    Console(highlight=False).print(table)


@cli.command("status", cls=OneLineUsageCommand, short_help="Show holders and epochs.")
@click.argument("resources", nargs=-1, metavar="[RESOURCE]...")
@click.option(
    "--window",
    metavar="DURATION",
    default="1h",
    show_default=True,
    help="The figures cover this much history (90s, 15m, 2h, 7d).",
)
@stores_option("Count the writes this store rejected; repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (format 1).")
@url_option()
def status_command(
    resources: tuple[str, ...],
    window: str,
    store_urls: tuple[str, ...],
    as_json: bool,
    url: str | None,
) -> None:
    """Show the holder, epoch, remaining time and last epoch of each RESOURCE, and what
    happened in the last --window: ownership changes, time without owner, and (with --store)
    the writes the stores rejected.

    With no RESOURCE, every resource the coordinator has ever granted is shown. A resource that
    was never granted shows last epoch 0.
    """
    names = [validate_resource(name) for name in resources]  # before any I/O
    span = parse_duration("--window", window)
    stores = open_existing_stores(list(store_urls))
    try:
        with connect(url, create=False) as coord:
            rows = read_status(coord, names, stores=stores, window=span)
            shown_url = display_url(coord.url)
            coordinator_id = coord.coordinator_id
    finally:
        for store in stores:
            store.close()
    if as_json:
        document = {
            "format": JSON_FORMAT,
            "url": shown_url,
            "coordinator_id": coordinator_id,
            "window": span,
            "stores": [display_url(store.url) for store in stores],
            "resources": [row.as_json() for row in rows],
        }
        click.echo(json.dumps(document, indent=2))
        return
    if not rows:
        click.echo(f"no resources have been granted at {shown_url}")
        return
    if sys.stdout.isatty():
        _rich(rows, shown_url, span, bool(stores))
    else:
        click.echo(_plain(rows, span, bool(stores)))
