"""Every error retrysafe raises, each with a machine ``code`` for problem answers.

They all derive from :class:`IdempotencyError`; a built-in base in brackets is
kept, so ``except ValueError`` catches those as well. ``docs/errors.md`` says
what each means and how each front door answers it::

    IdempotencyError
    ├── InvalidKeyError [ValueError]
    ├── AmbiguousCredentialsError [ValueError]
    ├── PrincipalRequiredError
    ├── InProgressError
    ├── FingerprintMismatchError
    ├── LeaseLostError
    ├── StoreUnavailableError
    │   ├── SchemaVersionError
    │   └── SchemaModeError [ValueError]
    ├── SecretError [ValueError]
    ├── BodyError
    ├── BodyTooLarge
    ├── StepResultError [TypeError]
    ├── MeshError
    ├── SignatureError
    ├── OutboxError
    ├── UpstreamError
    ├── MapError [ValueError]
    ├── MissingExtraError [ImportError]
    ├── InvalidTransitionError
    │   └── PaymentNotFoundError [LookupError]
    ├── SequenceError
    │   ├── OutOfOrderError
    │   └── SequenceGapError
    ├── VersionConflictError
    └── HistoryFullError
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = [
    "AmbiguousCredentialsError",
    "BodyError",
    "BodyTooLarge",
    "FingerprintMismatchError",
    "HistoryFullError",
    "IdempotencyError",
    "InProgressError",
    "InvalidKeyError",
    "InvalidTransitionError",
    "LeaseLostError",
    "MapError",
    "MeshError",
    "MissingExtraError",
    "OutOfOrderError",
    "OutboxError",
    "PaymentNotFoundError",
    "PrincipalRequiredError",
    "SchemaModeError",
    "SchemaVersionError",
    "SecretError",
    "SequenceError",
    "SequenceGapError",
    "SignatureError",
    "StepResultError",
    "StoreUnavailableError",
    "UpstreamError",
    "VersionConflictError",
]


class IdempotencyError(Exception):
    """Base class of every retrysafe error."""

    code: str = "idempotency_error"


# -- the key, the caller and the engine ---------------------------------------------------


class InvalidKeyError(IdempotencyError, ValueError):
    """The idempotency key is missing or malformed. Nothing was written."""

    code = "idempotency_key_invalid"


class AmbiguousCredentialsError(IdempotencyError, ValueError):
    """The request carries two different values of one credential header (two
    ``Authorization`` lines, say): who sends it is unclear. Nothing was written."""

    code = "idempotency_credentials_ambiguous"


class PrincipalRequiredError(IdempotencyError):
    """A keyed request carries no credential and anonymous requests are refused
    (``anonymous="refuse"``). Nothing was written."""

    code = "idempotency_principal_required"


class InProgressError(IdempotencyError):
    """Another attempt with this key holds a live lease."""

    code = "idempotency_in_flight"

    def __init__(
        self,
        message: str,
        *,
        key: str = "",
        retry_after: float = 1.0,
        original_request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.key = key
        self.retry_after = retry_after
        self.original_request_id = original_request_id


class FingerprintMismatchError(IdempotencyError):
    """The key was used before with a different request."""

    code = "idempotency_conflict"

    def __init__(
        self,
        message: str,
        *,
        key: str = "",
        original_fingerprint: str = "",
        fingerprint: str = "",
        original_request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.key = key
        self.original_fingerprint = original_fingerprint
        self.fingerprint = fingerprint
        self.original_request_id = original_request_id


class LeaseLostError(IdempotencyError):
    """A completion or renewal was refused: this attempt no longer owns the key.

    Its lease ran out and another attempt took the key over (fencing). The
    record was left as the new owner wrote it.
    """

    code = "idempotency_lease_lost"

    def __init__(self, message: str, *, key: str = "") -> None:
        super().__init__(message)
        self.key = key


# -- the store and the deployment secret ----------------------------------------------------


class StoreUnavailableError(IdempotencyError):
    """The store could not be reached or failed.

    Nothing is half-written. Whether a write that was sent before the failure
    landed is unknown (as after any network timeout); the fencing token keeps a
    retry safe either way. ``transient`` is False when sending again cannot help
    (a value that is not a record, a refused permission, a corrupt file): the
    engine then gives up a completion at once instead of resending it.
    """

    code = "idempotency_store_unavailable"

    def __init__(self, message: str, *, retry_after: float = 1.0, transient: bool = True) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.transient = transient


class SchemaVersionError(StoreUnavailableError):
    """The store's schema is not the one this retrysafe runs on: newer than it knows,
    or older and to be upgraded with ``retrysafe migrate`` (docs/stores.md)."""


class SchemaModeError(StoreUnavailableError, ValueError):
    """The PostgreSQL table was created partitioned and opened unpartitioned, or the
    other way round (or with another partition interval): the layout is fixed at creation."""


class SecretError(IdempotencyError, ValueError):
    """``$RETRYSAFE_SECRET`` is set but unusable, or the store cannot keep a secret."""

    code = "idempotency_secret_invalid"


# -- HTTP bodies ----------------------------------------------------------------------------


class BodyError(IdempotencyError):
    """The request body cannot be fingerprinted (malformed JSON, or too large)."""

    code = "idempotency_body_invalid"

    def __init__(self, message: str, *, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        if code is not None:
            self.code = code


class BodyTooLarge(IdempotencyError):
    """An ASGI request body passed the limit a JSON front door reads it with."""

    code = "idempotency_body_too_large"


# -- the workflow steps, the protocols, the client and the gateway --------------------------


class StepResultError(IdempotencyError, TypeError):
    """A step returned, but its result (or its reference) cannot be stored.

    The step's side effect happened, so the step and the operation are failed
    *finally*: no retry calls the step function again. ``derived_key`` is the key
    the step passed downstream: reconcile with it.
    """

    code = "idempotency_step_result"

    def __init__(self, message: str, *, step: str = "", derived_key: str = "") -> None:
        super().__init__(message)
        self.step, self.derived_key = step, derived_key


_MESH_CODE = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*")
_MESH_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


class MeshError(IdempotencyError):
    """A Mesh error: raise it from a handler to answer with ``errors: [...]``.

    ``code`` is SCREAMING_SNAKE_CASE; ``details`` a JSON object. Not retryable
    (the default): the failure is final, stored, and replayed to every retry
    with the same key. Retryable: nothing is stored and a retry runs again.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        retryable: bool = False,
        details: dict[str, Any] | None = None,
    ) -> None:
        if type(code) is not str or not _MESH_CODE.fullmatch(code):
            raise ValueError(f"code must be SCREAMING_SNAKE_CASE text, not {code!r}")
        if type(message) is not str:
            raise TypeError(f"message must be a str, not {type(message).__name__}")
        if details is not None:
            if not isinstance(details, dict):
                raise TypeError(f"details must be a dict, not {type(details).__name__}")
            _MESH_JSON(details)  # raises TypeError or ValueError now, not when it is stored
        super().__init__(message)
        self.code, self.message = code, message
        self.retryable = bool(retryable)
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        """The Mesh error object."""
        error: dict[str, Any] = {
            "code": self.code,
            "message": self.message,
            "retryable": self.retryable,
        }
        if self.details is not None:
            error["details"] = self.details
        return error


class SignatureError(IdempotencyError):
    """The delivery is not signed by a known secret, or is malformed or too old.

    Nothing was stored. ``reason`` is a short machine word: ``missing_header``,
    ``malformed_header``, ``bad_signature``, ``timestamp_out_of_tolerance``,
    ``no_event_id``, ``bad_secret`` or ``unknown_scheme``.
    """

    code = "webhook_signature_invalid"

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class OutboxError(IdempotencyError):
    """The outbox file cannot be opened, read or written."""

    code = "outbox_unavailable"


class UpstreamError(IdempotencyError):
    """The gateway could not talk to the upstream: a 502, or a 504 if ``timeout``.

    ``kind`` names the failure for the problem's detail: ConnectError,
    ConnectTimeout, PoolTimeout, ReadError, ReadTimeout, WriteTimeout,
    RemoteProtocolError (the upstream broke HTTP/1.1) or LocalProtocolError.
    """

    code = "upstream_unavailable"

    def __init__(self, kind: str, detail: object, *, timeout: bool = False) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.timeout = kind, timeout
        if timeout:
            self.code = "upstream_timeout"


# -- the guards -----------------------------------------------------------------------------


class InvalidTransitionError(IdempotencyError):
    """The payment may not move from ``current`` to ``requested``; nothing was written."""

    code = "payment_transition_invalid"

    def __init__(self, payment_id: str, current: str | None, requested: str, why: str = "") -> None:
        super().__init__(
            f"payment {payment_id!r}: no transition from {current!r} to {requested!r}{why}"
        )
        self.payment_id = payment_id
        self.current = current
        self.requested = requested


class PaymentNotFoundError(InvalidTransitionError, LookupError):
    """``advance`` on a payment that was never started (``current`` is None; pass
    ``create=True`` to start it on the way)."""

    code = "payment_not_found"

    def __init__(self, payment_id: str, requested: str) -> None:
        super().__init__(payment_id, None, requested, ": it was never started (create=True?)")


class SequenceError(IdempotencyError):
    """A sequence number was refused; nothing was written. ``last`` is the last accepted."""

    code = "sequence_refused"

    def __init__(
        self, message: str, *, session_id: str, operation: str, last: int, sequence: int
    ) -> None:
        super().__init__(message)
        self.session_id = session_id
        self.operation = operation
        self.last = last
        self.sequence = sequence


class OutOfOrderError(SequenceError):
    """The sequence number is not above the last one processed (a stale or repeated request)."""

    code = "sequence_out_of_order"


class SequenceGapError(SequenceError):
    """``strict``: the sequence number skips ahead of ``expected`` (``last + 1``)."""

    code = "sequence_gap"

    @property
    def expected(self) -> int:
        """The number that would have been accepted."""
        return self.last + 1


class VersionConflictError(IdempotencyError):
    """``cas``: the stored version is not the expected one; nothing was written."""

    code = "version_conflict"

    def __init__(self, key: str, current: int, expected: int) -> None:
        super().__init__(f"{key}: version is {current}, not the expected {expected}")
        self.key = key
        self.current = current
        self.expected = expected


class HistoryFullError(IdempotencyError):
    """The subject's history holds ``max_entries`` entries already; nothing was written."""

    code = "history_full"

    def __init__(self, subject: str, max_entries: int) -> None:
        super().__init__(f"history {subject!r} is full ({max_entries} entries)")
        self.subject = subject
        self.max_entries = max_entries


FieldPath = tuple[str | int, ...]
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")  # a TOML bare key, written without quotes


class MapError(IdempotencyError, ValueError):
    """An invalid idempotency map: ``source:line: field: what is wrong``.

    ``source`` is the file (or ``"<string>"``), ``line`` is 1-based (or None),
    ``field`` is the dotted name of the offending entry, such as
    ``operations.payment.ttl`` or ``routes[2].operation`` (or None).
    """

    code = "idempotency_map_invalid"

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        line: int | None = None,
        field: str | FieldPath | None = None,
    ) -> None:
        self.field_path: FieldPath = tuple(field) if isinstance(field, tuple) else ()
        self.message = message
        self.source = source
        self.line = line
        self.field = (_dotted(field) or None) if isinstance(field, tuple) else field
        super().__init__(str(self))

    def __str__(self) -> str:
        where = ""
        if self.source is not None:
            where = self.source if self.line is None else f"{self.source}:{self.line}"
            where += ": "
        what = f"{self.field}: " if self.field else ""
        return f"{where}{what}{self.message}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_map_error, (self.message, self.source, self.line, self.field))


def _rebuild_map_error(
    message: str, source: str | None, line: int | None, field: str | None
) -> Any:
    return MapError(message, source=source, line=line, field=field)


def _dotted(path: FieldPath) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = part if _BARE_KEY.fullmatch(part) else json.dumps(part)
            out += f".{text}" if out else text
    return out


class MissingExtraError(IdempotencyError, ImportError):
    """A feature needs a package that is not installed: the message names the
    extra that installs it (``pip install 'retrysafe[gateway]'``)."""

    code = "idempotency_missing_extra"

    def __init__(self, extra: str, feature: str, *, name: str | None = None) -> None:
        missing = f" ({name} is not installed)" if name else ""
        super().__init__(
            f"{feature} needs the {extra!r} extra{missing}: pip install 'retrysafe[{extra}]'",
            name=name,
        )
        self.extra = extra
