"""``fenced serve`` for tests: in a thread of the test process, or as a process of its own.

:class:`ServedCoordinator` runs the real application on the real uvicorn server, on a free
loopback port, in a thread with its own event loop; :meth:`ServedCoordinator.stop` shuts it down
as SIGTERM would (polls answered, backend closed). Fault tests that kill the server use
:class:`ServeProcess` (``python -m fenced serve``), stopped by its PID.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from fenced.server._app import DEFAULT_KEEP, DEFAULT_POLL, create_app
from fenced.server._run import bind, server_for

__all__ = ["ServeProcess", "ServedCoordinator"]


class ServedCoordinator:
    """``fenced serve`` over the coordinator at ``url``, in a thread; ``.url`` is its
    ``http://127.0.0.1:PORT``. A context manager."""

    def __init__(
        self,
        url: str,
        *,
        poll: float = DEFAULT_POLL,
        keep: float = DEFAULT_KEEP,
        stores: Mapping[str, str] | None = None,
        keys: str | Path | None = None,
    ) -> None:
        self.app = create_app(url, poll=poll, keep=keep, stores=stores, keys=keys)
        self._server = server_for(self.app)
        self._socket = bind("127.0.0.1:0", keys=False)
        port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fenced-serve", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._socket]))
        except BaseException as error:  # reported by start()
            self._failed = error

    def start(self) -> ServedCoordinator:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if self._failed is not None or not self._thread.is_alive():
                raise RuntimeError(f"fenced serve did not start: {self._failed!r}")
            if time.monotonic() > deadline:
                raise RuntimeError("fenced serve did not start within 30 s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Shut down as on SIGTERM: waiting polls answer 503, the backend is closed."""
        if self._thread.is_alive():
            self._server.stop()
            self._thread.join(30)
        self._socket.close()

    def __enter__(self) -> ServedCoordinator:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()


_LISTENING = re.compile(r"listening on (https?://\S+)")


class ServeProcess:
    """``python -m fenced serve --url URL --listen 127.0.0.1:0 …`` as a child process; ``.url``
    once started. Stopped by PID: :meth:`terminate` (SIGTERM), :meth:`kill` (SIGKILL)."""

    def __init__(self, url: str, *extra: str, cwd: Path | None = None) -> None:
        self._args = [sys.executable, "-m", "fenced", "serve", "--url", url,
                      "--listen", "127.0.0.1:0", *extra]  # fmt: skip
        self._cwd = cwd
        self.process: subprocess.Popen[str] | None = None
        self.url = ""
        self.lines: list[str] = []

    def start(self, timeout: float = 30.0) -> ServeProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            self._args, cwd=self._cwd, env=env, stderr=subprocess.PIPE, text=True
        )
        assert self.process.stderr is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.process.stderr.readline()
            if not line:
                break
            self.lines.append(line)
            found = _LISTENING.search(line)
            if found:
                self.url = found.group(1)
                threading.Thread(target=self._drain, daemon=True).start()
                return self
        self.kill()
        self.process.stderr.close()
        raise RuntimeError("fenced serve did not start: " + "".join(self.lines)[-2000:])

    def _drain(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        with self.process.stderr:
            for line in self.process.stderr:
                self.lines.append(line)

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.kill()
