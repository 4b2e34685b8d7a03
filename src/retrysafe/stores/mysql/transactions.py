"""The MySQL store's application transactions: a completion that commits with the
application's own writes in InnoDB (see retrysafe._core.transactions)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from retrysafe.errors import StoreUnavailableError
from retrysafe.stores._base import AsyncTransaction, Transaction
from retrysafe.stores.mysql.connection import (
    DRIVER_ERRORS,
    UNAVAILABLE_ERRORS,
    MySQLConnections,
    Op,
    aexecute,
    execute,
)

__all__ = ["MySQLTransactions", "completion_failed", "require_idle"]

#: The server's status flag for an open transaction (SERVER_STATUS_IN_TRANS).
_IN_TRANS = 1


def require_idle(conn: Any) -> None:
    """ValueError unless ``conn`` is outside any transaction: MySQL's ``BEGIN`` would
    silently commit what it holds."""
    status = getattr(conn, "server_status", None)
    if status is None:
        raise TypeError(
            f"a MySQL store's transaction takes a PyMySQL or asyncmy connection, "
            f"not {type(conn).__name__}"
        )
    if status & _IN_TRANS:
        raise ValueError("the connection is inside a transaction already; commit it first")


def completion_failed(exc: BaseException) -> StoreUnavailableError:
    """The completion, or the COMMIT, failed: nothing was committed, the attempt stays
    retryable."""
    return StoreUnavailableError(
        f"MySQL store: the completion could not be committed in this transaction "
        f"({type(exc).__name__}: {exc}); nothing was committed. A connection you pass "
        "must be to the store's database"
    )


def _runner(conn: Any) -> Transaction[Op]:
    def run(op: Op) -> bool:
        try:
            rowcount, _ = execute(conn, op)
        except DRIVER_ERRORS as exc:
            raise completion_failed(exc) from exc
        return bool(op.parse(rowcount, None))

    return Transaction(conn, run)


def _arunner(conn: Any) -> AsyncTransaction[Op]:
    async def run(op: Op) -> bool:
        try:
            rowcount, _ = await aexecute(conn, op)
        except DRIVER_ERRORS as exc:
            raise completion_failed(exc) from exc
        return bool(op.parse(rowcount, None))

    return AsyncTransaction(conn, run)


class MySQLTransactions(MySQLConnections):
    """The transaction half of :class:`~retrysafe.stores.mysql.MySQLStore`: the
    application's block runs between ``BEGIN`` and ``COMMIT`` on a pooled connection,
    or on the caller's (PyMySQL sync, asyncmy async)."""

    @contextmanager
    def completion_transaction(self, connection: Any = None) -> Iterator[Transaction[Op]]:
        own = connection is None
        if own:
            self._ensure_migrated()
            try:
                conn = self._take()
            except UNAVAILABLE_ERRORS as exc:
                raise self._unavailable(exc) from exc
        else:
            require_idle(connection)
            conn = connection
        broken = own
        try:
            conn.begin()
            try:
                yield _runner(conn)
            except BaseException:
                conn.rollback()
                raise
            try:
                conn.commit()
            except DRIVER_ERRORS as exc:
                raise completion_failed(exc) from exc
            broken = False
        finally:
            if own:
                self._give(conn, broken)

    @asynccontextmanager
    async def acompletion_transaction(
        self, connection: Any = None
    ) -> AsyncIterator[AsyncTransaction[Op]]:
        own = connection is None
        if own:
            await self._aensure_migrated()
            try:
                conn = await self._atake()
            except UNAVAILABLE_ERRORS as exc:
                raise self._unavailable(exc) from exc
        else:
            require_idle(connection)
            conn = connection
        broken = own
        try:
            await conn.begin()
            try:
                yield _arunner(conn)
            except BaseException:
                await conn.rollback()
                raise
            try:
                await conn.commit()
            except DRIVER_ERRORS as exc:
                raise completion_failed(exc) from exc
            broken = False
        finally:
            if own:
                await self._agive(conn, broken)
