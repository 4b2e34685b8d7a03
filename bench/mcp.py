"""MCP tool calls side by side: the bare server, retrysafe's in-process door, the proxy,
and ``mcp-idempotent``, in one run, against the same tiny MCP server.

The server is bench/_mcp_server.py (the official ``mcp`` SDK): ``charge`` appends a
line to a ledger per execution. Each target is an adapter that starts it (or a
proxy in front of it) and says how a client connects:

* **bare**: the server alone, over stdio and over Streamable HTTP (keys ignored);
* **in-process door**: ``retrysafe.mcp.McpIdempotency(store).install(server)``,
  over stdio and HTTP;
* **proxy**: ``python -m retrysafe mcp-proxy --store URL -- python SERVER ...`` (stdio)
  and ``... mcp-proxy --upstream http://127.0.0.1:P/mcp --listen 127.0.0.1:Q --store URL``
  (HTTP, with ``--anonymous share``: the bench's clients send no credentials),
  in front of the bare server;
* **mcp-idempotent**: the npm proxy, if ``--mcp-idempotent CMD`` gives a command
  that wraps a stdio server (``CMD -- python SERVER ...``). It is not on the npm
  registry (``npm view mcp-idempotent``: 404), so by default its row is skipped.

A target that is missing (the door or the proxy not installed, a command that
fails) is reported as skipped, not run; one whose storm or latency calls fail is
reported as failed. Two measures:

* **duplicate storm**: N clients (each its own connection: over stdio its own
  server or proxy process), each sending one key's ``tools/call`` M times (NxM
  calls, at most one execution expected); then K distinct keys spread over the
  clients (K executions expected). Every answer is classified: run, replayed,
  in flight (the door's refusal), other error.
* **latency added**: one client, sequential first calls (a fresh key each),
  interleaved in rounds over every target; median and p95 per target, and their
  ratio to the bare server over the same transport, measured in the same run.

Under the table, every retrysafe row whose storm ran other than once, or whose K
keys ran other than K times, is flagged, and the exit status is 1.

This is a benchmark, not a test. It writes its ledgers and SQLite stores in a
temporary folder.

    python bench/mcp.py [--clients N] [--retries M] [--keys K] [--work S]
                        [--calls C] [--rounds R] [--targets a,b] [--mcp-idempotent CMD]
"""

# ruff: noqa: E402  (the imports follow the sys.path guard below)
from __future__ import annotations

import sys
from pathlib import Path

# Keep this folder off sys.path: bench/http.py would shadow the standard library's http.
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import argparse
import asyncio
import contextlib
import secrets
import shlex
import socket
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from mcp.client import Client
from mcp.client.stdio import StdioServerParameters
from mcp.shared.exceptions import MCPError

from retrysafe.errors import InProgressError
from retrysafe.mcp import META_KEY, was_replayed

SERVER = HERE / "_mcp_server.py"
PY = sys.executable


class Skip(Exception):
    """A target that cannot run here; its message says why."""


@dataclass
class Target:
    """One way to reach the server: ``start`` yields a factory of connected clients."""

    name: str
    transport: str
    start: Callable[[Path, float], contextlib.AbstractContextManager[Callable[[], Client]]]
    note: str = ""
    #: retrysafe deduplicates here: its storm must run once, its K keys K times.
    retrysafe: bool = False
    skipped: str | None = None
    failed: str | None = None
    errors: int = 0
    samples: list[float] = field(default_factory=list)
    storm: Counter[str] = field(default_factory=Counter)
    storm_executions: int = 0
    keys: Counter[str] = field(default_factory=Counter)
    keys_executions: int = 0


# -- processes ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def process(argv: list[str], url: str, log: Path) -> Iterator[None]:
    """Run ``argv`` until the block ends; wait until ``url`` answers at all."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise Skip(f"exited with {proc.returncode}: {log.read_text()[-300:]!r}")
            try:
                httpx.get(url, timeout=1.0)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise Skip(f"{url} did not answer within 30 s") from None
                time.sleep(0.05)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def server_args(ledger: Path, work: float, door: str = "none", store: str = "") -> list[str]:
    argv = [str(SERVER), "--ledger", str(ledger), "--work", str(work), "--door", door]
    return [*argv, "--store", store] if store else argv


def _runs(argv: list[str], what: str) -> None:
    """Skip unless ``argv`` exits 0 (a probe: ``--help``, an import)."""
    try:
        done = subprocess.run(argv, capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Skip(f"{what}: {exc}") from None
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
        raise Skip(f"{what} is not available here ({tail[0][:120]})")


# -- the targets ----------------------------------------------------------------------------


def stdio(command: list[str]) -> Callable[[], Client]:
    params = StdioServerParameters(command=command[0], args=command[1:])
    return lambda: Client(params)


def bare_stdio(ledger: Path, work: float) -> Any:
    return contextlib.nullcontext(stdio([PY, *server_args(ledger, work)]))


@contextlib.contextmanager
def _http_server(ledger: Path, work: float, door: str = "none", store: str = "") -> Iterator[str]:
    port = free_port()
    argv = [PY, *server_args(ledger, work, door, store), "--http", f"127.0.0.1:{port}"]
    url = f"http://127.0.0.1:{port}/mcp"
    with process(argv, url, ledger.with_suffix(f".{port}.log")):
        yield url


@contextlib.contextmanager
def bare_http(ledger: Path, work: float) -> Iterator[Callable[[], Client]]:
    with _http_server(ledger, work) as url:
        yield lambda: Client(url)


def door_stdio(ledger: Path, work: float) -> Any:
    _runs([PY, "-c", "from retrysafe.mcp import IdempotencyMiddleware"], "the in-process door")
    store = f"sqlite:///{ledger.with_suffix('.db')}"
    return contextlib.nullcontext(stdio([PY, *server_args(ledger, work, "inprocess", store)]))


@contextlib.contextmanager
def door_http(ledger: Path, work: float) -> Iterator[Callable[[], Client]]:
    _runs([PY, "-c", "from retrysafe.mcp import IdempotencyMiddleware"], "the in-process door")
    store = f"sqlite:///{ledger.with_suffix('.db')}"
    with _http_server(ledger, work, "inprocess", store) as url:
        yield lambda: Client(url)


PROXY = [PY, "-m", "retrysafe", "mcp-proxy"]


def proxy_stdio(ledger: Path, work: float) -> Any:
    _runs([*PROXY, "--help"], "retrysafe mcp-proxy")
    store = f"sqlite:///{ledger.with_suffix('.db')}"
    return contextlib.nullcontext(
        stdio([*PROXY, "--store", store, "--", PY, *server_args(ledger, work)])
    )


@contextlib.contextmanager
def proxy_http(ledger: Path, work: float) -> Iterator[Callable[[], Client]]:
    _runs([*PROXY, "--help"], "retrysafe mcp-proxy")
    store = f"sqlite:///{ledger.with_suffix('.db')}"
    with _http_server(ledger, work) as upstream:
        port = free_port()
        argv = [*PROXY, "--upstream", upstream, "--listen", f"127.0.0.1:{port}", "--store", store]
        argv += ["--anonymous", "share"]  # one user on loopback, no credentials
        url = f"http://127.0.0.1:{port}/mcp"
        with process(argv, url, ledger.with_suffix(".proxy.log")):
            yield lambda: Client(url)


def mcp_idempotent(command: str | None) -> Callable[[Path, float], Any]:
    def start(ledger: Path, work: float) -> Any:
        if not command:
            raise Skip(
                "not installable here: `npm view mcp-idempotent` answers 404 (no such package "
                "on the npm registry), and mcp-gateway 1.0.0 is a stdio-to-SSE bridge with no "
                "deduplication; pass --mcp-idempotent CMD to run one"
            )
        return contextlib.nullcontext(
            stdio([*shlex.split(command), "--", PY, *server_args(ledger, work)])
        )

    return start


def targets(npm_command: str | None) -> list[Target]:
    return [
        Target("bare", "stdio", bare_stdio),
        Target("bare", "http", bare_http),
        Target("in-process door", "stdio", door_stdio, retrysafe=True),
        Target("in-process door", "http", door_http, retrysafe=True),
        Target("proxy", "stdio", proxy_stdio, retrysafe=True),
        Target("proxy", "http", proxy_http, retrysafe=True),
        Target("mcp-idempotent", "stdio", mcp_idempotent(npm_command)),
    ]


# -- the measures ---------------------------------------------------------------------------


def _kind(result: Any) -> str:
    if isinstance(result, MCPError):
        data = result.data if isinstance(result.data, dict) else {}
        return "in flight" if data.get("code") == InProgressError.code else "other error"
    if isinstance(result, BaseException):
        return "other error"
    return "replayed" if was_replayed(result) else "run"


async def _call(client: Client, order: str, key: str) -> Any:
    try:
        return await client.call_tool("charge", {"order": order, "amount": 1}, meta={META_KEY: key})
    except Exception as exc:  # classified, not raised
        return exc


def _executions(ledger: Path, orders: set[str]) -> int:
    lines = ledger.read_text().splitlines() if ledger.exists() else []
    return sum(1 for line in lines if line in orders)


async def storm(target: Target, connect: Callable[[], Client], ledger: Path, a: Any) -> None:
    """N clients x M sends of one key, then K distinct keys over the same clients."""
    tag = secrets.token_hex(4)
    async with contextlib.AsyncExitStack() as stack:
        # Entered one by one, in this task: anyio's scopes are left in the task that entered them.
        clients = [await stack.enter_async_context(connect()) for _ in range(a.clients)]

        async def repeat(client: Client, order: str, key: str, times: int) -> list[Any]:
            return [await _call(client, order, key) for _ in range(times)]

        order = f"storm-{tag}"
        answers = await asyncio.gather(*(repeat(c, order, order, a.retries) for c in clients))
        target.storm.update(_kind(r) for rs in answers for r in rs)
        target.storm_executions = _executions(ledger, {order})

        orders = [f"key-{tag}-{i}" for i in range(a.keys)]
        spread = [orders[i :: a.clients] for i in range(a.clients)]
        answers = await asyncio.gather(
            *(
                asyncio.gather(*(_call(c, o, o) for o in mine))
                for c, mine in zip(clients, spread, strict=True)
            )
        )
        target.keys.update(_kind(r) for rs in answers for r in rs)
        target.keys_executions = _executions(ledger, set(orders))


async def latency(live: list[tuple[Target, Callable[[], Client]]], a: Any) -> None:
    """Sequential first calls, interleaved in rounds over every target."""
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(connect()) for _, connect in live]
        for client in clients:  # warm up: the first calls pay for imports and connections
            for _ in range(5):
                await _call(client, "warmup", secrets.token_hex(8))
        for _ in range(a.rounds):
            for (target, _), client in zip(live, clients, strict=True):
                for _ in range(a.calls):
                    key = secrets.token_hex(8)
                    t0 = time.perf_counter()
                    result = await _call(client, f"lat-{key}", key)
                    target.samples.append(time.perf_counter() - t0)
                    if isinstance(result, BaseException):
                        target.errors += 1


# -- the report -----------------------------------------------------------------------------


def _p95(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=20)[-1] if len(samples) >= 20 else max(samples)


def flagged(all_targets: list[Target], a: Any) -> list[str]:
    """The retrysafe rows that did not deduplicate: storm executions != 1, or K keys'
    executions != K (or that failed)."""
    found = []
    for t in all_targets:
        if not t.retrysafe or t.skipped:
            continue
        row = f"{t.name} ({t.transport})"
        if t.failed:
            found.append(f"{row}: failed: {t.failed}")
        elif t.storm_executions != 1 or t.keys_executions != a.keys:
            found.append(
                f"{row}: the storm ran {t.storm_executions} times (1 expected), "
                f"the {a.keys} keys {t.keys_executions} times ({a.keys} expected)"
            )
    return found


def report(all_targets: list[Target], a: Any) -> str:
    bare = {t.transport: t for t in all_targets if t.name == "bare" and not t.skipped}
    lines = [
        f"Duplicate storm: {a.clients} clients x {a.retries} sends of one key "
        f"({a.clients * a.retries} calls); then {a.keys} distinct keys. Latency: "
        f"{a.rounds} rounds x {a.calls} sequential first calls per target, tool work 0 s.",
        "",
        "| target | transport | storm: executions | storm: answers | "
        f"{a.keys} keys: executions | median ms | p95 ms | median vs bare | p95 vs bare |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in all_targets:
        name = f"{t.name} ({t.note})" if t.note else t.name
        if t.skipped or t.failed:
            why = f"skipped: {t.skipped}" if t.skipped else f"failed: {t.failed}"
            lines.append(f"| {name} | {t.transport} | {why} | | | | | | |")
            continue
        answers = ", ".join(f"{k} {v}" for k, v in sorted(t.storm.items()))
        if t.errors:
            answers += f"; latency: {t.errors} errors"
        med, p95 = statistics.median(t.samples), _p95(t.samples)
        base = bare.get(t.transport)
        if base is not None and base is not t:
            ratios = (
                f"{med / statistics.median(base.samples):.2f}x",
                f"{p95 / _p95(base.samples):.2f}x",
            )
        else:
            ratios = ("1.00x", "1.00x") if base is t else ("-", "-")
        lines.append(
            f"| {name} | {t.transport} | {t.storm_executions} | {answers} | "
            f"{t.keys_executions} | {med * 1000:.2f} | {p95 * 1000:.2f} | "
            f"{ratios[0]} | {ratios[1]} |"
        )
    lines += ["", *(f"**NOT DEDUPLICATED: {line}**" for line in flagged(all_targets, a))]
    return "\n".join(lines).rstrip()


def _load_args(argv: list[str] | None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--retries", type=int, default=5)
    parser.add_argument("--keys", type=int, default=50)
    parser.add_argument("--work", type=float, default=0.2, help="the tool's seconds in the storm")
    parser.add_argument("--calls", type=int, default=50, help="latency calls per round and target")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--targets", default="", help="names to run, comma-separated")
    parser.add_argument("--mcp-idempotent", default=None, metavar="CMD")
    a = parser.parse_args(argv)
    if min(a.clients, a.retries, a.keys, a.calls, a.rounds) < 1:
        parser.error("--clients, --retries, --keys, --calls and --rounds must be at least 1")
    return a


async def main(argv: list[str] | None = None) -> int:
    a = _load_args(argv)
    chosen = {n.strip() for n in a.targets.split(",") if n.strip()}
    all_targets = [t for t in targets(a.mcp_idempotent) if not chosen or t.name in chosen]
    with tempfile.TemporaryDirectory(prefix="bench-mcp-") as tmp, contextlib.ExitStack() as stack:
        live: list[tuple[Target, Callable[[], Client]]] = []
        for i, t in enumerate(all_targets):
            print(f"storm: {t.name} ({t.transport})", file=sys.stderr)
            try:
                storm_ledger = Path(tmp) / f"storm-{i}.txt"
                with t.start(storm_ledger, a.work) as connect:
                    await storm(t, connect, storm_ledger, a)
                connect = stack.enter_context(t.start(Path(tmp) / f"latency-{i}.txt", 0.0))
            except Skip as exc:
                t.skipped = str(exc)
                continue
            except Exception as exc:  # one target's failure is its row's, not the run's
                t.failed = f"{type(exc).__name__}: {exc}"
                continue
            live.append((t, connect))
        print("latency: interleaved rounds", file=sys.stderr)
        await latency(live, a)
    print(report(all_targets, a))
    return 1 if flagged(all_targets, a) else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
