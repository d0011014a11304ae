"""A real, small tmpfs for the tests of a full disk.

The tests run as root (in CI too): a tmpfs that cannot be mounted fails the test, it never skips
it. The mount is undone when the block ends, lazily if something still holds it open.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = ["fill_up", "free_bytes", "mounted_tmpfs"]


@contextmanager
def mounted_tmpfs(disk: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (``"8m"``) on the new directory ``disk`` for the block."""
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)]
    mounted = subprocess.run(mount, capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs (run the tests as root): {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        if subprocess.run(["umount", str(disk)], check=False).returncode != 0:
            subprocess.run(["umount", "--lazy", str(disk)], check=True)


def free_bytes(disk: Path) -> int:
    """The bytes an unprivileged writer may still use on the file system of ``disk``."""
    stat = os.statvfs(disk)
    return stat.f_bavail * stat.f_frsize


def fill_up(path: Path) -> None:
    """Write ``path`` until the file system has no byte left (another program filling it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        block = b"\0" * 4096
        while True:
            try:
                os.write(fd, block if free_bytes(path.parent) >= len(block) else b"\0")
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                return
    finally:
        os.close(fd)
