"""The row form of a record, shared by the SQL stores (SQLite, PostgreSQL)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .._record import Outcome, Record, Status

__all__ = ["COLUMNS", "outcome_params", "record_from_row", "record_params"]

#: Column order of every SELECT and INSERT of a whole record.
COLUMNS: tuple[str, ...] = (
    "key_hash",
    "key",
    "scope",
    "operation",
    "fingerprint",
    "status",
    "token",
    "lease_until",
    "expires_at",
    "created_at",
    "updated_at",
    "completed_at",
    "attempts",
    "request_id",
    "final",
    "response_status",
    "response_headers",
    "response_media_type",
    "response_body",
    "request_payload",
    "metadata",
)


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
    )


def record_from_row(row: Sequence[Any]) -> Record:
    """A :class:`Record` from a row in :data:`COLUMNS` order."""
    body = row[18]
    outcome = None
    if body is not None:
        outcome = Outcome(
            body=bytes(body),
            status=row[15],
            headers=Outcome.parse_headers(row[16]),
            media_type=row[17] or "application/octet-stream",
        )
    payload = row[19]
    return Record(
        key_hash=row[0],
        key=row[1],
        scope=row[2],
        operation=row[3],
        fingerprint=row[4],
        status=Status(row[5]),
        token=row[6],
        lease_until=float(row[7]),
        expires_at=float(row[8]),
        created_at=float(row[9]),
        updated_at=float(row[10]),
        completed_at=None if row[11] is None else float(row[11]),
        attempts=int(row[12]),
        request_id=row[13],
        final=bool(row[14]),
        outcome=outcome,
        request_payload=None if payload is None else bytes(payload),
        metadata=json.loads(row[20]) if row[20] else {},
    )
