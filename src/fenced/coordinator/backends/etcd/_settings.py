"""The etcd coordinator's URL: ``etcd[s]://[user[:password]@]host:port[,host:port…][?…]``.

:func:`parse_etcd_url` turns a URL into :class:`EtcdSettings` (endpoints, key prefix, request
and connect timeouts, API, TLS, login) or raises :class:`~fenced.ConfigurationError` naming
what is wrong, with the password shown as ``***``; it reads only the environment
(``FENCED_ETCD_PASSWORD``), no files and no network.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote

from fenced.coordinator.backends.etcd._keys import DEFAULT_PREFIX, Keys
from fenced.coordinator.backends.etcd._security import Login, Tls
from fenced.core._errors import ConfigurationError
from fenced.core._urls import redacted

PASSWORD_VARIABLE = "FENCED_ETCD_PASSWORD"  # noqa: S105 - its name, not a password
"""The environment variable that holds the etcd user's password when the URL has none."""
_TLS_PARAMETERS = ("ca", "cert", "key", "server_name")


@dataclass(frozen=True)
class EtcdSettings:
    endpoints: list[tuple[str, int]]
    prefix: str
    timeout: float
    connect_timeout: float
    api: str = "grpc"
    tls: Tls | None = None
    login: Login | None = None

    def permission_hint(self) -> str:
        """What a "permission denied" from etcd needs: who needs which permission where."""
        who = "the client certificate's user" if self.login is None else "etcd user"
        user = "" if self.login is None else f" {self.login.user!r}"
        return (
            f"{who}{user} needs readwrite permission on the key prefix {self.prefix}/ "
            "(docs/etcd.md, 'Least privilege')"
        )

    def display(self) -> str:
        """The URL as fenced shows it: every setting that differs from its default, the user
        but never the password (``etcds://bob@h:1?ca=/p/ca.pem``)."""
        hosts = ",".join(
            f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in self.endpoints
        )
        user = "" if self.login is None else quote(self.login.user, safe="") + "@"
        query = [] if self.prefix == DEFAULT_PREFIX else [f"prefix={self.prefix}"]
        if self.api != "grpc":
            query.append(f"api={self.api}")
        if self.tls is not None:
            query += [
                f"{name}={value}"
                for name in _TLS_PARAMETERS
                if (value := getattr(self.tls, name)) is not None
            ]
        scheme = "etcds" if self.tls is not None else "etcd"
        return f"{scheme}://{user}{hosts}" + ("?" + "&".join(query) if query else "")


def _positive(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ConfigurationError(f"etcd URL: {name} must be a positive number of seconds")
    return value


def parse_etcd_url(url: str) -> EtcdSettings:
    """Parse ``etcd[s]://[user[:password]@]host:port[,host:port…][/][?…]`` (``docs/etcd.md``).

    Parameters: ``prefix``, ``timeout``, ``connect_timeout``, ``api`` (``grpc``, the default, or
    ``gateway``: etcd's JSON gateway, for a network that passes only HTTP/1.1); with ``etcds://``
    also ``ca``, ``cert``, ``key`` (a pair) and ``server_name``. A user without a password in
    the URL takes it from ``FENCED_ETCD_PASSWORD``."""
    # Split by hand: urllib's urlsplit rejects a multi-host netloc with an IPv6 literal.
    shown = redacted(url)
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in ("etcd", "etcds"):
        raise ConfigurationError(f"expected an etcd:// or etcds:// URL, got {shown!r}")
    rest, _, fragment = rest.partition("#")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    if path or fragment:
        raise ConfigurationError(f"{shown!r}: an etcd URL has no path (use ?prefix=/name)")
    del slash
    userinfo, at, netloc = netloc.rpartition("@")
    login = _login(shown, userinfo) if at else None
    endpoints: list[tuple[str, int]] = []
    for item in netloc.split(","):
        text = item.strip()
        if not text or "@" in text:
            raise ConfigurationError(f"{shown!r}: expected [user@]host:port[,host:port...]")
        host, port = text, 2379
        if text.startswith("["):
            host, bracket, rest = text[1:].partition("]")
            if not bracket:
                raise ConfigurationError(f"{shown!r}: unclosed '[' in {text!r}")
            if rest:
                port = _port(shown, rest.lstrip(":"))
        elif ":" in text:
            host, _, port_text = text.rpartition(":")
            port = _port(shown, port_text)
        if not host:
            raise ConfigurationError(f"{shown!r}: empty host")
        endpoints.append((host, port))
    if not endpoints:
        raise ConfigurationError(f"{shown!r}: no etcd endpoint")
    options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=False))
    known = {"prefix", "timeout", "connect_timeout", "api", *_TLS_PARAMETERS}
    unknown = set(options) - known
    if unknown:
        raise ConfigurationError(f"{shown!r}: unknown etcd URL parameter(s) {sorted(unknown)}")
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
        raise ConfigurationError(f"{shown!r}: api must be grpc or gateway, not {api!r}")
    tls = _tls(shown, scheme, options)
    return EtcdSettings(endpoints, prefix, timeout, connect, api, tls, login)


def _login(shown: str, userinfo: str) -> Login:
    user_text, colon, password_text = userinfo.partition(":")
    user = unquote(user_text)
    if not user:
        raise ConfigurationError(f"{shown!r}: an empty etcd user name")
    password = unquote(password_text) if colon else os.environ.get(PASSWORD_VARIABLE)
    if not password:
        raise ConfigurationError(
            f"{shown!r}: etcd user {user!r} has no password: put it in the URL "
            f"(etcd://{user}:PASSWORD@…) or in {PASSWORD_VARIABLE}"
        )
    return Login(user, password)


def _tls(shown: str, scheme: str, options: dict[str, str]) -> Tls | None:
    given = [name for name in _TLS_PARAMETERS if name in options]
    if scheme == "etcd":
        if given:
            raise ConfigurationError(
                f"{shown!r}: {', '.join(given)} are TLS settings: use etcds:// for TLS"
            )
        return None
    for name in given:
        if not options[name]:
            raise ConfigurationError(f"{shown!r}: {name}= is empty")
    if ("cert" in options) != ("key" in options):
        raise ConfigurationError(
            f"{shown!r}: a client certificate needs both cert= and key= (PEM files)"
        )
    paths = {name: Path(options[name]) for name in ("ca", "cert", "key") if name in options}
    return Tls(
        ca=paths.get("ca"),
        cert=paths.get("cert"),
        key=paths.get("key"),
        server_name=options.get("server_name"),
    )


def _port(url: str, text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigurationError(f"{url!r}: bad port {text!r}")
    return int(text)
