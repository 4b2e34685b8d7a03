"""``memory://``: an in-process store, thread-safe and asyncio-safe, bounded (LRU)."""

from __future__ import annotations

import heapq
import logging
import threading
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from retrysafe._model.decide import RawCell, claimable, live, writable
from retrysafe._model.record import FINANCIAL, ClaimResult, Outcome, Record, Status
from retrysafe.stores._base import ArchivedRecord, RecordQuery, Store, StoreStats, SweepBatch

__all__ = ["DEFAULT_MAX_BYTES", "MemoryStore", "record_bytes"]

log = logging.getLogger("retrysafe")

_Op = Callable[[], Any]

#: The default byte bound of a memory store's records.
DEFAULT_MAX_BYTES = 64 << 20
#: What a record costs beyond its strings and bytes (objects, dict slots), roughly.
_OVERHEAD = 600


def record_bytes(record: Record) -> int:
    """What ``record`` holds, in bytes: its strings, stored answer and payload,
    plus a fixed overhead per record (an estimate of its memory, not a measure)."""
    size = _OVERHEAD + len(record.key) + len(record.scope) + len(record.operation)
    size += len(record.fingerprint) + len(record.token) + len(record.request_id or "")
    if record.request_payload is not None:
        size += len(record.request_payload)
    if record.metadata:
        size += len(record.metadata_json())
    outcome = record.outcome
    if outcome is not None:
        size += len(outcome.body) + len(outcome.media_type)
        size += sum(len(k) + len(v) for k, v in outcome.headers)
    return size


def _bound(name: str, value: object, options: dict[str, str], default: int) -> int:
    """A bound given as an argument, else in the URL's query, else ``default``; at least 1."""
    if value is None:
        value = options.get(name, default)
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"memory:// {name} must be a whole number, not {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be at least 1, not {value!r}")
    return value


class MemoryStore(Store[_Op]):
    """Records in a dict guarded by a lock; the least recently used go past
    ``max_size`` records or ``max_bytes`` bytes (see :func:`record_bytes`).

    For tests and single-process services: nothing survives the process, and an
    evicted record is forgotten (a later retry of it runs again). Records whose
    lease is alive are never evicted. A finished record larger than ``max_bytes``
    on its own is forgotten at once. The bounds may be given in the URL too:
    ``memory://?max_size=1000&max_bytes=16777216``. The archive of swept
    financial records is a dict in the process as well (unbounded; eviction
    does not archive).
    """

    def __init__(
        self,
        url: str = "memory://",
        *,
        max_size: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        options = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))
        self.url = url
        self.max_size = _bound("max_size", max_size, options, 100_000)
        self.max_bytes = _bound("max_bytes", max_bytes, options, DEFAULT_MAX_BYTES)
        #: The records' bytes, as :func:`record_bytes` counts them.
        self.bytes = 0
        self._sizes: dict[str, int] = {}
        self._records: OrderedDict[str, Record] = OrderedDict()
        self._lock = threading.Lock()
        #: Swept financial records by (key_hash, token), with when they were archived.
        self._archive: dict[tuple[str, str], ArchivedRecord] = {}
        #: Versioned cells of retrysafe.guards (see retrysafe._core.cells), apart from records.
        self._cells: dict[str, RawCell] = {}
        self._cells_bound = self.max_size  # prune expired cells past this many

    def __len__(self) -> int:
        return len(self._records)

    # Ops are closures: the lock is held only for dict work, never across an await.
    def _run(self, op: _Op) -> Any:
        with self._lock:
            return op()

    async def _arun(self, op: _Op) -> Any:
        with self._lock:
            return op()

    # Records and their sizes change together, under the lock, only through these.

    def _put(self, key_hash: str, record: Record) -> None:
        self._records[key_hash] = record
        self._resized(key_hash, record)

    def _resized(self, key_hash: str, record: Record) -> None:
        size = record_bytes(record)
        self.bytes += size - self._sizes.get(key_hash, 0)
        self._sizes[key_hash] = size

    def _drop(self, key_hash: str) -> Record | None:
        self.bytes -= self._sizes.pop(key_hash, 0)
        return self._records.pop(key_hash, None)

    def _evict(self, now: float) -> None:
        """Forget the least recently used records until both bounds hold, but never
        one whose lease is alive (that would let a second attempt run beside it);
        pass over at most 16 of those and stay over the bound rather than break
        that rule."""
        records = self._records
        passed = 0
        while (len(records) > self.max_size or self.bytes > self.max_bytes) and passed < min(
            16, len(records)
        ):
            key_hash, oldest = next(iter(records.items()))
            if oldest.status is Status.PROCESSING and oldest.lease_until > now:
                records.move_to_end(key_hash)  # in flight: keep it, try the next one
                passed += 1
            else:
                self._drop(key_hash)

    def _settled(self, key_hash: str, record: Record, now: float) -> None:
        """Count a finished record's answer; forget it at once if it is over
        ``max_bytes`` on its own (rather than evict every other record for it)."""
        self._resized(key_hash, record)
        if self._sizes[key_hash] > self.max_bytes:
            self._drop(key_hash)
            log.warning(
                "retrysafe: a record of %d bytes is over the memory store's max_bytes=%d; "
                "it was not kept (a retry runs again) (key_hash=%s)",
                record_bytes(record),
                self.max_bytes,
                key_hash[:16],
            )
        elif self.bytes > self.max_bytes:
            self._evict(now)

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
                self._put(key_hash, record)  # the engine hands the record over
                if len(records) > self.max_size or self.bytes > self.max_bytes:
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
            self._put(key_hash, record)
            if self.bytes > self.max_bytes:
                self._evict(now)
            return ClaimResult(True, attempts=record.attempts, took_over=took_over)

        return op

    def _complete(self, key_hash: str, token: str, outcome: Outcome, now: float) -> _Op:
        def op() -> bool:
            cur = self._live(key_hash, token)
            if cur is None:
                return False
            cur.status, cur.outcome = Status.COMPLETED, outcome
            cur.completed_at = cur.updated_at = now
            self._settled(key_hash, cur, now)
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
            self._settled(key_hash, cur, now)
            return True

        return op

    def _renew(self, key_hash: str, token: str, lease_until: float, now: float) -> _Op:
        def op() -> bool:
            cur = self._live(key_hash, token)
            if cur is None:
                return False
            cur.lease_until, cur.updated_at = lease_until, now
            if lease_until > cur.expires_at:  # a live attempt never expires under its owner
                cur.expires_at = lease_until
            return True

        return op

    def _get(self, key_hash: str) -> _Op:
        def op() -> Record | None:
            cur = self._records.get(key_hash)
            return None if cur is None else cur.copy()

        return op

    def _delete(self, key_hash: str) -> _Op:
        return lambda: self._drop(key_hash) is not None

    def _cell_read(self, key: str) -> _Op:
        return lambda: self._cells.get(key)

    def _cell_write(
        self, key: str, expected: int | None, text: str, expires_at: float | None, now: float
    ) -> _Op:
        def op() -> bool:
            cells = self._cells
            cur = cells.get(key)
            if not writable(cur, expected, now):
                return False
            cells[key] = (1 if expected is None else expected + 1, text, expires_at)
            if cur is None and len(cells) > self._cells_bound:
                self._prune_cells(now)
            return True

        return op

    def _prune_cells(self, now: float) -> None:
        """Forget expired cells; the next prune waits until the live ones have doubled
        (so writes stay O(1) on average). Live cells are never dropped: unlike records,
        a guard's cell is its state, not a cache."""
        cells = self._cells
        for k in [k for k, c in cells.items() if not live(c[2], now)]:
            del cells[k]
        self._cells_bound = max(self.max_size, 2 * len(cells))

    def close(self) -> None:
        """Nothing to release; records stay until the store is dropped."""

    # -- operations work (sweeper, CLI) ----------------------------------------------
    #
    # The lock is held for a C-speed copy of the records and for the few changes;
    # scanning, filtering and sorting happen outside it, so claims wait little.
    # Records are only ever replaced (a takeover), or changed in status, outcome and
    # lease (complete, fail, renew; a renewal past expires_at pushes it later): their
    # key, operation and created_at can be read without the lock, expires_at only
    # grows, and every decision is checked again under it.

    def _snapshot(self) -> list[Record]:
        with self._lock:
            return list(self._records.values())

    def _archive_one(self, record: Record, archived_at: float) -> bool:
        """Archive a copy of ``record`` unless it is archived already (hold the lock)."""
        key = (record.key_hash, record.token)
        if key in self._archive:
            return False
        self._archive[key] = ArchivedRecord(record=record.copy(), archived_at=archived_at)
        return True

    def sweep(self, now: float, limit: int = 1000) -> SweepBatch:
        expired = [r for r in self._snapshot() if r.expires_at <= now]
        doomed = heapq.nsmallest(limit, expired, key=lambda r: r.expires_at)
        deleted = archived = 0
        with self._lock:
            records = self._records
            for r in doomed:
                if records.get(r.key_hash) is not r or r.expires_at > now:
                    continue  # taken over (a new record object) or deleted meanwhile
                if r.retention == FINANCIAL and self._archive_one(r, now):
                    archived += 1
                self._drop(r.key_hash)
                deleted += 1
        return SweepBatch(deleted, archived, done=len(expired) < limit)

    def _list_records(self, query: RecordQuery) -> list[Record]:
        found = query.select(self._snapshot())
        with self._lock:  # copies of consistent records: a completion may be under way
            copies = [r.copy() for r in found]
        return [r for r in copies if query.matches(r)]

    def stats(self, now: float) -> StoreStats:
        stats = StoreStats()
        counts = stats.counts
        oldest: Record | None = None
        for r in self._snapshot():
            if r.expires_at <= now:
                stats.expired += 1
                continue
            key = (r.operation, r.status.value)
            counts[key] = counts.get(key, 0) + 1
            if r.status is Status.PROCESSING and (
                oldest is None or r.created_at < oldest.created_at
            ):
                oldest = r
        with self._lock:
            stats.oldest_processing = None if oldest is None else oldest.copy()
            stats.archived = len(self._archive)
        return stats

    def archive_records(self, records: Sequence[Record], archived_at: float) -> int:
        with self._lock:
            return sum(self._archive_one(r, archived_at) for r in records)

    def archived_records(
        self, *, operation: str | None = None, limit: int = 100
    ) -> list[ArchivedRecord]:
        with self._lock:
            entries = list(self._archive.values())
        found = heapq.nlargest(
            limit,
            (a for a in entries if operation is None or a.record.operation == operation),
            key=lambda a: a.archived_at,
        )
        return [ArchivedRecord(record=a.record.copy(), archived_at=a.archived_at) for a in found]
