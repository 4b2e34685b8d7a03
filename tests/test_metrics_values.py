"""The metrics' values: exact from racing threads and from several processes, the
same on the hot path as on the general one, and never failing the request.

A report in one process adds to its thread's own list of values, with no lock;
these tests race threads at a switch interval of a microsecond, and compare the
exposition with that of the same reports made one after another. (CPython 3.11
does not switch threads inside ``values[i] += 1``, so a shared list would pass
the count too; what the race tests here is the rest: new slots added to every
thread's list while the others count, threads starting, ending and retiring.)
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from retrysafe import Status
from retrysafe._core import metrics as _metrics
from retrysafe._core.metrics import Metrics

KH = "k" * 64
#: Binary fractions: their sums are exact in any order, so racing threads and one
#: thread give the same text.
EXACT = (0.0625, 0.5, 0.25, 3.0, 0.001953125)


def text(registry: CollectorRegistry) -> list[str]:
    return sorted(generate_latest(registry).decode().splitlines())


def fresh() -> tuple[Metrics, CollectorRegistry]:
    registry = CollectorRegistry()
    return Metrics(registry=registry), registry


def hot(m: Metrics, ops: list[str], n: int) -> None:
    """What requests report: a claim, a completion and a replay, and a renewal."""
    for i in range(n):
        op = ops[i % len(ops)]
        m.claimed(op, KH, None, EXACT[i % 5])
        m.settled("complete", op, KH, EXACT[(i + 1) % 5], EXACT[(i + 2) % 5])
        m.replayed(op, KH, EXACT[(i + 3) % 5])
        m.store_call("renew", EXACT[i % 2])


@pytest.fixture
def racing() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def race(target: Callable[[int], None], threads: int) -> None:
    """``target(i)`` in ``threads`` threads, released together."""
    barrier = threading.Barrier(threads)

    def run(i: int) -> None:
        barrier.wait()
        target(i)

    started = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join()


@pytest.mark.usefixtures("racing")
def test_racing_threads_count_exactly_what_one_thread_counts() -> None:
    """16 threads report at once, half of them on operations no thread has reported
    yet: new slots are added to every thread's values while the others add to
    theirs. Nothing is lost, and the text is that of the same reports in a row."""
    threads, n = 16, 300
    ops_of = [["shared", f"own-{i}", f"pair-{i // 2}"] for i in range(threads)]
    m, registry = fresh()
    race(lambda i: hot(m, ops_of[i], n), threads)
    one, one_registry = fresh()
    for ops in ops_of:
        hot(one, ops, n)
    assert text(registry) == text(one_registry)
    assert registry.get_sample_value("retrysafe_executions_total", {"operation": "shared"}) == (
        threads * n / 3
    )
    count = registry.get_sample_value("retrysafe_store_seconds_count", {"call": "renew"})
    assert count == threads * n
    assert m._slots  # the hot path was taken


@pytest.mark.usefixtures("racing")
def test_scrapes_while_threads_report_never_go_down() -> None:
    m, registry = fresh()
    hot(m, ["op"], 1)
    done = threading.Event()
    seen: list[float] = []

    def scrape() -> None:
        while not done.is_set():
            seen.append(
                registry.get_sample_value("retrysafe_handler_seconds_count", {"operation": "op"})
                or 0.0
            )

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        race(lambda i: hot(m, ["op", f"new-{i}"], 400), 8)
    finally:
        done.set()
        scraper.join()
    assert all(a <= b for a, b in itertools.pairwise(seen))
    final = registry.get_sample_value("retrysafe_handler_seconds_count", {"operation": "op"})
    assert final == 1 + 8 * 200


class _Forgetful(dict[str, Any]):
    """A lookup that keeps nothing: every report takes the general path."""

    def __setitem__(self, key: str, value: Any) -> None:
        pass

    def setdefault(self, key: str, default: Any = None) -> Any:
        return _Forgetful()


def general_only() -> tuple[Metrics, CollectorRegistry]:
    """Metrics whose hot-path lookups keep nothing."""
    m, registry = fresh()
    m._slots = _Forgetful()
    m._store_slots = _Forgetful()  # type: ignore[assignment]
    m._count_slots = _Forgetful()  # type: ignore[assignment]
    return m, registry


def edge_cases(m: Metrics) -> None:
    """Reports the hot path hands to the general one, around ones it takes."""
    hot(m, ["a", "b", ""], 12)  # "" is labelled "(none)"
    m.claimed("a", KH, Status.PROCESSING, 0.5)  # a takeover
    m.claimed("a", KH, Status.FAILED, 0.5)  # a retry after a failure
    m.claimed("a", KH, None, 0.25, step=True)
    m.replayed("a", KH, 0.25, step=True)
    m.settled("fail", "b", KH, 0.0625, 30.0)
    m.settled("complete", "b", KH, 100.0, 1000.0)  # past the last bucket: +Inf
    m.store_call("claim", 0.0)  # the first bucket's bound is inclusive
    for _ in range(3):
        m.count("invalid_key", "a")
        m.count("unscoped", "b", 0)  # shown at zero
        m.count("unscoped", "", 2)
    for i in range(_metrics.MAX_OPERATIONS + 5):  # past the bound: "other"
        m.claimed(f"op-{i}", KH, None, 0.0625)
        m.replayed(f"op-{i}", KH, 0.0625)


def test_the_hot_path_reports_what_the_general_path_reports() -> None:
    m, registry = fresh()
    edge_cases(m)
    general, general_registry = general_only()
    edge_cases(general)
    assert not general._slots and not general._count_slots
    assert m._slots and m._store_slots and m._count_slots
    assert text(registry) == text(general_registry)
    # "a", "b" and "(none)" came first: 8 of the numbered operations are past the bound.
    assert registry.get_sample_value("retrysafe_executions_total", {"operation": "other"}) == 8
    assert registry.get_sample_value("retrysafe_unscoped_requests_total", {"operation": "b"}) == 0


def test_the_hot_path_adds_the_same_span_events() -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # another test may have set one
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    m, _ = fresh()
    general, _ = general_only()
    for name, metrics in (("hot", m), ("general", general)):
        with tracer.start_as_current_span(name):
            hot(metrics, ["a"], 3)
            metrics.settled("fail", "a", KH, 0.5, 0.5)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    events = {
        name: [(e.name, dict(e.attributes or {})) for e in spans[name].events]
        for name in ("hot", "general")
    }
    assert events["hot"] == events["general"]
    assert [e for e, _ in events["hot"]][:4] == [
        "retrysafe.claim",
        "retrysafe.complete",
        "retrysafe.replay",
        "retrysafe.claim",
    ]
    assert events["hot"][-1] == (
        "retrysafe.fail",
        {"retrysafe.operation": "a", "retrysafe.outcome": "ok", "retrysafe.key_hash": KH},
    )


def test_a_failing_report_on_the_hot_path_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    m, registry = fresh()
    hot(m, ["a"], 2)

    class Broken:
        def __getattr__(self, name: str) -> Any:
            raise OSError(28, "No space left on device")

    m._local = Broken()
    m._cells.local = Broken()  # type: ignore[union-attr]
    hot(m, ["a"], 3)  # nothing raised
    errors = [r for r in caplog.records if "metrics report failed" in r.getMessage()]
    assert len(errors) == 1 and errors[0].levelno == logging.ERROR
    assert registry.get_sample_value("retrysafe_executions_total", {"operation": "a"}) == 2


WORKER = """
import sys, threading
from retrysafe._core.metrics import METRICS
def work():
    for i in range(500):
        METRICS.claimed("op", "k", None, 0.0625)
        METRICS.settled("complete", "op", "k", 0.5, 0.25)
        METRICS.replayed("op", "k", 0.0625)
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


def test_several_processes_add_up_in_multiprocess_mode(tmp_path: Path) -> None:
    """prometheus_client's multi-process mode (``PROMETHEUS_MULTIPROC_DIR``): three
    processes of four threads each; whoever scrapes adds them up, exactly."""
    from prometheus_client import multiprocess

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    workers = [
        subprocess.Popen([sys.executable, "-c", WORKER], env=env, stderr=subprocess.PIPE)
        for _ in range(3)
    ]
    for w in workers:
        _, err = w.communicate(timeout=300)
        assert w.returncode == 0, err.decode()
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    get = registry.get_sample_value
    assert get("retrysafe_executions_total", {"operation": "op"}) == 3 * 4 * 500
    assert get("retrysafe_replays_total", {"operation": "op"}) == 3 * 4 * 500
    assert get("retrysafe_store_seconds_count", {"call": "claim"}) == 2 * 3 * 4 * 500
    assert get("retrysafe_store_seconds_sum", {"call": "complete"}) == 0.5 * 3 * 4 * 500
    assert get("retrysafe_handler_seconds_sum", {"operation": "op"}) == 0.25 * 3 * 4 * 500
