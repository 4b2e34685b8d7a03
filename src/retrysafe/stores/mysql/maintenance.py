"""The MySQL store's operations work (sweeper, CLI): sweeps in batches, listing,
counting and the archive. Sync, never on the request path."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any

from retrysafe._model.record import Record
from retrysafe.errors import StoreUnavailableError
from retrysafe.stores._base import ArchivedRecord, RecordQuery, StoreStats, SweepBatch
from retrysafe.stores._sql import list_clause, record_params
from retrysafe.stores.mysql.connection import DRIVER_ERRORS, UNAVAILABLE_ERRORS, Op, errno_of
from retrysafe.stores.mysql.schema import (
    ARCHIVE_SELECT,
    SELECT_COLUMNS,
    Names,
    archived_record,
    row_record,
)

__all__ = ["MySQLMaintenance"]

#: Times a sweep batch runs again after InnoDB chose it as a deadlock's victim.
_SWEEP_TRIES = 5
_DEADLOCK = 1213
#: Warnings an archive insert may raise: a duplicate key (the record is archived
#: already), and, under statement-based binary logging, the note that INSERT IGNORE …
#: SELECT is "unsafe" to replay (the archive's key makes it deterministic).
_HARMLESS = frozenset({1062, 1592})
#: "Binary logging not possible": statement-based logging at READ COMMITTED.
_ROW_LOGGING_ONLY = 1665


@contextmanager
def _transaction(conn: Any) -> Iterator[None]:
    """``BEGIN`` … ``COMMIT`` on ``conn``; ``ROLLBACK`` on an error (whose own failure,
    on a connection that died, leaves the first error standing)."""
    conn.begin()
    try:
        yield
    except BaseException:
        with suppress(*DRIVER_ERRORS):
            conn.rollback()
        raise
    conn.commit()


def _check_ignored(conn: Any, cur: Any) -> None:
    """Refuse an ``INSERT IGNORE`` that ignored more than duplicate keys (a value too
    long, say, which strict mode would have refused): the transaction rolls back."""
    if not cur.warning_count:
        return
    for _level, code, message in conn.show_warnings():
        if int(code) not in _HARMLESS:
            raise StoreUnavailableError(
                f"MySQL store: a record could not be archived as it is: {message}",
                transient=False,
            )


class MySQLMaintenance:
    """The operations half of :class:`~retrysafe.stores.mysql.MySQLStore`."""

    _names: Names
    _migrated: bool

    if TYPE_CHECKING:  # defined by MySQLConnections and MySQLStore

        def _run(self, op: Op) -> Any: ...
        def _take(self) -> Any: ...
        def _give(self, conn: Any, broken: bool = False) -> None: ...
        def _unavailable(self, exc: BaseException) -> StoreUnavailableError: ...
        def _ensure_migrated(self) -> None: ...

    def _build_maintenance_sql(self, names: Names) -> None:
        t, a = names.table, names.archive
        #: Set before each sweep batch (emptied on a server that logs statements).
        self._sweep_isolation = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"
        self._q_expired = (
            f"SELECT key_hash FROM {t} WHERE expires_at <= %s ORDER BY expires_at LIMIT %s "
            "FOR UPDATE SKIP LOCKED"
        )
        self._q_sweep_cells = f"DELETE FROM {names.cells} WHERE expires_at <= %s LIMIT %s"
        self._q_list = f"SELECT {SELECT_COLUMNS} FROM {t} AS t"
        self._q_list_archive = f"SELECT {ARCHIVE_SELECT} FROM {a} AS t"
        marks = ", ".join(["%s"] * (len(SELECT_COLUMNS.split(", ")) + 1))
        # The archive is keyed on (key hash, token): a record archived twice is one row.
        # IGNORE also turns a value that does not fit into a warning: _check_ignored
        # refuses the batch then.
        self._q_archive = f"INSERT IGNORE INTO {a} ({ARCHIVE_SELECT}) VALUES ({marks})"
        self._q_stats = (
            "SELECT operation, status, COUNT(*) FROM "
            f"{t} WHERE expires_at > %s GROUP BY operation, status",
            f"SELECT COUNT(*) FROM {t} WHERE expires_at <= %s",
            f"SELECT {SELECT_COLUMNS} FROM {t} WHERE status = 'processing' AND expires_at > %s "
            "ORDER BY created_at, key_hash LIMIT 1",
            f"SELECT COUNT(*) FROM {a}",
        )

    @contextmanager
    def _ops_connection(self) -> Iterator[Any]:
        """A connection for work of several statements or rows, the schema migrated."""
        self._ensure_migrated()
        try:
            conn = self._take()
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable(exc) from exc
        broken = True
        try:
            yield conn
            broken = False
        except DRIVER_ERRORS as exc:
            raise self._unavailable(exc) from exc
        finally:
            self._give(conn, broken)

    def _rows(self, query: str, params: Sequence[Any]) -> list[Any]:
        with self._ops_connection() as conn, conn.cursor() as cur:
            cur.execute(query, params)
            return list(cur.fetchall())

    def sweep(self, now: float, limit: int = 1000) -> SweepBatch:
        """One bounded sweep batch (see :meth:`Store.sweep`), in one transaction at READ
        COMMITTED: the oldest ``limit`` expired rows are locked (``SKIP LOCKED``: a row a
        claim holds is left for the next sweep, and no gap is locked, so only claims of
        the batch's own keys wait for it), their financial records copied to the
        archive, then deleted. Killed at any point, the batch rolls back whole.

        A server that logs statements (``binlog_format=STATEMENT``) refuses InnoDB
        writes at READ COMMITTED: the batch then runs at the session's own level,
        which the locked key list keeps as correct (it only adds gap locks)."""
        for attempt in range(_SWEEP_TRIES):
            try:
                return self._sweep_batch(now, limit)
            except StoreUnavailableError as exc:
                errno = errno_of(exc.__cause__) if exc.__cause__ is not None else None
                if errno == _ROW_LOGGING_ONLY and self._sweep_isolation:
                    self._sweep_isolation = ""
                    continue
                if errno != _DEADLOCK or attempt == _SWEEP_TRIES - 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _sweep_batch(self, now: float, limit: int) -> SweepBatch:
        t, a = self._names.table, self._names.archive
        with self._ops_connection() as conn, conn.cursor() as cur:
            if self._sweep_isolation:
                cur.execute(self._sweep_isolation)
            with _transaction(conn):
                cur.execute(self._q_expired, (now, limit))
                keys = [row[0] for row in cur.fetchall()]
                archived = deleted = 0
                if keys:
                    marks = ", ".join(["%s"] * len(keys))
                    # The rows are locked; expires_at is checked again all the same.
                    cur.execute(
                        f"INSERT IGNORE INTO {a} ({ARCHIVE_SELECT}) SELECT {SELECT_COLUMNS}, %s "
                        f"FROM {t} WHERE key_hash IN ({marks}) AND expires_at <= %s "
                        "AND retention = 'financial'",
                        (now, *keys, now),
                    )
                    _check_ignored(conn, cur)
                    archived = cur.rowcount
                    cur.execute(
                        f"DELETE FROM {t} WHERE key_hash IN ({marks}) AND expires_at <= %s",
                        (*keys, now),
                    )
                    deleted = cur.rowcount
            return SweepBatch(deleted, max(archived, 0), done=len(keys) < limit)

    def sweep_cells(self, now: float, limit: int = 1000) -> int:
        with self._ops_connection() as conn, conn.cursor() as cur:
            cur.execute(self._q_sweep_cells, (now, limit))
            return int(cur.rowcount)

    def _list_records(self, query: RecordQuery) -> list[Record]:
        clause, params = list_clause(query, mark="%s", alias="t")
        return [row_record(row) for row in self._rows(self._q_list + clause, params)]

    def stats(self, now: float) -> StoreStats:
        counts_q, expired_q, oldest_q, archived_q = self._q_stats
        stats = StoreStats()
        with self._ops_connection() as conn, conn.cursor() as cur:
            # One snapshot for every count.
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            cur.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY")
            try:
                cur.execute(counts_q, (now,))
                for operation, status, n in cur.fetchall():
                    stats.counts[(operation, status)] = int(n)
                cur.execute(expired_q, (now,))
                stats.expired = int(cur.fetchone()[0])
                cur.execute(oldest_q, (now,))
                row = cur.fetchone()
                stats.oldest_processing = None if row is None else row_record(row)
                cur.execute(archived_q)
                stats.archived = int(cur.fetchone()[0])
            finally:
                with suppress(*DRIVER_ERRORS):
                    conn.rollback()
        return stats

    def archive_records(self, records: Sequence[Record], archived_at: float) -> int:
        rows = [(*record_params(r), archived_at) for r in records]
        if not rows:
            return 0
        with self._ops_connection() as conn, conn.cursor() as cur, _transaction(conn):
            cur.executemany(self._q_archive, rows)  # one multi-row INSERT
            _check_ignored(conn, cur)
            return int(cur.rowcount)

    def archived_records(
        self, *, operation: str | None = None, limit: int = 100
    ) -> list[ArchivedRecord]:
        query = self._q_list_archive
        params: list[Any] = []
        if operation is not None:
            query += " WHERE t.operation = %s"
            params.append(operation)
        query += " ORDER BY t.archived_at DESC LIMIT %s"
        params.append(limit)
        return [archived_record(row) for row in self._rows(query, params)]
