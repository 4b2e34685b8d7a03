"""SQLite's compact rows (schema v4): every record reads back as written, packed or
not; a v2 or v3 file (records and archive) is rewritten in place."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock

from retrysafe import Claim, Engine, Outcome, Status
from retrysafe._model.hashing import key_hash
from retrysafe._model.record import Record
from retrysafe.stores import sqlite
from retrysafe.stores._sql import ARCHIVE_COLUMNS, COLUMNS, record_from_row, record_params
from retrysafe.stores._sqlite_rows import (
    pack_hex,
    pack_key,
    pack_token,
    row_params,
    row_record,
)
from retrysafe.stores.sqlite import SQLiteStore

HOUR = 3600.0
EXPIRES = "UPDATE retrysafe_records SET expires_at = ?"
DIGEST = key_hash("", "op", "k")


def base(**changes: Any) -> Record:
    record = Record(
        key_hash=DIGEST,
        key="3f2c0a8e-5b7d-4e8a-9c1f-2d6b8a4e7f10",
        scope="credentials:cff1c101ed921f9e10e6b01968a52bbe",
        operation="orders.create",
        fingerprint="ab" * 32,
        status=Status.COMPLETED,
        token="030508c3d43aec0c245a0",
        lease_until=1795779549.406825,
        expires_at=1795865919.406825,
        created_at=1795779519.406825,
        updated_at=1795779519.472335,
        completed_at=1795779519.472335,
        outcome=Outcome(
            b'{"id":1}', 201, (("content-type", "application/json"),), "application/json"
        ),
    )
    return dataclasses.replace(record, **changes)


#: Records whose every value takes one branch of the packing or the other.
EDGES = [
    base(),
    base(status=Status.PROCESSING, completed_at=None, outcome=None),
    base(status=Status.FAILED, completed_at=None, final=True, outcome=None),
    base(status=Status.FAILED, outcome=Outcome(b"no", 500)),  # completed_at of a failure
    base(completed_at=None),  # completed without a completion time
    base(completed_at=5.0),  # not the update time
    base(status=Status.PROCESSING, completed_at=7.0, outcome=None),
    base(key_hash="not hex", fingerprint="fp", token="token-1", key="k", scope=""),
    base(key_hash=DIGEST.upper(), fingerprint="abc", token="0a", key="x" * 36),
    base(key="3F2C0A8E-5B7D-4E8A-9C1F-2D6B8A4E7F10"),  # an upper-case UUID stays text
    base(key="3f2c0a8e-5b7d-4e8a-9c1f-2d6b8a4e7f1g"),
    base(key="3f2c0a8e-5b7d-4e8a-9c1f-2d6b8a4e-f10"),
    base(key="3f2c0a8e5-b7d-4e8a-9c1f-2d6b8a4e7f10"),
    base(scope="credentials:CFF1"),
    base(scope="credentials:abc"),
    base(scope=":ab"),
    base(scope="x:"),
    base(scope="kind:ab:cd"),
    base(scope="ключ:ab"),
    base(scope="abcd"),
    base(scope="user:ab"),
    base(scope="principal:" + "cd" * 16),
    base(scope="public:"),
    base(scope="\x01:ab"),
    base(scope="\x01"),
    base(scope="credentials"),
    base(outcome=Outcome(b"", None, (), "application/octet-stream")),
    base(outcome=Outcome(b"x", 200, (("a\0b", "c"),), "text/plain")),
    base(outcome=Outcome(b"x", 200, (("[a", "b"), ("c", "")), "")),
    base(outcome=Outcome(b"x", 200, (("", ""),), "1")),
    base(outcome=Outcome(b"x", 200, (("set-cookie", "a"), ("set-cookie", "b")))),
    base(retention="financial", request_id="req-1", metadata={"user": "u1", "n": [1]}),
    base(retention="other", request_payload=b"\x00payload", attempts=3),
    # Tokens: odd and even lengths, a leading 0 (text when even), not lowercase hex.
    base(token="abc"),
    base(token="0ab"),
    base(token="ab"),
    base(token="0"),
    base(token="00"),
    base(token="ABC"),
    base(token="abg"),
    base(token=""),
    # Headers the media type and body give, and ones they do not.
    base(outcome=Outcome(b"{}", 201, (("content-type", "application/json"),), "text/plain")),
    base(
        outcome=Outcome(
            b"0123456789",
            201,
            (("content-type", "text/csv"), ("x", "y"), ("content-length", "10")),
            "text/csv",
        )
    ),
    base(outcome=Outcome(b"12", 200, (("content-length", "3"), ("content-length", "2")))),
    base(outcome=Outcome(b"12", 200, (("Content-Length", "2"), ("Content-Type", "text/csv")))),
    base(outcome=Outcome(b"x", 200, (("\x01", ""), ("content-length", "1")))),
    base(outcome=Outcome(b"x", 200, (("a", "b"), ("\x02", "")))),
    base(outcome=Outcome(b"x", 200, (("content-length", "1"), ("[a", "b")))),
]


@pytest.mark.parametrize("record", EDGES, ids=range(len(EDGES)))
def test_a_record_reads_back_as_written(record: Record) -> None:
    params = row_params(record)
    assert not any(type(v) in (bytes, bool) for v in params)  # bound without a lookup
    # SQLite gives a blob back as bytes.
    row = [bytes(v) if type(v) is bytearray else v for v in params]
    assert row_record(row) == record


#: The plain row form reads an empty media type as application/octet-stream.
PLAIN = [r for r in EDGES if r.outcome is None or r.outcome.media_type]


@pytest.mark.parametrize("record", PLAIN, ids=range(len(PLAIN)))
def test_a_plain_row_reads_back_as_written(record: Record) -> None:
    """The plain row form (PostgreSQL's, and SQLite's before v3), filled field by field."""
    assert record_from_row(record_params(record)) == record


@pytest.mark.parametrize("record", EDGES, ids=range(len(EDGES)))
def test_a_record_reads_back_from_the_file(tmp_path: Path, record: Record) -> None:
    """Through SQLite itself: its column types keep each value as it was bound."""
    store = SQLiteStore(f"sqlite:///{tmp_path}/r.db")
    try:
        assert store.archive_records([record], 9.0) == 1
        (archived,) = store.archived_records()
        assert archived.record == record and archived.archived_at == 9.0
        assert store.claim(dataclasses.replace(record, expires_at=0.0)).claimed
        assert store._run(lambda conn: conn.execute(EXPIRES, (record.expires_at,)).rowcount) == 1
        assert store.get(record.key_hash) == record
        assert store.records(key=record.key) == [record]
        assert store.records(status=record.status) == [record]
    finally:
        store.close()


def test_tokens_headers_and_scopes_are_packed() -> None:
    """The engine's tokens (20 digits and a counter) are bytes whatever their length;
    an HTTP answer's content-type and content-length are a byte each, as is the kind
    of a principal's scope."""
    assert pack_token("030508c3d43aec0c245a0") == bytes.fromhex("0030508c3d43aec0c245a0")
    assert pack_token("a30508c3d43aec0c245a01") == bytes.fromhex("a30508c3d43aec0c245a01")
    assert pack_token("030508c3d43aec0c245a01") == "030508c3d43aec0c245a01"
    headers = (("content-type", "application/json"), ("content-length", "2"))
    params = row_params(base(outcome=Outcome(b"{}", 200, headers, "application/json")))
    assert params[16] == "\x01\0\0\x02\0"
    scope = "credentials:" + "ab" * 16
    assert row_params(base(scope=scope))[2] == b"\x01" + bytes.fromhex("ab" * 16)


def test_digests_and_uuids_are_packed() -> None:
    assert pack_hex(DIGEST) == bytes.fromhex(DIGEST)
    assert pack_hex("abc") == "abc" and pack_hex("AB") == "AB" and pack_hex("a b ") == "a b "
    assert pack_hex("") == ""
    assert len(pack_key("3f2c0a8e-5b7d-4e8a-9c1f-2d6b8a4e7f10")) == 16


def test_a_completion_keeps_its_time_once(tmp_path: Path, clock: Clock) -> None:
    store = SQLiteStore(f"sqlite:///{tmp_path}/c.db")
    engine = Engine(store, clock=clock)
    claim = engine.begin("k", operation="op", fingerprint="fp")
    assert isinstance(claim, Claim)
    clock.advance(1.5)
    engine.complete(claim, Outcome.json({"ok": True}))
    got = store.get(claim.key_hash)
    assert got is not None and got.completed_at == got.updated_at == clock.now
    assert store._run(
        lambda conn: conn.execute("SELECT completed_at, status FROM retrysafe_records").fetchone()
    ) == (None, 1)
    store.close()


# -- from schema v2 ------------------------------------------------------------------


def make_sqlite_v2(path: Path, records: list[Record], archived: list[Record]) -> None:
    """A database file exactly as schema v2 made it, holding ``records`` and ``archived``."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    for version in (1, 2):
        migration = sqlite.MIGRATIONS[version]
        assert isinstance(migration, str)
        for statement in migration.split(";"):
            if statement.strip():
                conn.execute(statement)
    conn.execute("PRAGMA user_version=2")
    conn.executemany(
        f"INSERT INTO retrysafe_records ({', '.join(COLUMNS)}) "
        f"VALUES ({', '.join('?' * len(COLUMNS))})",
        [record_params(r) for r in records],
    )
    conn.executemany(
        f"INSERT INTO retrysafe_archive ({', '.join(ARCHIVE_COLUMNS)}) "
        f"VALUES ({', '.join('?' * len(ARCHIVE_COLUMNS))})",
        [(*record_params(r), 42.0) for r in archived],
    )
    conn.close()


def test_a_v2_file_is_rewritten_compact(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "v2.db"
    live = [
        dataclasses.replace(
            r,
            key_hash=key_hash(r.scope, r.operation, f"k{i}"),
            expires_at=clock.now + HOUR,
            created_at=clock.now,
            updated_at=clock.now,
            lease_until=clock.now - 1,
            completed_at=clock.now if r.status is Status.COMPLETED else r.completed_at,
        )
        for i, r in enumerate(EDGES[:8])
    ]
    archived = [dataclasses.replace(r, token=f"t{i}") for i, r in enumerate(EDGES[:3])]
    make_sqlite_v2(path, live, archived)

    store = SQLiteStore(f"sqlite:///{path}")
    try:
        assert store.migrate() == sqlite.SCHEMA_VERSION == 4
        for record in live:
            assert store.get(record.key_hash) == record
        got = sorted((a.record for a in store.archived_records(limit=10)), key=lambda r: r.token)
        assert got == archived
        assert {a.archived_at for a in store.archived_records(limit=10)} == {42.0}
        # Old rows answer claims: a completed one stands, a lapsed lease is taken over.
        done, running = live[0], live[1]
        assert store.claim(dataclasses.replace(done, token="new")).record == done
        assert running.status is Status.PROCESSING and running.lease_until < clock.now
        taken = store.claim(dataclasses.replace(running, token="new", updated_at=clock.now))
        assert taken.claimed and taken.took_over is Status.PROCESSING
        running = dataclasses.replace(running, token="new", attempts=2)
        live[1] = running
        assert store.get(running.key_hash) == running
        assert store.complete(running.key_hash, "new", Outcome(b"ok"), clock.now)
        stats = store.stats(clock.now)
        assert sum(stats.counts.values()) == len(live) and stats.archived == len(archived)
        assert stats.by_status() == {"processing": 1, "completed": 5, "failed": 2}
        assert stats.oldest_processing is not None
        assert stats.oldest_processing.status is Status.PROCESSING
        clock.advance(2 * HOUR)
        batch = store.sweep(clock.now, 100)
        assert (batch.deleted, batch.archived) == (len(live), 0)
    finally:
        store.close()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 4
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        assert {
            "retrysafe_records",
            "retrysafe_records_key",
            "retrysafe_records_expires_at",
            "retrysafe_archive",
            "retrysafe_archive_archived_at",
        } <= tables
        assert not any(name.endswith("_v3") for name in tables)
    finally:
        conn.close()


def v3_params(r: Record) -> tuple[Any, ...]:
    """A record's row as schema v3 wrote it: even-length hex tokens packed, odd ones as
    text, headers joined by NUL without marks."""
    params = list(row_params(r))
    kind, colon, digits = r.scope.partition(":")
    packed = pack_hex(digits)
    if colon and kind.isascii() and type(packed) is bytearray:
        params[2] = bytearray(kind, "ascii") + b":" + packed
    params[6] = pack_hex(r.token)
    if r.outcome is not None and r.outcome.headers:
        parts = [x for pair in r.outcome.headers for x in pair]
        plain = not any("\0" in x for x in parts) and not parts[0].startswith("[")
        params[16] = "\0".join(parts) if plain else r.outcome.headers_json()
    return tuple(params)


def test_a_v3_file_is_rewritten(tmp_path: Path, clock: Clock) -> None:
    """Tokens of every length and headers that v4 marks (or that look like its marks)
    read back as v3 wrote them, in the records and the archive."""
    path = tmp_path / "v3.db"
    make_sqlite_v2(path, [], [])
    conn = sqlite3.connect(path, isolation_level=None)
    migration = sqlite.MIGRATIONS[3]
    assert callable(migration)
    migration(conn, 2)
    conn.execute("PRAGMA user_version=3")
    live = [
        dataclasses.replace(r, key_hash=key_hash(r.scope, r.operation, f"k{i}"))
        for i, r in enumerate(EDGES)
    ]
    archived = [dataclasses.replace(r, key_hash=f"{i:064x}") for i, r in enumerate(EDGES)]
    marks = ", ".join("?" * len(ARCHIVE_COLUMNS))
    conn.executemany(
        f"INSERT INTO retrysafe_records ({', '.join(COLUMNS)}) VALUES ({marks[3:]})",
        [v3_params(r) for r in live],
    )
    conn.executemany(
        f"INSERT INTO retrysafe_archive ({', '.join(ARCHIVE_COLUMNS)}) VALUES ({marks})",
        [(*v3_params(r), 42.0) for r in archived],
    )
    conn.close()

    store = SQLiteStore(f"sqlite:///{path}")
    try:
        assert store.migrate() == sqlite.SCHEMA_VERSION == 4
        for record in live:
            assert store.get(record.key_hash) == record
        got = store.archived_records(limit=len(EDGES) + 1)
        assert sorted((a.record for a in got), key=lambda r: r.key_hash) == archived
        # A migrated processing record is finished by its token.
        running = next(r for r in live if r.status is Status.PROCESSING)
        assert store.complete(running.key_hash, running.token, Outcome(b"ok"), clock.now)
    finally:
        store.close()
    conn = sqlite3.connect(path)
    try:
        indexes = {row[1] for row in conn.execute("PRAGMA index_list(retrysafe_records)")}
        assert indexes == {"retrysafe_records_key", "retrysafe_records_expires_at"}
        triggers = "SELECT name FROM sqlite_master WHERE type = 'trigger'"
        assert conn.execute(triggers).fetchall() == [("retrysafe_records_one_per_key",)]
        # A rowid table: no primary key of its own.
        assert not any(row[5] for row in conn.execute("PRAGMA table_info(retrysafe_records)"))
    finally:
        conn.close()


OUTCOMES = [r.outcome for r in EDGES if r.outcome is not None]


@pytest.mark.parametrize("final", [False, True])
def test_finishes_write_every_outcome_shape(tmp_path: Path, final: bool) -> None:
    """A completion or failure binds only the outcome's values other than NULL: each
    shape (no status, no headers, no media type, …) still reads back whole."""
    store = SQLiteStore(f"sqlite:///{tmp_path}/f.db")
    try:
        for i, outcome in enumerate([*OUTCOMES, None]):
            running = base(
                key_hash=f"a{i:063x}",
                status=Status.PROCESSING,
                completed_at=None,
                outcome=None,
                request_id="req" if i % 2 else None,
            )
            assert store.claim(running).claimed
            assert store.get(running.key_hash) == running
            now = running.updated_at + 1
            if outcome is not None:
                assert store.complete(running.key_hash, running.token, outcome, now)
                done = dataclasses.replace(
                    running,
                    status=Status.COMPLETED,
                    outcome=outcome,
                    updated_at=now,
                    completed_at=now,
                )
                assert not store.complete(running.key_hash, running.token, outcome, now)
            else:
                done = dataclasses.replace(running, status=Status.FAILED, updated_at=now)
            failed = f"b{i:063x}"
            assert store.claim(dataclasses.replace(running, key_hash=failed)).claimed
            assert store.fail(failed, running.token, outcome, final, now)
            assert store.get(failed) == dataclasses.replace(
                running,
                key_hash=failed,
                status=Status.FAILED,
                outcome=outcome,
                final=final,
                updated_at=now,
            )
            if outcome is None:
                continue
            assert store.get(running.key_hash) == done
    finally:
        store.close()


# -- v4: the rowid table and its key index ---------------------------------------------


def test_key_hashes_sharing_their_first_bytes_stay_apart(tmp_path: Path) -> None:
    """The key index holds 8 bytes of the hash: keys equal there (and texts equal in
    their first 8 characters) are told apart by the whole hash in every statement."""
    store = SQLiteStore(f"sqlite:///{tmp_path}/p.db")
    running = base(status=Status.PROCESSING, completed_at=None, outcome=None)
    try:
        for hashes in (("aa" * 32, "aa" * 8 + "bb" * 24), ("same-start-1", "same-start-2")):
            one, two = (dataclasses.replace(running, key_hash=h) for h in hashes)
            assert store.claim(one).claimed and store.claim(two).claimed
            assert store.claim(one).record == one and store.claim(two).record == two
            assert store.renew(one.key_hash, one.token, one.lease_until + 1, one.updated_at)
            assert store.complete(two.key_hash, two.token, Outcome(b"2"), two.updated_at)
            got_one, got_two = store.get(one.key_hash), store.get(two.key_hash)
            assert got_one is not None and got_one.status is Status.PROCESSING
            assert got_one.lease_until == one.lease_until + 1
            assert got_two is not None and got_two.outcome == Outcome(b"2")
            assert store.delete(one.key_hash)
            assert store.get(one.key_hash) is None and store.get(two.key_hash) == got_two
    finally:
        store.close()


def test_the_claims_insert_never_adds_a_second_row(tmp_path: Path) -> None:
    """Without a unique index, a trigger drops an INSERT of a key already there: the
    claim's, or any other connection's."""
    store = SQLiteStore(f"sqlite:///{tmp_path}/u.db")
    record = base(status=Status.PROCESSING, completed_at=None, outcome=None)
    insert = sqlite._insert(row_params(record))
    count = "SELECT count(*) FROM retrysafe_records"
    try:
        assert store._run(lambda conn: conn.execute(*insert).rowcount) == 1
        assert store._run(lambda conn: conn.execute(*insert).rowcount) == 0
        other = dataclasses.replace(record, token="abc", fingerprint="cd" * 32)
        assert not store.claim(other).claimed
        assert store._run(lambda conn: conn.execute(count).fetchone()) == (1,)
        assert store.get(record.key_hash) == record
    finally:
        store.close()
    conn = sqlite3.connect(tmp_path / "u.db", isolation_level=None)
    try:
        marks = ", ".join("?" * len(COLUMNS))
        plain = f"INSERT INTO retrysafe_records ({', '.join(COLUMNS)}) VALUES ({marks})"
        assert conn.execute(plain, row_params(record)).rowcount == 0
        assert conn.execute(count).fetchone() == (1,)
    finally:
        conn.close()
