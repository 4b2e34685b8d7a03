"""The MySQL store's application transactions: a completion that commits with the
application's own writes in InnoDB (see retrysafe._core.transactions).

The block runs between ``BEGIN`` and ``COMMIT`` on a connection of the store's pool
(PyMySQL sync, asyncmy async) or on the application's own. Three things differ from
PostgreSQL:

- ``BEGIN`` silently commits a transaction that is open already, so the application's
  connection is asked first, by the server: ``SET TRANSACTION READ WRITE`` (the next
  transaction's mode) is refused inside a transaction, read-only ones included. The
  drivers' cached status flag cannot tell: a result set's status misses a read-only
  transaction, and asyncmy never records a status of 0 (autocommit off, idle);
- the session is the connection's: what the block sets (``SET autocommit = 0``,
  ``sql_mode``, ``time_zone``, the isolation level, ``SET NAMES``, ``USE``, ...) is undone,
  in the round trip of the ``COMMIT`` or ``ROLLBACK``, before a pooled connection goes
  back; a connection that cannot be restored is closed;
- a failed ``ROLLBACK`` (the server dropped the connection, which rolls back) never
  hides the block's own exception.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pymysql.connections

from retrysafe.errors import StoreUnavailableError
from retrysafe.stores._base import AsyncTransaction, Transaction
from retrysafe.stores.mysql.connection import (
    DRIVER_ERRORS,
    SESSION_SETUP,
    UNAVAILABLE_ERRORS,
    MySQLConnections,
    Op,
    aexecute,
    errno_of,
    execute,
)

__all__ = [
    "MySQLTransactions",
    "checked_connection",
    "completion_failed",
    "opening_failed",
    "session_restore",
]

#: Sets the next transaction's access mode, which the server refuses inside a
#: transaction (ER_CANT_CHANGE_TX_CHARACTERISTICS): the check that a connection is idle.
_IDLE_CHECK = "SET TRANSACTION READ WRITE"
_IN_TRANSACTION = 1568


def opening_failed(exc: BaseException, store: MySQLConnections) -> Exception:
    """What the caller gets when the check or ``BEGIN`` failed: ValueError for a
    connection inside a transaction (``BEGIN`` would silently commit what it holds),
    else StoreUnavailableError."""
    if errno_of(exc) == _IN_TRANSACTION:
        return ValueError("the connection is inside a transaction already; commit it first")
    return store._unavailable(exc)


def checked_connection(conn: Any, asynchronous: bool) -> Any:
    """``conn`` if it is a connection of the driver the store's transactions drive
    (PyMySQL sync, asyncmy async), else TypeError."""
    if asynchronous:
        import asyncmy.connection  # the async driver: an extra of its own

        expected: type[Any] = asyncmy.connection.Connection
        wanted = "att.atransaction() takes an asyncmy connection (att.transaction(): PyMySQL)"
    else:
        expected = pymysql.connections.Connection
        wanted = "att.transaction() takes a PyMySQL connection (att.atransaction(): asyncmy)"
    if not isinstance(conn, expected):
        kind = type(conn)
        raise TypeError(f"a MySQL store's {wanted}, not {kind.__module__}.{kind.__qualname__}")
    return conn


def completion_failed(exc: BaseException) -> StoreUnavailableError:
    """The completion, or the COMMIT, failed: nothing was committed, the attempt stays
    retryable."""
    return StoreUnavailableError(
        f"MySQL store: the completion could not be committed in this transaction "
        f"({type(exc).__name__}: {exc}); nothing was committed. A connection you pass "
        "must be to the store's database"
    )


_MARIADB = re.compile(r"(\d+)\.(\d+)\.\d+-MariaDB")


def session_restore(server_info: str, charset: str, database: str) -> str:
    """The statements that put a pooled connection's session back as the pool made it
    (the store's statements rely on it): autocommit, ``sql_mode``, ``time_zone``, the
    server's default isolation, access mode, lock wait and safe-updates mode, the
    character set and the database."""
    mariadb = _MARIADB.search(server_info)
    old_mariadb = mariadb is not None and (int(mariadb[1]), int(mariadb[2])) < (11, 1)
    tx = "tx_" if old_mariadb else "transaction_"  # MariaDB before 11.1: tx_isolation
    defaults = (f"{tx}isolation", f"{tx}read_only", "innodb_lock_wait_timeout", "sql_safe_updates")
    reset = "".join(f", SESSION {name} = DEFAULT" for name in defaults)
    quoted = database.replace("`", "``")
    return f"{SESSION_SETUP}, SESSION autocommit = 1{reset}; SET NAMES {charset}; USE `{quoted}`"


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


def _end(conn: Any, verb: str, restore: str | None) -> bool:
    """``verb`` (``COMMIT``, ``ROLLBACK``), then ``restore`` in the same round trip:
    raises if ``verb`` failed; False if the session could not be restored. Without
    ``restore`` (the application's connection), the driver's own ``commit()`` or
    ``rollback()``."""
    if restore is None:
        getattr(conn, verb.lower())()
        return True
    cur = conn.cursor()
    try:
        cur.execute(f"{verb}; {restore}")
        try:
            while cur.nextset():
                pass
        except DRIVER_ERRORS:
            return False
        return True
    finally:
        with contextlib.suppress(*DRIVER_ERRORS):
            cur.close()


async def _aend(conn: Any, verb: str, restore: str | None) -> bool:
    """:func:`_end` on an asyncmy connection."""
    if restore is None:
        await getattr(conn, verb.lower())()
        return True
    cur = conn.cursor()
    try:
        await cur.execute(f"{verb}; {restore}")
        try:
            while await cur.nextset():
                pass
        except DRIVER_ERRORS:
            return False
        return True
    finally:
        with contextlib.suppress(*DRIVER_ERRORS):
            await cur.close()


def _rolled_back(conn: Any, restore: str | None) -> bool:
    """Roll back; False if that failed (the server rolls back a connection it lost) or
    the session could not be restored: the connection must not be reused."""
    try:
        return _end(conn, "ROLLBACK", restore)
    except DRIVER_ERRORS:
        return False


async def _arolled_back(conn: Any, restore: str | None) -> bool:
    try:
        return await _aend(conn, "ROLLBACK", restore)
    except DRIVER_ERRORS:
        return False


class MySQLTransactions(MySQLConnections):
    """The transaction half of :class:`~retrysafe.stores.mysql.MySQLStore`: the
    application's block runs between ``BEGIN`` and ``COMMIT`` on a pooled connection,
    or on the caller's (PyMySQL sync, asyncmy async)."""

    def _restore(self, conn: Any, own: bool) -> str | None:
        """What puts ``conn``'s session back after a block: only a pooled connection's."""
        if not own:
            return None
        kwargs = self._driver_kwargs()
        return session_restore(conn.get_server_info(), kwargs["charset"], kwargs["database"])

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
            conn = checked_connection(connection, asynchronous=False)
        broken = own
        try:
            try:
                if not own:
                    execute(conn, Op(_IDLE_CHECK, (), _nothing))
                execute(conn, Op("BEGIN", (), _nothing))
            except DRIVER_ERRORS as exc:
                raise opening_failed(exc, self) from exc
            restore = self._restore(conn, own)
            try:
                yield _runner(conn)
            except BaseException:
                broken = not _rolled_back(conn, restore)
                raise
            try:
                broken = not _end(conn, "COMMIT", restore)
            except DRIVER_ERRORS as exc:
                _rolled_back(conn, None)
                raise completion_failed(exc) from exc
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
            conn = checked_connection(connection, asynchronous=True)
        broken = own
        try:
            try:
                if not own:
                    await aexecute(conn, Op(_IDLE_CHECK, (), _nothing))
                await aexecute(conn, Op("BEGIN", (), _nothing))
            except DRIVER_ERRORS as exc:
                raise opening_failed(exc, self) from exc
            restore = self._restore(conn, own)
            try:
                yield _arunner(conn)
            except BaseException:
                broken = not await _arolled_back(conn, restore)
                raise
            try:
                broken = not await _aend(conn, "COMMIT", restore)
            except DRIVER_ERRORS as exc:
                await _arolled_back(conn, None)
                raise completion_failed(exc) from exc
        finally:
            if own:
                await self._agive(conn, broken)


def _nothing(rowcount: int, row: Any) -> None:
    return None
