"""A Django process for tests/test_mysql_orm_tx_ended.py: ``python _django_tx_ended.py
NATIVE_URL`` with run.py's environment (``RS_DB``: a ``mysql://`` URL). A block that
catches its deadlock and goes on, and one that runs DDL, on the ``django://`` store;
prints what it saw as one JSON line."""

from __future__ import annotations

import json
import sys
import threading
from typing import Any
from urllib.parse import urlsplit

import pymysql
from django_orm_app.run import configure

configure()

from django.db import OperationalError, connection  # noqa: E402

from retrysafe import Engine, Outcome, StoreUnavailableError, open_store  # noqa: E402
from retrysafe._model.hashing import key_hash  # noqa: E402

seen: dict[str, Any] = {}


def rival(url: str, locked: threading.Event) -> None:
    """Heavier than the block (200 rows written): locks row 2, then asks for row 1."""
    parts = urlsplit(url)
    conn = pymysql.connect(
        host=parts.hostname, port=parts.port, user=parts.username, database=parts.path[1:]
    )
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO rs_rows VALUES (%s, 0)", [(i,) for i in range(100, 300)])
        cur.execute("SELECT v FROM rs_rows WHERE id = 2 FOR UPDATE")
        locked.set()
        cur.execute("SELECT v FROM rs_rows WHERE id = 1 FOR UPDATE")
    conn.rollback()
    conn.close()


def deadlocked(url: str) -> None:
    with connection.cursor() as cur:
        cur.execute("UPDATE rs_rows SET v = 42 WHERE id = 1")
        locked = threading.Event()
        other = threading.Thread(target=rival, args=(url, locked))
        other.start()
        locked.wait(10)
        try:
            cur.execute("SELECT v FROM rs_rows WHERE id = 2 FOR UPDATE")
        except OperationalError as exc:
            seen["caught"] = exc.args[0]  # and the block goes on
        other.join()


def ddl(url: str) -> None:
    with connection.cursor() as cur:
        cur.execute("CREATE TABLE IF NOT EXISTS rs_ddl (id INT)")


def main(native_url: str) -> None:
    native = open_store(native_url)
    engine = Engine("django://default")
    with connection.cursor() as cur:
        cur.execute("CREATE TABLE rs_rows (id INT PRIMARY KEY, v INT NOT NULL) ENGINE=InnoDB")
        cur.execute("INSERT INTO rs_rows VALUES (1, 0), (2, 0)")
    for name, block in [("deadlock", deadlocked), ("ddl", ddl)]:
        try:
            with engine.attempt(name, operation="order") as att, att.transaction():
                block(native_url)
                att.outcome = Outcome.json(name)
            seen[name] = "completed"
        except StoreUnavailableError as exc:
            seen[name] = "refused" if "nothing was committed" in str(exc) else str(exc)
        seen[f"{name}_status"] = native.get(key_hash("", "order", name)).status.value  # type: ignore[union-attr]
    with connection.cursor() as cur:
        cur.execute("SELECT v FROM rs_rows WHERE id = 1")
        seen["v"] = cur.fetchone()[0]
    native.close()
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
