"""Peers side by side: retrysafe and the idempotency libraries a Python user would pick,
the same workload in one run, on one Redis server.

* **function level**: ``@retrysafe.idempotent`` (RedisStore) against Powertools for AWS
  Lambda's ``idempotent_function`` with its ``RedisCachePersistenceLayer``, run outside
  Lambda (bench/stores.py's decorator contenders, reused as they are);
* **HTTP level**: one Starlette app with one POST endpoint, wrapped by
  ``retrysafe.asgi.IdempotencyMiddleware`` and by each peer ASGI middleware from PyPI
  that has a Redis backend (``asgi-idempotency-header``, ``fastapi-idempotency-key``),
  driven in process through the raw ASGI interface (no socket, no HTTP client: what is
  measured is the middleware plus the same Starlette endpoint);
* **duplicate storm**: K distinct keys, each sent by M concurrent callers (threads for
  the decorators; asyncio tasks for the middlewares in one process; and two uvicorn
  server processes per middleware, the duplicates of a key split between them), with a
  handler that takes a while. Executions are counted per key in Redis, and every
  answer is classified (run, replay, 409, 422, error). Then every key is sent once more,
  as a client's retry after the storm would be.

Throughput contenders run interleaved in rounds after a warm-up (bench/stores.py's
``run_rounds``); a figure is the median over the rounds, a ratio a ratio of medians.
This is a benchmark, not a test (pytest does not run it). The peers are in the
``bench`` extra: ``pip install -e '.[bench]'``.

    python bench/peers.py [--rounds R] [--seconds S] [--warmup W] [--parts function,http,storm]
                          [--keys K] [--clients M] [--work SECONDS] [--rev REV]
                          [--write docs/performance.md]

It starts its own redis-server (no persistence) on a free loopback port and stops it
at the end. ``--rev`` measures a commit's ``src/`` (as bench/stores.py does), the
uvicorn servers included.
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
import importlib.util
import itertools
import json
import os
import secrets
import shlex
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

HOST = "127.0.0.1"
PATH = "/orders"
HEALTH = "/health"
REQUEST_BODY = b'{"order_id":"o-1","amount":1999,"currency":"eur"}'
FIRST, REPLAY = "first call", "replay"
SUBJECT = "retrysafe"
PARTS = ("function", "http", "storm")
BEGIN_MARK = "<!-- bench/peers.py: generated from here -->"
END_MARK = "<!-- bench/peers.py: up to here -->"
#: Requests per contender when counting Redis round trips.
COUNT_CALLS = 200

#: What each peer needs, and the distribution that brings it.
NEEDS = {
    "redis": "redis",
    "starlette": "starlette",
    "fastapi": "fastapi",  # asgi-idempotency-header's Redis backend imports fastapi.responses
    "aws_lambda_powertools.utilities.idempotency": "aws-lambda-powertools[aws-sdk]",
    "idempotency_header_middleware": "asgi-idempotency-header",
    "fastapi_idempotency_key": "fastapi-idempotency-key",
}


def _load(name: str, path: Path) -> ModuleType:
    """A module by file path, without putting its folder on sys.path."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def preflight() -> None:
    """Exit with a clear message if a peer (or what it needs) is not installed."""
    missing = []
    for module, dist in NEEDS.items():
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"  {module} (from {dist}): {exc}")
    if missing:
        raise SystemExit(
            "bench/peers.py needs the peers it compares, which are not installed:\n"
            + "\n".join(missing)
            + "\ninstall them with: pip install -e '.[bench]'"
        )


class BenchError(RuntimeError):
    """A contender did not do the work it is measured for."""


# -- the app: one POST endpoint -------------------------------------------------------------


class Endpoint:
    """A Starlette app with one POST endpoint that answers 201 and a small JSON body naming
    the key. It counts its executions in process (``calls``) and, given a Redis client,
    per key in a Redis hash (``HINCRBY``), so that several processes can be counted."""

    def __init__(self, work: float = 0.0, redis: Any = None, counts: str = "") -> None:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, PlainTextResponse, Response
        from starlette.routing import Route

        self.calls = 0

        async def create(request: Request) -> Response:
            order = await request.json()
            key = request.headers.get("idempotency-key", "")
            if work:
                await asyncio.sleep(work)
            self.calls += 1
            if redis is not None:
                await redis.hincrby(counts, key, 1)
            answer = {"id": "ch_123", "order_id": order["order_id"], "key": key}
            return JSONResponse(answer, status_code=201)

        async def health(request: Request) -> Response:
            return PlainTextResponse("ok")

        self.app = Starlette(routes=[Route(PATH, create, methods=["POST"]), Route(HEALTH, health)])


# -- the middlewares ------------------------------------------------------------------------

Closer = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class Middleware:
    name: str
    dist: str
    replay_header: bytes  # lowercase, as ASGI headers are
    detail: str
    wrap: Callable[[Any, str, str], tuple[Any, Closer]]  # (app, redis url, key prefix)


def _wrap_retrysafe(app: Any, url: str, ns: str) -> tuple[Any, Closer]:
    from retrysafe import Engine, open_store
    from retrysafe.asgi import IdempotencyMiddleware

    engine = Engine(open_store(url, prefix=f"{ns}rs:"))
    return IdempotencyMiddleware(app, store=engine), engine.aclose


def _wrap_header(app: Any, url: str, ns: str) -> tuple[Any, Closer]:
    import redis.asyncio
    from idempotency_header_middleware import IdempotencyHeaderMiddleware
    from idempotency_header_middleware.backends.redis import RedisBackend

    client = redis.asyncio.Redis.from_url(url)
    backend = RedisBackend(client, keys_key=f"{ns}hdr:keys", response_key=f"{ns}hdr:resp:")
    return IdempotencyHeaderMiddleware(app, backend=backend), client.aclose


def _wrap_fik(app: Any, url: str, ns: str) -> tuple[Any, Closer]:
    from fastapi_idempotency_key import IdempotencyMiddleware, RedisBackend

    backend = RedisBackend(redis_url=url, prefix=f"{ns}fik:")
    return IdempotencyMiddleware(app, backend=backend), backend.close


MIDDLEWARES = {
    m.name: m
    for m in (
        Middleware(
            SUBJECT,
            "retrysafe",
            b"idempotent-replayed",
            "`retrysafe.asgi.IdempotencyMiddleware(app, store=Engine(open_store(url)))`, "
            "default options",
            _wrap_retrysafe,
        ),
        Middleware(
            "asgi-idempotency-header",
            "asgi-idempotency-header",
            b"idempotent-replayed",
            "`IdempotencyHeaderMiddleware(app, backend=RedisBackend(redis.asyncio.Redis"
            ".from_url(url)))`, default options",
            _wrap_header,
        ),
        Middleware(
            "fastapi-idempotency-key",
            "fastapi-idempotency-key",
            b"idempotency-replayed",
            "`fastapi_idempotency_key.IdempotencyMiddleware(app, backend=RedisBackend("
            "redis_url=url))`, default options",
            _wrap_fik,
        ),
    )
}
PEERS = [name for name in MIDDLEWARES if name != SUBJECT]


# -- driving an ASGI app in process ---------------------------------------------------------


async def post(app: Any, key: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """One POST through the raw ASGI interface: (status, headers, body)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": PATH,
        "raw_path": PATH.encode(),
        "root_path": "",
        "query_string": b"",
        "client": (HOST, 50000),
        "server": (HOST, 80),
        "headers": [
            (b"host", b"bench"),
            (b"content-type", b"application/json"),
            (b"authorization", b"Bearer rsbench"),
            (b"content-length", str(len(REQUEST_BODY)).encode()),
            (b"idempotency-key", key.encode()),
        ],
    }
    done = asyncio.Event()
    started = False
    status = 0
    headers: list[tuple[bytes, bytes]] = []
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal started
        if not started:
            started = True
            return {"type": "http.request", "body": REQUEST_BODY, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status, headers = message["status"], list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    await app(scope, receive, send)
    return status, headers, b"".join(chunks)


def classify(status: int, headers: Sequence[tuple[bytes, bytes]], replay_header: bytes) -> str:
    """What an answer was: ran, replay, or the status code."""
    if status == 201:
        replayed = any(k.lower() == replay_header and v == b"true" for k, v in headers)
        return "replay" if replayed else "ran"
    return str(status)


ANSWER_NAMES = {
    "ran": "ran the endpoint (201)",
    "replay": "replay (201 + replay header)",
    "409": "409 in flight",
    "422": "422",
    "500": "500",
}


def describe_answers(answers: Counter[str], names: dict[str, str] = ANSWER_NAMES) -> str:
    total = sum(answers.values())
    if not total:
        return "-"
    return ", ".join(f"{names.get(a, a)} {n / total:.0%}" for a, n in answers.most_common())


# -- HTTP throughput -----------------------------------------------------------------------


@dataclass
class HttpSide:
    """One middleware over its own endpoint, driven from ``runner``'s event loop."""

    mw: Middleware
    endpoint: Endpoint
    app: Any
    close: Closer
    answers: dict[str, Counter[str]] = field(default_factory=dict)


def http_contenders(
    bs: Any, runner: asyncio.Runner, url: str, ns: str
) -> tuple[list[Any], dict[str, HttpSide]]:
    sides: dict[str, HttpSide] = {}
    contenders: list[Any] = []
    for name, mw in MIDDLEWARES.items():
        endpoint = Endpoint()
        app, close = mw.wrap(endpoint.app, url, f"{ns}tp:")
        side = HttpSide(mw, endpoint, app, close, {FIRST: Counter(), REPLAY: Counter()})
        sides[name] = side
        contenders += _side_contenders(bs, runner, side)
    # retrysafe first, each peer's first, retrysafe replay, each peer's replay
    firsts = [c for c in contenders if c.workload == FIRST]
    return firsts + [c for c in contenders if c.workload == REPLAY], sides


def _side_contenders(bs: Any, runner: asyncio.Runner, side: HttpSide) -> list[Any]:
    tag, seq = secrets.token_hex(4), itertools.count()
    replay_key = [""]
    replay_body = [b""]
    name, app, header = side.mw.name, side.app, side.mw.replay_header

    async def first(n: int) -> None:
        answers = side.answers[FIRST]
        for _ in range(n):
            status, headers, _ = await post(app, f"first-{tag}-{next(seq)}")
            answer = classify(status, headers, header)
            answers[answer] += 1
            if answer != "ran":
                raise BenchError(f"{name}: a first call answered {status}")

    async def prepare() -> None:
        replay_key[0] = f"replay-{tag}-{next(seq)}"
        status, _, body = await post(app, replay_key[0])
        if status != 201:
            raise BenchError(f"{name}: the first call of the replay key answered {status}")
        replay_body[0] = body

    async def replay(n: int) -> None:
        answers, key = side.answers[REPLAY], replay_key[0]
        for _ in range(n):
            status, headers, body = await post(app, key)
            answer = classify(status, headers, header)
            answers[answer] += 1
            # A peer that does not replay is reported as it answers (see describe_answers);
            # retrysafe must replay, and every replay must be the first answer.
            if answer == "replay" and json.loads(body) != json.loads(replay_body[0]):
                raise BenchError(f"{name}: a replay answered {body!r}, not {replay_body[0]!r}")
            if name == SUBJECT and answer != "replay":
                raise BenchError(f"{name}: a replay answered {status}")

    def executions() -> int:
        return side.endpoint.calls

    def sync(coro_fn: Callable[[int], Awaitable[None]]) -> Callable[[int], None]:
        return lambda n: runner.run(coro_fn(n))  # type: ignore[arg-type]

    return [
        bs.Contender(
            "http", name, FIRST, sync(first), executions=executions, detail=side.mw.detail
        ),
        bs.Contender(
            "http",
            name,
            REPLAY,
            sync(replay),
            lambda: runner.run(prepare()),
            executions,
            detail=side.mw.detail,
        ),
    ]


@contextlib.contextmanager
def counting_async_requests() -> Iterator[Counter[str]]:
    """Count every request redis.asyncio writes to a socket (one per round trip)."""
    from redis.asyncio.connection import AbstractConnection

    from_sync = sys.modules["_rsbench_stores"]._command_name
    original = AbstractConnection.send_packed_command
    sent: Counter[str] = Counter()

    async def send_packed_command(self: Any, command: Any, check_health: bool = True) -> None:
        sent[from_sync(command)] += 1
        await original(self, command, check_health)

    AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        AbstractConnection.send_packed_command = original  # type: ignore[method-assign]


def count_round_trips(c: Any, calls: int = COUNT_CALLS) -> Counter[str]:
    """Requests sent to Redis per call, by command (``c`` prepared first)."""
    c.prepare()
    with counting_async_requests() as sent:
        c.run(calls)
    return Counter({k: v / calls for k, v in sent.items()})


# -- the duplicate storm ---------------------------------------------------------------------


@dataclass
class Storm:
    """What one contender did under the storm."""

    where: str
    name: str
    keys: int
    callers: int
    wave: int  # keys sent at once (their callers all together)
    executions: Counter[str]  # per key
    answers: Counter[str]  # to every request of the storm
    after: Counter[str]  # to one more request per key, after the storm
    seconds: float

    @property
    def ran(self) -> int:
        return sum(self.executions.values())

    @property
    def duplicated_keys(self) -> int:
        return sum(1 for n in self.executions.values() if n > 1)

    @property
    def unexecuted_keys(self) -> int:
        return self.keys - sum(1 for n in self.executions.values() if n > 0)


def _storm_keys(tag: str, keys: int) -> list[str]:
    return [f"storm-{tag}-{i}" for i in range(keys)]


def _waves(names: list[str], wave: int) -> list[list[str]]:
    return [names[i : i + wave] for i in range(0, len(names), wave)]


async def _read_counts(url: str, counts: str) -> Counter[str]:
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(url)
    try:
        raw = await client.hgetall(counts)
    finally:
        await client.aclose()
    return Counter({k.decode(): int(v) for k, v in raw.items()})


async def asgi_storm(
    mw: Middleware, url: str, ns: str, keys: int, callers: int, wave: int, work: float
) -> Storm:
    """K keys x M concurrent asyncio tasks against one in-process app."""
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(url)
    counts = f"{ns}exec:{mw.name}:asgi:{wave}"
    endpoint = Endpoint(work, client, counts)
    app, close = mw.wrap(endpoint.app, url, f"{ns}storm-asgi:")
    names = _storm_keys(secrets.token_hex(4), keys)
    answers: Counter[str] = Counter()
    after: Counter[str] = Counter()
    try:
        t0 = time.perf_counter()
        for chunk in _waves(names, wave):
            results = await asyncio.gather(
                *(post(app, key) for key in chunk for _ in range(callers)), return_exceptions=True
            )
            for r in results:
                answers[
                    f"raised {type(r).__name__}"
                    if isinstance(r, BaseException)
                    else classify(r[0], r[1], mw.replay_header)
                ] += 1
        seconds = time.perf_counter() - t0
        for key in names:
            status, headers, _ = await post(app, key)
            after[classify(status, headers, mw.replay_header)] += 1
        executions = Counter(await client.hgetall(counts))
    finally:
        await close()
        await client.aclose()
    executions = Counter({k.decode(): int(v) for k, v in executions.items()})
    return Storm("in process", mw.name, keys, callers, wave, executions, answers, after, seconds)


class Server:
    """One uvicorn subprocess (``--serve``)."""

    def __init__(self, argv: list[str], port: int, log: Path) -> None:
        self.port, self.log = port, log
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

    def wait_ready(self, timeout: float = 30.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"server exited:\n{self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + HEALTH, timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise BenchError(f"server on port {self.port} did not answer in {timeout}s")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _http_storm(
    urls: Sequence[str], mw: Middleware, keys: int, callers: int, wave: int
) -> tuple[Counter[str], Counter[str], list[str], float]:
    import httpx

    names = _storm_keys(secrets.token_hex(4), keys)
    limits = httpx.Limits(max_connections=wave * callers, max_keepalive_connections=0)
    answers: Counter[str] = Counter()
    after: Counter[str] = Counter()
    header = mw.replay_header.decode()

    def kind(resp: httpx.Response) -> str:
        if resp.status_code == 201:
            return "replay" if resp.headers.get(header) == "true" else "ran"
        return str(resp.status_code)

    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def one(key: str, i: int) -> str:
            resp = await client.post(
                urls[i % len(urls)] + PATH,
                content=REQUEST_BODY,
                headers={
                    "content-type": "application/json",
                    "authorization": "Bearer rsbench",
                    "idempotency-key": key,
                },
            )
            return kind(resp)

        t0 = time.perf_counter()
        for chunk in _waves(names, wave):
            results = await asyncio.gather(
                *(one(key, i) for key in chunk for i in range(callers)), return_exceptions=True
            )
            for r in results:
                answers[f"raised {type(r).__name__}" if isinstance(r, BaseException) else r] += 1
        seconds = time.perf_counter() - t0
        for i, key in enumerate(names):
            after[await one(key, i)] += 1
    return answers, after, names, seconds


def server_storms(
    url: str,
    ns: str,
    keys: int,
    callers: int,
    waves: Sequence[int],
    work: float,
    stack: contextlib.ExitStack,
    free_port: Callable[[], int],
    processes: int = 2,
) -> list[Storm]:
    """Each middleware in ``processes`` uvicorn servers; a key's duplicates alternate."""
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rsbench-peers-")))
    servers: dict[str, list[Server]] = {}
    for name in MIDDLEWARES:
        servers[name] = []
        for i in range(processes):
            port = free_port()
            argv = ["--middleware", name, "--redis", url, "--ns", ns, "--work", str(work)]
            server = Server(argv, port, tmp / f"{name}-{i}.log")
            stack.callback(server.stop)
            servers[name].append(server)
    for group in servers.values():
        for server in group:
            server.wait_ready()
    storms = []
    where = f"{processes} uvicorn processes"
    for wave in waves:
        for name, group in servers.items():
            mw = MIDDLEWARES[name]
            answers, after, names, seconds = asyncio.run(
                _http_storm([s.url for s in group], mw, keys, callers, wave)
            )
            counted = asyncio.run(_read_counts(url, f"{ns}exec:{name}:uvicorn"))
            executions = Counter({k: n for k, n in counted.items() if k in set(names)})
            storm = Storm(where, name, keys, callers, wave, executions, answers, after, seconds)
            storms.append(storm)
            print(f"  {where} / {name}: {storm_line(storm)}", flush=True)
    for group in servers.values():
        for server in group:
            server.stop()
    return storms


def function_storms(
    url: str, ns: str, keys: int, callers: int, waves: Sequence[int], work: float
) -> list[Storm]:
    """K keys x M threads calling ``@idempotent`` and Powertools' ``idempotent_function``."""
    from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
    from aws_lambda_powertools.utilities.idempotency.persistence.redis import (
        RedisCachePersistenceLayer,
    )

    import retrysafe
    from retrysafe import Engine, open_store

    bs = sys.modules["_rsbench_stores"]
    executions: dict[str, Counter[str]] = {SUBJECT: Counter(), "Powertools": Counter()}
    lock = threading.Lock()

    ran_here = threading.local()  # whether this thread's call ran the function

    def ran(side: str, order: dict[str, Any]) -> dict[str, Any]:
        time.sleep(work)
        with lock:
            executions[side][order["order_id"]] += 1
        ran_here.ran = True
        return {"order_id": order["order_id"], "charged": order["amount"], "ok": True}

    engine = Engine(open_store(url, prefix=f"{ns}storm-dec:"))

    @retrysafe.idempotent(store=engine, key="{order[order_id]}")
    def charge_rs(order: dict[str, Any]) -> dict[str, Any]:
        return ran(SUBJECT, order)

    with warnings.catch_warnings():  # RedisConnection is deprecated in favour of a client
        warnings.simplefilter("ignore", DeprecationWarning)
        layer = RedisCachePersistenceLayer(url=url)
    config = IdempotencyConfig(event_key_jmespath="order_id")
    config.register_lambda_context(bs._FakeLambdaContext())

    @idempotent_function(
        data_keyword_argument="order",
        persistence_store=layer,
        config=config,
        key_prefix=f"{ns}storm-pt",
    )
    def charge_pt(order: dict[str, Any]) -> dict[str, Any]:
        return ran("Powertools", order)

    storms = []
    try:
        for wave, (side, func) in itertools.product(
            waves, ((SUBJECT, charge_rs), ("Powertools", charge_pt))
        ):
            storm = _thread_storm(side, func, executions[side], keys, callers, wave, ran_here)
            storms.append(storm)
            print(f"  threads / {side}: {storm_line(storm)}", flush=True)
    finally:
        engine.close()
        layer.client.close()
    return storms


def _thread_storm(
    side: str,
    func: Callable[..., Any],
    executions: Counter[str],
    keys: int,
    callers: int,
    wave: int,
    ran_here: threading.local,
) -> Storm:
    names = _storm_keys(secrets.token_hex(4), keys)
    answers: Counter[str] = Counter()
    after: Counter[str] = Counter()
    lock = threading.Lock()

    def call(key: str, into: Counter[str], barrier: threading.Barrier | None) -> None:
        if barrier is not None:
            barrier.wait()
        ran_here.ran = False
        try:
            func(order={"order_id": key, "amount": 1999})
            answer = "ran" if ran_here.ran else "returned"
        except Exception as exc:
            answer = f"raised {type(exc).__name__}"
        with lock:
            into[answer] += 1

    t0 = time.perf_counter()
    for chunk in _waves(names, wave):
        barrier = threading.Barrier(len(chunk) * callers)
        threads = [
            threading.Thread(target=call, args=(key, answers, barrier))
            for key in chunk
            for _ in range(callers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    seconds = time.perf_counter() - t0
    for key in names:
        call(key, after, None)
    executions = Counter({k: n for k, n in executions.items() if k in set(names)})
    return Storm(
        "threads, one process", side, keys, callers, wave, executions, answers, after, seconds
    )


def storm_line(s: Storm) -> str:
    return (
        f"{s.wave * s.callers} at once: {s.ran} executions for {s.keys} keys "
        f"({s.duplicated_keys} keys ran more than once); answers: {dict(s.answers)}; "
        f"after: {dict(s.after)}"
    )


# -- serving (runs in the uvicorn subprocesses) ------------------------------------------------


def serve(argv: Sequence[str]) -> int:
    """``--serve``: one middleware over the endpoint under uvicorn, until SIGTERM."""
    import redis.asyncio
    import uvicorn

    p = argparse.ArgumentParser(prog="bench/peers.py --serve")
    p.add_argument("--middleware", choices=list(MIDDLEWARES), required=True)
    p.add_argument("--redis", required=True)
    p.add_argument("--ns", required=True)
    p.add_argument("--work", type=float, default=0.0)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    mw = MIDDLEWARES[args.middleware]
    client = redis.asyncio.Redis.from_url(args.redis)
    endpoint = Endpoint(args.work, client, f"{args.ns}exec:{mw.name}:uvicorn")
    app, _close = mw.wrap(endpoint.app, args.redis, f"{args.ns}storm-uvicorn:")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    uvicorn.run(app, host=HOST, port=args.port, loop=loop, log_level="warning", access_log=False)
    return 0


# -- results ------------------------------------------------------------------------------------


def _spread(c: Any) -> str:
    return f"{min(c.samples):,.0f}-{max(c.samples):,.0f}"


def _x(value: float) -> str:
    return f"{value:.2f}x"


def pair_table(
    subject: Any,
    peers: Sequence[Any],
    answers: dict[str, str] | None = None,
    trips: dict[tuple[str, str], Counter[str]] | None = None,
) -> list[str]:
    """retrysafe against each peer for one workload, ratios both ways."""
    head = (
        "| workload | peer | retrysafe /s (median) | rounds min-max | peer /s (median) | "
        "rounds min-max | retrysafe / peer | peer / retrysafe | CPU us per call, "
        "retrysafe / peer |"
    )
    sep = "|---|---|--:|--:|--:|--:|--:|--:|--:|"
    if answers is not None:
        head += " what the peer answered |"
        sep += "---|"
    if trips is not None:
        head += " Redis round trips, retrysafe / peer |"
        sep += "--:|"
    lines = [head, sep]
    for peer in peers:
        ratio = subject.median / peer.median
        row = (
            f"| {subject.workload} | {peer.name} | {subject.median:,.0f} | {_spread(subject)} "
            f"| {peer.median:,.0f} | {_spread(peer)} | {_x(ratio)} | {_x(1 / ratio)} | "
            f"{subject.cpu:.0f} / {peer.cpu:.0f} |"
        )
        if answers is not None:
            row += f" {answers.get(peer.name, '-')} |"
        if trips is not None:
            mine = sum(trips[(subject.name, subject.workload)].values())
            theirs = sum(trips[(peer.name, peer.workload)].values())
            row += f" {mine:g} / {theirs:g} |"
        lines.append(row)
    return lines


def storm_table(storms: Sequence[Storm]) -> list[str]:
    lines = [
        "| callers | contender | keys x concurrent duplicates | requests at once | executions "
        "| keys run twice or more | keys never run | answers to the storm | answers to one "
        "retry per key afterwards |",
        "|---|---|--:|--:|--:|--:|--:|---|---|",
    ]
    for s in storms:
        dup = f"**{s.duplicated_keys}**" if s.duplicated_keys else "0"
        names = {"ran": "ran the function"} if s.where.startswith("threads") else ANSWER_NAMES
        lines.append(
            f"| {s.where} | {s.name} | {s.keys} x {s.callers} | {s.wave * s.callers} | "
            f"{s.ran} | {dup} | "
            f"{s.unexecuted_keys} | {describe_answers(s.answers, names)} | "
            f"{describe_answers(s.after, names)} |"
        )
    return lines


def trips_text(trips: Counter[str]) -> str:
    return ", ".join(f"{name} {n:g}" for name, n in sorted(trips.items())) or "-"


def render(
    args: argparse.Namespace,
    command: str,
    info: dict[str, str],
    libraries: str,
    dec: list[Any],
    http: list[Any],
    sides: dict[str, HttpSide],
    http_trips: dict[tuple[str, str], Counter[str]],
    storms: list[Storm],
    elapsed: float,
    bs: Any,
) -> str:
    out = [
        "### The last run",
        "",
        "Generated by `bench/peers.py --write`; do not edit by hand. Every figure comes from",
        "this run. Throughput contenders run interleaved in "
        f"{args.rounds} rounds of {args.seconds:g} s",
        "each (the order flips every round) after a warm-up; a rate is the median over the",
        "rounds, a ratio is a ratio of medians, and min-max is the spread over the rounds.",
        "One caller, one call at a time. CPU is this process's CPU time per call (the",
        "library's own Python work, which other load on the machine barely changes).",
        "",
        "#### Command",
        "",
        "```",
        command,
        "```",
        "",
        f"The run took {elapsed:.0f} s.",
        "",
        "#### Machine",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        f"- libraries: {libraries}",
        "- everything (benchmark, redis-server, uvicorn servers) on the one machine, over "
        "loopback TCP",
        "",
    ]
    if dec:
        subject = {c.workload: c for c in dec if c.name == bs.SUBJECT}
        peer = {c.workload: c for c in dec if c.name == bs.PEER}
        out += [
            "#### Function level: `@retrysafe.idempotent` against Powertools' "
            "`idempotent_function`",
            "",
            *pair_table(subject[FIRST], [peer[FIRST]]),
            *pair_table(subject[REPLAY], [peer[REPLAY]])[2:],
            "",
            "- Both decorate `charge(order: dict) -> dict`, called as `charge(order={...})`;",
            "  first calls use a new `order_id` each, replays repeat one completed `order_id`",
            "  (bench/stores.py's decorator contenders: every measurement checks that first",
            "  calls ran the function once each and replays not at all, and that replays",
            "  return the stored result).",
            f"- retrysafe: `{bs.RS_DETAIL}`",
            f"- Powertools: `{bs.PT_DETAIL}`, outside Lambda with a stand-in Lambda context",
            f"  whose remaining time is {bs.LAMBDA_REMAINING_MS} ms (retrysafe's default lease);",
            "  local cache and payload validation off (its defaults). retrysafe fingerprints",
            "  every argument (same key, other arguments: a conflict); Powertools, so",
            "  configured, does not.",
            "",
        ]
    if http:
        subject = {c.workload: c for c in http if c.name == SUBJECT}
        answers = {name: describe_answers(side.answers[REPLAY]) for name, side in sides.items()}
        for w in (FIRST, REPLAY):
            peers = [c for c in http if c.name != SUBJECT and c.workload == w]
            table = pair_table(
                subject[w], peers, answers if w == REPLAY else None, http_trips or None
            )
            out += [
                f"#### HTTP level, {w}s: the same Starlette endpoint behind each middleware",
                "",
                *table,
                "",
            ]
        out += [
            "- The app: one Starlette route, `POST /orders`, reading the JSON body and",
            "  answering 201 with a small JSON body (a `JSONResponse`). Requests go through",
            "  the raw ASGI interface in this process (no socket, no HTTP client), one at a",
            "  time, with an `Idempotency-Key`: a new one per first call; for replays, one",
            "  key completed before the measurement and then repeated. Every first call",
            "  must answer 201 and run the endpoint once, every replay must not run it;",
            "  a replay (201 and the middleware's replay header) must answer the first body.",
            "- A peer whose repeated requests did not replay is measured all the same, and",
            "  its answers are in the table: that rate is not a replay rate.",
            "- Redis round trips: requests redis.asyncio wrote to the socket per request,",
            f"  counted over {COUNT_CALLS} requests:",
        ]
        for (name, w), trips in http_trips.items():
            out.append(f"  - {name}, {w}: {trips_text(trips)}")
        out += [f"- {name}: {side.mw.detail}" for name, side in sides.items()]
        out.append("")
    if storms:
        out += [
            "#### Duplicate storm: executions per key",
            "",
            f"{args.keys} distinct keys, each sent by {args.clients} concurrent callers: once in",
            f"waves of {min(args.wave, args.keys)} keys (their callers all released together, "
            "the next wave",
            "when one is answered), once with every key at once (`requests at once`). The",
            f"handler takes {args.work * 1000:g} ms (a sleep) before it answers, so the",
            "duplicates arrive while the first attempt is in flight. Executions are counted",
            "per key (in Redis for the middlewares, so that several processes add up). After",
            "the storm every key is sent once more, as a client's retry would be.",
            "",
            *storm_table(storms),
            "",
            "- threads, one process: the decorators, one thread per call, all released",
            "  together by a barrier. `returned` is a call that returned the stored result",
            "  without running the function; `raised X` is the exception the call raised.",
            "- in process: the middlewares over the same endpoint in this process, one",
            "  asyncio task per request, a wave's all gathered at once. `raised",
            "  MaxConnectionsError`: redis-py's default pool (100 connections since",
            "  redis-py 8) refused the call and the middleware let it through (a 500 in a",
            "  server); retrysafe's pools wait for a free connection instead.",
            "- uvicorn processes: each middleware served by two uvicorn processes (as two",
            "  workers or two instances behind a load balancer would be) on one Redis; the",
            "  duplicates of a key alternate between the two, over real HTTP (httpx, one",
            "  connection per request).",
            "",
        ]
    return "\n".join(out)


# -- main -------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=1.0, help="length of one measurement")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per contender")
    p.add_argument("--warmup", type=float, default=0.3, help="warm-up seconds per contender")
    p.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated subset of " + ", ".join(PARTS)
    )
    p.add_argument("--keys", type=int, default=40, help="distinct keys in the storm")
    p.add_argument("--clients", type=int, default=8, help="concurrent callers per storm key")
    p.add_argument(
        "--wave", type=int, default=8, help="storm keys sent at once (then all --keys at once, too)"
    )
    p.add_argument("--work", type=float, default=0.05, help="seconds the storm handler takes")
    p.add_argument("--write", metavar="PATH", help="write the results as Markdown here")
    p.add_argument("--rev", help="measure this commit's src/ (git archive), not the work tree")
    args = p.parse_args(argv)
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        p.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    if args.rounds < 1 or args.seconds <= 0 or min(args.keys, args.wave) < 1 or args.clients < 2:
        p.error("--rounds, --keys and --wave must be at least 1, --clients 2, --seconds positive")
    args.waves = sorted({min(args.wave, args.keys), args.keys})
    return args


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--serve"]:
        return serve(sys.argv[2:])
    args = parse_args(argv)
    preflight()
    bs = _load("_rsbench_stores", HERE / "stores.py")
    if args.rev and not bs.in_rev():
        return int(bs.run_rev(args.rev))
    script = os.path.relpath(sys.argv[0]) if sys.argv[0] else "bench/peers.py"
    command = shlex.join(["python", script, *(sys.argv[1:] if argv is None else argv)])
    print(command, flush=True)
    started = time.monotonic()
    info = bs.machine_info()
    bs.note_rev(info)
    for k, v in info.items():
        print(f"  {k}: {v}")
    dec: list[Any] = []
    http: list[Any] = []
    sides: dict[str, HttpSide] = {}
    http_trips: dict[tuple[str, str], Counter[str]] = {}
    storms: list[Storm] = []

    with contextlib.ExitStack() as stack:
        url = bs.start_server("redis", stack)
        import redis

        admin = redis.Redis.from_url(url)
        stack.callback(admin.close)
        server = admin.info("server")
        info["redis-server"] = f"{server['redis_version']} (no persistence)"
        ns = f"rsbench-peers-{secrets.token_hex(4)}:"
        if "function" in args.parts:
            dec = bs.decorator_contenders(url, ns, stack)
            print(
                f"\n[function level] {len(dec)} contenders, {args.rounds} rounds of "
                f"{args.seconds:g}s",
                flush=True,
            )
            bs.run_rounds(dec, args.rounds, args.seconds, args.warmup)
        if "http" in args.parts:
            runner = stack.enter_context(asyncio.Runner())
            http, sides = http_contenders(bs, runner, url, ns)
            for side in sides.values():
                stack.callback(runner.run, side.close())
            print(
                f"\n[HTTP level] {len(http)} contenders, {args.rounds} rounds of {args.seconds:g}s",
                flush=True,
            )
            bs.run_rounds(http, args.rounds, args.seconds, args.warmup)
            for c in http:
                http_trips[(c.name, c.workload)] = count_round_trips(c)
            for side in sides.values():
                for w in (FIRST, REPLAY):
                    print(f"  {side.mw.name} {w}s answered: {describe_answers(side.answers[w])}")
        if "storm" in args.parts:
            print(
                f"\n[storm] {args.keys} keys x {args.clients} concurrent callers, handler "
                f"{args.work * 1000:g} ms",
                flush=True,
            )
            storms += function_storms(url, ns, args.keys, args.clients, args.waves, args.work)
            for wave, mw in itertools.product(args.waves, MIDDLEWARES.values()):
                storm = asyncio.run(
                    asgi_storm(mw, url, ns, args.keys, args.clients, wave, args.work)
                )
                print(f"  in process / {mw.name}: {storm_line(storm)}", flush=True)
                storms.append(storm)
            free_port = bs._servers_module().free_port
            storms += server_storms(
                url, ns, args.keys, args.clients, args.waves, args.work, stack, free_port
            )
    elapsed = time.monotonic() - started
    if hasattr(os, "getloadavg"):
        info["load average at end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())

    libraries = bs.library_info(
        [
            "aws-lambda-powertools",
            "asgi-idempotency-header",
            "fastapi-idempotency-key",
            "redis",
            "hiredis",
            "starlette",
            "uvicorn",
            "httpx",
        ]
    )
    doc = render(args, command, info, libraries, dec, http, sides, http_trips, storms, elapsed, bs)
    print()
    print(doc)
    if args.write:
        path = Path(args.write)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(bs.splice(path, doc, (BEGIN_MARK, END_MARK), "## Peers side by side"))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
