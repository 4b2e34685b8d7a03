"""bench/mcp.py's tiny MCP server (the official ``mcp`` SDK): one side-effecting tool.

``charge(order, amount)`` appends ``order`` to the ledger file (one line per
execution), waits ``--work`` seconds, and answers. ``--door`` puts a deduplication
in front of it in process: ``none`` (the bare server), ``inprocess``
(``retrysafe.mcp.IdempotencyExtension``) or ``standin`` (the stand-in of
examples/mcp_shop_server.py, for smoke runs only).

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
import importlib.util
from typing import Any

import anyio
from mcp.server.mcpserver import MCPServer

ROOT = HERE.parent


def _extension(door: str, store: str) -> Any:
    if door == "inprocess":
        from retrysafe import mcp

        return mcp.IdempotencyExtension(store=store)  # type: ignore[attr-defined]
    path = ROOT / "examples" / "mcp_shop_server.py"
    spec = importlib.util.spec_from_file_location("mcp_shop_server", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.IdempotencyExtension(store=store)


def build(ledger: Path, work: float, door: str, store: str | None) -> MCPServer:
    extensions = [] if door == "none" else [_extension(door, store or "sqlite:///bench-mcp.db")]
    server = MCPServer("bench", extensions=extensions)

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
    parser.add_argument("--door", choices=("none", "inprocess", "standin"), default="none")
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
