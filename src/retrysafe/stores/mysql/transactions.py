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
  ``sql_mode``, ``time_zone``, the isolation level, ``SET NAMES``, ``USE``, a statement
  time limit, ``LOCK TABLES``, ``GET_LOCK``, ...) is undone, in the round trip of the
  ``COMMIT`` or ``ROLLBACK``, before a pooled connection goes back; a connection that
  cannot be restored is closed. Temporary tables and ``@`` variables are not;
- a failed ``ROLLBACK`` (the server dropped the connection, which rolls back) never
  hides the block's own exception;
- InnoDB rolls back a deadlock victim's whole transaction, and DDL, ``LOCK TABLES`` or a
  ``BEGIN`` commit it: the session is then outside the block's transaction, and the
  completion's ``UPDATE`` would commit on its own. ``BEGIN`` is followed by a savepoint,
  released in the completion's round trip before the ``UPDATE``: once the transaction
  has ended, the savepoint is gone, the release fails (1305) and the completion is
  refused (everything rolled back, the attempt retryable).
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
    _multi,
    aexecute,
    errno_of,
    execute,
)

__all__ = [
    "MySQLTransactions",
    "arun_guarded",
    "checked_connection",
    "completion_failed",
    "opening_failed",
    "run_guarded",
    "session_restore",
    "take_savepoint",
]

#: Sets the next transaction's access mode, which the server refuses inside a
#: transaction (ER_CANT_CHANGE_TX_CHARACTERISTICS): the check that a connection is idle.
_IDLE_CHECK = "SET TRANSACTION READ WRITE"
_IN_TRANSACTION = 1568
#: Taken right after ``BEGIN``: it exists as long as the transaction ``BEGIN`` opened.
_SAVEPOINT = "SAVEPOINT retrysafe_tx"
_RELEASE = "RELEASE SAVEPOINT retrysafe_tx"


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


def session_restore(server_info: str, charset: str, database: str) -> tuple[str, ...]:
    """The statements that put a pooled connection's session back as the pool made it
    (the store's statements rely on it): the character set, the database, the table
    locks and user-level locks (``GET_LOCK``) the block left, and, last, ``sql_mode``,
    ``time_zone``, autocommit, the server's default isolation, access mode, lock wait,
    safe-updates mode and statement time limit in one ``SET`` (which changes all or
    none).

    ``UNLOCK TABLES`` commits a transaction only under ``LOCK TABLES``, which has ended
    the block's transaction already (its completion is refused): before the ``COMMIT``
    of a completed block it holds no table lock and commits nothing."""
    mariadb = _MARIADB.search(server_info)
    version = (int(mariadb[1]), int(mariadb[2])) if mariadb else None
    tx = "tx_" if version and version < (11, 1) else "transaction_"  # MariaDB < 11.1
    limit = "max_statement_time" if version else "max_execution_time"  # MySQL's name
    defaults = (
        f"{tx}isolation",
        f"{tx}read_only",
        "innodb_lock_wait_timeout",
        "sql_safe_updates",
        limit,
    )
    reset = "".join(f", SESSION {name} = DEFAULT" for name in defaults)
    quoted = database.replace("`", "``")
    # RELEASE_ALL_LOCKS(): MariaDB 10.5 and MySQL 5.7 on.
    locks = () if version and version < (10, 5) else ("SELECT RELEASE_ALL_LOCKS()",)
    return (
        f"SET NAMES {charset}",
        f"USE `{quoted}`",
        "UNLOCK TABLES",
        *locks,
        f"{SESSION_SETUP}, SESSION autocommit = 1{reset}",
    )


def _ops(*statements: str) -> Op:
    """``statements`` in one round trip (one each on a connection without
    ``MULTI_STATEMENTS``): the first error stops them and is raised."""
    return Op(statements, [()] * len(statements), _nothing)


def _commit(restore: tuple[str, ...]) -> Op:
    """``COMMIT``, after the session's restore: a restore that fails stops before it
    (nothing committed). Turning autocommit back on commits the transaction itself, if
    the block had turned it off, with everything it wrote."""
    return _ops(*restore, "COMMIT")


def _rollback(restore: tuple[str, ...]) -> Op:
    """``ROLLBACK``, then the session's restore (before it, ``autocommit = 1`` would
    commit what the block wrote with autocommit off)."""
    return _ops("ROLLBACK", *restore)


def take_savepoint() -> Op:
    """The savepoint taken as the block's transaction begins: it exists as long as that
    transaction does, and :func:`run_guarded` releases it before the completion."""
    return _ops(_SAVEPOINT)


def _guarded(conn: Any, op: Op) -> tuple[Op, ...]:
    """The completion ``op``, after the release of the savepoint the block's transaction
    began with: an error (1305) stops it before the ``UPDATE`` when that transaction has
    ended. One round trip on a connection that takes several statements
    (``ROW_COUNT()`` then gives the ``UPDATE``'s count), else two."""
    if not _multi(conn) or not isinstance(op.query, str):
        return _ops(_RELEASE), op
    query = (_RELEASE, op.query, "SELECT ROW_COUNT()")
    return (
        Op(query, [(), op.params, ()], lambda _, row: op.parse(int(row[0]) if row else 0, None)),
    )


def run_guarded(conn: Any, op: Op) -> bool:
    """Run the completion ``op`` on ``conn`` once the savepoint of
    :func:`take_savepoint` is released: whether it landed. A driver error (1305 when the
    block's transaction has ended: a deadlock, an implicit commit) is raised as is."""
    for step in _guarded(conn, op):
        rowcount, row = execute(conn, step)
    return bool(step.parse(rowcount, row))


async def arun_guarded(conn: Any, op: Op) -> bool:
    """:func:`run_guarded` on an asyncmy connection."""
    for step in _guarded(conn, op):
        rowcount, row = await aexecute(conn, step)
    return bool(step.parse(rowcount, row))


def _runner(conn: Any) -> Transaction[Op]:
    def run(op: Op) -> bool:
        try:
            return run_guarded(conn, op)
        except DRIVER_ERRORS as exc:
            raise completion_failed(exc) from exc

    return Transaction(conn, run)


def _arunner(conn: Any) -> AsyncTransaction[Op]:
    async def run(op: Op) -> bool:
        try:
            return await arun_guarded(conn, op)
        except DRIVER_ERRORS as exc:
            raise completion_failed(exc) from exc

    return AsyncTransaction(conn, run)


class MySQLTransactions(MySQLConnections):
    """The transaction half of :class:`~retrysafe.stores.mysql.MySQLStore`: the
    application's block runs between ``BEGIN`` and ``COMMIT`` on a pooled connection,
    or on the caller's (PyMySQL sync, asyncmy async)."""

    def _restore(self, conn: Any, own: bool) -> tuple[str, ...]:
        """What puts ``conn``'s session back after a block: only a pooled connection's."""
        if not own:
            return ()
        kwargs = self._driver_kwargs()
        return session_restore(conn.get_server_info(), kwargs["charset"], kwargs["database"])

    @staticmethod
    def _opening(own: bool) -> tuple[Op, ...]:
        """``BEGIN`` and the savepoint; on the application's connection, after asking the
        server that it is idle (round trips of their own: the connection may not take
        several statements at once)."""
        begin = _ops("BEGIN", _SAVEPOINT)  # (take_savepoint)
        return (begin,) if own else (_ops(_IDLE_CHECK), begin)

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
        broken = own  # a pooled connection goes back only once its session is restored
        try:
            try:
                for op in self._opening(own):
                    execute(conn, op)
            except DRIVER_ERRORS as exc:
                raise opening_failed(exc, self) from exc
            restore = self._restore(conn, own)
            try:
                yield _runner(conn)
            except BaseException:
                # A ROLLBACK that cannot be sent (the server dropped the connection,
                # which rolls back) never hides the block's own exception.
                with contextlib.suppress(*DRIVER_ERRORS):
                    execute(conn, _rollback(restore))
                    broken = False
                raise
            try:
                execute(conn, _commit(restore))
            except DRIVER_ERRORS as exc:
                with contextlib.suppress(*DRIVER_ERRORS):
                    execute(conn, _rollback(()))
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
            conn = checked_connection(connection, asynchronous=True)
        broken = own
        try:
            try:
                for op in self._opening(own):
                    await aexecute(conn, op)
            except DRIVER_ERRORS as exc:
                raise opening_failed(exc, self) from exc
            restore = self._restore(conn, own)
            try:
                yield _arunner(conn)
            except BaseException:
                with contextlib.suppress(*DRIVER_ERRORS):
                    await aexecute(conn, _rollback(restore))
                    broken = False
                raise
            try:
                await aexecute(conn, _commit(restore))
            except DRIVER_ERRORS as exc:
                with contextlib.suppress(*DRIVER_ERRORS):
                    await aexecute(conn, _rollback(()))
                raise completion_failed(exc) from exc
            broken = False
        finally:
            if own:
                await self._agive(conn, broken)


def _nothing(rowcount: int, row: Any) -> None:
    return None
