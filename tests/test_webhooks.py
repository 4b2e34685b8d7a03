"""``retrysafe.webhooks.verify``: every scheme, signed by the providers' own libraries
where one exists (Stripe's SDK, the Standard Webhooks reference library)."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from standardwebhooks.webhooks import Webhook
from stripe import WebhookSignature

from retrysafe import IdempotencyError
from retrysafe.webhooks import SCHEMES, SignatureError, verify

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
    assert verify("shopify", headers, BODY, "shpss_1") == "ev-9"
    del headers["X-Shopify-Event-Id"]
    lower = {k.lower(): v for k, v in headers.items()}  # any case, any mapping
    assert verify("shopify", lower, BODY, "shpss_1") == "wh-1"
    assert verify("shopify", list(lower.items()), BODY, ["old", "shpss_1"]) == "wh-1"


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
        assert verify("hmac", {"X-Signature": value, "X-Event-Id": "e1"}, BODY, "s3cret") == "e1"
    github = {"X-Hub-Signature-256": "sha256=" + mac.hexdigest(), "X-GitHub-Delivery": "d-7"}
    assert verify("hmac", github, BODY, b"s3cret") == "d-7"
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
        ("standard", {"webhook-id": "m", "webhook-timestamp": "1", "webhook-signature": "v2,x"},
         "malformed_header"),
        ("hmac", {"X-Signature": "zz"}, "malformed_header"),
        ("hmac", {}, "missing_header"),
        ("nope", {}, "unknown_scheme"),
    ],
)  # fmt: skip
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
