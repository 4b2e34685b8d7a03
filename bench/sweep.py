"""Sweeping expired records on SQLite and PostgreSQL, and what it does to claims.

For every store, in one run:

1. **populate** a fresh table with ``--records`` expired records, straight through
   SQL (SQLite: ``executemany`` in one transaction; PostgreSQL: ``COPY ... FROM
   STDIN``, then ``VACUUM (ANALYZE)``, as autovacuum would have by then). Rows are
   built from completed ``Record``s (``retrysafe.stores._sql.record_params``; SQLite's
   compact form, ``_sqlite_rows.row_params``)
   with a small JSON outcome, expiring over the last few minutes; a ``--financial``
   share has retention "financial" (archived before deletion). This is setup: its
   time is printed, never part of the figures.
2. **claim traffic**: ``--threads`` threads run ``engine.begin(new_key,
   operation=..., fingerprint=...)`` + ``engine.complete(claim, outcome)`` on one
   shared engine of the store (default options), **open loop**: each thread has a
   schedule of ``--rate`` claims per second and the claim latency is measured
   from the *scheduled* start (``time.perf_counter_ns``), so a claim held up by
   the sweep, and every claim queued behind it, shows in the tail instead of
   silently lowering the request rate (coordinated omission). The service time
   (from the call's actual start) is reported too.
3. **phases**, all under the same traffic: a warm-up of 1 s (not counted), an idle
   window of ``--window`` seconds, the sweep (a ``retrysafe.Sweeper`` in a process
   of its own, as ``retrysafe sweep`` runs beside the servers, so it does not share
   their GIL; ``--batch-size``, ``--pause``, deleting every populated record), then
   a second idle window. A claim belongs to the phase its
   scheduled start falls in; claims scheduled in the first 0.5 s after the sweep
   are left out (the backlog of its last batch is the sweep's, not idle time). The
   idle figures combine both windows (each is printed too). Every call of
   ``store.sweep`` (one batch) is timed: on PostgreSQL a batch is one statement;
   on SQLite it is several short paced transactions, so its time includes the
   gaps the sweep leaves for claims.
4. **verify**, failing loudly: the sweep deleted exactly the populated records,
   ``store.stats(now)`` finds no expired record left, the archive holds exactly
   the financial share, every claim of the traffic is still there (counted, and
   a sample read back completed), and no claim failed.

Target (the issue): p99 claim latency during a sweep <= 2x the idle p99.

The default rate, 4 threads x 100 claims/s = 400 claims (800 writes) per second, is
what the idle stores handle comfortably on a small machine: a third of what one thread
reaches on PostgreSQL and a twelfth on SQLite (``bench/stores.py``, first calls), with
the benchmark, the sweeper and the server sharing the CPUs. Much faster, and idle
latency becomes queueing for the CPUs rather than the store's; much slower, and the
p99s come from few claims (two idle windows of 5 s give 4,000; the output says how
many claims each figure comes from, and warns under 1,000 during the sweep).

This is a benchmark, not a test (pytest does not run it). It starts its own
PostgreSQL (tests/_servers.py) unless ``--postgres-url`` is given; a server of
its own is thrown away at the end, on another server its tables are dropped.

    python bench/sweep.py [--records 1000000] [--stores sqlite,postgres]
                          [--batch-size 1000] [--pause 0] [--threads 4] [--rate 100]
                          [--window 5] [--financial 0.1] [--sqlite-synchronous normal]
                          [--postgres-url URL] [--write docs/performance.md]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Keep this folder off sys.path: bench/http.py would shadow the standard library's http.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import secrets  # noqa: E402
import shlex  # noqa: E402
import sqlite3  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import textwrap  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from types import ModuleType, SimpleNamespace  # noqa: E402
from typing import Any  # noqa: E402

from retrysafe import Claim, Engine, Outcome, Record, Status, open_store  # noqa: E402
from retrysafe._model.hashing import key_hash  # noqa: E402
from retrysafe._model.record import FINANCIAL, STANDARD  # noqa: E402
from retrysafe.stores import Store  # noqa: E402
from retrysafe.stores._sql import COLUMNS, record_params  # noqa: E402
from retrysafe.stores._sqlite_rows import FINANCIAL_CODE, row_params  # noqa: E402

ROOT = HERE.parent
STORES = ("sqlite", "postgres")

#: The populated (expired) records and the claim traffic use operations of their
#: own, so the stats tell them apart.
EXPIRED_OPERATION = "bench.expired"
CLAIM_OPERATION = "bench.claim"
FINGERPRINT = "f" * 64
OUTCOME = Outcome.json({"id": "ch_123", "amount": 1999, "currency": "eur", "ok": True}, status=201)
DAY = 24 * 3600.0
#: Populated rows per executemany / COPY chunk (rows are built lazily, chunk by chunk).
CHUNK = 10_000
#: Warm-up under traffic before the first idle window (connections, prepared statements).
WARMUP = 1.0
#: Claims scheduled this long after the sweep ended belong to no phase.
SETTLE = 0.5
#: Claims of the traffic read back one by one at the end (all are counted).
READ_BACK = 500
TARGET_RATIO = 2.0
IDLE1, SWEEP, IDLE2, IDLE = "idle before", "during sweep", "idle after", "idle (both)"


class BenchError(RuntimeError):
    """The run did not do what it measures (a lost record, a failed claim, ...)."""


# -- populating -------------------------------------------------------------------------


def is_financial(i: int, share: float) -> bool:
    """Exactly floor(n * share) of the first n records, evenly spread."""
    return math.floor((i + 1) * share) > math.floor(i * share)


def expired_rows(
    n: int,
    share: float,
    now: float,
    tag: str,
    params: Callable[[Record], tuple[Any, ...]] = record_params,
) -> Iterator[list[tuple[Any, ...]]]:
    """Chunks of rows (COLUMNS order, as ``params`` writes a record: the plain form, or
    SQLite's own) of ``n`` completed records that expired before ``now``.

    Expiry times spread over the ``n`` ms before ``now - 60`` in insertion order; the
    primary key (a SHA-256) is random with respect to them, as in a real table.
    """
    prefix = secrets.token_hex(8)
    oldest = now - 60.0 - n / 1000.0
    chunk: list[tuple[Any, ...]] = []
    for i in range(n):
        retention = FINANCIAL if is_financial(i, share) else STANDARD
        expires = oldest + i / 1000.0
        created = expires - (7 * DAY if retention == FINANCIAL else DAY)
        key = f"expired-{tag}-{i}"
        record = Record(
            key_hash=key_hash("", EXPIRED_OPERATION, key),
            key=key,
            scope="",
            operation=EXPIRED_OPERATION,
            fingerprint=FINGERPRINT,
            status=Status.COMPLETED,
            token=f"{prefix}{i:x}",
            lease_until=created + 30.0,
            expires_at=expires,
            created_at=created,
            updated_at=created + 0.005,
            completed_at=created + 0.005,
            attempts=1,
            request_id=None,
            final=False,
            outcome=OUTCOME,
            request_payload=None,
            metadata={},
            retention=retention,
        )
        chunk.append(params(record))
        if len(chunk) == CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def financial_count(n: int, share: float) -> int:
    return sum(1 for i in range(n) if is_financial(i, share))


def populate_sqlite(path: str, n: int, share: float, tag: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous=OFF")  # setup only; the store keeps its own setting
        insert = (
            f"INSERT INTO retrysafe_records ({', '.join(COLUMNS)}) "
            f"VALUES ({', '.join('?' * len(COLUMNS))})"
        )
        conn.execute("BEGIN IMMEDIATE")
        try:
            for rows in expired_rows(n, share, time.time(), tag, row_params):
                conn.executemany(insert, rows)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # start the sweep with an empty WAL
    finally:
        conn.close()


def populate_postgres(url: str, table: str, n: int, share: float, tag: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(url, autocommit=True) as conn:
        copy_sql = sql.SQL("COPY {} ({}) FROM STDIN").format(
            sql.Identifier(table), sql.SQL(", ").join(map(sql.Identifier, COLUMNS))
        )
        with conn.transaction(), conn.cursor() as cur, cur.copy(copy_sql) as copy:
            for rows in expired_rows(n, share, time.time(), tag):
                for row in rows:
                    copy.write_row(row)
        conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(sql.Identifier(table)))


# -- claim traffic --------------------------------------------------------------------------


@dataclass
class Traffic:
    """Open-loop claim traffic: ``threads`` threads, each ``rate`` claims per second."""

    engine: Engine
    threads: int
    rate: float
    tag: str
    stop: threading.Event = field(default_factory=threading.Event)
    #: (scheduled, started, claimed, completed) in perf_counter_ns, per claim.
    samples: list[list[tuple[int, int, int, int]]] = field(default_factory=list)
    key_hashes: list[list[str]] = field(default_factory=list)
    errors: list[list[tuple[int, str]]] = field(default_factory=list)
    workers: list[threading.Thread] = field(default_factory=list)
    t0: int = 0

    def start(self) -> None:
        self.t0 = time.perf_counter_ns() + 50_000_000
        for i in range(self.threads):
            self.samples.append([])
            self.key_hashes.append([])
            self.errors.append([])
            t = threading.Thread(target=self._run, args=(i,), name=f"claims-{i}", daemon=True)
            self.workers.append(t)
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.workers:
            t.join()

    def _run(self, index: int) -> None:
        period = round(1e9 / self.rate)
        # Threads are staggered evenly over one period.
        scheduled = self.t0 + index * period // self.threads
        samples, hashes, errors = self.samples[index], self.key_hashes[index], self.errors[index]
        begin, complete, clock, stop = (
            self.engine.begin,
            self.engine.complete,
            time.perf_counter_ns,
            self.stop,
        )
        seq = 0
        while not stop.is_set():
            ahead = scheduled - clock()
            if ahead > 0:
                time.sleep(ahead / 1e9)
            key = f"claim-{self.tag}-{index}-{seq}"
            seq += 1
            started = clock()
            try:
                claim = begin(key, operation=CLAIM_OPERATION, fingerprint=FINGERPRINT)
                claimed = clock()
                if type(claim) is not Claim:
                    raise BenchError(f"a new key was not claimed: {claim!r}")
                complete(claim, OUTCOME)
                done = clock()
            except Exception as exc:
                errors.append((scheduled, f"{type(exc).__name__}: {exc}"))
            else:
                samples.append((scheduled, started, claimed, done))
                hashes.append(claim.key_hash)
            scheduled += period


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of sorted ``values`` (nan when empty)."""
    if not values:
        return math.nan
    return values[max(0, math.ceil(q * len(values)) - 1)]


@dataclass
class Phase:
    """The claims of one phase; latencies in ms."""

    name: str
    latency: list[float] = field(default_factory=list)  # from the scheduled start
    service: list[float] = field(default_factory=list)  # begin, from its actual start
    complete: list[float] = field(default_factory=list)
    errors: int = 0

    def add(self, sample: tuple[int, int, int, int]) -> None:
        scheduled, started, claimed, done = sample
        self.latency.append((claimed - scheduled) / 1e6)
        self.service.append((claimed - started) / 1e6)
        self.complete.append((done - claimed) / 1e6)

    def sort(self) -> None:
        self.latency.sort()
        self.service.sort()
        self.complete.sort()

    def p(self, q: float, what: str = "latency") -> float:
        return percentile(getattr(self, what), q)


def classify(traffic: Traffic, bounds: dict[str, tuple[int, int]]) -> dict[str, Phase]:
    """Every claim into the phase its scheduled start falls in (``bounds``: [start, end))."""
    phases = {name: Phase(name) for name in (*bounds, IDLE)}

    def phase_of(scheduled: int) -> str | None:
        for name, (lo, hi) in bounds.items():
            if lo <= scheduled < hi:
                return name
        return None

    for samples in traffic.samples:
        for sample in samples:
            name = phase_of(sample[0])
            if name is not None:
                phases[name].add(sample)
                if name in (IDLE1, IDLE2):
                    phases[IDLE].add(sample)
    for errors in traffic.errors:
        for scheduled, _ in errors:
            name = phase_of(scheduled)
            if name is not None:
                phases[name].errors += 1
                if name in (IDLE1, IDLE2):
                    phases[IDLE].errors += 1
    for phase in phases.values():
        phase.sort()
    return phases


# -- one store ------------------------------------------------------------------------------


@dataclass
class StoreRun:
    """Everything measured on one store."""

    store: str
    records: int
    financial: int
    populate_seconds: float = 0.0
    deleted: int = 0
    archived: int = 0
    batches: int = 0
    sweep_seconds: float = 0.0
    batch_ms: list[float] = field(default_factory=list)
    phases: dict[str, Phase] = field(default_factory=dict)
    claims: int = 0
    setting: str = ""

    @property
    def rate(self) -> float:
        return self.deleted / self.sweep_seconds if self.sweep_seconds > 0 else 0.0

    @property
    def ratio(self) -> float:
        return self.phases[SWEEP].p(0.99) / self.phases[IDLE].p(0.99)

    @property
    def met(self) -> bool:
        return self.ratio <= TARGET_RATIO


@dataclass
class Setup:
    """A store to measure: its URL, how to populate and count its table, and cleanup."""

    name: str
    url: str
    options: dict[str, Any]
    populate: Callable[[int, float, str], None]
    count: Callable[[str], int]  # SQL condition -> number of rows
    setting: str


def sqlite_setup(args: argparse.Namespace, stack: contextlib.ExitStack) -> Setup:
    directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rsbench-sweep-")))
    path = str(directory / "store.db")
    url = f"sqlite:///{path}?synchronous={args.sqlite_synchronous}"

    def count(where: str) -> int:
        # The compact row form keeps the retention as a code (see _sqlite_rows).
        where = where.replace("retention = 'financial'", f"retention = {FINANCIAL_CODE}")
        with contextlib.closing(sqlite3.connect(path)) as conn:
            return int(
                conn.execute(f"SELECT count(*) FROM retrysafe_records WHERE {where}").fetchone()[0]
            )

    return Setup(
        "sqlite",
        url,
        {},
        lambda n, share, tag: populate_sqlite(path, n, share, tag),
        count,
        f"SQLiteStore, sqlite:///<temp dir>/store.db?synchronous={args.sqlite_synchronous} "
        f"(SQLite {sqlite3.sqlite_version}, WAL)",
    )


def postgres_setup(
    args: argparse.Namespace, stack: contextlib.ExitStack, tag: str
) -> tuple[Setup, str]:
    import psycopg

    own = args.postgres_url is None
    url = args.postgres_url or start_postgres(stack)
    table = f"rsbench_sweep_{tag}"

    def drop() -> None:  # every table the store made (records, schema versions, archive)
        with psycopg.connect(url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() "
                "AND tablename LIKE %s",
                (f"{table}%",),
            ).fetchall()
            for (name,) in rows:
                conn.execute(f'DROP TABLE IF EXISTS "{name}" CASCADE')

    if not own:  # a server of our own is thrown away whole
        stack.callback(drop)

    def count(where: str) -> int:
        with psycopg.connect(url) as conn:
            row = conn.execute(f'SELECT count(*) FROM "{table}" WHERE {where}').fetchone()
            assert row is not None
            return int(row[0])

    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT current_setting('server_version'), current_setting('fsync'), "
            "current_setting('synchronous_commit')"
        ).fetchone()
    assert row is not None
    server = f"PostgreSQL {row[0]} (fsync={row[1]}, synchronous_commit={row[2]})"
    return Setup(
        "postgres",
        url,
        {"table": table},
        lambda n, share, t: populate_postgres(url, table, n, share, t),
        count,
        f"PostgresStore, default options, a table of its own; {server}",
    ), server


def run_store(setup: Setup, args: argparse.Namespace, tag: str) -> StoreRun:
    n, share = args.records, args.financial
    result = StoreRun(setup.name, n, financial_count(n, share), setting=setup.setting)
    print(f"\n[{setup.name}] {setup.setting}", flush=True)

    traffic_store = open_store(setup.url, **setup.options)
    try:
        traffic_store.migrate()  # type: ignore[attr-defined]

        t = time.perf_counter()
        setup.populate(n, share, tag)
        result.populate_seconds = time.perf_counter() - t
        populated = setup.count(f"operation = '{EXPIRED_OPERATION}'")
        financial = setup.count(f"operation = '{EXPIRED_OPERATION}' AND retention = 'financial'")
        if (populated, financial) != (n, result.financial):
            raise BenchError(
                f"{setup.name}: populated {populated} records ({financial} "
                f"financial), expected {n} ({result.financial})"
            )
        print(
            f"  populated {n:,} expired records ({result.financial:,} financial) "
            f"in {result.populate_seconds:.1f}s (setup, not measured)",
            flush=True,
        )

        sweeper = SweeperProcess(setup.url, setup.options, args.batch_size, args.pause)
        traffic = Traffic(Engine(traffic_store), args.threads, args.rate, tag)
        traffic.start()
        try:
            report = run_phases(traffic, sweeper, args.window, result)
        finally:
            traffic.finish()
        result.deleted, result.archived = report.deleted, report.archived
        result.batches, result.sweep_seconds = report.batches, report.seconds
        result.phases = classify(traffic, report.bounds)
        result.claims = sum(len(h) for h in traffic.key_hashes)
        verify(traffic_store, traffic, result)
    finally:
        traffic_store.close()
    print_store(result)
    return result


#: The sweeper's process: ``retrysafe sweep`` as an operator runs it, beside the
#: servers (not a thread of theirs, whose GIL it would share), with every
#: ``store.sweep`` call timed. It prints progress lines, then one JSON result line.
_SWEEPER = """
import json, sys, time
from retrysafe import Sweeper, open_store
url, options = sys.argv[1], json.loads(sys.argv[2])
batch_size, pause = int(sys.argv[3]), float(sys.argv[4])
store = open_store(url, **options)
store.get("0" * 64)  # connected before the clock starts
inner, batch_ms = store.sweep, []
def timed(now, limit=1000):
    t = time.perf_counter_ns()
    try:
        return inner(now, limit)
    finally:
        batch_ms.append((time.perf_counter_ns() - t) / 1e6)
store.sweep = timed
print("ready", flush=True)
sys.stdin.readline()
last = [time.monotonic()]
def progress(report):
    if time.monotonic() - last[0] >= 1.0:
        last[0] = time.monotonic()
        print(f"    swept {report.deleted:,} in {report.seconds:.1f}s ({report.rate:,.0f}/s)",
              flush=True)
r = Sweeper(store, batch_size=batch_size, pause=pause).run(progress=progress)
print("result " + json.dumps({"deleted": r.deleted, "archived": r.archived,
      "batches": r.batches, "seconds": r.seconds, "batch_ms": batch_ms}), flush=True)
store.close()
"""


@dataclass
class SweeperProcess:
    """How to start the sweeper's process (see ``_SWEEPER``)."""

    url: str
    options: dict[str, Any]
    batch_size: int
    pause: float

    def start(self) -> subprocess.Popen[str]:
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _SWEEPER,
                self.url,
                json.dumps(self.options),
                str(self.batch_size),
                repr(self.pause),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            child.kill()
            raise BenchError("the sweeper process did not start")
        return child


@dataclass
class PhaseReport:
    deleted: int
    archived: int
    batches: int
    seconds: float
    bounds: dict[str, tuple[int, int]]


def run_phases(
    traffic: Traffic, sweeper: SweeperProcess, window: float, result: StoreRun
) -> PhaseReport:
    """Warm-up, idle window, the sweep (in a process of its own), idle window."""
    clock = time.perf_counter_ns
    child = sweeper.start()
    time.sleep(max(0.0, WARMUP + (traffic.t0 - clock()) / 1e9))
    idle1 = clock()
    time.sleep(window)
    sweep_start = clock()
    print(
        f"  idle window done; sweeping (batch size {sweeper.batch_size}, pause {sweeper.pause:g}s)",
        flush=True,
    )

    assert child.stdin is not None and child.stdout is not None
    child.stdin.write("go\n")
    child.stdin.flush()
    found: dict[str, Any] | None = None
    for line in child.stdout:
        if line.startswith("result "):
            found = json.loads(line[7:])
        else:
            print(line, end="", flush=True)
    child.wait()
    sweep_end = clock()
    if found is None or child.returncode != 0:
        raise BenchError(f"{result.store}: the sweep failed (exit status {child.returncode})")
    result.batch_ms.extend(found["batch_ms"])
    report = SimpleNamespace(**found)
    print(
        f"  swept {report.deleted:,} records ({report.archived:,} archived) in "
        f"{report.seconds:.2f}s, {report.batches} batches; idle window",
        flush=True,
    )
    settled = sweep_end + int(SETTLE * 1e9)
    time.sleep(SETTLE + window)
    end = clock()
    return PhaseReport(
        report.deleted,
        report.archived,
        report.batches,
        report.seconds,
        {IDLE1: (idle1, sweep_start), SWEEP: (sweep_start, sweep_end), IDLE2: (settled, end)},
    )


def verify(store: Store[Any], traffic: Traffic, result: StoreRun) -> None:
    """Fail loudly unless the sweep removed exactly the expired records and nothing else."""
    problems: list[str] = []
    errors = [e for errs in traffic.errors for e in errs]
    if errors:
        problems.append(f"{len(errors)} claims failed, e.g. {errors[0][1]}")
    if result.deleted != result.records:
        problems.append(f"the sweep deleted {result.deleted} records, expected {result.records}")
    if result.archived != result.financial:
        problems.append(f"the sweep archived {result.archived}, expected {result.financial}")
    stats = store.stats(time.time())
    if stats.expired:
        problems.append(f"{stats.expired} expired records left after the sweep")
    if stats.archived is not None and stats.archived != result.financial:
        problems.append(f"the archive holds {stats.archived}, expected {result.financial}")
    live = stats.by_operation()
    if live.get(EXPIRED_OPERATION):
        problems.append(f"{live[EXPIRED_OPERATION]} populated records are live")
    completed = stats.counts.get((CLAIM_OPERATION, Status.COMPLETED.value), 0)
    if completed != result.claims or sum(live.values()) != result.claims:
        problems.append(
            f"{result.claims} claims made, {completed} completed claims in the "
            f"store, {sum(live.values())} live records in all"
        )
    hashes = [h for hs in traffic.key_hashes for h in hs]
    for kh in random.Random(0).sample(hashes, min(READ_BACK, len(hashes))):
        record = store.get(kh)
        if record is None or record.status is not Status.COMPLETED:
            problems.append(f"claim {kh[:16]} is {record and record.status}, expected completed")
            break
    if problems:
        raise BenchError(f"{result.store}: " + "; ".join(problems))
    print(
        f"  verified: no expired record left, {result.archived:,} archived, all "
        f"{result.claims:,} claims of the traffic live and completed",
        flush=True,
    )


# -- servers, machine -----------------------------------------------------------------------


def _load(name: str, path: Path) -> ModuleType:
    """A module by file path, without putting its folder on sys.path."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def start_postgres(stack: contextlib.ExitStack) -> str:
    servers = _load("_rsbench_servers", ROOT / "tests" / "_servers.py")
    server = servers.PostgresServer()
    t = time.monotonic()
    stack.enter_context(server)
    print(f"started postgres at {server.url} in {time.monotonic() - t:.1f}s", flush=True)
    return str(server.url)


# The machine and the commit measured, described as bench/stores.py describes them.
_stores = _load("_rsbench_stores", HERE / "stores.py")
machine_info = _stores.machine_info
_version = _stores._version


def _load_average() -> str:
    if not hasattr(os, "getloadavg"):
        return "?"
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


# -- output ---------------------------------------------------------------------------------


def ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def sweep_table(r: StoreRun, args: argparse.Namespace) -> list[str]:
    batch_p50 = statistics.median(r.batch_ms) if r.batch_ms else math.nan
    longest = max(r.batch_ms, default=math.nan)
    return [
        "| sweep | |",
        "|---|--:|",
        f"| records swept | {r.deleted:,} |",
        f"| of which financial, archived | {r.archived:,} |",
        f"| populate (bulk SQL; setup, not measured) | {r.populate_seconds:.1f} s |",
        f"| batch size, pause | {args.batch_size:,}, {args.pause:g} s |",
        f"| batches | {r.batches:,} |",
        f"| sweep time | {r.sweep_seconds:.2f} s |",
        f"| **records/s** | **{r.rate:,.0f}** |",
        f"| batch time p50 / longest (ms) | {ms(batch_p50)} / {ms(longest)} |",
    ]


def claims_table(r: StoreRun) -> list[str]:
    names = (IDLE1, SWEEP, IDLE2, IDLE)
    phases = [r.phases[name] for name in names]

    def row(label: str, cell: Callable[[Phase], str]) -> str:
        return f"| {label} | " + " | ".join(cell(p) for p in phases) + " |"

    return [
        "| claims | " + " | ".join(names) + " |",
        "|---|" + "--:|" * len(names),
        row("claims measured", lambda p: f"{len(p.latency):,}"),
        row("claim latency p50 (ms)", lambda p: ms(p.p(0.5))),
        row("**claim latency p99 (ms)**", lambda p: f"**{ms(p.p(0.99))}**"),
        row("claim latency max (ms)", lambda p: ms(p.p(1.0))),
        row(
            "begin service time p50 / p99 (ms)",
            lambda p: f"{ms(p.p(0.5, 'service'))} / {ms(p.p(0.99, 'service'))}",
        ),
        row(
            "complete p50 / p99 (ms)",
            lambda p: f"{ms(p.p(0.5, 'complete'))} / {ms(p.p(0.99, 'complete'))}",
        ),
        row("failed claims", lambda p: str(p.errors)),
    ]


def targets_table(runs: Sequence[StoreRun]) -> list[str]:
    out = [
        "| store | records/s | longest batch (ms) | idle p99 (ms) | sweep p99 (ms) "
        "| sweep p99 / idle p99 | target | |",
        "|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in runs:
        out.append(
            f"| {r.store} | {r.rate:,.0f} | {ms(max(r.batch_ms, default=math.nan))} "
            f"| {ms(r.phases[IDLE].p(0.99))} | {ms(r.phases[SWEEP].p(0.99))} "
            f"| {ms(r.ratio)}x | <= {TARGET_RATIO:g}x | {'met' if r.met else '**missed**'} |"
        )
    return out


def print_store(r: StoreRun) -> None:
    phases = "; ".join(
        f"{name}: n={len(p.latency)} p50={ms(p.p(0.5))} p99={ms(p.p(0.99))} max={ms(p.p(1.0))} ms"
        for name, p in r.phases.items()
    )
    print(f"  claims: {phases}", flush=True)
    print(
        f"  {r.rate:,.0f} records/s; longest batch {ms(max(r.batch_ms))} ms; "
        f"p99 ratio {ms(r.ratio)}x ({'met' if r.met else 'MISSED'})",
        flush=True,
    )


def render(
    args: argparse.Namespace,
    command: str,
    info: dict[str, str],
    runs: Sequence[StoreRun],
    elapsed: float,
) -> str:
    few = [r for r in runs if len(r.phases[SWEEP].latency) < 1000]
    out = [
        "### The last run",
        "",
        textwrap.fill(
            f"Generated by `bench/sweep.py --write` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; "
            "do not edit by hand. Each store's table is populated by bulk SQL with "
            f"{args.records:,} expired, completed records ({args.financial:.0%} of them "
            "financial, archived before deletion). Then, under claim traffic of "
            f"{args.threads} threads x {args.rate:g} claims/s, open loop (a claim's latency "
            "counts from its scheduled start, so a stalled claim and those queued behind it "
            "count in full), a `Sweeper` in a process of its own (as `retrysafe sweep` runs "
            "beside the servers) removes them all between two idle windows of "
            f"{args.window:g} s. A claim is `engine.begin(new_key, ...)`, followed (outside "
            "its latency) by `engine.complete(claim, outcome)`; it belongs to the phase its "
            f"scheduled start falls in, and those of the first {SETTLE:g} s after the sweep "
            "to none. A batch is one `store.sweep` call: one statement on PostgreSQL; on "
            "SQLite, short paced transactions of about 1 ms each with gaps for claims, so "
            "its time is not a lock hold. After every run the benchmark "
            "checked that no expired record was left, that the archive held exactly the "
            "financial records, and that every claim of the traffic was still there, "
            "completed.",
            width=88,
        ),
        "",
        "#### Command",
        "",
        "```",
        command,
        "```",
        "",
        f"The run took {elapsed:.0f} s.",
        "",
        "#### Machine",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        "- everything (benchmark, claim traffic, sweeper, server) on the one machine",
        "",
        "#### Target: p99 claim latency during a sweep <= 2x the idle p99",
        "",
        *targets_table(runs),
    ]
    if few:
        out += [
            "",
            "Few claims fell in the sweep of "
            + ", ".join(r.store for r in few)
            + " (under 1,000): its p99 is rough.",
        ]
    for r in runs:
        out += [
            "",
            f"#### {r.store}",
            "",
            f"{r.setting}.",
            "",
            *sweep_table(r, args),
            "",
            *claims_table(r),
        ]
    out.append("")
    return "\n".join(out)


BEGIN_MARK = "<!-- bench/sweep.py: generated from here -->"
END_MARK = "<!-- bench/sweep.py: generated up to here -->"
SECTION = "## Sweeping"


def splice(path: Path, generated: str) -> str:
    """The file (read now) with its generated part replaced, or a ``## Sweeping`` section
    holding it appended at the end."""
    return _stores.splice(path, generated, (BEGIN_MARK, END_MARK), SECTION)


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=1_000_000, help="expired records to sweep")
    p.add_argument("--stores", default=",".join(STORES), help="comma-separated subset")
    p.add_argument("--batch-size", type=int, default=1000, help="the Sweeper's batch_size")
    p.add_argument("--pause", type=float, default=0.0, help="the Sweeper's pause (s)")
    p.add_argument("--threads", type=int, default=4, help="threads of claim traffic")
    p.add_argument("--rate", type=float, default=100.0, help="claims per second per thread")
    p.add_argument("--window", type=float, default=5.0, help="seconds of each idle window")
    p.add_argument("--financial", type=float, default=0.1, help="share of financial records")
    p.add_argument(
        "--sqlite-synchronous",
        default="normal",
        choices=("off", "normal", "full", "extra"),
        help="SQLite's synchronous setting in the store URL",
    )
    p.add_argument("--postgres-url", help="use this PostgreSQL instead of starting one")
    p.add_argument("--write", metavar="PATH", help="put the results as Markdown in this file")
    args = p.parse_args(argv)
    args.stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    unknown = sorted(set(args.stores) - set(STORES))
    if unknown:
        p.error(f"unknown stores {unknown}; choose from {', '.join(STORES)}")
    if args.records < 1 or args.batch_size < 1 or args.threads < 1:
        p.error("--records, --batch-size and --threads must be at least 1")
    if not (args.rate > 0 and args.window > 0 and args.pause >= 0):
        p.error("--rate and --window must be positive, --pause at least 0")
    if not 0 <= args.financial <= 1:
        p.error("--financial is a share between 0 and 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "postgres" in args.stores:
        for module in ("psycopg", "psycopg_pool"):
            if importlib.util.find_spec(module) is None:
                raise SystemExit(
                    f"--stores postgres needs {module}: pip install 'retrysafe[postgres]'"
                )
    script = os.path.relpath(sys.argv[0]) if sys.argv[0] else "bench/sweep.py"
    command = shlex.join(["python", script, *(sys.argv[1:] if argv is None else argv)])
    started = time.monotonic()
    info = machine_info()
    tag = secrets.token_hex(4)
    runs: list[StoreRun] = []
    with contextlib.ExitStack() as stack:
        for name in args.stores:
            if name == "sqlite":
                setup = sqlite_setup(args, stack)
                sync = args.sqlite_synchronous
                info["SQLite"] = f"{sqlite3.sqlite_version} (WAL, synchronous={sync})"
            else:
                setup, server = postgres_setup(args, stack, tag)
                info["PostgreSQL"] = server.removeprefix("PostgreSQL ")
                info["client libraries"] = (
                    f"psycopg {_version('psycopg')}, psycopg-pool {_version('psycopg-pool')}"
                )
            runs.append(run_store(setup, args, tag))
    elapsed = time.monotonic() - started
    info["load average at end"] = _load_average()

    doc = render(args, command, info, runs, elapsed)
    print("\n" + doc)
    if args.write:
        path = Path(args.write)
        path.write_text(splice(path, doc))  # read just now: other sections stay as they are
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
