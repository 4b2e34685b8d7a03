"""A plain MCP server (the official SDK, no retrysafe) for the mcp-proxy tests.

``python plain.py DIR`` serves over stdio; ``python plain.py DIR --http PORT``
over Streamable HTTP at ``/mcp``; :func:`make_server` builds it in-process.
Every execution of a tool appends a line to ``DIR/<tool>.log`` (shared by every
process); ``slow`` writes ``DIR/slow.started`` and waits until
``DIR/slow.release`` exists.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations


def make_server(folder: Path) -> MCPServer:
    """The server, counting its executions in ``folder``."""
    server = MCPServer("plain")

    def ran(tool: str, text: str) -> int:
        """Count one execution of ``tool``; the executions so far."""
        with open(folder / f"{tool}.log", "a") as log:  # O_APPEND: one whole line per write
            log.write(text + "\n")
        return len((folder / f"{tool}.log").read_text().splitlines())

    @server.tool()
    def charge(amount: int) -> str:
        """A side effect: counted once per execution."""
        return f"charged {amount} (execution {ran('charge', str(amount))})"

    @server.tool()
    async def slow(tag: str) -> str:
        """Counted, then blocks until the test creates ``slow.release``."""
        count = ran("slow", tag)
        (folder / "slow.started").write_text(tag)
        while not (folder / "slow.release").exists():
            await asyncio.sleep(0.02)
        return f"slow {tag} (execution {count})"

    @server.tool()
    def report(size: int) -> str:
        """A side effect with a long answer (``size`` characters)."""
        ran("report", str(size))
        return "r" * size

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def lookup(name: str) -> str:
        """Read-only: counted, never deduplicated."""
        return f"{name} (lookup {ran('lookup', name)})"

    return server


if __name__ == "__main__":
    plain = make_server(Path(sys.argv[1]))
    if "--http" in sys.argv:
        port = int(sys.argv[sys.argv.index("--http") + 1])
        plain.run("streamable-http", host="127.0.0.1", port=port)
    else:
        plain.run()
