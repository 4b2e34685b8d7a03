"""Versioned compare-and-set cells: the storage primitive of :mod:`retrysafe.guards`.

A cell is ``(version, JSON value, expires_at)`` under a key; ``read`` and the
atomic ``write(key, expected_version, value, ttl)`` are one round trip each, run
by every store. Guards are written once as flows (generators yielding
:class:`Read` and :class:`Write`) that :meth:`Cells.run` and :meth:`Cells.arun`
drive. Where each store keeps cells, and their limits: docs/guards.md, "Storage".
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from retrysafe._model.decide import RawCell, live
from retrysafe.errors import StoreUnavailableError

#: Longer cell keys are stored as the SHA-256 of the key (identifiers stay free-form).
_LONGEST_KEY = 256

if TYPE_CHECKING:
    from retrysafe.stores import Store

__all__ = [
    "Cell",
    "Cells",
    "Flow",
    "Read",
    "Write",
    "cas_update",
]

T = TypeVar("T")

#: Compare-and-set rounds one update may take before it gives up (each lost round
#: means another writer changed the cell in between, so the others make progress).
MAX_ROUNDS = 1000


@dataclass(frozen=True, slots=True)
class Cell:
    """A live cell: its version (1 and up), JSON value and expiry (``None``: never)."""

    version: int
    value: Any
    expires_at: float | None


@dataclass(frozen=True, slots=True)
class Read:
    """A flow's request: the live cell under ``key`` at ``now`` (answer: Cell | None)."""

    key: str
    now: float


@dataclass(frozen=True, slots=True)
class Write:
    """A flow's request: compare-and-set (answer: bool)."""

    key: str
    expected: int | None
    value: Any
    expires_at: float | None
    now: float


#: A guard's logic: yields requests, receives their answers, returns its result.
Flow: TypeAlias = Generator[Read | Write, Any, T]

_encode = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def _cell(raw: RawCell | None, now: float) -> Cell | None:
    if raw is None or not live(raw[2], now):
        return None
    return Cell(raw[0], json.loads(raw[1]), raw[2])


def expiry(ttl: float | None, now: float) -> float | None:
    """When a cell written at ``now`` with ``ttl`` expires."""
    return None if ttl is None else now + ttl


def check_ttl(ttl: float | None, *, field: str = "ttl") -> float | None:
    """``ttl`` as seconds (a finite number above 0) or ``None``; else TypeError/ValueError."""
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise TypeError(f"{field} must be a number of seconds or None, not {ttl!r}")
    if not (math.isfinite(ttl) and ttl > 0):
        raise ValueError(f"{field} must be a finite number of seconds above 0, not {ttl!r}")
    return float(ttl)


class _Step:
    """Where a flow stands: the request it waits on, or its result."""

    __slots__ = ("cells", "done", "flow", "request", "value")

    value: Any  # the flow's result, once done

    def __init__(self, cells: Cells, flow: Flow[Any]) -> None:
        self.cells, self.flow, self.done, self.value = cells, flow, False, None
        self.send(None)

    def op(self) -> Any:
        """The store op of the pending request."""
        r = self.request
        store = self.cells.store
        if isinstance(r, Read):
            return store._cell_read(r.key)
        return store._cell_write(r.key, r.expected, _encode(r.value), r.expires_at, r.now)

    def answer(self, reply: Any) -> None:
        """Hand the store's reply to the flow (a read becomes a live Cell or None)."""
        r = self.request
        self.send(_cell(reply, r.now) if type(r) is Read else bool(reply))

    def send(self, answer: Any) -> None:
        try:
            self.request = self.flow.send(answer)
        except StopIteration as stop:
            self.done, self.value = True, stop.value


class Cells:
    """The cells of one guard on one store: keys ``[kind, namespace, *parts]``.

    ``kind`` names the guard (so two kinds of guard never share a cell), and
    ``namespace`` separates guards of one kind; a key is the JSON array of both and
    the parts, so no two part lists map to one key.
    """

    def __init__(
        self, store: Store[Any], kind: str, namespace: str, clock: Callable[[], float] = time.time
    ) -> None:
        if not isinstance(namespace, str) or not namespace:
            raise TypeError(f"namespace must be a non-empty str, not {namespace!r}")
        if not callable(clock):
            raise TypeError(f"clock must be callable, not {clock!r}")
        self.store = store
        self.kind = kind
        self.namespace = namespace
        self.clock = clock

    def key(self, *parts: str) -> str:
        for part in parts:
            if not isinstance(part, str):
                raise TypeError(f"identifiers must be str, not {type(part).__name__}: {part!r}")
        key = _encode([self.kind, self.namespace, *parts])
        if len(key) > _LONGEST_KEY:  # (PostgreSQL's index refuses long keys; keep all alike)
            key = _encode(
                [self.kind, self.namespace, "sha256", hashlib.sha256(key.encode()).hexdigest()]
            )
        return key

    # -- the two operations, for direct use -------------------------------------

    def read(self, key: str) -> Cell | None:
        return self.run(_read(key, self.clock()))

    async def aread(self, key: str) -> Cell | None:
        return await self.arun(_read(key, self.clock()))

    def write(self, key: str, expected_version: int | None, value: Any, ttl: float | None) -> bool:
        return self.run(self._write(key, expected_version, value, ttl))

    async def awrite(
        self, key: str, expected_version: int | None, value: Any, ttl: float | None
    ) -> bool:
        return await self.arun(self._write(key, expected_version, value, ttl))

    def _write(self, key: str, expected: int | None, value: Any, ttl: float | None) -> Flow[bool]:
        if expected is not None and (
            isinstance(expected, bool) or not isinstance(expected, int) or expected < 1
        ):
            raise ValueError(f"expected_version must be None or an int >= 1, not {expected!r}")
        _encode(value)  # fail loud on a value that is not JSON, before any round trip
        now = self.clock()
        return _write(Write(key, expected, value, expiry(check_ttl(ttl), now), now))

    # -- drivers ---------------------------------------------------------------------

    def run(self, flow: Flow[T]) -> T:
        """Drive ``flow`` to its end with the store's sync executor."""
        step = _Step(self, flow)
        while not step.done:
            step.answer(self.store._run(step.op()))
        return step.value

    async def arun(self, flow: Flow[T]) -> T:
        """Drive ``flow`` to its end with the store's async executor."""
        step = _Step(self, flow)
        while not step.done:
            step.answer(await self.store._arun(step.op()))
        return step.value


def _read(key: str, now: float) -> Flow[Cell | None]:
    return (yield Read(key, now))


def _write(request: Write) -> Flow[bool]:
    return (yield request)


#: What a decision returns when nothing is to be written: the result stands as it is.
KEEP: Any = object()


def cas_update(
    cells: Cells,
    key: str,
    decide: Callable[[Cell | None, float], tuple[Any, T]],
    ttl: float | None,
) -> Flow[T]:
    """Read, decide, compare-and-set; on a lost race read and decide again.

    ``decide(cell, now)`` returns ``(new_value, result)`` to write, or ``(KEEP,
    result)`` to write nothing, or raises (nothing written). Exactly one of racing
    writers of one version wins; the others decide again on what it wrote.
    """
    for _ in range(MAX_ROUNDS):
        now = cells.clock()
        cell = yield Read(key, now)
        value, result = decide(cell, now)
        if value is KEEP:
            return result
        expected = None if cell is None else cell.version
        if (yield Write(key, expected, value, expiry(ttl, now), now)):
            return result
    raise StoreUnavailableError(
        f"{key}: {MAX_ROUNDS} compare-and-set rounds lost to other writers; try again"
    )
