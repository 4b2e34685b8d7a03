"""Redis records for the Redis store's tests: a plain one, and version 1's bytes."""

from __future__ import annotations

from typing import Any

from retrysafe._model.record import Record, Status
from retrysafe.stores.redis import HEADER
from retrysafe.stores.redis.codec import _claim_blob, _json_prefix


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
    token, fp, blob = r.token.encode(), r.fingerprint.encode(), _claim_blob(r)
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
