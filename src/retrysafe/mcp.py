"""The MCP door: tool calls over the Model Context Protocol, run once per key.

::

    async with IdempotentTools(connect=lambda: Client("http://127.0.0.1:8000/mcp")) as tools:
        result = await tools.call_tool("charge", {"amount": 5})
        was_replayed(result)  # True if the server answered from its store

:class:`IdempotentTools` wraps the official ``mcp`` SDK client: each
side-effecting ``tools/call`` carries a key in
``_meta["dev.retrysafe/idempotencyKey"]`` and is retried with it after a
timeout, a dropped connection or an in-flight answer; a conflict is raised.
"""

from __future__ import annotations

from retrysafe._client.mcp import IdempotentTools, ToolSession, was_replayed

__all__ = ["IdempotentTools", "ToolSession", "was_replayed"]
