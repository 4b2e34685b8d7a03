"""bench/metrics.py's variants: each measured with metrics on and off, interleaved.

Loaded by path by bench/metrics.py (see its docstring); not a script of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from retrysafe import Engine, open_store
from retrysafe._core.metrics import METRICS
from retrysafe._ops.monitor import read_sample
from retrysafe._ops.serve import ServerThread, bind
from retrysafe.asgi import IdempotencyMiddleware

# bench/metrics.py loads this module by path, as it loads bench/stores.py and bench/http.py
# (the bench folder stays off sys.path: see there); they are in sys.modules by then.
bs = sys.modules["_rsbench_stores"]
bh = sys.modules["_rsbench_http"]
Contender = bs.Contender
BenchError = bs.BenchError
PATH = bh.PATH
BODY = bh.REQUEST_BODY.encode()
FIRST, REPLAY, MIX = "first", "replay", "mix"
WORKLOADS = (FIRST, REPLAY, MIX)
HOST = "127.0.0.1"


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
