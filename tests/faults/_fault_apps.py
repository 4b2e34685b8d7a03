"""The apps the fault tests run in real processes, and where they count their side effects.

Both count in a SQLite file of their own (``$FAULT_ROOT/effects.db``, WAL), so a
test can tell how often each key's side effect ran across worker processes,
whichever of them died:

- :class:`Work` is the protected app (behind :mod:`retrysafe.asgi`'s middleware,
  :func:`app_from_env`). ``POST /work`` with the key in ``Idempotency-Key`` logs a
  start ``(key, pid)``, then (body ``{"hold": true}``, first start of the key only)
  waits until the file ``$FAULT_ROOT/release`` exists, then writes one effect row
  and answers 201 ``{"key", "effect": n, "pid", "pad"}`` (``pad`` echoed from the
  body). A worker killed while it holds
  a request has started it but written no effect.
- :class:`Upstream` is what ``retrysafe gateway`` fronts (:func:`upstream_from_env`).
  ``POST /charge`` logs a call ``(key, client port)``, writes the effect once per
  ``Idempotency-Key`` (the key the gateway forwards: the upstream dedupes on it),
  then (``{"hold": true}``, first call of the key only) waits for the release
  file before it answers 201 ``{"key", "effect": n}``. A gateway worker killed
  while it waits has had the effect done upstream, but recorded nothing.

``GET /health`` answers 200 in both.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS starts (key TEXT, pid INTEGER, t REAL);
CREATE TABLE IF NOT EXISTS calls (key TEXT, port INTEGER, t REAL);
CREATE TABLE IF NOT EXISTS effects (
    n INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT, pid INTEGER, t REAL);
CREATE TABLE IF NOT EXISTS upstream_effects (
    n INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT UNIQUE, t REAL);
"""
HOLD_LIMIT = 90.0  # a held request gives up waiting for the release after this long


def connect(root: str | Path) -> sqlite3.Connection:
    """A connection to the effects file (created with its tables if needed)."""
    conn = sqlite3.connect(
        Path(root) / "effects.db", timeout=60, isolation_level=None, check_same_thread=False
    )
    conn.execute("PRAGMA journal_mode=WAL")
    conn.executescript(SCHEMA)
    return conn


async def _body(receive: Any) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return body


async def _answer(send: Any, status: int, doc: object) -> None:
    body = json.dumps(doc).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


class _App:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.conn = connect(root)

    async def hold(self) -> None:
        """Wait until the test releases held requests (or HOLD_LIMIT passes)."""
        deadline = time.monotonic() + HOLD_LIMIT
        while not (self.root / "release").exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = await _body(receive)
        if scope["path"] == "/health":
            await _answer(send, 200, {"ok": True})
            return
        headers = dict(scope["headers"])
        key = headers.get(b"idempotency-key", b"").decode("latin-1")
        doc = json.loads(body) if body else {}
        await self.handle(scope, key, doc, send)

    async def handle(self, scope: dict[str, Any], key: str, doc: Any, send: Any) -> None:
        raise NotImplementedError


class Work(_App):
    async def handle(self, scope: dict[str, Any], key: str, doc: Any, send: Any) -> None:
        if scope["path"] != "/work" or scope["method"] != "POST":
            await _answer(send, 404, {"error": "not found"})
            return
        pid = os.getpid()
        self.conn.execute("INSERT INTO starts VALUES (?, ?, ?)", (key, pid, time.time()))
        (starts,) = self.conn.execute(
            "SELECT COUNT(*) FROM starts WHERE key = ?", (key,)
        ).fetchone()
        if doc.get("hold") and starts == 1:
            await self.hold()
        cur = self.conn.execute(
            "INSERT INTO effects (key, pid, t) VALUES (?, ?, ?)", (key, pid, time.time())
        )
        answer = {"key": key, "effect": cur.lastrowid, "pid": pid, "pad": doc.get("pad", "")}
        await _answer(send, 201, answer)


class Upstream(_App):
    async def handle(self, scope: dict[str, Any], key: str, doc: Any, send: Any) -> None:
        if scope["path"] != "/charge" or scope["method"] != "POST":
            await _answer(send, 404, {"error": "not found"})
            return
        port = scope["client"][1]
        self.conn.execute("INSERT INTO calls VALUES (?, ?, ?)", (key, port, time.time()))
        (calls,) = self.conn.execute("SELECT COUNT(*) FROM calls WHERE key = ?", (key,)).fetchone()
        # The effect, once per forwarded key: a retry of it finds the first one.
        self.conn.execute(
            "INSERT OR IGNORE INTO upstream_effects (key, t) VALUES (?, ?)", (key, time.time())
        )
        (n,) = self.conn.execute("SELECT n FROM upstream_effects WHERE key = ?", (key,)).fetchone()
        if doc.get("hold") and calls == 1:
            await self.hold()
        await _answer(send, 201, {"key": key, "effect": n})


def app_from_env() -> Any:
    """:class:`Work` behind the ASGI middleware on ``$FAULT_STORE`` with lease ``$FAULT_LEASE``."""
    from retrysafe.asgi import IdempotencyMiddleware

    return IdempotencyMiddleware(
        Work(os.environ["FAULT_ROOT"]),
        store=os.environ["FAULT_STORE"],
        lease=float(os.environ["FAULT_LEASE"]),
    )


def upstream_from_env() -> Any:
    """:class:`Upstream`, bare: the gateway's upstream process."""
    return Upstream(os.environ["FAULT_ROOT"])
