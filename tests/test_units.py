"""Keys, fingerprints, store URLs, the memory store's bound, SQLite's schema version."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import gc
import sqlite3
import uuid
from pathlib import Path

import pytest

from retrysafe import (
    Claim,
    Engine,
    IdempotencyError,
    InProgressError,
    Outcome,
    Replay,
    canonical_json,
    fingerprint,
    idempotent,
    key_hash,
    open_store,
)
from retrysafe._model.decide import Verdict, claimable, retry_after, verdict
from retrysafe._model.record import ClaimResult, Record, Status
from retrysafe.stores.memory import MemoryStore, record_bytes
from retrysafe.stores.sqlite import SCHEMA_VERSION as SQLITE_SCHEMA_VERSION
from retrysafe.stores.sqlite import SQLiteStore


def test_key_hash_separates_its_parts() -> None:
    hashes = {
        key_hash("", "ab", "c"),
        key_hash("", "a", "bc"),
        key_hash("a", "b", "c"),
        key_hash("ab", "", "c"),
        key_hash("", "", "abc"),
    }
    assert len(hashes) == 5
    assert key_hash("s", "o", "k") == key_hash("s", "o", "k")
    assert len(key_hash("s", "o", "k")) == 64


def test_canonical_json_ignores_key_order_and_whitespace() -> None:
    a = {"b": [1, 2, {"y": 1, "x": 2}], "a": "é"}
    b = {"a": "é", "b": [1, 2, {"x": 2, "y": 1}]}
    assert canonical_json(a) == canonical_json(b) == '{"a":"é","b":[1,2,{"x":2,"y":1}]}'.encode()
    assert fingerprint(a) == fingerprint(b) != fingerprint({**a, "a": "e"})


def test_canonical_json_of_common_types() -> None:
    @dataclasses.dataclass
    class Item:
        sku: str
        qty: int

    value = {
        "item": Item("x", 2),
        "tags": {"b", "a"},
        "raw": b"\x00\xff",
        "when": dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
        "price": decimal.Decimal("29.99"),
        "id": uuid.UUID(int=1),
    }
    text = canonical_json(value).decode()
    assert '"item":{"qty":2,"sku":"x"}' in text and '"tags":["a","b"]' in text
    assert '"price":"29.99"' in text and "2026-01-02T03:04:05+00:00" in text
    with pytest.raises(TypeError, match="cannot fingerprint"):
        canonical_json({"x": object()})
    with pytest.raises(ValueError):
        canonical_json(float("nan"))


def _record(**changes: object) -> Record:
    base = Record(
        key_hash="h",
        key="k",
        scope="",
        operation="op",
        fingerprint="fp",
        status=Status.PROCESSING,
        token="t",
        lease_until=10.0,
        expires_at=100.0,
        created_at=0.0,
        updated_at=0.0,
    )
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    ("record", "fp", "now", "expected"),
    [
        (None, "fp", 5.0, True),
        (_record(), "fp", 5.0, False),  # lease alive
        (_record(), "fp", 10.0, True),  # lease ran out
        (_record(), "other", 10.0, False),  # …but another request never takes over
        (_record(), "other", 100.0, True),  # expired: free for anyone
        (_record(status=Status.FAILED), "fp", 5.0, True),
        (_record(status=Status.FAILED, final=True), "fp", 5.0, False),
        (_record(status=Status.COMPLETED), "fp", 50.0, False),
        (_record(status=Status.COMPLETED), "fp", 100.0, True),
    ],
)
def test_claimable(record: Record | None, fp: str, now: float, expected: bool) -> None:
    assert claimable(record, fp, now) is expected


def test_verdict_and_retry_after() -> None:
    assert verdict(_record(), "other") is Verdict.CONFLICT
    assert verdict(_record(), "fp") is Verdict.IN_PROGRESS
    assert verdict(_record(status=Status.COMPLETED), "fp") is Verdict.REPLAY
    # As long as the attempt has run, at least 1 s, never past the lease's end.
    assert retry_after(_record(), 0.2) == 1.0
    assert retry_after(_record(), 4.0) == 4.0
    assert retry_after(_record(), 7.5) == 3.0
    assert retry_after(_record(), 9.5) == 1.0
    assert retry_after(_record(), 50.0) == 1.0


def test_outcome_json_round_trip() -> None:
    out = Outcome.json({"a": [1, None]}, status=201, headers=(("x-a", "1"),))
    assert out.value == {"a": [1, None]} and out.status == 201
    assert Outcome.parse_headers(out.headers_json()) == (("x-a", "1"),)
    assert Outcome(b"raw").value == b"raw"
    with pytest.raises(TypeError):
        Outcome.json(object())


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("memory://", "MemoryStore"),
        ("sqlite:///x.db", "SQLiteStore"),
        ("sqlite:////tmp/x.db", "SQLiteStore"),
        ("redis://127.0.0.1:1/0", "RedisStore"),
        ("rediss://127.0.0.1:1/0", "RedisStore"),
        ("redis+cluster://127.0.0.1:1", "RedisStore"),
        ("postgresql://u@127.0.0.1:1/db", "PostgresStore"),
        ("postgres://u@127.0.0.1:1/db", "PostgresStore"),
    ],
)
def test_open_store_by_url(url: str, kind: str) -> None:
    store = open_store(url)
    assert type(store).__name__ == kind and store.url == url
    store.close()


def test_sqlite_paths() -> None:
    assert SQLiteStore("sqlite:///rel/x.db").path == "rel/x.db"
    assert SQLiteStore("sqlite:////abs/x.db").path == "/abs/x.db"
    for bad in ("sqlite://", "sqlite:///:memory:", "sqlite:///x.db?synchronous=sometimes"):
        with pytest.raises(ValueError):
            SQLiteStore(bad)


@pytest.mark.parametrize("url", ["bogus://x", "http://example", "", "redis"])
def test_unknown_urls(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RETRYSAFE_STORE", "bogus://from-env")
    with pytest.raises(ValueError, match="unknown store URL"):
        open_store(url)


def test_env_names_the_default_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RETRYSAFE_STORE", "memory://")
    assert isinstance(open_store(), MemoryStore)
    assert isinstance(Engine().store, MemoryStore)


def test_memory_store_is_bounded_lru() -> None:
    engine = Engine(MemoryStore(max_size=3))
    claims = []
    for key in "abc":
        claim = engine.begin(key)
        assert isinstance(claim, Claim)
        engine.complete(claim, Outcome.json(key))
        claims.append(claim)
    assert isinstance(engine.begin("a"), Replay)  # touch a: b is now the oldest
    assert isinstance(engine.begin("d"), Claim)
    assert len(engine.store) == 3  # type: ignore[arg-type]
    assert engine.store.get(claims[1].key_hash) is None
    assert engine.store.get(claims[0].key_hash) is not None
    with pytest.raises(ValueError):
        MemoryStore(max_size=0)


def test_memory_store_is_bounded_in_bytes() -> None:
    """150 answers of 1 MB each: the default 64 MiB bound holds, the newest replay."""
    store = MemoryStore()
    assert store.max_bytes == 64 << 20
    engine = Engine(store, max_body=2 << 20)
    claims = []
    for i in range(150):
        claim = engine.begin(f"k{i}")
        assert isinstance(claim, Claim)
        engine.complete(claim, Outcome(bytes([i]) * 1_000_000))
        claims.append(claim)
        assert store.bytes <= store.max_bytes
    assert 50 <= len(store) <= 67  # most of the bound is used, and no more
    assert store.bytes == sum(record_bytes(r) for r in store.records(limit=1000))
    newest = engine.begin("k149")
    assert isinstance(newest, Replay) and newest.outcome.body == bytes([149]) * 1_000_000
    assert store.get(claims[0].key_hash) is None  # the oldest were forgotten
    for claim in claims:  # deleting gives every byte back
        store.delete(claim.key_hash)
    assert (len(store), store.bytes) == (0, 0)


def test_memory_store_byte_bound_spares_live_leases_and_refuses_a_giant() -> None:
    store = open_store("memory://?max_bytes=3000000")
    assert isinstance(store, MemoryStore) and store.max_bytes == 3_000_000
    engine = Engine(store, max_body=8 << 20)
    running = engine.begin("running")  # in flight: never evicted, whatever it costs
    assert isinstance(running, Claim)
    for key in ("a", "b", "c", "d"):
        claim = engine.begin(key)
        assert isinstance(claim, Claim)
        engine.complete(claim, Outcome(b"x" * 1_000_000))
    assert store.bytes <= 3_000_000
    assert store.get(running.key_hash) is not None
    giant = engine.begin("giant")
    assert isinstance(giant, Claim)
    engine.complete(giant, Outcome(b"y" * 4_000_000))  # over the bound alone: not kept
    assert store.get(giant.key_hash) is None
    assert isinstance(engine.begin("d"), Replay)  # and nothing else was evicted for it
    with pytest.raises(InProgressError):
        engine.begin("running")
    for bad in ("memory://?max_bytes=0", "memory://?max_bytes=lots", "memory://?max_size=-1"):
        with pytest.raises(ValueError):
            open_store(bad)
    with pytest.raises(ValueError):
        MemoryStore(max_bytes=0)


def test_memory_store_never_evicts_a_live_lease() -> None:
    engine = Engine(MemoryStore(max_size=1))
    first = engine.begin("in-flight")
    assert isinstance(first, Claim)
    assert isinstance(engine.begin("other"), Claim)  # over the bound, but a is still running
    with pytest.raises(InProgressError):
        engine.begin("in-flight")  # not forgotten: no second owner
    engine.complete(first, Outcome.json(1))


def test_memory_store_rows_are_invisible_to_the_collector() -> None:
    """Completed, failed and renewed records are kept in forms the collector untracks."""
    store = MemoryStore()
    engine = Engine(store)
    for i in range(50):
        claim = engine.begin(f"k{i}", fingerprint="f", metadata={"n": i}, request_id="r")
        assert isinstance(claim, Claim)
        if i % 3 == 0:
            engine.complete(claim, Outcome.json({"i": i}, headers=(("x-a", "1"),), status=201))
        elif i % 3 == 1:
            engine.fail(claim, Outcome(b"no"), final=True)
        else:
            engine.renew(claim, 60)
    gc.collect()
    assert len(store) == 50
    assert not any(gc.is_tracked(row) for row in store._records.values())


def test_memory_store_rows_of_http_answers_are_untracked_by_one_full_collection() -> None:
    """Thousands of answers with headers (young collections run meanwhile, promoting
    rows): one full collection leaves none tracked, so none lengthens the next one."""
    store = MemoryStore()
    engine = Engine(store)
    for i in range(5000):
        claim = engine.begin(f"k{i}")
        assert isinstance(claim, Claim)
        headers = (("content-type", "application/json"), ("x-order", str(i)))
        engine.complete(claim, Outcome(b'{"id":1}', 201, headers, "application/json"))
    gc.collect()
    assert not any(gc.is_tracked(row) for row in store._records.values())
    replay = engine.begin("k7")
    assert isinstance(replay, Replay)
    assert replay.outcome.headers == (("content-type", "application/json"), ("x-order", "7"))


def test_memory_store_gives_back_every_field() -> None:
    store = MemoryStore()
    record = Record(
        key_hash="h" * 64,
        key="k",
        scope="s",
        operation="pay",
        fingerprint="f",
        status=Status.PROCESSING,
        token="t1",
        lease_until=1010.0,
        expires_at=1100.0,
        created_at=1000.0,
        updated_at=1000.0,
        request_id="r",
        request_payload=b"p",
        metadata={"m": [1, 2]},
        retention="financial",
    )
    assert store.claim(record) == ClaimResult(True)  # (== reads every field: an unset one raises)
    assert store.get(record.key_hash) == record
    assert store.bytes == record_bytes(record)
    outcome = Outcome(b"body", 201, (("x-a", "1"),), "text/plain")
    assert not store.complete(record.key_hash, "t2", outcome, 1001.0)  # another token
    assert store.complete(record.key_hash, "t1", outcome, 1002.0)
    done = dataclasses.replace(
        record, status=Status.COMPLETED, outcome=outcome, completed_at=1002.0, updated_at=1002.0
    )
    assert store.get(record.key_hash) == done
    assert store.bytes == record_bytes(done)
    assert not store.fail(record.key_hash, "t1", None, True, 1003.0)  # no longer processing
    found = store.claim(dataclasses.replace(record, token="t3", updated_at=1004.0))
    assert not found.claimed and found.record == done  # a finished record is read back
    assert found.record is not None and found.record.status is Status.COMPLETED


def test_sqlite_schema_is_versioned(tmp_path: Path) -> None:
    path = tmp_path / "v.db"
    store = SQLiteStore(f"sqlite:///{path}")
    assert store.migrate() == SQLITE_SCHEMA_VERSION == 4
    store.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SQLITE_SCHEMA_VERSION
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        conn.execute("PRAGMA user_version = 99")
    newer = SQLiteStore(f"sqlite:///{path}")
    with pytest.raises(IdempotencyError, match="newer"):
        newer.get("x")


def test_sqlite_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    """The database, its -wal and its -shm are created 0600: they hold stored answers."""
    import os
    import stat

    path = tmp_path / "private.db"
    old = os.umask(0o022)  # the usual umask, under which SQLite alone creates 0644
    try:
        store = SQLiteStore(f"sqlite:///{path}")
        engine = Engine(store)
        claim = engine.begin("k")
        assert isinstance(claim, Claim)
        engine.complete(claim, Outcome.json({"card": "4242"}))
        files = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
        assert all(f.exists() for f in files)  # the connection is open: WAL and SHM exist
        assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {
            f.name: 0o600 for f in files
        }
        store.close()
    finally:
        os.umask(old)


def test_sqlite_store_survives_a_fork(tmp_path: Path) -> None:
    import os

    store = SQLiteStore(f"sqlite:///{tmp_path}/f.db")
    engine = Engine(store)
    first = engine.begin("before-fork")
    parent_conn = store._conn()
    assert isinstance(first, Claim)
    engine.complete(first, Outcome.json("parent"))
    pid = os.fork()
    if pid == 0:  # the child uses its own connection, not the parent's
        code = 1
        try:
            replay = engine.begin("before-fork")
            child = engine.begin("in-child")
            own = store._conn() is not parent_conn
            if own and isinstance(replay, Replay) and isinstance(child, Claim):
                engine.complete(child, Outcome.json("child"))
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    again = engine.begin("in-child")
    assert isinstance(again, Replay) and again.outcome.value == "child"


async def test_sqlite_aclose_closes_the_worker_threads_connections(tmp_path: Path) -> None:
    import asyncio
    import os

    path = tmp_path / "a.db"
    store = SQLiteStore(f"sqlite:///{path}")
    engine = Engine(store)

    def open_handles() -> int:
        fds = os.listdir("/proc/self/fd")
        return sum(1 for fd in fds if os.path.realpath(f"/proc/self/fd/{fd}") == str(path))

    results = await asyncio.gather(*(engine.abegin(f"k{i}") for i in range(20)))
    assert all(isinstance(r, Claim) for r in results)
    assert open_handles() >= 1
    await engine.aclose()
    assert open_handles() == 0
    with pytest.raises(InProgressError):  # reopens on use; the record survived the close
        await engine.abegin("k0")


def test_a_request_id_is_kept_within_128_characters() -> None:
    import hashlib

    from retrysafe._model.record import stored_request_id

    assert stored_request_id("a" * 128) == "a" * 128
    assert stored_request_id(None) is None and stored_request_id("") is None
    for hostile in ("a" * 129, "a b", "\x1b[31mred", "é", "x\ud800"):
        expected = hashlib.sha256(hostile.encode("utf-8", "surrogatepass")).hexdigest()
        assert stored_request_id(hostile) == "sha256:" + expected
    engine = Engine(MemoryStore())
    claim = engine.begin("k", request_id="r" * (1 << 20))  # every front door, one engine
    assert isinstance(claim, Claim)
    assert engine.store.get(claim.key_hash).request_id.startswith("sha256:")


def test_record_copy_keeps_every_field() -> None:
    record = _record(
        completed_at=5.0,
        attempts=3,
        request_id="r",
        final=True,
        outcome=Outcome.json({"a": 1}),
        request_payload=b"{}",
        metadata={"m": 1},
        retention="financial",
    )
    copy = record.copy()
    assert copy == record and copy is not record
    assert {f.name for f in dataclasses.fields(Record)} == set(Record.__slots__)


def test_the_plans_record_and_claim_set_every_field() -> None:
    """Plan.record and Plan.answer fill blank instances field by field (the hot path):
    each field is set, to what the keyword construction gives."""
    from retrysafe._core.plan import Plan

    engine = Engine(MemoryStore(), ttl=100, lease=10)
    plan = Plan(
        engine, "k", operation="pay", scope="s", fingerprint="f", request_id="r", metadata={"m": 1}
    )
    record = plan.record(1000.0)
    expected = Record(
        key_hash=plan.key_hash,
        key="k",
        scope="s",
        operation="pay",
        fingerprint="f",
        status=Status.PROCESSING,
        token=record.token,
        lease_until=1010.0,
        expires_at=1100.0,
        created_at=1000.0,
        updated_at=1000.0,
        request_id="r",
        metadata={"m": 1},
    )
    assert record == expected  # (== reads every field: an unset one raises)
    claim = plan.answer(ClaimResult(True, attempts=2, took_over=Status.FAILED), record, 0.0)
    assert isinstance(claim, Claim)
    fields = {f.name: getattr(claim, f.name) for f in dataclasses.fields(Claim)}
    assert set(fields) == set(Claim.__slots__)
    assert fields | {"started": 0.0} == {
        "key": "k",
        "key_hash": plan.key_hash,
        "scope": "s",
        "operation": "pay",
        "fingerprint": "f",
        "token": record.token,
        "lease_until": 1010.0,
        "expires_at": 1100.0,
        "attempts": 2,
        "took_over": Status.FAILED,
        "request_id": "r",
        "started": 0.0,
        "answer_ttl": None,
    }
    done = dataclasses.replace(record, status=Status.COMPLETED, outcome=Outcome.json(1))
    replay = plan.answer(ClaimResult(False, record=done), record, 0.0)
    assert replay == Replay(done) and set(Replay.__slots__) == {"record"}


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"ttl": 0}, ValueError, "ttl must be a positive number of seconds"),
        ({"ttl": float("inf")}, ValueError, "ttl must be a positive"),
        ({"ttl": "1h"}, TypeError, "ttl must be a number of seconds, not str"),
        ({"lease": True}, TypeError, "lease must be a number of seconds, not bool"),
        ({"wait": -1}, ValueError, r"wait must be a number of seconds >= 0, not -1"),
        ({"wait": float("nan")}, ValueError, "wait must be a number"),
        ({"retention": "forever"}, ValueError, "retention must be one of standard, financial"),
        ({"max_body": -1}, ValueError, "max_body must not be negative"),
        ({"settle_retry": -1}, ValueError, "settle_retry must be zero or a positive"),
    ],
)
def test_options_are_checked_once_with_the_same_messages_everywhere(
    options: dict[str, object], error: type[Exception], match: str
) -> None:
    from retrysafe._core.options import Options

    with pytest.raises(error, match=match):
        Options(**options)  # type: ignore[arg-type]
    with pytest.raises(error, match=match):
        Engine("memory://", **options)  # type: ignore[arg-type]
    if "max_body" in options or "settle_retry" in options:
        return  # engine-wide only
    engine = Engine("memory://")
    with pytest.raises(error, match=match):
        engine.begin("k", **options)  # type: ignore[arg-type]
    with pytest.raises(error, match=match):
        idempotent(store=engine, **options)  # type: ignore[arg-type]


def test_options_are_normalised() -> None:
    from retrysafe._core.options import Options

    options = Options(ttl=5, lease=1, wait=0, max_body=True, settle_retry=0)
    assert (options.ttl, options.lease, options.wait) == (5.0, 1.0, 0.0)
    assert type(options.ttl) is float and options.max_body == 1 and options.settle_retry == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.ttl = 1  # type: ignore[misc]


def test_a_claim_in_flight_answers_wait_then_in_progress() -> None:
    from retrysafe._core.plan import Plan, Wait

    engine = Engine("memory://", wait=0.05)
    claim = engine.begin("k", operation="op")
    assert isinstance(claim, Claim)
    plan = Plan(engine, "k", operation="op")
    record = plan.record(engine.clock())
    answer = plan.answer(engine.store.claim(record), record, 0.0)
    assert isinstance(answer, Wait) and 0 < answer.seconds <= 0.05
    plan.deadline = 0.0  # the wait has run out
    with pytest.raises(InProgressError):
        plan.answer(engine.store.claim(plan.record(engine.clock())), record, 0.0)
    attempt = engine.attempt("other", operation="op")
    with attempt:
        attempt.complete(Outcome.json(1))
        assert attempt.finished and attempt.settled  # the former name reads the same


def test_is_key_accepts_what_the_key_pattern_matches() -> None:
    from retrysafe._model.hashing import KEY_PATTERN, is_key

    for code in range(0x250):
        char = chr(code)
        assert is_key(char) is bool(KEY_PATTERN.fullmatch(char)), hex(code)
    for key in ("a" * 255, "a" * 256, "", "a b", "a\x00", "é", "\ud800", 5, None, b"k"):
        assert is_key(key) is (type(key) is str and bool(KEY_PATTERN.fullmatch(key)))
