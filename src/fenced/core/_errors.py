"""The exceptions of fenced: one root, definite rejection apart from unknown outcome.

::

    FencedError                      root of everything fenced raises on purpose
    ├── ConfigurationError           a bad parameter, URL, capability or state file; fix the call
    │   │                            (also a ValueError)
    │   ├── InvalidName              a resource name, key or publication name that is not allowed
    │   ├── CorruptData              stored bytes that do not match their record: a damaged store
    │   └── AccessDenied             fenced serve refused the API key this role or name (403)
    │       └── NotAuthenticated     no API key, or one the server does not know (401)
    ├── Busy                         not acquired within ``wait`` (holder, epoch, remaining)
    │                                (also a TimeoutError)
    ├── LeaseLost                    the lease is no longer held (reason)
    ├── Rejected                     a store definitely refused a mutation; nothing applied
    │   ├── StaleToken               presented epoch below the domain's floor
    │   ├── NotInstalled             strict mode: a newer epoch that nobody installed with fence()
    │   └── ForeignToken             a token of another coordinator than the domain's
    ├── NotFound                     nothing stored under that name (also a LookupError)
    ├── IdempotencyConflict          an op_id reused with different content; nothing was applied
    ├── VersionConflict              a put's if_version did not match the key; nothing was applied
    ├── Unavailable                  retryable: the request was not carried out at all
    │                                (also a ConnectionError)
    └── OutcomeUnknown               the request was sent but its reply was lost: reconcile with
                                     op_id / request_id before assuming anything (on purpose,
                                     no builtin base)

Definite rejections (:class:`Rejected`, :class:`IdempotencyConflict`, :class:`VersionConflict`,
:class:`Busy`) guarantee that nothing happened. :class:`Unavailable` guarantees nothing happened
too but says "try again". :class:`OutcomeUnknown` guarantees nothing: the operation may or may not
have taken effect, and a retry with the same ``op_id`` or ``request_id`` tells which. Driver
errors (sqlite3, psycopg, …) are translated into these classes at the backend boundary with
``raise … from``.

Builtin bases, so that code written for the standard library catches fenced errors too:
``except TimeoutError`` catches :class:`Busy`, ``except ConnectionError`` catches
:class:`Unavailable`, ``except ValueError`` catches :class:`ConfigurationError` (with
:class:`InvalidName` and :class:`CorruptData`), ``except LookupError`` catches :class:`NotFound`.
Each class keeps its place in the tree above (``except FencedError`` and every fenced class catch
what they caught before). ``TimeoutError`` and ``ConnectionError`` are ``OSError`` subclasses, so
``except OSError`` catches :class:`Busy` and :class:`Unavailable` as well; their ``errno`` is
None. Every builtin base says "nothing happened, retrying is safe" or "bad input or data", which
is what code that catches it assumes. :class:`OutcomeUnknown` has no builtin base on purpose:
generic retry code catches ``ConnectionError``/``TimeoutError`` and retries blindly, and a blind
retry of a request whose outcome is unknown, without its ``op_id``/``request_id``, may apply it
twice (a second write, a second epoch). Catch it by name and reconcile.

Inside fenced: an ``except OSError`` or ``except ValueError`` around code that may raise a fenced
error lets it pass first (``except FencedError: raise``, as ``Translated`` in
``fenced/fence/_translated.py`` does), so that it is never translated a second time.
"""

from __future__ import annotations

import enum

__all__ = [
    "AccessDenied",
    "Busy",
    "ConfigurationError",
    "CorruptData",
    "FencedError",
    "ForeignToken",
    "IdempotencyConflict",
    "InvalidName",
    "LeaseLost",
    "LossReason",
    "NotAuthenticated",
    "NotFound",
    "NotInstalled",
    "OutcomeUnknown",
    "Rejected",
    "StaleToken",
    "Unavailable",
    "VersionConflict",
]


class FencedError(Exception):
    """Root of every error fenced raises on purpose."""


class ConfigurationError(FencedError, ValueError):
    """A bad parameter, URL, missing capability, or an unusable state file.

    Raised at the call, before any I/O where possible. Nothing was changed. Also a
    :class:`ValueError`, so are its subclasses :class:`InvalidName` and :class:`CorruptData`.
    """


class AccessDenied(ConfigurationError):
    """``fenced serve`` refused the request's API key: the key is not allowed this role on this
    name (HTTP 403). Nothing was changed; retrying with the same key is refused again."""


class NotAuthenticated(AccessDenied):
    """``fenced serve`` wants an API key and the request carried none, or one it does not know
    (HTTP 401; ``FENCED_API_KEY`` sets the client's key). Nothing was changed."""


class InvalidName(ConfigurationError):
    """A resource name, key or publication name that fenced does not accept.

    Raised before any I/O: nothing was read or written.
    """


class CorruptData(ConfigurationError):
    """Stored data does not match what the store recorded for it: the store is damaged.

    A publication's bytes are shorter or longer than its recorded size or have another SHA-256,
    or its object (or a chunk of it) is missing. Raised by every read of a publication
    (``Store.read``, and a ``Store.open`` stream before it would report a clean end). Nothing was
    changed; reading again gives the same answer until the data is repaired (a new publication,
    or the store restored from a backup).
    """


class Busy(FencedError, TimeoutError):
    """The lease was not acquired within ``wait``; nothing was granted.

    Also a :class:`TimeoutError` (an ``OSError`` whose ``errno`` is None): retrying is safe.

    ``holder`` and ``epoch`` describe the live lease at the last attempt (``holder`` is None when
    the resource was free but earlier waiters were queued ahead); ``remaining`` is the time in
    seconds that lease had left by the coordinator's clock.
    """

    def __init__(self, resource: str, holder: str | None, epoch: int, remaining: float) -> None:
        self.resource = resource
        self.holder = holder
        self.epoch = epoch
        self.remaining = remaining
        who = f"held by {holder!r} at epoch {epoch}" if holder else "earlier waiters are queued"
        super().__init__(f"{resource} is busy: {who}, {remaining:.3f}s remaining")


class LossReason(enum.Enum):
    """Why a lease stopped being held."""

    EXPIRED = "expired"
    """The local deadline passed (no successful renewal in time)."""
    REJECTED = "rejected"
    """The coordinator said the lease is no longer this owner's (expired there, or taken over)."""
    SUPERSEDED = "superseded"
    """A store reported a newer epoch than this lease's."""
    RELEASED = "released"
    """The lease was released by its owner."""
    UNCERTAIN = "uncertain"
    """Not lost for sure, but a renewal failed: :meth:`check` refuses to let new work start."""


class LeaseLost(FencedError):
    """The lease is not held: do not start or continue protected work.

    ``reason`` is a :class:`LossReason`; ``detail`` is a human sentence.
    """

    def __init__(self, reason: LossReason, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"lease lost ({reason.value})" + (f": {detail}" if detail else ""))


class Rejected(FencedError):
    """A store definitely refused a mutation. Nothing was applied."""


class StaleToken(Rejected):
    """The presented epoch is below the domain's floor: a newer owner exists."""

    def __init__(self, resource: str, presented: int, floor: int) -> None:
        self.resource = resource
        self.presented = presented
        self.floor = floor
        super().__init__(
            f"stale token for {resource}: epoch {presented} is below the floor {floor}"
        )


class NotInstalled(Rejected):
    """Strict mode: the epoch is above the floor but was never installed."""

    def __init__(self, resource: str, presented: int, floor: int) -> None:
        self.resource = resource
        self.presented = presented
        self.floor = floor
        super().__init__(
            f"epoch {presented} of {resource} is not installed (floor {floor}): install it first "
            "with store.fence(token) or coord.hold(..., fence=[store])"
        )


class ForeignToken(Rejected):
    """The token comes from another coordinator than the one this domain is bound to.

    ``floor`` is the domain's floor when the store checked (None where the store does not say).
    """

    def __init__(self, resource: str, presented: str, bound: str, floor: int | None = None) -> None:
        self.resource = resource
        self.presented = presented
        self.bound = bound
        self.floor = floor
        super().__init__(
            f"token for {resource} comes from coordinator {presented}, "
            f"but this store is bound to coordinator {bound}"
        )


class NotFound(FencedError, LookupError):
    """Nothing is published or stored under that name. Nothing was changed."""


class IdempotencyConflict(FencedError):
    """An ``op_id`` was reused with different content. Nothing was applied."""


class VersionConflict(FencedError):
    """A put's ``if_version`` did not match the key's current version. Nothing was applied.

    ``expected`` is the ``if_version`` given (0 means "the key must not exist"); ``actual`` is the
    key's version when the store checked (0 when the key did not exist). It is not a fencing
    rejection: the token was fine, the compare-and-set lost a race with another write.
    """

    def __init__(self, resource: str, key: str, expected: int, actual: int) -> None:
        self.resource = resource
        self.key = key
        self.expected = expected
        self.actual = actual
        want = "to be absent" if expected == 0 else f"at version {expected}"
        found = "absent" if actual == 0 else f"at version {actual}"
        super().__init__(
            f"version conflict on {resource} key {key!r}: expected it {want}, found {found}"
        )


class Unavailable(FencedError, ConnectionError):
    """The backend could not be reached or is busy; nothing happened. Retry is safe.

    Also a :class:`ConnectionError` (an ``OSError`` whose ``errno`` is None), so that retry code
    written for the standard library retries it.
    """


class OutcomeUnknown(FencedError):
    """The request may or may not have taken effect (its reply was lost).

    Retry with the same ``op_id`` / ``request_id`` to learn the outcome; never assume either way.
    Deliberately not a :class:`ConnectionError` or :class:`TimeoutError` (unlike
    :class:`Unavailable` and :class:`Busy`): code that retries those blindly, without the
    ``op_id``, could apply the operation twice.
    """
