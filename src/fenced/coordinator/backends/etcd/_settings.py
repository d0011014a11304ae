"""The etcd coordinator's URL: ``etcd://host:port[,host:port…][?prefix=/p&timeout=S&…]``.

:func:`parse_etcd_url` turns a URL into :class:`EtcdSettings` (endpoints, key prefix, request
and connect timeouts, API) or raises :class:`~fenced.ConfigurationError` naming what is wrong;
it does no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import parse_qsl

from fenced.coordinator.backends.etcd._keys import DEFAULT_PREFIX, Keys
from fenced.core._errors import ConfigurationError


@dataclass(frozen=True)
class EtcdSettings:
    endpoints: list[tuple[str, int]]
    prefix: str
    timeout: float
    connect_timeout: float
    api: str = "grpc"


def _positive(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ConfigurationError(f"etcd URL: {name} must be a positive number of seconds")
    return value


def parse_etcd_url(url: str) -> EtcdSettings:
    """Parse ``etcd://host:port[,host:port…][/][?prefix=/p&timeout=S&connect_timeout=S&api=A]``.

    ``api``: ``grpc`` (the default) or ``gateway`` (etcd's JSON gateway, for a network that
    passes only HTTP/1.1); watches use the gateway either way (``docs/etcd.md``, "Client")."""
    # Split by hand: urllib's urlsplit rejects a multi-host netloc with an IPv6 literal.
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != "etcd":
        raise ConfigurationError(f"expected an etcd:// URL, got {url!r}")
    rest, _, fragment = rest.partition("#")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    if path or fragment:
        raise ConfigurationError(f"{url!r}: an etcd URL has no path (use ?prefix=/name)")
    del slash
    endpoints: list[tuple[str, int]] = []
    for item in netloc.split(","):
        text = item.strip()
        if not text or "@" in text:
            raise ConfigurationError(f"{url!r}: expected host:port[,host:port...]")
        host, port = text, 2379
        if text.startswith("["):
            host, bracket, rest = text[1:].partition("]")
            if not bracket:
                raise ConfigurationError(f"{url!r}: unclosed '[' in {text!r}")
            if rest:
                port = _port(url, rest.lstrip(":"))
        elif ":" in text:
            host, _, port_text = text.rpartition(":")
            port = _port(url, port_text)
        if not host:
            raise ConfigurationError(f"{url!r}: empty host")
        endpoints.append((host, port))
    if not endpoints:
        raise ConfigurationError(f"{url!r}: no etcd endpoint")
    options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=False))
    unknown = set(options) - {"prefix", "timeout", "connect_timeout", "api"}
    if unknown:
        raise ConfigurationError(f"{url!r}: unknown etcd URL parameter(s) {sorted(unknown)}")
    prefix = options.get("prefix", DEFAULT_PREFIX)
    Keys(prefix)  # validates
    timeout = _positive("timeout", options["timeout"]) if "timeout" in options else 5.0
    connect = (
        _positive("connect_timeout", options["connect_timeout"])
        if "connect_timeout" in options
        else min(1.0, timeout)
    )
    api = options.get("api", "grpc")
    if api not in ("grpc", "gateway"):
        raise ConfigurationError(f"{url!r}: api must be grpc or gateway, not {api!r}")
    return EtcdSettings(endpoints, prefix, timeout, connect, api)


def _port(url: str, text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigurationError(f"{url!r}: bad port {text!r}")
    return int(text)
