"""A real a2a-sdk server whose request handler is retrysafe's IdempotentRequestHandler.

JSON-RPC (v1.0, and v0.3 compat) at ``/`` and HTTP+JSON (REST) under ``/rest``,
served in a thread of the test process, so the agent's counts and gates are
plain objects the tests read and open. Per test id (the ``X-Test-Id`` header):

- ``gate``: the agent emits its Task (working), then waits until the test
  opens the gate, then adds an artifact and completes;
- ``many``: as ``gate``, then :data:`MANY` status updates before it completes;
- ``message``: the agent answers with a Message;
- ``fail-once``: the first execution raises an A2A error;
- a request with ``X-Get-Fails``: reading a task (``GetTask``) fails;
- anything else: a completed Task with one artifact echoing the text.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Any

from a2a.helpers import get_message_text, new_task_from_user_message, new_text_message
from a2a.helpers import new_text_part as text_part
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes, create_rest_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import AgentCapabilities, AgentCard, AgentInterface, AgentSkill, TaskState
from a2a.utils.errors import InternalError
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, BaseUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection

from retrysafe.a2a import A2AMiddleware, IdempotentContextBuilder, IdempotentRequestHandler

#: How many updates a ``many`` execution sends after its gate opens.
MANY = 300


class Runs:
    """What the agent did, per test id: executions counted, gates to open."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.gates: dict[str, threading.Event] = {}

    def hit(self, tid: str) -> int:
        with self.lock:
            self.counts[tid] += 1
            return self.counts[tid]

    def gate(self, tid: str) -> threading.Event:
        with self.lock:
            return self.gates.setdefault(tid, threading.Event())


class GatedAgent(AgentExecutor):
    """Starts one task per execution and counts it."""

    def __init__(self, runs: Runs) -> None:
        self.runs = runs

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        tid = context.call_context.state["headers"].get("x-test-id", "default")
        n = self.runs.hit(tid)
        text = get_message_text(context.message)
        if text == "fail-once" and n == 1:
            raise InternalError(message="the agent failed")
        if text == "message":
            await event_queue.enqueue_event(
                new_text_message(f"reply {n}", context_id=context.context_id)
            )
            return
        task = context.current_task or new_task_from_user_message(context.message)
        await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        if text in ("gate", "many"):
            await updater.update_status(TaskState.TASK_STATE_WORKING)
            await asyncio.to_thread(self.runs.gate(tid).wait)  # the test opens it
        if text == "many":
            for i in range(MANY):
                await updater.update_status(
                    TaskState.TASK_STATE_WORKING, new_text_message(f"step {i}")
                )
        await updater.add_artifact([text_part(f"echo {n}: {text}")], name="answer")
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        raise InternalError(message="not cancelable")


class Handler(DefaultRequestHandler):
    """The SDK's handler, whose GetTask fails for a request with ``X-Get-Fails``."""

    async def on_get_task(self, params: Any, context: Any) -> Any:
        if "x-get-fails" in context.state["headers"]:
            raise InternalError(message="the task store failed")
        return await super().on_get_task(params, context)


def card(url: str, jsonrpc: str = "/") -> AgentCard:
    """The agent's card, its interfaces at ``url`` (JSON-RPC at ``jsonrpc``, REST at ``/rest``)."""
    base = url.rstrip("/")
    return AgentCard(
        name="counting agent",
        description="starts one task per message and counts them",
        version="1.0.0",
        supported_interfaces=[
            AgentInterface(url=base + jsonrpc, protocol_binding="JSONRPC", protocol_version="1.0"),
            AgentInterface(
                url=base + "/rest", protocol_binding="HTTP+JSON", protocol_version="1.0"
            ),
        ],
        capabilities=AgentCapabilities(streaming=True),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[AgentSkill(id="echo", name="echo", description="echoes", tags=["test"])],
    )


class Colleague(BaseUser):
    """A user whose identity is its own and whose display name others share."""

    def __init__(self, identity: str) -> None:
        self._identity = identity

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def display_name(self) -> str:
        return "Alex Kim"

    @property
    def identity(self) -> str:
        return self._identity


class HeaderUsers(AuthenticationBackend):
    """Authenticates the user whose identity is ``X-User`` (none without it); every
    user's display name is the same."""

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, Colleague] | None:
        name = conn.headers.get("x-user")
        return None if name is None else (AuthCredentials(["authenticated"]), Colleague(name))


def handler_app(
    runs: Runs,
    store: Any,
    *,
    middleware: bool = False,
    users: bool = False,
    builder: bool = True,
    **options: Any,
) -> tuple[Any, IdempotentRequestHandler]:
    """The server, and the retrysafe handler it calls.

    ``middleware``: JSON-RPC at ``/mw`` too, served by the bare SDK handler behind
    :class:`~retrysafe.a2a.A2AMiddleware` on the same store. ``users``: Starlette's
    authentication, the user named by ``X-User``. ``builder``: the routes build
    call contexts with :class:`~retrysafe.a2a.IdempotentContextBuilder` (else the
    SDK's default builder).
    """
    agent_card = card("http://127.0.0.1/")
    inner = Handler(
        agent_executor=GatedAgent(runs), task_store=InMemoryTaskStore(), agent_card=agent_card
    )
    handler = IdempotentRequestHandler(inner, store=store, **options)
    context = IdempotentContextBuilder() if builder else None
    routes = [
        *create_agent_card_routes(agent_card),
        *create_jsonrpc_routes(handler, "/", enable_v0_3_compat=True, context_builder=context),
        *create_rest_routes(handler, path_prefix="/rest", context_builder=context),
    ]
    if users:
        auth = [Middleware(AuthenticationMiddleware, backend=HeaderUsers())]
        return Starlette(routes=routes, middleware=auth), handler
    if not middleware:
        return Starlette(routes=routes), handler
    routes += create_jsonrpc_routes(inner, "/mw", enable_v0_3_compat=True)
    return A2AMiddleware(Starlette(routes=routes), store, path="/mw"), handler
