"""What completing inside the SQLAlchemy transaction costs.

In one run, from one thread, on a SQLite file and on a real PostgreSQL (started
here unless ``--postgres-url`` is given: the tests' throwaway cluster, which runs
with ``fsync=off`` and ``synchronous_commit=off``), the same order creation five ways:

* **floor**: the ORM insert + ``session.commit()``, no idempotency at all;
* **SQLAlchemy store**: ``SQLAlchemyStore(engine)``, the claim on a connection
  borrowed from the engine's pool, then the ORM insert and the completion in the
  Session's transaction (``att.transaction(session)``), one commit;
* the same with a SQLAlchemy ``Connection`` and the plain INSERT
  (``att.transaction(connection)``, ``exec_driver_sql``): the store's share without
  the ORM's;
* **native store**: the native store on the same database, ``att.transaction()``
  with the same INSERT through the DB-API connection (no ORM);
* **replays** of a completed key through both stores.

Contenders run interleaved in rounds (the order flips every round) after a
warm-up; every figure is the median over the rounds (bench/stores.py). The SQLite
file is in WAL mode with ``synchronous=FULL`` for every connection (the native
store's default, and SQLite's). This is a benchmark, not a test.

    python bench/orm.py [--rounds R] [--seconds S] [--databases sqlite,postgres]
                        [--postgres-url URL]
"""

# ruff: noqa: E402  (the imports follow the sys.path guard below)
from __future__ import annotations

import sys
from pathlib import Path

# Keep this folder off sys.path: bench/http.py would shadow the standard library's http.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import argparse
import contextlib
import importlib.util
import itertools
import os
import secrets
import shlex
import sqlite3
import tempfile
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import sqlalchemy
from sqlalchemy import Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from retrysafe import Engine, Outcome, Replay, open_store
from retrysafe.sqlalchemy import SQLAlchemyStore

DATABASES = ("sqlite", "postgres")


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
ORDER = {"cart_mandate_id": "cm", "user_id": "u", "amount": 2999}
OUTCOME = Outcome.json(ORDER)


def order_model(table: str) -> Any:
    class Base(DeclarativeBase):
        pass

    class Order(Base):
        __tablename__ = table
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
        cart_mandate_id: Mapped[str] = mapped_column(String(64), unique=True)
        user_id: Mapped[str] = mapped_column(String(64))
        amount: Mapped[int] = mapped_column(Integer)

    return Order


def contenders(
    section: str, db: sqlalchemy.Engine, native: Engine, insert: str, orders: str
) -> list[Any]:
    """The ways on one database; the SQLAlchemy store shares the native one's table."""
    Order = order_model(orders)
    Order.metadata.create_all(db)
    table = getattr(native.store, "table", None)
    sa = Engine(SQLAlchemyStore(db, **({} if table is None else {"table": table})))
    tag, seq = secrets.token_hex(4), itertools.count()
    replays: dict[str, str] = {}

    def floor(n: int) -> None:
        for _ in range(n):
            with Session(db) as session:
                session.add(Order(cart_mandate_id=f"{tag}-{next(seq)}", user_id="u", amount=1))
                session.commit()

    def with_sqlalchemy(n: int) -> None:
        for _ in range(n):
            key = f"{tag}-{next(seq)}"
            with sa.attempt(key, operation="order") as att:
                if att.replay is not None:
                    raise BenchError(f"{section}: a new key replayed")
                with Session(db) as session, att.transaction(session):
                    session.add(Order(cart_mandate_id=key, user_id="u", amount=1))
                    att.outcome = OUTCOME

    def with_connection(n: int) -> None:
        for _ in range(n):
            key = f"{tag}-{next(seq)}"
            with sa.attempt(key, operation="order") as att:
                if att.replay is not None:
                    raise BenchError(f"{section}: a new key replayed")
                with db.connect() as conn, att.transaction(conn):
                    conn.exec_driver_sql(insert, (key, "u", 1))
                    att.outcome = OUTCOME

    def with_native(n: int) -> None:
        for _ in range(n):
            key = f"{tag}-{next(seq)}"
            with native.attempt(key, operation="order") as att:
                if att.replay is not None:
                    raise BenchError(f"{section}: a new key replayed")
                with att.transaction() as conn:
                    conn.execute(insert, (key, "u", 1))
                    att.outcome = OUTCOME

    def replay_of(engine: Engine, name: str) -> tuple[Any, Any]:
        def prepare() -> None:
            replays[name] = key = f"{tag}-replay-{name}-{next(seq)}"
            engine.complete(engine.begin(key, operation="order"), OUTCOME)  # type: ignore[arg-type]

        def run(n: int) -> None:
            begin, key = engine.begin, replays[name]
            for _ in range(n):
                answer = begin(key, operation="order")
            if type(answer) is not Replay:
                raise BenchError(f"{section}: a completed key did not replay")

        return run, prepare

    sa_replay, sa_prepare = replay_of(sa, "sa")
    native_replay, native_prepare = replay_of(native, "native")
    return [
        Contender(section, "floor: ORM insert + commit", "order", floor),
        Contender(section, "SQLAlchemy store, transaction(session)", "order", with_sqlalchemy),
        Contender(section, "SQLAlchemy store, transaction(connection)", "order", with_connection),
        Contender(section, "native store, transaction()", "order", with_native),
        Contender(section, "SQLAlchemy store", "replay", sa_replay, sa_prepare),
        Contender(section, "native store", "replay", native_replay, native_prepare),
    ]


def sqlite_contenders(directory: Path, stack: contextlib.ExitStack) -> list[Any]:
    path = directory / "shop.db"
    native = Engine(f"sqlite:///{path}")  # WAL, synchronous=FULL (the store's default)
    stack.callback(native.close)
    native.complete(native.begin("warm", operation="order"), OUTCOME)  # type: ignore[arg-type]
    db = sqlalchemy.create_engine(f"sqlite:///{path}")  # the file is WAL now; FULL is SQLite's
    stack.callback(db.dispose)
    insert = "INSERT INTO orders (cart_mandate_id, user_id, amount) VALUES (?, ?, ?)"
    return contenders("sqlite file", db, native, insert, "orders")


def postgres_contenders(url: str, stack: contextlib.ExitStack) -> list[Any]:
    table = f"rsorm_{secrets.token_hex(4)}"
    native = Engine(open_store(url, table=table))
    stack.callback(native.close)
    native.complete(native.begin("warm", operation="order"), OUTCOME)  # type: ignore[arg-type]
    db = sqlalchemy.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    stack.callback(db.dispose)
    insert = f"INSERT INTO {table}_orders (cart_mandate_id, user_id, amount) VALUES (%s, %s, %s)"
    return contenders("postgres", db, native, insert, f"{table}_orders")


def render(command: str, info: dict[str, str], sections: dict[str, list[Any]]) -> str:
    out = [f"`{command}`", ""]
    out += [f"- {k}: {v}" for k, v in info.items()]
    for section, cs in sections.items():
        by = {(c.name, c.workload): c for c in cs}
        floor = by[("floor: ORM insert + commit", "order")].median
        native = by[("native store, transaction()", "order")].median
        out += ["", f"### {section}", ""]
        out += [
            "| contender | workload | ops/s (median) | µs/op | client CPU µs/op "
            "| vs floor | vs native |"
        ]
        out += ["|---|---|---:|---:|---:|---:|---:|"]
        for c in cs:
            ratio_floor = f"{floor / c.median:.2f}x" if c.workload == "order" else "—"
            if c.workload == "order":
                ratio_native = f"{native / c.median:.2f}x"
            else:
                other = by[("native store", "replay")].median
                ratio_native = f"{other / c.median:.2f}x"
            out.append(
                f"| {c.name} | {c.workload} | {c.median:,.0f} | {1e6 / c.median:,.0f} "
                f"| {c.cpu:,.0f} | {ratio_floor} | {ratio_native} |"
            )
    out += [
        "",
        "Ratios are time per operation against the floor (the ORM insert + commit alone) and",
        "against the native store (its `att.transaction()`, or its replay): 1.50x takes half",
        "as long again.",
    ]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--seconds", type=float, default=0.5)
    p.add_argument("--warmup", type=float, default=0.3)
    p.add_argument("--databases", default=",".join(DATABASES))
    p.add_argument("--postgres-url")
    args = p.parse_args(argv)
    chosen = [s.strip() for s in args.databases.split(",") if s.strip()]
    if set(chosen) - set(DATABASES) or args.rounds < 1 or args.seconds <= 0:
        p.error(f"--databases from {', '.join(DATABASES)}; --rounds >= 1, --seconds > 0")
    script = os.path.relpath(sys.argv[0]) if sys.argv[0] else "bench/orm.py"
    command = shlex.join(["python", script, *(sys.argv[1:] if argv is None else argv)])
    info = bs.machine_info()
    sections: dict[str, list[Any]] = {}
    with contextlib.ExitStack() as stack:
        if "sqlite" in chosen:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rsorm-")))
            sections["sqlite file"] = cs = sqlite_contenders(directory, stack)
            print(f"\n[sqlite] {len(cs)} contenders, {args.rounds} rounds", flush=True)
            bs.run_rounds(cs, args.rounds, args.seconds, args.warmup)
        if "postgres" in chosen:
            url = args.postgres_url or bs.start_server("postgres", stack)
            sections["postgres"] = cs = postgres_contenders(url, stack)
            print(f"\n[postgres] {len(cs)} contenders, {args.rounds} rounds", flush=True)
            bs.run_rounds(cs, args.rounds, args.seconds, args.warmup)
            import psycopg

            with psycopg.connect(url) as conn:
                version = conn.execute("SHOW server_version").fetchone()
            info["PostgreSQL"] = str(version[0] if version else "?")
        info["load average at end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        info["SQLite"] = sqlite3.sqlite_version
        info["libraries"] = bs.library_info(["sqlalchemy", "psycopg", "psycopg-pool"])
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print()
    print(render(command, {"run": started, **info}, sections))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
