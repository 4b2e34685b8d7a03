"""Live figures: the counters of every worker, sampled over time, and the store's gauges.

A :class:`Monitor` serves the Prometheus endpoint, the dashboard and
``retrysafe stats --watch``. It reads the counters of this process, or of every
process under ``PROMETHEUS_MULTIPROC_DIR``, once a second in a thread of its own
(started by the first request), and keeps the samples for the charts and the
sliding-window duplicate rate. The store is read in that thread too, every few
seconds: no request waits on it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from retrysafe._core.metrics import (
    COUNTERS,
    KEYED,
    METRICS,
    STORE_CALLS,
    Metrics,
    multiprocess_dir,
    require_prometheus,
)
from retrysafe.stores import Store, redact

__all__ = ["Monitor", "Sample"]

log = logging.getLogger("retrysafe.monitor")

_OUTCOME_OF = {name: outcome for outcome, (name, _) in COUNTERS.items()}
_HISTOGRAMS = {"retrysafe_store_seconds": "call", "retrysafe_handler_seconds": "operation"}
#: Outcomes drawn as series (per second) on the dashboard.
SERIES = ("executed", "replayed", "in_flight", "conflict", "failed")


@dataclass
class Sample:
    """The counters' totals at one moment (``t`` is ``time.time()``)."""

    t: float
    totals: dict[str, dict[str, float]]  # outcome -> operation -> count
    buckets: dict[str, dict[str, list[tuple[float, float]]]]  # histogram -> label -> (le, n)
    alerts: dict[str, float] = field(default_factory=dict)

    def total(self, outcome: str) -> float:
        return sum(self.totals.get(outcome, {}).values())


def _families() -> Iterable[Any]:
    """The retrysafe metric families: every worker's, or this process's."""
    if multiprocess_dir():
        from prometheus_client import multiprocess

        return multiprocess.MultiProcessCollector(None).collect()
    from prometheus_client import REGISTRY

    return (f for f in REGISTRY.collect() if f.name.startswith("retrysafe_"))


def read_sample() -> Sample:
    """The counters now (added up over the workers in multi-process mode)."""
    totals: dict[str, dict[str, float]] = {o: {} for o in COUNTERS}
    buckets: dict[str, dict[str, list[tuple[float, float]]]] = {h: {} for h in _HISTOGRAMS}
    alerts: dict[str, float] = {}
    for family in _families():
        outcome = _OUTCOME_OF.get(family.name)
        for s in family.samples:
            if outcome is not None and s.name.endswith("_total"):
                op = s.labels.get("operation", "")
                totals[outcome][op] = totals[outcome].get(op, 0.0) + s.value
            elif family.name == "retrysafe_alerts" and s.name.endswith("_total"):
                name = s.labels.get("alert", "")
                alerts[name] = alerts.get(name, 0.0) + s.value
            elif family.name in _HISTOGRAMS and s.name.endswith("_bucket"):
                label = s.labels.get(_HISTOGRAMS[family.name], "")
                le = math.inf if s.labels["le"] == "+Inf" else float(s.labels["le"])
                buckets[family.name].setdefault(label, []).append((le, s.value))
    # One value per bucket (the multi-process collector has added up the workers).
    for per in buckets.values():
        for pairs in per.values():
            pairs.sort()
    return Sample(time.time(), totals, buckets, alerts)


def quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a histogram's cumulative buckets (as Prometheus'
    ``histogram_quantile``: linear within the bucket); None when it is empty."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lower, below = 0.0, 0.0
    for le, n in cumulative:
        if n >= rank:
            if math.isinf(le):
                return lower
            if n == below:
                return le
            return lower + (le - lower) * (rank - below) / (n - below)
        lower, below = le, n
    return lower


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    old = dict(b)
    return [(le, n - old.get(le, 0.0)) for le, n in a]


def _rate(replayed: float, keyed: float) -> float | None:
    return None if keyed <= 0 else replayed / keyed


@dataclass
class StoreView:
    """What the store said at its last reading."""

    up: bool = False
    error: str | None = None
    checked_at: float | None = None
    probe_seconds: float | None = None
    by_status: dict[str, int] = field(default_factory=dict)
    by_operation: dict[str, int] = field(default_factory=dict)
    expired: int = 0
    archived: int | None = None
    oldest_processing_age: float | None = None
    in_flight: list[dict[str, Any]] = field(default_factory=list)


class Monitor:
    """Live figures over ``store`` (optional): see the module docstring.

    ``window`` is the sliding window of the duplicate rate (seconds),
    ``history`` how long samples are kept, ``interval`` the sampling period and
    ``store_every`` how often the store is read, while someone watches: the store
    (a full scan on Redis) is read only within ``idle`` seconds of a request for
    the figures (a page, a scrape; see :meth:`watched`).
    """

    def __init__(
        self,
        store: Store[Any] | None = None,
        *,
        window: float = 60.0,
        history: float = 600.0,
        interval: float = 1.0,
        store_every: float = 5.0,
        idle: float = 60.0,
        metrics: Metrics = METRICS,
    ) -> None:
        if not (window > 0 and history >= window and interval > 0 and store_every > 0 and idle > 0):
            raise ValueError("window, history, interval, store_every and idle must be positive")
        require_prometheus("serving the metrics (dashboard, Prometheus endpoint, stats)")
        self.idle = float(idle)
        self._watched = -math.inf
        self._closed = False
        self.store, self.window, self.history = store, float(window), float(history)
        self.interval, self.store_every, self.metrics = float(interval), float(store_every), metrics
        self.samples: collections.deque[Sample] = collections.deque(
            maxlen=int(history / interval) + 2
        )
        self.view = StoreView()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store_read = 0.0

    # -- the sampler ------------------------------------------------------------------------

    def watched(self) -> None:
        """Someone asked for the figures: keep reading the store for ``idle`` seconds."""
        self._watched = time.monotonic()

    def start(self) -> None:
        """Start sampling (once; in every process that serves figures)."""
        with self._lock:
            if self._closed or (self._thread is not None and self._thread.is_alive()):
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="retrysafe-monitor", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop sampling for good (a later :meth:`start` does nothing)."""
        with self._lock:
            self._closed = True
            self._stop.set()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)

    def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception as exc:  # a sampler that dies would freeze the dashboard
                log.warning("retrysafe: monitor sample failed: %r", exc)
            if self._stop.wait(self.interval):
                return

    def sample(self) -> Sample:
        """Take a sample now (and read the store if it is due)."""
        sample = read_sample()
        self.samples.append(sample)
        now = time.monotonic()
        if (
            self.store is not None
            and now - self._store_read >= self.store_every
            and now - self._watched < self.idle
        ):
            self.read_store()
        return sample

    def read_store(self) -> StoreView:
        """Read the store's gauges and in-flight records now; alert on stuck ones."""
        assert self.store is not None
        self._store_read = time.monotonic()
        view = StoreView(checked_at=time.time())
        started = time.perf_counter()
        try:
            now = time.time()
            stats = self.store.stats(now)
            view.probe_seconds = time.perf_counter() - started
            view.by_status = stats.by_status()
            view.by_operation = stats.by_operation()
            view.expired, view.archived = stats.expired, stats.archived
            if stats.oldest_processing is not None:
                view.oldest_processing_age = now - stats.oldest_processing.created_at
            processing = self.store.records(status="processing", limit=50)
            view.in_flight = [self._in_flight(r, now) for r in processing if r.expires_at > now]
            view.up = True
        except Exception as exc:  # any failure is the store being unhealthy, shown as such
            view.error = f"{type(exc).__name__}: {exc}"
        self.view = view
        return view

    def _in_flight(self, r: Any, now: float) -> dict[str, Any]:
        overdue = now - r.lease_until
        stuck = overdue > self.metrics.alerts.stuck_after
        if stuck and _alerting_worker():
            self.metrics.stuck(r.operation, r.key, r.key_hash, overdue)
        return {
            "key": r.key,
            "operation": r.operation,
            "scope": r.scope[:16],
            "key_hash": r.key_hash[:16],
            "age": round(now - r.created_at, 3),
            "lease_left": round(r.lease_until - now, 3),
            "attempts": r.attempts,
            "stuck": stuck,
        }

    # -- figures ----------------------------------------------------------------------------

    def _latest(self) -> Sample:
        if not self.samples:
            return self.sample()
        return self.samples[-1]

    def _since(self, seconds: float) -> Sample | None:
        """The oldest sample within the last ``seconds`` (None with fewer than two)."""
        samples = list(self.samples)  # a copy: the sampler appends meanwhile
        if len(samples) < 2:
            return None
        last = samples[-1].t
        for s in samples:
            if last - s.t <= seconds + self.interval / 2:
                return s if s is not samples[-1] else None
        return None

    def duplicate_rate(self) -> tuple[float | None, float | None]:
        """(lifetime, window): replayed ÷ keyed requests; None before any."""
        now = self._latest()
        lifetime = _rate(now.total("replayed"), sum(now.total(o) for o in KEYED))
        old = self._since(self.window)
        window = None
        if old is not None:
            keyed = sum(now.total(o) - old.total(o) for o in KEYED)
            window = _rate(now.total("replayed") - old.total("replayed"), keyed)
        return lifetime, window

    def latency(self, histogram: str, label: str | None = None) -> dict[str, float | str | None]:
        """p50 and p99 in seconds over the window, or the lifetime if the window has none."""
        now, old = self._latest(), self._since(self.window)

        def cumulative(sample: Sample) -> list[tuple[float, float]]:
            per = sample.buckets.get(histogram, {})
            chosen = per.values() if label is None else [per.get(label, [])]
            merged: dict[float, float] = {}
            for pairs in chosen:
                for le, n in pairs:
                    merged[le] = merged.get(le, 0.0) + n
            return sorted(merged.items())

        buckets, over = cumulative(now), "lifetime"
        if old is not None:
            recent = _minus(buckets, cumulative(old))
            if recent and recent[-1][1] > 0:
                buckets, over = recent, "window"
        count = buckets[-1][1] if buckets else 0.0
        return {
            "p50": quantile(0.5, buckets),
            "p99": quantile(0.99, buckets),
            "count": count,
            "over": over,
        }

    def series(self, points: int = 300) -> dict[str, list[Any]]:
        """Per-second rates of each outcome between samples, and the duplicate rate."""
        samples = list(self.samples)[-(points + 1) :]
        out: dict[str, list[Any]] = {"t": [], "duplicate_rate": [], **{o: [] for o in SERIES}}
        # Two samples taken together (the sampler's and a first request's) would make
        # a spike of a rate: such a pair is skipped.
        samples = [
            s
            for s, t in zip(samples, [-math.inf, *(s.t for s in samples)], strict=False)
            if s.t - t >= self.interval / 2
        ]
        for a, b in itertools.pairwise(samples):
            dt = b.t - a.t
            out["t"].append(round(b.t, 3))
            for o in SERIES:
                out[o].append(round((b.total(o) - a.total(o)) / dt, 3))
            keyed = sum(b.total(o) - a.total(o) for o in KEYED)
            rate = _rate(b.total("replayed") - a.total("replayed"), keyed)
            out["duplicate_rate"].append(None if rate is None else round(rate, 4))
        return out

    def snapshot(self, *, points: int = 300) -> dict[str, Any]:
        """Every live figure, as JSON for the dashboard and ``retrysafe stats --watch``."""
        latest = self._latest()
        lifetime, window = self.duplicate_rate()
        view = self.view
        by_operation: dict[str, dict[str, float]] = {}
        for outcome, per in latest.totals.items():
            for op, n in per.items():
                by_operation.setdefault(op, {})[outcome] = n
        return {
            "now": latest.t,
            "multiprocess": bool(multiprocess_dir()),
            "totals": {o: latest.total(o) for o in COUNTERS},
            "by_operation": by_operation,
            "alerts": latest.alerts,
            "duplicate_rate": {
                "lifetime": lifetime,
                "window": window,
                "window_seconds": self.window,
            },
            "latency": {
                "store": {
                    call: self.latency("retrysafe_store_seconds", call) for call in STORE_CALLS
                },
                "handler": self.latency("retrysafe_handler_seconds"),
            },
            "series": self.series(points),
            "store": self._store_json(),
            "in_flight": view.in_flight,
            "recent": [_event(e) for e in list(self.metrics.recent)[::-1][:50]],
        }

    def _store_json(self) -> dict[str, Any] | None:
        if self.store is None:
            return None
        view = self.view
        return {
            "url": redact(self.store.url),
            "up": view.up,
            "error": view.error,
            "checked_at": view.checked_at,
            "probe_seconds": view.probe_seconds,
            "by_status": view.by_status,
            "by_operation": view.by_operation,
            "expired": view.expired,
            "archived": view.archived,
            "oldest_processing_age": view.oldest_processing_age,
        }

    # -- Prometheus ---------------------------------------------------------------------------

    def collect(self) -> Iterator[Any]:
        """The derived gauges (a ``prometheus_client`` custom collector)."""
        from prometheus_client.core import GaugeMetricFamily

        lifetime, window = self.duplicate_rate()
        rate = GaugeMetricFamily(
            "retrysafe_duplicate_rate",
            "Replayed ÷ keyed requests, over the process lifetime "
            "(all workers) and the sliding window.",
            labels=["window"],
        )
        rate.add_metric(["lifetime"], math.nan if lifetime is None else lifetime)
        rate.add_metric([f"{self.window:g}s"], math.nan if window is None else window)
        yield rate
        if self.store is None:
            return
        view = self.view
        up = GaugeMetricFamily("retrysafe_store_up", "1 if the last store reading worked.")
        up.add_metric([], 1.0 if view.up else 0.0)
        yield up
        if not view.up:
            return
        records = GaugeMetricFamily(
            "retrysafe_records", "Live records by status.", labels=["status"]
        )
        for status, n in view.by_status.items():
            records.add_metric([status], n)
        yield records
        oldest = GaugeMetricFamily(
            "retrysafe_oldest_processing_seconds", "Age of the oldest processing record."
        )
        oldest.add_metric([], view.oldest_processing_age or 0.0)
        yield oldest
        expired = GaugeMetricFamily("retrysafe_expired_records", "Expired records not swept yet.")
        expired.add_metric([], view.expired)
        yield expired
        if view.archived is not None:
            archived = GaugeMetricFamily("retrysafe_archive_records", "Records in the archive.")
            archived.add_metric([], view.archived)
            yield archived

    def exposition(self) -> tuple[bytes, str]:
        """The Prometheus text of every metric (all workers' in multi-process mode)."""
        from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
        from prometheus_client.exposition import CONTENT_TYPE_LATEST

        self.start()
        if self.store is not None and self.view.checked_at is None:
            self.read_store()
        registry = CollectorRegistry()
        if multiprocess_dir():
            from prometheus_client import multiprocess

            multiprocess.MultiProcessCollector(registry)
            body = generate_latest(registry)
        else:
            body = generate_latest(REGISTRY)
        registry = CollectorRegistry()
        registry.register(self)
        return body + generate_latest(registry), CONTENT_TYPE_LATEST


_alerting: bool | None = None


def _alerting_worker() -> bool:
    """Whether this process raises the alerts found by reading the store: each worker
    reads it for its own pages, but one alert per stuck record is enough. With a
    multi-process folder, the worker holding a lock file in it (the kernel frees it
    when that worker dies, and the next reader takes it)."""
    global _alerting
    folder = multiprocess_dir()
    if folder is None:
        return True
    if not _alerting:
        import fcntl
        import os

        fd = os.open(os.path.join(folder, "retrysafe_alerts.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        _alerting = True  # the fd stays open: the lock is held until this process ends
    return True


def _event(e: Any) -> dict[str, Any]:
    return {
        "at": e.at,
        "kind": e.kind,
        "operation": e.operation,
        "key": e.key,
        "key_hash": e.key_hash[:16],
        "detail": e.detail,
        **e.extra,
    }
