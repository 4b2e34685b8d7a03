"""examples/sqlalchemy_orders.py in a real process: a duplicate storm, and a crash of
the app mid-request (after the ORM flush, before the commit) and its restart, on a
SQLite file and on PostgreSQL. One order per cart mandate, every time."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy
from _http_servers import Process, free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "sqlalchemy_orders.py"
sys.path.insert(0, str(EXAMPLE.parent))
from sqlalchemy_orders import storm  # noqa: E402


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/shop.db"
    server = request.getfixturevalue("postgres_server")
    # a database of its own: the example's tables have fixed names
    name = f"shop_{uuid.uuid4().hex[:8]}"
    admin = sqlalchemy.create_engine(
        server.url.replace("postgresql://", "postgresql+psycopg://", 1),
        isolation_level="AUTOCOMMIT",
    )
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    admin.dispose()
    base = server.url.replace("postgresql://", "postgresql+psycopg://", 1).rsplit("/", 1)[0]
    return f"{base}/{name}"


def _serve(database_url: str, port: int, **env: str) -> Process:
    argv = [sys.executable, str(EXAMPLE), "--port", str(port), "--lease", "1", "--wait", "10"]
    return Process(argv, port, {"DATABASE_URL": database_url, **env}, health="/orders")


def _orders(database_url: str) -> list[Any]:
    engine = sqlalchemy.create_engine(database_url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.exec_driver_sql("SELECT cart_mandate_id FROM orders")]
    finally:
        engine.dispose()


def test_a_storm_of_duplicates_makes_one_order_per_mandate(database_url: str) -> None:
    with _serve(database_url, free_port()) as app:
        assert storm(app.url, mandates=12, copies=6) == []
    rows = _orders(database_url)
    assert len(rows) == 12 and len(set(rows)) == 12


def test_a_crash_mid_request_and_a_restart_make_one_order(database_url: str) -> None:
    port = free_port()
    order = {"cart_mandate_id": "cm_crash", "total": 42}
    headers = {"Idempotency-Key": "k-crash", "X-User-Id": "alice"}
    with _serve(database_url, port, SQLALCHEMY_ORDERS_CRASH="after_flush") as app:
        with pytest.raises(httpx.TransportError):  # the process died after the flush
            httpx.post(f"{app.url}/orders", json=order, headers=headers, timeout=30)
        assert app.proc is not None and app.proc.wait(30) == -9
    assert _orders(database_url) == []  # the flushed row died with its transaction
    with _serve(database_url, port) as app:  # restarted; the dead request's lease runs out
        first = httpx.post(f"{app.url}/orders", json=order, headers=headers, timeout=30)
        again = httpx.post(f"{app.url}/orders", json=order, headers=headers, timeout=30)
    assert first.status_code == 201 and first.json()["cart_mandate_id"] == "cm_crash"
    assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    assert _orders(database_url) == [("cm_crash",)]


def test_the_examples_own_check() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--check"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "one order per cart mandate" in done.stdout
