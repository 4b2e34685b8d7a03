"""The demo shop: examples/retry_storm.py against ``retrysafe demo`` and against the
demo API alone, and the shop's HTTP answers to bad, late, forged and stale requests."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _http_servers import ThreadServer

from retrysafe._demo.api import DemoApi
from retrysafe._demo.shop import DEMO_SECRETS

ROOT = Path(__file__).resolve().parent.parent
STORM = ROOT / "examples" / "retry_storm.py"
ENV = {**os.environ, "RETRYSAFE_STORE": ""}
DONE = "exactly once: every side effect happened once"
ITEMS = [{"variant_id": "book", "quantity": 1, "price": "12.99"}]


def storm(url: str, customers: int = 6) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(STORM), url, "--customers", str(customers)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[httpx.Client, DemoApi]]:
    """The demo API alone (no gateway) on uvicorn, and a client for it."""
    api = DemoApi(str(tmp_path / "shop.db"), delay=0.0)
    with ThreadServer(api, "asgi") as server, httpx.Client(base_url=server.url) as client:
        yield client, api
    api.close()


# -- the retry storm --------------------------------------------------------------------


# Three Python processes start (the demo, serving its gateway and API, and two storms of
# about 115 requests each): 11 s beside two CPU hogs (13.5 s with six customers a
# storm, which took 66 s in a full run there). The bound is five times the full run's.
@pytest.mark.timeout(300)
def test_retry_storm_through_the_demo_gateway(tmp_path: Path) -> None:
    # The demo narrates every request: its output goes to a file, not a pipe nobody
    # reads (a full pipe would block the server's print).
    log = tmp_path / "demo.out"
    with log.open("w") as out:
        demo = subprocess.Popen(
            [sys.executable, "-m", "retrysafe", "demo", "--listen", "127.0.0.1:0"],
            cwd=tmp_path,
            env=ENV,
            text=True,
            stdout=out,
            stderr=subprocess.PIPE,
        )
    try:
        gateway = _gateway_of(log, demo)
        # Three customers a run: one refunded (every third, from the first), two not.
        first, second = storm(gateway, 3), storm(gateway, 3)  # fresh ids: a second run holds
        for result in (first, second):
            assert result.returncode == 0, result.stdout + result.stderr
            assert result.stdout.strip().splitlines()[-1] == DONE
        assert "answered as replays" in first.stdout and "webhooks_processed" in first.stdout
        stats = httpx.get(gateway + "/stats").json()
        assert stats["orders_created"] == stats["gateway_charges"] == 6
    finally:
        demo.send_signal(signal.SIGINT)
        _, err = demo.communicate(timeout=60)
    assert demo.returncode == 0 and "Traceback" not in err, err
    assert "replayed: the API did not run" in log.read_text()
    assert "retrysafe demo: stopped" in log.read_text()


def _gateway_of(log: Path, demo: subprocess.Popen[str]) -> str:
    """The gateway's URL from the demo's banner, once it answers its health check (a
    minute at most: the demo takes 3 s to start beside two CPU hogs)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert demo.poll() is None, demo.communicate()
        lines = [ln for ln in log.read_text().splitlines() if ln.startswith("  gateway   http")]
        if lines and "Ctrl-C" in log.read_text():
            url = lines[0].split()[1]
            try:
                if httpx.get(url + "/_retrysafe/health").status_code == 200:
                    return url
            except httpx.TransportError:
                pass
        time.sleep(0.05)
    raise AssertionError(f"the demo never served: {log.read_text()}")


def test_retry_storm_against_the_demo_api_alone(
    served: tuple[httpx.Client, DemoApi],
) -> None:
    client, api = served
    result = storm(str(client.base_url), customers=8)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == DONE
    assert "0 answered as replays" not in result.stdout  # webhook duplicates are replays
    assert api.stats["orders_created"] == 8
    assert api.stats["webhooks_processed"] == 2 * 8 + 3  # customers 0, 3 and 6 refund


def test_retry_storm_says_what_differed(
    served: tuple[httpx.Client, DemoApi], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, api = served
    real, calls = api.shop.stats, []

    def doubled_orders() -> dict[str, int]:  # as if one order had been made twice
        calls.append(1)
        counts = real()
        return {**counts, "orders_created": counts["orders_created"] * len(calls)}

    monkeypatch.setattr(api.shop, "stats", doubled_orders)
    result = storm(str(client.base_url), customers=2)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "orders_created                    2      4   <- differs" in result.stdout
    last = result.stdout.strip().splitlines()[-1]
    assert last == "NOT exactly once: orders_created 4 (expected 2)"


def test_retry_storm_without_a_demo(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    result = storm(url)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"no demo shop at {url}" in result.stdout and "retrysafe demo" in result.stdout


# -- answers to bad requests: a problem, a machine code, nothing written ----------------


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [
        ("POST", "/sessions", {"user_id": "u"}, 400, "invalid_field"),
        ("POST", "/sessions", {"user_id": "a:b", "device_id": "d"}, 400, "invalid_field"),
        ("POST", "/sessions", "[1]", 400, "invalid_json"),
        ("POST", "/sessions", "{", 400, "invalid_json"),
        ("POST", "/cart-mandates", {"user_id": "u", "items": []}, 400, "invalid_cart"),
        ("POST", "/cart-mandates", {"user_id": "u", "items": "book"}, 400, "invalid_cart"),
        (
            "POST",
            "/cart-mandates",
            {"user_id": "u", "items": [{**ITEMS[0], "price": "NaN"}]},
            400,
            "invalid_cart",
        ),
        (
            "POST",
            "/cart-mandates",
            {"user_id": "u", "items": [{**ITEMS[0], "quantity": 0}]},
            400,
            "invalid_cart",
        ),
        (
            "POST",
            "/cart-mandates",
            {"user_id": "u", "items": ITEMS, "currency": {"x": 1}},
            400,
            "invalid_field",
        ),
        (
            "POST",
            "/cart-mandates",
            {"user_id": "u", "device_id": "d", "items": ITEMS},
            401,
            "no_session",
        ),
        ("POST", "/intent-mandates", {"user_id": "u", "intent": {}}, 400, "invalid_intent"),
        ("POST", "/orders", {"user_id": "u", "cart_mandate_id": 7}, 400, "invalid_field"),
        ("POST", "/orders", {"user_id": "u", "cart_mandate_id": "cm_nope"}, 404, "unknown_mandate"),
        ("POST", "/payments", {"user_id": "u", "order_id": "ord_nope"}, 404, "unknown_order"),
        (
            "POST",
            "/session-updates",
            {"user_id": "u", "device_id": "d", "operation": "cart", "sequence": 1},
            401,
            "no_session",
        ),
        ("PUT", "/profiles/u", {"version": -1, "data": {}}, 400, "invalid_field"),
        ("PUT", "/profiles/a:b", {"version": 0, "data": {}}, 400, "invalid_field"),
        ("POST", "/consents/u", {"purpose": "marketing", "granted": "yes"}, 400, "invalid_field"),
        ("GET", "/payments/pay_nope", None, 404, "unknown_payment"),
        ("GET", "/nowhere", None, 404, "not_found"),
        ("GET", "/orders", None, 405, "method_not_allowed"),
        ("DELETE", "/profiles/u", None, 405, "method_not_allowed"),
        ("GET", "/webhooks/stripe", None, 405, "method_not_allowed"),
        ("POST", "/stats", {}, 405, "method_not_allowed"),
    ],
)
def test_bad_requests_get_a_problem_and_write_nothing(
    served: tuple[httpx.Client, DemoApi],
    method: str,
    path: str,
    body: Any,
    status: int,
    code: str,
) -> None:
    client, api = served
    before = api.stats
    content = body if isinstance(body, str) else None if body is None else json.dumps(body)
    r = client.request(method, path, content=content)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["code"] == code and r.json()["status"] == status
    assert api.stats == before
    assert client.get("/consents/u").json()["entries"] == []


def _mandate(client: httpx.Client, user: str) -> str:
    r = client.post("/cart-mandates", json={"user_id": user, "items": ITEMS})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def test_an_expired_cart_mandate_is_gone(
    served: tuple[httpx.Client, DemoApi], tmp_path: Path
) -> None:
    client, api = served
    mandate = _mandate(client, "alice")
    with sqlite3.connect(tmp_path / "shop.db") as db:  # 31 minutes later
        db.execute(
            "UPDATE shop_cart_mandates SET expires_at = ? WHERE id = ?", (time.time() - 60, mandate)
        )
    for _ in range(2):  # a retry is refused the same way, and writes nothing either
        r = client.post("/orders", json={"user_id": "alice", "cart_mandate_id": mandate})
        assert r.status_code == 410 and r.json()["code"] == "mandate_expired", r.text
    assert api.stats["orders_created"] == 0


def test_an_order_for_another_users_mandate_is_refused(
    served: tuple[httpx.Client, DemoApi],
) -> None:
    client, api = served
    mandate = _mandate(client, "alice")
    r = client.post("/orders", json={"user_id": "mallory", "cart_mandate_id": mandate})
    assert r.status_code == 404 and r.json()["code"] == "unknown_mandate"
    assert api.stats["orders_created"] == 0
    r = client.post("/orders", json={"user_id": "alice", "cart_mandate_id": mandate})
    assert r.status_code == 201 and api.stats["orders_created"] == 1


# -- webhooks: forged, early, late ------------------------------------------------------


def _stripe(kind: str, event_id: str, txn: str, secret: str = DEMO_SECRETS["stripe"]) -> Any:
    body = json.dumps({"id": event_id, "type": kind, "data": {"object": {"id": txn}}}).encode()
    t = int(time.time())
    mac = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return {"content": body, "headers": {"Stripe-Signature": f"t={t},v1={mac}"}}


def _shopify(event_id: str, secret: str = DEMO_SECRETS["shopify"]) -> Any:
    body = b'{"id": "ord_1"}'
    mac = base64.b64encode(hmac.new(secret.encode(), body, hashlib.sha256).digest()).decode()
    headers = {
        "X-Shopify-Hmac-Sha256": mac,
        "X-Shopify-Event-Id": event_id,
        "X-Shopify-Topic": "orders/create",
    }
    return {"content": body, "headers": headers}


def _paid(client: httpx.Client, user: str) -> dict[str, Any]:
    mandate = _mandate(client, user)
    order = client.post("/orders", json={"user_id": user, "cart_mandate_id": mandate}).json()
    paid = client.post("/payments", json={"user_id": user, "order_id": order["id"]})
    assert paid.status_code == 201 and paid.json()["status"] == "succeeded", paid.text
    return dict(paid.json())


def test_forged_webhooks_are_refused_and_write_nothing(
    served: tuple[httpx.Client, DemoApi],
) -> None:
    client, api = served
    txn = _paid(client, "alice")["transaction_id"]
    before = api.stats
    forged = [
        ("/webhooks/stripe", _stripe("charge.refunded", "evt_1", txn, secret="whsec_guess")),
        ("/webhooks/shopify", _shopify("shp_1", secret="guess")),
    ]
    for path, delivery in forged:
        r = client.post(path, **delivery)
        assert r.status_code == 401, r.text
        assert r.json()["code"] == "webhook_signature_invalid"
        assert r.json()["reason"] == "bad_signature"
    tampered = _shopify("shp_1")
    tampered["content"] = b'{"id": "ord_2"}'  # a body the signature is not for
    assert client.post("/webhooks/shopify", **tampered).status_code == 401
    unsigned = _stripe("charge.refunded", "evt_1", txn)
    del unsigned["headers"]["Stripe-Signature"]
    assert client.post("/webhooks/stripe", **unsigned).json()["reason"] == "missing_header"
    assert api.stats == before
    # Nothing was stored: the genuine deliveries of the same events are processed.
    r = client.post("/webhooks/stripe", **_stripe("charge.refunded", "evt_1", txn))
    assert r.status_code == 200 and r.json()["status"] == "processed", r.text
    assert client.post("/webhooks/shopify", **_shopify("shp_1")).json()["status"] == "processed"
    assert api.stats["webhooks_processed"] == before["webhooks_processed"] + 2


def test_a_success_event_after_the_refund_is_acknowledged_not_failed(
    served: tuple[httpx.Client, DemoApi],
) -> None:
    """Reordered: the refund first, then the (stale) success. The success gets 200 and
    leaves the payment refunded; a 5xx would have the provider redeliver it for days."""
    client, api = served
    paid = _paid(client, "alice")
    txn = paid["transaction_id"]
    r = client.post("/webhooks/stripe", **_stripe("charge.refunded", "evt_r", txn))
    assert r.status_code == 200 and r.json()["result"]["status"] == "refunded"
    r = client.post("/webhooks/stripe", **_stripe("payment_intent.succeeded", "evt_s", txn))
    assert r.status_code == 200, r.text
    assert r.json()["result"] == {
        "payment_id": paid["id"],
        "status": "refunded",
        "changed": False,
        "stale": True,
    }
    late = client.post("/webhooks/stripe", **_stripe("payment_intent.payment_failed", "e", txn))
    assert late.status_code == 200 and late.json()["result"]["stale"] is True
    assert client.get(f"/payments/{paid['id']}").json()["status"] == "refunded"
    assert api.stats["webhooks_processed"] == 3


def test_an_early_refund_fails_and_its_redelivery_after_the_success_applies(
    served: tuple[httpx.Client, DemoApi],
) -> None:
    """A refund while the payment is still pending is early, not stale: 5xx, nothing
    written; the provider's redelivery after the success event applies it."""
    client, api = served
    shop = api.shop
    shop.payment_states.start("pay_early")
    shop.db.conn().execute(
        "INSERT INTO shop_payments VALUES ('pay_early', 'ord_x', 100, 'EUR', 'txn_early', 0)"
    )
    refund = _stripe("charge.refunded", "evt_refund", "txn_early")
    r = client.post("/webhooks/stripe", **refund)
    assert r.status_code == 500 and r.json()["code"] == "webhook_handler_failed", r.text
    assert api.stats["webhooks_processed"] == 0
    assert shop.payment_states.state("pay_early") == "pending"
    r = client.post("/webhooks/stripe", **_stripe("payment_intent.succeeded", "evt_s", "txn_early"))
    assert r.status_code == 200 and r.json()["result"]["changed"] is True
    r = client.post("/webhooks/stripe", **refund)
    assert r.status_code == 200 and r.json()["status"] == "processed", r.text
    assert shop.payment_states.state("pay_early") == "refunded"
    assert api.stats["webhooks_processed"] == 2


def test_an_event_for_a_payment_not_recorded_yet_is_delivered_again(
    served: tuple[httpx.Client, DemoApi],
) -> None:
    client, api = served
    r = client.post("/webhooks/stripe", **_stripe("payment_intent.succeeded", "evt_1", "txn_x"))
    assert r.status_code == 500 and api.stats["webhooks_processed"] == 0


def test_a_session_is_used_only_with_its_token(served: tuple[httpx.Client, DemoApi]) -> None:
    client, api = served
    who = {"user_id": "alice", "device_id": "phone"}
    token = client.post("/sessions", json=who).json()["token"]
    cart = {**who, "items": ITEMS}
    before = api.stats
    for wrong in ({}, {"session_token": "forged"}, {"session_token": 7}):
        r = client.post("/cart-mandates", json={**cart, **wrong})
        assert r.status_code == 401 and r.json()["code"] == "no_session", r.text
    assert api.stats == before
    assert client.post("/cart-mandates", json={**cart, "session_token": token}).status_code == 201


def test_a_consent_change_sent_twice_is_one_entry(served: tuple[httpx.Client, DemoApi]) -> None:
    client, _ = served
    change = {"purpose": "marketing", "granted": True, "change_id": "c1"}
    first = client.post("/consents/bob", json=change)
    again = client.post("/consents/bob", json=change)
    assert first.status_code == again.status_code == 201 and first.json() == again.json()
    other = client.post("/consents/bob", json={**change, "granted": False})
    assert other.status_code == 422 and other.json()["code"] == "idempotency_conflict"
    entries = client.get("/consents/bob").json()["entries"]
    assert [(e["change_id"], e["granted"]) for e in entries] == [("c1", True)]


def test_a_failed_session_update_does_not_move_the_sequence(
    served: tuple[httpx.Client, DemoApi], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard's cell commits with the update's row and record (one SQLite transaction)."""
    client, api = served
    who = {"user_id": "carol", "device_id": "phone"}
    who["session_token"] = client.post("/sessions", json=who).json()["token"]
    update = {**who, "operation": "cart", "sequence": 1, "payload": {"n": 1}}
    real = json.dumps

    def failing(value: Any, **kw: Any) -> str:  # the row's payload cannot be written
        if value == {"n": 1} and not kw:  # (the fingerprint sorts its keys)
            raise OSError("disk full")
        return real(value, **kw)

    monkeypatch.setattr("retrysafe._demo.shop.json.dumps", failing)
    assert client.post("/session-updates", json=update).status_code == 500
    monkeypatch.setattr("retrysafe._demo.shop.json.dumps", real)
    retried = client.post("/session-updates", json=update)  # the same sequence number again
    assert retried.status_code == 201, retried.text
    assert api.stats["session_updates_applied"] == 1
