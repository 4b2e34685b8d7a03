"""Where a gateway request spends its instructions: in-process, part by part.

Every variant runs in one process of its own, on uvloop, over real loopback
sockets: a stub upstream (an asyncio protocol answering every request with a
fixed 201 and a 34-byte JSON body) and, for the server variants, uvicorn's
server and a raw keep-alive client in the same event loop. A variant adds one
part to the one above it:

* ``direct``: the raw client against the stub upstream (what hitting the
  upstream costs in this process: client and stub);
* ``proxy``: the gateway's upstream hop alone (``_Proxy`` as an ASGI app, called
  with prebuilt scopes) against the stub;
* ``proxy-floor``: the least an upstream hop does (``FloorProxy``, below), called
  the same way: what ``proxy`` would cost if the hop were free but for its I/O;
* ``middleware``: the gateway's middleware in front of ``_Proxy`` (the memory store),
  called with prebuilt scopes: ``app`` without the gateway's dispatch and body bound;
* ``app``: the whole gateway app (``Gateway``: the idle-body bound, the
  middleware with the memory store, the proxy), called with prebuilt scopes;
* ``server-bare``: the raw client against uvicorn's own httptools protocol
  serving the bare ASGI endpoint (the upstream the HTTP bench hits directly);
* ``server-floor``: the raw client against uvicorn's own httptools protocol
  serving the least a gateway does (the body forwarded with a fixed head on one
  kept-alive connection, the answer's body passed back): the floor of any
  gateway on uvicorn;
* ``server-plain``: the raw client against uvicorn's own httptools protocol
  serving the gateway app (no head or connection bounds);
* ``server``: the same with the gateway's ``HTTPProtocol`` (the bounds on), as
  ``retrysafe gateway`` serves it.

Cost per request: instructions executed (valgrind's callgrind, or with
``--counter perf`` the CPU's user-space instruction counter, which runs at full
speed: both the same on every run whatever the machine's load, within a few
hundred instructions for perf), the difference between runs of N+100 and 100
requests, so start-up and warm-up drop out; kernel work (the socket system
calls) is not counted. ``--counter cpu`` (the default without valgrind): the
least CPU time of 5 runs.

    python bench/gateway.py --breakdown [N] [--variants direct,proxy,...] [--src DIR]
                            [--counter valgrind|perf|cpu]
    python bench/gateway.py --profile VARIANT [--workload first|replay] [N]

``--src DIR`` imports retrysafe from DIR (an exported tree, say) instead of src/.
This is a benchmark, not a test (pytest does not run it).
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ holds http.py: first on sys.path when this runs as a script, it would shadow
# the standard library's ``http`` (which uvicorn imports).
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import cProfile  # noqa: E402
import importlib.util  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from typing import Any  # noqa: E402

ROOT = HERE.parent


# The HTTP bench's endpoint, request and answer: the upstream that bench hits directly.
_spec = importlib.util.spec_from_file_location("_rsbench_http", HERE / "http.py")
assert _spec is not None and _spec.loader is not None
_http = sys.modules["_rsbench_http"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_http)
HOST, PATH = _http.HOST, _http.PATH
REQUEST_BODY, ANSWER_BYTES = _http.REQUEST_BODY.encode(), _http.ANSWER_BYTES
UPSTREAM_ANSWER = (
    b"HTTP/1.1 201 Created\r\n"
    b"date: Fri, 27 Nov 2026 12:00:00 GMT\r\n"
    b"server: uvicorn\r\n"
    b"content-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(ANSWER_BYTES), ANSWER_BYTES)
)
VARIANTS = (
    "direct",
    "proxy",
    "proxy-floor",
    "middleware",
    "app",
    "server-bare",
    "server-floor",
    "server-plain",
    "server",
)
WORKLOADS = ("first", "replay")
_LENGTH = re.compile(rb"\r\ncontent-length: *([0-9]+)", re.IGNORECASE)


class Stub(asyncio.Protocol):
    """The upstream: answers each whole request (head and Content-Length body) at once."""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            m = _LENGTH.search(self.buffer, 0, end + 2)
            size = end + 4 + (int(m[1]) if m else 0)
            if len(self.buffer) < size:
                return
            self.buffer = self.buffer[size:]
            self.transport.write(UPSTREAM_ANSWER)


class Client(asyncio.Protocol):
    """A raw keep-alive HTTP/1.1 client: one request at a time, its answer read whole."""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.buffer = b""
        self.waiter: asyncio.Future[bytes] | None = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        m = _LENGTH.search(self.buffer, 0, end + 2)
        size = end + 4 + (int(m[1]) if m else 0)
        if len(self.buffer) >= size and self.waiter is not None:
            answer, self.buffer = self.buffer[:size], self.buffer[size:]
            self.waiter.set_result(answer)

    async def exchange(self, request: bytes) -> bytes:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        answer = await self.waiter
        if not answer.startswith((b"HTTP/1.1 201", b"HTTP/1.1 200")):
            raise RuntimeError(f"unexpected answer {answer[:200]!r}")
        return answer


def raw_request(key: str, host: bytes) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nhost: %s\r\nuser-agent: wrk\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nauthorization: Bearer rsbench\r\nidempotency-key: %s\r\n\r\n%s"
        % (PATH.encode(), host, len(REQUEST_BODY), key.encode(), REQUEST_BODY)
    )


def scope_of(key: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "scheme": "http",
        "method": "POST",
        "path": PATH,
        "raw_path": PATH.encode(),
        "root_path": "",
        "query_string": b"",
        "server": (HOST, 8000),
        "client": (HOST, 50000),
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"user-agent", b"wrk"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(REQUEST_BODY)).encode()),
            (b"authorization", b"Bearer rsbench"),
            (b"idempotency-key", key.encode()),
        ],
    }


class FloorProxy:
    """The least a gateway does: each request's body forwarded on one kept-alive
    connection with a fixed head, the answer's body passed back; no idempotency, no
    header filtering, no bounds."""

    def __init__(self, upstream: Any, host: bytes) -> None:
        self.upstream, self.host = upstream, host

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = (await receive())["body"]
        answer = await self.upstream.exchange(
            b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (scope["raw_path"], self.host, len(body), body)
        )
        content = answer.partition(b"\r\n\r\n")[2]
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(content)),
        ]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": content})


async def _serve(app: Any, protocol: Any) -> tuple[Any, int]:
    """uvicorn serving ``app`` with ``protocol`` on a free port of this event loop."""
    import uvicorn
    from uvicorn.server import ServerState

    config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False)
    config.load()
    state = ServerState()
    loop = asyncio.get_running_loop()

    def make() -> Any:
        return protocol(config=config, server_state=state, app_state={}, _loop=loop)

    server = await loop.create_server(make, HOST, 0)
    return server, server.sockets[0].getsockname()[1]


async def run(variant: str, workload: str, n: int) -> float:
    """``n`` requests of ``workload`` through ``variant``; their CPU seconds."""
    loop = asyncio.get_running_loop()
    stub = await loop.create_server(Stub, HOST, 0)
    upstream = f"http://{HOST}:{stub.sockets[0].getsockname()[1]}"
    call: Any
    if variant == "direct":
        _, client = await loop.create_connection(Client, HOST, stub.sockets[0].getsockname()[1])

        async def call(key: str) -> None:
            await client.exchange(raw_request(key, upstream[7:].encode()))
    else:
        from retrysafe.gateway import HTTPProtocol, create_app

        gateway = create_app(upstream, store="memory://", sweep_every=None)
        app: Any = gateway
        if variant == "proxy":
            app = gateway.proxy
        if variant == "middleware":
            app = gateway.middleware
        if variant == "proxy-floor":
            _, conn = await loop.create_connection(Client, HOST, int(upstream.rsplit(":")[2]))
            app = FloorProxy(conn, upstream[7:].encode())
        if variant.startswith("server"):
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

            protocol = HTTPProtocol if variant == "server" else HttpToolsProtocol
            server_app = _http.Endpoint() if variant == "server-bare" else app
            if variant == "server-floor":
                _, conn = await loop.create_connection(Client, HOST, int(upstream.rsplit(":")[2]))
                server_app = FloorProxy(conn, upstream[7:].encode())
            _, port = await _serve(server_app, protocol)
            _, client = await loop.create_connection(Client, HOST, port)
            host = f"{HOST}:{port}".encode()

            async def call(key: str) -> None:
                await client.exchange(raw_request(key, host))
        else:
            body = {"type": "http.request", "body": REQUEST_BODY, "more_body": False}

            async def receive() -> dict[str, Any]:
                return body

            async def send(message: Any) -> None:
                return None

            async def call(key: str) -> None:
                await app(scope_of(key), receive, send)

    for i in range(200):  # warm-up; warm-0 is the replayed key
        await call(f"warm-{i}")
    keys = ["warm-0" if workload == "replay" else f"key-{i}" for i in range(n)]
    start = time.process_time()
    for key in keys:
        await call(key)
    return time.process_time() - start


def _loop_run(variant: str, workload: str, n: int) -> float:
    import uvloop

    return uvloop.run(run(variant, workload, n))


def _argv(variant: str, workload: str, n: int, src: str | None) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--run",
        variant,
        workload,
        str(n),
        *(["--src", src] if src else []),
    ]


def _cost(job: tuple[str, str], n: int, src: str | None, counter: str) -> float:
    """Instructions (valgrind's callgrind, or perf's user-space counter) or CPU seconds
    of ``n`` requests of a job."""
    argv = _argv(*job, n, src)
    if counter == "valgrind":
        argv = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *argv]
    elif counter == "perf":
        argv = ["perf", "stat", "-x,", "-e", "instructions:u", *argv]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT)
    if counter == "cpu":
        return float(out.stdout.split()[-1])
    pattern = r"Collected : (\d+)" if counter == "valgrind" else r"(?m)^(\d+),[^,]*,instructions"
    m = re.search(pattern, out.stderr)
    if m is None:
        raise RuntimeError(f"no instruction count from {counter}:\n{out.stderr[-2000:]}")
    return int(m.group(1))


def breakdown(n: int, variants: Sequence[str], src: str | None, counter: str) -> None:
    once = ("direct", "proxy", "proxy-floor", "server-bare", "server-floor")  # nothing stored
    jobs = [(v, w) for v in variants for w in WORKLOADS if not (v in once and w == "replay")]
    unit = "CPU us" if counter == "cpu" else "instructions"

    def cost(job: tuple[str, str]) -> float:
        if counter != "cpu":  # the difference of two runs leaves out start-up and warm-up
            return (_cost(job, n + 100, src, counter) - _cost(job, 100, src, counter)) / n
        return min(_cost(job, n, src, counter) for _ in range(5)) / n * 1e6

    with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
        costs = dict(zip(jobs, pool.map(cost, jobs), strict=True))
    print(f"| variant | first call ({unit}/request) | replay ({unit}/request) |")
    print("|---|--:|--:|")
    for v in variants:
        cells = [f"{costs[(v, w)]:,.0f}" if (v, w) in costs else "-" for w in WORKLOADS]
        print(f"| {v} | {cells[0]} | {cells[1]} |")


def profile(variant: str, workload: str, n: int, top: int = 40) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    _loop_run(variant, workload, n)
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(top)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--breakdown", nargs="?", type=int, const=1000, metavar="N")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--profile", choices=VARIANTS)
    parser.add_argument("--workload", choices=WORKLOADS, default="first")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--src", help="import retrysafe from this folder")
    parser.add_argument(
        "--counter",
        choices=("valgrind", "perf", "cpu"),
        help="valgrind (the default when installed), perf (its user-space instructions "
        "counter: as exact, at full speed, where the CPU's counters are readable) or cpu",
    )
    parser.add_argument("--run", nargs=3, metavar=("VARIANT", "WORKLOAD", "N"), help="internal")
    args = parser.parse_args(argv)
    if args.src:
        sys.path.insert(0, str(Path(args.src).resolve()))
    if args.run:
        variant, workload, n = args.run
        print(_loop_run(variant, workload, int(n)))
        return 0
    if args.profile:
        profile(args.profile, args.workload, args.requests)
        return 0
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    counter = args.counter or ("valgrind" if shutil.which("valgrind") else "cpu")
    breakdown(args.breakdown or 1000, variants, args.src, counter)
    return 0


if __name__ == "__main__":
    sys.exit(main())
