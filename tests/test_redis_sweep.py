"""The Redis store's retention class: in the layout, and in the physical TTLs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import Clock, make_spec

from retrysafe import Claim, Engine, Outcome, Status
from retrysafe._record import Record
from retrysafe.stores import Store
from retrysafe.stores.redis import RedisStore, _record_value, record_from_value

HOUR = 3600.0


@pytest.fixture
def raw(redis_server: Any) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisStore]:
    s = make_spec("redis", request, tmp_path).open()
    assert isinstance(s, RedisStore)
    yield s
    s.close()


def _claim(store: Store[Any], clock: Clock, key: str, retention: str, **kw: Any) -> Claim:
    engine = Engine(store, ttl=kw.pop("ttl", HOUR), retention=retention, clock=clock)
    claim = engine.begin(key, operation=kw.pop("operation", "op"), fingerprint="fp", **kw)
    assert isinstance(claim, Claim)
    return claim


# -- retention in the layout ------------------------------------------------------------


def _record(**changes: Any) -> Record:
    fields: dict[str, Any] = dict(
        key_hash="h" * 64, key="k", scope="s", operation="op", fingerprint="f" * 64,
        status=Status.PROCESSING, token="tok", lease_until=2.0, expires_at=3.0,
        created_at=1.0, updated_at=1.0,
    )  # fmt: skip
    fields.update(changes)
    return Record(**fields)


@pytest.mark.parametrize("retention", ["standard", "financial"])
@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"request_id": "req-1"},
        {"request_payload": b"\x00payload\xff"},
        {"key": "with\x00nul", "request_id": "r"},
        {"key": "ünïcode", "metadata": {"user": "u1"}},
        {"outcome": Outcome(b"body", 201, (("x-a", "1"),), "text/plain")},
    ],
    ids=["plain", "request-id", "payload", "json-fields", "non-ascii", "outcome"],
)
def test_retention_round_trips(retention: str, changes: dict[str, Any]) -> None:
    record = _record(retention=retention, **changes)
    assert record_from_value(_record_value(record), record.key_hash) == record


def test_records_written_before_the_retention_bit_read_as_standard() -> None:
    for changes in ({}, {"request_id": "r"}, {"request_payload": b"p"}, {"key": "a\x00b"}):
        value = _record_value(_record(**changes))
        fp_len, token_len = int.from_bytes(value[48:52]), int.from_bytes(value[56:60])
        flags = value[60 + token_len + fp_len]
        assert chr(flags) in "01234567"  # what every earlier version wrote
        assert record_from_value(value, "h" * 64).retention == "standard"  # type: ignore[union-attr]


def test_the_financial_flag_keeps_the_older_bits() -> None:
    """Bit 8 sits above the digits' bits: a reader that knows bits 1, 2, 4 still decodes."""
    for changes in ({}, {"request_id": "r"}, {"request_payload": b"p"}, {"key": "a\x00b"}):
        standard = _record_value(_record(**changes))
        financial = _record_value(_record(retention="financial", **changes))
        fp_len, token_len = int.from_bytes(standard[48:52]), int.from_bytes(standard[56:60])
        at = 60 + token_len + fp_len
        assert financial[at] == standard[at] | 8 and financial[at] & 7 == standard[at] & 7
        assert financial[:at] == standard[:at] and financial[at + 1 :] == standard[at + 1 :]


# -- physical TTLs ----------------------------------------------------------------------


def _pttl(raw: redis.Redis, store: RedisStore, key_hash: str) -> int:
    return int(raw.pttl(store.record_key(key_hash)))


@pytest.mark.parametrize("claims", ["set", "script"])
def test_financial_records_never_get_a_ttl(
    store: RedisStore, raw: redis.Redis, clock: Clock, claims: str
) -> None:
    store._set_claims = claims == "set"  # "script": the path of Redis < 7.0
    engine = Engine(store, ttl=HOUR, retention="financial", clock=clock)
    claim = engine.begin("pay-1", operation="op", fingerprint="fp")
    assert isinstance(claim, Claim)
    assert _pttl(raw, store, claim.key_hash) == -1
    engine.renew(claim, 60)
    assert _pttl(raw, store, claim.key_hash) == -1
    engine.complete(claim, Outcome(b"ok", 200))
    assert _pttl(raw, store, claim.key_hash) == -1
    record = store.get(claim.key_hash)
    assert record is not None and record.retention == "financial"

    # Expired (by the engine's clock): taken over, and still no TTL.
    clock.advance(2 * HOUR)
    again = engine.begin("pay-1", operation="op", fingerprint="fp")
    assert isinstance(again, Claim) and again.key_hash == claim.key_hash
    assert _pttl(raw, store, claim.key_hash) == -1
    engine.fail(again)
    assert _pttl(raw, store, claim.key_hash) == -1
    # A retry of the failure takes it over again.
    third = engine.begin("pay-1", operation="op", fingerprint="fp")
    assert isinstance(third, Claim)
    assert _pttl(raw, store, claim.key_hash) == -1


@pytest.mark.parametrize("claims", ["set", "script"])
def test_standard_records_keep_their_ttl(
    store: RedisStore, raw: redis.Redis, clock: Clock, claims: str
) -> None:
    store._set_claims = claims == "set"
    engine = Engine(store, ttl=HOUR, clock=clock)
    claim = engine.begin("k-1", operation="op", fingerprint="fp")
    assert isinstance(claim, Claim)
    assert HOUR * 1000 - 5000 < _pttl(raw, store, claim.key_hash) <= HOUR * 1000
    engine.fail(claim)
    assert HOUR * 1000 - 5000 < _pttl(raw, store, claim.key_hash) <= HOUR * 1000
    again = engine.begin("k-1", operation="op", fingerprint="fp")  # retry of a failure
    assert isinstance(again, Claim) and again.attempts == 2
    assert HOUR * 1000 - 5000 < _pttl(raw, store, claim.key_hash) <= HOUR * 1000
    engine.complete(again, Outcome(b"ok", 200))
    assert HOUR * 1000 - 5000 < _pttl(raw, store, claim.key_hash) <= HOUR * 1000


def test_a_takeover_follows_the_new_records_retention(
    store: RedisStore, raw: redis.Redis, clock: Clock
) -> None:
    standard = _claim(store, clock, "k", "standard")
    clock.advance(2 * HOUR)  # expired by the engine's clock, still in Redis
    financial = _claim(store, clock, "k", "financial")
    assert financial.key_hash == standard.key_hash
    assert _pttl(raw, store, standard.key_hash) == -1  # the old TTL is gone
    clock.advance(2 * HOUR)
    _claim(store, clock, "k", "standard")
    assert _pttl(raw, store, standard.key_hash) > 0
