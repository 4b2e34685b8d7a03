"""``memory://``: an in-process store, thread-safe and asyncio-safe, bounded (LRU).

Each record is kept as a flat tuple of str, bytes, numbers and None (a *row*,
laid out in docs/stores.md), which the garbage collector stops tracking: a
store of 100,000 records adds nothing to a full collection's pause. A
:class:`Record` is built only for what leaves the store.
"""

from __future__ import annotations

import functools
import heapq
import json
import logging
import threading
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

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

#: A stored record (see docs/stores.md): key, scope, operation, fingerprint, status
#: value, token, lease_until, expires_at, created_at, updated_at, completed_at,
#: attempts, request_id, final, the answer's body or None, request_payload, metadata
#: as JSON text or None, retention, its bytes (record_bytes); then, with an answer,
#: its status, media type and each header's name and value.
_Row: TypeAlias = tuple[Any, ...]
# Where a row holds what the store reads or changes.
_STATUS, _TOKEN, _LEASE, _EXPIRES, _CREATED, _SIZE = 4, 5, 6, 7, 8, 18
_PROCESSING, _COMPLETED, _FAILED = Status.PROCESSING.value, Status.COMPLETED.value, "failed"
_STATUSES = {s.value: s for s in Status}
_VALUES = {s: s.value for s in Status}
_blank = object.__new__


def record_bytes(record: Record) -> int:
    """What ``record`` holds, in bytes: its strings, stored answer and payload,
    plus a fixed overhead per record (an estimate of its memory, not a measure)."""
    return _bytes(record, record.metadata_json() if record.metadata else None)


def _bytes(record: Record, metadata: str | None) -> int:
    """:func:`record_bytes` of ``record`` whose metadata has this JSON text."""
    size = _OVERHEAD + len(record.key) + len(record.scope) + len(record.operation)
    size += len(record.fingerprint) + len(record.token) + len(record.request_id or "")
    if record.request_payload is not None:
        size += len(record.request_payload)
    if metadata is not None:
        size += len(metadata)
    outcome = record.outcome
    if outcome is not None:
        size += _answer_bytes(outcome)
    return size


def _answer_bytes(outcome: Outcome) -> int:
    size = len(outcome.body) + len(outcome.media_type)
    headers = outcome.headers
    return size + sum(len(k) + len(v) for k, v in headers) if headers else size


def _answer(outcome: Outcome | None) -> tuple[Any, ...]:
    """What a row keeps of an answer after its bytes: its status, media type, then
    each header's name and value, flat; nothing without an answer. A row holds no
    tuple: the collector untracks a tuple only once it has seen every tuple in it
    untracked, and answers nested in rows kept many rows tracked for several full
    collections."""
    if outcome is None:
        return ()
    headers = outcome.headers
    if not headers:
        return (outcome.status, outcome.media_type)
    return (outcome.status, outcome.media_type, *[x for h in headers for x in h])


def _row(r: Record) -> _Row:
    """``r`` as the store keeps it (its bytes counted as :func:`record_bytes` does)."""
    metadata = r.metadata_json() if r.metadata else None  # a dict would keep the row tracked
    outcome = r.outcome
    if outcome is None and metadata is None and r.request_payload is None:
        # A claim's record, the common case: _bytes's sum, with nothing else to add.
        size = _OVERHEAD + len(r.key) + len(r.scope) + len(r.operation) + len(r.fingerprint)
        size += len(r.token) + len(r.request_id or "")
        body, answer = None, ()
    else:
        size = _bytes(r, metadata)
        body, answer = None if outcome is None else outcome.body, _answer(outcome)
    return (
        r.key,
        r.scope,
        r.operation,
        r.fingerprint,
        _VALUES[r.status],
        r.token,
        r.lease_until,
        r.expires_at,
        r.created_at,
        r.updated_at,
        r.completed_at,
        r.attempts,
        r.request_id,
        r.final,
        body,
        r.request_payload,
        metadata,
        r.retention,
        size,
        *answer,
    )


def _record(key_hash: str, row: _Row) -> Record:
    """A new :class:`Record` from a row (filled field by field, as Record.copy is)."""
    c = _blank(Record)
    c.key_hash = key_hash
    (
        c.key,
        c.scope,
        c.operation,
        c.fingerprint,
        status,
        c.token,
        c.lease_until,
        c.expires_at,
        c.created_at,
        c.updated_at,
        c.completed_at,
        c.attempts,
        c.request_id,
        c.final,
        body,
        c.request_payload,
        metadata,
        c.retention,
        _,
        *answer,
    ) = row
    c.status = _STATUSES[status]
    if body is None:
        c.outcome = None
    else:
        o = c.outcome = _blank(Outcome)
        o.body, o.status, o.media_type = body, answer[0], answer[1]
        o.headers = tuple(zip(answer[2::2], answer[3::2], strict=True)) if len(answer) > 2 else ()
    c.metadata = {} if metadata is None else json.loads(metadata)
    return c


def _result(
    claimed: bool, record: Record | None, attempts: int, took_over: Status | None
) -> ClaimResult:
    """A :class:`ClaimResult` filled field by field (a plain call: the dataclass's
    construction goes through ``type.__call__``)."""
    result = _blank(ClaimResult)
    result.claimed, result.record, result.attempts, result.took_over = (
        claimed,
        record,
        attempts,
        took_over,
    )
    return result


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

    drive_inline = True  # no I/O at all
    settle_expiry = True

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
        self._records: OrderedDict[str, _Row] = OrderedDict()
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

    # The calls of every request run their op directly, under the lock: no closure.

    def claim(self, record: Record) -> ClaimResult:
        with self._lock:
            return self._claim_now(record)

    async def aclaim(self, record: Record) -> ClaimResult:
        with self._lock:
            return self._claim_now(record)

    def complete(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome,
        now: float,
        expires_at: float | None = None,
    ) -> bool:
        with self._lock:
            return self._settle_now(key_hash, token, _COMPLETED, outcome, None, now, expires_at)

    async def acomplete(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome,
        now: float,
        expires_at: float | None = None,
    ) -> bool:
        with self._lock:
            return self._settle_now(key_hash, token, _COMPLETED, outcome, None, now, expires_at)

    # Rows and the byte count change together, under the lock, only through these.

    def _put(self, key_hash: str, row: _Row, old: _Row | None) -> None:
        self._records[key_hash] = row
        self.bytes += row[_SIZE] if old is None else row[_SIZE] - old[_SIZE]

    def _drop(self, key_hash: str) -> _Row | None:
        row = self._records.pop(key_hash, None)
        if row is not None:
            self.bytes -= row[_SIZE]
        return row

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
            if oldest[_STATUS] == _PROCESSING and oldest[_LEASE] > now:
                records.move_to_end(key_hash)  # in flight: keep it, try the next one
                passed += 1
            else:
                self._drop(key_hash)

    def _live(self, key_hash: str, token: str) -> _Row | None:
        cur = self._records.get(key_hash)
        if cur is None or cur[_TOKEN] != token or cur[_STATUS] != _PROCESSING:
            return None
        self._records.move_to_end(key_hash)
        return cur

    def _claim(self, record: Record) -> _Op:
        return functools.partial(self._claim_now, record)

    def _claim_now(self, record: Record) -> ClaimResult:
        records, key_hash = self._records, record.key_hash
        cur = records.get(key_hash)
        if cur is None:  # the common first call (_put's work, inline)
            row = records[key_hash] = _row(record)
            self.bytes += row[_SIZE]
            if len(records) > self.max_size or self.bytes > self.max_bytes:
                self._evict(record.updated_at)
            return _result(True, None, 1, None)
        records.move_to_end(key_hash)
        now = record.updated_at
        found = _record(key_hash, cur)  # reads get records of their own
        if not claimable(found, record.fingerprint, now):
            return _result(False, found, 1, None)
        took_over = None
        if found.expires_at > now:
            took_over = found.status
            record.attempts = found.attempts + 1
            record.created_at = found.created_at
        self._put(key_hash, _row(record), cur)
        if self.bytes > self.max_bytes:
            self._evict(now)
        return _result(True, None, record.attempts, took_over)

    def _complete(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome,
        now: float,
        expires_at: float | None = None,
    ) -> _Op:
        return functools.partial(
            self._settle_now, key_hash, token, _COMPLETED, outcome, None, now, expires_at
        )

    def _fail(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome | None,
        final: bool,
        now: float,
        expires_at: float | None = None,
    ) -> _Op:
        return functools.partial(
            self._settle_now, key_hash, token, _FAILED, outcome, final, now, expires_at
        )

    def _settle_now(
        self,
        key_hash: str,
        token: str,
        status: str,
        outcome: Outcome | None,
        final: bool | None,
        now: float,
        expires_at: float | None = None,
    ) -> bool:
        """Complete (``final`` None) or fail the live attempt ``token`` (and move its
        expiry to ``expires_at`` if given); count the answer's bytes, and forget the
        record at once if it is over ``max_bytes`` on its own (rather than evict every
        other record for it)."""
        records = self._records
        cur = records.get(key_hash)  # _live's work, inline
        if cur is None or cur[_TOKEN] != token or cur[_STATUS] != _PROCESSING:
            return False
        records.move_to_end(key_hash)
        old = cur[_SIZE]
        if outcome is None:
            size, body, answer = old, None, ()
        else:
            size, body, answer = old + _answer_bytes(outcome), outcome.body, _answer(outcome)
        row = (
            *cur[:4],
            status,
            token,
            cur[6],
            cur[7] if expires_at is None else expires_at,
            cur[8],
            now,
            now if final is None else cur[10],
            cur[11],
            cur[12],
            cur[13] if final is None else final,
            body,
            *cur[15:18],
            size,
            *answer,
        )
        records[key_hash] = row  # _put's work, inline
        self.bytes += size - old
        if size > self.max_bytes:
            self._drop(key_hash)
            log.warning(
                "retrysafe: a record of %d bytes is over the memory store's max_bytes=%d; "
                "it was not kept (a retry runs again) (key_hash=%s)",
                size,
                self.max_bytes,
                key_hash[:16],
            )
        elif self.bytes > self.max_bytes:
            self._evict(now)
        return True

    def _renew(self, key_hash: str, token: str, lease_until: float, now: float) -> _Op:
        def op() -> bool:
            cur = self._live(key_hash, token)
            if cur is None:
                return False
            # A live attempt never expires under its owner.
            expires_at = lease_until if lease_until > cur[_EXPIRES] else cur[_EXPIRES]
            self._put(key_hash, (*cur[:6], lease_until, expires_at, cur[8], now, *cur[10:]), cur)
            return True

        return op

    def _get(self, key_hash: str) -> _Op:
        def op() -> Record | None:
            cur = self._records.get(key_hash)
            return None if cur is None else _record(key_hash, cur)

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
    # The lock is held for a C-speed copy of the rows and for the few changes;
    # scanning, filtering, sorting and building records happen outside it, so claims
    # wait little. Rows never change (a change stores a new one), and every decision
    # is checked again under the lock.

    def _snapshot(self) -> list[tuple[str, _Row]]:
        with self._lock:
            return list(self._records.items())

    def _archive_one(self, record: Record, archived_at: float) -> bool:
        """Archive a copy of ``record`` unless it is archived already (hold the lock)."""
        key = (record.key_hash, record.token)
        if key in self._archive:
            return False
        self._archive[key] = ArchivedRecord(record=record.copy(), archived_at=archived_at)
        return True

    def sweep(self, now: float, limit: int = 1000) -> SweepBatch:
        expired = [(k, row) for k, row in self._snapshot() if row[_EXPIRES] <= now]
        doomed = heapq.nsmallest(limit, expired, key=lambda item: item[1][_EXPIRES])
        deleted = archived = 0
        with self._lock:
            records = self._records
            for key_hash, row in doomed:
                cur = records.get(key_hash)
                if cur is None or cur[_TOKEN] != row[_TOKEN] or cur[_EXPIRES] > now:
                    continue  # taken over (another token), renewed or deleted meanwhile
                if cur[17] == FINANCIAL and self._archive_one(_record(key_hash, cur), now):
                    archived += 1
                self._drop(key_hash)
                deleted += 1
        return SweepBatch(deleted, archived, done=len(expired) < limit)

    def _list_records(self, query: RecordQuery) -> list[Record]:
        return query.select(_record(k, row) for k, row in self._snapshot())

    def stats(self, now: float) -> StoreStats:
        stats = StoreStats()
        counts = stats.counts
        oldest: tuple[str, _Row] | None = None
        for key_hash, row in self._snapshot():
            if row[_EXPIRES] <= now:
                stats.expired += 1
                continue
            key = (row[2], row[_STATUS])
            counts[key] = counts.get(key, 0) + 1
            if row[_STATUS] == _PROCESSING and (
                oldest is None or row[_CREATED] < oldest[1][_CREATED]
            ):
                oldest = (key_hash, row)
        stats.oldest_processing = None if oldest is None else _record(*oldest)
        with self._lock:
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
