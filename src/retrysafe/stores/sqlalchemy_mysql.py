"""The MySQL/MariaDB store on a SQLAlchemy engine (``mysql+pymysql://`` or
``mariadb+pymysql://``; ``mysql+asyncmy://`` for an AsyncEngine).

Imported by :class:`retrysafe.stores.sqlalchemy.SQLAlchemyStore` when the engine is
MySQL or MariaDB, so that the other stores need no MySQL driver.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.util import greenlet_spawn

from retrysafe.errors import StoreUnavailableError
from retrysafe.stores.mysql import SCHEMA_VERSION, MySQLStore
from retrysafe.stores.mysql.connection import DRIVER_ERRORS, Op, aexecute, execute
from retrysafe.stores.mysql.transactions import completion_failed, run_guarded, take_savepoint
from retrysafe.stores.mysql_borrowed import (
    SQL_MODE_QUERY,
    committed_migration,
    drive_migration,
    session_refusal,
)
from retrysafe.stores.sqlalchemy import (
    AnyEngine,
    SQLAlchemyStore,
    _borrowed_error,
    lending_engine,
    sync_engine,
)

__all__ = ["SQLAlchemyMySQLStore"]

#: The server's status flag for autocommit mode (SERVER_STATUS_AUTOCOMMIT).
_AUTOCOMMIT = 2
#: Where a pooled connection's checked ``sql_mode`` is kept (its pool record's ``info``,
#: which lives as long as the DB-API connection).
_MODE = "retrysafe_sql_mode"
#: The connection's transaction in which the completion's savepoint was taken (a weak
#: reference, in the pool record's ``info``).
_SAVEPOINT_OF = "retrysafe_savepoint_of"


def _release(fairy: Any, broken: bool, ended: bool) -> None:
    """Give a borrowed pool connection back: a broken one is invalidated (closed, and the
    server rolls back what it held); one whose transaction the store ended (``ended``)
    goes back without the pool's reset ``ROLLBACK`` (a round trip for nothing)."""
    if broken:
        fairy.invalidate()
        fairy.close()
        return
    close_special = getattr(fairy, "_close_special", None)  # SQLAlchemy's own checkin
    if ended and close_special is not None:
        close_special(transaction_reset=True)
    else:
        fairy.close()


class SQLAlchemyMySQLStore(SQLAlchemyStore, MySQLStore):
    """The MySQL/MariaDB store on a SQLAlchemy engine's pool (PyMySQL; asyncmy for an
    AsyncEngine).

    Each operation borrows a connection from the engine's pool and gives it back. The
    connection keeps the application's session: its statements run one by one (no
    multi-statement flag), in the connection's implicit transaction, ended by a
    ``COMMIT`` before it goes back (skipped when the engine is in ``AUTOCOMMIT``): a
    claim is ``INSERT``, ``SELECT``, ``COMMIT``; a completion or a replay is its
    statement and ``COMMIT``. The session must be strict (see
    :mod:`retrysafe.stores.mysql_borrowed`); its ``sql_mode`` is read once per pooled
    connection. ``options`` are :class:`MySQLStore`'s (``table``, ``auto_migrate``,
    ``max_size``, ``connect_timeout``). The sync methods of a store on an AsyncEngine
    (sweeps, stats, ``get``) use a small pool of the store's own (PyMySQL) to the
    same database.
    """

    def __init__(self, engine: AnyEngine, **options: Any) -> None:
        sync = lending_engine(engine, "mysql", "MySQL")
        url = sync.url.set(drivername="mysql", query={})
        charset = sync.url.query.get("charset")
        native = url.render_as_string(hide_password=False)
        if isinstance(charset, str):
            native += f"?charset={charset}"
        super().__init__(native, **options)
        self._on_engine(engine)
        self._where = f"{sync.url!r} (table {self.table})"
        self._borrowed: dict[int, Any] = {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {sync_engine(self.engine).url!r} table={self.table}>"

    # -- connections: borrowed from the engine ------------------------------------------

    def _refused(self, info: dict[str, Any], sql_mode: Any) -> None:
        if isinstance(sql_mode, bytes):
            sql_mode = sql_mode.decode()
        refusal = session_refusal(str(sql_mode or ""), f"{type(self).__name__} at {self._where}")
        if refusal is not None:
            raise refusal
        info[_MODE] = sql_mode

    def _take(self) -> Any:
        if self.is_async:  # a pool of the store's own: a thread cannot await the driver
            return super()._take()
        fairy = self._borrow(raw=True)
        try:
            conn = fairy.driver_connection
            if _MODE not in fairy.info:
                self._refused(fairy.info, _first_cell(execute(conn, _mode_op())))
        except BaseException:
            _release(fairy, True, False)
            raise
        self._borrowed[id(conn)] = fairy
        return conn

    def _give(self, conn: Any, broken: bool = False) -> None:
        fairy = self._borrowed.pop(id(conn), None)
        if fairy is None:  # the fallback pool's (an AsyncEngine's store)
            super()._give(conn, broken)
            return
        try:
            if not broken and not conn.server_status & _AUTOCOMMIT:
                conn.commit()
        except BaseException:
            broken = True
            raise
        finally:
            _release(fairy, broken, True)

    async def _atake(self) -> Any:
        try:
            fairy = await greenlet_spawn(sync_engine(self.engine).raw_connection)
        except SQLAlchemyError as exc:
            raise _borrowed_error(self, exc) from exc
        try:
            conn = fairy.driver_connection
            if _MODE not in fairy.info:
                self._refused(fairy.info, _first_cell(await aexecute(conn, _mode_op())))
        except BaseException:
            await greenlet_spawn(_release, fairy, True, False)
            raise
        self._borrowed[id(conn)] = fairy
        return conn

    async def _agive(self, conn: Any, broken: bool = False) -> None:
        fairy = self._borrowed.pop(id(conn))
        try:
            if not broken and not conn.server_status & _AUTOCOMMIT:
                await conn.commit()
        except BaseException:
            broken = True
            raise
        finally:
            await greenlet_spawn(_release, fairy, broken, True)

    async def _arun(self, op: Any) -> Any:
        if not self.is_async:
            return await asyncio.to_thread(self._run, op)
        return await super()._arun(op)

    def _migration(self) -> Any:
        return committed_migration(super()._migration())

    def create_on(self, conn: Connection) -> int:
        """Create or upgrade the tables through ``conn`` (MySQL commits each DDL statement
        by itself, and what the connection's transaction held before it)."""
        drive_migration(conn.connection.dbapi_connection, self._migration())
        self._migrated = True
        return SCHEMA_VERSION

    # -- the application transaction ------------------------------------------------------

    def _joinable(self, session: Any) -> Connection:
        """The base's, and, once per transaction of the connection (as the block begins),
        the savepoint the completion releases first: a deadlock or an implicit commit in
        the block ends the transaction and the savepoint, and the completion is refused
        (see retrysafe.stores.mysql.transactions)."""
        conn = super()._joinable(session)
        fairy, tx = conn.connection, conn.get_transaction()
        taken = fairy.info.get(_SAVEPOINT_OF)
        if taken is None or taken() is not tx:
            try:
                execute(fairy.dbapi_connection, take_savepoint())
            except DRIVER_ERRORS as exc:
                raise completion_failed(exc) from exc
            fairy.info[_SAVEPOINT_OF] = weakref.ref(tx)
        return conn

    def _complete_in(self, conn: Connection, op: Any) -> bool:
        fairy = conn.connection
        dbapi = fairy.dbapi_connection
        fairy.info.pop(_SAVEPOINT_OF, None)  # released below, or gone with the transaction
        try:
            if _MODE not in fairy.info:
                self._refused(fairy.info, _first_cell(execute(dbapi, _mode_op())))
            return run_guarded(dbapi, op)
        except StoreUnavailableError:
            raise
        except DRIVER_ERRORS as exc:
            raise completion_failed(exc) from exc


def _mode_op() -> Op:
    return Op(SQL_MODE_QUERY, (), lambda rowcount, row: row)


def _first_cell(answer: tuple[int, Any]) -> Any:
    row = answer[1]
    return None if row is None else row[0]
