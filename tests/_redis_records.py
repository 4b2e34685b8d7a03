"""Redis records for the Redis store's tests: a plain one, and the bytes of versions
1 and 2."""

from __future__ import annotations

from typing import Any

from retrysafe._model.record import Record, Status
from retrysafe.stores.redis import HEADER
from retrysafe.stores.redis.codec import (
    _claim_blob,
    _json_prefix,
    _outcome_blob,
    _stored_fingerprint,
    _stored_token,
    _v2_header,
)


def make_record(**changes: Any) -> Record:
    """A processing record of key hash ``h`` * 64 (times 1-3), with ``changes``."""
    fields: dict[str, Any] = dict(
        key_hash="h" * 64,
        key="k",
        scope="s",
        operation="op",
        fingerprint="f" * 64,
        status=Status.PROCESSING,
        token="tok",
        lease_until=2.0,
        expires_at=3.0,
        created_at=1.0,
        updated_at=1.0,
    )
    fields.update(changes)
    return Record(**fields)


def v1_value(r: Record) -> bytes:
    """``r`` as layout version 1 stored it: the fingerprint as text, a JSON outcome."""
    token, fp, blob = r.token.encode(), r.fingerprint.encode(), _claim_blob(r, compact=False)
    fixed = HEADER.pack(
        b"1",
        r.attempts,
        r.created_at,
        r.expires_at,
        r.lease_until,
        r.final,
        r.status.value[0].encode(),
        r.completed_at is not None,
        r.updated_at,
        r.completed_at or 0.0,
        len(fp),
        len(blob),
        len(token),
    )
    o = r.outcome
    tail = b"" if o is None else _json_prefix(o.status, o.media_type, o.headers) + o.body
    return fixed + token + fp + blob + tail


def v2_value(r: Record) -> bytes:
    """``r`` as layout version 2 stored it: a 60-byte header, a UUID key as its text."""
    token, fp = _stored_token(r.token), _stored_fingerprint(r.fingerprint)
    blob = _claim_blob(r, compact=False)
    fixed = bytearray(_v2_header(r, len(token), len(fp), blob))
    fixed[1:5] = r.attempts.to_bytes(4, "big")
    tail = b"" if r.outcome is None else _outcome_blob(r.outcome)
    return bytes(fixed) + token + fp + blob + tail
