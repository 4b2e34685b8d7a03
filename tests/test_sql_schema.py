"""Schema v2 of the SQL stores: a real v1 database upgrades in place and old records
read back as standard; the sweep and stats statements, under concurrent claims too."""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from _servers import PostgresServer
from conftest import Clock

from retrysafe import Claim, Engine, Outcome, Status, StoreUnavailableError
from retrysafe._cli.app import main
from retrysafe._model.hashing import key_hash
from retrysafe._model.record import Record
from retrysafe.errors import SchemaVersionError
from retrysafe.stores import postgres, sqlite
from retrysafe.stores._packing import tagged_token
from retrysafe.stores._sql import COLUMNS, record_params
from retrysafe.stores.postgres import PostgresStore
from retrysafe.stores.postgres.rows import V3_ORDER
from retrysafe.stores.sqlite import SQLiteStore

HOUR = 3600.0
V1_COLUMNS = COLUMNS[: COLUMNS.index("retention")]


def v1_record(clock: Clock, i: int) -> Record:
    """A completed record as retrysafe 1.x wrote it (no retention class)."""
    now = clock.now
    return Record(
        key_hash=key_hash("", "order", f"old-{i}"),
        key=f"old-{i}",
        scope="",
        operation="order",
        fingerprint="fp",
        status=Status.COMPLETED,
        token=f"token-{i}",
        lease_until=now + 30,
        expires_at=now + HOUR,
        created_at=now,
        updated_at=now,
        completed_at=now,
        attempts=1,
        request_id=f"req-{i}",
        final=False,
        outcome=Outcome.json({"n": i}, status=201),
        request_payload=None,
        metadata={"user": "u1"},
    )


def v1_params(record: Record) -> tuple[Any, ...]:
    return record_params(record)[: len(V1_COLUMNS)]


def check_upgraded(store: Any, clock: Clock, old: list[Record]) -> None:
    """Old records read back whole, standard; new ones work, financial ones archive."""
    for record in old:
        got = store.get(record.key_hash)
        assert got is not None
        assert got.retention == "standard"
        assert got.outcome is not None and got.outcome.value == {"n": int(got.key[4:])}
        assert got.metadata == {"user": "u1"} and got.token == record.token
    engine = Engine(store, ttl=HOUR, retention="financial", clock=clock)
    claim = engine.begin("new-1", operation="payment", fingerprint="fp")
    assert isinstance(claim, Claim)
    engine.complete(claim, Outcome(b"paid", 200))
    got = store.get(claim.key_hash)
    assert got is not None and got.retention == "financial"
    # An old record is taken over once it expired (the takeover writes a v2 row) and
    # lives on; the others and the financial one are swept.
    clock.advance(2 * HOUR)
    again = Engine(store, ttl=HOUR, clock=clock).begin("old-0", operation="order")
    assert isinstance(again, Claim) and again.key_hash == old[0].key_hash
    batch = store.sweep(clock.now, 100)
    assert (batch.deleted, batch.archived, batch.done) == (len(old), 1, True)
    retaken = store.get(old[0].key_hash)
    assert retaken is not None and retaken.status is Status.PROCESSING
    archived = store.archived_records()
    assert [a.record.key for a in archived] == ["new-1"]
    assert archived[0].record.outcome is not None
    assert archived[0].record.outcome.body == b"paid"
    assert archived[0].archived_at == clock.now
    assert store.stats(clock.now).archived == 1


# -- SQLite ----------------------------------------------------------------------------


def make_sqlite_v1(path: Path, records: list[Record]) -> None:
    """A database file exactly as schema v1 made it, holding ``records``."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    for statement in sqlite.MIGRATIONS[1].split(";"):
        if statement.strip():
            conn.execute(statement)
    conn.execute("PRAGMA user_version=1")
    marks = ", ".join("?" * len(V1_COLUMNS))
    conn.executemany(
        f"INSERT INTO retrysafe_records ({', '.join(V1_COLUMNS)}) VALUES ({marks})",
        [v1_params(r) for r in records],
    )
    conn.close()


def sqlite_columns(path: Path, table: str) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
    finally:
        conn.close()


def test_sqlite_v1_file_upgrades_in_place(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "v1.db"
    old = [v1_record(clock, i) for i in range(3)]
    make_sqlite_v1(path, old)
    assert sqlite_columns(path, "retrysafe_archive") == []

    store = SQLiteStore(f"sqlite:///{path}")
    try:
        assert store.migrate() == sqlite.SCHEMA_VERSION
        check_upgraded(store, clock, old)
    finally:
        store.close()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == sqlite.SCHEMA_VERSION == 4
        indexes = {row[1] for row in conn.execute("PRAGMA index_list(retrysafe_archive)")}
        assert "retrysafe_archive_archived_at" in indexes
    finally:
        conn.close()
    assert sqlite_columns(path, "retrysafe_records") == list(COLUMNS)
    assert sqlite_columns(path, "retrysafe_archive") == [*COLUMNS, "archived_at"]


@pytest.mark.parametrize("version", [1, 2, 3])
def test_an_older_sqlite_file_is_not_rewritten_on_first_use(
    tmp_path: Path, clock: Clock, version: int
) -> None:
    """The upgrade rewrites the tables under any older process still using the file:
    it is `retrysafe migrate`'s, run once those are stopped, never a side effect of
    the first claim. Until then every operation is refused, and nothing is written."""
    path = tmp_path / "old.db"
    make_sqlite_v1(path, [v1_record(clock, 0)])
    conn = sqlite3.connect(path, isolation_level=None)
    for target in range(2, version + 1):
        migration = sqlite.MIGRATIONS[target]
        if callable(migration):
            migration(conn, target - 1)
        else:
            conn.executescript(migration)
        conn.execute(f"PRAGMA user_version={target}")
    conn.close()
    before = path.read_bytes()

    store = SQLiteStore(f"sqlite:///{path}")
    engine = Engine(store, clock=clock)
    try:
        with pytest.raises(SchemaVersionError, match="retrysafe migrate"):
            engine.begin("new-1", operation="payment", fingerprint="fp")
        with pytest.raises(StoreUnavailableError):  # the front doors' 503
            store.get("0" * 64)
        assert path.read_bytes() == before
        assert store.migrate() == sqlite.SCHEMA_VERSION
        assert isinstance(engine.begin("new-1", operation="payment", fingerprint="fp"), Claim)
    finally:
        store.close()


def test_sqlite_migrate_command_upgrades_v1(tmp_path: Path, clock: Clock, capsys: Any) -> None:
    path = tmp_path / "v1.db"
    make_sqlite_v1(path, [v1_record(clock, 0)])
    assert main(["migrate", "--store", f"sqlite:///{path}"]) == 0
    assert f"schema at version {sqlite.SCHEMA_VERSION}" in capsys.readouterr().out
    assert sqlite_columns(path, "retrysafe_records")[-1] == "retention"
    assert main(["migrate", "--store", f"sqlite:///{path}"]) == 0  # current: nothing to do


def test_sqlite_sweep_statements_use_the_indexes(tmp_path: Path) -> None:
    store = SQLiteStore(f"sqlite:///{tmp_path}/plan.db")
    store.migrate()
    conn = sqlite3.connect(tmp_path / "plan.db")
    try:
        for query in (sqlite._SWEEP_ARCHIVE, sqlite._SWEEP_DELETE):
            plan = " | ".join(row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + query, (1, 2)))
            assert "USING INTEGER PRIMARY KEY" in plan, plan
            assert "retrysafe_records_expires_at" in plan, plan
            assert "SCAN" not in plan, plan
    finally:
        conn.close()
        store.close()


def test_sqlite_sweep_waits_for_a_writer_and_then_sees_its_claim(
    tmp_path: Path, clock: Clock
) -> None:
    """A claim that takes over an expired record while a sweep is due keeps it."""
    url = f"sqlite:///{tmp_path}/race.db"
    busy = threading.Event()

    class Waits(SQLiteStore):
        """The real store, telling when a statement found the write lock taken."""

        def _run_when_free(self, op: Any) -> Any:
            busy.set()
            return super()._run_when_free(op)

    store = Waits(url)
    engine = Engine(store, ttl=HOUR, clock=clock)
    first = engine.begin("k", operation="op", fingerprint="fp")
    assert isinstance(first, Claim)
    engine.complete(first, Outcome(b"1"))
    clock.advance(2 * HOUR)
    # Another connection holds the write lock, as a claim's statement does.
    other = sqlite3.connect(tmp_path / "race.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    other.execute(
        "UPDATE retrysafe_records SET expires_at = ?, token = 'new' WHERE key_hash = ?",
        (clock.now + HOUR, bytes.fromhex(first.key_hash)),
    )
    swept: list[Any] = []
    sweeper = threading.Thread(target=lambda: swept.append(store.sweep(clock.now, 10)))
    sweeper.start()
    # Until the sweep has met the lock (after a 0.1 s sleep, a busy machine could commit
    # before the sweep began: it found the record live without ever waiting).
    assert busy.wait(30)
    assert not swept  # the sweep waits for the lock …
    other.execute("COMMIT")
    sweeper.join(10)
    other.close()
    assert swept[0].deleted == 0  # … and then finds the record live
    got = store.get(first.key_hash)
    assert got is not None and got.token == "new"
    store.close()


def test_sqlite_sweep_moves_a_batch_in_short_paced_transactions(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch is several transactions of a few rows, each followed by a gap."""
    store = SQLiteStore(f"sqlite:///{tmp_path}/paced.db?synchronous=normal")
    money = Engine(store, ttl=HOUR, retention="financial", clock=clock)
    for i in range(300):
        claim = money.begin(f"k{i}", operation="payment")
        assert isinstance(claim, Claim)
    transactions: list[int] = []
    sleeps: list[float] = []
    some = store._sweep_some

    def spy(now: float, rows: int, conn: sqlite3.Connection) -> tuple[int, int, float, float]:
        transactions.append(rows)
        return some(now, rows, conn)

    monkeypatch.setattr(store, "_sweep_some", spy)
    monkeypatch.setattr(sqlite.time, "sleep", sleeps.append)
    store._sweep_rows = 16
    batch = store.sweep(clock.now + 2 * HOUR, 250)
    assert (batch.deleted, batch.archived, batch.done) == (250, 250, False)
    assert len(transactions) > 1 and transactions[0] == 16 and sum(transactions) == 250
    assert len(sleeps) == len(transactions) and min(sleeps) >= store.sweep_gap
    last = store.sweep(clock.now + 2 * HOUR, 250)
    assert (last.deleted, last.archived, last.done) == (50, 50, True)
    assert len(store.archived_records(limit=1000)) == 300
    store.close()

    unpaced = SQLiteStore(f"sqlite:///{tmp_path}/paced.db?sweep_gap=0")
    assert unpaced.sweep_gap == 0
    sleeps.clear()
    assert unpaced.sweep(clock.now + 2 * HOUR, 10).deleted == 0 and sleeps == []
    unpaced.close()
    with pytest.raises(ValueError, match="sweep_gap"):
        SQLiteStore(f"sqlite:///{tmp_path}/paced.db?sweep_gap=-1")


# -- PostgreSQL ------------------------------------------------------------------------


@pytest.fixture
def pg_url(postgres_server: PostgresServer) -> str:
    return postgres_server.url


@pytest.fixture
def pg_table() -> str:
    return f"v_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def pg(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        yield conn


def make_postgres_v1(
    url: str, table: str, records: list[Record], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table as schema v1 made it: the store's own migration, stopped at v1."""
    with monkeypatch.context() as patch:
        patch.setattr(postgres.store, "SCHEMA_VERSION", 1)
        store = PostgresStore(url, table=table)
        assert store.migrate() == 1
        store.close()
    with psycopg.connect(url, autocommit=True) as conn:
        cols = psycopg.sql.SQL(", ").join(map(psycopg.sql.Identifier, V1_COLUMNS))
        marks = psycopg.sql.SQL(", ").join(psycopg.sql.Placeholder() for _ in V1_COLUMNS)
        query = psycopg.sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
            psycopg.sql.Identifier(*table.split(".")), cols, marks
        )
        with conn.cursor() as cur:
            cur.executemany(query, [v1_params(r) for r in records])


def pg_columns(conn: psycopg.Connection[Any], table: str) -> list[str]:
    schema, _, name = table.rpartition(".")
    rows = conn.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = %s "
        "AND table_schema = coalesce(nullif(%s, ''), current_schema()) ORDER BY ordinal_position",
        (name, schema),
    ).fetchall()
    return [row[0] for row in rows]


def test_postgres_v1_table_upgrades_in_place(
    pg_url: str,
    pg_table: str,
    pg: psycopg.Connection[Any],
    clock: Clock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    old = [v1_record(clock, i) for i in range(3)]
    make_postgres_v1(pg_url, pg_table, old, monkeypatch)
    assert pg_columns(pg, pg_table) == list(V1_COLUMNS)
    assert pg_columns(pg, f"{pg_table}_archive") == []

    store = PostgresStore(pg_url, table=pg_table)
    try:
        # v3 rewrites the table: never on first use (an old process may still run on
        # it), only when asked for, and nothing is written before.
        for _ in range(2):
            with pytest.raises(SchemaVersionError, match="retrysafe migrate"):
                store.get(old[0].key_hash)
        assert pg_columns(pg, pg_table) == list(V1_COLUMNS)
        assert store.migrate() == postgres.SCHEMA_VERSION
        check_upgraded(store, clock, old)
    finally:
        store.close()
    assert pg_columns(pg, pg_table) == list(V3_ORDER)
    assert pg_columns(pg, f"{pg_table}_archive") == [*V3_ORDER, "archived_at"]
    versions = pg.execute(f"SELECT version FROM {pg_table}_schema ORDER BY version").fetchall()
    assert [v[0] for v in versions] == [1, 2, 3]
    indexes = {
        row[0]
        for row in pg.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = %s", (f"{pg_table}_archive",)
        )
    }
    assert indexes == {f"{pg_table}_archive_pkey", f"{pg_table}_archived_at"}


def test_postgres_without_auto_migrate_needs_the_migrate_command(
    pg_url: str, pg_table: str, clock: Clock, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    old = [v1_record(clock, 0)]
    make_postgres_v1(pg_url, pg_table, old, monkeypatch)
    store = PostgresStore(pg_url, table=pg_table, auto_migrate=False)
    try:
        with pytest.raises(StoreUnavailableError, match="retention"):
            store.get(old[0].key_hash)
        assert main(["migrate", "--store", f"{pg_url}?table={pg_table}"]) == 0
        assert f"schema at version {postgres.SCHEMA_VERSION}" in capsys.readouterr().out
        got = store.get(old[0].key_hash)
        assert got is not None and got.retention == "standard"
    finally:
        store.close()


def test_postgres_archive_lives_beside_a_schema_qualified_table(
    pg_url: str, pg: psycopg.Connection[Any], clock: Clock
) -> None:
    schema = f"s_{uuid.uuid4().hex[:8]}"
    pg.execute(f"CREATE SCHEMA {schema}")
    store = PostgresStore(pg_url, table=f"{schema}.records")
    try:
        engine = Engine(store, ttl=HOUR, retention="financial", clock=clock)
        claim = engine.begin("k", operation="payment")
        assert isinstance(claim, Claim)
        engine.complete(claim, Outcome(b"x"))
        assert store.sweep(clock.now + 2 * HOUR, 10).archived == 1
    finally:
        store.close()
    assert pg.execute(f"SELECT count(*) FROM {schema}.records_archive").fetchone() == (1,)


def test_postgres_sweep_skips_a_row_a_claim_holds_and_keeps_it_once_live(
    pg_url: str, pg_table: str, pg: psycopg.Connection[Any], clock: Clock
) -> None:
    """The sweeper never waits on a claim, and never deletes what the claim made live."""
    store = PostgresStore(pg_url, table=pg_table)
    try:
        engine = Engine(store, ttl=HOUR, retention="financial", clock=clock)
        made = []
        for i in range(3):
            claim = engine.begin(f"k{i}", operation="payment")
            assert isinstance(claim, Claim)
            engine.complete(claim, Outcome(b"x"))
            made.append(claim.key_hash)
        clock.advance(2 * HOUR)
        # A takeover in progress: the row is locked and about to live on.
        with pg.transaction():
            pg.execute(
                f"UPDATE {pg_table} SET expires_at = %s, token = %s WHERE key_hash = %s",
                (clock.now + HOUR, tagged_token("new"), bytes.fromhex(made[0])),
            )
            started = time.monotonic()
            batch = store.sweep(clock.now, 10)
            assert time.monotonic() - started < 5  # skipped, not waited for
            assert (batch.deleted, batch.archived, batch.done) == (2, 2, True)
        assert store.sweep(clock.now, 10).deleted == 0  # committed: live now
        got = store.get(made[0])
        assert got is not None and got.token == "new"
    finally:
        store.close()


def test_postgres_sweep_statement_uses_the_indexes(
    pg_url: str, pg_table: str, pg: psycopg.Connection[Any]
) -> None:
    """One batch reads the expires_at index and deletes through the primary key: no
    scan of the table (``IN (subquery)`` made the planner hash-join a full scan)."""
    store = PostgresStore(pg_url, table=pg_table)
    try:
        store.migrate()
        pg.execute(
            f"INSERT INTO {pg_table} (key_hash, key, scope, operation, fingerprint, status, "
            "token, lease_until, expires_at, created_at, updated_at, attempts, final, metadata) "
            "SELECT sha256(i::text::bytea), 'k', '', 'op', 'fp', 1, convert_to('t' || i, 'UTF8'), "
            "0, i % 100, 0, 0, 1, false, NULL FROM generate_series(1, 20000) AS i"
        )
        pg.execute(f"ANALYZE {pg_table}")
        rows = pg.execute("EXPLAIN " + store._q_sweep, (50.0, 100, 50.0, 50.0)).fetchall()
        plan = "\n".join(row[0] for row in rows)
        assert f"{pg_table}_expires_at" in plan and f"{pg_table}_pkey" in plan, plan
        assert "LockRows" in plan and f"Seq Scan on {pg_table}" not in plan, plan
        batch = store.sweep(50.0, 100)
        assert (batch.deleted, batch.archived, batch.done) == (100, 0, False)
    finally:
        store.close()


# -- both ------------------------------------------------------------------------------


@pytest.mark.parametrize("store_spec", ["memory", "sqlite", "postgres"], indirect=True)
def test_stats_name_the_oldest_live_processing_record(store_spec: Any, clock: Clock) -> None:
    """Across operations and statuses, whatever order the groups come in."""
    store = store_spec.open()
    try:
        short = Engine(store, ttl=HOUR, clock=clock)
        long = Engine(store, ttl=100 * HOUR, clock=clock)
        expiring = short.begin("expiring", operation="b")  # oldest, but expires first
        clock.advance(10)
        done = long.begin("done", operation="a")
        assert isinstance(done, Claim)
        long.complete(done, Outcome(b""))
        clock.advance(10)
        oldest = long.begin("oldest", operation="c")
        clock.advance(10)
        for i, operation in enumerate("abcab"):
            long.begin(f"later-{i}", operation=operation)
            clock.advance(1)
        assert isinstance(expiring, Claim) and isinstance(oldest, Claim)
        stats = store.stats(clock.now)
        assert stats.oldest_processing is not None
        assert stats.oldest_processing.key == "expiring"
        later = store.stats(clock.now + HOUR)
        assert later.oldest_processing is not None
        assert later.oldest_processing.key == "oldest"
        assert later.expired == 1 and later.by_status()["processing"] == 6
        assert later.counts[("a", "completed")] == 1
    finally:
        store.close()
