"""The PostgreSQL store's connections: its URL options, the pools (one sync, one per
event loop, never carried across a fork), the executors that run one op per round
trip, and how a driver error becomes StoreUnavailableError."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar, cast, overload
from urllib.parse import unquote

import psycopg
from psycopg import pq, sql
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolClosed, PoolTimeout

from retrysafe.errors import StoreUnavailableError
from retrysafe.stores._sockets import has_input

if TYPE_CHECKING:
    from retrysafe.stores.postgres.store import PostgresStore

__all__ = ["UNAVAILABLE_ERRORS", "PostgresConnections", "store_cursor"]


class _Op(NamedTuple):
    """One statement and how to read its result: ``parse(rowcount, first_row)``.

    ``parse`` may return another op, which the executor then runs on the same
    connection (a claim's takeover, or its retry after a lost race).
    """

    query: str
    params: Sequence[Any]
    parse: Callable[[int, Sequence[Any] | None], Any]
    #: ``recover(op, error)`` when the statement raised: the op to run instead, or
    #: raise. ``None``: every error is the caller's (the unpartitioned table's ops).
    recover: Callable[[_Op, psycopg.Error], _Op] | None = None


# -- URL handling ------------------------------------------------------------------

_DEFAULT_INTERVAL = 86400.0
_DEFAULT_AHEAD = 7 * 86400.0

_OWN_OPTIONS = (
    "table",
    "min_size",
    "max_size",
    "auto_migrate",
    "partitioned",
    "partition_interval",
    "partition_ahead",
)


def _split_url(url: str) -> tuple[str, dict[str, str]]:
    """(libpq URL without our own query options, our options)."""
    base, _, rest = url.partition("?")
    query, hash_, fragment = rest.partition("#")
    keep: list[str] = []
    ours: dict[str, str] = {}
    for item in query.split("&"):
        name, _, value = item.partition("=")
        if unquote(name) in _OWN_OPTIONS:
            ours[unquote(name)] = unquote(value)
        elif item:
            keep.append(item)
    conninfo = base + ("?" + "&".join(keep) if keep else "") + hash_ + fragment
    return conninfo, ours


# -- the executors' helpers ---------------------------------------------------------

UNAVAILABLE_ERRORS = (psycopg.Error, PoolTimeout, PoolClosed, OSError)


def _closed_by_server(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """True when an idle pooled connection has input: the server closed or is closing it.

    No round trip: a zero-timeout poll of the socket. An idle autocommit connection
    expects nothing, so anything readable (EOF, a FATAL shutdown notice) means discard.
    """
    try:
        fd = conn.pgconn.socket
    except psycopg.Error:
        return True
    return has_input(fd)


def _has_rows(cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]) -> bool:
    """Whether the statement returned rows (cheaper than building ``cur.description``)."""
    result = cur.pgresult
    return result is not None and result.status == pq.ExecStatus.TUPLES_OK


#: The query of an op that makes the executor go on on another pooled connection (this
#: one is closed): ``parse(0, None)`` gives the op to run there (see _pclaim_recover).
_RECONNECT = "-- retrysafe: another connection"


# A migration is a generator of (query, params) that receives each statement's first row.
_Flow = Generator[tuple[str, Sequence[Any] | None], Sequence[Any] | None, int]


def _drive(conn: psycopg.Connection[Any], flow: _Flow) -> int:
    """Run a migration flow in one transaction on a sync connection."""
    row: Sequence[Any] | None = None
    with conn.transaction():
        try:
            while True:
                query, params = flow.send(row)
                cur = conn.execute(query, params)
                row = cur.fetchone() if _has_rows(cur) else None
        except StopIteration as stop:
            return int(stop.value)


async def _adrive(conn: psycopg.AsyncConnection[Any], flow: _Flow) -> int:
    """Run a migration flow in one transaction on an async connection."""
    row: Sequence[Any] | None = None
    async with conn.transaction():
        try:
            while True:
                query, params = flow.send(row)
                cur = await conn.execute(query, params)
                row = await cur.fetchone() if _has_rows(cur) else None
        except StopIteration as stop:
            return int(stop.value)


_C = TypeVar("_C")


class _KeptCursors(Generic[_C]):
    """Binary cursors kept for the store's statements: one for each of its hot ones
    (``PostgresStore._cursor_queries``), one for all others.

    psycopg keeps a cursor's adapters (the dumper of each parameter type, the loader
    of each result column) while the cursor runs the same query object again; a
    cursor shared by a claim and its completion would look them all up again for
    every statement."""

    _store_cursors: dict[str, _C] | None = None

    def store_cursor(self, query: str = "") -> _C:
        """The cursor kept for ``query``; for ``""``, the shared one."""
        cursors = self._store_cursors
        if cursors is None:
            cursors = self._store_cursors = {}
        cur = cursors.get(query)
        if cur is None:
            # the connection's own cursor() (this class is mixed into a connection's)
            cur = cursors[query] = cast("Any", self).cursor(binary=True)
        return cur


class _Connection(_KeptCursors["psycopg.Cursor[Any]"], psycopg.Connection[Any]):
    """A pooled connection that keeps binary cursors for the store's statements."""


class _AsyncConnection(_KeptCursors["psycopg.AsyncCursor[Any]"], psycopg.AsyncConnection[Any]):
    """:class:`_Connection` for the async pools."""


@overload
def store_cursor(conn: psycopg.Connection[Any], query: str = "") -> psycopg.Cursor[Any]: ...
@overload
def store_cursor(
    conn: psycopg.AsyncConnection[Any], query: str = ""
) -> psycopg.AsyncCursor[Any]: ...
def store_cursor(conn: Any, query: str = "") -> Any:
    """The cursor that runs ``query``: a kept one on the store's own connections, a new
    one on a borrowed connection."""
    if isinstance(conn, _KeptCursors):
        return conn.store_cursor(query)
    return conn.cursor()


class _LoopPool:
    """The async pool of one event loop, closed by ``aclose()`` or when the loop shuts down."""

    __slots__ = ("guard", "migrate_lock", "pool")

    def __init__(self, pool: AsyncConnectionPool[_AsyncConnection]) -> None:
        self.pool = pool
        self.migrate_lock = asyncio.Lock()
        self.guard: asyncio.Task[None] | None = None


#: Pools a forked child inherited from its parent. They are kept referenced, never
#: closed: closing (or a finalizer) would send Terminate on the parent's connections,
#: and their worker threads did not survive the fork. One entry per store and fork.
_INHERITED: list[Any] = []


def _forget_pools(ref: weakref.ref[PostgresStore]) -> None:
    """After ``fork()``, in the child: drop the parent's pools and locks (see ``__init__``)."""
    store = ref()
    if store is None:
        return
    _INHERITED.append((store._pool, list(store._apools.values())))
    store._pool = None
    store._apools = weakref.WeakKeyDictionary()
    store._lock = threading.Lock()


class PostgresConnections:
    """The connection half of :class:`PostgresStore`: pools, checkout and the executors."""

    connect_timeout: float
    max_size: int
    min_size: int
    _conninfo: str
    _conn_kwargs: dict[str, Any]
    _where: str
    _lock: threading.Lock
    _migrated: bool
    _pool: ConnectionPool[_Connection] | None
    _apools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopPool]
    _migration: Callable[[], _Flow]
    #: The statements each run on a cursor of their own (see :class:`_Connection`).
    _cursor_queries: frozenset[str]

    def _unavailable(self, exc: BaseException) -> StoreUnavailableError:
        if isinstance(exc, StoreUnavailableError):
            return exc
        if isinstance(exc, PoolTimeout):
            reason = (
                f"no connection within {self.connect_timeout:g}s (server down or unreachable, "
                f"or all {self.max_size} pooled connections busy)"
            )
        else:
            reason = str(exc).strip() or type(exc).__name__
        return StoreUnavailableError(
            f"PostgreSQL store at {self._where} is unavailable: {reason}",
            retry_after=max(1.0, self.connect_timeout),
        )

    def _pool_kwargs(self) -> dict[str, Any]:
        return {
            "kwargs": self._conn_kwargs,
            "min_size": self.min_size,
            "max_size": self.max_size,
            "open": False,
            "timeout": self.connect_timeout,
            # Give up reconnecting quickly so that new callers start a fresh attempt
            # (rather than wait out a long backoff) once the server is back.
            "reconnect_timeout": self.connect_timeout,
            "name": f"retrysafe {self._where}",
        }

    def _sync_pool(self) -> ConnectionPool[_Connection]:
        pool = self._pool
        if pool is None:
            with self._lock:
                pool = self._pool
                if pool is None:
                    pool = ConnectionPool(
                        self._conninfo, connection_class=_Connection, **self._pool_kwargs()
                    )
                    pool.open(wait=False)
                    self._pool = pool
        return pool

    async def _loop_pool(self) -> _LoopPool:
        loop = asyncio.get_running_loop()
        entry = self._apools.get(loop)
        if entry is None:
            # Pools of loops that ended without aclose(): their tasks are gone, drop them.
            for old in [old for old in self._apools if old.is_closed()]:
                self._apools.pop(old, None)
            pool = AsyncConnectionPool(
                self._conninfo, connection_class=_AsyncConnection, **self._pool_kwargs()
            )
            entry = self._apools[loop] = _LoopPool(pool)
            entry.guard = loop.create_task(self._close_at_shutdown(loop, entry))
            await pool.open(wait=False)
        return entry

    async def _close_at_shutdown(self, loop: asyncio.AbstractEventLoop, entry: _LoopPool) -> None:
        """Close ``entry``'s pool when its loop shuts down without ``aclose()``.

        ``asyncio.run()`` and pytest-asyncio cancel every task before closing a loop;
        a psycopg_pool worker that is connecting at that moment swallows the
        cancellation and would block the shutdown until its pool is closed.
        """
        try:
            await loop.create_future()
        finally:
            if self._apools.get(loop) is entry:
                del self._apools[loop]
                await entry.pool.close()

    # The two executors: take a live pooled connection (skipping idle ones the server
    # dropped, see _closed_by_server), migrate once if due, run the op's statement.

    def _checkout(self, pool: ConnectionPool[_Connection]) -> _Connection:
        """A live pooled connection (skipping idle ones the server dropped), the schema
        migrated once; the caller puts it back."""
        conn = pool.getconn()
        for _ in range(self.max_size):
            if not _closed_by_server(conn):
                break
            conn.close()  # the pool replaces a closed connection
            pool.putconn(conn)
            conn = pool.getconn()
        if not self._migrated:
            try:
                with self._lock:
                    if not self._migrated:
                        _drive(conn, self._migration())
                        self._migrated = True
            except BaseException:
                pool.putconn(conn)
                raise
        return conn

    # A store that borrows its connections (the SQLAlchemy store) overrides these four:
    # take a live, migrated connection; give it back (``broken``: it must not be reused).

    def _take(self) -> psycopg.Connection[Any]:
        return self._checkout(self._pool or self._sync_pool())

    def _give(self, conn: psycopg.Connection[Any], broken: bool = False) -> None:
        if broken:
            conn.close()  # the pool replaces a closed connection
        (self._pool or self._sync_pool()).putconn(cast(_Connection, conn))

    async def _atake(self) -> psycopg.AsyncConnection[Any]:
        entry = await self._loop_pool()
        conn = await self._acheckout(entry.pool)
        if not self._migrated:
            try:
                async with entry.migrate_lock:
                    if not self._migrated:
                        await _adrive(conn, self._migration())
                        self._migrated = True
            except BaseException:
                await entry.pool.putconn(conn)
                raise
        return conn

    async def _agive(self, conn: psycopg.AsyncConnection[Any], broken: bool = False) -> None:
        if broken:
            await conn.close()
        entry = await self._loop_pool()
        await entry.pool.putconn(cast(_AsyncConnection, conn))

    def _run(self, op: _Op) -> Any:
        try:
            conn: psycopg.Connection[Any] | None
            conn = self._take()
            try:
                own = self._cursor_queries
                while True:
                    query = op.query
                    if query is _RECONNECT:
                        old, conn = conn, None
                        self._give(old, broken=True)
                        conn = self._take()
                        op = op.parse(0, None)
                        continue
                    cur = store_cursor(conn, query if query in own else "")
                    try:
                        cur.execute(query, op.params)
                    except psycopg.Error as exc:
                        if op.recover is None:
                            raise
                        op = op.recover(op, exc)
                        continue
                    result = op.parse(cur.rowcount, cur.fetchone() if _has_rows(cur) else None)
                    if result.__class__ is not _Op:
                        return result
                    op = result
            finally:
                if conn is not None:
                    self._give(conn)
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable(exc) from exc

    async def _acheckout(self, pool: AsyncConnectionPool[_AsyncConnection]) -> _AsyncConnection:
        """A live pooled connection (as :meth:`_checkout`, without the migration)."""
        conn = await pool.getconn()
        for _ in range(self.max_size):
            if not _closed_by_server(conn):
                break
            await conn.close()
            await pool.putconn(conn)
            conn = await pool.getconn()
        return conn

    async def _arun(self, op: _Op) -> Any:
        try:
            conn: psycopg.AsyncConnection[Any] | None
            conn = await self._atake()
            try:
                own = self._cursor_queries
                while True:
                    query = op.query
                    if query is _RECONNECT:
                        old, conn = conn, None
                        await self._agive(old, broken=True)
                        conn = await self._atake()
                        op = op.parse(0, None)
                        continue
                    cur = store_cursor(conn, query if query in own else "")
                    try:
                        await cur.execute(query, op.params)
                    except psycopg.Error as exc:
                        if op.recover is None:
                            raise
                        op = op.recover(op, exc)
                        continue
                    row = await cur.fetchone() if _has_rows(cur) else None
                    result = op.parse(cur.rowcount, row)
                    if result.__class__ is not _Op:
                        return result
                    op = result
            finally:
                if conn is not None:
                    await self._agive(conn)
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable(exc) from exc

    def close(self) -> None:
        """Close the sync pool (and forget async pools of closed loops); reopens on use."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
        for loop in [loop for loop in self._apools if loop.is_closed()]:
            self._apools.pop(loop, None)

    async def aclose(self) -> None:
        """Close the running loop's pool and the sync pool; reopens on use."""
        entry = self._apools.pop(asyncio.get_running_loop(), None)
        if entry is not None:
            if entry.guard is not None:
                entry.guard.cancel()
            await entry.pool.close()
        if self._pool is not None:
            await asyncio.to_thread(self.close)

    @contextmanager
    def _ops_connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A live, migrated connection for work of several statements or rows."""
        try:
            conn = self._take()
            try:
                yield conn
            finally:
                self._give(conn)  # the pool rolls back a transaction left open
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable(exc) from exc

    def _ops_rows(self, query: str | sql.Composed, params: Sequence[Any]) -> list[Any]:
        with self._ops_connection() as conn:
            return store_cursor(conn).execute(query, params).fetchall()
