"""What only the MySQL/MariaDB store has, on real MariaDB servers.

The race tests run again here on a server whose default isolation is READ COMMITTED
(``mysql_rc_server``; test_races runs them on InnoDB's default, REPEATABLE READ, and
the takeover race below runs on both). Then: one round trip per claim, completion
and replay, counted on the wire by a proxy (tests/_mysql_wire.py); a takeover and a
fenced stale completion under a real race; URLs refused before any connection; a
server that never answers; a migration that N processes start at once; a table of a
newer schema; bodies of several MiB and of every byte value; stale pooled
connections after a restart; a cancelled claim; a store used across ``fork()``.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx
import pymysql
import pytest
from _hangup import CALLER
from _http_apps import Counter
from _mysql_children import open_and_claim, use_after_fork
from _mysql_wire import COM_QUERY, COM_QUIT, CommandCounter
from _servers import MySQLServer, free_port
from conftest import POOL_WAIT, Api, StoreSpec
from test_cli import Serving
from test_cli_ops import (  # noqa: F401 (test_cli_ops' tests, collected again on MySQL)
    output,
    populate,
    run,
    test_inspect_json,
    test_list_filters_and_json,
    test_stats,
    test_sweep_then_archive_list,
)

# The race suite, collected again in this module, on the READ COMMITTED server.
from test_races import test_processes_race, test_tasks_race, test_threads_race  # noqa: F401

from retrysafe import (
    Claim,
    Engine,
    InProgressError,
    LeaseLostError,
    Outcome,
    Replay,
    Status,
    StoreUnavailableError,
    open_store,
)
from retrysafe.stores.mysql import SCHEMA_VERSION, MySQLStore, SchemaVersionError

OP = "op"
T0 = 1_800_000_000.0
MiB = 1 << 20


def _spec(server: MySQLServer, **options: Any) -> StoreSpec:
    return StoreSpec("mysql", server.url, {"table": f"t_{uuid.uuid4().hex[:12]}", **options})


@pytest.fixture
def store_spec(mysql_rc_server: MySQLServer) -> StoreSpec:
    """test_races' stores here: the READ COMMITTED server's."""
    return _spec(mysql_rc_server, **POOL_WAIT)


@pytest.fixture
def shared_spec(mysql_rc_server: MySQLServer) -> StoreSpec:
    return _spec(mysql_rc_server, **POOL_WAIT)


@pytest.fixture(params=["repeatable-read", "read-committed"])
def isolation_server(request: pytest.FixtureRequest) -> MySQLServer:
    name = "mysql_server" if request.param == "repeatable-read" else "mysql_rc_server"
    server: MySQLServer = request.getfixturevalue(name)
    return server


@pytest.fixture(scope="module")
def own_server() -> Iterator[MySQLServer]:
    """A MariaDB of this module's own, which tests restart."""
    with MySQLServer() as server:
        yield server


def admin(server: MySQLServer) -> Any:
    """A PyMySQL connection of the server's user (autocommit)."""
    parts = urlsplit(server.url)
    return pymysql.connect(
        host=parts.hostname,
        port=parts.port or 3306,
        user=unquote(parts.username or ""),
        database=parts.path.lstrip("/"),
        autocommit=True,
        connect_timeout=30,
    )


def rows(server: MySQLServer, query: str, *params: Any) -> list[tuple[Any, ...]]:
    conn = admin(server)
    try:
        with conn.cursor() as cur:
            cur.execute(query, params)
            return list(cur.fetchall())
    finally:
        conn.close()


# -- round trips on the wire --------------------------------------------------------------


@pytest.fixture
def wire(mysql_server: MySQLServer) -> Iterator[CommandCounter]:
    with CommandCounter(mysql_server.port) as proxy:
        yield proxy


def _count(proxy: CommandCounter, call: Any) -> tuple[Any, list[bytes]]:
    """``call()``'s result and the commands it sent, on the one pooled connection."""
    links, before = len(proxy.links), proxy.commands()
    result = call()
    assert len(proxy.links) == links, "the call opened a connection"
    return result, proxy.sent()[before:]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_round_trip_per_claim_completion_and_replay(
    wire: CommandCounter, mysql_server: MySQLServer, mode: str
) -> None:
    """Counted as the commands the client sends (tests/_mysql_wire.py): a claim, a
    completion, a failure and a replay are one ``COM_QUERY`` each; a takeover of an
    expired lease is two (the claim, then the compare-and-set ``UPDATE``)."""
    table = f"t_{uuid.uuid4().hex[:12]}"
    store = MySQLStore(wire.url(mysql_server.url), table=table, max_size=1)
    now = [T0]
    api = Api(Engine(store, lease=10, clock=lambda: now[0]), mode)
    try:
        api.begin("warm-up", operation=OP)  # connects and creates the tables
        claim, sent = _count(wire, lambda: api.begin("k", operation=OP))
        assert isinstance(claim, Claim) and len(sent) == 1, sent
        assert sent[0][0] == COM_QUERY and b"INSERT" in sent[0] and b"SELECT" in sent[0]
        _, sent = _count(wire, lambda: api.complete(claim, Outcome.json("done")))
        assert len(sent) == 1 and sent[0].startswith(bytes([COM_QUERY]) + b"UPDATE"), sent
        replay, sent = _count(wire, lambda: api.begin("k", operation=OP))
        assert isinstance(replay, Replay) and replay.outcome.value == "done"
        assert len(sent) == 1, sent
        failing, _ = _count(wire, lambda: api.begin("f", operation=OP))
        _, sent = _count(wire, lambda: api.fail(failing, Outcome.json("no")))
        assert len(sent) == 1, sent
        held, _ = _count(wire, lambda: api.begin("lease", operation=OP))
        assert isinstance(held, Claim)
        now[0] += 11  # the lease ran out
        took, sent = _count(wire, lambda: api.begin("lease", operation=OP))
        assert isinstance(took, Claim) and took.took_over is Status.PROCESSING
        assert len(sent) == 2 and sent[1].startswith(bytes([COM_QUERY]) + b"UPDATE"), sent
    finally:
        api.close()
        store.close()


# -- a takeover and a fenced stale completion, raced ------------------------------------


def test_takeover_races_a_stale_completion(isolation_server: MySQLServer) -> None:
    """A claim whose lease ran out completes while 24 threads try to take the key over.

    Either its completion lands first (no takeover; every racer replays it), or
    exactly one racer takes over and the completion is refused (LeaseLostError):
    the key ends with one owner's answer, never both, at both isolation levels."""
    spec = _spec(isolation_server, **POOL_WAIT)
    store = spec.open()
    racers = 24
    outcomes = {"completed": 0, "fenced": 0}
    try:
        for round_ in range(6):
            key = f"k{round_}"
            first = Engine(store, lease=10, clock=lambda: T0).begin(key, operation=OP)
            assert isinstance(first, Claim)
            late = Engine(store, lease=10, clock=lambda: T0 + 11)
            barrier = threading.Barrier(racers + 1)

            def take(i: int, key: str = key, late: Engine = late, barrier: Any = barrier) -> Any:
                barrier.wait()
                try:
                    return late.begin(key, operation=OP)
                except InProgressError as exc:
                    return exc

            def finish(first: Claim = first, barrier: Any = barrier) -> bool:
                barrier.wait()
                try:
                    Engine(store, lease=10, clock=lambda: T0).complete(first, Outcome.json("first"))
                except LeaseLostError:
                    return False
                return True

            with ThreadPoolExecutor(racers + 1) as pool:
                completed = pool.submit(finish)
                answers = list(pool.map(take, range(racers)))
                landed = completed.result()
            claims = [a for a in answers if isinstance(a, Claim)]
            if landed:
                outcomes["completed"] += 1
                assert not claims, "a takeover and the completion both won"
                for a in answers:
                    assert isinstance(a, (Replay, InProgressError)), a
                    if isinstance(a, Replay):
                        assert a.outcome.value == "first"
                final = "first"
            else:
                outcomes["fenced"] += 1
                assert len(claims) == 1, f"{len(claims)} takeovers"
                assert claims[0].took_over is Status.PROCESSING and claims[0].attempts == 2
                assert all(isinstance(a, InProgressError) for a in answers if a is not claims[0])
                late.complete(claims[0], Outcome.json("second"))
                final = "second"
            record = store.get(first.key_hash)
            assert record is not None and record.status is Status.COMPLETED
            assert record.outcome is not None and record.outcome.value == final
            again = late.begin(key, operation=OP)
            assert isinstance(again, Replay) and again.outcome.value == final
    finally:
        store.close()
    print(f"\nrounds where the completion landed / was fenced: {outcomes}")


def test_a_deadlock_that_keeps_coming_back_is_given_up(mysql_server: MySQLServer) -> None:
    """A statement InnoDB keeps choosing as a deadlock's victim runs again 10 times,
    then the error is the caller's (a plain op, and a guard cell's first write, whose
    own recover treats a duplicate key as lost): never an endless retry."""
    from retrysafe.stores.mysql.connection import Op, play

    store = _spec(mysql_server).open()
    deadlock = pymysql.err.OperationalError(1213, "Deadlock found")
    try:
        for op in (
            Op("DO 0", (), lambda rowcount, row: "done"),
            store._cell_write("c", None, "{}", None, T0),
        ):
            flow = play(op)
            next(flow)
            sent = 0
            with pytest.raises(pymysql.err.OperationalError):
                while sent < 100:
                    sent += 1
                    flow.send(deadlock)
            assert sent == 11, sent  # the first try and 10 more
    finally:
        store.close()


# -- URLs, a server that is down, the schema -------------------------------------------


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A loopback port that takes connections into its backlog and never answers."""
    sock = socket.create_server(("127.0.0.1", 0), backlog=64)
    sock.setblocking(False)
    yield sock
    sock.close()


def test_bad_urls_are_refused_before_connecting(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    base = f"mysql://u:s3cret@127.0.0.1:{port}"
    bad = [
        f"{base}/db?bogus=1",  # unknown option
        f"{base}/db?table=x&tabel=y",
        base,  # no database
        f"{base}/",
        f"{base}/a/b",
        "mysql://u:s3cret@127.0.0.1:99999/db",  # bad port
        "mysql://u:s3cret@127.0.0.1:port/db",
        f"{base}/db?table=bad-name",  # bad table name
        f"{base}/db?table=a.b.c",
        f"{base}/db?table=x%3BDROP%20TABLE%20y",
        f"{base}/db?table=" + "x" * 49,
        f"{base}/db?max_size=0",
        f"{base}/db?connect_timeout=soon",
        f"{base}/db?auto_migrate=maybe",
        f"{base}/db?charset=latin1",  # the tables are utf8mb4: always the connection's
    ]
    for url in bad:
        for opener in (open_store, MySQLStore):
            with pytest.raises(ValueError) as err:
                opener(url)
            assert "s3cret" not in str(err.value), err.value
    for table in ("1; DROP TABLE t", "t`", "db.t.u", ""):
        with pytest.raises(ValueError):
            MySQLStore(f"{base}/db", table=table)
    with pytest.raises(BlockingIOError):
        listener.accept()  # nobody connected


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("down", ["refused", "silent"])
def test_a_server_that_is_down(listener: socket.socket, mode: str, down: str) -> None:
    """Nothing listens (refused), or a server takes the connection and never greets
    (a hung server, a full backlog): StoreUnavailableError within connect_timeout."""
    port = free_port() if down == "refused" else listener.getsockname()[1]
    store = open_store(f"mysql://u:s3cret@127.0.0.1:{port}/db?connect_timeout=1")
    engine = Engine(store)
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError) as err:
        if mode == "sync":
            engine.begin("k", operation=OP)
        else:
            asyncio.run(asyncio.wait_for(engine.abegin("k", operation=OP), 30))
    # connect_timeout is 1 s; a caller that is not bounded waits 30 s (async) or forever
    assert time.monotonic() - started < 10
    assert err.value.code == "idempotency_store_unavailable"
    assert "s3cret" not in str(err.value) and f"127.0.0.1:{port}/db" in str(err.value)
    store.close()


def test_connect_timeout_bounds_connecting_only(mysql_server: MySQLServer) -> None:
    """Statements on an open connection wait as long as the server takes."""
    store = MySQLStore(mysql_server.url, table=f"t_{uuid.uuid4().hex[:12]}", connect_timeout=0.2)
    with store.completion_transaction() as tx, tx.connection.cursor() as cur:
        cur.execute("SELECT SLEEP(0.6), 7")
        assert cur.fetchone()[1] == 7
    store.close()


def test_processes_migrate_a_fresh_table_at_once(mysql_server: MySQLServer) -> None:
    """Six processes open a table that does not exist yet and claim one key at the same
    moment: one set of tables, at version 1, and one claim."""
    table = f"t_{uuid.uuid4().hex[:12]}"
    processes = 6
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(processes), ctx.Queue()
    procs = [
        ctx.Process(target=open_and_claim, args=(mysql_server.url, table, barrier, queue))
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    answers = sorted(queue.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert answers == ["claim"] + ["in progress"] * (processes - 1), answers
    assert rows(mysql_server, f"SELECT version FROM `{table}_schema`") == [(SCHEMA_VERSION,)]
    tables = rows(
        mysql_server,
        "SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE()"
        " AND table_name LIKE %s ORDER BY table_name",
        f"{table}%",
    )
    suffixes = ["", "_archive", "_schema", "_state"]
    assert [t[0] for t in tables] == [table + s for s in suffixes]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_newer_schema_is_refused(mysql_server: MySQLServer, mode: str) -> None:
    table = f"t_{uuid.uuid4().hex[:12]}"
    assert MySQLStore(mysql_server.url, table=table).migrate() == SCHEMA_VERSION
    rows(mysql_server, f"INSERT INTO `{table}_schema` VALUES ({SCHEMA_VERSION + 1}, 0)")
    store = MySQLStore(mysql_server.url, table=table)
    engine = Engine(store)
    with pytest.raises(SchemaVersionError, match="newer"):
        if mode == "sync":
            engine.begin("k", operation=OP)
        else:
            asyncio.run(engine.abegin("k", operation=OP))
    with pytest.raises(SchemaVersionError):
        store.migrate()
    assert rows(mysql_server, f"SELECT COUNT(*) FROM `{table}`") == [(0,)]  # nothing written
    store.close()


# -- bodies and texts ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_large_and_binary_bodies_round_trip(mysql_server: MySQLServer, mode: str) -> None:
    """A body as large as the server's ``max_allowed_packet`` lets one statement carry,
    a body of every byte value, and a binary request payload come back byte for byte.

    Both drivers send bytes as hexadecimal (``X'…'``, two bytes a byte; the store's
    asyncmy connections do so too): what they carry is half the packet, less room for
    the rest of the statement (1 MiB here: the request payload and the other columns)."""
    ((packet,),) = rows(mysql_server, "SELECT @@max_allowed_packet")
    size = min(int(packet) // 2 - MiB, 32 * MiB)
    assert size >= 4 * MiB, packet
    big = os.urandom(size)
    every = bytes(range(256)) * 4096  # 1 MiB; NUL, quotes, backslashes, 0x1a, ...
    store = _spec(mysql_server).open()
    api = Api(Engine(store, max_body=size), mode)
    try:
        for key, body in (("big", big), ("every", every)):
            claim = api.begin(key, operation=OP, request_payload=every)
            assert isinstance(claim, Claim)
            api.complete(claim, Outcome(body, media_type="application/octet-stream"))
            replay = api.begin(key, operation=OP)
            assert isinstance(replay, Replay) and replay.outcome.body == body
            record = store.get(claim.key_hash)
            assert record is not None and record.request_payload == every
    finally:
        api.close()
        store.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_answer_over_the_packet_fails_finally(mysql_server: MySQLServer, mode: str) -> None:
    """An answer larger than ``max_allowed_packet`` carries is refused before it is sent
    (the server would close the connection, which looks like an outage and was resent
    until the lease ended, leaving the key to run again): the handler ran, so the
    attempt fails finally at once and a retry gets the failure; the pool still works."""
    ((packet,),) = rows(mysql_server, "SELECT @@max_allowed_packet")
    body = b"\x00" * (int(packet) // 2 + 1)
    store = _spec(mysql_server).open()
    api = Api(Engine(store, max_body=len(body), lease=300), mode)
    try:
        claim = api.begin("too-big", operation=OP)
        assert isinstance(claim, Claim)
        api.begin("warm-up", operation=OP)  # the store has read the server's limit
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError) as err:
            api.complete(claim, Outcome(body))
        assert not err.value.transient and "max_allowed_packet" in str(err.value)
        assert time.monotonic() - started < 30  # not resent for the 300 s lease
        record = store.get(claim.key_hash)
        assert record is not None and record.status is Status.FAILED and record.final
        again = api.begin("too-big", operation=OP)
        assert isinstance(again, Replay) and again.failed
    finally:
        api.close()
        store.close()


def test_errors_that_resending_cannot_cure_are_not_transient(mysql_server: MySQLServer) -> None:
    """A table dropped under the store (error 1146) is not an outage: not transient, so
    the engine does not resend into it; a server that is down stays transient."""
    spec = _spec(mysql_server)
    store = spec.open()
    try:
        engine = Engine(store)
        claim = engine.begin("dropped", operation=OP)
        assert isinstance(claim, Claim)
        table = spec.options["table"]
        rows(mysql_server, f"DROP TABLE `{table}`")
        with pytest.raises(StoreUnavailableError) as err:
            store.get(claim.key_hash)
        assert not err.value.transient
    finally:
        store.close()
    down = open_store(f"mysql://u@127.0.0.1:{free_port()}/db?connect_timeout=1")
    with pytest.raises(StoreUnavailableError) as err:
        down.get("0" * 64)
    assert err.value.transient


def test_a_user_with_ordinary_grants(mysql_server: MySQLServer) -> None:
    """The store needs no more than SELECT, INSERT, UPDATE, DELETE, CREATE and INDEX on
    its own database (the tests' usual user has every privilege): migrate, claim,
    complete, replay, sweep with the financial archive, stats and list all work."""
    user = f"narrow_{uuid.uuid4().hex[:8]}"
    database = urlsplit(mysql_server.url).path.lstrip("/")
    rows(mysql_server, f"CREATE USER '{user}'@'127.0.0.1' IDENTIFIED BY 'pw'")
    rows(
        mysql_server,
        f"GRANT SELECT, INSERT, UPDATE, DELETE, CREATE, INDEX ON `{database}`.* "
        f"TO '{user}'@'127.0.0.1'",
    )
    url = f"mysql://{user}:pw@127.0.0.1:{mysql_server.port}/{database}"
    store = MySQLStore(url, table=f"t_{uuid.uuid4().hex[:12]}")
    try:
        assert store.migrate() == SCHEMA_VERSION
        clock = [T0]
        engine = Engine(store, clock=lambda: clock[0], ttl=60)
        claim = engine.begin("paid", operation=OP, retention="financial")
        assert isinstance(claim, Claim)
        engine.complete(claim, Outcome.json({"paid": 1}))
        replay = engine.begin("paid", operation=OP)
        assert isinstance(replay, Replay) and replay.outcome.value == {"paid": 1}
        assert store.stats(T0).by_status()["completed"] == 1
        assert [r.key for r in store.records(operation=OP)] == ["paid"]
        batch = store.sweep(T0 + 3600)
        assert (batch.deleted, batch.archived) == (1, 1)
        assert [a.record.key for a in store.archived_records()] == ["paid"]
    finally:
        store.close()
        rows(mysql_server, f"DROP USER '{user}'@'127.0.0.1'")


def test_non_ascii_texts_round_trip(mysql_server: MySQLServer) -> None:
    """Keys, scopes, operations, fingerprints, metadata and answers outside ASCII (four-
    byte UTF-8 too) come back as they were, and keys that differ only in case or accent
    are different keys (the columns compare byte for byte)."""
    store = _spec(mysql_server).open()
    engine = Engine(store)
    operation = "opération-支払い-💳"
    metadata = {"note": "naïve ☃ 𝄞 😀", "€": ["ß", "ǅ"]}
    claim = engine.begin(
        "k", operation=operation, scope="tenant-ü", fingerprint="fp-Ω", metadata=metadata
    )
    assert isinstance(claim, Claim)
    engine.complete(claim, Outcome.json({"answer": "ok ✓ 🚀"}))
    record = store.get(claim.key_hash)
    assert record is not None
    assert (record.operation, record.scope, record.fingerprint) == (operation, "tenant-ü", "fp-Ω")
    assert record.metadata == metadata and record.outcome is not None
    assert record.outcome.value == {"answer": "ok ✓ 🚀"}
    # The store keeps whatever key it is given (the engine takes printable ASCII).
    for key in ("ключ-🔑-鍵", "Ключ-🔑-鍵", "клЮч-🔑-鍵", "cafe", "café", "cafe\u0301"):
        copy = record.copy()
        copy.key, copy.key_hash, copy.token = key, uuid.uuid4().hex * 2, uuid.uuid4().hex
        copy.status, copy.outcome = Status.PROCESSING, None
        assert store.claim(copy).claimed
        found = store.get(copy.key_hash)
        assert found is not None and found.key == key and found.metadata == metadata
    store.close()


# -- pooled connections: a restart, a cancelled claim, a fork --------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("how", ["restart", "kill"])
def test_stale_pooled_connections_after_a_restart(
    own_server: MySQLServer, mode: str, how: str
) -> None:
    """Three idle pooled connections, then the server restarts (or is SIGKILLed and
    started): the next calls work, on fresh connections, none reported as an outage."""
    store = _spec(own_server, max_size=3).open()
    engine = Engine(store)
    api = Api(engine, mode)

    def claim_all(keys: list[str]) -> list[Any]:
        if api.loop is None:
            with ThreadPoolExecutor(len(keys)) as pool:
                return list(pool.map(lambda k: engine.begin(k, operation=OP), keys))

        async def claim() -> list[Any]:
            return list(await asyncio.gather(*(engine.abegin(k, operation=OP) for k in keys)))

        return api.loop.run_until_complete(claim())

    try:
        assert all(isinstance(c, Claim) for c in claim_all(["a", "b", "c"]))
        if how == "restart":
            own_server.restart()
        else:
            own_server.kill()
            own_server.start()
        for keys in (["d"], ["e", "f", "g"]):  # one, then the whole pool at once
            assert all(isinstance(c, Claim) for c in claim_all(keys))
        with pytest.raises(InProgressError):  # what was written before is still there
            engine.begin("a", operation=OP)
    finally:
        api.close()
        store.close()


async def test_a_cancelled_claim_leaves_the_pool_usable(mysql_server: MySQLServer) -> None:
    """A claim cancelled while the server runs it (it waits on a row lock): its
    connection is not given back mid-statement (the pool's only one here: the next
    call works at once, with its own answer), and the key keeps its owner."""
    spec = _spec(mysql_server, max_size=1)
    table = spec.options["table"]
    store = spec.open()
    engine = Engine(store, lease=60)
    first = await engine.abegin("k", operation=OP)
    assert isinstance(first, Claim)
    blocker = admin(mysql_server)
    try:
        with blocker.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute(
                f"SELECT 1 FROM `{table}` WHERE key_hash = %s FOR UPDATE", (first.key_hash,)
            )
        task = asyncio.create_task(Engine(store).abegin("k", operation=OP))
        # The claim's statement runs on the server: it waits for the blocker's lock.
        waiting = (
            "SELECT COUNT(*) FROM information_schema.processlist"
            " WHERE command = 'Query' AND info LIKE %s"
        )
        deadline = time.monotonic() + 30
        while rows(mysql_server, waiting, f"INSERT INTO `{table}`%") != [(1,)]:
            assert time.monotonic() < deadline, "the claim never waited on the lock"
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # While the cancelled statement still waits on the server: another key.
        other = await asyncio.wait_for(engine.abegin("other", operation=OP), 10)
        assert isinstance(other, Claim) and other.key == "other"
    finally:
        blocker.rollback()
        blocker.close()
    record = await store.aget(first.key_hash)
    assert record is not None and record.status is Status.PROCESSING
    assert record.token == first.token
    await engine.acomplete(first, Outcome.json("one"))
    replay = await engine.abegin("k", operation=OP)
    assert isinstance(replay, Replay) and replay.outcome.value == "one"
    await store.aclose()


def test_a_store_used_before_fork_works_in_the_child(
    wire: CommandCounter, mysql_server: MySQLServer
) -> None:
    """The child of a ``fork()`` gets pools of its own: it connects anew, and never
    uses, nor ends, the parent's connection (no command from the child on it, no
    ``COM_QUIT``); the parent goes on on the same connection."""
    store = MySQLStore(wire.url(mysql_server.url), table=f"t_{uuid.uuid4().hex[:12]}", max_size=1)
    engine = Engine(store)
    loop = asyncio.new_event_loop()
    try:
        claim = engine.begin("parent", operation=OP)
        assert isinstance(claim, Claim)
        engine.complete(claim, Outcome.json("parent"))
        loop.run_until_complete(engine.abegin("parent-async", operation=OP))
        assert len(wire.links) == 2  # the sync pool's connection, the loop's
        before = [len(link.commands) for link in wire.links]
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=use_after_fork, args=(store, queue))
        child.start()
        assert queue.get(timeout=60) == "ok"
        child.join(30)
        assert child.exitcode == 0
        assert [len(link.commands) for link in wire.links[:2]] == before  # untouched
        assert len(wire.links) == 4  # the child's own two
        replay = engine.begin("child", operation=OP)
        assert isinstance(replay, Replay) and replay.outcome.value == "child"
        done = loop.run_until_complete(engine.abegin("child-async", operation=OP))
        assert isinstance(done, Replay)
        assert len(wire.links) == 4, "the parent had to reconnect"
        parents = wire.links[:2]
        assert [len(link.commands) for link in parents] == [n + 1 for n in before]
        assert not any(link.closed for link in parents)
        assert not any(c[0] == COM_QUIT for link in parents for c in link.commands)
    finally:
        loop.run_until_complete(store.aclose())
        loop.close()
        store.close()


# -- the CLI on MySQL ----------------------------------------------------------------


@pytest.fixture
def url(mysql_server: MySQLServer) -> str:
    """test_cli_ops' store (its tests below run on it), in a fresh MariaDB table."""
    return populate(f"{mysql_server.url}?table=t_{uuid.uuid4().hex[:12]}")


def test_cli_migrate(mysql_server: MySQLServer, capsys: Any) -> None:
    table = f"t_{uuid.uuid4().hex[:12]}"
    url = f"{mysql_server.url}?table={table}"
    for _ in range(2):  # creates, then finds the tables at the version
        out = output(capsys, "migrate", "--store", url)
        assert out.strip().endswith(f"schema at version {SCHEMA_VERSION}"), out
    assert rows(mysql_server, f"SELECT version FROM `{table}_schema`") == [(SCHEMA_VERSION,)]


def test_cli_on_a_server_that_is_down(tmp_path: Path) -> None:
    down = f"mysql://u:s3cret@127.0.0.1:{free_port()}/db?connect_timeout=1"
    for command in ("migrate", "sweep", "stats", "list"):
        result = run(command, "--store", down, cwd=tmp_path)
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        err = result.stderr.strip()
        assert err.startswith(f"retrysafe {command}: error: MySQL store at 127.0.0.1:"), err
        assert "unavailable" in err and len(err.splitlines()) == 1, err
        assert "Traceback" not in err and "s3cret" not in err


def test_cli_gateway_on_mysql(
    mysql_server: MySQLServer, upstream: str, counter: Counter, tmp_path: Path
) -> None:
    """``retrysafe gateway --store mysql://…`` in front of the test API: a keyed POST
    runs once, its retries are replayed."""
    store = f"{mysql_server.url}?table=t_{uuid.uuid4().hex[:12]}"
    gw = Serving(
        "gateway", "--upstream", upstream, "--listen", "127.0.0.1:0", "--store", store, cwd=tmp_path
    )
    try:
        address = gw.read_until("listening on").split()[-1]
        assert "mysql://retrysafe@127.0.0.1" in gw.read_until("store")
        gw.ready(address)
        test_id = uuid.uuid4().hex
        headers = {"Idempotency-Key": f"gw-{test_id}", "X-Test-Id": test_id, **CALLER}
        answers = [
            httpx.post(address + "/orders", json={"n": 1}, headers=headers, timeout=30)
            for _ in range(3)
        ]
        assert [r.status_code for r in answers] == [201] * 3
        assert [r.headers.get("idempotent-replayed") for r in answers] == [None, "true", "true"]
        assert {r.content for r in answers} == {answers[0].content}
        assert counter.count(test_id) == 1
        gw.interrupt()
    finally:
        gw.kill()


def _block(server: MySQLServer, table: str, key_hash: str) -> Any:
    """A connection whose open transaction holds ``key_hash``'s row lock."""
    blocker = admin(server)
    with blocker.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute(f"SELECT 1 FROM `{table}` WHERE key_hash = %s FOR UPDATE", (key_hash,))
    return blocker


def _on_the_server(server: MySQLServer, statement: str) -> bool:
    """Whether a statement that starts so runs on ``server`` (waits on a lock, here)."""
    running = rows(
        server,
        "SELECT COUNT(*) FROM information_schema.processlist"
        " WHERE command = 'Query' AND info LIKE %s",
        statement + "%",
    )
    return running == [(1,)]


def test_close_while_a_call_is_in_flight(mysql_server: MySQLServer) -> None:
    """``close()`` while a completion waits on the server (on a row lock): the completion
    lands, and the store goes on working with the pool's size (max_size=1 here: one
    call at a time, however often it was closed)."""
    spec = _spec(mysql_server, max_size=1)
    store = spec.open()
    engine = Engine(store)
    claim = engine.begin("k", operation=OP)
    assert isinstance(claim, Claim)
    blocker = _block(mysql_server, spec.options["table"], claim.key_hash)
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(engine.complete, claim, Outcome.json("done"))
        deadline = time.monotonic() + 30
        while not _on_the_server(mysql_server, f"UPDATE `{spec.options['table']}`"):
            assert time.monotonic() < deadline, "the completion never reached the server"
            time.sleep(0.02)
        store.close()
        blocker.rollback()
        blocker.close()
        done.result(timeout=30)
    for i in range(3):
        assert isinstance(engine.begin(f"after-{i}", operation=OP), Claim)
    replay = engine.begin("k", operation=OP)
    assert isinstance(replay, Replay) and replay.outcome.value == "done"
    store.close()


async def test_aclose_while_a_call_is_in_flight(mysql_server: MySQLServer) -> None:
    """:func:`test_close_while_a_call_is_in_flight` with ``aclose()``: afterwards the
    pool still lends one connection at a time (a second call waits for the first)."""
    spec = _spec(mysql_server, max_size=1, connect_timeout=0.5)
    table = spec.options["table"]
    store = spec.open()
    engine = Engine(store)
    claim = await engine.abegin("k", operation=OP)
    assert isinstance(claim, Claim)
    blocker = _block(mysql_server, table, claim.key_hash)
    try:
        done = asyncio.create_task(engine.acomplete(claim, Outcome.json("done")))
        deadline = time.monotonic() + 30
        while not _on_the_server(mysql_server, f"UPDATE `{table}`"):
            assert time.monotonic() < deadline, "the completion never reached the server"
            await asyncio.sleep(0.02)
        await store.aclose()
    finally:
        blocker.rollback()
        blocker.close()
    await asyncio.wait_for(done, 30)
    # One connection at a time still: while one call waits on the lock, a second one
    # gets none within connect_timeout.
    blocker = _block(mysql_server, table, claim.key_hash)
    try:
        held = asyncio.create_task(engine.abegin("k", operation=OP))
        deadline = time.monotonic() + 30
        while not _on_the_server(mysql_server, f"INSERT INTO `{table}`"):
            assert time.monotonic() < deadline, "the claim never reached the server"
            await asyncio.sleep(0.02)
        with pytest.raises(StoreUnavailableError, match="pooled connections busy"):
            await engine.abegin("other", operation=OP)
    finally:
        blocker.rollback()
        blocker.close()
    replay = await asyncio.wait_for(held, 30)
    assert isinstance(replay, Replay) and replay.outcome.value == "done"
    await store.aclose()
