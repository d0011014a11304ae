"""The host's boot-time clock and boot id, read from the kernel."""

from __future__ import annotations

import time
from pathlib import Path

__all__ = ["SystemHostClock"]

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


class SystemHostClock:
    """CLOCK_BOOTTIME and the kernel's boot id: the embedded coordinator's clock.

    Wall-clock steps do not move CLOCK_BOOTTIME; a reboot changes the boot id, so every lease
    from before a reboot is expired by definition.
    """

    def __init__(self) -> None:
        try:
            self._boot_id = _BOOT_ID.read_text().strip()
        except OSError:  # not Linux: fall back to a per-boot approximation
            self._boot_id = f"boot-at-{int(time.time() - time.clock_gettime(time.CLOCK_BOOTTIME))}"

    def boottime(self) -> float:
        return time.clock_gettime(time.CLOCK_BOOTTIME)

    def boot_id(self) -> str:
        return self._boot_id
