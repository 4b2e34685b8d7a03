"""``retrysafe.webhooks``: ``verify`` for every scheme, and the ``Receiver`` that
verifies, deduplicates and dispatches, on every store, sync and async, over HTTP and
under races. Deliveries are signed by the providers' own libraries where one exists
(Stripe's SDK, the Standard Webhooks reference library), Shopify's by its documented
algorithm (the base64 HMAC-SHA256 of the raw body)."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import hashlib
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from _http_servers import ThreadServer
from _racing import race_processes
from conftest import StoreSpec
from fastapi import FastAPI, Request, Response  # (FastAPI resolves the view's annotations)
from hypothesis import given
from hypothesis import strategies as st
from standardwebhooks.webhooks import Webhook
from stripe import WebhookSignature

from retrysafe import Engine, IdempotencyError, Status, Store, open_store
from retrysafe.webhooks import (
    SCHEMES,
    Delivery,
    Receiver,
    SignatureError,
    WebhookResponse,
    verify,
)

NOW = 1_763_900_000
BODY = json.dumps({"id": "evt_1Q2w3E", "type": "payment_intent.succeeded"}).encode()
STANDARD_SECRET = "whsec_" + base64.b64encode(b"a-standard-webhooks-secret-32byt").decode()


def shopify_headers(body: bytes, secret: str, **extra: str) -> dict[str, str]:
    mac = hmac.new(secret.encode(), body, hashlib.sha256).digest()
    return {"X-Shopify-Hmac-Sha256": base64.b64encode(mac).decode(), **extra}


def stripe_headers(body: bytes, secret: str, at: int = NOW) -> dict[str, str]:
    return {
        "Stripe-Signature": WebhookSignature.generate_signature_header(body.decode(), secret, at)
    }


def standard_headers(
    body: bytes, secret: str, at: int = NOW, msg: str = "msg_2Lm"
) -> dict[str, str]:
    signature = Webhook(secret).sign(msg, dt.datetime.fromtimestamp(at, dt.UTC), body.decode())
    return {"webhook-id": msg, "webhook-timestamp": str(at), "webhook-signature": signature}


# -- each scheme accepts its provider's signature and returns the event id ------------------


def test_shopify() -> None:
    headers = shopify_headers(
        BODY, "shpss_1", **{"X-Shopify-Event-Id": "ev-9", "X-Shopify-Webhook-Id": "wh-1"}
    )
    signed = "sha256:" + hashlib.sha256(BODY).hexdigest()
    assert verify("shopify", headers, BODY, "shpss_1") == signed
    assert verify("shopify", headers, BODY, "shpss_1", trust_event_ids=True) == "ev-9"
    del headers["X-Shopify-Event-Id"]
    lower = {k.lower(): v for k, v in headers.items()}  # any case, any mapping
    assert verify("shopify", lower, BODY, "shpss_1", trust_event_ids=True) == "wh-1"
    assert verify("shopify", list(lower.items()), BODY, ["old", "shpss_1"]) == signed


@pytest.mark.parametrize("scheme", ["shopify", "hmac"])
def test_an_unsigned_event_id_is_not_what_verify_returns(scheme: str) -> None:
    """A captured delivery resent under another event-id header (the signature
    still checks out, since it covers only the body) gets the same id: it cannot be
    handled again under a new id, nor take the id of an event still to come."""
    if scheme == "shopify":
        headers = shopify_headers(BODY, "s3cret", **{"X-Shopify-Event-Id": "ev-1"})
        name = "X-Shopify-Event-Id"
    else:
        mac = hmac.new(b"s3cret", BODY, hashlib.sha256).hexdigest()
        headers, name = {"X-Signature": mac, "X-Event-Id": "ev-1"}, "X-Event-Id"
    ids = {
        verify(scheme, {**headers, name: forged}, BODY, "s3cret")
        for forged in ("ev-1", "ev-2", "ev-from-tomorrow")
    }
    assert ids == {"sha256:" + hashlib.sha256(BODY).hexdigest()}
    other = BODY.replace(b"evt_1Q2w3E", b"evt_other")
    resigned = (
        shopify_headers(other, "s3cret", **{name: "ev-1"})
        if scheme == "shopify"
        else {"X-Signature": hmac.new(b"s3cret", other, hashlib.sha256).hexdigest(), name: "ev-1"}
    )
    assert verify(scheme, resigned, other, "s3cret") not in ids  # another body, another id


def test_stripe_agrees_with_the_stripe_sdk() -> None:
    headers = stripe_headers(BODY, "whsec_test_1")
    WebhookSignature.verify_header(
        BODY, headers["Stripe-Signature"], "whsec_test_1", tolerance=10**10
    )
    assert verify("stripe", headers, BODY, "whsec_test_1", now=NOW + 299) == "evt_1Q2w3E"
    # During a rotation Stripe signs with both secrets: either one verifies.
    new = stripe_headers(BODY, "whsec_new")["Stripe-Signature"].split("v1=")[1]
    both = f"{headers['Stripe-Signature']},v1={new}"
    assert verify("stripe", {"stripe-signature": both}, BODY, "whsec_new", now=NOW) == "evt_1Q2w3E"


def test_standard_agrees_with_the_reference_library() -> None:
    fresh = standard_headers(BODY, STANDARD_SECRET, at=int(time.time()))
    Webhook(STANDARD_SECRET).verify(BODY, fresh)  # (the library checks against its own clock)
    assert verify("standard", fresh, BODY, STANDARD_SECRET) == "msg_2Lm"
    headers = standard_headers(BODY, STANDARD_SECRET)
    assert verify("standard", headers, BODY, STANDARD_SECRET, now=NOW) == "msg_2Lm"
    rotated = {**headers, "webhook-signature": "v1,AAAA " + headers["webhook-signature"]}
    assert (
        verify(
            "standard",
            rotated,
            BODY,
            ["whsec_" + base64.b64encode(b"x" * 32).decode(), STANDARD_SECRET],
            now=NOW,
        )
        == "msg_2Lm"
    )


def test_generic_hmac() -> None:
    mac = hmac.new(b"s3cret", BODY, hashlib.sha256)
    for value in (
        mac.hexdigest(),
        "sha256=" + mac.hexdigest(),
        base64.b64encode(mac.digest()).decode(),
    ):
        headers = {"X-Signature": value, "X-Event-Id": "e1"}
        assert verify("hmac", headers, BODY, "s3cret", trust_event_ids=True) == "e1"
    github = {"X-Hub-Signature-256": "sha256=" + mac.hexdigest(), "X-GitHub-Delivery": "d-7"}
    assert verify("hmac", github, BODY, b"s3cret", trust_event_ids=True) == "d-7"
    assert verify("hmac", github, BODY, b"s3cret") == "sha256:" + hashlib.sha256(BODY).hexdigest()
    anonymous = verify("hmac", {"X-Signature": mac.hexdigest()}, BODY, "s3cret")
    assert anonymous == "sha256:" + hashlib.sha256(BODY).hexdigest()  # a redelivery shares it


# -- and refuses everything else, with a reason -------------------------------------------


@pytest.mark.parametrize(
    ("scheme", "headers", "reason"),
    [
        ("shopify", {}, "missing_header"),
        ("shopify", {"X-Shopify-Hmac-Sha256": "not base64!"}, "malformed_header"),
        ("stripe", {"Stripe-Signature": "t=1"}, "malformed_header"),
        ("stripe", {"Stripe-Signature": "v1=00"}, "malformed_header"),
        ("standard", {"webhook-id": "m", "webhook-timestamp": "1"}, "missing_header"),
        (
            "standard",
            {"webhook-id": "m", "webhook-timestamp": "1", "webhook-signature": "v2,x"},
            "malformed_header",
        ),
        ("hmac", {"X-Signature": "zz"}, "malformed_header"),
        ("hmac", {}, "missing_header"),
        ("nope", {}, "unknown_scheme"),
    ],
)
def test_malformed_deliveries(scheme: str, headers: dict[str, str], reason: str) -> None:
    with pytest.raises(SignatureError) as err:
        verify(scheme, headers, BODY, "secret", now=NOW)
    assert err.value.reason == reason and isinstance(err.value, IdempotencyError)
    assert err.value.code == "webhook_signature_invalid"


def test_wrong_secret_or_tampered_body() -> None:
    cases: list[tuple[str, dict[str, str], str]] = [
        ("shopify", shopify_headers(BODY, "right", **{"X-Shopify-Event-Id": "e"}), "right"),
        ("stripe", stripe_headers(BODY, "whsec_right"), "whsec_right"),
        ("standard", standard_headers(BODY, STANDARD_SECRET), STANDARD_SECRET),
        ("hmac", {"X-Signature": hmac.new(b"right", BODY, hashlib.sha256).hexdigest()}, "right"),
    ]
    other = "whsec_" + base64.b64encode(b"another-secret-of-thirty-two-byt").decode()
    for scheme, headers, secret in cases:
        assert verify(scheme, headers, BODY, secret, now=NOW)
        for bad_secret, body in ((other, BODY), (secret, BODY + b" "), (secret, BODY[:-1])):
            with pytest.raises(SignatureError) as err:
                verify(scheme, headers, body, bad_secret, now=NOW)
            assert err.value.reason in {"bad_signature", "no_event_id"}, (scheme, err.value)


def test_timestamps_outside_the_tolerance_are_refused() -> None:
    stripe = stripe_headers(BODY, "whsec_t")
    standard = standard_headers(BODY, STANDARD_SECRET)
    for scheme, headers, secret in (
        ("stripe", stripe, "whsec_t"),
        ("standard", standard, STANDARD_SECRET),
    ):
        for now in (NOW + 301, NOW - 301):
            with pytest.raises(SignatureError) as err:
                verify(scheme, headers, BODY, secret, now=now)  # a replay, or a skewed clock
            assert err.value.reason == "timestamp_out_of_tolerance"
        assert verify(scheme, headers, BODY, secret, now=NOW + 3000, tolerance=3600)
        with pytest.raises(SignatureError):
            verify(scheme, headers, BODY, secret, now=NOW + 2, tolerance=1)
    # Without now=, the clock decides: a delivery signed just now passes.
    fresh = stripe_headers(BODY, "whsec_t", at=int(time.time()))
    assert verify("stripe", fresh, BODY, "whsec_t") == "evt_1Q2w3E"


def test_a_forged_timestamp_is_a_bad_signature() -> None:
    headers = stripe_headers(BODY, "whsec_t")
    forged = headers["Stripe-Signature"].replace(f"t={NOW}", f"t={NOW + 1000}")
    with pytest.raises(SignatureError) as err:
        verify("stripe", {"Stripe-Signature": forged}, BODY, "whsec_t", now=NOW + 1000)
    assert err.value.reason == "bad_signature"


def test_stripe_needs_an_event_id_and_bad_arguments_are_clear() -> None:
    body = b'{"type": "ping"}'
    with pytest.raises(SignatureError) as err:
        verify("stripe", stripe_headers(body, "whsec_t"), body, "whsec_t", now=NOW)
    assert err.value.reason == "no_event_id"
    with pytest.raises(SignatureError) as err:
        verify("hmac", {"X-Signature": "00"}, BODY, [])
    assert err.value.reason == "bad_secret"
    with pytest.raises(SignatureError) as err:
        verify("standard", standard_headers(BODY, STANDARD_SECRET), BODY, "whsec_%%%", now=NOW)
    assert err.value.reason == "bad_secret"
    with pytest.raises(TypeError):
        verify("hmac", {}, "text", "s")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        verify("hmac", {}, BODY, "s", tolerance=-1)


@given(
    scheme=st.sampled_from(sorted(SCHEMES)),
    headers=st.dictionaries(
        st.sampled_from(
            [
                "X-Shopify-Hmac-Sha256",
                "Stripe-Signature",
                "webhook-id",
                "webhook-timestamp",
                "webhook-signature",
                "X-Signature",
                "X-Event-Id",
            ]
        ),
        st.text(max_size=80),
    ),
    body=st.binary(max_size=200),
)
def test_garbage_never_passes_and_never_crashes(
    scheme: str, headers: dict[str, Any], body: bytes
) -> None:
    with pytest.raises(SignatureError):
        verify(scheme, headers, body, "whsec_" + base64.b64encode(b"k" * 24).decode(), now=NOW)


# == the Receiver: verify, then deduplicate, then dispatch ==================================

STRIPE_SECRET = "whsec_receiver_test"
SHOPIFY_SECRET = "shpss_receiver_test"


def stripe_event(event_id: str = "evt_1R", kind: str = "charge.succeeded", **data: Any) -> bytes:
    return json.dumps({"id": event_id, "object": "event", "type": kind, "data": data}).encode()


def signed_stripe(
    event_id: str = "evt_1R", secret: str = STRIPE_SECRET, at: float | None = None
) -> tuple[dict[str, str], bytes]:
    """A Stripe delivery signed by Stripe's SDK now (or at ``at``)."""
    body = stripe_event(event_id)
    return stripe_headers(body, secret, int(time.time() if at is None else at)), body


class Handler:
    """A handler that counts its runs; ``fail`` raises on that many first runs."""

    def __init__(self, fail: int = 0, result: Any = None) -> None:
        self.runs: list[str] = []
        self.fail = fail
        self.result = result

    def __call__(self, delivery: Delivery) -> Any:
        self.runs.append(delivery.event_id)
        if self.fail:
            self.fail -= 1
            raise RuntimeError("db password hunter2 leaked in a traceback")
        if self.result is not None:
            return self.result
        return {"handled": delivery.event_id, "type": delivery.json()["type"]}


class Deliver:
    """``receiver.handle`` (sync), or ``await receiver.ahandle`` on a loop of this test's
    own with the handler made async (so both the sync and the async paths run)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.loop = asyncio.new_event_loop() if mode == "async" else None
        self.receivers: list[Receiver] = []

    def receiver(self, store: Any, handler: Callable[[Delivery], Any], **options: Any) -> Receiver:
        if self.mode == "async":
            plain = handler

            async def handler(delivery: Delivery) -> Any:
                await asyncio.sleep(0)
                return plain(delivery)

        options.setdefault("scheme", "stripe")
        options.setdefault("secrets", STRIPE_SECRET)
        receiver = Receiver(store, handler=handler, **options)
        self.receivers.append(receiver)
        return receiver

    def __call__(self, receiver: Receiver, headers: Any, body: bytes) -> WebhookResponse:
        if self.loop is None:
            return receiver.handle(headers, body)
        return self.loop.run_until_complete(receiver.ahandle(headers, body))

    def close(self) -> None:
        if self.loop is not None:
            for receiver in self.receivers:
                self.loop.run_until_complete(receiver.aclose())
            self.loop.close()


@pytest.fixture
def deliver(mode: str) -> Iterator[Deliver]:
    d = Deliver(mode)
    yield d
    d.close()


def is_problem(answer: WebhookResponse, status: int, code: str) -> dict[str, Any]:
    """``answer`` is an RFC 9457 problem with this status and code; its body."""
    assert answer.status == status, answer
    assert dict(answer.headers)["content-type"] == "application/problem+json"
    body = answer.body
    assert body["status"] == status and body["code"] == code
    assert body["type"] == f"urn:retrysafe:problem:{code}" and body["title"] and body["detail"]
    return body


def test_first_delivery_then_duplicates(store: Store[Any], deliver: Deliver) -> None:
    handler = Handler()
    receiver = deliver.receiver(store, handler)
    headers, body = signed_stripe()
    first = deliver(receiver, headers, body)
    assert first.status == 200 and dict(first.headers) == {"content-type": "application/json"}
    result = {"handled": "evt_1R", "type": "charge.succeeded"}
    assert first.body == {"status": "processed", "event_id": "evt_1R", "result": result}
    # Providers re-sign every redelivery (a new timestamp): still the same event.
    for again_headers in (headers, signed_stripe(at=time.time() - 60)[0]):
        again = deliver(receiver, again_headers, body)
        assert again.status == 200 and dict(again.headers)["idempotent-replayed"] == "true"
        assert again.body == {
            "status": "duplicate",
            "event_id": "evt_1R",
            "original_event_id": "evt_1R",
            "result": result,
        }
    assert handler.runs == ["evt_1R"]
    [record] = store.records()
    assert record.key == "webhook:stripe:evt_1R" and record.status is Status.COMPLETED
    assert record.operation == "webhook" and record.request_id == "evt_1R"
    assert record.metadata == {"source": "stripe", "event_id": "evt_1R"}
    assert record.expires_at - record.created_at == 24 * 3600  # the Idempotency Map's TTL
    other = deliver(receiver, *signed_stripe("evt_2R"))
    assert other.body["status"] == "processed" and handler.runs == ["evt_1R", "evt_2R"]


def test_bad_signatures_store_nothing(
    store: Store[Any], deliver: Deliver, caplog: pytest.LogCaptureFixture
) -> None:
    handler = Handler()
    receiver = deliver.receiver(store, handler)
    headers, body = signed_stripe()
    signature = headers["Stripe-Signature"]
    now = time.time()
    cases = {
        "bad_signature": [
            ({"Stripe-Signature": signature}, body.replace(b"evt_1R", b"evt_9X")),  # forged
            ({"Stripe-Signature": signature}, body[:-1]),  # truncated
            signed_stripe(secret="whsec_someone_else"),  # wrong secret
        ],
        "timestamp_out_of_tolerance": [
            signed_stripe(at=now - 1000),  # stale: a replay
            signed_stripe(at=now + 1000),  # from the future
        ],
        "missing_header": [({}, body)],
        "malformed_header": [({"Stripe-Signature": "t=1"}, body)],
    }
    with caplog.at_level(logging.DEBUG, logger="retrysafe"):
        for reason, deliveries in cases.items():
            for bad_headers, bad_body in deliveries:
                answer = deliver(receiver, bad_headers, bad_body)
                problem = is_problem(answer, 401, "webhook_signature_invalid")
                assert problem["reason"] == reason
    assert handler.runs == [] and store.records() == []
    assert STRIPE_SECRET not in caplog.text and STRIPE_SECRET not in repr(receiver)


def test_handler_failure_is_retried_by_the_next_delivery(
    store: Store[Any], deliver: Deliver, caplog: pytest.LogCaptureFixture
) -> None:
    handler = Handler(fail=1)
    receiver = deliver.receiver(store, handler)
    headers, body = signed_stripe()
    with caplog.at_level(logging.ERROR, logger="retrysafe"):
        failed = deliver(receiver, headers, body)
    problem = is_problem(failed, 500, "webhook_handler_failed")
    assert "hunter2" not in failed.content.decode() and "RuntimeError" not in str(problem)
    assert "hunter2" in caplog.text  # the traceback is in the log, not the answer
    [record] = store.records()
    assert record.status is Status.FAILED and not record.final  # retryable
    again = deliver(receiver, *signed_stripe())  # the provider's redelivery
    assert again.status == 200 and again.body["status"] == "processed"
    assert deliver(receiver, headers, body).body["status"] == "duplicate"
    assert handler.runs == ["evt_1R", "evt_1R"]
    assert [r.status for r in store.records()] == [Status.COMPLETED]


def test_rotation_accepts_old_and_new_secrets(store: Store[Any], deliver: Deliver) -> None:
    handler = Handler()
    receiver = deliver.receiver(store, handler, secrets=["whsec_old", "whsec_new"])
    assert deliver(receiver, *signed_stripe("evt_old", "whsec_old")).status == 200
    assert deliver(receiver, *signed_stripe("evt_new", "whsec_new")).status == 200
    stranger = deliver(receiver, *signed_stripe("evt_x", "whsec_retired"))
    assert is_problem(stranger, 401, "webhook_signature_invalid")["reason"] == "bad_signature"
    assert handler.runs == ["evt_old", "evt_new"]
    assert sorted(r.key for r in store.records()) == [
        "webhook:stripe:evt_new",
        "webhook:stripe:evt_old",
    ]


def gateway_delivery(msg: str, transaction: str, kind: str) -> tuple[dict[str, str], bytes]:
    """A payment gateway's delivery, signed the Standard Webhooks way (as Svix does)."""
    body = json.dumps({"type": kind, "data": {"transaction_id": transaction}}).encode()
    return standard_headers(body, STANDARD_SECRET, at=int(time.time()), msg=msg), body


def transaction_of(delivery: Delivery) -> tuple[str, str] | None:
    event = delivery.json()
    if "transaction_id" not in event["data"]:
        return None  # an event about no transaction: deduplicated by its id
    return event["data"]["transaction_id"], event["type"]


def test_payment_gateway_one_event_type_per_transaction(
    store: Store[Any], deliver: Deliver
) -> None:
    seen: list[tuple[str, str | None, str | None]] = []

    def handler(delivery: Delivery) -> Any:
        seen.append((delivery.event_id, delivery.transaction_id, delivery.event_type))
        return {"ok": True}

    receiver = deliver.receiver(
        store,
        handler,
        scheme="standard",
        secrets=STANDARD_SECRET,
        source="acmepay",
        transaction=transaction_of,
    )
    first = deliver(receiver, *gateway_delivery("msg_1", "tx_42", "payment.succeeded"))
    assert first.body == {"status": "processed", "event_id": "msg_1", "result": {"ok": True}}
    # The gateway sends the same event type of the same transaction under a new id.
    again = deliver(receiver, *gateway_delivery("msg_2", "tx_42", "payment.succeeded"))
    assert again.body == {
        "status": "duplicate",
        "event_id": "msg_2",
        "original_event_id": "msg_1",
        "result": {"ok": True},
    }
    refund = deliver(receiver, *gateway_delivery("msg_3", "tx_42", "refund.processed"))
    assert refund.body["status"] == "processed"
    other = deliver(receiver, *gateway_delivery("msg_4", "tx_43", "payment.succeeded"))
    assert other.body["status"] == "processed"
    body = json.dumps({"type": "account.updated", "data": {}}).encode()
    headers = standard_headers(body, STANDARD_SECRET, at=int(time.time()), msg="msg_5")
    assert deliver(receiver, headers, body).body["status"] == "processed"
    assert deliver(receiver, headers, body).body["status"] == "duplicate"
    assert seen == [
        ("msg_1", "tx_42", "payment.succeeded"),
        ("msg_3", "tx_42", "refund.processed"),
        ("msg_4", "tx_43", "payment.succeeded"),
        ("msg_5", None, None),
    ]
    records = {r.key: r for r in store.records()}
    assert set(records) == {
        "webhook:acmepay:tx_42:payment.succeeded",
        "webhook:acmepay:tx_42:refund.processed",
        "webhook:acmepay:tx_43:payment.succeeded",
        "webhook:acmepay:msg_5",
    }
    kept = records["webhook:acmepay:tx_42:payment.succeeded"]
    assert kept.operation == "payment_webhook"  # for reconciliation:
    assert kept.metadata == {
        "source": "acmepay",
        "event_id": "msg_1",
        "transaction_id": "tx_42",
        "event_type": "payment.succeeded",
    }


def test_in_flight_delivery_gets_409(store: Store[Any], deliver: Deliver) -> None:
    headers, body = signed_stripe()
    inner: list[WebhookResponse] = []

    def handler(delivery: Delivery) -> Any:
        # The provider delivers again while the first delivery is still being handled.
        if deliver.loop is None:
            inner.append(receiver.handle(headers, body))
        else:
            inner.append(
                asyncio.run_coroutine_threadsafe(
                    receiver.ahandle(headers, body), deliver.loop
                ).result(10)
            )
        return "done"

    if deliver.mode == "async":  # a plain handler: ahandle runs it in a worker thread
        receiver = Receiver(store, scheme="stripe", secrets=STRIPE_SECRET, handler=handler)
        deliver.receivers.append(receiver)
    else:
        receiver = deliver.receiver(store, handler)
    assert deliver(receiver, headers, body).body["result"] == "done"
    [busy] = inner
    assert is_problem(busy, 409, "idempotency_in_flight")["retry_after"] >= 1
    assert int(dict(busy.headers)["retry-after"]) >= 1
    assert deliver(receiver, headers, body).body["status"] == "duplicate"


def test_result_that_is_not_json(
    store: Store[Any], deliver: Deliver, caplog: pytest.LogCaptureFixture
) -> None:
    handler = Handler(result=object())
    receiver = deliver.receiver(store, handler)
    headers, body = signed_stripe()
    with caplog.at_level(logging.ERROR, logger="retrysafe"):
        first = deliver(receiver, headers, body)
    is_problem(first, 500, "webhook_result_invalid")
    assert "not a JSON value" in caplog.text
    [record] = store.records()
    assert record.status is Status.FAILED and record.final  # it ran: never again
    again = deliver(receiver, headers, body)  # the provider retries the 500
    assert again.status == 200
    assert again.body == {
        "status": "duplicate",
        "event_id": "evt_1R",
        "original_event_id": "evt_1R",
        "result": None,
    }
    assert handler.runs == ["evt_1R"]


def test_store_down_is_503(deliver: Deliver) -> None:
    handler = Handler()
    receiver = deliver.receiver("redis://127.0.0.1:1", handler)
    answer = deliver(receiver, *signed_stripe())
    is_problem(answer, 503, "idempotency_store_unavailable")
    assert int(dict(answer.headers)["retry-after"]) >= 1 and handler.runs == []


def test_shopify_and_standard_schemes(memory: Store[Any], deliver: Deliver) -> None:
    handler = Handler(result={"ok": True})
    shopify = deliver.receiver(memory, handler, scheme="shopify", secrets=SHOPIFY_SECRET)
    body = b"not json: Shopify's scheme does not need the body"
    event = {
        "X-Shopify-Event-Id": "98880550-7158-44d4-b7cd-2c97c8a091b5",
        "X-Shopify-Webhook-Id": "b54557e4-bdd9-4b37-8a5f-bf7d70bcd043",
    }
    headers = shopify_headers(body, SHOPIFY_SECRET, **event)
    first = deliver(shopify, headers, body).body
    assert first["status"] == "processed" and first["event_id"] == event["X-Shopify-Event-Id"]
    # A retry of the event comes with another webhook id but the same event id.
    retry = shopify_headers(body, SHOPIFY_SECRET, **{**event, "X-Shopify-Webhook-Id": "w2"})
    assert deliver(shopify, retry, body).body["status"] == "duplicate"
    # Without X-Shopify-Event-Id, the webhook id is the event id.
    other = b'{"id": 2}'
    legacy = shopify_headers(other, SHOPIFY_SECRET, **{"X-Shopify-Webhook-Id": "w3"})
    assert deliver(shopify, legacy, other).body["event_id"] == "w3"
    forged = shopify_headers(body, "wrong", **event)
    assert deliver(shopify, forged, body).status == 401
    standard = deliver.receiver(memory, handler, scheme="standard", secrets=STANDARD_SECRET)
    signed = standard_headers(body, STANDARD_SECRET, at=int(time.time()), msg="msg_ab")
    assert deliver(standard, signed, body).body["status"] == "processed"
    assert deliver(standard, signed, body).body["status"] == "duplicate"
    stale = standard_headers(body, STANDARD_SECRET, at=int(time.time()) - 301, msg="msg_cd")
    assert deliver(standard, stale, body).status == 401
    assert len(handler.runs) == 3
    # Shopify signs the body only: its records are keyed by what is signed.
    digest = {hashlib.sha256(b).hexdigest()[:40] for b in (body, other)}
    assert sorted(r.key for r in memory.records()) == sorted(
        [*(f"webhook:shopify:sha256-{d}" for d in digest), "webhook:standard:msg_ab"]
    )
    ids = {r.request_id for r in memory.records() if r.key.startswith("webhook:shopify")}
    assert ids == {event["X-Shopify-Event-Id"], "w3"}  # the header ids, kept for inspection


def test_an_unsigned_event_id_cannot_replay_or_shadow_a_delivery(
    memory: Store[Any], deliver: Deliver
) -> None:
    """A captured Shopify delivery resent under new event ids is still one event."""
    handler = Handler(result="ok")
    shopify = deliver.receiver(memory, handler, scheme="shopify", secrets=SHOPIFY_SECRET)
    body = b'{"id": 1, "total": "10.00"}'
    for event_id in ("evt-1", "evt-attacker-2", "evt-attacker-3"):
        headers = shopify_headers(body, SHOPIFY_SECRET, **{"X-Shopify-Event-Id": event_id})
        deliver(shopify, headers, body)
    assert handler.runs == ["evt-1"]
    # An old body sent under the id of a later event does not shadow that event.
    later = b'{"id": 2, "total": "99.00"}'
    shadow = shopify_headers(body, SHOPIFY_SECRET, **{"X-Shopify-Event-Id": "evt-9"})
    assert deliver(shopify, shadow, body).body["status"] == "duplicate"
    real = shopify_headers(later, SHOPIFY_SECRET, **{"X-Shopify-Event-Id": "evt-9"})
    assert deliver(shopify, real, later).body["status"] == "processed"
    assert handler.runs == ["evt-1", "evt-9"]
    # Behind a trusted transport, the map's key by the header id.
    trusting = deliver.receiver(
        memory,
        handler,
        scheme="shopify",
        secrets=SHOPIFY_SECRET,
        source="trusted",
        trust_event_ids=True,
    )
    headers = shopify_headers(body, SHOPIFY_SECRET, **{"X-Shopify-Event-Id": "evt-1"})
    deliver(trusting, headers, body)
    assert any(r.key == "webhook:trusted:evt-1" for r in memory.records())


def test_sources_scope_keys_and_odd_ids_are_hashed(memory: Store[Any]) -> None:
    handler = Handler(result="ok")
    github = Receiver(memory, scheme="hmac", secrets="s3cret", handler=handler, source="github")
    other = Receiver(memory, scheme="hmac", secrets="s3cret", handler=handler, source="billing")
    mac = hmac.new(b"s3cret", BODY, hashlib.sha256).hexdigest()
    headers = {"X-Hub-Signature-256": "sha256=" + mac, "X-GitHub-Delivery": "d-1"}
    assert github.handle(headers, BODY).body["status"] == "processed"
    assert other.handle(headers, BODY).body["status"] == "processed"  # the same id elsewhere
    assert github.handle(headers, BODY).body["status"] == "duplicate"
    # The generic scheme signs the body only: the key is the body's hash, whatever the id.
    anonymous = {"X-Signature": mac}
    assert github.handle(anonymous, BODY).body["status"] == "duplicate"
    body_key = "sha256-" + hashlib.sha256(BODY).hexdigest()[:40]
    keys = sorted(r.key for r in memory.records())
    assert keys == [f"webhook:billing:{body_key}", f"webhook:github:{body_key}"]
    assert handler.runs == ["d-1", "d-1"]
    # Trusting the header ids: an odd id (no id header: "sha256:<body hash>") is hashed.
    trusting = Receiver(
        memory,
        scheme="hmac",
        secrets="s3cret",
        handler=handler,
        source="trusted",
        trust_event_ids=True,
    )
    assert trusting.handle(anonymous, BODY).body["event_id"].startswith("sha256:")
    assert trusting.handle(anonymous, BODY).body["status"] == "duplicate"
    trusted = [r.key for r in memory.records() if r.key.startswith("webhook:trusted:")]
    assert len(trusted) == 1 and trusted[0].startswith("webhook:trusted:sha256-")
    assert trusted[0] != f"webhook:trusted:{body_key}"  # the hash of the id, not of the body


def test_body_limit_and_bad_options(memory: Store[Any]) -> None:
    handler = Handler()
    receiver = Receiver(
        memory, scheme="stripe", secrets=STRIPE_SECRET, handler=handler, max_body=64
    )
    is_problem(receiver.handle(*signed_stripe()), 413, "idempotency_body_too_large")
    assert handler.runs == [] and memory.records() == []
    for options, error in [
        ({"scheme": "paypal"}, ValueError),
        ({"secrets": []}, ValueError),
        ({"scheme": "standard", "secrets": "whsec_%%%"}, ValueError),
        ({"source": "two words"}, ValueError),
        ({"source": "a:b"}, ValueError),
        ({"handler": "not callable"}, TypeError),
        ({"transaction": 42}, TypeError),
        ({"tolerance": -1}, ValueError),
        ({"ttl": 0}, ValueError),
        ({"max_body": -1}, ValueError),
    ]:
        with pytest.raises(error):
            Receiver(memory, **{"scheme": "stripe", "secrets": "s", "handler": handler, **options})
    with pytest.raises(TypeError):
        receiver.handle({}, "text")  # type: ignore[arg-type]


def test_delivery_json_and_headers(memory: Store[Any]) -> None:
    got: list[Delivery] = []
    receiver = Receiver(
        memory, scheme="stripe", secrets=STRIPE_SECRET, handler=lambda d: got.append(d)
    )
    headers, body = signed_stripe()
    assert receiver.handle({**headers, "X-Trace": "abc"}, body).body["result"] is None
    [delivery] = got
    assert delivery.json() is delivery.json() and delivery.json()["id"] == "evt_1R"
    assert delivery.headers["x-trace"] == delivery.headers["X-TRACE"] == "abc"
    assert delivery.key == "webhook:stripe:evt_1R" and delivery.source == "stripe"
    assert delivery.body == body and delivery.transaction_id is None
    with pytest.raises(AttributeError):
        delivery.key = "other"  # type: ignore[misc]


def test_transaction_that_fails_stores_nothing(memory: Store[Any]) -> None:
    handler = Handler()

    def broken(delivery: Delivery) -> Any:
        return delivery.json()["data"]["missing"]

    receiver = Receiver(
        memory, scheme="stripe", secrets=STRIPE_SECRET, handler=handler, transaction=broken
    )
    is_problem(receiver.handle(*signed_stripe()), 500, "webhook_handler_failed")
    wrong = Receiver(
        memory,
        scheme="stripe",
        secrets=STRIPE_SECRET,
        handler=handler,
        transaction=lambda d: ("tx", 7),
    )
    is_problem(wrong.handle(*signed_stripe()), 500, "webhook_handler_failed")
    assert handler.runs == [] and memory.records() == []


def test_async_handler_from_sync_code_and_sync_handler_in_ahandle(memory: Store[Any]) -> None:
    async def ahandler(delivery: Delivery) -> Any:
        await asyncio.sleep(0)
        return threading.current_thread().name

    receiver = Receiver(memory, scheme="stripe", secrets=STRIPE_SECRET, handler=ahandler)
    assert receiver.handle(*signed_stripe("evt_a")).body["status"] == "processed"

    async def from_a_loop() -> None:
        with pytest.raises(RuntimeError, match="ahandle"):
            receiver.handle(*signed_stripe("evt_b"))
        plain = Receiver(
            memory,
            scheme="stripe",
            secrets=STRIPE_SECRET,
            handler=lambda d: threading.current_thread().name,
        )
        answer = await plain.ahandle(*signed_stripe("evt_c"))
        assert answer.body["result"] != threading.current_thread().name  # a worker thread

    asyncio.run(from_a_loop())
    assert [r.key for r in memory.records()] == ["webhook:stripe:evt_a", "webhook:stripe:evt_c"]


def test_long_handler_keeps_its_key(memory: Store[Any]) -> None:
    headers, body = signed_stripe()
    inner: list[WebhookResponse] = []
    runs: list[str] = []

    def slow(delivery: Delivery) -> Any:
        runs.append(delivery.event_id)
        if len(runs) == 1:
            time.sleep(2.0)  # two leases: without renewal a redelivery would take the key
            inner.append(receiver.handle(headers, body))
        return "done"

    receiver = Receiver(memory, scheme="stripe", secrets=STRIPE_SECRET, handler=slow, lease=1.0)
    assert receiver.handle(headers, body).body["status"] == "processed"
    assert inner[0].status == 409 and runs == ["evt_1R"]


# -- over HTTP: the ASGI adapter on uvicorn, the WSGI adapter on werkzeug ----------------------


@pytest.mark.parametrize("kind", ["asgi", "wsgi"])
def test_over_http(kind: str, tmp_path: Path) -> None:
    handler = Handler()
    store = open_store(f"sqlite:///{tmp_path}/webhooks.db")
    receiver = Receiver(
        store, scheme="stripe", secrets=STRIPE_SECRET, handler=handler, max_body=4096
    )
    app = receiver.asgi if kind == "asgi" else receiver.wsgi
    headers, body = signed_stripe()
    with ThreadServer(app, kind) as server, httpx.Client(base_url=server.url) as client:
        answers = [client.post("/hooks/stripe", content=body, headers=headers) for _ in range(3)]
        assert [a.status_code for a in answers] == [200, 200, 200]
        assert [a.json()["status"] for a in answers] == ["processed", "duplicate", "duplicate"]
        assert answers[0].headers["content-type"] == "application/json"
        assert "idempotent-replayed" not in answers[0].headers
        assert answers[1].headers["idempotent-replayed"] == "true"
        # The key is the event id, never an Idempotency-Key header.
        keyed = client.post("/", content=body, headers={**headers, "Idempotency-Key": "k2"})
        assert keyed.json()["status"] == "duplicate"
        forged = client.post("/", content=body, headers={"Stripe-Signature": "t=1,v1=00"})
        assert forged.status_code == 401
        assert forged.headers["content-type"] == "application/problem+json"
        assert forged.json()["reason"] == "bad_signature"
        get = client.get("/")
        assert get.status_code == 405 and get.headers["allow"] == "POST"
        big = stripe_event("evt_big", note="x" * 5000)
        assert client.post("/", content=big, headers=headers).status_code == 413

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
            yield big

        assert client.post("/", content=chunks(), headers=headers).status_code == 413
    assert handler.runs == ["evt_1R"] and [r.key for r in store.records()] == [
        "webhook:stripe:evt_1R"
    ]
    store.close()


# -- races: one run of the handler, however many deliveries come at once -----------------------

THREADS = 32


def racing_receiver(store: Store[Any], effects: str) -> Receiver:
    """A receiver whose handler's side effect is a line in ``effects`` (outside every process)."""

    def handler(delivery: Delivery) -> Any:
        with open(effects, "a") as f:
            f.write(f"{delivery.event_id}\n")
        return {"charged": delivery.json()["id"]}

    return Receiver(Engine(store), scheme="stripe", secrets=STRIPE_SECRET, handler=handler)


def check_race(answers: list[tuple[int, str]], effects: Path, racers: int) -> None:
    assert len(answers) == racers
    assert answers.count((200, "processed")) == 1, answers
    assert set(answers) <= {(200, "processed"), (200, "duplicate"), (409, "in_flight")}
    assert effects.read_text().splitlines() == ["evt_race"]


def outcome(answer: WebhookResponse) -> tuple[int, str]:
    if answer.status == 409:
        return 409, "in_flight"
    return answer.status, answer.body.get("status", answer.body.get("code"))


def test_threads_race(store: Store[Any], tmp_path: Path) -> None:
    effects = tmp_path / "effects"
    effects.touch()
    receiver = racing_receiver(store, str(effects))
    barrier = threading.Barrier(THREADS)

    def racer(i: int) -> tuple[int, str]:
        headers, body = signed_stripe("evt_race")  # each thread's own signature
        barrier.wait()
        return outcome(receiver.handle(headers, body))

    with ThreadPoolExecutor(THREADS) as pool:
        answers = list(pool.map(racer, range(THREADS)))
    check_race(answers, effects, THREADS)


async def test_tasks_race(store: Store[Any], tmp_path: Path) -> None:
    effects = tmp_path / "effects"
    effects.touch()
    receiver = racing_receiver(store, str(effects))
    headers, body = signed_stripe("evt_race")
    gate = asyncio.Event()

    async def racer() -> tuple[int, str]:
        await gate.wait()
        return outcome(await receiver.ahandle(headers, body))

    tasks = [asyncio.create_task(racer()) for _ in range(64)]
    await asyncio.sleep(0)
    gate.set()
    answers = await asyncio.gather(*tasks)
    await receiver.aclose()
    check_race(answers, effects, 64)


def _webhook_racer(store: Store[Any], effects: str) -> Callable[[str], tuple[int, str]]:
    receiver = racing_receiver(store, effects)

    def racer(who: str) -> tuple[int, str]:
        return outcome(receiver.handle(*signed_stripe("evt_race")))

    return racer


def test_processes_race(shared_spec: StoreSpec, tmp_path: Path) -> None:
    effects = tmp_path / "effects"
    effects.touch()
    answers = race_processes(shared_spec, _webhook_racer, str(effects), processes=4, threads=8)
    check_race(answers, effects, 4 * 8)


# -- the documented framework one-liners (docs/webhooks.md) -------------------------------------


def test_flask_view_and_mounted_wsgi_app(memory: Store[Any]) -> None:
    from flask import Flask, request
    from werkzeug.middleware.dispatcher import DispatcherMiddleware

    handler = Handler()
    stripe = Receiver(memory, scheme="stripe", secrets=STRIPE_SECRET, handler=handler)
    app = Flask(__name__)

    @app.post("/hooks/stripe")
    def stripe_hook() -> Any:
        answer = stripe.handle(request.headers, request.get_data())
        return answer.content, answer.status, answer.headers

    app.wsgi_app = DispatcherMiddleware(app.wsgi_app, {"/hooks/mounted": stripe.wsgi})  # type: ignore[method-assign]
    client = app.test_client()
    headers, body = signed_stripe()
    first = client.post("/hooks/stripe", data=body, headers=headers)
    result = {"handled": "evt_1R", "type": "charge.succeeded"}
    assert first.status_code == 200
    assert first.json == {"status": "processed", "event_id": "evt_1R", "result": result}
    again = client.post("/hooks/mounted", data=body, headers=headers)
    assert again.status_code == 200 and again.json["status"] == "duplicate"  # type: ignore[index]
    assert again.headers["Idempotent-Replayed"] == "true"
    forged = client.post("/hooks/stripe", data=body, headers={"Stripe-Signature": "t=1,v1=00"})
    assert forged.status_code == 401 and forged.content_type == "application/problem+json"
    assert handler.runs == ["evt_1R"]


async def test_fastapi_view_and_route(memory: Store[Any]) -> None:
    handler = Handler()
    stripe = Receiver(memory, scheme="stripe", secrets=STRIPE_SECRET, handler=handler)
    app = FastAPI()

    @app.post("/hooks/stripe")
    async def stripe_hook(request: Request) -> Response:
        answer = await stripe.ahandle(request.headers, await request.body())
        return Response(answer.content, answer.status, dict(answer.headers))

    app.add_route("/hooks/direct", stripe.asgi, methods=["POST"])  # the exact path, no redirect
    headers, body = signed_stripe()
    transport = httpx.ASGITransport(app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        first = await client.post("/hooks/stripe", content=body, headers=headers)
        assert first.status_code == 200 and first.json()["status"] == "processed"
        again = await client.post("/hooks/direct", content=body, headers=headers)
        assert again.status_code == 200 and again.json()["status"] == "duplicate"
        assert again.headers["idempotent-replayed"] == "true"
    assert handler.runs == ["evt_1R"]


def test_django_view(memory: Store[Any], tmp_path: Path) -> None:
    from _http_apps import Counter, django_app

    django_app(Counter(tmp_path), {})  # the test suite's Django settings
    from django.http import HttpResponse
    from django.test import RequestFactory
    from django.views.decorators.csrf import csrf_exempt
    from django.views.decorators.http import require_POST

    handler = Handler()
    stripe = Receiver(memory, scheme="stripe", secrets=STRIPE_SECRET, handler=handler)

    @csrf_exempt
    @require_POST
    def stripe_hook(request: Any) -> HttpResponse:
        answer = stripe.handle(request.headers, request.body)
        return HttpResponse(answer.content, status=answer.status, headers=dict(answer.headers))

    headers, body = signed_stripe()
    meta = {"HTTP_STRIPE_SIGNATURE": headers["Stripe-Signature"]}
    factory = RequestFactory()
    for expected in ("processed", "duplicate"):
        request = factory.post("/hooks/stripe", body, content_type="application/json", **meta)
        answer = stripe_hook(request)
        assert answer.status_code == 200 and json.loads(answer.content)["status"] == expected
    assert (
        stripe_hook(factory.post("/hooks/stripe", body, content_type="text/plain")).status_code
        == 401
    )
    assert handler.runs == ["evt_1R"]
