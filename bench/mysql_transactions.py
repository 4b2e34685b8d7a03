"""What a transactional completion costs on MySQL/MariaDB: one order per key, written
through the engine, against one real MariaDB.

Each round creates ``--orders`` orders (a new key each) in four ways, interleaved:

* **raw**: no idempotency, the floor: ``BEGIN``, ``INSERT`` of the order, ``COMMIT``
  (three round trips) on one PyMySQL connection with the store's connection settings;
* **plain**: claim, ``INSERT`` of the order in autocommit, completion: three round trips
  and two commits, not atomic;
* **store**: claim, then ``att.transaction()`` on the store's pooled connection:
  ``BEGIN``, ``INSERT``, the completion's ``UPDATE``, and ``COMMIT`` with the session
  restore in its round trip;
* **app**: the same on the application's own PyMySQL connection (one more round trip:
  the server is asked that the connection is idle).

Figures are the median per order over the rounds (wall clock, and this process's CPU
time, which other load on the machine barely moves), and each way's ratio to raw. After
the rounds the run checks what it timed: the orders table holds one row per order
written, and a sample of each engine way's keys has a completed record. This is a
benchmark, not a test.

    python bench/mysql_transactions.py [--rounds R] [--orders N]
                                       [--url mysql://user@host:port/database]

Without ``--url`` it starts its own MariaDB (tests/_servers.py) and stops it at the end;
with one, it drops the tables it made (the orders table and the store's).
"""

# ruff: noqa: E402  (the imports follow the sys.path guard below)
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
for extra in (ROOT / "src", ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import pymysql

from retrysafe import Engine, Outcome, Status, key_hash, open_store

OPERATION = "order"
#: Keys of each engine way whose record is read back after the rounds.
SAMPLE = 50
#: The store's tables besides its main one (``table``, see the MySQL store's schema).
STORE_SUFFIXES = ("", "_archive", "_state", "_schema")


def connect(url: str) -> Any:
    """The application's own connection: the URL's server, autocommit."""
    parts = urlsplit(url)
    return pymysql.connect(
        host=parts.hostname,
        port=parts.port or 3306,
        user=parts.username or "",
        password=parts.password or "",
        database=parts.path.lstrip("/"),
        autocommit=True,
    )


def ways(engine: Engine, app: Any, raw: Any, insert: str) -> dict[str, Callable[[str], None]]:
    """Each way of writing one order for a key, by name."""
    floor = raw.cursor()

    def raw_order(key: str) -> None:
        floor.execute("BEGIN")
        floor.execute(insert, (key, 1))
        floor.execute("COMMIT")

    def plain(key: str) -> None:
        with engine.attempt(key, operation=OPERATION) as att, app.cursor() as cur:
            cur.execute(insert, (key, 1))
            att.outcome = Outcome.json(1)

    def in_transaction(connection: Any) -> Callable[[str], None]:
        def order(key: str) -> None:
            with (
                engine.attempt(key, operation=OPERATION) as att,
                att.transaction(connection) as conn,
                conn.cursor() as cur,
            ):
                cur.execute(insert, (key, 1))
                att.outcome = Outcome.json(1)

        return order

    return {
        "raw": raw_order,
        "plain": plain,
        "store": in_transaction(None),
        "app": in_transaction(app),
    }


def check(store: Any, app: Any, table: str, keys: dict[str, list[str]]) -> str:
    """Fail unless every order timed was written and a sample of each engine way's keys
    has a completed record; say what was checked."""
    written = sum(map(len, keys.values()))
    with app.cursor() as cur:
        cur.execute(f"SELECT COUNT(*) FROM {table}")
        rows = cur.fetchone()[0]
    if rows != written:
        raise SystemExit(f"{table} holds {rows} orders, {written} were written")
    sampled = 0
    for name, written_keys in keys.items():
        if name == "raw":
            continue
        for key in random.sample(written_keys, min(SAMPLE, len(written_keys))):
            record = store.get(key_hash("", OPERATION, key))
            if record is None or record.status is not Status.COMPLETED:
                status = None if record is None else record.status.value
                raise SystemExit(f"{name}: the record of {key} is {status}, not completed")
            sampled += 1
    return f"checked: {rows} order rows, {sampled} sampled records completed"


def run(url: str, rounds: int, orders: int) -> tuple[dict[str, tuple[float, float]], str]:
    """Per way, the median wall-clock and client CPU seconds per order; what was checked."""
    tag = uuid.uuid4().hex[:8]
    base = f"bench_tx_{tag}"
    table = f"bench_orders_{tag}"
    store = open_store(url, table=base)
    engine = Engine(store)
    app = connect(url)
    raw = pymysql.connect(**store._driver_kwargs())  # type: ignore[attr-defined]
    try:
        with app.cursor() as cur:
            cur.execute(
                f"CREATE TABLE {table} (cart_mandate_id VARCHAR(64) PRIMARY KEY, "
                "amount INT NOT NULL) ENGINE=InnoDB"
            )
        contenders = ways(engine, app, raw, f"INSERT INTO {table} VALUES (%s, %s)")
        times: dict[str, list[float]] = {name: [] for name in contenders}
        cpu: dict[str, list[float]] = {name: [] for name in contenders}
        keys: dict[str, list[str]] = {name: [] for name in contenders}
        for n in range(rounds + 1):  # the first round warms up
            order = list(contenders) if n % 2 else list(reversed(contenders))
            for name in order:
                batch = [uuid.uuid4().hex for _ in range(orders)]
                write = contenders[name]
                started, cpu_started = time.perf_counter(), time.process_time()
                for key in batch:
                    write(key)
                if n:
                    times[name].append((time.perf_counter() - started) / orders)
                    cpu[name].append((time.process_time() - cpu_started) / orders)
                keys[name] += batch
        checked = check(store, app, table, keys)
    finally:
        raw.close()
        store.close()
        with app.cursor() as cur:
            for name in [table, *(f"{base}{suffix}" for suffix in STORE_SUFFIXES)]:
                cur.execute(f"DROP TABLE IF EXISTS {name}")
        app.close()
    medians = {
        name: (statistics.median(times[name]), statistics.median(cpu[name])) for name in times
    }
    return medians, checked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--orders", type=int, default=300)
    parser.add_argument("--url")
    args = parser.parse_args()
    if args.url:
        result, checked = run(args.url, args.rounds, args.orders)
    else:
        from _servers import MySQLServer

        with MySQLServer() as server:
            result, checked = run(server.url, args.rounds, args.orders)
    floor, floor_cpu = result["raw"]
    print("way     µs per order  x raw   client CPU µs per order  x raw")
    for name, (seconds, cpu) in result.items():
        print(
            f"{name:6} {seconds * 1e6:13.0f} {seconds / floor:6.2f}x "
            f"{cpu * 1e6:24.0f} {cpu / floor_cpu:6.2f}x"
        )
    print(checked)


if __name__ == "__main__":
    main()
