"""The objects of a file store: immutable published (or staged) bytes in a resource's
``objects/``, named ``<epoch:020d>-<uuid hex>``.

:func:`write_object` returns only when the complete object and its name are durable, so that a
commit may then name it; until then no pointer can. A failed write leaves nothing behind (or
debris that gc removes after its grace period, if the process dies).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable

from fenced.fence._background import Background
from fenced.fence.file._files import fsync_dir, new_file, translated, write_all


def write_object(rdir: str, object_id: str, chunks: Iterable[bytes], now: float, what: str) -> None:
    """Write ``chunks`` as object ``object_id`` of the resource directory ``rdir``, durably.

    The bytes go to ``staging/<id>.part``, which is renamed into ``objects/`` once complete; then
    the object is ``fdatasync``-ed while ``objects/`` is ``fsync``-ed, and both end before this
    returns. Its mtime is ``now``: gc measures an unpublished object's idle time from it. An
    OSError is translated for doing ``what``; an error reading ``chunks`` propagates unchanged.
    """
    part = f"{rdir}/staging/{object_id}.part"
    final = f"{rdir}/objects/{object_id}"
    try:
        with translated(what):
            fd = new_file(part)
        try:
            for chunk in chunks:  # an error reading the data propagates unchanged
                with translated(what):
                    write_all(fd, chunk)
            with translated(what):
                os.utime(fd, (now, now))  # gc measures an unpublished object's idle time
                os.replace(part, final)  # complete: a crash from here leaves debris for gc
                # The two syncs are independent (both only need the rename before them,
                # and both must end before the commit): the name's sync runs on the helper
                # thread meanwhile, so the device can take both cache flushes at once.
                named = Background(functools.partial(fsync_dir, f"{rdir}/objects"))
                try:
                    os.fdatasync(fd)  # the bytes and the size
                finally:
                    named.wait()  # the name is durable (or this raises)
        finally:
            os.close(fd)
    except BaseException:
        for path in (part, final):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        raise
