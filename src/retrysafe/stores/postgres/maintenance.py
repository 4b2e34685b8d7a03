"""The PostgreSQL store's operations work (sweeper, CLI): sweeps, the partitioned
table's detach-archive-drop step, listing, counting and the archive."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, NamedTuple

import psycopg
from psycopg import sql

from retrysafe._model.record import Record
from retrysafe.stores._base import ArchivedRecord, RecordQuery, StoreStats, SweepBatch
from retrysafe.stores._sql import list_clause
from retrysafe.stores.postgres.connection import _Op, store_cursor
from retrysafe.stores.postgres.rows import (
    archived_record,
    pack_digest,
    pack_record_key,
    row_params,
    row_record,
    status_code,
    status_value,
    unpack_digest,
)
from retrysafe.stores.postgres.schema import _DDL_LOCK_TIMEOUT, _Names, _PNames

__all__ = ["PostgresMaintenance"]

log = logging.getLogger("retrysafe")


class _Partition(NamedTuple):
    """An attached partition: its qualified name, bounds, and whether a detach is pending."""

    name: sql.Identifier
    lower: float
    upper: float
    pending: bool


_BOUNDS = re.compile(r"FROM \('([^']+)'\) TO \('([^']+)'\)")


def _scalar(cur: psycopg.Cursor[Any]) -> Any:
    """The first column of the one row a function call or an aggregate returns."""
    row = cur.fetchone()
    assert row is not None
    return row[0]


class PostgresMaintenance:
    """The operations half of :class:`PostgresStore`: sync, never on the request path.

    It uses the statements and names that :class:`PostgresStore` composes, and the
    executors of :class:`~retrysafe.stores.postgres.connection.PostgresConnections`.
    """

    # Set by PostgresStore.__init__ and _build_sql.
    partitioned: bool
    _where: str
    _names: _Names
    _pnames: _PNames
    _table_name: str
    _cols: sql.Composed
    _archive_cols: sql.Composed
    _q_sweep: str
    _q_cells_index: str
    _q_cells_sweep: str
    _q_leftovers: str
    _leftover_args: tuple[str, str, str]
    _q_add_partition: str
    _q_partitions: str
    _q_refresh: str
    _q_list: sql.Composed
    _q_list_archive: sql.Composed
    _q_stats: list[str]
    _q_archive: str

    if TYPE_CHECKING:  # defined by PostgresConnections and PostgresStore

        def _run(self, op: _Op) -> Any: ...
        def _ops_connection(self) -> AbstractContextManager[psycopg.Connection[Any]]: ...
        def _ops_rows(self, query: str | sql.Composed, params: Sequence[Any]) -> list[Any]: ...
        def _lowers_ahead(self, now: float, have: set[float]) -> Iterator[float]: ...

    def sweep(self, now: float, limit: int = 1000) -> SweepBatch:
        """One bounded sweep step (see :meth:`Store.sweep`).

        A partitioned table deletes no rows one by one: a step drops at most one
        partition that holds only expired records, however many (``limit`` bounds
        row deletes, so it does not apply), after finishing what an interrupted
        sweep left behind; see :meth:`_psweep`.
        """
        if self.partitioned:
            return self._psweep(now)

        def parse(rowcount: int, row: Sequence[Any] | None) -> SweepBatch:
            assert row is not None
            deleted, archived = int(row[0]), int(row[1])
            return SweepBatch(deleted, archived, done=deleted < limit)

        return self._run(_Op(self._q_sweep, (now, limit, now, now), parse))

    def sweep_cells(self, now: float, limit: int = 1000) -> int:
        with self._ops_connection() as conn:
            cur = store_cursor(conn)
            try:
                cur.execute(self._q_cells_index)
            except psycopg.errors.UndefinedTable:
                return 0  # no guard has written a cell yet
            except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject):
                pass  # another sweeper created the index at the same moment
            cur.execute(self._q_cells_sweep, (now, limit, now))
            return int(cur.rowcount)

    def _psweep(self, now: float) -> SweepBatch:
        """A sweep step on the partitioned table: detach, archive, drop.

        1. Finish an interrupted sweep: a detach left pending is finalized, and a
           detached partition (found by name, comment and catalog) is archived and
           dropped like any other; that is the whole step.
        2. Create the partitions missing up to ``now + partition_ahead + 2 intervals``.
        3. Take the oldest attached partition whose upper bound is <= ``now`` (its
           rows are all expired): ``DETACH PARTITION … CONCURRENTLY``, then in one
           transaction copy its financial rows to the archive (``ON CONFLICT DO
           NOTHING``), count its rows and ``DROP`` it.

        Detach before archive before drop: a sweep killed at any point leaves either
        an attached partition, a pending detach or a detached table, and the next
        step goes on from there; the archive's key absorbs a second copy. Claims
        are never blocked: a concurrent detach locks the parent in SHARE UPDATE
        EXCLUSIVE mode, new queries stop seeing the partition at once, and it waits
        for the ones that still do; the drop locks only the detached table. Every
        lock wait is bounded by ``lock_timeout``; a step that times out (a long
        transaction on the table) stops there and reports done, and the next sweep
        takes it up. Only one sweep works on a table at a time (a session advisory
        lock); another one returns at once with nothing done.
        """
        pn = self._pnames
        deleted = archived = 0
        with self._ops_connection() as conn:
            cur = conn.cursor()
            if not _scalar(cur.execute("SELECT pg_try_advisory_lock(%s)", (pn.sweep_lock,))):
                return SweepBatch(0, 0, done=True)
            try:
                cur.execute("SELECT set_config('lock_timeout', %s, false)", (_DDL_LOCK_TIMEOUT,))
                parts = self._partitions(cur)
                for part in parts:
                    if part.pending:
                        cur.execute(
                            sql.SQL("ALTER TABLE {} DETACH PARTITION {} FINALIZE").format(
                                self._names.table, part.name
                            )
                        )
                leftovers = cur.execute(self._q_leftovers, self._leftover_args).fetchall()
                for schema, name in leftovers:
                    rows, copied = self._archive_and_drop(conn, sql.Identifier(schema, name), now)
                    deleted += rows
                    archived += copied
                if leftovers:
                    return SweepBatch(deleted, archived, done=False)

                have = {p.lower for p in parts if not p.pending}
                attached = False
                for lower in self._lowers_ahead(now, have):
                    row = cur.execute(self._q_add_partition, (lower,)).fetchone()
                    attached = attached or (row is not None and row[0] is not None)
                if attached:
                    self._refresh(cur)

                expired = sorted(
                    (p for p in parts if not p.pending and p.upper <= now), key=lambda p: p.upper
                )
                if not expired:
                    return SweepBatch(0, 0, done=True)
                cur.execute(
                    sql.SQL("ALTER TABLE {} DETACH PARTITION {} CONCURRENTLY").format(
                        self._names.table, expired[0].name
                    )
                )
                self._refresh(cur)
                rows, copied = self._archive_and_drop(conn, expired[0].name, now)
                return SweepBatch(rows, copied, done=len(expired) == 1)
            except psycopg.errors.LockNotAvailable:
                return SweepBatch(deleted, archived, done=True)
            finally:
                cur.execute("RESET lock_timeout")
                cur.execute("SELECT pg_advisory_unlock(%s)", (pn.sweep_lock,))

    def _partitions(self, cur: psycopg.Cursor[Any]) -> list[_Partition]:
        """The partitions attached to the table (or with a detach pending), from the catalog."""
        found = []
        for schema, name, pending, bound in cur.execute(self._q_partitions, (self._table_name,)):
            match = _BOUNDS.search(bound or "")
            if match is not None:  # not a range with finite bounds: not one of ours
                lower, upper = float(match.group(1)), float(match.group(2))
                found.append(_Partition(sql.Identifier(schema, name), lower, upper, pending))
        return found

    def _refresh(self, cur: Any) -> None:
        """The sweep's :meth:`_refreshed`: a failure is logged and the sweep goes on."""
        try:
            cur.execute(self._q_refresh)
        except psycopg.Error as exc:
            log.info("retrysafe: could not refresh %s's partitions: %s", self._where, exc)

    def _archive_and_drop(
        self, conn: psycopg.Connection[Any], part: sql.Identifier, now: float
    ) -> tuple[int, int]:
        """Copy a detached partition's financial rows to the archive, count its rows and
        drop it, in one transaction: (rows, newly archived)."""
        moved = sql.SQL(
            "WITH archived AS (INSERT INTO {archive} ({archive_cols}) "
            "SELECT {cols}, %s FROM {part} WHERE retention = 'financial' "
            "ON CONFLICT (key_hash, token) DO NOTHING RETURNING 1) "
            "SELECT (SELECT count(*) FROM {part}), (SELECT count(*) FROM archived)"
        ).format(
            archive=self._names.archive, archive_cols=self._archive_cols, cols=self._cols, part=part
        )
        with conn.transaction():
            cur = conn.cursor()
            counts = cur.execute(moved, (now,)).fetchone()
            assert counts is not None  # the SELECT always returns its one row
            rows, copied = counts
            cur.execute(sql.SQL("DROP TABLE {}").format(part))
        return int(rows), int(copied)

    def _list_records(self, query: RecordQuery) -> list[Record]:
        clause, params = list_clause(
            query, mark="%s", alias="t", status=status_code, key=pack_record_key
        )
        rows = self._ops_rows(self._q_list + sql.SQL(clause), params)
        return [row_record(row) for row in rows]

    def stats(self, now: float) -> StoreStats:
        counts_q, expired_q, get_q, archived_q = self._q_stats
        stats = StoreStats()
        oldest: tuple[float, str] | None = None
        with self._ops_connection() as conn, conn.transaction():
            cur = store_cursor(conn)
            # One snapshot for every count.
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            for operation, status, n, created_at, key_hash in cur.execute(counts_q, (now,)):
                stats.counts[(operation, status_value(status))] = int(n)
                if key_hash is not None and (oldest is None or created_at < oldest[0]):
                    oldest = (created_at, unpack_digest(key_hash))
            stats.expired = int(_scalar(cur.execute(expired_q, (now,))))
            if oldest is not None:
                row = cur.execute(get_q, (pack_digest(oldest[1]),)).fetchone()
                stats.oldest_processing = None if row is None else row_record(row)
            stats.archived = int(_scalar(cur.execute(archived_q)))
        return stats

    def archive_records(self, records: Sequence[Record], archived_at: float) -> int:
        rows = [(*row_params(r), archived_at) for r in records]
        if not rows:
            return 0
        with self._ops_connection() as conn, conn.transaction():
            cur = store_cursor(conn)
            cur.executemany(self._q_archive, rows)  # pipelined; rowcount sums the inserts
            return cur.rowcount

    def archived_records(
        self, *, operation: str | None = None, limit: int = 100
    ) -> list[ArchivedRecord]:
        query = self._q_list_archive
        params: list[Any] = []
        if operation is not None:
            query += sql.SQL(" WHERE t.operation = %s")
            params.append(operation)
        query += sql.SQL(" ORDER BY t.archived_at DESC LIMIT %s")
        params.append(limit)
        return [archived_record(row) for row in self._ops_rows(query, params)]
