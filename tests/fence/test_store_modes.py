"""The modes of what the local stores create: ``0600`` files and ``0700`` directories whatever
the umask; ``0660`` and ``2770`` (with the directory's group) in a shared, setgid group
directory, where another member of the group uses the store; existing modes never changed."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from fenced.core._errors import StaleToken
from fenced.fence import Store, open_store
from fenced.testing.store_conformance import R, token
from support.local_users import NOBODY, as_nobody, mode

KINDS = ["sqlite", "file"]


def _url(kind: str, directory: Path) -> str:
    """The URL of a store of ``kind`` in ``directory`` (the file store *is* the directory)."""
    return f"sqlite:///{directory}/store.db" if kind == "sqlite" else f"file://{directory}"


def _use(store: Store) -> None:
    """Make the store create every kind of file it has: a binding, values large enough for a
    checkpoint (and so the journals), op ids, a rejection, publications, gc's trash."""
    store.fence(token(2))
    for round_ in range(3):
        store.put(token(2), "big", os.urandom(40 * 1024), op_id=f"put-{round_}")
        store.publish(token(2), os.urandom(1024))
    with pytest.raises(StaleToken):
        store.put(token(1), "big", b"late")
    assert store.gc(keep=1, grace=0) == 2


def _created(directory: Path) -> dict[str, int]:
    """Every file and directory below ``directory`` with its mode. The file store empties its
    ``trash`` in the background: an entry deleted while being listed is listed again."""
    for _ in range(20):
        try:
            return {str(p.relative_to(directory)): mode(p) for p in directory.rglob("*")}
        except FileNotFoundError:
            continue
    raise AssertionError(f"{directory} kept changing while it was listed")


def _kinds(created: dict[str, int]) -> set[str]:
    """The names in ``created``, with digests and object ids replaced by what they name."""
    kinds = set()
    for name in created:
        path = Path(name)
        if path.suffix == ".lock":
            kinds.add("<resource>.lock")
        elif path.parent.name in ("resources", "objects"):
            kinds.add(f"<{path.parent.name}>")
        else:
            kinds.add(path.name)
    return kinds


FILES = {
    "sqlite": {"store.db", "store.db-wal", "store.db-shm"},
    "file": {
        "fenced-store.json",
        "locks",
        "<resource>.lock",
        "resources",
        "<resources>",
        "state.json",
        "state.log",
        "records.jsonl",
        "ops.jsonl",
        "objects",
        "<objects>",
        "staging",
        "trash",
    },
}
"""What a used store of each kind has created, at least (the modes of all are checked)."""


@pytest.mark.parametrize("value", [0o022, 0o000], ids=["umask-022", "umask-000"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_store_creates_private_files_whatever_the_umask(
    tmp_path: Path, umask: Callable[[int], None], kind: str, value: int
) -> None:
    umask(value)
    directory = tmp_path / "store"
    if kind == "sqlite":
        directory.mkdir(mode=0o755)
    with open_store(_url(kind, directory)) as store:
        _use(store)
        created = _created(directory)
    assert FILES[kind] <= _kinds(created), sorted(created)
    for name, bits in created.items():
        wanted = 0o700 if (directory / name).is_dir() else 0o600
        assert bits == wanted, f"{name}: {bits:o}"
    assert mode(directory) == (0o755 if kind == "sqlite" else 0o700)  # made by fenced: 0700


@pytest.mark.parametrize("kind", KINDS)
def test_a_shared_group_directory_shares_the_store_with_its_group(
    public_dir: Path, umask: Callable[[int], None], kind: str
) -> None:
    """``install -d -m 2770 -g GROUP DIR``: what the store creates there is ``0660`` (files) and
    ``2770`` (directories), in the directory's group, whatever the owner's umask; a member of
    the group (nobody, in nogroup) uses the store; nothing is open to others."""
    umask(0o077)
    directory = public_dir / "shared"
    directory.mkdir()
    os.chown(directory, -1, NOBODY)
    os.chmod(directory, 0o2770)
    url = _url(kind, directory)
    with open_store(url) as store:
        _use(store)
        out = as_nobody(
            """
            import os, sys
            import fenced
            from fenced.testing.store_conformance import R, token
            with fenced.open_store(sys.argv[1]) as store:
                store.fence(token(3))
                store.put(token(3), "by-nobody", b"member")
                store.publish(token(3), b"published by a member")
                print(store.read(R).decode(), store.gc(keep=1, grace=0))
            """,
            url,
        )
        assert out.split() == ["published", "by", "a", "member", "1"]
        assert store.get(R, "by-nobody") is not None and store.floor(R) == 3
        created = _created(directory)
        groups = {name: os.stat(directory / name).st_gid for name in created}
    assert FILES[kind] <= _kinds(created), sorted(created)
    for name, bits in created.items():
        assert bits == (0o2770 if (directory / name).is_dir() else 0o660), f"{name}: {bits:o}"
    assert set(groups.values()) == {NOBODY}, groups
    assert mode(directory) == 0o2770


def test_a_file_store_directory_that_exists_keeps_its_mode(
    tmp_path: Path, umask: Callable[[int], None]
) -> None:
    """The store's own directory, made by its user beforehand (here ``0755``), keeps its mode;
    what the store creates inside is private all the same."""
    umask(0o022)
    directory = tmp_path / "store"
    directory.mkdir(mode=0o755)
    with open_store(_url("file", directory)) as store:
        _use(store)
    assert mode(directory) == 0o755
    assert {bits for bits in _created(directory).values()} == {0o600, 0o700}
