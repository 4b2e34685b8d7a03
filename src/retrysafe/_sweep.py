"""The sweeper: removes expired records in bounded batches, archiving financial ones.

Expiry is also lazy (a claim treats an expired record as absent), so the sweeper
only reclaims space; it never decides an answer. Each batch is one short step
of the store (see :meth:`Store.sweep`), so claims are never blocked for long.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .stores import Store, open_store

__all__ = ["SweepReport", "Sweeper"]


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
