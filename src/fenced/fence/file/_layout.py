"""Where a file store keeps things: the names of its files and how a resource names its directory.

No resource name, key or publication name is ever a path component: a resource's directory is
the SHA-256 of its name, its objects are named by :data:`OBJECT_ID`, and everything else lives
inside the state files (see :mod:`fenced.fence.file._store` for the whole layout).
"""

from __future__ import annotations

import functools
import hashlib
import re

META = "fenced-store.json"
"""The store's metadata file, in the store's directory: format, format version and mode."""
STATE = "state.json"
LOG = "state.log"
JOURNAL = "records.jsonl"
OPS = "ops.jsonl"
TRASH = "trash"
OBJECT_ID = re.compile(r"[0-9]{20}-[0-9a-f]{32}")
"""An object's name: ``<epoch:020d>-<uuid hex>``."""
RESOURCE_DIR = re.compile(r"[0-9a-f]{64}")
"""A resource directory's name: :func:`resource_digest` of the resource."""


@functools.lru_cache(maxsize=4096)
def resource_digest(resource: str) -> str:
    return hashlib.sha256(resource.encode()).hexdigest()
