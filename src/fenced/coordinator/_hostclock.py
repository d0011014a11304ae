"""The host's boot-time clock and boot id, read from the kernel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fenced.core._clock import SystemClock
from fenced.core._errors import ConfigurationError

__all__ = ["SystemHostClock"]

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_SYSCTL = "/usr/sbin/sysctl"


def _boot_id(platform: str) -> str:
    """This boot's id: Linux's ``boot_id``, macOS's ``kern.bootsessionuuid``; else an error.

    There is no approximation: one derived from the wall clock (``time() - uptime``) moves with
    every wall-clock step and NTP slew, and two processes that computed different ids would each
    take the other's leases for ones from a previous boot, that is expired.
    """
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        pass
    if platform == "darwin":
        try:
            found = subprocess.run(
                [_SYSCTL, "-n", "kern.bootsessionuuid"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            found = ""
        if found:
            return found
    raise ConfigurationError(
        f"cannot read this host's boot id on {platform} (Linux: {_BOOT_ID}, macOS: sysctl "
        "kern.bootsessionuuid): the embedded coordinator needs it to expire leases across reboots"
    )


class SystemHostClock(SystemClock):
    """The host's boot clock and boot id: the embedded coordinator's clock.

    :meth:`boottime` is :meth:`SystemClock.now` (CLOCK_BOOTTIME on Linux, CLOCK_MONOTONIC on
    macOS: both count suspend; see :mod:`fenced.core._clock`). Wall-clock steps do not move it; a
    reboot changes the boot id, so every lease from before a reboot is expired by definition.
    Raises :class:`ConfigurationError` on a platform whose boot id it cannot read.
    """

    def __init__(self) -> None:
        super().__init__()
        self._boot_id = _boot_id(sys.platform)

    def boottime(self) -> float:
        return self.now()

    def boot_id(self) -> str:
        return self._boot_id
