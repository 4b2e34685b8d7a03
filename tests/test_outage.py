"""A store that goes away: StoreUnavailableError, nothing half-written, and back to work.

Redis, PostgreSQL and MariaDB are really stopped and started again on the same port;
SQLite is made unavailable by another process's exclusive lock and by a file
that is not a database.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _servers import MySQLServer, PostgresServer, RedisServer

from retrysafe import (
    Claim,
    Engine,
    LeaseLostError,
    Outcome,
    Replay,
    Status,
    StoreUnavailableError,
    open_store,
)
from retrysafe.stores.sqlite import SQLiteStore


@pytest.fixture(params=["redis", "postgres", "mysql"])
def server(request: pytest.FixtureRequest) -> Iterator[Any]:
    servers = {
        "redis": lambda: RedisServer(durable=True),
        "postgres": PostgresServer,
        "mysql": lambda: MySQLServer(durable=True),
    }
    with servers[request.param]() as srv:
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
    engine = Engine(open_store(server.url), lease=60, settle_retry=0.2)
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
        f"mysql://u:s3cret@127.0.0.1:{port}/db",
    ):
        store = open_store(url)  # must not raise
        with pytest.raises(StoreUnavailableError) as err:
            store.get("0" * 64)
        assert "s3cret" not in str(err.value) and "s3cret" not in repr(store)
        store.close()


def test_sqlite_locked_by_another_process(tmp_path: Path) -> None:
    path = tmp_path / "locked.db"
    engine = Engine(open_store(f"sqlite:///{path}?timeout=0.2"), settle_retry=0.2)
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


# -- a completion the store could not take is sent again -----------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_completion_outlives_a_short_outage(server: Any, mode: str) -> None:
    """A completion sent while the server restarts is retried (``settle_retry``) and
    lands: the record is completed, not left in flight for a takeover to run again."""
    call = run_both(mode)
    engine = Engine(open_store(server.url), lease=60, settle_retry=30)
    claim = call(engine, "begin", "k", operation="op")
    assert isinstance(claim, Claim)
    server.stop()
    outage = 0.5  # how long the server stays down, not a wait for anything
    back = threading.Timer(outage, server.start)
    started = time.monotonic()
    back.start()
    try:
        call(engine, "complete", claim, Outcome.json("done"))
    finally:
        back.join()
    assert time.monotonic() - started >= outage  # it did wait for the server
    replay = call(engine, "begin", "k", operation="op")
    assert isinstance(replay, Replay) and replay.outcome.value == "done"
    call(engine, "close")


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize(("lease", "spent"), [(5.0, 4.99), (1.0, 0.0)], ids=["late", "frozen"])
def test_resends_end_with_the_lease(server: Any, mode: str, lease: float, spent: float) -> None:
    """The resends stop when what the claim had left of its lease runs out (another
    attempt may own the key then): at once when the engine's clock says 4.99 of 5 s
    are spent; after 1 s with a clock that never moves (a test's), as what is left is
    measured on the monotonic clock from the first failed send."""
    call = run_both(mode)
    now = [1_800_000_000.0]
    engine = Engine(open_store(server.url), lease=lease, settle_retry=600, clock=lambda: now[0])
    claim = call(engine, "begin", "k", operation="op")
    assert isinstance(claim, Claim)
    server.stop()
    now[0] += spent
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError):
        call(engine, "complete", claim, Outcome.json("done"))
    waited = time.monotonic() - started
    assert lease - spent - 0.6 <= waited < lease - spent + 5  # (0.5 s: the longest backoff)
    server.start()
    call(engine, "close")


class _LostReply(SQLiteStore):
    """A real SQLite store whose first completion and failure apply, then report the
    store unreachable, as when a connection drops before the reply arrives."""

    lost = 0
    reads_lost = 0  # how many reads after it fail too

    def complete(self, *args: Any) -> bool:
        return self._lose(super().complete(*args))

    def fail(self, *args: Any) -> bool:
        return self._lose(super().fail(*args))

    async def acomplete(self, *args: Any) -> bool:
        return self._lose(await super().acomplete(*args))

    async def afail(self, *args: Any) -> bool:
        return self._lose(await super().afail(*args))

    def get(self, key_hash: str) -> Any:
        if self.reads_lost:
            self.reads_lost -= 1
            raise StoreUnavailableError("the read failed too")
        return super().get(key_hash)

    async def aget(self, key_hash: str) -> Any:
        return self.get(key_hash)

    def _lose(self, ok: bool) -> bool:
        if self.lost == 0:
            self.lost += 1
            raise StoreUnavailableError("the reply was lost")
        return ok


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("write", ["complete", "fail"])
def test_a_resent_write_that_had_applied_is_not_stale(
    tmp_path: Path, write: str, mode: str
) -> None:
    """The second send finds the record settled under this attempt's token: success,
    not LeaseLostError (which would tell the caller its work was thrown away). The
    read that finds it failing once too only means one more resend."""
    call = run_both(mode)
    store = _LostReply(f"sqlite:///{tmp_path}/s.db")
    store.reads_lost = 1
    engine = Engine(store, final_failures=True)
    claim = call(engine, "begin", "k", operation="op")
    assert isinstance(claim, Claim)
    if write == "complete":
        call(engine, "complete", claim, Outcome.json("done"))
    else:
        call(engine, "fail", claim, Outcome.json("no"))
    assert store.reads_lost == 0
    record = engine.store.get(claim.key_hash)
    assert engine.store.lost == 1 and record is not None and record.token == claim.token
    expected = Status.COMPLETED if write == "complete" else Status.FAILED
    assert record.status is expected


def test_a_resent_write_after_a_takeover_is_stale(tmp_path: Path) -> None:
    """When the record now carries another attempt's token, the resent completion is
    refused as stale, as it would have been without the lost reply."""
    store = _LostReply(f"sqlite:///{tmp_path}/s.db")
    t0 = 1_800_000_000.0
    late = Engine(store, lease=10, clock=lambda: t0)  # its clock says the lease still runs
    first = late.begin("k", operation="op")
    second = Engine(store, lease=10, clock=lambda: t0 + 11).begin("k", operation="op")
    assert isinstance(first, Claim) and isinstance(second, Claim)
    with pytest.raises(LeaseLostError):
        late.complete(first, Outcome.json("first"))
    assert store.lost == 1  # the refusal's reply was lost, and the resend refused too
    record = store.get(first.key_hash)
    assert record is not None and record.status is Status.PROCESSING
    assert record.token == second.token and record.outcome is None


def test_a_resent_failure_is_not_taken_for_a_completion(tmp_path: Path) -> None:
    """A failure whose first send meets the outage, on a record this attempt had
    already completed (a commit whose reply was lost, then the handler's error), is
    not reported as recorded: the record holds a completion, not this failure."""
    store = _LostReply(f"sqlite:///{tmp_path}/s.db")
    engine = Engine(store)
    claim = engine.begin("k", operation="op")
    assert isinstance(claim, Claim)
    store.lost = 1  # the completion goes through
    engine.complete(claim, Outcome.json("done"))
    store.lost = 0  # the failure's first send is "lost", and refused
    with pytest.raises(LeaseLostError):
        engine.fail(claim, Outcome.json("no"))
    record = store.get(claim.key_hash)
    assert record is not None and record.status is Status.COMPLETED


def test_settle_retry_is_checked() -> None:
    for bad, error in (
        (-1, ValueError),
        (float("nan"), ValueError),
        (True, TypeError),
        ("5", TypeError),
    ):
        with pytest.raises(error):
            Engine("memory://", settle_retry=bad)  # type: ignore[arg-type]
    assert Engine("memory://", settle_retry=0).settle_retry == 0.0
