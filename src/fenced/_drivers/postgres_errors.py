"""A psycopg error translated to the fenced error a caller can act on.

:func:`translate` tells configuration problems (authentication, missing database, schema or
table, privileges, a TLS certificate that does not verify) from transient ones, and a failure
before anything was sent (:class:`~fenced.core._errors.Unavailable`, nothing changed) from a
broken connection after a change was sent (:class:`~fenced.core._errors.OutcomeUnknown`, it may
have committed).
"""

from __future__ import annotations

import psycopg

from fenced.core._errors import ConfigurationError, FencedError, OutcomeUnknown, Unavailable

__all__ = ["is_config_message", "translate"]

_CONFIG_MESSAGES = (
    "does not exist",
    "password authentication failed",
    "authentication failed",
    "no pg_hba.conf entry",
    "password is required",
    "permission denied",
    "invalid uri",
    "invalid connection option",
    "invalid sslmode",
    "too many connections for role",
    # TLS (libpq's client-side checks and the server's demand for a client certificate): a
    # wrong CA, a certificate for another host name, a server without TLS, missing or
    # unreadable files. Trying again cannot help.
    "certificate",
    "private key",
    "unknown ca",
    "does not match host name",
    "does not support ssl",
    "pg_hba.conf rejects",
)
# SQLSTATE classes: 28 auth, 3D catalog, 3F schema, 42 syntax/undefined/privilege, 0A unsupported
_CONFIG_CLASSES = ("28", "3D", "3F", "42", "0A")
# The server ended the session (connection class 08, admin shutdown/crash/cannot-connect 57P0x).
_GONE_STATES = ("57P01", "57P02", "57P03", "57P04", "57P05")


def is_config_message(message: str) -> bool:
    """True if ``message`` names a problem of configuration (credentials, names, privileges)."""
    lowered = message.lower()
    return any(text in lowered for text in _CONFIG_MESSAGES)


def translate(error: psycopg.Error, doing: str, *, sent: bool, where: str = "") -> FencedError:
    """The fenced error for ``error``, raised while ``doing`` (the caller chains it).

    ``sent``: a statement that changes state had been sent when the error happened. Then a
    broken connection (or the server ending the session) is :class:`OutcomeUnknown`: the change
    may have committed with its reply lost. A server error on a live connection means the
    statement failed and its transaction rolled back: :class:`Unavailable` (retry), or
    :class:`ConfigurationError` for authentication, missing database/schema/table and privilege
    problems. Before anything was sent, every connection problem is :class:`Unavailable`.
    """
    state = getattr(error, "sqlstate", None) or ""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    prefix = f"{doing}" + (f" ({where})" if where else "")
    if state[:2] in _CONFIG_CLASSES or (not state and is_config_message(text)):
        return ConfigurationError(f"{prefix}: {text}")
    gone = not state or state[:2] == "08" or state in _GONE_STATES
    if sent and gone:
        return OutcomeUnknown(
            f"{prefix}: the connection failed after the request was sent ({text}); it may or "
            "may not have taken effect"
        )
    return Unavailable(f"{prefix}: {text}; nothing was changed, retry")
