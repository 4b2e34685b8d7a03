"""A store that goes away: StoreUnavailableError, nothing half-written, and back to work.

Redis and PostgreSQL are really stopped and started again on the same port;
SQLite is made unavailable by another process's exclusive lock and by a file
that is not a database.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _servers import PostgresServer, RedisServer

from retrysafe import (
    Claim,
    Engine,
    Outcome,
    Replay,
    Status,
    StoreUnavailableError,
    open_store,
)


@pytest.fixture(params=["redis", "postgres"])
def server(request: pytest.FixtureRequest) -> Iterator[Any]:
    srv = RedisServer(durable=True) if request.param == "redis" else PostgresServer()
    with srv:
        yield srv


def run_both(mode: str) -> Callable[..., Any]:
    """Call engine.<name> (sync) or engine.a<name> (async, on one loop of its own)."""
    loop = asyncio.new_event_loop() if mode == "async" else None

    def call(engine: Engine, name: str, *args: Any, **kwargs: Any) -> Any:
        if loop is None:
            return getattr(engine, name)(*args, **kwargs)
        result = loop.run_until_complete(getattr(engine, "a" + name)(*args, **kwargs))
        if name == "close":
            loop.close()
        return result

    return call


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_server_stopped_mid_test(server: Any, mode: str) -> None:
    call = run_both(mode)
    engine = Engine(open_store(server.url), lease=60)
    done = call(engine, "begin", "before", operation="op")
    assert isinstance(done, Claim)
    call(engine, "complete", done, Outcome.json("kept"))
    pending = call(engine, "begin", "pending", operation="op")
    assert isinstance(pending, Claim)

    server.stop()
    for attempt in (
        lambda: call(engine, "begin", "during", operation="op"),
        lambda: call(engine, "complete", pending, Outcome.json("lost")),
        lambda: call(engine, "begin", "before", operation="op"),
    ):
        with pytest.raises(StoreUnavailableError) as err:
            attempt()
        assert err.value.code == "idempotency_store_unavailable"

    server.start()
    # Back to work on the very next call: stale connections are dropped unasked.
    replay = call(engine, "begin", "before", operation="op")
    assert isinstance(replay, Replay) and replay.outcome.value == "kept"
    # The completion that failed wrote nothing: the record is still in flight, ours.
    record = engine.store.get(pending.key_hash)
    assert record is not None and record.status is Status.PROCESSING
    assert record.token == pending.token and record.outcome is None
    call(engine, "complete", pending, Outcome.json("now"))
    fresh = call(engine, "begin", "during", operation="op")
    assert isinstance(fresh, Claim) and fresh.attempts == 1
    call(engine, "close")


def test_opening_never_connects() -> None:
    from _servers import free_port

    port = free_port()  # nothing listens here
    for url in (
        f"redis://:s3cret@127.0.0.1:{port}/0",
        f"postgresql://u:s3cret@127.0.0.1:{port}/db",
    ):
        store = open_store(url)  # must not raise
        with pytest.raises(StoreUnavailableError) as err:
            store.get("0" * 64)
        assert "s3cret" not in str(err.value) and "s3cret" not in repr(store)
        store.close()


def test_sqlite_locked_by_another_process(tmp_path: Path) -> None:
    path = tmp_path / "locked.db"
    engine = Engine(open_store(f"sqlite:///{path}?timeout=0.2"))
    claim = engine.begin("k", operation="op")
    assert isinstance(claim, Claim)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreUnavailableError, match="locked"):
            engine.begin("other", operation="op")
        with pytest.raises(StoreUnavailableError):
            engine.complete(claim, Outcome.json(1))
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    record = engine.store.get(claim.key_hash)
    assert record is not None and record.status is Status.PROCESSING
    engine.complete(claim, Outcome.json(1))
    assert isinstance(engine.begin("other", operation="op"), Claim)


def test_sqlite_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "garbage.db"
    path.write_bytes(b"this is not a database" * 100)
    engine = Engine(open_store(f"sqlite:///{path}"))
    with pytest.raises(StoreUnavailableError, match=r"garbage\.db"):
        engine.begin("k", operation="op")
