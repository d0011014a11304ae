"""``fenced status [RESOURCE…] [--json] [--url URL]``: who holds what, at which epoch.

Read-only: it asks the coordinator for each resource's live lease and its last granted epoch. With
no RESOURCE it lists every resource the coordinator has ever granted. Human output is a table (a
rich table on a terminal, plain aligned columns otherwise); ``--json`` prints one stable document
(format 1, documented in docs/cli.md).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import click

from fenced.cli.app import OneLineUsageCommand, cli
from fenced.coordinator.client import Coordinator
from fenced.coordinator.connect import connect
from fenced.core.names import validate_resource

__all__ = ["JSON_FORMAT", "ResourceStatus", "display_url", "read_status", "status_command"]

JSON_FORMAT = 1
"""Version of the ``--json`` document; bumped only for incompatible changes."""


@dataclass(frozen=True, slots=True)
class ResourceStatus:
    """One row: the live lease (if any) and the last epoch ever granted for ``resource``.

    ``holder``, ``epoch``, ``expires_in`` and ``ttl`` are None when nobody holds the resource.
    ``expires_in`` is the remaining time by the coordinator's clock when it answered.
    """

    resource: str
    holder: str | None
    epoch: int | None
    expires_in: float | None
    ttl: float | None
    last_epoch: int

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
        }


def read_status(coord: Coordinator, resources: list[str]) -> list[ResourceStatus]:
    """The status of ``resources`` (all known ones if empty), in the given or sorted order.

    The live lease is read before the last epoch, so ``last_epoch >= epoch`` always holds even
    if a grant happens in between.
    """
    names = resources or coord.resources()
    rows = []
    for name in names:
        info = coord.current(name)
        last = coord.last_epoch(name)
        if info is None:
            rows.append(ResourceStatus(name, None, None, None, None, last))
        else:
            rows.append(
                ResourceStatus(
                    name, info.holder, info.epoch, info.expires_in, info.ttl, max(last, info.epoch)
                )
            )
    return rows


def display_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (safe to print)."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.rsplit("@", 1)
        user = netloc[0].split(":", 1)[0]
        return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))
    except ValueError:
        return url


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _cells(row: ResourceStatus) -> list[str]:
    return [
        row.resource,
        row.holder if row.holder is not None else "-",
        str(row.epoch) if row.epoch is not None else "-",
        _seconds(row.expires_in),
        str(row.last_epoch),
    ]


_HEADERS = ["RESOURCE", "HOLDER", "EPOCH", "REMAINING", "LAST EPOCH"]
_NUMERIC = {2, 3, 4}


def _plain(rows: list[ResourceStatus]) -> str:
    table = [_HEADERS, *(_cells(row) for row in rows)]
    widths = [max(len(line[col]) for line in table) for col in range(len(_HEADERS))]
    lines = []
    for line in table:
        cells = [
            cell.rjust(widths[col]) if col in _NUMERIC else cell.ljust(widths[col])
            for col, cell in enumerate(line)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _rich(rows: list[ResourceStatus], url: str) -> None:
    from rich.console import Console  # noqa: PLC0415 - only on a terminal
    from rich.table import Table  # noqa: PLC0415

    table = Table(title=f"fenced status · {url}", title_justify="left")
    for col, header in enumerate(_HEADERS):
        table.add_column(header.title(), justify="right" if col in _NUMERIC else "left")
    for row in rows:
        style = None if row.held else "dim"
        table.add_row(*_cells(row), style=style)
    Console(highlight=False).print(table)


@cli.command("status", cls=OneLineUsageCommand, short_help="Show holders and epochs.")
@click.argument("resources", nargs=-1, metavar="[RESOURCE]...")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (format 1).")
@click.option(
    "--url",
    metavar="URL",
    help="Coordinator URL [default: $FENCED_URL, else sqlite:.fenced/fenced.db].",
)
def status_command(resources: tuple[str, ...], as_json: bool, url: str | None) -> None:
    """Show the holder, epoch, remaining time and last epoch of each RESOURCE.

    With no RESOURCE, every resource the coordinator has ever granted is shown. A resource that
    was never granted shows last epoch 0.
    """
    names = [validate_resource(name) for name in resources]  # before any I/O
    with connect(url) as coord:
        rows = read_status(coord, names)
        shown_url = display_url(coord.url)
        coordinator_id = coord.coordinator_id
    if as_json:
        document = {
            "format": JSON_FORMAT,
            "url": shown_url,
            "coordinator_id": coordinator_id,
            "resources": [row.as_json() for row in rows],
        }
        click.echo(json.dumps(document, indent=2))
        return
    if not rows:
        click.echo(f"no resources have been granted at {shown_url}")
        return
    if sys.stdout.isatty():
        _rich(rows, shown_url)
    else:
        click.echo(_plain(rows))
