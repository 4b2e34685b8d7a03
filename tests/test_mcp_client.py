"""retrysafe.mcp's client helper, IdempotentTools, with the official ``mcp`` SDK's client
and server (examples/mcp_shop_server.py): over stdio (a subprocess) and Streamable HTTP
(uvicorn, in a subprocess that is killed and restarted, or in a thread)."""

from __future__ import annotations

import runpy
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from _http_servers import Process, ThreadServer, free_port
from mcp.client import Client, ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError

from retrysafe.client import RetryPolicy
from retrysafe.errors import FingerprintMismatchError, InvalidKeyError
from retrysafe.mcp import IdempotentTools, was_replayed

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "examples" / "mcp_shop_server.py"
AGENT = ROOT / "examples" / "mcp_agent.py"
META_KEY = "dev.retrysafe/idempotencyKey"


#: The example server's module globals (its build()).
shop_server = runpy.run_path(str(SERVER), run_name="mcp_shop_server")


@dataclass
class Shop:
    """The files of one shop: its store, its ledger, the drop-once marker."""

    root: Path
    waits: list[float] = field(default_factory=list)

    @property
    def store(self) -> str:
        return f"sqlite:///{self.root / 'shop.db'}"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.txt"

    @property
    def drop(self) -> Path:
        return self.root / "drop"

    def charges(self) -> list[str]:
        return self.ledger.read_text().splitlines() if self.ledger.exists() else []

    def argv(self, *extra: str) -> list[str]:
        return [
            sys.executable,
            str(SERVER),
            "--store",
            self.store,
            "--ledger",
            str(self.ledger),
            "--drop-once",
            str(self.drop),
            *extra,
        ]

    def policy(self, on_wait: Any = None) -> RetryPolicy:
        """A policy that records its waits (and runs ``on_wait`` at each)."""

        async def asleep(seconds: float) -> None:
            self.waits.append(seconds)
            if on_wait is not None:
                on_wait()
            await anyio.sleep(seconds)

        return RetryPolicy(max_attempts=20, max_time=120, base=0.05, cap=0.5, asleep=asleep)


@pytest.fixture
def shop(tmp_path: Path) -> Shop:
    return Shop(tmp_path)


# -- a dropped answer: the server stores it, then exits without sending it ----------------


async def test_dropped_answer_over_stdio_is_replayed_after_a_reconnect(shop: Shop) -> None:
    shop.drop.touch()
    params = StdioServerParameters(command=sys.executable, args=shop.argv()[1:])
    async with IdempotentTools(connect=lambda: Client(params), retry=shop.policy()) as tools:
        first = tools.session
        result = await tools.call_tool("charge", {"order": "A1", "amount": 5})
        assert tools.session is not first  # a new server process
    assert not shop.drop.exists()  # the first attempt ran, and its answer was dropped
    assert shop.charges() == ["A1 5"]
    assert was_replayed(result)
    assert result.structured_content == {"result": "charged 5 for A1"}
    assert len(shop.waits) >= 1


async def test_a_client_session_over_stdio_is_reconnected_too(shop: Shop) -> None:
    """The low-level ``ClientSession``, as ``connect`` makes it: stdio, then initialize."""
    shop.drop.touch()
    params = StdioServerParameters(command=sys.executable, args=shop.argv()[1:])

    @asynccontextmanager
    async def connect() -> AsyncIterator[ClientSession]:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            yield session

    async with IdempotentTools(connect=connect, retry=shop.policy()) as tools:
        result = await tools.call_tool("charge", {"order": "S1", "amount": 3})
        count = await tools.call_tool("charges")
    assert shop.charges() == ["S1 3"]
    assert was_replayed(result) and not was_replayed(count)


class Restarting:
    """The shop over HTTP in a subprocess, restarted on the same port when it exits."""

    def __init__(self, shop: Shop) -> None:
        self.port = free_port()
        self.argv = shop.argv("--http", f"127.0.0.1:{self.port}")
        self.restarts = 0
        self._stop = threading.Event()
        self.process = Process(self.argv, self.port, health="/mcp").__enter__()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def _watch(self) -> None:
        proc = self.process.proc
        assert proc is not None
        try:
            proc.wait()
        except subprocess.SubprocessError:
            return
        if not self._stop.is_set():
            self.restarts += 1
            self.process = Process(self.argv, self.port, health="/mcp").__enter__()

    def close(self) -> None:
        self._stop.set()
        self.process.__exit__()
        self._thread.join(30)
        self.process.__exit__()


@pytest.fixture
def http_shop(shop: Shop) -> Iterator[Restarting]:
    server = Restarting(shop)
    try:
        yield server
    finally:
        server.close()


async def test_dropped_answer_over_http_is_replayed_after_a_restart(
    shop: Shop, http_shop: Restarting
) -> None:
    shop.drop.touch()
    url = http_shop.url
    async with IdempotentTools(connect=lambda: Client(url), retry=shop.policy()) as tools:
        result = await tools.call_tool("charge", {"order": "B2", "amount": 7})
    assert http_shop.restarts == 1
    assert shop.charges() == ["B2 7"]
    assert was_replayed(result)
    assert result.structured_content == {"result": "charged 7 for B2"}


# -- the shop in a thread: a gated tool, the keys the server saw ----------------------------


@dataclass
class Served:
    url: str
    gate: threading.Event
    seen: list[dict[str, Any]]


@asynccontextmanager
async def served(shop: Shop) -> AsyncIterator[Served]:
    gate = threading.Event()
    seen: list[dict[str, Any]] = []

    async def record(ctx: Any, call_next: Any) -> Any:
        if ctx.method == "tools/call":
            params = dict(ctx.params or {})
            seen.append(params)
            sep_3182(params, len(seen))
        return await call_next(ctx)

    # One test client and no sign-in over HTTP: its calls share their keys.
    build = shop_server["build"]
    server = build(shop.store, shop.ledger, middleware=[record], anonymous="share")

    @server.tool()
    async def gated_charge(order: str, amount: int) -> str:
        """Charge, then wait for the test's gate (shielded: a charge is not interrupted)."""
        with anyio.CancelScope(shield=True):
            with shop.ledger.open("a") as f:
                f.write(f"{order} {amount}\n")
            await anyio.to_thread.run_sync(gate.wait)
        return f"charged {amount} for {order}"

    app = server.streamable_http_app()
    with ThreadServer(app, "asgi") as http:
        try:
            yield Served(http.url + "/mcp", gate, seen)
        finally:
            gate.set()


def sep_3182(params: dict[str, Any], nth: int) -> None:
    """Refuse as a SEP-3182 server would (``data.type``, no ``data.code``): order
    ``sep-busy`` is in progress on its first call, ``sep-conflict`` always a conflict."""
    order = (params.get("arguments") or {}).get("order")
    key = (params.get("_meta") or {}).get(META_KEY)
    data = {"idempotencyKey": key}
    if order == "sep-busy" and nth == 1:
        raise MCPError(-32603, "in progress", {**data, "type": "idempotency_key_in_progress"})
    if order == "sep-conflict":
        raise MCPError(-32602, "conflict", {**data, "type": "idempotency_key_conflict"})


def _keys(seen: list[dict[str, Any]]) -> list[Any]:
    return [(p.get("_meta") or {}).get(META_KEY) for p in seen]


async def test_a_timeout_is_retried_with_the_same_key_and_runs_once(shop: Shop) -> None:
    async with served(shop) as server:
        policy = shop.policy(on_wait=server.gate.set)  # the tool ends once the client waits
        async with Client(server.url) as client:
            tools = IdempotentTools(client, retry=policy, timeout=0.5)
            result = await tools.call_tool("gated_charge", {"order": "C3", "amount": 9})
    assert shop.charges() == ["C3 9"]
    assert was_replayed(result)
    keys = _keys([p for p in server.seen if p.get("name") == "gated_charge"])
    assert len(keys) >= 2 and keys[0] is not None and set(keys) == {keys[0]}


async def test_in_flight_waits_the_servers_retry_after_and_gets_the_answer(shop: Shop) -> None:
    async with served(shop) as server:
        policy = shop.policy(on_wait=server.gate.set)
        async with Client(server.url) as client:
            tools = IdempotentTools(client, retry=policy)
            results: list[Any] = []

            async def call() -> None:
                args = {"order": "D4", "amount": 1}
                results.append(await tools.call_tool("gated_charge", args, key="order-D4"))

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                tg.start_soon(call)
    assert shop.charges() == ["D4 1"]
    assert sorted(was_replayed(r) for r in results) == [False, True]
    assert results[0].structured_content == results[1].structured_content
    # The in-flight answer's data.retryAfter (whole seconds, at least 1), not the backoff
    # (at most the policy's cap, 0.5 s).
    assert any(w >= 1 for w in shop.waits)


async def test_a_conflict_is_raised_at_once_and_not_retried(shop: Shop) -> None:
    async with served(shop) as server, Client(server.url) as client:
        tools = IdempotentTools(client, retry=shop.policy())
        await tools.call_tool("charge", {"order": "E5", "amount": 2}, key="order-E5")
        with pytest.raises(FingerprintMismatchError) as info:
            await tools.call_tool("charge", {"order": "E5", "amount": 3}, key="order-E5")
    assert shop.waits == []
    assert len(server.seen) == 2
    assert info.value.key == "order-E5"
    assert info.value.original_fingerprint
    cause = info.value.__cause__
    assert isinstance(cause, MCPError) and cause.data["code"] == "idempotency_conflict"
    assert shop.charges() == ["E5 2"]


async def test_sep_3182_refusals_are_understood_by_their_data_type(shop: Shop) -> None:
    async with served(shop) as server, Client(server.url) as client:
        tools = IdempotentTools(client, retry=shop.policy(), discover=False)
        result = await tools.call_tool("charge", {"order": "sep-busy", "amount": 1})
        with pytest.raises(FingerprintMismatchError):
            await tools.call_tool("charge", {"order": "sep-conflict", "amount": 1})
    assert not was_replayed(result)
    assert len(shop.waits) == 1  # the in-progress refusal was retried once; the conflict never
    assert shop.charges() == ["sep-busy 1"]
    keys = _keys(server.seen)
    assert keys[0] == keys[1] and keys[2] != keys[0]


async def test_a_read_only_tool_is_called_without_a_key(shop: Shop) -> None:
    async with served(shop) as server, Client(server.url) as client:
        tools = IdempotentTools(client, retry=shop.policy())
        await tools.call_tool("charge", {"order": "F6", "amount": 4})
        count = await tools.call_tool("charges")
        named = IdempotentTools(client, read_only={"charge"}, discover=False)
        await named.call_tool("charge", {"order": "F7", "amount": 1})  # named read-only
    assert count.structured_content == {"result": 1}
    assert "charges" in tools.read_only
    keys = _keys(server.seen)
    assert keys[0] is not None and keys[1:] == [None, None]


async def test_bad_input_is_refused_before_anything_is_sent(shop: Shop) -> None:
    async with served(shop) as server, Client(server.url) as client:
        tools = IdempotentTools(client, discover=False)
        with pytest.raises(InvalidKeyError):
            await tools.call_tool("charge", {"order": "G7", "amount": 1}, key="")
        with pytest.raises(TypeError):
            await tools.call_tool("charge", [1, 2])  # type: ignore[arg-type]
    assert server.seen == []
    with pytest.raises(TypeError):
        IdempotentTools()
    with pytest.raises(TypeError):
        IdempotentTools(connect=lambda: Client("http://127.0.0.1:9/mcp"), read_only="charge")


# -- the example agent -----------------------------------------------------------------------


def test_the_example_agent_runs() -> None:
    done = subprocess.run(
        [sys.executable, str(AGENT)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "executions: 1" in done.stdout
    assert "replayed: True" in done.stdout
