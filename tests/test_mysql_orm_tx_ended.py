"""The SQLAlchemy MySQL store (PyMySQL, asyncmy) and the Django one (mysqlclient): a
block whose transaction a deadlock or an implicit commit ended inside it gets its
completion refused, never committed on its own without the block's writes (the native
store's case is in tests/test_mysql_transactions.py, whose helpers this reuses)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy
from _servers import MySQLServer
from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from test_django_mysql import project  # noqa: F401  (the fixture: a migrated database)
from test_django_orm import Project
from test_mysql_transactions import Orders, heavier_rival, new_orders, spec_on, two_rows

from retrysafe import Engine, Outcome, StoreUnavailableError
from retrysafe._model.hashing import key_hash
from retrysafe._model.record import Status
from retrysafe.sqlalchemy import SQLAlchemyStore

SCRIPT = Path(__file__).resolve().parent / "_django_tx_ended.py"


@pytest.fixture
def orders(mysql_server: MySQLServer) -> Orders:
    return new_orders(spec_on(mysql_server))


def deadlock(orders: Orders, t: str) -> tuple[threading.Thread, threading.Event]:
    locked = threading.Event()
    return heavier_rival(orders, t, locked), locked


def test_sqlalchemy_a_deadlock_or_an_implicit_commit_refuses_the_completion(
    mysql_server: MySQLServer, orders: Orders
) -> None:
    engine = sqlalchemy.create_engine(mysql_server.url.replace("mysql://", "mysql+pymysql://"))
    store = SQLAlchemyStore(engine, table=f"t_{uuid.uuid4().hex[:12]}")
    t = two_rows(orders)

    def deadlocked(session: Any) -> None:
        session.execute(text(f"UPDATE {t} SET v = 42 WHERE id = 1"))
        rival, locked = deadlock(orders, t)
        assert locked.wait(10)
        with pytest.raises(OperationalError, match="1213"):  # caught, and the block goes on
            session.execute(text(f"SELECT v FROM {t} WHERE id = 2 FOR UPDATE"))
        rival.join()
        orders.sql(f"DELETE FROM {t} WHERE id >= 100")

    def ddl(session: Any) -> None:
        session.execute(text(f"CREATE TABLE IF NOT EXISTS {orders.table}_ddl (id INT)"))

    app_session, app_conn = Session(engine), engine.connect()
    cases = [(None, deadlocked), (app_session, deadlocked), (None, ddl), (app_conn, ddl)]
    for n, (given, block) in enumerate(cases):
        with (
            pytest.raises(StoreUnavailableError, match="nothing was committed"),
            Engine(store).attempt(f"k{n}", operation="order") as att,
            att.transaction(given) as session,
        ):
            block(session)
            att.outcome = Outcome.json(n)
        assert store.get(key_hash("", "order", f"k{n}")).status is Status.FAILED
    assert orders.sql(f"SELECT v FROM {t} WHERE id = 1") == [(0,)]
    with Engine(store).attempt("ok", operation="order") as att, att.transaction(app_session):
        att.outcome = Outcome.json("fine")  # the same session goes on completing
    assert store.get(key_hash("", "order", "ok")).status is Status.COMPLETED
    app_session.close()
    app_conn.close()
    store.close()
    engine.dispose()


def test_sqlalchemy_async_a_deadlock_refuses_the_completion(
    mysql_server: MySQLServer, orders: Orders
) -> None:
    url = mysql_server.url.replace("mysql://", "mysql+asyncmy://")
    t = two_rows(orders)

    async def main() -> None:
        engine = create_async_engine(url)
        store = SQLAlchemyStore(engine, table=f"t_{uuid.uuid4().hex[:12]}")
        mine = AsyncSession(engine)
        for n, given in enumerate([None, mine]):
            with pytest.raises(StoreUnavailableError, match="nothing was committed"):
                async with (
                    Engine(store).attempt(f"k{n}", operation="order") as att,
                    att.atransaction(given) as session,
                ):
                    await session.execute(text(f"UPDATE {t} SET v = 42 WHERE id = 1"))
                    rival, locked = deadlock(orders, t)
                    assert await asyncio.to_thread(locked.wait, 10)
                    with pytest.raises(OperationalError, match="1213"):
                        await session.execute(text(f"SELECT v FROM {t} WHERE id = 2 FOR UPDATE"))
                    await asyncio.to_thread(rival.join)
                    orders.sql(f"DELETE FROM {t} WHERE id >= 100")
                    att.outcome = Outcome.json(n)
            assert (await store.aget(key_hash("", "order", f"k{n}"))).status is Status.FAILED
        await mine.close()
        await store.aclose()
        await engine.dispose()

    asyncio.run(main())
    assert orders.sql(f"SELECT v FROM {t} WHERE id = 1") == [(0,)]


def test_django_a_deadlock_or_an_implicit_commit_refuses_the_completion(
    project: Project,  # noqa: F811  (the fixture imported above)
) -> None:
    """The Django store (mysqlclient, in ``atomic()``): the same refusals."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), project.native_url],
        env=project.env(),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {
        "caught": 1213,
        "deadlock": "refused",
        "deadlock_status": "failed",
        "ddl": "refused",
        "ddl_status": "failed",
        "v": 0,
    }
