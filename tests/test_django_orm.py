"""The Django app and store: records in Django's own database, completed in the view's
transaction, on a SQLite file and on the real PostgreSQL server (and, the tests that
tests/test_django_mysql.py imports, on a real MariaDB).

Django's settings are process-wide (another test module configures them in this
process), so every Django project here runs in processes of its own:
``tests/django_orm_app/run.py`` configures one (``RS_DB``, ``RS_ATOMIC``) and migrates
it, serves it (WSGI on werkzeug's threaded server, ASGI on uvicorn) or runs a
scenario of ``tests/django_orm_app/scenarios.py``. This process checks what they
left with the native stores and the CLI on the same database.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psycopg
import pymysql
import pytest

from retrysafe import IdempotencyMap, Status, open_store
from retrysafe.stores.mysql import SCHEMA_VERSION as MYSQL_VERSION
from retrysafe.stores.sqlite import SCHEMA_VERSION

RUN = Path(__file__).resolve().parent / "django_orm_app" / "run.py"
SRC = Path(__file__).resolve().parent.parent / "src"
IMAP = IdempotencyMap.default()
CALLER = {"Authorization": "Bearer alice"}


class Project:
    """One Django project on one database: its processes, and the native store URL."""

    def __init__(self, db: str, native_url: str, vendor: str) -> None:
        self.db, self.native_url, self.vendor = db, native_url, vendor
        self.pids: dict[str, int] = {}  # the server process of each base URL

    def env(
        self, atomic: bool = False, db_options: dict[str, Any] | None = None, **options: Any
    ) -> dict[str, str]:
        env = dict(os.environ, RS_DB=self.db, RS_ATOMIC="1" if atomic else "0")
        env["RS_OPTIONS"] = json.dumps(options)
        env["RS_DB_OPTIONS"] = json.dumps(db_options or {})
        env["PYTHONPATH"] = str(SRC)
        return env

    def run(
        self,
        *args: str,
        check: bool = True,
        atomic: bool = False,
        db_options: dict[str, Any] | None = None,
        **options: Any,
    ) -> Any:
        """``run.py ARGS`` to its end; its last stdout line as JSON (None without one)."""
        done = subprocess.run(
            [sys.executable, str(RUN), *args],
            env=self.env(atomic, db_options, **options),
            capture_output=True,
            text=True,
            timeout=90,
        )
        if check:
            assert done.returncode == 0, done.stderr[-3000:]
        lines = done.stdout.strip().splitlines()
        return json.loads(lines[-1]) if lines and lines[-1][:1] in '{["' else done

    @contextmanager
    def serve(self, kind: str = "wsgi", atomic: bool = False, **options: Any) -> Iterator[str]:
        """The project served on a free loopback port: its base URL."""
        proc = subprocess.Popen(
            [sys.executable, str(RUN), "serve", kind],
            env=self.env(atomic, **options),
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # "READY <port>" once it listens
            assert line.startswith("READY"), line
            base = f"http://127.0.0.1:{line.split()[1]}"
            self.pids[base] = proc.pid
            yield base
        finally:
            proc.kill()
            proc.wait(timeout=30)

    def native(self) -> Any:
        return open_store(self.native_url)

    def record(self, mandate: str, user: str = "u") -> Any:
        """The record of the order of ``mandate`` (its key's only one), read through the
        native store."""
        store = self.native()
        try:
            (found,) = store.records(key=IMAP.key("order", cart_mandate_id=mandate, user_id=user))
            return found
        finally:
            store.close()


@pytest.fixture(params=["sqlite", "postgres"])
def project(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Project]:
    """A migrated project on a new SQLite file or a new PostgreSQL database."""
    if request.param == "sqlite":
        path = tmp_path / "shop.sqlite3"
        made = Project(str(path), f"sqlite:///{path}", "sqlite")
        made.run("migrate")
        yield made
        return
    server = request.getfixturevalue("postgres_server")
    name = f"dj_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = server.url.rpartition("/")[0] + f"/{name}"
    made = Project(url, url, "postgresql")
    made.run("migrate")
    yield made
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


def mysql_tables(url: str) -> dict[str, Any]:
    """The tables of a ``mysql://user@host:port/db`` database (name: engine) and the
    records' schema version (``version``)."""
    parts = urlsplit(url)
    database = parts.path.lstrip("/")
    conn = pymysql.connect(
        host=parts.hostname, port=parts.port, user=parts.username, database=database
    )
    try:
        cur = conn.cursor()
        query = "SELECT table_name, engine FROM information_schema.tables WHERE table_schema = %s"
        cur.execute(query, (database,))
        found: dict[str, Any] = dict(cur.fetchall())
        cur.execute("SELECT MAX(version) FROM retrysafe_records_schema")
        found["version"] = cur.fetchone()[0]  # type: ignore[index]
        return found
    finally:
        conn.close()


def _order(
    base: str, mandate: str, *, path: str = "/orders", user: str = "u", **headers: str
) -> Any:
    key = IMAP.key("order", cart_mandate_id=mandate, user_id=user)
    return httpx.post(
        base + path,
        json={"cart_mandate_id": mandate, "user_id": user, "total": 5},
        headers={**CALLER, "Idempotency-Key": key, **headers},
        timeout=60,
    )


def _count(base: str, mandate: str) -> int:
    return int(httpx.get(f"{base}/count/{mandate}", timeout=30).json()["orders"])


# -- the table, the native store, the CLI, the management commands --------------------------


def test_migrate_creates_the_native_table(project: Project) -> None:
    """migrate creates the native store's table; its records are the native ones: the
    native store, the CLI, the app's model and the management commands read them."""
    if project.vendor == "sqlite":
        import sqlite3

        with sqlite3.connect(project.db) as conn:
            assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    elif project.vendor == "mysql":
        tables = mysql_tables(project.db)
        assert tables["retrysafe_records"] == "InnoDB" and tables["version"] == MYSQL_VERSION
        assert "django_orm_app_order" in tables
    else:
        with psycopg.connect(project.db) as conn:
            tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables")}
        assert {"retrysafe_records", "django_orm_app_order"} <= tables
    seen = project.run("scenario", "transactions", project.native_url)
    assert seen["plain"]["after_first"] == [1, "completed"]
    native = project.native()
    try:
        assert native.migrate() > 0  # the native migration finds its own schema current
    finally:
        native.close()
    cli = subprocess.run(
        [sys.executable, "-m", "retrysafe", "stats", "--store", project.native_url, "--json"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(SRC)),
        timeout=60,
    )
    assert cli.returncode == 0, cli.stderr
    by_status = json.loads(cli.stdout)["by_status"]
    assert by_status.get("completed") == 3  # p1, p2 (retried), o1
    model = project.run("scenario", "records")
    assert ["order", "completed", "order:p1:u", True] in model
    assert len(model) == sum(by_status.values())
    stats = project.run("manage", "retrysafe_stats", "--json")
    assert stats["by_status"] == by_status
    text = project.run("manage", "retrysafe_stats").stdout
    assert "by status: " in text and "oldest processing record: 'order:" in text
    swept = project.run("manage", "retrysafe_sweep", "--json")
    assert swept["deleted"] == 0  # nothing has expired


# -- att.transaction() in plain code ----------------------------------------------------------


def test_transaction_in_plain_code(project: Project) -> None:
    """Outside and inside an outer atomic(); a stale worker's write rolls back."""
    seen = project.run("scenario", "transactions", project.native_url)
    plain = seen["plain"]
    assert plain["after_first"] == [1, "completed"]
    assert plain["replayed"] is True and plain["after_replay"] == 1
    assert plain["after_raise"] == [0, "failed"]  # the row and the completion rolled back
    assert plain["after_retry"] == [1, "completed"]
    outer = seen["outer"]
    # the completion commits with the outermost block; another connection sees it only then
    assert outer["committed"] == [1, "completed"]
    if project.vendor != "sqlite":  # the claim committed on its own
        assert outer["inside"] == [1, "processing"]
        assert outer["rolled_back"] == [0, "processing"]  # retried once its lease runs out
    else:  # SQLite: the claim joined the outer block's transaction (one writer)
        assert outer["inside"] == [1, None]
        assert outer["rolled_back"] == [0, None]
    stale = seen["stale"]
    assert stale["lease_lost"] is True and stale["taker_attempts"] == 2
    assert stale["rows"] == 0  # the stale worker's ORM write rolled back
    assert stale["record"] == ["processing", True]  # the new owner's record, untouched


def test_a_crash_between_the_write_and_the_commit_leaves_neither(project: Project) -> None:
    killed = project.run("scenario", "crash", "1", check=False)
    assert killed.returncode == -signal.SIGKILL
    seen = project.run("scenario", "after_crash", project.native_url)
    assert seen["left"] == [0, "processing"]  # the claim committed, the transaction did not
    assert seen["retry"]["cart_mandate_id"] == "m1"  # taken over once the lease ran out
    assert seen["after"] == [1, "completed"]
    assert project.record("m1").attempts == 2


def test_racing_threads_create_one_order(project: Project) -> None:
    """32 threads, two users, one mandate: one row; every answer of the winner agrees."""
    seen = project.run("scenario", "race", "32")
    answers = seen["answers"]
    won = [a for a in answers if a != "taken"]
    assert won and all(a == won[0] for a in won)
    assert len(won) in (24, 8)  # alice's 24 or bob's 8: the other user's are refused
    assert all(a == "taken" for a in answers if a not in won)
    assert seen["rows"] == 1


def test_racing_processes_in_plain_code_create_one_order(project: Project) -> None:
    """3 processes x 8 threads of plain ``att.transaction()`` on one mandate: one row."""
    with ThreadPoolExecutor(3) as pool:
        runs = list(pool.map(lambda _: project.run("scenario", "race", "8"), range(3)))
    answers = [a for seen in runs for a in seen["answers"]]
    won = [a for a in answers if a != "taken"]
    assert won and all(a == won[0] for a in won)  # one order, every winner's answer
    assert all(seen["rows"] == 1 for seen in runs)


def test_att_transaction_from_async_code(project: Project) -> None:
    seen = project.run("scenario", "async_plain", project.native_url)
    assert seen["same"] is True  # the second call replayed the first's answer
    assert seen["after"] == [1, "completed"]


# -- the store's own connections ----------------------------------------------------------------


def test_the_stores_connections_outlive_no_thread(project: Project) -> None:
    """40 short-lived threads (a thread-per-request server's) each call the store: its
    connections stay bounded (PostgreSQL: its pool of 2; SQLite: none once they ended)."""
    open_after = project.run("scenario", "threads", "40")["open"]
    assert open_after <= (2 if project.vendor == "postgresql" else 0)


def test_a_thread_per_request_server_keeps_few_connections(project: Project) -> None:
    """Werkzeug's threaded server (a thread per request, as runserver): 20 keyed requests
    leave at most the store's pool open on the server."""
    if project.vendor != "postgresql":
        pytest.skip("connections on the server: PostgreSQL's")
    with project.serve("wsgi", store="django://default?max_size=2") as base:
        for i in range(20):
            assert _order(base, f"t{i}").status_code == 201
        with psycopg.connect(project.db, autocommit=True) as conn:
            query = (
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid()"
            )
            assert conn.execute(query).fetchone()[0] <= 2  # type: ignore[index]


def test_djangos_connection_pool_is_left_alone(project: Project) -> None:
    if project.vendor != "postgresql":
        pytest.skip("Django's pool: PostgreSQL's")
    pool = {"pool": {"min_size": 2, "max_size": 2, "timeout": 5}}
    seen = project.run("scenario", "pool", db_options=pool)
    assert seen["order"] == "q1" and seen["rows"] == 1
    assert seen["cursor"] is True and seen["prepare_threshold"] is None  # Django's own


# -- the middleware -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "atomic", "path"),
    [("wsgi", False, "/orders"), ("wsgi", True, "/orders"), ("asgi", False, "/aorders")],
    ids=["wsgi", "wsgi-atomic-requests", "asgi-async-view"],
)
def test_the_middleware_commits_the_order_and_its_record_together(
    project: Project, kind: str, atomic: bool, path: str
) -> None:
    with project.serve(kind, atomic) as base:
        first = _order(base, "m1", path=path)
        assert first.status_code == 201
        assert project.record("m1").status is Status.COMPLETED
        again = _order(base, "m1", path=path)
        assert again.headers["idempotent-replayed"] == "true"
        assert again.json() == first.json()
        assert _count(base, "m1") == 1
        # a view that raises after its write: Django answers 500; both roll back
        failed = _order(base, "m2", path=path, **{"X-Fail": "1"})
        assert failed.status_code == 500
        assert _count(base, "m2") == 0
        assert project.record("m2").status is Status.FAILED  # retryable
        retried = _order(base, "m2", path=path)
        assert retried.status_code == 201 and _count(base, "m2") == 1
        assert _order(base, "m2", path=path).json() == retried.json()
        assert _count(base, "m2") == 1
        if path == "/orders":  # a 5xx answer rolls the write back too
            answered = _order(base, "m3", **{"X-Status": "503"})
            assert answered.status_code == 503 and _count(base, "m3") == 0
            assert project.record("m3").status is Status.FAILED


@pytest.mark.parametrize(
    ("kind", "path"), [("wsgi", "/orders"), ("asgi", "/aorders")], ids=["wsgi", "asgi"]
)
def test_a_view_that_marks_its_transaction_for_rollback_fails_the_attempt(
    project: Project, kind: str, path: str
) -> None:
    """``set_rollback(True)``: Django rolls back without an error, so the view's 2xx is
    never told: a 500 saying nothing committed, the attempt failed (retryable)."""
    with project.serve(kind) as base:
        first = _order(base, "m1", path=path, **{"X-Rollback": "1"})
        assert first.status_code == 500
        assert first.json()["code"] == "idempotency_rolled_back"
        assert _count(base, "m1") == 0
        record = project.record("m1")
        assert record.status is Status.FAILED and record.attempts == 1
        retried = _order(base, "m1", path=path)  # runs again (not 409 "in flight")
        assert retried.status_code == 201 and _count(base, "m1") == 1
        # an error answer is the view's own (DRF's 400s): still nothing committed
        answered = _order(base, "m2", **{"X-Rollback": "1", "X-Status": "400"})
        assert answered.status_code == 400 and answered.json() == {"status": 400}
        assert _count(base, "m2") == 0
        assert project.record("m2").status is Status.FAILED


def test_a_transaction_marked_for_rollback_in_plain_code_and_a_raising_hook(
    project: Project,
) -> None:
    seen = project.run("scenario", "marked", project.native_url)
    assert seen["plain"] == "TransactionManagementError"
    assert seen["plain_after"] == [0, "failed"]  # nothing committed, retryable
    # the hook raised after the COMMIT: a 500, but the attempt completed (no false alert)
    assert seen["hook"] == [500, 201, "true"]
    assert seen["hook_after"] == [1, ["completed", "failed"]]  # (the first: plain code's)
    assert seen["logged"] == []


def test_an_aborted_transaction_is_the_views_error_not_the_stores(project: Project) -> None:
    """An error the view caught without a savepoint aborts PostgreSQL's transaction: the
    completion fails as the view's bug (500), not as an unreachable store (503)."""
    if project.vendor != "postgresql":
        pytest.skip("an aborted transaction: PostgreSQL's")
    with project.serve("wsgi") as base:
        for _ in range(2):
            answer = _order(base, "m1", **{"X-Swallow": "1"})
            assert answer.status_code == 500
            assert "idempotency_store_unavailable" not in answer.text
        assert _count(base, "m1") == 0
        record = project.record("m1")
        assert record.status is Status.FAILED and record.attempts == 2


def test_the_middleware_refuses_to_run_inside_an_outer_atomic(project: Project) -> None:
    """Inside an outer atomic() the middleware's block would be a savepoint (settled before
    anything commits): refused with an error that says so, nothing left in flight."""
    seen = project.run("scenario", "nested")
    assert seen["error"].startswith("RuntimeError: the idempotency middleware's transaction")
    # (SQLite's claim joined the outer transaction and rolled back with it)
    assert seen["rows"] == 0 and seen["records"] == (
        ["failed"] if project.vendor != "sqlite" else []
    )
    assert seen["retry"] == 201 and seen["rows_after"] == 1


def test_the_alias_prepare_threshold_is_honoured(project: Project) -> None:
    """Django prepares nothing by default (transaction poolers): the store's own
    connections follow the alias (its OPTIONS), unless the store's URL says otherwise."""
    if project.vendor != "postgresql":
        pytest.skip("prepared statements: PostgreSQL's")
    default = project.run("scenario", "prepare")
    assert (default["given"], default["threshold"], default["store_threshold"]) == (
        True,
        None,
        None,
    )
    assert default["django_cursor"] is False
    on = project.run("scenario", "prepare", db_options={"prepare_threshold": 5})
    assert on["threshold"] == 5
    by_url = project.run("scenario", "prepare", "prepare_threshold=5")
    assert by_url["store_threshold"] == 5 and by_url["threshold"] is None
    off = project.run(
        "scenario", "prepare", "prepare_threshold=none", db_options={"prepare_threshold": 5}
    )
    assert off["store_threshold"] is None and off["threshold"] == 5


def test_the_urls_libpq_parameters_win_over_the_aliass(project: Project) -> None:
    """``django://default?sslmode=...&connect_timeout=...``: what the store connects with
    (libpq's own parameters; the alias's otherwise)."""
    if project.vendor != "postgresql":
        pytest.skip("libpq parameters: PostgreSQL's")
    given = project.run(
        "scenario", "prepare", "connect_timeout=3&sslmode=disable&application_name=shop"
    )
    assert given["kwargs"]["sslmode"] == "disable"
    assert given["kwargs"]["connect_timeout"] == "3" and given["timeout"] == 3.0
    assert given["kwargs"]["application_name"] == "shop"
    plain = project.run("scenario", "prepare", "")
    assert "sslmode" not in plain["kwargs"] and plain["kwargs"]["connect_timeout"] == 2


@pytest.mark.parametrize("kind", ["wsgi", "asgi"])
def test_a_failed_commit_fails_the_attempt(project: Project, kind: str) -> None:
    """A foreign key Django checks at COMMIT (deferred) fails it: nothing committed, the
    record failed (retryable), so a retry runs again instead of "in flight"."""
    key = {"Idempotency-Key": "line-1", **CALLER}
    with project.serve(kind) as base:
        first = httpx.post(f"{base}/lines", json={}, headers=key, timeout=60)
        assert first.status_code == 500
        store = project.native()
        try:
            (record,) = store.records()
            assert record.status is Status.FAILED and record.attempts == 1
            retried = httpx.post(f"{base}/lines", json={}, headers=key, timeout=60)
            assert retried.status_code == 500  # ran again (the line is still orphaned)
            (record,) = store.records()
            assert record.status is Status.FAILED and record.attempts == 2
        finally:
            store.close()


@pytest.mark.parametrize("atomic", [False, True], ids=["atomic", "atomic-requests"])
def test_the_middleware_sends_no_savepoint_of_its_own(project: Project, atomic: bool) -> None:
    seen = project.run("scenario", "statements", "/orders", atomic=atomic)
    assert seen["status"] == 201 and seen["rows"] == 1
    # ATOMIC_REQUESTS: Django's own atomic() around the view, nested: a savepoint
    sent = [s for s in seen["statements"] if s != "BEGIN"]  # (SQLite's BEGIN IMMEDIATE)
    assert sent == (["SAVEPOINT", "INSERT", "RELEASE"] if atomic else ["INSERT"])


def test_without_the_transaction_the_write_commits_before_the_record(project: Project) -> None:
    """``transactional: False``: the middleware as with any store (the 500's write stays)."""
    with project.serve("wsgi", transactional=False) as base:
        assert _order(base, "m1", **{"X-Fail": "1"}).status_code == 500
        assert _count(base, "m1") == 1  # committed by the view; the record failed
        assert project.record("m1").status is Status.FAILED


def test_a_worker_killed_in_the_view_leaves_neither(project: Project) -> None:
    with project.serve("wsgi", lease=1) as base, pytest.raises(httpx.TransportError):
        _order(base, "m1", **{"X-Crash": "1"})
    assert project.record("m1").status is Status.PROCESSING
    with project.serve("wsgi", lease=1) as base:
        assert _count(base, "m1") == 0
        retried = _order(base, "m1")  # waits for the dead worker's lease, then runs
        assert retried.status_code == 201
        assert _count(base, "m1") == 1
    assert project.record("m1").attempts == 2


def test_a_lost_lease_rolls_the_views_writes_back(project: Project, tmp_path: Path) -> None:
    """A worker stalled mid-view (SIGSTOP: no lease renewal) while another takes the key
    over: its order rolls back, the new owner's order and record stay. PostgreSQL only:
    on SQLite the stalled view's transaction holds the write lock, so nobody can take
    the key over before it ends."""
    if project.vendor != "postgresql":
        pytest.skip("SQLite's one writer: a takeover waits for the stalled view's commit")
    gate, written = tmp_path / "gate", tmp_path / "written"
    native = project.native()
    with (
        project.serve("wsgi", lease=1) as first,
        project.serve("wsgi", lease=1) as second,
        ThreadPoolExecutor(2) as pool,
    ):
        hold = {"X-Hold": str(gate), "X-Written": str(written)}
        stale = pool.submit(_order, first, "m1", **hold)
        _until(written.exists)  # its order row is written, not committed
        os.kill(project.pids[first], signal.SIGSTOP)  # no renewal: the lease runs out
        try:
            taker = pool.submit(_order, second, "m1")  # waits out the lease, takes over
            _until(lambda: _attempts(native, "m1") == 2)
            gate.touch()
        finally:
            os.kill(project.pids[first], signal.SIGCONT)
        lost, won = stale.result(timeout=60), taker.result(timeout=60)
        assert lost.status_code == 409, lost.text
        assert lost.json()["code"] == "idempotency_lease_lost"
        assert won.status_code == 201, won.text
        assert _count(second, "m1") == 1  # the new owner's order only
        assert _order(first, "m1").json() == won.json()  # its answer is the one replayed
    record = project.record("m1")
    assert record.status is Status.COMPLETED and record.attempts == 2
    native.close()


def _attempts(store: Any, mandate: str) -> int:
    found = store.records(key=IMAP.key("order", cart_mandate_id=mandate, user_id="u"))
    return int(found[0].attempts) if found else 0


def _until(condition: Callable[[], bool], timeout: float = 60) -> None:
    """Poll ``condition`` (a state another process reaches) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


def test_racing_processes_and_threads_create_one_order(project: Project) -> None:
    """4 server processes x 8 concurrent requests on one mandate: one row, one answer."""
    with (
        project.serve() as a,
        project.serve() as b,
        project.serve() as c,
        project.serve("asgi") as d,
        ThreadPoolExecutor(32) as pool,
    ):
        bases = [a, b, c, d] * 8
        answers = list(pool.map(lambda base: _order(base, "m1"), bases))
        assert _count(a, "m1") == 1
    assert {r.status_code for r in answers} == {201}
    assert len({r.content for r in answers}) == 1
    assert sum(r.headers.get("idempotent-replayed") != "true" for r in answers) == 1


def test_misuse_is_refused(project: Project) -> None:
    assert project.run("scenario", "middleware", "django://default", "true") == "alias=default"
    assert project.run("scenario", "middleware", "django://default", "false") == "alias=None"
    refused = project.run("scenario", "middleware", "memory://", "true")
    assert "transactional=True needs a django:// store" in refused
    seen = project.run("scenario", "misuse")
    assert seen["vendor"].startswith("ValueError: django://other: the database is unknown")
    assert seen["alias"].startswith("ValueError: django://nowhere: settings.DATABASES has no")
    assert seen["own_connection"] == "accepted"
    assert seen["other_connection"].startswith("ValueError: the Django store of 'default'")
    assert seen["atransaction"].startswith("TypeError: Django's transactions are sync")
