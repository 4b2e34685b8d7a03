"""The MCP door (retrysafe.mcp) with the official SDK's client and servers, over
stdio (the client spawns the server) and Streamable HTTP (uvicorn in a process)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx2
import mcp_types
import pydantic
import pytest
from _http_servers import TESTS, Process, free_port
from conftest import store_url
from mcp.client import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from retrysafe import Engine
from retrysafe.mcp import EXTENSION_ID, META_KEY, REPLAY_META, McpIdempotency
from retrysafe.stores.memory import MemoryStore

SHOP = str(TESTS / "mcp_servers" / "shop.py")


class Shop:
    """One shop server's store and counters; clients over stdio or HTTP."""

    def __init__(self, store: str, root: Path, lowlevel: bool = False, variant: str = "") -> None:
        self.store, self.root = store, root
        self.variant = "--lowlevel" if lowlevel else variant
        self.url: str | None = None

    @property
    def env(self) -> dict[str, str]:
        return {
            "RETRYSAFE_TEST_STORE": self.store,
            "RETRYSAFE_TEST_COUNTERS": str(self.root),
            "PYTHONPATH": str(TESTS.parent / "src"),
        }

    def argv(self) -> list[str]:
        return [SHOP, self.variant] if self.variant else [SHOP]

    def count(self, test_id: str) -> int:
        try:
            return (self.root / test_id).stat().st_size
        except FileNotFoundError:
            return 0

    def open_gate(self, test_id: str) -> None:
        (self.root / f"{test_id}.gate").touch()

    def client(self, token: str | None = None) -> Client:
        if self.url is None:
            params = StdioServerParameters(command=sys.executable, args=self.argv(), env=self.env)
            return Client(params)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        http = httpx2.AsyncClient(headers=headers, timeout=60)
        return Client(streamable_http_client(self.url, http_client=http))


@contextlib.contextmanager
def http_shop(shop: Shop, *extra: str) -> Iterator[Shop]:
    port = free_port()
    argv = [sys.executable, *shop.argv(), "--http", str(port), *extra]
    with Process(argv, port, shop.env, health="/mcp"):
        shop.url = f"http://127.0.0.1:{port}/mcp"
        yield shop


@pytest.fixture
def sqlite_shop(tmp_path: Path) -> Shop:
    return Shop(f"sqlite:///{tmp_path}/mcp.db", tmp_path / "counts")


def keyed(key: Any) -> dict[str, Any]:
    return {META_KEY: key}


def text(result: Any) -> str:
    return str(result.content[0].text)


def records(shop: Shop) -> int:
    path = shop.store.removeprefix("sqlite:///")
    if not Path(path).exists():
        return 0
    with contextlib.closing(sqlite3.connect(path)) as db:
        tables = [r[0] for r in db.execute("select name from sqlite_master where type='table'")]
        return sum(
            db.execute(f'select count(*) from "{t}"').fetchone()[0] for t in tables if "record" in t
        )


@pytest.fixture(autouse=True)
def _root(sqlite_shop: Shop) -> None:
    sqlite_shop.root.mkdir(parents=True, exist_ok=True)


async def test_a_retry_after_a_lost_answer_replays_over_stdio(sqlite_shop: Shop) -> None:
    tid, key = "lost", str(uuid.uuid4())
    async with sqlite_shop.client() as client:
        first = await client.call_tool("charge", {"test_id": tid, "amount": 5}, meta=keyed(key))
    # the agent lost that answer; it reconnects (a new server process) and retries
    async with sqlite_shop.client() as client:
        again = await client.call_tool("charge", {"test_id": tid, "amount": 5}, meta=keyed(key))
        assert client.server_capabilities.extensions is not None
        settings = client.server_capabilities.extensions[EXTENSION_ID]
    assert settings["unrecordedTools"] == ["refund"]
    assert settings["keyArgument"] == "idempotency_key" and "argument" in settings["keyIn"]
    assert sqlite_shop.count(tid) == 1
    assert text(again) == text(first) == "charge 5 run 1"
    assert again.meta is not None and again.meta[REPLAY_META]["replayed"] is True


@pytest.mark.parametrize("lowlevel", [False, True], ids=["MCPServer", "lowlevel"])
async def test_conflict_read_only_and_opt_out_over_stdio(tmp_path: Path, lowlevel: bool) -> None:
    shop = Shop(f"sqlite:///{tmp_path}/mcp.db", tmp_path / "counts", lowlevel=lowlevel)
    shop.root.mkdir(exist_ok=True)
    key = str(uuid.uuid4())
    async with shop.client() as client:
        await client.call_tool("charge", {"test_id": "c", "amount": 5}, meta=keyed(key))
        with pytest.raises(MCPError) as caught:
            await client.call_tool("charge", {"test_id": "c", "amount": 6}, meta=keyed(key))
        assert caught.value.code == -32602
        data = caught.value.data
        assert data["code"] == "idempotency_conflict" and data["retryable"] is False
        assert data["type"] == "idempotency_key_conflict" and data["idempotencyKey"] == key
        before = records(shop)
        for name in ("lookup", "refund"):  # read-only, and opted out with skip=
            for _ in range(2):
                done = await client.call_tool(name, {"test_id": name}, meta=keyed("k-" + name))
                assert done.meta is None or REPLAY_META not in done.meta
        assert records(shop) == before
    assert shop.count("c") == 1
    assert shop.count("lookup") == 2 and shop.count("refund") == 2


async def test_in_flight_duplicate_gets_a_retry_hint(sqlite_shop: Shop) -> None:
    tid, key = "inflight", str(uuid.uuid4())
    async with sqlite_shop.client() as client:
        first = asyncio.ensure_future(client.call_tool("slow", {"test_id": tid}, meta=keyed(key)))
        while sqlite_shop.count(tid) == 0:  # the first call is running
            await asyncio.sleep(0.01)
        with pytest.raises(MCPError) as caught:
            await client.call_tool("slow", {"test_id": tid}, meta=keyed(key))
        sqlite_shop.open_gate(tid)
        assert text(await first) == "slow run 1"
    data = caught.value.data
    assert caught.value.code == -32603
    assert data["code"] == "idempotency_in_flight" and data["retryable"] is True
    assert data["type"] == "idempotency_key_in_progress" and data["retryAfter"] >= 1
    assert sqlite_shop.count(tid) == 1


@pytest.mark.parametrize(
    ("meta", "arguments", "why"),
    [
        ("k" * 5000, {}, "limit"),
        (12, {}, "must be a string"),
        ("one", {"idempotency_key": "two"}, "two different"),
    ],
    ids=["too-long", "not-a-string", "two-keys"],
)
async def test_a_bad_key_is_invalid_params_and_runs_nothing(
    sqlite_shop: Shop, meta: Any, arguments: dict[str, Any], why: str
) -> None:
    async with sqlite_shop.client() as client:
        with pytest.raises(MCPError) as caught:
            await client.call_tool(
                "charge", {"test_id": "bad", "amount": 1, **arguments}, meta=keyed(meta)
            )
    assert caught.value.code == -32602 and why in caught.value.message
    assert caught.value.data["code"] == "idempotency_key_invalid"
    assert sqlite_shop.count("bad") == 0 and records(sqlite_shop) == 0


async def test_the_store_down_is_retryable_and_runs_nothing(tmp_path: Path) -> None:
    shop = Shop(f"redis://127.0.0.1:{free_port()}/0", tmp_path / "counts")
    shop.root.mkdir(exist_ok=True)
    async with shop.client() as client:
        with pytest.raises(MCPError) as caught:
            await client.call_tool("charge", {"test_id": "down", "amount": 1}, meta=keyed("k1"))
    data = caught.value.data
    assert data["code"] == "idempotency_store_unavailable" and data["retryable"] is True
    assert data["retryAfter"] >= 1
    assert shop.count("down") == 0


@pytest.mark.parametrize("kind", ["sqlite", "redis", "postgres", "mysql"])
async def test_concurrent_duplicates_over_http_run_once(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Many tasks on two server processes that share the store: one run."""
    url = store_url(kind, request, tmp_path)
    one = Shop(url, tmp_path / "counts")
    two = Shop(url, tmp_path / "counts")
    one.root.mkdir(exist_ok=True)
    tid, key = f"storm-{kind}", str(uuid.uuid4())
    calls = (one, two) * 4
    refused: list[MCPError] = []
    all_refused = asyncio.Event()
    with http_shop(one), http_shop(two):

        async def call(shop: Shop) -> str:
            async with shop.client() as client:
                try:
                    done = await client.call_tool("slow", {"test_id": tid}, meta=keyed(key))
                except MCPError as exc:
                    refused.append(exc)
                    if len(refused) == len(calls) - 1:
                        all_refused.set()
                    return "in flight"
                return text(done)

        running = [asyncio.ensure_future(call(s)) for s in calls]
        # every duplicate is refused while the first call still waits at its gate
        await asyncio.wait_for(all_refused.wait(), 60)
        assert one.count(tid) == 1
        one.open_gate(tid)
        answers = await asyncio.gather(*running)
        async with two.client() as client:  # a retry once it is done: the stored answer
            again = await client.call_tool("slow", {"test_id": tid}, meta=keyed(key))
    assert one.count(tid) == 1
    assert sorted(answers) == ["in flight"] * (len(calls) - 1) + ["slow run 1"]
    assert {e.data["code"] for e in refused} == {"idempotency_in_flight"}
    assert text(again) == "slow run 1" and again.meta[REPLAY_META]["replayed"] is True


async def test_two_oauth_principals_never_share_a_key(sqlite_shop: Shop) -> None:
    key = str(uuid.uuid4())
    with http_shop(sqlite_shop, "--oauth"):
        answers = {}
        for token in ("token-alice", "token-bob", "token-alice", "token-alice-2"):
            http = httpx2.AsyncClient(
                headers={"Authorization": f"Bearer {token}", "Idempotency-Key": key}, timeout=60
            )
            async with Client(streamable_http_client(sqlite_shop.url or "", http_client=http)) as c:
                done = await c.call_tool("charge", {"test_id": "owners", "amount": 3})
                answers.setdefault(token, []).append(text(done))
    assert answers == {  # a refreshed token of alice's is alice: her answer
        "token-alice": ["charge 3 run 1", "charge 3 run 1"],
        "token-bob": ["charge 3 run 2"],
        "token-alice-2": ["charge 3 run 1"],
    }
    assert sqlite_shop.count("owners") == 2


class Sep3182Params(mcp_types.CallToolRequestParams):
    """``tools/call`` params with SEP-3182's ``idempotencyKey``, which the SDK's model lacks."""

    idempotency_key: str = pydantic.Field(alias="idempotencyKey")


class Sep3182Call(mcp_types.Request[Sep3182Params, Literal["tools/call"]]):
    method: Literal["tools/call"] = "tools/call"
    params: Sep3182Params


async def test_sep_3182_idempotency_key_param_is_read(sqlite_shop: Shop) -> None:
    key, arguments = str(uuid.uuid4()), {"test_id": "sep", "amount": 2}
    async with sqlite_shop.client() as client:
        params = Sep3182Params(name="charge", arguments=arguments, idempotencyKey=key)
        first = await client.session.send_request(
            Sep3182Call(params=params), mcp_types.CallToolResult
        )
        # the same key in _meta is the same call
        again = await client.call_tool("charge", arguments, meta=keyed(key))
    assert text(first) == text(again) == "charge 2 run 1"
    assert again.meta is not None and again.meta[REPLAY_META]["replayed"] is True
    assert sqlite_shop.count("sep") == 1


async def test_a_multi_round_trip_ask_is_not_kept_as_the_answer(tmp_path: Path) -> None:
    """An MRTR ask (InputRequiredResult) frees the key: the leg that carries the
    client's answer runs and is kept, and a retry replays that."""
    shop = Shop(f"sqlite:///{tmp_path}/mcp.db", tmp_path / "counts", lowlevel=True)
    shop.root.mkdir(exist_ok=True)
    key = str(uuid.uuid4())
    async with shop.client() as client:
        done = await client.call_tool("confirm", {"test_id": "mrtr"}, meta=keyed(key))
        again = await client.call_tool("confirm", {"test_id": "mrtr"}, meta=keyed(key))
    assert text(done) == text(again) == "confirm run 1"
    assert again.meta is not None and again.meta[REPLAY_META]["replayed"] is True
    assert shop.count("mrtr") == 1


async def test_handle_scopes_keys_by_principal_and_asks_only_for_keyed_calls() -> None:
    door = McpIdempotency("memory://")
    runs: list[str] = []
    asked: list[str] = []

    def call(who: str | None) -> Any:
        async def principal() -> str | None:
            asked.append(str(who))
            return who

        async def call_next() -> dict[str, Any]:
            runs.append(str(who))
            return {"result": {"content": [{"type": "text", "text": f"run {len(runs)}"}]}}

        return principal, call_next

    params = {"name": "charge", "arguments": {"n": 1}, "_meta": {META_KEY: "k1"}}
    answers = []
    for who in ("alice", "bob", "alice", None, None):
        principal, call_next = call(who)
        answers.append(await door.handle(params, call_next, principal=principal))
    unkeyed_principal, unkeyed = call("carol")
    await door.handle({"name": "charge"}, unkeyed, principal=unkeyed_principal)
    texts = [a["result"]["content"][0]["text"] for a in answers]
    assert texts == ["run 1", "run 2", "run 1", "run 3", "run 4"]  # anonymous: unrecorded
    assert runs == ["alice", "bob", "None", "None", "carol"]
    assert "carol" not in asked  # a call without a key never looks for its caller


async def test_http_principal_hashes_credentials_and_anonymous_follows_the_option() -> None:
    def scope(*headers: tuple[bytes, bytes]) -> dict[str, Any]:
        return {"type": "http", "headers": list(headers), "query_string": b""}

    run = McpIdempotency("memory://", anonymous="run")
    alice = await run.http_principal(scope((b"authorization", b"Bearer alice")))
    bob = await run.http_principal(scope((b"authorization", b"Bearer bob")))
    assert alice and bob and alice != bob and "alice" not in alice
    assert await run.http_principal(scope()) is None
    refuse = McpIdempotency("memory://")  # an MCP door refuses them by default
    params = {"name": "charge", "_meta": {META_KEY: "k"}}

    async def nobody() -> str | None:
        return await refuse.http_principal(scope())

    async def never() -> dict[str, Any]:
        raise AssertionError("ran")

    reply = await refuse.handle(params, never, principal=nobody)
    assert reply["error"]["code"] == -32600
    assert reply["error"]["data"]["code"] == "idempotency_principal_required"


def test_bad_options_are_refused() -> None:
    with pytest.raises(TypeError, match="key_argument"):
        McpIdempotency("memory://", key_argument="")
    with pytest.raises(TypeError, match="skip"):
        McpIdempotency("memory://", skip=[""])
    with pytest.raises(TypeError, match="unexpected option"):
        McpIdempotency("memory://", tll=5)


@pytest.mark.parametrize("kind", ["sqlite", "redis", "postgres", "mysql"])
async def test_a_client_that_drops_mid_call_gets_the_answer_on_retry(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Over Streamable HTTP the client gives up while the tool runs (its task is
    cancelled, the stream closes): the call runs to its end and is recorded; the
    retry is in flight meanwhile, then gets the stored answer. One run."""
    shop = Shop(store_url(kind, request, tmp_path), tmp_path / "counts")
    shop.root.mkdir(exist_ok=True)
    tid, key = f"drop-{kind}", str(uuid.uuid4())
    with http_shop(shop):

        async def first() -> Any:
            async with shop.client() as client:
                return await client.call_tool("slow", {"test_id": tid}, meta=keyed(key))

        gone = asyncio.ensure_future(first())
        while shop.count(tid) == 0:  # the tool is running
            await asyncio.sleep(0.01)
        gone.cancel()
        with pytest.raises(BaseException):  # noqa: B017 (the cancellation, grouped or not)
            await gone
        async with shop.client() as client:
            with pytest.raises(MCPError) as caught:
                await client.call_tool("slow", {"test_id": tid}, meta=keyed(key))
            shop.open_gate(tid)
            while True:  # until the first call has recorded its answer
                try:
                    again = await client.call_tool("slow", {"test_id": tid}, meta=keyed(key))
                    break
                except MCPError as exc:
                    assert exc.data["code"] == "idempotency_in_flight"
                    await asyncio.sleep(0.05)
    assert caught.value.data["code"] == "idempotency_in_flight"
    assert text(again) == "slow run 1" and again.meta[REPLAY_META]["replayed"] is True
    assert shop.count(tid) == 1


def test_a_server_is_installed_once() -> None:
    from mcp.server import MCPServer

    server = MCPServer("shop")
    door = McpIdempotency("memory://")
    middleware = door.install(server)
    assert middleware in server.middleware
    with pytest.raises(ValueError, match="already"):
        McpIdempotency("memory://").install(server)
    with pytest.raises(TypeError, match="MCPServer"):
        door.install(object())
    del server._lowlevel_server  # the SDK's internals moved
    with pytest.raises(TypeError, match="internals"):
        door.install(server)


# -- in process: the SDK's client on its in-memory transport -------------------------


def charging_server(*, annotate_read_only: bool = False) -> tuple[Any, list[int]]:
    """An ``MCPServer`` with one tool, ``export``, that counts its runs."""
    from mcp.server import MCPServer
    from mcp_types import ToolAnnotations

    server = MCPServer("shop")
    runs: list[int] = []
    annotations = ToolAnnotations(read_only_hint=True) if annotate_read_only else None

    @server.tool(annotations=annotations)
    async def export(x: int) -> str:
        runs.append(x)
        return f"export run {len(runs)}"

    return server, runs


async def test_a_read_only_tool_replaced_by_a_writing_one_is_deduplicated() -> None:
    server, runs = charging_server(annotate_read_only=True)
    McpIdempotency(MemoryStore()).install(server)
    async with Client(server) as client:
        await client.call_tool("export", {"x": 1}, meta=keyed("k1"))
        await client.call_tool("export", {"x": 1}, meta=keyed("k1"))  # read-only: runs again
        assert len(runs) == 2
        server.remove_tool("export")

        @server.tool()
        async def export(x: int) -> str:
            runs.append(x)
            return f"writes {len(runs)}"

        first = await client.call_tool("export", {"x": 1}, meta=keyed("k2"))
        again = await client.call_tool("export", {"x": 1}, meta=keyed("k2"))
    assert text(first) == text(again) == "writes 3" and len(runs) == 3
    assert again.meta is not None and again.meta[REPLAY_META]["replayed"] is True


async def test_calls_without_a_key_never_look_up_tools_and_a_failing_lookup_deduplicates(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tool list that fails breaks no call: one without a key passes untouched,
    a keyed one is deduplicated (not read-only), and it is logged once."""
    server, runs = charging_server(annotate_read_only=True)
    middleware = McpIdempotency(MemoryStore()).install(server)
    listed: list[int] = []

    async def broken(name: str, ctx: Any) -> bool:
        listed.append(1)
        raise RuntimeError("tools down")

    monkeypatch.setattr(middleware, "_read_only", broken)
    async with Client(server) as client:
        for i in range(20):  # made-up names and real ones, no key: no lookup
            with contextlib.suppress(MCPError):
                await client.call_tool(f"nope{i}", {})
        done = await client.call_tool("export", {"x": 1})
        assert text(done) == "export run 1" and listed == []
        for _ in range(2):
            keyed_done = await client.call_tool("export", {"x": 2}, meta=keyed("k"))
    assert text(keyed_done) == "export run 2" and runs == [1, 2] and len(listed) == 2
    assert keyed_done.meta is not None and keyed_done.meta[REPLAY_META]["replayed"] is True
    assert sum("read-only" in r.getMessage() for r in caplog.records) == 1


async def test_a_low_level_tool_list_is_read_again_and_keeps_only_listed_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mcp.server.lowlevel import Server
    from mcp_types import CallToolResult, ListToolsResult, TextContent, Tool, ToolAnnotations

    import retrysafe._protocols.mcp_sdk as sdk

    now = [0.0]
    monkeypatch.setattr(sdk.time, "monotonic", lambda: now[0])
    schema = {"type": "object"}
    read_only = [True]
    runs: list[str] = []

    async def list_tools(ctx: Any, params: Any) -> ListToolsResult:
        hint = ToolAnnotations(read_only_hint=read_only[0])
        return ListToolsResult(tools=[Tool(name="export", input_schema=schema, annotations=hint)])

    async def call_tool(ctx: Any, params: Any) -> CallToolResult:
        runs.append(params.name)
        return CallToolResult(content=[TextContent(type="text", text=f"run {len(runs)}")])

    server = Server("shop", on_list_tools=list_tools, on_call_tool=call_tool)
    middleware = McpIdempotency(MemoryStore()).install(server)
    async with Client(server) as client:
        for i in range(50):  # made-up names are not kept
            await client.call_tool(f"made-up-{i}", {}, meta=keyed(f"m{i}"))
        assert set(middleware._listed) == {"export"}
        await client.call_tool("export", {}, meta=keyed("k"))
        read_only[0] = False  # the tool now writes; the list is read again after LIST_TTL
        now[0] += sdk.LIST_TTL
        first = await client.call_tool("export", {}, meta=keyed("k"))
        again = await client.call_tool("export", {}, meta=keyed("k"))
    assert text(first) == text(again) == "run 52"
    assert again.meta is not None and again.meta[REPLAY_META]["replayed"] is True


async def list_two(ctx: Any, params: Any) -> Any:
    """The tools of :func:`asking_server` (the client reads them after a result)."""
    from mcp_types import ListToolsResult, Tool

    tools = [Tool(name=n, input_schema={"type": "object"}) for n in ("charge", "confirm")]
    return ListToolsResult(tools=tools)


def asking_server(*, fails: int = 0) -> tuple[Any, list[str]]:
    """A low-level server whose ``confirm`` asks first (MRTR), and whose ``charge``
    raises ``fails`` times (a plain exception), then answers."""
    from mcp.server.lowlevel import Server
    from mcp_types import CallToolResult, InputRequiredResult, TextContent

    runs: list[str] = []

    async def call_tool(ctx: Any, params: Any) -> CallToolResult | InputRequiredResult:
        if params.name == "confirm" and params.request_state is None:
            return InputRequiredResult(request_state="asked")
        runs.append(params.name)
        if params.name == "charge" and len(runs) <= fails:
            raise RuntimeError("card declined")
        return CallToolResult(content=[TextContent(type="text", text=f"{params.name} {len(runs)}")])

    return Server("shop", on_list_tools=list_two, on_call_tool=call_tool), runs


async def test_an_ask_frees_the_key_even_when_failures_are_final() -> None:
    server, runs = asking_server()
    McpIdempotency(Engine(MemoryStore(), final_failures=True)).install(server)
    async with Client(server) as client:
        done = await client.call_tool("confirm", {}, meta=keyed("k"))
        again = await client.call_tool("confirm", {}, meta=keyed("k"))
    assert text(done) == text(again) == "confirm 1" and runs == ["confirm"]
    assert again.meta is not None and again.meta[REPLAY_META]["replayed"] is True


async def test_final_failures_replay_a_plain_exception_as_the_sdk_answers_it() -> None:
    server, runs = asking_server(fails=1)
    McpIdempotency(MemoryStore(), final_failures=True).install(server)
    async with Client(server) as client:
        errors = []
        for _ in range(2):
            with pytest.raises(MCPError) as caught:
                await client.call_tool("charge", {}, meta=keyed("k"))
            errors.append((caught.value.code, caught.value.message))
    assert errors == [(-32603, "Internal server error")] * 2 and runs == ["charge"]


async def test_the_dispatchers_refusals_are_never_kept() -> None:
    """A keyed call the SDK refuses before any tool runs (no tools/call handler:
    -32601) is not its answer, even with final failures: the key stays free."""
    from mcp.server.lowlevel import Server
    from mcp_types import CallToolRequestParams

    server = Server("shop", on_list_tools=list_two)  # no tools/call handler yet
    McpIdempotency(MemoryStore(), final_failures=True).install(server)
    answering, runs = asking_server()
    async with Client(server) as client:
        with pytest.raises(MCPError) as caught:
            await client.call_tool("charge", {}, meta=keyed("k"))
        assert caught.value.code == -32601
        entry = answering.get_request_handler("tools/call")
        assert entry is not None
        server.add_request_handler("tools/call", CallToolRequestParams, entry.handler)
        done = await client.call_tool("charge", {}, meta=keyed("k"))
    assert text(done) == "charge 1" and runs == ["charge"]


async def test_stdio_callers_are_the_local_user_apart_from_named_principals() -> None:
    """The local user and a ``principal=`` that names the same string (or the old
    fixed "stdio") are other callers: a key of one is never the other's."""
    from retrysafe._protocols.mcp import local_principal

    server, _ = charging_server()
    named: list[str | None] = [None]
    McpIdempotency(MemoryStore(), principal=lambda ctx: named[0]).install(server)
    answers = []
    async with Client(server) as client:
        for name in (None, None, "stdio", local_principal()):
            named[0] = name
            answers.append(text(await client.call_tool("export", {"x": 1}, meta=keyed("k"))))
    assert answers == ["export run 1", "export run 1", "export run 2", "export run 3"]
