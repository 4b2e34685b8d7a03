"""The MySQL/MariaDB schema: the records table, the archive of financial records, the
guards' cells, and the version table, all InnoDB, created under a named lock.

The records keep the text row form of :mod:`retrysafe.stores._sql` (the SQLite and
PostgreSQL v2 form). Texts compare byte for byte (``utf8mb4_bin``), a fencing token
is ``VARBINARY``, a time is a ``DOUBLE`` of Unix seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from retrysafe._model.record import Record
from retrysafe.stores._base import ArchivedRecord
from retrysafe.stores._sql import (
    ARCHIVE_COLUMNS,
    COLUMN_SPECS,
    COLUMNS,
    archived_from_row,
    record_from_row,
)

__all__ = [
    "ARCHIVE_SELECT",
    "SCHEMA_VERSION",
    "SELECT_COLUMNS",
    "Names",
    "archived_record",
    "quote",
    "row_record",
    "schema_statements",
]

#: The version this code writes and understands.
SCHEMA_VERSION = 1

_ASCII = "CHARACTER SET ascii COLLATE ascii_bin"
#: The type of each column (by name, where it is not its kind's).
_BY_NAME = {
    "key_hash": f"CHAR(64) {_ASCII}",
    "token": "VARBINARY(1024)",
    "status": f"VARCHAR(10) {_ASCII}",
    "retention": f"VARCHAR(32) {_ASCII}",
    "response_headers": "MEDIUMTEXT",
    "metadata": "MEDIUMTEXT",
}
_BY_KIND = {
    "text": "TEXT",
    "real": "DOUBLE",
    "integer": "INT",
    "bool": "BOOLEAN",
    "bytes": "LONGBLOB",
}


def quote(*parts: str) -> str:
    """A name as MySQL quotes it (parts already checked: letters, digits, ``_``)."""
    return ".".join(f"`{p}`" for p in parts)


class Names(NamedTuple):
    """The tables of one store, quoted, and the lock name its migration takes."""

    table: str
    archive: str
    cells: str
    versions: str
    base: str
    database: str | None
    lock: str

    @classmethod
    def of(cls, parts: tuple[str, ...]) -> Names:
        *database, base = parts
        db = database[0] if database else None
        return cls(
            quote(*parts),
            quote(*database, f"{base}_archive"),
            quote(*database, f"{base}_state"),
            quote(*database, f"{base}_schema"),
            base,
            db,
            f"retrysafe:{'.'.join(parts)}"[:64],
        )


def _columns() -> str:
    lines = []
    for name, kind, nullable in COLUMN_SPECS:
        kind_type = _BY_NAME.get(name, _BY_KIND[kind])
        default = " DEFAULT 'standard'" if name == "retention" else ""
        lines.append(f"{quote(name)} {kind_type}{'' if nullable else ' NOT NULL'}{default}")
    return ",\n    ".join(lines)


def schema_statements(names: Names) -> list[str]:
    """Schema v1: every statement idempotent (``IF NOT EXISTS``), so a migration cut
    short (MySQL commits each DDL statement by itself) is finished by the next."""
    columns = _columns()
    return [
        f"CREATE TABLE IF NOT EXISTS {names.table} (\n    {columns},\n"
        f"    PRIMARY KEY (key_hash),\n"
        f"    KEY {quote(names.base + '_exp')} (expires_at),\n"
        f"    CONSTRAINT {quote(names.base + '_status')} "
        "CHECK (status IN ('processing', 'completed', 'failed'))\n"
        ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin",
        f"CREATE TABLE IF NOT EXISTS {names.archive} (\n    {columns},\n"
        "    archived_at DOUBLE NOT NULL,\n"
        "    PRIMARY KEY (key_hash, token),\n"
        f"    KEY {quote(names.base + '_arch')} (archived_at)\n"
        ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin",
        f"CREATE TABLE IF NOT EXISTS {names.cells} (\n"
        "    cell_key VARCHAR(768) NOT NULL PRIMARY KEY,\n"
        "    version BIGINT NOT NULL,\n"
        "    value MEDIUMTEXT NOT NULL,\n"
        "    expires_at DOUBLE NULL,\n"
        f"    KEY {quote(names.base + '_state_exp')} (expires_at)\n"
        ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin",
    ]


#: Every column of a whole record, quoted, in :data:`COLUMNS` order.
SELECT_COLUMNS = ", ".join(quote(c) for c in COLUMNS)
ARCHIVE_SELECT = ", ".join(quote(c) for c in ARCHIVE_COLUMNS)


_TOKEN = COLUMNS.index("token")


def _text_token(row: Sequence[Any]) -> list[Any]:
    values = list(row)
    token = values[_TOKEN]
    if isinstance(token, (bytes, bytearray)):
        values[_TOKEN] = token.decode()
    return values


def row_record(row: Sequence[Any]) -> Record:
    """A :class:`Record` from a row in :data:`COLUMNS` order (its token as bytes)."""
    return record_from_row(_text_token(row))


def archived_record(row: Sequence[Any]) -> ArchivedRecord:
    """An :class:`ArchivedRecord` from an archive row in :data:`ARCHIVE_COLUMNS` order."""
    return archived_from_row(_text_token(row))
