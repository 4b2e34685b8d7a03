"""One claim, decided with no I/O: its validated inputs, the record it writes, and
what the store's answer means (a :class:`Claim`, a :class:`Replay`, or a
:class:`Wait` before claiming again)."""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict, Unpack

from retrysafe._core.metrics import METRICS
from retrysafe._core.options import Options
from retrysafe._model.decide import Verdict, retry_after, verdict
from retrysafe._model.hashing import is_key, key_hash, validate_key
from retrysafe._model.record import ClaimResult, Outcome, Record, Status, stored_request_id
from retrysafe.errors import (
    FingerprintMismatchError,
    InProgressError,
    InvalidKeyError,
    StoreUnavailableError,
)

if TYPE_CHECKING:
    from retrysafe._core.engine import Engine

#: A slots instance with no field set yet (the hot path fills each one by name).
_blank = object.__new__
_perf = time.perf_counter

__all__ = ["BeginOptions", "Claim", "Plan", "Replay", "Wait"]


class BeginOptions(TypedDict, total=False):
    """Keyword options of :meth:`Engine.begin` (and of ``attempt``)."""

    operation: str
    scope: str
    fingerprint: str
    request_id: str | None
    ttl: float | None
    lease: float | None
    wait: float | None
    metadata: dict[str, Any] | None
    request_payload: bytes | None
    retention: str | None
    ttl_from: Literal["claim", "completion"]


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
    started: float = 0.0  # time.perf_counter() when the claim was granted
    #: Seconds the answer is kept from when it is stored (``ttl_from="completion"``);
    #: None: the record keeps the expiry its claim set.
    answer_ttl: float | None = None

    def settled_expiry(self, now: float) -> float | None:
        """The record's expiry if its answer is stored at ``now`` (None: the claim's
        stays). :attr:`expires_at` takes it once the store has written it."""
        return None if self.answer_ttl is None else now + self.answer_ttl


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


@dataclass(frozen=True, slots=True)
class Wait:
    """Another attempt holds the key: sleep ``seconds``, then claim again."""

    seconds: float


class _Tokens:
    """Fencing tokens: a random per-process prefix and a counter (fresh after fork).

    Tokens must never repeat; they need not be secret (they never leave the
    store). This is four times cheaper than a random token per claim.
    """

    def __init__(self) -> None:
        self.restart()
        os.register_at_fork(after_in_child=self.restart)

    def restart(self) -> None:
        self.prefix = os.urandom(10).hex()
        self.counter = itertools.count()

    def new(self) -> str:
        """A token no other claim of any process gets."""
        return "%s%x" % (self.prefix, next(self.counter))  # noqa: UP031 - cheaper than an f-string's :x


_new_token = _Tokens().new  # a bound method: cheaper to call than an instance


_json_check = json.JSONEncoder(allow_nan=False).encode


class Plan:
    """One ``begin``: its validated inputs, and what a claim's result means."""

    __slots__ = (
        "answer_ttl",
        "deadline",
        "delay",
        "fingerprint",
        "key",
        "key_hash",
        "lease",
        "metadata",
        "operation",
        "request_id",
        "request_payload",
        "retention",
        "scope",
        "step",
        "ttl",
        "wait",
    )

    def __init__(self, engine: Engine, key: str, **options: Unpack[BeginOptions]) -> None:
        self.fill(engine, key, **options)

    def fill(
        self,
        engine: Engine,
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
        retention: str | None = None,
        ttl_from: Literal["claim", "completion"] = "claim",
    ) -> None:
        """Validate one call's inputs and take them (``__init__`` on a blank plan).

        ``ttl_from="completion"`` keeps the answer ``ttl`` from when it is stored
        instead of from the claim, on a store that can move a record's expiry as it
        settles it (see :func:`~retrysafe.stores.settles_expiry`; another keeps the
        claim's).
        """
        if not is_key(key):
            try:
                validate_key(key)  # raises with the reason
            except InvalidKeyError as exc:
                METRICS.refused(operation if type(operation) is str else "", exc)
                raise
        if type(operation) is not str or type(scope) is not str or type(fingerprint) is not str:
            raise TypeError("operation, scope and fingerprint must be str")
        if ttl is None and lease is None and wait is None and retention is None:
            # The engine's options, checked when it was made (_take's first case, inline).
            self.ttl = engine.ttl
            self.lease = engine.lease if engine.lease <= engine.ttl else engine.ttl
            self.wait, self.retention = engine.wait, engine.retention
        else:
            self._take(engine, Options(ttl=ttl, lease=lease, wait=wait, retention=retention))
        self.answer_ttl: float | None = None
        if ttl_from == "completion":
            if engine.settles_expiry:
                self._answer_ttl(engine, lease)
        elif ttl_from != "claim":
            raise ValueError(f'ttl_from must be "claim" or "completion", not {ttl_from!r}')
        self.key, self.operation, self.scope, self.fingerprint = key, operation, scope, fingerprint
        self.key_hash = key_hash(scope, operation, key)
        if request_id is None:
            self.request_id = None
        elif type(request_id) is str:
            self.request_id = stored_request_id(request_id)
        else:
            raise TypeError("request_id must be a str or None")
        if request_payload is not None and type(request_payload) is not bytes:
            raise TypeError("request_payload must be bytes or None")
        self.request_payload = request_payload
        self.metadata = {}
        if metadata:
            if not isinstance(metadata, dict):
                raise TypeError("metadata must be a dict of JSON values")
            self.metadata = dict(metadata)
            _json_check(self.metadata)  # every store must be able to keep it
        self.deadline: float | None = None
        self.delay = 0.01
        self.step = False  # a workflow's step (counted apart from requests)

    @classmethod
    def shared(cls, engine: Engine, operation: str, options: Options | None = None) -> Plan:
        """The plan a front door builds once, from options it checked when it was
        configured, to :meth:`derive` a plan per call from."""
        plan = cls(engine, "-", operation=operation)
        plan._take(engine, options)
        return plan

    def _take(self, engine: Engine, options: Options | None) -> None:
        """Set the call's ttl, lease, wait and retention: those of ``options`` that
        are given, within the engine's (a call may only narrow its ttl)."""
        if options is None:
            self.ttl, self.lease, self.wait = engine.ttl, engine.lease, engine.wait
            if self.lease > self.ttl:  # the lease is capped by the TTL
                self.lease = self.ttl
            self.retention = engine.retention
            return
        self.ttl = engine.ttl if options.ttl is None else min(options.ttl, engine.ttl)
        self.lease = engine.lease if options.lease is None else options.lease
        if self.lease > self.ttl:
            self.lease = self.ttl
        self.wait = engine.wait if options.wait is None else options.wait
        self.retention = engine.retention if options.retention is None else options.retention

    def _answer_ttl(self, engine: Engine, lease: float | None) -> None:
        """Keep the answer ``ttl`` from when it is stored. That ``ttl`` is a cache
        duration, so it no longer caps the lease: the running attempt keeps its full
        lease (within the engine's ttl), and its record lives at least as long."""
        self.answer_ttl = self.ttl
        wanted = engine.lease if lease is None else float(lease)
        wanted = min(wanted, engine.ttl)
        if wanted > self.lease:
            self.lease = wanted
            self.ttl = max(self.ttl, wanted)

    def derive(self, key: str, scope: str, fingerprint: str, request_id: str | None = None) -> Plan:
        """This plan's validated options for another call (``key`` must be valid).

        For front doors that validate their options once and build a plan per
        request without re-checking them.
        """
        plan = Plan.__new__(Plan)
        plan.ttl, plan.lease, plan.wait = self.ttl, self.lease, self.wait
        plan.operation, plan.metadata, plan.request_payload = self.operation, {}, None
        plan.key, plan.scope, plan.fingerprint = key, scope, fingerprint
        plan.request_id = None if request_id is None else stored_request_id(request_id)
        plan.retention = self.retention
        plan.answer_ttl = self.answer_ttl
        plan.step = self.step
        plan.key_hash = key_hash(scope, plan.operation, key)
        plan.deadline = None
        plan.delay = 0.01
        return plan

    def record(self, now: float) -> Record:
        """The processing record a claim at ``now`` writes (a fresh fencing token each time).

        On every first call: a blank record given each field, as :meth:`Record.copy`
        does (a third of a keyword construction's cost; tests/test_units.py checks that
        every field is set).
        """
        r = _blank(Record)
        r.key_hash = self.key_hash
        r.key = self.key
        r.scope = self.scope
        r.operation = self.operation
        r.fingerprint = self.fingerprint
        r.status = Status.PROCESSING
        r.token = _new_token()
        r.lease_until = now + self.lease
        r.expires_at = now + self.ttl
        r.created_at = now
        r.updated_at = now
        r.completed_at = None
        r.attempts = 1
        r.request_id = self.request_id
        r.final = False
        r.outcome = None
        r.request_payload = self.request_payload
        r.metadata = self.metadata
        r.retention = self.retention
        return r

    def unreachable(self, error: StoreUnavailableError) -> None:
        """Report that the claim could not reach the store."""
        METRICS.refused(self.operation, error, self.key, self.key_hash)

    def answer(self, result: ClaimResult, record: Record, started: float) -> Claim | Replay | Wait:
        """What the store's answer to claiming ``record`` means (the store call begun
        at ``started``, a ``perf_counter()``): run, replay, or wait and claim again.

        Raises :class:`FingerprintMismatchError`, or :class:`InProgressError` once
        the wait has run out.
        """
        now_perf = _perf()
        if result.claimed:
            METRICS.claimed(
                self.operation, self.key_hash, result.took_over, now_perf - started, self.step
            )
            c = _blank(Claim)  # as record() builds its record, for the same reason
            c.key = self.key
            c.key_hash = self.key_hash
            c.scope = self.scope
            c.operation = self.operation
            c.fingerprint = self.fingerprint
            c.token = record.token
            c.lease_until = record.lease_until
            c.expires_at = record.expires_at
            c.attempts = result.attempts
            c.took_over = result.took_over
            c.request_id = self.request_id
            c.started = now_perf
            c.answer_ttl = self.answer_ttl
            return c
        found = result.record
        assert found is not None
        decision = verdict(found, self.fingerprint)
        if decision is Verdict.REPLAY:
            METRICS.replayed(self.operation, self.key_hash, now_perf - started, self.step)
            replay = _blank(Replay)  # as record() builds its record
            replay.record = found
            return replay
        METRICS.store_call("claim", now_perf - started)
        if decision is Verdict.CONFLICT:
            raise self._refused(
                FingerprintMismatchError(
                    "idempotency key was already used with a different request",
                    key=self.key,
                    original_fingerprint=found.fingerprint,
                    fingerprint=self.fingerprint,
                    original_request_id=found.request_id,
                )
            )
        now = record.updated_at
        # The wait is bounded on the monotonic clock: the engine's clock may be frozen.
        tick = time.monotonic()
        if self.deadline is None:
            self.deadline = tick + self.wait
        if tick >= self.deadline:
            raise self._refused(
                InProgressError(
                    "a request with this idempotency key is still in progress",
                    key=self.key,
                    retry_after=retry_after(found, now),
                    original_request_id=found.request_id,
                )
            )
        pause = min(self.delay, self.deadline - tick, max(found.lease_until - now, 0.001))
        self.delay = min(self.delay * 2, 0.25)
        return Wait(float(pause))

    def _refused(self, error: Exception) -> Exception:
        METRICS.refused(self.operation, error, self.key, self.key_hash)
        return error
