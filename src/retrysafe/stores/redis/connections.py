"""The store's own connections to one standalone Redis server: a bounded pool of
sockets, sync or per event loop, each with a ``hiredis.Reader``; commands packed by
``hiredis.pack_command``. Why, and what still goes through redis-py: docs/stores.md
("The store's own connections")."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, cast

from redis import exceptions as _rx
from redis._parsers import BaseParser
from redis.connection import Connection, UnixDomainSocketConnection, parse_url

try:
    import hiredis
except ImportError:  # pragma: no cover - the redis extra brings it; redis-py does without
    _HIREDIS = False
else:
    _HIREDIS = True

__all__ = ["MAX_REPLY", "AsyncPool", "Endpoint", "Pool", "endpoint"]

#: Options of redis-py's pool and connection the store's own path handles the same
#: way; a URL with any other (TLS, keepalive, health checks, ...) stays on redis-py.
_OURS = frozenset(
    {
        "host",
        "port",
        "path",
        "db",
        "username",
        "password",
        "protocol",
        "client_name",
        "socket_timeout",
        "socket_connect_timeout",
        "max_connections",
        "timeout",
        "connection_class",
    }
)

_RECV = 65536
#: The most bytes one reply may take: a Redis string's own bound (512 MiB, the
#: server's default ``proto-max-bulk-len``) and room for the rest of a reply. A
#: garbled or hostile stream past it closes its connection rather than fill memory.
MAX_REPLY = (512 << 20) + (1 << 20)


class _Link(Protocol):
    reader: Any  # its hiredis.Reader


_C = TypeVar("_C", bound=_Link)  # a pool's connection


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where and how to connect: one server, as redis-py would from the same URL."""

    host: str
    port: int
    path: str | None  # a unix socket's path
    db: int
    username: str | None
    password: str | None = field(repr=False)  # never in a log or an error report
    protocol: int
    client_name: str | None
    socket_timeout: float | None
    connect_timeout: float | None
    max_connections: int
    #: How long a call waits for a free connection when all are in use (None: forever).
    wait: float | None

    @property
    def where(self) -> str:
        return self.path or f"{self.host}:{self.port}"


def endpoint(url: str, options: dict[str, Any]) -> Endpoint | None:
    """The endpoint of a standalone ``redis://`` or ``unix://`` URL, with the store's
    ``options`` under the URL's as redis-py merges them (``max_connections``, the
    pool's wait ``timeout``, socket timeouts); None when the URL asks for anything
    this module does not do the same way as redis-py (or hiredis or ``poll`` is
    missing)."""
    if not _HIREDIS or not hasattr(select, "poll"):  # (Windows has no poll)
        return None
    kwargs = {**options, **parse_url(url)}
    if not kwargs.keys() <= _OURS or (kwargs.get("username") and not kwargs.get("password")):
        return None
    kind = kwargs.pop("connection_class", Connection)
    if kind not in (Connection, UnixDomainSocketConnection):
        return None
    protocol = int(kwargs.get("protocol") or 2)
    if protocol not in (2, 3):
        return None
    return Endpoint(
        host=kwargs.get("host") or "localhost",
        port=int(kwargs.get("port") or 6379),
        path=kwargs.get("path") if kind is UnixDomainSocketConnection else None,
        db=int(kwargs.get("db") or 0),
        username=kwargs.get("username"),
        password=kwargs.get("password"),
        protocol=protocol,
        client_name=kwargs.get("client_name"),
        socket_timeout=kwargs.get("socket_timeout"),
        connect_timeout=kwargs.get("socket_connect_timeout"),
        max_connections=int(kwargs["max_connections"]),
        wait=kwargs.get("timeout"),
    )


# -- shared by both pools -------------------------------------------------------------


def _reader() -> Any:
    """A reply reader; error replies become redis-py's exceptions (its own table)."""
    return hiredis.Reader(protocolError=_rx.InvalidResponse, replyError=BaseParser.parse_error)


def _hello(e: Endpoint) -> Generator[tuple[Any, ...], Any, None]:
    """A new connection's set-up, as redis-py's ``on_connect``: yields each command,
    is sent its reply (or the error reply thrown in)."""
    if e.protocol == 3:
        auth = ("AUTH", e.username or "default", e.password) if e.password else ()
        reply = yield ("HELLO", 3, *auth)
        if not isinstance(reply, dict) or reply.get(b"proto") != 3:
            raise _rx.ConnectionError("Invalid RESP version")
    elif e.username or e.password:
        args = (e.username, e.password) if e.username else (e.password,)
        try:
            reply = yield ("AUTH", *args)
        except _rx.AuthenticationWrongNumberOfArgsError:  # Redis < 6: a password only
            reply = yield ("AUTH", e.password)
        if reply != b"OK":
            raise _rx.AuthenticationError("Invalid Username or Password")
    if e.client_name and (yield ("CLIENT", "SETNAME", e.client_name)) != b"OK":
        raise _rx.ConnectionError("Error setting client name")
    if e.db and (yield ("SELECT", e.db)) != b"OK":
        raise _rx.ConnectionError("Invalid Database")


def _next(steps: Generator[tuple[Any, ...], Any, None], reply: Any) -> tuple[Any, ...] | None:
    """The set-up's next command after ``reply`` (None to start); None once it is done."""
    try:
        return steps.throw(reply) if isinstance(reply, Exception) else steps.send(reply)
    except StopIteration:
        return None


def _lost(exc: OSError, e: Endpoint, connecting: bool = False) -> _rx.RedisError:
    """What redis-py raises for a socket's failure (the store reports it unavailable)."""
    if isinstance(exc, TimeoutError):
        text = "Timeout connecting to server" if connecting else "Timeout reading from socket"
        return _rx.TimeoutError(text)
    if connecting and exc.errno is not None:
        return _rx.ConnectionError(
            f"Error {exc.errno} connecting to {e.where}. {exc.strerror or exc}."
        )
    doing = "connecting to" if connecting else "while reading from"
    return _rx.ConnectionError(f"Error {doing} {e.where}: {exc}")


def _in_step(reply: Any) -> bool:
    """Whether a connection that read ``reply`` goes back to the pool: a reply, or an
    error reply that is a :class:`~redis.exceptions.ResponseError` (not LOADING, a
    lost authentication, ...: redis-py's connection errors)."""
    return not isinstance(reply, _rx.RedisError) or isinstance(reply, _rx.ResponseError)


def _closed() -> _rx.ConnectionError:
    return _rx.ConnectionError("Connection closed by server.")


def _too_long() -> _rx.InvalidResponse:
    return _rx.InvalidResponse(f"A reply over {MAX_REPLY} bytes")


def _watch(fd: int) -> Any:
    """A poller of ``fd``'s readability (``select.poll``: no limit on the fd's number,
    as ``select.select`` has), or None without a descriptor."""
    if fd < 0:
        return None
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return poller


def _stale(poller: Any) -> bool:
    """An idle connection with something to read (EOF after a server restart, or a
    reply nobody asked for) is not reused."""
    return poller is not None and bool(poller.poll(0))


def _no_connection() -> _rx.ConnectionError:
    return _rx.ConnectionError("No connection available.")


@contextlib.contextmanager
def _setting_up(e: Endpoint, close: Callable[[], None]) -> Iterator[None]:
    """Around a new connection's set-up: on any failure, close it; a socket's as
    redis-py raises it."""
    try:
        yield
    except BaseException as exc:
        close()
        if isinstance(exc, OSError):
            raise _lost(exc, e, connecting=True) from exc
        raise


class _Bounded(Generic[_C]):
    """What both pools share: the idle connections, the count, giving back, closing."""

    def __init__(self, e: Endpoint) -> None:
        self.endpoint = e
        self._idle: list[_C] = []
        self._count = 0  # open connections, idle or in use
        self._closed = False

    @property
    def connections(self) -> int:
        """How many connections are open, idle or in use."""
        return self._count

    def _settle(self, conn: _C, reply: Any) -> Any:
        """Give ``conn`` back (or close it), then the reply, or its error raised. A
        connection with bytes left after its reply (nobody asked for them) is closed:
        the next caller would read them as its own reply."""
        if _in_step(reply) and not conn.reader.has_data():
            self._give_back(conn)
        else:
            self._discard(conn)
        if isinstance(reply, _rx.RedisError):
            raise reply
        return reply

    def _give_back(self, conn: _C) -> None:
        self._idle.append(conn)
        if self._closed:  # (after the append: a close() running now, or done, drains it)
            self._drain()
        else:
            self._returned()

    def _returned(self) -> None:
        """A connection is idle again: wake a caller waiting for one."""
        raise NotImplementedError

    def _discard(self, conn: _C) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Close the idle connections; those in use close when their call ends."""
        self._closed = True
        self._drain()

    def _drain(self) -> None:
        idle = self._idle
        while True:
            try:
                conn = idle.pop()
            except IndexError:  # (another thread took the last one)
                return
            self._discard(conn)


# -- sync -------------------------------------------------------------------------------


class _Conn:
    __slots__ = ("poller", "reader", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.poller = _watch(sock.fileno())
        self.reader = _reader()

    def call(self, packed: bytes) -> Any:
        """Send one packed command; its reply (an error reply as an exception object)."""
        sock, reader = self.sock, self.reader
        sock.sendall(packed)
        reply = reader.gets()
        read = 0
        while reply is False:
            data = sock.recv(_RECV)
            if not data:
                raise _closed()
            read += len(data)
            if read > MAX_REPLY:
                raise _too_long()
            reader.feed(data)
            reply = reader.gets()
        return reply


class Pool(_Bounded[_Conn]):
    """Connections shared by threads: at most ``max_connections``; a call past them
    waits for a free one up to the endpoint's ``wait``. A connection whose command
    failed in any way but an error reply is closed, never reused."""

    def __init__(self, e: Endpoint) -> None:
        super().__init__(e)
        self._waiting = 0
        self._cond = threading.Condition(threading.Lock())

    def call(self, args: Sequence[Any]) -> Any:
        """One command's reply; an error reply raised as redis-py's exception."""
        packed = hiredis.pack_command(tuple(args))
        conn = self._take()
        try:
            reply = conn.call(packed)
        except OSError as exc:
            self._discard(conn)
            raise _lost(exc, self.endpoint) from exc
        except BaseException:  # a closed connection, a bad reply, an interrupt
            self._discard(conn)
            raise
        return self._settle(conn, reply)

    def _take(self) -> _Conn:
        idle = self._idle
        while True:
            try:
                conn = idle.pop()
            except IndexError:
                conn = self._open_or_wait()
            try:
                if not _stale(conn.poller):
                    return conn
            except BaseException:  # an interrupt: the connection is not lost to the bound
                self._discard(conn)
                raise
            self._discard(conn)

    def _open_or_wait(self) -> _Conn:
        deadline: float | None = None
        with self._cond:
            self._waiting += 1  # before looking: a connection given back now wakes us
            try:
                while True:
                    if self._idle:
                        return self._idle.pop()
                    if self._count < self.endpoint.max_connections:
                        self._count += 1
                        break
                    wait = self.endpoint.wait
                    if wait is not None:
                        now = time.monotonic()
                        deadline = deadline or now + wait
                        if now >= deadline:
                            raise _no_connection()
                        wait = deadline - now
                    self._cond.wait(wait)
            finally:
                self._waiting -= 1
        try:
            return self._connect()
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def _connect(self) -> _Conn:
        e = self.endpoint
        try:
            if e.path is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(e.connect_timeout)
                    sock.connect(e.path)
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((e.host, e.port), e.connect_timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            raise _lost(exc, e, connecting=True) from exc
        conn = _Conn(sock)
        with _setting_up(e, sock.close):
            sock.settimeout(e.socket_timeout)
            steps = _hello(e)
            args = _next(steps, None)
            while args is not None:
                args = _next(steps, conn.call(hiredis.pack_command(args)))
        return conn

    def _returned(self) -> None:
        if self._waiting:
            with self._cond:
                self._cond.notify()

    def _discard(self, conn: _Conn) -> None:
        conn.sock.close()
        with self._cond:
            self._count -= 1
            self._cond.notify()


# -- asyncio ------------------------------------------------------------------------------


class _Protocol(asyncio.Protocol):
    """One connection on an event loop: feeds a reader, answers the waiting call."""

    __slots__ = ("lost", "poller", "read", "reader", "transport", "waiter")

    def __init__(self) -> None:
        self.reader = _reader()
        self.waiter: asyncio.Future[Any] | None = None
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.poller: Any = None
        self.read = 0  # bytes of the awaited reply so far

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # (uvloop's: not a subclass)
        sock = transport.get_extra_info("socket")
        self.poller = _watch(sock.fileno() if sock is not None else -1)

    def data_received(self, data: bytes) -> None:
        waiter = self.waiter
        if waiter is None:  # nobody asked: this connection is out of step
            self.lost = True
            return
        reader = self.reader
        self.read += len(data)
        try:
            if self.read > MAX_REPLY:
                raise _too_long()
            reader.feed(data)
            reply = reader.gets()
        except Exception as exc:  # a malformed or endless reply: this caller's error
            self.waiter = None
            self.close()
            if not waiter.done():
                waiter.set_exception(exc)
            return
        if reply is not False:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(_closed())

    def send(self, packed: bytes, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any]:
        """Write one command; the future of its reply."""
        waiter = self.waiter = loop.create_future()
        self.read = 0
        assert self.transport is not None
        self.transport.write(packed)
        return waiter

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.abort()


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(_rx.TimeoutError("Timeout reading from socket"))


class AsyncPool(_Bounded[_Protocol]):
    """As :class:`Pool`, for the tasks of one event loop. A call cancelled while its
    reply is unread closes its connection."""

    def __init__(self, e: Endpoint, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(e)
        self.loop = loop
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def call(self, args: Sequence[Any]) -> Any:
        """As :meth:`Pool.call`."""
        packed = hiredis.pack_command(tuple(args))
        conn = await self._take()
        try:
            reply = await self._ask(conn, packed)
        except OSError as exc:
            self._discard(conn)
            raise _lost(exc, self.endpoint) from exc
        except BaseException:  # a closed connection, a timeout, a cancelled call
            self._discard(conn)
            raise
        return self._settle(conn, reply)

    async def _ask(self, conn: _Protocol, packed: bytes) -> Any:
        waiter = conn.send(packed, self.loop)
        timeout = self.endpoint.socket_timeout
        if timeout is None:
            return await waiter
        timer = self.loop.call_later(timeout, _expire, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()

    async def _take(self) -> _Protocol:
        idle = self._idle
        while True:
            conn = idle.pop() if idle else await self._open_or_wait()
            if not (conn.lost or _stale(conn.poller)):
                return conn
            self._discard(conn)

    async def _open_or_wait(self) -> _Protocol:
        deadline: float | None = None
        while True:
            if self._idle:
                return self._idle.pop()
            if self._count < self.endpoint.max_connections:
                break
            wait = self.endpoint.wait
            if wait is not None:
                now = self.loop.time()
                deadline = deadline or now + wait
                if now >= deadline:
                    raise _no_connection()
                wait = deadline - now
            waiter = self.loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, wait)
            except BaseException as exc:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken, but leaving: pass the turn on
                else:
                    with contextlib.suppress(ValueError):
                        self._waiters.remove(waiter)
                if isinstance(exc, asyncio.TimeoutError):
                    raise _no_connection() from None
                raise
        self._count += 1
        try:
            return await self._connect()
        except BaseException:
            self._count -= 1
            self._wake()
            raise

    async def _connect(self) -> _Protocol:
        e = self.endpoint
        conn = _Protocol()
        try:
            if e.path is not None:
                opening = self.loop.create_unix_connection(lambda: conn, e.path)
            else:
                opening = self.loop.create_connection(lambda: conn, e.host, e.port)
            await asyncio.wait_for(opening, e.connect_timeout)
        except OSError as exc:  # (asyncio.TimeoutError too)
            raise _lost(exc, e, connecting=True) from exc
        with _setting_up(e, conn.close):
            steps = _hello(e)
            args = _next(steps, None)
            while args is not None:
                args = _next(steps, await self._ask(conn, hiredis.pack_command(args)))
        return conn

    def _returned(self) -> None:
        if self._waiters:
            self._wake()

    def _discard(self, conn: _Protocol) -> None:
        conn.close()
        self._count -= 1
        self._wake()

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
