"""What the engine reports: Prometheus counters and histograms, alerts, trace events.

The engine calls :data:`METRICS` at each decision, so every front door reports
the same figures. In one process a claim, a replay or a completion is one
dictionary lookup (the operation's slots, resolved on its first report) and a few
additions to this thread's own list of values: no lock, nothing built. With
metrics disabled it is one attribute test. See docs/metrics.md, "How they count".

Under several worker processes, set ``PROMETHEUS_MULTIPROC_DIR`` before the
workers start (``retrysafe gateway --workers N`` does): each process writes its
counters to files there, and whichever process answers a scrape adds them up.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import logging
import math
import os
import sys
import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from retrysafe.errors import (
    AmbiguousCredentialsError,
    FingerprintMismatchError,
    InProgressError,
    InvalidKeyError,
    MissingExtraError,
    PrincipalRequiredError,
    StoreUnavailableError,
)

__all__ = [
    "COUNTERS",
    "METRICS",
    "AlertLog",
    "Alerts",
    "Event",
    "Metrics",
    "multiprocess_dir",
    "require_prometheus",
]

log = logging.getLogger("retrysafe.alerts")

#: outcome -> (metric name without ``_total``, help). The outcomes a keyed request
#: can have are the first four (their sum is every keyed request); the others are
#: events of an attempt or refusals before the engine decided anything.
COUNTERS: dict[str, tuple[str, str]] = {
    "executed": ("retrysafe_executions", "Keyed requests that ran the handler (claims granted)."),
    "replayed": ("retrysafe_replays", "Keyed requests answered from the store (duplicates)."),
    "in_flight": (
        "retrysafe_in_flight_conflicts",
        "Keyed requests refused because the key was in flight (HTTP 409).",
    ),
    "conflict": (
        "retrysafe_fingerprint_conflicts",
        "Keys reused with another request (HTTP 422).",
    ),
    "failed": ("retrysafe_failures", "Attempts marked failed."),
    "lease_takeover": (
        "retrysafe_lease_takeovers",
        "Claims that took over a processing record whose lease had run out.",
    ),
    "stale_refused": (
        "retrysafe_stale_completions_refused",
        "Completions, failures and renewals refused because the attempt had lost its lease.",
    ),
    "invalid_key": ("retrysafe_invalid_keys", "Requests refused for a missing or malformed key."),
    "unscoped": (
        "retrysafe_unscoped_requests",
        "Keyed requests run without a record: they carried no credential (anonymous='run').",
    ),
    "principal_refused": (
        "retrysafe_principal_refusals",
        "Keyed requests refused for missing (anonymous='refuse') or ambiguous credentials.",
    ),
    "store_unavailable": (
        "retrysafe_store_unavailable",
        "Requests that found the store unreachable.",
    ),
    "unrecorded": (
        "retrysafe_unrecorded_outcomes",
        "Completions and failures that could not be written: the store was unreachable.",
    ),
    "step_executed": (
        "retrysafe_step_executions",
        "Workflow steps that ran (labelled operation/step; not requests of their own).",
    ),
    "step_replayed": (
        "retrysafe_step_replays",
        "Workflow steps answered from the store when their operation was retried.",
    ),
}
#: The outcomes that together are every keyed request (the duplicate rate's denominator).
KEYED = ("executed", "replayed", "in_flight", "conflict")
STORE_CALLS = ("claim", "complete", "fail", "renew")
_STORE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
_HANDLER_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
_STORE_SUM = len(_STORE_BUCKETS) + 1  # a histogram's slot of its sum, after +Inf's
_HANDLER_SUM = len(_HANDLER_BUCKETS) + 1
_TRACE = "opentelemetry.trace"
_MODULES = sys.modules  # read on every report: one global instead of two lookups
_NOTHING: dict[str, int] = {}
#: Operation labels kept apart; past this many, new ones are counted as ``other``.
MAX_OPERATIONS = 200
_NO_OPERATION = "(none)"


def require_prometheus(feature: str) -> None:
    """Raise :class:`MissingExtraError` naming the ``metrics`` extra unless
    ``prometheus_client`` can be imported (what serves the counters needs it)."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError("metrics", feature, name=exc.name) from exc


def multiprocess_dir() -> str | None:
    """The folder of multi-process metrics, if this process runs in that mode."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


@dataclass(frozen=True)
class Alerts:
    """When the engine raises an alert (a ``retrysafe.alerts`` log event and a counter).

    ``burst``: this many requests refused as in flight on one key within
    ``burst_window`` seconds (so ``burst + 1`` arrived together). ``failures``:
    an attempt fails and it was the key's ``failures``-th attempt in a row.
    ``stuck_after``: a processing record whose lease ended this many seconds ago
    (found when the store's gauges are read). A stale completion is always one.
    """

    burst: int = 3
    burst_window: float = 1.0
    failures: int = 3
    stuck_after: float = 0.0

    def __post_init__(self) -> None:
        if self.burst < 1 or self.failures < 1:
            raise ValueError("burst and failures must be at least 1")
        if not self.burst_window > 0 or self.stuck_after < 0:
            raise ValueError("burst_window must be positive and stuck_after not negative")


class _Held:
    """The alerts of one kind held back in the current interval."""

    __slots__ = ("count", "key_hashes", "operations", "until")

    def __init__(self, until: float) -> None:
        self.until = until
        self.count = 0
        self.operations: dict[str, int] = {}
        self.key_hashes: list[str] = []


class AlertLog:
    """Alert log lines, at most one per alert kind per ``interval`` seconds.

    The first alert of a kind is logged at once, with its detail. The ones that
    follow within the interval are counted, and when it ends one summary line
    per kind says how many there were, on which operations (the first
    :data:`MAX_SUMMARY_OPERATIONS`, the rest as ``other``) and a few key hashes
    (at most ``samples``). Summaries are written by a timer thread, by the next
    alert of the kind, by :meth:`flush`, and at exit. Counters and the
    dashboard's recent events still see every alert.
    """

    def __init__(
        self,
        interval: float = 10.0,
        *,
        samples: int = 5,
        clock: Callable[[], float] = time.monotonic,
        timer: bool = True,
    ) -> None:
        if not interval > 0 or samples < 0:
            raise ValueError("interval must be positive and samples not negative")
        self.interval = float(interval)
        self.samples = samples
        self.clock = clock
        self._timer_on = timer
        self._timer: threading.Timer | None = None
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()

    def emit(self, name: str, message: str, args: tuple[Any, ...], fields: dict[str, Any]) -> None:
        """Log ``message % args`` now, or count it in this interval's summary of ``name``."""
        with self._lock:
            now = self.clock()
            summaries = self._due(now, name)
            held = self._held.get(name)
            if held is None:
                self._held[name] = _Held(now + self.interval)
            else:
                held.count += 1
                op = fields.get("operation", "")
                ops = held.operations
                if op not in ops and len(ops) >= MAX_SUMMARY_OPERATIONS:
                    op = "other"
                ops[op] = ops.get(op, 0) + 1
                sample = str(fields.get("key_hash", ""))
                if len(held.key_hashes) < self.samples and sample not in held.key_hashes:
                    held.key_hashes.append(sample)
                self._schedule(held.until - now)
        self._write(summaries)
        if held is None:
            log.warning(message, *args, extra={"retrysafe": fields})

    def flush(self, *, everything: bool = False) -> None:
        """Write the summaries of the intervals that have ended (``everything``: all)."""
        with self._lock:
            summaries = self._due(math.inf if everything else self.clock(), None)
        self._write(summaries)

    def _due(self, now: float, name: str | None) -> list[tuple[str, _Held]]:
        """Take the held alerts of the ended intervals (``name``'s, or all). A summary
        opens the next interval; an interval that held nothing just ends."""
        due: list[tuple[str, _Held]] = []
        for kind in [name] if name is not None else list(self._held):
            held = self._held.get(kind)
            if held is None or now < held.until:
                continue
            if held.count:
                due.append((kind, held))
                self._held[kind] = _Held(now + self.interval)
            else:
                del self._held[kind]
        return due

    def _schedule(self, delay: float) -> None:
        if not self._timer_on or (self._timer is not None and self._timer.is_alive()):
            return
        self._timer = threading.Timer(max(delay, 0.0) + 0.01, self._tick)
        self._timer.daemon = True
        self._timer.start()

    def _tick(self) -> None:
        self.flush()
        with self._lock:
            pending = [h.until for h in self._held.values() if h.count]
            self._timer = None
            if pending:
                self._schedule(min(pending) - self.clock())

    def _write(self, summaries: list[tuple[str, _Held]]) -> None:
        for name, held in summaries:
            ops = ", ".join(f"{op or _NO_OPERATION} x{n}" for op, n in held.operations.items())
            fields = {
                "alert": name,
                "summary": True,
                "count": held.count,
                "interval": self.interval,
                "operations": dict(held.operations),
                "key_hashes": list(held.key_hashes),
            }
            log.warning(
                "retrysafe alert %s: %d more within %gs (operations: %s; key_hash e.g. %s)",
                name,
                held.count,
                self.interval,
                ops,
                ", ".join(held.key_hashes) or "-",
                extra={"retrysafe": fields},
            )

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._timer = None


#: Operations named in an alert summary; the others are counted as ``other``.
MAX_SUMMARY_OPERATIONS = 10


@dataclass(frozen=True)
class Event:
    """A recent refusal, failure or alert, kept in memory for the dashboard."""

    at: float
    kind: str
    operation: str
    key: str
    key_hash: str
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class _Otel:
    """Span events on the current span, once the application has imported
    ``opentelemetry.trace`` (the ``otel`` extra) and set a tracer provider
    (``trace.set_tracer_provider``). Nothing here imports it: an application that
    traces has imported it already. Until then the engine's reports skip
    :meth:`event` after one test of ``sys.modules``; until a provider is set, an
    event costs one attribute read: the API keeps the provider in a module global
    (read directly; if a later API hides it, every event looks at the current
    span)."""

    def __init__(self) -> None:
        self.trace: Any = None  # the module, once imported

    def event(self, name: str, operation: str, outcome: str, key_hash: str) -> None:
        trace = self.trace
        if trace is None:
            trace = self.trace = sys.modules.get(_TRACE)
            if trace is None:
                return
        if getattr(trace, "_TRACER_PROVIDER", True) is None:
            return
        span = trace.get_current_span()
        if span.is_recording():
            span.add_event(
                name,
                {
                    "retrysafe.operation": operation,
                    "retrysafe.outcome": outcome,
                    "retrysafe.key_hash": key_hash,
                },
            )


_FAMILIES: dict[str, tuple[str, str, str, tuple[float, ...] | None]] = {
    **{o: (name, text, "operation", None) for o, (name, text) in COUNTERS.items()},
    "alert": ("retrysafe_alerts", "Alerts raised, by alert.", "alert", None),
    "store": ("retrysafe_store_seconds", "Store round-trip time by call.", "call", _STORE_BUCKETS),
    "handler": (
        "retrysafe_handler_seconds",
        "Time from a claim to its completion or failure.",
        "operation",
        _HANDLER_BUCKETS,
    ),
}


class _Owner:
    """Held in a thread's locals only: its end is that thread's end."""


class _Child:
    """One labelled counter or histogram: its slots in every thread's values (a
    counter: one; a histogram: a count per bucket, +Inf's, then the sum)."""

    __slots__ = ("_bounds", "_cells", "slot")

    def __init__(self, cells: _Cells, slot: int, bounds: tuple[float, ...]) -> None:
        self._cells, self.slot, self._bounds = cells, slot, bounds

    def inc(self, n: float = 1) -> None:
        self._cells.mine()[self.slot] += n
        if not n:  # shown at zero, as a child that counted 0 always was
            self._cells.zero.add(self.slot)

    def observe(self, value: float) -> None:
        values, slot = self._cells.mine(), self.slot
        values[slot + bisect_left(self._bounds, value)] += 1.0  # Prometheus' le is inclusive
        values[slot + len(self._bounds) + 1] += value


class _Thread(threading.local):
    """A thread's values: made (zeros, a slot for every child) when the thread
    first reports, and retired when it ends."""

    def __init__(self, cells: _Cells) -> None:  # once per thread, on its first use
        self.values = cells.join()
        # Dropped with the thread's locals when it ends: then its values retire.
        self.owner = owner = _Owner()
        weakref.finalize(owner, cells.retire, self.values)


class _Cells:
    """The metrics of one process: one flat list of values per thread, added up by
    :meth:`collect`. Only its thread adds to a list, so an update takes no lock and
    loses nothing; every list has a slot for every child (a new child's slots are
    added to all of them, under the lock, before the child is handed out).

    When a thread ends, its values are added to the retired totals (a server
    that starts a thread per request must not grow a list per request).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._size = 0
        self._slots: dict[tuple[str, str], int] = {}
        self._retired: list[float] = []
        self._lists: list[list[float]] = [self._retired]
        self.zero: set[int] = set()  # the slots of counters that counted 0
        self.local = _Thread(self)

    def child(self, family: str, label: str) -> _Child:
        bounds = _FAMILIES[family][3] or ()
        size = len(bounds) + 2 if bounds else 1
        with self._lock:
            slot = self._slots.get((family, label))
            if slot is None:
                slot = self._slots[(family, label)] = self._size
                self._size += size
                for values in self._lists:
                    values.extend([0.0] * size)
        return _Child(self, slot, bounds)

    def mine(self) -> list[float]:
        """This thread's values."""
        values: list[float] = self.local.values
        return values

    def join(self) -> list[float]:
        """A new thread's values, added up from now on."""
        with self._lock:
            values = [0.0] * self._size
            self._lists.append(values)
        return values

    def retire(self, values: list[float]) -> None:
        """Move an ended thread's values into the retired totals."""
        with self._lock:
            retired = self._retired
            for i, v in enumerate(values):
                retired[i] += v
            self._lists = [v for v in self._lists if v is not values]

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        with self._lock:  # summed under the lock: a thread retiring now is counted once
            totals = [sum(column) for column in zip(*self._lists, strict=True)]
            slots = list(self._slots.items())
        children: dict[str, list[tuple[str, list[float]]]] = {f: [] for f in _FAMILIES}
        for (family, value), slot in slots:
            bounds = _FAMILIES[family][3]
            values = totals[slot : slot + (len(bounds) + 2 if bounds else 1)]
            if any(values) or slot in self.zero:  # a child appears once it has counted
                children[family].append((value, values))
        for family, (name, text, label, bounds) in _FAMILIES.items():
            mine = children[family]
            if bounds is None:
                counter = CounterMetricFamily(name, text, labels=[label])
                for value, values in mine:
                    counter.add_metric([value], values[0])
                yield counter
                continue
            histogram = HistogramMetricFamily(name, text, labels=[label])
            edges = [*(floatToGoString(b) for b in bounds), "+Inf"]
            for value, values in mine:
                running, buckets = 0.0, []
                for edge, n in zip(edges, values[:-1], strict=True):
                    running += n
                    buckets.append((edge, running))
                histogram.add_metric([value], buckets, sum_value=values[-1])
            yield histogram


def _quiet(method: Callable[..., None]) -> Callable[..., None]:
    """A report that never raises: metrics must not fail the request they describe."""

    @functools.wraps(method)
    def report(self: Metrics, *args: Any, **kwargs: Any) -> None:
        try:
            method(self, *args, **kwargs)
        except Exception as exc:
            self._broken(exc)

    return report


class _Op:
    """An operation's label and the children of its metrics on every request."""

    __slots__ = ("executed", "handler", "label", "replayed")

    def __init__(self, label: str, executed: Any, replayed: Any, handler: Any) -> None:
        self.label, self.executed, self.replayed, self.handler = label, executed, replayed, handler


class _Slots:
    """Where a claim, a replay and a completion of one operation add in a thread's
    values (one process: :class:`_Cells`), found with one lookup."""

    __slots__ = ("claim", "executed", "handler", "replayed")

    def __init__(self, claim: int, executed: int, replayed: int, handler: int) -> None:
        self.claim, self.executed, self.replayed, self.handler = claim, executed, replayed, handler


class Metrics:
    """The process's metrics (one instance, :data:`METRICS`); see the module docstring.

    ``registry``: where the metrics are registered (default: ``prometheus_client``'s
    own, or none in multi-process mode, where they live in files); another
    instance needs one of its own.
    """

    def __init__(
        self,
        enabled: bool = True,
        alerts: Alerts | None = None,
        registry: Any = None,
        alert_log: AlertLog | None = None,
    ) -> None:
        self.enabled = enabled
        self.registry = registry
        self.alerts = alerts or Alerts()
        self.alert_log = alert_log or AlertLog()
        self.recent: collections.deque[Event] = collections.deque(maxlen=200)
        self._made = False
        self._cells: _Cells | None = None
        self._local: Any = None  # the cells' thread locals
        # The hot path's lookups (filled in one process only: multi-process mode
        # goes through prometheus_client's children).
        self._slots: dict[str, _Slots] = {}
        self._store_slots: dict[str, int] = {}
        self._count_slots: dict[str, dict[str, int]] = {}  # outcome -> operation -> slot
        self._lock = threading.Lock()
        self._children: dict[tuple[str, str], Any] = {}
        self._operations: dict[str, str] = {}
        self._ops: dict[str, _Op] = {}
        self._store: dict[str, Any] = {}
        self._bursts: collections.OrderedDict[str, list[float]] = collections.OrderedDict()
        self._stuck: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._otel = _Otel()
        self._failures: set[str] = set()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork)

    # -- the prometheus objects ------------------------------------------------------------

    def _make(self) -> None:
        """Create the metrics on first use (so an unused process registers nothing).

        In one process they are lock-free per-thread cells added up when scraped
        (:class:`_Cells`); in multi-process mode, ``prometheus_client``'s own,
        which live in memory-mapped files every worker can read. Without
        ``prometheus_client`` (the ``metrics`` extra), the cells count all the same
        and nothing serves them.
        """
        with self._lock:
            if self._made:
                return
            try:
                from prometheus_client import REGISTRY, Counter, Histogram
            except ImportError:  # counted all the same, served by nothing
                self._cells = _Cells()
                self._local = self._cells.local
                self._made = True
                return
            registry = self.registry
            if not multiprocess_dir():
                self._cells = _Cells()
                self._local = self._cells.local
                (registry or REGISTRY).register(self._cells)
                self._made = True
                return
            self._families = {
                family: Counter(name, text, [label], registry=registry)
                if bounds is None
                else Histogram(name, text, [label], buckets=bounds, registry=registry)
                for family, (name, text, label, bounds) in _FAMILIES.items()
            }
            self._made = True

    def _child(self, family: str, label: str) -> Any:
        """The labelled child of a metric (cached: ``labels()`` takes a lock)."""
        child = self._children.get((family, label))
        if child is None:
            self._make()
            if self._cells is not None:
                child = self._cells.child(family, label)
            else:
                child = self._families[family].labels(label)
            self._children[(family, label)] = child
        return child

    def _op(self, operation: str) -> _Op:
        """The children of an operation's frequent metrics, found with one lookup."""
        op = self._ops.get(operation)
        if op is None:
            label = self._label(operation)
            op = _Op(
                label,
                self._child("executed", label),
                self._child("replayed", label),
                self._child("handler", label),
            )
            if label != "other":  # bounded like the labels
                self._ops[operation] = op
                if self._cells is not None:
                    claim = self._store_child("claim").slot
                    slots = _Slots(claim, op.executed.slot, op.replayed.slot, op.handler.slot)
                    self._slots[operation] = slots
        return op

    def _store_child(self, call: str) -> Any:
        child = self._store.get(call)
        if child is None:
            child = self._store[call] = self._child("store", call)
            if self._cells is not None:
                self._store_slots[call] = child.slot
        return child

    def _label(self, operation: str) -> str:
        """The operation's label; bounded, since operations can come from requests."""
        label = self._operations.get(operation)
        if label is None:
            if len(self._operations) >= MAX_OPERATIONS:
                return "other"
            label = self._operations[operation] = operation or _NO_OPERATION
        return label

    def count(self, outcome: str, operation: str, n: float = 1) -> None:
        """Add ``n`` to the ``outcome`` counter of ``operation``."""
        if not self.enabled:
            return
        try:
            slot = self._count_slots.get(outcome, _NOTHING).get(operation)
            if slot is None:
                self._count(outcome, operation, n)
                return
            values = self._local.values
            values[slot] += n
        except Exception as exc:
            self._broken(exc)

    def _count(self, outcome: str, operation: str, n: float) -> None:
        """:meth:`count` the general way: a new operation, or multi-process mode."""
        label = self._label(operation)
        child = self._child(outcome, label)
        child.inc(n)
        if self._cells is not None and label != "other":  # bounded like the labels
            self._count_slots.setdefault(outcome, {})[operation] = child.slot

    # -- what the engine reports -----------------------------------------------------------

    def claimed(
        self,
        operation: str,
        key_hash: str,
        took_over: object,
        seconds: float,
        step: bool = False,
    ) -> None:
        """A claim was granted after a store call of ``seconds`` (``step``: a workflow's)."""
        if not self.enabled:
            return
        if not self._answered(True, operation, key_hash, seconds, step or took_over is not None):
            self._claimed(operation, key_hash, took_over, seconds, step)

    def _claimed(
        self, operation: str, key_hash: str, took_over: object, seconds: float, step: bool
    ) -> None:
        """:meth:`claimed` the general way: a new operation, a step, a takeover (or a
        retry after a failure), or multi-process mode."""
        try:
            op = self._op(operation)
            self._store_child("claim").observe(seconds)
            if step:
                self._child("step_executed", op.label).inc()
            else:
                op.executed.inc()
            outcome = "executed"
            if took_over is not None and getattr(took_over, "value", took_over) == "processing":
                self._child("lease_takeover", op.label).inc()
                outcome = "lease_takeover"
            self._otel.event("retrysafe.claim", operation, outcome, key_hash)
        except Exception as exc:
            self._broken(exc)

    def replayed(self, operation: str, key_hash: str, seconds: float, step: bool = False) -> None:
        """A claim found a finished record to replay (``step``: a workflow's)."""
        if self.enabled and not self._answered(False, operation, key_hash, seconds, step):
            self._replayed(operation, key_hash, seconds, step)

    def _answered(
        self, ran: bool, operation: str, key_hash: str, seconds: float, rare: bool
    ) -> bool:
        """A claim's answer on the hot path: it ``ran`` (an execution) or replayed, after
        a store call of ``seconds``. False if it is left to the general way: ``rare`` (a
        step, a takeover or a retry), a new operation, or multi-process mode."""
        try:
            at = self._slots.get(operation)
            if at is None or rare:
                return False
            values = self._local.values
            values[at.executed if ran else at.replayed] += 1.0
            values[at.claim + bisect_left(_STORE_BUCKETS, seconds)] += 1.0
            values[at.claim + _STORE_SUM] += seconds
            if self._otel.trace is not None or _TRACE in _MODULES:
                if ran:
                    self._otel.event("retrysafe.claim", operation, "executed", key_hash)
                else:
                    self._otel.event("retrysafe.replay", operation, "replayed", key_hash)
        except Exception as exc:
            self._broken(exc)
        return True

    def _replayed(self, operation: str, key_hash: str, seconds: float, step: bool) -> None:
        """:meth:`replayed` the general way: a new operation, a step, or multi-process mode."""
        try:
            self._store_child("claim").observe(seconds)
            op = self._op(operation)
            if step:
                self._child("step_replayed", op.label).inc()
            else:
                op.replayed.inc()
            self._otel.event("retrysafe.replay", operation, "replayed", key_hash)
        except Exception as exc:
            self._broken(exc)

    @_quiet
    def refused(
        self, operation: str, error: BaseException, key: str = "", key_hash: str = ""
    ) -> None:
        """A keyed request was refused: in flight, conflict, bad key or store down.

        Counted once however many layers report it (the error is marked).
        """
        if not self.enabled or getattr(error, "_retrysafe_counted", False):
            return
        if isinstance(error, InProgressError):
            outcome = "in_flight"
        elif isinstance(error, FingerprintMismatchError):
            outcome = "conflict"
        elif isinstance(error, InvalidKeyError):
            outcome = "invalid_key"
        elif isinstance(error, StoreUnavailableError):
            outcome = "store_unavailable"
        elif isinstance(error, AmbiguousCredentialsError | PrincipalRequiredError):
            outcome = "principal_refused"
        else:
            return
        with contextlib.suppress(AttributeError):  # a slotted exception is counted again
            # A marker on the instance; the error classes do not declare it.
            error._retrysafe_counted = True  # type: ignore[union-attr]
        self._child(outcome, self._label(operation)).inc()
        self._otel.event("retrysafe.claim", operation, outcome, key_hash)
        if outcome in ("in_flight", "conflict"):
            self._note(outcome, operation, key or getattr(error, "key", ""), key_hash, str(error))
        if outcome == "in_flight" and key_hash:
            self._burst(operation, key or getattr(error, "key", ""), key_hash)

    def settled(
        self, call: str, operation: str, key_hash: str, seconds: float, handler: float
    ) -> None:
        """A completion or failure (``call``) was stored after ``handler`` seconds of work."""
        if not self.enabled:
            return
        try:
            at = self._slots.get(operation)
            store = self._store_slots.get(call)
            if at is None or store is None:
                self._store_child(call).observe(seconds)
                self._op(operation).handler.observe(handler)
            else:
                values = self._local.values
                values[store + bisect_left(_STORE_BUCKETS, seconds)] += 1.0
                values[store + _STORE_SUM] += seconds
                values[at.handler + bisect_left(_HANDLER_BUCKETS, handler)] += 1.0
                values[at.handler + _HANDLER_SUM] += handler
            if self._otel.trace is not None or _TRACE in _MODULES:
                self._otel.event(f"retrysafe.{call}", operation, "ok", key_hash)
        except Exception as exc:
            self._broken(exc)

    @_quiet
    def failed(self, operation: str, key: str, key_hash: str, attempts: int, final: bool) -> None:
        """An attempt was marked failed; its key's ``attempts``-th attempt."""
        if not self.enabled:
            return
        self._child("failed", self._label(operation)).inc()
        detail = f"attempt {attempts} failed" + (" finally" if final else "")
        self._note("failed", operation, key, key_hash, detail, attempts=attempts, final=final)
        if attempts >= self.alerts.failures:
            detail = f"the key failed {attempts} attempts in a row"
            self.alert("repeated_failures", operation, key, key_hash, detail, attempts=attempts)

    def store_call(self, call: str, seconds: float) -> None:
        """A store call (``claim``, ``renew``, …) took ``seconds``."""
        if not self.enabled:
            return
        try:
            store = self._store_slots.get(call)
            if store is None:
                self._store_child(call).observe(seconds)
                return
            values = self._local.values
            values[store + bisect_left(_STORE_BUCKETS, seconds)] += 1.0
            values[store + _STORE_SUM] += seconds
        except Exception as exc:
            self._broken(exc)

    @_quiet
    def unrecorded(self, what: str, operation: str, key: str, key_hash: str) -> None:
        """A completion or failure could not be written: the store was unreachable.

        The side effect may have run with no record of it: a retry after the lease
        runs it again unless the handler is idempotent downstream.
        """
        if not self.enabled:
            return
        self._child("unrecorded", self._label(operation)).inc()
        self.alert(
            "unrecorded_outcome",
            operation,
            key,
            key_hash,
            f"the {what} could not be written: the store was unreachable",
        )

    @_quiet
    def stale(self, what: str, operation: str, key: str, key_hash: str) -> None:
        """A completion, failure or renewal was refused: the lease had been lost."""
        if not self.enabled:
            return
        self._child("stale_refused", self._label(operation)).inc()
        self.alert(
            "stale_completion",
            operation,
            key,
            key_hash,
            f"a stale {what} was refused: the attempt had lost its lease",
        )

    @_quiet
    def stuck(self, operation: str, key: str, key_hash: str, overdue: float) -> None:
        """A processing record's lease ended ``overdue`` seconds ago (alerted once per record)."""
        if not self.enabled or key_hash in self._stuck:
            return
        self._stuck[key_hash] = None
        while len(self._stuck) > 10_000:
            self._stuck.popitem(last=False)
        detail = f"processing {overdue:.1f}s past its lease"
        self.alert("stuck_processing", operation, key, key_hash, detail, overdue=round(overdue, 3))

    def _broken(self, exc: Exception) -> None:
        """A report failed (a full disk under the multi-process folder, say): log it
        once per kind, and go on."""
        kind = type(exc).__name__
        if kind not in self._failures:
            self._failures.add(kind)
            log.error(
                "retrysafe: a metrics report failed (%s: %s); requests go on without it", kind, exc
            )

    def _after_fork(self) -> None:
        """In a forked child: new locks (one held by another thread at the fork would
        never be released)."""
        self._lock = threading.Lock()
        if self._cells is not None:
            self._cells._lock = threading.Lock()
        self.alert_log._after_fork()

    # -- alerts and recent events ------------------------------------------------------------

    @_quiet
    def alert(
        self, name: str, operation: str, key: str, key_hash: str, detail: str, **extra: Any
    ) -> None:
        """Count an alert and log it as a structured ``retrysafe.alerts`` event, at most
        one line per kind per interval (see :class:`AlertLog`). Never the raw key."""
        if not self.enabled:
            return
        self._child("alert", name).inc()
        fields = {"alert": name, "operation": operation, "key_hash": key_hash[:16], **extra}
        self.alert_log.emit(
            name,
            "retrysafe alert %s: %s (operation=%s key_hash=%s)",
            (name, detail, operation, key_hash[:16]),
            fields,
        )
        self._note(f"alert:{name}", operation, key, key_hash, detail, **extra)

    def _note(
        self, kind: str, operation: str, key: str, key_hash: str, detail: str, **extra: Any
    ) -> None:
        self.recent.append(Event(time.time(), kind, operation, key, key_hash, detail, extra))

    def _burst(self, operation: str, key: str, key_hash: str) -> None:
        now = time.monotonic()
        with self._lock:
            times = self._bursts.pop(key_hash, [])
            times = [t for t in times if now - t < self.alerts.burst_window]
            times.append(now)
            fire = len(times) >= self.alerts.burst
            if not fire:
                self._bursts[key_hash] = times
                while len(self._bursts) > 10_000:
                    self._bursts.popitem(last=False)
        if fire:
            self.alert(
                "burst",
                operation,
                key,
                key_hash,
                f"{len(times) + 1} requests with one key within {self.alerts.burst_window:g}s",
                requests=len(times) + 1,
            )


#: The process's metrics; the engine reports here.
METRICS = Metrics(
    enabled=os.environ.get("RETRYSAFE_METRICS", "1").strip().lower()
    not in ("0", "false", "no", "off")
)
# The alerts held back for a summary are written when the process ends.
atexit.register(lambda: METRICS.alert_log.flush(everything=True))
