"""The text row form of a record, shared by the SQL stores (SQLite and PostgreSQL up to
schema v2; their migrations read it), and the column list and listing clause of both."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from retrysafe._model.record import Outcome, Record, Status
from retrysafe.stores._base import ArchivedRecord, RecordQuery

__all__ = [
    "ARCHIVE_COLUMNS",
    "COLUMNS",
    "COLUMN_SPECS",
    "archived_from_row",
    "list_clause",
    "outcome_params",
    "record_from_row",
    "record_params",
]

#: Every record column, in the order of every SELECT and INSERT of a whole record:
#: (name, kind, nullable). A kind is ``text``, ``real`` (a time), ``integer``,
#: ``bool`` or ``bytes``; each SQL store declares it in its own types.
COLUMN_SPECS: tuple[tuple[str, str, bool], ...] = (
    ("key_hash", "text", False),
    ("key", "text", False),
    ("scope", "text", False),
    ("operation", "text", False),
    ("fingerprint", "text", False),
    ("status", "text", False),
    ("token", "text", False),
    ("lease_until", "real", False),
    ("expires_at", "real", False),
    ("created_at", "real", False),
    ("updated_at", "real", False),
    ("completed_at", "real", True),
    ("attempts", "integer", False),
    ("request_id", "text", True),
    ("final", "bool", False),
    ("response_status", "integer", True),
    ("response_headers", "text", True),
    ("response_media_type", "text", True),
    ("response_body", "bytes", True),
    ("request_payload", "bytes", True),
    ("metadata", "text", False),
    ("retention", "text", False),  # schema v2
)
#: Column order of every SELECT and INSERT of a whole record.
COLUMNS: tuple[str, ...] = tuple(name for name, _, _ in COLUMN_SPECS)
#: Column order of the archive: a whole record, then when it was archived.
ARCHIVE_COLUMNS: tuple[str, ...] = (*COLUMNS, "archived_at")


def outcome_params(outcome: Outcome | None) -> tuple[Any, Any, Any, Any]:
    """(response_status, response_headers, response_media_type, response_body)."""
    if outcome is None:
        return (None, None, None, None)
    return (outcome.status, outcome.headers_json(), outcome.media_type, outcome.body)


def record_params(r: Record) -> tuple[Any, ...]:
    """Parameters in :data:`COLUMNS` order."""
    return (
        r.key_hash,
        r.key,
        r.scope,
        r.operation,
        r.fingerprint,
        r.status.value,
        r.token,
        r.lease_until,
        r.expires_at,
        r.created_at,
        r.updated_at,
        r.completed_at,
        r.attempts,
        r.request_id,
        r.final,
        *outcome_params(r.outcome),
        r.request_payload,
        r.metadata_json(),
        r.retention,
    )


_STATUS = {s.value: s for s in Status}
_blank = object.__new__


def record_from_row(row: Sequence[Any]) -> Record:
    """A :class:`Record` from a row in :data:`COLUMNS` order, filled field by field on a
    blank instance (as ``Record.copy`` is: a third of a keyword construction)."""
    r: Record = _blank(Record)
    r.key_hash = row[0]
    r.key = row[1]
    r.scope = row[2]
    r.operation = row[3]
    r.fingerprint = row[4]
    r.status = _STATUS[row[5]]
    r.token = row[6]
    r.lease_until = float(row[7])
    r.expires_at = float(row[8])
    r.created_at = float(row[9])
    r.updated_at = float(row[10])
    v = row[11]
    r.completed_at = None if v is None else float(v)
    r.attempts = int(row[12])
    r.request_id = row[13]
    r.final = bool(row[14])
    body = row[18]
    if body is None:
        r.outcome = None
    else:
        o: Outcome = _blank(Outcome)
        o.body = bytes(body)
        o.status = row[15]
        o.headers = Outcome.parse_headers(row[16])
        o.media_type = row[17] or "application/octet-stream"
        r.outcome = o
    v = row[19]
    r.request_payload = None if v is None else bytes(v)
    v = row[20]
    r.metadata = json.loads(v) if v and v != "{}" else {}
    r.retention = row[21]
    return r


def archived_from_row(row: Sequence[Any]) -> ArchivedRecord:
    """An :class:`ArchivedRecord` from a row in :data:`ARCHIVE_COLUMNS` order."""
    return ArchivedRecord(record=record_from_row(row), archived_at=float(row[22]))


def _status_value(status: Status | str) -> Any:
    return Status(status).value


def _same(key: str) -> Any:
    return key


def list_clause(
    query: RecordQuery,
    *,
    mark: str,
    alias: str = "",
    status: Callable[[Status | str], Any] = _status_value,
    key: Callable[[str], Any] = _same,
) -> tuple[str, list[Any]]:
    """The end of a listing's ``SELECT … FROM records``: its ``WHERE`` (when ``query``
    filters), ``ORDER BY`` and ``LIMIT``, with ``mark`` as the placeholder, and the
    parameters; ``status`` and ``key`` give the stored form of those filters."""
    col = f"{alias}." if alias else ""
    where: list[str] = []
    params: list[Any] = []
    for condition, value in (
        ("status =", None if query.status is None else status(query.status)),
        ("operation =", query.operation),
        ("created_at <", query.created_before),
        ("key =", None if query.key is None else key(query.key)),
    ):
        if value is not None:
            where.append(f"{col}{condition} {mark}")
            params.append(value)
    text = f" WHERE {' AND '.join(where)}" if where else ""
    params.append(query.limit)
    return f"{text} ORDER BY {col}created_at, {col}key_hash LIMIT {mark}", params
