"""The sweeper: removes expired records in bounded batches, archiving financial ones.

Expiry is also lazy (a claim treats an expired record as absent), so the sweeper
only reclaims space; it never decides an answer. Each batch is one short step
of the store (see :meth:`Store.sweep`), so claims are never blocked for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from retrysafe._core.cells import Cells
from retrysafe.stores import Store, open_store

__all__ = ["DEFAULT_SWEEP_EVERY", "BackgroundSweeper", "SweepReport", "Sweeper"]

log = logging.getLogger("retrysafe")

#: How often a server that retrysafe runs (the gateway) sweeps its store, in seconds.
DEFAULT_SWEEP_EVERY = 300.0


@dataclass(slots=True)
class SweepReport:
    """Totals of one sweep: records deleted (archived ones included), archived, batches."""

    deleted: int = 0
    archived: int = 0
    batches: int = 0
    cells: int = 0  # expired guard cells deleted (retrysafe.guards)
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        """Records deleted per second."""
        return self.deleted / self.seconds if self.seconds > 0 else 0.0


class Sweeper:
    """Delete expired records of ``store`` (a Store or a URL), ``batch_size`` at a time.

    ``pause`` seconds between batches leave room for claims on a busy store.
    ``clock`` returns seconds since the epoch (the engine's clock).
    """

    def __init__(
        self,
        store: Store[Any] | str | None = None,
        *,
        batch_size: int = 1000,
        pause: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, not {batch_size!r}")
        if not pause >= 0:
            raise ValueError(f"pause must be >= 0 seconds, not {pause!r}")
        self.store: Store[Any] = store if isinstance(store, Store) else open_store(store)
        self.batch_size = batch_size
        self.pause = float(pause)
        self.clock = clock

    def run(
        self,
        *,
        progress: Callable[[SweepReport], None] | None = None,
        max_batches: int | None = None,
        stop: threading.Event | None = None,
    ) -> SweepReport:
        """Sweep until no expired record is left (as of the sweep's start).

        ``progress`` is called after every batch with the running totals.
        """
        report = SweepReport()
        started = time.monotonic()
        now = self.clock()  # records expiring during the sweep wait for the next one
        while max_batches is None or report.batches < max_batches:
            if stop is not None and stop.is_set():
                break
            batch = self.store.sweep(now, self.batch_size)
            report.batches += 1
            report.deleted += batch.deleted
            report.archived += batch.archived
            report.seconds = time.monotonic() - started
            if progress is not None:
                progress(report)
            if batch.done:
                self._sweep_cells(now, report)
                break
            if self.pause:
                if stop is not None:
                    stop.wait(self.pause)
                else:
                    time.sleep(self.pause)
        report.seconds = time.monotonic() - started
        return report

    def _sweep_cells(self, now: float, report: SweepReport) -> None:
        """The guards' expired cells, once the records are done (same batch size)."""
        while True:
            deleted = self.store.sweep_cells(now, self.batch_size)
            report.cells += deleted
            if deleted < self.batch_size:
                return

    async def arun(self, **options: Any) -> SweepReport:
        """:meth:`run` on a worker thread."""
        return await asyncio.to_thread(self.run, **options)

    def run_every(
        self,
        every: float,
        *,
        stop: threading.Event | None = None,
        on_sweep: Callable[[SweepReport], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
        progress: Callable[[SweepReport], None] | None = None,
    ) -> None:
        """Sweep now and then every ``every`` seconds, until ``stop`` is set.

        A sweep that fails (the store is down) is reported to ``on_error`` and
        tried again at the next tick; without ``on_error`` it raises.
        """
        if not every > 0:
            raise ValueError(f"every must be a positive number of seconds, not {every!r}")
        stop = stop or threading.Event()
        while not stop.is_set():
            tick = time.monotonic()
            try:
                report = self.run(progress=progress, stop=stop)
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(exc)
            else:
                if on_sweep is not None:
                    on_sweep(report)
            stop.wait(max(0.0, every - (time.monotonic() - tick)))


class BackgroundSweeper:
    """Sweep ``store`` every ``every`` seconds from an event loop, one process at a time.

    At each tick a process takes a lease cell in the store by compare-and-set,
    for ``every`` seconds; only the process that took it sweeps, so several
    workers on one store sweep about once per interval between them (a sweep
    that outlasts its lease may overlap the next one, which is safe: every
    batch is atomic). The sweep runs on a worker thread and never blocks the
    loop. A failed tick (the store is down) is logged and tried again at the
    next. :meth:`start` on the loop, :meth:`aclose` before closing the store.
    """

    def __init__(
        self, store: Store[Any], every: float, *, clock: Callable[[], float] = time.time
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int | float) or not every > 0:
            raise ValueError(f"every must be a positive number of seconds, not {every!r}")
        self.every = float(every)
        self.sweeper = Sweeper(store, clock=clock)
        self.cells = Cells(store, "sweep", "background", clock)
        self.lease = self.cells.key("lease")
        #: Ticks done, and sweeps among them (the ticks where this process had the lease).
        self.ticks = 0
        self.sweeps = 0
        self._stop = threading.Event()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Tick now and then every ``every`` seconds (call it on the running loop)."""
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        assert self._wake is not None
        while not self._stop.is_set():
            await self.tick()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.every)

    async def tick(self) -> SweepReport | None:
        """Take the lease and sweep; None if another process holds it or the tick failed."""
        try:
            if not await self.cells.awrite(self.lease, None, os.getpid(), self.every):
                return None
            report = await asyncio.to_thread(self.sweeper.run, stop=self._stop)
        except Exception as exc:  # the store is down: the next tick tries again
            log.warning("retrysafe: background sweep failed: %s", exc or type(exc).__name__)
            return None
        else:
            self.sweeps += 1
            if report.deleted or report.cells:
                log.info(
                    "retrysafe: swept %d expired records (%d archived) and %d cells in %.3f s",
                    report.deleted,
                    report.archived,
                    report.cells,
                    report.seconds,
                )
            return report
        finally:
            self.ticks += 1

    async def aclose(self) -> None:
        """Stop ticking; a sweep under way stops after its current batch."""
        self._stop.set()
        if self._task is not None:
            assert self._wake is not None
            self._wake.set()
            await self._task
