"""The compact row form of a record in PostgreSQL (schema v3): digests, keys, scopes
and tokens as ``bytea``, the status as a code, NULL for default values. The store
converts at its edge; the Store protocol keeps its texts. docs/stores.md
("PostgreSQL row") gives the layout and the rules."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from retrysafe._model.record import STANDARD, Outcome, Record, Status
from retrysafe.stores._base import ArchivedRecord
from retrysafe.stores._packing import (
    COMPLETED,
    FAILED,
    PROCESSING,
    STATUSES,
    pack_headers,
    pack_scope,
    tagged_token,
    unheaders,
    unkey,
    unscope,
    untag_token,
)
from retrysafe.stores._sql import COLUMNS

__all__ = [
    "COMPLETED",
    "FAILED",
    "PROCESSING",
    "STATUSES",
    "V3_ORDER",
    "V3_TYPES",
    "archived_record",
    "outcome_params",
    "pack_digest",
    "pack_record_key",
    "row_params",
    "row_record",
    "status_code",
    "status_value",
    "unpack_digest",
]

_STATUSES = STATUSES
_CODES = {s.value: i for i, s in enumerate(_STATUSES)}  # by value: a str hashes in C
#: NULL stands for this media type; any other is stored as its text.
_JSON_MEDIA = "application/json"

#: The type of each v3 column, in :data:`COLUMNS` order.
V3_TYPES: dict[str, str] = {
    "key_hash": "bytea NOT NULL",
    "key": "bytea NOT NULL",
    "scope": "bytea NOT NULL",
    "operation": "text NOT NULL",
    "fingerprint": "bytea NOT NULL",
    "status": "smallint NOT NULL",
    "token": "bytea NOT NULL",
    "lease_until": "double precision NOT NULL",
    "expires_at": "double precision NOT NULL",
    "created_at": "double precision NOT NULL",
    "updated_at": "double precision NOT NULL",
    "completed_at": "double precision",
    "attempts": "integer NOT NULL",
    "request_id": "text",
    "final": "boolean NOT NULL",
    "response_status": "integer",
    "response_headers": "bytea",
    "response_media_type": "text",
    "response_body": "bytea",
    "request_payload": "bytea",
    "metadata": "text",
    "retention": "text",
}
assert tuple(V3_TYPES) == COLUMNS
#: The order of the columns in the table: fixed widths first, widest first (no
#: alignment padding between them), then the variable-length ones.
V3_ORDER: tuple[str, ...] = (
    "lease_until",
    "expires_at",
    "created_at",
    "updated_at",
    "completed_at",
    "attempts",
    "response_status",
    "status",
    "final",
    "key_hash",
    "fingerprint",
    "token",
    "key",
    "scope",
    "operation",
    "request_id",
    "response_media_type",
    "response_headers",
    "response_body",
    "request_payload",
    "metadata",
    "retention",
)
assert sorted(V3_ORDER) == sorted(COLUMNS)

_blank = object.__new__
_fromhex = bytes.fromhex
_COMPLETED = Status.COMPLETED
_NO_OUTCOME = (None, None, None, None)
_NOT_SENT = (None,) * len(COLUMNS)  # equal to no stored value: row_record decodes all
_NO_RECORD: Record = _blank(Record)
_NAN = float("nan")
_DIGEST = 32
_UUID = 16
_PAD = b"\xff"  # never in UTF-8: tells a text of a packed value's length apart


def status_code(status: Status | str) -> int:
    """The stored code of a status."""
    return _CODES[Status(status).value]


def status_value(code: int) -> str:
    """The status value of a stored code."""
    return _STATUSES[code].value


def _text(raw: bytes, size: int) -> str:
    """The text of a value stored as UTF-8 (0xFF appended when that is ``size`` bytes)."""
    if len(raw) == size + 1 and raw[-1] == 0xFF:
        raw = raw[:-1]
    return raw.decode()


def pack_digest(text: str) -> bytes:
    """64 lowercase hex digits (a SHA-256) as their 32 bytes; any other text as its
    UTF-8, with 0xFF appended when that is 32 bytes long."""
    if len(text) == 64:
        try:
            raw = _fromhex(text)
        except ValueError:
            pass
        else:
            if raw.hex() == text:  # not uppercase, no whitespace
                return raw
    raw = text.encode()
    return raw + _PAD if len(raw) == _DIGEST else raw


def unpack_digest(raw: bytes) -> str:
    """Inverse of :func:`pack_digest`."""
    return raw.hex() if len(raw) == _DIGEST else _text(raw, _DIGEST)


def pack_record_key(key: str) -> bytes:
    """A lowercase canonical UUID as its 16 bytes; any other key as its UTF-8, with
    0xFF appended when that is 16 bytes long."""
    if len(key) == 36 and key[8] == key[13] == key[18] == key[23] == "-":
        digits = key.replace("-", "")
        try:
            raw = _fromhex(digits)
        except ValueError:
            pass
        else:
            if len(raw) == _UUID and raw.hex() == digits:
                return raw
    raw = key.encode()
    return raw + _PAD if len(raw) == _UUID else raw


def _unpack_key(raw: bytes) -> str:
    return unkey(raw) if len(raw) == _UUID else _text(raw, _UUID)


def _pack_scope(scope: str) -> bytes:
    """A principal's ``kind:hex`` scope as 0x00 and SQLite's packed form; any other
    as its UTF-8, after 0x01 when it starts with byte 0 or 1."""
    if not scope:
        return b""
    packed = pack_scope(scope)
    if type(packed) is bytearray:
        return b"\x00" + packed
    raw = scope.encode()
    return b"\x01" + raw if raw[:1] in (b"\x00", b"\x01") else raw


def _unpack_scope(raw: bytes) -> str:
    if not raw:
        return ""
    first = raw[0]
    if first == 0:
        return unscope(raw[1:])
    return (raw[1:] if first == 1 else raw).decode()


def outcome_params(outcome: Outcome | None) -> tuple[Any, Any, Any, Any]:
    """(response_status, response_headers, response_media_type, response_body)."""
    if outcome is None:
        return _NO_OUTCOME
    media = outcome.media_type
    body = outcome.body
    headers = outcome.headers
    text = pack_headers(headers, media, body) if headers else None
    return (
        outcome.status,
        None if text is None else text.encode(),
        None if media == _JSON_MEDIA else media,
        body,
    )


def row_params(r: Record) -> tuple[Any, ...]:
    """A record's v3 row, in :data:`COLUMNS` order.

    ``completed_at`` is NULL when it is ``updated_at`` of a completed record (a
    completion sets both), NaN for a completed record without one."""
    status = r.status
    at = r.completed_at
    if status is _COMPLETED:
        at = None if at == r.updated_at else _NAN if at is None else at
    scope = r.scope
    outcome = r.outcome
    retention = r.retention
    return (
        pack_digest(r.key_hash),
        pack_record_key(r.key),
        _pack_scope(scope) if scope else b"",
        r.operation,
        pack_digest(r.fingerprint),
        _CODES[status._value_],
        tagged_token(r.token),
        r.lease_until,
        r.expires_at,
        r.created_at,
        r.updated_at,
        at,
        r.attempts,
        r.request_id,
        r.final,
        *(_NO_OUTCOME if outcome is None else outcome_params(outcome)),
        r.request_payload,
        r.metadata_json() if r.metadata else None,
        None if retention == STANDARD else retention,
    )


def row_record(
    row: Sequence[Any], sent: Sequence[Any] = _NOT_SENT, like: Record = _NO_RECORD
) -> Record:
    """A :class:`Record` from a v3 row in :data:`COLUMNS` order, filled field by field
    on a blank instance (as ``Record.copy`` is).

    ``sent`` and ``like``: the row a claim sent and its record. The key hash, key,
    scope and fingerprint stored as the claim sent them are ``like``'s texts (each
    packed form reads back as exactly one text), not decoded again."""
    r: Record = _blank(Record)
    v = row[0]
    if v == sent[0]:
        r.key_hash = like.key_hash
    else:
        r.key_hash = v.hex() if len(v) == _DIGEST else _text(v, _DIGEST)
    v = row[1]
    if v == sent[1]:
        r.key = like.key
    else:
        r.key = _unpack_key(v) if _UUID - 1 < len(v) < _UUID + 2 else v.decode()
    v = row[2]
    if v == sent[2]:
        r.scope = like.scope
    else:
        r.scope = _unpack_scope(v) if v else ""
    r.operation = row[3]
    v = row[4]
    if v == sent[4]:
        r.fingerprint = like.fingerprint
    else:
        r.fingerprint = v.hex() if len(v) == _DIGEST else _text(v, _DIGEST)
    status = r.status = _STATUSES[row[5]]
    r.token = untag_token(row[6])
    r.lease_until = row[7]
    r.expires_at = row[8]
    r.created_at = row[9]
    r.updated_at = row[10]
    v = row[11]
    if v is None:
        r.completed_at = r.updated_at if status is _COMPLETED else None
    else:
        r.completed_at = None if v != v else v  # NaN: completed without one
    r.attempts = row[12]
    r.request_id = row[13]
    r.final = row[14]
    body = row[18]
    if body is None:
        r.outcome = None
    else:
        o: Outcome = _blank(Outcome)
        o.body = body
        o.status = row[15]
        v = row[17]
        media = o.media_type = _JSON_MEDIA if v is None else v
        v = row[16]
        o.headers = () if v is None else unheaders(v.decode(), media, body)
        r.outcome = o
    r.request_payload = row[19]
    v = row[20]
    r.metadata = json.loads(v) if v else {}
    v = row[21]
    r.retention = STANDARD if v is None else v
    return r


def archived_record(row: Sequence[Any]) -> ArchivedRecord:
    """An archived record from a v3 row in ``ARCHIVE_COLUMNS`` order."""
    return ArchivedRecord(record=row_record(row), archived_at=row[22])
