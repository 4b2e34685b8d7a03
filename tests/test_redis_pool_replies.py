"""The Redis store's own connections (stores/redis/connections.py) against a server
that misbehaves: a malformed reply, one without end, bytes nobody asked for. The
connection is closed each time, the caller gets an error, and the next caller never
reads another's reply. Also: a connection given back to a closed pool, an interrupt
in a sync call, and many short event loops."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from retrysafe.stores.redis import RedisStore, connections
from retrysafe.stores.redis.connections import AsyncPool, Pool, endpoint

#: What the fake server sends for one command: bytes, or a function of its socket.
Reply = bytes | Callable[[socket.socket], None]


class FakeServer:
    """A loopback server answering the n-th command of each connection with
    ``replies[n]`` (one command per read: the pools send one at a time)."""

    def __init__(self, replies: list[Reply]) -> None:
        self.replies = replies
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.cleanups: list[Callable[[], object]] = []  # run when the test ends
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            for reply in self.replies:
                try:
                    if not conn.recv(65536):
                        return
                    if callable(reply):
                        reply(conn)
                    else:
                        conn.sendall(reply)
                except OSError:
                    return
            conn.recv(65536)  # until the client closes

    def pool_options(self) -> tuple[str, dict[str, Any]]:
        return f"redis://127.0.0.1:{self.port}/0", {
            "max_connections": 2,
            "timeout": 5.0,
            "socket_timeout": 5.0,
        }


@pytest.fixture
def fake() -> Iterator[Callable[[list[Reply]], FakeServer]]:
    servers: list[FakeServer] = []

    def make(replies: list[Reply]) -> FakeServer:
        servers.append(FakeServer(replies))
        return servers[-1]

    yield make
    for server in servers:
        for cleanup in server.cleanups:
            cleanup()
        server.sock.close()


def _pool(server: FakeServer, mode: str) -> tuple[Callable[[tuple[Any, ...]], Any], Any]:
    """A function that sends one command through a new pool, sync or on an event
    loop of its own (where nothing may reach the loop's exception handler); the pool."""
    e = endpoint(*server.pool_options())
    assert e is not None
    if mode == "sync":
        pool = Pool(e)
        server.cleanups.append(pool.close)
        return pool.call, pool
    loop = asyncio.new_event_loop()
    errors: list[Any] = []
    loop.set_exception_handler(lambda loop, context: errors.append(context))
    apool = AsyncPool(e, loop)

    def close() -> None:
        apool.close()
        loop.run_until_complete(asyncio.sleep(0))  # (the transports' connection_lost)
        loop.close()

    server.cleanups.append(close)

    def call(args: tuple[Any, ...]) -> Any:
        try:
            return loop.run_until_complete(apool.call(args))
        finally:
            loop.run_until_complete(asyncio.sleep(0))  # let connection_lost run
            assert not errors, errors

    return call, apool


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_bytes_after_a_reply_close_its_connection(fake: Any, mode: str) -> None:
    """A reply followed by one nobody asked for: the caller gets its own, and the next
    caller gets a new connection, not the stray reply."""
    server = fake([b"+FIRST\r\n+STRAY\r\n", b"+SECOND\r\n"])
    call, pool = _pool(server, mode)
    assert call(("PING",)) == b"FIRST"
    assert pool.connections == 0
    assert call(("PING",)) == b"FIRST"  # a new connection's first reply
    assert server.accepted == 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_malformed_reply_closes_its_connection(fake: Any, mode: str) -> None:
    server = fake([b"!!not resp\r\n"])
    call, pool = _pool(server, mode)
    with pytest.raises(redis.exceptions.InvalidResponse, match="Protocol error"):
        call(("PING",))
    assert pool.connections == 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_reply_past_max_reply_closes_its_connection(
    fake: Any, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bulk string that never ends is read up to MAX_REPLY bytes, not further."""
    monkeypatch.setattr(connections, "MAX_REPLY", 100_000)

    def endless(conn: socket.socket) -> None:
        conn.sendall(b"$2000000000\r\n")
        while True:  # until the client closes the connection
            conn.sendall(b"x" * 65536)

    server = fake([endless])
    call, pool = _pool(server, mode)
    with pytest.raises(redis.exceptions.InvalidResponse, match="over 100000 bytes"):
        call(("GET", "k"))
    assert pool.connections == 0


def test_a_reply_up_to_max_reply_is_read(fake: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connections, "MAX_REPLY", 100_000)
    value = b"v" * 90_000
    call, _ = _pool(fake([b"$%d\r\n%s\r\n" % (len(value), value)]), "sync")
    assert call(("GET", "k")) == value


def test_a_connection_given_back_to_a_closed_pool_is_closed(redis_server: Any) -> None:
    e = endpoint(redis_server.url, {"max_connections": 2, "timeout": 5.0})
    assert e is not None
    pool = Pool(e)
    conn = pool._take()
    pool.close()
    assert pool._settle(conn, b"OK") == b"OK"
    assert pool.connections == 0 and not pool._idle


def test_an_interrupt_in_a_sync_call_closes_its_connection(
    redis_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt while a reply is awaited: the connection is not given back
    (its reply would reach the next caller), and the pool can open another."""
    store = RedisStore(redis_server.url, prefix=f"intr-{uuid.uuid4().hex[:8]}:")
    assert store.get("0" * 64) is None
    pool = store._pool
    assert pool is not None and pool.connections == 1

    def interrupted(self: Any, packed: bytes) -> Any:
        self.sock.sendall(packed)
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(connections._Conn, "call", interrupted)
        with pytest.raises(KeyboardInterrupt):
            store.get("0" * 64)
    assert pool.connections == 0 and not pool._idle
    assert store.get("0" * 64) is None
    store.close()


def test_an_interrupt_while_a_connection_is_taken_keeps_the_bound(
    redis_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt while an idle connection is checked: it is closed, not lost to
    the bound (with one connection allowed, the next call still gets one)."""
    store = RedisStore(
        f"{redis_server.url}?max_connections=1&timeout=0.5",
        prefix=f"take-{uuid.uuid4().hex[:8]}:",
    )
    assert store.get("0" * 64) is None
    pool = store._pool
    assert pool is not None and pool.connections == 1

    def interrupted(poller: Any) -> bool:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(connections, "_stale", interrupted)
        with pytest.raises(KeyboardInterrupt):
            store.get("0" * 64)
    assert pool.connections == 0
    assert store.get("0" * 64) is None
    store.close()


def test_many_short_event_loops_leave_one_pool(redis_server: Any) -> None:
    """A pool per event loop, dropped once its loop is closed: many ``asyncio.run``
    calls leave at most one pool, and no sockets behind."""
    store = RedisStore(redis_server.url, prefix=f"loops-{uuid.uuid4().hex[:8]}:")

    async def one() -> None:
        assert await store.aget("0" * 64) is None

    asyncio.run(one())
    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        asyncio.run(one())
    assert len(store._pools) <= 1
    gc.collect()
    # A leak leaves a socket per loop (50); the slack is for files other threads of
    # the test process open meanwhile (the whole suite shares it).
    assert len(os.listdir("/proc/self/fd")) <= fds + 10
    store.close()
    assert not store._pools
