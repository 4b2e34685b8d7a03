"""The demo API behind ``retrysafe demo``: the demo shop over HTTP.

A plain ASGI app; each route calls one method of :class:`~retrysafe._demo.shop.Shop`
on a worker thread. Every side effect is a row, counted by ``GET /stats``, so a
retry that got through twice would show.

- ``POST /sessions`` ``{"user_id", "device_id"}``: open or reuse a session.
- ``POST /cart-mandates`` ``{"user_id", "device_id"?, "items": [{"variant_id",
  "quantity", "price"}], "currency"?}``: a mandate per session and cart (30 minutes).
- ``POST /intent-mandates`` ``{"user_id", "intent": {...}}``.
- ``POST /orders`` ``{"user_id", "cart_mandate_id"}`` (or ``"items"``: the mandate
  is made first): once per cart mandate.
- ``POST /payments`` ``{"user_id", "order_id"}``: charge once through the payment gateway.
- ``GET /payments/{id}``: the payment's state.
- ``POST /webhooks/stripe``, ``POST /webhooks/shopify``: signed deliveries.
- ``POST /session-updates`` ``{"user_id", "device_id", "operation", "sequence", "payload"}``.
- ``PUT /profiles/{user}`` ``{"version", "data"}``; ``POST``/``GET /consents/{user}``.
- ``GET /``: the routes; ``GET /stats``: the side-effect counters.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from retrysafe._demo.shop import Shop, ShopError, refusal
from retrysafe._http.asgi import at_most, read_body, send_answer, send_json
from retrysafe._http.problems import Response, problem
from retrysafe.asgi import Receive, Scope, Send
from retrysafe.errors import BodyTooLarge, IdempotencyError

__all__ = ["DemoApi"]

log = logging.getLogger("retrysafe.demo")

_MAX_BODY = 64 << 10
_ROUTES = {
    "POST /sessions": "open or reuse a session for a user and device",
    "POST /cart-mandates": "a cart mandate per session and cart, for 30 minutes",
    "POST /intent-mandates": "an intent mandate per user and intent",
    "POST /orders": 'once per cart mandate, e.g. {"user_id": "u1", "items": '
    '[{"variant_id": "book", "quantity": 1, "price": "12.99"}]}',
    "POST /payments": "charge an order once (the gateway gets a derived key)",
    "GET /payments/{id}": "a payment's state",
    "POST /webhooks/stripe": "Stripe-style payment events (signed)",
    "POST /webhooks/shopify": "Shopify-style events (signed)",
    "POST /session-updates": "ordered updates: an earlier sequence after a later one is refused",
    "PUT /profiles/{user}": "compare-and-set on the version you read",
    "POST /consents/{user}": "append a consent change (never updated)",
    "GET /consents/{user}": "the consent history",
    "GET /stats": "side effects so far",
}


class DemoApi:
    """The demo shop as an ASGI app, its data in the SQLite file at ``path``.

    ``delay`` is the payment gateway's latency (retries pile up meanwhile);
    ``on_effect(kind, document)`` is called after each successful write.
    """

    def __init__(
        self,
        path: str,
        *,
        delay: float = 0.05,
        on_effect: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.shop = Shop(path, gateway_delay=delay)
        self.on_effect = on_effect
        self._pool = ThreadPoolExecutor(32, thread_name_prefix="demo-shop")

    @property
    def stats(self) -> dict[str, int]:
        return self.shop.stats()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.shop.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        try:
            try:
                status, doc = await self._route(method, path, scope, receive)
            except IdempotencyError as exc:  # a guard's refusal, the store down, …
                raise refusal(exc) from None
            except ShopError:
                raise
            except Exception:
                log.exception("retrysafe demo: %s %s failed", method, path)
                raise ShopError(500, "internal_error", "the shop failed; retry") from None
        except ShopError as exc:
            answer = problem(exc.status, exc.code, exc.detail, **exc.extra)
            await send_answer(send, answer)
            return
        if isinstance(doc, _Raw):
            await send_answer(send, Response.sized(status, doc.headers, doc.body))
            return
        await send_json(send, status, doc)

    async def _route(
        self, method: str, path: str, scope: Scope, receive: Receive
    ) -> tuple[int, Any]:
        shop = self.shop
        parts = path.strip("/").split("/")
        if path == "/":
            _allow(method, "GET")
            return 200, {"name": "retrysafe demo shop", "routes": _ROUTES}
        if path == "/stats":
            _allow(method, "GET")
            return 200, await self._thread(shop.stats)
        if path.startswith("/webhooks/") and len(parts) == 2 and parts[1] in ("stripe", "shopify"):
            _allow(method, "POST")
            body = await _body(receive)
            receiver = shop.stripe if parts[1] == "stripe" else shop.shopify
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
            answer = await receiver.ahandle(headers, body)
            self._effect(f"webhook {parts[1]}", answer.body)
            return answer.status, _Raw(list(answer.headers), answer.content)
        simple = {
            "/sessions": shop.open_session,
            "/cart-mandates": shop.cart_mandate,
            "/intent-mandates": shop.intent_mandate,
            "/orders": shop.order,
            "/payments": shop.pay,
            "/session-updates": shop.session_update,
        }
        if path in simple:
            _allow(method, "POST")
            doc = await _json(receive)
            status, answer = await self._thread(simple[path], doc)
            self._effect(path.strip("/"), answer)
            return status, answer
        if len(parts) == 2 and parts[0] == "payments":
            _allow(method, "GET")
            return await self._thread(shop.payment, parts[1])
        if len(parts) == 2 and parts[0] == "profiles":
            _allow(method, "PUT")
            return await self._thread(shop.put_profile, parts[1], await _json(receive))
        if len(parts) == 2 and parts[0] == "consents":
            if method == "GET":
                return await self._thread(shop.consent_history, parts[1])
            _allow(method, "POST")
            return await self._thread(shop.add_consent, parts[1], await _json(receive))
        raise ShopError(404, "not_found", f"no route {path}; GET / lists them")

    async def _thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _effect(self, kind: str, doc: dict[str, Any]) -> None:
        if self.on_effect is not None:
            self.on_effect(kind, doc)


class _Raw:
    """An answer made elsewhere (the webhook receiver's), sent as it is."""

    def __init__(self, headers: list[tuple[str, str]], body: bytes) -> None:
        self.headers, self.body = headers, body


def _allow(method: str, allowed: str) -> None:
    if method != allowed and not (allowed == "GET" and method == "HEAD"):
        raise ShopError(405, "method_not_allowed", f"this route answers {allowed}")


async def _body(receive: Receive) -> bytes:
    try:
        body = await read_body(receive, at_most(_MAX_BODY))
    except BodyTooLarge:
        raise ShopError(413, "body_too_large", f"the body is over {_MAX_BODY} bytes") from None
    if body is None:
        raise ShopError(400, "client_left", "the client left before its body arrived")
    return body


async def _json(receive: Receive) -> dict[str, Any]:
    try:
        doc = json.loads(await _body(receive))
    except ValueError:
        raise ShopError(400, "invalid_json", "the body must be a JSON object") from None
    if not isinstance(doc, dict):
        raise ShopError(400, "invalid_json", "the body must be a JSON object")
    return doc
