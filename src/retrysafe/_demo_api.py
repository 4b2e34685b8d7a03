"""The demo API behind ``retrysafe demo``: orders and payments with visible side effects.

A plain ASGI app that knows nothing about idempotency: every ``POST`` creates a
record and bumps a counter, so a retry that got through twice would show.

- ``GET /``: what it serves; ``GET /stats``: the side-effect counters.
- ``POST /orders`` ``{"item": "book", "quantity": 1}`` → 201 the order.
- ``POST /payments`` ``{"amount": 2999, "currency": "EUR"}`` → 201 the payment.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from .asgi import Receive, Scope, Send

__all__ = ["DemoApi"]

_MAX_BODY = 64 << 10
_INDEX = {
    "name": "retrysafe demo API",
    "routes": {
        "POST /orders": 'create an order, e.g. {"item": "book", "quantity": 1}',
        "POST /payments": 'charge a payment, e.g. {"amount": 2999, "currency": "EUR"}',
        "GET /stats": "side effects so far: orders created, payments charged",
    },
}


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class DemoApi:
    """The demo API. ``delay`` is how long each side effect takes (retries pile up
    meanwhile); ``on_effect(kind, record)`` is called after each one."""

    def __init__(
        self,
        *,
        delay: float = 0.05,
        on_effect: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.delay = delay
        self.on_effect = on_effect
        self.stats = {"orders_created": 0, "payments_charged": 0}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        try:
            if path in ("/", "/stats"):
                if method not in ("GET", "HEAD"):
                    raise _BadRequest(405, f"{path} answers GET")
                await _send(send, 200, _INDEX if path == "/" else self.stats)
            elif path in ("/orders", "/payments"):
                if method != "POST":
                    raise _BadRequest(405, f"{path} answers POST")
                doc = await _read_json(receive)
                record = self._order(doc) if path == "/orders" else self._payment(doc)
                await asyncio.sleep(self.delay)  # the work takes a moment
                kind = "orders_created" if path == "/orders" else "payments_charged"
                self.stats[kind] += 1
                record["id"] = f"{'ord' if path == '/orders' else 'pay'}_{self.stats[kind]}"
                record["created_at"] = round(time.time(), 3)
                if self.on_effect is not None:
                    self.on_effect(kind, record)
                await _send(send, 201, record)
            else:
                raise _BadRequest(404, f"no route {path}; GET / lists them")
        except _BadRequest as exc:
            await _send(send, exc.status, {"error": str(exc)})

    @staticmethod
    def _order(doc: dict[str, Any]) -> dict[str, Any]:
        item, quantity = doc.get("item"), doc.get("quantity", 1)
        if not isinstance(item, str) or not item:
            raise _BadRequest(400, '"item" must be a non-empty string')
        if not isinstance(quantity, int) or isinstance(quantity, bool) or quantity < 1:
            raise _BadRequest(400, '"quantity" must be a positive integer')
        return {"item": item, "quantity": quantity, "status": "created"}

    @staticmethod
    def _payment(doc: dict[str, Any]) -> dict[str, Any]:
        amount, currency = doc.get("amount"), doc.get("currency", "EUR")
        if not isinstance(amount, int) or isinstance(amount, bool) or amount < 1:
            raise _BadRequest(400, '"amount" must be a positive integer (cents)')
        if not isinstance(currency, str) or len(currency) != 3:
            raise _BadRequest(400, '"currency" must be a three-letter code')
        return {"amount": amount, "currency": currency.upper(), "status": "charged"}


async def _read_json(receive: Receive) -> dict[str, Any]:
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _BadRequest(400, "the client left")
        body += message.get("body", b"")
        if len(body) > _MAX_BODY:
            raise _BadRequest(413, f"the body is over {_MAX_BODY} bytes")
        if not message.get("more_body", False):
            break
    try:
        doc = json.loads(body)
    except ValueError:
        raise _BadRequest(400, "the body must be a JSON object") from None
    if not isinstance(doc, dict):
        raise _BadRequest(400, "the body must be a JSON object")
    return doc


async def _send(send: Send, status: int, doc: dict[str, Any]) -> None:
    body = json.dumps(doc).encode() + b"\n"
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
