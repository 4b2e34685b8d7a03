"""Typed errors. Every error carries a machine ``code`` for problem+json answers."""

from __future__ import annotations

__all__ = [
    "AmbiguousCredentialsError",
    "FingerprintMismatchError",
    "IdempotencyError",
    "InProgressError",
    "InvalidKeyError",
    "LeaseLostError",
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
