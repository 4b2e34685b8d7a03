"""A tiny shop MCP server (the official ``mcp`` SDK) for examples/mcp_agent.py.

``charge`` has a side effect: it appends a line to the ledger file. ``charges``
is read-only (``readOnlyHint``): it counts the ledger's lines. A ``tools/call``
with a key in ``_meta["dev.retrysafe/idempotencyKey"]`` runs once per key; its
repeats get the stored answer.

``--drop-once FILE`` simulates lost answers: if FILE exists, once N ``tools/call``
requests (the number FILE holds; 1 if it is empty) have run and their answers are
stored, the server deletes FILE and exits without sending any of them, as if the
connection had dropped. It is a crash, not a network drop: a call still running
in it when it exits is not recorded, so its retry waits "in flight" until its
lease ends and then runs again. Hence N: the calls a test sends at once.

    python examples/mcp_shop_server.py --store sqlite:///shop.db --ledger ledger.txt
    python examples/mcp_shop_server.py ... --http 127.0.0.1:8000   # Streamable HTTP at /mcp
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Literal

import anyio
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

from retrysafe.mcp import McpIdempotency


def drop_once(marker: Path) -> Any:
    """A middleware that exits the server, once, after ``marker``'s number of
    ``tools/call`` requests have answered (each held until the last one has)."""
    answered = 0
    last = anyio.Event()

    async def middleware(ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        nonlocal answered
        result = await call_next(ctx)
        if ctx.method == "tools/call" and marker.exists():
            answered += 1
            if answered < int(marker.read_text(encoding="utf-8").strip() or "1"):
                await last.wait()  # held: no answer goes out before the exit
            marker.unlink()
            os._exit(3)  # the answers are stored, but never sent
        return result

    return middleware


def build(
    store: str,
    ledger: Path,
    drop: Path | None = None,
    middleware: list[Any] | None = None,
    anonymous: Literal["run", "refuse", "share"] | None = None,
) -> MCPServer:
    """The shop server: ``charge`` (side effect), ``charges`` (read-only).

    ``anonymous``: what a Streamable HTTP caller without credentials gets (see
    :class:`~retrysafe.mcp.McpIdempotency`); over stdio the caller is the one
    local client."""
    middleware = list(middleware or [])
    if drop is not None:
        middleware.append(drop_once(drop))
    shop = MCPServer("shop", middleware=middleware)
    # Keyed tools/call requests run once per key; read-only tools pass through.
    McpIdempotency(store, ttl=3600, lease=30, anonymous=anonymous).install(shop)

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
    if args.http is None:
        build(args.store, args.ledger, args.drop_once).run("stdio")
        return
    # A demo on loopback with one user and no sign-in: its callers share their keys.
    # A real deployment names them (OAuth, or principal=): anonymous callers' keys
    # are otherwise not recorded, so that no answer reaches another caller.
    shop = build(args.store, args.ledger, args.drop_once, anonymous="share")
    import uvicorn

    host, _, port = args.http.rpartition(":")
    uvicorn.run(shop.streamable_http_app(host=host), host=host, port=int(port), log_level="warning")


if __name__ == "__main__":
    main()
