"""The Redis store's own connections (stores/redis/connections.py): which URLs use
them, that they answer as the redis-py path does, and how they connect, wait, time
out, drop a stale or broken connection and set a connection up (AUTH, SELECT,
CLIENT SETNAME, RESP3, a unix socket)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from _servers import RedisServer

from retrysafe import Claim, Engine, LeaseLostError, Outcome, Replay, StoreUnavailableError
from retrysafe.stores.redis import RedisStore
from retrysafe.stores.redis.connections import Endpoint, endpoint
from retrysafe.stores.redis.store import _Op, _parse_bool

OPTIONS = {"max_connections": 100, "timeout": 5.0, "socket_timeout": 5.0}


@pytest.fixture
def raw(redis_server: Any) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def _store(url: str, **kwargs: Any) -> RedisStore:
    return RedisStore(url, prefix=f"pool-{uuid.uuid4().hex[:8]}:", **kwargs)


# -- which URLs --------------------------------------------------------------------------


def test_plain_and_unix_urls_are_the_stores_own() -> None:
    e = endpoint("redis://u:pw@h:7000/3?protocol=3&client_name=me", OPTIONS)
    assert e == Endpoint(
        host="h",
        port=7000,
        path=None,
        db=3,
        username="u",
        password="pw",
        protocol=3,
        client_name="me",
        socket_timeout=5.0,
        connect_timeout=None,
        max_connections=100,
        wait=5.0,
    )
    assert "pw" not in repr(e) and "username='u'" in repr(
        e
    )  # a repr lands in logs and error reports
    e = endpoint("unix:///tmp/r.sock?db=2", OPTIONS)
    assert e is not None and (e.path, e.db, e.protocol) == ("/tmp/r.sock", 2, 2)
    # the URL's options win over the store's, as in redis-py's from_url
    e = endpoint("redis://h?max_connections=3&timeout=0.5&socket_timeout=1", OPTIONS)
    assert e is not None and (e.max_connections, e.wait, e.socket_timeout) == (3, 0.5, 1.0)
    assert endpoint("redis://", OPTIONS) == endpoint("redis://localhost:6379/0", OPTIONS)


@pytest.mark.parametrize(
    "url",
    [
        "rediss://h:6380/0",  # TLS
        "rediss://h/0?ssl_cert_reqs=none",
        "redis://h/0?socket_keepalive=1",
        "redis://h/0?health_check_interval=30",
        "redis://h/0?encoding=latin-1",
        "redis://u@h/0",  # a username without a password
    ],
)
def test_other_options_stay_on_redis_py(url: str) -> None:
    assert endpoint(url, OPTIONS) is None
    store = RedisStore(url)
    assert store._endpoint is None
    store.close()


def test_a_cluster_stays_on_redis_py() -> None:
    assert RedisStore("redis+cluster://127.0.0.1:7000")._endpoint is None


# -- the same answers as the redis-py path ------------------------------------------------


def _walk(engine: Engine, mode: str) -> list[Any]:
    """Every hot command once: claim, replay, conflict, renew, fail, complete, get;
    through the engine's sync methods or its async ones (on a loop of its own)."""
    loop = None
    if mode == "async":
        loop = asyncio.new_event_loop()
    elif mode == "uvloop":  # (the gateway's loop: its transports are not asyncio's)
        loop = pytest.importorskip("uvloop").new_event_loop()

    def call(name: str, *args: Any, **kwargs: Any) -> Any:
        if loop is None:
            return getattr(engine, name)(*args, **kwargs)
        return loop.run_until_complete(getattr(engine, "a" + name)(*args, **kwargs))

    out: list[Any] = []
    first = call("begin", "a", operation="op", fingerprint="f1")
    assert isinstance(first, Claim)
    with pytest.raises(Exception) as conflict:
        call("begin", "a", operation="op", fingerprint="f2")
    out.append(type(conflict.value).__name__)
    lease = first.lease_until
    call("renew", first, 30)
    out.append(first.lease_until > lease)
    call("complete", first, Outcome.json({"n": 1}))
    replay = call("begin", "a", operation="op", fingerprint="f1")
    assert isinstance(replay, Replay)
    out.append(replay.outcome.value)
    second = call("begin", "b", operation="op")
    assert isinstance(second, Claim)
    call("fail", second, Outcome.json("no", status=500), final=False)
    again = call("begin", "b", operation="op")
    assert isinstance(again, Claim)
    out.append(again.attempts)
    with pytest.raises(LeaseLostError):
        call("complete", second, Outcome.json("late"))
    record = engine.store.get(first.key_hash)
    assert record is not None and record.outcome is not None
    out.append((record.status.value, record.outcome.value))
    if loop is not None:
        loop.run_until_complete(engine.store.aclose())
        loop.close()
    return out


@pytest.mark.parametrize("mode", ["sync", "async", "uvloop"])
def test_both_paths_give_the_same_answers(redis_server: Any, mode: str) -> None:
    answers = []
    for url in (redis_server.url, f"{redis_server.url}?health_check_interval=3600"):
        store = _store(url)
        assert (store._endpoint is not None) == (url == redis_server.url)
        answers.append(_walk(Engine(store), mode))
        store.close()
    assert answers[0] == answers[1]
    assert answers[0][2] == {"n": 1}


# -- connections ---------------------------------------------------------------------------


def _clients(raw: redis.Redis, name: str) -> list[dict[str, Any]]:
    return [c for c in raw.client_list() if c.get("name") == name]


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_connection_is_set_up_as_its_url_says(raw: redis.Redis, protocol: int) -> None:
    """AUTH as an ACL user, SELECT, CLIENT SETNAME and HELLO, sync and async."""
    user, password = f"u{uuid.uuid4().hex[:8]}", "s3cret-pool"
    raw.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "+@all")
    name = f"rs-{uuid.uuid4().hex[:8]}"
    host, port = (
        raw.connection_pool.connection_kwargs["host"],
        raw.connection_pool.connection_kwargs["port"],
    )
    url = f"redis://{user}:{password}@{host}:{port}/5?client_name={name}&protocol={protocol}"
    try:
        store = _store(url)
        assert store._endpoint is not None
        engine = Engine(store)
        claim = engine.begin("k", operation="op")
        assert isinstance(claim, Claim)
        (info,) = _clients(raw, name)
        assert (info["user"], info["db"], info["resp"]) == (user, "5", str(protocol))
        in_five = redis.Redis(host=host, port=port, db=5)
        assert in_five.get(store.record_key(claim.key_hash)) is not None
        assert raw.get(store.record_key(claim.key_hash)) is None  # not in db 0
        in_five.close()

        async def twice() -> Any:
            await engine.acomplete(claim, Outcome.json(1))
            found = await engine.abegin("k", operation="op")
            assert len(_clients(raw, name)) == 2  # the loop's own connection
            await store.aclose()
            return found

        assert isinstance(asyncio.run(twice()), Replay)
        store.close()
    finally:
        raw.execute_command("ACL", "DELUSER", user)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_wrong_password_is_unavailable_and_not_shown(redis_server: Any, mode: str) -> None:
    url = redis_server.url.replace("redis://", "redis://nobody:wrong-pw@", 1)
    store = _store(url)
    engine = Engine(store)
    with pytest.raises(StoreUnavailableError) as info:
        if mode == "sync":
            engine.begin("k", operation="op")
        else:
            asyncio.run(engine.abegin("k", operation="op"))
    assert "wrong-pw" not in str(info.value)
    assert store._pool is None or store._pool.connections == 0
    store.close()


def test_a_unix_socket(tmp_path: Path) -> None:
    path = tmp_path / "r.sock"
    with RedisServer(extra=["--unixsocket", str(path), "--unixsocketperm", "700"]):
        store = _store(f"unix://{path}?db=1")
        assert store._endpoint is not None and store._endpoint.path == str(path)
        engine = Engine(store)
        claim = engine.begin("k", operation="op")
        assert isinstance(claim, Claim)
        engine.complete(claim, Outcome.json("u"))

        async def replay() -> Any:
            found = await engine.abegin("k", operation="op")
            await store.aclose()
            return found

        found = asyncio.run(replay())
        assert isinstance(found, Replay) and found.outcome.value == "u"
        store.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_killed_connection_is_dropped_unasked(raw: redis.Redis, mode: str) -> None:
    """The server closed an idle connection (a restart, a CLIENT KILL): the next call
    opens another rather than fail."""
    name = f"rs-{uuid.uuid4().hex[:8]}"
    host, port = (
        raw.connection_pool.connection_kwargs["host"],
        raw.connection_pool.connection_kwargs["port"],
    )
    store = _store(f"redis://{host}:{port}/0?client_name={name}")
    engine = Engine(store)

    def kill() -> None:
        raw.execute_command("CLIENT", "KILL", "USER", "default", "SKIPME", "yes")
        while _clients(raw, name):
            pass

    if mode == "sync":
        assert isinstance(engine.begin("a", operation="op"), Claim)
        kill()
        assert isinstance(engine.begin("b", operation="op"), Claim)
        assert store._pool is not None and store._pool.connections == 1
    else:

        async def run() -> None:
            assert isinstance(await engine.abegin("a", operation="op"), Claim)
            kill()
            assert isinstance(await engine.abegin("b", operation="op"), Claim)
            assert store._pools[asyncio.get_running_loop()].connections == 1
            await store.aclose()

        asyncio.run(run())
    store.close()


def _blpop(key: str) -> _Op:
    return _Op(("BLPOP", key, 0), _parse_bool, "k")


def _fails_leaving(store: RedisStore, op: _Op, mode: str, match: str) -> int:
    """Run ``op`` (sync, or on a loop of its own), which must fail as ``match``;
    how many connections its pool has open after it."""
    if mode == "sync":
        with pytest.raises(StoreUnavailableError, match=match):
            store._run(op)
        assert store._pool is not None
        return store._pool.connections

    async def run() -> int:
        with pytest.raises(StoreUnavailableError, match=match):
            await store._arun(op)
        left = store._pools[asyncio.get_running_loop()].connections
        await store.aclose()
        return left

    return asyncio.run(run())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_read_past_socket_timeout_closes_its_connection(redis_server: Any, mode: str) -> None:
    store = _store(redis_server.url, socket_timeout=0.2)
    op = _blpop(f"never-{uuid.uuid4().hex[:8]}")
    assert _fails_leaving(store, op, mode, "Timeout reading from socket") == 0
    assert store.get("0" * 64) is None  # the next call has a connection of its own
    store.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_exhausted_pool_is_unavailable_after_its_wait(raw: redis.Redis, mode: str) -> None:
    """One connection, held by a blocked command: the next call waits ``timeout`` for
    it, then is unavailable, as redis-py's BlockingConnectionPool."""
    host, port = (
        raw.connection_pool.connection_kwargs["host"],
        raw.connection_pool.connection_kwargs["port"],
    )
    waiting = f"held-{uuid.uuid4().hex[:8]}"
    store = _store(f"redis://{host}:{port}/0?max_connections=1&timeout=0.1")

    async def run() -> None:
        held = asyncio.ensure_future(store._arun(_blpop(waiting)))
        while not any(c.get("cmd") == "blpop" for c in raw.client_list()):
            await asyncio.sleep(0.01)
        with pytest.raises(StoreUnavailableError, match="No connection available"):
            await store._arun(_Op(("GET", "x"), _parse_bool, "k"))
        raw.rpush(waiting, b"x")
        assert await held is True
        assert await store.aget("0" * 64) is None  # the connection is back for others
        await store.aclose()

    if mode == "async":
        asyncio.run(run())
    else:
        import threading

        done = threading.Event()
        thread = threading.Thread(target=lambda: (store._run(_blpop(waiting)), done.set()))
        thread.start()
        while not any(c.get("cmd") == "blpop" for c in raw.client_list()):
            pass
        with pytest.raises(StoreUnavailableError, match="No connection available"):
            store.get("0" * 64)
        raw.rpush(waiting, b"x")
        thread.join()
        assert done.is_set()
        assert store.get("0" * 64) is None
    store.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_error_reply_keeps_its_connection(
    redis_server: Any, raw: redis.Redis, mode: str
) -> None:
    store = _store(redis_server.url)
    name = f"{store.prefix}list"
    raw.rpush(name, b"x")
    op = _Op(("GET", name), _parse_bool, "k")
    assert _fails_leaving(store, op, mode, "not a retrysafe record") == 1
    raw.delete(name)
    store.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_flushed_scripts_are_loaded_again(redis_server: Any, raw: redis.Redis, mode: str) -> None:
    store = _store(redis_server.url)
    engine = Engine(store)
    claim = engine.begin("k", operation="op")
    assert isinstance(claim, Claim)
    raw.script_flush()
    if mode == "sync":
        engine.complete(claim, Outcome.json("done"))
    else:

        async def run() -> None:
            await engine.acomplete(claim, Outcome.json("done"))
            await store.aclose()

        asyncio.run(run())
    replay = engine.begin("k", operation="op")
    assert isinstance(replay, Replay) and replay.outcome.value == "done"
    store.close()


def test_close_closes_idle_connections_and_the_next_call_reconnects(redis_server: Any) -> None:
    store = _store(redis_server.url)
    assert store.get("0" * 64) is None
    pool = store._pool
    assert pool is not None and pool.connections == 1
    store.close()
    assert pool.connections == 0 and store._pool is None
    assert store.get("0" * 64) is None
    store.close()


async def test_a_cancelled_waiter_leaves_the_queue(redis_server: Any, raw: redis.Redis) -> None:
    """Two calls wait for the one connection; the first is cancelled: the second gets
    it when it comes back, and the pool still holds one connection."""
    store = _store(f"{redis_server.url}?max_connections=1")
    waiting = f"held-{uuid.uuid4().hex[:8]}"
    held = asyncio.ensure_future(store._arun(_blpop(waiting)))
    while not any(c.get("cmd") == "blpop" for c in raw.client_list()):
        await asyncio.sleep(0.01)
    pool = store._pools[asyncio.get_running_loop()]
    first = asyncio.ensure_future(store.aget("0" * 64))
    second = asyncio.ensure_future(store.aget("1" * 64))
    while len(pool._waiters) < 2:
        await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    raw.rpush(waiting, b"x")
    assert await held is True
    assert await second is None
    assert pool.connections == 1 and not pool._waiters
    await store.aclose()
