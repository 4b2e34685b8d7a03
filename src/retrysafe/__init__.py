"""retrysafe: make retries safe.

One side effect and the same answer, however often a call is retried.
"""

from __future__ import annotations

from retrysafe._core.engine import DEFAULT_LEASE, DEFAULT_TTL, Attempt, Claim, Engine, Replay
from retrysafe._decorator import idempotent
from retrysafe._map.map import IdempotencyMap
from retrysafe._map.operations import Operation
from retrysafe._map.routes import Route
from retrysafe._model.hashing import canonical_json, fingerprint, key_hash, validate_key
from retrysafe._model.record import ClaimResult, Outcome, Record, Status
from retrysafe._ops.sweep import Sweeper, SweepReport
from retrysafe.errors import (
    AmbiguousCredentialsError,
    FingerprintMismatchError,
    IdempotencyError,
    InProgressError,
    InvalidKeyError,
    LeaseLostError,
    MapError,
    PrincipalRequiredError,
    StoreUnavailableError,
)
from retrysafe.stores import Store, open_store

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
