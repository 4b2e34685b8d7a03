"""The engine: one state machine for every front door, sync and async.

Each operation is written once, as a generator that yields store calls
(``("claim", args)``) and sleeps (``("sleep", seconds)``); :func:`_drive` runs
it with blocking calls and :func:`_adrive` with awaits. The decisions the
generators make are the plain functions of :mod:`retrysafe._decide`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeAlias

from ._decide import Verdict, retry_after, verdict
from ._errors import (
    FingerprintMismatchError,
    InProgressError,
    LeaseLostError,
    StoreUnavailableError,
)
from ._keys import key_hash, validate_key
from ._record import ClaimResult, Outcome, Record, Status
from .stores import Store, open_store

__all__ = ["DEFAULT_LEASE", "DEFAULT_TTL", "Attempt", "Claim", "Engine", "Replay"]

log = logging.getLogger("retrysafe")

DEFAULT_TTL = 24 * 3600.0
DEFAULT_LEASE = 30.0
DEFAULT_MAX_BODY = 1 << 20

_Effect: TypeAlias = tuple[str, tuple[Any, ...]]
_Flow: TypeAlias = Generator[_Effect, Any, Any]


@dataclass(slots=True)
class Claim:
    """Ownership of a key for one attempt; pass it to complete, fail or renew."""

    key: str
    key_hash: str
    scope: str
    operation: str
    fingerprint: str
    token: str
    lease_until: float
    expires_at: float
    attempts: int
    took_over: Status | None
    request_id: str | None


@dataclass(slots=True)
class Replay:
    """A finished record to answer with instead of running again."""

    record: Record

    @property
    def outcome(self) -> Outcome | None:
        return self.record.outcome

    @property
    def failed(self) -> bool:
        """True when the record is a final failure (replayed like a result)."""
        return self.record.status is Status.FAILED


class _Tokens:
    """Fencing tokens: a random per-process prefix and a counter (fresh after fork).

    Tokens must never repeat; they need not be secret (they never leave the
    store). This is four times cheaper than a random token per claim.
    """

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self.prefix = os.urandom(10).hex()
        self.counter = itertools.count()

    def __call__(self) -> str:
        return f"{self.prefix}{next(self.counter):x}"


_new_token = _Tokens()


def _drive(flow: _Flow, store: Store[Any]) -> Any:
    """Run a flow with blocking store calls; store errors are thrown into it."""
    send: Callable[[Any], _Effect] = flow.send
    value: Any = None
    while True:
        try:
            name, args = send(value)
        except StopIteration as stop:
            return stop.value
        try:
            value = time.sleep(*args) if name == "sleep" else getattr(store, name)(*args)
            send = flow.send
        except Exception as exc:
            value, send = exc, flow.throw


async def _adrive(flow: _Flow, store: Store[Any]) -> Any:
    """Run a flow from a coroutine; the twin of :func:`_drive`."""
    send: Callable[[Any], _Effect] = flow.send
    value: Any = None
    while True:
        try:
            name, args = send(value)
        except StopIteration as stop:
            return stop.value
        try:
            if name == "sleep":
                value = await asyncio.sleep(*args)
            else:
                value = await getattr(store, "a" + name)(*args)
            send = flow.send
        except Exception as exc:
            value, send = exc, flow.throw


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
    return value


def _str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, not {type(value).__name__}")
    return value


class Engine:
    """Claim a key, run once, store the outcome, replay it to every retry.

    ``store`` is a :class:`~retrysafe.stores.Store` or a URL for
    :func:`~retrysafe.open_store`. ``ttl`` is how long a record is kept (a call
    may only narrow it), ``lease`` how long an attempt owns a key before another
    may take it over, ``wait`` how long a duplicate waits for an attempt in
    flight before it gets :class:`InProgressError`. ``final_failures`` makes
    failures final (replayed) instead of retryable. ``clock`` returns seconds
    since the epoch.
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
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store: Store[Any] = store if isinstance(store, Store) else open_store(store)
        self.ttl = _positive("ttl", ttl)
        self.lease = _positive("lease", lease)
        if wait < 0:
            raise ValueError("wait must not be negative")
        self.wait = float(wait)
        self.final_failures = final_failures
        self.max_body = int(max_body)
        self.clock = clock

    def __repr__(self) -> str:
        return f"<Engine store={self.store!r} ttl={self.ttl:g}s lease={self.lease:g}s>"

    # -- the flows (written once) ----------------------------------------------

    def _begin(
        self,
        key: str,
        operation: str,
        scope: str,
        fingerprint: str,
        request_id: str | None,
        ttl: float | None,
        lease: float | None,
        wait: float | None,
        metadata: dict[str, Any] | None,
        request_payload: bytes | None,
    ) -> _Flow:
        validate_key(key)
        _str("operation", operation)
        _str("scope", scope)
        _str("fingerprint", fingerprint)
        ttl = self.ttl if ttl is None else min(_positive("ttl", ttl), self.ttl)
        lease = min(self.lease if lease is None else _positive("lease", lease), ttl)
        wait = self.wait if wait is None else max(0.0, float(wait))
        kh = key_hash(scope, operation, key)
        meta = dict(metadata) if metadata else {}
        deadline: float | None = None
        delay = 0.01
        while True:
            now = self.clock()
            token = _new_token()
            record = Record(
                kh, key, scope, operation, fingerprint, Status.PROCESSING, token, now + lease,
                now + ttl, now, now, None, 1, request_id, False, None, request_payload, meta,
            )  # fmt: skip
            result: ClaimResult = yield ("claim", (record,))
            if result.claimed:
                return Claim(
                    key, kh, scope, operation, fingerprint, token, record.lease_until,
                    record.expires_at, result.attempts, result.took_over, request_id,
                )  # fmt: skip
            found = result.record
            assert found is not None
            decision = verdict(found, fingerprint)
            if decision is Verdict.REPLAY:
                return Replay(found)
            if decision is Verdict.CONFLICT:
                raise FingerprintMismatchError(
                    "idempotency key was already used with a different request",
                    key=key,
                    original_fingerprint=found.fingerprint,
                    fingerprint=fingerprint,
                )
            deadline = now + wait if deadline is None else deadline
            if now >= deadline:
                raise InProgressError(
                    "a request with this idempotency key is still in progress",
                    key=key,
                    retry_after=retry_after(found, now),
                )
            yield ("sleep", (min(delay, deadline - now, max(found.lease_until - now, 0.001)),))
            delay = min(delay * 2, 0.25)

    def _complete(self, claim: Claim, outcome: Outcome) -> _Flow:
        if not isinstance(outcome, Outcome):
            raise TypeError(f"outcome must be an Outcome, not {type(outcome).__name__}")
        if len(outcome.body) > self.max_body:
            yield from self._fail(claim, None, None)
            raise ValueError(
                f"outcome body of {len(outcome.body)} bytes exceeds max_body={self.max_body}; "
                "the attempt was marked failed"
            )
        ok = yield ("complete", (claim.key_hash, claim.token, outcome, self.clock()))
        if not ok:
            self._lost(claim, "completion")

    def _fail(self, claim: Claim, outcome: Outcome | None, final: bool | None) -> _Flow:
        final = self.final_failures if final is None else final
        ok = yield ("fail", (claim.key_hash, claim.token, outcome, final, self.clock()))
        if not ok:
            self._lost(claim, "failure")

    def _renew(self, claim: Claim, lease: float | None) -> _Flow:
        now = self.clock()
        lease_until = min(now + (self.lease if lease is None else _positive("lease", lease)),
                          claim.expires_at)  # fmt: skip
        ok = yield ("renew", (claim.key_hash, claim.token, lease_until, now))
        if not ok:
            self._lost(claim, "renewal")
        claim.lease_until = lease_until

    @staticmethod
    def _lost(claim: Claim, what: str) -> None:
        log.warning(
            "retrysafe: stale %s refused: lease lost (operation=%s key_hash=%s attempt=%d)",
            what, claim.operation, claim.key_hash[:16], claim.attempts,
        )  # fmt: skip
        raise LeaseLostError(
            f"{what} refused: this attempt's lease ran out and another attempt owns the key",
            key=claim.key,
        )

    # -- sync API ------------------------------------------------------------

    def begin(
        self,
        key: str,
        *,
        operation: str = "",
        scope: str = "",
        fingerprint: str = "",
        request_id: str | None = None,
        ttl: float | None = None,
        lease: float | None = None,
        wait: float | None = None,
        metadata: dict[str, Any] | None = None,
        request_payload: bytes | None = None,
    ) -> Claim | Replay:
        """Claim ``key``; a :class:`Claim` means run now, a :class:`Replay` means answer with it.

        Raises :class:`InvalidKeyError` (nothing written), :class:`InProgressError`,
        :class:`FingerprintMismatchError` or :class:`StoreUnavailableError`.
        """
        return _drive(
            self._begin(key, operation, scope, fingerprint, request_id, ttl, lease, wait,
                        metadata, request_payload),
            self.store,
        )  # fmt: skip

    def complete(self, claim: Claim, outcome: Outcome) -> None:
        """Store the outcome; :class:`LeaseLostError` if the claim no longer owns the key."""
        _drive(self._complete(claim, outcome), self.store)

    def fail(
        self, claim: Claim, outcome: Outcome | None = None, *, final: bool | None = None
    ) -> None:
        """Mark the attempt failed: retryable unless ``final`` (default: the engine's policy)."""
        _drive(self._fail(claim, outcome, final), self.store)

    def renew(self, claim: Claim, lease: float | None = None) -> None:
        """Extend a live lease by ``lease`` seconds from now (never past the record's expiry)."""
        _drive(self._renew(claim, lease), self.store)

    # -- async API -------------------------------------------------------------

    async def abegin(
        self,
        key: str,
        *,
        operation: str = "",
        scope: str = "",
        fingerprint: str = "",
        request_id: str | None = None,
        ttl: float | None = None,
        lease: float | None = None,
        wait: float | None = None,
        metadata: dict[str, Any] | None = None,
        request_payload: bytes | None = None,
    ) -> Claim | Replay:
        """Async :meth:`begin`."""
        return await _adrive(
            self._begin(key, operation, scope, fingerprint, request_id, ttl, lease, wait,
                        metadata, request_payload),
            self.store,
        )  # fmt: skip

    async def acomplete(self, claim: Claim, outcome: Outcome) -> None:
        """Async :meth:`complete`."""
        await _adrive(self._complete(claim, outcome), self.store)

    async def afail(
        self, claim: Claim, outcome: Outcome | None = None, *, final: bool | None = None
    ) -> None:
        """Async :meth:`fail`."""
        await _adrive(self._fail(claim, outcome, final), self.store)

    async def arenew(self, claim: Claim, lease: float | None = None) -> None:
        """Async :meth:`renew`."""
        await _adrive(self._renew(claim, lease), self.store)

    # -- context manager -----------------------------------------------------

    def attempt(self, key: str, **options: Any) -> Attempt:
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
        return Attempt(self, key, options)

    def close(self) -> None:
        self.store.close()

    async def aclose(self) -> None:
        await self.store.aclose()


class Attempt:
    """One attempt at an operation; see :meth:`Engine.attempt`."""

    __slots__ = ("_engine", "_key", "_options", "claim", "outcome", "replay")

    def __init__(self, engine: Engine, key: str, options: dict[str, Any]) -> None:
        self._engine, self._key, self._options = engine, key, options
        self.claim: Claim | None = None
        self.replay: Replay | None = None
        self.outcome: Outcome | None = None

    def _start(self) -> _Flow:
        o = self._options
        result = yield from self._engine._begin(
            self._key, o.get("operation", ""), o.get("scope", ""), o.get("fingerprint", ""),
            o.get("request_id"), o.get("ttl"), o.get("lease"), o.get("wait"),
            o.get("metadata"), o.get("request_payload"),
        )  # fmt: skip
        if isinstance(result, Replay):
            self.replay = result
        else:
            self.claim = result
        return self

    def _settle(self, exc: BaseException | None) -> _Flow:
        claim, engine = self.claim, self._engine
        if claim is None:
            return
        if exc is None and self.outcome is not None:
            yield from engine._complete(claim, self.outcome)
            return
        try:
            yield from engine._fail(claim, None, None)
        except (LeaseLostError, StoreUnavailableError) as err:
            if exc is None:
                raise
            log.warning("retrysafe: could not mark a failed attempt: %s", err)
        if exc is None:
            raise RuntimeError("attempt left without an outcome; it was marked failed")

    def __enter__(self) -> Attempt:
        return _drive(self._start(), self._engine.store)

    def __exit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _drive(self._settle(exc), self._engine.store)

    async def __aenter__(self) -> Attempt:
        return await _adrive(self._start(), self._engine.store)

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await _adrive(self._settle(exc), self._engine.store)
