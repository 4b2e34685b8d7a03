"""Schema v3 of the PostgreSQL store (the compact row): the row codec's round trips,
the migration's SQL conversion against the codec, and a v2 table with live records
upgraded under them, plain and partitioned."""

from __future__ import annotations

import hashlib
import math
import re
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from _servers import PostgresServer
from conftest import Clock
from psycopg import sql

from retrysafe import (
    Claim,
    Engine,
    InProgressError,
    Outcome,
    Status,
)
from retrysafe._cli.app import main
from retrysafe._core.plan import Replay
from retrysafe._model.hashing import key_hash
from retrysafe._model.record import ClaimResult, Record
from retrysafe.errors import SchemaVersionError
from retrysafe.stores import postgres
from retrysafe.stores._packing import tagged_token, untag_token
from retrysafe.stores._sql import COLUMNS, record_from_row, record_params
from retrysafe.stores.postgres import PostgresStore
from retrysafe.stores.postgres.rows import (
    pack_digest,
    pack_record_key,
    row_params,
    row_record,
    unpack_digest,
)

HOUR = 3600.0
DAY = 24 * HOUR
DIGEST = hashlib.sha256(b"x").hexdigest()
UUID = "3f2c0a8e-5b7d-4e8a-9c1f-2d6b8a4e7f10"


def record(i: int, now: float = 1_800_000_000.0, **fields: Any) -> Record:
    """A completed record with ordinary values; ``fields`` replace them."""
    values: dict[str, Any] = dict(
        key_hash=hashlib.sha256(f"k{i}".encode()).hexdigest(),
        key=f"key-{i}",
        scope="",
        operation="order",
        fingerprint=DIGEST,
        status=Status.COMPLETED,
        token="0" * 20 + f"{i:x}",
        lease_until=now + 30,
        expires_at=now + HOUR,
        created_at=now,
        updated_at=now + 1,
        completed_at=now + 1,
        attempts=1,
        request_id=None,
        final=False,
        outcome=Outcome.json({"n": i}, status=201),
        request_payload=None,
        metadata={},
    )
    values.update(fields)
    return Record(**values)


#: Records at every edge of the codec's rules (and of the migration's SQL).
EDGES: list[dict[str, Any]] = [
    {},
    {"key_hash": "not hex", "fingerprint": "fp"},
    {"key_hash": "x" * 32, "fingerprint": "y" * 32},  # texts of a digest's length
    {"key_hash": DIGEST.upper(), "fingerprint": DIGEST[:63] + "g"},
    {"key_hash": "é" * 16, "fingerprint": ""},  # 32 bytes of UTF-8
    {"token": "abc"},  # odd-length hex
    {"token": "abcd"},
    {"token": "ABCD"},
    {"token": "token-1"},
    {"token": "\x01lead"},
    {"token": "\x02lead"},
    {"token": ""},
    {"token": "a" * 1025},
    {"key": UUID},
    {"key": UUID.upper()},
    {"key": "abcdefghijklmnop"},  # 16 bytes, not a UUID
    {"key": "ééééééé"},
    {"key": ""},
    {"scope": "credentials:abcd"},
    {"scope": "user:00ff"},
    {"scope": "principal:" + DIGEST},
    {"scope": "public:ab"},
    {"scope": "tenant:abcd"},  # a kind without a code
    {"scope": ":abcd"},
    {"scope": "\x05ctl:abcd"},  # a control character leads: kept as text
    {"scope": "\x01lead"},
    {"scope": "a:b:cc"},
    {"scope": "x:abc"},
    {"scope": "user:ABCD"},
    {"scope": "plain"},
    {"status": Status.PROCESSING, "completed_at": None, "outcome": None},
    {"status": Status.FAILED, "completed_at": None, "final": True},
    {"status": Status.FAILED, "completed_at": None, "outcome": None, "attempts": 3},
    {"completed_at": None},  # completed without one
    {"completed_at": 1_800_000_000.5},
    {"outcome": Outcome(b"raw", 200, media_type="application/octet-stream")},
    {"outcome": Outcome(b"", 204, media_type="")},
    {"outcome": Outcome(b"t", 200, media_type="text/plain; charset=utf-8")},
    {
        "outcome": Outcome(
            b'{"a":1}',
            200,
            headers=(("content-type", "application/json"), ("content-length", "7"), ("x", "1")),
            media_type="application/json",
        )
    },
    {"outcome": Outcome(b"x", 200, headers=(("x-nul", "a\0b"), ("y", "")))},
    {"outcome": Outcome(b"x", None, headers=(("[odd", "1"),))},
    {"metadata": {"user": "u1", "n": [1, 2]}},
    {"retention": "financial"},
    {"retention": "custom"},
    {"request_id": "req-1", "request_payload": b"\x00payload"},
]


@pytest.mark.parametrize("i", range(len(EDGES)))
def test_a_row_reads_back_the_record_it_was_made_from(i: int) -> None:
    r = record(i, **EDGES[i])
    row = served(row_params(r))
    assert len(row) == len(COLUMNS)
    assert row_record(row) == r


def served(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """A row as psycopg reads it back: ``bytea`` values as ``bytes``."""
    return tuple(bytes(v) if isinstance(v, bytearray) else v for v in row)


def test_a_row_is_compact() -> None:
    r = record(0, key=UUID, scope="user:" + "ab" * 16)
    row = dict(zip(COLUMNS, served(row_params(r)), strict=True))
    assert len(row["key_hash"]) == len(row["fingerprint"]) == 32
    assert len(row["key"]) == 16 and len(row["scope"]) == 18
    assert len(row["token"]) == 12  # 0x01 and 11 bytes for 21 hex digits
    assert (row["status"], row["completed_at"], row["retention"], row["metadata"]) == (
        1,
        None,
        None,
        None,
    )
    assert row["response_media_type"] is None and row["response_headers"] is None


def test_a_completed_record_without_a_completion_time_keeps_none() -> None:
    row = served(row_params(record(0, completed_at=None)))
    assert math.isnan(row[COLUMNS.index("completed_at")])
    assert row_record(row).completed_at is None


def reference_digest(text: str) -> bytes:
    """pack_digest's rule, written plainly."""
    if re.fullmatch("[0-9a-f]{64}", text):
        return bytes.fromhex(text)
    raw = text.encode()
    return raw + b"\xff" if len(raw) == 32 else raw


def reference_key(key: str) -> bytes:
    """pack_record_key's rule, written plainly."""
    if re.fullmatch("[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", key):
        return uuid.UUID(key).bytes
    raw = key.encode()
    return raw + b"\xff" if len(raw) == 16 else raw


def reference_token(token: str) -> bytes:
    """tagged_token's rule, written plainly."""
    if re.fullmatch("[0-9a-f]{1,1024}", token):
        return (
            b"\x01" + bytes.fromhex("0" + token)
            if len(token) % 2
            else b"\x00" + bytes.fromhex(token)
        )
    raw = token.encode()
    return b"\x02" + raw if raw[:1] in (b"\x00", b"\x01", b"\x02") else raw


#: Texts at the edges of the hex rules: what ``bytes.fromhex`` takes that the rules do
#: not (whitespace, uppercase), lengths around each bound, non-ASCII digits.
HEXISH = [
    DIGEST,
    "0" * 64,
    "9" * 64,
    DIGEST.upper(),
    DIGEST[:63] + "A",
    DIGEST[:62] + " a",
    " " + DIGEST[:63],
    DIGEST[:31] + "\t" + DIGEST[32:],
    DIGEST[:62] + "\n" + "0",
    DIGEST + "00",
    DIGEST[:62],
    "\u0660" * 64,  # Arabic-Indic digits: str.isdigit, not hex
    "g" * 64,
    "",
    "a",
    "ab",
    "a b",
    "abc",
    "0abc",
    "ab cd",
    "ABCD",
    "a" * 1023,
    "a" * 1024,
    "a" * 1025,
    "ab" * 513,
    UUID,
    UUID.upper(),
    UUID.replace("-", ""),
    UUID[:8] + " " + UUID[9:],
    UUID[:35] + "-",
    "3f2c0a8e-5b7d-4e8a-9c1f-2d6b8a4e7f1 ",
    "3f2c0a8e-5b7d-4e8a-9c1f--d6b8a4e7f10",
    "3f2c0a8e-5b7d-4e8a-9c1f-2d6b 8a4e7f0",
    "\x00lead",
    "\x01lead",
    "\x02lead",
    "\x03lead",
    "é" * 8,
    "é" * 16,
]


@pytest.mark.parametrize("text", HEXISH)
def test_the_packers_follow_their_rules(text: str) -> None:
    assert pack_digest(text) == reference_digest(text)
    assert pack_record_key(text) == reference_key(text)
    assert tagged_token(text) == reference_token(text)
    assert unpack_digest(pack_digest(text)) == text
    assert untag_token(tagged_token(text)) == text


@pytest.mark.parametrize("i", range(len(EDGES)))
def test_a_claims_row_read_with_what_it_sent_gives_the_stored_record(i: int) -> None:
    """A claim reads the stored row with the row it sent: values stored as sent are
    the claim's own texts, every other value is decoded (each edge record against a
    plain claim, and against a claim of itself with another token)."""
    stored = record(i, **EDGES[i])
    row = served(row_params(stored))
    plain = record(0, status=Status.PROCESSING, outcome=None, completed_at=None)
    itself = record(i, **{**EDGES[i], "token": "other", "status": Status.PROCESSING})
    for claim in (plain, itself):
        assert row_record(row, served(row_params(claim)), claim) == stored


def test_a_completion_binds_what_its_claim_packed_and_packs_what_it_does_not_hold() -> None:
    """The packed key hash and token a claim sent are bound again by its renewals and
    its completion (no server needed: the ops are built and parsed here)."""
    store = PostgresStore("postgresql://u@127.0.0.1:1/db", auto_migrate=False)
    r = record(1, status=Status.PROCESSING, outcome=None, completed_at=None)
    packed = (pack_digest(r.key_hash), tagged_token(r.token))
    inserted = (None,) * len(COLUMNS) + (True,)
    assert store._claim(r).parse(1, inserted) == ClaimResult(True, attempts=r.attempts)
    assert tuple(store._renew(r.key_hash, r.token, 2.0, 1.0).params[-2:]) == packed
    # another token of the same key (a stale owner's): its own packed form
    stale = store._fail(r.key_hash, "feed", None, False, 1.0).params[-2:]
    assert tuple(stale) == (packed[0], tagged_token("feed"))
    assert tuple(store._complete(r.key_hash, r.token, Outcome(b"x"), 1.0).params[-2:]) == packed
    assert store._held == {}  # settled: a later completion packs again, the same bytes
    assert tuple(store._complete(r.key_hash, r.token, Outcome(b"x"), 1.0).params[-2:]) == packed
    for i in range(postgres.store._HELD + 1):  # bounded
        claimed = record(i, status=Status.PROCESSING, outcome=None, completed_at=None)
        store._claim(claimed).parse(1, inserted)
        assert 0 < len(store._held) <= postgres.store._HELD


# -- PostgreSQL --------------------------------------------------------------------------


@pytest.fixture
def pg_url(postgres_server: PostgresServer) -> str:
    return postgres_server.url


@pytest.fixture
def pg(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        yield conn


def make_v2(
    url: str, table: str, monkeypatch: pytest.MonkeyPatch, *, partitioned: bool = False
) -> None:
    """An empty table as schema v2 made it: the store's own migration, stopped at v2."""
    with monkeypatch.context() as patch:
        patch.setattr(postgres.store, "SCHEMA_VERSION", 2)
        store = PostgresStore(url, table=table, partitioned=partitioned)
        assert store.migrate() == 2
        store.close()


def insert_v2(
    pg: psycopg.Connection[Any], table: str, records: list[Record], *, archived_at: float = 0
) -> None:
    """Rows as a v2 process wrote them (into ``table``'s archive with ``archived_at``)."""
    cols = [*COLUMNS, "archived_at"] if archived_at else list(COLUMNS)
    query = sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
        sql.Identifier(f"{table}_archive" if archived_at else table),
        sql.SQL(", ").join(map(sql.Identifier, cols)),
        sql.SQL(", ").join(sql.Placeholder() for _ in cols),
    )
    extra = (archived_at,) if archived_at else ()
    with pg.cursor() as cur:
        cur.executemany(query, [(*record_params(r), *extra) for r in records])


def add_partitions(pg: psycopg.Connection[Any], table: str, records: list[Record]) -> None:
    for r in records:
        pg.execute(
            sql.SQL("SELECT {}(%s)").format(sql.Identifier(f"{table}_add_partition")),
            (r.expires_at,),
        )


def raw_rows(pg: psycopg.Connection[Any], table: str) -> dict[bytes, tuple[Any, ...]]:
    cols = sql.SQL(", ").join(map(sql.Identifier, COLUMNS))
    rows = pg.execute(sql.SQL("SELECT {} FROM {}").format(cols, sql.Identifier(table))).fetchall()
    return {row[0]: tuple(row) for row in rows}


@pytest.mark.parametrize("partitioned", [False, True], ids=["plain", "partitioned"])
def test_the_migration_converts_each_value_as_the_codec_does(
    pg_url: str, pg: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch, partitioned: bool
) -> None:
    """The v3 step's SQL gives the bytes rows.row_params gives for what v2 read back,
    at every edge of the rules; the headers keep their JSON form and read back alike."""
    table = f"m_{uuid.uuid4().hex[:12]}"
    make_v2(pg_url, table, monkeypatch, partitioned=partitioned)
    old = [record(i, **edge) for i, edge in enumerate(EDGES)]
    if partitioned:
        add_partitions(pg, table, old)
    insert_v2(pg, table, old)
    insert_v2(pg, table, old[:3], archived_at=1_800_000_100.0)
    # What a v2 process read back: the reference.
    cols = sql.SQL(", ").join(map(sql.Identifier, COLUMNS))
    v2 = [
        record_from_row(row)
        for row in pg.execute(sql.SQL("SELECT {} FROM {}").format(cols, sql.Identifier(table)))
    ]
    assert len(v2) == len(old)

    store = PostgresStore(pg_url, table=table, partitioned=partitioned)
    try:
        assert store.migrate() == 3
        rows = raw_rows(pg, table)
        headers = COLUMNS.index("response_headers")
        for r in v2:
            want = served(row_params(r))
            got = rows[want[0]]
            for name, a, b in zip(COLUMNS, got, want, strict=True):
                if name == "completed_at" and isinstance(b, float) and math.isnan(b):
                    assert math.isnan(a), r
                elif name != "response_headers":
                    assert a == b, (name, r, a, b)
            assert row_record(got) == r
            assert (got[headers] is None) == (want[headers] is None), r
            assert store.get(r.key_hash) == r
        archived = {a.record.key_hash: a for a in store.archived_records()}
        assert len(archived) == 3
        for r in v2[:3]:
            assert archived[r.key_hash].record == r
            assert archived[r.key_hash].archived_at == 1_800_000_100.0
        assert store.migrate() == 3  # twice: nothing to do
        assert len(raw_rows(pg, table)) == len(old)
    finally:
        store.close()


FP = hashlib.sha256(b"request").hexdigest()


def live(clock: Clock, key: str, status: Status, **fields: Any) -> Record:
    """A record of ``key`` as the engine writes it for operation ``order``."""
    now = clock.now
    values: dict[str, Any] = dict(
        key_hash=key_hash("", "order", key),
        key=key,
        fingerprint=FP,
        status=status,
        token=hashlib.sha256(key.encode()).hexdigest()[:21],
        created_at=now,
        updated_at=now,
        completed_at=now if status is Status.COMPLETED else None,
        expires_at=now + HOUR,
    )
    values.update(fields)
    return record(0, now, **values)


@pytest.mark.parametrize("partitioned", [False, True], ids=["plain", "partitioned"])
def test_a_v2_table_with_live_records_upgrades_under_them(
    pg_url: str,
    pg: psycopg.Connection[Any],
    clock: Clock,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
    partitioned: bool,
) -> None:
    """Drained, migrated by ``retrysafe migrate``, started again: a completed record
    replays, a failed one replays its failure, the claim in flight is told so and
    its owner completes it with its token, financial records are archived (the
    archive's v2 rows kept), and a v2 process refuses the table."""
    table = f"m_{uuid.uuid4().hex[:12]}"
    make_v2(pg_url, table, monkeypatch, partitioned=partitioned)
    done = live(clock, "done", Status.COMPLETED, outcome=Outcome.json({"n": 1}, status=201))
    failed = live(clock, "failed", Status.FAILED, final=True, outcome=Outcome(b"no", 402))
    inflight = live(clock, "inflight", Status.PROCESSING, outcome=None)
    paid = live(clock, "paid", Status.COMPLETED, retention="financial", outcome=Outcome(b"$"))
    older = live(clock, UUID, Status.COMPLETED, retention="financial")
    records = [done, failed, inflight, paid]
    if partitioned:
        add_partitions(pg, table, records)
    insert_v2(pg, table, records)
    insert_v2(pg, table, [older], archived_at=clock.now - 10)

    flags = "&partitioned=true" if partitioned else ""
    url = f"{pg_url}?table={table}{flags}"
    assert postgres.SCHEMA_VERSION == 3
    assert main(["migrate", "--store", url]) == 0
    assert "schema at version 3" in capsys.readouterr().out

    store = PostgresStore(pg_url, table=table, partitioned=partitioned)
    try:
        engine = Engine(store, ttl=HOUR, clock=clock)
        replay = engine.begin("done", operation="order", fingerprint=FP)
        assert isinstance(replay, Replay) and replay.outcome == done.outcome
        replay = engine.begin("failed", operation="order", fingerprint=FP)
        assert isinstance(replay, Replay) and replay.failed
        with pytest.raises(InProgressError):
            engine.begin("inflight", operation="order", fingerprint=FP)
        assert not store.complete(inflight.key_hash, "0" + inflight.token, Outcome(b"x"), clock.now)
        assert store.complete(inflight.key_hash, inflight.token, Outcome(b"ok"), clock.now)
        replay = engine.begin("inflight", operation="order", fingerprint=FP)
        assert isinstance(replay, Replay) and replay.outcome is not None
        assert replay.outcome.body == b"ok"
        assert store.get(paid.key_hash) == paid

        listed = {r.key for r in store.records()}
        assert listed == {"done", "failed", "inflight", "paid"}
        assert [r.key for r in store.records(status="failed")] == ["failed"]
        assert [r.key for r in store.records(key="paid")] == ["paid"]
        stats = store.stats(clock.now)
        assert stats.counts == {("order", "completed"): 3, ("order", "failed"): 1}
        assert stats.archived == 1 and stats.oldest_processing is None
        assert [a.record for a in store.archived_records()] == [older]

        assert store.delete(failed.key_hash) and store.get(failed.key_hash) is None
        assert not store.delete(failed.key_hash)
        claim = engine.begin("new", operation="order", fingerprint=FP)
        assert isinstance(claim, Claim)
        clock.advance(3 * DAY)  # past the end of a partitioned table's (daily) partition
        deleted = archived_now = 0
        for _ in range(100):  # a partitioned sweep drops one partition per step
            batch = store.sweep(clock.now, 100)
            deleted, archived_now = deleted + batch.deleted, archived_now + batch.archived
            if batch.done:
                break
        assert (deleted, archived_now) == (4, 1)
        archived = [a.record for a in store.archived_records()]
        assert sorted(a.key for a in archived) == sorted(["paid", UUID])
        assert store.delete(claim.key_hash) is False  # swept already
        assert store.migrate() == 3  # twice: nothing to do
    finally:
        store.close()

    # A v2 process still running fails on every write (its status text into the
    # code), and one that starts refuses the table: neither becomes a second owner.
    type_errors = (psycopg.errors.DatatypeMismatch, psycopg.errors.InvalidTextRepresentation)
    with pytest.raises(type_errors):
        insert_v2(pg, table, [live(clock, "late", Status.PROCESSING, outcome=None)])
    with monkeypatch.context() as patch:
        patch.setattr(postgres.store, "SCHEMA_VERSION", 2)
        old = PostgresStore(pg_url, table=table, partitioned=partitioned)
        try:
            with pytest.raises(SchemaVersionError, match="version 3 is newer"):
                old.get(done.key_hash)
        finally:
            old.close()


def test_a_partition_a_sweep_left_detached_is_archived_by_the_migration(
    pg_url: str, pg: psycopg.Connection[Any], clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The v2 rows of a table a killed sweep detached and did not drop: the v3 archive
    cannot take them later, so the migration archives its financial rows and drops it."""
    table = f"m_{uuid.uuid4().hex[:12]}"
    make_v2(pg_url, table, monkeypatch, partitioned=True)
    paid = live(clock, "paid", Status.COMPLETED, retention="financial")
    plain = live(clock, "plain", Status.COMPLETED)
    add_partitions(pg, table, [paid])
    insert_v2(pg, table, [paid, plain])
    name = pg.execute(
        "SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = %s::regclass AND c.relname ~ %s",
        (table, f"_p{int(paid.expires_at // DAY * DAY)}$"),
    ).fetchone()
    assert name is not None
    pg.execute(
        sql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(
            sql.Identifier(table), sql.Identifier(name[0])
        )
    )
    store = PostgresStore(pg_url, table=table, partitioned=True)
    try:
        assert store.migrate() == 3
        assert [a.record for a in store.archived_records()] == [paid]
        assert store.get(paid.key_hash) is None and store.get(plain.key_hash) is None
    finally:
        store.close()
    assert pg.execute("SELECT to_regclass(%s)", (name[0],)).fetchone() == (None,)
