"""The keys file of ``fenced serve --keys FILE``: API keys scoped to roles and name prefixes.

A key is ``fk_<id>_<secret>``: ``fk_``, 12 lowercase hex digits of id, ``_``, and 43 URL-safe
base64 characters (32 random bytes from :mod:`secrets`). It is shown once, when it is made
(``fenced keys add``); the file keeps only its id and a salted hash, never the key. A request
carries it as ``Authorization: Bearer fk_…``.

The file is one JSON document, written atomically (a temporary file in the same directory,
fsync, ``os.replace``, fsync of the directory) with mode 0600, under an exclusive ``flock`` of
its directory so that two ``fenced keys`` commands never lose each other's change::

    {"format": "fenced-keys", "version": 1, "keys": [
      {"id": "3f9a0c12ab34", "name": "ci", "roles": ["hold", "read"], "prefixes": ["jobs/"],
       "created": "2025-06-01T12:00:00Z", "revoked": null,
       "salt": "<32 hex digits>", "sha256": "<64 hex digits>"}]}

``sha256`` is SHA-256 of the 16 salt bytes followed by the whole key text. A plain salted hash,
not a slow KDF (scrypt, argon2): a slow KDF protects guessable passwords, but a key holds 256
random bits, beyond any guessing however fast the hash, and a slow KDF would cost every request.
The id finds the key's entry in a dict; the hashes are compared with :func:`hmac.compare_digest`.
A key with an id the file does not have is compared with a dummy entry all the same, and is
refused with the same message as a wrong secret or a revoked key: the answer tells nothing about
which ids exist.

Rules of :meth:`KeysAuthority.check` (``role`` on ``name``):

* no ``Authorization`` header, not ``Bearer``, a malformed key, an unknown id, a wrong secret or a
  revoked key: :class:`~fenced.NotAuthenticated` (HTTP 401);
* a role the key was not given (``admin`` implies ``hold``, ``write`` and ``read``), or a
  ``name`` that starts with none of the key's prefixes: :class:`~fenced.AccessDenied` (403);
* a prefix is a plain string prefix of the name as the route receives it (``jobs`` also covers
  ``jobs-old``; end it with ``/`` for a subtree); ``""`` covers every name;
* a route about no single name (``name`` None: the list of resources, every resource's records)
  shows or touches every name, so it needs a key whose prefixes include ``""``. A route that
  filters what it answers by the key's scope can ask :meth:`KeysAuthority.scope` instead.

Messages name the key by its id and name, never by its text; nothing here logs a key.

The server re-reads the file when it changes (``fenced keys revoke`` takes effect at the next
request, without a restart): every :meth:`~KeysAuthority.check` stats the file (one ``stat``
system call) and reads it again when its inode, size or modification time differ. A file that
cannot be read at start raises :class:`~fenced.ConfigurationError` naming it; one that becomes
unreadable or malformed while serving refuses every request with
:class:`~fenced.Unavailable` (503, fail closed) until it is fixed, and is logged once per change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from fenced.core._errors import (
    AccessDenied,
    ConfigurationError,
    NotAuthenticated,
    NotFound,
    Unavailable,
)

if TYPE_CHECKING:  # fenced.server._auth imports FastAPI; `fenced keys` needs only this module
    from fenced.server._auth import Authority

__all__ = [
    "FILE_FORMAT",
    "FILE_VERSION",
    "ROLES",
    "ApiKey",
    "KeysAuthority",
    "NewKey",
    "RoleName",
    "add_key",
    "open_keys",
    "read_keys",
    "revoke_key",
]

log = logging.getLogger("fenced.server.keys")

RoleName = Literal["hold", "write", "read", "admin"]
"""The same values as :data:`fenced.server._auth.Role`."""
ROLES: tuple[RoleName, ...] = ("hold", "write", "read", "admin")
"""Every role, in the order shown: ``admin`` implies the other three."""
FILE_FORMAT = "fenced-keys"
FILE_VERSION = 1

_KEY = re.compile(r"fk_([0-9a-f]{12})_([A-Za-z0-9_-]{43})")
_ID = re.compile(r"[0-9a-f]{12}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_PREFIX = re.compile(r"[A-Za-z0-9._/-]{0,255}")
_SALT_BYTES = 16
_MAX_HEADER = 200
_DUMMY_SALT = bytes(_SALT_BYTES)
_DUMMY_DIGEST = hashlib.sha256(b"fenced: no key has this digest").digest()


def _digest(salt: bytes, key: str) -> bytes:
    return hashlib.sha256(salt + key.encode("ascii")).digest()


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass(frozen=True, slots=True)
class ApiKey:
    """One entry of the keys file: everything about a key except the key itself."""

    id: str
    name: str
    roles: tuple[RoleName, ...]
    """Sorted in :data:`ROLES` order; never empty."""
    prefixes: tuple[str, ...]
    """The key acts only on names that start with one of these (``""``: every name)."""
    created: str
    """ISO 8601, UTC (display only)."""
    revoked: str | None
    """When it was revoked (ISO 8601, UTC), or None while it is valid."""
    salt: bytes
    sha256: bytes

    def has_role(self, role: RoleName) -> bool:
        """Whether the key was given ``role`` (``admin`` implies every role)."""
        return role in self.roles or "admin" in self.roles

    def covers(self, name: str | None) -> bool:
        """Whether ``name`` is in the key's scope; None (every name) only with prefix ``""``."""
        if name is None:
            return "" in self.prefixes
        return any(name.startswith(prefix) for prefix in self.prefixes)

    def public(self) -> dict[str, object]:
        """The entry as ``fenced keys list --json`` shows it: no salt, no hash."""
        return {
            "id": self.id,
            "name": self.name,
            "roles": list(self.roles),
            "prefixes": list(self.prefixes),
            "created": self.created,
            "revoked": self.revoked,
        }

    def stored(self) -> dict[str, object]:
        """The entry as the keys file stores it."""
        return {**self.public(), "salt": self.salt.hex(), "sha256": self.sha256.hex()}


@dataclasses.dataclass(frozen=True, slots=True)
class NewKey:
    """What :func:`add_key` made: the entry, and the key text (shown once, stored nowhere)."""

    entry: ApiKey
    key: str


# -- validation -------------------------------------------------------------------------------


def validate_roles(roles: Sequence[str]) -> tuple[RoleName, ...]:
    """``roles`` without repeats, in :data:`ROLES` order; raises :class:`ConfigurationError` for
    an unknown role or none at all."""
    if not roles:
        raise ConfigurationError(f"a key needs at least one role ({', '.join(ROLES)})")
    for role in roles:
        if role not in ROLES:
            raise ConfigurationError(f"unknown role {role!r}; the roles are {', '.join(ROLES)}")
    return tuple(role for role in ROLES if role in roles)


def validate_prefixes(prefixes: Sequence[str]) -> tuple[str, ...]:
    """``prefixes`` without repeats, sorted; raises :class:`ConfigurationError` for none at all,
    or for one no name could start with (names are ``[A-Za-z0-9._-]`` and ``/``)."""
    if not prefixes:
        raise ConfigurationError("a key needs at least one name prefix ('' for every name)")
    for prefix in prefixes:
        if not _PREFIX.fullmatch(prefix):
            raise ConfigurationError(
                f"prefix {prefix!r} cannot start a name: names are at most 255 characters of "
                "A-Z a-z 0-9 . _ - and '/'"
            )
    return tuple(sorted(set(prefixes)))


def validate_key_name(name: str) -> str:
    """``name`` if it can name a key, else :class:`ConfigurationError`: 1-64 characters of
    ``A-Z a-z 0-9 . _ @ -``, starting with a letter or digit, and not 12 hex digits (an id)."""
    if not _NAME.fullmatch(name):
        raise ConfigurationError(
            f"key name {name!r} is not allowed: 1-64 characters of A-Z a-z 0-9 . _ @ -, "
            "starting with a letter or digit"
        )
    if _ID.fullmatch(name):
        raise ConfigurationError(f"key name {name!r} looks like a key id; choose another")
    return name


# -- the file ---------------------------------------------------------------------------------


def _malformed(path: Path, what: str) -> ConfigurationError:
    return ConfigurationError(f"keys file {path} is malformed: {what}")


def _field(entry: dict[str, object], name: str, kind: type, where: str, path: Path) -> object:
    value = entry.get(name)
    if not isinstance(value, kind):
        raise _malformed(path, f"{where}.{name} must be a {kind.__name__}")
    return value


def _hex(entry: dict[str, object], name: str, size: int, where: str, path: Path) -> bytes:
    text = cast(str, _field(entry, name, str, where, path))
    if not re.fullmatch(rf"[0-9a-f]{{{2 * size}}}", text):
        raise _malformed(path, f"{where}.{name} must be {2 * size} lowercase hex digits")
    return bytes.fromhex(text)


def _instant(value: object, where: str, path: Path) -> str:
    if not isinstance(value, str):
        raise _malformed(path, f"{where} must be an ISO 8601 time")
    try:
        datetime.fromisoformat(value)
    except ValueError:
        raise _malformed(path, f"{where} must be an ISO 8601 time, not {value!r}") from None
    return value


def _entry(raw: object, index: int, path: Path) -> ApiKey:
    where = f"keys[{index}]"
    if not isinstance(raw, dict):
        raise _malformed(path, f"{where} must be an object")
    entry = cast(dict[str, object], raw)
    key_id = cast(str, _field(entry, "id", str, where, path))
    if not _ID.fullmatch(key_id):
        raise _malformed(path, f"{where}.id must be 12 lowercase hex digits")
    name = cast(str, _field(entry, "name", str, where, path))
    roles = cast(list[object], _field(entry, "roles", list, where, path))
    prefixes = cast(list[object], _field(entry, "prefixes", list, where, path))
    if not all(isinstance(item, str) for item in roles + prefixes):
        raise _malformed(path, f"{where}: roles and prefixes must be strings")
    try:
        validate_key_name(name)
        checked_roles = validate_roles(cast(list[str], roles))
        checked_prefixes = validate_prefixes(cast(list[str], prefixes))
    except ConfigurationError as error:
        raise _malformed(path, f"{where}: {error}") from None
    revoked = entry.get("revoked")
    return ApiKey(
        id=key_id,
        name=name,
        roles=checked_roles,
        prefixes=checked_prefixes,
        created=_instant(entry.get("created"), f"{where}.created", path),
        revoked=None if revoked is None else _instant(revoked, f"{where}.revoked", path),
        salt=_hex(entry, "salt", _SALT_BYTES, where, path),
        sha256=_hex(entry, "sha256", hashlib.sha256().digest_size, where, path),
    )


def parse_keys(data: bytes, path: Path) -> tuple[ApiKey, ...]:
    """The entries of a keys file's bytes (``path`` only names it in errors).

    Raises :class:`ConfigurationError` with one line naming ``path`` for anything but a keys
    file of this format: not JSON, another format or version, a missing or mistyped field, an
    unknown role, a repeated id, two valid keys with one name."""
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigurationError(f"keys file {path} is not valid JSON: {error}") from None
    if not isinstance(document, dict) or document.get("format") != FILE_FORMAT:
        raise _malformed(path, f"not a {FILE_FORMAT!r} document")
    if document.get("version") != FILE_VERSION:
        raise _malformed(path, f"version {document.get('version')!r}; this fenced reads 1")
    raw = document.get("keys")
    if not isinstance(raw, list):
        raise _malformed(path, "'keys' must be a list")
    entries = tuple(_entry(item, index, path) for index, item in enumerate(raw))
    ids: set[str] = set()
    names: set[str] = set()
    for entry in entries:
        if entry.id in ids:
            raise _malformed(path, f"id {entry.id} appears twice")
        ids.add(entry.id)
        if entry.revoked is None:
            if entry.name in names:
                raise _malformed(path, f"two valid keys are named {entry.name!r}")
            names.add(entry.name)
    return entries


def _unreadable(path: Path, error: OSError) -> ConfigurationError:
    if isinstance(error, FileNotFoundError):
        return ConfigurationError(
            f"no keys file at {path} (create it with 'fenced keys add NAME --keys {path} …')"
        )
    return ConfigurationError(f"cannot read keys file {path}: {error.strerror or error}")


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise _unreadable(path, error) from None


def read_keys(path: Path) -> tuple[ApiKey, ...]:
    """The entries of the keys file at ``path``, revoked ones included, in the file's order.

    Raises :class:`ConfigurationError` naming ``path`` if it does not exist, cannot be read or
    is malformed. Reads only: never creates or changes anything."""
    return parse_keys(_read_bytes(path), path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` of ``path``'s directory while the block runs (no lock file)."""
    try:
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as error:
        raise ConfigurationError(
            f"cannot use the directory of keys file {path}: {error.strerror or error}"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write(path: Path, entries: Sequence[ApiKey]) -> None:
    """Replace the file at ``path`` atomically with ``entries``, mode 0600, durably."""
    document = {
        "format": FILE_FORMAT,
        "version": FILE_VERSION,
        "keys": [entry.stored() for entry in entries],
    }
    data = (json.dumps(document, indent=2) + "\n").encode()
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:
        raise ConfigurationError(
            f"cannot write keys file {path}: {error.strerror or error}"
        ) from None
    try:
        with os.fdopen(fd, "wb") as file:
            os.fchmod(file.fileno(), 0o600)
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(error, OSError):
            raise ConfigurationError(
                f"cannot write keys file {path}: {error.strerror or error}"
            ) from None
        raise
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def add_key(
    path: Path,
    name: str,
    roles: Sequence[str],
    prefixes: Sequence[str],
    *,
    clock: Callable[[], float] = time.time,
) -> NewKey:
    """Make a key named ``name`` with ``roles`` on ``prefixes`` and add it to the keys file at
    ``path`` (created, mode 0600, if it does not exist; its directory must).

    Returns the entry and the key text, which is stored nowhere: the caller shows it once.
    Raises :class:`ConfigurationError` for a bad name, role or prefix, a name a valid key
    already has, or a file that cannot be read or written; then the file is unchanged."""
    validate_key_name(name)
    checked_roles = validate_roles(roles)
    checked_prefixes = validate_prefixes(prefixes)
    with _locked(path):
        entries = read_keys(path) if path.exists() else ()
        if any(entry.name == name and entry.revoked is None for entry in entries):
            raise ConfigurationError(
                f"keys file {path} already has a valid key named {name!r} "
                "(revoke it first, or choose another name)"
            )
        taken = {entry.id for entry in entries}
        key_id = secrets.token_hex(6)
        while key_id in taken:
            key_id = secrets.token_hex(6)
        key = f"fk_{key_id}_{secrets.token_urlsafe(32)}"
        salt = secrets.token_bytes(_SALT_BYTES)
        entry = ApiKey(
            id=key_id,
            name=name,
            roles=checked_roles,
            prefixes=checked_prefixes,
            created=_utc(clock()),
            revoked=None,
            salt=salt,
            sha256=_digest(salt, key),
        )
        _write(path, [*entries, entry])
    return NewKey(entry, key)


def revoke_key(
    path: Path, id_or_name: str, *, clock: Callable[[], float] = time.time
) -> tuple[ApiKey, bool]:
    """Revoke the key with id ``id_or_name``, else the valid key of that name, in the keys file
    at ``path``: a server using the file refuses it from its next request on.

    Returns the entry (revoked) and whether this call revoked it (False: it already was; the
    file is unchanged). The entry stays in the file, marked revoked. Raises :class:`NotFound`
    if no key has that id or name, :class:`ConfigurationError` if the file cannot be read or
    written (then it is unchanged)."""
    with _locked(path):
        entries = list(read_keys(path))
        found = [i for i, entry in enumerate(entries) if entry.id == id_or_name]
        if not found:
            found = [
                i
                for i, entry in enumerate(entries)
                if entry.name == id_or_name and entry.revoked is None
            ]
        if not found:
            gone = [entry for entry in entries if entry.name == id_or_name]
            if gone:
                return gone[-1], False
            raise NotFound(f"keys file {path} has no key with id or name {id_or_name!r}")
        index = found[0]
        entry = entries[index]
        if entry.revoked is not None:
            return entry, False
        revoked = dataclasses.replace(entry, revoked=_utc(clock()))
        entries[index] = revoked
        _write(path, entries)
    return revoked, True


# -- the server's side ------------------------------------------------------------------------


class KeysAuthority:
    """The :class:`~fenced.server._auth.Authority` of a keys file; see the module docstring.

    Safe to call from several threads. Each call costs one ``stat`` of the file, one dict
    lookup and one SHA-256 of the presented key; the file is parsed again only after it
    changed."""

    def __init__(self, path: Path) -> None:
        """Read the keys file at ``path``; raises :class:`ConfigurationError` naming it if it
        does not exist, cannot be read or is malformed."""
        self.path = path
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int, int] | None = None
        self._keys: dict[str, ApiKey] = {}
        self._broken: str | None = None
        self._load(raising=True)

    def _load(self, raising: bool) -> None:
        """Parse the file again; on failure raise (``raising``) or remember the failure."""
        try:
            try:
                with open(self.path, "rb") as file:
                    status = os.fstat(file.fileno())
                    data = file.read()
            except OSError as error:
                raise _unreadable(self.path, error) from None
            entries = parse_keys(data, self.path)
        except ConfigurationError as error:
            if raising:
                raise
            if self._broken != str(error):
                log.warning("refusing every request: %s", error)
            self._broken = str(error)
            self._keys = {}
            self._seen = self._signature()
            return
        if self._broken is not None or self._seen is not None:
            log.info("keys file %s read again: %d key(s)", self.path, len(entries))
        self._keys = {entry.id: entry for entry in entries}
        self._broken = None
        self._seen = (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)

    def _signature(self) -> tuple[int, int, int, int] | None:
        try:
            status = os.stat(self.path)
        except OSError:
            return None
        return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)

    def _current(self) -> dict[str, ApiKey]:
        """The keys of the file as it is now; :class:`Unavailable` if it is broken."""
        with self._lock:
            signature = self._signature()
            if signature is None or signature != self._seen:
                self._load(raising=False)
            if self._broken is not None:
                raise Unavailable(
                    "the server cannot read its API keys file; every request is refused "
                    "until its operator fixes it"
                )
            return self._keys

    def authenticate(self, authorization: str | None) -> ApiKey:
        """The valid key the ``Authorization`` header carries (``Bearer fk_…``).

        Raises :class:`~fenced.NotAuthenticated` without one (no header, another scheme, a
        malformed, unknown, wrong or revoked key; the last four with one message), and
        :class:`~fenced.Unavailable` while the file is broken."""
        keys = self._current()
        if authorization is None or not authorization.strip():
            raise NotAuthenticated(
                "an API key is needed: send the header 'Authorization: Bearer <key>'"
            )
        scheme, _, text = authorization.strip().partition(" ")
        text = text.strip()
        if scheme.lower() != "bearer" or len(text) > _MAX_HEADER or not _KEY.fullmatch(text):
            raise NotAuthenticated(
                "the Authorization header does not carry a fenced API key (expected 'Bearer fk_…')"
            )
        entry = keys.get(text[3:15])
        if entry is None:
            hmac.compare_digest(_digest(_DUMMY_SALT, text), _DUMMY_DIGEST)  # the same work
        elif hmac.compare_digest(_digest(entry.salt, text), entry.sha256) and not entry.revoked:
            return entry
        raise NotAuthenticated("the API key is not valid (unknown, wrong or revoked)")

    def check(self, authorization: str | None, role: RoleName, name: str | None) -> None:
        """Return if the header's key may act as ``role`` on ``name`` (None: on every name).

        Raises :class:`~fenced.NotAuthenticated` (see :meth:`authenticate`),
        :class:`~fenced.AccessDenied` for a role the key lacks or a name outside its prefixes,
        :class:`~fenced.Unavailable` while the file is broken."""
        entry = self.authenticate(authorization)
        if not entry.has_role(role):
            raise AccessDenied(
                f"API key {entry.id} ({entry.name}) does not have the role {role!r} "
                f"(it has {', '.join(entry.roles)})"
            )
        if not entry.covers(name):
            shown = ", ".join(repr(prefix) for prefix in entry.prefixes)
            if name is None:
                raise AccessDenied(
                    f"API key {entry.id} ({entry.name}) is limited to names starting with "
                    f"{shown}; this request concerns every name"
                )
            raise AccessDenied(
                f"API key {entry.id} ({entry.name}) may not act on {name[:300]!r}: "
                f"it is limited to names starting with {shown}"
            )

    def scope(self, authorization: str | None, role: RoleName) -> tuple[str, ...]:
        """The name prefixes within which the header's key may act as ``role``: for a route
        that answers about several names and filters its answer by them.

        Raises as :meth:`check` does for a missing key or role."""
        entry = self.authenticate(authorization)
        if not entry.has_role(role):
            raise AccessDenied(f"API key {entry.id} ({entry.name}) does not have the role {role!r}")
        return entry.prefixes


def open_keys(path: Path) -> Authority:
    """The authority of the keys file at ``path`` (:class:`KeysAuthority`).

    Raises :class:`~fenced.ConfigurationError` with one line naming the file if it does not
    exist, cannot be read or is malformed."""
    return KeysAuthority(path)
