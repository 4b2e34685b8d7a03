"""retrysafe.a2a: A2A JSON-RPC sends made exactly-once.

The middleware runs in front of the real a2a-sdk server (v1.0 ``SendMessage``
and v0.3 ``message/send`` on one endpoint) on a real uvicorn; the agent counts
the tasks it starts in files, outside the server. The function wrapper runs on
every store.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest.mock import AsyncMock, Mock

import httpx
import pytest
from _a2a_app import Counter, make_app
from _http_servers import Process, ThreadServer, free_port, uvicorn_argv
from conftest import StoreSpec

from retrysafe import Engine, Store, StoreUnavailableError
from retrysafe._core.principal import Principals
from retrysafe._http.asgi import caller
from retrysafe._protocols.a2a import normal_message, part_v03, part_v10, result_as
from retrysafe.a2a import (
    SEND_METHODS,
    A2AIdempotency,
    A2AMiddleware,
    ErrorCode,
)

_ids = itertools.count(1)


def v03(mid: str, text: str = "hello", **message: Any) -> dict[str, Any]:
    """A v0.3 ``message/send`` request."""
    msg = {
        "kind": "message",
        "messageId": mid,
        "role": "user",
        "parts": [{"kind": "text", "text": text}],
        **message,
    }
    return {
        "jsonrpc": "2.0",
        "id": next(_ids),
        "method": "message/send",
        "params": {"message": msg},
    }


def v10(mid: str, text: str = "hello", **message: Any) -> dict[str, Any]:
    """A v1.0 ``SendMessage`` request (ProtoJSON)."""
    msg = {"messageId": mid, "role": "ROLE_USER", "parts": [{"text": text}], **message}
    return {
        "jsonrpc": "2.0",
        "id": f"req-{next(_ids)}",
        "method": "SendMessage",
        "params": {"message": msg},
    }


def rpc(method: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": next(_ids), "method": method, "params": params}


#: The credentials a test's requests carry unless it says otherwise (None: none).
CALLER = "Bearer agent-caller"


class Client:
    """Posts JSON-RPC requests for one test (its test id, its principal)."""

    def __init__(self, url: str, tid: str, counter: Counter) -> None:
        self.url, self.tid, self.counter = url, tid, counter
        self.http = httpx.Client(timeout=30)

    def post(self, body: Any, auth: str | None = CALLER, **kwargs: Any) -> httpx.Response:
        headers = {"x-test-id": self.tid, "a2a-version": "0.3"}
        if isinstance(body, dict) and body.get("method", "")[:1].isupper():
            headers["a2a-version"] = "1.0"
        if auth:
            headers["authorization"] = auth
        return self.http.post(self.url + "/", json=body, headers=headers, **kwargs)

    def call(self, body: Any, auth: str | None = CALLER) -> dict[str, Any]:
        response = self.post(body, auth)
        assert response.status_code == 200, response.text
        doc = response.json()
        if isinstance(body, dict):
            assert doc["id"] == body["id"]  # every answer carries its own request's id
        return doc  # type: ignore[no-any-return]

    @property
    def tasks(self) -> int:
        """How many executions the agent started for this test."""
        return self.counter.count(self.tid)

    def open_gate(self) -> None:
        self.counter.gate(self.tid).touch()


@pytest.fixture(scope="module")
def counters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("a2a-counters")


@pytest.fixture(scope="module")
def agent(counters: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The agent behind the middleware, on SQLite, in a thread of this process."""
    db = tmp_path_factory.mktemp("a2a-store") / "a2a.db"
    with ThreadServer(make_app(counters, f"sqlite:///{db}"), "asgi") as server:
        yield server.url


@pytest.fixture
def client(agent: str, counters: Path) -> Iterator[Client]:
    c = Client(agent, uuid.uuid4().hex, Counter(counters))
    yield c
    c.open_gate()  # never leave an execution waiting
    c.http.close()


def mid() -> str:
    return str(uuid.uuid4())


def data_of(error: dict[str, Any]) -> dict[str, Any]:
    """What an error says, in either shape: the ErrorInfo metadata of v1.0's data
    list (strings), or v0.3's data object."""
    data = error["data"]
    if isinstance(data, dict):
        return data
    assert data[0]["@type"] == "type.googleapis.com/google.rpc.ErrorInfo"
    return data[0]["metadata"]  # type: ignore[no-any-return]


def task_of(doc: dict[str, Any]) -> dict[str, Any]:
    """The Task of a send's answer, in either spelling."""
    result = doc["result"]
    return result.get("task", result)  # type: ignore[no-any-return]


# -- the conversation ---------------------------------------------------------------------


def test_duplicated_sends_in_both_spellings_start_one_task(client: Client) -> None:
    """message/send twice, SendMessage twice, one messageId: one task, four answers."""
    m = mid()
    first = client.post(v03(m))
    assert first.headers.get("idempotent-replayed") is None
    a = first.json()
    second = client.post(body := v03(m))
    assert second.headers["idempotent-replayed"] == "true"
    b = second.json()
    assert b["id"] == body["id"] != a["id"]
    assert b["result"] == a["result"]
    c, d = client.call(v10(m)), client.call(v10(m))
    assert c["result"] == d["result"]
    assert c["result"]["task"]["id"] == a["result"]["id"]
    assert c["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
    assert client.tasks == 1
    # Task reads pass through to the agent, in both spellings.
    task_id = a["result"]["id"]
    got = client.post(rpc("tasks/get", {"id": task_id}))
    assert got.headers.get("idempotent-replayed") is None
    assert got.json()["result"]["id"] == task_id
    assert client.call(rpc("GetTask", {"id": task_id}))["result"]["id"] == task_id
    assert client.tasks == 1


def test_a_retry_in_the_other_spelling_gets_the_sdk_shape(client: Client) -> None:
    """A replay converted to the other spelling equals what the SDK itself answers."""
    m = mid()
    sent = client.call(v03(m, metadata={"n": 1}))["result"]
    replay = client.call(v10(m, metadata={"n": 1.0}))["result"]  # ProtoJSON numbers are doubles
    assert replay == {"task": client.call(rpc("GetTask", {"id": sent["id"]}))["result"]}
    m = mid()
    sent = client.call(v10(m, contextId="ctx-" + m))["result"]["task"]
    replay = client.call(v03(m, contextId="ctx-" + m))["result"]
    assert replay == client.call(rpc("tasks/get", {"id": sent["id"]}))["result"]
    assert client.tasks == 2


def test_a_message_answer_replays_in_both_spellings(client: Client) -> None:
    m = mid()
    first = client.call(v10(m, "message"))["result"]
    assert first["message"]["role"] == "ROLE_AGENT"
    assert client.call(v10(m, "message"))["result"] == first
    legacy = client.call(v03(m, "message"))["result"]
    assert legacy["kind"] == "message"
    assert legacy["role"] == "agent"
    assert legacy["messageId"] == first["message"]["messageId"]
    assert legacy["parts"] == [{"kind": "text", "text": "reply 1"}]
    assert client.tasks == 1


def test_other_content_under_the_same_message_id_is_a_conflict(client: Client) -> None:
    m = mid()
    first = client.call(v03(m, "one thing"))
    for body in (v03(m, "another thing"), v10(m, "another thing"), v10(m, "one thing", taskId="t")):
        error = client.call(body)["error"]
        assert error["code"] == ErrorCode.CONFLICT == -32602
        data = data_of(error)
        assert data["code"] == "idempotency_conflict"
        if body["method"] == "message/send":  # v0.3: the keys of before
            assert data["retryable"] is False
            assert data["original_request_id"] == str(first["id"])
            assert len(data["original_fingerprint"]) == 64
        else:
            assert data["retryable"] == "false"
            assert data["originalRequestId"] == str(first["id"])
            assert len(data["originalFingerprint"]) == 64
    assert client.tasks == 1


def test_principals_and_contexts_never_share_a_message(client: Client) -> None:
    m = mid()
    answers = [
        client.call(v03(m), auth="Bearer alice"),
        client.call(v03(m), auth="Bearer bob"),
        client.call(v03(m, contextId="c1"), auth="Bearer alice"),
        client.call(v03(m, contextId="c2"), auth="Bearer alice"),
    ]
    assert len({a["result"]["id"] for a in answers}) == 4
    assert client.tasks == 4
    # Each one replays within its own principal and context.
    again = client.call(v10(m, contextId="c2"), auth="Bearer alice")
    assert again["result"]["task"]["id"] == answers[3]["result"]["id"]
    assert client.tasks == 4


@pytest.mark.parametrize("message_id", [None, "", "x" * 1025, 42, ["m"]])
def test_a_send_without_a_usable_message_id_is_invalid_params(
    client: Client, message_id: Any
) -> None:
    body = v03("placeholder")
    if message_id is None:
        del body["params"]["message"]["messageId"]
    else:
        body["params"]["message"]["messageId"] = message_id
    error = client.call(body)["error"]
    assert error["code"] == -32602
    assert error["data"]["code"] == "idempotency_key_invalid"
    assert client.tasks == 0
    # v1.0: a field violation names the messageId.
    body = v10("placeholder")
    body["params"]["message"]["messageId"] = message_id
    error = client.call(body)["error"]
    assert error["code"] == -32602
    assert error["data"][1]["@type"] == "type.googleapis.com/google.rpc.BadRequest"
    assert error["data"][1]["fieldViolations"][0]["field"] == "message.messageId"
    assert client.tasks == 0


def test_a_duplicate_in_flight_gets_an_in_flight_error(client: Client) -> None:
    m = mid()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.call, v03(m, "gate"))
        deadline = time.monotonic() + 30
        while client.tasks == 0:  # until the first send runs in the agent
            assert not first.done(), first.result()
            assert time.monotonic() < deadline, "the first send never reached the agent in 30 s"
            time.sleep(0.005)
        response = client.post(v10(m, "gate"))
        error = response.json()["error"]
        assert error["code"] == ErrorCode.IN_FLIGHT == -32603
        data = data_of(error)
        assert data["code"] == "idempotency_in_flight"
        assert data["retryable"] == "true"
        assert int(data["retryAfter"]) >= 1
        assert response.headers["retry-after"] == data["retryAfter"]
        legacy = client.post(v03(m, "gate"))
        data = legacy.json()["error"]["data"]
        assert (data["code"], data["retryable"]) == ("idempotency_in_flight", True)
        assert legacy.headers["retry-after"] == str(data["retry_after"])
        client.open_gate()
        task = first.result()["result"]
    assert client.call(v03(m, "gate"))["result"] == task
    assert client.tasks == 1


@pytest.mark.parametrize("text", ["fail-once", "crash-once"])
def test_a_failed_send_stays_retryable(client: Client, text: str) -> None:
    m = mid()
    first = client.post(v03(m, text))
    if text == "fail-once":  # a JSON-RPC error, passed on unchanged
        assert first.status_code == 200
        assert first.json()["error"]["message"] == "the agent failed"
    else:
        assert first.status_code == 500
        assert first.text == "Internal Server Error"
    retry = client.post(v10(m, text))
    assert retry.headers.get("idempotent-replayed") is None
    task = retry.json()["result"]["task"]
    assert client.call(v03(m, text))["result"]["id"] == task["id"]
    assert client.tasks == (2 if text == "fail-once" else 1)


def test_a_client_that_leaves_still_gets_its_answer_recorded(client: Client) -> None:
    m = mid()
    with pytest.raises(httpx.ReadTimeout):
        client.post(v03(m, "gate"), timeout=httpx.Timeout(30, read=0.3))
    client.open_gate()
    deadline = time.monotonic() + 30
    while "error" in (doc := client.call(v03(m, "gate"))):  # until the first send completes
        assert data_of(doc["error"])["code"] == "idempotency_in_flight"
        assert time.monotonic() < deadline, "the first send was still in flight after 30 s"
        time.sleep(0.01)
    assert doc["result"]["status"]["state"] == "completed"
    assert client.tasks == 1


def test_what_passes_through(client: Client) -> None:
    # The agent card (GET).
    card = client.http.get(client.url + "/.well-known/agent-card.json")
    assert card.json()["name"] == "counting agent"
    # Streaming sends are not deduplicated: each one runs.
    m = mid()
    for method in ("message/stream", "SendStreamingMessage"):
        body = v03(m) if method == "message/stream" else v10(m)
        body["method"] = method
        response = client.post(body)
        assert response.headers["content-type"].startswith("text/event-stream")
        assert "completed" in response.text or "COMPLETED" in response.text
    assert client.tasks == 2
    # Invalid JSON and unknown methods reach the agent, which answers them.
    raw = client.http.post(client.url + "/", content=b"{not json", headers={"a2a-version": "1.0"})
    assert raw.json()["error"]["code"] == -32700
    assert client.call(rpc("tasks/nothing", {}))["error"]["code"] == -32601
    # A batch without a send too (the SDK refuses batches itself).
    batch = client.post([rpc("tasks/get", {"id": "x"})]).json()
    assert batch["error"]["message"] == "Batch requests are not supported"  # the SDK's answer


def test_a_batched_send_is_refused(client: Client) -> None:
    doc = client.post([v03(mid()), rpc("tasks/get", {"id": "x"})]).json()
    assert doc["id"] is None
    assert doc["error"]["code"] == -32600
    assert data_of(doc["error"])["code"] == "idempotency_batch_unsupported"
    assert client.tasks == 0


def test_an_unreachable_store_fails_closed(counters: Path) -> None:
    app = make_app(counters, f"redis://127.0.0.1:{free_port()}/0")
    with ThreadServer(app, "asgi") as server:
        client = Client(server.url, uuid.uuid4().hex, Counter(counters))
        response = client.post(v10(mid()))
        error = response.json()["error"]
        assert error["code"] == ErrorCode.STORE_UNAVAILABLE == -32603
        assert data_of(error)["code"] == "idempotency_store_unavailable"
        assert response.headers["retry-after"] == data_of(error)["retryAfter"]
        assert client.tasks == 0
        # Task reads do not need the store.
        assert client.call(rpc("GetTask", {"id": "nope"}))["error"]["code"] == -32001
        client.http.close()


def test_limits(counters: Path) -> None:
    """A request over max_request_body is refused; a result over max_body runs once."""
    app = make_app(counters, "memory://", max_request_body=300, max_body=200)
    with ThreadServer(app, "asgi") as server:
        client = Client(server.url, uuid.uuid4().hex, Counter(counters))
        error = client.post(v03(mid(), "x" * 300)).json()["error"]
        assert (error["code"], data_of(error)["code"]) == (-32600, "idempotency_body_too_large")
        assert client.tasks == 0
        m = mid()
        assert client.call(v03(m))["result"]["status"]["state"] == "completed"  # 500+ bytes
        error = client.call(v10(m))["error"]
        assert (error["code"], data_of(error)["code"]) == (-32603, "idempotency_failed")
        assert client.tasks == 1
        client.http.close()


# -- many at once ----------------------------------------------------------------------------


def test_many_threads_and_processes_start_one_task(shared_spec: StoreSpec, tmp_path: Path) -> None:
    """48 clients send one message at once, in both spellings, to 3 worker processes."""
    counter = Counter(tmp_path / "counters")
    port = free_port()
    env = {
        "A2A_TEST_COUNTERS": str(counter.root),
        "A2A_TEST_STORE": shared_spec.url,
        "A2A_TEST_OPTIONS": json.dumps(shared_spec.options),
    }
    argv = uvicorn_argv("_a2a_app:app_from_env", port, workers=3)
    with Process(argv, port, env, health="/.well-known/agent-card.json") as server:
        client = Client(server.url, uuid.uuid4().hex, counter)
        m = mid()
        start = threading.Barrier(48)

        def send(i: int) -> dict[str, Any]:
            body = v03(m) if i % 2 else v10(m)
            start.wait()
            return client.call(body)

        with ThreadPoolExecutor(48) as pool:
            answers = list(pool.map(send, range(48)))
        client.http.close()
    assert counter.count(client.tid) == 1
    assert len({task_of(a)["id"] for a in answers}) == 1  # every one waited for the answer


# -- the function wrapper ----------------------------------------------------------------------


class Agent:
    """A JSON-RPC handler that starts a task per send it runs (v0.3 or v1.0 shape)."""

    def __init__(self) -> None:
        self.runs = 0
        self.fail = False
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        if request["method"] not in SEND_METHODS:
            return {"jsonrpc": "2.0", "id": request["id"], "result": {"runs": self.runs}}
        self.runs += 1
        if self.fail:
            return {
                "jsonrpc": "2.0",
                "id": request["id"],
                "error": {"code": -32603, "message": "failed"},
            }
        status = {"state": "completed", "timestamp": "2026-01-01T00:00:00+00:00"}
        task = {"kind": "task", "id": f"task-{self.runs}", "contextId": "ctx", "status": status}
        result = task if request["method"] == "message/send" else result_as(task, "1.0")
        return {"jsonrpc": "2.0", "id": request["id"], "result": result}

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        self.entered.set()
        assert self.release.wait(30)
        return self.answer(request)


@pytest.fixture
def dedupe(store: Store[Any]) -> A2AIdempotency:
    return A2AIdempotency(store)


def test_the_wrapper_runs_each_message_once(dedupe: A2AIdempotency) -> None:
    agent = Agent()
    dispatch = dedupe.wrap(agent)
    m = mid()
    first = dispatch(v03(m))
    assert first["result"]["id"] == "task-1"
    assert dispatch(body := v03(m))["id"] == body["id"]
    assert dispatch(v03(m))["result"] == first["result"]
    v1 = dispatch(v10(m))["result"]
    assert v1 == {
        "task": {
            "id": "task-1",
            "contextId": "ctx",
            "status": {"state": "TASK_STATE_COMPLETED", "timestamp": "2026-01-01T00:00:00Z"},
        }
    }
    assert agent.runs == 1
    # Another principal is another message; other reads pass through every time.
    assert dispatch(v10(m), principal="tenant-b")["result"]["task"]["id"] == "task-2"
    assert dispatch(rpc("tasks/get", {"id": "task-1"}))["result"] == {"runs": 2}
    # Other content under the same messageId is a conflict.
    assert dispatch(v10(m, "changed"))["error"]["code"] == ErrorCode.CONFLICT
    assert agent.runs == 2


def test_the_wrapper_leaves_failures_retryable(dedupe: A2AIdempotency) -> None:
    agent = Agent()
    agent.fail = True
    m = mid()
    assert dedupe.handle(v03(m), agent)["error"]["message"] == "failed"
    agent.fail = False

    def boom(request: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        dedupe.handle(v03(m), boom)
    assert dedupe.handle(v03(m), agent)["result"]["id"] == "task-2"
    assert dedupe.handle(v03(m), agent)["result"]["id"] == "task-2"
    assert agent.runs == 2


def test_the_wrapper_answers_in_flight(dedupe: A2AIdempotency) -> None:
    agent = Agent()
    agent.release.clear()
    m = mid()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(dedupe.handle, v03(m), agent)
        assert agent.entered.wait(30)
        error = dedupe.handle(v03(m), agent)["error"]
        assert error["code"] == ErrorCode.IN_FLIGHT
        assert error["data"]["original_request_id"] is not None
        agent.release.set()
        assert first.result()["result"]["id"] == "task-1"
    assert agent.runs == 1


async def test_the_async_wrapper(dedupe: A2AIdempotency) -> None:
    agent = Agent()

    async def answer(request: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0)
        return agent.answer(request)

    dispatch = dedupe.wrap(answer)
    m = mid()
    answers = await asyncio.gather(*(dispatch(v10(m)) for _ in range(5)))
    ok = [a for a in answers if "result" in a]
    assert ok and all(a["result"] == ok[0]["result"] for a in ok)
    assert all(a["error"]["code"] == ErrorCode.IN_FLIGHT for a in answers if "error" in a)
    assert (await dispatch(v03(m)))["result"]["id"] == "task-1"
    assert agent.runs == 1
    await dedupe.aclose()


async def test_an_object_with_an_async_call_is_wrapped_async(memory: Store[Any]) -> None:
    agent = Agent()

    class Dispatcher:
        async def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
            return agent.answer(request)

    dedupe = A2AIdempotency(memory)
    dispatch = dedupe.wrap(Dispatcher())
    m = mid()
    assert (await dispatch(v03(m)))["result"]["id"] == "task-1"
    assert (await dispatch(v10(m)))["result"]["task"]["id"] == "task-1"
    assert agent.runs == 1
    await dedupe.aclose()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_answer_that_cannot_be_recorded_still_reaches_the_caller(
    mode: str, memory: Store[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gone = StoreUnavailableError("gone")
    monkeypatch.setattr(memory, "complete", Mock(side_effect=gone))
    monkeypatch.setattr(memory, "acomplete", AsyncMock(side_effect=gone))
    dedupe, agent, m = A2AIdempotency(Engine(memory, settle_retry=0)), Agent(), mid()

    async def answer(request: dict[str, Any]) -> dict[str, Any]:
        return agent.answer(request)

    with caplog.at_level(logging.ERROR, logger="retrysafe"):
        if mode == "sync":
            response = dedupe.handle(v03(m), agent)
        else:
            response = asyncio.run(dedupe.ahandle(v03(m), answer))
    assert response["result"]["id"] == "task-1"
    assert f"the answer to message {m!r} was sent but not recorded (gone)" in caplog.text


def test_the_principal_of_a_request() -> None:
    def scope(headers: list[tuple[bytes, bytes]], **extra: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "method": "POST",
            "path": "/",
            "query_string": b"",
            "headers": headers,
            **extra,
        }

    def named(asgi: dict[str, Any], principals: Principals | None = None) -> str | None:
        who = caller(asgi, principals or Principals())
        return None if who is None else who.scope(b"s" * 32)

    bearer = scope([(b"authorization", b"Bearer alice")])
    assert named(bearer) is not None and "alice" not in named(bearer)  # type: ignore[operator]
    assert named(bearer) != named(scope([(b"authorization", b"Bearer bob")]))
    assert named(scope([])) is None  # no credential: anonymous, never shared by default
    tenant = Principals(principal=lambda request: request.native["path"])
    assert named(bearer, tenant) == named(scope([], path="/"), tenant) != named(bearer)
    assert named(bearer, Principals(principal=lambda request: None)) == named(bearer)
    with pytest.raises(TypeError, match=r"must return a str, None or .*ANONYMOUS, not int"):
        named(bearer, Principals(principal=lambda request: 42))  # type: ignore[arg-type,return-value]


def test_many_threads_run_the_wrapper_once(store: Store[Any]) -> None:
    dedupe = A2AIdempotency(Engine(store), wait=30)
    agent = Agent()
    m = mid()
    start = threading.Barrier(32)

    def send(i: int) -> dict[str, Any]:
        start.wait()
        return dedupe.handle(v03(m) if i % 2 else v10(m), agent)

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(send, range(32)))
    assert agent.runs == 1
    assert {task_of(a)["id"] for a in answers} == {"task-1"}


def test_the_wrapper_refuses_a_send_without_message_id(memory: Store[Any]) -> None:
    agent = Agent()
    body = rpc("SendMessage", {"message": {"role": "ROLE_USER", "parts": [{"text": "x"}]}})
    error = A2AIdempotency(memory).handle(body, agent)["error"]
    assert (error["code"], data_of(error)["code"]) == (-32602, "idempotency_key_invalid")
    assert agent.runs == 0


def test_a_result_too_large_to_store_runs_once(memory: Store[Any]) -> None:
    agent = Agent()
    dedupe = A2AIdempotency(memory, max_body=40)
    m = mid()
    assert dedupe.handle(v03(m), agent)["result"]["id"] == "task-1"
    assert dedupe.handle(v03(m), agent)["error"]["code"] == ErrorCode.FAILED
    assert agent.runs == 1


def test_final_failures_replay_the_error(memory: Store[Any]) -> None:
    agent = Agent()
    agent.fail = True
    dedupe = A2AIdempotency(memory, final_failures=True)
    m = mid()
    assert dedupe.handle(v03(m), agent)["error"]["message"] == "failed"
    agent.fail = False
    again = dedupe.handle(body := v10(m), agent)
    assert again == {
        "jsonrpc": "2.0",
        "id": body["id"],
        "error": {"code": -32603, "message": "failed"},
    }
    assert agent.runs == 1


# -- the two spellings -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (
            {"kind": "text", "text": "hi", "metadata": {"a": 1}},
            {"text": "hi", "metadata": {"a": 1}},
        ),
        (
            {"kind": "file", "file": {"bytes": "aGk=", "mimeType": "text/plain", "name": "a.txt"}},
            {"raw": "aGk=", "mediaType": "text/plain", "filename": "a.txt"},
        ),
        ({"kind": "file", "file": {"uri": "https://x/y"}}, {"url": "https://x/y"}),
        ({"kind": "data", "data": {"k": [1, 2]}}, {"data": {"k": [1, 2]}}),
        (
            {"kind": "data", "data": {"value": [1, 2]}, "metadata": {"data_part_compat": True}},
            {"data": [1, 2]},
        ),
    ],
)
def test_parts_convert_both_ways(old: dict[str, Any], new: dict[str, Any]) -> None:
    assert part_v10(old) == new
    assert part_v03(new) == old
    assert part_v10(new) == new
    assert part_v03(old) == old


def test_one_message_in_both_spellings_has_one_normal_form() -> None:
    legacy = {
        "kind": "message",
        "messageId": "m",
        "role": "user",
        "contextId": "c",
        "parts": [
            {"kind": "file", "file": {"bytes": "aGk=", "mimeType": "text/plain"}},
            {"kind": "data", "data": {"n": 1}},
        ],
        "metadata": {"x": 2},
        "referenceTaskIds": [],
    }
    current = {
        "message_id": "other",
        "role": 1,
        "context_id": "c",
        "taskId": "",
        "parts": [{"raw": "aGk", "media_type": "text/plain"}, {"data": {"n": 1.0}}],
        "metadata": {"x": 2.0},
    }
    assert normal_message(legacy) == normal_message(current)
    assert normal_message(legacy) != normal_message({**current, "role": "ROLE_AGENT"})


async def test_a_cancelled_request_runs_its_send_once(memory: Store[Any]) -> None:
    """A server that cancels the request's task (client gone, timeout) while the
    app's sync agent runs in a thread: the send still ends and is recorded; a
    retry meanwhile is in flight, never runs it again; the app's late answer
    goes nowhere."""
    agent = Agent()
    agent.release.clear()
    runs: list[int] = []
    to_the_cancelled: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        request = json.loads((await receive())["body"])
        runs.append(1)
        run = agent if len(runs) == 1 else agent.answer  # only the first run waits
        body = json.dumps(await asyncio.to_thread(run, request)).encode()  # as a sync endpoint
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})
        to_the_cancelled.append(await receive())

    middleware = A2AMiddleware(app, store=memory)

    async def post(body: dict[str, Any], sent: list[Any] | None = None) -> dict[str, Any]:
        sent = [] if sent is None else sent

        async def receive() -> Any:
            return {"type": "http.request", "body": json.dumps(body).encode()}

        async def send(message: Any) -> None:
            sent.append(message)

        caller = [(b"authorization", CALLER.encode())]
        await middleware(
            {"type": "http", "method": "POST", "path": "/", "headers": caller}, receive, send
        )
        return json.loads(sent[-1]["body"])  # type: ignore[no-any-return]

    m = mid()
    first_sent: list[Any] = []
    first = asyncio.create_task(post(v03(m), first_sent))
    try:
        assert await asyncio.to_thread(agent.entered.wait, 10), "the agent never started"
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        retry = await asyncio.wait_for(post(v10(m)), 5)
        assert len(runs) == 1, "the retry ran the agent again, alongside the first run"
        assert data_of(retry["error"])["code"] == "idempotency_in_flight"
    finally:
        agent.release.set()
    deadline = time.monotonic() + 10
    while "error" in (answer := await post(v03(m))):
        assert answer["error"]["data"]["code"] == "idempotency_in_flight"
        assert time.monotonic() < deadline, "the first answer was never recorded"
        await asyncio.sleep(0.01)
    assert answer["result"]["id"] == "task-1" and agent.runs == len(runs) == 1
    assert first_sent == [] and to_the_cancelled == [{"type": "http.disconnect"}]
    await middleware.core.aclose()


def test_lifespan_passes_through_and_closes_the_store(memory: Store[Any]) -> None:
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})

    closed: list[bool] = []
    middleware = A2AMiddleware(app, store=memory)
    middleware.core.engine.store.aclose = lambda: closed.append(True) or asyncio.sleep(0)  # type: ignore[method-assign]
    messages = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])

    async def receive() -> Any:
        return next(messages)

    async def send(message: Any) -> None:
        seen.append(message["type"])

    asyncio.run(middleware({"type": "lifespan"}, receive, send))
    assert seen == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert closed == [True]


def test_options_are_checked() -> None:
    with pytest.raises(TypeError):
        A2AMiddleware(lambda *a: None, store="memory://", scope="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        A2AIdempotency("memory://", ttl=-1)
