"""The MySQL store's connections: its URL, the pools (one sync, one per event loop,
never carried across a fork), and the executors that run one op per round trip.

PyMySQL serves the sync calls and asyncmy the async ones (docs/stores.md, "MySQL
drivers"). Both speak the same protocol with the same parameter style, so every op
is written once and both executors drive it through :func:`play`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import ssl
import threading
import weakref
from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit

import pymysql
from pymysql.constants import CLIENT

from retrysafe.errors import MissingExtraError, StoreUnavailableError
from retrysafe.stores._options import to_bool
from retrysafe.stores._redact import redact, redact_in
from retrysafe.stores._sockets import has_input

__all__ = [
    "CONNECTION_LOST",
    "DRIVER_ERRORS",
    "UNAVAILABLE_ERRORS",
    "MySQLConnections",
    "Op",
    "aexecute",
    "classify",
    "errno_of",
    "execute",
    "note_packet_limit",
    "packet_limit",
    "play",
    "retry_locked",
    "wire_size",
]

Row = Sequence[Any]


class Op(NamedTuple):
    """One round trip and how to read its answer: ``parse(rowcount, row)``.

    ``query`` is one statement, or several run in one round trip (``params`` then
    holds each one's parameters): ``rowcount`` is the first statement's, ``row`` the
    first row of the last statement that returned rows. ``parse`` may return another
    op, which runs next on the same connection. ``recover(op, error)`` gives the op
    to run instead of a failed one, or raises; by default a deadlock (nothing
    written) runs the op again, a few times. Either may also give
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


#: A deadlock: InnoDB rolled the statement back, nothing was written, and running it
#: again is what the server asks. A lock wait timeout (1205) is not retried: it already
#: waited the server's innodb_lock_wait_timeout, and becomes StoreUnavailableError.
_LOCK_ERRORS = frozenset({1213})
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


def retry_locked(op: Op, exc: BaseException, tries: int = 0) -> Op:
    """``op`` again after a deadlock (InnoDB rolled its statement back), at most
    :data:`_MAX_LOCK_RETRIES` times; any other error is raised."""
    if errno_of(exc) in _LOCK_ERRORS and tries < _MAX_LOCK_RETRIES:
        # (an op with a recover of its own replaces this one again, counting on)
        return op._replace(recover=lambda o, e: retry_locked(o, e, tries + 1))
    raise exc


def play(op: Op) -> Generator[Op, tuple[int, Row | None] | BaseException, Any]:
    """Run ``op`` and what follows it: yields each op to execute, receives its
    ``(rowcount, row)`` or the driver error it raised, returns the result."""
    while True:
        answer = yield op
        if isinstance(answer, BaseException):
            recover = op.recover
            result = recover(op, answer) if recover is not None else retry_locked(op, answer)
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


class _Hex:
    """Bytes that the store's asyncmy connections send as a hex literal."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _hex_literal(value: _Hex, mapping: Any = None) -> str:
    return "_binary X'" + value.data.hex() + "'"


async def aexecute(conn: Any, op: Op) -> tuple[int, Row | None]:
    """:func:`execute` on an asyncmy connection."""
    rowcount: int | None = None
    row: Row | None = None
    # asyncmy escapes bytes a character at a time (about 17 ms per MiB, on the event
    # loop); the store's own connections take them as hex literals (under 3 ms).
    hexed = getattr(conn, "sends_hex", False)
    async with conn.cursor() as cur:
        for query, params in _statements(op, _multi(conn)):
            if hexed:
                params = [_Hex(p) if p.__class__ is bytes else p for p in params]
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

#: The store's own options in the URL's query; the rest are the connection's.
OWN_OPTIONS = ("table", "min_size", "max_size", "auto_migrate", "connect_timeout")
_SSL_OPTIONS = ("ssl", "ssl_ca", "ssl_cert", "ssl_key", "ssl_verify_cert")
_CONNECT_OPTIONS = ("unix_socket", *_SSL_OPTIONS)


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
    tls: dict[str, str] = {}
    for item in parts.query.split("&"):
        if not item:
            continue
        name, _, value = item.partition("=")
        name, value = unquote(name), unquote(value)
        if name in OWN_OPTIONS:
            ours[name] = value
        elif name in _SSL_OPTIONS:
            tls[name] = value
        elif name in _CONNECT_OPTIONS:
            kwargs[name] = value
        else:
            known = ", ".join((*OWN_OPTIONS, *_CONNECT_OPTIONS))
            raise ValueError(
                f"unknown option {name!r} in the store URL {redact(url)!r} (known: {known})"
            )
    if tls:
        try:
            kwargs["ssl"] = _tls_context(tls)
        except (ValueError, OSError) as exc:
            raise ValueError(
                f"invalid TLS options in the store URL {redact(url)!r}: {exc}"
            ) from None
    return kwargs, ours


def _tls_context(options: dict[str, str]) -> ssl.SSLContext | None:
    """The TLS context of ``ssl=true`` or any ``ssl_*`` option: the server's certificate
    and host name are verified (against ``ssl_ca``, else the system's CAs) unless
    ``ssl_verify_cert=false``; ``ssl_cert`` and ``ssl_key`` present a client certificate."""
    if "ssl" in options and not to_bool(options["ssl"]) and len(options) == 1:
        return None
    context = ssl.create_default_context(cafile=options.get("ssl_ca"))
    if not to_bool(options.get("ssl_verify_cert", "true")):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if "ssl_cert" in options:
        context.load_cert_chain(options["ssl_cert"], options.get("ssl_key"))
    return context


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
    return fd < 0 or has_input(fd)


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
            with self._lock:
                keep = not (broken or self._closed)
                if keep:
                    self._idle.append(conn)
            if not keep:
                _close(conn)
        finally:
            self._free.release()

    def close(self) -> None:
        """Close the idle connections, and each busy one when it comes back."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._closed = True
        for conn in idle:
            _close(conn)


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
        if self._free.locked():
            try:
                await asyncio.wait_for(self._free.acquire(), self._timeout)
            except TimeoutError:
                raise TimeoutError(f"no pooled connection within {self._timeout:g}s") from None
        else:
            # Free: acquire() returns without suspending. wait_for would wrap it in a
            # task and a timer, three more turns of the loop on every store call.
            await self._free.acquire()
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


class _StoreConnection(pymysql.connections.Connection):  # type: ignore[misc]
    """One of the store's own PyMySQL connections."""


@functools.cache
def _async_driver() -> tuple[type[Any], dict[Any, Any]]:
    """The class of the store's asyncmy connections (they send bytes as hex literals)
    and their encoders."""
    try:
        import asyncmy.connection
        import asyncmy.converters
    except ImportError as exc:
        raise MissingExtraError("mysql", "the MySQL store's async calls", name="asyncmy") from exc
    connection_class = type("HexConnection", (asyncmy.connection.Connection,), {"sends_hex": True})
    return connection_class, {**asyncmy.converters.conversions, _Hex: _hex_literal}


#: The server errors that sending again cannot cure: a value that does not fit (too
#: long, not in the column's charset, out of range, NULL where none may be, a packet
#: over max_allowed_packet), a missing table, a refused permission. The engine gives
#: up a completion at once on them instead of resending it for the whole lease.
_PERMANENT = frozenset({1044, 1045, 1048, 1142, 1143, 1146, 1153, 1264, 1292, 1366, 1406})
#: The attribute where a connection keeps its server's ``max_allowed_packet``.
_PACKET_LIMIT = "retrysafe_max_packet"
#: What a parameter adds beyond its own bytes at most: a literal's prefix and quotes
#: (``_binary X'…'``), the separators of a multi-statement packet, the command byte.
_LITERAL_ROOM = 16
#: The characters the drivers escape with a backslash in a text literal.
_ESCAPED = (b"\\", b"'", b'"', b"\0", b"\n", b"\r", b"\x1a")


def packet_limit(conn: Any) -> int | None:
    """The ``max_allowed_packet`` noted on ``conn`` (:func:`note_packet_limit`), if any."""
    return getattr(conn, _PACKET_LIMIT, None)


def note_packet_limit(conn: Any, limit: Any) -> None:
    """Keep ``conn``'s server's ``max_allowed_packet`` on it: the executors then refuse a
    larger statement before sending it (see ``MySQLConnections._check_size``)."""
    setattr(conn, _PACKET_LIMIT, int(limit))


def wire_size(op: Op) -> int:
    """How many bytes ``op``'s statements take on the wire, at most: bytes as hex
    literals (both drivers send them so), texts in UTF-8 with their escapes."""
    if isinstance(op.query, str):
        size, params = len(op.query), op.params
    else:
        size = sum(map(len, op.query))
        params = [p for ps in op.params for p in ps]
    for value in params:
        size += _LITERAL_ROOM
        if value.__class__ is bytes:
            size += 2 * len(value)
        elif value.__class__ is str:
            data = value.encode("utf-8", "surrogatepass")
            size += len(data)
            if len(data) > 4096:
                size += sum(data.count(c) for c in _ESCAPED)
            else:
                size += len(data)  # at most every byte escaped; cheaper than counting
    return size


_READ_LIMIT = "SELECT @@max_allowed_packet"


def classify(exc: BaseException) -> BaseException:
    """``exc`` when an op's ``recover`` may see it (a server error, the connection
    intact); else raise it (the connection is lost, or its state unknown)."""
    errno = errno_of(exc)
    if not errno or errno in CONNECTION_LOST:
        raise exc
    return exc


class MySQLConnections:
    """The connection half of :class:`~retrysafe.stores.mysql.MySQLStore`: pools,
    checkout and the two executors."""

    url: str
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
            reason = redact_in(str(exc).strip() or type(exc).__name__, self.url)
        return StoreUnavailableError(
            f"MySQL store at {self._where} is unavailable: {reason}",
            retry_after=max(1.0, self.connect_timeout),
            transient=errno_of(exc) not in _PERMANENT,
        )

    def _driver_kwargs(self) -> dict[str, Any]:
        return {
            **self._connect_kwargs,
            "autocommit": True,
            # The tables are utf8mb4: a narrower connection charset cannot carry
            # every text a record holds.
            "charset": "utf8mb4",
            "connect_timeout": self.connect_timeout,
            "client_flag": CLIENT.MULTI_STATEMENTS | CLIENT.FOUND_ROWS,
            "init_command": SESSION_SETUP,
            # asyncmy sends bytes as _binary'…' literals, never read in the connection's
            # charset (the store's own asyncmy connections send hex, see _Hex); PyMySQL
            # always sends them as _binary X'…' hex.
            "binary_prefix": True,
        }

    def _sync_pool(self) -> _SyncPool:
        pool = self._pool
        if pool is None:
            with self._pool_lock:
                pool = self._pool
                if pool is None:
                    pool = _SyncPool(self._connect, self.max_size, self.connect_timeout)
                    self._pool = pool
        return pool

    def _connect(self) -> Any:
        """A new PyMySQL connection whose greeting, login and session setup each get
        ``connect_timeout`` (PyMySQL bounds only the TCP connect: a server that takes
        the connection and never greets would hold the caller forever); its
        statements then wait as long as the server takes (a lock wait may be long)."""
        timeout = self.connect_timeout
        conn = _StoreConnection(
            **self._driver_kwargs(), read_timeout=timeout, write_timeout=timeout
        )
        try:
            # Each connection reads its server's limit (it may change, or differ after a
            # failover), still within connect_timeout.
            with conn.cursor() as cur:
                cur.execute(_READ_LIMIT)
                note_packet_limit(conn, cur.fetchone()[0])
        except BaseException:
            _close(conn)
            raise
        conn._read_timeout = conn._write_timeout = None  # PyMySQL applies them per read
        return conn

    async def _aconnect(self) -> Any:
        """:meth:`_connect` for asyncio: an asyncmy connection that sends bytes as hex
        literals, the whole connection bounded by ``connect_timeout``."""
        connection_class, conv = _async_driver()
        conn = connection_class(**self._driver_kwargs(), conv=conv)

        async def connect() -> None:
            await conn.connect()
            async with conn.cursor() as cur:
                await cur.execute(_READ_LIMIT)
                note_packet_limit(conn, (await cur.fetchone())[0])

        try:
            await asyncio.wait_for(connect(), self.connect_timeout)
        except BaseException:
            conn.close()
            raise
        return conn

    def _loop_pool(self) -> _AsyncPool:
        loop = asyncio.get_running_loop()
        pool = self._apools.get(loop)
        if pool is None:
            pool = _AsyncPool(self._aconnect, self.max_size, self.connect_timeout)
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

    def _check_size(self, conn: Any, op: Op) -> None:
        """Refuse, before sending, a statement over ``conn``'s server's
        ``max_allowed_packet``: the server would close the connection, which looks like
        an outage and would be resent until the lease ends. Nothing is written; the
        engine gives up at once. A connection whose limit is not noted is not checked."""
        limit = packet_limit(conn)
        if limit is not None and (size := wire_size(op)) > limit:
            raise StoreUnavailableError(
                f"MySQL store at {self._where}: a statement of {size} bytes exceeds the "
                f"server's max_allowed_packet ({limit}); store a smaller answer or raise "
                "max_allowed_packet (new connections read it)",
                transient=False,
            )

    def _run(self, op: Op) -> Any:
        try:
            conn = self._take()
            broken = True
            try:
                flow = play(self._first(op))
                step = next(flow)
                while True:
                    self._check_size(conn, step)
                    try:
                        answer: tuple[int, Row | None] | BaseException = execute(conn, step)
                    except DRIVER_ERRORS as exc:
                        answer = classify(exc)
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
                    self._check_size(conn, step)
                    try:
                        answer: tuple[int, Row | None] | BaseException = await aexecute(conn, step)
                    except DRIVER_ERRORS as exc:
                        answer = classify(exc)
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
