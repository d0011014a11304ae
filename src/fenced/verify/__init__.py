"""``fenced verify``: evidence, with real processes and real faults, that stale owners are harmless.

Nothing in the library imports this package; the command line does (``fenced verify``, see
docs/verify.md). Its parts:

* :mod:`.cases` — the practice table: seven scripted cases (crash, pause, lost renewal reply,
  delayed release, storage timeout, restore, old write before the new owner's first write);
* :mod:`.schedule` and :mod:`.nemesis` — randomized mode: seeded fault schedules of several
  workers while a nemesis pauses, kills and restores, timed around TTL boundaries;
* :mod:`.worker`, :mod:`.faults`, :mod:`.processes` — the worker processes, the in-process wire
  faults and the recording of every call, the signals;
* :mod:`.recorder` — one history file per run, CLOCK_MONOTONIC timestamps;
* :mod:`.history`, :mod:`.checker`, :mod:`.report` — a recorded history read into calls and
  leases, the invariants verified on it, and the verdict;
* :mod:`.mutants` — seeded defects the checker must catch (detection power);
* :mod:`.table` — rich, plain-text and JSON rendering; :mod:`.target` — what runs where;
  :mod:`.restoring` — backup and restore as verification uses them.
"""
