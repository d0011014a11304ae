"""The public names are a contract (DESIGN §10): pinned here so a rename fails loudly."""

from __future__ import annotations

import builtins

import fenced

PUBLIC = {
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
    errors = [name for name in PUBLIC if _is_exception(getattr(fenced, name))]
    assert "FencedError" in errors and "LeaseLost" in errors  # the check below is not vacuous
    for name in errors:
        assert issubclass(getattr(fenced, name), fenced.FencedError), name


def test_no_public_name_shadows_a_builtin() -> None:
    """``from fenced import *`` must not replace a builtin (``TimeoutError``, ``ConnectionError``,
    ``open`` ...). Checked against the :mod:`builtins` module itself: ``__builtins__`` is a dict
    in an imported module, whose ``dir()`` lists dict methods, not builtin names."""
    assert hasattr(builtins, "TimeoutError")  # what is compared against really is the builtins
    shadowing = sorted(name for name in fenced.__all__ if hasattr(builtins, name))
    assert shadowing == []


def _is_exception(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseException)
