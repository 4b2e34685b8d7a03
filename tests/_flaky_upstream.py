"""A flaky upstream for the client tests: an ASGI app run by uvicorn in its own process.

``POST /work?mode=MODE`` with a JSON body ``{"id": ID}`` does the work of
mutation ``ID`` (one row in the ``effects`` table of the SQLite file in
``$FLAKY_DB``), but flakily, by ``MODE``:

- ``ok``: does the work and answers 201 ``{"id": ID, "effect": N}``;
- ``503`` (``&n=N``): answers 503 to the first ``N`` calls of ``ID``, then works;
- ``drop`` (``&n=N``): the first ``N`` calls of ``ID`` start an answer and drop the
  connection half-way, before any work;
- ``slow`` (``&s=SECONDS``): does the work at once, then sleeps (past the
  caller's timeout) before answering.

``GET /health`` answers 200.

:func:`serve` runs it in a process of its own behind retrysafe: the gateway
(another process) or the ASGI middleware (in the app's process).
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import sys
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _http_servers import Process, free_port, uvicorn_argv

from retrysafe._http.asgi import at_most, read_body

SCHEMA = "CREATE TABLE IF NOT EXISTS effects (n INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT)"


def effects(db: str) -> dict[str, int]:
    """How many times each mutation took effect."""
    with sqlite3.connect(db) as conn:
        conn.execute(SCHEMA)
        rows = conn.execute("SELECT id, COUNT(*) FROM effects GROUP BY id").fetchall()
    return {row[0]: row[1] for row in rows}


class Flaky:
    def __init__(self, db: str) -> None:
        self.conn = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute(SCHEMA)
        self.calls: dict[str, int] = {}

    def work(self, ident: str) -> int:
        cur = self.conn.execute("INSERT INTO effects (id) VALUES (?)", (ident,))
        return int(cur.lastrowid or 0)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive, at_most(1 << 20)) or b""
        if scope["path"] == "/health":
            await answer(send, 200, {"ok": True})
            return
        if scope["path"] != "/work" or scope["method"] != "POST":
            await answer(send, 404, {"error": "not found"})
            return
        query = dict(urllib.parse.parse_qsl(scope["query_string"].decode("latin-1")))
        ident = str(json.loads(body)["id"])
        mode = query.get("mode", "ok")
        calls = self.calls[ident] = self.calls.get(ident, 0) + 1
        if mode == "503" and calls <= int(query.get("n", 1)):
            await answer(send, 503, {"error": "busy"})
            return
        if mode == "drop" and calls <= int(query.get("n", 1)):
            start = {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"1000")],
            }
            await send(start)
            await send({"type": "http.response.body", "body": b"{", "more_body": True})
            raise ConnectionAbortedError("dropped on purpose")  # uvicorn closes the socket
        effect = self.work(ident)
        if mode == "slow":
            await asyncio.sleep(float(query.get("s", 1)))
        await answer(send, 201, {"id": ident, "effect": effect})


async def answer(send: Any, status: int, doc: object) -> None:
    body = json.dumps(doc).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def app_from_env() -> Flaky:
    """The app over ``$FLAKY_DB``: a factory for ``uvicorn --factory``."""
    return Flaky(os.environ["FLAKY_DB"])


def app_with_middleware_from_env() -> Any:
    """The app behind retrysafe's ASGI middleware on ``$FLAKY_STORE``."""
    from retrysafe.asgi import IdempotencyMiddleware

    return IdempotencyMiddleware(app_from_env(), store=os.environ["FLAKY_STORE"])


#: The ways :func:`serve` puts retrysafe in front of the flaky app.
FRONTS = ("gateway", "middleware")


@contextmanager
def serve(front: str, root: Path) -> Iterator[tuple[str, str]]:
    """(retrysafe's URL, the effects DB): the flaky app behind ``front``, in real processes."""
    db, store = str(root / "effects.db"), f"sqlite:///{root / 'retrysafe.db'}"
    port = free_port()
    if front == "middleware":
        argv = uvicorn_argv("_flaky_upstream:app_with_middleware_from_env", port)
        with Process(argv, port, {"FLAKY_DB": db, "FLAKY_STORE": store}, health="/health") as p:
            yield p.url, db
        return
    argv = uvicorn_argv("_flaky_upstream:app_from_env", port)
    with Process(argv, port, {"FLAKY_DB": db}, health="/health") as upstream:
        gp = free_port()
        gateway = [
            sys.executable,
            "-m",
            "retrysafe",
            "gateway",
            "--upstream",
            upstream.url,
            "--store",
            store,
            "--listen",
            f"127.0.0.1:{gp}",
        ]
        with Process(gateway, gp, health="/_retrysafe/health") as g:
            yield g.url, db
