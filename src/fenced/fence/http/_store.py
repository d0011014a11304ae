"""``HttpStore``: a :class:`~fenced.Store` whose every operation is carried out by ``fenced
serve`` (``http(s)://host:port[/prefix]/stores/NAME``).

The server's store decides everything (the fencing rules, op ids, records, gc); this client
checks its arguments with the same functions as the in-process store (bad input raises the same
exception, with the same message, before any request), sends one request per operation and
turns the answer back into the same value or exception class (:mod:`fenced.core._problems`).

Errors: a connection that cannot be made is :class:`~fenced.Unavailable` (nothing was sent);
a reply lost after a mutation was sent is :class:`~fenced.OutcomeUnknown`: the mutation may have
been applied; retry with the same ``op_id`` (sent as ``Idempotency-Key``) to learn its outcome,
which the server's store then returns without applying anything twice. A lost reply to a read is
:class:`~fenced.Unavailable`. No request is retried here.

Reads of a publication are checked twice: by the server's store as it streams them, and here
against the size and SHA-256 the answer's headers announce (:class:`~fenced.CorruptData`). A
download cut short (the server found damage, or the connection broke) is
:class:`~fenced.Unavailable`.

Options: where a store keeps its state, its clock, retention and grace periods are the server's
(``fenced serve --store NAME=URL``); ``open_store`` options other than the defaults are refused
(:class:`~fenced.ConfigurationError`) rather than silently ignored. Thread-safe: one httpx
client and its connection pool serve every thread.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO, cast

import httpx

from fenced._drivers.http import client, encode_sf_string
from fenced.core._clock import SystemClock
from fenced.core._errors import (
    ConfigurationError,
    FencedError,
    NotFound,
    OutcomeUnknown,
    Unavailable,
)
from fenced.core._names import validate_resource
from fenced.core._problems import PROBLEM_PREFIX, error_of_problem
from fenced.core._records import Record
from fenced.core._token import FencingToken
from fenced.fence import _store as local
from fenced.fence._checked import CheckedStream, shown_publication
from fenced.fence._rules import resolve_mode
from fenced.fence._source import CHUNK_SIZE, PublishData, Source
from fenced.fence._values import Item, Mode, Publication, Version
from fenced.fence.backend import (
    DEFAULT_RECORD_LIMIT,
    DEFAULT_RECORD_RETENTION,
    Capability,
    StoreOptions,
)
from fenced.fence.http._wire import (
    IDEMPOTENCY_HEADER,
    TOKEN_HEADER,
    StoreUrl,
    item_of_headers,
    item_path,
    parse_store_url,
    publication_of,
    publication_of_headers,
    publication_path,
    records_of,
    resource_path,
    version_of,
)

__all__ = ["HttpStore", "open_http_store"]


def open_http_store(url: object, mode: Mode | None, options: StoreOptions) -> HttpStore:
    """The store ``url`` names on its server (the ``http``/``https`` kind's factory).

    Asks the server for the store's mode and capabilities: ConfigurationError for a bad URL,
    an option the server owns, a name the server does not serve (``not-found``) or ``mode``
    other than the store's; Unavailable if the server cannot be reached."""
    if not isinstance(url, str):
        raise ConfigurationError("an http(s) store is named by its URL")
    _check_options(options)
    settings = parse_store_url(url)
    remote = _Remote(url, settings)
    try:
        remote.describe(mode)
    except BaseException:
        remote.close()
        raise
    return HttpStore(remote, options)


def _check_options(options: StoreOptions) -> None:
    defaults = {
        "op_retention": local.DEFAULT_OP_RETENTION,
        "gc_grace": local.DEFAULT_GC_GRACE,
        "busy_timeout": local.DEFAULT_BUSY_TIMEOUT,
        "record_retention": DEFAULT_RECORD_RETENTION,
        "record_limit": DEFAULT_RECORD_LIMIT,
    }
    for option, default in defaults.items():
        if getattr(options, option) != default:
            raise ConfigurationError(
                f"{option} of an http(s) store is the server's (fenced serve --store NAME=URL): "
                "leave it at its default here"
            )
    if not isinstance(options.clock, SystemClock):
        raise ConfigurationError("an http(s) store runs on the server's clock: pass no clock")
    if options.backend_options is not None:
        raise ConfigurationError("options= is for a pool or an engine, not http(s): stores")


class _Remote:
    """The server side of one store: its identity and the transport."""

    def __init__(self, url: str, settings: StoreUrl) -> None:
        self.url = url
        self.settings = settings
        self.mode: Mode = "strict"
        self.capabilities: frozenset[Capability] = frozenset()
        self.client = client(settings.options)

    def describe(self, mode: Mode | None) -> None:
        try:
            body = self.json("GET", "", what=f"open {self.settings.name}")
        except NotFound as error:
            raise ConfigurationError(f"{self.url}: {error}") from None
        try:
            stored = body["mode"]
            capabilities = body["capabilities"]
            if not isinstance(stored, str) or not isinstance(capabilities, list):
                raise ValueError("mode, capabilities")
        except (KeyError, ValueError) as error:
            raise Unavailable(f"{self.settings.base} does not answer as fenced serve") from error
        self.mode = resolve_mode(stored, mode, f"the store {self.url}")
        known = {c.value for c in Capability}
        served = {Capability(c) for c in capabilities if c in known}
        # the server's store may live in local files; this client writes none
        self.capabilities = frozenset((served - {Capability.LOCAL_FILES})
                                      | {Capability.MULTI_PROCESS})  # fmt: skip

    # -- transport ----------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        what: str,
        mutating: bool = False,
        headers: Mapping[str, str] | None = None,
        content: bytes | Iterator[bytes] | None = None,
        body: Mapping[str, object] | None = None,
        params: Mapping[str, int] | None = None,
        stream: bool = False,
        absent: str | None = None,
    ) -> httpx.Response | None:
        """One request; the answer if 2xx or 304, None for a 404 whose problem says the
        ``absent`` thing is missing; otherwise the exception the answer stands for."""
        request = self.client.build_request(
            method, self.settings.base + path, headers=headers, content=content, json=body,
            params=params,
        )  # fmt: skip
        try:
            reply = self.client.send(request, stream=stream)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as error:
            raise Unavailable(f"{what}: cannot reach {self.settings.base}: {error}") from error
        except httpx.TransportError as error:
            if mutating:
                raise OutcomeUnknown(
                    f"{what}: the reply was lost ({error!r}); retry with the same op_id to "
                    "learn the outcome"
                ) from error
            raise Unavailable(f"{what}: the reply was lost ({error!r})") from error
        if reply.status_code < 300 or reply.status_code == 304:
            return reply
        try:
            if stream:
                reply.read()
            document: Any = reply.json() if reply.content else None
        except (ValueError, httpx.HTTPError):
            document = None
        finally:
            reply.close()
        if not isinstance(document, Mapping):
            document = {}
        if absent is not None and reply.status_code == 404 and document.get("missing") == absent:
            return None
        if not str(document.get("type", "")).startswith(PROBLEM_PREFIX) and (
            reply.status_code >= 500
        ):
            cls = OutcomeUnknown if mutating else Unavailable
            raise cls(f"{what}: HTTP {reply.status_code} from the server or a proxy")
        raise error_of_problem(reply.status_code, document)

    def json(self, method: str, path: str, *, what: str, mutating: bool = False,
             **kwargs: Any) -> Mapping[str, Any]:  # fmt: skip
        reply = self.request(method, path, what=what, mutating=mutating, **kwargs)
        assert reply is not None
        try:
            found = reply.json()
        except ValueError:
            found = None
        if not isinstance(found, Mapping):
            raise _bad_reply(what, mutating, ValueError("not a JSON object"))
        return found

    def close(self) -> None:
        self.client.close()


def _bad_reply(what: str, mutating: bool, error: Exception) -> FencedError:
    message = f"{what}: the server's reply is not fenced's API ({error})"
    return OutcomeUnknown(message) if mutating else Unavailable(message)


def _mutation_headers(token: FencingToken, op_id: str | None) -> dict[str, str]:
    headers = {TOKEN_HEADER: str(token)}
    if op_id is not None:
        headers[IDEMPOTENCY_HEADER] = encode_sf_string(op_id)
    return headers


class HttpStore(local.Store):
    """A store served by ``fenced serve`` (module docstring): :class:`~fenced.Store`'s
    operations, each one request to the server, with the same arguments, checks, answers and
    exceptions."""

    def __init__(self, remote: _Remote, options: StoreOptions) -> None:
        # not Store.__init__: there is no local backend; the server's store does the work
        self._remote = remote
        self._options = options
        self._clock = options.clock
        self._closed = False

    @property
    def url(self) -> str:
        """The URL the store was opened with."""
        return self._remote.url

    @property
    def mode(self) -> Mode:
        """The server's store's mode."""
        return self._remote.mode

    @property
    def capabilities(self) -> frozenset[Capability]:
        """The server's store's capabilities, but ``local_files``; ``multi_process`` always."""
        return self._remote.capabilities

    def _open_remote(self) -> _Remote:
        if self._closed:
            raise ConfigurationError(f"the store {self.url} is closed")
        return self._remote

    # -- mutations ----------------------------------------------------------------------------

    def fence(self, token: FencingToken) -> int:
        """:meth:`fenced.Store.fence`, by ``POST …/resources/{resource}:fence``."""
        token = local.check_fence(token)
        remote = self._open_remote()
        what = f"fence of {token.resource}"
        body = remote.json("POST", resource_path(token.resource, "fence"), what=what,
                           mutating=True, headers=_mutation_headers(token, None))  # fmt: skip
        floor = body.get("floor")
        if type(floor) is not int:
            raise _bad_reply(what, True, ValueError("floor"))
        return floor

    def put(
        self,
        token: FencingToken,
        key: str,
        value: bytes | bytearray | memoryview,
        *,
        op_id: str | None = None,
        if_version: int | None = None,
    ) -> Version:
        """:meth:`fenced.Store.put`, by ``PUT …/items/{resource}:{key}``."""
        token, key, data, op_id, if_version = local.check_put(token, key, value, op_id, if_version)
        remote = self._open_remote()
        headers = _mutation_headers(token, op_id)
        headers["Content-Type"] = "application/octet-stream"
        if if_version == 0:
            headers["If-None-Match"] = "*"
        elif if_version is not None:
            headers["If-Match"] = f'"{if_version}"'
        what = f"put of {token.resource} key {key!r}"
        body = remote.json("PUT", item_path(token.resource, key), what=what, mutating=True,
                           headers=headers, content=data)  # fmt: skip
        try:
            return version_of(body)
        except ValueError as error:
            raise _bad_reply(what, True, error) from error

    def publish(
        self,
        token: FencingToken,
        data: PublishData,
        *,
        name: str = "",
        op_id: str | None = None,
    ) -> Publication:
        """:meth:`fenced.Store.publish`, by ``PUT …/publications/{resource}[:{name}]``: the
        data is streamed in chunks of at most 1 MiB (a path or a stream is never read whole).
        The server's answer must name the size and SHA-256 of the bytes sent, else
        :class:`~fenced.OutcomeUnknown` (something between changed them)."""
        token, name, op_id = local.check_publish(token, name, op_id)
        source = Source(data)
        remote = self._open_remote()
        headers = _mutation_headers(token, op_id)
        headers["Content-Type"] = "application/octet-stream"
        what = f"publish of {shown_publication(token.resource, name)}"
        body = remote.json("PUT", publication_path("publications", token.resource, name),
                           what=what, mutating=True, headers=headers,
                           content=iter(source))  # fmt: skip
        try:
            publication = publication_of(body)
        except ValueError as error:
            raise _bad_reply(what, True, error) from error
        if (publication.size, publication.sha256) != (source.size, source.sha256):
            raise OutcomeUnknown(
                f"{what}: the server published {publication.size} bytes with another SHA-256 "
                "than the ones sent; check the publication"
            )
        return publication

    def gc(self, keep: int = 1, grace: float | None = None) -> int:
        """:meth:`fenced.Store.gc`, by ``POST /v1/stores/{store}:gc`` (the ``admin`` role)."""
        keep, grace = local.check_gc(keep, grace)
        remote = self._open_remote()
        settings = remote.settings
        what = f"gc of {settings.name}"
        # the store's own path: POST {base}:gc
        body = remote.json("POST", ":gc", what=what, mutating=True,
                           body={"keep": keep, "grace": grace})  # fmt: skip
        deleted = body.get("deleted")
        if type(deleted) is not int:
            raise _bad_reply(what, True, ValueError("deleted"))
        return deleted

    def rebind(
        self, resource: str, coordinator_id: str, *, previous: str | None = None, ceiling: int
    ) -> str | None:
        """:meth:`fenced.Store.rebind`, by ``POST …/resources/{resource}:rebind`` (``admin``)."""
        new = local.check_rebind(resource, coordinator_id, previous, ceiling)
        remote = self._open_remote()
        what = f"rebind of {resource}"
        body = remote.json("POST", resource_path(resource, "rebind"), what=what, mutating=True,
                           body={"coordinator_id": new, "previous": previous,
                                 "ceiling": ceiling})  # fmt: skip
        found = body.get("previous")
        if found is not None and type(found) is not str:
            raise _bad_reply(what, True, ValueError("previous"))
        return found

    # -- reads --------------------------------------------------------------------------------

    def _state(self, resource: str) -> Mapping[str, Any]:
        validate_resource(resource)
        remote = self._open_remote()
        what = f"state of {resource}"
        body = remote.json("GET", resource_path(resource), what=what)
        floor, bound = body.get("floor"), body.get("coordinator_id")
        if (floor is not None and type(floor) is not int) or (
            bound is not None and type(bound) is not str
        ):
            raise _bad_reply(what, False, ValueError("floor, coordinator_id"))
        return body

    def binding(self, resource: str) -> str | None:
        """:meth:`fenced.Store.binding`, by ``GET …/resources/{resource}``."""
        bound: str | None = self._state(resource).get("coordinator_id")
        return bound

    def floor(self, resource: str) -> int | None:
        """:meth:`fenced.Store.floor`, by ``GET …/resources/{resource}``."""
        floor: int | None = self._state(resource).get("floor")
        return floor

    def get(self, resource: str, key: str) -> Item | None:
        """:meth:`fenced.Store.get`, by ``GET …/items/{resource}:{key}``."""
        local.check_get(resource, key)
        remote = self._open_remote()
        what = f"get of {resource} key {key!r}"
        reply = remote.request("GET", item_path(resource, key), what=what, absent="item")
        if reply is None:
            return None
        try:
            return item_of_headers(resource, key, reply.content, reply.headers)
        except ValueError as error:
            raise _bad_reply(what, False, error) from error

    def latest(self, resource: str, name: str = "") -> Publication | None:
        """:meth:`fenced.Store.latest`, by ``GET …/pointers/{resource}[:{name}]``."""
        local.check_publication(resource, name)
        remote = self._open_remote()
        what = f"latest of {shown_publication(resource, name)}"
        reply = remote.request("GET", publication_path("pointers", resource, name), what=what,
                               absent="publication")  # fmt: skip
        if reply is None:
            return None
        try:
            found = reply.json()
            if not isinstance(found, Mapping):
                raise ValueError("not a JSON object")
            return publication_of(found)
        except ValueError as error:
            raise _bad_reply(what, False, error) from error

    def open(self, resource: str, name: str = "") -> BinaryIO:
        """:meth:`fenced.Store.open`, by a streamed ``GET …/publications/{resource}[:{name}]``:
        the bytes are checked against the answer's size and SHA-256 as they are read. A
        download cut short is :class:`~fenced.Unavailable`."""
        publication, stream = self._download(resource, name)
        return io.BufferedReader(CheckedStream(stream, publication), CHUNK_SIZE)

    def read(self, resource: str, name: str = "") -> bytes:
        """:meth:`fenced.Store.read`: all the bytes of the current publication, checked."""
        publication, stream = self._download(resource, name)
        with CheckedStream(stream, publication) as checked:
            return checked.readall()

    def _download(self, resource: str, name: str) -> tuple[Publication, BinaryIO]:
        local.check_publication(resource, name)
        remote = self._open_remote()
        what = f"read of {shown_publication(resource, name)}"
        reply = remote.request("GET", publication_path("publications", resource, name),
                               what=what, stream=True, absent="publication")  # fmt: skip
        if reply is None:
            raise NotFound(f"nothing is published as {shown_publication(resource, name)}")
        try:
            publication = publication_of_headers(resource, name, reply.headers)
        except ValueError as error:
            reply.close()
            raise _bad_reply(what, False, error) from error
        return publication, cast(BinaryIO, _Download(reply, what))

    def floors(self) -> dict[str, int]:
        """:meth:`fenced.Store.floors`, by ``GET …/floors`` (the ``admin`` role)."""
        remote = self._open_remote()
        body = remote.json("GET", "/floors", what="floors")
        found = body.get("floors")
        if not isinstance(found, Mapping) or not all(
            isinstance(k, str) and type(v) is int for k, v in found.items()
        ):
            raise _bad_reply("floors", False, ValueError("floors"))
        return dict(found)

    def history(self, resource: str, after: int = 0) -> list[Record]:
        """:meth:`fenced.Store.history`, by ``GET …/resources/{resource}:history``."""
        local.check_history(resource, after)
        remote = self._open_remote()
        what = f"history of {resource}"
        body = remote.json("GET", resource_path(resource, "history"), what=what,
                           params={"after": after})  # fmt: skip
        try:
            return records_of(body)
        except ValueError as error:
            raise _bad_reply(what, False, error) from error

    # -- life cycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connections; later calls raise :class:`~fenced.ConfigurationError`.
        Idempotent."""
        if not self._closed:
            self._closed = True
            self._remote.close()


class _Download(io.RawIOBase):
    """The body of a streamed answer as a raw binary stream; transport errors are
    :class:`~fenced.Unavailable`. Closing it closes the answer."""

    def __init__(self, reply: httpx.Response, what: str) -> None:
        super().__init__()
        self._reply = reply
        self._what = what
        self._chunks = reply.iter_bytes(CHUNK_SIZE)
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        if not target:
            return 0
        while not self._pending:
            try:
                chunk = next(self._chunks, None)
            except httpx.HTTPError as error:
                raise Unavailable(f"{self._what}: the download broke off ({error!r})") from error
            if chunk is None:
                return 0
            self._pending = memoryview(chunk)
        size = min(len(target), len(self._pending))
        target[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size

    def close(self) -> None:
        if not self.closed:
            self._reply.close()
        super().close()
