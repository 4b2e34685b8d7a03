"""Transactional completion: the application's writes and the record's completion commit together.

With a store that lives in the application's database (SQLite, PostgreSQL, MySQL, the
SQLAlchemy and Django stores), :meth:`Attempt.transaction` runs the
completion's compare-and-set ``UPDATE`` inside the transaction that holds the
business writes. Either both commit or neither does: a crash between the
business write and the commit leaves no side effect without its record and no
record without its side effect.

The store opens the transaction and runs the op in it
(:meth:`Store.completion_transaction`); this module checks the attempt and its
outcome and settles the attempt. The sync and async drivers only differ in
``await``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from retrysafe._core.engine import Attempt, Claim

__all__ = ["atransaction", "transaction"]


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


@contextmanager
def transaction(att: Attempt, connection: Any = None) -> Iterator[Any]:
    """See :meth:`Attempt.transaction`."""
    claim = _owned(att)
    with att._engine.store.completion_transaction(connection) as tx:
        yield tx.connection
        op, started, expires_at = _completion(att, claim)
        att._engine._finished(claim, tx.run(op), started, expires_at=expires_at)
    att.finished = True  # committed: leaving the attempt's block writes nothing more


@asynccontextmanager
async def atransaction(att: Attempt, connection: Any = None) -> AsyncIterator[Any]:
    """See :meth:`Attempt.atransaction`."""
    claim = _owned(att)
    async with att._engine.store.acompletion_transaction(connection) as tx:
        yield tx.connection
        op, started, expires_at = _completion(att, claim)
        att._engine._finished(claim, await tx.run(op), started, expires_at=expires_at)
    att.finished = True
