"""Typed errors. Every error carries a machine ``code`` for problem+json answers."""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = [
    "AmbiguousCredentialsError",
    "FingerprintMismatchError",
    "IdempotencyError",
    "InProgressError",
    "InvalidKeyError",
    "LeaseLostError",
    "MapError",
    "PrincipalRequiredError",
    "StoreUnavailableError",
]


class IdempotencyError(Exception):
    """Base class of every retrysafe error."""

    code: str = "idempotency_error"


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
