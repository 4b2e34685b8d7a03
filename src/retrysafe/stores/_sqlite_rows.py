"""The compact row form of a record in SQLite (schema v4): each value in its
shortest faithful form. docs/stores.md ("SQLite row") gives the layout.

Values are bound in the types that Python's sqlite3 binds without its adapter
lookup (``int``, ``float``, ``str``, ``bytearray``): any other (``bytes``,
``bool``, ``None``) costs a lookup of about 2,000 instructions per value. So
packed values are ``bytearray``, short blobs are copied into one, flags are ints,
and the store's statements leave NULLs out of their parameters."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from retrysafe._model.record import FINANCIAL, STANDARD, Outcome, Record, Status
from retrysafe.stores._packing import COMPLETED, FAILED, PROCESSING, STATUSES, pack_hex, pack_key
from retrysafe.stores._packing import pack_headers as _pack_headers
from retrysafe.stores._packing import pack_scope as _pack_scope
from retrysafe.stores._packing import unheaders as _unheaders
from retrysafe.stores._packing import unkey as _unkey
from retrysafe.stores._packing import unscope as _unscope
from retrysafe.stores._sql import COLUMNS

__all__ = [
    "COMPLETED",
    "FAILED",
    "FINANCIAL_CODE",
    "PROCESSING",
    "V3_TYPES",
    "blob",
    "pack_hex",
    "pack_key",
    "pack_token",
    "row_params",
    "row_record",
    "status_code",
    "status_value",
    "v3_record",
]

_STATUSES = STATUSES
_CODES = {s: i for i, s in enumerate(_STATUSES)}
#: Retention codes; another class would be stored as its text.
_RETENTIONS = (STANDARD, FINANCIAL)
FINANCIAL_CODE = 1
#: Media type codes; NULL is ``application/octet-stream``, any other type its text.
_JSON_MEDIA = "application/json"

#: The declared type of each v3 column, in :data:`COLUMNS` order. ``BLOB`` has no
#: affinity: the column keeps a value's packed bytes or its text as given.
V3_TYPES: dict[str, str] = {
    "key_hash": "BLOB NOT NULL",
    "key": "BLOB NOT NULL",
    "scope": "BLOB NOT NULL",
    "operation": "TEXT NOT NULL",
    "fingerprint": "BLOB NOT NULL",
    "status": "INTEGER NOT NULL",
    "token": "BLOB NOT NULL",
    "lease_until": "REAL NOT NULL",
    "expires_at": "REAL NOT NULL",
    "created_at": "REAL NOT NULL",
    "updated_at": "REAL NOT NULL",
    "completed_at": "BLOB",
    "attempts": "INTEGER NOT NULL",
    "request_id": "TEXT",
    "final": "INTEGER NOT NULL",
    "response_status": "INTEGER",
    "response_headers": "TEXT",
    "response_media_type": "BLOB",
    "response_body": "BLOB",
    "request_payload": "BLOB",
    "metadata": "TEXT",
    "retention": "BLOB NOT NULL",
}
assert tuple(V3_TYPES) == COLUMNS

_blank = object.__new__


def status_code(status: Status | str) -> int:
    """The stored code of a status."""
    return _CODES[Status(status)]


def status_value(code: int) -> str:
    """The status value of a stored code."""
    return _STATUSES[code].value


#: Blobs up to this size are bound as a ``bytearray`` copy (cheaper than the lookup).
_COPIED = 2048


def blob(value: bytes | None) -> bytes | bytearray | None:
    """``value`` in the form sqlite3 binds cheapest."""
    if value is not None and len(value) <= _COPIED:
        return bytearray(value)
    return value


def pack_token(token: str) -> str | bytearray:
    """A lowercase hex fencing token as its bytes: odd-length after a ``0`` digit (the
    engine's are 20 digits and a counter); even-length when its first digit is not
    ``0``, which keeps the two apart; any other token as it is."""
    odd = len(token) & 1
    if not odd and (not token or token[0] == "0"):
        return token
    packed = pack_hex("0" + token if odd else token)
    return packed if type(packed) is bytearray else token


def outcome_params(outcome: Outcome | None) -> tuple[Any, Any, Any, Any]:
    """(response_status, response_headers, response_media_type, response_body)."""
    if outcome is None:
        return (None, None, None, None)
    media: Any = outcome.media_type
    if media == _JSON_MEDIA:
        media = 1
    elif media == "application/octet-stream":
        media = None
    body = outcome.body
    headers = _pack_headers(outcome.headers, outcome.media_type, body)
    return (outcome.status, headers, media, blob(body))


def _completed_at(r: Record) -> Any:
    """NULL when it is ``updated_at`` of a completed record (a completion sets both);
    ``''`` for a completed record without one."""
    at = r.completed_at
    if r.status is Status.COMPLETED:
        if at == r.updated_at:
            return None
        if at is None:
            return ""
    return at


def row_params(r: Record) -> tuple[Any, ...]:
    """A record's v4 row, in :data:`COLUMNS` order."""
    retention = r.retention
    return (
        pack_hex(r.key_hash),
        pack_key(r.key),
        _pack_scope(r.scope),
        r.operation,
        pack_hex(r.fingerprint),
        _CODES[r.status],
        pack_token(r.token),
        r.lease_until,
        r.expires_at,
        r.created_at,
        r.updated_at,
        _completed_at(r),
        r.attempts,
        r.request_id,
        1 if r.final else 0,
        *outcome_params(r.outcome),
        blob(r.request_payload),
        r.metadata_json() if r.metadata else None,
        0 if retention == STANDARD else 1 if retention == FINANCIAL else retention,
    )


def row_record(row: Sequence[Any]) -> Record:
    """A :class:`Record` from a v4 row in :data:`COLUMNS` order, filled field by field
    on a blank instance (as ``Record.copy`` is)."""
    r: Record = _blank(Record)
    v = row[0]
    r.key_hash = v.hex() if type(v) is bytes else v
    r.key = _unkey(row[1])
    v = row[2]
    r.scope = _unscope(v) if v else ""
    r.operation = row[3]
    v = row[4]
    r.fingerprint = v.hex() if type(v) is bytes else v
    status = r.status = _STATUSES[row[5]]
    v = row[6]
    if type(v) is bytes:  # the reverse of pack_token
        v = v.hex()
        if v[0] == "0":
            v = v[1:]
    r.token = v
    r.lease_until = row[7]
    r.expires_at = row[8]
    r.created_at = row[9]
    r.updated_at = row[10]
    v = row[11]
    if v is None:
        r.completed_at = r.updated_at if status is Status.COMPLETED else None
    else:
        r.completed_at = None if v == "" else float(v)
    r.attempts = row[12]
    r.request_id = row[13]
    r.final = bool(row[14])
    body = row[18]
    if body is None:
        r.outcome = None
    else:
        o: Outcome = _blank(Outcome)
        o.body = body
        o.status = row[15]
        v = row[17]
        media = o.media_type = (
            "application/octet-stream" if v is None else _JSON_MEDIA if v == 1 else str(v)
        )
        o.headers = _unheaders(row[16], media, body)
        r.outcome = o
    r.request_payload = row[19]
    v = row[20]
    r.metadata = json.loads(v) if v else {}
    v = row[21]
    r.retention = _RETENTIONS[v] if type(v) is int else v
    return r


def v3_record(row: Sequence[Any]) -> Record:
    """A :class:`Record` from a v3 row (for the migration to v4): every packed scope as
    ``kind:`` and the bytes, every even-length hex token packed, and headers without
    marks."""
    r = row_record(row)
    v = row[2]
    if type(v) is bytes:
        kind, _, packed = v.partition(b":")
        r.scope = f"{kind.decode()}:{packed.hex()}"
    v = row[6]
    r.token = v.hex() if type(v) is bytes else v
    text = row[16]
    if r.outcome is not None and text and text[0] != "[":
        parts = text.split("\0")
        r.outcome.headers = tuple(zip(parts[::2], parts[1::2], strict=True))
    return r
