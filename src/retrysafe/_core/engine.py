"""The engine: one state machine for every front door, sync and async.

What decides is written once, as plain code with no I/O (:class:`Plan` in
``plan.py``, the options in ``options.py``, the helpers here); the sync and
async methods are thin shells around it that differ only in ``await``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypedDict, Unpack

from retrysafe._core.metrics import METRICS
from retrysafe._core.options import (
    DEFAULT_LEASE,
    DEFAULT_MAX_BODY,
    DEFAULT_TTL,
    Options,
    positive,
)
from retrysafe._core.plan import BeginOptions, Claim, Plan, Replay, Wait
from retrysafe._model.record import STANDARD, Outcome, Record, Status
from retrysafe.errors import LeaseLostError, StoreUnavailableError
from retrysafe.stores import DEFAULT_STORE_URL, Store, open_store, settles_expiry

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_MAX_BODY",
    "DEFAULT_TTL",
    "Attempt",
    "BeginOptions",
    "Claim",
    "DoorOptions",
    "Engine",
    "Options",
    "Plan",
    "Replay",
    "door_engine",
    "engine_for",
    "run_to_end",
    "shared_store",
]

log = logging.getLogger("retrysafe")

_blank = object.__new__
_perf = time.perf_counter


class _Resends:
    """The resends of one completion or failure that the store could not take.

    They go on, with a backoff, until the lease the claim had left when the first
    send failed has run out (measured on the monotonic clock, so a frozen or stepped
    engine clock cannot stretch it), or ``settle_retry``, whichever is first.
    Only the token-checked writes are resent: one that had applied is refused, and
    :meth:`settled` then reads whether the record holds this attempt's outcome. An
    error that is not ``transient`` (sending again cannot help) is raised at once.
    """

    __slots__ = ("claim", "deadline", "status", "tries", "what")

    def __init__(self, engine: Engine, claim: Claim, what: str) -> None:
        self.claim, self.what, self.tries = claim, what, 0
        self.status = Status.COMPLETED if what == "completion" else Status.FAILED
        left = claim.lease_until - engine.clock()
        if engine.settle_retry is not None:
            left = min(left, engine.settle_retry)
        self.deadline = time.monotonic() + left

    def delay(self, exc: StoreUnavailableError) -> float:
        """How long to wait before the next send; or raise ``exc`` when none is left."""
        delay = min(0.02 * 2**self.tries, 0.5)
        if not exc.transient or time.monotonic() + delay >= self.deadline:
            claim = self.claim
            METRICS.unrecorded(self.what, claim.operation, claim.key, claim.key_hash)
            raise exc
        self.tries += 1
        return delay

    def settled(self, record: Record | None, expires_at: float | None) -> tuple[bool, float | None]:
        """After a refused resend: whether an earlier send had applied (the record
        holds this attempt's token and the status this write sets; a later attempt's
        token would differ), and then the expiry that send gave the record."""
        if record is None or record.token != self.claim.token or record.status is not self.status:
            return False, expires_at
        return True, None if expires_at is None else record.expires_at


class Engine:
    """Claim a key, run once, store the outcome, replay it to every retry.

    ``store`` is a :class:`~retrysafe.stores.Store` or a URL for
    :func:`~retrysafe.open_store`. ``ttl`` is how long a record is kept (a call
    may only narrow it), ``lease`` how long an attempt owns a key before another
    may take it over, ``wait`` how long a duplicate waits for an attempt in
    flight before it gets :class:`InProgressError`. ``final_failures`` makes
    failures final (replayed) instead of retryable. ``retention`` is the class of
    the records it writes (``"financial"`` ones are archived before deletion).
    ``clock`` returns seconds since the epoch. A completion or failure the store
    cannot take (a failover, a cut connection) is sent again until the lease ends
    (or for ``settle_retry`` seconds, whichever is first) before
    :class:`StoreUnavailableError` is raised: otherwise the record would stay in
    flight and a retry would run the handler again once the lease ran out.
    """

    def __init__(
        self,
        store: Store[Any] | str | None = None,
        *,
        ttl: float = DEFAULT_TTL,
        lease: float = DEFAULT_LEASE,
        wait: float = 0.0,
        final_failures: bool = False,
        max_body: int = DEFAULT_MAX_BODY,
        retention: str = STANDARD,
        clock: Callable[[], float] = time.time,
        settle_retry: float | None = None,
    ) -> None:
        options = Options(
            ttl=ttl,
            lease=lease,
            wait=wait,
            retention=retention,
            max_body=max_body,
            settle_retry=settle_retry,
        )
        self.store: Store[Any] = store if isinstance(store, Store) else open_store(store)
        self.ttl = DEFAULT_TTL if options.ttl is None else options.ttl
        self.lease = DEFAULT_LEASE if options.lease is None else options.lease
        self.wait = 0.0 if options.wait is None else options.wait
        self.final_failures = final_failures
        self.max_body = DEFAULT_MAX_BODY if options.max_body is None else options.max_body
        self.retention = STANDARD if options.retention is None else options.retention
        self.clock = clock
        self.settle_retry = options.settle_retry
        self._expiry_store: Store[Any] | None = None
        self._settles = False

    def __repr__(self) -> str:
        return f"<Engine store={self.store!r} ttl={self.ttl:g}s lease={self.lease:g}s>"

    @property
    def settles_expiry(self) -> bool:
        """Whether the store can move a record's expiry as it settles it (see
        :func:`~retrysafe.stores.settles_expiry`), worked out once per store."""
        store = self.store
        if self._expiry_store is not store:
            self._settles, self._expiry_store = settles_expiry(store), store
        return self._settles

    # -- shared, I/O-free pieces -----------------------------------------------

    def _outcome_error(self, outcome: Outcome) -> Exception | None:
        """Why ``outcome`` cannot be stored, or None.

        The handler has run by then, so the attempt is failed *finally*: a retry
        gets the failure replayed instead of running the side effect again.
        """
        if not isinstance(outcome, Outcome):
            return TypeError(
                f"outcome must be an Outcome, not {type(outcome).__name__}; "
                "the attempt was marked failed (final)"
            )
        if len(outcome.body) > self.max_body:
            return ValueError(
                f"outcome body of {len(outcome.body)} bytes exceeds max_body={self.max_body}; "
                "the attempt was marked failed (final)"
            )
        return None

    def _final(self, final: bool | None) -> bool:
        return self.final_failures if final is None else bool(final)

    def _lease_until(self, lease: float | None, now: float) -> float:
        return now + (self.lease if lease is None else positive("lease", lease))

    def _finished(
        self,
        claim: Claim,
        ok: bool,
        started: float,
        final: bool | None = None,
        expires_at: float | None = None,
    ) -> None:
        """After the store call (begun at ``started``) of a completion, or of a
        failure (``final`` given), which gave the record ``expires_at`` if not None:
        report it, or refuse it as stale."""
        if not ok:
            self._lost(claim, "completion" if final is None else "failure")
        if expires_at is not None:
            claim.expires_at = expires_at
        METRICS.settled(
            "complete" if final is None else "fail",
            claim.operation,
            claim.key_hash,
            _perf() - started,
            started - claim.started,
        )
        if final is not None:
            METRICS.failed(claim.operation, claim.key, claim.key_hash, claim.attempts, final)

    @staticmethod
    def _renewed(claim: Claim, until: float) -> None:
        claim.lease_until = until
        if until > claim.expires_at:  # the store moved the record's expiry with it
            claim.expires_at = until

    @staticmethod
    def _lost(claim: Claim, what: str) -> None:
        METRICS.stale(what, claim.operation, claim.key, claim.key_hash)
        log.warning(
            "retrysafe: stale %s refused: lease lost (operation=%s key_hash=%s attempt=%d)",
            what,
            claim.operation,
            claim.key_hash[:16],
            claim.attempts,
        )
        raise LeaseLostError(
            f"{what} refused: this attempt's lease ran out and another attempt owns the key",
            key=claim.key,
        )

    # -- sync API ------------------------------------------------------------

    def begin(self, key: str, **options: Unpack[BeginOptions]) -> Claim | Replay:
        """Claim ``key``: a :class:`Claim` means run now, a :class:`Replay` means answer with it.

        Options (all keyword): ``operation``, ``scope``, ``fingerprint``,
        ``request_id``, ``ttl`` (may only narrow the engine's), ``lease``,
        ``wait``, ``metadata``, ``request_payload``, ``ttl_from`` (``"claim"``,
        the default: the record expires ``ttl`` after the claim; ``"completion"``:
        ``ttl`` after the answer is stored, on a store that can say so, see
        :attr:`Store.settle_expiry`). Raises
        :class:`InvalidKeyError` (nothing written), :class:`InProgressError`,
        :class:`FingerprintMismatchError` or :class:`StoreUnavailableError`.
        """
        plan = _blank(Plan)  # Plan(self, key, **options), without type.__call__'s detour
        plan.fill(self, key, **options)
        return self._begin(plan)

    def _begin(self, plan: Plan) -> Claim | Replay:
        while True:
            record = plan.record(self.clock())
            started = _perf()
            try:
                result = self.store.claim(record)
            except StoreUnavailableError as exc:
                plan.unreachable(exc)
                raise
            answer = plan.answer(result, record, started)
            if not isinstance(answer, Wait):
                return answer
            time.sleep(answer.seconds)

    def complete(self, claim: Claim, outcome: Outcome) -> None:
        """Store the outcome; :class:`LeaseLostError` if the claim no longer owns the key."""
        if type(outcome) is not Outcome or len(outcome.body) > self.max_body:
            error = self._outcome_error(outcome)
            if error is not None:
                self.fail(claim, final=True)
                raise error
        started = _perf()
        write = self.store.complete
        expires_at = None
        try:
            if claim.answer_ttl is None:
                ok = write(claim.key_hash, claim.token, outcome, self.clock())
            else:
                now = self.clock()
                expires_at = claim.settled_expiry(now)
                ok = _settle(write, claim, now, expires_at, outcome)
        except StoreUnavailableError as exc:
            try:
                ok, expires_at = self._resend(claim, "completion", exc, write, True, outcome)
            except StoreUnavailableError as last:
                if not last.transient:
                    with contextlib.suppress(StoreUnavailableError):
                        _settle(self.store.fail, claim, *self._refusal(claim))
                raise
        self._finished(claim, ok, started, expires_at=expires_at)

    def fail(
        self, claim: Claim, outcome: Outcome | None = None, *, final: bool | None = None
    ) -> None:
        """Mark the attempt failed: retryable unless ``final`` (default: the engine's policy)."""
        final = self._final(final)
        started = _perf()
        write = self.store.fail
        now = self.clock()
        expires_at = claim.settled_expiry(now) if final else None  # nothing kept otherwise
        try:
            ok = _settle(write, claim, now, expires_at, outcome, final)
        except StoreUnavailableError as exc:
            ok, expires_at = self._resend(claim, "failure", exc, write, final, outcome, final)
        self._finished(claim, ok, started, final, expires_at)

    def _refusal(self, claim: Claim) -> tuple[float, float | None, None, bool]:
        """After the store refused a completion for good (``transient`` false: an answer
        larger than the server takes, say), on its first send or on a resend: the
        handler ran, so the attempt fails finally without its answer, as an answer over
        ``max_body`` does, and a retry gets the failure. These are the arguments of
        that one ``_settle`` of the store's ``fail``; its own errors are swallowed (the
        caller raises the refusal), and if it fails the record stays in flight until
        its lease ends."""
        now = self.clock()
        return now, claim.settled_expiry(now), None, True

    def _resend(
        self,
        claim: Claim,
        what: str,
        exc: StoreUnavailableError,
        write: Callable[..., bool],
        keeps: bool,
        *args: Any,
    ) -> tuple[bool, float | None]:
        """After ``exc`` on the first send: ``write(key_hash, token, *args, now)`` (a
        completion or failure) again while the store is unreachable (see
        :class:`_Resends`); ``(ok, the record's new expiry or None)``. ``keeps``: the
        write may move the expiry (a completion or a final failure)."""
        resends = _Resends(self, claim, what)
        while True:
            time.sleep(resends.delay(exc))
            try:
                now = self.clock()
                expires_at = claim.settled_expiry(now) if keeps else None
                if _settle(write, claim, now, expires_at, *args):
                    return True, expires_at
                return resends.settled(self.store.get(claim.key_hash), expires_at)
            except StoreUnavailableError as again:
                exc = again

    def renew(self, claim: Claim, lease: float | None = None) -> None:
        """Extend a live lease to ``lease`` seconds from now (default: the engine's).

        A lease past the record's expiry moves the expiry with it: a running
        attempt never expires under its owner.
        """
        if not self.try_renew(claim, lease):
            self._lost(claim, "renewal")

    def try_renew(self, claim: Claim, lease: float | None = None) -> bool:
        """:meth:`renew` that answers False (and logs nothing) when the lease was lost."""
        now = self.clock()
        until = self._lease_until(lease, now)
        started = _perf()
        if not self.store.renew(claim.key_hash, claim.token, until, now):
            return False
        METRICS.store_call("renew", time.perf_counter() - started)
        self._renewed(claim, until)
        return True

    # -- async API: the same shells with await -----------------------------------

    async def abegin(self, key: str, **options: Unpack[BeginOptions]) -> Claim | Replay:
        """Async :meth:`begin`."""
        plan = _blank(Plan)
        plan.fill(self, key, **options)
        return await self._abegin(plan)

    async def _abegin(self, plan: Plan) -> Claim | Replay:
        while True:
            record = plan.record(self.clock())
            started = _perf()
            try:
                result = await self.store.aclaim(record)
            except StoreUnavailableError as exc:
                plan.unreachable(exc)
                raise
            answer = plan.answer(result, record, started)
            if not isinstance(answer, Wait):
                return answer
            await asyncio.sleep(answer.seconds)

    async def acomplete(self, claim: Claim, outcome: Outcome) -> None:
        """Async :meth:`complete`."""
        if type(outcome) is not Outcome or len(outcome.body) > self.max_body:
            error = self._outcome_error(outcome)
            if error is not None:
                await self.afail(claim, final=True)
                raise error
        started = _perf()
        write = self.store.acomplete
        expires_at = None
        try:
            if claim.answer_ttl is None:
                ok = await write(claim.key_hash, claim.token, outcome, self.clock())
            else:
                now = self.clock()
                expires_at = claim.settled_expiry(now)
                ok = await _settle(write, claim, now, expires_at, outcome)
        except StoreUnavailableError as exc:
            try:
                ok, expires_at = await self._aresend(claim, "completion", exc, write, True, outcome)
            except StoreUnavailableError as last:
                if not last.transient:
                    with contextlib.suppress(StoreUnavailableError):
                        await _settle(self.store.afail, claim, *self._refusal(claim))
                raise
        self._finished(claim, ok, started, expires_at=expires_at)

    async def afail(
        self, claim: Claim, outcome: Outcome | None = None, *, final: bool | None = None
    ) -> None:
        """Async :meth:`fail`."""
        final = self._final(final)
        started = _perf()
        write = self.store.afail
        now = self.clock()
        expires_at = claim.settled_expiry(now) if final else None  # nothing kept otherwise
        try:
            ok = await _settle(write, claim, now, expires_at, outcome, final)
        except StoreUnavailableError as exc:
            ok, expires_at = await self._aresend(
                claim, "failure", exc, write, final, outcome, final
            )
        self._finished(claim, ok, started, final, expires_at)

    async def _aresend(
        self,
        claim: Claim,
        what: str,
        exc: StoreUnavailableError,
        write: Callable[..., Coroutine[Any, Any, bool]],
        keeps: bool,
        *args: Any,
    ) -> tuple[bool, float | None]:
        """Async :meth:`_resend`."""
        resends = _Resends(self, claim, what)
        while True:
            await asyncio.sleep(resends.delay(exc))
            try:
                now = self.clock()
                expires_at = claim.settled_expiry(now) if keeps else None
                if await _settle(write, claim, now, expires_at, *args):
                    return True, expires_at
                return resends.settled(await self.store.aget(claim.key_hash), expires_at)
            except StoreUnavailableError as again:
                exc = again

    async def arenew(self, claim: Claim, lease: float | None = None) -> None:
        """Async :meth:`renew`."""
        now = self.clock()
        until = self._lease_until(lease, now)
        started = _perf()
        if not await self.store.arenew(claim.key_hash, claim.token, until, now):
            self._lost(claim, "renewal")
        METRICS.store_call("renew", time.perf_counter() - started)
        self._renewed(claim, until)

    # -- context manager -----------------------------------------------------

    def attempt(self, key: str, **options: Unpack[BeginOptions]) -> Attempt:
        """``with`` / ``async with`` form of begin → complete | fail.

        ::

            with engine.attempt(key, operation="charge", fingerprint=fp) as att:
                if att.replay:
                    return att.replay.outcome.value
                att.outcome = Outcome.json(charge())

        Leaving the block with an exception fails the attempt (and re-raises);
        leaving it without setting ``outcome`` fails it and raises ``RuntimeError``.
        ``options`` are those of :meth:`begin`.
        """
        return Attempt(self, Plan(self, key, **options))

    def close(self) -> None:
        self.store.close()

    async def aclose(self) -> None:
        await self.store.aclose()


def _settle(
    write: Callable[..., Any], claim: Claim, now: float, expires_at: float | None, *args: Any
) -> Any:
    """``write(key_hash, token, *args, now)``: a completion or failure at ``now``, with
    the record's new expiry ``expires_at`` if one is given."""
    if expires_at is None:
        return write(claim.key_hash, claim.token, *args, now)
    return write(claim.key_hash, claim.token, *args, now, expires_at)


_stores: dict[str, Store[Any]] = {}
_stores_lock = threading.Lock()


def shared_store(store: Store[Any] | str | None) -> Store[Any]:
    """``store`` itself, or the one store (one pool) of this process for its URL."""
    if isinstance(store, Store):
        return store
    url = store or os.environ.get("RETRYSAFE_STORE") or DEFAULT_STORE_URL
    with _stores_lock:
        if url not in _stores:
            _stores[url] = open_store(url)
        return _stores[url]


def engine_for(
    store: Store[Any] | Engine | str | None, *, share: bool = False, **options: Any
) -> Engine:
    """A front door's engine: ``store`` itself if it is an :class:`Engine`, else a
    new one over it with the ``options`` that are not None (the rest default).

    ``share``: a URL opens the process-wide store for it (see :func:`shared_store`).
    """
    if isinstance(store, Engine):
        return store
    if share:
        store = shared_store(store)
    return Engine(store, **{k: v for k, v in options.items() if v is not None})


class DoorOptions(TypedDict, total=False):
    """The engine options of a protocol door (A2A, MCP): seconds of ``ttl``,
    ``lease`` and ``wait``, the ``operation`` in the key hash, the records'
    ``retention`` class, the largest answer kept (``max_body``)."""

    ttl: float | None
    lease: float | None
    wait: float | None
    operation: str
    retention: str | None
    max_body: int | None


def door_engine(
    store: Store[Any] | Engine | str | None, operation: str, /, **options: Unpack[DoorOptions]
) -> tuple[Engine, Plan]:
    """The engine of a protocol door over ``store`` (a store, URL or engine; URLs
    shared with ``@idempotent``), and the plan every call derives from: the options
    validated once (``operation`` is the default of ``options["operation"]``).
    :class:`TypeError` for an option it does not know."""
    unknown = sorted(set(options) - set(DoorOptions.__annotations__))
    if unknown:
        raise TypeError(f"unexpected option {unknown[0]!r}")
    ttl, lease, retention = options.get("ttl"), options.get("lease"), options.get("retention")
    max_body = options.get("max_body")
    engine = engine_for(
        store, share=True, ttl=ttl, lease=lease, retention=retention, max_body=max_body
    )
    plan = Plan(
        engine,
        "-",
        operation=options.get("operation", operation),
        ttl=ttl,
        lease=lease,
        wait=options.get("wait"),
        retention=retention,
    )
    return engine, plan


class Attempt:
    """One attempt at an operation; see :meth:`Engine.attempt`.

    Set ``outcome`` to complete the claim on leaving the block. ``final = True``
    makes a failure on leaving (an exception) final instead of the engine's
    policy: for a handler that ran but whose answer cannot be stored.

    A front door that must record the outcome before the block ends (before the
    last byte of an answer leaves) calls :meth:`complete` or :meth:`fail` (or
    their async twins) inside it; leaving the block then writes nothing more.
    """

    __slots__ = ("_engine", "_plan", "claim", "final", "finished", "outcome", "replay")

    def __init__(self, engine: Engine, plan: Plan) -> None:
        self._engine, self._plan = engine, plan
        self.claim: Claim | None = None
        self.replay: Replay | None = None
        self.outcome: Outcome | None = None
        self.final: bool | None = None
        self.finished = False  # completed or failed: leaving the block writes nothing more

    @property
    def settled(self) -> bool:
        """The former name of :attr:`finished`, kept for code that reads or sets it."""
        return self.finished

    @settled.setter
    def settled(self, value: bool) -> None:
        self.finished = value

    def _owned(self) -> Claim:
        if self.claim is None or self.finished:
            raise RuntimeError("this attempt holds no unsettled claim")
        self.finished = True  # even if the store call fails: the block must not retry it
        return self.claim

    def complete(self, outcome: Outcome) -> None:
        """Store ``outcome`` now (see :meth:`Engine.complete`)."""
        self._engine.complete(self._owned(), outcome)

    def fail(self, outcome: Outcome | None = None, *, final: bool | None = None) -> None:
        """Mark the attempt failed now (see :meth:`Engine.fail`)."""
        self._engine.fail(self._owned(), outcome, final=final)

    async def acomplete(self, outcome: Outcome) -> None:
        """Async :meth:`complete`, shielded from cancellation."""
        # (_shielded's body, inlined: one coroutine less on every first call)
        engine = self._engine
        started = _start(engine.acomplete(self._owned(), outcome), engine.store.drive_inline)
        if isinstance(started, asyncio.Future):
            await asyncio.shield(started)

    async def afail(self, outcome: Outcome | None = None, *, final: bool | None = None) -> None:
        """Async :meth:`fail`, shielded from cancellation."""
        engine = self._engine
        started = _start(
            engine.afail(self._owned(), outcome, final=final), engine.store.drive_inline
        )
        if isinstance(started, asyncio.Future):
            await asyncio.shield(started)

    def transaction(self, connection: Any = None) -> contextlib.AbstractContextManager[Any]:
        """Complete inside the application's own database transaction (SQLite, PostgreSQL,
        MySQL/MariaDB, a SQLAlchemy ``Session``, the Django ORM).

        ::

            with engine.attempt(key, operation="order") as att:
                if att.replay:
                    return att.replay.outcome.value
                with att.transaction() as conn:
                    conn.execute("INSERT INTO orders (cart_mandate_id) VALUES (?)", (mid,))
                    att.outcome = Outcome.json({"order": mid})

        Yields ``connection`` or, by default, a connection of the store's own:
        with the SQLite, PostgreSQL and MySQL stores a ``sqlite3`` connection to
        the store's file, a psycopg connection or a PyMySQL connection to its
        database, not inside a transaction; with ``SQLAlchemyStore`` a ``Session``
        or ``Connection`` of its engine; with a ``django://`` store,
        ``transaction.atomic(using=alias)`` on the thread's connection. On leaving
        the block the completion is written in that transaction and committed
        with the block's writes: both or neither. An exception, or a lost lease
        (:class:`LeaseLostError`), rolls everything back and the attempt fails as
        usual. :class:`TypeError` for a store outside the application's database
        (Redis, memory).
        """
        from retrysafe._core.transactions import transaction

        return transaction(self, connection)

    def atransaction(self, connection: Any = None) -> contextlib.AbstractAsyncContextManager[Any]:
        """Async :meth:`transaction`: a psycopg ``AsyncConnection`` (PostgreSQL), or an
        ``AsyncSession``/``AsyncConnection`` (``SQLAlchemyStore`` on an AsyncEngine)."""
        from retrysafe._core.transactions import atransaction

        return atransaction(self, connection)

    def _started(self, answer: Claim | Replay) -> Attempt:
        if isinstance(answer, Replay):
            self.replay = answer
        else:
            self.claim = answer
        return self

    def _to_store(self, exc: BaseException | None) -> Outcome | None:
        """The outcome leaving the block completes the claim with; None: fail it."""
        return self.outcome if exc is None else None

    @staticmethod
    def _failed(exc: BaseException | None, error: Exception | None) -> None:
        """After failing the claim: report a failure to fail, or a missing outcome."""
        if error is not None:
            if exc is None:
                raise error
            log.warning("retrysafe: could not mark a failed attempt: %s", error)
        if exc is None:
            raise RuntimeError("attempt left without an outcome; it was marked failed")

    def __enter__(self) -> Attempt:
        return self._started(self._engine._begin(self._plan))

    def __exit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        claim = self.claim
        if claim is None or self.finished:
            return
        outcome = self._to_store(exc)
        if outcome is not None:
            self._engine.complete(claim, outcome)
            return
        error = None
        try:
            self._engine.fail(claim, final=self.final)
        except (LeaseLostError, StoreUnavailableError) as err:
            error = err
        self._failed(exc, error)

    # Async: the store calls are shielded from cancellation (a client that
    # disconnects cancels its request's task). A claim that lands after its task
    # was cancelled is failed at once, so retries are not told "in flight" for a
    # whole lease; a completion under way finishes, so the side effect that ran
    # is recorded and never runs again.

    async def __aenter__(self) -> Attempt:
        engine = self._engine
        task = _start(engine._abegin(self._plan), engine.store.drive_inline)
        if not isinstance(task, asyncio.Future):
            return self._started(task)  # answered without suspending: nothing to shield
        try:
            return self._started(await asyncio.shield(task))
        except asyncio.CancelledError:
            task.add_done_callback(self._release_orphan)
            raise

    def _release_orphan(self, task: asyncio.Future[Claim | Replay]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        claim = task.result()
        if isinstance(claim, Claim):
            run_to_end(self._engine.afail(claim))

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        claim = self.claim
        if claim is None or self.finished:
            return
        outcome = self._to_store(exc)
        if outcome is not None:
            await _shielded(self._engine.acomplete(claim, outcome), self._engine.store.drive_inline)
            return
        error = None
        try:
            await _shielded(
                self._engine.afail(claim, final=self.final), self._engine.store.drive_inline
            )
        except (LeaseLostError, StoreUnavailableError) as err:
            error = err
        self._failed(exc, error)


#: Store calls that must finish even if their caller was cancelled.
_pending: set[asyncio.Future[Any]] = set()

# _start(coro, inline) runs ``coro`` up to its first suspension. A call that needs no
# I/O wait (the memory store, a cached answer) returns its result there, with no extra
# turn of the event loop; one that suspends goes on in a task of its own that no
# cancellation reaches (see run_to_end), and that task is returned. Python 3.12+
# does this with a public mechanism, an eager task, which runs that first step as
# the new task (its current task and its own context). 3.11 has none: there the
# coroutine can only be driven by hand, and its first step then runs as the
# *caller's* task, so a timeout it enters there (redis-py's reads, psycopg's waits)
# would later cancel the caller instead of the read, and a context variable it sets
# (a tracing span) would be reset in another context. So on 3.11 the first step is
# taken by hand only for a store whose class says its async calls enter nothing of
# the kind (``Store.drive_inline``: the memory and SQLite stores); every other store
# call gets its task at once. Chosen once, here, by version.
if sys.version_info >= (3, 12):

    def _start(coro: Coroutine[Any, Any, Any], inline: bool) -> Any:
        """Run ``coro`` up to its first suspension: its result, or its task."""
        task = asyncio.Task(coro, loop=asyncio.get_running_loop(), eager_start=True)
        if task.done():
            return task.result()
        return _keep(task)

else:

    def _start(coro: Coroutine[Any, Any, Any], inline: bool) -> Any:
        """Run ``coro`` up to its first suspension (by hand only if ``inline``): its
        result, or its task."""
        if not inline:
            return run_to_end(coro)
        try:
            waiting = coro.send(None)
        except StopIteration as stop:
            return stop.value
        except BaseException:
            coro.close()
            raise
        return run_to_end(_resume(coro, waiting))

    async def _resume(coro: Coroutine[Any, Any, Any], waiting: Any) -> Any:
        """Drive a started coroutine to its end, as a task would."""
        while True:
            if waiting is None:  # a bare yield (asyncio.sleep(0))
                await asyncio.sleep(0)
            else:
                # What asyncio.Task does with a future its coroutine yields.
                waiting._asyncio_future_blocking = False
                # Its outcome reaches ``coro`` when it resumes: ignore it here.
                with contextlib.suppress(BaseException):
                    await waiting
            try:
                if waiting is None or waiting.done():
                    waiting = coro.send(None)
                else:  # this task itself was cancelled (the loop is closing)
                    waiting = coro.throw(asyncio.CancelledError())
            except StopIteration as stop:
                return stop.value


async def _shielded(coro: Coroutine[Any, Any, Any], inline: bool) -> Any:
    """Await ``coro``; if the caller is cancelled meanwhile, ``coro`` still runs to its end
    (``inline``: see :func:`_start`)."""
    started = _start(coro, inline)
    if isinstance(started, asyncio.Future):
        return await asyncio.shield(started)
    return started


def run_to_end(coro: Any) -> asyncio.Future[Any]:
    """A task for ``coro`` that runs to its end whoever waits for it (failures logged)."""
    return _keep(asyncio.ensure_future(coro))


def _keep(task: asyncio.Future[Any]) -> asyncio.Future[Any]:
    """Hold ``task`` until it ends, so nothing collects it unfinished."""
    _pending.add(task)
    task.add_done_callback(_forget)
    return task


def _forget(task: asyncio.Future[Any]) -> None:
    _pending.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.debug("retrysafe: store call of a cancelled attempt failed: %r", task.exception())
