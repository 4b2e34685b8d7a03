"""The SQLAlchemy stores at the edges of what they join: a cancelled operation, a Session
that writes through a second connection (``binds=``), pools of one connection, and a
Connection that has not begun. The fixtures are test_sqlalchemy's."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from test_sqlalchemy import (  # noqa: F401 (db and sync_store: the fixtures)
    Db,
    db,
    order_model,
    run_async_engine,
    savepoint_recipe_app,
    sync_store,
)

from retrysafe import Engine, Outcome
from retrysafe._model.hashing import key_hash
from retrysafe._model.record import Status
from retrysafe.sqlalchemy import SQLAlchemyStore


def test_a_cancelled_aiosqlite_op_gives_the_connection_back_as_it_was(tmp_path: Path) -> None:
    """The store switches the adapter to autocommit while it borrows a connection; a task
    cancelled at any await of the op must not leave it so in the application's pool (its
    sessions would commit each statement and roll back nothing)."""

    async def main() -> list[Any]:
        aengine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path}/shop.db", pool_size=1)
        store = SQLAlchemyStore(aengine)
        async with Engine(store).attempt("warm", operation="o") as att:  # migrated
            att.outcome = Outcome.json(0)
        levels = []
        for i in range(70):
            task = asyncio.ensure_future(store.aget(f"x{i}"))
            for _ in range(i % 7):  # cancelled at each await in turn
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            async with aengine.connect() as conn:
                raw = await conn.get_raw_connection()
                levels.append(raw.driver_connection._conn.isolation_level)
        await aengine.dispose()
        return levels

    levels = asyncio.run(main())
    assert levels == [""] * 70


@pytest.mark.parametrize("other", ["a second engine", "an AUTOCOMMIT option engine"])
def test_a_mapper_bound_to_a_second_connection_of_the_same_database_is_refused(
    db: Db,  # noqa: F811 (test_sqlalchemy's fixture)
    sync_store: Any,  # noqa: F811
    other: str,
) -> None:
    """Two connections are two transactions, committed one by one (the completion's could
    land first), and an AUTOCOMMIT one commits at the flush: refused as the connection
    joins, before its first statement."""
    engine, Order = Engine(sync_store), db.model()
    second = (
        db.engine()
        if other == "a second engine"
        else sync_store.engine.execution_options(isolation_level="AUTOCOMMIT")
    )
    with (
        pytest.raises(ValueError, match="binds"),
        engine.attempt("k", operation="order") as att,
        Session(sync_store.engine, binds={Order: second}) as session,
        att.transaction(session),
    ):
        session.add(Order(cart_mandate_id="m", user_id="u", amount=1))
        session.flush()
        att.outcome = Outcome.json(1)
    assert db.rows() == []
    assert sync_store.get(key_hash("", "order", "k")).status is Status.FAILED

    async def main(aengine: Engine, Order: Any) -> Any:
        auto = aengine.store.engine.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(ValueError, match="binds"):
            async with (
                aengine.attempt("k2", operation="order") as att,
                AsyncSession(aengine.store.engine, binds={Order: auto}) as session,
                att.atransaction(session),
            ):
                session.add(Order(cart_mandate_id="m", user_id="u", amount=1))
                await session.flush()
        return await aengine.store.aget(key_hash("", "order", "k2"))

    assert run_async_engine(db, main).status is Status.FAILED
    assert db.rows() == []


def test_a_connection_not_yet_begun_under_the_pysqlite_savepoint_recipe_is_joined(
    tmp_path: Path,
) -> None:
    """Under SQLAlchemy's recipe (isolation_level=None on connect, BEGIN on SQLAlchemy's
    begin) a Connection's first statement begins a real transaction: joined as a Session
    is, its insert and the completion commit together, and an error rolls both back."""
    app, store, engine, _ = savepoint_recipe_app(tmp_path)
    insert = "INSERT INTO orders (cart_mandate_id, user_id, amount) VALUES (?, 'u', 1)"
    with (
        pytest.raises(KeyError),
        engine.attempt("k1", operation="order") as att,
        app.connect() as conn,
        att.transaction(conn),
    ):
        conn.exec_driver_sql(insert, ("a",))
        raise KeyError("declined")
    with engine.attempt("k2", operation="order") as att, app.connect() as c, att.transaction(c):
        c.exec_driver_sql(insert, ("b",))
        att.outcome = Outcome.json(1)
    with app.connect() as conn:
        rows = list(conn.exec_driver_sql("SELECT cart_mandate_id FROM orders"))
    assert rows == [("b",)]
    assert store.get(key_hash("", "order", "k1")).status is Status.FAILED
    assert store.get(key_hash("", "order", "k2")).status is Status.COMPLETED
    app.dispose()


@pytest.mark.parametrize("pool", ["StaticPool", "SingletonThreadPool", "AssertionPool"])
def test_a_postgres_engine_on_a_pool_of_one_connection_is_refused(pool: str) -> None:
    """The store cannot borrow from it, and a pool of its own built from the URL would
    drop the engine's connect_args (a search_path: claims in one schema, the completion
    in another; an sslmode): refused, sync or async, naming the pool. No connection is
    opened to find out."""
    import sqlalchemy.pool

    poolclass = getattr(sqlalchemy.pool, pool)
    url = "postgresql+psycopg://app@localhost:1/shop"
    args = {"options": "-c search_path=shop"}
    sync = sqlalchemy.create_engine(url, poolclass=poolclass, connect_args=args)
    with pytest.raises(ValueError, match=pool):
        SQLAlchemyStore(sync)
    if pool != "SingletonThreadPool":  # not an async pool
        aengine = create_async_engine(url, poolclass=poolclass, connect_args=args)
        with pytest.raises(ValueError, match=pool):
            SQLAlchemyStore(aengine)
    sync.dispose()


def test_the_store_is_a_class_of_which_each_dialects_store_is_a_kind(
    db: Db,  # noqa: F811 (test_sqlalchemy's fixture)
) -> None:
    kind = {"sqlite": "SQLAlchemySQLiteStore", "postgres": "SQLAlchemyPostgresStore"}.get(
        db.spec.name.removeprefix("sqlalchemy-"), "SQLAlchemyMySQLStore"
    )
    engine = db.engine()
    store = SQLAlchemyStore(engine, **db.spec.options)
    assert isinstance(store, SQLAlchemyStore) and type(store).__name__ == kind
    store.close()
    engine.dispose()

    async def build() -> None:
        aengine = create_async_engine(db.async_url)
        astore = SQLAlchemyStore(aengine, **db.spec.options)
        assert isinstance(astore, SQLAlchemyStore) and type(astore).__name__ == kind
        await aengine.dispose()

    asyncio.run(build())
