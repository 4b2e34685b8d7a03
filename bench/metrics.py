"""What reporting metrics costs: requests per second with metrics on against off, in one run.

Issue "Step 7" asks for an overhead benchmark with a target: the rate with metrics
on at least 0.95 of the rate with them off. In one process and one run, every
variant is measured with ``METRICS.enabled`` on and off, interleaved (on, off, the
next variant's on, off, ...; the whole order flips every round), after a warm-up:

* **asgi**: ``retrysafe.asgi.IdempotencyMiddleware`` around the endpoint of
  bench/http.py (a pure ASGI app that reads the body and answers 201 with a small
  JSON body), driven by direct ASGI calls on one event loop (uvloop when installed):
  no socket, no server, nothing that hides the Python work, so the worst case for
  the overhead. On ``memory://`` and on ``sqlite:///<temp dir>/m.db`` (default
  options), with first requests (a new key each), replays (one completed key) and
  the mix (the two alternating);
* **engine**: ``engine.begin`` + ``engine.complete`` on the memory store, and
  ``begin`` of a completed key (bench/stores.py's contenders): the per-call CPU
  cost metrics add;
* **server**: the same middleware and endpoint under uvicorn
  (``retrysafe._ops.serve.ServerThread``, a thread of this process, so that toggling
  ``METRICS.enabled`` reaches it) and an ``httpx.Client`` (keep-alive) sending keyed
  POSTs one after another from the main thread; first requests, replays and the mix.
  The server thread's own CPU clock gives its CPU per request too: the ratio a
  saturated server would reach.

A variant's ratio is the median over the rounds of its rate with metrics on divided
by its rate with them off *in the same round*; added CPU is the median over the
rounds of the difference in this process's CPU time per request (on - off), which
other load on the machine moves far less than the rate. Before the rounds each
variant is checked: with metrics on, its requests are counted (executions +
replays); with them off, nothing is. A separate table times each metrics call
(``timeit``, also in prometheus_client's multi-process mode): what the engine's
reports cost, piece by piece.

    python bench/metrics.py [--rounds R] [--seconds S] [--sections asgi,engine,server]
                            [--stores memory,sqlite] [--server-stores memory[,sqlite]]
                            [--rev REV] [--instructions [N]] [--call-instructions [N]]
                            [--profile]
                            [--write docs/performance.md]

``--rev`` measures a commit's ``src/`` (exported with ``git archive``, run in a child
process) instead of a working tree that others may be editing. ``--instructions``
counts, with valgrind, the instructions per request of the in-process memory variants
with metrics off and on: exact figures, whatever the machine's load (about 30 s
more). ``--call-instructions`` counts, with valgrind too, the instructions of each
metrics call and of a scrape, in one process and in multi-process mode. ``--profile``
adds a cProfile of the in-process memory-store variants' metrics-on loops after the
rounds.

This is a benchmark, not a test (pytest does not run it).
"""

# ruff: noqa: E402  (the imports follow the sys.path guard below)
from __future__ import annotations

import sys
from pathlib import Path

# Keep this folder off sys.path: bench/http.py would shadow the standard library's http.
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import argparse
import asyncio
import contextlib
import cProfile
import functools
import gc
import importlib.util
import io
import itertools
import json
import os
import pstats
import re
import secrets
import shlex
import sqlite3
import statistics
import subprocess
import tempfile
import textwrap
import threading
import time
import timeit
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import ModuleType
from typing import Any

import httpx

from retrysafe import Engine, open_store
from retrysafe._core.metrics import METRICS
from retrysafe._ops.monitor import read_sample
from retrysafe._ops.serve import ServerThread, bind
from retrysafe.asgi import IdempotencyMiddleware

BEGIN_MARK = "<!-- bench/metrics.py: generated from here -->"
END_MARK = "<!-- bench/metrics.py: generated up to here -->"
SECTION = "## Step 7: metrics overhead"
SECTIONS = ("asgi", "engine", "server")
SINGLE, MULTI = "one process", "multi-process mode"
TARGET = 0.95
FIRST, REPLAY, MIX = "first", "replay", "mix"
WORKLOADS = (FIRST, REPLAY, MIX)
HOST = "127.0.0.1"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bs = _load("_rsbench_stores", HERE / "stores.py")
bh = _load("_rsbench_http", HERE / "http.py")
Contender = bs.Contender
BenchError = bs.BenchError
PATH = bh.PATH
BODY = bh.REQUEST_BODY.encode()


# -- pairs: one variant, metrics on and off ------------------------------------------------


@dataclass
class Pair:
    """One variant measured twice per round: with metrics on and with them off."""

    section: str
    store: str
    workload: str
    on: Any  # Contender
    off: Any  # Contender
    run: Callable[[int], None]
    prepare: Callable[[], None]
    #: (CPU seconds of the server's thread, requests sent) so far, for the server variants
    server: Callable[[], tuple[float, int]] | None = None
    server_us: dict[str, list[float]] = field(default_factory=lambda: {"on": [], "off": []})

    @property
    def label(self) -> str:
        return f"{self.section}/{self.store}/{self.workload}"

    @property
    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.on.samples, self.off.samples, strict=True)]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def added_cpu(self) -> float:
        """Median over the rounds of (CPU us per request on) - (off)."""
        diffs = [a - b for a, b in zip(self.on.cpu_us, self.off.cpu_us, strict=True)]
        return statistics.median(diffs)

    @property
    def cpu_ratio(self) -> float:
        """Off's CPU per request over on's: the rate ratio of a CPU-bound process."""
        return statistics.median(
            b / a for a, b in zip(self.on.cpu_us, self.off.cpu_us, strict=True)
        )

    def server_figures(self) -> tuple[float, float, float, float]:
        """The server thread's CPU us per request (medians off, on), the median per-round
        difference, and the median per-round ratio off / on."""
        on, off = self.server_us["on"], self.server_us["off"]
        return (
            statistics.median(off),
            statistics.median(on),
            statistics.median(a - b for a, b in zip(on, off, strict=True)),
            statistics.median(b / a for a, b in zip(on, off, strict=True)),
        )


def pair(
    section: str,
    store: str,
    workload: str,
    run: Callable[[int], None],
    prepare: Callable[[], None] = bs._noop,
) -> Pair:
    def on() -> None:
        METRICS.enabled = True
        prepare()

    def off() -> None:
        METRICS.enabled = False
        prepare()

    name = f"{section}/{store}"
    return Pair(
        section,
        store,
        workload,
        Contender(name, "on", workload, run, on),
        Contender(name, "off", workload, run, off),
        run,
        prepare,
    )


def counted() -> float:
    sample = read_sample()
    return sample.total("executed") + sample.total("replayed")


def check_counting(pairs: Sequence[Pair], n: int = 20) -> None:
    """Metrics on: each request is counted once (an execution or a replay); off: none is."""
    try:
        for p in pairs:
            for enabled in (True, False):
                METRICS.enabled = enabled
                p.prepare()  # a replay key's first request is counted here, before
                before = counted()
                p.run(n)
                got, want = counted() - before, n if enabled else 0
                if got != want:
                    state = "on" if enabled else "off"
                    raise BenchError(
                        f"{p.label}: {n} requests with metrics {state} "
                        f"counted {got:g} times (expected {want})"
                    )
    finally:
        METRICS.enabled = True


def run_rounds(pairs: Sequence[Pair], rounds: int, seconds: float, warmup: float) -> None:
    """Warm each pair up (one batch size for both sides), then measure all interleaved."""
    try:
        for p in pairs:
            p.off.measure(warmup)
            rate = p.on.measure(warmup)
            p.on.batch = p.off.batch = max(1, min(1000, int(rate / 200)))  # ~5 ms per batch
            p.on.cpu_us.clear()
            p.off.cpu_us.clear()
        flat = [(p, side) for p in pairs for side in ("on", "off")]
        for r in range(rounds):
            for p, side in flat if r % 2 == 0 else reversed(flat):
                before = p.server() if p.server else (0.0, 0)
                c = getattr(p, side)
                c.samples.append(c.measure(seconds))
                if p.server:
                    after = p.server()
                    us = (after[0] - before[0]) / (after[1] - before[1]) * 1e6
                    p.server_us[side].append(us)
            line = "  ".join(
                f"{p.store}/{p.workload}={p.on.samples[-1] / p.off.samples[-1]:.3f}" for p in pairs
            )
            print(f"  round {r + 1}/{rounds} (on/off): {line}", flush=True)
    finally:
        METRICS.enabled = True


# -- asgi: the middleware driven by direct ASGI calls ----------------------------------------


def new_loop() -> asyncio.AbstractEventLoop:
    if importlib.util.find_spec("uvloop") is not None:
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def loop_name() -> str:
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


HEADERS = [
    (b"host", b"127.0.0.1"),
    (b"user-agent", b"rsbench"),
    (b"content-type", b"application/json"),
    (b"authorization", b"Bearer rsbench"),
    (b"content-length", str(len(BODY)).encode()),
]


def scope_of(key: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": PATH,
        "raw_path": PATH.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [*HEADERS, (b"idempotency-key", key.encode())],
        "client": (HOST, 50000),
        "server": (HOST, 8000),
    }


class Keys:
    """Fresh keys for first requests and one completed key for replays."""

    def __init__(self, name: str) -> None:
        self.tag = f"{name}-{secrets.token_hex(4)}"
        self.seq = itertools.count()
        self.replay = ""

    def fresh(self) -> str:
        return f"{self.tag}-{next(self.seq)}"


def workload_runs(
    label: str,
    send_one: Callable[[str], Any],
    endpoint: Any,
    keys: Keys,
    batch: Callable[[Callable[[int], Any]], Callable[[int], None]],
) -> dict[str, tuple[Callable[[int], None], Callable[[], None]]]:
    """Per workload: run(n) and prepare(), built on ``send_one(key)`` (a coroutine
    function or a plain one; ``batch`` turns a body of n requests into run(n))."""

    def checked(expected: Callable[[int], int], body: Callable[[int], Any]) -> Callable[[int], Any]:
        def wrapped(n: int) -> Any:
            before = endpoint.calls
            result = body(n)

            def verify() -> None:
                ran = endpoint.calls - before
                if ran != expected(n):
                    raise BenchError(
                        f"{label}: the endpoint ran {ran} times for {n} requests "
                        f"(expected {expected(n)})"
                    )

            return result, verify

        return wrapped

    def prepare_replay() -> None:
        keys.replay = keys.fresh()
        batch(lambda n: [send_one(keys.replay)])(1)

    def first(n: int) -> Any:
        return [send_one(keys.fresh()) for _ in range(n)]

    def replay(n: int) -> Any:
        key = keys.replay
        return [send_one(key) for _ in range(n)]

    def mix(n: int) -> Any:
        key = keys.replay
        return [send_one(keys.fresh() if i % 2 == 0 else key) for i in range(n)]

    return {
        FIRST: (batch(checked(lambda n: n, first)), bs._noop),
        REPLAY: (batch(checked(lambda n: 0, replay)), prepare_replay),
        MIX: (batch(checked(lambda n: (n + 1) // 2, mix)), prepare_replay),
    }


def asgi_pairs(store: str, url: str, loop: asyncio.AbstractEventLoop) -> list[Pair]:
    endpoint = bh.Endpoint()
    app = IdempotencyMiddleware(endpoint, store=url, operation=f"rsbench.asgi.{store}")
    bad: list[int] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": BODY, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and message["status"] != 201:
            bad.append(message["status"])

    def send_one(key: str) -> Coroutine[Any, Any, None]:
        return app(scope_of(key), receive, send)

    def batch(body: Callable[[int], Any]) -> Callable[[int], None]:
        async def many(coros: list[Coroutine[Any, Any, None]]) -> None:
            for coro in coros:
                await coro

        def run(n: int) -> None:
            made = body(n)
            coros, verify = made if isinstance(made, tuple) else (made, None)
            loop.run_until_complete(many(coros))
            if verify is not None:
                verify()
            if bad:
                raise BenchError(f"asgi/{store}: answered {bad[:5]} instead of 201")

        return run

    runs = workload_runs(f"asgi/{store}", send_one, endpoint, Keys(f"asgi-{store}"), batch)
    return [pair("asgi", store, w, run, prep) for w, (run, prep) in runs.items()]


# -- engine: begin + complete, and replays -------------------------------------------------


def engine_pairs() -> list[Pair]:
    engine = Engine(open_store("memory://"))
    first, replay = bs.engine_contenders("engine/memory", engine, "")
    return [
        pair("engine", "memory", FIRST, first.run),
        pair("engine", "memory", REPLAY, replay.run, replay.prepare),
    ]


# -- server: uvicorn in a thread of this process, httpx from the main thread -----------------


def server_pairs(store: str, url: str, stack: contextlib.ExitStack) -> list[Pair]:
    endpoint = bh.Endpoint()
    app = IdempotencyMiddleware(endpoint, store=url, operation=f"rsbench.server.{store}")
    server = stack.enter_context(ServerThread(app, bind(HOST, 0)))
    client = stack.enter_context(httpx.Client(base_url=server.url, timeout=30))
    headers = {"content-type": "application/json", "authorization": "Bearer rsbench"}
    sent = [0]
    assert server.thread.ident is not None
    clock = time.pthread_getcpuclockid(server.thread.ident)

    def server_cpu() -> tuple[float, int]:
        return time.clock_gettime(clock), sent[0]

    def send_one(key: str) -> None:
        sent[0] += 1
        r = client.post(PATH, content=BODY, headers={**headers, "idempotency-key": key})
        if r.status_code != 201:
            raise BenchError(f"server/{store}: answered {r.status_code}: {r.text[:200]}")

    def batch(body: Callable[[int], Any]) -> Callable[[int], None]:
        def run(n: int) -> None:
            made = body(n)
            if isinstance(made, tuple):
                made[1]()

        return run

    runs = workload_runs(f"server/{store}", send_one, endpoint, Keys(f"server-{store}"), batch)
    pairs = [pair("server", store, w, run, prep) for w, (run, prep) in runs.items()]
    for p in pairs:
        p.server = server_cpu
    return pairs


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
            [sys.executable, __file__, "--call-costs-json"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- instructions per metrics call, whatever the machine's load -------------------------------

CALL_WARMUP = 200


def call_count_run(n: int) -> None:
    """The child of :func:`call_instructions`: an empty loop of ``n``, then each of
    :data:`CALLS` ``n`` times and :data:`SCRAPE` ``n // 100`` times, each batch inside
    one ``functools.reduce`` call (the only code callgrind counts, dumped after each)."""
    names = call_names()
    batches = [("", "pass", True, n)]
    batches += [(what, stmt, enabled, n) for what, stmt, enabled, _ in CALLS]
    batches.append((SCRAPE, "scrape()", True, max(1, n // 100)))
    try:
        for _, stmt, enabled, k in batches:
            METRICS.enabled = enabled
            timer = timeit.Timer(stmt, globals=names)
            timer.timeit(min(k, CALL_WARMUP))
            gc.collect()
            functools.reduce(lambda _, t: t.timeit(k), [timer], None)
    finally:
        METRICS.enabled = True


def _call_instructions(n: int, multi: bool, tmp: str) -> dict[str, float]:
    folder = Path(tmp) / ("multi" if multi else "single")
    folder.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    if multi:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
    argv = [sys.executable, __file__, "--call-count-run", str(n)]
    totals, stderr = callgrind(argv, folder / "calls.out", env)
    whats = [what for what, *_ in CALLS]
    if len(totals) != len(whats) + 2:
        raise BenchError(f"call instructions: callgrind gave {totals}:\n{stderr[-2000:]}")
    per_loop = totals[0] / n
    counts = {w: t / n - per_loop for w, t in zip(whats, totals[1:-1], strict=True)}
    counts[SCRAPE] = totals[-1] / max(1, n // 100)
    return counts


def call_instructions(n: int) -> Costs:
    """mode -> call -> instructions per call, counted by callgrind (an empty loop's
    subtracted; the scrape's not), in one process and in multi-process mode."""
    from concurrent.futures import ThreadPoolExecutor

    with (
        tempfile.TemporaryDirectory(prefix="rsbench-callgrind-") as tmp,
        ThreadPoolExecutor(2) as pool,
    ):
        single, multi = pool.map(lambda multi: _call_instructions(n, multi, tmp), (False, True))
    return {SINGLE: single, MULTI: multi}


# -- instructions: what metrics add per request, whatever the machine's load ----------------

COUNTED = [("asgi", FIRST), ("asgi", REPLAY), ("engine", FIRST), ("engine", REPLAY)]
COUNT_WARMUP = 200


def count_run(section: str, workload: str, n: int) -> None:
    """The child of :func:`instructions`: one in-process variant on the memory store,
    warmed up with metrics off and on, then ``n`` requests off and ``n`` on, each batch
    inside one ``functools.reduce`` call: the only code callgrind counts (and dumps
    after), so start-up, warm-up and preparation are left out."""
    loop = new_loop()
    pairs = asgi_pairs("memory", "memory://", loop) if section == "asgi" else engine_pairs()
    chosen = next(p for p in pairs if p.workload == workload)
    for state in (False, True):
        METRICS.enabled = state
        chosen.prepare()
        chosen.run(COUNT_WARMUP)
    for state in (False, True):
        METRICS.enabled = state
        chosen.prepare()
        gc.collect()
        gc.freeze()  # a full collection within one batch would walk the whole heap
        functools.reduce(lambda _, k: chosen.run(k), [n], None)
    METRICS.enabled = True


def callgrind(
    argv: list[str], out: Path, env: dict[str, str] | None = None
) -> tuple[list[int], str]:
    """Run ``argv`` under callgrind, counting only inside ``functools.reduce`` calls
    and dumping after each: the instructions of each dump, and the child's stderr
    (an empty list if it failed)."""
    run = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--collect-atstart=no",
            "--toggle-collect=functools_reduce",
            "--dump-after=functools_reduce",
            f"--callgrind-out-file={out}",
            *argv,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    dumps = sorted(out.parent.glob(f"{out.name}.*"), key=lambda f: int(f.suffix[1:]))
    totals = []
    for dump in dumps:
        found = re.search(r"^totals: (\d+)", dump.read_text(), re.M)
        totals.append(int(found.group(1)) if found else -1)
    if run.returncode != 0 or (totals and min(totals) <= 0):
        return [], run.stderr
    return totals, run.stderr


def _instructions(section: str, workload: str, n: int, tmp: str) -> tuple[float, float]:
    argv = [sys.executable, __file__, "--count-run", section, workload, str(n)]
    totals, stderr = callgrind(argv, Path(tmp) / f"{section}-{workload}.out")
    if len(totals) != 2:
        raise BenchError(
            f"{section}/{workload}: callgrind gave {totals} (expected 2 dumps):\n{stderr[-2000:]}"
        )
    return totals[0] / n, totals[1] / n


def instructions(n: int) -> dict[tuple[str, str], tuple[float, float]]:
    """(section, workload) -> instructions per request (off, on) on the memory store,
    counted by valgrind's callgrind: the same on every run, whatever the machine's load."""
    from concurrent.futures import ThreadPoolExecutor

    with (
        tempfile.TemporaryDirectory(prefix="rsbench-callgrind-") as tmp,
        ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool,
    ):
        results = pool.map(lambda job: _instructions(*job, n, tmp), COUNTED)
        return dict(zip(COUNTED, results, strict=True))


def instructions_table(counts: dict[tuple[str, str], tuple[float, float]]) -> list[str]:
    lines = [
        "| variant | workload | instructions/req off | on | added | off / on | target >= 0.95 |",
        "|---|---|--:|--:|--:|--:|---|",
    ]
    for (section, workload), (off, on) in counts.items():
        lines.append(
            f"| {section} / memory | {workload} | {off:,.0f} | {on:,.0f} | {on - off:+,.0f} | "
            f"{off / on:.3f} | {verdict(off / on)} |"
        )
    return lines


# -- profile ------------------------------------------------------------------------------------


ENTRY_POINTS = ("claimed", "replayed", "settled", "store_call", "refused", "failed")


def profile(pairs: Sequence[Pair], seconds: float, top: int = 25) -> str:
    """cProfile of each pair's metrics-on loop: the top functions by own time, and the
    metrics' own functions. Returns the text printed."""
    chunks = []
    for p in pairs:
        p.on.prepare()
        prof = cProfile.Profile()
        deadline = time.perf_counter() + seconds
        done = 0
        prof.enable()
        while time.perf_counter() < deadline:
            p.on.run(p.on.batch)
            done += p.on.batch
        prof.disable()
        METRICS.enabled = True
        buf = io.StringIO()
        buf.write(f"\n=== cProfile: {p.label}, metrics on, {done} requests ===\n")
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime").print_stats(top)
        stats = pstats.Stats(prof, stream=buf)
        raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
        entry = sum(
            v[3] for k, v in raw.items() if k[0].endswith("_metrics.py") and k[2] in ENTRY_POINTS
        )
        total = stats.total_tt  # type: ignore[attr-defined]
        buf.write(
            f"--- {p.label}: the engine's METRICS calls take {entry:.3f} s of "
            f"{total:.3f} s profiled ({entry / total:.0%}; cProfile inflates small "
            "calls: see the timeit table); their callees: ---\n"
        )
        stats.sort_stats("tottime").print_stats(r"_metrics\.py|prometheus_client|opentelemetry")
        text = buf.getvalue()
        print(text)
        chunks.append(text)
    return "\n".join(chunks)


# -- report -------------------------------------------------------------------------------------


def verdict(ratio: float) -> str:
    return "meets" if ratio >= TARGET else "**misses**"


def server_table(pairs: Sequence[Pair]) -> list[str]:
    lines = [
        "| variant | workload | server thread CPU us/req off | on | added "
        "| off / on (rounds min-max) | target >= 0.95 |",
        "|---|---|--:|--:|--:|--:|---|",
    ]
    for p in pairs:
        off, on, added, ratio = p.server_figures()
        rs = [b / a for a, b in zip(p.server_us["on"], p.server_us["off"], strict=True)]
        lines.append(
            f"| {p.section} / {p.store} | {p.workload} | {off:.1f} | {on:.1f} | "
            f"{added:+.1f} | {ratio:.3f} ({min(rs):.2f}-{max(rs):.2f}) | "
            f"{verdict(ratio)} |"
        )
    return lines


def results_table(pairs: Sequence[Pair], unit: str) -> list[str]:
    lines = [
        f"| variant | workload | {unit}/s off | {unit}/s on | on / off (rounds min-max) "
        f"| CPU us/{unit} off | on | added | CPU ratio | target >= 0.95 |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for p in pairs:
        rs = p.ratios
        lines.append(
            f"| {p.section} / {p.store} | {p.workload} | {p.off.median:,.0f} | "
            f"{p.on.median:,.0f} | {p.ratio:.3f} ({min(rs):.2f}-{max(rs):.2f}) | "
            f"{p.off.cpu:.1f} | {p.on.cpu:.1f} | {p.added_cpu:+.1f} | {p.cpu_ratio:.3f} | "
            f"{verdict(p.ratio)} |"
        )
    return lines


Costs = dict[str, dict[str, Any]]  # mode -> what -> ns per call (and CHILDREN -> classes)


def costs_table(costs: Costs, unit: str = "ns per call") -> list[str]:
    """One row per call of :data:`CALLS` and the scrape; a column per mode."""
    modes = list(costs)
    lines = [
        "| call | " + " | ".join(f"{unit}, {mode}" for mode in modes) + " | how often |",
        "|---|" + "--:|" * len(modes) + "---|",
    ]
    rows = [(what, note) for what, _, _, note in CALLS]
    rows.append((SCRAPE, f"per scrape, {SCRAPE_OPS} operations"))
    for what, note in rows:
        cells = [f"{costs[mode][what]:,.0f}" if what in costs[mode] else "-" for mode in modes]
        if any(c != "-" for c in cells):
            lines.append(f"| {what} | " + " | ".join(cells) + f" | {note} |")
    return lines


def added_ns(costs: dict[str, Any]) -> tuple[float, float]:
    """What metrics add to a first request and to a replay (ns), by the call costs."""
    on, off = (
        [costs[f"`METRICS.{call}(...)`, {state}"] for call in ("claimed", "settled", "replayed")]
        for state in ("on", "off")
    )
    return on[0] + on[1] - off[0] - off[1], on[2] - off[2]


def _wrap(text: str) -> str:
    return textwrap.fill(text, 88, break_long_words=False, break_on_hyphens=False)


def library_info() -> str:
    names = [
        "prometheus-client",
        "opentelemetry-api",
        "opentelemetry-sdk",
        "uvicorn",
        "uvloop",
        "httptools",
        "httpx",
    ]
    return bs.library_info(names)


def otel_state() -> str:
    try:
        from opentelemetry import trace
    except ImportError:
        return "opentelemetry-api not installed: `_Otel.event` returns at once"
    provider = type(trace.get_tracer_provider()).__name__
    state = f"opentelemetry-api installed, tracer provider `{provider}`"
    if provider in ("ProxyTracerProvider", "NoOpTracerProvider"):
        state += (
            " (none configured: `trace.get_current_span()` returns a non-recording span, "
            "so `_Otel.event` adds no event)"
        )
    return state


def render(
    sections: dict[str, list[Pair]],
    costs: Costs,
    counts: dict[tuple[str, str], tuple[float, float]],
    args: Any,
    command: str,
    info: dict[str, str],
    elapsed: float,
    per_call: Costs | None = None,
) -> str:
    first_added, replay_added = added_ns(costs[SINGLE])
    out = [
        "### The last run",
        "",
        _wrap(
            f"Generated by `bench/metrics.py --write` on {datetime.now(UTC):%Y-%m-%d %H:%M} "
            "UTC; do not edit by hand. One process, one thread driving the requests; every "
            "variant is measured with `METRICS.enabled` on and off, interleaved (on, off, "
            f"the next variant's on, off, ...) in {args.rounds} rounds of {args.seconds:g} s "
            "each, the whole order flipping every round, after a warm-up. *on / off* is the "
            "median over the rounds of the rate with metrics on divided by the rate with "
            "them off in the same round; rates and CPU are medians over the rounds; *added* "
            "is the median of the per-round difference in this process's CPU time per "
            "request (on - off), and the *CPU ratio* (off's CPU per request over on's) is "
            "the rate ratio of a process that is CPU-bound, which other load on the machine "
            "moves far less than the wall-clock rate. Before the rounds, every variant was "
            "checked to count each request once with metrics on and none with them off."
        ),
        "",
        "```",
        command,
        "```",
        "",
        f"The run took {elapsed:.0f} s.",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        "",
    ]
    if "asgi" in sections:
        out += [
            "#### The middleware, in process (no socket)",
            "",
            _wrap(
                "`IdempotencyMiddleware(endpoint, store=URL, operation=...)` around "
                "bench/http.py's endpoint (a pure ASGI app that reads the body and answers "
                f"201 with a {len(bh.ANSWER_BYTES)}-byte JSON body), called directly on one "
                f"{loop_name()} event loop with a {len(BODY)}-byte JSON body and an "
                "`Idempotency-Key`: a new key per request (*first*), one completed key "
                "(*replay*), or the two alternating (*mix*). The SQLite store is "
                "`sqlite:///<temp dir>/m.db` with its default options (WAL, "
                "`synchronous=FULL`; its async calls run in a thread, which counts in CPU)."
            ),
            "",
            *results_table(sections["asgi"], "req"),
            "",
        ]
    if "engine" in sections:
        out += [
            "#### The engine alone (memory store)",
            "",
            _wrap(
                "bench/stores.py's engine contenders: `engine.begin(new_key, operation=..., "
                "fingerprint=...)` + `engine.complete(claim, prebuilt outcome)` (*first*), "
                "and `engine.begin` of one completed key (*replay*), sync API, one thread."
            ),
            "",
            *results_table(sections["engine"], "op"),
            "",
        ]
    if "server" in sections:
        out += [
            "#### Through a real server (uvicorn in a thread of this process)",
            "",
            _wrap(
                "The same middleware and endpoint served by `retrysafe._ops.serve.ServerThread` "
                "(uvicorn, one thread of this process with its own event loop, default "
                "settings: httptools and uvloop when installed, no access log), and an "
                "`httpx.Client` (keep-alive, one connection) posting from the main thread, "
                "one request after another, over loopback. Client and server share this "
                "process, so its CPU per request is both sides' (the client's part does not "
                "change with metrics)."
            ),
            "",
            *results_table(sections["server"], "req"),
            "",
            _wrap(
                "The server's own CPU per request: the CPU clock of uvicorn's thread "
                "(`time.pthread_getcpuclockid`) over each measurement, divided by the "
                "requests sent in it. *off / on* here (the median of the per-round ratios) "
                "is the rate ratio of a saturated server, which the rates above, with one "
                "client waiting for each answer and its own CPU in the same process, do not "
                "show."
            ),
            "",
            *server_table(sections["server"]),
            "",
        ]
    if counts:
        out += [
            "#### Instructions per request (valgrind)",
            "",
            _wrap(
                "The in-process variants on the memory store, each in a child process under "
                "valgrind's callgrind: after a warm-up of "
                f"{COUNT_WARMUP} requests with metrics off and as many on, "
                f"{args.instructions} requests with metrics off and {args.instructions} on, "
                "each batch the only code callgrind counts (start-up, warm-up and one-time "
                "costs left out) and started after `gc.collect()` + `gc.freeze()` (so that "
                "a full collection in one batch does not walk the whole heap); "
                "instructions per request. The count is the same on every "
                "run, whatever the machine's load; *off / on* is the rate ratio a CPU-bound "
                "process would reach (an instruction is not a fixed time, but metrics add "
                "plain Python work like the rest)."
            ),
            "",
            *instructions_table(counts),
            "",
        ]
    out += [
        "#### What each metrics call costs",
        "",
        _wrap(
            "`timeit` of each call the engine makes to `METRICS`: the least of 7 runs of "
            "100,000 calls, minus an empty loop, on the process's real `METRICS` (with "
            f"{SCRAPE_OPS} operations counted already, from this thread and an ended one; "
            "a scrape: 200 calls). A first request makes "
            "`claimed` + `settled`, a replay `replayed`; with metrics off each is a method "
            "call that returns at once. By these figures metrics add "
            f"{first_added / 1000:.2f} us to a first request and {replay_added / 1000:.2f} us "
            f"to a replay. *{MULTI}*: the same in a child process with "
            "`PROMETHEUS_MULTIPROC_DIR` set to an empty temp dir (what `retrysafe gateway "
            "--workers N` does), where every value lives in a memory-mapped file; there "
            + (
                "metrics add {:.2f} us to a first request and {:.2f} us to a replay.".format(
                    *(ns / 1000 for ns in added_ns(costs[MULTI]))
                )
                if MULTI in costs
                else "(not measured)."
            )
        ),
        "",
        *costs_table(costs),
        "",
        *(f"- the values timed, {mode}: `{c[CHILDREN]}`" for mode, c in costs.items()),
        f"- {otel_state()}",
        "",
    ]
    if per_call:
        out += [
            "#### Instructions per metrics call (valgrind)",
            "",
            _wrap(
                "The same calls counted by callgrind in a child process (in each mode): "
                f"after a warm-up of {CALL_WARMUP} calls, {args.call_instructions} calls of "
                "each inside one `functools.reduce` call, the only code counted, minus an "
                f"empty loop's instructions; a scrape, {max(1, args.call_instructions // 100)} "
                "times, whole. The same on every run, whatever the machine's load."
            ),
            "",
            *costs_table(per_call, "instructions"),
            "",
        ]
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    p.add_argument("--seconds", type=float, default=0.3, help="length of one measurement")
    p.add_argument("--warmup", type=float, default=0.3, help="warm-up seconds per side")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    p.add_argument("--stores", default="memory,sqlite", help="stores of the asgi section")
    p.add_argument("--server-stores", default="memory", help="stores of the server section")
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the rounds, cProfile each variant's metrics-on loop",
    )
    p.add_argument("--rev", help="measure this git revision's src/ (git archive), not the tree")
    p.add_argument(
        "--instructions",
        type=int,
        nargs="?",
        const=1000,
        default=0,
        metavar="N",
        help="also count the instructions per request of the in-process memory variants "
        "with valgrind (N requests each, default 1000)",
    )
    p.add_argument(
        "--call-instructions",
        type=int,
        nargs="?",
        const=10_000,
        default=0,
        metavar="N",
        help="also count the instructions of each metrics call and of a scrape with "
        "valgrind, in one process and in multi-process mode (N calls each, default 10000)",
    )
    p.add_argument("--count-run", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--call-count-run", type=int, help=argparse.SUPPRESS)
    p.add_argument("--call-costs-json", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--write",
        type=Path,
        default=None,
        metavar="PATH",
        help="write the results as Markdown into this file",
    )
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    args.stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    args.server_stores = [s.strip() for s in args.server_stores.split(",") if s.strip()]
    if set(args.sections) - set(SECTIONS):
        p.error(f"--sections: choose from {', '.join(SECTIONS)}")
    if set(args.stores + args.server_stores) - {"memory", "sqlite"}:
        p.error("--stores / --server-stores: choose from memory, sqlite")
    if args.rounds < 1 or args.seconds <= 0:
        p.error("--rounds must be at least 1 and --seconds positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.count_run:  # a child of instructions()
        count_run(args.count_run[0], args.count_run[1], int(args.count_run[2]))
        return 0
    if args.call_count_run:  # a child of call_instructions()
        call_count_run(args.call_count_run)
        return 0
    if args.call_costs_json:  # the child of multiprocess_costs()
        print(json.dumps(call_costs()))
        return 0
    if args.rev and not bs.in_rev():
        return bs.run_rev(args.rev)
    command = shlex.join(["python", "bench/metrics.py", *(sys.argv[1:] if argv is None else argv)])
    started = time.monotonic()
    info = bs.machine_info()
    bs.note_rev(info)
    info["libraries"] = library_info()
    info["SQLite"] = sqlite3.sqlite_version
    sections: dict[str, list[Pair]] = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rsbench-metrics-")))
        urls = {"memory": "memory://", "sqlite": f"sqlite:///{tmp}/m.db"}
        loop = new_loop()
        stack.callback(loop.close)
        builders: dict[str, Callable[[], list[Pair]]] = {
            "asgi": lambda: [p for s in args.stores for p in asgi_pairs(s, urls[s], loop)],
            "engine": engine_pairs,
            "server": lambda: [
                p for s in args.server_stores for p in server_pairs(s, urls[s], stack)
            ],
        }
        profiled = []
        for name in args.sections:
            pairs = builders[name]()
            check_counting(pairs)
            print(
                f"\n[{name}] {len(pairs)} variants x (on, off), {args.rounds} rounds of "
                f"{args.seconds:g} s",
                flush=True,
            )
            run_rounds(pairs, args.rounds, args.seconds, args.warmup)
            sections[name] = pairs
            if args.profile and name != "server":  # cProfile sees this thread only
                profiled += [p for p in pairs if p.store == "memory" and p.workload != MIX]
        if args.profile:
            profile(profiled, max(1.0, args.seconds))
    info["load average at end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    costs: Costs = {SINGLE: call_costs(), MULTI: multiprocess_costs()}
    counts = instructions(args.instructions) if args.instructions else {}
    per_call = call_instructions(args.call_instructions) if args.call_instructions else {}
    elapsed = time.monotonic() - started

    for name, pairs in sections.items():
        print(f"\n== {name}: metrics on / off (target >= {TARGET}) ==")
        print(bs.plain(results_table(pairs, "op" if name == "engine" else "req")))
        if name == "server":
            print(bs.plain(server_table(pairs)))
    if counts:
        print("\n== instructions per request (valgrind), in process, memory store ==")
        print(bs.plain(instructions_table(counts)))
    print("\n== what each metrics call costs (ns) ==")
    print(bs.plain(costs_table(costs)))
    if per_call:
        print("\n== instructions per metrics call (valgrind) ==")
        print(bs.plain(costs_table(per_call, "instructions")))
    for mode, c in costs.items():
        print(f"the children timed, {mode}: {c[CHILDREN]}")
    print(
        f"\n(total {elapsed:.0f} s; load average at start "
        f"{info['load average at start (1, 5, 15 min)']}, at end {info['load average at end']})"
    )
    if args.write is not None:
        text = render(sections, costs, counts, args, command, info, elapsed, per_call)
        args.write.write_text(bs.splice(args.write, text, (BEGIN_MARK, END_MARK), SECTION))
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
