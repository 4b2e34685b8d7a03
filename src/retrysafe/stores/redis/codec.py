"""The Redis record codec: a record as one string, and back (layout in docs/stores.md)."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from typing import Any

from retrysafe._model.record import FINANCIAL, STANDARD, Outcome, Record, Status
from retrysafe.errors import StoreUnavailableError

__all__ = ["HEADER", "LAYOUT_VERSION", "record_from_value"]

#: What decoding a value that is not a well-formed record raises (another program's
#: key, a truncated or corrupt value): struct.error, IndexError, KeyError, ValueError
#: (UnicodeDecodeError, json.JSONDecodeError, a wrong field count), TypeError.
_MALFORMED: tuple[type[BaseException], ...] = (
    struct.error,
    IndexError,
    KeyError,
    ValueError,
    TypeError,
)

# -- layout --------------------------------------------------------------------------

#: First byte of every record; a new layout gets a new version.
LAYOUT_VERSION = b"1"
#: The fixed part of a record (docs/stores.md, "Redis layout").
HEADER = struct.Struct(">cIddd?c?ddIII")

_FIXED = HEADER.size  # 60
_DONE = struct.Struct(">c?dd")  # complete: status, has completed_at, updated_at, completed_at
_FAILED = struct.Struct(">?c")  # fail: final, status
_DOUBLE = struct.Struct(">d")
_U32 = struct.Struct(">I")

_STATUS_BYTE: dict[Status, bytes] = {
    Status.PROCESSING: b"p",
    Status.COMPLETED: b"c",
    Status.FAILED: b"f",
}
_STATUS: dict[bytes, Status] = {v: k for k, v in _STATUS_BYTE.items()}
_TOOK: tuple[Status | None, ...] = (None, Status.PROCESSING, Status.FAILED, None)

# -- encoding ------------------------------------------------------------------------

_MAX_PEXPIRE_MS = 10**15  # ~31,000 years; keeps PX far from its overflow error
#: The flags character of a claim blob: chr(0x30 | flags), so bits 1, 2 and 4 keep
#: the digits "0"-"7" of records written before bit 8 (financial) existed.
_FLAG_CHARS = "0123456789:;<=>?"
_encode_json = json.JSONEncoder(separators=(",", ":")).encode
_encode_meta = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode  # metadata_json
_CACHE_MAX = 256
#: Outcome prefixes (JSON + NUL) of header-less outcomes by (status, media type), and
#: back: the common ones (``Outcome.json``, a bare 200) are a dict lookup each way.
_PREFIX_OF: dict[tuple[int | None, str], bytes] = {}
_PREFIX: dict[bytes, tuple[int | None, str]] = {}


def _ttl_ms(expires_at: float, now: float) -> int:
    """Physical TTL in ms for PX (at least 1); 0 means "no TTL" (infinite)."""
    delta = (expires_at - now) * 1000.0
    if 1.0 <= delta <= _MAX_PEXPIRE_MS:
        return math.ceil(delta)
    if not math.isfinite(delta):
        return 0 if delta > 0 else 1
    return min(max(1, math.ceil(delta)), _MAX_PEXPIRE_MS)


def _token(token: str) -> bytes:
    """Token length (uint32) and token, as a record holds them from offset 56."""
    raw = token.encode()
    return _U32.pack(len(raw)) + raw


def _record_value(r: Record) -> bytes:
    """The stored form of a record being claimed (attempts 1; a takeover patches it)."""
    token = r.token.encode()
    fp = r.fingerprint.encode()
    blob = _claim_blob(r)
    completed = r.completed_at
    fixed = HEADER.pack(
        LAYOUT_VERSION,
        1,
        r.created_at,
        r.expires_at,
        r.lease_until,
        r.final,
        _STATUS_BYTE[r.status],
        completed is not None,
        r.updated_at,
        0.0 if completed is None else completed,
        len(fp),
        len(blob),
        len(token),
    )
    if r.outcome is None:
        return b"".join((fixed, token, fp, blob))
    return b"".join((fixed, token, fp, blob, _outcome_blob(r.outcome)))


def _claim_blob(r: Record) -> bytes:
    rid = r.request_id
    payload = r.request_payload
    flags = (rid is not None) | (payload is not None) << 1 | (r.retention == FINANCIAL) << 3
    text = f"{r.key}\x00{r.scope}\x00{r.operation}\x00{'' if rid is None else rid}\x00"
    if text.count("\x00") != 4:  # a NUL inside a field: JSON strings instead
        flags |= 4
        text = "".join(f"{json.dumps(s)}\x00" for s in (r.key, r.scope, r.operation, rid or ""))
    meta = _encode_meta(r.metadata) if r.metadata else ""
    blob = f"{_FLAG_CHARS[flags]}\x00{text}{meta}".encode()
    if payload is None:
        return blob
    return b"".join((blob, b"\x00", payload))


def _outcome_blob(outcome: Outcome) -> bytes:
    headers = outcome.headers
    if headers:
        prefix = _outcome_prefix(outcome.status, outcome.media_type, headers)
    else:
        key = (outcome.status, outcome.media_type)
        prefix = _PREFIX_OF.get(key)
        if prefix is None:
            prefix = _outcome_prefix(outcome.status, outcome.media_type, ())
            if len(_PREFIX_OF) < _CACHE_MAX:
                _PREFIX_OF[key] = prefix
    return b"".join((prefix, outcome.body))


def _outcome_prefix(status: int | None, media_type: str, headers: Sequence[Any]) -> bytes:
    pairs = [[k, v] for k, v in headers]
    return _encode_json([status, media_type, pairs]).encode() + b"\x00"


# -- parsing -------------------------------------------------------------------------


def record_from_value(value: bytes | None, key_hash: str) -> Record | None:
    """A :class:`Record` from a stored value (``None`` if there is none)."""
    if value is None:
        return None
    (
        version,
        attempts,
        created,
        expires,
        lease,
        final,
        status,
        has_completed,
        updated,
        completed,
        fp_len,
        blob_len,
        token_len,
    ) = HEADER.unpack_from(value)
    if version != LAYOUT_VERSION:
        raise StoreUnavailableError(
            f"Redis record {key_hash} has layout version {version!r}; this retrysafe "
            f"reads version {LAYOUT_VERSION!r} (a newer retrysafe wrote it?)"
        )
    fp_at = _FIXED + token_len
    blob_at = fp_at + fp_len
    end = blob_at + blob_len
    if len(value) < end or blob_len == 0:
        raise ValueError(f"truncated: {len(value)} bytes, the header announces at least {end}")
    flags = value[blob_at]
    if flags | 9 == 57:  # "0" "1" "8" "9": no payload, no JSON fields: decode at once
        text = value[_FIXED:end].decode()
        if text.isascii():  # byte offsets are character offsets
            blob_at -= _FIXED
            token, fp = text[:token_len], text[token_len:blob_at]
            _, key, scope, operation, rid, meta = text[blob_at:].split("\x00")
            return Record(
                key_hash=key_hash,
                key=key,
                scope=scope,
                operation=operation,
                fingerprint=fp,
                status=_STATUS[status],
                token=token,
                lease_until=lease,
                expires_at=expires,
                created_at=created,
                updated_at=updated,
                completed_at=completed if has_completed else None,
                attempts=attempts,
                request_id=rid if flags & 1 else None,
                final=final,
                outcome=_outcome(value, end) if len(value) > end else None,
                request_payload=None,
                metadata=json.loads(meta) if meta else {},
                retention=FINANCIAL if flags & 8 else STANDARD,
            )
    parts = value[blob_at:end].split(b"\x00", 6)
    if flags & 4:
        key, scope, operation, rid = (json.loads(p) for p in parts[1:5])
    else:
        key, scope, operation, rid = (
            parts[1].decode(),
            parts[2].decode(),
            parts[3].decode(),
            parts[4].decode(),
        )
    meta = parts[5]
    return Record(
        key_hash=key_hash,
        key=key,
        scope=scope,
        operation=operation,
        fingerprint=value[fp_at:blob_at].decode(),
        status=_STATUS[status],
        token=value[_FIXED:fp_at].decode(),
        lease_until=lease,
        expires_at=expires,
        created_at=created,
        updated_at=updated,
        completed_at=completed if has_completed else None,
        attempts=attempts,
        request_id=rid if flags & 1 else None,
        final=final,
        outcome=_outcome(value, end) if len(value) > end else None,
        request_payload=parts[6] if flags & 2 else None,
        metadata=json.loads(meta) if meta else {},
        retention=FINANCIAL if flags & 8 else STANDARD,
    )


def _outcome(value: bytes, start: int) -> Outcome:
    cut = value.index(b"\x00", start)
    prefix = value[start:cut]
    known = _PREFIX.get(prefix)
    if known is not None:
        return Outcome(value[cut + 1 :], known[0], (), known[1])
    status, media_type, pairs = json.loads(prefix)
    if not pairs and len(_PREFIX) < _CACHE_MAX:
        _PREFIX[prefix] = (status, media_type)
    return Outcome(value[cut + 1 :], status, tuple((k, v) for k, v in pairs), media_type)
