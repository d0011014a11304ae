"""A/B of two versions of fenced's embedded coordinator, on the same disk at the same moments.

Each version runs in its own long-lived worker process (``PYTHONPATH`` = that version's ``src``)
that loops ``acquire(ttl=30, wait=0)`` + ``release()`` on a temporary database in
``benchmarks/``; a third worker loops the 4 KiB ``pwrite`` + ``fdatasync`` baseline. The
controller asks each worker in turn for one block of cycles (100 cycles, 200 syncs), rotating the
order, so every version sees the same disk conditions within a fraction of a second. Whole-run
figures on this shared machine swing by 30 % from minute to minute; block-by-block ratios do not.

Prints each worker's median block rate and the median of the per-block ratios (version ÷
fdatasync, new ÷ old, with quartiles). Not a test: no assertion.

    git worktree add /tmp/fenced-old HEAD~1      # or any ref
    .venv/bin/python benchmarks/ab_coordinator.py --old /tmp/fenced-old/src --new src
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _common import fdatasync_loop

HERE = Path(__file__).resolve().parent


def _worker(kind: str) -> None:
    """Serve blocks: read a count per line, run that many cycles, print the seconds taken."""
    directory = Path(tempfile.mkdtemp(prefix=".bench-ab-", dir=HERE))
    try:
        cycle = fdatasync_loop(directory)[0] if kind == "fdatasync" else _fenced_cycle(directory)
        for _ in range(300):  # warm-up
            cycle()
        print("ready", flush=True)
        for line in sys.stdin:
            count = int(line)
            started = time.perf_counter()
            for _ in range(count):
                cycle()
            print(time.perf_counter() - started, flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _fenced_cycle(directory: Path) -> Callable[[], None]:
    import fenced  # the version under test (PYTHONPATH)

    coord = fenced.connect(f"sqlite:///{directory / 'fenced.db'}")

    def cycle() -> None:
        coord.release(coord.acquire("bench/ab", ttl=30, wait=0))

    return cycle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="src directory of version A")
    parser.add_argument("--new", type=Path, required=True, help="src directory of version B")
    parser.add_argument("--blocks", type=int, default=200, help="blocks per worker")
    args = parser.parse_args()
    sources = {"old": args.old.resolve(), "new": args.new.resolve(), "fdatasync": None}
    sizes = {"old": 100, "new": 100, "fdatasync": 200}
    workers: dict[str, subprocess.Popen[str]] = {}
    try:
        for name, src in sources.items():
            env = dict(os.environ)
            if src is not None:
                env["PYTHONPATH"] = str(src)
            kind = "fdatasync" if src is None else "fenced"
            workers[name] = subprocess.Popen(
                [sys.executable, __file__, "--worker", kind],
                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
        for worker in workers.values():
            assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
        names = list(workers)
        rates: dict[str, list[float]] = {name: [] for name in names}
        for block in range(args.blocks):
            for name in names[block % 3 :] + names[: block % 3]:
                worker = workers[name]
                assert worker.stdin is not None and worker.stdout is not None
                worker.stdin.write(f"{sizes[name]}\n")
                worker.stdin.flush()
                rates[name].append(sizes[name] / float(worker.stdout.readline()))
    finally:
        for worker in workers.values():
            if worker.stdin is not None:
                worker.stdin.close()
            worker.wait(timeout=60)
    for name in names:
        print(f"{name:<10} median block rate {statistics.median(rates[name]):8,.0f}/s")
    for name in ("old", "new"):
        ratios = [a / b for a, b in zip(rates[name], rates["fdatasync"], strict=True)]
        print(f"{name} / fdatasync: {statistics.median(ratios):.3f}")
    ratios = [a / b for a, b in zip(rates["new"], rates["old"], strict=True)]
    low, _, high = statistics.quantiles(ratios, n=4)
    print(f"new / old: {statistics.median(ratios):.3f} (quartiles {low:.3f} – {high:.3f})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2])
    else:
        main()
