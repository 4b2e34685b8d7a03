"""A flaky imitation of a few Stripe endpoints: an ASGI app run by uvicorn in its own process.

``POST /v1/customers`` and ``POST /v1/payment_intents`` take a form-encoded body
(``email=…&metadata[mode]=slow``, as the official SDK sends it) and create a
``customer`` or ``payment_intent`` object shaped enough like Stripe's for the
SDK to parse. Every call that reaches the app is one row of the ``calls`` table
of the SQLite file in ``$STRIPE_DB`` (with the ``Idempotency-Key`` it carried);
a call that created an object also has the object's id there: one effect.

The answer is flaky by ``metadata[mode]``, counting the calls per key:

- ``ok``: creates the object and answers 200;
- ``503`` (``metadata[n]=N``): answers 503 to the first ``N`` calls, then works;
- ``drop`` (``metadata[n]=N``): closes the connection with no answer at all,
  before any work, on the first ``N`` calls;
- ``cut`` (``metadata[n]=N``): starts a 200 answer and breaks it off after one
  byte, before any work, on the first ``N`` calls;
- ``slow`` (``metadata[s]=SECONDS``): creates the object at once, then sleeps
  (past the caller's timeout) before answering.

Answers carry ``Request-Id`` and echo ``Idempotency-Key``, as Stripe's do.
``GET /health`` answers 200.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sqlite3
import time
import urllib.parse
from typing import Any

from retrysafe._http.asgi import at_most, read_body

SCHEMA = """CREATE TABLE IF NOT EXISTS calls (
    n INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT, path TEXT, mode TEXT, object_id TEXT)"""
PREFIXES = {"/v1/customers": "cus", "/v1/payment_intents": "pi"}
METADATA = re.compile(r"metadata\[(.+)\]")


def calls(db: str) -> list[sqlite3.Row]:
    """Every call that reached the upstream, in order: rows of key, path, mode, object_id."""
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        conn.execute(SCHEMA)
        return conn.execute("SELECT * FROM calls ORDER BY n").fetchall()


class StripeUpstream:
    def __init__(self, db: str) -> None:
        self.conn = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute(SCHEMA)
        self.counts: dict[str, int] = {}

    def record(self, key: str, path: str, mode: str, prefix: str | None = None) -> str | None:
        cur = self.conn.execute(
            "INSERT INTO calls (key, path, mode) VALUES (?, ?, ?)", (key, path, mode)
        )
        if prefix is None:
            return None
        object_id = f"{prefix}_{cur.lastrowid:08d}"
        self.conn.execute("UPDATE calls SET object_id = ? WHERE n = ?", (object_id, cur.lastrowid))
        return object_id

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive, at_most(1 << 20)) or b""
        path = scope["path"]
        if path == "/health":
            await answer(send, 200, {"ok": True})
            return
        prefix = PREFIXES.get(path)
        if prefix is None or scope["method"] != "POST":
            error = {"type": "invalid_request_error", "message": f"no route {path}"}
            await answer(send, 404, {"error": error})
            return
        form = dict(urllib.parse.parse_qsl(body.decode(), keep_blank_values=True))
        metadata = {m[1]: v for k, v in form.items() if (m := METADATA.fullmatch(k))}
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = headers.get("idempotency-key", "")
        mode = metadata.get("mode", "ok")
        count = self.counts[key] = self.counts.get(key, 0) + 1
        echo = [(b"idempotency-key", key.encode("latin-1"))]
        if mode in ("503", "drop", "cut") and count <= int(metadata.get("n", 1)):
            self.record(key, path, mode)
            if mode == "drop":
                # uvicorn binds ``send`` to the request cycle that owns the socket:
                # close it with not a byte of an answer written.
                send.__self__.transport.close()
                await asyncio.sleep(0)  # let uvicorn see the disconnect
                return
            if mode == "cut":
                start = [(b"content-type", b"application/json"), (b"content-length", b"1000")]
                await send({"type": "http.response.start", "status": 200, "headers": start})
                await send({"type": "http.response.body", "body": b"{", "more_body": True})
                raise ConnectionAbortedError("cut on purpose")  # uvicorn closes the socket
            error = {"type": "api_error", "message": "try again"}
            await answer(send, 503, {"error": error}, echo)
            return
        object_id = self.record(key, path, mode, prefix)
        if mode == "slow":
            await asyncio.sleep(float(metadata.get("s", 1)))
        doc = {k: v for k, v in form.items() if "[" not in k}
        if "amount" in doc:
            doc["amount"] = int(doc["amount"])
        obj = {
            **doc,
            "id": object_id,
            "object": "customer" if prefix == "cus" else "payment_intent",
            "created": int(time.time()),
            "livemode": False,
            "metadata": metadata,
        }
        request_id = f"req_{object_id}".encode()
        await answer(send, 200, obj, [*echo, (b"request-id", request_id)])


async def answer(
    send: Any, status: int, doc: object, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps(doc).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + (extra or [])}
    )
    await send({"type": "http.response.body", "body": body})


def app_from_env() -> StripeUpstream:
    """The app over ``$STRIPE_DB``: a factory for ``uvicorn --factory``."""
    return StripeUpstream(os.environ["STRIPE_DB"])
