"""The SQLAlchemy stores at the edges of what they join: a cancelled operation, a Session
that writes through a second connection (``binds=``), pools of one connection, and a
Connection that has not begun. The fixtures are test_sqlalchemy's."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy.ext.asyncio import create_async_engine
from test_sqlalchemy import Db, db, order_model, sync_store  # noqa: F401 (fixtures)

from retrysafe import Engine, Outcome
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
