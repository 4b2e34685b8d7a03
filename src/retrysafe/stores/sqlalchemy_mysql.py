"""The MySQL/MariaDB store on a SQLAlchemy engine (``mysql+pymysql://`` or
``mariadb+pymysql://``; ``mysql+asyncmy://`` for an AsyncEngine).

Imported by :class:`retrysafe.stores.sqlalchemy.SQLAlchemyStore` when the engine is
MySQL or MariaDB, so that the other stores need no MySQL driver.
"""

from __future__ import annotations

import asyncio
import inspect
import weakref
from collections.abc import Mapping
from typing import Any

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.util import greenlet_spawn

from retrysafe.errors import StoreUnavailableError
from retrysafe.stores.mysql import SCHEMA_VERSION, MySQLStore
from retrysafe.stores.mysql.connection import DRIVER_ERRORS, aexecute, execute, packet_limit
from retrysafe.stores.mysql.transactions import completion_failed, run_guarded, take_savepoint
from retrysafe.stores.mysql_borrowed import (
    accept_session,
    committed_migration,
    drive_migration,
    session_op,
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
#: The connection's transaction in which the completion's savepoint was taken (a weak
#: reference, in the pool record's ``info``).
_SAVEPOINT_OF = "retrysafe_savepoint_of"

#: What of an AsyncEngine's connect arguments (its URL's, with ``connect_args``) the
#: store's own PyMySQL connections carry over: PyMySQL takes them as asyncmy does (``ssl``:
#: an SSLContext or a dict of ``ca``, ``cert``, ``key``, ...).
_CARRIED = {
    **{name: name for name in ("host", "port", "user", "password", "unix_socket", "ssl")},
    "db": "database",  # (asyncmy's name)
    "database": "database",
}
#: What the store's own connections set themselves: their session (strict mode, UTC,
#: utf8mb4, autocommit), their flags and timeouts.
_OWN = frozenset(
    [
        "charset",
        "client_flag",
        "autocommit",
        "init_command",
        "sql_mode",
        "connect_timeout",
        "read_timeout",
        "write_timeout",
        "binary_prefix",
        "conv",
        "cursor_cls",
        "cursorclass",
    ]
)


def _own_connect_kwargs(sync: Engine) -> dict[str, Any]:
    """PyMySQL's connect arguments for the store's own connections to an AsyncEngine's
    server: the engine's own (URL and ``connect_args``: password, TLS, socket). A
    ValueError for what cannot be carried over (an argument PyMySQL has no equivalent
    for, a ``creator``/``async_creator``, a ``do_connect`` event): the store's sync
    calls would otherwise connect without it (in clear text, for TLS)."""
    creator = getattr(sync.pool, "_creator", None)
    params = None if creator is None else inspect.getclosurevars(creator).nonlocals.get("cparams")
    where = f"the AsyncEngine {sync.url!r}"
    if not isinstance(params, Mapping) or sync.dialect.dispatch.do_connect:
        raise ValueError(
            f"{where} makes its connections itself (a creator or a do_connect event): the "
            "MySQL store's sync calls (get, sweep, stats, list) use connections of their "
            "own and could not make them alike; give the store a sync Engine, or use "
            "MySQLStore with a mysql:// URL"
        )
    unknown = sorted(name for name in params if name not in _CARRIED and name not in _OWN)
    if unknown:
        raise ValueError(
            f"{where} has connect arguments the MySQL store's own connections (its sync "
            f"calls: get, sweep, stats, list) cannot carry over: {', '.join(unknown)}; "
            f"they take {', '.join(sorted(set(_CARRIED)))}"
        )
    return {_CARRIED[name]: value for name, value in params.items() if name in _CARRIED}


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
    :mod:`retrysafe.stores.mysql_borrowed`); its ``sql_mode`` and
    ``max_allowed_packet`` are read once per pooled connection, and a statement over
    the packet limit is refused before it is sent. ``options`` are
    :class:`MySQLStore`'s (``table``, ``auto_migrate``, ``max_size``,
    ``connect_timeout``). The sync methods of a store on an AsyncEngine (sweeps, stats,
    ``get``) use a small pool of the store's own (PyMySQL) to the same database, with
    the engine's connect arguments (password, TLS); an engine whose arguments it
    cannot carry over is refused (ValueError).
    """

    def __init__(self, engine: AnyEngine, **options: Any) -> None:
        sync = lending_engine(engine, "mysql", "MySQL")
        # The native store's options; its own connections always use utf8mb4, whatever
        # the engine's ?charset= (the borrowed ones keep the application's).
        native = sync.url.set(drivername="mysql", query={}).render_as_string(hide_password=False)
        super().__init__(native, **options)
        if sync.dialect.is_async:  # the sync calls' connections are the store's own
            self._connect_kwargs = _own_connect_kwargs(sync)
        self._on_engine(engine)
        self._where = f"{sync.url!r} (table {self.table})"
        self._borrowed: dict[int, Any] = {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {sync_engine(self.engine).url!r} table={self.table}>"

    # -- connections: borrowed from the engine ------------------------------------------

    def _accept(self, conn: Any, answer: tuple[int, Any]) -> None:
        accept_session(conn, answer, f"{type(self).__name__} at {self._where}")

    def _take(self) -> Any:
        if self.is_async:  # a pool of the store's own: a thread cannot await the driver
            return super()._take()
        fairy = self._borrow(raw=True)
        try:
            conn = fairy.driver_connection
            if packet_limit(conn) is None:  # not checked yet
                self._accept(conn, execute(conn, session_op()))
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
            if packet_limit(conn) is None:  # not checked yet
                self._accept(conn, await aexecute(conn, session_op()))
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
        drive_migration(
            conn.connection.dbapi_connection, self._migration(), DRIVER_ERRORS, self._unavailable
        )
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
        dbapi, driver = fairy.dbapi_connection, fairy.driver_connection
        fairy.info.pop(_SAVEPOINT_OF, None)  # released below, or gone with the transaction
        try:
            if packet_limit(driver) is None:  # not checked yet
                self._accept(driver, execute(dbapi, session_op()))
            self._check_size(driver, op)
            return run_guarded(dbapi, op)
        except StoreUnavailableError:
            raise
        except DRIVER_ERRORS as exc:
            raise completion_failed(exc) from exc
