"""``file:`` stores: a directory, a state log and immutable objects.

* :mod:`.store` — the backend (:class:`~.store.FileBackend`), its commits and checkpoints, and
  the ordering that makes an acknowledged write survive ``kill -9`` and power loss;
* :mod:`.state` — a resource's state and its JSON form; :mod:`.statelog` — the commit log and
  its replay over the checkpoint; :mod:`.journal` — the journals of records and op records;
* :mod:`.transaction` — the backend's transaction over one loaded state;
* :mod:`.objects` — writing an object durably; :mod:`.gc` — garbage collection and ``trash/``;
* :mod:`.meta` — the store's metadata file and its one format; :mod:`.layout` — file names;
  :mod:`.lock` — the flock of a resource's critical section; :mod:`.files` — durable file
  primitives and the errors a failed one raises.
"""
