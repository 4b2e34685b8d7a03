"""The Store protocol: the seam between the engine and a server.

Each operation is one round trip. A concrete store describes an operation once,
as an *op* (its own opaque value: a closure, a script call, a SQL statement),
and supplies two executors, ``_run`` and ``_arun``; the sync and async methods
below are shared by every store, so no store writes its logic twice.
"""

from __future__ import annotations

import abc
import dataclasses
import heapq
import inspect
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from retrysafe._model.record import ClaimResult, Outcome, Record, Status
from retrysafe.stores._redact import redact

__all__ = [
    "ArchivedRecord",
    "AsyncTransaction",
    "RecordQuery",
    "Store",
    "StoreStats",
    "SweepBatch",
    "Transaction",
    "settles_expiry",
]


@dataclass(slots=True)
class SweepBatch:
    """What one bounded sweep batch did.

    ``deleted`` counts every expired record removed, archived ones included;
    ``archived`` the financial records newly copied to the archive; ``done`` is
    true when the batch found fewer expired records than its limit.
    """

    deleted: int = 0
    archived: int = 0
    done: bool = True


@dataclass(slots=True)
class StoreStats:
    """Counts of live (unexpired) records, read by ``retrysafe stats``.

    ``counts`` maps (operation, status) to a number of records; ``expired`` is the
    number of records past their expiry that no sweep has removed yet;
    ``oldest_processing`` the processing record claimed longest ago; ``archived``
    the archive's size (``None`` when the store has no archive).
    """

    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    expired: int = 0
    oldest_processing: Record | None = None
    archived: int | None = None

    def by_status(self) -> dict[str, int]:
        totals = {s.value: 0 for s in Status}
        for (_, status), n in self.counts.items():
            totals[status] = totals.get(status, 0) + n
        return totals

    def by_operation(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for (operation, _), n in self.counts.items():
            totals[operation] = totals.get(operation, 0) + n
        return totals


@dataclass(slots=True)
class ArchivedRecord:
    """A financial record as the archive keeps it: the record and when it was archived."""

    record: Record
    archived_at: float


@dataclass(frozen=True, slots=True)
class RecordQuery:
    """Which records :meth:`Store.records` lists, oldest ``created_at`` first.

    Every filter given must match: ``status`` (a :class:`Status` or its value),
    ``operation``, ``created_before`` (a time: records created earlier), ``key`` (the
    client's raw key, in every scope and operation). At most ``limit`` records.
    Validated when made: an unknown status or a negative ``limit`` raises
    ``ValueError``.
    """

    status: Status | str | None = None
    operation: str | None = None
    created_before: float | None = None
    limit: int = 100
    key: str | None = None

    def __post_init__(self) -> None:
        if self.status is not None and not isinstance(self.status, Status):
            object.__setattr__(self, "status", Status(self.status))
        if self.created_before is not None:
            object.__setattr__(self, "created_before", float(self.created_before))
        limit = self.limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit must be a non-negative integer, not {limit!r}")

    def matches(self, record: Record) -> bool:
        """Whether ``record`` passes every filter (for the stores that filter in Python)."""
        return (
            (self.status is None or record.status is self.status)
            and (self.operation is None or record.operation == self.operation)
            and (self.created_before is None or record.created_at < self.created_before)
            and (self.key is None or record.key == self.key)
        )

    def select(self, records: Iterable[Record]) -> list[Record]:
        """The first ``limit`` matching ``records`` by (``created_at``, key hash)."""
        return heapq.nsmallest(
            self.limit, filter(self.matches, records), key=lambda r: (r.created_at, r.key_hash)
        )


OpT = TypeVar("OpT")


@dataclass(frozen=True, slots=True)
class Transaction(Generic[OpT]):
    """An application transaction that a completion joins (:meth:`Store.completion_transaction`).

    ``connection`` is what the application's block writes through (a DB-API
    connection, an ORM session); ``run(op)`` runs a completion op in the same
    transaction and answers whether it landed (False: the lease was lost).
    """

    connection: Any
    run: Callable[[OpT], bool]


@dataclass(frozen=True, slots=True)
class AsyncTransaction(Generic[OpT]):
    """Async :class:`Transaction`: ``await run(op)``."""

    connection: Any
    run: Callable[[OpT], Awaitable[bool]]


def _not_transactional(store: Store[Any]) -> TypeError:
    return TypeError(
        "transactional completion needs a store in the application's database "
        f"(SQLite, PostgreSQL, MySQL, SQLAlchemy or Django), not {type(store).__name__}"
    )


class Store(abc.ABC, Generic[OpT]):
    """Where records live. Sync and async methods are equals.

    * ``claim(record)``: atomically write ``record`` (status processing) if the
      key is claimable (see :func:`retrysafe._model.decide.claimable`), else return
      the live record. Taking over a live record keeps its ``created_at`` and
      counts ``attempts`` on; the result carries the new attempt number.
    * ``complete`` / ``fail`` / ``renew``: compare-and-set on the fencing
      token of a processing record; ``False`` when the token no longer owns it.
      ``renew`` past the record's ``expires_at`` moves ``expires_at`` to the new
      ``lease_until``: a live attempt never expires under its owner.
      ``complete`` and ``fail`` keep the record's ``expires_at``, or, given
      ``expires_at``, set it in the same write (a store that can declares
      :attr:`settle_expiry`; the engine gives it only to such a store).
    * ``get`` / ``delete``: read or remove one record by key hash.

    Errors reaching the server raise :class:`~retrysafe.StoreUnavailableError`
    and leave nothing half-written.
    """

    url: str = ""
    #: True when this store's async methods may be driven by hand up to their first
    #: suspension in the caller's task (the engine does so on Python 3.11 to save a
    #: task per call): they enter no timeout, cancel scope or context variable that
    #: outlives that step (a thread hop, or no I/O at all). False for any other store.
    drive_inline: ClassVar[bool] = False
    #: True when ``_complete`` and ``_fail`` take ``expires_at`` (the record's new
    #: expiry, set by the same write): the engine then keeps an answer ``ttl`` from
    #: when it is stored if a call asks (``ttl_from="completion"``). A store that
    #: does not say so keeps the expiry of the claim.
    settle_expiry: ClassVar[bool] = False

    # -- what each store defines -------------------------------------------------

    @abc.abstractmethod
    def _claim(self, record: Record) -> OpT: ...

    @abc.abstractmethod
    def _complete(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome,
        now: float,
        expires_at: float | None = None,
    ) -> OpT: ...

    @abc.abstractmethod
    def _fail(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome | None,
        final: bool,
        now: float,
        expires_at: float | None = None,
    ) -> OpT: ...

    @abc.abstractmethod
    def _renew(self, key_hash: str, token: str, lease_until: float, now: float) -> OpT: ...

    @abc.abstractmethod
    def _get(self, key_hash: str) -> OpT: ...

    @abc.abstractmethod
    def _delete(self, key_hash: str) -> OpT: ...

    # Versioned cells (retrysafe.guards, see retrysafe._core.cells), apart from the records:
    # ``_cell_read`` gives the raw cell (version, JSON text, expires_at), expired or
    # not, or None; ``_cell_write`` is one atomic compare-and-set by
    # retrysafe._core.cells.writable that writes version 1 (expected None) or expected + 1
    # and answers whether it wrote. Stores without cells keep these defaults.

    def _cell_read(self, key: str) -> OpT:
        raise NotImplementedError(f"{type(self).__name__} has no versioned cells")

    def _cell_write(
        self, key: str, expected: int | None, text: str, expires_at: float | None, now: float
    ) -> OpT:
        raise NotImplementedError(f"{type(self).__name__} has no versioned cells")

    @abc.abstractmethod
    def _run(self, op: OpT) -> Any:
        """Execute one op synchronously."""

    @abc.abstractmethod
    async def _arun(self, op: OpT) -> Any:
        """Execute one op from a coroutine."""

    def completion_transaction(
        self, connection: Any = None
    ) -> AbstractContextManager[Transaction[OpT]]:
        """Open the application transaction that a completion commits in.

        Entering begins it (on ``connection``, or on a connection of the store's),
        leaving commits it, an exception rolls it back. Stores whose records can
        share a transaction with the application's tables override this; the
        others raise :class:`TypeError`.
        """
        raise _not_transactional(self)

    def acompletion_transaction(
        self, connection: Any = None
    ) -> AbstractAsyncContextManager[AsyncTransaction[OpT]]:
        """Async :meth:`completion_transaction`."""
        raise _not_transactional(self)

    def close(self) -> None:
        """Release connections (the store reconnects if used again)."""

    async def aclose(self) -> None:
        """Release connections from a coroutine."""
        self.close()

    # -- the shared protocol ---------------------------------------------------

    def claim(self, record: Record) -> ClaimResult:
        return self._run(self._claim(record))

    async def aclaim(self, record: Record) -> ClaimResult:
        return await self._arun(self._claim(record))

    def complete(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome,
        now: float,
        expires_at: float | None = None,
    ) -> bool:
        return self._run(self._completion(key_hash, token, outcome, now, expires_at))

    async def acomplete(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome,
        now: float,
        expires_at: float | None = None,
    ) -> bool:
        return await self._arun(self._completion(key_hash, token, outcome, now, expires_at))

    def fail(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome | None,
        final: bool,
        now: float,
        expires_at: float | None = None,
    ) -> bool:
        return self._run(self._failure(key_hash, token, outcome, final, now, expires_at))

    async def afail(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome | None,
        final: bool,
        now: float,
        expires_at: float | None = None,
    ) -> bool:
        return await self._arun(self._failure(key_hash, token, outcome, final, now, expires_at))

    # ``expires_at`` reaches ``_complete``/``_fail`` only when given: a store written
    # before it existed (four and five arguments) still works without it.

    def _completion(
        self, key_hash: str, token: str, outcome: Outcome, now: float, expires_at: float | None
    ) -> OpT:
        if expires_at is None:
            return self._complete(key_hash, token, outcome, now)
        return self._complete(key_hash, token, outcome, now, expires_at)

    def _failure(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome | None,
        final: bool,
        now: float,
        expires_at: float | None,
    ) -> OpT:
        if expires_at is None:
            return self._fail(key_hash, token, outcome, final, now)
        return self._fail(key_hash, token, outcome, final, now, expires_at)

    def renew(self, key_hash: str, token: str, lease_until: float, now: float) -> bool:
        return self._run(self._renew(key_hash, token, lease_until, now))

    async def arenew(self, key_hash: str, token: str, lease_until: float, now: float) -> bool:
        return await self._arun(self._renew(key_hash, token, lease_until, now))

    def get(self, key_hash: str) -> Record | None:
        return self._run(self._get(key_hash))

    async def aget(self, key_hash: str) -> Record | None:
        return await self._arun(self._get(key_hash))

    def delete(self, key_hash: str) -> bool:
        return self._run(self._delete(key_hash))

    async def adelete(self, key_hash: str) -> bool:
        return await self._arun(self._delete(key_hash))

    # -- operations work (sweeper, CLI): sync, bounded, never on the request path ----

    def sweep(self, now: float, limit: int = 1000) -> SweepBatch:
        """Delete at most ``limit`` records expired at ``now``, in short steps.

        Financial records are copied to the archive first; a record is deleted only
        once it is archived, and archived at most once (keyed on key hash and
        fencing token), so an interrupted sweep loses and duplicates nothing. A
        record claimed again after it was read is not deleted.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot sweep")

    def sweep_cells(self, now: float, limit: int = 1000) -> int:
        """Delete at most ``limit`` guard cells (:mod:`retrysafe.guards`) expired at ``now``.

        Returns how many. Stores whose cells expire by themselves (memory, Redis)
        have nothing to do.
        """
        return 0

    def records(self, query: RecordQuery | None = None, /, **filters: Any) -> list[Record]:
        """Records (expired ones included) that ``query`` selects, oldest first.

        The filters may come as a :class:`RecordQuery` or as its fields by keyword
        (``store.records(status="processing", limit=50)``); keywords given with a
        query replace its fields. ``key`` searches the whole table or keyspace:
        for inspection only.
        """
        if query is None:
            query = RecordQuery(**filters)
        elif filters:
            query = dataclasses.replace(query, **filters)
        return self._list_records(query)

    def _list_records(self, query: RecordQuery) -> list[Record]:
        """The records ``query`` selects (each store's own listing)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list records")

    def stats(self, now: float) -> StoreStats:
        """Counts by operation and status at ``now`` (see :class:`StoreStats`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot count records")

    def archive_records(self, records: Sequence[Record], archived_at: float) -> int:
        """Copy ``records`` into this store's archive; return how many were new.

        Idempotent: a record already archived (same key hash and token) is skipped.
        """
        raise NotImplementedError(f"{type(self).__name__} has no archive")

    def archived_records(
        self, *, operation: str | None = None, limit: int = 100
    ) -> list[ArchivedRecord]:
        """Archived records, most recently archived first."""
        raise NotImplementedError(f"{type(self).__name__} has no archive")

    def __enter__(self) -> Store[OpT]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {redact(self.url)}>"


#: The methods through which a completion or failure reaches a store.
_SETTLES = ("complete", "acomplete", "fail", "afail", "_complete", "_fail")


def settles_expiry(store: Store[Any]) -> bool:
    """Whether ``store`` can move a record's expiry as it settles it: it says so
    (:attr:`Store.settle_expiry`), and every settling method it has, a subclass's
    override included, takes ``expires_at``. A subclass written before that
    argument existed then keeps the claim's expiry instead of failing after the
    handler ran."""
    if not store.settle_expiry:
        return False
    for name in _SETTLES:
        method = getattr(type(store), name, None)
        if method is None:
            continue
        try:
            parameters = inspect.signature(method).parameters.values()
        except (TypeError, ValueError):
            return False
        if not any(
            p.name == "expires_at" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            for p in parameters
        ):
            return False
    return True
