"""RedisStore against values it did not write, and commands the server refuses.

Whatever sits under a record key (another program's value, a truncated or corrupt
record, another type), and whatever the server answers with an error, a call
raises :class:`StoreUnavailableError` naming the key, never a raw decoding or
redis-py error, and never overwrites the value. Records of layout version 1 (an
upgraded deployment's live records, under the same keys) are not foreign: they
replay, refuse, wait and are taken over as before, and the operations views read
them (docs/stores.md, "Redis layout").
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
from _redis_records import v1_value, v2_value
from conftest import Clock, make_spec

from retrysafe import (
    Claim,
    Engine,
    FingerprintMismatchError,
    InProgressError,
    Outcome,
    Replay,
    Status,
    StoreUnavailableError,
    key_hash,
)
from retrysafe._model.record import Record
from retrysafe.stores.redis import LAYOUT_VERSION, RedisStore

OP = "foreign"
KEY = "the-key"


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisStore]:
    s = make_spec("redis", request, tmp_path).open()
    assert isinstance(s, RedisStore)
    yield s
    s.close()


@pytest.fixture
def raw(redis_server: Any) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def _valid_record(engine: Engine, raw: redis.Redis, store: RedisStore) -> bytes:
    """The stored bytes of a live processing record (of another key)."""
    claim = engine.begin("source", operation=OP, fingerprint="fp")
    assert isinstance(claim, Claim)
    value = raw.get(store.record_key(claim.key_hash))
    assert isinstance(value, bytes)
    return value


#: name → how to put a foreign value under a key: (raw client, key, a valid record).
WRITERS: dict[str, Callable[[redis.Redis, str, bytes], None]] = {
    "garbage": lambda r, k, valid: r.set(k, b"garbage"),
    "empty": lambda r, k, valid: r.set(k, b""),
    "foreign-text": lambda r, k, valid: r.set(k, b"another program's value " * 4),
    "truncated-header": lambda r, k, valid: r.set(k, valid[:40]),
    "truncated-body": lambda r, k, valid: r.set(k, valid[:-5]),
    "bad-status": lambda r, k, valid: r.set(k, valid[:30] + b"x" + valid[31:]),
    # the operation's name is text in every layout (a fixed offset can land in a
    # binary field, whose length varies with the record's token)
    "bad-utf8": lambda r, k, valid: r.set(k, valid.replace(OP.encode(), b"\xff" + OP[1:].encode())),
    "hash": lambda r, k, valid: r.hset(k, mapping={"a": "b"}),
}


def _dump(raw: redis.Redis, key: str) -> Any:
    kind = raw.type(key)
    return kind, raw.hgetall(key) if kind == b"hash" else raw.get(key)


@pytest.mark.parametrize("claims", ["set", "script"])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("value", sorted(WRITERS))
def test_foreign_value_is_refused_and_kept(
    store: RedisStore, raw: redis.Redis, value: str, mode: str, claims: str
) -> None:
    engine = Engine(store)
    valid = _valid_record(engine, raw, store)
    store._set_claims = claims == "set"  # "script": the path of Redis < 7.0
    kh = key_hash("", OP, KEY)
    rkey = store.record_key(kh)
    WRITERS[value](raw, rkey, valid)
    before = _dump(raw, rkey)

    with pytest.raises(StoreUnavailableError) as info:
        if mode == "sync":
            engine.begin(KEY, operation=OP, fingerprint="fp")
        else:

            async def begin() -> None:
                try:
                    await engine.abegin(KEY, operation=OP, fingerprint="fp")
                finally:
                    await store.aclose()

            asyncio.run(begin())
    assert kh in str(info.value)  # the key hash or the whole key name
    if value != "foreign-text":  # a wrong layout version is detected, not raised by decoding
        assert info.value.__cause__ is not None
    assert _dump(raw, rkey) == before, "the foreign value was overwritten"

    with pytest.raises(StoreUnavailableError, match=kh):
        store.get(kh)
    assert _dump(raw, rkey) == before


def test_a_completion_refused_for_good_is_not_resent(store: RedisStore, raw: redis.Redis) -> None:
    """A completion that meets a value that is not a string (WRONGTYPE: another
    program's key) cannot land however often it is sent: it is given up at once,
    not resent for the whole lease, and the value is kept."""
    engine = Engine(store, lease=60)
    claim = engine.begin("k", operation=OP)
    assert isinstance(claim, Claim)
    rkey = store.record_key(claim.key_hash)
    raw.delete(rkey)
    raw.hset(rkey, "a", "b")
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError) as info:
        engine.complete(claim, Outcome.json(1))
    assert time.monotonic() - started < 10 and info.value.transient is False  # not 60
    assert raw.type(rkey) == b"hash" and raw.hgetall(rkey) == {b"a": b"b"}


def test_refused_command_is_unavailable_without_password(
    store: RedisStore, raw: redis.Redis, redis_server: Any
) -> None:
    """NOPERM (an ACL that forbids SET and EVALSHA) comes out as StoreUnavailableError."""
    user = f"retrysafe-{uuid.uuid4().hex[:8]}"
    password = f"secret-{uuid.uuid4().hex}"
    raw.execute_command(
        "ACL", "SETUSER", user, "on", f">{password}", "~*", "+@all", "-set", "-evalsha"
    )
    try:
        url = redis_server.url.replace("redis://", f"redis://{user}:{password}@", 1)
        limited = RedisStore(url, prefix=store.prefix)
        try:
            with pytest.raises(StoreUnavailableError) as info:
                Engine(limited).begin(KEY, operation=OP, fingerprint="fp")
        finally:
            limited.close()
    finally:
        raw.execute_command("ACL", "DELUSER", user)
    message = str(info.value)
    assert "NOPERM" in message or "permission" in message.lower()
    assert password not in message
    assert "***" in message
    assert raw.get(store.record_key(key_hash("", OP, KEY))) is None


@pytest.mark.parametrize("value", sorted(WRITERS))
def test_sweep_records_and_stats_skip_a_foreign_value(
    store: RedisStore, raw: redis.Redis, value: str
) -> None:
    """Operations work walks past what it cannot read, and never deletes it."""
    engine = Engine(store, ttl=60)
    valid = _valid_record(engine, raw, store)
    rkey = store.record_key(key_hash("", OP, KEY))
    WRITERS[value](raw, rkey, valid)
    before = _dump(raw, rkey)
    assert [r.key for r in store.records()] == ["source"]
    stats = store.stats(time.time() + 3600)
    assert (sum(stats.counts.values()), stats.expired) == (0, 1)
    batch = store.sweep(time.time() + 3600, 10)
    assert (batch.deleted, batch.done) == (1, True)
    assert _dump(raw, rkey) == before


async def test_a_burst_past_the_pool_waits_for_connections(redis_server: Any) -> None:
    """More concurrent calls than connections: they queue for the pool, none is refused."""
    store = RedisStore(redis_server.url, prefix=f"burst-{uuid.uuid4().hex[:8]}:", max_connections=4)
    engine = Engine(store)
    claims = await asyncio.gather(*(engine.abegin(f"k{i}", operation="burst") for i in range(300)))
    assert all(isinstance(c, Claim) for c in claims)
    assert 1 <= store._pools[asyncio.get_running_loop()].connections <= 4
    await store.aclose()
    with pytest.raises((TypeError, ValueError)):
        RedisStore(redis_server.url, max_connections=0)


def _blocked(raw: redis.Redis) -> bool:
    return any(c.get("cmd") == "blpop" for c in raw.client_list())


async def test_a_cancelled_call_closes_its_connection(store: RedisStore, raw: redis.Redis) -> None:
    """A call cancelled while its reply is unread closes that connection, so the next
    call on the pool never reads the reply meant for the cancelled one."""
    from retrysafe.stores.redis.store import _Op, _parse_bool

    waiting = f"cancel-{uuid.uuid4().hex[:8]}"
    blocked = asyncio.ensure_future(store._arun(_Op(("BLPOP", waiting, 0), _parse_bool, "k")))
    while not _blocked(raw):  # sent, its reply unread
        await asyncio.sleep(0.01)
    blocked.cancel()
    with pytest.raises(asyncio.CancelledError):
        await blocked
    engine = Engine(store)
    claim = await engine.abegin("after-cancel", operation=OP, fingerprint="fp")
    assert isinstance(claim, Claim)  # a reply of its own, not BLPOP's
    while _blocked(raw):  # until the server sees it closed
        await asyncio.sleep(0.01)
    raw.rpush(waiting, b"x")
    assert raw.lpop(waiting) == b"x"  # nobody was left waiting to take it
    await store.aclose()


def test_threads_past_the_pool_wait_for_connections(redis_server: Any) -> None:
    """The sync client too: 64 threads on a pool of 4 all claim (redis-py's own pool
    refuses a call past its limit, which reached callers as StoreUnavailableError)."""
    store = RedisStore(
        redis_server.url, prefix=f"tburst-{uuid.uuid4().hex[:8]}:", max_connections=4
    )
    engine = Engine(store)
    gate = threading.Barrier(64)

    def claim(i: int) -> Any:
        gate.wait()
        return engine.begin(f"k{i}", operation="burst")

    with ThreadPoolExecutor(64) as pool:
        claims = list(pool.map(claim, range(64)))
    assert all(isinstance(c, Claim) for c in claims)
    assert store._pool is not None and 1 <= store._pool.connections <= 4
    assert store._sync_client().connection_pool.max_connections == 4  # the operations work's
    store.close()


def test_renewal_past_the_expiry_moves_the_physical_ttl(store: RedisStore, raw: Any) -> None:
    engine = Engine(store, ttl=5, lease=3)
    standard = engine.begin("std", operation="ttl")
    financial = engine.begin("fin", operation="ttl", retention="financial")
    assert isinstance(standard, Claim) and isinstance(financial, Claim)
    key, fin_key = store.record_key(standard.key_hash), store.record_key(financial.key_hash)
    assert 0 < raw.pttl(key) <= 5000 and raw.pttl(fin_key) == -1
    engine.renew(standard, 30)
    engine.renew(financial, 30)
    assert 28_000 < raw.pttl(key) <= 30_000  # the TTL followed the lease
    assert raw.pttl(fin_key) == -1  # a financial record still has none (the sweeper's)
    engine.renew(standard, 1)  # a shorter lease never shortens the expiry
    assert raw.pttl(key) > 28_000


# -- records of layout versions 1 (before the compact fields) and 2 (before the short
# -- header and UUID keys) ----------------------------------------------------------

SHA = "0123456789abcdef" * 4
JSON_HEADERS = (("content-type", "application/json"), ("content-length", "8"))
HOUR = 3600.0


_WRITERS = {"1": v1_value, "2": v2_value}


def _as_version_1(
    store: RedisStore,
    raw: redis.Redis,
    engine: Engine,
    key: str,
    version: str = "1",
    **changes: Any,
) -> Record:
    """Claim ``key`` (fingerprint SHA), then rewrite its record as ``version`` wrote it,
    with ``changes``, keeping the TTL; the record as the store reads it back."""
    claim = engine.begin(key, operation="op", fingerprint=SHA)
    assert isinstance(claim, Claim)
    current = store.get(claim.key_hash)
    assert current is not None
    old = dataclasses.replace(current, **changes)
    name = store.record_key(claim.key_hash)
    raw.set(name, _WRITERS[version](old), keepttl=True)
    assert raw.get(name)[:1] == version.encode()  # type: ignore[index]
    assert store.get(claim.key_hash) == old
    return old


@pytest.mark.parametrize("version", ["1", "2"])
@pytest.mark.parametrize("claims", ["set", "script"])
def test_version_1_records_replay_refuse_and_wait(
    store: RedisStore, raw: redis.Redis, clock: Clock, claims: str, version: str
) -> None:
    store._set_claims = claims == "set"  # "script": the path of Redis < 7.0
    engine = Engine(store, ttl=HOUR, clock=clock)
    outcome = Outcome(b'{"id":1}', 201, JSON_HEADERS, "application/json")
    done = _as_version_1(
        store,
        raw,
        engine,
        "done",
        version,
        status=Status.COMPLETED,
        completed_at=clock.now,
        outcome=outcome,
    )
    replay = engine.begin("done", operation="op", fingerprint=SHA)
    assert isinstance(replay, Replay) and replay.outcome == outcome
    with pytest.raises(FingerprintMismatchError):
        engine.begin("done", operation="op", fingerprint="f" * 64)
    _as_version_1(store, raw, engine, "busy", version)  # processing, lease live
    with pytest.raises(InProgressError):
        engine.begin("busy", operation="op", fingerprint=SHA, wait=0)
    assert store.get(done.key_hash) == done  # nothing rewritten


@pytest.mark.parametrize("version", ["1", "2"])
@pytest.mark.parametrize("claims", ["set", "script"])
@pytest.mark.parametrize("left", ["lease-ran-out", "failed"])
def test_version_1_records_are_taken_over(
    store: RedisStore, raw: redis.Redis, clock: Clock, claims: str, left: str, version: str
) -> None:
    store._set_claims = claims == "set"
    engine = Engine(store, ttl=HOUR, lease=10, clock=clock)
    changes: dict[str, Any] = {"status": Status.FAILED} if left == "failed" else {}
    old = _as_version_1(store, raw, engine, str(uuid.uuid4()), version, **changes)
    clock.advance(20)  # past the lease
    claim = engine.begin(old.key, operation="op", fingerprint=SHA)
    assert isinstance(claim, Claim) and claim.attempts == 2
    value = raw.get(store.record_key(old.key_hash))
    assert value is not None and value[:1] == LAYOUT_VERSION
    engine.complete(claim, Outcome.json({"ok": True}))
    new = store.get(old.key_hash)
    assert new is not None and new.created_at == old.created_at and new.attempts == 2
    assert new.status is Status.COMPLETED and new.outcome == Outcome.json({"ok": True})


def test_a_version_1_attempt_is_its_own_process_s_to_settle(
    store: RedisStore, raw: redis.Redis, clock: Clock
) -> None:
    """A version-1 record in flight belongs to the older process that claimed it (and
    its own scripts): this release's token-checked writes never match its token
    (stored in another form) and write nothing; its owner's completion then replays."""
    engine = Engine(store, ttl=HOUR, clock=clock)
    old = _as_version_1(store, raw, engine, "k")
    name = store.record_key(old.key_hash)
    before = raw.get(name)
    assert not store.renew(old.key_hash, old.token, clock.now + 60, clock.now)
    assert not store.complete(old.key_hash, old.token, Outcome(b"x"), clock.now)
    assert not store.fail(old.key_hash, old.token, None, False, clock.now)
    assert raw.get(name) == before
    done = dataclasses.replace(
        old, status=Status.COMPLETED, completed_at=clock.now, outcome=Outcome.json(1)
    )
    raw.set(name, v1_value(done), keepttl=True)  # what the older process writes
    replay = engine.begin("k", operation="op", fingerprint=SHA)
    assert isinstance(replay, Replay) and replay.outcome == Outcome.json(1)


def test_a_version_2_attempt_settles_in_version_2(
    store: RedisStore, raw: redis.Redis, clock: Clock
) -> None:
    """A version-2 record in flight stores its token as this release does: its owner's
    renew, complete and fail (this release's scripts, if its owner was upgraded with
    the token) keep version 2's layout, and the record reads back right."""
    engine = Engine(store, ttl=HOUR, clock=clock)
    for end in ("complete", "fail"):
        old = _as_version_1(store, raw, engine, f"v2-{end}", "2")
        name = store.record_key(old.key_hash)
        later = clock.now + 60
        assert store.renew(old.key_hash, old.token, later, clock.now + 1)
        assert not store.complete(old.key_hash, "0" + old.token, Outcome(b"x"), clock.now)
        if end == "complete":
            assert store.complete(old.key_hash, old.token, Outcome.json(1), clock.now + 2)
            want = dataclasses.replace(
                old,
                status=Status.COMPLETED,
                lease_until=later,
                updated_at=clock.now + 2,
                completed_at=clock.now + 2,
                outcome=Outcome.json(1),
            )
        else:
            assert store.fail(old.key_hash, old.token, Outcome.json(2), True, clock.now + 2)
            want = dataclasses.replace(
                old,
                status=Status.FAILED,
                final=True,
                lease_until=later,
                updated_at=clock.now + 2,
                outcome=Outcome.json(2),
            )
        assert raw.get(name)[:1] == b"2"  # type: ignore[index]
        assert store.get(old.key_hash) == want


@pytest.mark.parametrize("version", ["1", "2"])
def test_operations_views_read_version_1_records(
    store: RedisStore, raw: redis.Redis, clock: Clock, version: str
) -> None:
    engine = Engine(store, ttl=HOUR, clock=clock)
    prefix = f"v{version}-{uuid.uuid4().hex[:8]}-"
    old = _as_version_1(store, raw, engine, prefix + "a", version)
    listed = store.records(key=prefix + "a")
    assert listed == [old]
    assert store.stats(clock.now).counts.get(("op", "processing"), 0) >= 1
    clock.advance(2 * HOUR)  # expired (logically; the physical TTL is the real clock's)
    swept = 0
    while True:
        batch = store.sweep(clock.now)
        swept += batch.deleted
        if batch.done:
            break
    assert swept >= 1 and store.get(old.key_hash) is None
    other = _as_version_1(store, raw, engine, prefix + "b", version)
    assert store.delete(other.key_hash) and store.get(other.key_hash) is None
