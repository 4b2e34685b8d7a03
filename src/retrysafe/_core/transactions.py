"""Transactional completion: the application's writes and the record's completion commit together.

With the SQLite and PostgreSQL stores, :meth:`Attempt.transaction` runs the
completion's compare-and-set ``UPDATE`` on the application's own connection,
inside the transaction that holds its business writes. Either both commit or
neither does: a crash between the business write and the commit leaves no side
effect without its record and no record without its side effect.

The decisions (which store, whether the connection may be used, whether the
completion landed) are plain functions; the sync and async drivers only differ
in ``await``.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

from retrysafe.errors import StoreUnavailableError
from retrysafe.stores import Store

if TYPE_CHECKING:
    from retrysafe._core.engine import Attempt, Claim

__all__ = ["atransaction", "transaction"]

_NEEDS = "transactional completion needs a SQLite or PostgreSQL store"


def _kind(store: Store[Any]) -> str:
    """``"sqlite"`` or ``"postgres"``; TypeError for any other store."""
    from retrysafe.stores.sqlite import SQLiteStore

    if isinstance(store, SQLiteStore):
        return "sqlite"
    try:
        from retrysafe.stores.postgres import PostgresStore
    except ImportError:  # psycopg not installed: it cannot be a PostgreSQL store
        pass
    else:
        if isinstance(store, PostgresStore):
            return "postgres"
    raise TypeError(f"{_NEEDS}, not {type(store).__name__}")


def _owned(att: Attempt) -> Claim:
    if att.claim is None or att.finished:
        raise RuntimeError("transaction() needs an attempt that holds an unsettled claim")
    return att.claim


def _completion(att: Attempt, claim: Claim) -> tuple[Any, float, float | None]:
    """The store's completion op for the block's outcome, checked as :meth:`Engine.complete`
    checks it."""
    outcome = att.outcome
    if outcome is None:
        raise RuntimeError("set attempt.outcome inside the transaction block")
    error = att._engine._outcome_error(outcome)
    if error is not None:
        att.final = True  # the business writes roll back, but the handler did run
        raise error
    engine = att._engine
    now = engine.clock()
    expires_at = claim.settled_expiry(now)
    op = engine.store._completion(claim.key_hash, claim.token, outcome, now, expires_at)
    return op, time.perf_counter(), expires_at


def _same_sqlite_file(store: Any, conn: sqlite3.Connection) -> None:
    row = conn.execute("PRAGMA database_list").fetchone()
    path = row[2] if row else ""
    if not path or os.path.realpath(path) != os.path.realpath(store.path):
        raise ValueError(
            f"the connection is to {path or 'an in-memory database'!r}, "
            f"not to the store's file {store.path!r}"
        )


def _pg_idle(conn: Any) -> None:
    import psycopg

    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise ValueError("the connection is inside a transaction already; commit it first")


def _pg_unavailable() -> tuple[type[BaseException], ...]:
    from retrysafe.stores.postgres import UNAVAILABLE_ERRORS

    return UNAVAILABLE_ERRORS


def _pg_failed(store: Any, exc: BaseException) -> StoreUnavailableError:
    """The completion statement failed: the transaction rolls back, the attempt stays retryable.

    A row moved to another partition meanwhile (partitioned tables) or a
    connection to another database (no such table) end here.
    """
    return StoreUnavailableError(
        f"PostgreSQL store: the completion could not be written in this transaction "
        f"({type(exc).__name__}: {exc}); nothing was committed. A connection you pass "
        "must be to the store's database, with its table on the search path"
    )


@contextmanager
def transaction(att: Attempt, connection: Any = None) -> Iterator[Any]:
    """See :meth:`Attempt.transaction`."""
    claim = _owned(att)
    store = att._engine.store
    if _kind(store) == "sqlite":
        with _sqlite(store, connection) as conn:
            yield conn
            op, started, expires_at = _completion(att, claim)
            att._engine._finished(claim, op(conn), started, expires_at=expires_at)
    else:
        with _postgres(store, connection) as conn, conn.transaction():
            yield conn
            op, started, expires_at = _completion(att, claim)
            try:
                cur = conn.execute(op.query, op.params)
            except _pg_unavailable() as exc:
                raise _pg_failed(store, exc) from exc
            ok = op.parse(cur.rowcount, None)
            att._engine._finished(claim, ok, started, expires_at=expires_at)
    att.finished = True  # committed: leaving the attempt's block writes nothing more


@asynccontextmanager
async def atransaction(att: Attempt, connection: Any = None) -> AsyncIterator[Any]:
    """See :meth:`Attempt.atransaction` (PostgreSQL only)."""
    claim = _owned(att)
    store = att._engine.store
    if _kind(store) != "postgres":
        raise TypeError(
            "atransaction() needs a PostgreSQL store; with SQLite, run the sync "
            "transaction() in a thread (asyncio.to_thread)"
        )
    async with _apostgres(store, connection) as conn, conn.transaction():
        yield conn
        op, started, expires_at = _completion(att, claim)
        try:
            cur = await conn.execute(op.query, op.params)
        except _pg_unavailable() as exc:
            raise _pg_failed(store, exc) from exc
        ok = op.parse(cur.rowcount, None)
        att._engine._finished(claim, ok, started, expires_at=expires_at)
    att.finished = True


# -- connections ----------------------------------------------------------------------


@contextmanager
def _sqlite(store: Any, connection: sqlite3.Connection | None) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` … ``COMMIT`` on ``connection`` or this thread's store connection.

    By default the transaction runs on the connection the store itself uses in
    this thread, so store calls made inside the block (a guard, another claim)
    join the transaction instead of waiting for its write lock. ``BEGIN
    IMMEDIATE`` takes the lock up front, waiting for it as the store's own
    writes do (up to its ``timeout``, then :class:`StoreUnavailableError`).
    """
    if connection is None:
        conn = store._conn()
        if conn.in_transaction:
            raise ValueError("a transaction of this store is already open in this thread")
        store._run(_begin)
    else:
        conn = connection
        _same_sqlite_file(store, conn)
        if conn.in_transaction:
            raise ValueError("the connection is inside a transaction already; commit it first")
        try:
            _begin(conn)
        except (
            sqlite3.OperationalError
        ) as exc:  # the lock stayed taken for the connection's timeout
            raise StoreUnavailableError(f"SQLite store {store.path}: {exc}") from exc
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:  # some errors (a full disk) end it already
            conn.execute("ROLLBACK")
        raise


def _begin(conn: sqlite3.Connection) -> None:
    conn.execute("BEGIN IMMEDIATE")


@contextmanager
def _postgres(store: Any, connection: Any) -> Iterator[Any]:
    if connection is not None:
        _pg_idle(connection)
        yield connection
        return
    # Only taking the connection maps errors to StoreUnavailableError: the
    # application's own statements raise their own errors (a unique violation).
    try:
        pool = store._pool or store._sync_pool()
        conn = store._checkout(pool)
    except _pg_unavailable() as exc:
        raise store._unavailable(exc) from exc
    try:
        yield conn
    finally:
        _pg_reset(conn)
        pool.putconn(conn)


def _pg_reset(conn: Any) -> None:
    """Back to the pool without what the block set for the session (``SET``, say)."""
    import psycopg

    try:
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
            conn.execute("RESET ALL")
            return
    except psycopg.Error:
        pass
    conn.close()  # the pool replaces a closed connection


@asynccontextmanager
async def _apostgres(store: Any, connection: Any) -> AsyncIterator[Any]:
    if connection is not None:
        _pg_idle(connection)
        yield connection
        return
    try:
        entry = await store._loop_pool()
        conn = await store._acheckout(entry.pool)
    except _pg_unavailable() as exc:
        raise store._unavailable(exc) from exc
    try:
        yield conn
    finally:
        await _apg_reset(conn)
        await entry.pool.putconn(conn)


async def _apg_reset(conn: Any) -> None:
    """Async :func:`_pg_reset`."""
    import psycopg

    try:
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
            await conn.execute("RESET ALL")
            return
    except psycopg.Error:
        pass
    await conn.close()
