"""Who may call which route: API keys (bearer tokens) scoped to name prefixes and roles.

Every route declares the role it needs with :func:`require` (``hold``, ``write``, ``read``,
``admin``). Without a keys file (``fenced serve`` without ``--keys``) every request is allowed,
and the server listens on loopback only (:func:`fenced.server._run.bind`). With one, a request
without a known key is refused with :class:`~fenced.NotAuthenticated` (401) and a key outside its
role or name prefixes with :class:`~fenced.AccessDenied` (403), before the route runs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal, Protocol

from fastapi import Depends, Request, params

__all__ = ["Authority", "Role", "read_scope", "require", "require_key"]

Role = Literal["hold", "write", "read", "admin"]


class Authority(Protocol):
    """What the server asks of a keys file (:mod:`fenced.server._keys`)."""

    def authenticate(self, authorization: str | None) -> object:
        """The key of the ``Authorization`` header; :class:`~fenced.NotAuthenticated` if there
        is none or it is not a valid key."""

    def scope(self, authorization: str | None, role: Role) -> tuple[str, ...]:
        """The name prefixes within which the header's key may act as ``role`` (``""``: every
        name); raises as :meth:`check` does for a missing key or role."""

    def check(self, authorization: str | None, role: Role, name: str | None) -> None:
        """Return if the ``Authorization`` header's key may act as ``role`` on ``name`` (a
        resource name or a store key; None: a route about no one name). Raises
        :class:`~fenced.NotAuthenticated` or :class:`~fenced.AccessDenied`."""


def require(role: Role, name_param: str = "resource") -> params.Depends:
    """A FastAPI dependency: the route needs ``role`` on the path parameter ``name_param``."""

    async def check(request: Request) -> None:
        authority: Authority | None = request.app.state.fenced.authority
        if authority is None:
            return
        name = request.path_params.get(name_param)
        authority.check(request.headers.get("authorization"), role, name)

    checker: Callable[[Request], Awaitable[None]] = check
    dependency: params.Depends = Depends(checker)
    return dependency


def require_key() -> params.Depends:
    """A FastAPI dependency: any valid key (routes every client needs, whatever its roles:
    ``/v1/coordinator``, which a client reads when it connects)."""

    async def check(request: Request) -> None:
        authority: Authority | None = request.app.state.fenced.authority
        if authority is not None:
            authority.authenticate(request.headers.get("authorization"))

    checker: Callable[[Request], Awaitable[None]] = check
    dependency: params.Depends = Depends(checker)
    return dependency


async def read_scope(request: Request) -> tuple[str, ...] | None:
    """A FastAPI dependency of the routes that answer about every name (``/v1/leases``,
    ``/v1/records``): the prefixes the request's key may read, to filter the answer by; None
    without a keys file (every name)."""
    authority: Authority | None = request.app.state.fenced.authority
    if authority is None:
        return None
    prefixes = authority.scope(request.headers.get("authorization"), "read")
    return None if "" in prefixes else prefixes
