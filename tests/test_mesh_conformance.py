"""The Mesh door as the protocol's texts ask: the envelope, keys, codes, HTTP statuses,
the client's retries by code, and the echo of other extensions.

The texts are the Mesh idempotency extension and the Forrst protocol pages it is
taken from (``protocol.md``, ``errors.md``, ``transport.md``, ``extensions/index.md``).
The HTTP tests serve a real :class:`MeshApp` on uvicorn over a SQLite file.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _hangup import CALLER
from _http_servers import ThreadServer

from retrysafe import Store, open_store
from retrysafe._ops.monitor import read_sample
from retrysafe.mesh import URN, MeshApp, MeshError, MeshIdempotency

KEY = "charge_order456_v1"
ARGUMENTS = {"amount": 100, "currency": "USD", "customer_id": "cust_123"}
RESULT = {"charge_id": "ch_abc", "status": "succeeded"}
PROTOCOL = {"name": "mesh", "version": "0.1.0"}
TRACING = "urn:mesh:ext:tracing"


def request(
    rid: str = "req_001",
    key: Any = KEY,
    arguments: dict[str, Any] | None = None,
    function: str = "payments.charge",
    extensions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The extension's request example; ``key`` None: without the extension."""
    call = {"function": function, "version": "1", "arguments": dict(arguments or ARGUMENTS)}
    envelope: dict[str, Any] = {"protocol": dict(PROTOCOL), "id": rid, "call": call}
    own = [] if key is None else [{"urn": URN, "options": {"key": key}}]
    if extensions is not None or own:
        envelope["extensions"] = [*(extensions or []), *own]
    return envelope


def data(response: dict[str, Any]) -> dict[str, Any]:
    [entry] = [e for e in response["extensions"] if e["urn"] == URN]
    return entry["data"]  # type: ignore[no-any-return]


class Functions:
    """The app's handlers, counting their runs."""

    def __init__(self) -> None:
        self.runs: list[str] = []

    def charge(self, call: dict[str, Any]) -> Any:
        self.runs.append("charge")
        return RESULT

    def declined(self, call: dict[str, Any]) -> Any:
        self.runs.append("declined")
        raise MeshError("PAYMENTS_CARD_DECLINED", "card declined")

    def flaky(self, call: dict[str, Any]) -> Any:
        self.runs.append("flaky")
        raise MeshError("PAYMENTS_GATEWAY_BUSY", "try again", retryable=True)

    def crash(self, call: dict[str, Any]) -> Any:
        self.runs.append("crash")
        raise RuntimeError("boom")

    def handlers(self) -> dict[str, Callable[..., Any]]:
        return {
            "payments.charge": self.charge,
            "payments.declined": self.declined,
            "payments.flaky": self.flaky,
            "payments.crash": self.crash,
        }


Served = tuple[httpx.Client, Functions, Store[Any]]


def serve(tmp_path: Path, **options: Any) -> Iterator[Served]:
    functions = Functions()
    store = open_store(f"sqlite:///{tmp_path}/mesh.db")
    app = MeshApp(functions.handlers(), store, **options)
    with (
        ThreadServer(app, "asgi") as server,
        httpx.Client(base_url=server.url, headers=CALLER) as client,
    ):
        yield client, functions, store
    store.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    yield from serve(tmp_path)


# -- 1. a response holds exactly one of result and errors (protocol.md, "Error Fields") --------


def test_success_envelopes_carry_no_errors(served: Served) -> None:
    client, functions, _ = served
    first = client.post("/", json=request()).json()
    cached = client.post("/", json=request("req_002")).json()
    plain = client.post("/", json=request(key=None)).json()
    for answer in (first, cached, plain):
        assert "errors" not in answer, answer
        assert answer["result"] == RESULT
    assert data(first)["status"] == "processed" and data(cached)["status"] == "cached"
    # Nothing to say: no extensions either, as in the protocol's minimal response.
    assert plain == {"protocol": PROTOCOL, "id": "req_001", "result": RESULT}
    assert functions.runs == ["charge", "charge"]


def test_a_null_result_is_a_success(memory: Store[Any]) -> None:
    mesh = MeshIdempotency(memory)
    answer = mesh.handle(request(), lambda call: None)
    assert answer["result"] is None and "errors" not in answer
    assert data(answer)["status"] == "processed"


def test_error_envelopes_carry_a_null_result_and_errors(served: Served) -> None:
    client, _, _ = served
    client.post("/", json=request())
    answers = [
        client.post("/", json=request(function="payments.declined")).json(),
        client.post("/", json=request("req_002", function="payments.declined")).json(),
        client.post("/", json=request(arguments={"amount": 1})).json(),
        client.post("/", json=request(function="payments.nope")).json(),
        client.post("/", json={"id": "req_001"}).json(),
    ]
    for answer in answers:
        assert answer["result"] is None and len(answer["errors"]) >= 1, answer
    assert data(answers[1])["status"] == "cached"


# -- 3. the protocol's standard codes (errors.md), as the reference implementation uses them ----

KEY_AT = "/extensions/0/options/key"
OLD_CODES = ("IDEMPOTENCY_KEY_REQUIRED", "IDEMPOTENCY_KEY_INVALID", "IDEMPOTENCY_STORE_UNAVAILABLE")


def invalid_keys() -> float:
    return read_sample().totals["invalid_key"].get("(none)", 0.0)


@pytest.mark.parametrize(
    "options", [{}, {"key": None}, {"key": 42}, {"key": ""}, {"key": ["k"]}], ids=repr
)
def test_a_missing_or_invalid_key_is_invalid_arguments(
    options: dict[str, Any], mode: str, memory: Store[Any]
) -> None:
    envelope = request()
    envelope["extensions"][0]["options"] = options
    mesh = MeshIdempotency(memory)
    runs: list[Any] = []
    before = invalid_keys()
    if mode == "sync":
        answer = mesh.handle(envelope, runs.append)
    else:
        answer = asyncio.run(mesh.ahandle(envelope, runs.append))
    [error] = answer["errors"]
    assert error["code"] == "INVALID_ARGUMENTS" and error["retryable"] is False
    assert error["source"] == {"pointer": KEY_AT} and error["message"]
    assert answer["result"] is None and runs == [] and memory.records() == []
    assert invalid_keys() == before + 1  # the metric still counts invalid keys


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_unreachable_store_is_unavailable(mode: str) -> None:
    mesh = MeshIdempotency("redis://127.0.0.1:1")
    runs: list[Any] = []
    if mode == "sync":
        answer = mesh.handle(request(), runs.append)
    else:
        answer = asyncio.run(mesh.ahandle(request(), runs.append))
    [error] = answer["errors"]
    assert error["code"] == "UNAVAILABLE" and error["retryable"] is True
    assert error["details"] == {"key": KEY, "retry_after": {"value": 1, "unit": "second"}}
    assert runs == []


def test_no_answer_uses_a_code_outside_the_spec(served: Served) -> None:
    client, _, _ = served
    bodies = [
        request(key=None),
        {**request(), "extensions": [{"urn": URN}]},
        request(key=7),
        request(key=""),
        request(function="payments.nope"),
        request(function="payments.declined"),
    ]
    for body in bodies:
        text = client.post("/", json=body).text
        assert not any(code in text for code in OLD_CODES), text
