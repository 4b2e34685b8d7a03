"""The SQLAlchemy stores: records in the application's database, the completion in its
ORM transaction (sync Session and AsyncSession), on SQLite files and real PostgreSQL.

The order-once pattern of the agentic-commerce idempotency map: an ORM model with a
unique ``cart_mandate_id``, the key ``order:{cartMandateId}:{userId}``, the order row
and the completed record committed by one ``session.commit()``. Crashes are real
(SIGKILL of a worker process).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy
from _racing import race_processes
from conftest import Clock, StoreSpec, make_spec
from sqlalchemy import Integer, String, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from retrysafe import (
    Engine,
    IdempotencyMap,
    InProgressError,
    LeaseLostError,
    Outcome,
    Store,
    StoreUnavailableError,
    open_store,
)
from retrysafe._model.hashing import key_hash
from retrysafe._model.record import Status
from retrysafe.sqlalchemy import SQLAlchemyStore, acreate_tables, create_tables

IMAP = IdempotencyMap.default()
DATABASES = ["sqlite", "postgres", "mysql"]


def order_model(table: str) -> Any:
    """The application's Order model (a registry of its own: each test has its table)."""

    class Base(DeclarativeBase):
        pass

    class Order(Base):
        __tablename__ = table
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
        cart_mandate_id: Mapped[str] = mapped_column(String(64), unique=True)
        user_id: Mapped[str] = mapped_column(String(64))
        amount: Mapped[int] = mapped_column(Integer)

    return Order


@dataclass
class Db:
    """One test's database: its SQLAlchemy URLs, the native store URL, the orders table."""

    spec: StoreSpec  # the sync SQLAlchemy store's spec (picklable: worker processes)
    async_url: str
    native_url: str
    orders: str

    @property
    def sqlite(self) -> bool:
        return self.spec.name == "sqlalchemy-sqlite"

    def engine(self) -> sqlalchemy.Engine:
        return sqlalchemy.create_engine(self.spec.url, **self.spec.engine_options)

    def store(self, engine: Any) -> Any:
        return SQLAlchemyStore(engine, **self.spec.options)

    def model(self) -> Any:
        return order_model(self.orders)

    def rows(self) -> list[tuple[Any, ...]]:
        engine = self.engine()
        try:
            with engine.connect() as conn:
                query = f"SELECT cart_mandate_id, user_id, amount FROM {self.orders} ORDER BY 1"
                return [tuple(r) for r in conn.exec_driver_sql(query)]
        finally:
            engine.dispose()


@pytest.fixture(params=DATABASES)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Db:
    spec = make_spec(f"sqlalchemy-{request.param}", request, tmp_path)
    if request.param == "sqlite":
        path = spec.url.split("///", 1)[1]
        async_url, native = f"sqlite+aiosqlite:///{path}", f"sqlite:///{path}"
    else:  # (PostgreSQL: psycopg for both; MySQL: PyMySQL, asyncmy)
        async_url = spec.url.replace("+pymysql", "+asyncmy", 1)
        native = spec.url.replace("+psycopg", "", 1).replace("+pymysql", "", 1)
        native += f"?table={spec.options['table']}"
    d = Db(spec, async_url, native, f"orders_{uuid.uuid4().hex[:10]}")
    engine = d.engine()
    d.model().metadata.create_all(engine)
    engine.dispose()
    return d


def _attempt(engine: Engine, mandate: str, user: str, amount: int, lease: float | None) -> Any:
    """The attempt of an order (sync or async: ``with`` or ``async with``)."""
    key = IMAP.key("order", cart_mandate_id=mandate, user_id=user)
    return engine.attempt(key, operation="order", scope=user, fingerprint=str(amount), lease=lease)


def _place(Order: Any, found: Any, mandate: str, user: str, amount: int) -> tuple[Any, Any]:
    """(the row to add, or None if the mandate has this user's order; the answer).
    The mandate holding another user's order is ValueError."""
    if found is not None and found.user_id != user:
        raise ValueError("this cart mandate belongs to another user's order")
    row = None if found else Order(cart_mandate_id=mandate, user_id=user, amount=amount)
    return row, {"cart_mandate_id": mandate, "user_id": user, "amount": amount}


def _crash(crash: str, point: str) -> None:
    if crash == point:
        os.kill(os.getpid(), signal.SIGKILL)


def create_order(
    engine: Engine,
    Order: Any,  # the model class
    mandate: str,
    user: str,
    amount: int,
    *,
    crash: str = "",
    lease: float | None = None,
) -> dict[str, Any]:
    """Order creation: once per cart mandate, the record committed with the ORM row."""
    with _attempt(engine, mandate, user, amount, lease) as att:
        if att.replay is not None:
            return att.replay.outcome.value  # type: ignore[no-any-return]
        with Session(engine.store.engine) as session, att.transaction(session):  # type: ignore[attr-defined]
            found = session.scalar(select(Order).where(Order.cart_mandate_id == mandate))
            row, order = _place(Order, found, mandate, user, amount)
            if row is not None:
                session.add(row)
                session.flush()
            _crash(crash, "before_commit")
            att.outcome = Outcome.json(order)
        _crash(crash, "after_commit")
        return order  # type: ignore[no-any-return]


async def acreate_order(
    engine: Engine,
    Order: Any,
    mandate: str,
    user: str,
    amount: int,
    *,
    crash: str = "",
    lease: float | None = None,
) -> dict[str, Any]:
    """:func:`create_order` with an AsyncSession."""
    async with _attempt(engine, mandate, user, amount, lease) as att:
        if att.replay is not None:
            return att.replay.outcome.value  # type: ignore[no-any-return]
        async with AsyncSession(engine.store.engine) as session, att.atransaction(session):  # type: ignore[attr-defined]
            found = await session.scalar(select(Order).where(Order.cart_mandate_id == mandate))
            row, order = _place(Order, found, mandate, user, amount)
            if row is not None:
                session.add(row)
                await session.flush()
            _crash(crash, "before_commit")
            att.outcome = Outcome.json(order)
        _crash(crash, "after_commit")
        return order  # type: ignore[no-any-return]


def run_async_engine(db: Db, main: Any) -> Any:
    """``asyncio.run(main(engine, Order))`` with an Engine on an AsyncEngine store of ``db``."""

    async def run() -> Any:
        aengine = create_async_engine(db.async_url)
        store = SQLAlchemyStore(aengine, **db.spec.options)
        try:
            return await main(Engine(store), db.model())
        finally:
            await store.aclose()
            await aengine.dispose()

    return asyncio.run(run())


def _record(store: Store[Any], mandate: str, user: str) -> Any:
    return store.get(
        key_hash(user, "order", IMAP.key("order", cart_mandate_id=mandate, user_id=user))
    )


@pytest.fixture
def sync_store(db: Db) -> Any:
    engine = db.engine()
    store = db.store(engine)
    if db.spec.name == "sqlalchemy-mysql":  # InnoDB: no table newer than a snapshot (1412)
        store.migrate()
    yield store
    store.close()
    engine.dispose()


# -- commit together, roll back together -------------------------------------------------------


def test_row_and_record_commit_together_and_replay(db: Db, sync_store: Any) -> None:
    engine, Order = Engine(sync_store), db.model()
    first = create_order(engine, Order, "mandate_1", "user_1", 2999)
    assert first == {"cart_mandate_id": "mandate_1", "user_id": "user_1", "amount": 2999}
    assert db.rows() == [("mandate_1", "user_1", 2999)]
    record = _record(sync_store, "mandate_1", "user_1")
    assert record.status is Status.COMPLETED and record.outcome.value == first
    assert create_order(engine, Order, "mandate_1", "user_1", 2999) == first  # a replay
    assert db.rows() == [("mandate_1", "user_1", 2999)]
    assert _record(sync_store, "mandate_1", "user_1").attempts == 1


def test_async_session_commits_together_and_replays(db: Db) -> None:
    Order = db.model()

    async def main() -> list[Any]:
        aengine = create_async_engine(db.async_url)
        store = SQLAlchemyStore(aengine, **db.spec.options)
        engine = Engine(store)
        try:
            answers = [await acreate_order(engine, Order, "m", "u", 5) for _ in range(2)]
            with pytest.raises(KeyError):  # an error after the write rolls both back
                async with (
                    engine.attempt("k-err", operation="order", scope="u") as att,
                    att.atransaction() as session,
                ):
                    assert isinstance(session, AsyncSession)
                    session.add(Order(cart_mandate_id="m2", user_id="u", amount=1))
                    await session.flush()
                    raise KeyError("boom")
            answers.append((await store.aget(key_hash("u", "order", "k-err"))).status)
            await store.aclose()
            return answers
        finally:
            await aengine.dispose()

    first, again, failed = asyncio.run(main())
    assert first == again == {"cart_mandate_id": "m", "user_id": "u", "amount": 5}
    assert failed is Status.FAILED
    assert db.rows() == [("m", "u", 5)]
    native = open_store(db.native_url)
    assert _record(native, "m", "u").status is Status.COMPLETED
    assert _record(native, "m", "u").attempts == 1
    native.close()


def test_an_error_after_the_write_rolls_both_back(db: Db, sync_store: Any) -> None:
    engine, Order = Engine(sync_store), db.model()
    key = IMAP.key("order", cart_mandate_id="m", user_id="u")
    with (
        pytest.raises(ZeroDivisionError),
        engine.attempt(key, operation="order", scope="u", fingerprint="1") as att,
        att.transaction() as session,  # a Session of the store's own
    ):
        assert isinstance(session, Session)
        session.add(Order(cart_mandate_id="m", user_id="u", amount=1))
        session.flush()
        _ = 1 / 0
    assert db.rows() == []
    record = _record(sync_store, "m", "u")
    assert record.status is Status.FAILED and not record.final  # retryable
    assert create_order(engine, Order, "m", "u", 1)["amount"] == 1
    assert db.rows() == [("m", "u", 1)]


def test_a_stale_worker_gets_lease_lost_and_its_session_rolls_back(
    db: Db, sync_store: Any, clock: Clock
) -> None:
    engine, Order = Engine(sync_store, lease=5, clock=clock), db.model()
    key = IMAP.key("order", cart_mandate_id="m", user_id="u")
    session = Session(sync_store.engine)
    with (
        pytest.raises(LeaseLostError),
        engine.attempt(key, operation="order", scope="u", fingerprint="1") as att,
    ):
        clock.advance(6)  # the lease ran out: another worker takes the key over
        taker = engine.begin(key, operation="order", scope="u", fingerprint="1")
        assert taker.attempts == 2  # type: ignore[union-attr]
        with att.transaction(session):
            session.add(Order(cart_mandate_id="m", user_id="u", amount=1))
            att.outcome = Outcome.json({"late": True})
    assert not session.in_transaction() and not session.new  # rolled back
    session.close()
    assert db.rows() == []
    record = _record(sync_store, "m", "u")
    assert record.status is Status.PROCESSING and record.token == taker.token  # type: ignore[union-attr]
    assert record.outcome is None


def test_a_session_with_an_open_transaction_commits_with_the_block(db: Db, sync_store: Any) -> None:
    """Reads and writes the session made before the block belong to its transaction.

    (On SQLite the writes come after the claim: a session that has written holds the
    file's write lock, which the claim would wait for.)
    """
    engine, Order = Engine(sync_store), db.model()
    with Session(sync_store.engine) as session:
        assert session.scalar(select(Order).where(Order.cart_mandate_id == "a")) is None
        with engine.attempt("k", operation="order") as att:
            session.add(Order(cart_mandate_id="early", user_id="u", amount=1))
            session.flush()
            assert session.in_transaction()
            with att.transaction(session):
                session.add(Order(cart_mandate_id="a", user_id="u", amount=2))
                att.outcome = Outcome.json(2)
            assert not session.in_transaction()
        with pytest.raises(KeyError), engine.attempt("k2", operation="order") as att:
            session.add(Order(cart_mandate_id="b", user_id="u", amount=3))
            session.flush()
            with att.transaction(session):
                raise KeyError("boom")
        assert not session.in_transaction()
    assert db.rows() == [("a", "u", 2), ("early", "u", 1)]  # b rolled back with the block
    assert sync_store.get(key_hash("", "order", "k")).status is Status.COMPLETED
    assert sync_store.get(key_hash("", "order", "k2")).status is Status.FAILED


def test_a_connection_of_the_engine_works(db: Db, sync_store: Any) -> None:
    engine = Engine(sync_store)
    with sync_store.engine.connect() as conn:
        with engine.attempt("k", operation="order") as att, att.transaction(conn) as got:
            assert got is conn
            conn.exec_driver_sql(
                f"INSERT INTO {db.orders} (cart_mandate_id, user_id, amount) VALUES ('c', 'u', 3)"
            )
            att.outcome = Outcome.json(3)
        assert not conn.in_transaction()
    assert db.rows() == [("c", "u", 3)]


def test_a_session_on_another_database_is_refused(db: Db, sync_store: Any, tmp_path: Path) -> None:
    engine = Engine(sync_store)
    other = sqlalchemy.create_engine(f"sqlite:///{tmp_path}/other.db")
    with (
        pytest.raises(ValueError, match="store's database"),
        engine.attempt("k", operation="order") as att,
        Session(other) as session,
        att.transaction(session),
    ):
        pass
    assert sync_store.get(key_hash("", "order", "k")).status is Status.FAILED
    with (
        pytest.raises(TypeError, match="Session or Connection"),
        engine.attempt("k2", operation="order") as att,
        att.transaction(sqlite3.connect(":memory:")),
    ):
        pass
    other.dispose()


def test_the_sync_and_async_forms_are_refused_on_the_other_kind_of_engine(db: Db) -> None:
    sync_db, aengine = db.engine(), create_async_engine(db.async_url)
    sync_engine, async_engine = (
        Engine(SQLAlchemyStore(sync_db, **db.spec.options)),
        Engine(SQLAlchemyStore(aengine, **db.spec.options)),
    )

    async def main() -> None:
        with pytest.raises(TypeError, match="sync Engine"):
            async with sync_engine.attempt("k1", operation="o") as att, att.atransaction():
                pass
        await aengine.dispose()

    asyncio.run(main())
    with (
        pytest.raises(TypeError, match="AsyncEngine"),
        async_engine.attempt("k2", operation="o") as att,
        att.transaction(),
    ):
        pass
    sync_db.dispose()


# -- crashes -----------------------------------------------------------------------------------


def _crashing_worker(spec: StoreSpec, table: str, crash: str, async_url: str) -> None:
    Order = order_model(table)
    if not async_url:
        store = spec.open()
        create_order(Engine(store), Order, "m", "u", 11, crash=crash, lease=60)
        return

    async def main() -> None:
        store = SQLAlchemyStore(create_async_engine(async_url), **spec.options)
        await acreate_order(Engine(store), Order, "m", "u", 11, crash=crash, lease=60)

    asyncio.run(main())


@pytest.mark.parametrize("session", ["Session", "AsyncSession"])
@pytest.mark.parametrize("crash", ["before_commit", "after_commit"])
def test_a_crash_leaves_both_or_neither(db: Db, crash: str, session: str, clock: Clock) -> None:
    """SIGKILL after the flush, before the commit, leaves neither; after it, both."""
    async_url = db.async_url if session == "AsyncSession" else ""
    worker = mp.get_context("spawn").Process(
        target=_crashing_worker, args=(db.spec, db.orders, crash, async_url)
    )
    worker.start()
    worker.join(timeout=60)
    assert worker.exitcode == -signal.SIGKILL
    store, Order = db.spec.open(), db.model()
    record = _record(store, "m", "u")
    if crash == "before_commit":
        assert db.rows() == []
        assert record.status is Status.PROCESSING  # the claim committed; the session did not
        clock.now = record.lease_until - 1
        with pytest.raises(InProgressError):  # until the dead worker's lease runs out
            create_order(Engine(store, clock=clock), Order, "m", "u", 11)
        clock.advance(2)
        retried = create_order(Engine(store, clock=clock), Order, "m", "u", 11)
        assert _record(store, "m", "u").attempts == 2
    else:
        assert db.rows() == [("m", "u", 11)]
        assert record.status is Status.COMPLETED
        retried = create_order(Engine(store), Order, "m", "u", 11)  # a replay: no new row
        assert _record(store, "m", "u").attempts == 1
    assert retried == {"cart_mandate_id": "m", "user_id": "u", "amount": 11}
    assert db.rows() == [("m", "u", 11)]
    store.close()


# -- races -------------------------------------------------------------------------------------


def test_racing_threads_create_one_order(db: Db, sync_store: Any) -> None:
    """24 threads, two users, one mandate: one row; every answer of the winner's key agrees."""
    engine, Order = Engine(sync_store, wait=30), db.model()
    barrier = threading.Barrier(24)

    def racer(i: int) -> Any:
        barrier.wait()
        try:
            return create_order(engine, Order, "m", "alice" if i % 4 else "bob", 3)
        except (ValueError, IntegrityError) as exc:  # the other user's order won
            return type(exc).__name__

    with ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(racer, range(24)))
    rows = db.rows()
    assert len(rows) == 1
    owner = rows[0][1]
    won = [a for a in answers if isinstance(a, dict)]
    assert won and all(a == {"cart_mandate_id": "m", "user_id": owner, "amount": 3} for a in won)
    assert len(won) == (18 if owner == "alice" else 6)
    lost = [a for a in answers if not isinstance(a, dict)]
    assert set(lost) <= {"ValueError", "IntegrityError"}


def test_racing_async_tasks_create_one_order(db: Db) -> None:
    Order = db.model()

    async def main() -> list[Any]:
        aengine = create_async_engine(db.async_url, pool_size=10, max_overflow=20)
        engine = Engine(SQLAlchemyStore(aengine, **db.spec.options), wait=30)
        try:
            return list(
                await asyncio.gather(
                    *(acreate_order(engine, Order, "m", "u", 4) for _ in range(32))
                )
            )
        finally:
            await aengine.dispose()

    answers = asyncio.run(main())
    assert answers == [{"cart_mandate_id": "m", "user_id": "u", "amount": 4}] * 32
    assert db.rows() == [("m", "u", 4)]


def _setup_race(store: Any, table: str) -> Any:
    engine, Order = Engine(store, wait=60), order_model(table)
    return lambda who: create_order(engine, Order, "m", "u", 9)


def test_racing_processes_create_one_order(db: Db) -> None:
    answers = race_processes(db.spec, _setup_race, db.orders, processes=4, threads=8)
    assert len(answers) == 32
    assert all(a == {"cart_mandate_id": "m", "user_id": "u", "amount": 9} for a in answers)
    assert db.rows() == [("m", "u", 9)]


# -- the schema, the drivers, the CLI -------------------------------------------------------------


def test_create_tables_in_the_callers_transaction(db: Db) -> None:
    engine = db.engine()
    with engine.connect() as conn:
        conn.begin()
        assert create_tables(conn, **db.spec.options) >= 1
        conn.rollback()  # SQLite, PostgreSQL: nothing committed; MySQL's DDL commits at once
    native = open_store(db.native_url, auto_migrate=False) if not db.sqlite else None
    if db.sqlite:
        with engine.connect() as conn:
            names = {r[0] for r in conn.exec_driver_sql("SELECT name FROM sqlite_master")}
        assert "retrysafe_records" not in names
    else:
        assert native is not None
        if db.native_url[:5] == "postg":
            with pytest.raises(StoreUnavailableError):
                native.get("00" * 32)  # no table: it was the rolled-back transaction's
        else:
            assert native.get("00" * 32) is None  # the table outlived the rollback
        native.close()
    version = create_tables(engine, **db.spec.options)  # the engine: committed
    store = open_store(db.native_url, **({} if db.sqlite else {"auto_migrate": False}))
    assert store.get("00" * 32) is None  # the table is there
    assert store.migrate() == version
    store.close()
    engine.dispose()

    async def again() -> int:
        aengine = create_async_engine(db.async_url)
        try:
            return await acreate_tables(aengine, **db.spec.options)
        finally:
            await aengine.dispose()

    assert asyncio.run(again()) == version  # idempotent


_ENV = """
from alembic import context
from sqlalchemy import create_engine

engine = create_engine(context.config.get_main_option("sqlalchemy.url"))
with engine.connect() as connection:
    context.configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
"""

_REVISION = """
from alembic import op

from retrysafe.sqlalchemy import create_tables

revision = "0001"
down_revision = None


def upgrade():
    create_tables(op.get_bind(){options})


def downgrade():
    pass
"""


def test_an_alembic_migration_creates_the_tables(db: Db, tmp_path: Path) -> None:
    from alembic import command
    from alembic.config import Config

    scripts = tmp_path / "migrations"
    (scripts / "versions").mkdir(parents=True)
    (scripts / "env.py").write_text(_ENV)
    options = "" if db.sqlite else f", table={db.spec.options['table']!r}"
    (scripts / "versions" / "0001_retrysafe.py").write_text(_REVISION.format(options=options))
    config = Config()
    config.set_main_option("script_location", str(scripts))
    config.set_main_option("sqlalchemy.url", db.spec.url)
    command.upgrade(config, "head")
    store = open_store(db.native_url, **({} if db.sqlite else {"auto_migrate": False}))
    assert store.get("00" * 32) is None  # created by the migration, not by the store
    engine = Engine(store)
    with engine.attempt("k", operation="o") as att:
        att.outcome = Outcome.json(1)
    store.close()


def test_unsupported_drivers_and_dialects_are_refused() -> None:
    with pytest.raises(TypeError, match=r"postgresql\+psycopg://"):
        SQLAlchemyStore(create_async_engine("postgresql+asyncpg://u@localhost/db"))
    with pytest.raises(TypeError, match=r"sqlite:// .*postgresql"):
        SQLAlchemyStore(sqlalchemy.create_engine("mssql+pymssql://u@h/db", module=sqlite3))
    with pytest.raises(TypeError, match="Engine or AsyncEngine"):
        SQLAlchemyStore("sqlite:///x.db")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="database file"):
        SQLAlchemyStore(sqlalchemy.create_engine("sqlite://"))


def test_the_cli_and_a_native_store_see_what_the_store_wrote(
    db: Db, sync_store: Any, clock: Clock
) -> None:
    engine, Order = Engine(sync_store), db.model()
    create_order(engine, Order, "m", "u", 1)
    with pytest.raises(KeyError), engine.attempt("stale", operation="order", ttl=60):
        raise KeyError("failed: its record expires in a minute")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
    out = subprocess.run(
        [sys.executable, "-m", "retrysafe", "stats", "--store", db.native_url, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    ).stdout
    stats = json.loads(out)
    assert "order" in json.dumps(stats) and "completed" in json.dumps(stats)
    native = open_store(db.native_url)
    assert native.get(_record(sync_store, "m", "u").key_hash).status is Status.COMPLETED
    swept = native.sweep(time.time() + 120)  # the failed one has expired; the order has not
    assert swept.deleted == 1
    assert sync_store.get(key_hash("", "order", "stale")) is None
    assert _record(sync_store, "m", "u").status is Status.COMPLETED
    native.close()


def test_borrowing_costs_no_round_trip(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A claim on a borrowed psycopg connection is one Sync: toggling autocommit and giving
    the connection back send nothing."""
    spec = make_spec("sqlalchemy-postgres", request, tmp_path)
    db = sqlalchemy.create_engine(spec.url, pool_size=1, max_overflow=0)
    store = SQLAlchemyStore(db, **spec.options)
    engine = Engine(store)
    with engine.attempt("warm", operation="o") as att:  # migrated, the connection pooled
        att.outcome = Outcome.json(0)
    trace = tmp_path / "trace.txt"
    with db.connect() as conn:
        pgconn = conn.connection.driver_connection.pgconn  # type: ignore[union-attr]
    with trace.open("w") as f:
        pgconn.trace(f.fileno())
        try:
            with engine.attempt("k", operation="o") as att:  # claim, then completion
                att.outcome = Outcome.json(1)
            assert engine.begin("k", operation="o") is not None  # a replay
        finally:
            pgconn.untrace()
    sent = [line.split("\t") for line in trace.read_text().splitlines()]
    frontend = [parts[3] for parts in sent if len(parts) > 3 and parts[1] == "F"]
    assert frontend.count("Sync") + frontend.count("Query") == 3, frontend
    store.close()
    db.dispose()


def test_close_never_disposes_the_engine(db: Db) -> None:
    engine = db.engine()
    store = db.store(engine)
    Engine(store).begin("k", operation="o")
    store.close()
    with engine.connect() as conn:  # the application's pool still serves
        assert conn.exec_driver_sql("SELECT 1").scalar() == 1
    assert store.get(key_hash("", "o", "k")) is not None  # and the store goes on
    engine.dispose()


def test_psycopg_is_the_driver_of_postgres(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    spec = make_spec("sqlalchemy-postgres", request, tmp_path)
    db = sqlalchemy.create_engine(spec.url)
    store = SQLAlchemyStore(db, **spec.options)
    conn = store._take()
    try:
        assert isinstance(conn, psycopg.Connection) and conn.autocommit
    finally:
        store._give(conn)
    with db.connect() as sa_conn:
        assert not sa_conn.connection.driver_connection.autocommit  # type: ignore[union-attr]
    db.dispose()
    # An AUTOCOMMIT engine's connections go back in autocommit mode.
    auto = sqlalchemy.create_engine(spec.url, isolation_level="AUTOCOMMIT", pool_size=1)
    Engine(SQLAlchemyStore(auto, **spec.options)).begin("k", operation="o")
    with auto.connect() as sa_conn:
        assert sa_conn.connection.driver_connection.autocommit  # type: ignore[union-attr]
    auto.dispose()


def test_an_autocommit_session_is_refused(db: Db, sync_store: Any) -> None:
    """An AUTOCOMMIT connection would commit the completion apart from the writes."""
    engine, Order = Engine(sync_store), db.model()
    auto = sync_store.engine.execution_options(isolation_level="AUTOCOMMIT")
    with (
        pytest.raises(ValueError, match="autocommit"),
        engine.attempt("k", operation="order") as att,
        Session(auto) as session,
        att.transaction(session),
    ):
        session.add(Order(cart_mandate_id="m", user_id="u", amount=1))
        att.outcome = Outcome.json(1)
    assert sync_store.get(key_hash("", "order", "k")).status is Status.FAILED


def test_an_aiosqlite_store_waits_for_the_lock_without_blocking_the_loop(tmp_path: Path) -> None:
    """A claim that finds SQLite's write lock taken retries with asyncio.sleep: other
    tasks run meanwhile; past the store's timeout it is StoreUnavailableError."""
    path = tmp_path / "shop.db"
    create_tables(sqlalchemy.create_engine(f"sqlite:///{path}"))
    holder = sqlite3.connect(path, isolation_level=None)

    async def main() -> tuple[int, int, Any]:
        aengine = create_async_engine(f"sqlite+aiosqlite:///{path}", connect_args={"timeout": 0})
        store = SQLAlchemyStore(aengine, timeout=0.5)
        engine = Engine(store)
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)

        holder.execute("BEGIN IMMEDIATE")  # another writer holds the lock
        task = asyncio.create_task(ticker())
        try:
            with pytest.raises(StoreUnavailableError, match="locked"):
                await engine.abegin("k1", operation="o")
            during = ticks
            holder.execute("ROLLBACK")  # released: the next claim goes through
            claim = await engine.abegin("k2", operation="o")
        finally:
            done.set()
            await task
            await aengine.dispose()
        return during, ticks, claim

    during, _, claim = asyncio.run(main())
    holder.close()
    assert during > 50  # the loop ran other tasks while the claim waited
    assert claim.attempts == 1  # type: ignore[union-attr]


# -- async sessions: a lost lease, racing processes ----------------------------------------------


def test_a_stale_async_worker_gets_lease_lost_and_its_session_rolls_back(
    db: Db, clock: Clock
) -> None:
    key = IMAP.key("order", cart_mandate_id="m", user_id="u")

    async def main(engine: Engine, Order: Any) -> tuple[Any, Any]:
        engine = Engine(engine.store, lease=5, clock=clock)
        async with AsyncSession(engine.store.engine) as session:  # type: ignore[attr-defined]
            with pytest.raises(LeaseLostError):
                async with engine.attempt(key, operation="order", scope="u") as att:
                    clock.advance(6)  # the lease ran out: another worker takes the key over
                    taker = await engine.abegin(key, operation="order", scope="u")
                    async with att.atransaction(session):
                        session.add(Order(cart_mandate_id="m", user_id="u", amount=1))
                        await session.flush()
                        att.outcome = Outcome.json({"late": True})
            assert not session.in_transaction() and not session.new  # rolled back
        return taker, await engine.store.aget(key_hash("u", "order", key))

    taker, record = run_async_engine(db, main)
    assert db.rows() == []
    assert record.status is Status.PROCESSING and record.token == taker.token
    assert record.outcome is None


_ASYNC_RACERS = 4  # threads per process


def _setup_async_race(_store: Any, async_url: str, options: dict[str, Any], table: str) -> Any:
    """Each racer thread runs acreate_order on an AsyncEngine store of its own loop, built
    and migrated here, before the barrier (the racers then start together)."""
    Order = order_model(table)

    async def ready() -> Any:
        store = SQLAlchemyStore(create_async_engine(async_url), **options)
        await store.aget("warm")  # migrates
        await store.engine.dispose()  # its connections were this loop's
        return store

    stores = [asyncio.run(ready()) for _ in range(_ASYNC_RACERS)]

    def racer(who: str) -> Any:
        store = stores[int(who.rsplit("-", 1)[1])]

        async def main() -> Any:
            try:
                return await acreate_order(Engine(store, wait=60), Order, "m", "u", 9)
            finally:
                await store.engine.dispose()

        return asyncio.run(main())

    return racer


def test_racing_processes_with_async_sessions_create_one_order(db: Db, sync_store: Any) -> None:
    answers = race_processes(
        db.spec,
        _setup_async_race,
        db.async_url,
        db.spec.options,
        db.orders,
        processes=4,
        threads=_ASYNC_RACERS,
    )
    assert answers == [{"cart_mandate_id": "m", "user_id": "u", "amount": 9}] * 16
    assert db.rows() == [("m", "u", 9)]
    # one racer ran the body (a second run would answer the same and add no row):
    # one claim, completed; the 15 others replayed it
    record = _record(sync_store, "m", "u")
    assert record.status is Status.COMPLETED and record.attempts == 1


# -- what the block may not be, and what the store must not touch --------------------------------


def test_an_autocommit_session_is_refused_before_it_writes(db: Db, sync_store: Any) -> None:
    """Its INSERTs would commit one by one: refused as the block begins, nothing written."""
    engine, Order = Engine(sync_store), db.model()
    auto = sync_store.engine.execution_options(isolation_level="AUTOCOMMIT")
    ran = []
    with (
        pytest.raises(ValueError, match="autocommit"),
        engine.attempt("k", operation="order") as att,
        Session(auto) as session,
        att.transaction(session),
    ):
        ran.append(1)
        session.add(Order(cart_mandate_id="m", user_id="u", amount=1))
    insert = f"INSERT INTO {db.orders} (cart_mandate_id, user_id, amount) VALUES ('c', 'u', 1)"
    with (
        auto.connect() as conn,
        pytest.raises(ValueError, match="autocommit"),
        engine.attempt("k2", operation="order") as att,
        att.transaction(conn),
    ):
        ran.append(2)
        conn.exec_driver_sql(insert)

    async def main(aengine: Engine, Order: Any) -> None:
        auto = aengine.store.engine.execution_options(isolation_level="AUTOCOMMIT")  # type: ignore[attr-defined]
        async with AsyncSession(auto) as session:
            with pytest.raises(ValueError, match="autocommit"):
                async with (
                    aengine.attempt("k3", operation="order") as att,
                    att.atransaction(session),
                ):
                    ran.append(3)
                    session.add(Order(cart_mandate_id="a", user_id="u", amount=1))

    run_async_engine(db, main)
    assert ran == [] and db.rows() == []
    for key in ("k", "k2", "k3"):
        assert sync_store.get(key_hash("", "order", key)).status is Status.FAILED


def test_a_session_with_a_mapper_bound_elsewhere_is_refused(
    db: Db, sync_store: Any, tmp_path: Path
) -> None:
    """``binds=`` sends the order to another database: its commit would be apart."""
    engine, Order = Engine(sync_store), db.model()
    shop = sqlalchemy.create_engine(f"sqlite:///{tmp_path}/shop.db")
    Order.metadata.create_all(shop)
    with (
        pytest.raises(ValueError, match="binds"),
        engine.attempt("k", operation="order") as att,
        Session(sync_store.engine, binds={Order: shop}) as session,
        att.transaction(session),
    ):
        session.add(Order(cart_mandate_id="m", user_id="u", amount=1))
        att.outcome = Outcome.json(1)
    with shop.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT count(*) FROM {db.orders}").scalar() == 0
    shop.dispose()
    assert sync_store.get(key_hash("", "order", "k")).status is Status.FAILED


@pytest.mark.parametrize("pool", ["StaticPool", "SingletonThreadPool"])
def test_a_pool_of_one_connection_never_lends_the_sessions_own(db: Db, pool: str) -> None:
    """A store call inside the block must not commit the session's half-done work (the
    pool would hand it the session's own connection): the error rolls everything back."""
    import sqlalchemy.pool

    options: dict[str, Any] = {"poolclass": getattr(sqlalchemy.pool, pool)}
    if not db.sqlite:
        # PostgreSQL: refused (a pool of the store's own, built from the URL, would drop
        # the engine's connect_args: search_path, sslmode…); see test_sqlalchemy_joins
        app = sqlalchemy.create_engine(db.spec.url, **options)
        with pytest.raises(ValueError, match=pool):
            SQLAlchemyStore(app, **db.spec.options)
        app.dispose()
        return
    options["connect_args"] = {"check_same_thread": False}
    app = sqlalchemy.create_engine(db.spec.url, **options)
    store = SQLAlchemyStore(app, **db.spec.options)
    engine, Order = Engine(store), db.model()
    with (
        pytest.raises(KeyError),
        engine.attempt("k", operation="order") as att,
        Session(app) as session,
        att.transaction(session),
    ):
        session.add(Order(cart_mandate_id="m", user_id="u", amount=1))
        session.flush()
        assert store.get(key_hash("", "order", "other")) is None  # a guard's lookup
        raise KeyError("payment declined")
    assert db.rows() == []
    assert store.get(key_hash("", "order", "k")).status is Status.FAILED
    assert create_order(engine, Order, "m", "u", 1)["amount"] == 1  # and it works
    assert db.rows() == [("m", "u", 1)]
    store.close()
    app.dispose()


def savepoint_recipe_app(tmp_path: Path) -> tuple[sqlalchemy.Engine, Any, Engine, Any]:
    """(engine, store, Engine, Order) on a SQLite file under SQLAlchemy's pysqlite recipe
    for SAVEPOINTs: isolation_level=None on connect, BEGIN on SQLAlchemy's begin."""
    app = sqlalchemy.create_engine(f"sqlite:///{tmp_path}/shop.db")

    @sqlalchemy.event.listens_for(app, "connect")
    def _connect(dbapi: Any, _record: Any) -> None:
        dbapi.isolation_level = None

    @sqlalchemy.event.listens_for(app, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN")

    Order = order_model("orders")
    Order.metadata.create_all(app)
    store = SQLAlchemyStore(app)
    return app, store, Engine(store), Order


def test_sqlalchemys_pysqlite_savepoint_recipe_is_a_transaction(tmp_path: Path) -> None:
    """isolation_level=None on connect plus BEGIN on SQLAlchemy's begin: a real transaction
    (SAVEPOINTs work), not autocommit."""
    app, store, engine, Order = savepoint_recipe_app(tmp_path)
    with engine.attempt("k", operation="order") as att, Session(app) as s, att.transaction(s):
        s.add(Order(cart_mandate_id="a", user_id="u", amount=1))
        with pytest.raises(IntegrityError), s.begin_nested():  # a SAVEPOINT rolled back
            s.add(Order(cart_mandate_id="a", user_id="v", amount=2))
        att.outcome = Outcome.json(1)
    with app.connect() as conn:
        assert list(conn.exec_driver_sql("SELECT cart_mandate_id, user_id FROM orders")) == [
            ("a", "u")
        ]
    assert store.get(key_hash("", "order", "k")).status is Status.COMPLETED
    app.dispose()


def test_an_aiosqlite_store_sends_one_statement_per_op_and_logs_none(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As the native store: no PRAGMA to restore an isolation level, and the keys and the
    stored answers stay out of the application's SQL log."""
    import logging

    from sqlalchemy.util import await_only

    sent: list[str] = []
    claim_and_completion: list[str] = []

    async def main() -> None:
        aengine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path}/shop.db")

        @sqlalchemy.event.listens_for(aengine.sync_engine, "connect")
        def _connect(dbapi: Any, _record: Any) -> None:
            await_only(dbapi.driver_connection.set_trace_callback(sent.append))

        engine = Engine(SQLAlchemyStore(aengine))
        async with engine.attempt("warm", operation="o") as att:  # migrated
            att.outcome = Outcome.json(0)
        sent.clear()
        async with engine.attempt("k-secret", operation="o") as att:
            att.outcome = Outcome.json({"card": "4111-secret"})
        claim_and_completion.extend(sent)
        sent.clear()
        async with engine.attempt("k-secret", operation="o") as att:
            assert att.replay is not None
        assert len(sent) == 1, sent  # the replay's SELECT
        await aengine.dispose()

    caplog.set_level(logging.INFO, logger="sqlalchemy.engine")
    asyncio.run(main())
    # the native store's statements only: the claim's lookup and INSERTs, the completion
    assert not [s for s in claim_and_completion if s.startswith("PRAGMA")]
    assert len(claim_and_completion) == 4, claim_and_completion
    assert "secret" not in caplog.text
