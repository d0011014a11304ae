"""The user-facing Coordinator and its backends."""

from fenced.coordinator._rebind import rebind
from fenced.coordinator._restore import advance, backup, restore

__all__ = ["advance", "backup", "rebind", "restore"]
