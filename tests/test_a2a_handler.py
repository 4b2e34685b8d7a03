"""retrysafe.a2a.IdempotentRequestHandler: every A2A send once, streaming or not, any binding.

The official a2a-sdk on both ends: its server (``DefaultRequestHandler`` wrapped
by retrysafe's handler, JSON-RPC with v0.3 compat and REST routes) on a real
uvicorn in a thread, its client (``create_client``, streaming by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _a2a_handler_app import Runs, card, handler_app
from _http_servers import ThreadServer, free_port
from a2a.client import ClientConfig, create_client
from a2a.client.client import Client
from a2a.server.context import ServerCallContext
from a2a.types import Message, Part, Role, SendMessageRequest, StreamResponse, Task, TaskState
from a2a.utils.errors import InternalError, InvalidParamsError, InvalidRequestError
from conftest import StoreSpec

import retrysafe.a2a as a2a_module
from retrysafe._model.record import Outcome
from retrysafe.a2a import IdempotentRequestHandler

COMPLETED = TaskState.TASK_STATE_COMPLETED
CALLER = "Bearer agent-caller"


class Agent:
    """The served agent: its URL and what it ran."""

    def __init__(self, url: str, runs: Runs, handler: IdempotentRequestHandler) -> None:
        self.url, self.runs, self.handler = url, runs, handler


@contextlib.contextmanager
def serve(store: Any, **options: Any) -> Iterator[Agent]:
    runs = Runs()
    app, handler = handler_app(runs, store, **options)
    with ThreadServer(app, "asgi") as server:
        try:
            yield Agent(server.url, runs, handler)
        finally:
            for gate in runs.gates.values():
                gate.set()  # never leave an execution waiting


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    db = tmp_path_factory.mktemp("a2a-handler") / "a2a.db"
    with serve(f"sqlite:///{db}") as served:
        yield served


@pytest.fixture
def tid() -> str:
    return uuid.uuid4().hex


async def connect(
    agent: Agent,
    tid: str,
    *,
    streaming: bool = True,
    binding: str = "JSONRPC",
    auth: str | None = CALLER,
    jsonrpc: str = "/",
    user: str | None = None,
    extra: dict[str, str] | None = None,
) -> Client:
    """An official client of ``agent`` for test ``tid`` (JSON-RPC at path ``jsonrpc``)."""
    headers = {"x-test-id": tid}
    if auth is not None:
        headers["authorization"] = auth
    if user is not None:
        headers["x-user"] = user
    headers.update(extra or {})
    config = ClientConfig(
        httpx_client=httpx.AsyncClient(headers=headers, timeout=60),
        streaming=streaming,
        supported_protocol_bindings=[binding],
    )
    return await create_client(card(agent.url, jsonrpc), config)


def request(mid: str, text: str = "hello") -> SendMessageRequest:
    return SendMessageRequest(
        message=Message(message_id=mid, role=Role.ROLE_USER, parts=[Part(text=text)])
    )


async def send(client: Client, mid: str, text: str = "hello") -> list[StreamResponse]:
    return [event async for event in client.send_message(request(mid, text))]


def task_id(events: list[StreamResponse]) -> str:
    """The id of the task the events are about."""
    first = events[0]
    return first.task.id if first.HasField("task") else first.status_update.task_id


def final_state(events: list[StreamResponse]) -> int:
    last = events[-1]
    return last.task.status.state if last.HasField("task") else last.status_update.status.state


def stored_task(events: list[StreamResponse]) -> Task:
    """A replayed stream: one event, the stored final Task."""
    assert len(events) == 1 and events[0].HasField("task"), events
    return events[0].task


def echo(task: Task) -> str:
    return task.artifacts[0].parts[0].text


# -- streaming sends -------------------------------------------------------------------


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
async def test_three_streaming_sends_run_once(agent: Agent, tid: str, binding: str) -> None:
    client = await connect(agent, tid, binding=binding)
    mid = str(uuid.uuid4())
    first = await send(client, mid)
    again = [await send(client, mid), await send(client, mid)]
    assert agent.runs.counts[tid] == 1
    assert final_state(first) == COMPLETED
    for events in again:
        task = stored_task(events)
        assert task.id == task_id(first)
        assert task.status.state == COMPLETED
        assert echo(task) == "echo 1: hello"


async def test_a_resend_while_running_joins_the_running_task(agent: Agent, tid: str) -> None:
    mid = str(uuid.uuid4())
    one, two = await connect(agent, tid), await connect(agent, tid)
    stream1 = aiter(one.send_message(request(mid, "gate")))
    head1 = await anext(stream1)
    stream2 = aiter(two.send_message(request(mid, "gate")))
    head2 = await anext(stream2)
    # The resend's stream is the running task's (A2A §3.1.6: the current Task first).
    assert head2.HasField("task") and head2.task.id == head1.task.id
    assert head2.task.status.state not in (COMPLETED, TaskState.TASK_STATE_FAILED)
    agent.runs.gate(tid).set()
    rest1 = [head1, *[e async for e in stream1]]
    rest2 = [head2, *[e async for e in stream2]]
    assert final_state(rest1) == final_state(rest2) == COMPLETED
    assert agent.runs.counts[tid] == 1
    # And once it ended, a third send gets the stored Task.
    task = stored_task(await send(one, mid, "gate"))
    assert task.id == head1.task.id and echo(task) == "echo 1: gate"


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
async def test_the_same_message_id_with_another_message_is_refused(
    agent: Agent, tid: str, binding: str
) -> None:
    client = await connect(agent, tid, binding=binding)
    mid = str(uuid.uuid4())
    await send(client, mid)
    with pytest.raises(InvalidParamsError) as caught:
        await send(client, mid, "something else")
    assert caught.value.data is not None
    assert caught.value.data["code"] == "idempotency_conflict"
    assert caught.value.data["retryable"] == "false"
    plain = await connect(agent, tid, streaming=False, binding=binding)
    with pytest.raises(InvalidParamsError):
        await send(plain, mid, "something else")
    assert agent.runs.counts[tid] == 1


async def test_a_client_that_leaves_mid_stream_leaves_no_second_run(agent: Agent, tid: str) -> None:
    mid = str(uuid.uuid4())
    leaving = await connect(agent, tid)
    stream = aiter(leaving.send_message(request(mid, "gate")))
    head = await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    await leaving.close()
    agent.runs.gate(tid).set()
    # The run went on without its client: the retry joins it or gets its stored Task.
    again = await send(await connect(agent, tid), mid, "gate")
    assert task_id(again) == head.task.id and final_state(again) == COMPLETED
    assert agent.runs.counts[tid] == 1


async def test_a_stream_whose_client_left_holds_no_events(agent: Agent, tid: str) -> None:
    mid = str(uuid.uuid4())
    leaving = await connect(agent, tid)
    stream = aiter(leaving.send_message(request(mid, "many")))
    head = await anext(stream)
    (run,) = [run for (_, key), run in agent.handler._runs.items() if key == mid]
    await stream.aclose()  # type: ignore[attr-defined]
    await leaving.close()
    agent.runs.gate(tid).set()
    # Its MANY updates are not kept for the client that left (nor any past a bound).
    again = await send(await connect(agent, tid), mid, "many")
    assert task_id(again) == head.task.id and final_state(again) == COMPLETED
    assert run.events.qsize() <= 1
    assert agent.runs.counts[tid] == 1


async def test_a_plain_resend_while_the_stream_runs_waits_for_its_task(
    agent: Agent, tid: str
) -> None:
    mid = str(uuid.uuid4())
    stream = aiter((await connect(agent, tid)).send_message(request(mid, "gate")))
    head = await anext(stream)
    (run,) = [run for (_, key), run in agent.handler._runs.items() if key == mid]
    plain = asyncio.ensure_future(send(await connect(agent, tid, streaming=False), mid, "gate"))
    while run.joiners == 0:  # the plain send has joined the run before it may end
        assert not plain.done(), plain
        await asyncio.sleep(0.01)
    agent.runs.gate(tid).set()
    assert final_state([head, *[e async for e in stream]]) == COMPLETED
    task = stored_task(await plain)
    assert task.id == head.task.id and task.status.state == COMPLETED
    assert agent.runs.counts[tid] == 1


async def test_a_plain_resend_waits_for_the_run_no_longer_than_its_lease(
    tmp_path: Path, tid: str
) -> None:
    with serve(f"sqlite:///{tmp_path}/lease.db", lease=1) as agent:
        mid = str(uuid.uuid4())
        stream = aiter((await connect(agent, tid)).send_message(request(mid, "gate")))
        await anext(stream)
        with pytest.raises(InternalError) as caught:
            await send(await connect(agent, tid, streaming=False), mid, "gate")
        assert caught.value.data is not None
        assert caught.value.data["code"] == "idempotency_in_flight"
        agent.runs.gate(tid).set()
        assert final_state([e async for e in stream]) == COMPLETED
        assert agent.runs.counts[tid] == 1


async def test_a_failed_send_runs_again(agent: Agent, tid: str) -> None:
    mid = str(uuid.uuid4())
    client = await connect(agent, tid)
    with pytest.raises(InternalError, match="the agent failed"):
        await send(client, mid, "fail-once")
    second = await send(client, mid, "fail-once")
    assert final_state(second) == COMPLETED
    assert stored_task(await send(client, mid, "fail-once")).id == task_id(second)
    assert agent.runs.counts[tid] == 2


async def test_a_stream_that_ended_is_not_run_again_when_reading_its_task_fails(
    agent: Agent, tid: str
) -> None:
    # Every event reached the client; reading the final Task then fails: the
    # send ran, so what the stream carried is stored and a retry replays it.
    mid = str(uuid.uuid4())
    failing = await connect(agent, tid, extra={"x-get-fails": "1"})
    first = await send(failing, mid)
    assert final_state(first) == COMPLETED
    again = await send(await connect(agent, tid), mid)
    assert stored_task(again).id == task_id(first)
    assert agent.runs.counts[tid] == 1


async def test_callers_without_credentials(tmp_path: Path, agent: Agent, tid: str) -> None:
    # By default they run without a record (as on every door: anonymous="run").
    mid = str(uuid.uuid4())
    anonymous = await connect(agent, tid, auth=None)
    await send(anonymous, mid)
    await send(anonymous, mid)
    assert agent.runs.counts[tid] == 2
    with serve(f"sqlite:///{tmp_path}/refuse.db", anonymous="refuse") as strict:
        with pytest.raises(InvalidRequestError) as caught:
            await send(await connect(strict, tid, auth=None), mid)
        assert caught.value.data is not None
        assert caught.value.data["code"] == "idempotency_principal_required"
        assert strict.runs.counts[tid] == 0


async def test_an_authenticated_user_is_the_caller(tmp_path: Path, tid: str) -> None:
    with serve(f"sqlite:///{tmp_path}/users.db", users=True) as agent:
        mid = str(uuid.uuid4())
        # A refreshed token is the same user: the retry gets the stored Task.
        first = await send(await connect(agent, tid, user="ada", auth="Bearer t1"), mid)
        again = await send(await connect(agent, tid, user="ada", auth="Bearer t2"), mid)
        assert stored_task(again).id == task_id(first)
        other = await send(await connect(agent, tid, user="bob", auth="Bearer t1"), mid)
        assert task_id(other) != task_id(first)
        assert agent.runs.counts[tid] == 2


@pytest.mark.parametrize("builder", [True, False])
async def test_users_who_share_a_display_name_never_share_an_answer(
    tmp_path: Path, tid: str, builder: bool
) -> None:
    # Both users are displayed as "Alex Kim"; their identities differ. With the
    # context builder, the identity names the caller (a refreshed token is the
    # same user); without it, the SDK gives only the display name, which is not
    # used: the credentials decide.
    with serve(f"sqlite:///{tmp_path}/names.db", users=True, builder=builder) as agent:
        mid = str(uuid.uuid4())
        first = await send(await connect(agent, tid, user="u-1", auth="Bearer t1"), mid)
        other = await send(await connect(agent, tid, user="u-2", auth="Bearer t2"), mid)
        assert task_id(other) != task_id(first)
        if builder:
            again = await send(await connect(agent, tid, user="u-1", auth="Bearer t3"), mid)
            assert stored_task(again).id == task_id(first)
        assert agent.runs.counts[tid] == 2


async def test_two_values_of_one_credential_header_are_refused(agent: Agent, tid: str) -> None:
    # The context builder passes every header line: the ambiguity is seen over HTTP.
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "SendMessage",
        "params": {
            "message": {
                "messageId": str(uuid.uuid4()),
                "role": "ROLE_USER",
                "parts": [{"text": "x"}],
            }
        },
    }
    headers = [
        ("authorization", "Bearer one"),
        ("authorization", "Bearer two"),
        ("a2a-version", "1.0"),
        ("x-test-id", tid),
    ]
    async with httpx.AsyncClient() as http:
        answer = (await http.post(agent.url + "/", json=body, headers=headers)).json()
    assert answer["error"]["code"] == -32600
    [info] = [d for d in answer["error"]["data"] if d["@type"].endswith("ErrorInfo")]
    assert info["metadata"]["code"] == "idempotency_credentials_ambiguous"
    assert agent.runs.counts[tid] == 0


async def test_a_v03_send_refused_by_the_handler_has_its_metadata_as_data(
    agent: Agent, tid: str
) -> None:
    # The SDK's v0.3 adapter sends the error's data as it is: the ErrorInfo metadata
    # (strings), not the middleware's v0.3 keys.
    mid = str(uuid.uuid4())

    def body(text: str) -> dict[str, Any]:
        message = {"messageId": mid, "role": "user", "parts": [{"kind": "text", "text": text}]}
        return {"jsonrpc": "2.0", "id": 1, "method": "message/send", "params": {"message": message}}

    headers = {"authorization": CALLER, "a2a-version": "0.3", "x-test-id": tid}
    async with httpx.AsyncClient(headers=headers, timeout=60) as http:
        assert "result" in (await http.post(agent.url + "/", json=body("one"))).json()
        answer = (await http.post(agent.url + "/", json=body("two"))).json()
    assert answer["error"]["code"] == -32602
    data = answer["error"]["data"]
    assert data["code"] == "idempotency_conflict" and data["retryable"] == "false"


async def test_principal_names_the_caller_from_the_call_context(tmp_path: Path, tid: str) -> None:
    def tenant(context: Any) -> str | None:
        return context.state["headers"].get("x-tenant")

    with serve(f"sqlite:///{tmp_path}/tenants.db", principal=tenant) as agent:
        mid = str(uuid.uuid4())
        acme = {"x-tenant": "acme"}
        first = await send(await connect(agent, tid, auth="Bearer t1", extra=acme), mid)
        again = await send(await connect(agent, tid, auth="Bearer t2", extra=acme), mid)
        assert stored_task(again).id == task_id(first)
        other = {"x-tenant": "other"}
        assert task_id(await send(await connect(agent, tid, extra=other), mid)) != task_id(first)
        assert agent.runs.counts[tid] == 2


async def test_a_store_down_refuses_the_send_and_runs_nothing(tid: str) -> None:
    with serve(f"redis://127.0.0.1:{free_port()}/0") as agent:
        with pytest.raises(InternalError) as caught:
            await send(await connect(agent, tid), str(uuid.uuid4()))
        data = caught.value.data
        assert data is not None and data["code"] == "idempotency_store_unavailable"
        assert data["retryable"] == "true" and int(data["retryAfter"]) >= 1
        assert agent.runs.counts[tid] == 0


def test_an_unknown_option_is_refused() -> None:
    with pytest.raises(TypeError, match="tll"):
        IdempotentRequestHandler(None, "memory://", tll=3)  # type: ignore[arg-type,call-arg]


async def test_a_changed_message_is_refused_while_the_first_runs(agent: Agent, tid: str) -> None:
    mid = str(uuid.uuid4())
    client = await connect(agent, tid)
    stream = aiter(client.send_message(request(mid, "gate")))
    await anext(stream)
    with pytest.raises(InvalidParamsError):
        await send(await connect(agent, tid), mid, "other")
    # The refused message left the running send joinable: its resend joins it.
    resend = aiter((await connect(agent, tid)).send_message(request(mid, "gate")))
    head = await anext(resend)
    assert head.HasField("task") and head.task.status.state != COMPLETED
    agent.runs.gate(tid).set()
    assert final_state([e async for e in stream]) == COMPLETED
    assert final_state([head, *[e async for e in resend]]) == COMPLETED
    assert agent.runs.counts[tid] == 1


async def test_a_plain_resend_of_a_streamed_message_gets_the_stored_task(
    agent: Agent, tid: str
) -> None:
    mid = str(uuid.uuid4())
    first = await send(await connect(agent, tid), mid)
    plain = await send(await connect(agent, tid, streaming=False), mid)
    task = stored_task(plain)
    assert task.id == task_id(first) and task.status.state == COMPLETED
    rest = await send(await connect(agent, tid, streaming=False, binding="HTTP+JSON"), mid)
    assert stored_task(rest).id == task.id
    # v0.3 (the compat adapter), in its own spelling.
    body = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "message/send",
        "params": {
            "message": {
                "kind": "message",
                "messageId": mid,
                "role": "user",
                "parts": [{"kind": "text", "text": "hello"}],
            }
        },
    }
    headers = {"authorization": CALLER, "x-test-id": tid}
    async with httpx.AsyncClient(timeout=60) as http:
        answer = (await http.post(agent.url + "/", json=body, headers=headers)).json()
    assert answer["result"]["kind"] == "task" and answer["result"]["id"] == task.id
    assert answer["result"]["status"]["state"] == "completed"
    assert agent.runs.counts[tid] == 1


async def test_plain_sends_run_once_and_a_stream_replays_them(agent: Agent, tid: str) -> None:
    mid = str(uuid.uuid4())
    plain = await connect(agent, tid, streaming=False)
    first, second = await send(plain, mid), await send(plain, mid)
    assert stored_task(second).id == stored_task(first).id
    assert stored_task(await send(await connect(agent, tid), mid)).id == stored_task(first).id
    assert agent.runs.counts[tid] == 1


async def test_a_message_answer_is_replayed_as_the_message(agent: Agent, tid: str) -> None:
    mid = str(uuid.uuid4())
    client = await connect(agent, tid)
    first, second = await send(client, mid, "message"), await send(client, mid, "message")
    assert len(second) == 1 and second[0].HasField("message")
    assert second[0].message.parts[0].text == first[-1].message.parts[0].text == "reply 1"
    assert agent.runs.counts[tid] == 1


async def test_two_principals_do_not_share_a_message_id(agent: Agent, tid: str) -> None:
    mid = str(uuid.uuid4())
    alice = await send(await connect(agent, tid, auth="Bearer alice"), mid)
    bob = await send(await connect(agent, tid, auth="Bearer bob"), mid)
    assert task_id(alice) != task_id(bob)
    assert agent.runs.counts[tid] == 2


async def test_any_message_id_the_spec_allows_and_not_more(agent: Agent, tid: str) -> None:
    client = await connect(agent, tid)
    for mid in ("msg-é-42", "m" * 300, "🙂"):
        first = await send(client, mid)
        assert stored_task(await send(client, mid)).id == task_id(first)
    assert agent.runs.counts[tid] == 3
    with pytest.raises(InvalidParamsError) as caught:
        await send(client, "m" * 1025)
    assert caught.value.data is not None
    assert caught.value.data["code"] == "idempotency_key_invalid"
    assert agent.runs.counts[tid] == 3


async def test_the_middleware_and_the_handler_share_their_records(tmp_path: Path) -> None:
    with serve(f"sqlite:///{tmp_path}/shared.db", middleware=True) as agent:
        tid, mid = uuid.uuid4().hex, str(uuid.uuid4())
        # A plain send through A2AMiddleware, then the handler's stream and REST send:
        via_middleware = await connect(agent, tid, streaming=False, jsonrpc="/mw")
        first = stored_task(await send(via_middleware, mid))
        assert stored_task(await send(await connect(agent, tid), mid)).id == first.id
        rest = await connect(agent, tid, streaming=False, binding="HTTP+JSON")
        assert stored_task(await send(rest, mid)).id == first.id
        # and the other way round.
        other = str(uuid.uuid4())
        second = await send(await connect(agent, tid), other)
        assert stored_task(await send(via_middleware, other)).id == task_id(second)
        assert agent.runs.counts[tid] == 2


# -- races -------------------------------------------------------------------------------


@pytest.mark.parametrize("store_spec", ["sqlite", "redis"], indirect=True)
async def test_many_concurrent_sends_run_once(store_spec: StoreSpec) -> None:
    with serve(store_spec.open()) as agent:
        tid, mid = uuid.uuid4().hex, str(uuid.uuid4())
        clients = [
            await connect(
                agent, tid, streaming=n % 2 == 0, binding=("JSONRPC", "HTTP+JSON")[n % 3 == 0]
            )
            for n in range(12)
        ]
        answers = await asyncio.gather(*(send(c, mid) for c in clients))
        assert agent.runs.counts[tid] == 1
        assert len({task_id(events) for events in answers}) == 1
        assert all(final_state(events) == COMPLETED for events in answers)


async def test_a_resend_while_another_process_runs_it_gets_the_in_flight_error(
    tmp_path: Path, tid: str
) -> None:
    # Two servers over one store stand for two processes: the second cannot join the
    # first's run, so its resend is told to retry.
    store = f"sqlite:///{tmp_path}/shared.db"
    with serve(store) as first, serve(store) as second:
        mid = str(uuid.uuid4())
        stream = aiter((await connect(first, tid)).send_message(request(mid, "gate")))
        await anext(stream)
        with pytest.raises(InternalError) as caught:
            await send(await connect(second, tid), mid, "gate")
        data = caught.value.data
        assert data is not None and data["code"] == "idempotency_in_flight"
        assert data["retryable"] == "true" and int(data["retryAfter"]) >= 1
        first.runs.gate(tid).set()
        assert final_state([e async for e in stream]) == COMPLETED
        assert stored_task(await send(await connect(second, tid), mid, "gate"))
        assert first.runs.counts[tid] == 1 and second.runs.counts[tid] == 0


def call(tid: str) -> ServerCallContext:
    """A call context as the SDK's HTTP routes build it, for a handler called directly."""
    return ServerCallContext(state={"headers": {"authorization": CALLER, "x-test-id": tid}})


async def stream_of(handler: IdempotentRequestHandler, tid: str, mid: str) -> list[Any]:
    return [e async for e in handler.on_message_send_stream(request(mid, "gate"), call(tid))]


async def test_aclose_lets_the_running_sends_end_and_be_recorded(tmp_path: Path, tid: str) -> None:
    store, runs, mid = f"sqlite:///{tmp_path}/close.db", Runs(), str(uuid.uuid4())
    _, handler = handler_app(runs, store)
    stream = aiter(handler.on_message_send_stream(request(mid, "gate"), call(tid)))
    head = await anext(stream)
    closing = asyncio.ensure_future(handler.aclose())
    await asyncio.sleep(0)  # aclose has begun: the run it waits for may now end
    runs.gate(tid).set()
    await closing
    assert [e async for e in stream]
    _, again = handler_app(runs, store)
    try:
        [replay] = await stream_of(again, tid, mid)
    finally:
        await again.aclose()
    assert isinstance(replay, Task) and replay.id == head.id
    assert replay.status.state == COMPLETED and runs.counts[tid] == 1


async def test_aclose_cancels_a_send_that_outlasts_it(tmp_path: Path, tid: str) -> None:
    # Cancelled, it is recorded as failed: a retry runs it again.
    store, runs, mid = f"sqlite:///{tmp_path}/cancel.db", Runs(), str(uuid.uuid4())
    _, handler = handler_app(runs, store)
    stream = aiter(handler.on_message_send_stream(request(mid, "gate"), call(tid)))
    await anext(stream)
    try:
        await handler.aclose(timeout=0)
        with pytest.raises(InternalError, match="interrupted"):
            async for _ in stream:
                pass
    finally:
        runs.gate(tid).set()  # the cancelled execution's thread may go
    _, again = handler_app(runs, store)
    try:
        events = await stream_of(again, tid, mid)
    finally:
        await again.aclose()
    assert events[-1].status.state == COMPLETED and runs.counts[tid] == 2


def test_the_handler_is_imported_on_first_use() -> None:
    assert "IdempotentRequestHandler" in a2a_module.__all__
    assert a2a_module.IdempotentRequestHandler is IdempotentRequestHandler
    assert "IdempotentContextBuilder" in a2a_module.__all__
    assert a2a_module.IdempotentContextBuilder.__name__ == "IdempotentContextBuilder"


@pytest.mark.parametrize("version", ["1.0", "0.3"])
def test_a_stored_json_rpc_error_is_replayed_as_its_sdk_class(version: str) -> None:
    """A send that the middleware recorded as failed finally (``final_failures``)
    replays through the handler as the SDK error of its code, with its metadata."""
    from a2a.utils.errors import TaskNotFoundError

    from retrysafe._protocols.a2a_handler import replayed_result

    meta = {"code": "task_gone", "retryable": "false"}
    if version == "1.0":
        info = {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "TASK_NOT_FOUND"}
        data: Any = [{**info, "domain": "a2a-protocol.org", "metadata": meta}]
    else:
        data = meta
    error = {"code": -32001, "message": "no such task", "data": data}
    with pytest.raises(TaskNotFoundError) as raised:
        replayed_result(Outcome.json({"method": "SendMessage", "error": error}))
    assert (raised.value.message, raised.value.data) == ("no such task", meta)
