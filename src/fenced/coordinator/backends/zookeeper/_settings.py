"""The ZooKeeper coordinator's URL: ``zk://host:port[,host:port…][/chroot][?…]``.

:func:`parse_zk_url` turns a URL into :class:`ZkSettings` or raises
:class:`~fenced.ConfigurationError` naming what is wrong; it reads nothing and opens nothing.

Parameters (all optional):

* ``session_timeout`` — seconds, the ZooKeeper session timeout fenced asks for (default 10; the
  server clamps it to its ``minSessionTimeout``/``maxSessionTimeout``). A waiter's place in a
  queue and every lease this client was granted end when its session expires.
* ``timeout`` — seconds a single request may take before it fails (default 5).
* ``connect_timeout`` — seconds to establish the first session when the coordinator is opened
  (default ``min(5, timeout)``).

The chroot is the path under which fenced keeps its nodes (default ``/fenced``); it is created
when the coordinator is opened with ``create=True``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl

from fenced.core._errors import ConfigurationError
from fenced.core._urls import redacted

__all__ = ["DEFAULT_CHROOT", "ZkSettings", "parse_zk_url"]

DEFAULT_CHROOT = "/fenced"
_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")


@dataclass(frozen=True)
class ZkSettings:
    """What a ``zk://`` URL says."""

    hosts: tuple[tuple[str, int], ...]
    chroot: str
    session_timeout: float = 10.0
    timeout: float = 5.0
    connect_timeout: float = 5.0

    def connect_string(self) -> str:
        """The host list as kazoo takes it (without the chroot: fenced prefixes its paths)."""
        return ",".join(
            f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in self.hosts
        )

    def display(self) -> str:
        """The URL as fenced shows it (``zk://h1:2181,h2:2181/chroot``)."""
        chroot = "" if self.chroot == DEFAULT_CHROOT else self.chroot
        return f"zk://{self.connect_string()}{chroot}"


def _seconds(shown: str, name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ConfigurationError(f"{shown!r}: {name} must be a positive number of seconds")
    return value


def _port(shown: str, text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigurationError(f"{shown!r}: bad port {text!r}")
    return int(text)


def parse_zk_url(url: str) -> ZkSettings:
    """Parse ``zk://host:port[,host:port…][/chroot][?session_timeout=S&timeout=S]``."""
    shown = redacted(url)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != "zk":
        raise ConfigurationError(f"expected a zk:// URL, got {shown!r}")
    rest, _, fragment = rest.partition("#")
    if fragment:
        raise ConfigurationError(f"{shown!r}: a zk:// URL has no fragment")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        raise ConfigurationError(
            f"{shown!r}: zk:// takes no user or password (ZooKeeper ACLs are not supported)"
        )
    hosts: list[tuple[str, int]] = []
    for item in netloc.split(","):
        text = item.strip()
        if not text:
            raise ConfigurationError(f"{shown!r}: expected host:port[,host:port...]")
        host, port = text, 2181
        if text.startswith("["):
            host, bracket, tail = text[1:].partition("]")
            if not bracket:
                raise ConfigurationError(f"{shown!r}: unclosed '[' in {text!r}")
            if tail:
                port = _port(shown, tail.removeprefix(":"))
        elif ":" in text:
            host, _, port_text = text.rpartition(":")
            port = _port(shown, port_text)
        if not host:
            raise ConfigurationError(f"{shown!r}: empty host")
        hosts.append((host, port))
    chroot = DEFAULT_CHROOT
    if slash and path.strip("/"):
        segments = path.strip("/").split("/")
        if path.endswith("/") or any(
            not _SEGMENT.fullmatch(s) or s in (".", "..") or s == "zookeeper" for s in segments
        ):
            raise ConfigurationError(
                f"{shown!r}: the chroot must be /name[/name...] of letters, digits, '.', '_', '-' "
                "(and not under /zookeeper)"
            )
        chroot = "/" + "/".join(segments)
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = set(options) - {"session_timeout", "timeout", "connect_timeout"}
    if unknown:
        raise ConfigurationError(f"{shown!r}: unknown zk URL parameter(s) {sorted(unknown)}")
    timeout = _seconds(shown, "timeout", options["timeout"]) if "timeout" in options else 5.0
    return ZkSettings(
        tuple(hosts),
        chroot,
        _seconds(shown, "session_timeout", options["session_timeout"])
        if "session_timeout" in options
        else 10.0,
        timeout,
        _seconds(shown, "connect_timeout", options["connect_timeout"])
        if "connect_timeout" in options
        else min(5.0, timeout),
    )
