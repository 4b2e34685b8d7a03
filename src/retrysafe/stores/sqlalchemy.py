"""Stores on a SQLAlchemy 2.x engine: the records in the application's own database.

:class:`SQLAlchemyStore` is the store for the engine's dialect: SQLite (pysqlite,
aiosqlite), PostgreSQL (psycopg 3, sync or async) or MySQL/MariaDB (PyMySQL, asyncmy).
Each is the native store (:class:`~retrysafe.stores.sqlite.SQLiteStore`,
:class:`~retrysafe.stores.postgres.PostgresStore`,
:class:`~retrysafe.stores.mysql.MySQLStore`) with one change: it borrows its
connections from the engine's pool, one per operation, and gives them back. Every
statement, the migration, sweeps, stats and listings are the native ones, on the
native tables, so ``retrysafe stats --store sqlite:///same.db`` (or
``postgresql://same-db``) sees what these stores write.

Their application transaction is an ORM :class:`~sqlalchemy.orm.Session` (or a
:class:`~sqlalchemy.engine.Connection`) of the engine, and for an
:class:`~sqlalchemy.ext.asyncio.AsyncEngine` an
:class:`~sqlalchemy.ext.asyncio.AsyncSession` (or ``AsyncConnection``): the
completion's compare-and-set runs on the session's connection and commits with the
session (:class:`SessionTransactions`). The async forms reach the driver through
SQLAlchemy's own sync facade (``run_sync``), so one piece of code serves both.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from retrysafe.errors import MissingExtraError, StoreUnavailableError

try:
    from sqlalchemy import event
    from sqlalchemy.engine import Connection, Engine
    from sqlalchemy.exc import SQLAlchemyError
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
    from sqlalchemy.orm import Session
    from sqlalchemy.pool import AssertionPool, SingletonThreadPool, StaticPool
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingExtraError("sqlalchemy", "retrysafe.sqlalchemy", name=exc.name) from exc
from retrysafe.stores._base import AsyncTransaction, Transaction
from retrysafe.stores.sqlite import _FIRST_WAIT, _LONGEST_WAIT, SQLiteStore, _busy

if TYPE_CHECKING:
    pass

__all__ = [
    "SQLAlchemySQLiteStore",
    "SQLAlchemyStore",
    "SessionTransactions",
    "acreate_tables",
    "create_tables",
    "lending_engine",
    "sync_engine",
]

AnyEngine = Engine | AsyncEngine
_SQLITE_DRIVERS = ("pysqlite", "aiosqlite")
#: MySQL/MariaDB drivers: PyMySQL for an Engine, asyncmy for an AsyncEngine.
_MYSQL_DRIVERS = ("pymysql", "asyncmy")
_SUPPORTED = (
    "sqlite:// (pysqlite), sqlite+aiosqlite://, postgresql+psycopg:// (sync or async), "
    "mysql+pymysql:// or mariadb+pymysql://, mysql+asyncmy:// or mariadb+asyncmy://"
)


def sync_engine(engine: AnyEngine) -> Engine:
    """The sync :class:`Engine` behind ``engine`` (itself, or an AsyncEngine's)."""
    return engine.sync_engine if isinstance(engine, AsyncEngine) else engine


def _dialect(engine: Engine) -> str:
    """``"sqlite"``, ``"postgresql"`` or ``"mysql"`` (MySQL or MariaDB); TypeError for any
    other dialect or driver."""
    dialect = engine.dialect
    name, driver = dialect.name, dialect.driver
    if name == "sqlite" and driver in _SQLITE_DRIVERS:
        return name
    if name == "postgresql" and driver == "psycopg":
        return name
    if name in ("mysql", "mariadb"):
        if driver in _MYSQL_DRIVERS:
            return "mysql"
        raise TypeError(
            f"the SQLAlchemy store on {name} needs the PyMySQL driver (asyncmy for an "
            f"AsyncEngine), not {driver!r}: create the engine with a {name}+pymysql:// URL "
            f"(create_engine) or a {name}+asyncmy:// URL (create_async_engine)"
        )
    if name == "postgresql":
        raise TypeError(
            f"the SQLAlchemy store on PostgreSQL needs the psycopg 3 driver, not {driver!r}: "
            "create the engine with a postgresql+psycopg:// URL (create_engine or "
            "create_async_engine)"
        )
    raise TypeError(f"no SQLAlchemy store for the {name}+{driver} dialect; supported: {_SUPPORTED}")


def _same_database(ours: Engine, theirs: Engine) -> bool:
    """Whether ``theirs`` reaches the database of ``ours`` (the same engine, the same
    file, or the same server and database)."""
    if theirs is ours:
        return True
    a, b = ours.url, theirs.url
    if a.get_backend_name() != b.get_backend_name():
        return False
    if a.get_backend_name() == "sqlite":
        return bool(a.database) and os.path.realpath(a.database or "") == os.path.realpath(
            b.database or ""
        )
    return (a.host, a.port or 5432, a.database) == (b.host, b.port or 5432, b.database)


# -- a sqlite3-like connection over SQLAlchemy's sync facade ----------------------------------


class _Empty:
    rowcount = 0


class _DriverSQL:
    """What the SQLite store's ops use of a ``sqlite3.Connection`` (``execute``,
    ``executemany``, ``in_transaction``), on the DB-API connection of a SQLAlchemy
    :class:`Connection` (aiosqlite's adapter): the statements reach the driver
    unchanged, past SQLAlchemy's compilation, logging and events (no key or stored
    answer in the application's SQL log). Under ``run_sync`` of an AsyncEngine each
    awaits the driver without blocking the event loop. Errors are the driver's own
    (``sqlite3`` errors), as the native store sees them."""

    __slots__ = ("dbapi", "driver")

    def __init__(self, conn: Connection) -> None:
        fairy = conn.connection
        self.dbapi: Any = fairy.dbapi_connection
        self.driver: Any = fairy.driver_connection

    def execute(self, sql: str, params: Sequence[Any] | None = None) -> Any:
        cursor = self.dbapi.cursor()
        cursor.execute(sql, None if params is None else tuple(params))
        return cursor

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Any:
        many = [tuple(row) for row in rows]
        if not many:
            return _Empty()
        cursor = self.dbapi.cursor()
        cursor.executemany(sql, many)
        return cursor

    @property
    def in_transaction(self) -> bool:
        return bool(self.driver.in_transaction)


class _Savepoint:
    """The native SQLite migration inside a transaction that is not its own (Alembic's):
    its ``BEGIN IMMEDIATE`` … ``COMMIT`` become a savepoint and its release."""

    __slots__ = ("_conn",)
    _WORDS = {
        "BEGIN IMMEDIATE": ("SAVEPOINT retrysafe_migration",),
        "COMMIT": ("RELEASE retrysafe_migration",),
        "ROLLBACK": ("ROLLBACK TO retrysafe_migration", "RELEASE retrysafe_migration"),
    }

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[Any] | None = None) -> Any:
        instead = self._WORDS.get(sql)
        if instead is None:
            return self._conn.execute(sql) if params is None else self._conn.execute(sql, params)
        for statement in instead:
            result = self._conn.execute(statement)
        return result

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Any:
        return self._conn.executemany(sql, rows)

    @property
    def in_transaction(self) -> bool:
        return True  # the savepoint is released or rolled back by the migration itself


# -- the application transaction: a Session of the engine --------------------------------


def _autocommit(conn: Connection) -> str | None:
    """Why statements on ``conn`` would commit one by one, or None (read locally, no
    statement): SQLAlchemy's ``AUTOCOMMIT`` isolation level (the connection's or the
    engine's), or a driver in autocommit mode outside a transaction. On SQLite a driver
    with ``isolation_level=None`` inside a transaction it was told to ``BEGIN``
    (SQLAlchemy's recipe for SAVEPOINTs on pysqlite) is a real transaction, accepted."""
    level = conn.get_execution_options().get("isolation_level")
    if level is None:
        level = getattr(conn.dialect, "_on_connect_isolation_level", None)
    if level == "AUTOCOMMIT":
        return "its isolation_level is 'AUTOCOMMIT'"
    fairy = conn.connection
    if conn.dialect.name == "sqlite":
        driver: Any = fairy.driver_connection
        if driver.isolation_level is None and not driver.in_transaction:
            return "its sqlite3 driver has isolation_level=None and began no transaction"
        return None
    if conn.dialect.name in ("mysql", "mariadb"):
        mysql: Any = fairy.driver_connection
        if mysql.get_autocommit():  # (read locally: the server's status)
            return "its MySQL driver has autocommit on"
        return None
    if getattr(fairy.dbapi_connection, "autocommit", False):
        return "its psycopg driver has autocommit on"
    return None


def _one_connection_pool(engine: Engine) -> bool:
    """Whether ``engine``'s pool hands one DB-API connection to every checkout (of a
    thread): a borrowed connection could be the one a Session is writing on."""
    return isinstance(engine.pool, StaticPool | SingletonThreadPool | AssertionPool)


def _held_connections(session: Session) -> Iterable[Connection]:
    """The connections ``session``'s transaction has acquired (one per database it used)."""
    transaction = session.get_transaction()
    if transaction is None:
        return ()
    held = getattr(transaction, "connections", None)  # SQLAlchemy 2.1.7+
    if held is None:
        held = [entry[0] for entry in transaction._connections.values()]
    return cast(Iterable[Connection], held)


def lending_engine(engine: AnyEngine, dialect: str, name: str) -> Engine:
    """The sync engine of ``engine``, checked for a server store (``dialect`` of
    :func:`_dialect`, ``name`` for messages): TypeError for another dialect, ValueError
    for a pool that shares one connection. The store could not borrow from such a pool
    (it would lend the Session's own connection), and a pool of its own from the URL
    alone would drop the engine's ``connect_args`` (search_path, sslmode, password)."""
    sync = sync_engine(engine)
    if _dialect(sync) != dialect:
        raise TypeError(f"not a {name} engine: {sync.url!r}")
    if _one_connection_pool(sync):
        raise ValueError(
            f"the SQLAlchemy {name} store needs an engine whose pool lends distinct "
            f"connections, not a {type(sync.pool).__name__}: use the default QueuePool "
            "(or NullPool)"
        )
    return sync


def _borrowed_error(store: Any, exc: SQLAlchemyError) -> StoreUnavailableError:
    return StoreUnavailableError(
        f"{type(store).__name__}: no connection from the SQLAlchemy engine's pool "
        f"({type(exc).__name__}: {str(exc).strip()})"
    )


def _only(joined: Connection, new: Connection) -> None:
    """ValueError unless ``new`` is the connection the block joined: a second one (a
    ``binds=`` mapping, even to the same database) is a second transaction, which
    would commit apart from the completion."""
    if new is not joined:
        raise ValueError(
            f"the session also writes through a second connection ({new.engine.url!r}, "
            "binds=): it would commit apart from the completion; bind every mapper to "
            "the session's one engine"
        )


@contextmanager
def _one_connection(session: Any, joined: Connection) -> Iterator[None]:
    """While the block runs, refuse any connection but ``joined`` as it joins ``session``'s
    transaction (``after_begin``), before its first statement: an AUTOCOMMIT bind
    would otherwise commit at the flush."""
    if not isinstance(session, Session):
        yield
        return

    def joining(_session: Session, _transaction: Any, new: Connection) -> None:
        _only(joined, new)

    event.listen(session, "after_begin", joining)
    try:
        yield
    finally:
        event.remove(session, "after_begin", joining)


class SessionTransactions:
    """The application transaction of the SQLAlchemy stores: a :class:`Session` or
    :class:`Connection` of the store's engine (:class:`AsyncSession` or
    :class:`AsyncConnection` for an AsyncEngine).

    Leaving the block without an exception flushes the session, runs the completion's
    compare-and-set on its connection (the same database transaction) and commits the
    session; an exception, or a completion that finds the lease lost, rolls the session
    back. A session that has a transaction open already is accepted: everything it
    holds commits or rolls back with the block. A session bound to another database is
    refused with :class:`ValueError`.
    """

    engine: AnyEngine
    #: Whether the engine is an AsyncEngine (its driver is async).
    is_async: bool
    #: Whether the store's operations use connections of its own, not the engine's:
    #: an engine whose pool shares one DB-API connection (StaticPool,
    #: SingletonThreadPool, AssertionPool) would lend the very connection a Session is
    #: writing on, and toggling its autocommit mode would commit that Session's work.
    own_connections: bool

    def _on_engine(self, engine: AnyEngine) -> None:
        sync = sync_engine(engine)
        self.engine = engine
        self.is_async = sync.dialect.is_async
        self.own_connections = _one_connection_pool(sync)

    def _complete_in(self, conn: Connection, op: Any) -> bool:
        """Run the completion ``op`` on ``conn``'s connection, in its transaction."""
        raise NotImplementedError

    def _borrow(self, raw: bool = False) -> Any:
        """A connection of the (sync) engine's pool for one operation, which the caller
        closes: a :class:`Connection`, or with ``raw`` the pool's DB-API connection proxy
        (``driver_connection``, ``invalidate()``; a few microseconds cheaper)."""
        engine = sync_engine(self.engine)
        try:
            return engine.raw_connection() if raw else engine.connect()
        except SQLAlchemyError as exc:
            raise _borrowed_error(self, exc) from exc

    async def _aborrow(self) -> AsyncConnection:
        """:meth:`_borrow` from the AsyncEngine's pool."""
        engine = self.engine
        assert isinstance(engine, AsyncEngine)
        try:
            return await engine.connect()
        except SQLAlchemyError as exc:
            raise _borrowed_error(self, exc) from exc

    def _joinable(self, session: Session | Connection) -> Connection:
        """``session``'s connection (a Session's begins its transaction), or ValueError if
        its statements commit one by one, or if the Session's transaction holds another
        connection: checked as the block begins, before any write."""
        if isinstance(session, Session):
            conn = session.connection()
        else:
            conn = session
            if not conn.in_transaction():
                # as a Session's connection() does: its first statement would begin
                # anyway (SQLAlchemy's pysqlite recipe sends BEGIN then)
                conn.begin()
        why = _autocommit(conn)
        if why is not None:
            raise ValueError(
                f"the session's connection is in autocommit mode ({why}): its writes "
                "would commit apart from the completion"
            )
        if isinstance(session, Session):
            for held in _held_connections(session):
                _only(conn, held)
        return conn

    def _settle_in(self, session: Session | Connection, op: Any) -> bool:
        """Flush the session and run ``op`` in its transaction (sync, or under ``run_sync``)."""
        if isinstance(session, Session):
            session.flush()
        return self._complete_in(self._joinable(session), op)

    def _checked(self, given: Any, kinds: tuple[type[Any], ...]) -> Any:
        if not isinstance(given, kinds):
            raise TypeError(
                f"{type(self).__name__} joins a {' or '.join(k.__name__ for k in kinds)} of its "
                f"engine, not a {type(given).__name__}"
            )
        bind: Any
        if isinstance(given, AsyncSession):
            bind = given.sync_session.get_bind()
        elif isinstance(given, Session):
            bind = given.get_bind()
        elif isinstance(given, AsyncConnection):
            bind = given.sync_engine
        else:
            bind = given.engine
        if not isinstance(bind, Engine) or not _same_database(sync_engine(self.engine), bind):
            raise ValueError(
                f"the session is bound to {getattr(bind, 'url', bind)!r}, not to the store's "
                f"database {sync_engine(self.engine).url!r}"
            )
        return given

    @contextmanager
    def completion_transaction(self, connection: Any = None) -> Iterator[Transaction[Any]]:
        """The block runs in ``connection`` (a Session or Connection of the engine) or in a
        Session of its own, which it gets; see :class:`SessionTransactions`."""
        if self.is_async:
            raise TypeError("a store on an AsyncEngine: use atransaction() with an AsyncSession")
        own = connection is None
        session = (
            Session(sync_engine(self.engine))
            if own
            else self._checked(connection, (Session, Connection))
        )
        try:
            with _one_connection(session, self._joinable(session)):
                yield Transaction(session, partial(self._settle_in, session))
                session.commit()
        except BaseException:
            session.rollback()
            raise
        finally:
            if own:
                session.close()

    @asynccontextmanager
    async def acompletion_transaction(
        self, connection: Any = None
    ) -> AsyncIterator[AsyncTransaction[Any]]:
        """Async :meth:`completion_transaction`: an AsyncSession or AsyncConnection."""
        if not self.is_async:
            raise TypeError(
                "a store on a sync Engine: use transaction() with a Session "
                "(in a thread from async code), or build the store on an AsyncEngine"
            )
        own = connection is None
        engine = self.engine
        assert isinstance(engine, AsyncEngine)
        session = (
            AsyncSession(engine)
            if own
            else self._checked(connection, (AsyncSession, AsyncConnection))
        )

        async def run(op: Any) -> bool:
            return bool(await session.run_sync(self._settle_in, op))

        sync_session = session.sync_session if isinstance(session, AsyncSession) else None
        try:
            with _one_connection(sync_session, await session.run_sync(self._joinable)):
                yield AsyncTransaction(session, run)
                await session.commit()
        except BaseException:
            await session.rollback()
            raise
        finally:
            if own:
                await session.close()


# -- SQLite -----------------------------------------------------------------------------------


_SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")


class SQLAlchemyStore(SessionTransactions):
    """The store of a SQLAlchemy engine: ``SQLAlchemyStore(engine, **options)``.

    It is a :class:`SQLAlchemySQLiteStore`, a
    :class:`~retrysafe.stores.sqlalchemy_postgres.SQLAlchemyPostgresStore` or a
    :class:`~retrysafe.stores.sqlalchemy_mysql.SQLAlchemyMySQLStore` (by the engine's
    dialect), on the engine's own pool. ``engine`` is an :class:`Engine` or an
    :class:`AsyncEngine`; ``options`` go to the native store (``timeout`` for SQLite;
    ``table``, ``auto_migrate``, ``partitioned``… for PostgreSQL; ``table``,
    ``auto_migrate`` for MySQL). An
    unsupported dialect or driver raises :class:`TypeError` naming the supported ones.
    """

    def __new__(cls, engine: AnyEngine, **options: Any) -> Any:
        if cls is SQLAlchemyStore:
            if not isinstance(engine, Engine | AsyncEngine):
                raise TypeError(
                    f"expected a SQLAlchemy Engine or AsyncEngine, not {type(engine).__name__}"
                )
            sync = sync_engine(engine)
            if isinstance(engine, Engine) and sync.dialect.is_async:
                raise TypeError("an engine with an async driver: pass the AsyncEngine itself")
            cls = _store_class(_dialect(sync))
        return object.__new__(cls)


class SQLAlchemySQLiteStore(SQLAlchemyStore, SQLiteStore):
    """The SQLite store on a SQLAlchemy engine's pool (pysqlite, or aiosqlite's AsyncEngine).

    Each operation borrows a connection and gives it back. With a sync engine the
    op runs on the ``sqlite3`` connection itself, in autocommit mode while it is
    borrowed (the isolation level it had is restored). With an AsyncEngine it runs
    through ``run_sync`` on the aiosqlite adapter's cursor, switched the same way,
    never blocking the event loop. The sync methods of a store on an AsyncEngine
    (sweeps, stats, ``get``), and every operation when the engine's pool shares one
    connection, use a ``sqlite3`` connection of the store's own to the same file.
    ``timeout`` is how long the store retries a write that finds SQLite's lock taken
    (default 10 s), after the driver's own busy wait (the engine's ``timeout``).
    """

    # Its async calls on an AsyncEngine enter SQLAlchemy's greenlet bridge and the
    # pool's queue: not a plain thread hop, so the engine gives each a task of its own.
    drive_inline = False

    def __init__(self, engine: AnyEngine, *, timeout: float | None = None) -> None:
        sync = sync_engine(engine)
        if _dialect(sync) != "sqlite":
            raise TypeError(f"not a SQLite engine: {sync.url!r}")
        database = sync.url.database or ""
        if database in ("", ":memory:") or sync.url.query.get("mode") == "memory":
            raise ValueError(
                "the SQLAlchemy SQLite store needs a database file (an in-memory database "
                "is one connection's, out of reach of other processes and the CLI)"
            )
        super().__init__(f"sqlite:///{database}", timeout=timeout)
        self._on_engine(engine)

    # -- connections: borrowed from the engine ------------------------------------------

    def _on_connection(self, op: Callable[[Any], Any]) -> Any:
        if self.is_async or self.own_connections:  # connections of the store's own
            return super()._on_connection(op)
        borrowed = self._borrow(raw=True)
        try:
            conn = borrowed.driver_connection
            assert isinstance(conn, sqlite3.Connection)
            level = conn.isolation_level
            conn.isolation_level = None  # no statement: autocommit while borrowed
            try:
                if not self._migrated:
                    self._first_use(conn)
                return op(conn)
            finally:
                conn.isolation_level = level
        finally:
            borrowed.close()

    def _first_use(self, conn: Any) -> None:
        """Migrate, and adopt the connection's ``synchronous`` (the sweep restores it)."""
        level = conn.execute("PRAGMA synchronous").fetchone()[0]
        if isinstance(level, int) and 0 <= level < len(_SYNCHRONOUS):
            self.synchronous = _SYNCHRONOUS[level]
        self._migrate(conn)

    def _in_run_sync(self, conn: Connection, op: Callable[[Any], Any]) -> Any:
        view = _DriverSQL(conn)
        level = view.driver.isolation_level
        try:
            # the adapter queues the change on the driver's thread and awaits it: no
            # statement (SQLAlchemy's AUTOCOMMIT option would cost a PRAGMA on return).
            # Inside the try: a task cancelled during that await still queues the
            # restore after it (the thread runs them in order), so the connection never
            # goes back to the application's pool in autocommit mode.
            view.dbapi.isolation_level = None
            if not self._migrated:
                self._first_use(view)
            return op(view)
        finally:
            view.dbapi.isolation_level = level

    async def _aon_connection(self, op: Callable[[Any], Any]) -> Any:
        conn = await self._aborrow()
        try:
            return await conn.run_sync(self._in_run_sync, op)
        finally:
            await conn.close()

    async def _arun(self, op: Callable[[Any], Any]) -> Any:
        """As the native ``_run``, awaiting: a busy lock is retried until ``timeout``."""
        if not self.is_async or self.own_connections:
            return await asyncio.to_thread(self._run, op)
        deadline: float | None = None
        delay = _FIRST_WAIT
        while True:
            try:
                return await self._aon_connection(op)
            except sqlite3.OperationalError as exc:
                if not _busy(exc):
                    raise StoreUnavailableError(f"SQLite store {self.path}: {exc}") from exc
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.timeout
                elif now >= deadline:
                    raise StoreUnavailableError(f"SQLite store {self.path}: {exc}") from exc
            except sqlite3.DatabaseError as exc:
                raise StoreUnavailableError(
                    f"SQLite store {self.path}: {exc}", transient=False
                ) from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, _LONGEST_WAIT)

    def close(self) -> None:
        """Close the connections of the store's own (never the engine's)."""
        super().close()

    # -- the application transaction ------------------------------------------------------

    def _complete_in(self, conn: Connection, op: Any) -> bool:
        driver = conn.connection.driver_connection
        target = driver if isinstance(driver, sqlite3.Connection) else _DriverSQL(conn)
        try:
            return bool(op(target))
        except sqlite3.Error as exc:
            raise StoreUnavailableError(
                f"SQLite store {self.path}: the completion could not be written in this "
                f"transaction ({type(exc).__name__}: {exc}); nothing was committed"
            ) from exc

    def create_on(self, conn: Connection) -> int:
        """Create or upgrade the tables through ``conn``, in its transaction if it has one."""
        driver = conn.connection.driver_connection
        view = driver if isinstance(driver, sqlite3.Connection) else _DriverSQL(conn)
        if conn.in_transaction() and not view.in_transaction:
            # sqlite3 begins on the first write only: begin now, so that the tables
            # belong to the caller's transaction (and roll back with it)
            view.execute("BEGIN")
        self._rewrite_allowed = True
        self._migrated = False
        self._migrate(cast(sqlite3.Connection, _Savepoint(view)))
        return int(view.execute("PRAGMA user_version").fetchone()[0])


def _store_class(dialect: str) -> type[Any]:
    """The store class of a dialect of :func:`_dialect` (each imports its own driver)."""
    if dialect == "sqlite":
        return SQLAlchemySQLiteStore
    if dialect == "mysql":
        from retrysafe.stores.sqlalchemy_mysql import SQLAlchemyMySQLStore

        return SQLAlchemyMySQLStore
    from retrysafe.stores.sqlalchemy_postgres import SQLAlchemyPostgresStore

    return SQLAlchemyPostgresStore


# -- create_tables ---------------------------------------------------------------------------


def create_tables(bind: Engine | Connection, **options: Any) -> int:
    """Create or upgrade the records' tables in the database of ``bind``; return the
    schema version.

    ``bind`` is an :class:`Engine` (its own transaction, committed) or a
    :class:`Connection`: the statements then run in that connection's transaction,
    which its owner commits (Alembic's ``op.get_bind()``). ``options`` are the
    store's (``table=`` for PostgreSQL). Under an AsyncEngine use :func:`acreate_tables`.
    """
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            return create_tables(conn, **options)
    if not isinstance(bind, Connection):
        raise TypeError(f"expected a SQLAlchemy Engine or Connection, not {type(bind).__name__}")
    return int(_store_class(_dialect(bind.engine))(bind.engine, **options).create_on(bind))


async def acreate_tables(bind: AsyncEngine | AsyncConnection, **options: Any) -> int:
    """:func:`create_tables` for an :class:`AsyncEngine` or :class:`AsyncConnection`."""
    if isinstance(bind, AsyncEngine):
        async with bind.begin() as conn:
            return await acreate_tables(conn, **options)
    if not isinstance(bind, AsyncConnection):
        raise TypeError(
            f"expected a SQLAlchemy AsyncEngine or AsyncConnection, not {type(bind).__name__}"
        )
    return int(await bind.run_sync(partial(create_tables, **options)))
