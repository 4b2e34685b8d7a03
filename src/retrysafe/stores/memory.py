"""``memory://``: an in-process store, thread-safe and asyncio-safe, bounded (LRU)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .._decide import claimable
from .._record import ClaimResult, Outcome, Record, Status
from ._base import Store

__all__ = ["MemoryStore"]

_Op = Callable[[], Any]


class MemoryStore(Store[_Op]):
    """Records in a dict guarded by a lock; the least recently used go past ``max_size``.

    For tests and single-process services: nothing survives the process, and an
    evicted record is forgotten (a later retry of it runs again). Records whose
    lease is alive are never evicted.
    """

    def __init__(self, url: str = "memory://", *, max_size: int = 100_000) -> None:
        if max_size < 1:
            raise ValueError("max_size must be at least 1")
        self.url = url
        self.max_size = max_size
        self._records: OrderedDict[str, Record] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    # Ops are closures: the lock is held only for dict work, never across an await.
    def _run(self, op: _Op) -> Any:
        with self._lock:
            return op()

    async def _arun(self, op: _Op) -> Any:
        with self._lock:
            return op()

    def _evict(self, now: float) -> None:
        """Forget the least recently used record, but never one whose lease is alive
        (that would let a second attempt run beside it); look at most 16 deep and
        stay over the bound rather than break that rule."""
        records = self._records
        for _ in range(min(16, len(records))):
            key_hash, oldest = records.popitem(last=False)
            if oldest.status is not Status.PROCESSING or oldest.lease_until <= now:
                return
            records[key_hash] = oldest  # in flight: keep it, try the next one

    def _live(self, key_hash: str, token: str) -> Record | None:
        cur = self._records.get(key_hash)
        if cur is None or cur.token != token or cur.status is not Status.PROCESSING:
            return None
        self._records.move_to_end(key_hash)
        return cur

    def _claim(self, record: Record) -> _Op:
        def op() -> ClaimResult:
            records, key_hash = self._records, record.key_hash
            cur = records.get(key_hash)
            if cur is None:  # the common first call
                records[key_hash] = record  # the engine hands the record over
                if len(records) > self.max_size:
                    self._evict(record.updated_at)
                return ClaimResult(True)
            records.move_to_end(key_hash)
            now = record.updated_at
            if not claimable(cur, record.fingerprint, now):
                return ClaimResult(False, record=cur.copy())  # reads get copies
            took_over = None
            if cur.expires_at > now:
                took_over = cur.status
                record.attempts = cur.attempts + 1
                record.created_at = cur.created_at
            records[key_hash] = record
            return ClaimResult(True, attempts=record.attempts, took_over=took_over)

        return op

    def _complete(self, key_hash: str, token: str, outcome: Outcome, now: float) -> _Op:
        def op() -> bool:
            cur = self._live(key_hash, token)
            if cur is None:
                return False
            cur.status, cur.outcome = Status.COMPLETED, outcome
            cur.completed_at = cur.updated_at = now
            return True

        return op

    def _fail(
        self, key_hash: str, token: str, outcome: Outcome | None, final: bool, now: float
    ) -> _Op:
        def op() -> bool:
            cur = self._live(key_hash, token)
            if cur is None:
                return False
            cur.status, cur.outcome, cur.final, cur.updated_at = Status.FAILED, outcome, final, now
            return True

        return op

    def _renew(self, key_hash: str, token: str, lease_until: float, now: float) -> _Op:
        def op() -> bool:
            cur = self._live(key_hash, token)
            if cur is None:
                return False
            cur.lease_until, cur.updated_at = lease_until, now
            return True

        return op

    def _get(self, key_hash: str) -> _Op:
        def op() -> Record | None:
            cur = self._records.get(key_hash)
            return None if cur is None else cur.copy()

        return op

    def _delete(self, key_hash: str) -> _Op:
        return lambda: self._records.pop(key_hash, None) is not None

    def close(self) -> None:
        """Nothing to release; records stay until the store is dropped."""
