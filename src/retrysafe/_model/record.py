"""The stored record, its states, and the outcome it replays."""

from __future__ import annotations

import datetime as dt
import enum
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from retrysafe._model.json_text import compact_encoder, json_value

__all__ = [
    "FINANCIAL",
    "MAX_REQUEST_ID",
    "RETENTIONS",
    "STANDARD",
    "ClaimResult",
    "Outcome",
    "Record",
    "Status",
    "iso_time",
    "record_json",
    "stored_request_id",
]

#: Retention classes: ``standard`` records are deleted once expired; ``financial``
#: ones are copied to the archive first (and kept 7 days by the default map).
STANDARD = "standard"
FINANCIAL = "financial"
RETENTIONS = (STANDARD, FINANCIAL)


#: The longest request id stored as it came; a longer one is stored as its hash.
MAX_REQUEST_ID = 128
_PLAIN_REQUEST_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID}}}")


def stored_request_id(value: str | None) -> str | None:
    """The form of a client's request id that a record keeps.

    1 to 128 visible ASCII characters are kept as they are; anything else
    (longer, spaces, control or non-ASCII characters) is kept as
    ``sha256:`` and the hex SHA-256 of its UTF-8 bytes (71 characters), so a
    record never holds more than 128 characters of it and logs can still match
    it. An empty id is None.
    """
    if not value or _PLAIN_REQUEST_ID.fullmatch(value):
        return value or None
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
    return f"sha256:{digest}"


class Status(enum.StrEnum):
    """The three states of a record (an absent or expired record has none)."""

    PROCESSING = "processing"
    COMPLETED = "completed"
    FAILED = "failed"


JSON_MEDIA_TYPE = "application/json"


_blank = object.__new__

_JSON = compact_encoder()


@dataclass(slots=True)
class Outcome:
    """What an attempt produced, stored and replayed byte for byte.

    ``status`` and ``headers`` are used by the HTTP front doors; functions store
    a JSON value (see :meth:`json`).
    """

    body: bytes = b""
    status: int | None = None
    headers: tuple[tuple[str, str], ...] = ()
    media_type: str = "application/octet-stream"

    @classmethod
    def json(
        cls, value: Any, *, status: int | None = None, headers: tuple[tuple[str, str], ...] = ()
    ) -> Outcome:
        """An outcome holding ``value`` as compact JSON (raises ``TypeError`` if not JSON)."""
        body = _JSON(value).encode()
        if cls is not Outcome:  # a subclass may construct itself its own way
            return cls(body, status, headers, JSON_MEDIA_TYPE)
        o = _blank(Outcome)  # each field given: a third of the dataclass construction's cost
        o.body, o.status, o.headers, o.media_type = body, status, headers, JSON_MEDIA_TYPE
        return o

    @property
    def value(self) -> Any:
        """The JSON value of a :meth:`json` outcome; the raw body otherwise."""
        if self.media_type == JSON_MEDIA_TYPE:
            return json_value(self.body) if self.body else None
        return self.body

    def headers_json(self) -> str:
        """The headers as a JSON array of pairs (the stores' column form)."""
        return _JSON(self.headers) if self.headers else "[]"

    @staticmethod
    def parse_headers(text: str | bytes | None) -> tuple[tuple[str, str], ...]:
        """Inverse of :meth:`headers_json`."""
        if not text or text == "[]":
            return ()
        return tuple((str(k), str(v)) for k, v in json.loads(text))


@dataclass(slots=True, kw_only=True)
class Record:
    """One idempotency record, as every store keeps it.

    Times are seconds since the epoch, taken from the engine's clock.
    """

    key_hash: str
    key: str
    scope: str
    operation: str
    fingerprint: str
    status: Status
    token: str
    lease_until: float
    expires_at: float
    created_at: float
    updated_at: float
    completed_at: float | None = None
    attempts: int = 1
    request_id: str | None = None
    final: bool = False
    outcome: Outcome | None = None
    request_payload: bytes | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    retention: str = STANDARD

    def copy(self) -> Record:
        """A shallow copy.

        A blank record given each field: the fastest form measured (docs/engine.md),
        a third of a keyword construction. A new field must be added here too.
        """
        c = _blank(Record)
        c.key_hash = self.key_hash
        c.key = self.key
        c.scope = self.scope
        c.operation = self.operation
        c.fingerprint = self.fingerprint
        c.status = self.status
        c.token = self.token
        c.lease_until = self.lease_until
        c.expires_at = self.expires_at
        c.created_at = self.created_at
        c.updated_at = self.updated_at
        c.completed_at = self.completed_at
        c.attempts = self.attempts
        c.request_id = self.request_id
        c.final = self.final
        c.outcome = self.outcome
        c.request_payload = self.request_payload
        c.metadata = self.metadata
        c.retention = self.retention
        return c

    def metadata_json(self) -> str:
        """Metadata as compact JSON (the stores' column form)."""
        return _JSON(self.metadata) if self.metadata else "{}"


@dataclass(slots=True)
class ClaimResult:
    """What a store's claim-or-read returned.

    ``claimed``: the caller now owns the key; ``attempts`` is its attempt number
    and ``took_over`` the status it replaced (``processing`` after a lease ran
    out, ``failed`` on a retry), if any. Not claimed: ``record`` is the live
    record that stood in the way.
    """

    claimed: bool
    record: Record | None = None
    attempts: int = 1
    took_over: Status | None = None


#: The most of a stored answer's body :func:`record_json` shows.
MAX_SHOWN_BODY = 64 * 1024


def iso_time(t: float | None) -> str | None:
    """A Unix time as ISO 8601 in UTC, to the millisecond (None stays None)."""
    if t is None:
        return None
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="milliseconds")


def record_json(r: Record, *, answer: bool = False) -> dict[str, Any]:
    """A record as JSON, for the CLI and the key inspector; ``answer`` adds the stored
    answer's headers and (up to 64 KiB of) its body, as text if it is UTF-8."""
    o = r.outcome
    shown: dict[str, Any] | None = None
    if o is not None:
        shown = {"status": o.status, "media_type": o.media_type, "bytes": len(o.body)}
        if answer:
            try:
                text: str | None = o.body[:MAX_SHOWN_BODY].decode("utf-8")
            except UnicodeDecodeError:
                text = None
            shown["headers"] = [list(h) for h in o.headers]
            shown["body"] = text
            shown["truncated"] = len(o.body) > MAX_SHOWN_BODY
    return {
        "key": r.key,
        "scope": r.scope,
        "operation": r.operation,
        "key_hash": r.key_hash,
        "status": r.status.value,
        "final": r.final,
        "attempts": r.attempts,
        "retention": r.retention,
        "fingerprint": r.fingerprint,
        "request_id": r.request_id,
        "created_at": iso_time(r.created_at),
        "updated_at": iso_time(r.updated_at),
        "completed_at": iso_time(r.completed_at),
        "lease_until": iso_time(r.lease_until),
        "expires_at": iso_time(r.expires_at),
        "answer": shown,
        "metadata": r.metadata,
    }
