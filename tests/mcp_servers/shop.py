"""A small MCP shop behind the retrysafe MCP door, for the tests.

``python shop.py [--lowlevel | --fastmcp] [--http PORT] [--oauth]``: an
``MCPServer`` (or a low-level ``Server``, or a FastMCP server) over stdio, or
over Streamable HTTP on uvicorn. Its store
is ``$RETRYSAFE_TEST_STORE``; its tools count their runs in
``$RETRYSAFE_TEST_COUNTERS`` (one file per ``test_id``, shared across processes):

- ``charge(test_id, amount)``: a side effect;
- ``slow(test_id)``: waits until the test creates the gate file ``<test_id>.gate``;
- ``lookup(test_id)``: annotated read-only;
- ``refund(test_id)``: opted out (``skip``);
- ``confirm(test_id)`` (low-level only): asks first (an MRTR ``InputRequiredResult``),
  runs on the leg that echoes its ``requestState``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from mcp.server import MCPServer
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.lowlevel import Server
from mcp_types import (
    CallToolResult,
    InputRequiredResult,
    ListToolsResult,
    TextContent,
    Tool,
    ToolAnnotations,
)

from retrysafe.mcp import McpIdempotency

ROOT = Path(os.environ.get("RETRYSAFE_TEST_COUNTERS", "."))
#: Bearer tokens and their subjects (``token-alice-2``: alice's refreshed token).
TOKENS = {"token-alice": "alice", "token-bob": "bob", "token-alice-2": "alice"}


def hit(test_id: str) -> int:
    safe = "".join(c for c in test_id if c.isalnum() or c in "-_") or "default"
    fd = os.open(ROOT / safe, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, b"x")
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


async def gate(test_id: str) -> None:
    path = ROOT / f"{test_id}.gate"
    for _ in range(6000):  # the test opens it; at most a minute if it fails
        if path.exists():
            return
        await asyncio.sleep(0.01)


async def run(name: str, args: dict[str, Any]) -> str:
    test_id = str(args.get("test_id", "default"))
    n = hit(test_id)
    if name == "slow":
        await gate(test_id)
    amount = args.get("amount")
    return f"{name} run {n}" if amount is None else f"{name} {amount} run {n}"


class Verifier:
    """Two bearer tokens, two users of one client."""

    async def verify_token(self, token: str) -> AccessToken | None:
        user = TOKENS.get(token)
        if user is None:
            return None
        return AccessToken(
            token=token,
            client_id="agent",
            scopes=["shop"],
            subject=user,
            claims={"iss": "https://auth.example"},
        )


def mcpserver(oauth: bool, port: int) -> MCPServer:
    auth: dict[str, Any] = {}
    if oauth:
        auth = {
            "token_verifier": Verifier(),
            "auth": AuthSettings(
                issuer_url="https://auth.example",
                resource_server_url=f"http://127.0.0.1:{port}/mcp",
            ),
        }
    server = MCPServer("shop", **auth)

    @server.tool()
    async def charge(test_id: str, amount: int) -> str:
        return await run("charge", {"test_id": test_id, "amount": amount})

    @server.tool()
    async def slow(test_id: str) -> str:
        return await run("slow", {"test_id": test_id})

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    async def lookup(test_id: str) -> str:
        return await run("lookup", {"test_id": test_id})

    @server.tool()
    async def refund(test_id: str) -> str:
        return await run("refund", {"test_id": test_id})

    return server


def lowlevel() -> Server[Any]:
    schema = {"type": "object", "properties": {"test_id": {"type": "string"}}}
    tools = [Tool(name=n, input_schema=schema) for n in ("charge", "slow", "refund")] + [
        Tool(name="lookup", input_schema=schema, annotations=ToolAnnotations(read_only_hint=True))
    ]

    async def list_tools(ctx: Any, params: Any) -> ListToolsResult:
        return ListToolsResult(tools=tools)

    async def call_tool(ctx: Any, params: Any) -> CallToolResult | InputRequiredResult:
        if params.name == "confirm" and params.request_state is None:
            return InputRequiredResult(request_state="asked")  # MRTR: ask, then run
        text = await run(params.name, params.arguments or {})
        return CallToolResult(content=[TextContent(type="text", text=text)])

    return Server("shop", on_list_tools=list_tools, on_call_tool=call_tool)


def fastmcp(oauth: bool) -> Any:
    from fastmcp import FastMCP
    from fastmcp.server.auth.providers.jwt import StaticTokenVerifier

    tokens = {
        t: {"client_id": "agent", "sub": user, "iss": "https://auth.example", "scopes": ["shop"]}
        for t, user in TOKENS.items()
    }
    server = FastMCP("shop", auth=StaticTokenVerifier(tokens) if oauth else None)

    @server.tool
    async def charge(test_id: str, amount: int) -> str:
        return await run("charge", {"test_id": test_id, "amount": amount})

    @server.tool
    async def slow(test_id: str) -> str:
        return await run("slow", {"test_id": test_id})

    @server.tool(annotations={"readOnlyHint": True})
    async def lookup(test_id: str) -> str:
        return await run("lookup", {"test_id": test_id})

    @server.tool
    async def refund(test_id: str) -> str:
        return await run("refund", {"test_id": test_id})

    return server


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lowlevel", action="store_true")
    parser.add_argument("--fastmcp", action="store_true")
    parser.add_argument("--http", type=int, default=0)
    parser.add_argument("--oauth", action="store_true")
    opts = parser.parse_args(argv)
    if opts.fastmcp:
        server: Any = fastmcp(opts.oauth)
    else:
        server = lowlevel() if opts.lowlevel else mcpserver(opts.oauth, opts.http)
    door = McpIdempotency(
        os.environ["RETRYSAFE_TEST_STORE"],
        skip={"refund"},
        key_argument="idempotency_key",
        anonymous="share",
    )
    door.install(server)
    if opts.fastmcp:
        if opts.http:
            server.run("http", host="127.0.0.1", port=opts.http, path="/mcp", show_banner=False)
        else:
            server.run("stdio", show_banner=False)
        return
    if not opts.http:
        if opts.lowlevel:
            import anyio
            from mcp.server.stdio import stdio_server

            async def serve() -> None:
                async with stdio_server() as (read, write):
                    await server.run(read, write, server.create_initialization_options())

            anyio.run(serve)
        else:
            server.run("stdio")
        return
    import uvicorn

    app = server.streamable_http_app(json_response=False)
    uvicorn.run(app, host="127.0.0.1", port=opts.http, log_level="error")


if __name__ == "__main__":
    main(sys.argv[1:])
