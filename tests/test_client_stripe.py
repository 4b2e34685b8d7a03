"""The official ``stripe`` SDK, retries on, through the gateway: exactly once with its own keys.

Issue "Step 6". A real ``retrysafe gateway`` process runs in front of a real,
flaky imitation of Stripe's API (tests/_stripe_upstream.py, which counts its
effects in SQLite), and the official SDK (``stripe.StripeClient`` with its
default requests-based HTTP client and ``max_network_retries`` on) is pointed at
the gateway. These tests prove that:

- the SDK's retries of a 503, of a connection dropped before any work and of a
  read timeout after the work each end in the object and one effect; after the
  timeout the upstream saw the call once, the SDK's retries got 409 while it ran
  and then the gateway's replay;
- the gateway keys on the key the SDK generates: every attempt of a call
  carries one key, two calls two keys, and that key is the one the upstream and
  the gateway's store saw;
- 8 threads sharing one SDK client over every flaky mode get every object, with
  one effect per call;
- an explicit ``idempotency_key`` reused with the same params is a replay; with
  other params the gateway's 422 reaches the SDK as a plain ``APIError`` (not
  ``IdempotencyError``, which it raises only for Stripe's own 400/404 with
  ``error.type == "idempotency_error"``), unretried, with no second effect;
- an answer cut off mid-body is not retried by the SDK (requests raises
  ``ChunkedEncodingError``, which the SDK does not count as retryable), and
  calling again with the key the SDK used is safe.

What the SDK (stripe 16, ``stripe._http_client.HTTPClient``) retries, up to
``max_network_retries`` times with one key per call: a ``Stripe-Should-Retry``
header decides first, then 409 and every status >= 500; of the transport errors,
the requests client retries only timeouts and connection errors. It generates
an ``Idempotency-Key`` (a random UUID4-shaped string) for every POST, retries
on or off. Its sleeps are ``INITIAL_DELAY`` and ``MAX_DELAY`` (0.5 s and 5 s),
made short here.
"""

from __future__ import annotations

import json
import re
import sys
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import requests
import stripe
from _http_servers import Process, free_port, uvicorn_argv
from _stripe_upstream import calls

from retrysafe import open_store

TIMEOUT = 4.0  # the SDK's: room for a loaded machine; the slow mode outlasts it
SLOW = "6"
NO_ANSWER = 0  # the status of an attempt that got no (whole) answer
MODES: dict[str, dict[str, str]] = {
    "ok": {"mode": "ok"},
    "503": {"mode": "503", "n": "2"},
    "drop": {"mode": "drop", "n": "1"},
    "slow": {"mode": "slow", "s": SLOW},
}
UUID4ISH = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass
class Stack:
    url: str  # the gateway's
    db: str  # the upstream's calls and effects
    store: str  # the gateway's store URL


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two real processes: the gateway in front of the Stripe imitation."""
    root = tmp_path_factory.mktemp("stripe")
    db, store = str(root / "stripe.db"), f"sqlite:///{root / 'gateway.db'}"
    up, gp = free_port(), free_port()
    argv = uvicorn_argv("_stripe_upstream:app_from_env", up)
    with Process(argv, up, {"STRIPE_DB": db}, health="/health") as upstream:
        argv = [
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
        with Process(argv, gp, health="/_retrysafe/health") as gateway:
            yield Stack(gateway.url, db, store)


class Recording(stripe.RequestsClient):
    """The SDK's default HTTP client, keeping ``(Idempotency-Key, status)`` per attempt."""

    def __init__(self) -> None:
        super().__init__(timeout=TIMEOUT)
        self.attempts: list[tuple[str | None, int]] = []

    def request(
        self, method: str, url: str, headers: Mapping[str, str] | None, post_data: Any = None
    ) -> tuple[bytes, int, Mapping[str, str]]:
        key = (headers or {}).get("Idempotency-Key")
        try:
            content, status, rheaders = super().request(method, url, headers, post_data)
        except stripe.APIConnectionError:
            self.attempts.append((key, NO_ANSWER))
            raise
        self.attempts.append((key, status))
        return content, status, rheaders

    def statuses(self) -> list[int]:
        return [status for _, status in self.attempts]


@pytest.fixture
def sdk(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> tuple[stripe.StripeClient, Recording]:
    monkeypatch.setattr(stripe._http_client.HTTPClient, "INITIAL_DELAY", 0.05)
    monkeypatch.setattr(stripe._http_client.HTTPClient, "MAX_DELAY", 0.25)
    http = Recording()
    client = stripe.StripeClient(
        "sk_test_retrysafe",
        base_addresses={"api": stack.url},
        max_network_retries=60,  # enough 409s (at most 0.25 s apart) to outwait the slow mode
        http_client=http,
    )
    return client, http


def effects_of(stack: Stack, key: str) -> list[str | None]:
    """What each upstream call with ``key`` created (None: the call had no effect)."""
    return [row["object_id"] for row in calls(stack.db) if row["key"] == key]


def replayed(obj: stripe.StripeObject) -> bool:
    assert obj.last_response is not None
    return obj.last_response.headers.get("Idempotent-Replayed") == "true"


def key_of(obj: stripe.StripeObject) -> str:
    """The key the upstream saw for ``obj`` (it echoes it, as Stripe does)."""
    assert obj.last_response is not None
    key = obj.last_response.idempotency_key
    assert key
    return key


@pytest.mark.parametrize(
    ("mode", "statuses", "upstream"),
    [
        ("ok", [200], 1),
        ("503", [503, 503, 200], 3),
        ("drop", [502, 200], 2),  # the gateway answers the hang-up with a retryable 502
        ("slow", None, 1),  # a timeout, 409s while the first call runs, the replay
    ],
)
def test_each_flaky_mode_ends_in_one_effect(
    stack: Stack,
    sdk: tuple[stripe.StripeClient, Recording],
    mode: str,
    statuses: list[int] | None,
    upstream: int,
) -> None:
    client, http = sdk
    email = f"{mode}-{uuid.uuid4().hex[:8]}@example.com"
    customer = client.v1.customers.create(params={"email": email, "metadata": MODES[mode]})
    assert customer.object == "customer" and customer.email == email
    assert customer.metadata.to_dict() == MODES[mode]
    assert effects_of(stack, key_of(customer)) == [None] * (upstream - 1) + [customer.id]
    got = http.statuses()
    if statuses is not None:
        assert got == statuses
        assert not replayed(customer)
    else:
        assert got[0] == NO_ANSWER and got[-1] == 200, got
        assert set(got[1:-1]) == {409}, got
        assert replayed(customer)  # the first answer was lost: this one is the gateway's


def test_the_gateway_keys_on_the_sdks_own_key(
    stack: Stack, sdk: tuple[stripe.StripeClient, Recording]
) -> None:
    client, http = sdk
    params: dict[str, Any] = {"email": "twice@example.com", "metadata": MODES["503"]}
    first = client.v1.customers.create(params=params)
    first_keys = {key for key, _ in http.attempts}
    http.attempts.clear()
    second = client.v1.customers.create(params=params)  # same params: a new call, a new key
    second_keys = {key for key, _ in http.attempts}

    assert len(first_keys) == 1 and len(second_keys) == 1 and first_keys != second_keys
    (key,) = first_keys
    assert key is not None and UUID4ISH.fullmatch(key)
    assert key_of(first) == key and key_of(second) == second_keys.pop()
    assert first.id != second.id
    assert effects_of(stack, key) == [None, None, first.id]

    records = [r for r in open_store(stack.store).records(limit=1000) if r.key == key]
    assert [(r.status.value, r.attempts) for r in records] == [("completed", 3)]


def test_8_threads_over_every_flaky_mode(
    stack: Stack, sdk: tuple[stripe.StripeClient, Recording]
) -> None:
    client, _ = sdk

    def call(i: int) -> tuple[str, stripe.StripeObject]:
        mode = list(MODES)[i % len(MODES)]
        metadata = {**MODES[mode], "i": str(i)}
        if i % 2:
            params = {"email": f"t{i}@example.com", "metadata": metadata}
            return mode, client.v1.customers.create(params=params)
        params = {"amount": 100 + i, "currency": "usd", "metadata": metadata}
        return mode, client.v1.payment_intents.create(params=params)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(32)))

    keys = {key_of(obj) for _, obj in results}
    assert len(keys) == len(results)
    for i, (mode, obj) in enumerate(results):
        assert obj.metadata["i"] == str(i)
        assert obj.object == ("customer" if i % 2 else "payment_intent")
        done = [e for e in effects_of(stack, key_of(obj)) if e is not None]
        assert done == [obj.id], (i, mode, done)


def test_an_explicit_key_reused_replays_or_conflicts(
    stack: Stack, sdk: tuple[stripe.StripeClient, Recording]
) -> None:
    client, http = sdk
    key = f"order-{uuid.uuid4()}"
    params: dict[str, Any] = {"amount": 2999, "currency": "eur", "metadata": MODES["503"]}
    first = client.v1.payment_intents.create(params=params, options={"idempotency_key": key})
    again = client.v1.payment_intents.create(params=params, options={"idempotency_key": key})
    assert again.to_dict() == first.to_dict() and again.amount == 2999
    assert replayed(again) and not replayed(first)

    http.attempts.clear()
    other = {**params, "amount": 5000}
    with pytest.raises(stripe.APIError) as info:
        client.v1.payment_intents.create(params=other, options={"idempotency_key": key})
    error = info.value
    assert not isinstance(error, stripe.IdempotencyError)
    assert error.http_status == 422
    assert json.loads(error.http_body or "")["code"] == "idempotency_conflict"
    assert http.attempts == [(key, 422)]  # not retried
    assert effects_of(stack, key) == [None, None, first.id]


def test_an_answer_cut_off_mid_body_is_not_retried_by_the_sdk(
    stack: Stack, sdk: tuple[stripe.StripeClient, Recording]
) -> None:
    client, http = sdk
    params: dict[str, Any] = {"email": "cut@example.com", "metadata": {"mode": "cut", "n": "1"}}
    with pytest.raises(stripe.APIConnectionError) as info:
        client.v1.customers.create(params=params)
    assert isinstance(info.value.__cause__, requests.exceptions.ChunkedEncodingError)
    ((key, status),) = http.attempts  # one attempt, whatever max_network_retries says
    assert key is not None and status == NO_ANSWER

    customer = client.v1.customers.create(params=params, options={"idempotency_key": key})
    assert effects_of(stack, key) == [None, customer.id]
    assert not replayed(customer)  # the cut answer was a failure, not a stored answer
