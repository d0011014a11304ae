"""Private database plumbing shared by the coordinator's backends and the stores.

:mod:`.postgres` (URLs, connections and pools, error translation, migrations; a user's own pool
or engine in :mod:`.postgres_borrowed`), :mod:`.sqlite` (busy retry, error codes),
:mod:`.local` (the paths of ``sqlite:`` and ``file:`` URLs, with the checks that need the
disk) and :mod:`.permissions` (the modes of the local files fenced creates). Below both
``fenced.coordinator`` and ``fenced.fence``, above ``fenced.core``: neither side imports the
other to share it. Not public API.
"""
