"""The Idempotency Map drives the HTTP front doors: per-route operation, TTL,
retention, key requirement, header, duplicate answer and key format.

Every front door (Starlette, FastAPI, Flask, Django, the gateway in front of a
real upstream process) serves the test API of ``_http_apps`` on a real server.
"""

from __future__ import annotations

import http.client
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _doors import DOORS, build
from _hangup import CALLER, caller_scope, cookieless
from _http_apps import Counter
from _http_servers import ThreadServer
from test_http import problem

from retrysafe import IdempotencyMap, Store, key_hash, open_store

MAP = """
[operations.payment]
key = "payment:{order_id}:{amount}:{currency}:{timestamp}"
scope = "order"
ttl = "7d"
retention = "financial"

[operations.order]
key = "order:{cart_mandate_id}:{user_id}"
scope = "cart"
ttl = "2h"
lease = "10s"

[[routes]]
method = "POST"
path = "/orders"
operation = "order"
require_key = true
duplicate_response = "no_content"

[[routes]]
method = "POST"
path = "/raw"
operation = "payment"
header = "X-Payment-Key"
validate_key = true
"""

PAYMENT_KEY = "payment:order_789:2999:USD:1705420800"


@pytest.fixture(scope="module", params=DOORS)
def served(
    request: pytest.FixtureRequest, counter: Counter, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Store[Any], Counter]]:
    root = tmp_path_factory.mktemp(request.param)
    path = root / "idempotency.toml"
    path.write_text(MAP)
    store = open_store(f"sqlite:///{root}/map.db")
    upstream = request.getfixturevalue("upstream") if request.param == "gateway" else None
    app, kind = build(request.param, counter, store, upstream, map=str(path))
    with ThreadServer(app, kind) as server:
        yield server.url, store, counter
    store.close()


@pytest.fixture
def client(served: tuple[str, Store[Any], Counter]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served[0], timeout=30, headers=CALLER, cookies=cookieless()) as c:
        yield c


def test_route_requires_its_key_and_answers_duplicates_with_204(
    served: tuple[str, Store[Any], Counter], client: httpx.Client
) -> None:
    _, store, counter = served
    tid = uuid.uuid4().hex
    problem(
        client.post("/orders", json={"a": 1}, headers={"x-test-id": tid}),
        400,
        "idempotency_key_required",
    )
    assert counter.count(tid) == 0
    key = f"order:mandate_{tid}:user_1"
    headers = {"x-test-id": tid, "idempotency-key": key}
    first = client.post("/orders", json={"a": 1}, headers=headers)
    assert first.status_code == 201, first.text
    again = client.post("/orders", json={"a": 1}, headers=headers)
    assert again.status_code == 204 and again.headers["idempotent-replayed"] == "true"
    assert counter.count(tid) == 1
    record = store.get(key_hash(caller_scope(store), "order", key))
    assert record is not None and record.operation == "order"
    assert record.retention == "standard"
    assert record.expires_at - record.created_at == pytest.approx(2 * 3600)


def send_target(url: str, target: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """POST ``target`` byte for byte (httpx would remove its dot segments first)."""
    where = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname or "", where.port, timeout=30)
    try:
        conn.request(
            "POST",
            target,
            body=b'{"a": 1}',
            headers={"content-type": "application/json", **CALLER, **headers},
        )
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


@pytest.mark.parametrize("target", ["//orders", "/./orders", "/x/../orders", "/x//..//orders"])
def test_route_is_not_dodged_by_the_spelling_of_its_path(
    served: tuple[str, Store[Any], Counter], target: str
) -> None:
    """Repeated slashes and dot segments still match the route: its key requirement,
    operation and TTL apply, whatever the app then makes of the path."""
    url, store, _ = served
    status, body = send_target(url, target, {})
    assert status == 400 and b"idempotency_key_required" in body, (status, body)
    key = f"order:mandate_{uuid.uuid4().hex}:user_1"
    send_target(url, target, {"idempotency-key": key})
    record = store.get(key_hash(caller_scope(store), "order", key))
    assert record is not None and record.operation == "order"
    assert record.expires_at - record.created_at == pytest.approx(2 * 3600)


def test_route_reads_its_own_header_and_checks_the_key_format(
    served: tuple[str, Store[Any], Counter], client: httpx.Client
) -> None:
    _, store, counter = served
    tid = uuid.uuid4().hex
    key = f"payment:order_{tid}:2999:USD:1705420800"
    headers = {"x-test-id": tid, "x-payment-key": key}
    first = client.post("/raw", content=b"charge", headers=headers)
    assert first.status_code == 200, first.text
    again = client.post("/raw", content=b"charge", headers=headers)
    assert again.headers["idempotent-replayed"] == "true" and again.content == b"charge"
    record = store.get(key_hash(caller_scope(store), "payment", key))
    assert record is not None and record.retention == "financial"
    assert record.expires_at - record.created_at == pytest.approx(7 * 86400)

    bad = client.post(
        "/raw", content=b"charge", headers={"x-test-id": tid, "x-payment-key": "pay-123"}
    )
    doc = problem(bad, 400, "idempotency_key_invalid")
    assert "payment:{order_id}:{amount}:{currency}:{timestamp}" in doc["detail"]
    assert counter.count(tid) == 1  # the replay and the refused key ran nothing
    assert store.get(key_hash(caller_scope(store), "payment", "pay-123")) is None


def test_unmatched_requests_get_the_middleware_options(
    served: tuple[str, Store[Any], Counter], client: httpx.Client
) -> None:
    _, store, _ = served
    key = f"k-{uuid.uuid4().hex}"
    first = client.post("/status/201", headers={"idempotency-key": key})
    again = client.post("/status/201", headers={"idempotency-key": key})
    assert first.status_code == again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    record = store.get(key_hash(caller_scope(store), "http", key))
    assert record is not None and record.operation == "http"


def test_a_broken_map_is_refused_when_the_middleware_is_built(tmp_path: Path) -> None:
    from retrysafe.asgi import IdempotencyMiddleware

    path = tmp_path / "broken.toml"
    path.write_text(MAP.replace('operation = "order"', 'operation = "ordr"'))
    with pytest.raises(ValueError) as info:
        IdempotencyMiddleware(lambda *a: None, store="memory://", map=str(path))
    assert f"{path}:17: routes[0].operation" in str(info.value)


def test_a_map_object_works_too() -> None:
    from retrysafe.asgi import IdempotencyMiddleware

    imap = IdempotencyMap.loads(MAP)
    mw = IdempotencyMiddleware(lambda *a: None, store="memory://", map=imap)
    payment = mw.policy.select("POST", "/raw")
    assert payment is not None and payment.operation == "payment"
    assert payment.engine.retention == "financial" and payment.engine.ttl == 7 * 86400
    assert mw.policy.select("GET", "/orders") is None
    assert mw.policy.select("POST", "/other") is mw.policy


def test_star_routes_protect_writes_and_rest_patterns_take_any_character() -> None:
    from retrysafe import Operation, Route
    from retrysafe.asgi import IdempotencyMiddleware

    imap = IdempotencyMap(
        [Operation("payment", key="payment:{order_id}", scope="order")],
        [Route("*", "/pay/{x}", "payment"), Route("POST", "/payments/*", "payment")],
    )
    policy = IdempotencyMiddleware(lambda *a: None, store="memory://", map=imap).policy
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        chosen = policy.select(method, "/pay/1")
        assert chosen is not None and chosen.operation == "payment", method
    # A CORS preflight never carries the key: "*" must not demand one from it.
    for method in ("OPTIONS", "GET", "HEAD"):
        assert policy.select(method, "/pay/1") is None, method
    # A decoded %0A in the path must not slip past a rest-of-path route.
    chosen = policy.select("POST", "/payments/a\nb")
    assert chosen is not None and chosen.operation == "payment"
