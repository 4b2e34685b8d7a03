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
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import REQUEST_TIMEOUT

from retrysafe._protocols.mcp import extension_settings
from retrysafe.client import RetryPolicy
from retrysafe.errors import (
    FingerprintMismatchError,
    InvalidKeyError,
    MissingExtraError,
    PrincipalRequiredError,
)
from retrysafe.mcp import EXTENSION_ID, IdempotentTools, McpIdempotency, was_replayed

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
    """The low-level ``ClientSession``, as ``connect`` makes it: stdio, then
    ``server/discover`` (a legacy ``initialize`` handshake shows no extensions, so
    its lost calls are raised, not resent)."""
    shop.drop.touch()
    params = StdioServerParameters(command=sys.executable, args=shop.argv()[1:])

    @asynccontextmanager
    async def connect() -> AsyncIterator[ClientSession]:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.discover()
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


# -- what is resent, and to whom ----------------------------------------------------------------


def _quick(waits: list[float], on_wait: Any = None) -> RetryPolicy:
    async def asleep(seconds: float) -> None:
        waits.append(seconds)
        if on_wait is not None:
            on_wait()
        await anyio.sleep(seconds)

    return RetryPolicy(max_attempts=4, max_time=30, base=0.01, cap=0.05, asleep=asleep)


def _slow_tool(server: MCPServer, name: str, runs: list[str], release: anyio.Event) -> None:
    """A side-effecting tool that answers once ``release`` is set (after a client timeout)."""

    async def tool(order: str) -> str:
        runs.append(order)
        await release.wait()
        return f"done {order}"

    server.add_tool(tool, name=name)


async def test_a_lost_call_is_not_resent_to_a_server_that_does_not_deduplicate() -> None:
    """A server that advertises no deduplication runs every resend: a timeout is raised."""
    server, runs, release, waits = MCPServer("bare"), [], anyio.Event(), []
    _slow_tool(server, "charge", runs, release)
    async with Client(server) as client:
        tools = IdempotentTools(client, retry=_quick(waits), timeout=0.3, discover=False)
        with pytest.raises(MCPError) as info:
            await tools.call_tool("charge", {"order": "H1"})
        assert info.value.code == REQUEST_TIMEOUT
        assert runs == ["H1"] and waits == []
        # The caller may say the tool is safe to run again.
        policy = _quick(waits, release.set)
        sure = IdempotentTools(client, retry=policy, timeout=0.3, assume_idempotent=True)
        await sure.call_tool("charge", {"order": "H2"})
        release.set()
    assert runs.count("H2") == 2


async def test_a_lost_call_to_an_unrecorded_tool_is_not_resent(tmp_path: Path) -> None:
    """The door advertises its skipped tools in ``unrecordedTools``: a lost call to one
    is raised; a lost call to a recorded tool of the same server is resent, and replayed."""
    server, runs, release, waits = MCPServer("mail"), [], anyio.Event(), []
    door = McpIdempotency(f"sqlite:///{tmp_path / 'mail.db'}", skip=["send_email"])
    door.settings = extension_settings(door.plan.ttl, unrecorded=door.skip)  # as advertised
    door.install(server)
    _slow_tool(server, "send_email", runs, release)
    _slow_tool(server, "charge", runs, release)
    async with Client(server) as client:
        assert client.server_capabilities.extensions is not None
        settings = client.server_capabilities.extensions[EXTENSION_ID]
        assert settings["unrecordedTools"] == ["send_email"]
        tools = IdempotentTools(client, retry=_quick(waits, release.set), timeout=0.3)
        with pytest.raises(MCPError):
            await tools.call_tool("send_email", {"order": "I1"})
        assert runs == ["I1"] and waits == []
        result = await tools.call_tool("charge", {"order": "I2"})
    assert runs == ["I1", "I2"]
    assert waits and result.structured_content == {"result": "done I2"}


# -- refusals, by a server that advertises deduplication -------------------------------------


def deduplicating(tmp_path: Path, middleware: Any) -> MCPServer:
    """A server with the door, ``middleware`` before it, and a ``charge`` tool."""
    server = MCPServer("deduplicating", middleware=[middleware])
    McpIdempotency(f"sqlite:///{tmp_path / 'd.db'}").install(server)

    @server.tool()
    def charge(order: str) -> str:
        return f"charged {order}"

    return server


@asynccontextmanager
async def refusing(
    tmp_path: Path, refusals: list[dict[str, Any]]
) -> AsyncIterator[tuple[Client, list[str]]]:
    """A deduplicating server whose first ``tools/call``s are refused with ``refusals``'
    ``data`` (one each, in order); the methods it was asked are listed."""
    asked: list[str] = []

    async def refuse(ctx: Any, call_next: Any) -> Any:
        asked.append(ctx.method)
        if ctx.method == "tools/call" and refusals:
            data = refusals.pop(0)
            raise MCPError(int(data.pop("jsonrpc", -32603)), str(data.get("code")), data)
        return await call_next(ctx)

    async with Client(deduplicating(tmp_path, refuse)) as client:
        yield client, asked


async def test_store_unavailable_is_retried_after_its_retry_after_even_zero(
    tmp_path: Path,
) -> None:
    waits: list[float] = []
    refusals = [{"code": "idempotency_store_unavailable", "retryAfter": 0}]
    async with refusing(tmp_path, refusals) as (client, asked):
        tools = IdempotentTools(client, retry=_quick(waits), discover=False)
        result = await tools.call_tool("charge", {"order": "J1"})
    assert result.structured_content == {"result": "charged J1"}
    assert waits == [0.0] and asked.count("tools/call") == 2


async def test_an_error_marked_retryable_is_retried_with_its_key(tmp_path: Path) -> None:
    waits: list[float] = []
    async with refusing(tmp_path, [{"code": "busy_upstream", "retryable": True}]) as (c, asked):
        tools = IdempotentTools(c, retry=_quick(waits), discover=False)
        await tools.call_tool("charge", {"order": "J2"})
    assert len(waits) == 1 and asked.count("tools/call") == 2


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        ({"code": "idempotency_key_invalid", "jsonrpc": -32602}, InvalidKeyError),
        ({"code": "idempotency_principal_required", "jsonrpc": -32600}, PrincipalRequiredError),
    ],
)
async def test_refusals_are_raised_typed_at_once(
    tmp_path: Path, data: dict[str, Any], kind: type[Exception]
) -> None:
    waits: list[float] = []
    async with refusing(tmp_path, [dict(data, retryable=True)]) as (client, asked):
        tools = IdempotentTools(client, retry=_quick(waits), discover=False)
        with pytest.raises(kind) as info:
            await tools.call_tool("charge", {"order": "K1"})
    assert isinstance(info.value.__cause__, MCPError)
    assert waits == [] and asked.count("tools/call") == 1


async def test_a_caller_cancelled_while_waiting_leaves_the_helper_usable(tmp_path: Path) -> None:
    waiting = anyio.Event()
    policy = RetryPolicy(max_attempts=5, max_time=120, asleep=lambda s: _wait(waiting, s))
    refusals = [{"code": "idempotency_in_flight", "retryAfter": 60}]
    async with refusing(tmp_path, refusals) as (client, asked):
        tools = IdempotentTools(client, retry=policy, discover=False)
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(tools.call_tool, "charge", {"order": "L1"})
                await waiting.wait()
                scope.cancel()
        assert scope.cancelled_caught
        result = await tools.call_tool("charge", {"order": "L2"})
    assert result.structured_content == {"result": "charged L2"}
    assert asked.count("tools/call") == 2


async def _wait(waiting: anyio.Event, seconds: float) -> None:
    waiting.set()
    await anyio.sleep(seconds)


async def test_a_failed_or_slow_tools_list_is_tried_once_and_bounded(tmp_path: Path) -> None:
    """The helper lists the tools once, whatever the outcome, within its timeout; the
    calls go on with keys. (The SDK's client lists them again on its own, after a call.)"""
    listed, hang = [], anyio.Event()

    async def stuck(ctx: Any, call_next: Any) -> Any:
        if ctx.method == "tools/list":
            listed.append(1)
            if len(listed) == 1:
                await hang.wait()  # never set: the client gives up after its timeout
        return await call_next(ctx)

    async def failed() -> Any:
        lists.append(1)
        raise MCPError(-32603, "no listing")

    async with Client(deduplicating(tmp_path, stuck)) as client:
        slow, lists = IdempotentTools(client, timeout=0.5), []
        real = slow.list_tools
        slow.list_tools = lambda: (lists.append(1), real())[1]  # type: ignore[method-assign]
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for order in ("M1", "M2", "M3"):
                    tg.start_soon(slow.call_tool, "charge", {"order": order})
            await slow.call_tool("charge", {"order": "M4"})
        assert lists == [1]
        failing, lists = IdempotentTools(client, timeout=0.5), []
        failing.list_tools = failed  # type: ignore[method-assign]
        await failing.call_tool("charge", {"order": "M5"})
        result = await failing.call_tool("charge", {"order": "M6"})
        assert lists == [1]
    assert result.structured_content == {"result": "charged M6"}


# -- connections -----------------------------------------------------------------------------


async def test_a_failed_first_connection_leaves_nothing_entered() -> None:
    @asynccontextmanager
    async def unreachable() -> AsyncIterator[Any]:
        raise OSError("connection refused")
        yield  # pragma: no cover

    with anyio.CancelScope():
        tools = IdempotentTools(connect=unreachable, retry=RetryPolicy(max_time=5))
        with pytest.raises(OSError):
            async with tools:
                pass  # pragma: no cover
    await anyio.sleep(0)  # the scopes above were left in order


def counting(connect: Any, connects: list[int]) -> Any:
    def again() -> Any:
        connects.append(1)
        return connect()

    return again


async def test_concurrent_calls_that_see_one_drop_reconnect_once(shop: Shop) -> None:
    shop.drop.write_text("3")  # the server exits once the three calls are recorded
    params = StdioServerParameters(command=sys.executable, args=shop.argv()[1:])
    connects: list[int] = []
    connect = counting(lambda: Client(params), connects)
    async with IdempotentTools(connect=connect, retry=shop.policy()) as tools:
        await tools.list_tools()
        results: list[Any] = []

        async def call(order: str) -> None:
            results.append(await tools.call_tool("charge", {"order": order, "amount": 1}))

        async with anyio.create_task_group() as tg:
            for order in ("N1", "N2", "N3"):
                tg.start_soon(call, order)
    assert not shop.drop.exists()
    assert sorted(shop.charges()) == ["N1 1", "N2 1", "N3 1"]
    assert len(connects) == 2 and len(results) == 3


async def test_a_read_only_call_is_sent_again_after_a_drop(shop: Shop) -> None:
    shop.drop.touch()
    params = StdioServerParameters(command=sys.executable, args=shop.argv()[1:])
    connects: list[int] = []
    connect = counting(lambda: Client(params), connects)
    async with IdempotentTools(connect=connect, retry=shop.policy()) as tools:
        await tools.list_tools()
        count = await tools.call_tool("charges")
    assert not shop.drop.exists()  # the first answer was dropped
    assert count.structured_content == {"result": 0}
    assert len(connects) == 2


# -- keys ------------------------------------------------------------------------------------


async def test_a_long_or_non_ascii_key_is_sent_as_given(shop: Shop) -> None:
    long = "k" * 300
    async with served(shop) as server, Client(server.url) as client:
        tools = IdempotentTools(client, discover=False)
        await tools.call_tool("charge", {"order": "O1", "amount": 1}, key="заказ-O1")
        await tools.call_tool("charge", {"order": "O2", "amount": 1}, key=long)
        again = await tools.call_tool("charge", {"order": "O2", "amount": 1}, key=long)
        made = IdempotentTools(client, discover=False, key_factory=lambda: "")
        with pytest.raises(InvalidKeyError):
            await made.call_tool("charge", {"order": "O3", "amount": 1})
    assert _keys(server.seen) == ["заказ-O1", long, long]
    assert was_replayed(again)
    assert shop.charges() == ["O1 1", "O2 1"]


def test_a_missing_httpx_is_the_mcp_extra_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client needs httpx (retrysafe[client], which the mcp extra pulls in)."""
    import retrysafe.mcp as door

    def missing(name: str) -> Any:
        raise ImportError("No module named 'httpx'", name="httpx")

    monkeypatch.setattr(door.importlib, "import_module", missing)
    with pytest.raises(MissingExtraError):
        door.__getattr__("IdempotentTools")
