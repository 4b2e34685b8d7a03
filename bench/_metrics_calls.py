"""bench/metrics.py's timing of each metrics call (``timeit``), in one process and in
prometheus_client's multi-process mode.

Loaded by path by bench/metrics.py (see its docstring); not a script of its own.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import timeit
from pathlib import Path
from typing import Any

from retrysafe._core.metrics import METRICS

#: The script whose children time and count the calls (bench/metrics.py's hidden flags).
SCRIPT = Path(__file__).resolve().with_name("metrics.py")
ROOT = SCRIPT.parent.parent
SINGLE, MULTI = "one process", "multi-process mode"
Costs = dict[str, dict[str, Any]]  # mode -> what -> ns per call (and CHILDREN -> classes)


# -- what each metrics call costs -------------------------------------------------------------


#: (what, statement, enabled, how often); run on the process's real ``METRICS``.
CALLS: list[tuple[str, str, bool, str]] = [
    ("`METRICS.claimed(...)`, on", "m.claimed(op, kh, None, 2e-6)", True, "1 per first request"),
    (
        "`METRICS.settled(...)`, on",
        'm.settled("complete", op, kh, 2e-6, 5e-6)',
        True,
        "1 per first request",
    ),
    ("`METRICS.replayed(...)`, on", "m.replayed(op, kh, 2e-6)", True, "1 per replay"),
    ("`METRICS.claimed(...)`, off", "m.claimed(op, kh, None, 2e-6)", False, "the same, off"),
    (
        "`METRICS.settled(...)`, off",
        'm.settled("complete", op, kh, 2e-6, 5e-6)',
        False,
        "the same, off",
    ),
    ("`METRICS.replayed(...)`, off", "m.replayed(op, kh, 2e-6)", False, "the same, off"),
    (
        '`METRICS.store_call("renew", ...)`, on',
        'm.store_call("renew", 2e-6)',
        True,
        "1 per lease renewal",
    ),
    (
        '`METRICS.count("invalid_key", op)`, on',
        'm.count("invalid_key", op)',
        True,
        "1 per refused key (not the hot path)",
    ),
    (
        "`time.perf_counter()`",
        "time.perf_counter()",
        True,
        "4 per first request, 2 per replay, on or off",
    ),
]
#: The scrape: every retrysafe metric as Prometheus text, :data:`SCRAPE_OPS` operations.
SCRAPE = "a scrape (`generate_latest`)"
SCRAPE_OPS = 10


CHILDREN = "children"  # the key of call_costs() that names the children's classes


def call_names() -> dict[str, Any]:
    """The names :data:`CALLS` use, with the metrics made and :data:`SCRAPE_OPS`
    operations counted (from this thread and from an ended one), so that every call
    timed is a steady-state one."""
    from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

    m = METRICS
    m.enabled = True
    op, kh = "rsbench.micro", "k" * 64

    def traffic() -> None:
        for name in [op, *(f"rsbench.op{i}" for i in range(SCRAPE_OPS - 1))]:
            m.claimed(name, kh, None, 2e-6)  # creates the metrics and the children
            m.settled("complete", name, kh, 2e-6, 5e-6)
            m.replayed(name, kh, 2e-6)
        m.store_call("renew", 2e-6)
        m.count("invalid_key", op)

    traffic()
    ended = threading.Thread(target=traffic)
    ended.start()
    ended.join()
    registry = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    return {
        "m": m,
        "op": op,
        "kh": kh,
        "time": time,
        "scrape": functools.partial(generate_latest, registry),
    }


def call_costs(number: int = 100_000, repeat: int = 7) -> dict[str, Any]:
    """ns per call of each of :data:`CALLS`: the least of ``repeat`` timeit runs of
    ``number`` calls, minus an empty loop's; the same of :data:`SCRAPE` (``number``
    / 500 calls); and, under :data:`CHILDREN`, how the process keeps its values."""
    m = METRICS
    names = call_names()
    empty = min(timeit.Timer("pass").repeat(repeat, number)) / number
    out: dict[str, Any] = {CHILDREN: values_kind()}
    try:
        for what, stmt, enabled, _ in CALLS:
            m.enabled = enabled
            best = min(timeit.Timer(stmt, globals=names).repeat(repeat, number)) / number
            out[what] = max(0.0, best - empty) * 1e9
        m.enabled = True
        few = max(1, number // 500)
        out[SCRAPE] = min(timeit.Timer("scrape()", globals=names).repeat(repeat, few)) / few * 1e9
    finally:
        m.enabled = True
    return out


def values_kind() -> str:
    """Where this process's metrics live: its own cells, or prometheus_client's values."""
    cells = getattr(METRICS, "_cells", None)
    if cells is not None:
        return f"{type(cells).__module__}.{type(cells).__qualname__}"
    return "prometheus_client.metrics.Counter, prometheus_client.metrics.Histogram"


def multiprocess_costs() -> dict[str, Any]:
    """:func:`call_costs` in a child process in prometheus_client's multi-process mode
    (``PROMETHEUS_MULTIPROC_DIR`` set, as ``retrysafe gateway --workers N`` does)."""
    with tempfile.TemporaryDirectory(prefix="rsbench-multiproc-") as tmp:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": tmp}
        out = subprocess.run(
            [sys.executable, str(SCRIPT), "--call-costs-json"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
    return json.loads(out.stdout.strip().splitlines()[-1])
