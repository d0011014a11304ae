"""``fenced serve [--url URL] [--store NAME=URL …] [--listen HOST:PORT] [--tls-cert F --tls-key F
[--tls-client-ca F]] [--keys FILE]``: the fenced service over HTTP (docs/server.md).

Runs in the foreground until SIGTERM or SIGINT (a graceful stop: :mod:`fenced.server._run`),
then exits 0. It prints one line on stderr when it listens (``fenced serve: listening on
http://HOST:PORT``: the port chosen when ``--listen`` ends in ``:0``). Bad options, a bad URL,
a keys file it cannot read or an address it cannot bind: one line and exit 2, before it listens.
Needs the ``server`` extra (``pip install 'fenced[server]'``).
"""

from __future__ import annotations

from pathlib import Path

import click

from fenced.cli._app import OneLineUsageCommand, cli, url_option
from fenced.core._errors import ConfigurationError

__all__ = ["parse_stores", "serve_command"]


def parse_stores(specs: tuple[str, ...]) -> dict[str, str]:
    """``NAME=URL`` options as a mapping; ConfigurationError for a bad or repeated NAME."""
    stores: dict[str, str] = {}
    for spec in specs:
        name, sep, url = spec.partition("=")
        name = name.strip()
        if not sep or not url.strip():
            raise ConfigurationError(f"--store wants NAME=URL, got {spec.split('=')[0]!r}…")
        if not name or not all(c.isalnum() or c in "-_." for c in name) or len(name) > 64:
            raise ConfigurationError(
                f"--store NAME must be 1-64 letters, digits, '-', '_' or '.', got {name!r}"
            )
        if name in stores:
            raise ConfigurationError(f"--store {name}= is given twice")
        stores[name] = url.strip()
    return stores


_FILE = click.Path(dir_okay=False, path_type=Path)


@cli.command("serve", cls=OneLineUsageCommand, short_help="Serve leases and stores over HTTP.")
@url_option()
@click.option(
    "--store",
    "store_specs",
    multiple=True,
    metavar="NAME=URL",
    help="Serve the store at URL as /v1/stores/NAME; repeatable.",
)
@click.option(
    "--listen",
    default="127.0.0.1:8470",
    show_default=True,
    metavar="HOST:PORT",
    help="Address to listen on (port 0: any free port). Non-loopback needs --keys.",
)
@click.option("--tls-cert", type=_FILE, metavar="FILE", help="Serve HTTPS with this certificate.")
@click.option("--tls-key", type=_FILE, metavar="FILE", help="The certificate's private key.")
@click.option(
    "--tls-client-ca", type=_FILE, metavar="FILE", help="Require client certificates from this CA."
)
@click.option("--keys", type=_FILE, metavar="FILE", help="API keys (fenced keys add --keys FILE).")
@click.option(
    "--poll",
    type=click.FloatRange(0.1, 300),
    default=20.0,
    show_default=True,
    help="Seconds one request may wait on the server (long poll).",
)
def serve_command(
    url: str | None,
    store_specs: tuple[str, ...],
    listen: str,
    tls_cert: Path | None,
    tls_key: Path | None,
    tls_client_ca: Path | None,
    keys: Path | None,
    poll: float,
) -> None:
    """Serve the coordinator at --url (the embedded default without it) and the --store stores
    over HTTP/JSON (/v1, described by /openapi.json), with a live page at /.

    Clients in any language use the API; Python uses fenced.connect("http://HOST:PORT") and
    fenced.open_store("http://HOST:PORT/stores/NAME"). Without --keys every request is allowed
    and only loopback addresses may be used. SIGTERM or Ctrl-C stops it gracefully: waiting
    requests are answered 503 (retry), requests in flight finish, leases stay with their
    holders until their ttl."""
    stores = parse_stores(store_specs)
    try:
        from fenced.server._run import serve  # noqa: PLC0415 - the server extra
    except ImportError as error:
        raise ConfigurationError(
            f"fenced serve needs the server extra: pip install 'fenced[server]' ({error})"
        ) from error
    serve(
        url,
        listen=listen,
        tls_cert=tls_cert,
        tls_key=tls_key,
        tls_client_ca=tls_client_ca,
        keys=keys,
        stores=stores,
        poll=poll,
    )
