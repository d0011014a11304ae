"""Private database plumbing shared by the coordinator's backends and the stores.

:mod:`.postgres` (URLs, connections and pools, error translation, migrations) and :mod:`.sqlite`
(busy retry, error codes). Below both ``fenced.coordinator`` and ``fenced.fence``, above
``fenced.core``: neither side imports the other to share it. Not public API.
"""
