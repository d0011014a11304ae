"""Another local user (``nobody``), the process umask and file modes, for the tests of who may
read and use fenced's local files.

The session runs as root (in CI too); processes of the second user are started with
``user=nobody``. A test that needs them fails, never skips, when the session is not root.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

__all__ = ["NOBODY", "as_nobody", "mode", "public_dir", "umask"]

NOBODY = 65534  # uid of nobody and gid of nogroup (Debian)


def as_nobody(code: str, *args: str, groups: tuple[int, ...] = ()) -> str:
    """Run ``code`` with ``sys.executable`` as user nobody (group nogroup plus ``groups``);
    return its stdout. Fails the test if it exits non-zero."""
    if os.geteuid() != 0:
        pytest.fail("this test runs a process as user nobody: run the test suite as root (CI does)")
    done = subprocess.run(
        [sys.executable, "-I", "-c", textwrap.dedent(code), *args],
        user=NOBODY,
        group=NOBODY,
        extra_groups=list(groups),
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory every user may traverse and list (``0755``, like a project directory)."""
    path = Path(tempfile.mkdtemp(prefix="fenced-security-"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def umask() -> Iterator[Callable[[int], None]]:
    """Set the process's umask for the test; the previous one is put back after it."""
    previous = os.umask(0o022)

    def set_umask(value: int) -> None:
        os.umask(value)

    try:
        yield set_umask
    finally:
        os.umask(previous)


def mode(path: Path) -> int:
    """The permission bits of ``path`` (setgid included)."""
    return stat.S_IMODE(os.stat(path).st_mode)
