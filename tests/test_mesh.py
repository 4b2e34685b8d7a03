"""The Mesh idempotency extension on every store, sync and async, and over HTTP."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from _hangup import CALLER
from _http_servers import ThreadServer
from _racing import race_processes
from conftest import Clock, StoreSpec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retrysafe import Engine, Store, StoreUnavailableError, key_hash, open_store
from retrysafe.mesh import URN, MeshApp, MeshError, MeshIdempotency, status_of

KEY = "charge_order456_v1"
ARGUMENTS = {"amount": 100, "currency": "USD", "customer_id": "cust_123"}
RESULT = {"charge_id": "ch_abc", "status": "succeeded"}
PROTOCOL = {"name": "mesh", "version": "0.1.0"}


def request(
    rid: str = "req_001",
    key: str | None = KEY,
    arguments: dict[str, Any] | None = None,
    function: str = "payments.charge",
    version: str | None = "1",
    **options: Any,
) -> dict[str, Any]:
    """The Mesh idempotency extension's request example, with what a test changes."""
    arguments = dict(ARGUMENTS) if arguments is None else arguments
    call: dict[str, Any] = {"function": function, "arguments": arguments}
    if version is not None:
        call["version"] = version
    envelope: dict[str, Any] = {"protocol": dict(PROTOCOL), "id": rid, "call": call}
    if key is not None:
        envelope["extensions"] = [{"urn": URN, "options": {"key": key, **options}}]
    return envelope


def iso(seconds: float) -> str:
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def args_hash(arguments: dict[str, Any]) -> str:
    """What a client computes: SHA-256 of the arguments as canonical JSON."""
    text = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def data(response: dict[str, Any]) -> dict[str, Any]:
    [entry] = response["extensions"]
    assert entry["urn"] == URN
    return entry["data"]  # type: ignore[no-any-return]


class Charges:
    """A handler that counts its runs and answers with ``RESULT`` (or what it is told)."""

    def __init__(self, answer: Callable[[dict[str, Any]], Any] = lambda call: RESULT) -> None:
        self.calls: list[dict[str, Any]] = []
        self.answer = answer

    def __call__(self, call: dict[str, Any]) -> Any:
        self.calls.append(call)
        return self.answer(call)


class Mesh:
    """``handle`` (sync) or ``ahandle`` with an async handler on a loop of this test's own."""

    def __init__(self, mode: str, mesh: MeshIdempotency) -> None:
        self.mode, self.mesh = mode, mesh
        self.loop = asyncio.new_event_loop() if mode == "async" else None

    def __call__(self, envelope: Any, handler: Callable[..., Any], scope: str = "") -> Any:
        if self.loop is None:
            return self.mesh.handle(envelope, handler, scope=scope)

        async def ahandler(call: dict[str, Any]) -> Any:
            await asyncio.sleep(0)
            return handler(call)

        return self.loop.run_until_complete(self.mesh.ahandle(envelope, ahandler, scope=scope))

    def close(self) -> None:
        if self.loop is not None:
            self.loop.run_until_complete(self.mesh.aclose())
            self.loop.close()


@pytest.fixture
def engine(store: Store[Any], clock: Clock) -> Engine:
    return Engine(store, clock=clock, lease=10)


@pytest.fixture
def make(mode: str, engine: Engine) -> Iterator[Callable[..., Mesh]]:
    made: list[Mesh] = []

    def make(**options: Any) -> Mesh:
        made.append(Mesh(mode, MeshIdempotency(engine, **options)))
        return made[-1]

    yield make
    for m in made:
        m.close()


@pytest.fixture
def run(make: Callable[..., Mesh]) -> Mesh:
    return make()


# -- the extension's examples --------------------------------------------------------


def test_first_request_is_processed(run: Mesh, clock: Clock, store: Store[Any]) -> None:
    charge = Charges()
    assert run(request(), charge) == {
        "protocol": PROTOCOL,
        "id": "req_001",
        "result": RESULT,
        "extensions": [
            {
                "urn": URN,
                "data": {
                    "key": KEY,
                    "status": "processed",
                    "original_request_id": "req_001",
                    "expires_at": iso(clock.now + 24 * 3600),
                },
            }
        ],
    }
    assert charge.calls == [request()["call"]]
    # Stored under hash(scope, function@version, key), with the arguments' hash.
    record = store.get(key_hash("", "payments.charge@1", KEY))
    assert record is not None and record.request_id == "req_001"
    assert "sha256:" + record.fingerprint == args_hash(ARGUMENTS)
    assert record.operation == "payments.charge@1"


def test_retry_is_cached(run: Mesh, clock: Clock) -> None:
    charge = Charges()
    first_at = clock.now
    run(request(), charge)
    clock.advance(90)
    assert run(request("req_002"), charge) == {
        "protocol": PROTOCOL,
        "id": "req_002",
        "result": RESULT,
        "extensions": [
            {
                "urn": URN,
                "data": {
                    "key": KEY,
                    "status": "cached",
                    "original_request_id": "req_001",
                    "cached_at": iso(first_at),
                    "expires_at": iso(first_at + 24 * 3600),
                },
            }
        ],
    }
    assert data(run(request("req_003"), charge))["status"] == "cached"
    assert len(charge.calls) == 1


def test_other_arguments_conflict(run: Mesh) -> None:
    charge = Charges()
    run(request(), charge)
    other = {**ARGUMENTS, "amount": 200}
    assert run(request("req_003", arguments=other), charge) == {
        "protocol": PROTOCOL,
        "id": "req_003",
        "result": None,
        "errors": [
            {
                "code": "IDEMPOTENCY_CONFLICT",
                "message": "Idempotency key already used with different arguments",
                "retryable": False,
                "details": {"key": KEY, "original_arguments_hash": args_hash(ARGUMENTS)},
            }
        ],
        "extensions": [
            {
                "urn": URN,
                "data": {
                    "key": KEY,
                    "status": "conflict",
                    "original_request_id": "req_001",
                },
            }
        ],
    }
    assert len(charge.calls) == 1
    # The same arguments in another key order are the same request.
    reordered = dict(reversed(list(ARGUMENTS.items())))
    assert data(run(request("req_004", arguments=reordered), charge))["status"] == "cached"


def processing(mode: str, mesh: MeshIdempotency) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the outer answer, the answer to a duplicate sent while the outer one runs)."""
    inner: dict[str, Any] = {}
    if mode == "sync":

        def handler(call: dict[str, Any]) -> Any:
            inner["answer"] = mesh.handle(request("req_004"), handler)
            return RESULT

        return mesh.handle(request(), handler), inner["answer"]

    async def ahandler(call: dict[str, Any]) -> Any:
        inner["answer"] = await mesh.ahandle(request("req_004"), ahandler)
        return RESULT

    async def main() -> dict[str, Any]:
        try:
            return await mesh.ahandle(request(), ahandler)
        finally:
            await mesh.aclose()

    return asyncio.run(main()), inner["answer"]


def test_duplicate_while_processing(mode: str, engine: Engine) -> None:
    outer, inner = processing(mode, MeshIdempotency(engine))
    assert inner == {
        "protocol": PROTOCOL,
        "id": "req_004",
        "result": None,
        "errors": [
            {
                "code": "IDEMPOTENCY_PROCESSING",
                "message": "Previous request with this key is still processing",
                "retryable": True,
                "details": {"key": KEY, "retry_after": {"value": 1, "unit": "second"}},
            }
        ],
        "extensions": [
            {
                "urn": URN,
                "data": {
                    "key": KEY,
                    "status": "processing",
                    "original_request_id": "req_001",
                },
            }
        ],
    }
    assert outer["result"] == RESULT and data(outer)["status"] == "processed"


def test_retry_after_grows_with_the_attempt(engine: Engine, clock: Clock) -> None:
    mesh = MeshIdempotency(engine)

    def handler(call: dict[str, Any]) -> Any:
        clock.advance(4.2)
        retry = mesh.handle(request("req_002"), handler)["errors"][0]["details"]["retry_after"]
        assert retry == {"value": 5, "unit": "second"}  # ceil(4.2)
        return RESULT

    assert data(mesh.handle(request(), handler))["status"] == "processed"


# -- what makes two calls the same --------------------------------------------------------


def test_function_version_and_scope_separate_records(run: Mesh) -> None:
    charge = Charges(lambda call: {"ran": len(charge.calls)})
    assert data(run(request(), charge))["status"] == "processed"
    assert data(run(request("r2", version="2"), charge))["status"] == "processed"  # v2 ≠ v1
    assert data(run(request("r3", version=None), charge))["status"] == "processed"  # latest
    assert data(run(request("r4", function="payments.refund"), charge))["status"] == "processed"
    assert data(run(request("r5"), charge, scope="tenant-b"))["status"] == "processed"
    assert len(charge.calls) == 5
    replay = run(request("r6", version="2"), charge)
    assert data(replay)["status"] == "cached" and replay["result"] == {"ran": 2}
    assert data(run(request("r7"), charge, scope="tenant-b"))["original_request_id"] == "r5"


def test_function_and_version_never_collide(run: Mesh) -> None:
    charge = Charges(lambda call: [call["function"], call.get("version")])
    pairs = [("a@b", "c"), ("a", "b@c"), ("a\\", "@c"), ("a\\@", "c"), ("a@b@c", None)]
    for i, (function, version) in enumerate(pairs):
        answer = run(request(f"r{i}", function=function, version=version), charge)
        assert data(answer)["status"] == "processed"
        assert answer["result"] == [function, version]


# -- ttl -------------------------------------------------------------------------------


def test_ttl_narrows_and_is_refused_over_the_policy(
    make: Callable[..., Mesh], clock: Clock
) -> None:
    run = make(ttl=3600)
    charge = Charges()
    start = clock.now
    short = run(request(key="short", ttl={"value": 10, "unit": "minute"}), charge)
    assert data(short)["expires_at"] == iso(start + 600)
    over = run(request(key="over", ttl={"value": 2, "unit": "hours"}), charge)
    assert over["errors"][0]["code"] == "INVALID_ARGUMENTS"  # over the policy: refused
    assert over["errors"][0]["details"] == {"max_ttl": {"value": 3600, "unit": "second"}}
    plain = run(request(key="plain"), charge)
    assert data(plain)["expires_at"] == iso(start + 3600)
    longer = make(ttl=3600, max_ttl=7200)  # a maximum over the default lets a call lengthen it
    long = longer(request(key="long", ttl={"value": 2, "unit": "hours"}), charge)
    assert data(long)["expires_at"] == iso(start + 7200)
    clock.advance(601)
    assert data(run(request("r2", key="short"), charge))["status"] == "processed"
    assert data(run(request("r3", key="long"), charge))["status"] == "cached"
    clock.advance(6600)
    assert data(run(request("r4", key="long"), charge))["status"] == "processed"
    assert len(charge.calls) == 5


@pytest.mark.parametrize(
    ("ttl", "seconds"),
    [
        ({"value": 90, "unit": "second"}, 90),
        ({"value": 1.5, "unit": "hours"}, 5400),
        ({"value": 1, "unit": "day"}, 86400),
        ({"value": 2500, "unit": "milliseconds"}, 2.5),
    ],
)
def test_ttl_units(ttl: dict[str, Any], seconds: float, memory: Store[Any], clock: Clock) -> None:
    mesh = MeshIdempotency(Engine(memory, clock=clock))
    mesh.handle(request(ttl=ttl), Charges())
    record = memory.get(key_hash("", "payments.charge@1", KEY))
    assert record is not None and record.expires_at == pytest.approx(clock.now + seconds)


def test_expired_answer_runs_again(run: Mesh, clock: Clock) -> None:
    charge = Charges()
    run(request(), charge)
    clock.advance(24 * 3600)
    again = data(run(request("req_009"), charge))
    assert again["status"] == "processed" and again["original_request_id"] == "req_009"
    assert len(charge.calls) == 2


# -- without the extension -----------------------------------------------------------------


def test_request_without_the_extension_passes_through(run: Mesh, store: Store[Any]) -> None:
    charge = Charges()
    plain = request(key=None)
    other = request(key=None)
    other["extensions"] = [{"urn": "urn:mesh:ext:tracing", "options": {"trace_id": "t1"}}]
    for envelope in (plain, plain):
        assert run(envelope, charge) == {"protocol": PROTOCOL, "id": "req_001", "result": RESULT}
    assert run(other, charge) == {
        "protocol": PROTOCOL,
        "id": "req_001",
        "result": RESULT,
        "extensions": [{"urn": "urn:mesh:ext:tracing"}],  # echoed by its URN
    }
    assert charge.calls == [plain["call"], plain["call"], other["call"]]
    assert store.records() == []


def test_passthrough_hands_over_the_call_object(memory: Store[Any]) -> None:
    envelope = request(key=None)
    charge = Charges()
    MeshIdempotency(memory).handle(envelope, charge)
    assert charge.calls[0] is envelope["call"]


# -- the handler's failures ------------------------------------------------------------------


def test_mesh_error_is_final_and_replayed(run: Mesh, clock: Clock) -> None:
    def decline(call: dict[str, Any]) -> Any:
        raise MeshError("PAYMENT_DECLINED", "card declined", details={"reason": "funds"})

    charge = Charges(decline)
    first = run(request(), charge)
    error = {
        "code": "PAYMENT_DECLINED",
        "message": "card declined",
        "retryable": False,
        "details": {"reason": "funds"},
    }
    assert first["result"] is None and first["errors"] == [error]
    assert data(first) == {
        "key": KEY,
        "status": "processed",
        "original_request_id": "req_001",
        "expires_at": iso(clock.now + 24 * 3600),
    }
    again = run(request("req_002"), charge)
    assert again["errors"] == [error] and again["result"] is None
    assert data(again)["status"] == "cached" and data(again)["original_request_id"] == "req_001"
    assert len(charge.calls) == 1


def test_retryable_mesh_error_runs_again(run: Mesh) -> None:
    def flaky(call: dict[str, Any]) -> Any:
        if len(charge.calls) == 1:
            raise MeshError("DEPENDENCY_ERROR", "bank timed out", retryable=True)
        return RESULT

    charge = Charges(flaky)
    first = run(request(), charge)
    assert first["errors"] == [
        {"code": "DEPENDENCY_ERROR", "message": "bank timed out", "retryable": True}
    ]
    assert data(first) == {"key": KEY, "status": "processed", "original_request_id": "req_001"}
    second = run(request("req_002"), charge)
    assert second["result"] == RESULT and data(second)["status"] == "processed"
    assert data(run(request("req_003"), charge))["original_request_id"] == "req_002"


def test_exception_propagates_and_leaves_the_key_retryable(run: Mesh) -> None:
    def crash(call: dict[str, Any]) -> Any:
        if len(charge.calls) == 1:
            raise RuntimeError("bank down")
        return RESULT

    charge = Charges(crash)
    with pytest.raises(RuntimeError, match="bank down"):
        run(request(), charge)
    assert data(run(request("req_002"), charge))["status"] == "processed"
    assert len(charge.calls) == 2


@pytest.mark.parametrize("result", [{"when": object()}, float("nan"), {1, 2}])
def test_result_that_is_not_json_fails_finally(run: Mesh, result: Any) -> None:
    charge = Charges(lambda call: result)
    first = run(request(), charge)
    [error] = first["errors"]
    assert error["code"] == "INTERNAL_ERROR" and error["retryable"] is False
    assert "not a JSON value" in error["message"]
    assert first["result"] is None and data(first)["status"] == "processed"
    json.dumps(first)
    again = run(request("req_002"), charge)
    assert again["errors"] == [error] and data(again)["status"] == "cached"
    assert len(charge.calls) == 1


def test_result_over_max_body_fails_finally(memory: Store[Any]) -> None:
    mesh = MeshIdempotency(Engine(memory, max_body=100))
    charge = Charges(lambda call: "x" * 200)
    [error] = mesh.handle(request(), charge)["errors"]
    assert error["code"] == "INTERNAL_ERROR" and "202 bytes" in error["message"]
    assert mesh.handle(request("req_002"), charge)["errors"] == [error]
    assert len(charge.calls) == 1


def test_mesh_error_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="SCREAMING_SNAKE_CASE"):
        MeshError("not-snake", "x")
    with pytest.raises(TypeError):
        MeshError("CODE", 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        MeshError("CODE", "x", details={"when": object()})
    with pytest.raises(ValueError):
        MeshError("CODE", "x", details={"n": float("nan")})


# -- the store --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_store_down_is_a_retryable_error(mode: str) -> None:
    run = Mesh(mode, MeshIdempotency("redis://127.0.0.1:1"))
    charge = Charges()
    try:
        answer = run(request(), charge)
    finally:
        run.close()
    assert answer == {
        "protocol": PROTOCOL,
        "id": "req_001",
        "result": None,
        "errors": [
            {
                "code": "UNAVAILABLE",
                "message": "the idempotency store cannot be reached; retry with the same key",
                "retryable": True,
                "details": {"key": KEY, "retry_after": {"value": 1, "unit": "second"}},
            }
        ],
    }
    assert charge.calls == []


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_answer_that_cannot_be_recorded_still_reaches_the_caller(
    mode: str, memory: Store[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def down(*args: Any) -> Any:
        raise StoreUnavailableError("gone")

    async def adown(*args: Any) -> Any:
        down()

    monkeypatch.setattr(memory, "complete", down)
    monkeypatch.setattr(memory, "acomplete", adown)
    run = Mesh(mode, MeshIdempotency(Engine(memory, settle_retry=0)))
    with caplog.at_level(logging.ERROR, logger="retrysafe"):
        answer = run(request(), Charges())
    run.close()
    assert answer["result"] == RESULT and data(answer)["status"] == "processed"
    assert "not recorded" in caplog.text


def test_engine_with_final_failures_replays_a_crash(memory: Store[Any]) -> None:
    mesh = MeshIdempotency(Engine(memory, final_failures=True))

    def crash(call: dict[str, Any]) -> Any:
        raise RuntimeError("bank down")

    charge = Charges(crash)
    with pytest.raises(RuntimeError):
        mesh.handle(request(), charge)
    again = mesh.handle(request("req_002"), charge)
    [error] = again["errors"]
    assert error["code"] == "INTERNAL_ERROR" and error["retryable"] is False
    assert "bank down" not in error["message"]
    assert data(again)["status"] == "cached" and len(charge.calls) == 1


def test_constructor_options(memory: Store[Any]) -> None:
    engine = Engine(memory, ttl=600, lease=5)
    assert MeshIdempotency(engine).ttl == 600
    assert MeshIdempotency(engine, ttl=60).ttl == 60
    assert MeshIdempotency(engine, ttl=6000).ttl == 600  # an engine's ttl is the ceiling
    assert MeshIdempotency(memory, ttl=7200).engine.ttl == 7200  # the policy's, the longest
    for bad in ({"ttl": 0}, {"ttl": -1}, {"lease": 0}, {"wait": -1}, {"ttl": float("inf")}):
        with pytest.raises(ValueError):
            MeshIdempotency(memory, **bad)
        with pytest.raises(ValueError):
            MeshIdempotency(engine, **bad)
    with pytest.raises(TypeError):
        MeshIdempotency(memory, ttl="1h")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        MeshIdempotency(memory).handle(request(), Charges(), scope=None)  # type: ignore[arg-type]


def test_default_store_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("RETRYSAFE_STORE", f"sqlite:///{tmp_path}/env.db")
    mesh = MeshIdempotency()
    assert data(mesh.handle(request(), Charges()))["status"] == "processed"
    mesh.close()
    assert (tmp_path / "env.db").exists()


# -- malformed requests: an error envelope, the handler not run, nothing written ------------------

_KEY_AT = "/extensions/0/options/key"
_TTL_AT = "/extensions/0/options/ttl"


def _with(path: str, value: Any) -> dict[str, Any]:
    """A valid request with the field at ``path`` (slash-separated) set to ``value``."""
    envelope = request()
    *parents, last = path.split("/")
    node: Any = envelope
    for part in parents:
        node = node[int(part) if isinstance(node, list) else part]
    node[int(last) if isinstance(node, list) else last] = value
    return envelope


def _without(path: str) -> dict[str, Any]:
    envelope = request()
    *parents, last = path.split("/")
    node: Any = envelope
    for part in parents:
        node = node[int(part) if isinstance(node, list) else part]
    del node[last]
    return envelope


MALFORMED = [
    ([], "INVALID_REQUEST", ""),
    ("{}", "INVALID_REQUEST", ""),
    (None, "INVALID_REQUEST", ""),
    (_without("protocol"), "INVALID_REQUEST", "/protocol"),
    (_with("protocol", {"name": "grpc", "version": "1"}), "INVALID_REQUEST", "/protocol"),
    (_with("protocol", {"name": "mesh", "version": 1}), "INVALID_REQUEST", "/protocol"),
    (_with("protocol", "mesh"), "INVALID_REQUEST", "/protocol"),
    (_without("id"), "INVALID_REQUEST", "/id"),
    (_with("id", 7), "INVALID_REQUEST", "/id"),
    (_with("id", ""), "INVALID_REQUEST", "/id"),
    (_without("call"), "INVALID_REQUEST", "/call"),
    (_with("call", "payments.charge"), "INVALID_REQUEST", "/call"),
    (_without("call/function"), "INVALID_REQUEST", "/call/function"),
    (_with("call/function", ""), "INVALID_REQUEST", "/call/function"),
    (_with("call/function", ["payments.charge"]), "INVALID_REQUEST", "/call/function"),
    (_with("call/version", 1), "INVALID_REQUEST", "/call/version"),
    (_with("call/version", ""), "INVALID_REQUEST", "/call/version"),
    (_with("call/arguments", [100, "USD"]), "INVALID_REQUEST", "/call/arguments"),
    (_with("call/arguments", {"amount": float("nan")}), "INVALID_REQUEST", "/call/arguments"),
    (_with("call/arguments", {"when": object()}), "INVALID_REQUEST", "/call/arguments"),
    (_with("context", "trace"), "INVALID_REQUEST", "/context"),
    (_with("extensions", {"urn": URN}), "INVALID_REQUEST", "/extensions"),
    (_with("extensions/0", URN), "INVALID_REQUEST", "/extensions/0"),
    (_with("extensions/0", {"options": {"key": KEY}}), "INVALID_REQUEST", "/extensions/0"),
    (_with("extensions/0/urn", 5), "INVALID_REQUEST", "/extensions/0"),
    (
        _with("extensions", [{"urn": URN, "options": {"key": "a"}}] * 2),
        "INVALID_REQUEST",
        "/extensions/1",
    ),
    (
        _with("extensions/0/options", "charge_order456_v1"),
        "INVALID_REQUEST",
        "/extensions/0/options",
    ),
    (_with("extensions/0/options", {}), "INVALID_ARGUMENTS", _KEY_AT),
    (_without("extensions/0/options"), "INVALID_ARGUMENTS", _KEY_AT),
    (_with(_KEY_AT[1:], 456), "INVALID_ARGUMENTS", _KEY_AT),
    (_with(_KEY_AT[1:], ""), "INVALID_ARGUMENTS", _KEY_AT),
    (_with(_KEY_AT[1:], "x" * 1025), "INVALID_ARGUMENTS", _KEY_AT),
    (_with(_TTL_AT[1:], "24h"), "INVALID_ARGUMENTS", _TTL_AT),
    (_with(_TTL_AT[1:], 3600), "INVALID_ARGUMENTS", _TTL_AT),
    (_with(_TTL_AT[1:], {"value": 0, "unit": "hour"}), "INVALID_ARGUMENTS", _TTL_AT + "/value"),
    (_with(_TTL_AT[1:], {"value": -1, "unit": "hour"}), "INVALID_ARGUMENTS", _TTL_AT + "/value"),
    (_with(_TTL_AT[1:], {"value": True, "unit": "hour"}), "INVALID_ARGUMENTS", _TTL_AT + "/value"),
    (_with(_TTL_AT[1:], {"value": "1", "unit": "hour"}), "INVALID_ARGUMENTS", _TTL_AT + "/value"),
    (_with(_TTL_AT[1:], {"unit": "hour"}), "INVALID_ARGUMENTS", _TTL_AT + "/value"),
    (
        _with(_TTL_AT[1:], {"value": float("inf"), "unit": "hour"}),
        "INVALID_ARGUMENTS",
        _TTL_AT + "/value",
    ),
    (
        _with(_TTL_AT[1:], {"value": 5e-324, "unit": "millisecond"}),
        "INVALID_ARGUMENTS",
        _TTL_AT + "/value",
    ),
    (_with(_TTL_AT[1:], {"value": 1, "unit": "week"}), "INVALID_ARGUMENTS", _TTL_AT + "/unit"),
    (_with(_TTL_AT[1:], {"value": 1}), "INVALID_ARGUMENTS", _TTL_AT + "/unit"),
]


@pytest.mark.parametrize(("envelope", "code", "pointer"), MALFORMED)
def test_malformed_request(
    envelope: Any, code: str, pointer: str, mode: str, memory: Store[Any]
) -> None:
    run = Mesh(mode, MeshIdempotency(memory))
    charge = Charges()
    answer = run(envelope, charge)
    run.close()
    [error] = answer["errors"]
    assert error["code"] == code and error["retryable"] is False
    assert error["source"] == {"pointer": pointer} and error["message"]
    assert answer["result"] is None and "extensions" not in answer
    assert set(answer) == {"protocol", "id", "result", "errors"}
    valid_id = isinstance(envelope, dict) and isinstance(envelope.get("id"), str) and envelope["id"]
    assert answer["id"] == (envelope["id"] if valid_id else None)
    assert answer["protocol"] == PROTOCOL
    json.dumps(answer)
    assert charge.calls == [] and memory.records() == []


def test_protocol_is_echoed(memory: Store[Any]) -> None:
    mesh = MeshIdempotency(memory)
    assert mesh.handle(_with("protocol", {"name": "mesh", "version": "0.2.0"}), Charges())[
        "protocol"
    ] == {"name": "mesh", "version": "0.2.0"}
    assert mesh.handle(_with("protocol", "mesh/0.1"), Charges())["protocol"] == "mesh/0.1"


# Any JSON value, and valid requests with one part replaced by a value of the wrong kind.
_scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
json_values = st.recursive(
    _scalars | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
_not_object = json_values.filter(lambda v: not isinstance(v, dict))
_not_text = json_values.filter(lambda v: not isinstance(v, str))
_bad_key = _not_text.filter(lambda v: v is not None) | st.just("") | st.text(min_size=1025)
_bad_ttl = st.one_of(
    _not_object.filter(lambda v: v is not None),
    st.fixed_dictionaries(
        {
            "value": st.integers(max_value=0) | st.floats(max_value=0) | st.text() | st.booleans(),
            "unit": st.sampled_from(["second", "hour"]),
        }
    ),
    st.fixed_dictionaries(
        {
            "value": st.integers(1, 10),
            "unit": _not_text | st.sampled_from(["week", "Second", "s", "h", ""]),
        }
    ),
)
MUTATIONS = st.one_of(
    st.tuples(
        st.just("protocol"),
        json_values.filter(
            lambda v: (
                v != PROTOCOL
                and not (
                    isinstance(v, dict)
                    and v.get("name") == "mesh"
                    and isinstance(v.get("version"), str)
                    and v["version"]
                )
                and not isinstance(v, str)
            )
        ),
    ),
    st.tuples(st.just("id"), _not_text | st.just("")),
    st.tuples(st.just("call"), _not_object),
    st.tuples(st.just("call/function"), _not_text | st.just("")),
    st.tuples(st.just("call/version"), _not_text.filter(lambda v: v is not None) | st.just("")),
    st.tuples(st.just("call/arguments"), _not_object.filter(lambda v: v is not None)),
    st.tuples(st.just("context"), _not_object.filter(lambda v: v is not None)),
    st.tuples(st.just("extensions"), _not_object.filter(lambda v: not isinstance(v, list | None))),
    st.tuples(
        st.just("extensions/0"),
        json_values.filter(
            lambda v: not (isinstance(v, dict) and isinstance(v.get("urn"), str) and v["urn"])
        ),
    ),
    st.tuples(st.just("extensions/0/options"), _not_object.filter(lambda v: v is not None)),
    st.tuples(st.just(_KEY_AT[1:]), _bad_key),
    st.tuples(st.just(_TTL_AT[1:]), _bad_ttl),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(envelope=json_values | MUTATIONS.map(lambda m: _with(*m)))
def test_property_malformed_requests_get_an_error_envelope(envelope: Any) -> None:
    memory = open_store("memory://")
    mesh = MeshIdempotency(memory)
    charge = Charges()
    answer = mesh.handle(envelope, charge)
    assert set(answer) == {"protocol", "id", "result", "errors"}
    [error] = answer["errors"]
    assert error["code"] in {"INVALID_REQUEST", "INVALID_ARGUMENTS"}
    assert error["retryable"] is False and isinstance(error["message"], str)
    assert answer["result"] is None
    json.dumps(answer, allow_nan=False)
    assert charge.calls == [] and memory.records() == [] and memory.stats(0).counts == {}
    assert asyncio.run(mesh.ahandle(envelope, charge)) == answer
    assert charge.calls == [] and memory.records() == []


@settings(max_examples=100, deadline=None)
@given(
    arguments=st.dictionaries(st.text(max_size=6), json_values, max_size=5),
    function=st.text(min_size=1, max_size=10),
    version=st.none() | st.text(min_size=1, max_size=4),
)
def test_property_valid_requests_run_once(
    arguments: dict[str, Any], function: str, version: str | None
) -> None:
    memory = open_store("memory://")
    mesh = MeshIdempotency(memory)
    charge = Charges(lambda call: call["arguments"])
    envelope = request(arguments=arguments, function=function, version=version)
    first = mesh.handle(envelope, charge)
    assert "errors" not in first and data(first)["status"] == "processed"
    again = mesh.handle(json.loads(json.dumps({**envelope, "id": "req_002"})), charge)
    assert again["result"] == json.loads(json.dumps(arguments)) and len(charge.calls) == 1
    assert data(again)["status"] == "cached"


# -- races: one execution, whoever comes at once --------------------------------------------------

THREADS = 64
TASKS = 200


def check_race(answers: list[dict[str, Any]], effects: Path, racers: int) -> None:
    statuses = [data(a)["status"] for a in answers]
    assert len(answers) == racers
    assert statuses.count("processed") == 1, statuses
    assert set(statuses) <= {"processed", "cached", "processing"}
    winner = next(a for a in answers if data(a)["status"] == "processed")
    for answer in answers:
        if data(answer)["status"] == "cached":
            assert answer["result"] == winner["result"]
            assert data(answer)["original_request_id"] == winner["id"]
        elif data(answer)["status"] == "processing":
            assert answer["errors"][0]["code"] == "IDEMPOTENCY_PROCESSING"
    assert effects.read_text().splitlines() == [winner["id"]]


def race_request(who: str) -> dict[str, Any]:
    """One racer's request: the same key and arguments, its own id."""
    return request(who, key="race")


def racing_handler(effects: Path, envelope: dict[str, Any]) -> Callable[..., Any]:
    """A handler whose side effect is a line in ``effects`` (outside every process)."""

    def handler(call: dict[str, Any]) -> Any:
        with effects.open("a") as f:
            f.write(envelope["id"] + "\n")
        return {"charged_by": envelope["id"]}

    return handler


def test_threads_race(store: Store[Any], tmp_path: Path) -> None:
    mesh = MeshIdempotency(store)
    effects = tmp_path / "effects"
    effects.touch()
    barrier = threading.Barrier(THREADS)

    def racer(i: int) -> dict[str, Any]:
        envelope = race_request(f"thread-{i}")
        barrier.wait()
        return mesh.handle(envelope, racing_handler(effects, envelope))

    with ThreadPoolExecutor(THREADS) as pool:
        answers = list(pool.map(racer, range(THREADS)))
    check_race(answers, effects, THREADS)


async def test_tasks_race(store: Store[Any], tmp_path: Path) -> None:
    mesh = MeshIdempotency(store)
    effects = tmp_path / "effects"
    effects.touch()
    gate = asyncio.Event()

    async def racer(i: int) -> dict[str, Any]:
        envelope = race_request(f"task-{i}")
        run = racing_handler(effects, envelope)

        async def handler(call: dict[str, Any]) -> Any:
            result = run(call)
            await asyncio.sleep(0.01)  # the others arrive while this one holds the key
            return result

        await gate.wait()
        return await mesh.ahandle(envelope, handler)

    tasks = [asyncio.create_task(racer(i)) for i in range(TASKS)]
    await asyncio.sleep(0)
    gate.set()
    answers = await asyncio.gather(*tasks)
    await mesh.aclose()
    check_race(answers, effects, TASKS)


def _mesh_racer(store: Store[Any], effects: str) -> Callable[[str], dict[str, Any]]:
    mesh = MeshIdempotency(store)

    def racer(who: str) -> dict[str, Any]:
        envelope = race_request(who)
        return mesh.handle(envelope, racing_handler(Path(effects), envelope))

    return racer


def test_processes_race(shared_spec: StoreSpec, tmp_path: Path) -> None:
    effects = tmp_path / "effects"
    effects.touch()
    answers = race_processes(shared_spec, _mesh_racer, str(effects), processes=4, threads=8)
    check_race(answers, effects, 4 * 8)


# -- over HTTP ----------------------------------------------------------------------------------


class Functions:
    """The app's handlers: a plain charge (run in a worker thread), an async refund, a crash."""

    def __init__(self) -> None:
        self.runs: list[str] = []
        self.threads: list[str] = []

    def charge(self, call: dict[str, Any]) -> Any:
        self.runs.append("charge")
        self.threads.append(threading.current_thread().name)
        return RESULT

    async def refund(self, call: dict[str, Any]) -> Any:
        self.runs.append("refund")
        return {"refunded": call["arguments"]["amount"]}

    def crash(self, call: dict[str, Any]) -> Any:
        self.runs.append("crash")
        raise RuntimeError("secret connection string")

    def handlers(self) -> dict[str, Callable[..., Any]]:
        return {
            "payments.charge": self.charge,
            "payments.refund": self.refund,
            "payments.crash": self.crash,
        }


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[httpx.Client, Functions, Store[Any]]]:
    functions = Functions()
    store = open_store(f"sqlite:///{tmp_path}/mesh.db")
    app = MeshApp(functions.handlers(), store, max_body=4096)
    with (
        ThreadServer(app, "asgi") as server,
        httpx.Client(base_url=server.url, headers=CALLER) as client,
    ):
        yield client, functions, store
    store.close()


def test_http_first_cached_conflict(served: tuple[httpx.Client, Functions, Store[Any]]) -> None:
    client, functions, _ = served
    first = client.post("/mesh", json=request())
    assert first.status_code == 200 and first.headers["content-type"] == "application/json"
    assert first.json()["result"] == RESULT and data(first.json())["status"] == "processed"
    cached = client.post("/mesh", json=request("req_002")).json()
    assert cached["result"] == RESULT and data(cached)["status"] == "cached"
    assert data(cached)["original_request_id"] == "req_001"
    conflict = client.post("/mesh", json=request("req_003", arguments={"amount": 1})).json()
    assert conflict["errors"][0]["code"] == "IDEMPOTENCY_CONFLICT"
    assert functions.runs == ["charge"]
    assert not functions.threads[0].startswith("uvicorn")  # a worker thread, not the loop's
    refund = client.post("/mesh", json=request(function="payments.refund")).json()
    assert refund["result"] == {"refunded": 100} and functions.runs == ["charge", "refund"]


def test_http_scope_is_the_caller(served: tuple[httpx.Client, Functions, Store[Any]]) -> None:
    client, functions, _ = served
    for token in ("alice", "bob", "alice"):
        client.post("/mesh", json=request(), headers={"authorization": f"Bearer {token}"})
    assert functions.runs == ["charge", "charge"]


def test_http_unknown_function(served: tuple[httpx.Client, Functions, Store[Any]]) -> None:
    client, _, store = served
    answer = client.post("/mesh", json=request(function="payments.nope"))
    assert answer.status_code == 404
    assert answer.json() == {
        "protocol": PROTOCOL,
        "id": "req_001",
        "result": None,
        "errors": [
            {
                "code": "FUNCTION_NOT_FOUND",
                "message": "no function 'payments.nope'",
                "retryable": False,
                "source": {"pointer": "/call/function"},
            }
        ],
    }
    assert store.records() == []


def test_http_handler_crash(
    served: tuple[httpx.Client, Functions, Store[Any]], caplog: pytest.LogCaptureFixture
) -> None:
    client, functions, _ = served
    with caplog.at_level(logging.ERROR, logger="retrysafe"):
        answer = client.post("/mesh", json=request(function="payments.crash"))
    assert answer.status_code == 500
    [error] = answer.json()["errors"]
    assert error["code"] == "INTERNAL_ERROR" and error["retryable"] is True
    assert "secret" not in answer.text
    assert "secret connection string" in caplog.text
    client.post("/mesh", json=request("req_002", function="payments.crash"))
    assert functions.runs == ["crash", "crash"]  # the key stayed retryable


@pytest.mark.parametrize(
    ("body", "position"),
    [(b'{"id": "req_001",', 17), (b"\xff{}", 0), (b'{"a": NaN}', 0), ('{"é": 1,'.encode(), 9)],
)
def test_http_body_that_is_not_json(
    served: tuple[httpx.Client, Functions, Store[Any]], body: bytes, position: int
) -> None:
    client, functions, store = served
    answer = client.post("/mesh", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400
    [error] = answer.json()["errors"]
    assert error["code"] == "PARSE_ERROR" and error["source"] == {"position": position}
    assert answer.json()["id"] is None and functions.runs == [] and store.records() == []


def test_http_method_and_size(served: tuple[httpx.Client, Functions, Store[Any]]) -> None:
    client, functions, store = served
    get = client.get("/mesh")
    assert get.status_code == 405 and get.headers["allow"] == "POST"
    assert get.json()["errors"][0]["code"] == "INVALID_REQUEST"
    big = request(arguments={"note": "x" * 5000})
    too_large = client.post("/mesh", json=big)
    assert too_large.status_code == 413
    assert too_large.json()["errors"][0]["code"] == "INVALID_REQUEST"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        yield json.dumps(big).encode()

    assert client.post("/mesh", content=chunks()).status_code == 413
    invalid = client.post("/mesh", json={"id": "req_001"})
    assert invalid.status_code == 400 and invalid.json()["errors"][0]["code"] == "INVALID_REQUEST"
    assert functions.runs == [] and store.records() == []


def test_http_custom_principal_and_store_down() -> None:
    """A principal= callable names an anonymous caller; the store is down, so even
    the deployment secret cannot be read: a retryable Mesh error, nothing run."""
    runs: list[int] = []

    def charge(call: Any) -> Any:
        runs.append(1)
        return RESULT

    app = MeshApp(
        {"payments.charge": charge}, "redis://127.0.0.1:1", principal=lambda request: "tenant"
    )
    with ThreadServer(app, "asgi") as server:
        answer = httpx.post(server.url, json=request())
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    [error] = answer.json()["errors"]
    assert error["code"] == "UNAVAILABLE" and error["retryable"] is True
    assert runs == []


def test_the_old_scope_option_still_names_the_caller(memory: Store[Any]) -> None:
    """``scope=`` (a callable over the ASGI scope) is ``principal=``'s old name."""
    with pytest.warns(DeprecationWarning, match="principal="):
        app = MeshApp(
            {"payments.charge": lambda call: RESULT}, memory, scope=lambda asgi: asgi["path"]
        )
    with ThreadServer(app, "asgi") as server:
        for path in ("/a", "/b", "/a"):
            httpx.post(server.url + path, json=request())
    assert len(memory.records()) == 2


async def test_app_lifespan_and_deep_json(memory: Store[Any]) -> None:
    app = MeshApp({}, memory)
    sent: list[dict[str, Any]] = []
    inbox = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive() -> dict[str, Any]:
        return inbox.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app({"type": "lifespan"}, receive, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]

    sent.clear()
    deep = b"[" * 100_000
    inbox = [{"type": "http.request", "body": deep, "more_body": False}]
    await MeshApp({}, memory, max_body=1 << 20)(
        {"type": "http", "method": "POST", "headers": []}, receive, send
    )
    assert sent[0]["status"] == 400
    assert json.loads(sent[1]["body"])["errors"][0]["code"] == "PARSE_ERROR"


async def call_app(app: MeshApp, envelope: dict[str, Any]) -> dict[str, Any]:
    """POST ``envelope`` to ``app`` in-process; the response envelope."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": json.dumps(envelope).encode()}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    caller = [(b"authorization", CALLER["authorization"].encode())]
    await app({"type": "http", "method": "POST", "headers": caller}, receive, send)
    answer: dict[str, Any] = json.loads(sent[1]["body"])
    assert sent[0]["status"] == status_of(answer)
    return answer


async def test_app_cancelled_request_runs_its_handler_once(memory: Store[Any]) -> None:
    """A server that cancels the request's task (client gone, timeout) while a
    plain handler runs in its thread: the handling still ends and records its
    answer; a retry meanwhile is told it is processing, never runs it again."""
    started, release = threading.Event(), threading.Event()
    runs: list[str] = []

    def charge(call: dict[str, Any]) -> Any:
        runs.append("charge")
        if len(runs) == 1:  # the first run blocks until the test releases it
            started.set()
            release.wait(10)
        return RESULT

    app = MeshApp({"payments.charge": charge}, memory, wait=0)
    first = asyncio.create_task(call_app(app, request()))
    try:
        assert await asyncio.to_thread(started.wait, 10), "the handler never started"
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        # The first handler is still blocked in its thread.
        retry = await asyncio.wait_for(call_app(app, request("req_002")), 5)
        assert len(runs) == 1, "the retry ran the handler again, alongside the first run"
        assert retry["errors"][0]["code"] == "IDEMPOTENCY_PROCESSING"
        assert data(retry)["status"] == "processing"
    finally:
        release.set()
    deadline = asyncio.get_running_loop().time() + 10
    while data(answer := await call_app(app, request("req_003")))["status"] == "processing":
        assert asyncio.get_running_loop().time() < deadline, "the first answer was never recorded"
        await asyncio.sleep(0.01)
    assert data(answer)["status"] == "cached" and answer["result"] == RESULT
    assert data(answer)["original_request_id"] == "req_001"
    assert len(runs) == 1
    await app.mesh.aclose()


def test_app_options() -> None:
    with pytest.raises(TypeError):
        MeshApp({"f": "not callable"}, "memory://")  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        MeshApp([], "memory://")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        MeshApp({}, "memory://", max_body=-1)
    with pytest.raises(TypeError):
        MeshApp({}, "memory://", scope="tenant")  # type: ignore[arg-type]
    mesh = MeshIdempotency("memory://")
    assert MeshApp({}, mesh).mesh is mesh
