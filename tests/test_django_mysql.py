"""The Django app and store on MySQL/MariaDB (Django's ``mysql`` backend, mysqlclient):
migrate creates the native MySQL tables, ``att.transaction()`` and the transactional
middleware commit the order and its completion together on Django's connection, a
rollback leaves neither, a replay adds nothing, and racing server processes make one
order per cart mandate. Each Django project runs in processes of its own (see
tests/test_django_orm.py, whose project runner this reuses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pymysql
import pytest
from _servers import MySQLServer
from test_django_orm import SRC, Project, _count, _order

from retrysafe import Status
from retrysafe.stores.mysql import SCHEMA_VERSION


def _admin(server: MySQLServer, statement: str) -> None:
    conn = pymysql.connect(
        host="127.0.0.1", port=int(server.url.rsplit(":", 1)[1].split("/")[0]), user=server.user
    )
    try:
        conn.cursor().execute(statement)
    finally:
        conn.close()


@pytest.fixture
def project(mysql_server: MySQLServer) -> Iterator[Project]:
    """A migrated project on a new MariaDB database."""
    name = f"dj_{uuid.uuid4().hex[:12]}"
    _admin(mysql_server, f"CREATE DATABASE {name}")
    url = mysql_server.url.rpartition("/")[0] + f"/{name}"
    made = Project(url, url, "mysql")
    made.run("migrate")
    yield made
    _admin(mysql_server, f"DROP DATABASE {name}")


def _tables(project: Project) -> dict[str, Any]:
    url = project.db.removeprefix("mysql://")
    user, _, rest = url.partition("@")
    host, _, database = rest.partition("/")
    conn = pymysql.connect(
        host=host.split(":")[0], port=int(host.split(":")[1]), user=user, database=database
    )
    try:
        cur = conn.cursor()
        cur.execute(
            "SELECT table_name, engine FROM information_schema.tables WHERE table_schema = %s",
            (database,),
        )
        found: dict[str, Any] = dict(cur.fetchall())
        cur.execute("SELECT MAX(version) FROM retrysafe_records_schema")
        found["version"] = cur.fetchone()[0]  # type: ignore[index]
        return found
    finally:
        conn.close()


def test_migrate_creates_the_native_tables_and_plain_code_commits_together(
    project: Project,
) -> None:
    """The native store's InnoDB tables and version; ``att.transaction()`` in plain code:
    commit together, replay, roll back together (outside and inside an outer atomic),
    a stale worker's write rolled back; the CLI, the commands and the model read the
    records."""
    tables = _tables(project)
    assert tables["retrysafe_records"] == "InnoDB" and tables["version"] == SCHEMA_VERSION
    assert "django_orm_app_order" in tables
    seen = project.run("scenario", "transactions", project.native_url)
    plain = seen["plain"]
    assert plain["after_first"] == [1, "completed"]
    assert plain["replayed"] is True and plain["after_replay"] == 1
    assert plain["after_raise"] == [0, "failed"]  # the row and the completion rolled back
    assert plain["after_retry"] == [1, "completed"]
    outer = seen["outer"]
    assert outer["inside"] == [1, "processing"]  # the claim committed on its own
    assert outer["committed"] == [1, "completed"]  # the completion: with the outer block
    assert outer["rolled_back"] == [0, "processing"]
    stale = seen["stale"]
    assert stale["lease_lost"] is True and stale["taker_attempts"] == 2
    assert stale["rows"] == 0 and stale["record"] == ["processing", True]
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
    assert project.run("manage", "retrysafe_stats", "--json")["by_status"] == by_status
    model = project.run("scenario", "records")  # the app's model reads MySQL's text columns
    assert ["order", "completed", "order:p1:u", True] in model
    assert len(model) == sum(by_status.values())
    assert project.run("manage", "retrysafe_sweep", "--json")["deleted"] == 0


@pytest.mark.parametrize(
    ("kind", "path"), [("wsgi", "/orders"), ("asgi", "/aorders")], ids=["wsgi", "asgi"]
)
def test_the_middleware_commits_together_rolls_back_together_and_replays(
    project: Project, kind: str, path: str
) -> None:
    with project.serve(kind) as base:
        first = _order(base, "m1", path=path)
        assert first.status_code == 201
        assert project.record("m1").status is Status.COMPLETED
        again = _order(base, "m1", path=path)
        assert again.headers["idempotent-replayed"] == "true"
        assert again.json() == first.json() and _count(base, "m1") == 1  # no second row
        failed = _order(base, "m2", path=path, **{"X-Fail": "1"})  # raises after its write
        assert failed.status_code == 500
        assert _count(base, "m2") == 0  # neither the row ...
        assert project.record("m2").status is Status.FAILED  # ... nor a completion
        marked = _order(base, "m3", path=path, **{"X-Rollback": "1"})  # set_rollback(True)
        assert marked.status_code == 500 and marked.json()["code"] == "idempotency_rolled_back"
        assert _count(base, "m3") == 0 and project.record("m3").status is Status.FAILED
        retried = _order(base, "m2", path=path)
        assert retried.status_code == 201 and _count(base, "m2") == 1
        assert _order(base, "m2", path=path).json() == retried.json()
        assert _count(base, "m2") == 1


def test_racing_processes_create_one_order(project: Project) -> None:
    """3 processes x 8 threads of plain ``att.transaction()`` on one mandate (two users),
    then 4 server processes (3 WSGI, 1 ASGI) x 8 concurrent requests on another: one
    row, one answer, one run each."""
    with ThreadPoolExecutor(3) as pool:
        runs = list(pool.map(lambda _: project.run("scenario", "race", "8"), range(3)))
    won = [a for seen in runs for a in seen["answers"] if a != "taken"]
    assert won and all(a == won[0] for a in won)  # one order, every winner's answer
    assert all(seen["rows"] == 1 for seen in runs)
    with (
        project.serve() as a,
        project.serve() as b,
        project.serve() as c,
        project.serve("asgi") as d,
        ThreadPoolExecutor(32) as pool,
    ):
        answers = list(pool.map(lambda base: _order(base, "m2"), [a, b, c, d] * 8))
        assert _count(a, "m2") == 1
    assert {r.status_code for r in answers} == {201}
    assert len({r.content for r in answers}) == 1
    assert sum(r.headers.get("idempotent-replayed") != "true" for r in answers) == 1
    assert project.record("m2").attempts == 1


def test_binary_answers_and_a_session_that_is_not_strict(project: Project) -> None:
    """A 1 MiB answer of every byte value, completed on Django's mysqlclient connection,
    reads back intact; a Django connection that is not strict is refused: neither the
    row nor the completion commits."""
    seen = project.run("scenario", "binary", project.native_url, "bin")
    assert seen == {"refused": "", "status": "completed", "same": True, "rows": 1}
    lax = {"init_command": "SET SESSION sql_mode = 'NO_ENGINE_SUBSTITUTION'"}
    seen = project.run("scenario", "binary", project.native_url, "lax", db_options=lax)
    assert seen["refused"].startswith("StoreUnavailableError: ") and "not strict" in seen["refused"]
    assert (seen["status"], seen["rows"]) == ("failed", 0)
