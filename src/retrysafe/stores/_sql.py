"""The row form of a record, shared by the SQL stores (SQLite, PostgreSQL)."""

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


def record_from_row(row: Sequence[Any]) -> Record:
    """A :class:`Record` from a row in :data:`COLUMNS` order."""
    body = row[18]
    outcome = None
    if body is not None:
        outcome = Outcome(
            bytes(body),
            row[15],
            Outcome.parse_headers(row[16]),
            row[17] or "application/octet-stream",
        )
    payload, metadata, completed_at = row[19], row[20], row[11]
    return Record(
        key_hash=row[0],
        key=row[1],
        scope=row[2],
        operation=row[3],
        fingerprint=row[4],
        status=_STATUS[row[5]],
        token=row[6],
        lease_until=float(row[7]),
        expires_at=float(row[8]),
        created_at=float(row[9]),
        updated_at=float(row[10]),
        completed_at=None if completed_at is None else float(completed_at),
        attempts=int(row[12]),
        request_id=row[13],
        final=bool(row[14]),
        outcome=outcome,
        request_payload=None if payload is None else bytes(payload),
        metadata=json.loads(metadata) if metadata and metadata != "{}" else {},
        retention=row[21],
    )


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
