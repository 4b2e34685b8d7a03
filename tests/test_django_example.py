"""examples/django_orders, run for real: migrate, runserver on a free loopback port, a
duplicate storm, one order per cart mandate (checked by the shop and in its database)."""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "django_orders"
SRC = Path(__file__).resolve().parent.parent / "src"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_listening(proc: subprocess.Popen[str], port: int) -> None:
    """Until the server accepts connections (its stdout says it starts before it binds)."""
    assert proc.stdout is not None
    for line in proc.stdout:  # "Starting development server at ..." comes first
        if "Starting development server" in line:
            break
    while proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return
        except ConnectionRefusedError:
            continue
    raise AssertionError(f"runserver exited with {proc.returncode}")


def test_the_example_shop_creates_one_order_per_mandate(tmp_path: Path) -> None:
    db = tmp_path / "shop.sqlite3"
    env = dict(os.environ, ORDERS_DB=str(db), PYTHONPATH=str(SRC), PYTHONUNBUFFERED="1")
    manage = [sys.executable, str(EXAMPLE / "manage.py")]
    subprocess.run([*manage, "migrate", "-v", "0"], env=env, check=True, timeout=120)
    port = _free_port()
    server = subprocess.Popen(
        [*manage, "runserver", f"127.0.0.1:{port}", "--noreload"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_listening(server, port)
        base = f"http://127.0.0.1:{port}"
        storm_args = ["--mandates", "10", "--copies", "6", "--check"]
        storm = subprocess.run(
            [sys.executable, str(EXAMPLE / "storm.py"), base, *storm_args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert storm.returncode == 0, storm.stdout + storm.stderr
        assert "OK: one order per cart mandate" in storm.stdout
        refused = httpx.post(f"{base}/orders", json={}, headers={"Authorization": "Bearer u"})
        assert refused.status_code == 400  # require_key: no Idempotency-Key
    finally:
        server.kill()
        server.wait(timeout=30)
    with sqlite3.connect(db) as conn:
        orders = conn.execute(
            "SELECT count(*), count(DISTINCT cart_mandate_id) FROM orders_order"
        ).fetchone()
        records = conn.execute("SELECT count(*) FROM retrysafe_records").fetchone()[0]
    assert orders == (10, 10)
    assert records == 10  # one completed record per order, in the same file
    stats = subprocess.run(
        [*manage, "retrysafe_stats", "--json"], env=env, capture_output=True, text=True, timeout=60
    )
    assert stats.returncode == 0, stats.stderr
    assert '"completed": 10' in stats.stdout
