"""The MySQL/MariaDB sections of bench/stores.py (``--stores mysql``): the store's sync
API (PyMySQL) and async API (asyncmy) against their floor, the store's own
statements sent raw, and the server's statement counts. Loaded by bench/stores.py,
whose helpers it uses (``sys.modules["_rsbench_stores"]``); not run by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import secrets
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from retrysafe import Claim, Engine, open_store

bs = sys.modules["_rsbench_stores"]
Contender = bs.Contender
BenchError = bs.BenchError
FLOOR, SUBJECT, OPERATION = bs.FLOOR, bs.SUBJECT, bs.OPERATION
RESULT_BYTES, RESULT_OUTCOME, COUNT_CALLS = bs.RESULT_BYTES, bs.RESULT_OUTCOME, bs.COUNT_CALLS
engine_contenders, floor_contenders = bs.engine_contenders, bs.floor_contenders
_version, _count = bs._version, bs._count

#: ``--stores mysql --write``: the MySQL store's block, apart from the other stores'.
MYSQL_MARKS = (
    "<!-- bench/stores.py --stores mysql: generated from here -->",
    "<!-- bench/stores.py --stores mysql: generated up to here -->",
)
MYSQL_HEADING = "## MySQL/MariaDB: the store against its floor"


_MYSQL_FLOOR_SCHEMA = """
CREATE TABLE {table} (
    k VARCHAR(191) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
    status VARCHAR(10) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    token VARBINARY(1024) NOT NULL,
    updated_at DOUBLE NOT NULL,
    body LONGBLOB
) ENGINE=InnoDB
"""
#: The floor's round trips (each one ``execute``), the store's in kind: a claim is the
#: insert and the read of the key's row sent together; a completion one UPDATE.
_MYSQL_FLOOR_CLAIM = (
    "INSERT INTO {table} (k, status, token, updated_at) VALUES (%s, 'processing', %s, %s) "
    "ON DUPLICATE KEY UPDATE k = k; SELECT k, status, token, updated_at, body FROM {table} "
    "WHERE k = %s"
)
_MYSQL_FLOOR_COMPLETE = (
    "UPDATE {table} SET status = 'completed', body = %s, updated_at = %s "
    "WHERE k = %s AND token = %s AND status = 'processing'"
)
#: The third MySQL contender: the store's own statements, sent raw.
RAW = "store's SQL, raw"
RAW_DETAIL = (
    "{driver}, the floor's connection and cursor: the store's own statements "
    "(`INSERT ... ON DUPLICATE KEY UPDATE key_hash = key_hash; SELECT <22 columns>`, "
    "then its compare-and-set `UPDATE`) with the parameters the engine gave it on one "
    "first call (22 of them), a new key hash per key; no engine, no pool, no decoding "
    "beyond the driver's"
)
MYSQL_FLOOR_DETAIL = (
    "{driver}, one connection with the store's settings (autocommit, utf8mb4, "
    "MULTI_STATEMENTS | FOUND_ROWS, the store's session setup, binary_prefix), one cursor: "
    "a claim is `INSERT ... ON DUPLICATE KEY UPDATE k = k; SELECT ... WHERE k = %s` in one "
    "round trip, a completion `UPDATE ... WHERE k = %s AND token = %s AND status = "
    "'processing'`, a replay the claim's round trip on a completed row (table: ascii "
    "primary key, 3 columns and a blob)"
)


#: One statement of a MySQL floor: (query, parameters, check(rowcount, first row)).
MySQLStep = tuple[str, Sequence[Any], Callable[[int, Any], None]]


def _mysql_execute(cur: Any, step: MySQLStep) -> None:
    """One round trip through a PyMySQL cursor: the query, then the row of its last
    result (a claim's ``SELECT``), then the check."""
    query, params, check = step
    rowcount, row = cur.execute(query, params), None
    while cur.nextset():
        row = cur.fetchone()
    check(rowcount, row)


async def _amysql_execute(cur: Any, step: MySQLStep) -> None:
    """:func:`_mysql_execute` through an asyncmy cursor."""
    query, params, check = step
    rowcount, row = await cur.execute(query, params), None
    while await cur.nextset():
        row = await cur.fetchone()
    check(rowcount, row)


def _changed_one(rowcount: int, row: Any) -> None:
    if rowcount != 1:
        raise BenchError(f"mysql floor: a completion changed {rowcount} rows")


def _row_is(status: str) -> Callable[[int, Any], None]:
    def check(rowcount: int, row: Any) -> None:
        if row is None or status not in row:
            raise BenchError(f"mysql floor: the claim read {row!r}, expected {status}")

    return check


class MySQLFloor:
    """The floor's statements for a key: a first call (claim, completion) and a replay
    (the claim on a completed row). ``table`` is the floor's own narrow table."""

    def __init__(self, table: str) -> None:
        self.claim = _MYSQL_FLOOR_CLAIM.format(table=table)
        self.complete = _MYSQL_FLOOR_COMPLETE.format(table=table)
        self.token, self.now = b"t" * 32, time.time()

    def first(self, key: str) -> list[MySQLStep]:
        t, now = self.token, self.now
        return [
            (self.claim, (key, t, now, key), _row_is("processing")),
            (self.complete, (RESULT_BYTES, now, key, t), _changed_one),
        ]

    def replay(self, key: str) -> list[MySQLStep]:
        return [(self.claim, (key, self.token, self.now, key), _row_is("completed"))]


class StoreStatements(MySQLFloor):
    """The store's own statements with the parameters the engine gave it (caught from
    one first call), sent raw: the store's row (22 columns, the record's parameters)
    without the engine, the store's Python and its pool. The key's hash is the one
    parameter changed per key."""

    def __init__(self, engine: Engine, store: Any) -> None:
        ops: dict[str, Any] = {}
        claim, complete = store._claim, store._complete
        store._claim = lambda *a, **k: ops.setdefault("claim", claim(*a, **k))
        store._complete = lambda *a, **k: ops.setdefault("complete", complete(*a, **k))
        try:
            prepared = engine.begin(f"probe-{secrets.token_hex(4)}", operation=OPERATION)
            assert isinstance(prepared, Claim)
            engine.complete(prepared, RESULT_OUTCOME)
        finally:
            del store._claim, store._complete
        self.claim = "; ".join(ops["claim"].query)
        self.claim_params = [p for params in ops["claim"].params for p in params]
        self.complete = ops["complete"].query
        self.complete_params = list(ops["complete"].params)
        self.hash_of = functools.lru_cache(maxsize=4)(
            lambda key: hashlib.sha256(key.encode()).hexdigest()
        )

    def first(self, key: str) -> list[MySQLStep]:
        h = self.hash_of(key)
        claim, complete = list(self.claim_params), list(self.complete_params)
        claim[0] = claim[-1] = complete[-2] = h  # the insert's and the select's key; the CAS's
        return [
            (self.claim, claim, _row_is("processing")),
            (self.complete, complete, _changed_one),
        ]

    def replay(self, key: str) -> list[MySQLStep]:
        claim = list(self.claim_params)
        claim[0] = claim[-1] = self.hash_of(key)
        return [(self.claim, claim, _row_is("completed"))]


def mysql_floors(
    section: str,
    floors: Sequence[tuple[str, MySQLFloor, str]],
    cur: Any,
    loop: asyncio.AbstractEventLoop | None = None,
) -> list[list[Contender]]:
    """Contenders for each (name, statements, detail) of ``floors`` on ``cur`` (an
    asyncmy cursor driven on ``loop``, if given, else a PyMySQL one)."""

    def sync_calls(floor: MySQLFloor) -> tuple[Callable[[str], None], Callable[[str], None]]:
        def first(key: str) -> None:
            for step in floor.first(key):
                _mysql_execute(cur, step)

        def replay(key: str) -> None:
            _mysql_execute(cur, floor.replay(key)[0])

        return first, replay

    def async_calls(floor: MySQLFloor) -> tuple[Callable[[str], Any], Callable[[str], Any]]:
        async def first(key: str) -> None:
            for step in floor.first(key):
                await _amysql_execute(cur, step)

        async def replay(key: str) -> None:
            await _amysql_execute(cur, floor.replay(key)[0])

        return first, replay

    out = []
    for name, floor, detail in floors:
        if loop is None:
            first, replay = sync_calls(floor)
            write = first
        else:
            first, replay = async_calls(floor)
            write = functools.partial(_run_on, loop, first)
        out.append(floor_contenders(section, first, replay, write, detail, loop, name))
    return out


def _run_on(loop: asyncio.AbstractEventLoop, call: Callable[[str], Any], key: str) -> None:
    loop.run_until_complete(call(key))


def mysql_section(
    url: str,
    tag: str,
    own_server: bool,
    stack: contextlib.ExitStack,
    info: dict[str, str],
    clients: list[Any],
) -> list[Contender]:
    """The MySQL store's sync API (PyMySQL) against raw PyMySQL statements; the floor's
    connection goes to ``clients`` (for :func:`count_mysql_statements`)."""
    import pymysql

    store = open_store(url, table=f"rsbench_{tag}")
    engine = Engine(store)
    stack.callback(engine.close)
    conn = pymysql.connect(**store._driver_kwargs())  # type: ignore[attr-defined]
    stack.callback(conn.close)
    clients.append(conn)
    cur = conn.cursor()
    floor = f"rsbench_floor_{tag}"
    cur.execute(_MYSQL_FLOOR_SCHEMA.format(table=floor))
    if not own_server:
        stack.callback(_mysql_drop, conn, tag)
    cur.execute("SELECT VERSION(), @@innodb_flush_log_at_trx_commit")
    version, flush = cur.fetchone()
    # tx_isolation in MariaDB before 11.1, transaction_isolation in MySQL 8
    cur.execute("SHOW VARIABLES WHERE Variable_name IN ('tx_isolation', 'transaction_isolation')")
    isolation = cur.fetchone()[1]
    info["MySQL/MariaDB"] = f"{version} (innodb_flush_log_at_trx_commit={flush}, {isolation})"
    return _mysql_contenders("mysql", engine, store, cur, floor, f"PyMySQL {_version('pymysql')}")


def mysql_async_section(url: str, tag: str, stack: contextlib.ExitStack) -> list[Contender]:
    """The MySQL store's async API (asyncmy) against raw asyncmy statements, every batch
    of calls one coroutine on one event loop (the floor's table made by
    :func:`mysql_section`)."""
    import asyncmy

    loop = asyncio.new_event_loop()
    stack.callback(loop.close)
    store = open_store(url, table=f"rsbench_{tag}")
    engine = Engine(store)
    stack.callback(lambda: loop.run_until_complete(engine.aclose()))
    conn = loop.run_until_complete(
        asyncmy.connect(**store._driver_kwargs())  # type: ignore[attr-defined]
    )
    stack.callback(conn.close)
    driver = f"asyncmy {_version('asyncmy')}"
    floor = f"rsbench_floor_{tag}"
    return _mysql_contenders("mysql async", engine, store, conn.cursor(), floor, driver, loop)


def _mysql_contenders(
    section: str,
    engine: Engine,
    store: Any,
    cur: Any,
    floor_table: str,
    driver: str,
    loop: asyncio.AbstractEventLoop | None = None,
) -> list[Contender]:
    """The engine, its floor and the store's statements sent raw, interleaved."""
    api = "async API, asyncmy" if loop else "sync API, PyMySQL"
    if loop:  # the store's asyncmy connections send bytes as hex literals; the floor's not
        driver += (
            " (its own escaping of bytes; they are small here: a 56-byte body, a 32-byte token)"
        )
    ours = engine_contenders(section, engine, f"MySQLStore ({api}), default options", loop)
    floor, raw = mysql_floors(
        section,
        [
            (FLOOR, MySQLFloor(floor_table), MYSQL_FLOOR_DETAIL.format(driver=driver)),
            (RAW, StoreStatements(engine, store), RAW_DETAIL.format(driver=driver)),
        ],
        cur,
        loop,
    )
    return [c for trio in zip(ours, floor, raw, strict=True) for c in trio]


#: The server's counters read around a contender's calls (``SHOW GLOBAL STATUS``).
MYSQL_COUNTERS = (
    "Questions",
    "Com_insert",
    "Com_select",
    "Com_update",
    "Bytes_received",
    "Bytes_sent",
)


def _mysql_status(conn: Any) -> Counter[str]:
    names = ", ".join(f"'{n}'" for n in MYSQL_COUNTERS)
    with conn.cursor() as cur:
        cur.execute(f"SHOW GLOBAL STATUS WHERE Variable_name IN ({names})")
        return Counter({name: int(value) for name, value in cur.fetchall()})


def count_mysql_statements(
    contender: Contender, conn: Any, calls: int = COUNT_CALLS
) -> dict[str, float]:
    """Per call of ``contender``: statements the server ran (``Questions``, by kind) and
    bytes it received and sent, from the server's global counters read before and
    after ``calls`` calls, less what a read of the counters itself adds (nothing else
    may use the server meanwhile)."""
    contender.prepare()
    contender.run(10)  # connections made
    a, b = _mysql_status(conn), _mysql_status(conn)
    own = b - a  # what one read of the counters adds
    before = _mysql_status(conn)
    contender.run(calls)
    after = _mysql_status(conn)
    after.subtract(before)
    after.subtract(own)
    return {name: after[name] / calls for name in MYSQL_COUNTERS}


def mysql_breakdown_table(contenders: Sequence[Contender]) -> list[str]:
    """Per MySQL section and workload: the floor, the store's statements sent raw, and
    the engine; what the row costs (raw / floor) and what the engine, the store's
    Python and its pool cost (retrysafe / raw), in rate and in client CPU."""
    by = {(c.section, c.name, c.workload): c for c in contenders}
    lines = [
        "| store | workload | floor ops/s | store's SQL raw ops/s | retrysafe ops/s "
        "| raw / floor | retrysafe / raw | client CPU us/call: floor / raw / retrysafe |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for (section, name, workload), raw in by.items():
        if name != RAW:
            continue
        floor, ours = by[(section, FLOOR, workload)], by[(section, SUBJECT, workload)]
        lines.append(
            f"| {section} | {workload} | {floor.median:,.0f} | {raw.median:,.0f} "
            f"| {ours.median:,.0f} | {raw.median / floor.median:.2f}x "
            f"| {ours.median / raw.median:.2f}x "
            f"| {floor.cpu:.1f} / {raw.cpu:.1f} / {ours.cpu:.1f} |"
        )
    return lines


def mysql_statement_table(counts: dict[tuple[str, str, str], dict[str, float]]) -> list[str]:
    lines = [
        "| contender | workload | statements per call | INSERT | SELECT | UPDATE "
        "| bytes to the server | bytes from the server |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for (section, name, workload), n in counts.items():
        lines.append(
            f"| {section} / {name} | {workload} | {_count(n['Questions'])} "
            f"| {_count(n['Com_insert'])} | {_count(n['Com_select'])} "
            f"| {_count(n['Com_update'])} | {n['Bytes_received']:,.0f} | {n['Bytes_sent']:,.0f} |"
        )
    return lines


def _mysql_drop(conn: Any, tag: str) -> None:
    """Drop this run's tables (on a server that is not ours)."""
    with conn.cursor() as cur:
        for suffix in ("", "_archive", "_state", "_schema"):
            cur.execute(f"DROP TABLE IF EXISTS rsbench_{tag}{suffix}")
        cur.execute(f"DROP TABLE IF EXISTS rsbench_floor_{tag}")


def mysql_render(
    statements: dict[tuple[str, str, str], dict[str, float]], contenders: Sequence[Contender]
) -> list[str]:
    return [
        "#### MySQL: the floor, the store's statements sent raw, and the engine",
        "",
        "The same run's medians. *raw / floor* is what the store's row costs (22 columns",
        "to bind, send, store and read back, against the floor's 5); *retrysafe / raw* is",
        "what the engine, the store's Python (ops, decoding the row into a record) and",
        "its pool cost on top.",
        "",
        *mysql_breakdown_table(contenders),
        "",
        "#### MySQL statements per call",
        "",
        f"Counted over {COUNT_CALLS} calls per contender from the server's `SHOW GLOBAL STATUS`",
        "(`Questions`, `Com_insert`, `Com_select`, `Com_update`, `Bytes_received`,",
        "`Bytes_sent`), less what reading the counters adds. A claim's `INSERT` and `SELECT`",
        "go in one round trip (one multi-statement query), on both sides.",
        "",
        *mysql_statement_table(statements),
        "",
    ]
