"""Lease renewal for calls that run longer than a fraction of their lease.

One daemon thread per process renews every running attempt a third of its
lease after its claim (or its last renewal); a renewal past the record's expiry
moves the expiry too. So only a crash (the process and this thread dying
together) lets a lease run out and another caller take the key over.

The common call ends long before it is due: it costs two dictionary writes
here and nothing at the store, so it still makes one round trip to claim and
one to complete. The thread wakes every third of the shortest lease it has
seen and renews the running calls that are due, so a call is renewed at most
two thirds into its lease.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from types import TracebackType

from retrysafe._core.engine import Attempt, Claim, Engine
from retrysafe.errors import IdempotencyError

__all__ = ["Watch", "renewing", "watch"]

log = logging.getLogger("retrysafe")

#: After a failed renewal (the store is down), try again this soon (at most).
_RETRY = 0.5


class Watch:
    """One running attempt under renewal; :meth:`stop` it when the call ends."""

    __slots__ = ("attempt", "claim", "due", "engine", "lease")

    def __init__(
        self, engine: Engine, claim: Claim, lease: float, attempt: Attempt | None = None
    ) -> None:
        self.engine, self.claim, self.lease, self.attempt = engine, claim, lease, attempt
        self.due = time.monotonic() + lease / 3

    @property
    def done(self) -> bool:
        """Stopped, or its attempt completed or failed (nothing left to renew)."""
        return self not in _heartbeat.active or (self.attempt is not None and self.attempt.finished)

    def stop(self) -> None:
        """Renew no more (the heartbeat lets go of the attempt and its answer at once)."""
        _heartbeat.active.pop(self, None)


class _Heartbeat:
    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        #: The running attempts (a dict as an ordered set: writes need no lock).
        self.active: dict[Watch, None] = {}
        self._tick = float("inf")
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._running = False

    def watch(self, entry: Watch) -> Watch:
        self.active[entry] = None
        tick = entry.lease / 3
        if tick < self._tick or not self._running:
            self._start(tick)
        return entry

    def _start(self, tick: float) -> None:
        """Wake the thread sooner for a shorter lease, or start it (again, if it died)."""
        with self._lock:
            self._tick = min(self._tick, tick)
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="retrysafe-heartbeat", daemon=True).start()
        self._wake.set()

    def _run(self) -> None:
        try:
            while True:
                # Even with nothing running: a call that starts meanwhile is seen
                # within a tick, at most two thirds into its lease.
                self._wake.wait(self._tick)
                self._wake.clear()
                now = time.monotonic()
                for entry in list(self.active):
                    if entry.due <= now:
                        self._renew(entry)
        finally:
            self._running = False

    def _renew(self, entry: Watch) -> None:
        claim = entry.claim
        if entry.done:
            return
        try:
            renewed = entry.engine.try_renew(claim, entry.lease)
        except Exception as exc:  # the store is down (or broken): try again soon
            log.warning(
                "retrysafe: could not renew the lease of %s: %s",
                claim.operation,
                exc,
                exc_info=not isinstance(exc, IdempotencyError),
            )
            retry = min(_RETRY, entry.lease / 10)
            entry.due = time.monotonic() + retry
            if retry < self._tick:
                self._tick = retry
            return
        if renewed:
            entry.due = time.monotonic() + entry.lease / 3
            return
        if not entry.done:  # (a renewal racing the completion is expected)
            log.warning(
                "retrysafe: lease of %s lost: another attempt owns the key now", claim.operation
            )
        entry.stop()


_heartbeat = _Heartbeat()


def watch(engine: Engine, claim: Claim, lease: float) -> Watch:
    """Renew ``claim`` every ``lease / 3`` seconds until the returned watch is stopped."""
    return _heartbeat.watch(Watch(engine, claim, lease))


class renewing:  # (lower case: used like a function, ``with renewing(att):``)
    """Renew the lease of ``att``'s claim while the block runs (sync or async code).

    Nothing happens for an attempt that replays, or when ``enabled`` is false.
    """

    __slots__ = ("entry",)

    def __init__(self, att: Attempt, enabled: bool = True) -> None:
        claim = att.claim
        self.entry = (
            _heartbeat.watch(Watch(att._engine, claim, att._plan.lease, att))
            if enabled and claim is not None
            else None
        )

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.entry is not None:
            self.entry.stop()
