"""What the MySQL store's tests run in child processes (a module light to import:
each spawned child imports it)."""

from __future__ import annotations

from typing import Any

from retrysafe import Claim, Engine, InProgressError
from retrysafe.stores.mysql import MySQLStore

__all__ = ["open_and_claim"]


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
