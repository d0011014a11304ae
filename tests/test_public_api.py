"""The public names are a contract (DESIGN §10): pinned here so a rename fails loudly."""

from __future__ import annotations

import fenced

PUBLIC = {
    "Busy",
    "ConfigurationError",
    "Coordinator",
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
}


def test_all_is_pinned() -> None:
    assert set(fenced.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(fenced, name) is not None


def test_errors_share_one_root() -> None:
    for name in PUBLIC:
        obj = getattr(fenced, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, fenced.FencedError)
            assert name not in dir(__builtins__)  # never shadow a builtin name
