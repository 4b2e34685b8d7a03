"""Which Python drivers the MySQL store should use: its statement shapes through each
candidate, against one real MariaDB, in one run.

Sync: PyMySQL, mysqlclient (``MySQLdb``) and MariaDB's own connector (``mariadb``,
when installed). Async: asyncmy, asyncmy with bodies sent as hex literals
(``asyncmy-hex``: its own escaping of ``bytes`` is slow) and aiomysql. Each contender
has one connection (``autocommit``, client flags ``MULTI_STATEMENTS | FOUND_ROWS``, as
the store's) and a table of its own with the store's 22 record columns, and runs, from
one thread:

* **claim**: one round trip of two statements on a new key,
  ``INSERT INTO t (...22 columns...) VALUES (...) ON DUPLICATE KEY UPDATE key_hash =
  key_hash; SELECT <22 columns> FROM t WHERE key_hash = %s``: the row comes back
  (``mariadb`` sends parameters by the binary protocol, one statement at a time: two
  round trips there);
* **complete**: ``UPDATE t SET status = ..., response_body = %s (2 KiB of JSON), ... WHERE
  key_hash = %s AND token = %s AND status = ...`` on an existing row (rowcount 1);
* **replay**: the claim's round trip on the key of a completed row whose body is
  64 KiB of JSON: the INSERT changes nothing and the SELECT brings the 64 KiB back.

Contenders run interleaved in rounds (the order flips every round) after a warm-up;
every figure is the median over the rounds (bench/stores.py), and each driver's ratio
is its time per operation against the fastest of its kind (sync or async) on that
shape. The async drivers run on one event loop, one operation awaited after another,
as one request's claim is. This is a benchmark, not a test.

    python bench/mysql_drivers.py [--rounds R] [--seconds S] [--warmup W]
                                  [--drivers pymysql,mysqlclient,mariadb,asyncmy,...]
                                  [--url mysql://user[:password]@host:port/database]

Without ``--url`` it starts its own MariaDB (tests/_servers.py: ``mariadbd`` from
Debian's mariadb-server, the redo log fsynced once a second) and stops it at the end.
"""

# ruff: noqa: E402  (the imports follow the sys.path guard below)
from __future__ import annotations

import sys
from pathlib import Path

# Keep this folder off sys.path: bench/http.py would shadow the standard library's http.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import argparse
import asyncio
import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import itertools
import json
import os
import secrets
import shlex
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any
from urllib.parse import unquote, urlsplit

from retrysafe.stores._sql import COLUMN_SPECS


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bs = _load("_rsbench_stores", HERE / "stores.py")
Contender = bs.Contender
BenchError = bs.BenchError

SYNC = ("pymysql", "mysqlclient", "mariadb")
ASYNC = ("asyncmy", "asyncmy-hex", "aiomysql")
DRIVERS = (*SYNC, *ASYNC)
#: The distribution each driver comes from, and how it is built.
DISTRIBUTIONS = {
    "pymysql": "PyMySQL",
    "mysqlclient": "mysqlclient",
    "mariadb": "mariadb",
    "asyncmy": "asyncmy",
    "asyncmy-hex": "asyncmy",
    "aiomysql": "aiomysql",
}
#: Client flags of every connection: several statements per round trip, and an
#: UPDATE's rowcount counts the rows matched (not only those changed).
MULTI_STATEMENTS, FOUND_ROWS = 1 << 16, 1 << 1


def json_body(size: int) -> bytes:
    """``size`` bytes of a JSON response (quotes and all, as the store's bodies are)."""
    items = [{"sku": f"sku-{i:05d}", "qty": i % 7, "note": "ok"} for i in range(size // 30 + 1)]
    return json.dumps({"order": secrets.token_hex(8), "items": items}).encode()[:size]


COMPLETE_BODY = json_body(2048)
REPLAY_BODY = json_body(65536)


class Blob:
    """A body that asyncmy sends as a hex literal (``asyncmy-hex``): asyncmy 0.2.18
    escapes ``bytes`` with ``str.translate``, a character at a time."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def hex_literal(value: Blob, mapping: Any = None) -> str:
    """asyncmy's encoder of a :class:`Blob` (what PyMySQL 1.2.3+ sends for bytes)."""
    return "_binary X'" + value.data.hex() + "'"


# -- the statement shapes -------------------------------------------------------------------

#: MySQL's type for each column kind of the store's COLUMN_SPECS.
TYPES = {
    "text": "TEXT",
    "real": "DOUBLE",
    "integer": "INT",
    "bool": "BOOLEAN",
    "bytes": "LONGBLOB",
}
COLUMNS = [name for name, _, _ in COLUMN_SPECS]
NAMES = ", ".join(f"`{c}`" for c in COLUMNS)


def create_table(table: str) -> str:
    columns = ",\n  ".join(
        "`key_hash` VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL"
        if name == "key_hash"
        else f"`{name}` {TYPES[kind]}{'' if nullable else ' NOT NULL'}"
        for name, kind, nullable in COLUMN_SPECS
    )
    return (
        f"CREATE TABLE `{table}` (\n  {columns},\n  PRIMARY KEY (`key_hash`)\n)"
        " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
    )


def claim_sql(table: str) -> str:
    marks = ", ".join(["%s"] * len(COLUMNS))
    return (
        f"INSERT INTO `{table}` ({NAMES}) VALUES ({marks})"
        " ON DUPLICATE KEY UPDATE key_hash = key_hash;"
        f" SELECT {NAMES} FROM `{table}` WHERE key_hash = %s"
    )


def complete_sql(table: str) -> str:
    return (
        f"UPDATE `{table}` SET status = %s, response_status = %s, response_headers = %s,"
        " response_media_type = %s, response_body = %s, completed_at = %s, updated_at = %s,"
        " final = %s WHERE key_hash = %s AND token = %s AND status = %s"
    )


def claim_params(key: str, now: float) -> tuple[Any, ...]:
    """The claim's 22 INSERT parameters and the SELECT's key hash."""
    key_hash = hashlib.sha256(key.encode()).hexdigest()
    token = secrets.token_hex(16)
    record = {
        "key_hash": key_hash,
        "key": key,
        "scope": "tenant-1",
        "operation": "POST /orders",
        "fingerprint": "sha256:" + "ab" * 32,
        "status": "processing",
        "token": token,
        "lease_until": now + 30.0,
        "expires_at": now + 86400.0,
        "created_at": now,
        "updated_at": now,
        "completed_at": None,
        "attempts": 1,
        "request_id": None,
        "final": False,
        "response_status": None,
        "response_headers": None,
        "response_media_type": None,
        "response_body": None,
        "request_payload": None,
        "metadata": "{}",
        "retention": "standard",
    }
    return (*(record[c] for c in COLUMNS), key_hash)


def complete_params(
    key_hash: str, token: str, body: bytes, now: float, before: str, after: str
) -> tuple[Any, ...]:
    headers = '[["content-type","application/json"]]'
    return (after, 200, headers, "application/json", body, now, now, True, key_hash, token, before)


def as_is(body: bytes) -> Any:
    return body


@dataclass
class Shapes:
    """One contender's table, keys and statements; checks what each operation returns."""

    table: str
    claim: str = ""
    complete: str = ""
    seq: Any = None
    done_row: tuple[Any, ...] = ()  # (key_hash, token) of the row the completions flip
    flips: int = 0
    replay_params: tuple[Any, ...] = ()
    wrap: Callable[[bytes], Any] = as_is  # how a body goes to the driver

    def __post_init__(self) -> None:
        self.claim, self.complete = claim_sql(self.table), complete_sql(self.table)
        self.seq = itertools.count()

    def next_claim(self) -> tuple[Any, ...]:
        return claim_params(f"{self.table}-{next(self.seq)}", time.time())

    def next_complete(self) -> tuple[Any, ...]:
        """Flip the prepared row between processing and completed: every UPDATE matches
        its row by key, token and status, and writes a 2 KiB body."""
        self.flips += 1
        before, after = ("processing", "completed")[:: 1 if self.flips % 2 else -1]
        key_hash, token = self.done_row
        body = self.wrap(COMPLETE_BODY)
        return complete_params(key_hash, token, body, time.time(), before, after)

    def check_claim(self, params: tuple[Any, ...], row: Any) -> None:
        if row is None or row[0] != params[-1] or row[6] != params[6]:
            raise BenchError(f"{self.table}: the claim did not return its new row: {row!r}")

    def check_replay(self, row: Any) -> None:
        if row is None or row[5] != "completed" or len(row[18]) != len(REPLAY_BODY):
            raise BenchError(f"{self.table}: the replay did not return the completed row")

    def check_update(self, rowcount: int) -> None:
        if rowcount != 1:
            raise BenchError(f"{self.table}: the completion matched {rowcount} rows")


# -- the drivers ------------------------------------------------------------------------------


@dataclass
class Target:
    host: str
    port: int
    user: str
    password: str
    database: str


def parse_url(url: str) -> Target:
    parts = urlsplit(url)
    if parts.scheme not in ("mysql", "mariadb") or not parts.hostname:
        raise SystemExit(f"--url: mysql://user[:password]@host:port/database, not {url!r}")
    return Target(
        parts.hostname,
        parts.port or 3306,
        unquote(parts.username or "root"),
        unquote(parts.password or ""),
        parts.path.lstrip("/") or "retrysafe",
    )


def module_of(driver: str) -> ModuleType:
    """The module a driver is imported as."""
    name = {"mysqlclient": "MySQLdb"}.get(driver, driver.removesuffix("-hex"))
    return importlib.import_module(name)


def connect_args(t: Target) -> dict[str, Any]:
    """Keywords every driver's ``connect`` takes (``db``: aiomysql knows no ``database``)."""
    return {
        "host": t.host,
        "port": t.port,
        "user": t.user,
        "password": t.password,
        "db": t.database,
        "autocommit": True,
        "client_flag": MULTI_STATEMENTS | FOUND_ROWS,
    }


def connect_sync(driver: str, t: Target) -> Any:
    args = connect_args(t)
    args["database"] = args.pop("db")  # mariadb knows no ``db``
    return module_of(driver).connect(**args)


def patch_aiomysql() -> str:
    """aiomysql 0.3.2 calls ``pymysql.converters.escape_bytes_prefixed``, which PyMySQL
    1.2.3+ turned into a string (aio-libs/aiomysql#1080, open): every ``bytes``
    parameter fails with "'str' object is not callable". Put PyMySQL's
    ``escape_bytes`` (the same ``_binary X'..'``) in its place, as the open fix
    (aio-libs/aiomysql#1081) does; say so in the report."""
    import aiomysql.connection
    from pymysql.converters import escape_bytes

    if callable(aiomysql.connection.escape_bytes_prefixed):
        return ""
    aiomysql.connection.escape_bytes_prefixed = escape_bytes
    return (
        "aiomysql: patched for bytes parameters (aio-libs/aiomysql#1080: unpatched, "
        "aiomysql 0.3.2 on PyMySQL >= 1.2.3 fails on any bytes parameter)"
    )


async def connect_async(driver: str, t: Target) -> Any:
    module, args = module_of(driver), connect_args(t)
    if driver == "asyncmy-hex":
        args["conv"] = {**module.converters.conversions, Blob: hex_literal}
    return await module.connect(**args)


class SyncOps:
    """The three shapes through one DB-API connection."""

    def __init__(self, conn: Any, shapes: Shapes) -> None:
        self.conn, self.shapes = conn, shapes
        self.cur = conn.cursor()

    def run(self, sql: str, params: Sequence[Any]) -> tuple[int, Any]:
        """Execute ``sql``; (first statement's rowcount, first row of the last result)."""
        cur = self.cur
        cur.execute(sql, params)
        rowcount, row = cur.rowcount, None
        while cur.nextset():
            row = cur.fetchone()
        return rowcount, row

    def claims(self, n: int) -> None:
        shapes, run = self.shapes, self.run
        for _ in range(n):
            params = shapes.next_claim()
            shapes.check_claim(params, run(shapes.claim, params)[1])

    def completes(self, n: int) -> None:
        shapes, run = self.shapes, self.run
        for _ in range(n):
            shapes.check_update(run(shapes.complete, shapes.next_complete())[0])

    def replays(self, n: int) -> None:
        shapes, run, params = self.shapes, self.run, self.shapes.replay_params
        for _ in range(n):
            shapes.check_replay(run(shapes.claim, params)[1])


class PreparedOps(SyncOps):
    """``mariadb``'s way: a statement with parameters goes by the binary protocol (a
    server-side prepared statement), which takes one statement at a time. The claim's
    two statements are two round trips, each on a cursor of its own, which keeps its
    statement prepared from one call to the next."""

    def __init__(self, conn: Any, shapes: Shapes) -> None:
        super().__init__(conn, shapes)
        self.cursors: dict[str, Any] = {}

    def run(self, sql: str, params: Sequence[Any]) -> tuple[int, Any]:
        rowcount, row, rest = -1, None, list(params or ())
        for i, part in enumerate(sql.split("; ")):
            args, rest = rest[: part.count("%s")], rest[part.count("%s") :]
            cur = self.cursors.setdefault(part, self.conn.cursor())
            cur.execute(part, tuple(args) or None)
            if i == 0:
                rowcount = cur.rowcount
            if cur.description:
                row = cur.fetchone()
        return rowcount, row


class AsyncOps:
    """The three shapes through one asyncio connection, on a loop of its own."""

    def __init__(self, conn: Any, shapes: Shapes, loop: asyncio.AbstractEventLoop) -> None:
        self.conn, self.shapes, self.loop = conn, shapes, loop
        self.cur = loop.run_until_complete(self._cursor())

    async def _cursor(self) -> Any:
        cursor = self.conn.cursor()  # asyncmy: a cursor; aiomysql: an awaitable of one
        return await cursor if inspect.isawaitable(cursor) else cursor

    async def run(self, sql: str, params: Sequence[Any]) -> tuple[int, Any]:
        cur = self.cur
        await cur.execute(sql, params)
        rowcount, row = cur.rowcount, None
        while await cur.nextset():
            row = await cur.fetchone()
        return rowcount, row

    def _loop(self, n: int, step: Callable[[], Awaitable[None]]) -> None:
        async def many() -> None:
            for _ in range(n):
                await step()

        self.loop.run_until_complete(many())

    def claims(self, n: int) -> None:
        shapes = self.shapes

        async def step() -> None:
            params = shapes.next_claim()
            shapes.check_claim(params, (await self.run(shapes.claim, params))[1])

        self._loop(n, step)

    def completes(self, n: int) -> None:
        shapes = self.shapes

        async def step() -> None:
            shapes.check_update((await self.run(shapes.complete, shapes.next_complete()))[0])

        self._loop(n, step)

    def replays(self, n: int) -> None:
        shapes = self.shapes

        async def step() -> None:
            shapes.check_replay((await self.run(shapes.claim, shapes.replay_params))[1])

        self._loop(n, step)


def prepare(ops: SyncOps | AsyncOps) -> None:
    """Create the table, the row the completions flip and the completed replay row."""
    shapes = ops.shapes
    steps: list[tuple[str, Sequence[Any]]] = [
        (f"DROP TABLE IF EXISTS `{shapes.table}`", ()),
        (create_table(shapes.table), ()),
    ]
    flip, replay = shapes.next_claim(), shapes.next_claim()
    shapes.done_row = (flip[-1], flip[6])
    steps += [(shapes.claim, flip), (shapes.claim, replay)]
    now = time.time()
    steps.append(
        (
            shapes.complete,
            complete_params(
                replay[-1], replay[6], shapes.wrap(REPLAY_BODY), now, "processing", "completed"
            ),
        )
    )
    shapes.replay_params = replay
    for sql, params in steps:
        if isinstance(ops, AsyncOps):
            ops.loop.run_until_complete(ops.run(sql, params or None))  # type: ignore[arg-type]
        else:
            ops.run(sql, params or None)  # type: ignore[arg-type]


def contenders(driver: str, target: Target, tag: str, stack: contextlib.ExitStack) -> list[Any]:
    shapes = Shapes(f"bench_{driver.replace('-', '_')}_{tag}")
    if driver == "asyncmy-hex":
        shapes.wrap = Blob
    ops: SyncOps | AsyncOps
    if driver in ASYNC:
        loop = asyncio.new_event_loop()
        conn = loop.run_until_complete(connect_async(driver, target))
        ops = AsyncOps(conn, shapes, loop)

        def close_async() -> None:
            conn.close()
            loop.close()

        stack.callback(close_async)
        kind = "async"
    else:
        conn = connect_sync(driver, target)
        ops = PreparedOps(conn, shapes) if driver == "mariadb" else SyncOps(conn, shapes)
        stack.callback(conn.close)
        kind = "sync"
    prepare(ops)
    stack.callback(drop_table, target, shapes.table)
    if driver != "mariadb":  # the binary protocol sends bytes as they are
        ESCAPES[driver] = escape_cost(conn, shapes.wrap)
    return [
        Contender(kind, driver, "claim", ops.claims),
        Contender(kind, driver, "complete", ops.completes),
        Contender(kind, driver, "replay", ops.replays),
    ]


#: Client time (ms) to turn a 1 MiB JSON body into the SQL literal each driver sends.
ESCAPES: dict[str, float] = {}


def escape_cost(conn: Any, wrap: Callable[[bytes], Any]) -> float:
    """Fewest milliseconds of ``conn.literal(body)`` for a 1 MiB JSON body, of 9."""
    body = wrap(json_body(1 << 20))
    times = []
    for _ in range(9):
        t0 = time.perf_counter()
        conn.literal(body)
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def drop_table(target: Target, table: str) -> None:
    with contextlib.suppress(Exception):
        conn = connect_sync("pymysql", target)
        with conn.cursor() as cur:
            cur.execute(f"DROP TABLE IF EXISTS `{table}`")
        conn.close()


# -- report -----------------------------------------------------------------------------------

#: (pure Python or compiled, what ``pip install`` needs on Linux, asyncio).
NATURE = {
    "pymysql": ("pure Python", "wheel (py3-none-any)", "no"),
    "mysqlclient": (
        "C extension (libmariadb / libmysqlclient)",
        "sdist only: gcc, pkg-config, libmariadb-dev (or default-libmysqlclient-dev), python3-dev",
        "no",
    ),
    "mariadb": (
        "C extension (MariaDB Connector/C >= 3.3.1)",
        "sdist only (1.1.x): gcc, libmariadb-dev (mariadb_config); 2.0 (pure Python, "
        "asyncio) is a release candidate",
        "no (1.1.x)",
    ),
    "asyncmy": ("Cython-compiled", "manylinux wheels (x86_64, aarch64)", "yes"),
    "aiomysql": ("pure Python (on PyMySQL)", "wheel (py3-none-any)", "yes"),
    "asyncmy-hex": ("asyncmy, bodies sent as hex literals", "as asyncmy", "yes"),
}


def released(distribution: str) -> str:
    """Latest version and month from the package list of this workplace, if there."""
    listing = Path("/work/.library/env/packages/pypi.tsv")
    with contextlib.suppress(OSError), listing.open() as f:
        for line in f:
            cols = line.split("\t")
            if cols[0].lower() == distribution.lower():
                return f"{cols[1]} ({cols[2]})"
    return "?"


def render(command: str, info: dict[str, str], cs: Sequence[Any]) -> str:
    out = [f"`{command}`", ""]
    out += [f"- {k}: {v}" for k, v in info.items()]
    out += [
        "",
        "| kind | driver | workload | ops/s (median) | rounds min-max | µs/op "
        "| client CPU µs/op | vs fastest |",
        "|---|---|---|--:|--:|--:|--:|--:|",
    ]
    for c in cs:
        peers = [p for p in cs if p.section == c.section and p.workload == c.workload]
        best = max(p.median for p in peers)
        out.append(
            f"| {c.section} | {c.name} | {c.workload} | {c.median:,.0f} "
            f"| {min(c.samples):,.0f}-{max(c.samples):,.0f} | {1e6 / c.median:,.0f} "
            f"| {c.cpu:,.0f} | {best / c.median:.2f}x |"
        )
    out += [
        "",
        "vs fastest: time per operation against the fastest driver of the same kind on",
        "the same workload (1.00x: the fastest; 1.50x takes half as long again).",
        "",
        "| driver | version (installed) | built | pip install on Linux | asyncio "
        "| latest release |",
        "|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(c.name for c in cs):
        dist = DISTRIBUTIONS[name]
        built, install, aio = NATURE[name]
        out.append(
            f"| {name} | {bs.importlib.metadata.version(dist)} | {built} | {install} | {aio} "
            f"| {released(dist)} |"
        )
    out += [
        "",
        "Client time to escape a 1 MiB JSON body into the statement (``conn.literal``, "
        "fastest of 9; mariadb sends parameters by the binary protocol, unescaped):",
        "",
        "| driver | ms per MiB |",
        "|---|--:|",
    ]
    out += [f"| {name} | {ms:.1f} |" for name, ms in ESCAPES.items()]
    return "\n".join(out)


def start_server(stack: contextlib.ExitStack) -> str:
    tests = str(HERE.parent / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    server = importlib.import_module("_servers").MySQLServer()
    t0 = time.monotonic()
    stack.enter_context(server)
    print(f"started MariaDB at {server.url} in {time.monotonic() - t0:.1f}s", flush=True)
    return str(server.url)


def server_version(target: Target) -> str:
    conn = connect_sync("pymysql", target)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT VERSION(), @@innodb_flush_log_at_trx_commit")
            row = cur.fetchone()
    finally:
        conn.close()
    return f"{row[0]} (innodb_flush_log_at_trx_commit={row[1]})"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds per contender")
    p.add_argument("--seconds", type=float, default=1.0, help="length of one measurement")
    p.add_argument("--warmup", type=float, default=0.3, help="warm-up seconds per contender")
    p.add_argument("--drivers", default=",".join(DRIVERS), help="comma-separated subset")
    p.add_argument("--url", help="use this MySQL/MariaDB instead of starting one")
    args = p.parse_args(argv)
    chosen = [d.strip() for d in args.drivers.split(",") if d.strip()]
    if set(chosen) - set(DRIVERS) or args.rounds < 1 or args.seconds <= 0:
        p.error(f"--drivers from {', '.join(DRIVERS)}; --rounds >= 1, --seconds > 0")
    missing = []
    for driver in chosen:
        try:
            module_of(driver)
        except ImportError as exc:
            missing.append(driver)
            print(f"skipping {driver}: {exc}", flush=True)
    chosen = [d for d in chosen if d not in missing]
    script = os.path.relpath(sys.argv[0]) if sys.argv[0] else "bench/mysql_drivers.py"
    command = shlex.join(["python", script, *(sys.argv[1:] if argv is None else argv)])
    info = bs.machine_info()
    results: list[Any] = []
    with contextlib.ExitStack() as stack:
        target = parse_url(args.url or start_server(stack))
        info["server"] = server_version(target)
        if "aiomysql" in chosen and (note := patch_aiomysql()):
            info["note"] = note
        tag = secrets.token_hex(4)
        for kind, names in (("sync", SYNC), ("async", ASYNC)):
            group = [d for d in names if d in chosen]
            if not group:
                continue
            cs = [c for d in group for c in contenders(d, target, tag, stack)]
            print(f"\n[{kind}] {len(cs)} contenders, {args.rounds} rounds", flush=True)
            for workload in ("claim", "complete", "replay"):
                bs.run_rounds(
                    [c for c in cs if c.workload == workload],
                    args.rounds,
                    args.seconds,
                    args.warmup,
                )
            results += cs
        info["load average at end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print()
    print(render(command, {"run": started, **info}, results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
