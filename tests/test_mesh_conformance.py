"""The Mesh door as the protocol's texts ask: the envelope, keys, codes, HTTP statuses,
the client's retries by code, and the echo of other extensions.

The texts are the Mesh idempotency extension and the Forrst protocol pages it is
taken from (``protocol.md``, ``errors.md``, ``transport.md``, ``extensions/index.md``).
The HTTP tests serve a real :class:`MeshApp` on uvicorn over a SQLite file.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from _hangup import CALLER
from _http_servers import ThreadServer

from retrysafe import InvalidKeyError, Store, open_store
from retrysafe._model.hashing import protocol_key
from retrysafe._ops.monitor import read_sample
from retrysafe.client import MeshClient
from retrysafe.mesh import MAX_KEY_LENGTH, URN, MeshApp, MeshError, MeshIdempotency, status_of

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


# -- 2. a key is any string (idempotency.md, "Options"), of at most 1024 characters ------------

KEYS = [
    "commande_é_42",
    "k" * 256,
    "k" * MAX_KEY_LENGTH,
    "🔑",
    "a\ttab",
    "line\nbreak",
    "\ud800",  # a lone surrogate, as json.loads gives for "\\ud800"
    "sha256:" + "0" * 64,  # looks like a hashed key: hashed too, never taken for one
    " ",
]


@pytest.mark.parametrize("key", KEYS, ids=lambda k: repr(k)[:24])
def test_every_string_is_a_key_and_is_echoed_as_sent(
    key: str, mode: str, memory: Store[Any]
) -> None:
    mesh = MeshIdempotency(memory)
    runs: list[Any] = []

    def charge(call: dict[str, Any]) -> Any:
        runs.append(call)
        return RESULT

    def handle(envelope: dict[str, Any]) -> dict[str, Any]:
        if mode == "sync":
            return mesh.handle(envelope, charge)
        return asyncio.run(mesh.ahandle(envelope, charge))

    first = handle(request(key=key))
    again = handle(request("req_002", key=key))
    conflict = handle(request("req_003", key=key, arguments={"amount": 1}))
    assert (data(first)["key"], data(first)["status"]) == (key, "processed")
    assert (data(again)["key"], data(again)["status"]) == (key, "cached")
    assert again["result"] == RESULT and len(runs) == 1
    assert conflict["errors"][0]["details"]["key"] == key
    assert data(conflict)["key"] == key
    [record] = memory.records()
    assert record.key == protocol_key(key)


def test_a_raw_key_never_stands_for_a_hashed_one(memory: Store[Any]) -> None:
    mesh = MeshIdempotency(memory)
    hashed = protocol_key("commande_é_42")
    assert hashed.startswith("sha256:")
    mesh.handle(request(key="commande_é_42"), lambda call: 1)
    answer = mesh.handle(request(key=hashed), lambda call: 2)
    assert answer["result"] == 2 and data(answer)["status"] == "processed"
    assert len(memory.records()) == 2


@pytest.mark.parametrize("key", ["", "k" * (MAX_KEY_LENGTH + 1)], ids=["empty", "too long"])
def test_an_empty_or_overlong_key_is_refused(key: str, memory: Store[Any]) -> None:
    runs: list[Any] = []
    answer = MeshIdempotency(memory).handle(request(key=key), runs.append)
    [error] = answer["errors"]
    assert error["code"] == "INVALID_ARGUMENTS" and error["source"] == {"pointer": KEY_AT}
    assert ("1024" in error["message"]) == bool(key)
    assert runs == [] and memory.records() == []


def test_over_http_and_through_the_client(served: Served) -> None:
    client, functions, _ = served
    answer = client.post("/", json=request(key="commande_é_42")).json()
    assert data(answer)["key"] == "commande_é_42"
    with MeshClient(base_url=str(client.base_url), headers=CALLER) as mesh:
        again = mesh.call("/", "payments.charge", ARGUMENTS, version="1", key="commande_é_42")
        assert data(again)["status"] == "cached" and data(again)["key"] == "commande_é_42"
        long = mesh.call("/", "payments.charge", ARGUMENTS, version="1", key="k" * 1024)
        assert data(long)["status"] == "processed"
        with pytest.raises(InvalidKeyError, match="1024"):
            mesh.call("/", "payments.charge", ARGUMENTS, key="k" * 1025)
    assert functions.runs == ["charge", "charge"]


# -- 4. HTTP statuses reflect the error (protocol.md "Transport Conventions", transport.md
#       "Status Codes", errors.md's HTTP column); always_200 is the other binding ----------------


class Blocking:
    """A handler whose first run blocks until released (for IDEMPOTENCY_PROCESSING)."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, call: dict[str, Any]) -> Any:
        self.started.set()
        assert self.release.wait(30), "never released"
        return RESULT


def statuses(tmp_path: Path, http_status: str) -> dict[str, tuple[int, str, str | None]]:
    """(status, first error code or "", Retry-After) of every kind of answer of one app."""
    blocking = Blocking()
    functions = Functions()
    store = open_store(f"sqlite:///{tmp_path}/{http_status}.db")
    handlers = {**functions.handlers(), "payments.slow": blocking}
    options: dict[str, Any] = {} if http_status == "default" else {"http_status": http_status}
    app = MeshApp(handlers, store, max_body=4096, anonymous="refuse", **options)
    seen: dict[str, tuple[int, str, str | None]] = {}

    def keep(name: str, answer: httpx.Response) -> None:
        doc = answer.json()
        assert doc["id"] in ("req_001", "req_002", None) and "result" in doc  # an envelope
        code = doc["errors"][0]["code"] if "errors" in doc else ""
        seen[name] = (answer.status_code, code, answer.headers.get("retry-after"))

    with (
        ThreadServer(app, "asgi") as server,
        httpx.Client(base_url=server.url, headers=CALLER, timeout=30) as client,
        ThreadPoolExecutor(1) as pool,
    ):
        keep("processed", client.post("/", json=request()))
        keep("cached", client.post("/", json=request("req_002")))
        keep("conflict", client.post("/", json=request(arguments={"amount": 1})))
        keep("no key", client.post("/", json={**request(), "extensions": [{"urn": URN}]}))
        keep("bad key", client.post("/", json=request(key="")))
        keep("invalid request", client.post("/", json={"id": "req_001"}))
        keep("parse error", client.post("/", content=b'{"id": '))
        keep("not found", client.post("/", json=request(function="payments.nope")))
        keep("declined", client.post("/", json=request(function="payments.declined")))
        keep(
            "declined again",
            client.post("/", json=request("req_002", function="payments.declined")),
        )
        keep("flaky", client.post("/", json=request(function="payments.flaky")))
        keep("crash", client.post("/", json=request(function="payments.crash")))
        keep("anonymous", httpx.post(server.url, json=request()))
        first = pool.submit(client.post, "/", json=request(function="payments.slow"))
        try:
            assert blocking.started.wait(30), "the slow handler never started"
            keep("processing", client.post("/", json=request("req_002", function="payments.slow")))
        finally:
            blocking.release.set()
        keep("slow", first.result())
    store.close()
    down = MeshApp(handlers, "redis://127.0.0.1:1", principal=lambda r: "t", **options)
    with ThreadServer(down, "asgi") as server:
        keep("store down", httpx.post(server.url, json=request()))
    return seen


def test_semantic_statuses_by_default(tmp_path: Path) -> None:
    assert statuses(tmp_path, "default") == {
        "processed": (200, "", None),
        "cached": (200, "", None),
        "slow": (200, "", None),
        "conflict": (409, "IDEMPOTENCY_CONFLICT", None),
        "processing": (409, "IDEMPOTENCY_PROCESSING", "1"),
        "no key": (400, "INVALID_ARGUMENTS", None),
        "bad key": (400, "INVALID_ARGUMENTS", None),
        "invalid request": (400, "INVALID_REQUEST", None),
        "parse error": (400, "PARSE_ERROR", None),
        "not found": (404, "FUNCTION_NOT_FOUND", None),
        "declined": (400, "PAYMENTS_CARD_DECLINED", None),
        "declined again": (400, "PAYMENTS_CARD_DECLINED", None),  # a replay: the same status
        "flaky": (500, "PAYMENTS_GATEWAY_BUSY", None),
        "crash": (500, "INTERNAL_ERROR", None),
        "anonymous": (401, "UNAUTHORIZED", None),
        "store down": (503, "UNAVAILABLE", "1"),
    }


def test_always_200_is_the_other_binding_applied_throughout(tmp_path: Path) -> None:
    seen = statuses(tmp_path, "always_200")
    assert {name: status for name, (status, _, _) in seen.items()} == dict.fromkeys(seen, 200)
    assert not any(after for _, _, after in seen.values())
    assert seen["parse error"][1] == "PARSE_ERROR" and seen["processing"][1] == (
        "IDEMPOTENCY_PROCESSING"
    )


def test_the_binding_is_checked() -> None:
    with pytest.raises(ValueError, match="http_status"):
        MeshApp({}, "memory://", http_status="200")


@pytest.mark.parametrize(
    ("errors", "status"),
    [
        (None, 200),
        ([{"code": "IDEMPOTENCY_CONFLICT"}], 409),
        ([{"code": "DEADLINE_EXCEEDED"}], 408),
        ([{"code": "RATE_LIMITED"}], 429),
        ([{"code": "DEPENDENCY_ERROR"}], 502),
        ([{"code": "NOT_FOUND"}, {"code": "CONFLICT"}], 400),  # transport.md, Multiple Errors
        ([{"code": "APP_THING", "retryable": False}], 400),
        ([{"code": "APP_THING", "retryable": True}], 500),
        ([{"code": ["odd"]}], 400),
    ],
)
def test_status_of_is_public_for_other_http_layers(
    errors: list[dict[str, Any]] | None, status: int
) -> None:
    response: dict[str, Any] = {"protocol": PROTOCOL, "id": "r", "result": None}
    if errors is not None:
        response["errors"] = errors
    assert status_of(response) == status


def test_status_of_a_handled_answer(memory: Store[Any]) -> None:
    """A server with its own HTTP layer applies the same binding to handle()'s answers."""
    mesh = MeshIdempotency(memory)
    mesh.handle(request(), lambda call: RESULT)
    conflict = mesh.handle(request("req_002", arguments={"amount": 1}), lambda call: RESULT)
    assert status_of(conflict) == 409
    assert status_of(mesh.handle(request("req_003"), lambda call: RESULT)) == 200


# -- 7. the arguments hash: the documented canonical form, and the reference's -----------------

#: docs/mesh.md's test vector: arguments {"b": 1, "a": "é/x"}.
OURS = "sha256:d4736d06f285b021fc04ccea526f4a9706cefb7a8dc663fd8ebf15d7b11fb17c"
#: The reference implementation's hashArguments of the same arguments: PHP's
#: json_encode keeps the key order and escapes "/" and non-ASCII.
REFERENCE = "sha256:5d9d00e427e1605155cf3936bda330a6880024f644275bfd204fd2bae7553202"


def test_the_arguments_hash_is_the_documented_canonical_form(memory: Store[Any]) -> None:
    arguments = {"b": 1, "a": "é/x"}
    mesh = MeshIdempotency(memory)
    mesh.handle(request(arguments=arguments), lambda call: RESULT)
    conflict = mesh.handle(request("req_002", arguments={"b": 2}), lambda call: RESULT)
    [error] = conflict["errors"]
    assert error["details"]["original_arguments_hash"] == OURS
    text = json.dumps(
        arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )
    assert "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest() == OURS
    php = '{"b":1,"a":"\\u00e9\\/x"}'
    assert REFERENCE == "sha256:" + hashlib.sha256(php.encode()).hexdigest() != OURS


# -- 5 (last sentence). other extensions are echoed by URN (extensions/index.md, "Server
#    Handling": "Return response with same extensions (by URN)") --------------------------------

DEADLINE = "urn:mesh:ext:deadline"


def urns(response: dict[str, Any]) -> list[str]:
    return [entry["urn"] for entry in response.get("extensions", [])]


def test_other_extensions_are_echoed_in_request_order(served: Served) -> None:
    client, functions, _ = served
    tracing = {"urn": TRACING, "options": {"trace_id": "tr_1"}}
    deadline = {"urn": DEADLINE, "options": {"value": 5, "unit": "second"}}
    first = client.post("/", json=request(extensions=[tracing, deadline])).json()
    # The idempotency extension comes last in these requests: its entry is echoed last.
    assert urns(first) == [TRACING, DEADLINE, URN]
    assert first["extensions"][:2] == [{"urn": TRACING}, {"urn": DEADLINE}]
    assert data(first)["status"] == "processed"
    # A cached replay echoes the retry's own extensions, not the first request's.
    retry = request("req_002", extensions=[deadline])
    retry["extensions"].reverse()  # the idempotency extension first this time
    cached = client.post("/", json=retry).json()
    assert urns(cached) == [URN, DEADLINE] and data(cached)["status"] == "cached"
    again = client.post("/", json=request("req_003")).json()
    assert urns(again) == [URN]
    assert functions.runs == ["charge"]


def test_echo_on_errors_and_without_the_idempotency_extension(served: Served) -> None:
    client, _, _ = served
    tracing = {"urn": TRACING}
    plain = client.post("/", json=request(key=None, extensions=[tracing, tracing])).json()
    assert plain == {
        "protocol": PROTOCOL,
        "id": "req_001",
        "result": RESULT,
        "extensions": [{"urn": TRACING}],  # once per URN
    }
    client.post("/", json=request())
    conflict = client.post("/", json=request(arguments={"a": 1}, extensions=[tracing])).json()
    assert urns(conflict) == [TRACING, URN] and data(conflict)["status"] == "conflict"
    missing = client.post("/", json=request(function="payments.nope", extensions=[tracing]))
    assert urns(missing.json()) == [TRACING]  # no idempotency data: the function is unknown
    invalid = client.post("/", json=request(key="", extensions=[tracing])).json()
    assert "extensions" not in invalid  # a malformed request: nothing is echoed


def test_echo_through_handle(mode: str, memory: Store[Any]) -> None:
    mesh = MeshIdempotency(memory)
    envelope = request(extensions=[{"urn": TRACING, "options": {}}])
    if mode == "sync":
        answer = mesh.handle(envelope, lambda call: RESULT)
    else:
        answer = asyncio.run(mesh.ahandle(envelope, lambda call: RESULT))
    assert urns(answer) == [TRACING, URN]


def test_a_lone_surrogate_key_and_id_are_echoed_over_http(served: Served) -> None:
    """JSON may carry "\\ud800", which UTF-8 cannot: the answer escapes it as it came."""
    client, functions, _ = served
    body = json.dumps(request("\ud800", key="\ud800"))  # ensure_ascii: "\\ud800" escapes
    for _ in range(2):
        answer = client.post("/", content=body, headers={"content-type": "application/json"})
        assert answer.status_code == 200 and answer.json()["id"] == "\ud800"
        assert data(answer.json())["key"] == "\ud800" and "\\ud800" in answer.text
    assert data(answer.json())["status"] == "cached" and functions.runs == ["charge"]
