"""A real A2A agent (a2a-sdk, both spellings on one endpoint) behind retrysafe.a2a.

The agent counts the executions it starts in a file per test id (the
``X-Test-Id`` header), so a test can tell how many tasks it started, even
across worker processes. The message's text steers it:

- ``fail-once``: the first execution raises an A2A error (a JSON-RPC error);
- ``crash-once``: the first request gets a bare HTTP 500 (before the agent runs);
- ``gate``: the execution waits until the file ``<counters>/<test id>.gate`` exists;
- ``message``: the agent answers with a Message instead of a Task;
- anything else: a completed Task with one artifact echoing the text.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import _http_apps
from a2a.helpers import get_message_text, new_task_from_user_message, new_text_message
from a2a.helpers import new_text_part as text_part
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import AgentCapabilities, AgentCard, AgentInterface, AgentSkill
from a2a.utils.errors import InternalError
from starlette.applications import Starlette

from retrysafe._http.asgi import replaying
from retrysafe.a2a import A2AMiddleware


class Counter(_http_apps.Counter):
    """Counts per test id in files, and a gate file per test id."""

    def gate(self, test_id: str) -> Path:
        return self._path(test_id).with_suffix(".gate")


class Agent(AgentExecutor):
    """Starts one task per execution and counts it."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        tid = context.call_context.state["headers"].get("x-test-id", "default")
        n = self.counter.hit(tid)
        text = get_message_text(context.message)
        if text == "fail-once" and n == 1:
            raise InternalError(message="the agent failed")
        if text == "gate":
            gate = self.counter.gate(tid)
            while not gate.exists():  # the test opens it when it is ready
                await asyncio.sleep(0.01)
        if text == "message":
            reply = new_text_message(f"reply {n}", context_id=context.context_id)
            await event_queue.enqueue_event(reply)
            return
        task = context.current_task or new_task_from_user_message(context.message)
        await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        await updater.add_artifact([text_part(f"echo {n}: {text}")], name="answer")
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        raise InternalError(message="not cancelable")


def agent_app(counter: Counter) -> Starlette:
    """The A2A server: the agent card and JSON-RPC at ``/`` (v1.0, and v0.3 compat)."""
    url = "http://127.0.0.1/"
    card = AgentCard(
        name="counting agent",
        description="starts one task per message and counts them",
        version="1.0.0",
        supported_interfaces=[
            AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="1.0"),
            AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="0.3"),
        ],
        capabilities=AgentCapabilities(streaming=True),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[AgentSkill(id="echo", name="echo", description="echoes", tags=["test"])],
    )
    handler = DefaultRequestHandler(
        agent_executor=Agent(counter), task_store=InMemoryTaskStore(), agent_card=card
    )
    jsonrpc = create_jsonrpc_routes(handler, "/", enable_v0_3_compat=True)
    return Starlette(routes=[*create_agent_card_routes(card), *jsonrpc])


def crashing(app: Any, counter: Counter) -> Any:
    """``app``, except that the first ``crash-once`` request of a test gets a bare 500."""

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await app(scope, receive, send)
            return
        message = await receive()  # the middleware hands the body over in one message
        headers = dict(scope["headers"])
        tid = headers.get(b"x-test-id", b"default").decode() + "-crash"
        if b"crash-once" in message.get("body", b"") and counter.hit(tid) == 1:
            await send(
                {
                    "type": "http.response.start",
                    "status": 500,
                    "headers": [(b"content-type", b"text/plain")],
                }
            )
            await send({"type": "http.response.body", "body": b"Internal Server Error"})
            return
        await app(scope, replaying(message.get("body", b""), receive), send)

    return asgi


def make_app(counters: str | Path, store: Any, **options: Any) -> A2AMiddleware:
    counter = Counter(counters)
    return A2AMiddleware(crashing(agent_app(counter), counter), store=store, **options)


def app_from_env() -> A2AMiddleware:
    """For ``uvicorn --factory``: counters, store URL and options from the environment."""
    from retrysafe import open_store

    store = open_store(os.environ["A2A_TEST_STORE"], **json.loads(os.environ["A2A_TEST_OPTIONS"]))
    return make_app(os.environ["A2A_TEST_COUNTERS"], store, wait=30.0)
