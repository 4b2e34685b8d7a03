"""retrysafe: make retries safe.

One side effect and the same answer, however often a call is retried.
"""

from __future__ import annotations

from ._decorator import idempotent
from ._engine import DEFAULT_LEASE, DEFAULT_TTL, Attempt, Claim, Engine, Replay
from ._errors import (
    AmbiguousCredentialsError,
    FingerprintMismatchError,
    IdempotencyError,
    InProgressError,
    InvalidKeyError,
    LeaseLostError,
    PrincipalRequiredError,
    StoreUnavailableError,
)
from ._keys import canonical_json, fingerprint, key_hash, validate_key
from ._map import IdempotencyMap, MapError, Operation, Route
from ._record import ClaimResult, Outcome, Record, Status
from ._sweep import Sweeper, SweepReport
from .stores import Store, open_store

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_TTL",
    "AmbiguousCredentialsError",
    "Attempt",
    "Claim",
    "ClaimResult",
    "Engine",
    "FingerprintMismatchError",
    "IdempotencyError",
    "IdempotencyMap",
    "InProgressError",
    "InvalidKeyError",
    "LeaseLostError",
    "MapError",
    "Operation",
    "Outcome",
    "PrincipalRequiredError",
    "Record",
    "Replay",
    "Route",
    "Status",
    "Store",
    "StoreUnavailableError",
    "SweepReport",
    "Sweeper",
    "__version__",
    "canonical_json",
    "fingerprint",
    "idempotent",
    "key_hash",
    "open_store",
    "validate_key",
]
