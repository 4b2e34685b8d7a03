"""Bytes per record and records per GB of each store, through the public API.

For every store, N records are written two ways, each into a store of its own:

* **engine**: ``engine.begin(new_key, operation=..., fingerprint=...)`` and
  ``engine.complete(claim, Outcome.json(order))``, a 60-byte JSON answer;
* **http**: a keyed ``POST`` through ``retrysafe.asgi.IdempotencyMiddleware`` (with
  credentials, so the record is scoped) to an app answering the same 60 bytes
  with its ``content-type`` and ``content-length`` headers.

Then it reads what the store holds: memory, ``MemoryStore.bytes`` (its
:func:`~retrysafe.stores.memory.record_bytes` estimate); SQLite, the records
table and its indexes by ``dbstat`` (pages, and the payload in them) and the
file after a checkpoint; PostgreSQL, ``pg_total_relation_size`` of the table (its
indexes and TOAST included), as written and after ``VACUUM``; Redis,
``MEMORY USAGE`` of each key and ``used_memory`` before and after. Whatever
encoding a store has, this measures it. Not a test (pytest does not run it).

    python bench/sizes.py [-n N] [--stores memory,sqlite,postgres,redis]
                          [--redis-url URL] [--postgres-url URL] [--anatomy]
                          [--redis-compact-keys] [--in-flight K]

``--anatomy`` also prints where a PostgreSQL record's bytes go: the heap's live and
dead tuples and free space (pgstattuple, when the server has it), each index, and
each column's average size.

Redis records go under a prefix as long as the default ``retrysafe:`` (10
characters), so the key's allocation is the default's; ``--redis-compact-keys``
opens the Redis store with ``compact_keys=1`` (32-byte key hashes in the keys).

``--in-flight K``: the engine's first calls claim K keys before completing them (a
completion grows the row a claim wrote, which may split a full page).

Without URLs it starts its own redis-server and PostgreSQL (tests/_servers.py).
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
import functools
import importlib
import importlib.util
import secrets
import sqlite3
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

from retrysafe import Claim, Engine, Outcome, open_store
from retrysafe.asgi import IdempotencyMiddleware
from retrysafe.stores.memory import MemoryStore

ROOT = Path(__file__).resolve().parents[1]
STORES = ("memory", "sqlite", "postgres", "redis")
GB = 1_000_000_000

#: One small order: its answer is 60 bytes of compact JSON.
ORDER: dict[str, Any] = {"id": "ord_8f3a2", "status": "paid", "amount": 1999, "cur": "eur"}
ANSWER = Outcome.json(ORDER).body
assert len(ANSWER) == 60, len(ANSWER)
OPERATION = "orders.create"
FINGERPRINT = "3b" * 32
HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"60")]


def write_engine(store: Any, n: int, in_flight: int = 1) -> None:
    """``n`` first calls through an :class:`Engine` on ``store`` (a URL or a store),
    ``in_flight`` claims at a time before their completions."""
    engine = Engine(open_store(store) if isinstance(store, str) else store)
    outcome = Outcome.json(ORDER)
    try:
        for start in range(0, n, in_flight):
            claims = [
                engine.begin(str(uuid.uuid4()), operation=OPERATION, fingerprint=FINGERPRINT)
                for _ in range(min(in_flight, n - start))
            ]
            for claim in claims:
                assert type(claim) is Claim, claim
                engine.complete(claim, outcome)
    finally:
        if isinstance(store, str):
            engine.close()


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 201, "headers": HEADERS})
    await send({"type": "http.response.body", "body": ANSWER})


def _peers() -> Any:
    """bench/peers.py, for its in-process ``post`` through an ASGI app."""
    spec = importlib.util.spec_from_file_location("rsbench_peers", _HERE / "peers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def write_http(store: Any, n: int) -> None:
    """``n`` keyed first calls, with credentials, through the ASGI middleware on ``store``
    (bench/peers.py's request: a ``POST`` with a bearer token and a JSON body)."""
    post = _peers().post
    middleware = IdempotencyMiddleware(_app, store=store)

    async def run() -> None:
        for _ in range(n):
            status, _, body = await post(middleware, str(uuid.uuid4()))
            assert (status, body) == (201, ANSWER), (status, body)
        if isinstance(store, str):
            await middleware.policy.engine.aclose()

    asyncio.run(run())


Write = Callable[[Any, int], None]
Measure = dict[str, float]


def measure_memory(write: Write, n: int) -> Measure:
    # One store object: every memory:// URL would make a new one.
    store = MemoryStore(max_size=n + 1, max_bytes=2**40)
    write(store, n)
    return {"record_bytes": store.bytes / n}


def measure_sqlite(write: Write, n: int) -> Measure:
    with tempfile.TemporaryDirectory(prefix="rssizes-") as directory:
        path = Path(directory) / "store.db"
        write(f"sqlite:///{path}", n)
        conn = sqlite3.connect(path)
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            rows = conn.execute(
                "SELECT sum(pgsize), sum(payload) FROM dbstat "
                "WHERE name = 'retrysafe_records' OR name IN (SELECT name FROM sqlite_master "
                "WHERE type = 'index' AND tbl_name = 'retrysafe_records')"
            ).fetchone()
            count = conn.execute("SELECT count(*) FROM retrysafe_records").fetchone()[0]
        finally:
            conn.close()
        assert count == n, (count, n)
        return {
            "pages": rows[0] / n,
            "payload": rows[1] / n,
            "file": path.stat().st_size / n,
        }


#: ``--anatomy``: where a PostgreSQL record's bytes go, one block per way, printed last.
ANATOMY: list[str] = []


def _pg_anatomy(conn: Any, table: str, n: int, label: str) -> None:
    """Per record, as written: the heap split by pgstattuple (live tuples, dead
    tuples, free space), each index, TOAST, HOT updates, and each column's average
    ``pg_column_size`` (the live row; its header and padding are the rest)."""
    import psycopg

    def one(query: str, *params: Any) -> Any:
        row = conn.execute(query, params).fetchone()
        assert row is not None
        return row[0] if len(row) == 1 else row

    lines = [f"{label}, N = {n}: bytes per record"]
    try:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
        stat = one(
            "SELECT table_len, tuple_len, dead_tuple_count, dead_tuple_len, free_space "
            "FROM pgstattuple(%s::regclass)",
            table,
        )
        lines.append(
            f"  heap {stat[0] / n:,.0f}: live tuples {stat[1] / n:,.0f}, dead tuples "
            f"{stat[3] / n:,.0f} ({stat[2]} of them), free {stat[4] / n:,.0f}, "
            f"line pointers and page headers the rest"
        )
    except psycopg.Error as exc:  # the extension is optional
        lines.append(f"  heap {one('SELECT pg_relation_size(%s)', table) / n:,.0f} ({exc})")
    for (index,) in conn.execute(
        "SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = %s::regclass",
        (table,),
    ).fetchall():
        lines.append(f"  index {index}: {one('SELECT pg_relation_size(%s)', index) / n:,.0f}")
    toast = one(
        "SELECT coalesce(pg_total_relation_size(nullif(reltoastrelid, 0)), 0) "
        "FROM pg_class WHERE oid = %s::regclass",
        table,
    )
    hot = one(
        "SELECT n_tup_hot_upd, n_tup_upd FROM pg_stat_user_tables WHERE relid = %s::regclass", table
    )
    lines.append(f"  TOAST {toast / n:,.0f}; HOT updates {hot[0]} of {hot[1]}")
    columns = [
        r[0]
        for r in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
            "AND NOT attisdropped ORDER BY attnum",
            (table,),
        ).fetchall()
    ]
    sizes = one(
        "SELECT avg(pg_column_size(t.*)), "
        + ", ".join(f'coalesce(avg(pg_column_size(t."{c}")), 0)' for c in columns)
        + f" FROM {table} AS t"
    )
    lines.append(f"  live row {sizes[0]:,.1f} (tuple header, null bitmap, padding included):")
    lines.append(
        "    " + ", ".join(f"{c} {v:.1f}" for c, v in zip(columns, sizes[1:], strict=True))
    )
    ANATOMY.append("\n".join(lines))


def _way(write: Write) -> str:
    """The way a writer writes (``engine``, ``http``), through a ``partial`` too."""
    return str(getattr(write, "func", write).__name__).removeprefix("write_")


def measure_postgres(url: str, anatomy: bool = False) -> Callable[[Write, int], Measure]:
    import psycopg

    def measure(write: Write, n: int) -> Measure:
        table = f"rssizes_{secrets.token_hex(4)}"
        sep = "&" if "?" in url else "?"
        write(f"{url}{sep}table={table}", n)
        size = "SELECT pg_total_relation_size(%s)"
        with psycopg.connect(url, autocommit=True) as conn:
            count = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
            assert count is not None and count[0] == n, (count, n)
            if anatomy:
                _pg_anatomy(conn, table, n, f"postgres {_way(write)}")
            written = conn.execute(size, (table,)).fetchone()
            conn.execute(f"VACUUM {table}")
            vacuumed = conn.execute(size, (table,)).fetchone()
            heap = conn.execute("SELECT pg_relation_size(%s)", (table,)).fetchone()
            conn.execute(
                f"DROP TABLE IF EXISTS {table}, {table}_archive, {table}_schema, {table}_state"
            )
        assert written is not None and vacuumed is not None and heap is not None
        return {"total": written[0] / n, "vacuumed": vacuumed[0] / n, "heap": heap[0] / n}

    return measure


def measure_redis(url: str, compact_keys: bool = False) -> Callable[[Write, int], Measure]:
    import redis

    def measure(write: Write, n: int) -> Measure:
        prefix = f"rsz{secrets.token_hex(3)}:"  # as long as "retrysafe:"
        client = redis.Redis.from_url(url)
        try:
            before = int(client.info("memory")["used_memory"])
            sep = "&" if "?" in url else "?"
            compact = "&compact_keys=1" if compact_keys else ""
            write(f"{url}{sep}prefix={prefix}{compact}", n)
            after = int(client.info("memory")["used_memory"])
            keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
            # The middleware keeps its scope secret under the prefix too: records only.
            if len(keys) > n:
                keys = [k for k in keys if b"{" in k]
            assert len(keys) == n, (len(keys), n)
            usage = sum(int(client.memory_usage(k, samples=0) or 0) for k in keys)
            names = sum(len(k) for k in keys)
            values = sum(int(client.strlen(k)) for k in keys if client.type(k) == b"string")
            client.unlink(*keys)
        finally:
            client.close()
        return {
            "memory_usage": usage / n,
            "used_memory": (after - before) / n,
            "key": names / n,
            "value": values / n,
        }

    return measure


def _start(kind: str, stack: contextlib.ExitStack) -> str:
    """A throwaway server of ``kind`` (tests/_servers.py), stopped with ``stack``."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    servers = importlib.import_module("_servers")
    server = servers.PostgresServer() if kind == "postgres" else servers.RedisServer()
    return str(stack.enter_context(server).url)


#: Per store: the figure that counts as its cost per record, and how it is read.
COST = {
    "memory": ("record_bytes", "MemoryStore.bytes / N (record_bytes, an estimate)"),
    "sqlite": ("pages", "dbstat pages of the table and its indexes / N"),
    "postgres": ("total", "pg_total_relation_size (table, indexes, TOAST) / N, as written"),
    "redis": ("memory_usage", "MEMORY USAGE of each key, averaged"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=2000, help="records per store and way")
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--redis-url")
    parser.add_argument("--postgres-url")
    parser.add_argument(
        "--anatomy",
        action="store_true",
        help="PostgreSQL: where a record's bytes go (pgstattuple, indexes, columns)",
    )
    parser.add_argument("--redis-compact-keys", action="store_true")
    parser.add_argument(
        "--in-flight", type=int, default=1, help="engine claims made before their completions"
    )
    args = parser.parse_args(argv)
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    unknown = set(stores) - set(STORES)
    if unknown:
        parser.error(f"unknown stores: {', '.join(sorted(unknown))}")

    rows: list[tuple[str, str, Measure]] = []
    with contextlib.ExitStack() as stack:
        measures: dict[str, Callable[[Write, int], Measure]] = {
            "memory": measure_memory,
            "sqlite": measure_sqlite,
        }
        for kind, given in (("postgres", args.postgres_url), ("redis", args.redis_url)):
            if kind in stores:
                url = given or _start(kind, stack)
                if kind == "postgres":
                    measures[kind] = measure_postgres(url, args.anatomy)
                else:
                    measures[kind] = measure_redis(url, args.redis_compact_keys)
        for store in stores:
            engine = functools.partial(write_engine, in_flight=max(1, args.in_flight))
            for way, write in (("engine", engine), ("http", write_http)):
                figures = measures[store](write, args.n)
                rows.append((store, way, figures))
                print(f"{store} {way}: done", file=sys.stderr, flush=True)

    print(f"One small order (a 60-byte JSON answer), N = {args.n} records per row", end="")
    print(f", {args.in_flight} engine claims in flight.\n" if args.in_flight > 1 else ".\n")
    print("| store | written by | bytes per record | records per GB | how | other figures |")
    print("|---|---|--:|--:|---|---|")
    for store, way, figures in rows:
        name, how = COST[store]
        cost = figures[name]
        others = ", ".join(f"{k} {v:,.0f}" for k, v in figures.items() if k != name)
        print(f"| {store} | {way} | {cost:,.0f} | {GB / cost:,.0f} | {how} | {others or '-'} |")
    for block in ANATOMY:
        print(f"\n{block}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
