"""Requests per second of a minimal POST endpoint under uvicorn, bare and behind retrysafe.

One run measures, with the same load generator and the same settings:

* **bare**: the endpoint alone;
* **middleware**: ``retrysafe.asgi.IdempotencyMiddleware(endpoint, store=URL)`` with
  ``memory://``, ``sqlite:///<temp dir>/<name>.db`` (default options) and ``redis://`` (a
  throwaway redis-server started here, no persistence, stopped at the end);
* **floors**: the least an idempotency middleware can do with the same store and client
  library (claim the key in one call, run the endpoint, store its answer; a replay
  answers the stored bytes; no fingerprint, scope or engine), with a dict and with Redis
  (``SET NX GET`` + ``SET`` through ``redis.asyncio``, the round trips retrysafe makes);
* **fik-memory**: the peer fastapi-idempotency-key's middleware on its in-memory backend
  (default options), the one the issue's targets name for first calls;
* **fik-redis**: the same peer on its Redis backend (default options; as released, its
  replays answer 422: its completion overwrites the claim's fingerprint with ``""``);
  **fik-redis-kept**: the same with that one fix (the completion writes the claim's
  fingerprint; the same two round trips), so that its replays can be measured;
* **gateway**: ``retrysafe.gateway.create_app(upstream, store="memory://")`` in front of
  the bare server, against hitting that bare server directly (skipped, with a message,
  while ``retrysafe.gateway`` does not exist).

Every server is its own uvicorn process on a free loopback port, one worker, the same
settings for all (httptools and uvloop when installed). The endpoint (``--app asgi``,
the default) is a pure ASGI app that reads the body and answers 201 with a small
prebuilt JSON body; ``--app starlette`` is a Starlette route returning a
``JSONResponse``; ``--app asgi,starlette`` measures both, each against its own bare
server. The endpoint counts its executions, so every measurement checks that first
calls ran it once per request and that replays did not run it at all.

Load: wrk with a Lua script, every request a POST with a JSON body and an
``Idempotency-Key``: unique per request for **first calls**; for **replays**, keys from a
small set, each sent once before the measurement (to complete its record) and then
repeated. A measurement with a non-2xx/3xx answer or a socket error is invalid.

Variants run interleaved in rounds (the order flips every round) after a warm-up; a
variant's ratio is the median over the rounds of its rate divided by its bare server's
rate in the same round. This is a benchmark, not a test (pytest does not run it).

    python bench/http.py [--rounds N] [--seconds S] [--connections C] [--threads T]
                         [--app asgi[,starlette]] [--variants bare,memory,...]
                         [--workloads first,replay] [--rev REV] [--candidate DIR] [--write [PATH]]
    python bench/http.py --profile VARIANT [--seconds S]    # cProfile of one server
    python bench/http.py --breakdown [REQUESTS] [--rev REV] [--write [PATH]]  # part by part
    python bench/http.py --breakdown-redis [REQUESTS] [--rev REV]  # Redis, against the floor
    python bench/http.py --gc-probe first|replay N [FIRST_CALLS_BEFORE] [SRC]  # GC, in-process

``--breakdown`` runs the middleware in-process (no sockets), adding one part at a
time (the plumbing, the fingerprint, the engine), and counts the instructions each
costs per request with valgrind when it is installed (else the least CPU time).
``--breakdown-redis`` does the same on a Redis server of its own (outside valgrind:
the client's instructions) for the middleware on Redis, the Redis floor and the peer
on its Redis backend. ``--gc-probe`` counts the garbage collections (and the longest
of each generation) that N in-process requests set off, and the tracked objects they
leave behind: the part of the tail that is the garbage collector's, apart from the
machine's load.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file is called http.py: its folder, first on sys.path when it runs as a script,
# would shadow the standard library's ``http`` (which uvicorn and http.client import).
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import argparse  # noqa: E402
import contextlib  # noqa: E402
import cProfile  # noqa: E402
import http.client  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402
import re  # noqa: E402
import secrets  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

ROOT = HERE.parent
HOST = "127.0.0.1"
PATH = "/orders"
CALLS_PATH = "/_calls"  # GET: how often the endpoint ran (GET is not protected)
REQUEST_BODY = '{"order_id":"o-1","amount":1999,"currency":"eur"}'
ANSWER = {"id": "ch_123", "status": "created"}
ANSWER_BYTES = json.dumps(ANSWER, separators=(",", ":")).encode()

FIRST, REPLAY = "first call", "replay"
WORKLOADS = {"first": FIRST, "replay": REPLAY}
BARE, GATEWAY, PEER_MEMORY = "bare", "gateway", "fik-memory"
PEER_REDIS, PEER_REDIS_KEPT = "fik-redis", "fik-redis-kept"
PEERS = (PEER_MEMORY, PEER_REDIS, PEER_REDIS_KEPT)
PEER_MODULE = "fastapi_idempotency_key"
APPS = ("asgi", "starlette")


@dataclass(frozen=True)
class Spec:
    """A kind of server: ``store`` is a URL template (``{tmp}``, ``{name}``, ``{redis}``)."""

    kind: str  # bare, middleware, floor, gateway or peer
    detail: str
    store: str | None = None
    replayed: str = "idempotent-replayed"  # the header that marks a replay


SPECS: dict[str, Spec] = {
    BARE: Spec("bare", "the endpoint alone"),
    "memory": Spec(
        "middleware", '`IdempotencyMiddleware(endpoint, store="memory://")`', "memory://"
    ),
    "sqlite": Spec(
        "middleware",
        '`IdempotencyMiddleware(endpoint, store="sqlite:///<temp dir>'
        '/<name>.db")`, default options (WAL, `synchronous=FULL`)',
        "sqlite:///{tmp}/{name}.db",
    ),
    "redis": Spec(
        "middleware",
        '`IdempotencyMiddleware(endpoint, store="redis://127.0.0.1:<port>/0")`, default options',
        "{redis}",
    ),
    "floor-memory": Spec("floor", "floor middleware (see Setup) with a dict", "memory"),
    PEER_MEMORY: Spec(
        "peer",
        "`fastapi_idempotency_key.IdempotencyMiddleware(endpoint, backend=MemoryBackend())`, "
        "default options (the peer that leads on first calls)",
        "memory",
        "idempotency-replayed",
    ),
    PEER_REDIS: Spec(
        "peer",
        "`fastapi_idempotency_key.IdempotencyMiddleware(endpoint, backend=RedisBackend("
        "redis_url=url))`, default options (as released: every replay answers 422)",
        "{redis}",
        "idempotency-replayed",
    ),
    PEER_REDIS_KEPT: Spec(
        "peer",
        "fik-redis with one fix: the completion writes the claim's fingerprint (0.1.1 "
        'writes `""`, which refuses every replay); the same two round trips (`EVAL`s)',
        "{redis}",
        "idempotency-replayed",
    ),
    "floor-redis": Spec(
        "floor",
        "floor middleware (see Setup) with `redis.asyncio`: "
        "`SET key p NX GET PX ttl`, then `SET key answer PX ttl`",
        "{redis}",
    ),
    GATEWAY: Spec(
        "gateway",
        '`retrysafe.gateway.create_app("http://127.0.0.1:<bare port>", '
        'store="memory://")` in front of the bare server',
        "memory://",
    ),
}
#: (variant, workload) -> the least ratio to bare the issue asks for.
TARGETS: dict[tuple[str, str], float] = {
    ("memory", FIRST): 0.75,
    ("memory", REPLAY): 1.2,
    ("redis", FIRST): 0.6,
    ("redis", REPLAY): 0.6,
}
#: Keys of the replay workload (each thread starts at another one).
REPLAY_KEYS = 64
LIBRARIES = ("uvicorn", "uvloop", "httptools", "starlette", "redis", "hiredis", "httpx")


class BenchError(RuntimeError):
    """A server did not start or did not do the work it is measured for."""


def _load(name: str, path: Path) -> ModuleType:
    """A module by file path, without putting its folder on sys.path."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def gateway_available() -> bool:
    return importlib.util.find_spec("retrysafe.gateway") is not None


# -- the server side (runs in the uvicorn subprocesses) --------------------------------------


class Endpoint:
    """The minimal POST endpoint, pure ASGI: read the body, answer 201 with a small JSON."""

    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(ANSWER_BYTES)).encode()),
    ]

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["method"] == "GET" and scope["path"] == CALLS_PATH:
            await _send_calls(send, self.calls)
            return
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            more = message.get("more_body", False)
        self.calls += 1
        await send({"type": "http.response.start", "status": 201, "headers": self.headers})
        await send({"type": "http.response.body", "body": ANSWER_BYTES})


async def _send_calls(send: Any, calls: int) -> None:
    body = str(calls).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/plain")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def starlette_endpoint() -> Any:
    """The same endpoint as a Starlette route returning a ``JSONResponse``."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    counter = Endpoint()

    async def create(request: Request) -> Response:
        await request.body()
        counter.calls += 1
        return JSONResponse(ANSWER, status_code=201)

    async def calls(request: Request) -> Response:
        return PlainTextResponse(str(counter.calls))

    return Starlette(routes=[Route(PATH, create, methods=["POST"]), Route(CALLS_PATH, calls)])


PROCESSING = b"processing"
FLOOR_TTL_MS = 24 * 3600 * 1000  # retrysafe's default TTL


class Floor:
    """The least an idempotency middleware does: one store call to claim the key (or
    find its answer), the endpoint, one store call to keep the answer; a replay answers
    the stored bytes. No fingerprint, scope, key validation, engine or stored headers.
    ``store`` is ``"memory"`` (a dict) or a Redis URL (``redis.asyncio``).
    """

    replayed = [
        (b"content-type", b"application/json"),
        (b"idempotent-replayed", b"true"),
    ]

    def __init__(self, app: Any, store: str) -> None:
        self.app = app
        self.records: dict[bytes, bytes] = {}
        self.redis: Any = None
        if store != "memory":
            import redis.asyncio

            self.redis = redis.asyncio.Redis.from_url(store)

    async def claim(self, key: bytes) -> bytes | None:
        if self.redis is not None:
            return await self.redis.set(key, PROCESSING, nx=True, get=True, px=FLOOR_TTL_MS)
        old = self.records.get(key)
        if old is None:
            if len(self.records) >= 100_000:
                self.records.clear()
            self.records[key] = PROCESSING
        return old

    async def keep(self, key: bytes, answer: bytes) -> None:
        if self.redis is not None:
            await self.redis.set(key, answer, px=FLOOR_TTL_MS)
        else:
            self.records[key] = answer

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        key = next((v for k, v in scope["headers"] if k == b"idempotency-key"), None)
        if key is None:
            await self.app(scope, receive, send)
            return
        key = b"floor:" + key
        old = await self.claim(key)
        if old is not None:
            status = 409 if old == PROCESSING else 201
            await send({"type": "http.response.start", "status": status, "headers": self.replayed})
            await send({"type": "http.response.body", "body": b"" if status == 409 else old})
            return
        start: Any = None
        chunks: list[bytes] = []

        async def keep_and_send(message: Any) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message  # held until the answer is kept
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                await self.keep(key, b"".join(chunks))
            if start is not None:
                await send(start)
                start = None
            await send(message)

        await self.app(scope, receive, keep_and_send)


def fik_memory(app: Any) -> Any:
    """fastapi-idempotency-key's middleware on its in-memory backend, default options
    (as bench/peers.py builds it, with ``MemoryBackend`` for its ``RedisBackend``)."""
    from fastapi_idempotency_key import IdempotencyMiddleware, MemoryBackend

    return IdempotencyMiddleware(app, backend=MemoryBackend())


def peer_app(name: str, app: Any, store: str) -> Any:
    """The peer variant ``name`` around ``app`` (``store``: its Redis URL, if any)."""
    if name == PEER_MEMORY:
        return fik_memory(app)
    peers = _load("_rsbench_peers_app", HERE / "_peers_app.py")
    return peers.fik_redis(app, store, keep_fingerprint=name == PEER_REDIS_KEPT)


def server_settings() -> dict[str, Any]:
    """uvicorn's settings, the same for every variant."""
    have = {m: importlib.util.find_spec(m) is not None for m in ("uvloop", "httptools")}
    return {
        "host": HOST,
        "loop": "uvloop" if have["uvloop"] else "asyncio",
        "http": "httptools" if have["httptools"] else "h11",
        "workers": 1,
        "lifespan": "auto",
        "log_level": "warning",
        "access_log": False,
    }


def serve(argv: Sequence[str]) -> int:
    """``--serve``: one uvicorn server of one variant, until SIGTERM."""
    import uvicorn

    parser = argparse.ArgumentParser(prog="bench/http.py --serve")
    kinds = ("bare", "middleware", "floor", "gateway", "peer")
    parser.add_argument("--kind", choices=kinds, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--store")
    parser.add_argument("--peer", choices=PEERS, default=PEER_MEMORY)
    parser.add_argument("--upstream")
    parser.add_argument("--app", choices=APPS, default="asgi")
    parser.add_argument("--profile-out")
    parser.add_argument("--src", help="import retrysafe from this folder")
    args = parser.parse_args(argv)
    if args.src:
        sys.path.insert(0, args.src)

    app: Any
    if args.kind == "gateway":
        from retrysafe.gateway import create_app

        app = create_app(args.upstream, store=args.store)
    else:
        app = Endpoint() if args.app == "asgi" else starlette_endpoint()
        if args.kind == "middleware":
            from retrysafe.asgi import IdempotencyMiddleware

            app = IdempotencyMiddleware(app, store=args.store)
        elif args.kind == "floor":
            app = Floor(app, args.store)
        elif args.kind == "peer":
            app = peer_app(args.peer, app, args.store)
    profiler = cProfile.Profile() if args.profile_out else None
    # uvicorn shuts down on SIGTERM, then raises it again under this handler.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    if profiler is not None:
        profiler.enable()
    try:
        uvicorn.run(app, port=args.port, **server_settings())
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile_out)
    return 0


# -- the client side -----------------------------------------------------------------------


def _request(
    port: int, method: str, path: str, body: str | None = None, headers: Any = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    """One uvicorn subprocess."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path) -> None:
        self.name, self.port, self.log = name, port, log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--serve",
                    *argv,
                    "--port",
                    str(port),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} server exited:\n{self.log.read_text()[-3000:]}")
            try:
                _request(self.port, "GET", CALLS_PATH)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise BenchError(f"{self.name} server did not answer in {timeout}s") from None
                time.sleep(0.1)

    def cpu(self) -> float:
        return _cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # uvicorn shuts down gracefully (and dumps a profile)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- wrk -------------------------------------------------------------------------------------

LUA = """\
-- generated by bench/http.py: POSTs with a JSON body and an Idempotency-Key
local mode, prefix, nkeys = "first", "k", 1
local counter = 0
local next_id = 0
tid = 0 -- a global: setup() sets it in each thread's own Lua state

function setup(thread)
  thread:set("tid", next_id)
  next_id = next_id + 1
end

function init(args)
  mode, prefix, nkeys = args[1], args[2], tonumber(args[3])
  wrk.method = "POST"
  wrk.body = BODY
  wrk.headers["Content-Type"] = "application/json"
  wrk.headers["Authorization"] = "Bearer rsbench" -- a caller: keyed requests are recorded
end

function request()
  counter = counter + 1
  local key
  if mode == "replay" then
    key = prefix .. "-" .. ((counter + tid * 7) % nkeys)
  else
    key = prefix .. "-" .. tid .. "-" .. counter
  end
  wrk.headers["Idempotency-Key"] = key
  return wrk.format()
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "RSBENCH {\\"requests\\":%d,\\"duration_us\\":%d,\\"connect\\":%d,\\"read\\":%d," ..
    "\\"write\\":%d,\\"status\\":%d,\\"timeout\\":%d,\\"p50_us\\":%d,\\"p99_us\\":%d}\\n",
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def replay_key(prefix: str, i: int) -> str:
    """The keys the Lua script repeats in ``replay`` mode."""
    return f"{prefix}-{i}"


@dataclass
class Sample:
    """One wrk run against one server."""

    rps: float
    requests: int
    p50_ms: float
    p99_ms: float
    cpu_us: float  # CPU time of the server process(es) per request
    problems: list[str]

    @property
    def valid(self) -> bool:
        return not self.problems


@dataclass
class Load:
    """wrk's settings, the same for every variant."""

    threads: int
    connections: int
    seconds: int
    script: Path

    def argv(self, url: str, mode: str, prefix: str) -> list[str]:
        return [
            "wrk",
            "-t",
            str(self.threads),
            "-c",
            str(self.connections),
            "-d",
            f"{self.seconds}s",
            "--latency",
            "-s",
            str(self.script),
            url + PATH,
            "--",
            mode,
            prefix,
            str(REPLAY_KEYS),
        ]

    def run(self, url: str, mode: str, prefix: str) -> tuple[dict[str, int], str]:
        out = subprocess.run(
            self.argv(url, mode, prefix), capture_output=True, text=True, timeout=self.seconds + 60
        )
        line = next((x for x in out.stdout.splitlines() if x.startswith("RSBENCH ")), None)
        if out.returncode != 0 or line is None:
            raise BenchError(f"wrk failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        return json.loads(line[len("RSBENCH ") :]), out.stdout


@dataclass
class Variant:
    """One thing measured: a server, the bare server it is compared with, and the server
    whose endpoint runs its requests (itself, or the gateway's upstream)."""

    name: str
    app: str
    spec: Spec
    server: Server
    counter: Server
    reference: Variant | None = None  # None: this is a bare server
    candidate: bool = False  # retrysafe imported from --candidate
    samples: dict[str, list[Sample]] = field(default_factory=dict)

    @property
    def title(self) -> str:
        return f"{self.name} (candidate)" if self.candidate else self.name

    @property
    def label(self) -> str:
        return f"{self.title} ({self.app})"

    def servers(self) -> list[Server]:
        return [self.server] if self.counter is self.server else [self.server, self.counter]

    def calls(self) -> int:
        status, _, body = _request(self.counter.port, "GET", CALLS_PATH)
        if status != 200:
            raise BenchError(f"{self.label}: GET {CALLS_PATH} answered {status}")
        return int(body)

    def settled_calls(self, timeout: float = 10.0) -> int:
        """:meth:`calls` once requests still in flight when wrk stopped have run."""
        deadline = time.monotonic() + timeout
        calls = self.calls()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.calls()
            if now == calls:
                break
            calls = now
        return calls

    def _post(self, key: str) -> tuple[int, dict[str, str], bytes]:
        return _request(
            self.server.port,
            "POST",
            PATH,
            REQUEST_BODY,
            {
                "Content-Type": "application/json",
                "Idempotency-Key": key,
                "Authorization": "Bearer rsbench",
            },
        )

    def warm_replay_keys(self, prefix: str) -> None:
        """Send each replay key once, so the measurement only replays."""
        for i in range(REPLAY_KEYS):
            status, _, body = self._post(replay_key(prefix, i))
            if status != 201:
                raise BenchError(f"{self.label}: warming answered {status}: {body[:200]!r}")
        if self.reference is not None:
            status, headers, _ = self._post(replay_key(prefix, 0))
            if status != 201 or headers.get(self.spec.replayed) != "true":
                raise BenchError(f"{self.label}: a warmed key answered {status}, not a replay")

    def measure(self, load: Load, workload: str, tag: str) -> Sample:
        mode = "replay" if workload == REPLAY else "first"
        prefix = f"{tag}-{self.name}-{self.app}-{secrets.token_hex(4)}"
        if mode == "replay":
            try:
                self.warm_replay_keys(prefix)
            except BenchError as exc:  # a peer that does not replay: shown, not fatal
                if self.spec.kind != "peer":
                    raise
                return Sample(0.0, 0, 0.0, 0.0, 0.0, [str(exc).removeprefix(f"{self.label}: ")])
        calls_before = self.settled_calls()
        cpu_before = sum(s.cpu() for s in self.servers())
        stats, text = load.run(self.server.url, mode, prefix)
        cpu = sum(s.cpu() for s in self.servers()) - cpu_before
        ran = self.settled_calls() - calls_before
        n = stats["requests"]
        problems = []
        m = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
        refused = max(stats["status"], int(m.group(1)) if m else 0)
        if refused:
            problems.append(f"{refused} non-2xx/3xx answers")
        errors = {k: stats[k] for k in ("connect", "read", "write", "timeout") if stats[k]}
        if errors or "Socket errors" in text:
            problems.append(f"socket errors {errors}")
        if n == 0:
            problems.append("no request completed")
        # A first call runs the endpoint once (plus requests still in flight at the end);
        # behind retrysafe, a replay never runs it.
        if mode == "first" or self.reference is None:
            if not n <= ran <= n + load.connections:
                problems.append(f"the endpoint ran {ran} times for {n} requests")
        elif ran != 0:
            problems.append(f"the endpoint ran {ran} times for {n} replays")
        return Sample(
            rps=n / (stats["duration_us"] / 1e6),
            requests=n,
            p50_ms=stats["p50_us"] / 1000,
            p99_ms=stats["p99_us"] / 1000,
            cpu_us=cpu / max(n, 1) * 1e6,
            problems=problems,
        )


# -- setting up ------------------------------------------------------------------------------


def choose(requested: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """The variants to measure (bare first, the gateway last), and those skipped and why."""
    names = [BARE] + [n for n in SPECS if n in requested and n != BARE]
    skipped = []
    if GATEWAY in names and not gateway_available():
        print("skipping the gateway: retrysafe.gateway does not exist (yet)", flush=True)
        names.remove(GATEWAY)
        skipped.append((GATEWAY, "`retrysafe.gateway` did not exist when this ran"))
    for peer in PEERS:
        if peer in names and importlib.util.find_spec(PEER_MODULE) is None:
            print(f"skipping {peer}: fastapi-idempotency-key is not installed", flush=True)
            names.remove(peer)
            skipped.append((peer, "fastapi-idempotency-key was not installed"))
    return names, skipped


def start_variants(
    names: Sequence[str],
    apps: Sequence[str],
    stack: contextlib.ExitStack,
    info: dict[str, str],
    candidate: str | None = None,
    base: str | None = None,
) -> list[Variant]:
    """Start every server (a redis-server first if one is needed) and wait for them.

    Servers import retrysafe from ``base`` if given (else as installed). With
    ``candidate``, every retrysafe variant (middleware, gateway) runs twice: so, and
    importing retrysafe from that folder.
    """
    servers_mod = _load("_rsbench_servers", ROOT / "tests" / "_servers.py")
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rsbench-http-")))
    redis_url = ""
    if any("{redis}" in (SPECS[n].store or "") for n in names):
        redis = servers_mod.RedisServer()  # --save '' --appendonly no; stopped at exit
        stack.enter_context(redis)
        redis_url = redis.url
        out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
        version = out.stdout.split()[2].removeprefix("v=")
        info["redis-server"] = f"{version} (no persistence: `--save '' --appendonly no`)"

    def start(name: str, app: str, argv: list[str]) -> Server:
        port = servers_mod.free_port()
        server = Server(f"{name} ({app})", argv, port, tmp / f"{name}-{app}-{port}.log")
        stack.callback(server.stop)
        return server

    twins = [False, True] if candidate else [False]

    def src(twin: bool) -> list[str]:
        if twin:
            return ["--src", str(candidate)]
        return ["--src", base] if base else []

    variants = []
    for app in apps:
        bare_server = start(BARE, app, ["--kind", "bare", "--app", app, *src(False)])
        bare = Variant(BARE, app, SPECS[BARE], bare_server, bare_server)
        variants.append(bare)
        for name in names:
            spec = SPECS[name]
            if spec.kind in ("bare", "gateway"):
                continue
            assert spec.store is not None
            for twin in twins if spec.kind == "middleware" else [False]:
                tag = f"{name}-{app}-candidate" if twin else f"{name}-{app}"
                store = spec.store.format(tmp=tmp, name=tag, redis=redis_url)
                argv = ["--kind", spec.kind, "--app", app, "--store", store, *src(twin)]
                if spec.kind == "peer":
                    argv += ["--peer", name]
                server = start(name, app, argv)
                variants.append(Variant(name, app, spec, server, server, bare, twin))
    if GATEWAY in names:  # in front of the first endpoint's bare server
        bare = variants[0]
        argv = ["--kind", "gateway", "--upstream", bare.server.url, "--store", "memory://"]
        for twin in twins:
            server = start(GATEWAY, bare.app, argv + src(twin))
            gateway = Variant(GATEWAY, bare.app, SPECS[GATEWAY], server, bare.server, bare, twin)
            variants.append(gateway)
    for v in variants:
        v.server.wait_ready()
    return variants


# -- results -------------------------------------------------------------------------------


@dataclass
class Row:
    variant: Variant
    workload: str
    rounds: int
    valid: list[Sample]
    ratios: list[float]
    cpu_ratios: list[float]  # bare's server CPU per request / this one's, per round
    problems: list[str]

    @property
    def target(self) -> float | None:
        return TARGETS.get((self.variant.name, self.workload))

    @property
    def ratio(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    def median(self, attr: str) -> float:
        return statistics.median(getattr(s, attr) for s in self.valid) if self.valid else 0.0

    @property
    def verdict(self) -> str:
        if self.problems:
            return f"**invalid** ({len(self.problems)} of {self.rounds} rounds)"
        target, ratio = self.target, self.ratio
        if target is None or ratio is None:
            return "-"
        if ratio >= target:
            return f"met (+{ratio - target:.2f})"
        return f"**missed** by {target - ratio:.2f}"


def rows_of(variants: Sequence[Variant], workloads: Sequence[str]) -> list[Row]:
    rows = []
    for workload in workloads:
        for v in variants:
            samples = v.samples[workload]
            base = v.reference.samples[workload] if v.reference else samples
            problems = [
                f"round {i + 1}: {'; '.join(s.problems)}"
                for i, s in enumerate(samples)
                if not s.valid
            ]
            pairs = [
                (s, b)
                for s, b in zip(samples, base, strict=True)
                if s.valid and b.valid and v.reference
            ]
            ratios = [s.rps / b.rps for s, b in pairs]
            cpu_ratios = [b.cpu_us / s.cpu_us for s, b in pairs if s.cpu_us]
            valid = [s for s in samples if s.valid]
            rows.append(Row(v, workload, len(samples), valid, ratios, cpu_ratios, problems))
    return rows


def results_table(rows: Sequence[Row]) -> list[str]:
    out = [
        "| variant | endpoint | workload | req/s (median) | rounds min-max "
        "| ratio to bare (median) | ratio min-max | p50 ms | p99 ms | server CPU us/req "
        "| CPU ratio | target | met? |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        rps = [s.rps for s in r.valid]
        spread = f"{min(rps):,.0f}-{max(rps):,.0f}" if rps else "-"
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
        rspread = f"{min(r.ratios):.2f}-{max(r.ratios):.2f}" if r.ratios else "-"
        target = "-" if r.target is None else f">= {r.target:.2f}"
        cpu_ratio = f"{statistics.median(r.cpu_ratios):.2f}" if r.cpu_ratios else "-"
        out.append(
            f"| {r.variant.title} | {r.variant.app} | {r.workload} | {r.median('rps'):,.0f} "
            f"| {spread} | {ratio} | {rspread} | {r.median('p50_ms'):.2f} "
            f"| {r.median('p99_ms'):.2f} | {r.median('cpu_us'):.0f} | {cpu_ratio} | {target} "
            f"| {r.verdict} |"
        )
    return out


def run_rounds(
    variants: Sequence[Variant], workloads: Sequence[str], load: Load, rounds: int, warmup: int
) -> None:
    """Warm every server up, then measure all of them interleaved, ``rounds`` times."""
    warm = Load(load.threads, load.connections, warmup, load.script)
    for v in variants:
        for workload in workloads:
            v.measure(warm, workload, "warm")
            v.samples[workload] = []
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for workload in workloads:
            for v in order:
                v.samples[workload].append(v.measure(load, workload, f"r{r}"))
            line = "  ".join(
                f"{v.title}/{v.app}={v.samples[workload][-1].rps:,.0f}"
                + ("" if v.samples[workload][-1].valid else "(INVALID)")
                for v in variants
            )
            print(f"  round {r + 1}/{rounds} {workload}: {line}", flush=True)
            for v in variants:
                for p in v.samples[workload][-1].problems:
                    print(f"    {v.label}: {p}", flush=True)


def profile(name: str, app: str, load: Load, top: int) -> None:
    """Run one variant's server under cProfile for one first-call load, print the top."""
    with contextlib.ExitStack() as stack:
        variants = start_variants([BARE, name], [app], stack, {})
        target = next(v for v in variants if v.name == name)
        out = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "server.prof"
        # Start the measured server again under the profiler, on the same port and store.
        old = target.server
        old.stop()
        argv = [*old.proc.args[3:-2], "--profile-out", str(out)]  # after --serve, before --port
        target.server = Server(old.name, argv, old.port, old.log)
        stack.callback(target.server.stop)
        if target.counter is old:
            target.counter = target.server
        target.server.wait_ready()
        sample = target.measure(load, FIRST, "profile")
        print(
            f"{target.label}: {sample.rps:,.0f} req/s under cProfile "
            f"({sample.cpu_us:.0f} us server CPU per request)",
            flush=True,
        )
        target.server.stop()
        stats = pstats.Stats(str(out))
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)


# -- where the time goes: the middleware in-process ------------------------------------------

#: In-process variants, each adding one part of the middleware to the one before.
BREAKDOWN = {
    "bare": "the endpoint alone",
    "floor": "the floor middleware with a dict",
    "plumbing": '`IdempotencyMiddleware(endpoint, store="memory://")` with the request '
    "fingerprint and the engine's claim and completion stubbed out (entering an attempt "
    "claims every key, so this replay column is a first call; building the attempt, with "
    "its key hash, stays)",
    "plumbing+fingerprint": "the same with the real fingerprint (engine still stubbed out)",
    "middleware": '`IdempotencyMiddleware(endpoint, store="memory://")`',
    PEER_MEMORY: "fastapi-idempotency-key's middleware on its memory backend (a side branch: "
    "its step is counted from bare)",
}
#: ``--breakdown-redis``: the in-process variants on Redis (the server outside valgrind).
BREAKDOWN_REDIS = {
    "redis": '`IdempotencyMiddleware(endpoint, store="redis://...")`',
    "floor-redis": "the floor middleware with `redis.asyncio` (`SET NX GET`, then `SET`)",
    PEER_REDIS: "fastapi-idempotency-key on its Redis backend (first calls only: as "
    "released, its replays answer 422)",
    PEER_REDIS_KEPT: "the same, its completion keeping the claim's fingerprint",
}
#: The environment variable that gives --breakdown-run the Redis server's URL.
REDIS_ENV = "RSBENCH_REDIS_URL"
BREAKDOWN_MARKS = (
    "<!-- bench/http.py --breakdown: generated from here -->",
    "<!-- bench/http.py --breakdown: generated up to here -->",
)


def _first_module(*names: str) -> Any:
    """The first of ``names`` that imports: bench --rev runs older trees, whose modules
    had other names."""
    for name in names[:-1]:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return importlib.import_module(names[-1])


def _stub_engine() -> None:
    """In this process, every engine attempt claims its key and stores nothing."""
    Attempt = _first_module("retrysafe._core.engine", "retrysafe._engine").Attempt

    async def enter(self: Any) -> Any:
        self.claim = self.replay = None
        return self

    async def leave(self: Any, *exc: object) -> None:
        return None

    async def settle(self: Any, *args: object, **kwargs: object) -> None:
        self.settled = True

    Attempt.__aenter__, Attempt.__aexit__ = enter, leave  # type: ignore[method-assign]
    Attempt.acomplete = Attempt.afail = settle  # type: ignore[method-assign]


def _breakdown_app(name: str) -> Any:
    if name == "bare":
        return Endpoint()
    if name == "floor":
        return Floor(Endpoint(), "memory")
    if name == PEER_MEMORY:
        return fik_memory(Endpoint())
    redis_url = os.environ.get(REDIS_ENV, "")
    if name == "floor-redis":
        return Floor(Endpoint(), redis_url)
    if name in (PEER_REDIS, PEER_REDIS_KEPT):
        return peer_app(name, Endpoint(), redis_url)
    from retrysafe.asgi import IdempotencyMiddleware

    # the HTTP core's module at this tree's revision (--rev measures older trees too)
    _http = _first_module("retrysafe._http.policy", "retrysafe._http")

    if name in ("plumbing", "plumbing+fingerprint"):
        _stub_engine()
    if name == "plumbing":
        # this process only: the body's canonical form and the hash over it
        _http.request_fingerprint = lambda *args: "f" * 64
        _http.body_form = lambda *args: (b"b", b"")
        _http.form_fingerprint = lambda *args: "f" * 64
    return IdempotencyMiddleware(Endpoint(), store=redis_url if name == "redis" else "memory://")


def _in_process_request(key: str) -> dict[str, Any]:
    """The scope of one in-process POST (the breakdown's and the GC probe's)."""
    body = REQUEST_BODY.encode()
    headers = [
        (b"host", b"127.0.0.1"),
        (b"user-agent", b"wrk"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"authorization", b"Bearer rsbench"),
        (b"idempotency-key", key.encode()),
    ]
    return {
        "type": "http",
        "method": "POST",
        "path": PATH,
        "raw_path": PATH.encode(),
        "query_string": b"",
        "headers": headers,
    }


async def _in_process_receive() -> dict[str, Any]:
    return {"type": "http.request", "body": REQUEST_BODY.encode(), "more_body": False}


async def _in_process_send(message: Any) -> None:
    return None


def _run_loop(main: Any) -> Any:
    if importlib.util.find_spec("uvloop") is not None:
        import uvloop

        return uvloop.run(main)
    import asyncio

    return asyncio.run(main)


def breakdown_run(argv: Sequence[str]) -> int:
    """``--breakdown-run NAME WORKLOAD N [SRC]``: N requests in-process (retrysafe from
    SRC if given); prints their CPU seconds."""
    name, workload, n = argv[0], argv[1], int(argv[2])
    if len(argv) > 3:
        sys.path.insert(0, argv[3])
    app = _breakdown_app(name)
    receive, send = _in_process_receive, _in_process_send

    # On Redis, keys of this run only (the server outlives it)
    run_id = f"{secrets.token_hex(4)}-" if os.environ.get(REDIS_ENV) else ""

    async def run() -> float:
        for i in range(200):  # warm-up; warm-0 is the replayed key
            await app(_in_process_request(f"{run_id}warm-{i}"), receive, send)
        warm = f"{run_id}warm-0"
        keys = [warm if workload == "replay" else f"{run_id}key-{i}" for i in range(n)]
        scopes = [_in_process_request(key) for key in keys]
        start = time.process_time()
        for one in scopes:
            await app(one, receive, send)
        return time.process_time() - start

    print(_run_loop(run()))
    return 0


def gc_probe(argv: Sequence[str]) -> int:
    """``--gc-probe WORKLOAD N [FIRST_CALLS_BEFORE] [SRC]``: the garbage collections N
    in-process requests to the middleware (memory://) set off, and the tracked objects
    they leave, after FIRST_CALLS_BEFORE first calls have filled the store. Replays
    use 64 keys, as the wrk replay workload does."""
    import collections
    import gc

    workload, n = argv[0], int(argv[1])
    before = int(argv[2]) if len(argv) > 2 else 0
    if len(argv) > 3:
        sys.path.insert(0, argv[3])
    app = _breakdown_app("middleware")
    receive, send = _in_process_receive, _in_process_send
    counts: collections.Counter[int] = collections.Counter()
    longest: dict[int, float] = collections.defaultdict(float)
    began = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            gen = info["generation"]
            counts[gen] += 1
            longest[gen] = max(longest[gen], (time.perf_counter() - began[0]) * 1e3)

    async def run() -> None:
        for i in range(REPLAY_KEYS):
            await app(_in_process_request(f"r-{i}"), receive, send)
        for i in range(before):
            await app(_in_process_request(f"before-{i}"), receive, send)
        gc.collect()
        tracked = len(gc.get_objects())
        gc.callbacks.append(timed)
        for i in range(n):
            key = f"r-{i % REPLAY_KEYS}" if workload == "replay" else f"k-{i}"
            await app(_in_process_request(key), receive, send)
        gc.callbacks.remove(timed)
        gc.collect()
        grown = len(gc.get_objects()) - tracked
        print(f"{workload}: {n} requests after {before} first calls")
        print(f"tracked objects left: {grown:+d} ({grown / n:+.2f} per request)")
        for gen in (0, 1, 2):
            print(f"gen{gen}: {counts[gen]} collections, longest {longest[gen]:.1f} ms")

    _run_loop(run())
    return 0


def _run_argv(name: str, workload: str, n: int, src: str | None) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--breakdown-run", name, workload]
    return [*argv, str(n), *([src] if src else [])]


def _instructions(name: str, workload: str, n: int, src: str | None) -> int:
    """Instructions the process executes for ``n`` requests (valgrind's callgrind)."""
    out = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            *_run_argv(name, workload, n, src),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    m = re.search(r"Collected : (\d+)", out.stderr)
    if m is None:
        raise BenchError(f"no instruction count from valgrind:\n{out.stderr[-2000:]}")
    return int(m.group(1))


def _cpu(name: str, workload: str, n: int, src: str | None) -> float:
    out = subprocess.run(
        _run_argv(name, workload, n, src), capture_output=True, text=True, check=True, cwd=ROOT
    )
    return float(out.stdout.split()[-1])


def breakdown(
    requests: int, src: str | None, variants: Sequence[str] = tuple(BREAKDOWN)
) -> tuple[str, dict[tuple[str, str], float]]:
    """Per-request cost of each in-process variant: valgrind instructions when valgrind
    is installed (exact: the same on every run), else the least CPU time of 9 runs."""
    from concurrent.futures import ThreadPoolExecutor

    have_peer = importlib.util.find_spec(PEER_MODULE) is not None
    names = [n for n in variants if n not in PEERS or have_peer]
    jobs = [(n, w) for n in names for w in ("first", "replay") if (n, w) != (PEER_REDIS, "replay")]
    if shutil.which("valgrind"):
        unit = "instructions"

        def cost(job: tuple[str, str]) -> float:
            # The difference of two runs leaves out start-up and warm-up.
            more = _instructions(*job, requests + 100, src)
            return (more - _instructions(*job, 100, src)) / requests
    else:
        unit = "CPU us"

        def cost(job: tuple[str, str]) -> float:
            return min(_cpu(*job, requests, src) for _ in range(9)) / requests * 1e6

    with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
        costs = dict(zip(jobs, pool.map(cost, jobs), strict=True))
    return unit, costs


def breakdown_table(unit: str, costs: dict[tuple[str, str], float]) -> list[str]:
    fmt = "{:,.0f}" if unit == "instructions" else "{:.1f}"
    out = [
        f"| in-process variant | first call: {unit}/request | added by this step "
        f"| replay: {unit}/request | added by this step |",
        "|---|--:|--:|--:|--:|",
    ]
    names = [name for name in BREAKDOWN if (name, "first") in costs]
    for i, name in enumerate(names):
        cells = []
        for w in ("first", "replay"):
            here = costs[name, w]
            cells.append(fmt.format(here))
            # floor is a side branch: plumbing adds to bare, like the floor does
            before = names[i - 1] if name not in ("bare", "plumbing", PEER_MEMORY) else "bare"
            cells.append("-" if name == "bare" else f"+{fmt.format(here - costs[before, w])}")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def breakdown_redis(requests: int, src: str | None) -> list[str]:
    """``--breakdown-redis``: the Redis variants in-process, against the Redis floor."""
    servers_mod = _load("_rsbench_servers", ROOT / "tests" / "_servers.py")
    with servers_mod.RedisServer() as redis:  # --save '' --appendonly no
        os.environ[REDIS_ENV] = redis.url
        unit, costs = breakdown(requests, src, tuple(BREAKDOWN_REDIS))
    out = [
        f"| in-process variant (Redis) | first call: {unit}/request | x floor-redis "
        f"| replay: {unit}/request | x floor-redis |",
        "|---|--:|--:|--:|--:|",
    ]
    for name in BREAKDOWN_REDIS:
        cells = []
        for w in ("first", "replay"):
            here, floor = costs.get((name, w)), costs.get(("floor-redis", w))
            cells += (
                ["-", "-"] if here is None or not floor else [f"{here:,.0f}", f"{here / floor:.2f}"]
            )
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def _wrap(text: str) -> str:
    return textwrap.fill(text, 88, break_long_words=False, break_on_hyphens=False)


def render_breakdown(
    unit: str, costs: dict[tuple[str, str], float], command: str, requests: int, code: str
) -> str:
    how = (
        "instructions executed (valgrind's callgrind: the same on every run, whatever the "
        "machine's load), the difference between runs of 100 and "
        f"{requests + 100} requests"
        if unit == "instructions"
        else f"the least CPU time of 9 runs of {requests} requests"
    )
    return "\n".join(
        [
            "#### Where the time goes (in-process)",
            "",
            _wrap(
                f"Generated by `bench/http.py --breakdown --write` on "
                f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; do not edit by hand. Each variant runs "
                "in a process of its own, without sockets or a server: a loop of POSTs with a "
                "new key each (first calls) or one completed key (replays), the body and "
                "headers of the HTTP run, the memory store, ASGI scopes built beforehand. Each "
                "step adds one part of the middleware to the step above it (the floor, a side "
                f"branch, adds to bare). Cost per request: {how}."
            ),
            "",
            "```",
            command,
            "```",
            "",
            *breakdown_table(unit, costs),
            "",
            *(f"- {name}: {what}" for name, what in BREAKDOWN.items()),
            f"- retrysafe: {code}",
            "",
        ]
    )


# -- the report -------------------------------------------------------------------------------

BEGIN_MARK = "<!-- bench/http.py: generated from here -->"
END_MARK = "<!-- bench/http.py: generated up to here -->"


def splice(path: Path, generated: str, marks: tuple[str, str] = (BEGIN_MARK, END_MARK)) -> str:
    """The file with its generated part replaced (appended when it has none)."""
    begin, end = marks
    block = f"{begin}\n{generated.rstrip()}\n{end}\n"
    old = path.read_text() if path.exists() else ""
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        return f"{head}{block}\n{tail}" if tail else f"{head}{block}"
    return f"{old.rstrip()}\n\n{block}" if old else block


ENDPOINTS = {
    "asgi": "a pure ASGI app: reads the body, answers 201 with a prebuilt "
    f"{len(ANSWER_BYTES)}-byte JSON body",
    "starlette": "a Starlette route: `await request.body()`, then "
    "`JSONResponse({...}, status_code=201)`",
}


def render(
    rows: Sequence[Row],
    variants: Sequence[Variant],
    args: argparse.Namespace,
    command: str,
    info: dict[str, str],
    elapsed: float,
    skipped: Sequence[tuple[str, str]],
) -> str:
    settings = server_settings()
    names = list(dict.fromkeys(v.name for v in variants))
    out = [
        "### The last run",
        "",
        _wrap(
            f"Generated by `bench/http.py --write` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; "
            "do not edit by hand. All servers ran at once and were measured interleaved, in "
            f"{args.rounds} rounds of {args.seconds} s per server and workload (the order "
            "flips every round), after a warm-up. A ratio is the median over the rounds of "
            "the variant's rate divided by its bare server's rate *in the same round*; "
            "req/s, p50, p99 and CPU are medians over the rounds."
        ),
        "",
        "#### Command",
        "",
        "```",
        command,
        "```",
        "",
        f"The run took {elapsed:.0f} s.",
        "",
        "#### Setup",
        "",
        *(f"- endpoint `{app}`: {ENDPOINTS[app]}, `POST {PATH}`" for app in args.apps),
        f"- uvicorn with `http={settings['http']}`, `loop={settings['loop']}`, one worker per",
        "  server, `log_level=warning`, no access log: the same settings for every server,",
        "  each its own process on its own loopback port",
        f"- load: `wrk -t {args.threads} -c {args.connections} -d {args.seconds}s --latency` "
        "with a Lua script:",
        f"  every request a POST with a {len(REQUEST_BODY)}-byte JSON body and an "
        "`Idempotency-Key`.",
        f"  First calls: a new key per request. Replays: {REPLAY_KEYS} keys, each sent once",
        "  before the measurement, then repeated. A measurement is invalid (left out) on a",
        "  non-2xx/3xx answer, a socket error, or an endpoint that ran other than once per",
        "  first call or at all on a replay (it counts its executions)",
        "- p50, p99: wrk's latency distribution; server CPU us/req: user + system CPU time",
        "  of the server process per completed request (the gateway's: gateway + upstream;",
        "  Redis's own CPU is not counted); CPU ratio: the median over the rounds of bare's",
        "  server CPU per request divided by the variant's, the ratio a server that is the",
        "  bottleneck would reach, less sensitive than req/s to other load on the machine",
        "- floor middleware: one store call to claim the key or find its answer, the",
        "  endpoint, one store call to keep the answer; a replay answers the stored bytes.",
        "  No fingerprint, scope, key validation, engine or stored headers: what any",
        "  idempotency middleware must spend with that store and client library",
        *(f"- {n}: {SPECS[n].detail}" for n in names),
        *(f"- {n}: skipped: {why}" for n, why in skipped),
        *(
            [f"- (candidate): the same, importing retrysafe from `{args.candidate}`"]
            if args.candidate
            else []
        ),
        "",
        "#### Machine",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        "- wrk, the servers and Redis share the machine's CPUs, over loopback TCP",
        "",
        "#### Results",
        "",
        *results_table(rows),
        "",
    ]
    invalid = [f"- {r.variant.label} / {r.workload}: {p}" for r in rows for p in r.problems]
    if invalid:
        out += ["Invalid measurements (left out of the figures):", "", *invalid, ""]
    return "\n".join(out)


def retrysafe_version() -> str:
    return importlib.metadata.version("retrysafe")


def export_rev(rev: str, stack: contextlib.ExitStack) -> tuple[str, str]:
    """``src/`` of git revision ``rev`` in a temporary folder, and how to name it."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", f"{rev}^{{commit}}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rsbench-rev-")))
    archive = subprocess.run(
        ["git", "archive", commit, "src"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    return str(tmp / "src"), f"git {commit}, exported with `git archive` (not the working tree)"


# -- main ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=int, default=5, help="per server, workload and round")
    p.add_argument("--warmup", type=int, default=2, help="seconds per server and workload")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="wrk threads")
    p.add_argument("--app", default="asgi", help="asgi, starlette or asgi,starlette")
    p.add_argument("--variants", default=",".join(SPECS), help="bare is always measured")
    p.add_argument("--workloads", default="first,replay")
    p.add_argument(
        "--profile",
        metavar="VARIANT",
        choices=tuple(SPECS),
        help="profile one variant's server (cProfile) instead of benchmarking",
    )
    p.add_argument("--top", type=int, default=30, help="functions listed by --profile")
    p.add_argument(
        "--breakdown",
        type=int,
        nargs="?",
        const=1000,
        metavar="REQUESTS",
        help="instead of benchmarking: the middleware's cost per request in-process, "
        "part by part (valgrind instructions if installed, else CPU time)",
    )
    p.add_argument(
        "--breakdown-redis",
        type=int,
        nargs="?",
        const=1000,
        metavar="REQUESTS",
        help="as --breakdown, for the Redis variants on a redis-server of its own",
    )
    p.add_argument(
        "--rev",
        help="measure this git revision's src/ (exported with git archive) "
        "instead of the working tree",
    )
    p.add_argument(
        "--candidate",
        metavar="DIR",
        help="also run every retrysafe variant importing retrysafe from DIR (the "
        "folder that holds a changed retrysafe package): a patch against the "
        "installed code, in the same run",
    )
    p.add_argument(
        "--write",
        nargs="?",
        const="docs/performance.md",
        metavar="PATH",
        help="splice the results into PATH (default docs/performance.md)",
    )
    args = p.parse_args(argv)
    args.apps = list(dict.fromkeys(args.app.split(",")))
    if not args.apps or any(a not in APPS for a in args.apps):
        p.error(f"--app: {' or '.join(APPS)}, or both separated by a comma")
    if args.candidate and not (Path(args.candidate) / "retrysafe" / "__init__.py").exists():
        p.error(f"--candidate: {args.candidate} holds no retrysafe package")
    unknown = set(args.variants.split(",")) - set(SPECS)
    if unknown:
        p.error(f"unknown variants: {', '.join(sorted(unknown))}")
    args.workload_names = [WORKLOADS[w] for w in args.workloads.split(",") if w in WORKLOADS]
    if not args.workload_names:
        p.error("--workloads: first and/or replay")
    if args.seconds < 1 or args.warmup < 1:
        p.error("--seconds and --warmup: whole seconds, at least 1 (what wrk -d takes)")
    if args.connections < args.threads:
        p.error("--connections must be at least --threads")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve"]:
        return serve(argv[1:])
    if argv[:1] == ["--breakdown-run"]:
        return breakdown_run(argv[1:])
    if argv[:1] == ["--gc-probe"]:
        return gc_probe(argv[1:])
    args = parse_args(argv)
    # Stop the servers on SIGTERM and SIGINT too (a shell ignores SIGINT for a
    # background job): both unwind the ExitStack below.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stores = _load("_rsbench_stores", HERE / "stores.py")  # machine and git details
    with contextlib.ExitStack() as stack:
        script = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "post.lua"
        script.write_text(f"BODY = {json.dumps(REQUEST_BODY)}\n{LUA}")
        load = Load(args.threads, args.connections, args.seconds, script)
        base, code = None, f"{retrysafe_version()} ({stores.git_state()})"
        if args.rev:
            base, code = export_rev(args.rev, stack)
        if args.breakdown_redis:
            print(stores.plain(breakdown_redis(args.breakdown_redis, base)))
            return 0
        if args.breakdown:
            unit, costs = breakdown(args.breakdown, base)
            print(stores.plain(breakdown_table(unit, costs)))
            if args.candidate:
                print(f"\ncandidate ({args.candidate}):")
                print(stores.plain(breakdown_table(*breakdown(args.breakdown, args.candidate))))
            if args.write:
                command = shlex.join(["python", "bench/http.py", *argv])
                path = Path(args.write) if Path(args.write).is_absolute() else ROOT / args.write
                text = render_breakdown(unit, costs, command, args.breakdown, code)
                path.write_text(splice(path, text, BREAKDOWN_MARKS))
                print(f"\nwrote {path}")
            return 0
        if args.profile:
            if args.profile == GATEWAY and not gateway_available():
                print("retrysafe.gateway does not exist (yet)", file=sys.stderr)
                return 1
            profile(args.profile, args.apps[0], load, args.top)
            return 0
        info = stores.machine_info()
        info["retrysafe"] = code
        wrk = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.split()
        info["wrk"] = " ".join(wrk[:2])
        info["server libraries"] = stores.library_info(LIBRARIES)
        names, skipped = choose(args.variants.split(","))
        t0 = time.monotonic()
        variants = start_variants(names, args.apps, stack, info, args.candidate, base)
        print(f"servers: {', '.join(f'{v.label} :{v.server.port}' for v in variants)}", flush=True)
        run_rounds(variants, args.workload_names, load, args.rounds, args.warmup)
        elapsed = time.monotonic() - t0
    info["load average at end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = rows_of(variants, args.workload_names)
    print()
    print(stores.plain(results_table(rows)))
    if args.write:
        command = shlex.join(["python", "bench/http.py", *argv])
        path = Path(args.write) if Path(args.write).is_absolute() else ROOT / args.write
        text = render(rows, variants, args, command, info, elapsed, skipped)
        path.write_text(splice(path, text))
        print(f"\nwrote {path}")
    return 1 if any(r.problems for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
