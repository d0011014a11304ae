"""How the etcd backend proves who it is and checks whom it talks to: TLS and etcd users.

Both transports (gRPC and the JSON gateway) take the same :class:`Tls` and :class:`Login`, so
a setting means the same thing on either path:

* :class:`Tls` (``etcds://…?ca=&cert=&key=&server_name=``): the server's certificate is
  verified against ``ca`` (without it: the system's trusted roots) and its host name — the
  endpoint's host, or ``server_name`` for certificates issued to a name — is checked; ``cert`` and
  ``key`` are the client certificate that ``--client-cert-auth`` members ask for. The files are
  read once, when the coordinator is made; an unreadable or malformed one is a
  :class:`~fenced.ConfigurationError` naming the parameter.
* :class:`Login` (``etcd://user:password@…``, or the password in ``FENCED_ETCD_PASSWORD``): an etcd
  user. The transport asks etcd for a token (``Authenticate``) before its first request and again
  whenever etcd says the token is no longer valid (it expired, or the user's password or roles
  changed): the request is then sent once more with the new token — etcd checks the token before
  it applies anything, so that repeat cannot apply a change twice. Without a login, a member with
  ``--client-cert-auth`` takes the client certificate's common name as the user.

:func:`diagnose` finds out *why* a TLS connection cannot be made (grpc reports only that the
channel did not connect), so that a wrong CA, an expired certificate, a name mismatch or a
plaintext server is one line naming the cause instead of a wait for the time budget.

Secrets: the password and tokens are never part of a ``repr``, a URL fenced shows, an error or a
log line.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fenced.core._errors import ConfigurationError

__all__ = ["Login", "Tls", "diagnose"]


@dataclass(frozen=True)
class Login:
    """An etcd user and its password (the password never shown)."""

    user: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class Tls:
    """The TLS settings of an ``etcds://`` URL (see the module docstring)."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None

    def _read(self, name: str, path: Path | None) -> bytes | None:
        if path is None:
            return None
        try:
            return path.read_bytes()
        except OSError as error:
            raise ConfigurationError(
                f"etcd URL: {name}={path}: cannot read it ({error.strerror or error})"
            ) from None

    def ssl_context(self) -> ssl.SSLContext:
        """A client context: verification on, host names checked, the client certificate loaded.

        Raises :class:`ConfigurationError` naming the file that cannot be read or used."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        if self.ca is not None:
            self._read("ca", self.ca)
            try:
                context.load_verify_locations(cafile=str(self.ca))
            except ssl.SSLError as error:
                raise ConfigurationError(
                    f"etcd URL: ca={self.ca}: not a PEM certificate ({error.reason or error})"
                ) from None
        if self.cert is not None and self.key is not None:
            self._read("cert", self.cert)
            self._read("key", self.key)
            try:
                context.load_cert_chain(str(self.cert), str(self.key))
            except ssl.SSLError as error:
                raise ConfigurationError(
                    f"etcd URL: cert={self.cert}, key={self.key}: not a matching PEM "
                    f"certificate and key ({error.reason or error})"
                ) from None
        return context

    def grpc_credentials(self) -> Any:
        """The same settings as ``grpc.ssl_channel_credentials`` (checked by :meth:`ssl_context`
        first, for its error messages)."""
        import grpc  # noqa: PLC0415 - only the gRPC transport calls this

        self.ssl_context()
        return grpc.ssl_channel_credentials(
            root_certificates=self._read("ca", self.ca),
            private_key=self._read("key", self.key),
            certificate_chain=self._read("cert", self.cert),
        )


def diagnose(tls: Tls, host: str, port: int, timeout: float) -> str | None:
    """Why a TLS connection to ``host:port`` fails, or None if it does not (or the cause is not
    TLS: the member is down or cut off — then the caller's own error stands).

    Connects, shakes hands as the gRPC channel would, and waits up to 0.2 s for the server's
    first word: with TLS 1.3 a server that wants a client certificate says so only after the
    handshake (an alert)."""
    context = tls.ssl_context()
    try:
        raw = socket.create_connection((host, port), timeout=max(timeout, 0.05))
    except OSError:
        return None
    name = tls.server_name or host
    try:
        with context.wrap_socket(raw, server_hostname=name) as sock:
            sock.settimeout(0.2)
            try:
                sock.recv(1)
            except TimeoutError:
                return None
            except ssl.SSLError as error:
                return _cause(tls, error, name)
            except OSError:
                return None
    except ssl.SSLCertVerificationError as error:
        return f"the server's certificate is refused: {error.verify_message} (checked as {name!r})"
    except ssl.SSLError as error:
        return _cause(tls, error, name)
    except OSError:
        return None
    finally:
        raw.close()
    return None


def _cause(tls: Tls, error: ssl.SSLError, name: str) -> str:
    reason = str(error.reason or error).lower().replace("_", " ")
    if "wrong version number" in reason or "record layer" in reason or "packet length" in reason:
        return "the server does not speak TLS (a plaintext member? use etcd://)"
    if isinstance(error, ssl.SSLEOFError) or "(eof)" in reason:
        return (
            "the server closed the connection during the TLS handshake: it does not speak TLS "
            "(a plaintext member? use etcd://)"
        )
    if tls.cert is None and ("bad certificate" in reason or "certificate required" in reason):
        return "the server wants a client certificate (add cert= and key= to the URL)"
    if "unknown ca" in reason or "bad certificate" in reason:
        return "the server refused the client certificate (not issued by a CA it trusts)"
    if "expired" in reason:
        return "the server refused the client certificate: it has expired"
    return f"TLS handshake with {name!r} failed: {reason}"
