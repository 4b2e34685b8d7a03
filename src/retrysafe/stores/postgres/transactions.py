"""The PostgreSQL store's application transactions: a completion that commits with the
application's own writes (see retrysafe._core.transactions)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import psycopg

from retrysafe.errors import StoreUnavailableError
from retrysafe.stores._base import AsyncTransaction, Transaction
from retrysafe.stores.postgres.connection import UNAVAILABLE_ERRORS, PostgresConnections, _Op

__all__ = ["PostgresTransactions", "completion_failed", "require_idle"]


def require_idle(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """ValueError unless ``conn`` is outside any transaction (retrysafe begins and commits it)."""
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise ValueError("the connection is inside a transaction already; commit it first")


def completion_failed(exc: BaseException) -> StoreUnavailableError:
    """The completion statement failed: the transaction rolls back, the attempt stays retryable.

    A row moved to another partition meanwhile (partitioned tables) or a
    connection to another database (no such table) end here.
    """
    return StoreUnavailableError(
        f"PostgreSQL store: the completion could not be written in this transaction "
        f"({type(exc).__name__}: {exc}); nothing was committed. A connection you pass "
        "must be to the store's database, with its table on the search path"
    )


def _completion_runner(conn: psycopg.Connection[Any]) -> Transaction[_Op]:
    def run(op: _Op) -> bool:
        try:
            cur = conn.execute(op.query, op.params)
        except UNAVAILABLE_ERRORS as exc:
            raise completion_failed(exc) from exc
        return bool(op.parse(cur.rowcount, None))

    return Transaction(conn, run)


def _acompletion_runner(conn: psycopg.AsyncConnection[Any]) -> AsyncTransaction[_Op]:
    async def run(op: _Op) -> bool:
        try:
            cur = await conn.execute(op.query, op.params)
        except UNAVAILABLE_ERRORS as exc:
            raise completion_failed(exc) from exc
        return bool(op.parse(cur.rowcount, None))

    return AsyncTransaction(conn, run)


def _is_idle(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    return conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


class PostgresTransactions(PostgresConnections):
    """The transaction half of :class:`PostgresStore`: the application's block runs in a
    ``conn.transaction()`` on a pooled connection, or on the caller's."""

    @contextmanager
    def completion_transaction(
        self, connection: psycopg.Connection[Any] | None = None
    ) -> Iterator[Transaction[_Op]]:
        with self._transaction_connection(connection) as conn, conn.transaction():
            yield _completion_runner(conn)

    @asynccontextmanager
    async def acompletion_transaction(
        self, connection: psycopg.AsyncConnection[Any] | None = None
    ) -> AsyncIterator[AsyncTransaction[_Op]]:
        async with self._atransaction_connection(connection) as conn, conn.transaction():
            yield _acompletion_runner(conn)

    @contextmanager
    def _transaction_connection(
        self, connection: psycopg.Connection[Any] | None
    ) -> Iterator[psycopg.Connection[Any]]:
        if connection is not None:
            require_idle(connection)
            yield connection
            return
        # Only taking the connection maps errors to StoreUnavailableError: the
        # application's own statements raise their own errors (a unique violation).
        try:
            conn = self._take()
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable(exc) from exc
        broken = True
        try:
            yield conn
        finally:
            # Back to the pool without what the block set for the session (SET, say).
            try:
                if _is_idle(conn):
                    conn.execute("RESET ALL")
                    broken = False
            except psycopg.Error:
                pass
            self._give(conn, broken)

    @asynccontextmanager
    async def _atransaction_connection(
        self, connection: psycopg.AsyncConnection[Any] | None
    ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        if connection is not None:
            require_idle(connection)
            yield connection
            return
        try:
            conn = await self._atake()
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable(exc) from exc
        broken = True
        try:
            yield conn
        finally:
            try:
                if _is_idle(conn):
                    await conn.execute("RESET ALL")
                    broken = False
            except psycopg.Error:
                pass
            await self._agive(conn, broken)
