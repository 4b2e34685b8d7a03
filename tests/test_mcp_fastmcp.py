"""The MCP door on a FastMCP server: ``McpIdempotency.install`` works on it too,
over stdio and Streamable HTTP, with the official SDK's client."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx2
import pytest
from mcp.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from test_mcp import Shop, http_shop, keyed, records, text

from retrysafe.mcp import EXTENSION_ID, REPLAY_META


@pytest.fixture
def shop(tmp_path: Path) -> Shop:
    made = Shop(f"sqlite:///{tmp_path}/mcp.db", tmp_path / "counts", variant="--fastmcp")
    made.root.mkdir()
    return made


async def test_fastmcp_over_stdio_replays_refuses_and_passes_read_only(shop: Shop) -> None:
    key = str(uuid.uuid4())
    async with shop.client() as client:
        assert EXTENSION_ID in (client.server_capabilities.extensions or {})
        first = await client.call_tool("charge", {"test_id": "f", "amount": 4}, meta=keyed(key))
    async with shop.client() as client:  # the answer was lost: a new session retries
        again = await client.call_tool("charge", {"test_id": "f", "amount": 4}, meta=keyed(key))
        with pytest.raises(MCPError) as caught:
            await client.call_tool("charge", {"test_id": "f", "amount": 9}, meta=keyed(key))
        before = records(shop)
        for _ in range(2):
            await client.call_tool("lookup", {"test_id": "ro"}, meta=keyed("ro-key"))
        assert records(shop) == before
    assert text(first) == text(again) == "charge 4 run 1"
    assert again.meta is not None and again.meta[REPLAY_META]["replayed"] is True
    assert caught.value.data["code"] == "idempotency_conflict"
    assert shop.count("f") == 1 and shop.count("ro") == 2


async def test_fastmcp_over_http_in_flight_and_two_principals(shop: Shop) -> None:
    key = str(uuid.uuid4())
    with http_shop(shop, "--oauth"):

        def client(token: str) -> Client:
            headers = {"Authorization": f"Bearer {token}"}
            http = httpx2.AsyncClient(headers=headers, timeout=60)
            return Client(streamable_http_client(shop.url or "", http_client=http))

        async with client("token-alice") as alice, client("token-bob") as bob:
            first = asyncio.ensure_future(
                alice.call_tool("slow", {"test_id": "fs"}, meta=keyed(key))
            )
            while shop.count("fs") == 0:
                await asyncio.sleep(0.01)
            with pytest.raises(MCPError) as caught:
                await alice.call_tool("slow", {"test_id": "fs"}, meta=keyed(key))
            # Bob's call with the same key is his own: it runs
            shop.open_gate("fs")
            bobs = await bob.call_tool("slow", {"test_id": "fs"}, meta=keyed(key))
            assert text(await first) == "slow run 1"
            again = await alice.call_tool("slow", {"test_id": "fs"}, meta=keyed(key))
        async with client("token-alice-2") as refreshed:  # alice's new token: alice
            hers = await refreshed.call_tool("slow", {"test_id": "fs"}, meta=keyed(key))
    assert text(hers) == "slow run 1" and hers.meta[REPLAY_META]["replayed"] is True
    assert caught.value.data["code"] == "idempotency_in_flight"
    assert caught.value.data["retryAfter"] >= 1
    assert text(bobs) == "slow run 2" and text(again) == "slow run 1"
    assert shop.count("fs") == 2
