"""State and ordering guards: small store-backed checks beside the idempotency records.

Each guard works alone on any store (memory, SQLite, Redis and Redis Cluster,
PostgreSQL), has sync methods and async twins (``a``-prefixed), and keeps its state
in versioned compare-and-set cells (see :mod:`retrysafe._core.cells`), apart from the
idempotency records. The decisions are plain functions; the sync and async methods
only drive the same flow with the store's two executors. See ``docs/guards.md``.

* :class:`PaymentStateMachine`: a payment's state, moved only along allowed
  transitions (gateway webhooks, the agentic-commerce idempotency map);
* :class:`SequenceGuard`: per-session, per-operation sequence numbers processed in
  order (the agentic-commerce idempotency map's "Session State Updates");
* :class:`SessionRegistry`: one active session token per user and device
  (the agentic-commerce idempotency map's "Session Token Generation");
* :class:`VersionedRecords`: optimistic locking (``cas``) or last-write-wins
  (``lww``) for synchronised data; :class:`History`: append-only lists
  (the agentic-commerce idempotency map's "Data Synchronization Idempotency").
"""

from __future__ import annotations

import hmac
import json
import math
import secrets
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from retrysafe._core.cells import KEEP, Cell, Cells, Flow, Read, cas_update, check_ttl
from retrysafe.errors import (
    HistoryFullError,
    InvalidTransitionError,
    OutOfOrderError,
    PaymentNotFoundError,
    SequenceError,
    SequenceGapError,
    VersionConflictError,
)
from retrysafe.stores import Store

__all__ = [
    "DEFAULT_EVENTS",
    "DEFAULT_TRANSITIONS",
    "Entry",
    "History",
    "HistoryFullError",
    "InvalidTransitionError",
    "OutOfOrderError",
    "PaymentNotFoundError",
    "PaymentStateMachine",
    "SequenceError",
    "SequenceGapError",
    "SequenceGuard",
    "Session",
    "SessionRegistry",
    "Transition",
    "VersionConflictError",
    "Versioned",
    "VersionedRecords",
]

Clock = Callable[[], float]

# -- helpers ---------------------------------------------------------------------------


def _whole(name: str, value: Any, *, least: int = 0) -> int:
    """``value`` if it is an int (not a bool) of at least ``least``; else TypeError/ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}: {value!r}")
    if value < least:
        raise ValueError(f"{name} must be >= {least}, not {value}")
    return value


def _json(name: str, value: Any) -> Any:
    """``value`` if it encodes as JSON (no NaN or infinity); else TypeError/ValueError."""
    json.dumps(value, allow_nan=False)
    return value


class _Guard:
    """A guard's cells and its two drivers."""

    _kind = ""

    def __init__(self, store: Store[Any], namespace: str, clock: Clock) -> None:
        if not isinstance(store, Store):
            raise TypeError(f"store must be a retrysafe Store, not {type(store).__name__}")
        self._cells = Cells(store, self._kind, namespace, clock)
        self.store = store
        self.namespace = namespace
        self.clock = clock


# -- payments --------------------------------------------------------------------------

#: pending → succeeded | failed | canceled; succeeded → refunded; the rest terminal.
DEFAULT_TRANSITIONS: Mapping[str, frozenset[str]] = {
    "pending": frozenset({"succeeded", "failed", "canceled"}),
    "succeeded": frozenset({"refunded"}),
    "failed": frozenset(),
    "canceled": frozenset(),
    "refunded": frozenset(),
}
#: Gateway event types (the agentic-commerce idempotency map) and the state each one means.
DEFAULT_EVENTS: Mapping[str, str] = {
    "payment.succeeded": "succeeded",
    "payment.failed": "failed",
    "payment.canceled": "canceled",
    "refund.processed": "refunded",
}


@dataclass(frozen=True, slots=True)
class Transition:
    """What ``start`` or ``advance`` did: ``changed`` is False for a repeat (a no-op)."""

    payment_id: str
    previous: str | None
    state: str
    changed: bool


def _target(transitions: Mapping[str, Collection[str]], events: Mapping[str, str], x: Any) -> str:
    """The state that a state name or an event type asks for; ValueError if neither."""
    if isinstance(x, str):
        if x in events:
            return events[x]
        if x in transitions:
            return x
    raise ValueError(f"unknown payment state or event {x!r}")


def _move(
    transitions: Mapping[str, Collection[str]],
    initial: str,
    payment_id: str,
    current: str | None,
    target: str,
    create: bool,
) -> tuple[Any, Transition]:
    """The decision of ``advance``: (value to write or KEEP, transition) or raise."""
    if current == target:
        return KEEP, Transition(payment_id, current, target, False)
    if current is None:
        if not create:
            raise PaymentNotFoundError(payment_id, target)
        if target != initial and target not in transitions[initial]:
            raise InvalidTransitionError(payment_id, None, target)
    elif target not in transitions[current]:
        raise InvalidTransitionError(payment_id, current, target)
    return {"state": target}, Transition(payment_id, current, target, True)


class PaymentStateMachine(_Guard):
    """A payment's state, moved only along ``transitions`` (``state -> next states``).

    ``start`` creates a payment in ``initial`` (``pending``); ``advance`` takes a
    state name or a gateway event type (``events``). A repeat (the payment is in the
    target state already) is a no-op with ``changed=False``; a move the table does
    not allow raises :class:`InvalidTransitionError` and writes nothing; an unknown
    state or event raises ``ValueError``. Racing conflicting moves: exactly one wins,
    the others re-read and get :class:`InvalidTransitionError`.
    """

    _kind = "payment_state"

    def __init__(
        self,
        store: Store[Any],
        *,
        transitions: Mapping[str, Collection[str]] = DEFAULT_TRANSITIONS,
        events: Mapping[str, str] = DEFAULT_EVENTS,
        namespace: str = "payment",
        ttl: float | None = None,
        initial: str = "pending",
        clock: Clock = time.time,
    ) -> None:
        super().__init__(store, namespace, clock)
        table = {state: frozenset(nexts) for state, nexts in transitions.items()}
        for state, nexts in table.items():
            unknown = nexts - table.keys()
            if unknown:
                raise ValueError(f"transitions from {state!r} lead to unknown {sorted(unknown)}")
        bad = {e: s for e, s in events.items() if s not in table}
        if bad:
            raise ValueError(f"events lead to unknown states: {bad}")
        if initial not in table:
            raise ValueError(f"initial state {initial!r} is not in the transitions")
        self.transitions: Mapping[str, frozenset[str]] = table
        self.events: Mapping[str, str] = dict(events)
        self.initial = initial
        self.ttl = check_ttl(ttl)

    def _state(self, payment_id: str) -> Flow[str | None]:
        cell = yield from _read(self._cells, payment_id)
        return None if cell is None else cell.value["state"]

    def _advance(self, payment_id: str, state_or_event: str, create: bool) -> Flow[Transition]:
        target = _target(self.transitions, self.events, state_or_event)
        key = self._cells.key(payment_id)

        def decide(cell: Cell | None, now: float) -> tuple[Any, Transition]:
            current = None if cell is None else cell.value["state"]
            return _move(self.transitions, self.initial, payment_id, current, target, create)

        return cas_update(self._cells, key, decide, self.ttl)

    def state(self, payment_id: str) -> str | None:
        """The payment's state, or None if it was never started (or expired)."""
        return self._cells.run(self._state(payment_id))

    async def astate(self, payment_id: str) -> str | None:
        return await self._cells.arun(self._state(payment_id))

    def start(self, payment_id: str) -> Transition:
        """Create the payment in the initial state; a payment that exists is left as it
        is (``changed=False``, its current state)."""
        return self._cells.run(self._start(payment_id))

    async def astart(self, payment_id: str) -> Transition:
        return await self._cells.arun(self._start(payment_id))

    def _start(self, payment_id: str) -> Flow[Transition]:
        initial = self.initial

        def decide(cell: Cell | None, now: float) -> tuple[Any, Transition]:
            if cell is None:
                return {"state": initial}, Transition(payment_id, None, initial, True)
            state = cell.value["state"]
            return KEEP, Transition(payment_id, state, state, False)

        return cas_update(self._cells, self._cells.key(payment_id), decide, self.ttl)

    def advance(self, payment_id: str, state_or_event: str, *, create: bool = False) -> Transition:
        """Move the payment to a state (or the state an event means).

        A payment with no state raises :class:`PaymentNotFoundError`, unless
        ``create`` is true: then it is treated as being in the initial state.
        """
        return self._cells.run(self._advance(payment_id, state_or_event, create))

    async def aadvance(
        self, payment_id: str, state_or_event: str, *, create: bool = False
    ) -> Transition:
        return await self._cells.arun(self._advance(payment_id, state_or_event, create))


def _read(cells: Cells, *parts: str) -> Flow[Cell | None]:
    return (yield Read(cells.key(*parts), cells.clock()))


# -- sequences ---------------------------------------------------------------------------


def _next_sequence(
    session_id: str, operation: str, last: int | None, sequence: int, strict: bool
) -> dict[str, int]:
    """The decision of ``accept``: the value to write, or raise."""
    if last is None or last + 1 == sequence or (sequence > last and not strict):
        return {"last": sequence}
    error, why = (
        (OutOfOrderError, f"is not after {last}")
        if sequence <= last
        else (SequenceGapError, f"skips {last + 1}")
    )
    raise error(
        f"session {session_id!r} {operation!r}: sequence {sequence} {why}",
        session_id=session_id,
        operation=operation,
        last=last,
        sequence=sequence,
    )


class SequenceGuard(_Guard):
    """The last processed sequence number per session and operation.

    ``accept`` moves it forward atomically; a number not above it raises
    :class:`OutOfOrderError`; with ``strict`` a number past ``last + 1`` raises
    :class:`SequenceGapError`. The first number of a session and operation may be
    any int >= 0. Each accept keeps the state ``ttl`` seconds more (default 24 h);
    after that the guard forgets it and accepts any number.
    """

    _kind = "sequence"

    def __init__(
        self,
        store: Store[Any],
        *,
        namespace: str = "session_update",
        ttl: float | None = 86400.0,
        strict: bool = False,
        clock: Clock = time.time,
    ) -> None:
        super().__init__(store, namespace, clock)
        self.ttl = check_ttl(ttl)
        self.strict = bool(strict)

    def _accept(self, session_id: str, operation: str, sequence: int) -> Flow[None]:
        _whole("sequence", sequence)
        key = self._cells.key(session_id, operation)
        strict = self.strict

        def decide(cell: Cell | None, now: float) -> tuple[Any, None]:
            last = None if cell is None else cell.value["last"]
            return _next_sequence(session_id, operation, last, sequence, strict), None

        return cas_update(self._cells, key, decide, self.ttl)

    def _last(self, session_id: str, operation: str) -> Flow[int | None]:
        cell = yield from _read(self._cells, session_id, operation)
        return None if cell is None else cell.value["last"]

    def accept(self, session_id: str, operation: str, sequence: int) -> None:
        """Record ``sequence`` as processed, or raise (see the class)."""
        self._cells.run(self._accept(session_id, operation, sequence))

    async def aaccept(self, session_id: str, operation: str, sequence: int) -> None:
        await self._cells.arun(self._accept(session_id, operation, sequence))

    def last(self, session_id: str, operation: str) -> int | None:
        """The last accepted sequence number, or None."""
        return self._cells.run(self._last(session_id, operation))

    async def alast(self, session_id: str, operation: str) -> int | None:
        return await self._cells.arun(self._last(session_id, operation))


# -- sessions ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Session:
    """An active session: ``created`` is True only for the call that made it.

    The token is a bearer secret: it is left out of the repr.
    """

    token: str = field(repr=False)
    user_id: str
    device_id: str
    created: bool
    expires_at: float | None


def _session(user_id: str, device_id: str, cell: Cell, created: bool) -> Session:
    return Session(cell.value["token"], user_id, device_id, created, cell.expires_at)


def _same_token(stored: str, given: str) -> bool:
    """Constant-time comparison (bytes, so any str compares without a TypeError)."""
    return hmac.compare_digest(stored.encode(), given.encode())


class SessionRegistry(_Guard):
    """One active session token per user and device.

    ``open`` returns the active session's token, or creates one atomically (racing
    opens get one token; exactly one of them sees ``created=True``). A session lasts
    ``ttl`` seconds from its creation (opening it again does not extend it); an
    expired or closed one is replaced by the next ``open``.
    """

    _kind = "session"

    def __init__(
        self,
        store: Store[Any],
        *,
        ttl: float = 3600.0,
        namespace: str = "session",
        token_factory: Callable[[], str] = secrets.token_urlsafe,
        clock: Clock = time.time,
    ) -> None:
        super().__init__(store, namespace, clock)
        checked = check_ttl(ttl)
        if checked is None:
            raise ValueError("a session needs a ttl")
        self.ttl = checked
        self.token_factory = token_factory

    def _open(self, user_id: str, device_id: str) -> Flow[Session]:
        key = self._cells.key(user_id, device_id)
        tokens: list[str] = []

        def decide(cell: Cell | None, now: float) -> tuple[Any, Session]:
            if cell is not None:
                return KEEP, _session(user_id, device_id, cell, False)
            if not tokens:
                token = self.token_factory()
                if not isinstance(token, str) or not token:
                    raise TypeError(f"token_factory must return a non-empty str, not {token!r}")
                tokens.append(token)
            made = Cell(1, {"token": tokens[0]}, now + self.ttl)
            return made.value, _session(user_id, device_id, made, True)

        return cas_update(self._cells, key, decide, self.ttl)

    def _get(self, user_id: str, device_id: str) -> Flow[Session | None]:
        cell = yield from _read(self._cells, user_id, device_id)
        return None if cell is None else _session(user_id, device_id, cell, False)

    def _close(self, user_id: str, device_id: str, token: str) -> Flow[bool]:
        if not isinstance(token, str):
            raise TypeError(f"token must be a str, not {type(token).__name__}")
        key = self._cells.key(user_id, device_id)
        cells = self._cells

        def decide(cell: Cell | None, now: float) -> tuple[Any, bool]:
            if cell is None or not _same_token(cell.value["token"], token):
                return KEEP, False
            return {"token": "", "closed": True}, True

        # A closed session is a cell that expires as it is written (ttl 0).
        return cas_update(cells, key, decide, 0.0)

    def open(self, user_id: str, device_id: str) -> Session:
        """The active session of this user and device, created if there is none."""
        return self._cells.run(self._open(user_id, device_id))

    async def aopen(self, user_id: str, device_id: str) -> Session:
        return await self._cells.arun(self._open(user_id, device_id))

    def get(self, user_id: str, device_id: str) -> Session | None:
        """The active session, or None."""
        return self._cells.run(self._get(user_id, device_id))

    async def aget(self, user_id: str, device_id: str) -> Session | None:
        return await self._cells.arun(self._get(user_id, device_id))

    def close(self, user_id: str, device_id: str, token: str) -> bool:
        """End the active session if ``token`` is its token; whether it did."""
        return self._cells.run(self._close(user_id, device_id, token))

    async def aclose(self, user_id: str, device_id: str, token: str) -> bool:
        return await self._cells.arun(self._close(user_id, device_id, token))


# -- versioned sync -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Versioned:
    """A stored value: its version (1 and up), the writer's ``timestamp`` (``lww``;
    optional with ``cas``), when it was stored, and whether this call wrote it."""

    entity: str
    entity_id: str
    version: int
    value: Any
    timestamp: float | None
    updated_at: float
    applied: bool = True


def _versioned(entity: str, entity_id: str, cell: Cell, applied: bool) -> Versioned:
    v = cell.value
    return Versioned(entity, entity_id, cell.version, v["value"], v["timestamp"], v["at"], applied)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _newer(timestamp: float, value: Any, stored: Mapping[str, Any]) -> bool:
    """``lww``: whether a write wins over the stored one: a later timestamp, or the same
    timestamp and a greater canonical JSON value (so every order of writes ends alike)."""
    mine = (timestamp, _canonical(value))
    return mine > (stored["timestamp"], _canonical(stored["value"]))


class VersionedRecords(_Guard):
    """Values per (entity, id) with optimistic locking or last-write-wins.

    ``conflict="cas"``: ``put`` needs the stored version (``expected_version``; 0 or
    None to create) and raises :class:`VersionConflictError` otherwise.
    ``conflict="lww"``: ``put`` needs a ``timestamp``; the write is applied only if
    ``(timestamp, canonical JSON of value)`` is greater than the stored one's, else
    the stored value comes back with ``applied=False``. So equal timestamps resolve
    the same way in every order, and under races the greatest timestamp ends stored.
    """

    _kind = "versioned"

    def __init__(
        self,
        store: Store[Any],
        *,
        namespace: str = "sync",
        conflict: Literal["cas", "lww"] = "cas",
        ttl: float | None = None,
        clock: Clock = time.time,
    ) -> None:
        super().__init__(store, namespace, clock)
        if conflict not in ("cas", "lww"):
            raise ValueError(f"conflict must be 'cas' or 'lww', not {conflict!r}")
        self.conflict = conflict
        self.ttl = check_ttl(ttl)

    def _get(self, entity: str, entity_id: str) -> Flow[Versioned | None]:
        cell = yield from _read(self._cells, entity, entity_id)
        return None if cell is None else _versioned(entity, entity_id, cell, False)

    def _put(
        self,
        entity: str,
        entity_id: str,
        value: Any,
        expected_version: int | None,
        timestamp: float | None,
    ) -> Flow[Versioned]:
        _json("value", value)
        if timestamp is not None:
            if isinstance(timestamp, bool) or not isinstance(timestamp, int | float):
                raise TypeError(f"timestamp must be a number, not {timestamp!r}")
            if not math.isfinite(timestamp):
                raise ValueError(f"timestamp must be finite, not {timestamp!r}")
        lww = self.conflict == "lww"
        if lww:
            if timestamp is None:
                raise TypeError("conflict='lww' needs a timestamp")
            if expected_version is not None:
                raise ValueError("conflict='lww' takes no expected_version")
            stamp = timestamp  # not None here, as the closure below cannot see
        else:
            expected = _whole("expected_version", expected_version or 0)
        key = self._cells.key(entity, entity_id)

        def decide(cell: Cell | None, now: float) -> tuple[Any, Versioned]:
            if lww:
                if cell is not None and not _newer(stamp, value, cell.value):
                    return KEEP, _versioned(entity, entity_id, cell, False)
            else:
                current = 0 if cell is None else cell.version
                if current != expected:
                    raise VersionConflictError(f"{entity} {entity_id!r}", current, expected)
            new = {"value": value, "timestamp": timestamp, "at": now}
            version = 1 if cell is None else cell.version + 1
            return new, _versioned(entity, entity_id, Cell(version, new, None), True)

        return cas_update(self._cells, key, decide, self.ttl)

    def get(self, entity: str, entity_id: str) -> Versioned | None:
        """The stored value (``applied=False``), or None."""
        return self._cells.run(self._get(entity, entity_id))

    async def aget(self, entity: str, entity_id: str) -> Versioned | None:
        return await self._cells.arun(self._get(entity, entity_id))

    def put(
        self,
        entity: str,
        entity_id: str,
        value: Any,
        *,
        expected_version: int | None = None,
        timestamp: float | None = None,
    ) -> Versioned:
        """Store ``value`` by the conflict rule (see the class)."""
        return self._cells.run(self._put(entity, entity_id, value, expected_version, timestamp))

    async def aput(
        self,
        entity: str,
        entity_id: str,
        value: Any,
        *,
        expected_version: int | None = None,
        timestamp: float | None = None,
    ) -> Versioned:
        flow = self._put(entity, entity_id, value, expected_version, timestamp)
        return await self._cells.arun(flow)


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of a history: its position (0 first), the entry, when it was recorded."""

    position: int
    entry: Any
    recorded_at: float


class History(_Guard):
    """Append-only lists per subject (consent history): no update, no delete.

    One cell per subject holds the whole list, appended by compare-and-set: racing
    appends are all kept, in one order. Each append rewrites the list, so a subject
    holds at most ``max_entries`` (default 10,000; then :class:`HistoryFullError`).
    An append is not idempotent by itself: a retried request appends again unless
    it runs under an idempotency key.
    """

    _kind = "history"

    def __init__(
        self,
        store: Store[Any],
        *,
        namespace: str = "history",
        max_entries: int = 10_000,
        clock: Clock = time.time,
    ) -> None:
        super().__init__(store, namespace, clock)
        self.max_entries = _whole("max_entries", max_entries, least=1)

    def _append(self, subject: str, entry: Any) -> Flow[int]:
        _json("entry", entry)
        limit = self.max_entries

        def decide(cell: Cell | None, now: float) -> tuple[Any, int]:
            entries = [] if cell is None else cell.value
            if len(entries) >= limit:
                raise HistoryFullError(subject, limit)
            return [*entries, [entry, now]], len(entries)

        return cas_update(self._cells, self._cells.key(subject), decide, None)

    def _entries(self, subject: str) -> Flow[list[Entry]]:
        cell = yield from _read(self._cells, subject)
        return [] if cell is None else [Entry(i, e, at) for i, (e, at) in enumerate(cell.value)]

    def append(self, subject: str, entry: Any) -> int:
        """Append a JSON ``entry``; its position."""
        return self._cells.run(self._append(subject, entry))

    async def aappend(self, subject: str, entry: Any) -> int:
        return await self._cells.arun(self._append(subject, entry))

    def entries(self, subject: str) -> list[Entry]:
        """Every entry, oldest first."""
        return self._cells.run(self._entries(subject))

    async def aentries(self, subject: str) -> list[Entry]:
        return await self._cells.arun(self._entries(subject))
