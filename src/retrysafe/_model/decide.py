"""The engine's decisions: what a found record means. Plain functions, no I/O.

Every store applies :func:`claimable` to what it read; the statements that
write a claim (the Redis script, the SQLite and PostgreSQL takeover UPDATEs)
re-check the same rule atomically in their own language, and the conformance
suite checks that they agree.
"""

from __future__ import annotations

import enum
import math
from typing import TypeAlias

from retrysafe._model.record import Record, Status

__all__ = ["RawCell", "Verdict", "claimable", "live", "retry_after", "verdict", "writable"]


class Verdict(enum.Enum):
    """What to do about a live record that could not be claimed."""

    REPLAY = "replay"
    IN_PROGRESS = "in_progress"
    CONFLICT = "conflict"


def claimable(record: Record | None, fingerprint: str, now: float) -> bool:
    """True when a claim may (over)write ``record``.

    Absent or expired records are free. A live record is taken over only by the
    same request: a retry after a retryable failure, or after its lease ran out.
    """
    if record is None or record.expires_at <= now:
        return True
    if record.fingerprint != fingerprint:
        return False
    if record.status is Status.FAILED:
        return not record.final
    return record.status is Status.PROCESSING and record.lease_until <= now


def verdict(record: Record, fingerprint: str) -> Verdict:
    """The answer for a live record that the claim did not take."""
    if record.fingerprint != fingerprint:
        return Verdict.CONFLICT
    if record.status is Status.PROCESSING:
        return Verdict.IN_PROGRESS
    return Verdict.REPLAY


def retry_after(record: Record, now: float) -> float:
    """Seconds a caller should wait before retrying an in-flight key (at least 1).

    As long as the attempt has run so far, and never past its lease: a request
    that began a moment ago will likely answer soon, one that has run for a
    while likely needs a while more, and a crashed one frees the key when its
    lease runs out.
    """
    wait = min(record.lease_until - now, now - record.updated_at)
    return float(max(1, math.ceil(wait)))


# -- compare-and-set cells (retrysafe._core.cells) ------------------------------

#: A cell as a store returns it, expired or not: (version, JSON text, expires_at)
#: (a tuple, or a list of the three from Redis, whose executor runs tuples as ops).
RawCell: TypeAlias = tuple[int, str, float | None]


def live(expires_at: float | None, now: float) -> bool:
    """Whether a cell with this expiry still counts at ``now``."""
    return expires_at is None or expires_at > now


def writable(cur: RawCell | None, expected: int | None, now: float) -> bool:
    """The compare-and-set rule that every store applies atomically.

    ``expected=None``: no live cell; an int: the live cell has that version.
    """
    if expected is None:
        return cur is None or not live(cur[2], now)
    return cur is not None and cur[0] == expected and live(cur[2], now)
