"""Transactional completion on MySQL/MariaDB (InnoDB): the order row and the completed
record commit together, on the store's own connection or the application's.

The order-once pattern of the agentic-commerce idempotency map: the key
``order:{cartMandateId}:{userId}`` plus a unique key on ``cart_mandate_id``, written
with PyMySQL (``att.transaction()``) and asyncmy (``att.atransaction()``). The servers
are real MariaDB processes at REPEATABLE READ (``mysql_server``) and READ COMMITTED
(``mysql_rc_server``); crashes are real SIGKILLs of worker processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import aiomysql
import asyncmy
import asyncmy.errors
import MySQLdb
import pymysql
import pymysql.connections
import pytest
from _racing import race_processes
from _servers import MySQLServer
from conftest import Clock, StoreSpec
from test_transactions import create_order

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
from retrysafe.stores.mysql.transactions import session_restore

IMAP = IdempotencyMap.default()
#: How the application connects: nothing (the store's pooled connection), or a
#: PyMySQL connection of its own with autocommit on or off.
CONNECTIONS = ["store", "autocommit", "manual"]
DUPLICATE_KEY = 1062


def params(url: str, **extra: Any) -> dict[str, Any]:
    parts = urlsplit(url)
    return {
        "host": parts.hostname,
        "port": parts.port,
        "user": parts.username,
        "database": parts.path.lstrip("/"),
        "connect_timeout": 30,
        **extra,
    }


def spec_on(server: MySQLServer, **options: Any) -> StoreSpec:
    table = f"t_{uuid.uuid4().hex[:12]}"
    return StoreSpec("mysql", server.url, {"table": table, "connect_timeout": 30.0, **options})


class Orders:
    """The application's InnoDB orders table, in the store's database."""

    def __init__(self, spec: StoreSpec, table: str) -> None:
        self.spec, self.table = spec, table

    def connect(self, *, autocommit: bool = True) -> pymysql.connections.Connection[Any]:
        return pymysql.connect(**params(self.spec.url, autocommit=autocommit))

    async def aconnect(self, *, autocommit: bool = True) -> Any:
        return await asyncmy.connect(**params(self.spec.url, autocommit=autocommit))

    def create_table(self) -> None:
        self.sql(
            f"CREATE TABLE {self.table} (cart_mandate_id VARCHAR(64) NOT NULL, "
            "user_id VARCHAR(64) NOT NULL, amount INT NOT NULL, "
            "UNIQUE KEY (cart_mandate_id)) ENGINE=InnoDB"
        )

    def sql(self, statement: str, args: Any = None) -> list[tuple[Any, ...]]:
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute(statement, args)
                return list(cur.fetchall())
        finally:
            conn.close()

    def rows(self) -> list[tuple[Any, ...]]:
        return self.sql(f"SELECT cart_mandate_id, user_id, amount FROM {self.table} ORDER BY 1")

    def insert_sql(self) -> str:
        return f"INSERT INTO {self.table} VALUES (%s, %s, %s)"

    def insert_once(self, conn: Any, mandate: str, user: str, amount: int) -> bool:
        """Insert the order; False on a duplicate key (the mandate has its order), which
        rolls back that statement only, not the transaction."""
        with conn.cursor() as cur:
            try:
                cur.execute(self.insert_sql(), (mandate, user, amount))
            except pymysql.IntegrityError as exc:
                if exc.args[0] != DUPLICATE_KEY:
                    raise
                return False
        return True

    def find(self, conn: Any, mandate: str) -> tuple[Any, ...] | None:
        """The mandate's order, (mandate, user, amount), by a locking read."""
        with conn.cursor() as cur:
            cur.execute(self.find_sql(), (mandate,))
            row = cur.fetchone()
        return None if row is None else (mandate, *row)

    def find_sql(self) -> str:
        # A locking read: the latest committed row, whatever the transaction's
        # REPEATABLE READ snapshot holds.
        return (
            f"SELECT user_id, amount FROM {self.table} WHERE cart_mandate_id = %s "
            "LOCK IN SHARE MODE"
        )


def order_of(mandate: str, user: str, existing: tuple[Any, ...] | None) -> dict[str, Any]:
    """The order answer once the insert met the mandate's order: this user's, or refused."""
    if existing is None or existing[0] != user:
        raise ValueError("this cart mandate belongs to another user's order")
    return {"cart_mandate_id": mandate, "user_id": user, "amount": existing[1]}


async def ainsert_once(
    orders: Orders, conn: Any, mandate: str, user: str, amount: int
) -> dict[str, Any]:
    async with conn.cursor() as cur:
        try:
            await cur.execute(orders.insert_sql(), (mandate, user, amount))
        except asyncmy.errors.IntegrityError as exc:
            if exc.args[0] != DUPLICATE_KEY:
                raise
            await cur.execute(orders.find_sql(), (mandate,))
            return order_of(mandate, user, await cur.fetchone())
    return {"cart_mandate_id": mandate, "user_id": user, "amount": amount}


def order_key(mandate: str, user: str) -> str:
    return IMAP.key("order", cart_mandate_id=mandate, user_id=user)


async def acreate_order(
    engine: Engine,
    orders: Orders,
    mandate: str,
    user: str,
    amount: int,
    connection: Any = None,
    *,
    crash: str = "",
    lease: float | None = None,
) -> dict[str, Any]:
    """test_transactions.create_order with asyncmy: the order once per cart mandate."""
    async with engine.attempt(
        order_key(mandate, user),
        operation="order",
        scope=user,
        fingerprint=str(amount),
        lease=lease,
    ) as att:
        if att.replay is not None:
            return att.replay.outcome.value  # type: ignore[union-attr,no-any-return]
        async with att.atransaction(connection) as conn:
            order = await ainsert_once(orders, conn, mandate, user, amount)
            if crash == "before_commit":
                os.kill(os.getpid(), signal.SIGKILL)
            att.outcome = Outcome.json(order)
        if crash == "after_commit":
            os.kill(os.getpid(), signal.SIGKILL)
        return order


def record(store: Store[Any], mandate: str, user: str) -> Any:
    return store.get(key_hash(user, "order", order_key(mandate, user)))


@pytest.fixture
def spec(mysql_server: MySQLServer) -> StoreSpec:
    return spec_on(mysql_server)


def new_orders(spec: StoreSpec) -> Orders:
    o = Orders(spec, f"orders_{uuid.uuid4().hex[:10]}")
    o.create_table()
    return o


@pytest.fixture
def orders(spec: StoreSpec) -> Orders:
    return new_orders(spec)


@pytest.fixture(params=["repeatable-read", "read-committed"])
def isolated(request: pytest.FixtureRequest) -> tuple[str, StoreSpec]:
    """A store on the server whose default isolation is the param."""
    fixture = "mysql_server" if request.param == "repeatable-read" else "mysql_rc_server"
    return request.param, spec_on(request.getfixturevalue(fixture))


@pytest.fixture
def store(spec: StoreSpec) -> Iterator[Store[Any]]:
    s = spec.open()
    yield s
    s.close()


@pytest.fixture(params=CONNECTIONS)
def connection(request: pytest.FixtureRequest, orders: Orders) -> Iterator[Any]:
    """What ``att.transaction()`` is given: None, or the application's connection."""
    if request.param == "store":
        yield None
        return
    conn = orders.connect(autocommit=request.param == "autocommit")
    yield conn
    conn.close()


def test_row_and_record_commit_together_and_replay(
    store: Store[Any], orders: Orders, connection: Any
) -> None:
    engine = Engine(store)
    first = create_order(engine, orders, "mandate_1", "user_1", 2999, connection=connection)
    assert first == {"cart_mandate_id": "mandate_1", "user_id": "user_1", "amount": 2999}
    assert orders.rows() == [("mandate_1", "user_1", 2999)]  # committed: another session sees it
    found = record(store, "mandate_1", "user_1")
    assert found.status is Status.COMPLETED and found.outcome.value == first
    again = create_order(engine, orders, "mandate_1", "user_1", 2999, connection=connection)
    assert again == first  # a replay: the block did not run
    assert orders.rows() == [("mandate_1", "user_1", 2999)]
    assert record(store, "mandate_1", "user_1").attempts == 1


def test_an_error_after_the_write_rolls_both_back(
    store: Store[Any], orders: Orders, connection: Any
) -> None:
    engine = Engine(store)
    with (
        pytest.raises(ZeroDivisionError),
        engine.attempt(order_key("m", "u"), operation="order", scope="u", fingerprint="1") as att,
        att.transaction(connection) as conn,
    ):
        orders.insert_once(conn, "m", "u", 1)
        _ = 1 / 0
    assert orders.rows() == []
    failed = record(store, "m", "u")
    assert failed.status is Status.FAILED and not failed.final  # retryable
    assert create_order(engine, orders, "m", "u", 1, connection=connection)["amount"] == 1
    assert orders.rows() == [("m", "u", 1)]
    assert record(store, "m", "u").attempts == 2


def test_a_stale_worker_gets_lease_lost_and_rolls_back(
    store: Store[Any], orders: Orders, connection: Any, clock: Clock
) -> None:
    engine = Engine(store, lease=5, clock=clock)
    key = order_key("m", "u")
    with (
        pytest.raises(LeaseLostError),
        engine.attempt(key, operation="order", scope="u", fingerprint="1") as att,
    ):
        clock.advance(6)  # the lease ran out: another worker takes the key over
        taker = engine.begin(key, operation="order", scope="u", fingerprint="1")
        assert taker.attempts == 2  # type: ignore[union-attr]
        with att.transaction(connection) as conn:
            orders.insert_once(conn, "m", "u", 1)
            att.outcome = Outcome.json({"late": True})
    assert orders.rows() == []
    now = record(store, "m", "u")
    assert now.status is Status.PROCESSING and now.token == taker.token  # type: ignore[union-attr]
    if connection is not None:  # rolled back: the application's connection is idle again
        with connection.cursor() as cur:
            cur.execute("SELECT @@in_transaction")
            assert cur.fetchone() == (0,)


@pytest.mark.parametrize(
    ("autocommit", "pending"),
    [
        (False, "INSERT INTO {t} VALUES ('mine', 'u', 1)"),
        (True, "BEGIN"),
        (False, "SELECT * FROM {t} WHERE cart_mandate_id = 'mine' FOR UPDATE"),
        (False, "SELECT COUNT(*) FROM {t}"),
    ],
    ids=["pending-insert", "begun", "locking-read", "snapshot-read"],
)
def test_a_connection_inside_a_transaction_is_refused(
    store: Store[Any], orders: Orders, autocommit: bool, pending: str
) -> None:
    """MySQL's BEGIN commits an open transaction silently: refused before any write."""
    engine = Engine(store)
    conn = orders.connect(autocommit=autocommit)
    try:
        with conn.cursor() as cur:
            cur.execute(pending.format(t=orders.table))
            cur.fetchall()
        with pytest.raises(ValueError, match="inside a transaction"):
            create_order(engine, orders, "m", "u", 5, connection=conn)
        with conn.cursor() as cur:  # the application's transaction is still open, untouched
            cur.execute("SELECT @@in_transaction")
            assert cur.fetchone() == (1,)
        conn.rollback()
    finally:
        conn.close()
    assert orders.rows() == []  # the pending insert was never committed
    assert record(store, "m", "u").status is Status.FAILED


def test_a_connection_of_another_driver_is_a_type_error(
    store: Store[Any], orders: Orders, spec: StoreSpec
) -> None:
    engine = Engine(store)
    url = params(spec.url)
    mysqldb = MySQLdb.connect(
        host=url["host"], port=url["port"], user=url["user"], database=url["database"]
    )
    lite = sqlite3.connect(":memory:")

    async def async_connections() -> tuple[Any, Any]:
        aio = await aiomysql.connect(
            host=url["host"], port=url["port"], user=url["user"], db=url["database"]
        )
        amy = await orders.aconnect()
        return aio, amy

    loop = asyncio.new_event_loop()
    aio, amy = loop.run_until_complete(async_connections())
    try:
        for n, (conn, driver) in enumerate(
            [(mysqldb, "Connection"), (lite, "Connection"), (aio, "aiomysql"), (amy, "asyncmy")]
        ):
            with (
                pytest.raises(TypeError, match="PyMySQL") as info,
                engine.attempt(f"k{n}", operation="order") as att,
                att.transaction(conn),
            ):
                raise AssertionError("the block must not run")
            assert driver in str(info.value)
            assert store.get(key_hash("", "order", f"k{n}")).status is Status.FAILED

        async def sync_connection_in_async_block() -> None:
            sync = orders.connect()
            try:
                async with (
                    engine.attempt("async-k", operation="order") as att,
                    att.atransaction(sync),
                ):
                    raise AssertionError("the block must not run")
            finally:
                sync.close()

        with pytest.raises(TypeError, match="asyncmy"):
            loop.run_until_complete(sync_connection_in_async_block())
        loop.run_until_complete(store.aclose())
    finally:
        aio.close()
        amy.close()
        loop.close()
        mysqldb.close()
        lite.close()
    assert orders.rows() == []


def test_the_unique_key_stops_another_key_for_the_same_mandate(
    store: Store[Any], orders: Orders
) -> None:
    engine = Engine(store)
    create_order(engine, orders, "m", "alice", 7)
    with pytest.raises(ValueError, match="another user"):
        create_order(engine, orders, "m", "mallory", 7)
    # Without the lookup, the unique key itself holds.
    with (
        pytest.raises(pymysql.IntegrityError),
        engine.attempt(order_key("m", "eve"), operation="order", scope="eve") as att,
        att.transaction() as conn,
        conn.cursor() as cur,
    ):
        cur.execute(orders.insert_sql(), ("m", "eve", 7))
        att.outcome = Outcome.json({})
    assert orders.rows() == [("m", "alice", 7)]
    assert record(store, "m", "mallory").status is Status.FAILED
    assert record(store, "m", "eve").status is Status.FAILED


# -- races: many threads and several processes on the same mandates -----------------

MANDATES = 4


def racer_args(i: int) -> tuple[str, str]:
    """Racer ``i``'s mandate and user: every mandate gets duplicates of two rival users."""
    return f"m{i % MANDATES}", "bob" if (i // MANDATES) % 4 == 0 else "alice"


def race_once(engine: Engine, orders: Orders, i: int, shift: int = 0) -> Any:
    """Racer ``i`` (its mandate moved by ``shift``): its answer, or its refusal."""
    mandate, user = racer_args(i)
    mandate = f"m{(int(mandate[1:]) + shift) % MANDATES}"
    try:
        return create_order(engine, orders, mandate, user, 3)
    except ValueError as exc:
        return (mandate, user, str(exc))


def check_race(orders: Orders, answers: list[Any]) -> None:
    rows = {m: (u, a) for m, u, a in orders.rows()}
    assert sorted(rows) == [f"m{n}" for n in range(MANDATES)]  # one order per mandate
    won = {a["cart_mandate_id"] for a in answers if isinstance(a, dict)}
    assert won == set(rows)  # each order's creator, and its duplicates, got it back
    assert any(not isinstance(a, dict) for a in answers)  # a rival user was refused
    for answer in answers:
        if isinstance(answer, dict):  # the owner's answer, identical for every duplicate
            owner = rows[answer["cart_mandate_id"]][0]
            assert answer == {
                "cart_mandate_id": answer["cart_mandate_id"],
                "user_id": owner,
                "amount": 3,
            }
        else:  # the rival user: refused by the unique key, no second order
            mandate, user, message = answer
            assert rows[mandate][0] != user and "another user" in message


def test_racing_threads_create_one_order_per_mandate(isolated: tuple[str, StoreSpec]) -> None:
    """At REPEATABLE READ and at READ COMMITTED."""
    orders = new_orders(isolated[1])
    store = isolated[1].open()
    engine = Engine(store, wait=60)
    barrier = threading.Barrier(32)

    def racer(i: int) -> Any:
        barrier.wait()
        return race_once(engine, orders, i)

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(racer, range(32)))
    check_race(orders, answers)
    for n in range(MANDATES):  # the winner's key: one attempt, then replays
        owner = orders.sql(
            f"SELECT user_id FROM {orders.table} WHERE cart_mandate_id = %s", (f"m{n}",)
        )
        assert record(store, f"m{n}", owner[0][0]).attempts == 1
    store.close()


def test_racing_tasks_create_one_order_per_mandate(isolated: tuple[str, StoreSpec]) -> None:
    orders = new_orders(isolated[1])
    store = isolated[1].open()
    engine = Engine(store, wait=60)

    async def racer(i: int, start: asyncio.Event) -> Any:
        await start.wait()
        mandate, user = racer_args(i)
        try:
            return await acreate_order(engine, orders, mandate, user, 3)
        except ValueError as exc:
            return (mandate, user, str(exc))

    async def main() -> list[Any]:
        start = asyncio.Event()
        tasks = [asyncio.create_task(racer(i, start)) for i in range(32)]
        await asyncio.sleep(0)  # every task waits on the event
        start.set()
        answers = await asyncio.gather(*tasks)
        await store.aclose()
        return answers

    check_race(orders, asyncio.run(main()))


def _setup_race(store: Store[Any], spec: StoreSpec, table: str) -> Any:
    engine, orders = Engine(store, wait=60), Orders(spec, table)
    # Each process's 8 racers: every mandate twice, one of them by the rival user (bob),
    # the mandates shifted per process.
    return lambda who: race_once(engine, orders, int(who.rsplit("-", 1)[1]), os.getpid())


def test_racing_processes_create_one_order_per_mandate(isolated: tuple[str, StoreSpec]) -> None:
    spec = isolated[1]
    orders = new_orders(spec)
    answers = race_processes(spec, _setup_race, spec, orders.table)
    assert len(answers) == 32
    check_race(orders, answers)


# -- crashes ---------------------------------------------------------------------------


def _crashing_worker(spec: StoreSpec, table: str, crash: str, mode: str) -> None:
    engine, orders = Engine(spec.open()), Orders(spec, table)
    if mode == "async":
        asyncio.run(acreate_order(engine, orders, "m", "u", 11, crash=crash, lease=30))
    create_order(engine, orders, "m", "u", 11, crash=crash, lease=30)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("crash", ["before_commit", "after_commit"])
def test_a_crash_leaves_both_or_neither(
    spec: StoreSpec, orders: Orders, crash: str, mode: str
) -> None:
    """SIGKILL between the business write and COMMIT leaves neither; after it, both."""
    worker = mp.get_context("spawn").Process(
        target=_crashing_worker, args=(spec, orders.table, crash, mode)
    )
    worker.start()
    worker.join(timeout=60)
    assert worker.exitcode == -signal.SIGKILL
    store = spec.open()
    found = record(store, "m", "u")
    if crash == "before_commit":
        assert orders.rows() == []  # the server rolled the dead session's transaction back
        assert found.status is Status.PROCESSING  # the claim committed on its own
        with pytest.raises(InProgressError):  # while the dead worker's lease runs
            create_order(Engine(store), orders, "m", "u", 11)
        later = Engine(store, clock=lambda: time.time() + 31)  # its lease has run out
        retried = create_order(later, orders, "m", "u", 11)
        assert record(store, "m", "u").attempts == 2
    else:
        assert orders.rows() == [("m", "u", 11)]
        assert found.status is Status.COMPLETED
        retried = create_order(Engine(store), orders, "m", "u", 11)  # a replay: no new row
        assert record(store, "m", "u").attempts == 1
    assert retried == {"cart_mandate_id": "m", "user_id": "u", "amount": 11}
    assert orders.rows() == [("m", "u", 11)]
    store.close()


def test_a_connection_to_another_database_rolls_back(
    store: Store[Any], orders: Orders, spec: StoreSpec
) -> None:
    """The completion's UPDATE names the store's table unqualified: on a connection to
    another database it fails, and the block's write rolls back with it."""
    engine = Engine(store)
    store.migrate()
    here = params(spec.url)["database"]
    conn = pymysql.connect(**{**params(spec.url), "database": "mysql", "autocommit": True})
    try:
        with (
            pytest.raises(StoreUnavailableError, match="store's database"),
            engine.attempt("k", operation="order") as att,
            att.transaction(conn),
            conn.cursor() as cur,
        ):
            cur.execute(f"INSERT INTO `{here}`.{orders.table} VALUES ('m', 'u', 1)")
            att.outcome = Outcome.json(1)
    finally:
        conn.close()
    assert orders.rows() == []
    assert store.get(key_hash("", "order", "k")).status is Status.FAILED


# -- isolation: REPEATABLE READ and READ COMMITTED --------------------------------------


def test_the_compare_and_set_reads_the_latest_row_at_either_isolation(
    isolated: tuple[str, StoreSpec], clock: Clock
) -> None:
    """The block read the record first (a REPEATABLE READ snapshot); the completion's
    UPDATE is a locking read of the latest row, so it lands for its owner and is refused
    to a worker whose key was taken over meanwhile."""
    level, spec = isolated
    orders = new_orders(spec)
    store = spec.open()
    engine = Engine(store, lease=5, clock=clock)
    table = spec.options["table"]
    read = f"SELECT token FROM {table} WHERE key_hash = %s"
    conn = orders.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT @@session.tx_isolation")
            assert cur.fetchone() == (level.upper(),)
        # The owner: its snapshot shows its claim; the completion lands.
        key = order_key("m1", "u")
        with (
            engine.attempt(key, operation="order", scope="u", fingerprint="1") as att,
            att.transaction(conn),
            conn.cursor() as cur,
        ):
            cur.execute(read, (key_hash("u", "order", key),))
            assert cur.fetchone() == (att.claim.token.encode(),)  # type: ignore[union-attr]
            cur.execute(orders.insert_sql(), ("m1", "u", 1))
            att.outcome = Outcome.json(1)
        assert record(store, "m1", "u").status is Status.COMPLETED
        # The stale worker: its snapshot predates the takeover.
        key = order_key("m2", "u")
        with (
            pytest.raises(LeaseLostError),
            engine.attempt(key, operation="order", scope="u", fingerprint="1") as att,
        ):
            mine = att.claim.token.encode()  # type: ignore[union-attr]
            with att.transaction(conn), conn.cursor() as cur:
                cur.execute(read, (key_hash("u", "order", key),))
                assert cur.fetchone() == (mine,)
                clock.advance(6)
                taker = engine.begin(key, operation="order", scope="u", fingerprint="1")
                cur.execute(read, (key_hash("u", "order", key),))
                seen = cur.fetchone()[0]  # type: ignore[index]
                # REPEATABLE READ still shows the snapshot; READ COMMITTED the takeover.
                assert seen == (mine if level == "repeatable-read" else taker.token.encode())  # type: ignore[union-attr]
                cur.execute(orders.insert_sql(), ("m2", "u", 1))
                att.outcome = Outcome.json(2)
        now = record(store, "m2", "u")
        assert now.status is Status.PROCESSING and now.token == taker.token  # type: ignore[union-attr]
    finally:
        conn.close()
    assert orders.rows() == [("m1", "u", 1)]
    store.close()


# -- defects: failures, session state, drivers ---------------------------------------------


def kill(spec: StoreSpec, thread_id: int) -> None:
    admin = pymysql.connect(**params(spec.url, autocommit=True))
    try:
        with admin.cursor() as cur:
            cur.execute("KILL CONNECTION %s", (thread_id,))
    finally:
        admin.close()


def test_a_lost_connection_keeps_the_applications_error(spec: StoreSpec, orders: Orders) -> None:
    """The server dropped the connection inside the block: the rollback cannot be sent,
    the block's own exception is what the caller sees, and the pool stays usable."""
    store = open_one(spec)
    engine = Engine(store)
    with (
        pytest.raises(KeyError, match="business"),
        engine.attempt("k", operation="order") as att,
        att.transaction() as conn,
    ):
        orders.insert_once(conn, "m", "u", 1)
        kill(spec, conn.thread_id())
        raise KeyError("business")
    assert orders.rows() == []
    assert store.get(key_hash("", "order", "k")).status is Status.FAILED
    assert create_order(engine, orders, "m", "u", 1)["amount"] == 1  # the one connection works
    store.close()


class DyingAtCommit(pymysql.connections.Connection):  # type: ignore[type-arg]
    """A PyMySQL connection whose server session is killed just before its COMMIT."""

    spec: StoreSpec

    def commit(self) -> None:
        kill(self.spec, self.thread_id())
        super().commit()

    def query(self, sql: Any, unbuffered: bool = False) -> int:
        if sql == "COMMIT":
            kill(self.spec, self.thread_id())
        return super().query(sql, unbuffered)  # type: ignore[no-any-return]


def test_a_failed_commit_is_unavailable_and_retryable(spec: StoreSpec, orders: Orders) -> None:
    store = spec.open()
    engine = Engine(store)
    DyingAtCommit.spec = spec
    conn = DyingAtCommit(**params(spec.url, autocommit=True))
    with pytest.raises(StoreUnavailableError, match="nothing was committed"):
        create_order(engine, orders, "m", "u", 1, connection=conn)
    conn.close()
    assert orders.rows() == []
    assert record(store, "m", "u").status is Status.FAILED  # retryable
    assert create_order(engine, orders, "m", "u", 1)["amount"] == 1
    store.close()


def open_one(spec: StoreSpec) -> Store[Any]:
    """The store with one pooled connection: every block and call reuses it."""
    return StoreSpec(spec.name, spec.url, {**spec.options, "max_size": 1}).open()


SESSION = (
    "SELECT @@session.autocommit, @@session.sql_mode, @@session.time_zone, "
    "@@session.tx_isolation, @@session.tx_read_only, @@session.innodb_lock_wait_timeout, "
    "@@session.sql_safe_updates, @@session.character_set_client, DATABASE()"
)


def spoiling_block(
    engine: Engine, key: str, statements: list[str], fails: type[Exception] | None
) -> None:
    """A block on the store's pooled connection that runs ``statements`` and sets its
    outcome; with ``fails`` (what the caller sees) KeyError, it raises after them."""
    with (
        pytest.raises(fails) if fails else contextlib.nullcontext(),
        engine.attempt(key, operation="o") as att,
        att.transaction() as conn,
    ):
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
        att.outcome = Outcome.json(key)
        if fails is KeyError:
            raise KeyError("rolled back")


def test_session_settings_do_not_outlive_the_block(
    spec: StoreSpec, orders: Orders, mysql_server: MySQLServer
) -> None:
    """What a block sets for its session (autocommit off, say) is undone before the
    connection goes back to the pool, committed or rolled back."""
    store = open_one(spec)
    engine = Engine(store)
    with (
        engine.attempt("probe", operation="o") as att,
        att.transaction() as conn,
        conn.cursor() as cur,
    ):
        cur.execute(SESSION)
        clean = cur.fetchone()
        att.outcome = Outcome.json(0)
    assert clean is not None and clean[0] == 1 and clean[-1] == "retrysafe"
    spoil = [
        "SET SESSION autocommit = 0, sql_mode = '', time_zone = '+05:00', "
        "tx_isolation = 'READ-UNCOMMITTED', tx_read_only = 1, innodb_lock_wait_timeout = 1, "
        "sql_safe_updates = 1",
        "SET NAMES latin1",
    ]
    for n, fails in enumerate([False, True]):
        if fails:  # (a completion outside the store's database would fail: see below)
            spoil.append("USE mysql")
        spoiling_block(engine, f"k{n}", spoil, KeyError if fails else None)
        with engine.attempt(f"after{n}", operation="o") as att, att.transaction() as conn:
            with conn.cursor() as cur:
                cur.execute(SESSION)
                assert cur.fetchone() == clean
            att.outcome = Outcome.json(n)
    # The store's own calls on that connection commit: another pool sees them.
    other = spec.open()
    for name, status in [
        ("k0", Status.COMPLETED),
        ("k1", Status.FAILED),
        ("after1", Status.COMPLETED),
    ]:
        assert other.get(key_hash("", "o", name)).status is status
    other.close()
    store.close()


# -- async: asyncmy -------------------------------------------------------------------------


def test_async_transactions(spec: StoreSpec, orders: Orders, clock: Clock) -> None:
    """``att.atransaction()`` on the store's pooled asyncmy connection and on the
    application's (autocommit on and off): commit together, replay, roll back on an
    error and on a lost lease, refuse a connection inside a transaction."""
    store = spec.open()
    engine = Engine(store, lease=5, clock=clock)

    async def main() -> None:
        own_on = await orders.aconnect(autocommit=True)
        own_off = await orders.aconnect(autocommit=False)
        for n, conn in enumerate([None, own_on, own_off]):
            m = f"m{n}"
            first = await acreate_order(engine, orders, m, "u", n, conn)
            assert first == {"cart_mandate_id": m, "user_id": "u", "amount": n}
            assert await acreate_order(engine, orders, m, "u", n, conn) == first  # replay
            with pytest.raises(KeyError):
                async with (
                    engine.attempt(f"boom{n}", operation="order") as att,
                    att.atransaction(conn) as tx,
                ):
                    await ainsert_once(orders, tx, f"boom{n}", "u", 1)
                    raise KeyError("after the write")
            key = f"stale{n}"
            with pytest.raises(LeaseLostError):
                async with engine.attempt(key, operation="order") as att:
                    clock.advance(6)
                    taker = await engine.abegin(key, operation="order")
                    async with att.atransaction(conn) as tx:
                        await ainsert_once(orders, tx, f"stale{n}", "u", 1)
                        att.outcome = Outcome.json(1)
            stale = store.get(key_hash("", "order", key))
            assert stale.token == taker.token  # type: ignore[union-attr]
        async with own_off.cursor() as cur:  # committed by a statement: idle again
            await cur.execute(orders.insert_sql(), ("by-sql", "u", 1))
            await cur.execute("COMMIT")  # (asyncmy keeps a stale in-transaction flag)
        assert (await acreate_order(engine, orders, "after-sql", "u", 1, own_off))["amount"] == 1
        async with own_off.cursor() as cur:  # autocommit off, a write pending: refused
            await cur.execute(orders.insert_sql(), ("pending", "u", 1))
        with pytest.raises(ValueError, match="inside a transaction"):
            await acreate_order(engine, orders, "refused", "u", 1, own_off)
        await own_off.rollback()
        own_on.close()
        own_off.close()
        await store.aclose()

    asyncio.run(main())
    assert orders.rows() == [
        ("after-sql", "u", 1),
        ("by-sql", "u", 1),
        ("m0", "u", 0),
        ("m1", "u", 1),
        ("m2", "u", 2),
    ]
    for n in range(3):
        assert store.get(key_hash("", "order", f"boom{n}")).status is Status.FAILED
    assert record(store, "refused", "u").status is Status.FAILED
    store.close()


@pytest.mark.parametrize("during", ["await", "query"])
@pytest.mark.parametrize("own", [True, False], ids=["store-connection", "app-connection"])
def test_a_cancelled_async_block_rolls_back(
    spec: StoreSpec, orders: Orders, own: bool, during: str
) -> None:
    """A task cancelled inside the block (its client went away), between statements or
    with a statement in flight (asyncmy then closes the connection): the write rolls
    back, the CancelledError is what the task ends with, the attempt stays retryable,
    and the store's one pooled connection serves again."""
    store = open_one(spec)
    engine = Engine(store)
    blocker = orders.connect()
    with blocker.cursor() as cur:  # holds the named lock the in-flight statement waits for
        cur.execute("SELECT GET_LOCK('tx-cancel', 0)")
        assert cur.fetchone() == (1,)

    async def main() -> None:
        conn = None if own else await orders.aconnect()
        written, never = asyncio.Event(), asyncio.Event()

        async def handler() -> None:
            key = order_key("m", "u")
            async with (
                engine.attempt(key, operation="order", scope="u", fingerprint="1") as att,
                att.atransaction(conn) as tx,
            ):
                await ainsert_once(orders, tx, "m", "u", 1)
                written.set()
                if during == "await":
                    await never.wait()
                async with tx.cursor() as cur:  # sent; the task waits for its answer
                    await cur.execute("SELECT GET_LOCK('tx-cancel', 60)")

        task = asyncio.create_task(handler())
        await written.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        blocker.close()  # the lock is free: a statement still running on the server ends
        assert orders.rows() == []
        assert record(store, "m", "u").status is Status.FAILED
        if conn is not None and during == "query":
            assert not conn.connected  # asyncmy closed it: its stream was cut mid-answer
            conn = await orders.aconnect()
        answer = await acreate_order(engine, orders, "m", "u", 1, conn)
        assert answer == {"cart_mandate_id": "m", "user_id": "u", "amount": 1}
        if conn is not None:
            conn.close()
        await store.aclose()

    try:
        asyncio.run(main())
    finally:
        if blocker.open:
            blocker.close()
    assert orders.rows() == [("m", "u", 1)]
    assert record(store, "m", "u").attempts == 2
    store.close()


@pytest.mark.parametrize(
    ("server_info", "prefix"),
    [
        ("5.5.5-10.11.19-MariaDB-0+deb12u1", "tx_"),  # MariaDB as the drivers see it
        ("10.6.18-MariaDB", "tx_"),
        ("11.1.2-MariaDB", "transaction_"),  # renamed in 11.1
        ("11.4.3-MariaDB-ubu2404", "transaction_"),
        ("8.0.36", "transaction_"),  # MySQL
        ("8.4.0-commercial", "transaction_"),
    ],
)
def test_the_session_restore_names_the_servers_variables(server_info: str, prefix: str) -> None:
    restore = session_restore(server_info, "utf8mb4", "sh`op")
    assert restore[:3] == ("SET NAMES utf8mb4", "USE `sh``op`", "UNLOCK TABLES")
    assert "SELECT RELEASE_ALL_LOCKS()" in restore[3:-1]
    session = restore[-1]
    limit = "max_statement_time" if "MariaDB" in server_info else "max_execution_time"
    assert f"SESSION {limit} = DEFAULT" in session
    # One SET, last: it changes every variable or none, and turning autocommit back on
    # (which commits) comes after everything that could fail.
    assert session.startswith("SET SESSION sql_mode = 'STRICT_TRANS_TABLES")
    assert f"SESSION {prefix}isolation = DEFAULT" in session
    assert f"SESSION {prefix}read_only = DEFAULT" in session
    assert "SESSION autocommit = 1" in session


def test_a_transactional_completion_sets_the_expiry_from_completion(
    store: Store[Any], clock: Clock
) -> None:
    """``ttl_from="completion"``: the completion's UPDATE in the block moves the record's
    expiry to the completion time plus the TTL, as a plain completion does."""
    engine = Engine(store, clock=clock, ttl=3600, lease=120)
    with engine.attempt("k", operation="order", ttl_from="completion") as att:
        clock.advance(60)
        with att.transaction():
            att.outcome = Outcome.json("done")
    found = store.get(key_hash("", "order", "k"))
    assert found.status is Status.COMPLETED and found.expires_at == clock.now + 3600


# -- a block whose transaction ended inside it ------------------------------------------


def two_rows(orders: Orders) -> str:
    t = f"{orders.table}_r"
    orders.sql(f"CREATE TABLE {t} (id INT PRIMARY KEY, v INT NOT NULL) ENGINE=InnoDB")
    orders.sql(f"INSERT INTO {t} VALUES (1, 0), (2, 0)")
    return t


def heavier_rival(orders: Orders, t: str, locked: threading.Event) -> threading.Thread:
    """A transaction heavier than the block's (200 rows written) that locks row 2, then
    asks for row 1, which the block holds: the block, asking for row 2, closes or meets
    the cycle and is the victim (InnoDB rolls back the lighter transaction, whole)."""

    def run() -> None:
        conn = orders.connect(autocommit=False)
        with conn.cursor() as cur:
            cur.executemany(f"INSERT INTO {t} VALUES (%s, 0)", [(i,) for i in range(100, 300)])
            cur.execute(f"SELECT v FROM {t} WHERE id = 2 FOR UPDATE")
            locked.set()
            cur.execute(f"SELECT v FROM {t} WHERE id = 1 FOR UPDATE")
        conn.commit()
        conn.close()

    rival = threading.Thread(target=run)
    rival.start()
    return rival


@pytest.mark.parametrize("connection", CONNECTIONS, indirect=True)
def test_a_deadlock_in_the_block_refuses_the_completion(
    store: Store[Any], orders: Orders, connection: Any
) -> None:
    """A block that catches its deadlock (1213) and goes on: its whole transaction was
    rolled back, so the completion is refused (nothing committed, retryable), never
    committed on its own without the block's writes."""
    t, locked, caught = two_rows(orders), threading.Event(), []
    with (
        pytest.raises(StoreUnavailableError, match="nothing was committed"),
        Engine(store).attempt("k", operation="order") as att,
        att.transaction(connection) as conn,
    ):
        with conn.cursor() as cur:
            cur.execute(f"UPDATE {t} SET v = 42 WHERE id = 1")  # the business write
            rival = heavier_rival(orders, t, locked)
            assert locked.wait(10)
            try:
                cur.execute(f"SELECT v FROM {t} WHERE id = 2 FOR UPDATE")
            except pymysql.err.OperationalError as exc:
                caught.append(exc.args[0])  # a statement-level "retry on deadlock" helper
        rival.join()
        att.outcome = Outcome.json(42)
    assert caught == [1213]
    assert orders.sql(f"SELECT v FROM {t} WHERE id = 1") == [(0,)]
    assert store.get(key_hash("", "order", "k")).status is Status.FAILED


@pytest.mark.parametrize("connection", CONNECTIONS, indirect=True)
def test_an_implicit_commit_in_the_block_refuses_the_completion(
    store: Store[Any], orders: Orders, connection: Any
) -> None:
    """DDL commits the block's transaction (so does ``LOCK TABLES`` or a ``BEGIN``): the
    completion that follows is refused, not committed by itself."""
    with (
        pytest.raises(StoreUnavailableError, match="nothing was committed"),
        Engine(store).attempt("k", operation="order") as att,
        att.transaction(connection) as conn,
    ):
        with conn.cursor() as cur:
            cur.execute(f"CREATE TABLE {orders.table}_ddl (id INT) ENGINE=InnoDB")
        att.outcome = Outcome.json(1)
    assert store.get(key_hash("", "order", "k")).status is Status.FAILED
    assert create_order(Engine(store), orders, "m", "u", 1, connection=connection)["amount"] == 1


def test_async_a_deadlock_or_an_implicit_commit_refuses_the_completion(
    spec: StoreSpec, orders: Orders
) -> None:
    """``att.atransaction()``: the same refusals, on the store's asyncmy connection and
    on the application's."""
    store = spec.open()
    engine = Engine(store)
    t = two_rows(orders)

    async def deadlocked(att: Any, tx: Any) -> None:
        async with tx.cursor() as cur:
            await cur.execute(f"UPDATE {t} SET v = 42 WHERE id = 1")
            locked = threading.Event()
            rival = heavier_rival(orders, t, locked)
            assert await asyncio.to_thread(locked.wait, 10)
            with pytest.raises(asyncmy.errors.OperationalError, match="1213"):
                await cur.execute(f"SELECT v FROM {t} WHERE id = 2 FOR UPDATE")
        await asyncio.to_thread(rival.join)
        orders.sql(f"DELETE FROM {t} WHERE id >= 100")

    async def ddl(att: Any, tx: Any) -> None:
        async with tx.cursor() as cur:
            await cur.execute(f"CREATE TABLE IF NOT EXISTS {orders.table}_ddl (id INT)")

    async def main() -> None:
        mine = await orders.aconnect(autocommit=False)
        for n, (conn, block) in enumerate(
            [(None, deadlocked), (mine, deadlocked), (None, ddl), (mine, ddl)]
        ):
            with pytest.raises(StoreUnavailableError, match="nothing was committed"):
                async with (
                    engine.attempt(f"k{n}", operation="order") as att,
                    att.atransaction(conn) as tx,
                ):
                    await block(att, tx)
                    att.outcome = Outcome.json(n)
            assert store.get(key_hash("", "order", f"k{n}")).status is Status.FAILED
        mine.close()
        await store.aclose()

    asyncio.run(main())
    assert orders.sql(f"SELECT v FROM {t} WHERE id = 1") == [(0,)]
    store.close()


def test_locks_and_time_limits_do_not_outlive_the_block(spec: StoreSpec, orders: Orders) -> None:
    """``LOCK TABLES``, ``GET_LOCK`` and a statement time limit that a block leaves on a
    pooled connection are undone before it goes back: committed, refused or rolled back."""
    store = open_one(spec)
    engine = Engine(store)
    hold = ["SELECT GET_LOCK('rs_held', 0)", "SET SESSION max_statement_time = 5"]
    tables = [f"LOCK TABLES {orders.table} WRITE", *hold]
    for n, (spoil, fails) in enumerate(
        [(hold, None), (tables, StoreUnavailableError), (tables, KeyError)]
    ):
        spoiling_block(engine, f"k{n}", spoil, KeyError if fails else None)
        assert orders.sql("SELECT IS_USED_LOCK('rs_held')") == [(None,)]
        assert store.get(key_hash("", "o", f"k{n}")) is not None  # no 1100: tables unlocked
        with engine.attempt(f"after{n}", operation="o") as att, att.transaction() as conn:
            with conn.cursor() as cur:
                cur.execute("SELECT @@session.max_statement_time")
                assert cur.fetchone() == (0,)
            att.outcome = Outcome.json(n)
    assert store.get(key_hash("", "o", "k0")).status is Status.COMPLETED
    store.close()
