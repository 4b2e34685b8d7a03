"""The Redis record layout: version 2's compact fields, and records of version 1.

Version 2 stores a SHA-256 fingerprint as 32 bytes and an outcome's status, media
type and headers in a compact prefix; every record must still read back exactly.
A deployment upgraded from version 1 holds live version-1 records under the same
keys: they replay, refuse, and are taken over as before, and the operations views
read them (docs/stores.md, "Redis layout").
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import Clock, make_spec

from retrysafe import (
    Claim,
    Engine,
    FingerprintMismatchError,
    InProgressError,
    Outcome,
    Replay,
    Status,
)
from retrysafe._model.record import Record
from retrysafe.stores.redis import HEADER, LAYOUT_VERSION, RedisStore, record_from_value
from retrysafe.stores.redis.codec import _claim_blob, _json_prefix, _record_value

HOUR = 3600.0
SHA = "0123456789abcdef" * 4

#: A completed record as retrysafe wrote it before layout version 2 (attempts 2).
V1_COMPLETED = (
    b"1\x00\x00\x00\x02A\xda\xd2t\x80\x00\x00\x00A\xda\xd2\xc8\xe0\x00\x00\x00A\xda\xd2t\x87"
    b"\x80\x00\x00\x00c\x01A\xda\xd2t\x80 \x00\x00A\xda\xd2t\x80 \x00\x00\x00\x00\x00@\x00"
    b"\x00\x00$\x00\x00\x00\x03t0k0123456789abcdef0123456789abcdef0123456789abcdef01234567"
    b'89abcdef1\x00order-1\x00credentials:ab\x00http\x00req-1\x00[201,"application/json",'
    b'[["content-type","application/json"],["content-length","8"]]]\x00{"id":1}'
)


def _record(**changes: Any) -> Record:
    fields: dict[str, Any] = dict(
        key_hash="h" * 64,
        key="k",
        scope="s",
        operation="op",
        fingerprint=SHA,
        status=Status.COMPLETED,
        token="tok",
        lease_until=2.0,
        expires_at=3.0,
        created_at=1.0,
        updated_at=1.5,
        completed_at=1.5,
    )
    fields.update(changes)
    return Record(**fields)


def _v1_value(r: Record) -> bytes:
    """``r`` as layout version 1 stored it: the fingerprint as text, a JSON outcome."""
    token, fp, blob = r.token.encode(), r.fingerprint.encode(), _claim_blob(r)
    fixed = HEADER.pack(
        b"1",
        r.attempts,
        r.created_at,
        r.expires_at,
        r.lease_until,
        r.final,
        r.status.value[0].encode(),
        r.completed_at is not None,
        r.updated_at,
        r.completed_at or 0.0,
        len(fp),
        len(blob),
        len(token),
    )
    o = r.outcome
    tail = b"" if o is None else _json_prefix(o.status, o.media_type, o.headers) + o.body
    return fixed + token + fp + blob + tail


# -- version 2 -----------------------------------------------------------------------


JSON_HEADERS = (("content-type", "application/json"), ("content-length", "8"))


@pytest.mark.parametrize(
    "outcome",
    [
        Outcome.json({"id": 1}),
        Outcome(b'{"id":1}', 201, JSON_HEADERS, "application/json"),
        Outcome(b"", 204),
        Outcome(b"body", 200, (("content-length", "99"),), "text/plain"),  # not the body's
        Outcome(b"x", 200, (("Content-Type", "text/csv"),), "text/csv"),
        Outcome(b"x", 200, (("content-type", "text/html"),), "application/json"),
        Outcome(b"x", 0, (("x-\u00e9", "v\udcff\u2603"), ("x-a", "")), "t/\u00fc"),
        Outcome(b"x", 65535, (), "application/octet-stream"),  # past uint16's 0xFFFF mark
        Outcome(b"x", -1, (), "text/plain; charset=utf-8"),
        Outcome(b"x", 200, (("x-big", "v" * 70_000),), "text/plain"),
        Outcome(b"x", 200, (("n" * 300, "v"),), "m" * 300),
        Outcome(b"x", 200, tuple((f"x-{i}", "v") for i in range(300)), "text/plain"),
        Outcome(b"\x00\x01[", None, (("content-length", "3"),), ""),
    ],
    ids=lambda o: f"{o.status}-{o.media_type[:20]}-{len(o.headers)}",
)
def test_outcomes_round_trip(outcome: Outcome) -> None:
    record = _record(outcome=outcome)
    value = _record_value(record)
    assert value[:1] == LAYOUT_VERSION == b"2"
    assert record_from_value(value, record.key_hash) == record


@pytest.mark.parametrize(
    "fingerprint",
    [SHA, SHA.upper(), SHA[:63], "fp", "", "\x00" + SHA[1:], "\x01x", "\x00", "ü" * 40],
    ids=["sha256", "upper", "short", "text", "empty", "nul", "soh", "nul-only", "unicode"],
)
def test_fingerprints_round_trip(fingerprint: str) -> None:
    record = _record(fingerprint=fingerprint, outcome=Outcome(b"x"))
    assert record_from_value(_record_value(record), record.key_hash) == record


def test_the_compact_fields_store_nothing_twice() -> None:
    """A SHA-256 takes 33 bytes, the media type and its content-type header one byte
    together, the content-length one byte."""
    outcome = Outcome(b'{"id":1}', 201, JSON_HEADERS, "application/json")
    compact = _record_value(_record(outcome=outcome))
    assert bytes.fromhex(SHA) in compact and SHA.encode() not in compact
    assert b"application/json" not in compact and b"content-length" not in compact
    assert len(compact) < len(_v1_value(_record(outcome=outcome))) - 100


def test_a_record_of_version_1_reads_the_same() -> None:
    record = record_from_value(V1_COMPLETED, "h" * 64)
    assert record == _record(
        key="order-1",
        scope="credentials:ab",
        operation="http",
        token="t0k",
        lease_until=1800000030.0,
        expires_at=1800086400.0,
        created_at=1800000000.0,
        updated_at=1800000000.5,
        completed_at=1800000000.5,
        attempts=2,
        request_id="req-1",
        outcome=Outcome(b'{"id":1}', 201, JSON_HEADERS, "application/json"),
    )
    assert _v1_value(record) == V1_COMPLETED  # the test's writer is version 1's


# -- version 1 records on a live server ------------------------------------------------


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisStore]:
    spec = make_spec("redis", request, tmp_path)
    s = spec.open()
    assert isinstance(s, RedisStore)
    yield s
    s.close()


@pytest.fixture
def raw(redis_server: Any) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def _as_version_1(
    store: RedisStore, raw: redis.Redis, engine: Engine, key: str, **changes: Any
) -> Record:
    """Claim ``key`` (fingerprint SHA), then rewrite its record as version 1 wrote it,
    with ``changes``, keeping the TTL; the record as the store reads it back."""
    claim = engine.begin(key, operation="op", fingerprint=SHA)
    assert isinstance(claim, Claim)
    current = store.get(claim.key_hash)
    assert current is not None
    old = dataclasses.replace(current, **changes)
    name = store.record_key(claim.key_hash)
    raw.set(name, _v1_value(old), keepttl=True)
    assert raw.get(name)[:1] == b"1"  # type: ignore[index]
    assert store.get(claim.key_hash) == old
    return old


@pytest.mark.parametrize("claims", ["set", "script"])
def test_version_1_records_replay_refuse_and_wait(
    store: RedisStore, raw: redis.Redis, clock: Clock, claims: str
) -> None:
    store._set_claims = claims == "set"  # "script": the path of Redis < 7.0
    engine = Engine(store, ttl=HOUR, clock=clock)
    outcome = Outcome(b'{"id":1}', 201, JSON_HEADERS, "application/json")
    done = _as_version_1(
        store,
        raw,
        engine,
        "done",
        status=Status.COMPLETED,
        completed_at=clock.now,
        outcome=outcome,
    )
    replay = engine.begin("done", operation="op", fingerprint=SHA)
    assert isinstance(replay, Replay) and replay.outcome == outcome
    with pytest.raises(FingerprintMismatchError):
        engine.begin("done", operation="op", fingerprint="f" * 64)
    _as_version_1(store, raw, engine, "busy")  # processing, lease live
    with pytest.raises(InProgressError):
        engine.begin("busy", operation="op", fingerprint=SHA, wait=0)
    assert store.get(done.key_hash) == done  # nothing rewritten


@pytest.mark.parametrize("claims", ["set", "script"])
@pytest.mark.parametrize("left", ["lease-ran-out", "failed"])
def test_version_1_records_are_taken_over(
    store: RedisStore, raw: redis.Redis, clock: Clock, claims: str, left: str
) -> None:
    store._set_claims = claims == "set"
    engine = Engine(store, ttl=HOUR, lease=10, clock=clock)
    changes: dict[str, Any] = {"status": Status.FAILED} if left == "failed" else {}
    old = _as_version_1(store, raw, engine, "k", **changes)
    clock.advance(20)  # past the lease
    claim = engine.begin("k", operation="op", fingerprint=SHA)
    assert isinstance(claim, Claim) and claim.attempts == 2
    value = raw.get(store.record_key(old.key_hash))
    assert value is not None and value[:1] == LAYOUT_VERSION
    engine.complete(claim, Outcome.json({"ok": True}))
    new = store.get(old.key_hash)
    assert new is not None and new.created_at == old.created_at and new.attempts == 2
    assert new.status is Status.COMPLETED and new.outcome == Outcome.json({"ok": True})


def test_an_attempt_on_a_version_1_record_completes(
    store: RedisStore, raw: redis.Redis, clock: Clock
) -> None:
    """The token-checked scripts patch version-1 records too (the outcome they append
    is read by its own first byte)."""
    engine = Engine(store, ttl=HOUR, clock=clock)
    old = _as_version_1(store, raw, engine, "k")
    outcome = Outcome(b"ok", 201, (("content-length", "2"),), "text/plain")
    assert store.renew(old.key_hash, old.token, clock.now + 60, clock.now)
    assert store.complete(old.key_hash, old.token, outcome, clock.now)
    new = store.get(old.key_hash)
    assert new is not None and new.status is Status.COMPLETED and new.outcome == outcome
    assert new.fingerprint == SHA and new.lease_until == clock.now + 60


def test_operations_views_read_version_1_records(
    store: RedisStore, raw: redis.Redis, clock: Clock
) -> None:
    engine = Engine(store, ttl=HOUR, clock=clock)
    prefix = f"v1-{uuid.uuid4().hex[:8]}-"
    old = _as_version_1(store, raw, engine, prefix + "a")
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
    other = _as_version_1(store, raw, engine, prefix + "b")
    assert store.delete(other.key_hash) and store.get(other.key_hash) is None
