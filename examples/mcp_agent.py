"""An agent that calls a side-effecting MCP tool through retrysafe's client helper.

It starts the shop server (examples/mcp_shop_server.py) over stdio and charges
two orders with ``charge``, one at a time. Before the first, it arms the server's
drop-once marker: the server runs the charge, stores its answer, and exits without
sending it, as when a connection drops (a crash, in fact: with several calls at
once, one still running would not be recorded). The server advertises
deduplication, so the helper starts a new server process and sends the call again
with the same key; the server answers from its store. Each order is charged once::

    python examples/mcp_agent.py

Exits 0 when every order was charged exactly once.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from mcp.client import Client
from mcp.client.stdio import StdioServerParameters

from retrysafe.client import RetryPolicy
from retrysafe.mcp import IdempotentTools, was_replayed

SERVER = Path(__file__).resolve().parent / "mcp_shop_server.py"
ORDERS = [("A-1", 500), ("A-2", 250)]


async def agent(workdir: Path) -> bool:
    ledger, drop = workdir / "ledger.txt", workdir / "drop"
    server = StdioServerParameters(
        command=sys.executable,
        args=[
            *(str(SERVER), "--store", f"sqlite:///{workdir / 'shop.db'}"),
            *("--ledger", str(ledger), "--drop-once", str(drop)),
        ],
    )
    retry = RetryPolicy(max_attempts=5, max_time=60, base=0.1)
    ok = True
    # connect= makes a new session (here: a new server process) after a dropped connection.
    async with IdempotentTools(connect=lambda: Client(server), retry=retry, timeout=30) as tools:
        for i, (order, amount) in enumerate(ORDERS):
            if i == 0:
                drop.touch()  # the server will lose this call's answer
            result = await tools.call_tool("charge", {"order": order, "amount": amount})
            lines = ledger.read_text().splitlines() if ledger.exists() else []
            executions = lines.count(f"{order} {amount}")
            text = result.structured_content or {}
            print(
                f"{order}: {text.get('result')} "
                f"(replayed: {was_replayed(result)}, executions: {executions})"
            )
            ok = ok and executions == 1
        # A read-only tool (readOnlyHint) is called without a key.
        total = await tools.call_tool("charges")
        print(f"charges in the ledger: {(total.structured_content or {}).get('result')}")
    return ok


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="mcp-agent-") as tmp:
        ok = asyncio.run(agent(Path(tmp)))
    print("every order was charged once" if ok else "an order was charged twice")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
