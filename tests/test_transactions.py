"""Transactional completion: business writes and the record's completion commit together.

The order-once pattern of the agentic-commerce idempotency map on SQLite and PostgreSQL (plain and
partitioned): a unique constraint on ``cart_mandate_id`` plus the key
``order:{cartMandateId}:{userId}``, the order row and the completed record
written in one transaction. Crashes are real (SIGKILL of a worker process).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import sqlite3
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
from _racing import race_processes
from conftest import Clock, StoreSpec, make_spec

from retrysafe import (
    Engine,
    IdempotencyMap,
    InProgressError,
    LeaseLostError,
    Outcome,
    Store,
    StoreUnavailableError,
)
from retrysafe._model.hashing import key_hash
from retrysafe._model.record import Status

SQL_STORES = ["sqlite", "postgres", "postgres-partitioned"]
IMAP = IdempotencyMap.default()


@pytest.fixture(params=SQL_STORES)
def sql_spec(request: pytest.FixtureRequest, tmp_path: Path) -> StoreSpec:
    return make_spec(request.param, request, tmp_path)


class Orders:
    """The application's orders table, next to the store's records (same file or database)."""

    def __init__(self, spec: StoreSpec, table: str) -> None:
        self.spec, self.table = spec, table
        self.sqlite = spec.name == "sqlite"
        self.mark = "?" if self.sqlite else "%s"

    def connect(self) -> Any:
        if self.sqlite:
            return sqlite3.connect(self.spec.url.split("///", 1)[1].split("?")[0], timeout=30)
        return psycopg.connect(self.spec.url, autocommit=True)

    def create_table(self) -> None:
        with self.connect() as conn:
            conn.execute(
                f"CREATE TABLE {self.table} (cart_mandate_id TEXT PRIMARY KEY, "
                "user_id TEXT NOT NULL, amount INTEGER NOT NULL)"
            )
            conn.commit()

    def rows(self) -> list[tuple[Any, ...]]:
        conn = self.connect()
        try:
            return list(conn.execute(f"SELECT * FROM {self.table} ORDER BY 1").fetchall())
        finally:
            conn.close()

    def insert(self, conn: Any, mandate: str, user: str, amount: int) -> None:
        m = self.mark
        conn.execute(f"INSERT INTO {self.table} VALUES ({m}, {m}, {m})", (mandate, user, amount))

    def insert_once(self, conn: Any, mandate: str, user: str, amount: int) -> bool:
        """Insert unless the mandate has its order (the unique constraint decides, atomically)."""
        m = self.mark
        sql = f"INSERT INTO {self.table} VALUES ({m}, {m}, {m}) ON CONFLICT DO NOTHING"
        return conn.execute(sql, (mandate, user, amount)).rowcount == 1

    def find(self, conn: Any, mandate: str) -> tuple[Any, ...] | None:
        m = self.mark
        sql = (
            f"SELECT cart_mandate_id, user_id, amount FROM {self.table} WHERE cart_mandate_id = {m}"
        )
        return conn.execute(sql, (mandate,)).fetchone()


def create_order(
    engine: Engine,
    orders: Orders,
    mandate: str,
    user: str,
    amount: int,
    *,
    crash: str = "",
    connection: Any = None,
    lease: float | None = None,
) -> dict[str, Any]:
    """Order creation: once per cart mandate, the record committed with the row."""
    key = IMAP.key("order", cart_mandate_id=mandate, user_id=user)
    with engine.attempt(
        key, operation="order", scope=user, fingerprint=str(amount), lease=lease
    ) as att:
        if att.replay is not None:
            return att.replay.outcome.value  # type: ignore[union-attr,no-any-return]
        with att.transaction(connection) as conn:
            if orders.insert_once(conn, mandate, user, amount):
                order = {"cart_mandate_id": mandate, "user_id": user, "amount": amount}
            else:  # the mandate has its order: this user's (an expired record) or another's
                existing = orders.find(conn, mandate)
                if existing is None or existing[1] != user:
                    raise ValueError("this cart mandate belongs to another user's order")
                order = {"cart_mandate_id": mandate, "user_id": user, "amount": existing[2]}
            if crash == "before_commit":
                os.kill(os.getpid(), signal.SIGKILL)
            att.outcome = Outcome.json(order)
        if crash == "after_commit":
            os.kill(os.getpid(), signal.SIGKILL)
        return order


def _record(store: Store[Any], mandate: str, user: str) -> Any:
    return store.get(
        key_hash(user, "order", IMAP.key("order", cart_mandate_id=mandate, user_id=user))
    )


@pytest.fixture
def orders(sql_spec: StoreSpec) -> Orders:
    o = Orders(sql_spec, f"orders_{uuid.uuid4().hex[:10]}")
    o.create_table()
    return o


@pytest.fixture
def sql_store(sql_spec: StoreSpec) -> Any:
    s = sql_spec.open()
    yield s
    s.close()


def test_row_and_record_commit_together_and_replay(sql_store: Store[Any], orders: Orders) -> None:
    engine = Engine(sql_store)
    first = create_order(engine, orders, "mandate_1", "user_1", 2999)
    assert first == {"cart_mandate_id": "mandate_1", "user_id": "user_1", "amount": 2999}
    assert orders.rows() == [("mandate_1", "user_1", 2999)]
    record = _record(sql_store, "mandate_1", "user_1")
    assert record.status is Status.COMPLETED and record.outcome.value == first
    assert create_order(engine, orders, "mandate_1", "user_1", 2999) == first  # a replay
    assert orders.rows() == [("mandate_1", "user_1", 2999)]


def test_an_error_after_the_write_rolls_both_back(sql_store: Store[Any], orders: Orders) -> None:
    engine = Engine(sql_store)
    key = IMAP.key("order", cart_mandate_id="m", user_id="u")
    with (
        pytest.raises(ZeroDivisionError),
        engine.attempt(key, operation="order", scope="u", fingerprint="1") as att,
        att.transaction() as conn,
    ):
        orders.insert(conn, "m", "u", 1)
        _ = 1 / 0
    assert orders.rows() == []
    record = _record(sql_store, "m", "u")
    assert record.status is Status.FAILED and not record.final  # retryable
    assert create_order(engine, orders, "m", "u", 1)["amount"] == 1
    assert orders.rows() == [("m", "u", 1)]


def test_leaving_without_an_outcome_rolls_back(sql_store: Store[Any], orders: Orders) -> None:
    engine = Engine(sql_store)
    with (
        pytest.raises(RuntimeError, match="outcome"),
        engine.attempt("k-1", operation="order") as att,
        att.transaction() as conn,
    ):
        orders.insert(conn, "m", "u", 1)
    assert orders.rows() == []
    assert sql_store.get(key_hash("", "order", "k-1")).status is Status.FAILED


def test_an_outcome_too_large_rolls_back_and_fails_finally(
    sql_store: Store[Any], orders: Orders
) -> None:
    engine = Engine(sql_store, max_body=10)
    with (
        pytest.raises(ValueError, match="max_body"),
        engine.attempt("k-2", operation="order") as att,
        att.transaction() as conn,
    ):
        orders.insert(conn, "m", "u", 1)
        att.outcome = Outcome.json({"much": "x" * 100})
    assert orders.rows() == []
    record = sql_store.get(key_hash("", "order", "k-2"))
    assert record.status is Status.FAILED and record.final


def test_a_lost_lease_rolls_the_business_write_back(
    sql_store: Store[Any], orders: Orders, clock: Clock
) -> None:
    engine = Engine(sql_store, lease=5, clock=clock)
    key = IMAP.key("order", cart_mandate_id="m", user_id="u")
    with (
        pytest.raises(LeaseLostError),
        engine.attempt(key, operation="order", scope="u", fingerprint="1") as att,
    ):
        clock.advance(6)  # the lease ran out: another worker takes the key over
        taker = engine.begin(key, operation="order", scope="u", fingerprint="1")
        assert taker.attempts == 2  # type: ignore[union-attr]
        with att.transaction() as conn:
            orders.insert(conn, "m", "u", 1)
            att.outcome = Outcome.json({"late": True})
    assert orders.rows() == []
    record = _record(sql_store, "m", "u")
    assert record.status is Status.PROCESSING and record.token == taker.token  # type: ignore[union-attr]


def test_the_applications_own_connection(sql_store: Store[Any], orders: Orders) -> None:
    engine = Engine(sql_store)
    conn = orders.connect()
    try:
        order = create_order(engine, orders, "m", "u", 5, connection=conn)
        assert orders.find(conn, "m") == ("m", "u", 5)
        assert order["amount"] == 5
    finally:
        conn.close()
    assert _record(sql_store, "m", "u").status is Status.COMPLETED


def test_a_connection_inside_a_transaction_is_refused(
    sql_store: Store[Any], orders: Orders
) -> None:
    engine = Engine(sql_store)
    conn = orders.connect()
    try:
        if orders.sqlite:
            conn.execute("BEGIN")
        else:
            conn.autocommit = False
            conn.execute("SELECT 1")
        with pytest.raises(ValueError, match="inside a transaction"):
            create_order(engine, orders, "m", "u", 5, connection=conn)
        conn.rollback()
    finally:
        conn.close()
    assert orders.rows() == []


def test_a_sqlite_connection_to_another_file_is_refused(tmp_path: Path) -> None:
    engine = Engine(f"sqlite:///{tmp_path}/records.db")
    other = sqlite3.connect(tmp_path / "other.db")
    with (
        pytest.raises(ValueError, match="store's file"),
        engine.attempt("k", operation="order") as att,
        att.transaction(other),
    ):
        pass
    assert engine.store.get(key_hash("", "order", "k")).status is Status.FAILED
    other.close()


@pytest.mark.parametrize("url", ["memory://", "redis"])
def test_other_stores_are_refused(url: str, request: pytest.FixtureRequest) -> None:
    if url == "redis":
        url = request.getfixturevalue("redis_server").url
    engine = Engine(url)
    key = f"k-{uuid.uuid4().hex}"
    with (
        pytest.raises(TypeError, match="SQLite, PostgreSQL"),
        engine.attempt(key, operation="order") as att,
        att.transaction(),
    ):
        pass
    engine.close()


def test_a_replay_holds_no_claim_to_complete(sql_store: Store[Any], orders: Orders) -> None:
    engine = Engine(sql_store)
    create_order(engine, orders, "m", "u", 1)
    key = IMAP.key("order", cart_mandate_id="m", user_id="u")
    with engine.attempt(key, operation="order", scope="u", fingerprint="1") as att:
        assert att.replay is not None
        with pytest.raises(RuntimeError, match="unsettled claim"), att.transaction():
            pass


def test_the_unique_constraint_stops_another_key_for_the_same_mandate(
    sql_store: Store[Any], orders: Orders
) -> None:
    """Another user (another key) cannot order the same cart mandate: the database refuses."""
    engine = Engine(sql_store)
    create_order(engine, orders, "m", "alice", 7)
    with pytest.raises(ValueError, match="another user"):
        create_order(engine, orders, "m", "mallory", 7)
    # Bypassing the lookup, the constraint itself holds.
    key = IMAP.key("order", cart_mandate_id="m", user_id="eve")
    with (
        pytest.raises((sqlite3.IntegrityError, psycopg.errors.UniqueViolation)),
        engine.attempt(key, operation="order", scope="eve") as att,
        att.transaction() as conn,
    ):
        orders.insert(conn, "m", "eve", 7)
        att.outcome = Outcome.json({})
    assert orders.rows() == [("m", "alice", 7)]
    assert _record(sql_store, "m", "eve").status is Status.FAILED


def test_racing_threads_create_one_order(sql_store: Store[Any], orders: Orders) -> None:
    """32 threads, two users, one mandate: one row; every answer of the winner's key agrees."""
    engine = Engine(sql_store, wait=30)
    barrier = threading.Barrier(32)

    def racer(i: int) -> Any:
        barrier.wait()
        try:
            return create_order(engine, orders, "m", "alice" if i % 4 else "bob", 3)
        except ValueError as exc:
            return str(exc)

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(racer, range(32)))
    rows = orders.rows()
    assert len(rows) == 1
    owner = rows[0][1]
    won = [a for a in answers if isinstance(a, dict)]
    assert won and all(a == {"cart_mandate_id": "m", "user_id": owner, "amount": 3} for a in won)
    lost = [a for a in answers if not isinstance(a, dict)]
    assert all("another user" in a for a in lost)
    assert len(won) == (24 if owner == "alice" else 8)


def _setup_race(store: Store[Any], spec: StoreSpec, table: str) -> Any:
    engine, orders = Engine(store, wait=60), Orders(spec, table)
    return lambda who: create_order(engine, orders, "m", "u", 9)


def test_racing_processes_create_one_order(sql_spec: StoreSpec, orders: Orders) -> None:
    answers = race_processes(sql_spec, _setup_race, sql_spec, orders.table)
    assert len(answers) == 32
    assert all(a == {"cart_mandate_id": "m", "user_id": "u", "amount": 9} for a in answers)
    assert orders.rows() == [("m", "u", 9)]


def _crashing_worker(spec: StoreSpec, table: str, crash: str) -> None:
    store = spec.open()
    create_order(Engine(store), Orders(spec, table), "m", "u", 11, crash=crash, lease=3)


@pytest.mark.parametrize("crash", ["before_commit", "after_commit"])
def test_a_crash_leaves_both_or_neither(sql_spec: StoreSpec, orders: Orders, crash: str) -> None:
    """SIGKILL between the business write and the commit leaves neither; after it, both."""
    worker = mp.get_context("spawn").Process(
        target=_crashing_worker, args=(sql_spec, orders.table, crash)
    )
    worker.start()
    worker.join(timeout=60)
    assert worker.exitcode == -signal.SIGKILL
    store = sql_spec.open()
    record = _record(store, "m", "u")
    if crash == "before_commit":
        assert orders.rows() == []
        assert record.status is Status.PROCESSING  # the claim committed; the transaction did not
        engine = Engine(store)
        with pytest.raises(InProgressError):  # until the dead worker's lease runs out
            create_order(engine, orders, "m", "u", 11)
        retried = create_order(Engine(store, wait=10), orders, "m", "u", 11)
        assert _record(store, "m", "u").attempts == 2
    else:
        assert orders.rows() == [("m", "u", 11)]
        assert record.status is Status.COMPLETED
        retried = create_order(Engine(store), orders, "m", "u", 11)  # a replay: no new row
        assert _record(store, "m", "u").attempts == 1
    assert retried == {"cart_mandate_id": "m", "user_id": "u", "amount": 11}
    assert orders.rows() == [("m", "u", 11)]
    store.close()


def test_async_postgres_transaction(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    spec = make_spec("postgres", request, tmp_path)
    orders = Orders(spec, f"orders_{uuid.uuid4().hex[:10]}")
    orders.create_table()
    store = spec.open()
    engine = Engine(store)

    async def order(connection: Any = None) -> Any:
        async with engine.attempt("k", operation="order", scope="u") as att:
            if att.replay is not None:
                return att.replay.outcome.value  # type: ignore[union-attr]
            async with att.atransaction(connection) as conn:
                await conn.execute(f"INSERT INTO {orders.table} VALUES (%s, %s, %s)", ("m", "u", 4))
                att.outcome = Outcome.json({"order": "m"})
            return {"order": "m"}

    async def failing() -> None:
        async with (
            engine.attempt("k2", operation="order", scope="u") as att,
            att.atransaction() as conn,
        ):
            await conn.execute(f"INSERT INTO {orders.table} VALUES (%s, %s, %s)", ("m2", "u", 4))
            raise KeyError("boom")

    async def main() -> None:
        assert await order() == {"order": "m"}
        assert await order() == {"order": "m"}  # replayed
        with pytest.raises(KeyError):
            await failing()
        own = await psycopg.AsyncConnection.connect(spec.url, autocommit=True)
        async with (
            engine.attempt("k3", operation="order", scope="u") as att,
            att.atransaction(own) as conn,
        ):
            assert conn is own
            att.outcome = Outcome.json(3)
        await own.close()
        await store.aclose()

    asyncio.run(main())
    assert orders.rows() == [("m", "u", 4)]
    assert store.get(key_hash("u", "order", "k")).status is Status.COMPLETED
    assert store.get(key_hash("u", "order", "k2")).status is Status.FAILED
    assert store.get(key_hash("u", "order", "k3")).status is Status.COMPLETED
    store.close()


def test_async_sqlite_transaction_is_refused_with_advice(tmp_path: Path) -> None:
    engine = Engine(f"sqlite:///{tmp_path}/r.db")

    async def main() -> None:
        async with engine.attempt("k", operation="order") as att, att.atransaction():
            pass

    with pytest.raises(TypeError, match="to_thread"):
        asyncio.run(main())


def test_sqlite_store_calls_inside_the_block_join_the_transaction(tmp_path: Path) -> None:
    """A guard written inside the block commits or rolls back with it (and never waits on it)."""
    from retrysafe.guards import SequenceGuard

    store = Engine(f"sqlite:///{tmp_path}/r.db?timeout=2").store
    engine, guard = Engine(store), SequenceGuard(store)
    with engine.attempt("u-1", operation="update") as att, att.transaction():
        guard.accept("s", "cart", 1)
        att.outcome = Outcome.json(1)
    assert guard.last("s", "cart") == 1
    with (
        pytest.raises(KeyError),
        engine.attempt("u-2", operation="update") as att,
        att.transaction(),
    ):
        guard.accept("s", "cart", 2)
        raise KeyError("the business write failed")
    assert guard.last("s", "cart") == 1  # rolled back with the block: a retry of 2 is accepted
    with engine.attempt("u-2", operation="update") as att, att.transaction():
        guard.accept("s", "cart", 2)
        att.outcome = Outcome.json(2)
    assert guard.last("s", "cart") == 2
    with engine.attempt("u-3", operation="update") as att, att.transaction():
        att.outcome = Outcome.json(3)
        with (
            pytest.raises(ValueError, match="already open"),
            engine.attempt("u-4", operation="update") as other,
            other.transaction(),
        ):
            pass
    assert store.get(key_hash("", "update", "u-3")).status is Status.COMPLETED
    store.close()


def test_sqlite_lock_held_elsewhere_is_store_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "r.db"
    engine = Engine(f"sqlite:///{path}?timeout=0.3")
    engine.store.migrate()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another writer keeps the write lock
    mine = sqlite3.connect(path, timeout=0)
    try:
        with pytest.raises(StoreUnavailableError):
            att = engine.attempt("k", operation="order")
            with att, att.transaction(mine):
                pass
        with (  # the store's own connection waits its timeout
            pytest.raises(StoreUnavailableError),
            engine.attempt("k2", operation="o") as att,
            att.transaction(),
        ):
            pass
    finally:
        holder.execute("ROLLBACK")
        holder.close()
        mine.close()
    # The claims themselves could not be written either (the lock was taken): nothing left.
    assert engine.store.get(key_hash("", "o", "k2")) is None


def test_postgres_session_settings_do_not_outlive_the_block(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    spec = make_spec("postgres", request, tmp_path)
    store = spec.open()
    engine = Engine(store)
    for n in range(3):  # more blocks than the pool needs: each gets a clean connection
        with engine.attempt(f"k{n}", operation="o") as att, att.transaction() as conn:
            # Harmless to this transaction (already begun), fatal to the store's
            # later writes on this connection if it went back to the pool unchanged.
            conn.execute("SET default_transaction_read_only = on")
            att.outcome = Outcome.json(n)
    for n in range(3):
        assert store.get(key_hash("", "o", f"k{n}")).status is Status.COMPLETED
        with engine.attempt(f"k{n}", operation="o") as att:
            assert att.replay is not None
    store.close()


def test_postgres_connection_without_the_table_rolls_back(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    spec = make_spec("postgres", request, tmp_path)
    orders = Orders(spec, f"orders_{uuid.uuid4().hex[:10]}")
    orders.create_table()
    store = spec.open()
    engine = Engine(store)
    conn = orders.connect()
    conn.execute("CREATE SCHEMA IF NOT EXISTS elsewhere")
    conn.execute("SET search_path = elsewhere")
    try:
        with (
            pytest.raises(StoreUnavailableError, match="store's database"),
            engine.attempt("k", operation="order") as att,
            att.transaction(conn),
        ):
            conn.execute(f"INSERT INTO public.{orders.table} VALUES ('m', 'u', 1)")
            att.outcome = Outcome.json(1)
    finally:
        conn.close()
    assert orders.rows() == []
    assert store.get(key_hash("", "order", "k")).status is Status.FAILED
    store.close()
