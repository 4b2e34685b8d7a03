"""A small a2a-sdk server for the agent-card tests: a card of the test's own
(signed or not, with or without an extended card) and the counting agent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _a2a_app import Agent, Counter
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentExtension,
    AgentInterface,
    AgentSkill,
)
from starlette.applications import Starlette


def card(*extensions: AgentExtension, **fields: Any) -> AgentCard:
    """An agent card with ``extensions`` and any other ``fields``."""
    return AgentCard(
        name="card agent",
        description="serves a card",
        version="1.0.0",
        supported_interfaces=[
            AgentInterface(url="http://127.0.0.1/", protocol_binding="JSONRPC", protocol_version=v)
            for v in ("1.0", "0.3")
        ],
        capabilities=AgentCapabilities(extensions=list(extensions), extended_agent_card=True),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[AgentSkill(id="echo", name="echo", description="echoes", tags=["test"])],
        **fields,
    )


def card_app(counters: Path, public: AgentCard, extended: AgentCard | None = None) -> Starlette:
    """The card at ``/.well-known/agent-card.json``, JSON-RPC (v1.0, v0.3) at ``/``."""
    handler = DefaultRequestHandler(
        agent_executor=Agent(Counter(counters)),
        task_store=InMemoryTaskStore(),
        agent_card=public,
        extended_agent_card=extended or public,
    )
    routes = create_jsonrpc_routes(handler, "/", enable_v0_3_compat=True)
    return Starlette(routes=[*create_agent_card_routes(public), *routes])
