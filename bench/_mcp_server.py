"""bench/mcp.py's tiny MCP server (the official ``mcp`` SDK): one side-effecting tool.

``charge(order, amount)`` appends ``order`` to the ledger file (one line per
execution), waits ``--work`` seconds, and answers. ``--door`` puts a deduplication
in front of it in process: ``none`` (the bare server), ``inprocess``
(``retrysafe.mcp.McpIdempotency(...).install``).

    python bench/_mcp_server.py --ledger L [--work S] [--door D --store URL] [--http HOST:PORT]
"""

# ruff: noqa: E402  (the imports follow the sys.path guard below)
from __future__ import annotations

import sys
from pathlib import Path

# Keep this folder off sys.path: bench/mcp.py would shadow the MCP SDK's mcp package.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import argparse

import anyio
from mcp.server.mcpserver import MCPServer

ROOT = HERE.parent


def build(ledger: Path, work: float, door: str, store: str | None) -> MCPServer:
    server = MCPServer("bench")
    if door == "inprocess":
        from retrysafe.mcp import McpIdempotency

        # The bench's clients send no credentials over HTTP: one user on loopback, so
        # its keys share one record space (anonymous callers' keyed calls are refused
        # by default). Over stdio the caller is the local user.
        McpIdempotency(store or "sqlite:///bench-mcp.db", anonymous="share").install(server)

    @server.tool()
    async def charge(order: str, amount: int) -> str:
        """Charge ``amount`` for ``order``: one ledger line per execution."""
        with ledger.open("a", encoding="utf-8") as f:
            f.write(order + "\n")
        if work > 0:
            await anyio.sleep(work)
        return f"charged {amount} for {order}"

    return server


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ledger", required=True, type=Path)
    parser.add_argument("--work", type=float, default=0.0)
    parser.add_argument("--door", choices=("none", "inprocess"), default="none")
    parser.add_argument("--store", default=None)
    parser.add_argument("--http", metavar="HOST:PORT", default=None)
    args = parser.parse_args(argv)
    server = build(args.ledger, args.work, args.door, args.store)
    if args.http is None:
        server.run("stdio")
        return
    import uvicorn

    host, _, port = args.http.rpartition(":")
    app = server.streamable_http_app(host=host)
    uvicorn.run(app, host=host, port=int(port), log_level="warning", access_log=False)


if __name__ == "__main__":
    main(sys.argv[1:])
