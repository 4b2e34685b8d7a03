"""The MySQL store's connections: its URL, the pools (one sync, one per event loop,
never carried across a fork), and the executors that run one op per round trip.

PyMySQL serves the sync calls and asyncmy the async ones (docs/stores.md, "MySQL
drivers"). Both speak the same protocol with the same parameter style, so every op
is written once and both executors drive it through :func:`play`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import threading
import weakref
from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit

import pymysql
from pymysql.constants import CLIENT

from retrysafe.errors import StoreUnavailableError
from retrysafe.stores._redact import redact

__all__ = [
    "CONNECTION_LOST",
    "DRIVER_ERRORS",
    "UNAVAILABLE_ERRORS",
    "MySQLConnections",
    "Op",
    "aexecute",
    "errno_of",
    "execute",
    "play",
]

Row = Sequence[Any]


class Op(NamedTuple):
    """One round trip and how to read its answer: ``parse(rowcount, row)``.

    ``query`` is one statement, or several run in one round trip (``params`` then
    holds each one's parameters): ``rowcount`` is the first statement's, ``row`` the
    first row of the last statement that returned rows. ``parse`` may return another
    op, which runs next on the same connection. ``recover(op, error)`` gives the op
    to run instead of a failed one, or raises; by default a deadlock or a lock wait
    timeout (nothing written) runs the op again, a few times. Either may also give
    the op's result instead of another op.
    """

    query: str | tuple[str, ...]
    params: Sequence[Any]
    parse: Callable[[int, Row | None], Any]
    recover: Callable[[Op, BaseException], Any] | None = None


# -- errors ------------------------------------------------------------------------


def errno_of(exc: BaseException) -> int | None:
    """The server's (or the client library's) error number of a driver error."""
    args = getattr(exc, "args", ())
    if args and isinstance(args[0], int):
        return args[0]
    return None


#: Deadlock found, lock wait timeout: the statement was rolled back, nothing written.
_LOCK_ERRORS = frozenset({1213, 1205})
#: Errors after which a connection is not reused: the server went away, the query was
#: interrupted, the connection was killed or shut down, or it never connected.
CONNECTION_LOST = frozenset({1053, 1927, 2003, 2006, 2013, 2055, 4031})
_MAX_LOCK_RETRIES = 10


def _driver_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [pymysql.MySQLError, OSError]
    try:
        import asyncmy.errors

        errors.append(asyncmy.errors.MySQLError)
    except ImportError:  # pragma: no cover - the async driver is optional
        pass
    return tuple(errors)


#: What either driver raises when the server fails or cannot be reached.
DRIVER_ERRORS: tuple[type[BaseException], ...] = _driver_errors()
#: What a store call turns into StoreUnavailableError: a driver error, or no pooled
#: connection in time.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (*DRIVER_ERRORS, TimeoutError)


def _retry_locked(tries: int, op: Op, exc: BaseException) -> Op:
    if errno_of(exc) in _LOCK_ERRORS and tries < _MAX_LOCK_RETRIES:
        return op._replace(recover=lambda o, e: _retry_locked(tries + 1, o, e))
    raise exc


def play(op: Op) -> Generator[Op, tuple[int, Row | None] | BaseException, Any]:
    """Run ``op`` and what follows it: yields each op to execute, receives its
    ``(rowcount, row)`` or the driver error it raised, returns the result."""
    while True:
        answer = yield op
        if isinstance(answer, BaseException):
            recover = op.recover
            result = recover(op, answer) if recover is not None else _retry_locked(0, op, answer)
        else:
            result = op.parse(*answer)
        if result.__class__ is not Op:
            return result
        op = result


def _statements(op: Op, multi: bool) -> list[tuple[str, Sequence[Any]]]:
    """The statements to send for ``op``: one round trip when the connection takes
    several statements at once (the store's own), else one each."""
    if isinstance(op.query, str):
        return [(op.query, op.params)]
    if multi:
        return [("; ".join(op.query), [p for params in op.params for p in params])]
    return list(zip(op.query, op.params, strict=True))


def _multi(conn: Any) -> bool:
    """Whether ``conn`` was opened with ``CLIENT.MULTI_STATEMENTS`` (PyMySQL keeps its
    flags in ``client_flag``, asyncmy in ``_client_flag``)."""
    flags = getattr(conn, "client_flag", None)
    if flags is None:
        flags = getattr(conn, "_client_flag", 0)
    return bool(flags & CLIENT.MULTI_STATEMENTS)


def execute(conn: Any, op: Op) -> tuple[int, Row | None]:
    """Run ``op``'s statements on a DB-API connection (PyMySQL, mysqlclient)."""
    rowcount: int | None = None
    row: Row | None = None
    cur = conn.cursor()
    try:
        for query, params in _statements(op, _multi(conn)):
            cur.execute(query, params)
            while True:
                if rowcount is None:
                    rowcount = cur.rowcount
                if cur.description is not None:
                    row = cur.fetchone()
                if not cur.nextset():
                    break
    finally:
        cur.close()
    return (rowcount or 0), row


async def aexecute(conn: Any, op: Op) -> tuple[int, Row | None]:
    """:func:`execute` on an asyncmy connection."""
    rowcount: int | None = None
    row: Row | None = None
    async with conn.cursor() as cur:
        for query, params in _statements(op, _multi(conn)):
            await cur.execute(query, params)
            while True:
                if rowcount is None:
                    rowcount = cur.rowcount
                if cur.description is not None:
                    row = await cur.fetchone()
                if not await cur.nextset():
                    break
    return (rowcount or 0), row


# -- the URL -------------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}")
#: The store's own options in the URL's query; the rest are the connection's.
OWN_OPTIONS = ("table", "min_size", "max_size", "auto_migrate", "connect_timeout")
_CONNECT_OPTIONS = ("unix_socket", "ssl_ca", "ssl_cert", "ssl_key", "ssl_verify_cert", "charset")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def to_bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(text)


def table_parts(table: str) -> tuple[str, ...]:
    """``[database.]name`` as its parts, each checked (it is quoted, never bound)."""
    parts = tuple(table.split("."))
    if len(parts) > 2 or not all(_NAME.fullmatch(p) for p in parts):
        raise ValueError(
            f"invalid table name {table!r}: use [database.]name, letters, digits and "
            "underscores, at most 48 characters each"
        )
    return parts


def parse_url(url: str) -> tuple[dict[str, Any], dict[str, str]]:
    """(the drivers' connection keywords, the store's own options) of a ``mysql://`` or
    ``mariadb://`` URL; ``ValueError`` for anything else."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in {"mysql", "mariadb"}:
        raise ValueError(f"not a mysql:// or mariadb:// URL: {redact(url)!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"invalid port in the store URL {redact(url)!r}") from None
    database = unquote(parts.path.lstrip("/"))
    if not database or "/" in database:
        raise ValueError(f"the store URL {redact(url)!r} names no database (mysql://host/db)")
    kwargs: dict[str, Any] = {
        "host": unquote(parts.hostname or "localhost"),
        "port": port or 3306,
        "user": unquote(parts.username or ""),
        "password": unquote(parts.password or ""),
        "database": database,
    }
    ours: dict[str, str] = {}
    ssl: dict[str, Any] = {}
    for item in parts.query.split("&"):
        if not item:
            continue
        name, _, value = item.partition("=")
        name, value = unquote(name), unquote(value)
        if name in OWN_OPTIONS:
            ours[name] = value
        elif name in {"ssl_ca", "ssl_cert", "ssl_key"}:
            ssl[name.removeprefix("ssl_")] = value
        elif name == "ssl_verify_cert":
            ssl["verify_cert"] = to_bool(value)
        elif name in _CONNECT_OPTIONS:
            kwargs[name] = value
        else:
            known = ", ".join((*OWN_OPTIONS, *_CONNECT_OPTIONS))
            raise ValueError(
                f"unknown option {name!r} in the store URL {redact(url)!r} (known: {known})"
            )
    if ssl:
        kwargs["ssl"] = ssl
    return kwargs, ours


def option(name: str, given: Any, default: Any, url_value: str | None, convert: Any) -> Any:
    """A store option from the URL or the keyword argument (not both, unless equal)."""
    if url_value is None:
        return given
    try:
        value = convert(url_value)
    except ValueError as exc:
        raise ValueError(f"invalid {name}={url_value!r} in the store URL") from exc
    if given != default and given != value:
        raise ValueError(f"{name} given both in the URL ({value!r}) and as an argument ({given!r})")
    return value


# -- pools -------------------------------------------------------------------------

#: Every connection of the store runs in this mode (the store's statements rely on it):
#: strict (too long a value is an error, never cut), backslashes escape (the client
#: libraries escape parameters so), times in UTC.
SESSION_SETUP = (
    "SET SESSION sql_mode = 'STRICT_TRANS_TABLES,NO_ENGINE_SUBSTITUTION', "
    "SESSION time_zone = '+00:00'"
)


def _idle_broken(conn: Any) -> bool:
    """True when an idle pooled connection has input (the server closed it, or is
    closing it): no round trip, a zero-timeout poll of its socket."""
    sock = getattr(conn, "_sock", None)  # PyMySQL
    if sock is None:
        transport = getattr(conn, "_transport", None)  # asyncmy
        if transport is None or transport.is_closing():
            return True
        sock = transport.get_extra_info("socket")
        if sock is None:
            return True
    try:
        fd = sock.fileno()
    except OSError:
        return True
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class _SyncPool:
    """At most ``size`` PyMySQL connections; a caller waits ``timeout`` for one.

    A pool lives as long as its store: :meth:`close` closes the idle connections, and
    those lent meanwhile as they come back, until the next :meth:`take` reopens it.
    """

    def __init__(self, connect: Callable[[], Any], size: int, timeout: float) -> None:
        self._connect = connect
        self._timeout = timeout
        self._idle: list[Any] = []
        self._free = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._closed = False

    def take(self) -> Any:
        if not self._free.acquire(timeout=self._timeout):
            raise TimeoutError(f"no pooled connection within {self._timeout:g}s")
        self._closed = False
        try:
            while True:
                with self._lock:
                    conn = self._idle.pop() if self._idle else None
                if conn is None:
                    return self._connect()
                if not _idle_broken(conn):
                    return conn
                _close(conn)
        except BaseException:
            self._free.release()
            raise

    def give(self, conn: Any, broken: bool) -> None:
        try:
            if broken or self._closed:
                _close(conn)
            else:
                with self._lock:
                    self._idle.append(conn)
        finally:
            self._free.release()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            self._closed = True
        for conn in idle:
            _close(conn)


def _connect(kwargs: dict[str, Any], timeout: float) -> Any:
    """A PyMySQL connection whose greeting, login and session setup each get ``timeout``
    (PyMySQL bounds only the TCP connect: a server that takes the connection and never
    greets, hung or with a full backlog, would hold the caller forever). Its statements
    then wait as long as the server takes (a lock wait may be long)."""
    conn = pymysql.connect(**kwargs, read_timeout=timeout, write_timeout=timeout)
    conn._read_timeout = conn._write_timeout = None  # PyMySQL applies them per read/write
    return conn


def _close(conn: Any) -> None:
    # Closing a connection the server dropped may fail: it is gone either way.
    with contextlib.suppress(Exception):
        conn.close()


class _AsyncPool:
    """:class:`_SyncPool` for one event loop, of asyncmy connections."""

    def __init__(self, connect: Callable[[], Any], size: int, timeout: float) -> None:
        self._connect = connect
        self._timeout = timeout
        self._idle: list[Any] = []
        self._free = asyncio.Semaphore(size)
        self._closed = False

    async def take(self) -> Any:
        try:
            await asyncio.wait_for(self._free.acquire(), self._timeout)
        except TimeoutError:
            raise TimeoutError(f"no pooled connection within {self._timeout:g}s") from None
        self._closed = False
        try:
            while self._idle:
                conn = self._idle.pop()
                if not _idle_broken(conn):
                    return conn
                conn.close()
            return await self._connect()
        except BaseException:
            self._free.release()
            raise

    def give(self, conn: Any, broken: bool) -> None:
        if broken or self._closed:
            conn.close()  # asyncmy's close() drops the transport: nothing to await
        else:
            self._idle.append(conn)
        self._free.release()

    def close(self) -> None:
        idle, self._idle = self._idle, []
        self._closed = True
        for conn in idle:
            conn.close()


class MySQLConnections:
    """The connection half of :class:`~retrysafe.stores.mysql.MySQLStore`: pools,
    checkout and the two executors."""

    connect_timeout: float
    max_size: int
    _where: str
    _connect_kwargs: dict[str, Any]
    _migrated: bool

    def _init_connections(self) -> None:
        self._pool: _SyncPool | None = None
        self._apools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _AsyncPool] = (
            weakref.WeakKeyDictionary()
        )
        self._pool_lock = threading.Lock()
        # A pool must not cross a fork: the child would share the parent's sockets.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_pools(ref))

    def _migration_op(self, then: Op) -> Op:
        raise NotImplementedError

    def _unavailable(self, exc: BaseException) -> StoreUnavailableError:
        if isinstance(exc, StoreUnavailableError):
            return exc
        if isinstance(exc, TimeoutError):
            reason = (
                f"no connection within {self.connect_timeout:g}s (server down or unreachable, "
                f"or all {self.max_size} pooled connections busy)"
            )
        else:
            reason = str(exc).strip() or type(exc).__name__
        return StoreUnavailableError(
            f"MySQL store at {self._where} is unavailable: {reason}",
            retry_after=max(1.0, self.connect_timeout),
        )

    def _driver_kwargs(self) -> dict[str, Any]:
        return {
            **self._connect_kwargs,
            "autocommit": True,
            "charset": self._connect_kwargs.get("charset", "utf8mb4"),
            "connect_timeout": self.connect_timeout,
            "client_flag": CLIENT.MULTI_STATEMENTS | CLIENT.FOUND_ROWS,
            "init_command": SESSION_SETUP,
            # asyncmy sends bytes as _binary'…' literals, never read in the connection's
            # charset; PyMySQL (which ignores this) always sends them as X'…' hex, twice
            # their size: a sync store's statement carries half as many bytes.
            "binary_prefix": True,
        }

    def _sync_pool(self) -> _SyncPool:
        pool = self._pool
        if pool is None:
            with self._pool_lock:
                pool = self._pool
                if pool is None:
                    kwargs = self._driver_kwargs()
                    timeout = self.connect_timeout
                    pool = _SyncPool(lambda: _connect(kwargs, timeout), self.max_size, timeout)
                    self._pool = pool
        return pool

    def _loop_pool(self) -> _AsyncPool:
        loop = asyncio.get_running_loop()
        pool = self._apools.get(loop)
        if pool is None:
            import asyncmy  # the async driver: an extra of its own

            kwargs = self._driver_kwargs()
            timeout = self.connect_timeout
            # The whole connection, its greeting and login included, in connect_timeout:
            # asyncmy bounds only the TCP connect.
            pool = _AsyncPool(
                lambda: asyncio.wait_for(asyncmy.connect(**kwargs), timeout),
                self.max_size,
                timeout,
            )
            self._apools[loop] = pool
        return pool

    # A store that borrows its connections (an ORM's) overrides these four: take a
    # connection; give it back (``broken``: it must not be reused).

    def _take(self) -> Any:
        return self._sync_pool().take()

    def _give(self, conn: Any, broken: bool = False) -> None:
        self._sync_pool().give(conn, broken)

    async def _atake(self) -> Any:
        return await self._loop_pool().take()

    async def _agive(self, conn: Any, broken: bool = False) -> None:
        self._loop_pool().give(conn, broken)

    def _ensure_migrated(self) -> None:
        if not self._migrated:
            self._run(Op("DO 0", (), lambda rowcount, row: None))

    async def _aensure_migrated(self) -> None:
        if not self._migrated:
            await self._arun(Op("DO 0", (), lambda rowcount, row: None))

    def _first(self, op: Op) -> Op:
        """``op``, after the schema's migration while it is due."""
        return op if self._migrated else self._migration_op(op)

    def _run(self, op: Op) -> Any:
        try:
            conn = self._take()
            broken = True
            try:
                flow = play(self._first(op))
                step = next(flow)
                while True:
                    try:
                        answer: tuple[int, Row | None] | BaseException = execute(conn, step)
                    except DRIVER_ERRORS as exc:
                        if errno_of(exc) in CONNECTION_LOST or not errno_of(exc):
                            raise
                        answer = exc
                    step = flow.send(answer)
            except StopIteration as stop:
                broken = False
                return stop.value
            finally:
                self._give(conn, broken)
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable(exc) from exc

    async def _arun(self, op: Op) -> Any:
        try:
            conn = await self._atake()
            broken = True
            try:
                flow = play(self._first(op))
                step = next(flow)
                while True:
                    try:
                        answer: tuple[int, Row | None] | BaseException = await aexecute(conn, step)
                    except DRIVER_ERRORS as exc:
                        if errno_of(exc) in CONNECTION_LOST or not errno_of(exc):
                            raise
                        answer = exc
                    step = flow.send(answer)
            except StopIteration as stop:
                broken = False
                return stop.value
            finally:
                await self._agive(conn, broken)
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable(exc) from exc

    def close(self) -> None:
        """Close the idle connections of the sync pool, and those in use as they come
        back; reopens on use. (The pool itself stays: a call under way gives its
        connection back to the pool it took it from.)"""
        pool = self._pool
        if pool is not None:
            pool.close()
        for loop in [loop for loop in self._apools if loop.is_closed()]:
            self._apools.pop(loop, None)

    async def aclose(self) -> None:
        """Close the running loop's idle connections and the sync pool's (see
        :meth:`close`); reopens on use."""
        pool = self._apools.get(asyncio.get_running_loop())
        if pool is not None:
            pool.close()
        self.close()


def _forget_pools(ref: weakref.ref[MySQLConnections]) -> None:
    """After ``fork()``, in the child: drop the parent's pools (never close them: that
    would end the parent's sessions)."""
    store = ref()
    if store is None:
        return
    _INHERITED.append((store._pool, list(store._apools.values())))
    store._pool = None
    store._apools = weakref.WeakKeyDictionary()
    store._pool_lock = threading.Lock()


_INHERITED: list[Any] = []
