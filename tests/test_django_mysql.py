"""The Django app and store on MySQL/MariaDB (Django's ``mysql`` backend, mysqlclient).

The shared tests of tests/test_django_orm.py imported below run here on a real
MariaDB, with this module's ``project`` (a new database each): migrate creates the
native InnoDB tables (the CLI, the commands and the model read them),
``att.transaction()`` in plain code and the transactional middleware (WSGI, ASGI)
commit the order and its completion together, a rollback leaves neither, a replay
adds no row, and racing threads, processes and server processes make one order per
cart mandate. The tests defined here are MySQL's own: binary answers through
mysqlclient, and a Django session that is not strict.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pymysql
import pytest
from _servers import MySQLServer
from test_django_orm import (  # noqa: F401  (collected here, on MySQL)
    Project,
    test_a_crash_between_the_write_and_the_commit_leaves_neither,
    test_a_view_that_marks_its_transaction_for_rollback_fails_the_attempt,
    test_migrate_creates_the_native_table,
    test_misuse_is_refused,
    test_racing_processes_and_threads_create_one_order,
    test_racing_processes_in_plain_code_create_one_order,
    test_racing_threads_create_one_order,
    test_the_middleware_commits_the_order_and_its_record_together,
    test_the_middleware_refuses_to_run_inside_an_outer_atomic,
    test_the_middleware_sends_no_savepoint_of_its_own,
    test_transaction_in_plain_code,
    test_without_the_transaction_the_write_commits_before_the_record,
)


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


def test_an_answer_over_the_packet_is_refused_before_it_is_sent(project: Project) -> None:
    """A completion over the Django connection's max_allowed_packet (16 MiB on MariaDB)
    is refused before it is sent (the server would close the connection mid-write, an
    outage to the engine): the attempt fails finally, the order is rolled back."""
    size = str(32 * 2**20)
    seen = project.run("scenario", "binary", project.native_url, "big", size)
    assert "max_allowed_packet" in seen["refused"]
    assert (seen["status"], seen["rows"]) == ("failed", 0)


def test_the_stores_connections_take_the_aliass_address_not_its_session(
    project: Project,
) -> None:
    """Host, port, user, database (and ``ssl``, ``connect_timeout``) come from the alias;
    Django's own session settings (``init_command``, ``charset``, its converters) do not:
    the store's connections run in the native store's session."""
    options = {"connect_timeout": 7, "charset": "utf8", "init_command": "SET @x = 1"}
    seen = project.run("scenario", "mysql_params", db_options=options)
    assert seen["kwargs"] == ["database", "host", "port", "user"]
    assert seen["timeout"] == 7.0 and seen["table"] == "retrysafe_records"
    assert seen["repr"] == "<DjangoStore django://default mysql table=retrysafe_records>"
    by_url = project.run(
        "scenario", "mysql_params", "connect_timeout=3&table=idem", db_options=options
    )
    assert (by_url["timeout"], by_url["table"]) == (3.0, "idem")


def test_a_failed_migration_frees_the_named_lock(mysql_server: MySQLServer) -> None:
    """migrate by a user who may not CREATE fails with a typed error (not transient) and
    releases the migration lock on Django's connection, which stays open: another
    store's migration in the same process does not wait for it."""
    name, user = f"dj_{uuid.uuid4().hex[:12]}", f"lim_{uuid.uuid4().hex[:8]}"
    _admin(mysql_server, f"CREATE DATABASE {name}")
    _admin(mysql_server, f"CREATE USER '{user}'@'127.0.0.1'")
    _admin(
        mysql_server, f"GRANT SELECT, INSERT, UPDATE, DELETE ON {name}.* TO '{user}'@'127.0.0.1'"
    )
    admin_url = mysql_server.url.rpartition("/")[0] + f"/{name}"
    try:
        Project(admin_url, admin_url, "mysql").run("manage", "migrate", "django_orm_app")
        limited = Project(
            admin_url.replace(f"//{mysql_server.user}@", f"//{user}@", 1), "", "mysql"
        )
        seen = limited.run("scenario", "failed_migration", admin_url)
        assert seen["error"].startswith("StoreUnavailableError: ") and "CREATE" in seen["error"]
        # a held migration lock would make it wait 30 s
        assert seen["transient"] is False and seen["waited"] < 20
    finally:
        _admin(mysql_server, f"DROP USER '{user}'@'127.0.0.1'")
        _admin(mysql_server, f"DROP DATABASE {name}")
