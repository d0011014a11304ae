"""The schema-step type every database backend and store migrates with, and its version check.

A :class:`Migration` takes a database from ``version - 1`` to ``version``; a component lists its
migrations in order and the newest version is ``migrations[-1].version``.
:func:`checked_version` refuses a database written by a newer fenced with
:class:`~fenced.core._errors.ConfigurationError` (the database is not touched), so an older fenced
never reads a format it does not know.
"""

from __future__ import annotations

from dataclasses import dataclass

from fenced.core._errors import ConfigurationError

__all__ = ["Migration", "checked_version"]


@dataclass(frozen=True, slots=True)
class Migration:
    """One schema step: the statements that take a database from ``version - 1`` to ``version``.

    Statements may hold placeholders their driver fills in (PostgreSQL: ``{s}``, the quoted
    schema)."""

    version: int
    summary: str
    statements: tuple[str, ...]


def checked_version(version: int, newest: int, where: str) -> int:
    """``version``; :class:`ConfigurationError` if it is newer than ``newest``."""
    if version > newest:
        raise ConfigurationError(
            f"{where} has schema version {version}, created by a newer fenced (this one knows "
            f"up to {newest}); upgrade fenced"
        )
    return version
