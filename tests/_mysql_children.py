"""What the MySQL store's tests run in child processes (a module light to import:
each spawned child imports it)."""

from __future__ import annotations

from typing import Any

from retrysafe import Claim, Engine, InProgressError
from retrysafe.stores.mysql import MySQLStore

__all__ = ["open_and_claim", "use_after_fork"]


def open_and_claim(url: str, table: str, barrier: Any, queue: Any) -> None:
    """Open ``table`` (fresh: the first use migrates it), then at the barrier claim key
    ``k``; put what came of it on ``queue``."""
    store = MySQLStore(url, table=table, connect_timeout=30)
    barrier.wait()
    try:
        claim = Engine(store).begin("k", operation="op")
        queue.put("claim" if isinstance(claim, Claim) else type(claim).__name__)
    except InProgressError:
        queue.put("in progress")
    except Exception as exc:  # reported to the test, which fails on it
        queue.put(f"{type(exc).__name__}: {exc}")
    store.close()


def use_after_fork(store: Any, queue: Any) -> None:
    """In a forked child: claim and complete key ``child`` on ``store``, the parent's
    (sync), then key ``child-async`` (async); put "ok" or the error on ``queue``."""
    import asyncio

    from retrysafe import Outcome

    try:
        engine = Engine(store)
        claim = engine.begin("child", operation="op")
        assert isinstance(claim, Claim), claim
        engine.complete(claim, Outcome.json("child"))

        async def use() -> None:
            claim = await engine.abegin("child-async", operation="op")
            assert isinstance(claim, Claim), claim
            await engine.acomplete(claim, Outcome.json("child"))
            await store.aclose()

        asyncio.run(use())
        queue.put("ok")
    except BaseException as exc:  # reported to the test, which fails on it
        queue.put(f"{type(exc).__name__}: {exc}")
