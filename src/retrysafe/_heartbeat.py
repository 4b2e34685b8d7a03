"""Lease renewal for calls that run longer than a fraction of their lease.

One daemon thread per process keeps a heap of running attempts, each due a
third of its lease after its claim (or its last renewal). A call that ends
before it is due costs a heap push and nothing at the store, so the usual call
still makes one round trip to claim and one to complete. A call that runs on
is renewed every third of a lease, so only a crash (the process and this
thread dying together) lets its lease run out and another caller take over.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator

from ._engine import Attempt, Claim, Engine
from ._errors import IdempotencyError, LeaseLostError

__all__ = ["Watch", "renewing", "watch"]

log = logging.getLogger("retrysafe")


class Watch:
    """One running attempt under renewal; :meth:`stop` it when the call ends."""

    __slots__ = ("attempt", "claim", "engine", "lease", "stopped")

    def __init__(
        self, engine: Engine, claim: Claim, lease: float, attempt: Attempt | None = None
    ) -> None:
        self.engine, self.claim, self.lease, self.attempt = engine, claim, lease, attempt
        self.stopped = False

    @property
    def done(self) -> bool:
        """Stopped, or its attempt completed or failed (nothing left to renew)."""
        return self.stopped or (self.attempt is not None and self.attempt.settled)

    def stop(self) -> None:
        self.stopped = True


class _Heartbeat:
    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Watch]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, entry: Watch) -> Watch:
        with self._cond:
            self._push(entry, time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="retrysafe-heartbeat", daemon=True
                )
                self._thread.start()
            elif self._heap[0][2] is entry:
                self._cond.notify()
        return entry

    def _push(self, entry: Watch, now: float) -> None:
        heapq.heappush(self._heap, (now + entry.lease / 3, next(self._order), entry))

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    while self._heap and self._heap[0][2].done:
                        heapq.heappop(self._heap)
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        entry = heapq.heappop(self._heap)[2]
                        break
                    self._cond.wait(self._heap[0][0] - now if self._heap else None)
            try:
                entry.engine.renew(entry.claim, entry.lease)
            except LeaseLostError as exc:
                if not entry.done:  # (a renewal racing the completion is expected)
                    log.warning("retrysafe: lease of %s lost: %s", entry.claim.operation, exc)
                continue
            except IdempotencyError as exc:  # the store is down: try again in a third
                log.warning(
                    "retrysafe: could not renew the lease of %s: %s", entry.claim.operation, exc
                )
            if not entry.done:
                with self._cond:
                    self._push(entry, time.monotonic())


_heartbeat = _Heartbeat()


def watch(engine: Engine, claim: Claim, lease: float) -> Watch:
    """Renew ``claim`` every ``lease / 3`` seconds until the returned watch is stopped."""
    return _heartbeat.watch(Watch(engine, claim, lease))


@contextlib.contextmanager
def renewing(att: Attempt, enabled: bool = True) -> Iterator[None]:
    """Renew the lease of ``att``'s claim while the block runs (sync or async code).

    Nothing happens for an attempt that replays, or when ``enabled`` is false.
    """
    if not enabled or att.claim is None:
        yield
        return
    entry = _heartbeat.watch(Watch(att._engine, att.claim, att._plan.lease, att))
    try:
        yield
    finally:
        entry.stop()
