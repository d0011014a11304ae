"""The public names are a contract (DESIGN §10): pinned here so a rename fails loudly."""

from __future__ import annotations

import builtins

import fenced

PUBLIC = {
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


PUBLIC_MODULES = {
    "fenced",
    "fenced.aio",
    "fenced.coordinator",
    "fenced.coordinator.aio_backend",
    "fenced.coordinator.backend",
    "fenced.fence",
    "fenced.fence.backend",
    "fenced.election",
    "fenced.observe",
    "fenced.observe.metrics",
    "fenced.observe.timeline",
    "fenced.verify",
}
"""Public modules besides ``fenced.testing`` (the public test kit, every module of it)."""


def test_every_module_outside_the_public_api_is_private() -> None:
    """A module a user may import without an underscore is one of the public ones (httpx's rule);
    a new module must be public on purpose (add it here and to the README) or be ``_private``."""
    import pathlib

    root = pathlib.Path(fenced.__file__).parent
    public = set()
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] in ("__init__", "__main__"):
            parts = parts[:-1]
        if any(part.startswith("_") for part in parts) or parts[:2] == ("fenced", "testing"):
            continue
        public.add(".".join(parts))
    # packages that only hold private modules are namespaces, not API
    namespaces = {
        m for m in public - PUBLIC_MODULES if (root.parent / m.replace(".", "/")).is_dir()
    }
    assert public - namespaces == PUBLIC_MODULES


def test_the_operations_api_is_public() -> None:
    import fenced.coordinator
    import fenced.fence
    import fenced.observe

    assert {"advance", "backup", "rebind", "restore"} <= set(fenced.coordinator.__all__)
    assert "install_postgres_guard" in fenced.fence.__all__
    assert {"Record", "RecordKind"} <= set(fenced.observe.__all__)


AIO_PUBLIC = {
    "AsyncCampaign",
    "AsyncCoordinator",
    "AsyncHeldLease",
    "AsyncHold",
    "AsyncLeadership",
    "AsyncObserver",
    "AsyncStore",
    "connect",
    "guard",
    "open_store",
}


def test_the_asyncio_face_is_pinned_and_mirrors_the_sync_names() -> None:
    import inspect

    import fenced.aio

    assert set(fenced.aio.__all__) == AIO_PUBLIC
    # every operation of the sync Coordinator and Store exists on the asyncio face
    for sync, face in ((fenced.Coordinator, fenced.aio.AsyncCoordinator),
                       (fenced.Store, fenced.aio.AsyncStore)):  # fmt: skip
        missing = {
            name
            for name, member in inspect.getmembers(sync)
            if not name.startswith("_") and callable(member) and name not in _SYNC_ONLY
        } - set(dir(face))
        assert missing == set(), (sync.__name__, missing)


_SYNC_ONLY = {"close"}  # the asyncio face closes with aclose() (or async with)
