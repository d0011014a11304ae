"""The ``http://`` / ``https://`` store kind: a store served by ``fenced serve`` (docs/server.md).

``fenced.open_store("http://host:port/stores/NAME")`` returns a :class:`~fenced.Store` whose
operations are carried out by the server's own store named ``NAME`` (``fenced serve --store
NAME=URL``): the server checks every token atomically with the change, exactly as in-process, and
its answers come back as the same exceptions. :mod:`._store` is the client, :mod:`._wire` the
API without I/O (shared with the server's routes).
"""
