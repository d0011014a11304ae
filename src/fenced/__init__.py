"""fenced: leases with fencing tokens, and protected resources that reject stale owners.

A coordinator decides who *should* work: :func:`connect` returns a :class:`Coordinator` that grants
leases whose :class:`FencingToken` carries an epoch larger than any granted before for that
resource. The protected resource decides which effects *may take place*: a store from
:func:`open_store` (or :func:`guard` inside your own SQL transaction) checks the token atomically
with each change and rejects a paused or partitioned worker whose lease has expired. Leader
election (``coord.campaign``, ``coord.leader``, ``coord.observe``, :func:`run_as_leader`,
:class:`Elector`) is built on the same leases: a term is a lease, so every :class:`Leadership`
carries a fencing token.
"""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from fenced.coordinator._client import Coordinator
from fenced.coordinator._connect import connect
from fenced.core._errors import (
    AccessDenied,
    Busy,
    ConfigurationError,
    CorruptData,
    FencedError,
    ForeignToken,
    IdempotencyConflict,
    InvalidName,
    LeaseLost,
    LossReason,
    NotAuthenticated,
    NotFound,
    NotInstalled,
    OutcomeUnknown,
    Rejected,
    StaleToken,
    Unavailable,
    VersionConflict,
)
from fenced.core._lease import Lease, LeaseInfo, LeaseState
from fenced.core._token import FencingToken
from fenced.election import (
    Elector,
    LeaderChange,
    LeaderChangeKind,
    LeaderInfo,
    Leadership,
    run_as_leader,
)
from fenced.fence import Item, Publication, Store, Version, guard, open_store
from fenced.runtime._keeper import HeldLease

__all__ = [
    "AccessDenied",
    "Busy",
    "ConfigurationError",
    "Coordinator",
    "CorruptData",
    "Elector",
    "FencedError",
    "FencingToken",
    "ForeignToken",
    "HeldLease",
    "IdempotencyConflict",
    "InvalidName",
    "Item",
    "LeaderChange",
    "LeaderChangeKind",
    "LeaderInfo",
    "Leadership",
    "Lease",
    "LeaseInfo",
    "LeaseLost",
    "LeaseState",
    "LossReason",
    "NotAuthenticated",
    "NotFound",
    "NotInstalled",
    "OutcomeUnknown",
    "Publication",
    "Rejected",
    "StaleToken",
    "Store",
    "Unavailable",
    "Version",
    "VersionConflict",
    "connect",
    "guard",
    "open_store",
    "run_as_leader",
]

try:  # the one version, in the package metadata (pyproject.toml)
    __version__ = _version("fenced")
except _PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
