"""A tiny shop MCP server (the official ``mcp`` SDK) for examples/mcp_agent.py.

``charge`` has a side effect: it appends a line to the ledger file. ``charges``
is read-only (``readOnlyHint``): it counts the ledger's lines. A ``tools/call``
with a key in ``_meta["dev.retrysafe/idempotencyKey"]`` runs once per key; its
repeats get the stored answer.

``--drop-once FILE`` simulates a lost answer: after a ``tools/call`` has run and
its answer is stored, if FILE exists the server deletes it and exits without
answering, as if the connection had dropped.

    python examples/mcp_shop_server.py --store sqlite:///shop.db --ledger ledger.txt
    python examples/mcp_shop_server.py ... --http 127.0.0.1:8000   # Streamable HTTP at /mcp
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import anyio
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.extension import Extension
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolRequestParams, CallToolResult, ToolAnnotations

try:  # the in-process door
    from retrysafe.mcp import IdempotencyExtension  # type: ignore[attr-defined]
except ImportError:  # a stand-in built on the MCP door's core, until the door is merged
    from retrysafe._protocols.mcp import (
        EXTENSION_ID,
        call_engine,
        extension_settings,
        parse_call,
        run_call,
    )

    class IdempotencyExtension(Extension):  # type: ignore[no-redef]
        identifier = EXTENSION_ID

        def __init__(self, store: str) -> None:
            self.engine, self.plan = call_engine(store, ttl=3600, lease=30)

        def settings(self) -> dict[str, Any]:
            return extension_settings(3600)

        async def intercept_tool_call(
            self,
            params: CallToolRequestParams,
            ctx: ServerRequestContext[Any, Any],
            call_next: CallNext,
        ) -> HandlerResult:
            wire = params.model_dump(by_alias=True, exclude_none=True, mode="json")
            call = parse_call(wire, request_id=ctx.request_id)
            if call is None:
                return await call_next(ctx)

            async def run() -> dict[str, Any]:
                result = await call_next(ctx)
                if isinstance(result, CallToolResult):
                    return {
                        "result": result.model_dump(by_alias=True, exclude_none=True, mode="json")
                    }
                return {"result": result}

            # A client's timeout sends notifications/cancelled: the call runs to its
            # end and is recorded, so that the client's retry gets its answer.
            with anyio.CancelScope(shield=True):
                reply = await run_call(self.engine, self.plan, call, run)
            if "error" in reply:
                error = reply["error"]
                raise MCPError(error["code"], error["message"], error.get("data"))
            return CallToolResult.model_validate(reply["result"])


def drop_once(marker: Path) -> Any:
    """A middleware that exits the server, once, after a ``tools/call`` has answered."""

    async def middleware(ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        result = await call_next(ctx)
        if ctx.method == "tools/call" and marker.exists():
            marker.unlink()
            os._exit(3)  # the answer is stored, but never sent
        return result

    return middleware


def build(
    store: str, ledger: Path, drop: Path | None = None, middleware: list[Any] | None = None
) -> MCPServer:
    """The shop server: ``charge`` (side effect), ``charges`` (read-only)."""
    middleware = list(middleware or [])
    if drop is not None:
        middleware.append(drop_once(drop))
    shop = MCPServer("shop", extensions=[IdempotencyExtension(store=store)], middleware=middleware)

    @shop.tool()
    def charge(order: str, amount: int) -> str:
        """Charge ``amount`` cents for ``order`` (appends to the ledger)."""
        with ledger.open("a", encoding="utf-8") as f:
            f.write(f"{order} {amount}\n")
        return f"charged {amount} for {order}"

    @shop.tool(annotations=ToolAnnotations(read_only_hint=True))
    def charges() -> int:
        """How many charges the ledger holds."""
        return len(ledger.read_text(encoding="utf-8").splitlines()) if ledger.exists() else 0

    return shop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="store URL, e.g. sqlite:///shop.db")
    parser.add_argument("--ledger", required=True, type=Path)
    parser.add_argument("--drop-once", type=Path, default=None)
    parser.add_argument("--http", metavar="HOST:PORT", default=None)
    args = parser.parse_args()
    shop = build(args.store, args.ledger, args.drop_once)
    if args.http is None:
        shop.run("stdio")
        return
    import uvicorn

    host, _, port = args.http.rpartition(":")
    uvicorn.run(shop.streamable_http_app(host=host), host=host, port=int(port), log_level="warning")


if __name__ == "__main__":
    main()
