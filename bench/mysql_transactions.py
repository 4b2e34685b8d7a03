"""What a transactional completion costs on MySQL/MariaDB: one order per key, written
through the engine, against one real MariaDB.

Each round creates ``--orders`` orders (a new key each) in three ways, interleaved:

* **plain**: claim, ``INSERT`` of the order in autocommit, completion: three round trips
  and two commits, not atomic;
* **store**: claim, then ``att.transaction()`` on the store's pooled connection:
  ``BEGIN``, ``INSERT``, the completion's ``UPDATE``, and ``COMMIT`` with the session
  restore in its round trip;
* **app**: the same on the application's own PyMySQL connection (one more round trip:
  the server is asked that the connection is idle).

Figures are the median per order over the rounds. This is a benchmark, not a test.

    python bench/mysql_transactions.py [--rounds R] [--orders N]
                                       [--url mysql://user@host:port/database]

Without ``--url`` it starts its own MariaDB (tests/_servers.py) and stops it at the end.
"""

# ruff: noqa: E402  (the imports follow the sys.path guard below)
from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
for extra in (ROOT / "src", ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import pymysql

from retrysafe import Engine, Outcome, open_store


def connect(url: str) -> Any:
    parts = urlsplit(url)
    return pymysql.connect(
        host=parts.hostname,
        port=parts.port or 3306,
        user=parts.username or "",
        password=parts.password or "",
        database=parts.path.lstrip("/"),
        autocommit=True,
    )


def run(url: str, rounds: int, orders: int) -> dict[str, float]:
    tag = uuid.uuid4().hex[:8]
    store = open_store(url, table=f"bench_tx_{tag}")
    engine = Engine(store)
    table = f"bench_orders_{tag}"
    app = connect(url)
    with app.cursor() as cur:
        cur.execute(
            f"CREATE TABLE {table} (cart_mandate_id VARCHAR(64) PRIMARY KEY, "
            "amount INT NOT NULL) ENGINE=InnoDB"
        )
    insert = f"INSERT INTO {table} VALUES (%s, %s)"

    def plain(key: str) -> None:
        with engine.attempt(key, operation="order") as att, app.cursor() as cur:
            cur.execute(insert, (key, 1))
            att.outcome = Outcome.json(1)

    def in_transaction(connection: Any) -> Any:
        def order(key: str) -> None:
            with (
                engine.attempt(key, operation="order") as att,
                att.transaction(connection) as conn,
                conn.cursor() as cur,
            ):
                cur.execute(insert, (key, 1))
                att.outcome = Outcome.json(1)

        return order

    ways = {"plain": plain, "store": in_transaction(None), "app": in_transaction(app)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for n in range(rounds + 1):  # the first round warms up
        order = list(ways) if n % 2 else list(reversed(ways))
        for name in order:
            started = time.perf_counter()
            for _ in range(orders):
                ways[name](uuid.uuid4().hex)
            if n:
                times[name].append((time.perf_counter() - started) / orders)
    with app.cursor() as cur:
        cur.execute(f"DROP TABLE {table}")
    app.close()
    store.close()
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--orders", type=int, default=300)
    parser.add_argument("--url")
    args = parser.parse_args()
    if args.url:
        result = run(args.url, args.rounds, args.orders)
    else:
        from _servers import MySQLServer

        with MySQLServer() as server:
            result = run(server.url, args.rounds, args.orders)
    for name, seconds in result.items():
        print(f"{name:6} {seconds * 1e6:8.0f} µs per order")


if __name__ == "__main__":
    main()
