"""retrysafe.client.MeshClient / AsyncMeshClient: Mesh calls with the idempotency extension.

The unit tests drive both clients over ``httpx.MockTransport`` with the fake
clock of tests/test_client.py, so no test sleeps. The end-to-end tests run a
real :class:`retrysafe.mesh.MeshApp` on uvicorn in its own process (built by
:func:`app_from_env` below), with a slow handler that counts its runs in a file
and a SQLite store, and record every answer on the wire.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from _hangup import CALLER
from _http_servers import Process, ThreadServer, free_port, uvicorn_argv
from test_client import FakeTime, expected_delays, policy
from test_client import scripted as scripted_once

from retrysafe import InvalidKeyError
from retrysafe._client.retry import mesh_retryable, retry_after
from retrysafe.client import AsyncMeshClient, Client, MeshClient, RetryPolicy, decide
from retrysafe.mesh import URN, MeshApp

URL = "http://mesh.test/call"
ARGUMENTS = {"amount": 100, "currency": "USD", "customer_id": "cust_123"}
RESULT = {"charge_id": "ch_abc", "status": "succeeded"}
PROTOCOL = {"name": "mesh", "version": "0.1.0"}


def answer(
    result: Any = None, errors: list[dict[str, Any]] | None = None, status: str = "cached"
) -> httpx.Response:
    """A Mesh answer, as MeshApp sends it: 200, JSON, the error (if any) in ``errors``."""
    entry = {"urn": URN, "data": {"key": "k", "status": status, "original_request_id": "req_0"}}
    doc: dict[str, Any] = {"protocol": PROTOCOL, "id": "req_x", "result": result}
    if errors:
        doc["errors"] = errors
    doc["extensions"] = [entry]
    return httpx.Response(200, json=doc)


def error(code: str, retryable: bool, **details: Any) -> dict[str, Any]:
    return {"code": code, "message": code.lower(), "retryable": retryable, "details": details}


def processing(value: float = 1, unit: str = "second") -> httpx.Response:
    ra = {"value": value, "unit": unit}
    return answer(None, [error("IDEMPOTENCY_PROCESSING", True, key="k", retry_after=ra)])


CACHED = answer(RESULT)
CONFLICT = answer(None, [error("IDEMPOTENCY_CONFLICT", False, original_arguments_hash="sha256:0")])


def scripted(
    answers: list[httpx.Response | Exception],
) -> tuple[Callable[[httpx.Request], httpx.Response], list[httpx.Request]]:
    """test_client's ``scripted``, but each answer is a fresh copy: a response object
    is bound to the client that got it, and the parameters are shared by sync and async."""
    handler, seen = scripted_once(answers)

    def fresh(request: httpx.Request) -> httpx.Response:
        r = handler(request)
        return httpx.Response(r.status_code, headers=r.headers, content=r.content)

    return fresh, seen


def mesh_call(
    mode: str,
    handler: Callable[[httpx.Request], httpx.Response],
    retry: RetryPolicy,
    **options: Any,
) -> dict[str, Any]:
    """``call("payments.charge", ARGUMENTS)`` through the sync or the async client."""
    transport = httpx.MockTransport(handler)
    if mode == "sync":
        with MeshClient(transport=transport, retry=retry) as c:
            return c.call(URL, "payments.charge", ARGUMENTS, **options)

    async def main() -> dict[str, Any]:
        async with AsyncMeshClient(transport=transport, retry=retry) as c:
            return await c.call(URL, "payments.charge", ARGUMENTS, **options)

    return asyncio.run(main())


def sent(request: httpx.Request) -> dict[str, Any]:
    return json.loads(request.content)  # type: ignore[no-any-return]


def key_of(envelope: dict[str, Any]) -> str:
    [ext] = [e for e in envelope["extensions"] if e["urn"] == URN]
    return ext["options"]["key"]  # type: ignore[no-any-return]


# -- the request ---------------------------------------------------------------------------


def test_the_envelope(mode: str) -> None:
    handler, seen = scripted([CACHED])
    other = {"urn": "urn:mesh:ext:trace", "options": {"span": "s1"}}
    doc = mesh_call(
        mode,
        handler,
        RetryPolicy(),
        version="1",
        key="charge_order456_v1",
        ttl=3600,
        extensions=[other],
    )
    assert doc["result"] == RESULT
    [request] = seen
    assert request.method == "POST" and str(request.url) == URL
    assert request.headers["content-type"] == "application/json"
    assert "idempotency-key" not in request.headers  # the key lives in the envelope
    envelope = sent(request)
    assert envelope["id"].startswith("req_") and len(envelope["id"]) == 36
    assert envelope == {
        "protocol": PROTOCOL,
        "id": envelope["id"],
        "call": {"function": "payments.charge", "version": "1", "arguments": ARGUMENTS},
        "extensions": [
            other,
            {
                "urn": URN,
                "options": {"key": "charge_order456_v1", "ttl": {"value": 3600, "unit": "second"}},
            },
        ],
    }


def test_a_new_key_per_call_without_version_or_ttl(mode: str) -> None:
    handler, seen = scripted([CACHED])
    mesh_call(mode, handler, RetryPolicy(key_version=7))
    mesh_call(mode, handler, RetryPolicy(key_version=7), ttl={"value": 2, "unit": "hour"})
    first, second = (sent(r) for r in seen)
    assert first["call"] == {"function": "payments.charge", "arguments": ARGUMENTS}
    assert first["extensions"] == [{"urn": URN, "options": {"key": key_of(first)}}]
    assert second["extensions"][0]["options"]["ttl"] == {"value": 2, "unit": "hour"}
    keys = [key_of(first), key_of(second)]
    assert [uuid.UUID(k).version for k in keys] == [7, 7] and keys[0] != keys[1]


@pytest.mark.parametrize(
    ("function", "arguments", "options", "error"),
    [
        ("f", {}, {"key": ""}, InvalidKeyError),
        ("f", {}, {"key": "k" * 1025}, InvalidKeyError),
        ("f", {}, {"key": 42}, InvalidKeyError),
        ("f", {}, {"extensions": [{"urn": URN, "options": {"key": "k"}}]}, ValueError),
        ("f", {}, {"version": ""}, ValueError),
        ("f", {}, {"ttl": 0}, ValueError),
        ("f", {}, {"ttl": "1h"}, TypeError),
        ("", {}, {}, ValueError),
        ("f", [1, 2], {}, TypeError),
        ("f", {"x": float("nan")}, {}, ValueError),  # not JSON
        ("f", {"x": object()}, {}, TypeError),
    ],
)
def test_bad_input_is_refused_before_sending(
    function: str, arguments: Any, options: dict[str, Any], error: type[Exception]
) -> None:
    handler, seen = scripted([CACHED])
    with MeshClient(transport=httpx.MockTransport(handler)) as c, pytest.raises(error):
        c.call(URL, function, arguments, **options)
    assert seen == []


def test_any_key_the_server_takes(mode: str) -> None:
    """Any string of 1-1024 characters, a lone surrogate included (JSON escapes it)."""
    for key in ("commande_é_42", "k" * 1024, "\ud800"):
        handler, seen = scripted([CACHED])
        mesh_call(mode, handler, RetryPolicy(), key=key)
        assert key_of(sent(seen[0])) == key


# -- retries -------------------------------------------------------------------------------


def test_processing_is_retried_after_its_retry_after_with_the_same_key_and_new_ids(
    mode: str,
) -> None:
    fake = FakeTime()
    handler, seen = scripted([processing(1500, "millisecond"), processing(2, "seconds"), CACHED])
    doc = mesh_call(mode, handler, policy(fake), key="order-1")
    assert doc["result"] == RESULT and "errors" not in doc
    assert fake.sleeps == [1.5, 2]
    envelopes = [sent(r) for r in seen]
    assert [key_of(e) for e in envelopes] == ["order-1"] * 3
    assert len({e["id"] for e in envelopes}) == 3
    assert all(e["call"] == envelopes[0]["call"] for e in envelopes)
    assert all("idempotency-key" not in r.headers for r in seen)


@pytest.mark.parametrize(
    ("first", "asked"),
    [
        (
            answer(
                None,
                [error("UNAVAILABLE", True, retry_after={"value": 3, "unit": "s"})],
            ),
            3,
        ),
        (answer(None, [{"code": "INTERNAL_ERROR", "message": "crashed", "retryable": True}]), None),
        (httpx.Response(503), None),
        (httpx.ReadTimeout("the answer was lost"), None),
    ],
)
def test_other_retryable_answers(
    mode: str, first: httpx.Response | Exception, asked: float | None
) -> None:
    fake = FakeTime()
    handler, seen = scripted([first, CACHED])
    doc = mesh_call(mode, handler, policy(fake, seed=4))
    assert doc["result"] == RESULT and len(seen) == 2
    assert fake.sleeps == [asked if asked is not None else expected_delays(4, 1)[0]]  # or jitter
    assert key_of(sent(seen[0])) == key_of(sent(seen[1]))


@pytest.mark.parametrize(
    "final",
    [
        CONFLICT,
        answer(None, [error("INVALID_ARGUMENTS", False)]),
        answer(None, [{"code": "FUNCTION_NOT_FOUND", "message": "no", "retryable": False}]),
        answer(None, [error("CARD_DECLINED", False)], status="processed"),
        answer(None, [error("IDEMPOTENCY_PROCESSING", True), error("OTHER", False)]),
        answer(None, [{"code": "NO_FLAG", "message": "retryable is missing"}]),
    ],
)
def test_never_retried(mode: str, final: httpx.Response) -> None:
    fake = FakeTime()
    handler, seen = scripted([final, CACHED])
    doc = mesh_call(mode, handler, policy(fake))
    assert doc == final.json()
    assert len(seen) == 1 and fake.sleeps == []


def test_attempts_are_bounded_and_the_last_envelope_is_the_answer(mode: str) -> None:
    fake = FakeTime()
    handler, seen = scripted([processing()])
    doc = mesh_call(mode, handler, policy(fake, max_attempts=3))
    assert doc["errors"][0]["code"] == "IDEMPOTENCY_PROCESSING"
    assert len(seen) == 3 and fake.sleeps == [1, 1]
    assert len({sent(r)["id"] for r in seen}) == 3


def test_time_is_bounded(mode: str) -> None:
    fake = FakeTime()
    handler, seen = scripted([processing(4)])
    doc = mesh_call(mode, handler, policy(fake, max_attempts=100, max_time=10))
    assert doc["errors"][0]["code"] == "IDEMPOTENCY_PROCESSING"
    assert fake.sleeps == [4, 4, 2] and len(seen) == 4  # the last wait is what is left


def test_retry_after_can_be_ignored(mode: str) -> None:
    fake = FakeTime()
    handler, seen = scripted([processing(30), processing(30), CACHED])
    mesh_call(mode, handler, policy(fake, seed=2, honour_retry_after=False))
    assert fake.sleeps == pytest.approx(expected_delays(2, 2)) and len(seen) == 3


def test_an_answer_that_is_no_envelope(mode: str) -> None:
    fake = FakeTime()
    handler, seen = scripted([httpx.Response(502, text="bad gateway")])
    with pytest.raises(httpx.HTTPStatusError):
        mesh_call(mode, handler, policy(fake, max_attempts=2))
    assert len(seen) == 2
    handler, _ = scripted([httpx.Response(200, text="<html>")])
    with pytest.raises(ValueError, match="without an envelope"):
        mesh_call(mode, handler, policy(fake))
    parse_error = {"code": "PARSE_ERROR", "message": "no", "retryable": False}
    refused = {
        "protocol": PROTOCOL,
        "id": None,
        "result": None,
        "errors": [parse_error],
    }
    handler, seen = scripted([httpx.Response(400, json=refused)])
    assert mesh_call(mode, handler, policy(fake)) == refused and len(seen) == 1


# -- retried by code, whatever the HTTP status (the extension's error table, errors.md) ----


def envelope_answer(
    status: int, *errors: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    """A Mesh error envelope without extensions, with the given HTTP status."""
    doc = {"protocol": PROTOCOL, "id": "req_x", "result": None, "errors": list(errors)}
    return httpx.Response(status, json=doc, headers=headers)


#: The extension's "Processing Error" example as the protocol's page has it: no
#: "retryable" field (the protocol's error object has none).
PROCESSING_WITHOUT_FLAG = {
    "code": "IDEMPOTENCY_PROCESSING",
    "message": "Previous request with this key is still processing",
    "details": {"key": "k", "retry_after": {"value": 1, "unit": "second"}},
}


@pytest.mark.parametrize("status", [409, 200])
def test_processing_is_retried_by_its_code(mode: str, status: int) -> None:
    fake = FakeTime()
    handler, seen = scripted([envelope_answer(status, PROCESSING_WITHOUT_FLAG), CACHED])
    doc = mesh_call(mode, handler, policy(fake))
    assert doc["result"] == RESULT and len(seen) == 2 and fake.sleeps == [1]


@pytest.mark.parametrize(
    "first",
    [
        envelope_answer(503, {"code": "UNAVAILABLE", "message": "down"}),
        envelope_answer(200, {"code": "RATE_LIMITED", "message": "slow down"}),
        envelope_answer(429, {"code": "RATE_LIMITED", "message": "slow down"}),
        envelope_answer(502, {"code": "DEPENDENCY_ERROR", "message": "upstream"}),
        envelope_answer(
            409, {"code": "IDEMPOTENCY_PROCESSING", "message": "x", "retryable": False}
        ),
    ],
    ids=["503 unavailable", "200 rate limited", "429", "502 dependency", "processing, flag false"],
)
def test_retryable_codes_are_retried_without_a_flag(mode: str, first: httpx.Response) -> None:
    fake = FakeTime()
    handler, seen = scripted([first, CACHED])
    assert mesh_call(mode, handler, policy(fake))["result"] == RESULT and len(seen) == 2


@pytest.mark.parametrize(
    "final",
    [
        envelope_answer(409, {"code": "IDEMPOTENCY_CONFLICT", "message": "x"}),
        envelope_answer(
            409,
            {"code": "IDEMPOTENCY_CONFLICT", "message": "x", "retryable": True},
            headers={"retry-after": "1"},
        ),
        envelope_answer(
            500, {"code": "INTERNAL_ERROR", "message": "unstorable", "retryable": False}
        ),
        envelope_answer(503, {"code": "UNAVAILABLE", "message": "x", "retryable": False}),
        envelope_answer(400, {"code": "INVALID_ARGUMENTS", "message": "x"}),
        envelope_answer(500, {"code": "APP_BROKEN", "message": "no flag, not a standard code"}),
    ],
    ids=[
        "conflict",
        "conflict with retry-after",
        "500 not retryable",
        "503 flag false",
        "400",
        "500 custom",
    ],
)
def test_never_retried_whatever_the_status(mode: str, final: httpx.Response) -> None:
    fake = FakeTime()
    handler, seen = scripted([final, CACHED])
    assert mesh_call(mode, handler, policy(fake)) == final.json()
    assert len(seen) == 1 and fake.sleeps == []


def test_against_a_real_server_processing_is_409_and_retried(tmp_path: Path) -> None:
    """MeshApp's semantic 409 for a call in flight: the client waits and gets it cached."""
    started, release = threading.Event(), threading.Event()
    runs: list[int] = []

    def slow(call: dict[str, Any]) -> Any:
        runs.append(1)
        started.set()
        assert release.wait(30)
        return RESULT

    seen: list[tuple[int, str]] = []

    def record(response: httpx.Response) -> None:
        response.read()
        errors = response.json().get("errors") or [{"code": ""}]
        seen.append((response.status_code, errors[0]["code"]))
        if errors[0]["code"] == "IDEMPOTENCY_PROCESSING":
            release.set()  # the retry's wait then ends with the answer stored

    store = f"sqlite:///{tmp_path}/mesh.db"
    with (
        ThreadServer(MeshApp({"payments.charge": slow}, store), "asgi") as server,
        MeshClient(
            base_url=server.url,
            headers=CALLER,
            retry=RetryPolicy(base=0.01, max_attempts=10, max_time=60),
            event_hooks={"response": [record]},
            timeout=60,
        ) as client,
        ThreadPoolExecutor(1) as pool,
    ):
        first = pool.submit(client.call, "/", "payments.charge", ARGUMENTS, key="order-9")
        assert started.wait(30)
        doc = client.call("/", "payments.charge", ARGUMENTS, key="order-9")
        assert first.result()["result"] == RESULT
    assert doc["result"] == RESULT and runs == [1]
    assert (409, "IDEMPOTENCY_PROCESSING") in seen


# -- the shared decision ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "unit", "seconds"),
    [
        (250, "ms", 0.25),
        (250, "millisecond", 0.25),
        (250, "milliseconds", 0.25),
        (2, "s", 2),
        (2, "second", 2),
        (2, "seconds", 2),
        (1, "m", 60),
        (1, "minute", 60),
        (1, "minutes", 60),
        (1, "hour", 3600),
    ],
)
def test_retry_after_units_in_mesh_errors(value: float, unit: str, seconds: float) -> None:
    assert retry_after(processing(value, unit)) == pytest.approx(seconds)


def test_retry_after_takes_the_longest_mesh_error() -> None:
    two = answer(
        None,
        [
            error("IDEMPOTENCY_PROCESSING", True, retry_after={"value": 1, "unit": "second"}),
            {"code": "X", "message": "x", "retryable": True, "retry_after": 5},
        ],
    )
    assert retry_after(two) == 5
    p = RetryPolicy()
    assert decide(1, two, p, 0.0, retryable=mesh_retryable) == 5
    assert decide(1, two, p, 0.0) is None  # the plain decision: a 200 is final


@pytest.mark.parametrize("client", [Client, MeshClient])
def test_a_plain_post_is_not_a_mesh_call(client: type[Client]) -> None:
    # A plain POST of a Mesh envelope may carry no idempotency extension: a 200 is final.
    fake = FakeTime()
    handler, seen = scripted([processing(), CACHED])
    with client(transport=httpx.MockTransport(handler), retry=policy(fake)) as c:
        r = c.post(URL, json={"protocol": PROTOCOL, "id": "req_1", "call": {"function": "f"}})
    assert r.json()["errors"][0]["code"] == "IDEMPOTENCY_PROCESSING"
    assert len(seen) == 1 and fake.sleeps == []
    assert "idempotency-key" in seen[0].headers  # the base client's rule, unchanged
    assert not mesh_retryable(httpx.Response(200, json={"errors": []}))
    assert not mesh_retryable(httpx.Response(200, json={"errors": ["oops"]}))


def test_async_mesh_client_streams_as_the_base_client() -> None:
    handler, seen = scripted([processing(), CACHED])

    async def main() -> bytes:
        transport = httpx.MockTransport(handler)
        async with (
            AsyncMeshClient(transport=transport, retry=policy(FakeTime())) as c,
            c.stream("POST", URL, json={}) as r,
        ):
            return await r.aread()

    assert b"IDEMPOTENCY_PROCESSING" in asyncio.run(main()) and len(seen) == 1


# -- a real MeshApp in its own process ------------------------------------------------------

SLOW = 0.5  # seconds the handler takes: duplicates arrive while it runs


def app_from_env() -> MeshApp:
    """The uvicorn factory: a slow charge that writes its order to ``$MESH_RUNS`` per run."""
    runs = Path(os.environ["MESH_RUNS"])

    def charge(call: dict[str, Any]) -> Any:
        order = call["arguments"]["order"]
        with runs.open("a") as f:
            f.write(order + "\n")
        time.sleep(SLOW)
        return {"order": order, "charge_id": "ch_" + uuid.uuid4().hex}

    return MeshApp({"payments.charge": charge}, os.environ["MESH_STORE"], wait=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(URL, the runs file) of a MeshApp on uvicorn in its own process."""
    root = tmp_path_factory.mktemp("mesh_client")
    runs = root / "runs"
    runs.touch()
    port = free_port()
    env = {"MESH_RUNS": str(runs), "MESH_STORE": f"sqlite:///{root / 'mesh.db'}"}
    with Process(uvicorn_argv("test_mesh_client:app_from_env", port), port, env) as proc:
        yield proc.url, runs


def runs_of(runs: Path, order: str) -> int:
    return runs.read_text().splitlines().count(order)


Seen = list[tuple[str, str]]  # (attempt id, its first error code, else status or exception)


def outcome_of(response: httpx.Response) -> str:
    errors = response.json().get("errors") or [{}]
    return str(errors[0].get("code", response.status_code))


class Recording(httpx.HTTPTransport):
    """Records every attempt on the wire: (envelope id, outcome)."""

    def __init__(self, seen: Seen) -> None:
        super().__init__()
        self.seen = seen

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        rid = json.loads(request.content)["id"]
        try:
            response = super().handle_request(request)
            response.read()
        except httpx.TransportError as exc:
            self.seen.append((rid, type(exc).__name__))
            raise
        self.seen.append((rid, outcome_of(response)))
        return response


class AsyncRecording(httpx.AsyncHTTPTransport):
    """:class:`Recording` for the async client."""

    def __init__(self, seen: Seen) -> None:
        super().__init__()
        self.seen = seen

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        rid = json.loads(request.content)["id"]
        try:
            response = await super().handle_async_request(request)
            await response.aread()
        except httpx.TransportError as exc:
            self.seen.append((rid, type(exc).__name__))
            raise
        self.seen.append((rid, outcome_of(response)))
        return response


def real_policy() -> RetryPolicy:
    return RetryPolicy(base=0.05, cap=0.5, max_attempts=6, max_time=20)


def status_of(envelope: dict[str, Any]) -> str:
    [entry] = envelope["extensions"]
    return entry["data"]["status"]  # type: ignore[no-any-return]


def check_once(answers: list[dict[str, Any]], seen: Seen, runs: Path, order: str) -> None:
    """One run; every caller the same result; the others were told PROCESSING and retried."""
    assert runs_of(runs, order) == 1
    assert all("errors" not in a for a in answers), answers
    assert {json.dumps(a["result"]) for a in answers} == {json.dumps(answers[0]["result"])}
    assert answers[0]["result"]["order"] == order
    statuses = sorted(status_of(a) for a in answers)
    assert statuses == ["cached"] * (len(answers) - 1) + ["processed"]
    [winner] = [a for a in answers if status_of(a) == "processed"]
    assert all(a["extensions"][0]["data"]["original_request_id"] == winner["id"] for a in answers)
    told = [rid for rid, what in seen if what == "IDEMPOTENCY_PROCESSING"]
    assert told, seen  # the retry path ran: some callers were answered PROCESSING first...
    assert len(seen) == len(answers) + len(told)  # ...and each such answer was retried once
    assert len({rid for rid, _ in seen}) == len(seen)  # a new id per attempt
    assert {a["id"] for a in answers} == {rid for rid, what in seen if what == "200"}


CALLERS = 8


def test_real_server_8_threads_one_key(server: tuple[str, Path]) -> None:
    url, runs = server
    order, key = uuid.uuid4().hex, "order-" + uuid.uuid4().hex
    seen: Seen = []
    barrier = threading.Barrier(CALLERS)

    def caller(_: int) -> dict[str, Any]:
        with MeshClient(
            transport=Recording(seen), retry=real_policy(), timeout=10, headers=CALLER
        ) as c:
            barrier.wait()
            return c.call(url, "payments.charge", {"order": order}, key=key)

    with ThreadPoolExecutor(CALLERS) as pool:
        answers = list(pool.map(caller, range(CALLERS)))
    check_once(answers, seen, runs, order)


def test_real_server_8_tasks_one_key(server: tuple[str, Path]) -> None:
    url, runs = server
    order, key = uuid.uuid4().hex, "order-" + uuid.uuid4().hex
    seen: Seen = []

    async def main() -> list[dict[str, Any]]:
        transport = AsyncRecording(seen)
        async with AsyncMeshClient(
            transport=transport, retry=real_policy(), timeout=10, headers=CALLER
        ) as c:
            one = {"order": order}
            calls = [c.call(url, "payments.charge", one, key=key) for _ in range(CALLERS)]
            return list(await asyncio.gather(*calls))

    check_once(asyncio.run(main()), seen, runs, order)


def test_real_server_lost_answer_is_replayed(mode: str, server: tuple[str, Path]) -> None:
    url, runs = server
    order = uuid.uuid4().hex
    seen: Seen = []
    timeout = httpx.Timeout(5, read=SLOW / 2)  # the first answer comes after the client left

    def sync() -> dict[str, Any]:
        with MeshClient(
            transport=Recording(seen), retry=real_policy(), timeout=timeout, headers=CALLER
        ) as c:
            return c.call(url, "payments.charge", {"order": order})

    async def asynchronous() -> dict[str, Any]:
        transport = AsyncRecording(seen)
        async with AsyncMeshClient(
            transport=transport, retry=real_policy(), timeout=timeout, headers=CALLER
        ) as c:
            return await c.call(url, "payments.charge", {"order": order})

    doc = sync() if mode == "sync" else asyncio.run(asynchronous())
    assert "errors" not in doc and doc["result"]["order"] == order
    assert status_of(doc) == "cached"
    assert seen[0][1] == "ReadTimeout"
    assert doc["extensions"][0]["data"]["original_request_id"] == seen[0][0]  # the lost attempt
    assert seen[-1] == (doc["id"], "200")
    assert runs_of(runs, order) == 1
