"""A retry storm against the retrysafe demo shop: every side effect happens once.

Start the demo (the gateway in front of the demo shop) and run the storm::

    retrysafe demo                       # serves on http://127.0.0.1:8000
    python examples/retry_storm.py       # or: python examples/retry_storm.py URL

For each of ``--customers`` customers, all at once, the script walks the
agentic-commerce flow of the idempotency map the way agents on a bad network do: every call is fired
several times concurrently (``asyncio.gather``), some with an ``Idempotency-Key``
and some without, some webhooks are delivered out of order and again. Then it
compares the shop's side-effect counters (``GET /stats``, before and after) with
what one run of the flow should have done, and exits 0 only if they match.

It works through the gateway (``retrysafe demo``) and straight against the demo
API: the gateway replays a repeated key, and the shop's own keys (a session per
device, a mandate per cart, an order per mandate, a charge per payment key, a
webhook per event) hold for the requests that carry none. Only the standard
library and httpx; every run uses fresh ids, so it can run again on one demo.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import hmac
import json
import random
import secrets
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

#: The demo's webhook secrets (retrysafe._demo.shop.DEMO_SECRETS; demo only).
STRIPE_SECRET = "whsec_retrysafe_demo_stripe"
SHOPIFY_SECRET = "retrysafe-demo-shopify"

#: Statuses a patient client asks again after: in flight (409), and the gateway or
#: the store briefly unavailable (502, 503, 504).
RETRY_STATUSES = {502, 503, 504}


@dataclass
class Storm:
    """One run: the client, what was sent, what the answers showed."""

    client: httpx.AsyncClient
    run: str
    requests: int = 0
    retries: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def check(self, ok: bool, what: str) -> None:
        """Note an answer that is not what exactly-once promises."""
        if not ok:
            self.problems.append(what)

    async def send(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        key: str | None = None,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
    ) -> httpx.Response:
        """One logical request, sent until it gets a final answer (like
        ``retrysafe demo --check``): a transport error, a 409 ``idempotency_in_flight``
        (the first attempt is still running) or a 502/503/504 is asked again after a
        short, jittered, growing backoff."""
        # The agent's token: the gateway keeps each caller's answers apart (a keyed
        # request without credentials would run there without a record).
        sent = {"Authorization": f"Bearer agent-{self.run}", **(headers or {})}
        if key is not None:
            sent["Idempotency-Key"] = key
        deadline, backoff = time.monotonic() + 30, 0.02
        while True:
            self.requests += 1
            try:
                if raw is not None:
                    r = await self.client.request(method, path, content=raw, headers=sent)
                else:
                    r = await self.client.request(method, path, json=body, headers=sent)
            except httpx.TransportError:
                r = None
            if r is not None and not _in_flight(r) and r.status_code not in RETRY_STATUSES:
                if r.headers.get("idempotent-replayed") == "true":
                    self.answers["replayed"] += 1
                return r
            if time.monotonic() > deadline:
                raise RuntimeError(f"{method} {path}: no final answer in 30 s")
            self.retries += 1
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, 1.0)


def _in_flight(r: httpx.Response) -> bool:
    if r.status_code != 409:
        return False
    try:
        return r.json().get("code") == "idempotency_in_flight"
    except ValueError:
        return False


def _same(values: list[Any]) -> bool:
    return len(set(values)) == 1


# -- signed webhooks, as the providers send them ----------------------------------------


def stripe_delivery(event: dict[str, Any], *, at: int) -> tuple[bytes, dict[str, str]]:
    """A Stripe-style delivery: ``Stripe-Signature: t=…,v1=hex(HMAC(secret, "t.body"))``.
    A redelivery is signed again with a new ``t``; the event id stays the body's ``id``."""
    body = json.dumps(event).encode()
    mac = hmac.new(STRIPE_SECRET.encode(), f"{at}.".encode() + body, hashlib.sha256)
    return body, {
        "Stripe-Signature": f"t={at},v1={mac.hexdigest()}",
        "Content-Type": "application/json",
    }


def shopify_delivery(
    topic: str, event_id: str, payload: dict[str, Any]
) -> tuple[bytes, dict[str, str]]:
    """A Shopify-style delivery: base64 HMAC of the body, the event id in a header."""
    body = json.dumps(payload).encode()
    mac = hmac.new(SHOPIFY_SECRET.encode(), body, hashlib.sha256).digest()
    return body, {
        "X-Shopify-Hmac-Sha256": base64.b64encode(mac).decode(),
        "X-Shopify-Event-Id": event_id,
        "X-Shopify-Topic": topic,
        "Content-Type": "application/json",
    }


# -- one customer's flow, every step duplicated -----------------------------------------


def refunds(index: int) -> bool:
    """Which customers get a refund (and a reordered refund webhook): every third."""
    return index % 3 == 0


async def customer(storm: Storm, index: int) -> None:
    """The shop's flow for one customer, each call fired several times at once."""
    s, tag = storm, f"{storm.run}-{index}"
    user, device = f"storm-{tag}", f"phone-{index}"
    who = {"user_id": user, "device_id": device}

    # Sessions: the same user and device opened 3 times at once -> one session
    # (the shop's SessionRegistry returns the active one instead of a new token).
    opened = await asyncio.gather(*(s.send("POST", "/sessions", who) for _ in range(3)))
    s.check(all(r.status_code in (200, 201) for r in opened), f"{user}: session refused")
    s.check(_same([r.json().get("token") for r in opened]), f"{user}: several session tokens")
    who["session_token"] = opened[0].json().get("token", "")  # later calls show it

    # Cart mandate: the same cart 3 times at once. Two carry one Idempotency-Key
    # (through the gateway the second is a replay), one carries none: the shop's
    # key cart_mandate:{session}:{cart_hash} is what makes that one the same mandate.
    items = [
        {"variant_id": f"book-{index}", "quantity": 1 + index % 3, "price": "12.99"},
        {"variant_id": "pen", "quantity": 2, "price": "1.50"},
    ]
    cart = {**who, "items": items, "currency": "EUR"}
    mandates = await asyncio.gather(
        s.send("POST", "/cart-mandates", cart, key=f"cart-{tag}"),
        s.send("POST", "/cart-mandates", cart, key=f"cart-{tag}"),
        s.send("POST", "/cart-mandates", cart),
    )
    s.check(all(r.status_code == 201 for r in mandates), f"{user}: cart mandate refused")
    mandate = mandates[0].json()["id"]
    s.check(_same([r.json()["id"] for r in mandates]), f"{user}: several cart mandates")

    # Intent mandate: twice at once, no key -> one (intent_mandate:{user}:{intent_hash}).
    intent = {"user_id": user, "intent": {"buy": "books", "max_total": "50.00"}}
    intents = await asyncio.gather(*(s.send("POST", "/intent-mandates", intent) for _ in range(2)))
    s.check(_same([r.json().get("id") for r in intents]), f"{user}: several intent mandates")

    # Order: 4 at once for the mandate, two with one key, one with another key, one
    # with none -> one order (order:{mandate}:{user}, and orders.cart_mandate_id is unique).
    order_body = {"user_id": user, "cart_mandate_id": mandate}
    orders = await asyncio.gather(
        s.send("POST", "/orders", order_body, key=f"order-{tag}"),
        s.send("POST", "/orders", order_body, key=f"order-{tag}"),
        s.send("POST", "/orders", order_body, key=f"order-{tag}-other-client"),
        s.send("POST", "/orders", order_body),
    )
    s.check(all(r.status_code == 201 for r in orders), f"{user}: order refused")
    order = orders[0].json()["id"]
    s.check(_same([r.json()["id"] for r in orders]), f"{user}: several orders")

    # Payment: 4 at once -> one charge at the payment gateway (the shop passes the key
    # {payment key}:charge on, the gateway dedupes by it), one transaction id for all.
    pay = {"user_id": user, "order_id": order}
    paid = await asyncio.gather(
        s.send("POST", "/payments", pay, key=f"pay-{tag}"),
        s.send("POST", "/payments", pay, key=f"pay-{tag}"),
        s.send("POST", "/payments", pay, key=f"pay-{tag}-retry"),
        s.send("POST", "/payments", pay),
    )
    s.check(all(r.status_code == 201 for r in paid), f"{user}: payment refused")
    txn, payment = paid[0].json()["transaction_id"], paid[0].json()["id"]
    s.check(_same([r.json()["transaction_id"] for r in paid]), f"{user}: several transactions")

    await stripe_webhooks(s, index, tag, txn, payment)

    # Shopify orders/create: delivered 3 times at once with one X-Shopify-Event-Id
    # -> processed once, the others answered "duplicate". The key is
    # webhook:shopify:{event_id} with the signed body's hash as the event id: the
    # header is not signed, so the same body replayed under a new id is a duplicate too.
    body, headers = shopify_delivery("orders/create", f"shp-{tag}", {"id": order})
    shopify = await asyncio.gather(
        *(s.send("POST", "/webhooks/shopify", raw=body, headers=headers) for _ in range(3))
    )
    statuses = sorted(r.json().get("status") for r in shopify)
    s.check(statuses == ["duplicate", "duplicate", "processed"], f"{user}: shopify {statuses}")
    replayed = {**headers, "X-Shopify-Event-Id": f"shp-{tag}-replayed"}
    r = await s.send("POST", "/webhooks/shopify", raw=body, headers=replayed)
    s.check(r.json().get("status") == "duplicate", f"{user}: replayed shopify body ran again")

    await session_updates(s, who)
    await profile_and_consent(s, user)


async def stripe_webhooks(s: Storm, index: int, tag: str, txn: str, payment: str) -> None:
    """Stripe-style events for the payment: duplicated, re-signed, reordered, resent.

    Keyed by ``webhook:stripe:{transaction}:{event type}``: a redelivery (same event
    id, a new signature) and a resend under a new event id are both duplicates.
    """
    now = int(time.time())

    def event(kind: str, event_id: str) -> dict[str, Any]:
        return {"id": event_id, "type": kind, "data": {"object": {"id": txn}}}

    succeeded = event("payment_intent.succeeded", f"evt_{tag}_succeeded")
    refunded = event("charge.refunded", f"evt_{tag}_refunded")
    if refunds(index):
        # Reordered: the refund arrives before the success event. The shop's own
        # charge already made the payment "succeeded", so the refund applies now;
        # the late success event is then stale and acknowledged (200) without
        # moving the state back, so the provider stops redelivering it.
        body, headers = stripe_delivery(refunded, at=now)
        first = await s.send("POST", "/webhooks/stripe", raw=body, headers=headers)
        s.check(first.status_code == 200, f"{tag}: refund answered {first.status_code}")
    # The success event 3 times at once: once as sent, twice re-signed later.
    deliveries = [stripe_delivery(succeeded, at=now + d) for d in (0, 1, 2)]
    answers = await asyncio.gather(
        *(s.send("POST", "/webhooks/stripe", raw=b, headers=h) for b, h in deliveries)
    )
    statuses = sorted(r.json().get("status") for r in answers)
    s.check(statuses == ["duplicate", "duplicate", "processed"], f"{tag}: stripe {statuses}")
    if refunds(index):
        # The provider did not see our 200 in time and delivers the refund again.
        again = stripe_delivery(refunded, at=now + 3)
        r = await s.send("POST", "/webhooks/stripe", raw=again[0], headers=again[1])
        s.check(r.json().get("status") == "duplicate", f"{tag}: refund redelivery applied")
    # The gateway resends the success under a new event id: same transaction and type,
    # so the same key, so not applied again.
    resend = stripe_delivery(event("payment_intent.succeeded", f"evt_{tag}_resent"), at=now)
    r = await s.send("POST", "/webhooks/stripe", raw=resend[0], headers=resend[1])
    s.check(r.json().get("status") == "duplicate", f"{tag}: resent event applied again")
    state = (await s.send("GET", f"/payments/{payment}")).json().get("status")
    expected = "refunded" if refunds(index) else "succeeded"
    s.check(state == expected, f"{tag}: payment is {state}, not {expected}")


async def session_updates(s: Storm, who: dict[str, str]) -> None:
    """Session updates with sequence numbers, out of order: 1, 3, 2, then 3 retried.

    ``session_update:{session}:{operation}:{sequence}``: 2 after 3 is refused (409
    out_of_order), the retry of 3 is replayed; 2 updates applied.
    """
    expected = {1: 201, 3: 201, 2: 409}
    for sequence in (1, 3, 2, 3):
        body = {**who, "operation": "cart", "sequence": sequence, "payload": {"step": sequence}}
        r = await s.send("POST", "/session-updates", body)
        want = expected.pop(sequence, 200)  # the second 3 is a replay (200)
        code = r.json().get("code") if r.status_code >= 400 else None
        s.check(r.status_code == want, f"{who['user_id']}: update {sequence} got {r.status_code}")
        if want == 409:
            s.check(code == "out_of_order", f"{who['user_id']}: update {sequence} got {code}")


async def profile_and_consent(s: Storm, user: str) -> None:
    """A profile written from two clients that both read version 0: one wins (200), the
    other gets 409 version_conflict. Consent changes are appended, never replaced."""
    writes = await asyncio.gather(
        *(
            s.send("PUT", f"/profiles/{user}", {"version": 0, "data": {"client": c}})
            for c in ("phone", "laptop")
        )
    )
    codes = sorted(r.status_code for r in writes)
    s.check(codes == [200, 409], f"{user}: profile writes {codes}")
    loser = [r for r in writes if r.status_code == 409]
    s.check(
        bool(loser) and loser[0].json().get("code") == "version_conflict",
        f"{user}: no version_conflict",
    )
    s.answers["profile conflicts (409)"] += len(loser)
    # Each change is sent twice at once (a double tap): its change_id keys it, one entry each.
    for n, granted in enumerate((True, False)):
        change = {"purpose": "marketing", "granted": granted, "change_id": f"c{n}"}
        await asyncio.gather(*(s.send("POST", f"/consents/{user}", change) for _ in range(2)))
    history = (await s.send("GET", f"/consents/{user}")).json().get("entries", [])
    s.check([e["granted"] for e in history] == [True, False], f"{user}: consent {history}")
    s.answers["consent entries"] += len(history)


# -- the run: stats before and after, expected against seen ----------------------------


def expected_effects(customers: int) -> dict[str, int]:
    """What one pass of the flow per customer must add to ``GET /stats``."""
    refunded = sum(1 for i in range(customers) if refunds(i))
    return {
        "sessions_created": customers,
        "cart_mandates_created": customers,
        "intent_mandates_created": customers,
        "orders_created": customers,
        "payments_recorded": customers,
        "gateway_charges": customers,
        # per customer: payment_intent.succeeded, orders/create, and the refund if any
        "webhooks_processed": 2 * customers + refunded,
        # per customer: sequences 1 and 3 (2 came too late, the second 3 was a replay)
        "session_updates_applied": 2 * customers,
    }


async def main(url: str, customers: int) -> int:
    limits = httpx.Limits(max_connections=customers * 4 + 10)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        storm = Storm(client, secrets.token_hex(4))
        try:
            before = (await client.get("/stats")).json()
        except (httpx.HTTPError, ValueError) as exc:
            print(f"retry storm: no demo shop at {url} ({exc!r}); start it with `retrysafe demo`")
            return 1
        started = time.perf_counter()
        flows = await asyncio.gather(
            *(customer(storm, i) for i in range(customers)), return_exceptions=True
        )
        seconds = time.perf_counter() - started
        after = (await client.get("/stats")).json()
    for index, failed in enumerate(flows):
        if isinstance(failed, BaseException):  # an answer the flow could not go on from
            storm.problems.append(f"customer {index} stopped: {failed!r}")

    expected = expected_effects(customers)
    print(f"retry storm: {customers} customers against {url} (run {storm.run})")
    print(f"  {'side effect':<26}{'expected':>9}{'seen':>7}")
    differ = []
    for name, want in expected.items():
        seen = after[name] - before[name]
        mark = "" if seen == want else "   <- differs"
        print(f"  {name:<26}{want:>9}{seen:>7}{mark}")
        if seen != want:
            differ.append(f"{name} {seen} (expected {want})")
    print(
        f"  {'profile conflicts (409)':<26}{customers:>9}"
        f"{storm.answers['profile conflicts (409)']:>7}"
    )
    print(f"  {'consent entries':<26}{2 * customers:>9}{storm.answers['consent entries']:>7}")
    print(
        f"  requests sent              {storm.requests} in {seconds:.2f} s "
        f"({storm.retries} asked again, {storm.answers['replayed']} "
        "answered as replays)"
    )
    for problem in storm.problems[:20]:
        print(f"  answer: {problem}")
    if differ or storm.problems:
        print("NOT exactly once: " + "; ".join(differ + storm.problems[:3]))
        return 1
    print("exactly once: every side effect happened once")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "url",
        nargs="?",
        default="http://127.0.0.1:8000",
        help="the gateway of `retrysafe demo`, or the demo API itself",
    )
    parser.add_argument("--customers", type=int, default=10, help="customers at once (10)")
    args = parser.parse_args()
    if args.customers < 1:
        parser.error("--customers must be at least 1")
    sys.exit(asyncio.run(main(args.url.rstrip("/"), args.customers)))
