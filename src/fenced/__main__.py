"""``python -m fenced`` and the ``fenced`` console script: the command line.

The command line needs the ``cli`` extra (click and rich); the library does not. Without them,
:func:`main` prints one line saying how to install them and exits with 2 (bad usage), instead of
a traceback from an import. It checks before importing :mod:`fenced.cli._main`, so an
``ImportError`` raised by fenced itself is never mistaken for a missing extra.
"""

from __future__ import annotations

import sys
from importlib.util import find_spec

__all__ = ["main"]

CLI_REQUIRES = ("click", "rich")
"""The distributions of the ``cli`` extra, as imported (pyproject.toml lists their versions)."""


def main() -> None:
    """Run the ``fenced`` command, or exit 2 with one line if the ``cli`` extra is missing."""
    missing = [name for name in CLI_REQUIRES if find_spec(name) is None]
    if missing:
        print(
            f"fenced: the command line needs {' and '.join(missing)}: pip install 'fenced[cli]'",
            file=sys.stderr,
        )
        sys.exit(2)
    from fenced.cli._main import main as run  # noqa: PLC0415 - only once click and rich are there

    run()


if __name__ == "__main__":
    main()
