"""Single-thread throughput of retrysafe's stores, each against its own floor.

For every store, one thread measures operations per second of:

* **first call**: ``engine.begin(new_key, operation=..., fingerprint=...)`` and
  ``engine.complete(claim, outcome)`` with a prebuilt ``Outcome.json(small_dict)``
  (sync API, default options);
* **replay**: ``engine.begin(key_of_a_completed_record, ...)`` returning a ``Replay``;

and, in the same run, the store's **floor**: the fewest raw commands that do the
same work through the same client library (Redis: ``SET NX`` + ``SET``, then
``GET``; PostgreSQL: ``INSERT ... ON CONFLICT DO NOTHING`` + ``UPDATE``, then
``SELECT``; MySQL/MariaDB, sync (PyMySQL) and async (asyncmy): ``INSERT ... ON
DUPLICATE KEY UPDATE`` + ``SELECT`` in one round trip + ``UPDATE``, then the same
``INSERT`` + ``SELECT`` on a completed row, in bench/_stores_mysql.py; SQLite:
``INSERT`` + ``UPDATE``, then ``SELECT``; memory: a dict behind a lock). On the same
Redis server, ``@retrysafe.idempotent`` is compared with Powertools for AWS Lambda's
``idempotent_function`` and its Redis persistence layer, and the Redis round trips
of every contender are counted.

Contenders run interleaved in rounds (retrysafe, floor, retrysafe, floor, ...;
the order flips every round), after a warm-up; the figure of a contender is the
median over the rounds. This is a benchmark, not a test (pytest does not run it).

    python bench/stores.py [--seconds S] [--rounds R]
                           [--stores memory,sqlite,redis,postgres,mysql]
                           [--redis-url URL] [--postgres-url URL] [--mysql-url URL]
                           [--write docs/performance.md]

Without URLs it starts its own redis-server, PostgreSQL and MariaDB (tests/_servers.py)
and stops them at the end.

    python bench/stores.py --redis-instructions [CALLS] [--redis-url URL] [--redis-py-path]

counts instead, with valgrind, the client instructions per call of each Redis
contender (the store and its floor, ``@idempotent`` and Powertools), one process
each: exact, whatever else the machine runs. ``--redis-py-path`` runs the store's
rows again with its own connections turned off (every command through redis-py's
pool, as a URL with a TLS option does): what owning them saves.

    python bench/stores.py --postgres-instructions N [--postgres-url URL]

counts, with valgrind, the client instructions per call of the PostgreSQL store and
its floor (first call, replay) over N calls: the server's work is not counted.
"""

# ruff: noqa: E402  (the imports follow the sys.path guard below)
from __future__ import annotations

import sys
from pathlib import Path

# Keep this folder off sys.path: bench/http.py would shadow the standard library's http.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse
import asyncio
import contextlib
import cProfile
import functools
import importlib
import importlib.metadata
import importlib.util
import itertools
import os
import platform
import pstats
import secrets
import shlex
import shutil
import sqlite3
import statistics
import subprocess
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import retrysafe
from retrysafe import Claim, Engine, Outcome, Replay, open_store
from retrysafe.stores.memory import MemoryStore

ROOT = Path(__file__).resolve().parents[1]
STORES = ("memory", "sqlite", "redis", "postgres", "mysql")
FIRST, REPLAY = "first call", "replay"
SUBJECT, FLOOR, PEER = "retrysafe", "floor", "Powertools"
DECORATOR = "@idempotent (redis)"
RS_DETAIL = 'retrysafe.idempotent(store=Engine(RedisStore(url)), key="{order[order_id]}")'
PT_DETAIL = (
    'idempotent_function(data_keyword_argument="order", persistence_store='
    'RedisCachePersistenceLayer(url=url), config=IdempotencyConfig(event_key_jmespath="order_id"))'
)

#: What one call stores and replays; the same on every side.
OPERATION = "bench.charge"
FINGERPRINT = "f" * 64
RESULT: dict[str, Any] = {"id": "ch_123", "amount": 1999, "currency": "eur", "ok": True}
#: Built once, as the floors write prebuilt bytes: serialising the handler's value
#: is the front door's work, not the store's.
RESULT_OUTCOME = Outcome.json(RESULT)
RESULT_BYTES = RESULT_OUTCOME.body
#: Remaining time the fake Lambda context reports to Powertools (its in-progress
#: expiry); the same as retrysafe's default lease.
LAMBDA_REMAINING_MS = int(retrysafe.DEFAULT_LEASE * 1000)
#: Calls per contender when counting Redis round trips.
COUNT_CALLS = 200

#: (section, workload) -> (kind, value): "ratio" is subject / reference, "absolute" ops/s.
TARGETS: dict[tuple[str, str], tuple[str, float]] = {
    ("memory", FIRST): ("absolute", 100_000.0),
    ("sqlite", FIRST): ("ratio", 0.6),
    ("sqlite", REPLAY): ("ratio", 0.6),
    ("redis", FIRST): ("ratio", 0.85),
    ("redis", REPLAY): ("ratio", 0.85),
    ("postgres", FIRST): ("ratio", 0.85),
    ("postgres", REPLAY): ("ratio", 0.85),
    # MySQL/MariaDB: floors the store meets, not parity. The claim writes and reads back
    # the whole 22-column record (the floor's row has 5 columns): the store's own
    # statements sent raw already run at 0.5-0.8x the floor (column definitions decoded
    # per result, 22 parameters escaped), and the engine, the store's Python and its
    # pool take 0.6-0.9x of that on top. A replay's floor is one narrow round trip, so
    # the row weighs most there. See docs/performance.md, "MySQL/MariaDB".
    ("mysql", FIRST): ("ratio", 0.4),
    ("mysql", REPLAY): ("ratio", 0.3),
    ("mysql async", FIRST): ("ratio", 0.4),
    ("mysql async", REPLAY): ("ratio", 0.3),
    (DECORATOR, FIRST): ("ratio", 1.4),
    (DECORATOR, REPLAY): ("ratio", 3.0),
}


class BenchError(RuntimeError):
    """A contender did not do the work it is measured for."""


def _noop() -> None:
    return None


# -- measuring -----------------------------------------------------------------------


@dataclass
class Contender:
    """One thing measured: ``run(n)`` does ``n`` operations of one workload."""

    section: str
    name: str
    workload: str
    run: Callable[[int], None]
    prepare: Callable[[], None] = _noop
    executions: Callable[[], int] | None = None  # how often the decorated function ran
    detail: str = ""
    batch: int = 1
    samples: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)  # this process's CPU time per operation

    @property
    def label(self) -> str:
        return f"{self.section} / {self.name} / {self.workload}"

    def measure(self, seconds: float) -> float:
        """Operations per second over ``seconds`` (at least one batch)."""
        self.prepare()
        ran_before = self.executions() if self.executions else 0
        run, batch, done = self.run, self.batch, 0
        clock = time.perf_counter
        cpu_start = time.process_time()
        start = clock()
        deadline = start + seconds
        while True:
            run(batch)
            done += batch
            now = clock()
            if now >= deadline:
                break
        if self.executions is not None:
            ran = self.executions() - ran_before
            expected = done if self.workload == FIRST else 0
            if ran != expected:
                raise BenchError(
                    f"{self.label}: the function ran {ran} times for {done} calls "
                    f"(expected {expected})"
                )
        self.cpu_us.append((time.process_time() - cpu_start) / done * 1e6)
        return done / (now - start)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def cpu(self) -> float:
        """Median client CPU time per operation (us): the work this process does, which
        other load on the machine barely changes, unlike the wall-clock rate."""
        return statistics.median(self.cpu_us)


def run_rounds(contenders: Sequence[Contender], rounds: int, seconds: float, warmup: float) -> None:
    """Warm every contender up, then measure them interleaved, ``rounds`` times."""
    for c in contenders:
        rate = c.measure(warmup)
        c.batch = max(1, min(1000, int(rate / 200)))  # about 5 ms between clock reads
    for r in range(rounds):
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for c in order:
            c.samples.append(c.measure(seconds))
        line = "  ".join(f"{c.name}/{c.workload}={c.samples[-1]:,.0f}" for c in contenders)
        print(f"  round {r + 1}/{rounds}: {line}", flush=True)


# -- retrysafe's side -----------------------------------------------------------------


def engine_contenders(
    section: str, engine: Engine, detail: str, loop: asyncio.AbstractEventLoop | None = None
) -> list[Contender]:
    """First calls and replays through ``engine``: its sync API, or with ``loop`` its
    async one (``abegin``/``acomplete``, each batch one coroutine on ``loop``)."""
    tag = secrets.token_hex(4)
    seq = itertools.count()
    replay_key = [""]

    def claimed(claim: Any) -> Claim:
        if type(claim) is not Claim:
            raise BenchError(f"{section}: a new key was not claimed: {claim!r}")
        return claim

    def replayed(result: Any) -> None:
        if type(result) is not Replay:
            raise BenchError(f"{section}: a completed key did not replay: {result!r}")

    def first(n: int) -> None:
        begin, complete, outcome = engine.begin, engine.complete, RESULT_OUTCOME
        for _ in range(n):
            claim = begin(f"first-{tag}-{next(seq)}", operation=OPERATION, fingerprint=FINGERPRINT)
            complete(claimed(claim), outcome)

    async def afirst(n: int) -> None:
        begin, complete, outcome = engine.abegin, engine.acomplete, RESULT_OUTCOME
        for _ in range(n):
            claim = await begin(
                f"first-{tag}-{next(seq)}", operation=OPERATION, fingerprint=FINGERPRINT
            )
            await complete(claimed(claim), outcome)

    def prepare_replay() -> None:
        key = f"replay-{tag}-{next(seq)}"
        claim = engine.begin(key, operation=OPERATION, fingerprint=FINGERPRINT)
        assert isinstance(claim, Claim)
        engine.complete(claim, Outcome.json(RESULT))
        replay_key[0] = key

    def replay(n: int) -> None:
        begin, key = engine.begin, replay_key[0]
        result: Any = None
        for _ in range(n):
            result = begin(key, operation=OPERATION, fingerprint=FINGERPRINT)
            replayed(result)
        check_replay(result)

    async def areplay(n: int) -> None:
        begin, key = engine.abegin, replay_key[0]
        result: Any = None
        for _ in range(n):
            result = await begin(key, operation=OPERATION, fingerprint=FINGERPRINT)
            replayed(result)
        check_replay(result)

    def check_replay(result: Any) -> None:
        if result is not None and result.outcome.value != RESULT:
            raise BenchError(f"{section}: the replay returned {result.outcome!r}")

    runs: tuple[Callable[[int], None], ...] = (first, replay)
    if loop is not None:
        runs = (_on_loop(loop, afirst), _on_loop(loop, areplay))
    return [
        Contender(section, SUBJECT, FIRST, runs[0], detail=detail),
        Contender(section, SUBJECT, REPLAY, runs[1], prepare_replay, detail=detail),
    ]


def _on_loop(
    loop: asyncio.AbstractEventLoop, batch: Callable[[int], Coroutine[Any, Any, None]]
) -> Callable[[int], None]:
    """``batch`` (a coroutine function of ``n``) as a plain ``run(n)`` on ``loop``."""
    return lambda n: loop.run_until_complete(batch(n))


def floor_contenders(
    section: str,
    first_call: Callable[[str], Any],
    replay_call: Callable[[str], Any],
    write_replay: Callable[[str], None],
    detail: str,
    loop: asyncio.AbstractEventLoop | None = None,
    name: str = FLOOR,
) -> list[Contender]:
    """Floors built from one-key callables: a first call, a replay, and a setup write.
    With ``loop``, ``first_call`` and ``replay_call`` are coroutine functions, each batch
    one coroutine on ``loop``."""
    tag = secrets.token_hex(4)
    seq = itertools.count()
    replay_key = [""]

    def first(n: int) -> None:
        for _ in range(n):
            first_call(f"floor:first-{tag}-{next(seq)}")

    async def afirst(n: int) -> None:
        for _ in range(n):
            await first_call(f"floor:first-{tag}-{next(seq)}")

    def prepare_replay() -> None:
        replay_key[0] = f"floor:replay-{tag}-{next(seq)}"
        write_replay(replay_key[0])

    def replay(n: int) -> None:
        key = replay_key[0]
        for _ in range(n):
            replay_call(key)

    async def areplay(n: int) -> None:
        key = replay_key[0]
        for _ in range(n):
            await replay_call(key)

    runs: tuple[Callable[[int], None], ...] = (first, replay)
    if loop is not None:
        runs = (_on_loop(loop, afirst), _on_loop(loop, areplay))
    return [
        Contender(section, name, FIRST, runs[0], detail=detail),
        Contender(section, name, REPLAY, runs[1], prepare_replay, detail=detail),
    ]


def _interleave(ours: list[Contender], floor: list[Contender]) -> list[Contender]:
    """retrysafe first, floor first, retrysafe replay, floor replay."""
    return [c for pair in zip(ours, floor, strict=True) for c in pair]


# -- memory ---------------------------------------------------------------------------


def memory_section() -> list[Contender]:
    engine = Engine("memory://")
    records: dict[str, tuple[str, bytes]] = {}
    lock = threading.Lock()
    processing = ("processing", b"")
    bound = MemoryStore().max_size  # the store evicts past this; the floor just starts over

    def first_call(key: str) -> None:
        with lock:
            if key in records:
                raise BenchError("memory floor: key exists")
            if len(records) >= bound:
                records.clear()
            records[key] = processing
        with lock:
            records[key] = ("completed", RESULT_BYTES)

    def replay_call(key: str) -> None:
        with lock:
            if records.get(key) is None:
                raise BenchError("memory floor: replay key missing")

    def write_replay(key: str) -> None:
        records.clear()
        first_call(key)

    return _interleave(
        engine_contenders("memory", engine, "memory:// (default max_size)"),
        floor_contenders(
            "memory",
            first_call,
            replay_call,
            write_replay,
            "dict behind a threading.Lock: insert-if-absent + set, then get",
        ),
    )


# -- SQLite ---------------------------------------------------------------------------

_SQLITE_FLOOR_SCHEMA = """
CREATE TABLE IF NOT EXISTS floor (
    key TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    token TEXT NOT NULL,
    updated_at REAL NOT NULL,
    body BLOB
) WITHOUT ROWID
"""


def sqlite_section(stack: contextlib.ExitStack, info: dict[str, str]) -> list[Contender]:
    directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rsbench-")))
    url = f"sqlite:///{directory / 'store.db'}?synchronous=normal"
    engine = Engine(url)
    stack.callback(engine.close)

    conn = sqlite3.connect(directory / "floor.db", isolation_level=None)  # autocommit
    stack.callback(conn.close)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(_SQLITE_FLOOR_SCHEMA)
    execute, now, token = conn.execute, time.time(), "t" * 32
    insert = "INSERT INTO floor (key, status, token, updated_at) VALUES (?, 'processing', ?, ?)"
    update = "UPDATE floor SET status = 'completed', body = ?, updated_at = ? WHERE key = ?"
    select = "SELECT key, status, token, updated_at, body FROM floor WHERE key = ?"

    def first_call(key: str) -> None:
        execute(insert, (key, token, now))
        execute(update, (RESULT_BYTES, now, key))

    def replay_call(key: str) -> None:
        if execute(select, (key,)).fetchone() is None:
            raise BenchError("sqlite floor: replay key missing")

    info["SQLite"] = f"{sqlite3.sqlite_version} (WAL, synchronous=NORMAL on both sides)"
    return _interleave(
        engine_contenders(
            "sqlite", engine, "SQLiteStore, sqlite:///<temp dir>/store.db?synchronous=normal"
        ),
        floor_contenders(
            "sqlite",
            first_call,
            replay_call,
            first_call,
            "sqlite3, autocommit, WAL, synchronous=NORMAL: INSERT + UPDATE, then SELECT by "
            "primary key (table: text primary key, 3 columns and a blob)",
        ),
    )


def instructions_run_one(
    section: Callable[[contextlib.ExitStack], list[Contender]], name: str, workload: str, n: int
) -> int:
    """``--instructions-run NAME WORKLOAD N`` (and ``--postgres-instructions-run``): 200
    calls to warm up, then ``n`` calls of one contender of ``section``, in this process
    (valgrind counts it)."""
    with contextlib.ExitStack() as stack:
        for c in section(stack):
            if c.name == name and c.workload == workload:
                c.prepare()
                c.run(200)
                c.run(n)
                return 0
    raise SystemExit(f"no contender {name} / {workload}")


def sqlite_instructions(n: int, run: Sequence[str] = ("--instructions-run",)) -> list[str]:
    """Instructions per call of each SQLite contender (valgrind's callgrind): the
    difference of a run of ``n`` calls and a run of none, over ``n``. The same on every
    run, whatever the machine's load; SQLite's C code and the fsyncs' system calls
    count, the kernel's work does not. ``run`` names another section's contenders
    (``--postgres-instructions-run URL``: the client's instructions only)."""
    from concurrent.futures import ThreadPoolExecutor

    def count(name: str, workload: str, calls: int) -> int:
        script = str(Path(__file__).resolve())
        argv = [sys.executable, script, run[0], name, workload, str(calls), *run[1:]]
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *argv],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        found = [line for line in out.stderr.splitlines() if "Collected :" in line]
        if not found:
            raise BenchError(f"no instruction count from valgrind:\n{out.stderr[-2000:]}")
        return int(found[-1].rsplit(":", 1)[1])

    jobs = [(name, w) for w in (FIRST, REPLAY) for name in (SUBJECT, FLOOR)]

    def per_call(job: tuple[str, str]) -> float:
        return (count(*job, n) - count(*job, 0)) / n

    with ThreadPoolExecutor(2) as pool:
        costs = dict(zip(jobs, pool.map(per_call, jobs), strict=True))
    lines = [
        "| workload | retrysafe instructions/call | floor instructions/call | floor / retrysafe |",
        "|---|--:|--:|--:|",
    ]
    for w in (FIRST, REPLAY):
        ours, floor = costs[(SUBJECT, w)], costs[(FLOOR, w)]
        lines.append(f"| {w} | {ours:,.0f} | {floor:,.0f} | {floor / ours:.2f} |")
    return lines


# -- Redis ----------------------------------------------------------------------------


def redis_section(
    url: str, ns: str, stack: contextlib.ExitStack, info: dict[str, str], decorators: bool = True
) -> tuple[list[Contender], list[Contender], Any]:
    """(store contenders, decorator contenders (none unless ``decorators``), a plain
    client for the floor and stats)."""
    import redis

    store = open_store(url, prefix=f"{ns}store:")
    engine = Engine(store)
    stack.callback(engine.close)

    client = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=2.0)
    stack.callback(client.close)
    processing = b"processing:" + b"t" * 32
    floor_prefix = f"{ns}"

    def first_call(key: str) -> None:
        k = floor_prefix + key
        if not client.set(k, processing, nx=True):
            raise BenchError("redis floor: SET NX found the key")
        client.set(k, RESULT_BYTES)

    def replay_call(key: str) -> None:
        if client.get(floor_prefix + key) is None:
            raise BenchError("redis floor: replay key missing")

    server = client.info("server")
    persistence = client.info("persistence")
    info["redis-server"] = (
        f"{server['redis_version']} (AOF {'on' if persistence.get('aof_enabled') else 'off'})"
    )
    store_contenders = _interleave(
        engine_contenders("redis", engine, "RedisStore, default options (a key prefix of its own)"),
        floor_contenders(
            "redis",
            first_call,
            replay_call,
            first_call,
            "redis-py + hiredis, one client: SET key val NX + SET key val2, then GET key",
        ),
    )
    return store_contenders, decorator_contenders(url, ns, stack) if decorators else [], client


class _FakeLambdaContext:
    """What Powertools reads from a Lambda context: the time left."""

    function_name = "bench"

    @staticmethod
    def get_remaining_time_in_millis() -> int:
        return LAMBDA_REMAINING_MS


def decorator_contenders(url: str, ns: str, stack: contextlib.ExitStack) -> list[Contender]:
    """``@retrysafe.idempotent`` and Powertools' ``idempotent_function`` on one Redis server."""
    from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
    from aws_lambda_powertools.utilities.idempotency.persistence.redis import (
        RedisCachePersistenceLayer,
    )

    executions: Counter[str] = Counter()
    engine = Engine(open_store(url, prefix=f"{ns}dec:"))
    stack.callback(engine.close)

    @retrysafe.idempotent(store=engine, key="{order[order_id]}")
    def charge_rs(order: dict[str, Any]) -> dict[str, Any]:
        executions[SUBJECT] += 1
        return {"order_id": order["order_id"], "charged": order["amount"], "ok": True}

    with warnings.catch_warnings():  # RedisConnection is deprecated in favour of a client
        warnings.simplefilter("ignore", DeprecationWarning)
        layer = RedisCachePersistenceLayer(url=url)
    stack.callback(layer.client.close)
    config = IdempotencyConfig(event_key_jmespath="order_id")
    config.register_lambda_context(_FakeLambdaContext())  # as the Lambda runtime would

    @idempotent_function(
        data_keyword_argument="order", persistence_store=layer, config=config, key_prefix=f"{ns}pt"
    )
    def charge_pt(order: dict[str, Any]) -> dict[str, Any]:
        executions[PEER] += 1
        return {"order_id": order["order_id"], "charged": order["amount"], "ok": True}

    contenders: list[Contender] = []
    for name, func, detail in (
        (SUBJECT, charge_rs, RS_DETAIL),
        (PEER, charge_pt, PT_DETAIL),
    ):
        contenders += _function_contenders(name, func, executions, detail)
    # retrysafe first, Powertools first, retrysafe replay, Powertools replay
    return _interleave(contenders[:2], contenders[2:])


def _function_contenders(
    name: str, func: Callable[..., Any], executions: Counter[str], detail: str
) -> list[Contender]:
    tag = secrets.token_hex(4)
    seq = itertools.count()
    replay_order: list[dict[str, Any]] = [{}]

    def first(n: int) -> None:
        for _ in range(n):
            func(order={"order_id": f"o-{tag}-{next(seq)}", "amount": 1999})

    def prepare_replay() -> None:
        replay_order[0] = {"order_id": f"r-{tag}-{next(seq)}", "amount": 1999}
        before = executions[name]
        func(order=replay_order[0])
        if executions[name] != before + 1:
            raise BenchError(f"{name}: the first call of the replay key did not run")

    def replay(n: int) -> None:
        order = replay_order[0]
        result: Any = None
        for _ in range(n):
            result = func(order=order)
        expected = {"order_id": order["order_id"], "charged": 1999, "ok": True}
        if result != expected:
            raise BenchError(f"{name}: the replay returned {result!r}, not {expected!r}")

    def count() -> int:
        return executions[name]

    return [
        Contender(DECORATOR, name, FIRST, first, executions=count, detail=detail),
        Contender(DECORATOR, name, REPLAY, replay, prepare_replay, count, detail=detail),
    ]


# -- Redis round trips ------------------------------------------------------------------


@dataclass
class RoundTrips:
    """Per call: requests the client sent, and the commands the server ran."""

    sent: Counter[str]
    server: Counter[str]
    server_usec: Counter[str]
    calls: int

    @property
    def per_call(self) -> float:
        return sum(self.sent.values()) / self.calls

    def describe(self, counter: Counter[str]) -> str:
        return ", ".join(f"{name} {_count(n / self.calls)}" for name, n in sorted(counter.items()))

    @property
    def server_us_per_call(self) -> float:
        """Server time of the requests (a script's time includes the commands it runs)."""
        return sum(self.server_usec[name] for name in self.sent) / self.calls

    @property
    def in_scripts(self) -> Counter[str]:
        """Server commands that no request named: run inside Lua scripts."""
        return self.server - self.sent


def _count(value: float) -> str:
    return f"{value:.0f}" if abs(value - round(value)) < 0.005 else f"{value:.2f}"


def _command_name(packed: Any) -> str:
    chunk = packed if isinstance(packed, (bytes, str)) else packed[0]
    if isinstance(chunk, str):
        chunk = chunk.encode()
    parts = bytes(chunk).split(b"\r\n", 3)  # *N, $len, NAME, ...
    return parts[2].decode(errors="replace").upper() if len(parts) > 2 else "?"


@contextlib.contextmanager
def counting_requests() -> Iterator[Counter[str]]:
    """Count every request redis-py writes to a socket (one per round trip), by command."""
    from redis.connection import AbstractConnection

    original = AbstractConnection.send_packed_command
    sent: Counter[str] = Counter()

    def send_packed_command(self: Any, command: Any, check_health: bool = True) -> None:
        sent[_command_name(command)] += 1
        original(self, command, check_health)

    AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        AbstractConnection.send_packed_command = original  # type: ignore[method-assign]


def _commandstats(client: Any) -> tuple[Counter[str], Counter[str]]:
    """(calls, microseconds) per command since the server started."""
    stats = client.info("commandstats")
    names = {k: k.removeprefix("cmdstat_").upper() for k in stats}
    calls = Counter({names[k]: v["calls"] for k, v in stats.items()})
    return calls, Counter({names[k]: v["usec"] for k, v in stats.items()})


def count_round_trips(contender: Contender, client: Any, calls: int = COUNT_CALLS) -> RoundTrips:
    contender.prepare()
    calls_before, usec_before = _commandstats(client)
    with counting_requests() as sent:
        contender.run(calls)
    calls_after, usec_after = _commandstats(client)
    server, usec = calls_after - calls_before, usec_after - usec_before
    server.pop("INFO", None)  # the first snapshot
    return RoundTrips(Counter(sent), server, usec, calls)


# -- PostgreSQL ---------------------------------------------------------------------------

_PG_FLOOR_SCHEMA = """
CREATE TABLE {table} (
    key text PRIMARY KEY,
    status text NOT NULL,
    token text NOT NULL,
    updated_at double precision NOT NULL,
    body bytea
)
"""


def postgres_section(
    url: str, tag: str, own_server: bool, stack: contextlib.ExitStack, info: dict[str, str]
) -> list[Contender]:
    import psycopg
    from psycopg_pool import ConnectionPool

    store_table = f"rsbench_{tag}"
    floor_table = f"rsbench_floor_{tag}"
    store = open_store(url, table=store_table)
    engine = Engine(store)

    # The floor's pool is configured and used as the store's is: autocommit
    # connections, the store's pool sizes, getconn/putconn around every
    # statement, binary results, psycopg's automatic prepared statements.
    sizes = {"min_size": store.min_size, "max_size": store.max_size}  # type: ignore[attr-defined]
    pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
        url, kwargs={"autocommit": True}, open=True, timeout=2.0, **sizes
    )
    admin = psycopg.connect(url, autocommit=True)

    def drop() -> None:
        engine.close()
        pool.close()
        if not own_server:  # a server of our own is thrown away whole
            admin.execute(f"DROP FUNCTION IF EXISTS {store_table}_claim")
            admin.execute(
                f"DROP TABLE IF EXISTS {store_table}, {store_table}_schema, {floor_table}"
            )
        admin.close()

    stack.callback(drop)
    admin.execute(_PG_FLOOR_SCHEMA.format(table=floor_table))
    row = admin.execute(
        "SELECT current_setting('server_version'), current_setting('fsync'), "
        "current_setting('synchronous_commit')"
    ).fetchone()
    assert row is not None
    info["PostgreSQL"] = f"{row[0]} (fsync={row[1]}, synchronous_commit={row[2]})"

    insert = (
        f"INSERT INTO {floor_table} (key, status, token, updated_at) "
        "VALUES (%s, 'processing', %s, %s) ON CONFLICT DO NOTHING"
    )
    update = (
        f"UPDATE {floor_table} SET status = 'completed', body = %s, updated_at = %s WHERE key = %s"
    )
    select = f"SELECT key, status, token, updated_at, body FROM {floor_table} WHERE key = %s"
    token, now = "t" * 32, time.time()

    def execute(query: str, params: tuple[Any, ...], fetch: bool) -> Any:
        conn = pool.getconn()
        try:
            cur = conn.execute(query, params, binary=True)  # type: ignore[call-overload]
            return cur.fetchone() if fetch else cur.rowcount
        finally:
            pool.putconn(conn)

    def first_call(key: str) -> None:
        if execute(insert, (key, token, now), False) != 1:
            raise BenchError("postgres floor: INSERT found the key")
        execute(update, (RESULT_BYTES, now, key), False)

    def replay_call(key: str) -> None:
        if execute(select, (key,), True) is None:
            raise BenchError("postgres floor: replay key missing")

    return _interleave(
        engine_contenders(
            "postgres",
            engine,
            f"PostgresStore, default options (pool min_size={sizes['min_size']}, "
            f"max_size={sizes['max_size']}), a table of its own",
        ),
        floor_contenders(
            "postgres",
            first_call,
            replay_call,
            first_call,
            "psycopg 3 through a psycopg_pool.ConnectionPool set up and used like the store's "
            "(autocommit, getconn/putconn per statement, binary, automatic prepared statements): "
            "INSERT ... ON CONFLICT DO NOTHING + UPDATE ... WHERE key = %s, then SELECT ... "
            "WHERE key = %s (table: text primary key, 3 columns and a bytea)",
        ),
    )


# -- Redis: client instructions per call (valgrind) ------------------------------------------

#: ``--redis-instructions``: the Redis contenders measured, by label.
INSTRUCTION_JOBS = (
    ("redis", SUBJECT, FIRST),
    ("redis", FLOOR, FIRST),
    ("redis", SUBJECT, REPLAY),
    ("redis", FLOOR, REPLAY),
    (DECORATOR, SUBJECT, FIRST),
    (DECORATOR, PEER, FIRST),
    (DECORATOR, SUBJECT, REPLAY),
    (DECORATOR, PEER, REPLAY),
)


def instructions_run(argv: Sequence[str]) -> int:
    """``--redis-instructions-run INDEX N URL [redis-py]``: ``N`` calls of one Redis
    contender (``INSTRUCTION_JOBS[INDEX]``) after a warm-up, in this process; with
    ``redis-py``, the store sends every command through redis-py."""
    index, n, url = int(argv[0]), int(argv[1]), argv[2]
    if argv[3:] == ["redis-py"]:
        from retrysafe.stores.redis import store as redis_store

        redis_store.endpoint = lambda url, options: None  # no URL is the store's own
    section, name, workload = INSTRUCTION_JOBS[index]
    with contextlib.ExitStack() as stack:
        ns = f"rsinstr-{secrets.token_hex(4)}:"
        stores, decorators, _ = redis_section(url, ns, stack, {}, section == DECORATOR)
        (c,) = [
            c
            for c in stores + decorators
            if (c.section, c.name, c.workload) == (section, name, workload)
        ]
        c.prepare()
        c.run(50)  # warm-up: connections made, scripts loaded
        # valgrind counts only inside functools.reduce (see _client_instructions)
        functools.reduce(lambda _, __: c.run(n), [None], None)
    return 0


def _client_instructions(index: int, n: int, url: str, redis_py: bool = False) -> int:
    """Instructions this interpreter executes for ``n`` calls (valgrind's callgrind,
    counting only inside the ``functools.reduce`` that makes them: no start-up, no
    warm-up)."""
    run = [sys.executable, str(Path(__file__).resolve()), "--redis-instructions-run"]
    argv = [*run, str(index), str(n), url, *(["redis-py"] if redis_py else [])]
    callgrind = ["--collect-atstart=no", "--toggle-collect=functools_reduce"]
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *callgrind, *argv],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    found = [line for line in out.stderr.splitlines() if "Collected : " in line]
    if not found:
        raise BenchError(f"no instruction count from valgrind:\n{out.stderr[-2000:]}")
    return int(found[-1].rsplit(" ", 1)[-1])


def redis_instructions(calls: int, url: str | None, redis_py: bool = False) -> int:
    """Print each Redis contender's client instructions per call. The server runs
    outside valgrind; only the client is counted. With ``redis_py``, the store's rows
    again with every command through redis-py."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--redis-instructions needs valgrind")
    with contextlib.ExitStack() as stack:
        url = url or start_server("redis", stack)
        rows = []
        jobs = [(i, job, False) for i, job in enumerate(INSTRUCTION_JOBS)]
        if redis_py:
            jobs += [(i, job, True) for i, job in enumerate(INSTRUCTION_JOBS) if job[1] == SUBJECT]
        for i, (section, name, workload), alone in jobs:
            per_call = _client_instructions(i, calls, url, alone) / calls
            if alone:
                name = f"{name}, through redis-py's pool"
            rows.append((section, name, workload, per_call))
            print(f"  {section} / {name} / {workload}: {per_call:,.0f}", flush=True)
    print("\n| section | contender | workload | client instructions per call |")
    print("|---|---|---|--:|")
    for section, name, workload, per_call in rows:
        print(f"| {section} | {name} | {workload} | {per_call:,.0f} |")
    return 0


# -- servers ------------------------------------------------------------------------------


@functools.cache
def mysql_module() -> Any:
    """bench/_stores_mysql.py (the MySQL sections), loaded by path: this folder stays off
    sys.path. It reads this module's helpers under the name ``_rsbench_stores``."""
    sys.modules.setdefault("_rsbench_stores", sys.modules[__name__])
    spec = importlib.util.spec_from_file_location(
        "_rsbench_stores_mysql", _HERE / "_stores_mysql.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _servers_module() -> Any:
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    return importlib.import_module("_servers")


def start_server(kind: str, stack: contextlib.ExitStack) -> str:
    """Start a throwaway server of ``kind`` (redis, postgres, mysql: a MariaDB) as the
    tests do; it stops when ``stack`` closes. Its URL."""
    servers = _servers_module()
    make = {
        "redis": servers.RedisServer,
        "postgres": servers.PostgresServer,
        "mysql": servers.MySQLServer,
    }
    server = make[kind]()
    t0 = time.monotonic()
    stack.enter_context(server)
    print(f"started {kind} at {server.url} in {time.monotonic() - t0:.1f}s", flush=True)
    return str(server.url)


def redis_cleanup(client: Any, ns: str) -> None:
    """Remove every key this run wrote (for a server that is not ours)."""
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{ns}*", count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            client.unlink(*batch)
            batch.clear()
    if batch:
        client.unlink(*batch)


# -- results ------------------------------------------------------------------------------


@dataclass
class Comparison:
    section: str
    workload: str
    subject: Contender
    reference: Contender | None

    @property
    def ratio(self) -> float | None:
        return None if self.reference is None else self.subject.median / self.reference.median

    def verdict(self) -> tuple[str, str, str] | None:
        """(measured, required, verdict) against the target, if there is one."""
        target = TARGETS.get((self.section, self.workload))
        if target is None:
            return None
        kind, value = target
        if kind == "absolute":
            got = self.subject.median
            measured, required = f"{got:,.0f}/s", f">= {value:,.0f}/s"
        else:
            assert self.ratio is not None
            got = self.ratio
            measured, required = f"{got:.2f}x", f">= {value:.2f}x"
        margin = got / value - 1
        if got >= value:
            how = f"{got - value:,.0f}/s" if kind == "absolute" else f"{got - value:.2f}"
            return measured, required, f"**met** (+{how}, {margin:+.0%})"
        how = f"{value - got:,.0f}/s" if kind == "absolute" else f"{value - got:.2f}"
        return measured, required, f"**missed** by {how} ({margin:+.0%})"

    @property
    def target_name(self) -> str:
        if self.section == DECORATOR:
            return f"@idempotent vs Powertools on Redis, {self.workload}s"
        kind, _ = TARGETS[(self.section, self.workload)]
        if kind == "absolute":
            return f"{self.section}: {self.workload}s per second"
        return f"{self.section}: {self.workload}, retrysafe / floor"


def comparisons(contenders: Sequence[Contender]) -> list[Comparison]:
    by_key = {(c.section, c.name, c.workload): c for c in contenders}
    result = []
    for c in contenders:
        if c.name != SUBJECT:
            continue
        ref = by_key.get((c.section, PEER if c.section == DECORATOR else FLOOR, c.workload))
        result.append(Comparison(c.section, c.workload, c, ref))
    return result


def _spread(c: Contender) -> str:
    return f"{min(c.samples):,.0f}-{max(c.samples):,.0f}"


def results_table(comps: Sequence[Comparison], reference: str) -> list[str]:
    lines = [
        f"| store | workload | retrysafe ops/s (median) | rounds min-max | {reference} ops/s "
        f"(median) | rounds min-max | retrysafe / {reference} | client CPU us/call, "
        f"retrysafe / {reference} |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for comp in comps:
        ref, sub = comp.reference, comp.subject
        theirs = (
            f"{ref.median:,.0f} | {_spread(ref)} | {comp.ratio:.2f}x | "
            f"{sub.cpu:.1f} / {ref.cpu:.1f}"
            if ref
            else f"- | - | - | {sub.cpu:.1f} / -"
        )
        lines.append(
            f"| {comp.section} | {comp.workload} | {sub.median:,.0f} | {_spread(sub)} | {theirs} |"
        )
    return lines


def targets_table(comps: Sequence[Comparison]) -> list[str]:
    lines = ["| target | measured | required | verdict |", "|---|--:|--:|---|"]
    for comp in comps:
        v = comp.verdict()
        if v is not None:
            lines.append(f"| {comp.target_name} | {v[0]} | {v[1]} | {v[2]} |")
    return lines


def round_trip_table(trips: dict[tuple[str, str], RoundTrips]) -> list[str]:
    lines = [
        "| contender | workload | round trips per call | requests sent per call | "
        "run inside Lua scripts per call | server time per call (us) |",
        "|---|---|--:|---|---|--:|",
    ]
    for (name, workload), rt in trips.items():
        lines.append(
            f"| {name} | {workload} | {_count(rt.per_call)} | {rt.describe(rt.sent)} | "
            f"{rt.describe(rt.in_scripts) or '-'} | {rt.server_us_per_call:.1f} |"
        )
    return lines


def plain(lines: list[str]) -> str:
    """A Markdown table as aligned plain text for the terminal."""
    rows = [
        [cell.strip().replace("**", "") for cell in line.strip("|").split("|")]
        for line in lines
        if not line.startswith("|---")
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


# -- machine ------------------------------------------------------------------------------


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


#: Set in the child that ``run_rev`` starts: where its ``retrysafe`` comes from.
REV_SRC, REV_COMMIT = "RSBENCH_SRC", "RSBENCH_REV"


@contextlib.contextmanager
def exported(rev: str) -> Iterator[tuple[str, str]]:
    """(the short commit of ``rev``, its ``src/`` exported with ``git archive`` into a
    temporary directory that lasts as long as the block)."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", f"{rev}^{{commit}}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="rsbench-rev-") as tmp:
        archive = subprocess.run(
            ["git", "archive", commit, "src"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield commit, str(Path(tmp) / "src")


def run_rev(rev: str) -> int:
    """Run the calling script again in a child whose ``retrysafe`` is ``rev``'s ``src/``
    (exported with ``git archive``), so that a benchmark measures a commit, not a
    working tree that others are editing."""
    with exported(rev) as (commit, src):
        env = {
            **os.environ,
            REV_SRC: src,
            REV_COMMIT: commit,
            "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
        }
        return subprocess.run([sys.executable, *sys.argv], env=env, check=False).returncode


def in_rev() -> bool:
    """Whether this process is the child of :func:`run_rev`."""
    return REV_SRC in os.environ


def note_rev(info: dict[str, str]) -> None:
    """In :func:`run_rev`'s child: check where ``retrysafe`` came from and say it in ``info``."""
    if not in_rev():
        return
    if not retrysafe.__file__ or not retrysafe.__file__.startswith(os.environ[REV_SRC]):
        raise SystemExit(f"--rev: retrysafe came from {retrysafe.__file__}")
    info["retrysafe"] = (
        f"git {os.environ[REV_COMMIT]}, exported with `git archive` (not the working tree)"
    )


def machine_info() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return {
        "CPU": f"{cpu}, {os.cpu_count()} logical CPUs (os.cpu_count())",
        "load average at start (1, 5, 15 min)": load,
        "load average at end": "?",  # filled in when the run ends
        "OS": platform.platform(),
        "Python": f"{platform.python_implementation()} {platform.python_version()}",
        "retrysafe": f"{retrysafe.__version__} ({git_state()})",
    }


def git_state() -> str:
    """The commit measured, and which files under src/ differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.rstrip()  # porcelain lines start with a space: keep it

    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = sorted(
            line[3:] for line in git("status", "--porcelain", "--", "src").splitlines()
        )
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    if not changed:
        return f"git {commit}, clean"
    return f"git {commit} plus uncommitted changes to {', '.join(changed)}"


def library_info(names: Sequence[str]) -> str:
    return ", ".join(f"{name} {_version(name)}" for name in names)


# -- profiling ------------------------------------------------------------------------------


def profile(contenders: Sequence[Contender], seconds: float, top: int) -> None:
    """Print where retrysafe's contenders spend their time (cProfile, by own time)."""
    for c in contenders:
        if c.name != SUBJECT:
            continue
        c.prepare()
        prof = cProfile.Profile()
        deadline = time.perf_counter() + seconds
        prof.enable()
        while time.perf_counter() < deadline:
            c.run(c.batch)
        prof.disable()
        print(f"\n=== profile: {c.label} (cProfile, sorted by own time) ===")
        stats = pstats.Stats(prof)
        stats.strip_dirs().sort_stats("tottime").print_stats(top)
        print(f"--- {c.label}: retrysafe functions by cumulative time ---")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(r"retrysafe/", top)


# -- main ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=1.0, help="length of one measurement")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per contender")
    p.add_argument("--warmup", type=float, default=0.3, help="warm-up seconds per contender")
    p.add_argument("--stores", default=",".join(STORES), help="comma-separated subset")
    p.add_argument("--redis-url", help="use this Redis instead of starting one")
    p.add_argument("--postgres-url", help="use this PostgreSQL instead of starting one")
    p.add_argument("--mysql-url", help="use this MySQL/MariaDB instead of starting one")
    p.add_argument("--write", metavar="PATH", help="write the results as Markdown here")
    p.add_argument(
        "--profile", action="store_true", help="cProfile retrysafe's contenders after the rounds"
    )
    p.add_argument(
        "--redis-instructions",
        type=int,
        nargs="?",
        const=200,
        metavar="CALLS",
        help="only count the Redis contenders' client instructions per call (valgrind)",
    )
    p.add_argument(
        "--redis-py-path",
        action="store_true",
        help="with --redis-instructions: the store's rows again, with every command "
        "through redis-py (its own connections off)",
    )
    p.add_argument(
        "--instructions",
        type=int,
        metavar="N",
        help="SQLite only: count instructions per call over N calls (valgrind), then exit",
    )
    p.add_argument(
        "--postgres-instructions",
        type=int,
        metavar="N",
        help="PostgreSQL only: count the client's instructions per call over N calls "
        "(valgrind), then exit",
    )
    args = p.parse_args(argv)
    args.stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    unknown = sorted(set(args.stores) - set(STORES))
    if unknown:
        p.error(f"unknown stores {unknown}; choose from {', '.join(STORES)}")
    if args.rounds < 1 or args.seconds <= 0:
        p.error("--rounds must be at least 1 and --seconds positive")
    return args


def build_sections(
    args: argparse.Namespace,
    stack: contextlib.ExitStack,
    info: dict[str, str],
    tag: str,
    redis_client: list[Any],
    mysql_client: list[Any] | None = None,
) -> Iterator[tuple[str, list[Contender]]]:
    """Yield each section's contenders, starting servers and opening stores on the way."""
    if "memory" in args.stores:
        yield "memory", memory_section()
    if "sqlite" in args.stores:
        yield "sqlite", sqlite_section(stack, info)
    if "redis" in args.stores:
        url = args.redis_url or start_server("redis", stack)
        ns = f"rsbench-{tag}:"
        stores, decorators, client = redis_section(url, ns, stack, info)
        if args.redis_url:  # not our server: remove what we wrote (before the client closes)
            stack.callback(redis_cleanup, client, ns)
        redis_client.append(client)
        yield "redis", stores
        yield DECORATOR, decorators
    if "postgres" in args.stores:
        url = args.postgres_url or start_server("postgres", stack)
        yield "postgres", postgres_section(url, tag, args.postgres_url is None, stack, info)
    if "mysql" in args.stores:
        url = args.mysql_url or start_server("mysql", stack)
        clients = [] if mysql_client is None else mysql_client
        my = mysql_module()
        yield "mysql", my.mysql_section(url, tag, args.mysql_url is None, stack, info, clients)
        yield "mysql async", my.mysql_async_section(url, tag, stack)


def preflight(args: argparse.Namespace) -> None:
    """Fail before measuring anything if a library the chosen stores need is missing."""
    needs = {
        "redis": ["redis", "aws_lambda_powertools.utilities.idempotency"],
        "postgres": ["psycopg", "psycopg_pool"],
        "mysql": ["pymysql", "asyncmy"],
    }
    for store in args.stores:
        for module in needs.get(store, []):
            try:
                importlib.import_module(module)
            except ImportError as exc:
                hint = ""
                if module.startswith("aws_lambda_powertools"):
                    hint = (
                        " (Powertools' idempotency utility imports boto3: "
                        "pip install 'aws-lambda-powertools[aws-sdk]')"
                    )
                raise SystemExit(f"--stores {store} needs {module}: {exc}{hint}") from exc


def main(argv: Sequence[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else list(argv)
    if raw[:1] == ["--redis-instructions-run"]:
        return instructions_run(raw[1:])
    if raw[:1] == ["--instructions-run"]:
        return instructions_run_one(
            lambda stack: sqlite_section(stack, {}), raw[1], raw[2], int(raw[3])
        )
    if raw[:1] == ["--postgres-instructions-run"]:  # against the server at raw[4]
        return instructions_run_one(
            lambda stack: postgres_section(raw[4], secrets.token_hex(4), False, stack, {}),
            raw[1],
            raw[2],
            int(raw[3]),
        )
    args = parse_args(argv)
    if args.redis_instructions is not None:
        return redis_instructions(args.redis_instructions, args.redis_url, args.redis_py_path)
    if args.instructions:
        print(plain(sqlite_instructions(args.instructions)))
        return 0
    if args.postgres_instructions:
        with contextlib.ExitStack() as stack:
            url = args.postgres_url or start_server("postgres", stack)
            run = ("--postgres-instructions-run", url)
            print(plain(sqlite_instructions(args.postgres_instructions, run)))
        return 0
    preflight(args)
    script = os.path.relpath(sys.argv[0]) if sys.argv[0] else "bench/stores.py"
    command = shlex.join(["python", script, *(sys.argv[1:] if argv is None else argv)])
    started = time.monotonic()
    info = machine_info()
    all_contenders: list[Contender] = []
    trips: dict[tuple[str, str], RoundTrips] = {}
    redis_client: list[Any] = []
    mysql_client: list[Any] = []
    statements: dict[tuple[str, str, str], dict[str, float]] = {}

    with contextlib.ExitStack() as stack:
        tag = secrets.token_hex(4)
        sections = build_sections(args, stack, info, tag, redis_client, mysql_client)
        for name, contenders in sections:
            print(
                f"\n[{name}] {len(contenders)} contenders, {args.rounds} rounds of "
                f"{args.seconds:g}s",
                flush=True,
            )
            run_rounds(contenders, args.rounds, args.seconds, args.warmup)
            if name in ("redis", DECORATOR):
                for c in contenders:
                    trips[(trip_label(c), c.workload)] = count_round_trips(c, redis_client[0])
            if name.startswith("mysql"):
                for c in contenders:
                    statements[(c.section, c.name, c.workload)] = (
                        mysql_module().count_mysql_statements(c, mysql_client[0])
                    )
            if args.profile:
                profile(contenders, args.seconds, 25)
            all_contenders += contenders
    elapsed = time.monotonic() - started
    if hasattr(os, "getloadavg"):
        info["load average at end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())

    comps = comparisons(all_contenders)
    store_comps = [c for c in comps if c.section != DECORATOR]
    peer_comps = [c for c in comps if c.section == DECORATOR]
    print("\n== retrysafe Engine vs each store's floor (median ops/s, one thread) ==")
    print(plain(results_table(store_comps, FLOOR)))
    if peer_comps:
        print("\n== @idempotent vs Powertools idempotent_function, same Redis ==")
        print(plain(results_table(peer_comps, PEER)))
    if trips:
        print("\n== Redis round trips per call ==")
        print(plain(round_trip_table(trips)))
    if statements:
        print("\n== MySQL: floor, the store's statements raw, the engine ==")
        print(plain(mysql_module().mysql_breakdown_table(all_contenders)))
        print("\n== MySQL statements per call (server counters) ==")
        print(plain(mysql_module().mysql_statement_table(statements)))
    print("\n== targets ==")
    print(plain(targets_table(comps)))
    print(f"\n(total {elapsed:.0f}s)")

    if args.write:
        libraries = library_info(
            [
                *("redis", "hiredis", "psycopg", "psycopg-pool", "pymysql", "asyncmy"),
                "aws-lambda-powertools",
            ]
        )
        extra = mysql_module().mysql_render(statements, all_contenders) if statements else []
        doc = render(args, command, info, libraries, all_contenders, comps, trips, elapsed, extra)
        marks, heading = (BEGIN_MARK, END_MARK), ""
        if args.stores == ["mysql"]:  # a block of its own, one heading level down
            marks, heading = mysql_module().MYSQL_MARKS, mysql_module().MYSQL_HEADING
            doc = "\n".join(
                f"#{line}" if line.startswith("#") else line for line in doc.split("\n")
            )
        path = Path(args.write)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(splice(path, doc, marks, heading))
        print(f"wrote {path}")
    return 0


BEGIN_MARK = "<!-- bench/stores.py: generated from here -->"
END_MARK = "<!-- bench/stores.py: generated up to here -->"


def splice(
    path: Path, generated: str, marks: tuple[str, str] = (BEGIN_MARK, END_MARK), section: str = ""
) -> str:
    """The file (read now) with the generated part between ``marks`` replaced; the
    hand-written text around it is kept. Without the marks, the block (under the
    heading ``section``, if given) is appended. Every bench script writes with it."""
    begin, end = marks
    block = f"{begin}\n{generated.rstrip()}\n{end}\n"
    old = path.read_text() if path.exists() else ""
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        return f"{head}{block}\n{tail}" if tail else f"{head}{block}"
    if section:
        block = f"{section}\n\n{block}"
    return f"{old.rstrip()}\n\n{block}" if old else block


def trip_label(c: Contender) -> str:
    if c.section == DECORATOR:
        return "@retrysafe.idempotent" if c.name == SUBJECT else "Powertools idempotent_function"
    return "retrysafe Engine (RedisStore)" if c.name == SUBJECT else "floor (raw redis-py)"


def render(
    args: argparse.Namespace,
    command: str,
    info: dict[str, str],
    libraries: str,
    contenders: Sequence[Contender],
    comps: Sequence[Comparison],
    trips: dict[tuple[str, str], RoundTrips],
    elapsed: float,
    extra: Sequence[str] = (),
) -> str:
    """The generated block; ``extra`` (Markdown lines) goes after the results."""
    store_comps = [c for c in comps if c.section != DECORATOR]
    peer_comps = [c for c in comps if c.section == DECORATOR]
    out = [
        "## The last run",
        "",
        "How fast retrysafe's engine is on each store, from one thread, measured against",
        "the store's *floor*: the fewest raw commands that do the same work through the",
        "same client library on the same server. A first call is `engine.begin(new_key,",
        "operation=..., fingerprint=...)` + `engine.complete(claim, outcome)` (the outcome,",
        "a small JSON dict, built once, as the floors write prebuilt bytes);",
        "a replay is `engine.begin(key_of_a_completed_record, ...)` returning a `Replay`",
        "(sync API, default engine options; a store named `... async` runs `abegin` and",
        "`acomplete` instead, each batch of calls one coroutine on one event loop, its",
        "floor likewise).",
        *(
            [
                "On the same Redis server, `@retrysafe.idempotent` is compared with the",
                "idempotency utility of Powertools for AWS Lambda.",
            ]
            if peer_comps
            else []
        ),
        "",
        f"Contenders run interleaved in {args.rounds} rounds of {args.seconds:g} s each (the order",
        "flips every round) after a warm-up; every figure is the median over the rounds and",
        "every ratio a ratio of medians. All figures below come from the run recorded here;",
        "this part is generated by `bench/stores.py --write` and should not be edited by hand.",
        "",
        "### Command",
        "",
        "```",
        command,
        "```",
        "",
        f"The run took {elapsed:.0f} s.",
        "",
        "### Machine",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        f"- client libraries: {libraries}",
        "- everything (benchmark, servers) on the one machine, over loopback TCP",
        "",
        "### Results",
        "",
        "#### retrysafe's Engine against each store's floor",
        "",
        *results_table(store_comps, FLOOR),
        "",
        "Floors and settings:",
        "",
    ]
    out += [
        f"- {c.section}, {c.name}: {c.detail}"
        for c in contenders
        if c.section != DECORATOR and c.workload == FIRST
    ]
    if peer_comps:
        out += [
            "",
            "#### `@retrysafe.idempotent` against Powertools' `idempotent_function` (Redis)",
            "",
            *results_table(peer_comps, PEER),
            "",
            "- Both decorate the same trivial function `charge(order: dict) -> dict`, called as",
            "  `charge(order={...})`; first calls use a new `order_id` each, replays repeat one",
            "  completed `order_id`. Every measurement counts the function's executions and",
            "  fails unless first calls ran it once per call and replays ran it zero times, for",
            "  both libraries; replays must also return the stored result.",
            *(
                f"- {c.name}: `{c.detail}`"
                for c in contenders
                if c.section == DECORATOR and c.workload == FIRST
            ),
            "- Powertools outside Lambda: its config gets a stand-in Lambda context",
            "  (`config.register_lambda_context(...)`, as the Lambda runtime would) whose",
            f"  `get_remaining_time_in_millis()` returns {LAMBDA_REMAINING_MS} (ms),",
            "  retrysafe's default lease. Its local cache and payload validation are off",
            "  (their defaults), so every Powertools call goes to Redis. retrysafe",
            "  fingerprints all arguments by default (same key + other arguments is a",
            "  conflict); Powertools, as configured, does not validate the payload.",
        ]
    if trips:
        out += [
            "",
            "#### Redis round trips per call",
            "",
            f"Counted over {COUNT_CALLS} calls per contender: the requests redis-py wrote to the",
            "socket (each one round trip), and the server's `INFO commandstats` deltas; a",
            "command the server ran that no request named ran inside a Lua script. Server",
            "time is the `usec` of the requested commands (a script's includes what it ran).",
            "",
            *round_trip_table(trips),
        ]
    out += ["", *extra]
    targets = targets_table(comps)
    if len(targets) > 2:  # a header and a rule, then a row per target
        out += ["", "### Targets", "", *targets, ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
