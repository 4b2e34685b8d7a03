"""Lease renewal for calls that run longer than a fraction of their lease.

One daemon thread per process keeps a heap of running attempts, each due a
third of its lease after its claim (or its last renewal). A call that ends
before it is due costs a heap push and nothing at the store, so the usual call
still makes one round trip to claim and one to complete. A call that runs on
is renewed every third of a lease (a renewal past the record's expiry moves
the expiry too), so only a crash (the process and this thread dying together)
lets its lease run out and another caller take over.
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
from ._errors import IdempotencyError

__all__ = ["Watch", "renewing", "watch"]

log = logging.getLogger("retrysafe")

#: After a failed renewal (the store is down), try again this soon (at most).
_RETRY = 0.5


class Watch:
    """One running attempt under renewal; :meth:`stop` it when the call ends."""

    __slots__ = ("attempt", "claim", "engine", "lease", "stopped")

    def __init__(
        self, engine: Engine, claim: Claim, lease: float, attempt: Attempt | None = None
    ) -> None:
        self.engine: Engine | None = engine
        self.claim: Claim | None = claim
        self.attempt = attempt
        self.lease = lease
        self.stopped = False

    @property
    def done(self) -> bool:
        """Stopped, or its attempt completed or failed (nothing left to renew)."""
        return self.stopped or (self.attempt is not None and self.attempt.settled)

    def stop(self) -> None:
        """Renew no more; the entry lets go of the attempt (and its answer) at once."""
        self.stopped = True
        self.engine = self.claim = self.attempt = None
        _heartbeat.stopped()


class _Heartbeat:
    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Watch]] = []
        self._order = itertools.count()
        self._stopped = 0
        self._thread: threading.Thread | None = None

    def watch(self, entry: Watch) -> Watch:
        with self._cond:
            self._push(entry, time.monotonic() + entry.lease / 3)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="retrysafe-heartbeat", daemon=True
                )
                self._thread.start()
            elif self._heap[0][2] is entry:
                self._cond.notify()
        return entry

    def stopped(self) -> None:
        """Count a stopped entry; drop them all once they are half the heap."""
        with self._cond:
            self._stopped += 1
            if self._stopped * 2 > len(self._heap):
                self._heap = [item for item in self._heap if not item[2].done]
                heapq.heapify(self._heap)
                self._stopped = 0

    def _push(self, entry: Watch, due: float) -> None:
        heapq.heappush(self._heap, (due, next(self._order), entry))

    def _next(self) -> Watch:
        """The next entry due (waiting for it), removed from the heap."""
        with self._cond:
            while True:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                now = time.monotonic()
                if self._heap and self._heap[0][0] <= now:
                    return heapq.heappop(self._heap)[2]
                self._cond.wait(self._heap[0][0] - now if self._heap else None)

    def _run(self) -> None:
        while True:
            entry = self._next()
            engine, claim = entry.engine, entry.claim
            if engine is None or claim is None:
                continue
            try:
                renewed = engine.try_renew(claim, entry.lease)
            except Exception as exc:  # the store is down (or broken): try again soon
                log.warning(
                    "retrysafe: could not renew the lease of %s: %s", claim.operation, exc,
                    exc_info=not isinstance(exc, IdempotencyError),
                )  # fmt: skip
                with self._cond:
                    self._push(entry, time.monotonic() + min(_RETRY, entry.lease / 10))
                continue
            if not renewed:
                if not entry.done:  # (a renewal racing the completion is expected)
                    log.warning(
                        "retrysafe: lease of %s lost: another attempt owns the key now",
                        claim.operation,
                    )
                continue
            with self._cond:
                if not entry.done:
                    self._push(entry, time.monotonic() + entry.lease / 3)


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
