"""The PostgreSQL store on a SQLAlchemy engine (``postgresql+psycopg://``, sync or async).

Imported by :class:`retrysafe.stores.sqlalchemy.SQLAlchemyStore` when the engine is
PostgreSQL, so that the SQLite store needs no psycopg.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator, Sequence
from typing import Any

import psycopg
from sqlalchemy.engine import Connection

from retrysafe.stores.postgres import PostgresStore
from retrysafe.stores.postgres.connection import UNAVAILABLE_ERRORS
from retrysafe.stores.postgres.transactions import completion_failed
from retrysafe.stores.sqlalchemy import AnyEngine, SQLAlchemyStore, lending_engine, sync_engine

__all__ = ["SQLAlchemyPostgresStore"]

_Flow = Generator[tuple[str, Sequence[Any] | None], Sequence[Any] | None, int]


def _execute(conn: Connection, query: str, params: Sequence[Any] | None) -> Any:
    """Run one statement on ``conn``'s DB-API connection, in its transaction: psycopg's
    own (sync), or SQLAlchemy's thin adapter of psycopg's AsyncConnection (under
    ``run_sync``); errors are psycopg's."""
    cur = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    cur.execute(query, params)
    return cur


def _drive(conn: Connection, flow: _Flow) -> int:
    """Run a migration flow (see ``PostgresStore._migration``) on ``conn``, in its
    transaction: the store's own (begun and committed here) or the caller's."""
    row: Sequence[Any] | None = None
    try:
        while True:
            query, params = flow.send(row)
            cur = _execute(conn, query, params)
            row = cur.fetchone() if cur.description is not None else None
    except StopIteration as stop:
        return int(stop.value)


class SQLAlchemyPostgresStore(SQLAlchemyStore, PostgresStore):
    """The PostgreSQL store on a SQLAlchemy engine's pool (psycopg 3).

    Each operation borrows a connection from the engine (``engine.connect()``; for an
    AsyncEngine, ``await engine.connect()``), runs its one statement on the psycopg
    connection in autocommit mode (set and restored locally: no statement), and gives
    it back; a broken one is invalidated. ``options`` are :class:`PostgresStore`'s
    (``table``, ``auto_migrate``, ``partitioned``…); the pool is the engine's. The sync
    methods of a store on an AsyncEngine (sweeps, stats, ``get``) use a small pool of
    the store's own to the same database.
    """

    def __init__(self, engine: AnyEngine, **options: Any) -> None:
        sync = lending_engine(engine, "postgresql", "PostgreSQL")
        libpq = sync.url.set(drivername="postgresql").render_as_string(hide_password=False)
        super().__init__(libpq, **options)
        self._on_engine(engine)
        self._borrowed: dict[int, tuple[Any, bool]] = {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {sync_engine(self.engine).url!r} table={self.table}>"

    # -- connections: borrowed from the engine ------------------------------------------

    def _migrate_on(self, conn: Connection) -> int:
        if conn.in_transaction():
            version = _drive(conn, self._migration())
        else:
            with conn.begin():
                version = _drive(conn, self._migration())
        self._migrated = True
        return version

    def create_on(self, conn: Connection) -> int:
        """Create or upgrade the table through ``conn``, in its transaction if it has one."""
        self._rewrite_allowed = True
        return self._migrate_on(conn)

    # Each borrowed psycopg connection (by id) -> its SQLAlchemy connection and the
    # autocommit mode it had (restored when it goes back; the engine may be AUTOCOMMIT).

    def _lend(self, sa_conn: Any, conn: Any) -> Any:
        self._borrowed[id(conn)] = (sa_conn, conn.autocommit)
        return conn

    def _returned(self, conn: Any, broken: bool) -> tuple[Any, bool | None]:
        """(its SQLAlchemy connection, the autocommit mode to restore, or None: the
        connection is broken and is invalidated instead)."""
        sa_conn, autocommit = self._borrowed.pop(id(conn))
        return sa_conn, None if broken or conn.broken else autocommit

    def _take(self) -> psycopg.Connection[Any]:
        if self.is_async:  # a pool of the store's own: a thread cannot await the driver
            return super()._take()
        if not self._migrated:
            with self._borrow() as first:
                self._migrate_on(first)
        sa_conn = self._borrow(raw=True)
        conn: Any = None
        try:
            conn = sa_conn.driver_connection
            assert isinstance(conn, psycopg.Connection)
            self._lend(sa_conn, conn)
            conn.autocommit = True  # local: psycopg sends nothing
        except BaseException:
            self._borrowed.pop(id(conn), None)
            sa_conn.close()
            raise
        return conn

    def _give(self, conn: psycopg.Connection[Any], broken: bool = False) -> None:
        if id(conn) not in self._borrowed:  # the fallback pool's (an AsyncEngine's store)
            super()._give(conn, broken)
            return
        sa_conn, autocommit = self._returned(conn, broken)
        if autocommit is not None:
            try:
                conn.autocommit = autocommit
            except psycopg.Error:
                autocommit = None
        if autocommit is None:
            sa_conn.invalidate()
        sa_conn.close()

    async def _atake(self) -> psycopg.AsyncConnection[Any]:
        sa_conn = await self._aborrow()
        conn: Any = None
        try:
            if not self._migrated:
                await sa_conn.run_sync(self._migrate_on)
            conn = (await sa_conn.get_raw_connection()).driver_connection
            assert isinstance(conn, psycopg.AsyncConnection)
            self._lend(sa_conn, conn)
            await conn.set_autocommit(True)  # local: psycopg sends nothing
        except BaseException:
            self._borrowed.pop(id(conn), None)
            await sa_conn.close()
            raise
        return conn

    async def _agive(self, conn: psycopg.AsyncConnection[Any], broken: bool = False) -> None:
        sa_conn, autocommit = self._returned(conn, broken)
        if autocommit is not None:
            try:
                await conn.set_autocommit(autocommit)
            except psycopg.Error:
                autocommit = None
        if autocommit is None:
            await sa_conn.invalidate()
        await sa_conn.close()

    async def _arun(self, op: Any) -> Any:
        if not self.is_async:
            return await asyncio.to_thread(self._run, op)
        return await super()._arun(op)

    # -- the application transaction ------------------------------------------------------

    def _complete_in(self, conn: Connection, op: Any) -> bool:
        try:
            rowcount = _execute(conn, op.query, op.params).rowcount
        except UNAVAILABLE_ERRORS as exc:
            raise completion_failed(exc) from exc
        return bool(op.parse(rowcount, None))
