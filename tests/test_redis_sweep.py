"""The Redis store's retention, physical TTLs, archive option, sweep, listing and stats.

What tests/test_sweep.py states for every store, seen from inside Redis: which
records carry a TTL, what the sweep's scan does on a large or changing keyspace,
what it never deletes, and the same on a real three-node Redis Cluster.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
from _redis_records import make_record as _record
from _servers import RedisCluster, free_port
from conftest import Clock, make_spec

from retrysafe import Claim, Engine, Outcome, Status, StoreUnavailableError, Sweeper
from retrysafe.stores import Store, open_store
from retrysafe.stores.redis import RedisStore, record_from_value
from retrysafe.stores.redis.codec import HEAD, LENGTHS, _record_value

HOUR = 3600.0


@pytest.fixture
def raw(redis_server: Any) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def _open(request: pytest.FixtureRequest, tmp_path: Path, **options: Any) -> RedisStore:
    spec = make_spec("redis", request, tmp_path)
    store = open_store(spec.url, **spec.options, **options)
    assert isinstance(store, RedisStore)
    return store


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisStore]:
    """A Redis store with a SQLite archive of its own."""
    s = _open(request, tmp_path, archive=f"sqlite:///{tmp_path}/archive.db")
    yield s
    s.close()


@pytest.fixture
def bare(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisStore]:
    """A Redis store without an archive."""
    s = _open(request, tmp_path)
    yield s
    s.close()


def _claim(store: Store[Any], clock: Clock, key: str, retention: str, **kw: Any) -> Claim:
    engine = Engine(store, ttl=kw.pop("ttl", HOUR), retention=retention, clock=clock)
    claim = engine.begin(key, operation=kw.pop("operation", "op"), fingerprint="fp", **kw)
    assert isinstance(claim, Claim)
    return claim


# -- retention in the layout ------------------------------------------------------------


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


def _flags_at(value: bytes) -> int:
    """Where a version-3 record's claim blob (its flags byte) starts."""
    at = HEAD.size + 8 * (value[31] == 1)
    token_len, fp_len, _ = LENGTHS.unpack_from(value, at)
    return at + LENGTHS.size + token_len + fp_len


def test_records_written_before_the_retention_bit_read_as_standard() -> None:
    for changes in ({}, {"request_id": "r"}, {"request_payload": b"p"}, {"key": "a\x00b"}):
        value = _record_value(_record(**changes))
        assert value[:1] == b"3"
        flags = value[_flags_at(value)]
        assert chr(flags) in "01234567"  # what every earlier version wrote
        assert record_from_value(value, "h" * 64).retention == "standard"  # type: ignore[union-attr]


def test_the_financial_flag_keeps_the_older_bits() -> None:
    """Bit 8 sits above the digits' bits: a reader that knows bits 1, 2, 4 still decodes."""
    for changes in ({}, {"request_id": "r"}, {"request_payload": b"p"}, {"key": "a\x00b"}):
        standard = _record_value(_record(**changes))
        financial = _record_value(_record(retention="financial", **changes))
        at = _flags_at(standard)
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


# -- the archive option -----------------------------------------------------------------


def test_archive_in_the_url_query(redis_server: Any, tmp_path: Path, clock: Clock) -> None:
    archive_url = f"sqlite:///{tmp_path}/a.db"
    url = f"{redis_server.url}?prefix=t-{time.time_ns()}:&archive={quote(archive_url, safe='')}"
    store = open_store(url)
    assert isinstance(store, RedisStore)
    try:
        assert store._archive is None  # opened on first use
        assert "archive" not in store._client_url
        claim = _claim(store, clock, "pay", "financial")
        record = store.get(claim.key_hash)
        assert record is not None
        assert store.archive_records([record], clock.now) == 1
        assert store.archive is not None and store.archive.url == archive_url
        assert [a.record.key_hash for a in store.archived_records()] == [claim.key_hash]
    finally:
        store.close()


def test_archive_as_a_store(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    archive = open_store("memory://")
    store = _open(request, tmp_path, archive=archive)
    assert store.archive is archive
    closed: list[bool] = []
    archive.close = lambda: closed.append(True)  # type: ignore[method-assign]
    store.close()
    assert closed == []  # the caller's store: the caller closes it


@pytest.mark.parametrize(
    ("archive", "error"),
    [
        ("redis://127.0.0.1:6379/1", ValueError),
        ("ftp://example.com/a", ValueError),
        ("", ValueError),
        ("memory://", ValueError),  # would vanish with the process: records lost
        (42, TypeError),
    ],
)
def test_archive_must_be_an_archiving_store(
    redis_server: Any, archive: Any, error: type[Exception]
) -> None:
    with pytest.raises(error, match="archive"):
        RedisStore(redis_server.url, archive=archive)
    with pytest.raises(TypeError, match="archive"):
        RedisStore(redis_server.url, archive=RedisStore(redis_server.url))


def test_two_archives_are_refused(redis_server: Any) -> None:
    url = f"{redis_server.url}?archive={quote('sqlite:///a.db', safe='')}"
    with pytest.raises(ValueError, match="two archives"):
        RedisStore(url, archive="sqlite:///b.db")


def test_an_archive_password_is_redacted(redis_server: Any) -> None:
    archive = "postgresql://user:s3cret@127.0.0.1:1/db?password=s3cret2"
    store = RedisStore(f"{redis_server.url}?archive={quote(archive, safe='')}")
    assert "s3cret" not in repr(store) and "***" in repr(store)


def test_without_an_archive(bare: RedisStore, clock: Clock) -> None:
    claim = _claim(bare, clock, "pay", "financial")
    record = bare.get(claim.key_hash)
    assert record is not None
    with pytest.raises(NotImplementedError, match="no archive"):
        bare.archive_records([record], clock.now)
    with pytest.raises(NotImplementedError, match="no archive"):
        bare.archived_records()
    assert bare.stats(clock.now).archived is None


def test_close_closes_the_archive(store: RedisStore, clock: Clock) -> None:
    archive = store.archive
    assert archive is not None
    closed: list[bool] = []
    original = archive.close
    archive.close = lambda: (closed.append(True), original())  # type: ignore[method-assign]
    store.close()
    assert closed == [True]


# -- sweep -----------------------------------------------------------------------------


def test_financial_records_without_an_archive_stop_the_sweep(
    bare: RedisStore, raw: redis.Redis, clock: Clock
) -> None:
    standard = [_claim(bare, clock, f"s{i}", "standard").key_hash for i in range(3)]
    financial = _claim(bare, clock, "pay", "financial").key_hash
    clock.advance(2 * HOUR)
    with pytest.raises(StoreUnavailableError, match="financial records need an archive"):
        bare.sweep(clock.now, 100)
    # Nothing was deleted, not even the standard records of the batch.
    for kh in [*standard, financial]:
        assert raw.exists(bare.record_key(kh))
    # Only standard records expired: they are swept.
    assert bare.delete(financial)
    assert bare.sweep(clock.now, 100).deleted == 3


def test_a_record_claimed_again_during_the_sweep_is_kept(
    request: pytest.FixtureRequest, tmp_path: Path, clock: Clock
) -> None:
    """The record changes between the sweep's read and its delete: it stays."""
    racer: dict[str, Any] = {}

    class RacingArchive(type(open_store("memory://"))):  # type: ignore[misc]
        def archive_records(self, records: Any, archived_at: float) -> int:
            n = super().archive_records(records, archived_at)
            if "store" in racer:  # a client claims the expired key meanwhile
                racer["claim"] = _claim(racer["store"], clock, "pay", "financial")
            return n

    store = _open(request, tmp_path, archive=RacingArchive("memory://"))
    try:
        first = _claim(store, clock, "pay", "financial")
        clock.advance(2 * HOUR)
        racer["store"] = store
        batch = store.sweep(clock.now, 100)
        assert (batch.deleted, batch.archived) == (0, 1)
        kept = store.get(first.key_hash)
        assert kept is not None and kept.token == racer["claim"].token
        assert kept.status is Status.PROCESSING
    finally:
        store.close()


def test_a_record_completed_during_the_sweep_is_kept(
    store: RedisStore, raw: redis.Redis, clock: Clock
) -> None:
    claim = _claim(store, clock, "k", "standard")
    clock.advance(2 * HOUR)
    real = store._get_many

    def get_then_complete(client: Any, keys: Any) -> list[Any]:
        values = real(client, keys)
        store.complete(claim.key_hash, claim.token, Outcome(b"late", 200), clock.now)
        return values

    store._get_many = get_then_complete  # type: ignore[method-assign]
    assert store.sweep(clock.now, 100).deleted == 0
    record = store.get(claim.key_hash)
    assert record is not None and record.status is Status.COMPLETED


def test_foreign_keys_under_the_prefix_are_skipped(
    store: RedisStore, raw: redis.Redis, clock: Clock
) -> None:
    expired = _claim(store, clock, "k", "standard").key_hash
    foreign = {
        f"{store.prefix}{{garbage}}": b"garbage",
        f"{store.prefix}{{}}": b"",
        f"{store.prefix}plain": b"another program",
        f"{store.prefix}sub:{{{expired}}}": raw.get(store.record_key(expired)),  # nested prefix
    }
    for key, value in foreign.items():
        raw.set(key, value)
    raw.hset(f"{store.prefix}{{hash}}", mapping={"a": "b"})
    raw.rpush(f"{store.prefix}{{list}}", "x")
    clock.advance(2 * HOUR)
    report = Sweeper(store, batch_size=2, clock=clock).run()
    assert report.deleted == 1
    for key, value in foreign.items():
        assert raw.get(key) == value
    assert raw.type(f"{store.prefix}{{hash}}") == b"hash"
    assert [r.key_hash for r in store.records()] == []
    assert store.stats(clock.now).counts == {}


def test_glob_characters_in_the_prefix(
    redis_server: Any, raw: redis.Redis, tmp_path: Path, clock: Clock
) -> None:
    tag = time.time_ns()
    store = RedisStore(redis_server.url, prefix=f"g[{tag}]*?\\:")
    other = RedisStore(redis_server.url, prefix=f"g{tag}xx\\:")  # what an unescaped glob hits
    try:
        _claim(store, clock, "a", "standard")
        kept = _claim(other, clock, "b", "standard").key_hash
        assert len(store.records()) == 1 and len(other.records()) == 1
        clock.advance(2 * HOUR)
        assert Sweeper(store, clock=clock).run().deleted == 1
        assert other.get(kept) is not None
    finally:
        store.close()
        other.close()


def test_batches_continue_one_scan_and_stay_bounded(
    store: RedisStore, raw: redis.Redis, clock: Clock
) -> None:
    """A pass over many live keys takes several bounded batches, never restarting."""
    pipe = raw.pipeline(transaction=False)
    live = _claim(store, clock, "live", "standard", ttl=100 * HOUR)
    value = raw.get(store.record_key(live.key_hash))
    for i in range(5000):
        pipe.set(store.record_key(f"{i:064x}"), value)
    pipe.execute()
    expired = [_claim(store, clock, f"e{i}", "standard").key_hash for i in range(5)]
    clock.advance(2 * HOUR)

    scans = 0
    real = store._scan_step

    def counting(*args: Any) -> list[bytes]:
        nonlocal scans
        scans += 1
        return real(*args)

    store._scan_step = counting  # type: ignore[method-assign]
    batches = []
    while True:
        batch = store.sweep(clock.now, 1)  # a batch looks at most at 1000 keys
        batches.append(batch)
        if batch.done:
            break
        assert len(batches) < 50, "the sweep restarts its scan"
    assert sum(b.deleted for b in batches) == 5
    assert 6 <= len(batches) <= 12
    # One pass over the server's keys (other tests' keys too), not one per batch.
    assert scans < raw.dbsize() / 100 + 10
    assert store._sweep_pass is None  # the next sweep starts a new pass
    assert all(store.get(kh) is None for kh in expired)
    assert store.get(live.key_hash) is not None


def test_done_needs_a_whole_pass_at_the_latest_time(store: RedisStore, clock: Clock) -> None:
    """A pass begun at an earlier ``now`` is finished, then one at the new ``now`` runs."""
    early = [_claim(store, clock, f"early{i}", "standard").key_hash for i in range(30)]
    clock.advance(HOUR / 2)
    late = [_claim(store, clock, f"late{i}", "financial").key_hash for i in range(30)]
    first = store.sweep(clock.now + HOUR / 2, 5)  # only the early ones have expired
    assert (first.deleted, first.done) == (5, False)
    report = Sweeper(store, batch_size=7, clock=lambda: clock.now + 2 * HOUR).run()
    assert report.deleted == 55 and report.archived == 30
    assert all(store.get(kh) is None for kh in early + late)


def test_sweep_refuses_a_bad_limit(store: RedisStore) -> None:
    for limit in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="limit"):
            store.sweep(0.0, limit)  # type: ignore[arg-type]


def test_sweep_and_stats_when_redis_is_down(tmp_path: Path, clock: Clock) -> None:
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", connect_timeout=0.5)
    try:
        for call in (
            lambda: store.sweep(clock.now, 10),
            lambda: store.records(),
            lambda: store.stats(clock.now),
        ):
            with pytest.raises(StoreUnavailableError, match="unavailable"):
                call()
    finally:
        store.close()


# -- records and stats ------------------------------------------------------------------


def test_records_and_stats_by_scan(store: RedisStore, clock: Clock) -> None:
    a = _claim(store, clock, "a", "standard", operation="x")
    clock.advance(1)
    _claim(store, clock, "b", "financial", operation="y")
    clock.advance(1)
    c = _claim(store, clock, "c", "standard", operation="x", ttl=100 * HOUR)
    Engine(store, clock=clock).complete(c, Outcome(b"done", 200))
    assert [r.key for r in store.records()] == ["a", "b", "c"]
    assert [r.key for r in store.records(limit=2)] == ["a", "b"]
    assert store.records(limit=0) == []
    assert [r.key for r in store.records(operation="x")] == ["a", "c"]
    assert [r.key for r in store.records(status="completed")] == ["c"]
    assert [r.key for r in store.records(created_before=clock.now - 1)] == ["a"]
    with pytest.raises(ValueError):
        store.records(status="nonsense")

    stats = store.stats(clock.now)
    assert stats.counts == {("x", "processing"): 1, ("y", "processing"): 1, ("x", "completed"): 1}
    assert stats.oldest_processing is not None and stats.oldest_processing.key_hash == a.key_hash
    assert (stats.expired, stats.archived) == (0, 0)
    clock.advance(2 * HOUR)
    later = store.stats(clock.now)
    assert later.counts == {("x", "completed"): 1} and later.expired == 2
    assert later.oldest_processing is None
    Sweeper(store, clock=clock).run()
    assert store.stats(clock.now).archived == 1
    assert [r.key for r in store.records()] == ["c"]


# -- Redis Cluster ----------------------------------------------------------------------


def test_cluster_sweep_records_and_stats(
    redis_cluster: RedisCluster, tmp_path: Path, clock: Clock
) -> None:
    store = RedisStore(
        redis_cluster.url,
        prefix=f"sweep-{uuid.uuid4().hex[:8]}:",
        archive=f"sqlite:///{tmp_path}/archive.db",
    )
    try:
        made = {
            kind: [_claim(store, clock, f"{kind}{i}", kind).key_hash for i in range(40)]
            for kind in ("standard", "financial")
        }
        live = [
            _claim(store, clock, f"live{i}", "standard", ttl=100 * HOUR).key_hash for i in range(20)
        ]
        client = store._sync_client()
        spread = {client.get_node_from_key(store.record_key(kh)).name for kh in live}
        assert len(spread) == 3, "the records should land on every primary"
        assert len(store.records(limit=1000)) == 100
        clock.advance(2 * HOUR)
        assert store.stats(clock.now).expired == 80
        report = Sweeper(store, batch_size=7, clock=clock).run()
        assert (report.deleted, report.archived) == (80, 40)
        assert all(store.get(kh) is None for kh in made["standard"] + made["financial"])
        assert all(store.get(kh) is not None for kh in live)
        archived = sorted(a.record.key_hash for a in store.archived_records(limit=100))
        assert archived == sorted(made["financial"])
        assert store.stats(clock.now).counts == {("op", "processing"): 20}
    finally:
        store.close()
