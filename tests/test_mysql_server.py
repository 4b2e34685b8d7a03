"""The MariaDB servers the MySQL store's tests run on (tests/_servers.py).

They must be what the fixtures promise: unprivileged, on loopback only, InnoDB, the
isolation asked for, and a SIGKILL followed by a start must keep committed data.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pymysql
import pytest
from _servers import MySQLServer


def connect(server: MySQLServer) -> Any:
    """A PyMySQL connection from the server's URL (autocommit)."""
    url = urlsplit(server.url)
    return pymysql.connect(
        host=url.hostname,
        port=url.port,
        user=url.username,
        database=url.path.lstrip("/"),
        autocommit=True,
        connect_timeout=30,
    )


def scalar(server: MySQLServer, sql: str) -> Any:
    conn = connect(server)
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
            row = cur.fetchone()
    finally:
        conn.close()
    assert row is not None
    return row[0]


def isolation(server: MySQLServer) -> str:
    """The server's default isolation: ``@@transaction_isolation`` (MySQL 8, MariaDB
    11.1+) or ``@@tx_isolation`` (MariaDB 10.x)."""
    try:
        return str(scalar(server, "SELECT @@GLOBAL.transaction_isolation"))
    except pymysql.err.OperationalError as exc:
        if exc.args[0] != 1193:  # ER_UNKNOWN_SYSTEM_VARIABLE
            raise
    return str(scalar(server, "SELECT @@GLOBAL.tx_isolation"))


def listeners(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp*) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            address, hex_port = cols[1].rsplit(":", 1)
            if int(hex_port, 16) == port and cols[3] == "0A":  # TCP_LISTEN
                found.add(address)
    return found


def test_server_runs_unprivileged_on_loopback_only(mysql_server: MySQLServer) -> None:
    assert mysql_server.running and mysql_server.pid is not None
    status = Path(f"/proc/{mysql_server.pid}/status").read_text()
    uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
    assert "0" not in uids, status  # real, effective, saved, filesystem
    if os.geteuid() == 0:
        assert mysql_server.os_user is not None
    assert scalar(mysql_server, "SELECT @@bind_address") == "127.0.0.1"
    assert listeners(mysql_server.port) == {"0100007F"}  # 127.0.0.1, nothing else


def test_url_user_has_its_database_and_innodb(mysql_server: MySQLServer) -> None:
    url = urlsplit(mysql_server.url)
    assert (url.scheme, url.hostname, url.port) == ("mysql", "127.0.0.1", mysql_server.port)
    assert scalar(mysql_server, "SELECT CURRENT_USER()") == "retrysafe@127.0.0.1"
    assert scalar(mysql_server, "SELECT DATABASE()") == "retrysafe"
    assert scalar(mysql_server, "SELECT @@default_storage_engine") == "InnoDB"
    assert scalar(mysql_server, "SELECT @@character_set_server") == "utf8mb4"
    assert isolation(mysql_server) == "REPEATABLE-READ"


def test_rc_server_is_read_committed(mysql_rc_server: MySQLServer) -> None:
    assert isolation(mysql_rc_server) == "READ-COMMITTED"
    conn = connect(mysql_rc_server)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT @@SESSION.tx_isolation")  # a new session inherits it
            assert cur.fetchone() == ("READ-COMMITTED",)
    finally:
        conn.close()


@pytest.fixture
def private_server() -> Iterator[MySQLServer]:
    """A server of this test's own, since it is killed."""
    with MySQLServer() as server:
        yield server


def test_kill_then_start_keeps_committed_rows(private_server: MySQLServer) -> None:
    server = private_server
    port, pid = server.port, server.pid
    conn = connect(server)
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE t (k INT PRIMARY KEY, v VARCHAR(20)) ENGINE=InnoDB")
        cur.executemany("INSERT INTO t VALUES (%s, %s)", [(i, f"v{i}") for i in range(100)])
        conn.begin()
        cur.execute("INSERT INTO t VALUES (1000, 'uncommitted')")  # lost with the crash
    server.kill()
    assert not server.running
    with pytest.raises(pymysql.err.OperationalError), conn.cursor() as cur:
        cur.execute("SELECT 1")
    conn.close()
    server.start()
    assert server.running and server.port == port and server.pid != pid
    assert scalar(server, "SELECT COUNT(*) FROM t WHERE k < 100") == 100
    assert scalar(server, "SELECT COUNT(*) FROM t WHERE k = 1000") == 0
    assert server.log_path is not None
    log = server.log_path.read_text()
    # InnoDB saw the crash: it recovered from its redo log, or rolled back the open
    # transaction that the log recorded.
    assert "crash recovery" in log or "recovered transaction" in log, log[-3000:]
    server.restart()  # a clean stop and start: same port, same rows
    assert server.port == port
    assert scalar(server, "SELECT GROUP_CONCAT(v ORDER BY k) FROM t WHERE k < 3") == "v0,v1,v2"


def test_close_removes_the_data_directory() -> None:
    server = MySQLServer()
    server.start()
    log_path = server.log_path
    assert log_path is not None and log_path.exists()
    server.close()
    assert not server.running
    assert not log_path.parent.exists()
