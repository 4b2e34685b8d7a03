"""``retrysafe mcp-proxy`` in front of a plain MCP server (the official SDK, no
retrysafe), driven by the official SDK's client, over stdio and Streamable HTTP,
on SQLite, Redis and PostgreSQL.

The upstream (tests/mcp_servers/plain.py) counts each tool's executions in a
file shared by every process; ``slow`` blocks until the test releases it.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest
from _http_servers import Process, ThreadServer, free_port
from conftest import store_url
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

ROOT = Path(__file__).resolve().parent.parent
PLAIN = str(Path(__file__).resolve().parent / "mcp_servers" / "plain.py")
META = "dev.retrysafe/idempotencyKey"
EXT = "dev.retrysafe/idempotency"
SHARED = ["sqlite", "redis", "postgres", "mysql"]
#: The per-request fields of a 2026-07-28 request, as the SDK's client sends them.
SESSION = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"},
    "io.modelcontextprotocol/clientCapabilities": {},
}


def proxy_argv(store: str, folder: Path, *options: str) -> list[str]:
    """``retrysafe mcp-proxy`` over stdio in front of the plain server."""
    return [
        sys.executable,
        "-m",
        "retrysafe",
        "mcp-proxy",
        "--store",
        store,
        *options,
        "--",
        sys.executable,
        PLAIN,
        str(folder),
    ]


def runs(folder: Path, tool: str = "charge") -> int:
    """How many times ``tool`` ran upstream, in every process."""
    log = folder / f"{tool}.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def text(result: Any) -> str:
    return str(result.content[0].text)


def keyed(key: str) -> dict[str, Any]:
    return {META: key}


async def replays_and_conflicts(client: Client) -> None:
    """The extension is advertised; a retry is the replay; other arguments conflict."""
    assert EXT in (client.server_capabilities.extensions or {})
    first = await client.call_tool("charge", {"amount": 5}, meta=keyed("order-1"))
    again = await client.call_tool("charge", {"amount": 5}, meta=keyed("order-1"))
    assert text(again) == text(first) == "charged 5 (execution 1)"
    assert (again.meta or {})[EXT]["replayed"] is True
    with pytest.raises(MCPError) as caught:
        await client.call_tool("charge", {"amount": 6}, meta=keyed("order-1"))
    assert caught.value.code == -32602
    assert caught.value.data["code"] == "idempotency_conflict"


@asynccontextmanager
async def stdio_client(
    store: str, folder: Path, *options: str, mode: str = "auto"
) -> AsyncIterator[Client]:
    argv = proxy_argv(store, folder, *options)
    # The SDK gives the child a minimal environment: the tests' own PYTHONPATH too.
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    params = StdioServerParameters(command=argv[0], args=argv[1:], cwd=str(ROOT), env=env)
    async with Client(params, mode=mode) as client:
        yield client


@pytest.fixture(params=SHARED)
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return store_url(request.param, request, tmp_path)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "upstream"
    path.mkdir()
    return path


# -- stdio ------------------------------------------------------------------------------


async def test_stdio_retry_replays_and_conflicts(shared_url: str, folder: Path) -> None:
    async with stdio_client(shared_url, folder) as client:
        await replays_and_conflicts(client)
        # Unkeyed calls pass through, every time.
        await client.call_tool("charge", {"amount": 1})
    assert runs(folder) == 2
    # Another proxy process on the same store replays too.
    async with stdio_client(shared_url, folder) as client:
        later = await client.call_tool("charge", {"amount": 5}, meta=keyed("order-1"))
    assert text(later) == "charged 5 (execution 1)"
    assert runs(folder) == 2


@pytest.mark.parametrize(("first", "then"), [("legacy", "auto"), ("auto", "legacy")])
async def test_stdio_replay_fits_the_retrying_clients_protocol(
    tmp_path: Path, folder: Path, first: str, then: str
) -> None:
    """An answer recorded for a 2025-06-18 client replays to a 2026-07-28 one (which
    requires resultType), and the other way round."""
    url = f"sqlite:///{tmp_path}/s.db"
    async with stdio_client(url, folder, mode=first) as client:
        one = await client.call_tool("charge", {"amount": 1}, meta=keyed("v-1"))
    async with stdio_client(url, folder, mode=then) as client:
        again = await client.call_tool("charge", {"amount": 1}, meta=keyed("v-1"))
    assert text(one) == text(again) == "charged 1 (execution 1)"
    assert (again.meta or {})[EXT]["replayed"] is True


def _raw_proxy(
    store: str, folder: Path, *options: str, stderr: int | None = None
) -> subprocess.Popen[bytes]:
    """The proxy as a bare subprocess: a client that writes lines and may never read."""
    proc = subprocess.Popen(
        proxy_argv(store, folder, *options),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        cwd=ROOT,
    )
    assert proc.stdin is not None and proc.stdout is not None
    _send(
        proc, {"jsonrpc": "2.0", "id": 0, "method": "server/discover", "params": {"_meta": SESSION}}
    )
    assert json.loads(proc.stdout.readline())["id"] == 0
    return proc


def _send(proc: subprocess.Popen[bytes], message: dict[str, Any]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(message).encode() + b"\n")
    proc.stdin.flush()


def _call(request_id: int, tool: str, arguments: dict[str, Any], key: str) -> dict[str, Any]:
    params = {"name": tool, "arguments": arguments, "_meta": {**SESSION, **keyed(key)}}
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params}


def _kill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def _wait_for(path: Path) -> None:
    """Wait until the upstream creates ``path`` (it does so as ``slow`` starts)."""
    for _ in range(3000):
        if path.exists():
            return
        select.select([], [], [], 0.02)
    raise AssertionError(f"{path.name} never appeared")


async def test_stdio_answer_lost_after_the_record_is_a_replay(
    shared_url: str, folder: Path
) -> None:
    """Killed once the answer is recorded and written, before the client read it:
    the retry through a new proxy on the same store is the replay."""
    proc = _raw_proxy(shared_url, folder)
    _send(proc, _call(1, "charge", {"amount": 7}, "lost-1"))
    # The proxy records, then writes: a readable answer is a recorded one. Not read.
    assert proc.stdout is not None
    readable, _, _ = select.select([proc.stdout], [], [], 60)
    assert readable
    _kill(proc)
    assert runs(folder) == 1
    async with stdio_client(shared_url, folder) as client:
        retry = await client.call_tool("charge", {"amount": 7}, meta=keyed("lost-1"))
    assert text(retry) == "charged 7 (execution 1)"
    assert (retry.meta or {})[EXT]["replayed"] is True
    assert runs(folder) == 1


async def test_stdio_killed_mid_call_is_in_flight_after_restart(
    shared_url: str, folder: Path
) -> None:
    """SIGKILL while ``slow`` runs: the restarted proxy answers in flight while the
    first call's lease lives, and runs nothing."""
    proc = _raw_proxy(shared_url, folder, "--lease", "10m")
    _send(proc, _call(1, "slow", {"tag": "a"}, "slow-1"))
    _wait_for(folder / "slow.started")
    _kill(proc)
    try:
        async with stdio_client(shared_url, folder) as client:
            with pytest.raises(MCPError) as caught:
                await client.call_tool("slow", {"tag": "a"}, meta=keyed("slow-1"))
    finally:
        (folder / "slow.release").write_text("go")
    assert caught.value.code == -32603
    assert caught.value.data["code"] == "idempotency_in_flight"
    assert caught.value.data["retryable"] is True
    assert caught.value.data["retryAfter"] >= 1
    assert runs(folder, "slow") == 1


async def test_stdio_client_closing_at_once_still_gets_its_call_recorded(
    tmp_path: Path, folder: Path
) -> None:
    """The client writes a keyed call and closes its side: the proxy still records
    and writes the answer before it exits with the server's status."""
    url = f"sqlite:///{tmp_path}/s.db"
    proc = _raw_proxy(url, folder)
    assert proc.stdin is not None and proc.stdout is not None
    _send(proc, _call(1, "charge", {"amount": 8}, "eof-1"))
    proc.stdin.close()
    lines = proc.stdout.read().splitlines()
    assert proc.wait(60) == 0
    proc.stdout.close()
    assert [json.loads(line)["id"] for line in lines] == [1]
    async with stdio_client(url, folder) as client:
        retry = await client.call_tool("charge", {"amount": 8}, meta=keyed("eof-1"))
    assert (retry.meta or {})[EXT]["replayed"] is True
    assert runs(folder) == 1


def test_stdio_cancelled_keyed_call_runs_to_its_end(tmp_path: Path, folder: Path) -> None:
    """A keyed call the client cancels is not cancelled upstream: it runs to its end
    and is recorded, its late answer is dropped; the retry is in flight, then the
    replay. One execution."""
    proc = _raw_proxy(f"sqlite:///{tmp_path}/s.db", folder)
    assert proc.stdout is not None
    _send(proc, _call(1, "slow", {"tag": "a"}, "cancel-1"))
    _wait_for(folder / "slow.started")
    cancel = {"requestId": 1, "reason": "the client timed out"}
    _send(proc, {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": cancel})
    _send(proc, _call(2, "slow", {"tag": "a"}, "cancel-1"))
    busy = json.loads(proc.stdout.readline())
    assert busy["id"] == 2 and busy["error"]["data"]["code"] == "idempotency_in_flight"
    (folder / "slow.release").write_text("go")
    answers = []
    for request_id in range(3, 3000):  # until the first call is recorded
        _send(proc, _call(request_id, "slow", {"tag": "a"}, "cancel-1"))
        answers.append(answer := json.loads(proc.stdout.readline()))
        if "result" in answer:
            break
        assert answer["error"]["data"]["code"] == "idempotency_in_flight", answer
        select.select([], [], [], 0.02)
    _kill(proc)
    assert all(a["id"] != 1 for a in answers)  # the cancelled request gets no answer
    assert answer["result"]["content"][0]["text"] == "slow a (execution 1)"
    assert answer["result"]["_meta"][EXT]["replayed"] is True
    assert runs(folder, "slow") == 1


def test_stdio_server_dying_mid_call_is_a_retryable_error_with_a_code(tmp_path: Path) -> None:
    """The server exits without answering a keyed call: -32603, data.code
    server_unavailable, retryable."""
    gone = [sys.executable, "-c", "import sys; sys.stdin.readline()"]
    argv = [sys.executable, "-m", "retrysafe", "mcp-proxy", "--store", f"sqlite:///{tmp_path}/s.db"]
    proc = subprocess.Popen([*argv, "--", *gone], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    _send(proc, _call(1, "charge", {"amount": 1}, "gone-1"))
    assert proc.stdout is not None
    answer = json.loads(proc.stdout.readline())
    _kill(proc)
    assert answer["id"] == 1 and answer["error"]["code"] == -32603
    assert answer["error"]["data"] == {"code": "server_unavailable", "retryable": True}


async def test_stdio_concurrent_duplicates_run_once(tmp_path: Path, folder: Path) -> None:
    """Many tasks on one client, and several processes each with its own proxy."""
    url = f"sqlite:///{tmp_path}/shared.db"

    async def one_client(calls: int) -> list[str]:
        async with stdio_client(url, folder) as client:
            outcomes = await asyncio.gather(
                *(
                    client.call_tool("charge", {"amount": 9}, meta=keyed("storm-1"))
                    for _ in range(calls)
                ),
                return_exceptions=True,
            )
        seen = []
        for outcome in outcomes:
            if isinstance(outcome, MCPError):
                assert outcome.data["code"] == "idempotency_in_flight", outcome
                seen.append("in flight")
            else:
                assert not isinstance(outcome, BaseException), outcome
                seen.append(text(outcome))
        return seen

    answers = await asyncio.gather(*(one_client(6) for _ in range(4)))
    assert runs(folder) == 1
    done = {a for group in answers for a in group if a != "in flight"}
    assert done <= {"charged 9 (execution 1)"}


async def test_stdio_principals_and_read_only(tmp_path: Path, folder: Path) -> None:
    url = f"sqlite:///{tmp_path}/shared.db"
    for name in ("alice", "bob", "alice"):
        async with stdio_client(url, folder, "--principal", name) as client:
            await client.call_tool("charge", {"amount": 2}, meta=keyed("same-key"))
    assert runs(folder) == 2  # alice once, bob once
    async with stdio_client(url, folder) as client:
        await client.list_tools()  # the proxy learns that lookup is read-only
        for _ in range(2):
            await client.call_tool("lookup", {"name": "x"}, meta=keyed("read-1"))
    assert runs(folder, "lookup") == 2


async def test_stdio_bad_keys_are_invalid_params_and_never_forwarded(
    tmp_path: Path, folder: Path
) -> None:
    url = f"sqlite:///{tmp_path}/shared.db"
    async with stdio_client(url, folder) as client:
        for bad in ("", "k" * 1025, 42):
            with pytest.raises(MCPError) as caught:
                await client.call_tool("charge", {"amount": 1}, meta={META: bad})
            assert caught.value.code == -32602
            assert caught.value.data["code"] == "idempotency_key_invalid"
    assert runs(folder) == 0


def test_stdio_malformed_and_over_long_lines(tmp_path: Path, folder: Path) -> None:
    """A line that is not JSON passes through; one over the limit is refused; the
    proxy keeps relaying."""
    proc = _raw_proxy(f"sqlite:///{tmp_path}/s.db", folder, "--max-body", "4096")
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"not json\n")
    proc.stdin.write(
        b'{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"x":"' + b"y" * 5000 + b'"}}\n'
    )
    proc.stdin.flush()
    refused = json.loads(proc.stdout.readline())
    assert refused["id"] is None and refused["error"]["code"] == -32600
    two = _call(6, "charge", {"amount": 3}, "a")
    two["params"]["idempotencyKey"] = "b"
    _send(proc, two)
    refused = json.loads(proc.stdout.readline())
    assert refused["id"] == 6 and refused["error"]["code"] == -32602
    _send(proc, _call(7, "charge", {"amount": 3}, "after-1"))
    answer = json.loads(proc.stdout.readline())
    assert answer["id"] == 7 and "result" in answer
    _kill(proc)
    assert runs(folder) == 1


def _answer(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    assert proc.stdout is not None
    answer: dict[str, Any] = json.loads(proc.stdout.readline())
    return answer


async def test_stdio_reused_and_unmatchable_ids_are_refused(tmp_path: Path, folder: Path) -> None:
    """A request reusing the id of a keyed call still running is refused, never
    forwarded (its answer was taken for the call's and recorded under its key); so is
    a keyed call whose id an answer may not match."""
    url = f"sqlite:///{tmp_path}/s.db"
    proc = _raw_proxy(url, folder)
    _send(proc, _call(1, "slow", {"tag": "a"}, "slow-1"))
    _wait_for(folder / "slow.started")
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": SESSION}}
    for reused in (listing, _call(1, "charge", {"amount": 1}, "other-1")):
        _send(proc, reused)
        refused = _answer(proc)
        assert refused["id"] == 1 and refused["error"]["code"] == -32600, refused
    for odd in (None, 1.5, 4.0, 2**53 + 1, True):
        _send(proc, _call(2, "charge", {"amount": 1}, "odd-1") | {"id": odd})
        refused = _answer(proc)
        assert refused["id"] == odd and refused["error"]["code"] == -32600, refused
    (folder / "slow.release").write_text("go")
    answer = _answer(proc)
    assert answer["id"] == 1 and answer["result"]["content"][0]["text"] == "slow a (execution 1)"
    _send(proc, _call(3, "slow", {"tag": "a"}, "slow-1"))
    replay = _answer(proc)
    assert replay["result"]["content"][0]["text"] == "slow a (execution 1)"
    _kill(proc)
    assert runs(folder) == 0 and runs(folder, "slow") == 1


def test_stdio_non_string_method_passes_through(tmp_path: Path, folder: Path) -> None:
    """A method that is not a string is the server's to refuse: the relay goes on."""
    proc = _raw_proxy(f"sqlite:///{tmp_path}/s.db", folder)
    _send(proc, {"jsonrpc": "2.0", "id": 3, "method": ["x"]})
    _send(proc, {"jsonrpc": "2.0", "id": 4, "method": {"a": 1}})
    _send(proc, _call(5, "charge", {"amount": 3}, "after-1"))
    while (answer := _answer(proc))["id"] != 5:
        assert "error" in answer, answer
    assert "result" in answer
    _kill(proc)
    assert runs(folder) == 1


async def test_stdio_client_that_stops_reading(tmp_path: Path, folder: Path) -> None:
    """The client closes the proxy's stdout but not its stdin: the answer is recorded,
    the proxy ends its server and exits, without a traceback."""
    url = f"sqlite:///{tmp_path}/s.db"
    proc = _raw_proxy(url, folder, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    _send(proc, _call(1, "charge", {"amount": 4}, "gone-1"))
    proc.wait(60)  # its server's status (terminated if it is slow to exit at EOF)
    assert b"Traceback" not in proc.stderr.read()
    for pipe in (proc.stdin, proc.stderr):
        assert pipe is not None
        pipe.close()
    async with stdio_client(url, folder) as client:
        retry = await client.call_tool("charge", {"amount": 4}, meta=keyed("gone-1"))
    assert (retry.meta or {})[EXT]["replayed"] is True
    assert runs(folder) == 1


def test_stdio_long_answer_on_a_socket_shared_by_stdin_and_stdout(
    tmp_path: Path, folder: Path
) -> None:
    """stdin and stdout one socket (made non-blocking by the reader): a 3 MB answer
    to a client that reads late arrives whole."""
    mine, theirs = socket.socketpair()
    argv = proxy_argv(f"sqlite:///{tmp_path}/s.db", folder)
    proc = subprocess.Popen(argv, stdin=theirs, stdout=theirs, cwd=ROOT)
    theirs.close()
    size = 3_000_000
    mine.sendall(json.dumps(_call(1, "report", {"size": size}, "big-1")).encode() + b"\n")
    with mine.makefile("rb") as lines:
        readable, _, _ = select.select([mine], [], [], 60)
        assert readable
        answer = json.loads(lines.readline())
    assert answer["result"]["content"][0]["text"] == "r" * size
    mine.close()
    assert proc.wait(60) == 0


def test_stdio_long_lines_other_than_tools_call_and_a_last_line(
    tmp_path: Path, folder: Path
) -> None:
    """A line over --max-body that is not a tools/call (the client's answer to a
    server's request, here a tools/list) is relayed; the last line, without its newline,
    reaches the server at once."""
    url = f"sqlite:///{tmp_path}/s.db"
    proc = _raw_proxy(url, folder, "--max-body", "4096", "--lease", "10m")
    assert proc.stdin is not None and proc.stdout is not None
    listing = {"jsonrpc": "2.0", "id": 9, "method": "tools/list", "params": {"_meta": SESSION}}
    listing["params"]["pad"] = "y" * 10_000
    _send(proc, listing)
    assert "tools" in _answer(proc)["result"]
    proc.stdin.write(json.dumps(_call(1, "charge", {"amount": 8}, "last-1")).encode())
    out, _ = proc.communicate(timeout=60)
    assert [json.loads(line)["id"] for line in out.splitlines()] == [1]
    assert proc.returncode == 0 and runs(folder) == 1


def test_stdio_server_that_ignores_eof_is_terminated(tmp_path: Path) -> None:
    """The client closes: a server that does not exit at EOF is terminated after a
    grace period, the proxy exits."""
    deaf = "import signal, sys, time; sys.stdin.read(); time.sleep(600)"
    argv = [sys.executable, "-m", "retrysafe", "mcp-proxy", "--store", f"sqlite:///{tmp_path}/s.db"]
    proc = subprocess.Popen(
        [*argv, "--", sys.executable, "-c", deaf], stdin=subprocess.PIPE, cwd=ROOT
    )
    proc.communicate(b"", timeout=60)
    assert proc.returncode != 0  # the server's status: terminated


# -- Streamable HTTP --------------------------------------------------------------------


def _start(argv: list[str], port: int) -> Process:
    server = Process(argv, port, health="/mcp")
    server.__enter__()
    return server


def _proxy_process(store: str, upstream: int, port: int, *options: str) -> Process:
    argv = [
        sys.executable,
        "-m",
        "retrysafe",
        "mcp-proxy",
        "--upstream",
        f"http://127.0.0.1:{upstream}/mcp",
        "--listen",
        f"127.0.0.1:{port}",
        "--store",
        store,
        *options,
    ]
    return _start(argv, port)


def _sigkill(server: Process) -> None:
    assert server.proc is not None
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(30)
    if server.proc.stdout:
        server.proc.stdout.close()


@contextmanager
def http_proxy(store: str, folder: Path, *options: str) -> Iterator[tuple[Process, Process]]:
    """The plain server on Streamable HTTP, and the proxy in front: (upstream, proxy)."""
    up = _start([sys.executable, PLAIN, str(folder), "--http", str(port := free_port())], port)
    try:
        proxy = _proxy_process(store, up.port, free_port(), *options)
        try:
            yield up, proxy
        finally:
            proxy.__exit__()
    finally:
        up.__exit__()


@asynccontextmanager
async def http_client(
    url: str, mode: str = "auto", headers: dict[str, str] | None = None
) -> AsyncIterator[Client]:
    transport = streamable_http_client(
        f"{url}/mcp", http_client=httpx2.AsyncClient(headers=headers or {}, timeout=120)
    )
    async with Client(transport, mode=mode) as client:
        yield client


#: auto: the 2026-07-28 protocol, answered as application/json; legacy: initialize
#: and a session, answered as text/event-stream.
MODES = ["auto", "legacy"]


@pytest.mark.parametrize("mode", MODES)
async def test_http_retry_replays_conflicts_and_scopes(
    shared_url: str, folder: Path, mode: str
) -> None:
    with http_proxy(shared_url, folder) as (_, proxy):
        alice = {"Authorization": "Bearer alice-token"}
        async with http_client(proxy.url, mode, alice) as client:
            await replays_and_conflicts(client)
            await client.list_tools()  # the proxy learns that lookup is read-only
            for _ in range(2):
                await client.call_tool("lookup", {"name": "x"}, meta=keyed("read-1"))
        assert runs(folder) == 1
        assert runs(folder, "lookup") == 2
        # Another bearer token is another caller: the same key runs once for it.
        bob = {"Authorization": "Bearer bob-token"}
        async with http_client(proxy.url, mode, bob) as client:
            theirs = await client.call_tool("charge", {"amount": 5}, meta=keyed("order-1"))
            again = await client.call_tool("charge", {"amount": 5}, meta=keyed("order-1"))
        assert text(theirs) == text(again) == "charged 5 (execution 2)"
        assert runs(folder) == 2
        # The key in the Idempotency-Key header.
        async with http_client(proxy.url, mode, {**alice, "Idempotency-Key": "h-1"}) as client:
            one = await client.call_tool("charge", {"amount": 1})
            two = await client.call_tool("charge", {"amount": 1})
        assert text(one) == text(two) == "charged 1 (execution 3)"
    assert runs(folder) == 3


async def test_http_replay_fits_the_retrying_clients_protocol(tmp_path: Path, folder: Path) -> None:
    """Recorded for a 2025-06-18 client (SSE), replayed to a 2026-07-28 one (JSON)."""
    token = {"Authorization": "Bearer t"}
    with http_proxy(f"sqlite:///{tmp_path}/s.db", folder) as (_, proxy):
        async with http_client(proxy.url, "legacy", token) as client:
            one = await client.call_tool("charge", {"amount": 1}, meta=keyed("v-1"))
        async with http_client(proxy.url, "auto", token) as client:
            again = await client.call_tool("charge", {"amount": 1}, meta=keyed("v-1"))
    assert text(one) == text(again) == "charged 1 (execution 1)"
    assert (again.meta or {})[EXT]["replayed"] is True


async def test_http_bad_keys_are_invalid_params_and_never_forwarded(
    tmp_path: Path, folder: Path
) -> None:
    with http_proxy(f"sqlite:///{tmp_path}/s.db", folder) as (_, proxy):
        token = {"Authorization": "Bearer t"}
        async with http_client(proxy.url, "auto", token) as client:
            for bad in ("", "k" * 1025, 42):
                with pytest.raises(MCPError) as caught:
                    await client.call_tool("charge", {"amount": 1}, meta={META: bad})
                assert caught.value.code == -32602
                assert caught.value.data["code"] == "idempotency_key_invalid"
        headers = {**token, "Idempotency-Key": "other"}
        async with http_client(proxy.url, "auto", headers) as client:
            with pytest.raises(MCPError) as caught:
                await client.call_tool("charge", {"amount": 1}, meta=keyed("one"))
            assert caught.value.code == -32602
    assert runs(folder) == 0


async def test_http_keyed_call_without_credentials_is_refused_by_default(
    tmp_path: Path, folder: Path
) -> None:
    """A keyed call nobody can name is refused (-32600), never forwarded: run
    unrecorded, its client's retries would run it again. Unkeyed calls pass."""
    with http_proxy(f"sqlite:///{tmp_path}/s.db", folder) as (_, proxy):
        async with http_client(proxy.url, "auto") as client:
            with pytest.raises(MCPError) as caught:
                await client.call_tool("charge", {"amount": 1}, meta=keyed("anon-1"))
            assert runs(folder) == 0
            await client.call_tool("charge", {"amount": 1})
    assert caught.value.code == -32600
    assert caught.value.data["code"] == "idempotency_principal_required"
    assert runs(folder) == 1


async def test_middleware_names_the_caller_of_keyed_calls_only(tmp_path: Path) -> None:
    """An unkeyed tools/call reaches the app whoever sends it (no credentials, two
    different Authorization lines); a keyed one from either is refused."""
    from retrysafe.mcp import McpProxyMiddleware

    reached = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        request = json.loads((await receive())["body"])
        reached.append(request["id"])
        body = json.dumps({"jsonrpc": "2.0", "id": request["id"], "result": {"content": []}})
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body.encode()})

    unkeyed = {"name": "charge", "arguments": {"amount": 1}}
    middleware = McpProxyMiddleware(app, f"sqlite:///{tmp_path}/s.db")
    two = [("Authorization", "Bearer a"), ("Authorization", "Bearer b")]
    with ThreadServer(middleware, "asgi") as server:
        async with httpx2.AsyncClient() as raw:
            for request_id, headers in enumerate(([], two)):
                call = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call"}
                answer = await raw.post(
                    f"{server.url}/mcp", json={**call, "params": unkeyed}, headers=headers
                )
                assert answer.json()["result"] == {"content": []}
                keyed_call = _call(10 + request_id, "charge", {"amount": 1}, "k")
                refused = await raw.post(f"{server.url}/mcp", json=keyed_call, headers=headers)
                assert refused.json()["error"]["code"] == -32600
    assert reached == [0, 1]


@pytest.mark.parametrize(("anonymous", "executions"), [("share", 1), ("run", 2)])
async def test_middleware_anonymous_share_and_run_are_explicit(
    tmp_path: Path, folder: Path, anonymous: Any, executions: int
) -> None:
    from mcp_servers.plain import make_server

    from retrysafe.mcp import McpProxyMiddleware

    app = McpProxyMiddleware(
        make_server(folder).streamable_http_app(),
        f"sqlite:///{tmp_path}/s.db",
        anonymous=anonymous,
    )
    with ThreadServer(app, "asgi") as server:
        async with http_client(server.url, "auto") as client:
            for _ in range(2):
                await client.call_tool("charge", {"amount": 2}, meta=keyed("anon-2"))
    assert runs(folder) == executions


async def test_http_proxy_has_the_gateways_limits_on_clients(tmp_path: Path, folder: Path) -> None:
    """A request head over 64 KiB is answered 431 by the proxy, as by the gateway;
    --timeout must be positive."""
    with http_proxy(f"sqlite:///{tmp_path}/s.db", folder) as (_, proxy):
        async with httpx2.AsyncClient() as raw:
            answer = await raw.post(
                f"{proxy.url}/mcp",
                json=_call(1, "charge", {"amount": 1}, "h"),
                headers={"Authorization": "Bearer t", "X-Pad": "p" * (70 << 10)},
            )
    assert answer.status_code == 431
    assert runs(folder) == 0
    bad = [sys.executable, "-m", "retrysafe", "mcp-proxy", "--upstream", "http://127.0.0.1:9/mcp"]
    done = subprocess.run([*bad, "--timeout", "0"], capture_output=True, timeout=60)
    assert done.returncode == 2 and b"--timeout" in done.stderr


@pytest.mark.parametrize("option", [["--anonymous", "share"], ["--principal-header", "x-key"]])
def test_stdio_refuses_the_http_callers_options(tmp_path: Path, option: list[str]) -> None:
    """--anonymous and --principal-header mean nothing over stdio: refused, not ignored."""
    argv = proxy_argv(f"sqlite:///{tmp_path}/s.db", tmp_path, *option)
    done = subprocess.run(argv, capture_output=True, timeout=60)
    assert done.returncode == 2 and option[0].encode() in done.stderr


async def test_http_concurrent_duplicates_run_once(tmp_path: Path, folder: Path) -> None:
    """Many tasks on several clients, through two proxies that share one store."""
    url = f"sqlite:///{tmp_path}/s.db"
    with http_proxy(url, folder) as (up, proxy):
        second = _proxy_process(url, up.port, free_port())
        try:

            async def one_client(at: str) -> list[str]:
                async with http_client(at, "auto", {"Authorization": "Bearer t"}) as client:
                    outcomes = await asyncio.gather(
                        *(
                            client.call_tool("charge", {"amount": 9}, meta=keyed("storm-1"))
                            for _ in range(6)
                        ),
                        return_exceptions=True,
                    )
                seen = []
                for outcome in outcomes:
                    if isinstance(outcome, MCPError):
                        assert outcome.data["code"] == "idempotency_in_flight", outcome
                    else:
                        assert not isinstance(outcome, BaseException), outcome
                        seen.append(text(outcome))
                return seen

            answers = await asyncio.gather(
                *(one_client(at) for at in (proxy.url, second.url, proxy.url, second.url))
            )
        finally:
            second.__exit__()
    assert runs(folder) == 1
    assert {a for group in answers for a in group} == {"charged 9 (execution 1)"}


async def test_http_killed_mid_call_is_in_flight_after_restart(
    shared_url: str, folder: Path
) -> None:
    """SIGKILL the proxy while ``slow`` runs upstream (which keeps running); the
    proxy restarted on the same store answers in flight, and runs nothing."""
    token = {"Authorization": "Bearer t"}
    with http_proxy(shared_url, folder, "--lease", "10m") as (up, proxy):

        async def first() -> None:
            async with http_client(proxy.url, "auto", token) as client:
                await client.call_tool("slow", {"tag": "a"}, meta=keyed("slow-1"))

        call = asyncio.create_task(first())
        try:
            await asyncio.to_thread(_wait_for, folder / "slow.started")
            _sigkill(proxy)
            (lost,) = await asyncio.gather(call, return_exceptions=True)
            assert isinstance(lost, BaseException)  # the answer never came
            again = _proxy_process(shared_url, up.port, proxy.port, "--lease", "10m")
            try:
                async with http_client(again.url, "auto", token) as client:
                    with pytest.raises(MCPError) as caught:
                        await client.call_tool("slow", {"tag": "a"}, meta=keyed("slow-1"))
            finally:
                again.__exit__()
        finally:
            (folder / "slow.release").write_text("go")
            call.cancel()
    assert caught.value.data["code"] == "idempotency_in_flight"
    assert caught.value.data["retryable"] is True
    assert runs(folder, "slow") == 1


async def test_http_answer_lost_after_the_record_is_a_replay(shared_url: str, folder: Path) -> None:
    """Killed once the answer is recorded (the proxy sends nothing before), before
    the client read it: the retry through the restarted proxy is the replay."""
    token = {"Authorization": "Bearer t"}
    with http_proxy(shared_url, folder) as (up, proxy):
        body = json.dumps(_call(1, "charge", {"amount": 7}, "lost-1")).encode()
        head = (
            f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{proxy.port}\r\n"
            "Authorization: Bearer t\r\nContent-Type: application/json\r\n"
            "Accept: application/json, text/event-stream\r\n"
            "MCP-Protocol-Version: 2026-07-28\r\nMcp-Method: tools/call\r\nMcp-Name: charge\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            sock.sendall(head + body)
            readable, _, _ = select.select([sock], [], [], 60)  # never read
            assert readable
            _sigkill(proxy)
        assert runs(folder) == 1
        again = _proxy_process(shared_url, up.port, proxy.port)
        try:
            async with http_client(again.url, "auto", token) as client:
                retry = await client.call_tool("charge", {"amount": 7}, meta=keyed("lost-1"))
        finally:
            again.__exit__()
    assert text(retry) == "charged 7 (execution 1)"
    assert (retry.meta or {})[EXT]["replayed"] is True
    assert runs(folder) == 1


async def test_middleware_in_front_of_a_python_asgi_app(tmp_path: Path, folder: Path) -> None:
    """The proxy's middleware on its own, around the SDK's own ASGI app (JSON and SSE)."""
    from mcp_servers.plain import make_server

    from retrysafe.mcp import McpProxyMiddleware

    app = McpProxyMiddleware(
        make_server(folder).streamable_http_app(), f"sqlite:///{tmp_path}/s.db", max_body=4096
    )
    with ThreadServer(app, "asgi") as server:
        for mode in MODES:
            async with http_client(server.url, mode, {"Authorization": "Bearer t"}) as client:
                first = await client.call_tool("charge", {"amount": 4}, meta=keyed("mw-1"))
                again = await client.call_tool("charge", {"amount": 4}, meta=keyed("mw-1"))
            assert text(first) == text(again) == "charged 4 (execution 1)"
        # A body over max_body is refused whole: nothing reaches the app.
        big = _call(9, "charge", {"amount": 1, "pad": "x" * 5000}, "mw-2")
        async with httpx2.AsyncClient() as raw:
            answer = await raw.post(f"{server.url}/mcp", json=big)
        assert answer.status_code == 413
        assert answer.json()["error"]["code"] == -32600
    assert runs(folder) == 1


async def test_http_upstream_down_is_a_json_rpc_error_with_a_code(tmp_path: Path) -> None:
    """The forwarder's 502 to a keyed call reaches the MCP client as a JSON-RPC error
    it can read (data.code, retryable), and the attempt is not kept in flight."""
    from retrysafe.gateway import forwarder
    from retrysafe.mcp import McpProxyMiddleware

    down = forwarder(f"http://127.0.0.1:{free_port()}", timeout=5)
    app = McpProxyMiddleware(down, f"sqlite:///{tmp_path}/s.db")
    headers = {"Authorization": "Bearer t", "Accept": "application/json, text/event-stream"}
    with ThreadServer(app, "asgi") as server:
        async with httpx2.AsyncClient(headers=headers) as raw:
            for _ in range(2):  # the second is not "in flight": the first failed
                answer = await raw.post(
                    f"{server.url}/mcp", json=_call(1, "charge", {"amount": 1}, "down-1")
                )
                assert answer.status_code == 200
                assert answer.headers["content-type"] == "application/json"
                error = answer.json()["error"]
                assert error["code"] == -32603
                assert error["data"]["code"] == "upstream_unavailable"
                assert error["data"]["retryable"] is True


async def test_http_big_notification_before_the_response_is_streamed_unread(
    tmp_path: Path,
) -> None:
    """An SSE event over max_body that is not the response (a big log notification)
    goes on unread, in pieces; the small response after it is recorded and replayed."""
    from retrysafe.mcp import McpProxyMiddleware

    executions = 0
    note = {"jsonrpc": "2.0", "method": "notifications/message", "params": {"data": "n" * 6000}}
    streamed = b"event: message\r\ndata: " + json.dumps(note).encode() + b"\r\n\r\n"

    async def sse_app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal executions
        request = json.loads((await receive())["body"])
        executions += 1
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for at in range(0, len(streamed), 1000):
            body = streamed[at : at + 1000]
            await send({"type": "http.response.body", "body": body, "more_body": True})
        content = [{"type": "text", "text": f"ok {executions}"}]
        answer = {"jsonrpc": "2.0", "id": request["id"], "result": {"content": content}}
        body = b"data: " + json.dumps(answer).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": body, "more_body": False})

    app = McpProxyMiddleware(sse_app, f"sqlite:///{tmp_path}/s.db", max_body=4096)
    headers = {"Authorization": "Bearer t", "Accept": "application/json, text/event-stream"}
    with ThreadServer(app, "asgi") as server:
        async with httpx2.AsyncClient(headers=headers) as raw:
            url = f"{server.url}/mcp"
            first = await raw.post(url, json=_call(1, "charge", {"amount": 1}, "note-1"))
            again = await raw.post(url, json=_call(2, "charge", {"amount": 1}, "note-1"))
    lf = first.content.replace(b"\r\n", b"\n")  # the proxy may end lines either way
    assert lf.startswith(streamed.replace(b"\r\n", b"\n"))
    assert b'"text": "ok 1"' in first.content
    assert again.json()["result"]["content"][0]["text"] == "ok 1"
    assert again.json()["result"]["_meta"][EXT]["replayed"] is True
    assert executions == 1


async def test_http_stream_cut_before_the_response_leaves_the_call_in_flight(
    tmp_path: Path,
) -> None:
    """A server that closes a call's SSE stream before the response (to answer later,
    or the connection broke) may still be running the tool: the key stays held (its
    repeat is "in flight") instead of being freed for a second run."""
    from retrysafe.mcp import McpProxyMiddleware

    executions = 0

    async def cut_app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal executions
        if scope["type"] != "http":
            return
        await receive()
        executions += 1
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        note = {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}}
        body = b"data: " + json.dumps(note).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": body, "more_body": False})

    app = McpProxyMiddleware(cut_app, f"sqlite:///{tmp_path}/s.db", lease=600)
    headers = {"Authorization": "Bearer t", "Accept": "application/json, text/event-stream"}
    with ThreadServer(app, "asgi") as server:
        async with httpx2.AsyncClient(headers=headers) as raw:
            url = f"{server.url}/mcp"
            first = await raw.post(url, json=_call(1, "charge", {"amount": 1}, "cut-1"))
            again = await raw.post(url, json=_call(2, "charge", {"amount": 1}, "cut-1"))
    assert b"notifications/progress" in first.content
    assert again.json()["error"]["data"]["code"] == "idempotency_in_flight"
    assert executions == 1


async def test_http_non_string_method_passes_through(tmp_path: Path, folder: Path) -> None:
    """A method that is not a string reaches the app, which judges it (was a 500)."""
    from mcp_servers.plain import make_server

    from retrysafe.mcp import McpProxyMiddleware

    app = McpProxyMiddleware(
        make_server(folder).streamable_http_app(), f"sqlite:///{tmp_path}/s.db"
    )
    with ThreadServer(app, "asgi") as server:
        async with httpx2.AsyncClient() as raw:
            for method in (["x"], {"a": 1}):
                odd = {"jsonrpc": "2.0", "id": 3, "method": method}
                answer = await raw.post(f"{server.url}/mcp", json=odd)
                assert answer.status_code < 500, answer.text


async def over_limit_runs_once(client: Client, folder: Path) -> None:
    """An answer over max_body reaches the client unrecorded; the retry is refused
    (failed finally), never run again."""
    first = await client.call_tool("report", {"size": 6000}, meta=keyed("big-1"))
    assert text(first) == "r" * 6000
    with pytest.raises(MCPError) as caught:
        await client.call_tool("report", {"size": 6000}, meta=keyed("big-1"))
    assert caught.value.data["code"] == "idempotency_failed"
    assert runs(folder, "report") == 1


async def test_answer_over_max_body_never_runs_again(tmp_path: Path, folder: Path) -> None:
    async with stdio_client(f"sqlite:///{tmp_path}/a.db", folder, "--max-body", "4096") as client:
        await over_limit_runs_once(client, folder)
    (folder / "report.log").unlink()
    with http_proxy(f"sqlite:///{tmp_path}/b.db", folder, "--max-body", "4096") as (_, proxy):
        for mode in MODES:
            async with http_client(proxy.url, mode, {"Authorization": f"Bearer {mode}"}) as client:
                await over_limit_runs_once(client, folder)
            (folder / "report.log").unlink()


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), True, "5"])
def test_the_forwarder_refuses_a_timeout_the_gateway_refuses(timeout: Any) -> None:
    from retrysafe.gateway import Gateway, forwarder

    for make in (forwarder, Gateway):
        with pytest.raises(ValueError, match="positive number of seconds"):
            make("http://127.0.0.1:9", timeout=timeout)
