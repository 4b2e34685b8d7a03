"""bench/peers.py's duplicate storm: K keys, each sent by M concurrent callers, in
threads, in process, and to uvicorn processes (which run ``bench/peers.py --serve``).

Loaded by path by bench/peers.py (see its docstring); not a script of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# bench/peers.py loads this module by path, after the ones it uses (the bench
# folder stays off sys.path: see there); they are in sys.modules by then.
pa = sys.modules["_rsbench_peers_app"]

#: The script the uvicorn processes run (with ``--serve``).
SCRIPT = Path(__file__).resolve().with_name("peers.py")
ROOT = SCRIPT.parent.parent


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
    mw: pa.Middleware, url: str, ns: str, keys: int, callers: int, wave: int, work: float
) -> Storm:
    """K keys x M concurrent asyncio tasks against one in-process app."""
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(url)
    counts = f"{ns}exec:{mw.name}:asgi:{wave}"
    endpoint = pa.Endpoint(work, client, counts)
    app, close = mw.wrap(endpoint.app, url, f"{ns}storm-asgi:")
    names = _storm_keys(secrets.token_hex(4), keys)
    answers: Counter[str] = Counter()
    after: Counter[str] = Counter()
    try:
        t0 = time.perf_counter()
        for chunk in _waves(names, wave):
            results = await asyncio.gather(
                *(pa.post(app, key) for key in chunk for _ in range(callers)),
                return_exceptions=True,
            )
            for r in results:
                answers[
                    f"raised {type(r).__name__}"
                    if isinstance(r, BaseException)
                    else pa.classify(r[0], r[1], mw.replay_header)
                ] += 1
        seconds = time.perf_counter() - t0
        for key in names:
            status, headers, _ = await pa.post(app, key)
            after[pa.classify(status, headers, mw.replay_header)] += 1
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
                    str(SCRIPT),
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
        return f"http://{pa.HOST}:{self.port}"

    def wait_ready(self, timeout: float = 30.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise pa.BenchError(f"server exited:\n{self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + pa.HEALTH, timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise pa.BenchError(f"server on port {self.port} did not answer in {timeout}s")
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
    urls: Sequence[str], mw: pa.Middleware, keys: int, callers: int, wave: int
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
                urls[i % len(urls)] + pa.PATH,
                content=pa.REQUEST_BODY,
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
    for name in pa.MIDDLEWARES:
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
            mw = pa.MIDDLEWARES[name]
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
    executions: dict[str, Counter[str]] = {pa.SUBJECT: Counter(), "Powertools": Counter()}
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
        return ran(pa.SUBJECT, order)

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
            waves, ((pa.SUBJECT, charge_rs), ("Powertools", charge_pt))
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
    p.add_argument("--middleware", choices=list(pa.MIDDLEWARES), required=True)
    p.add_argument("--redis", required=True)
    p.add_argument("--ns", required=True)
    p.add_argument("--work", type=float, default=0.0)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    mw = pa.MIDDLEWARES[args.middleware]
    client = redis.asyncio.Redis.from_url(args.redis)
    endpoint = pa.Endpoint(args.work, client, f"{args.ns}exec:{mw.name}:uvicorn")
    app, _close = mw.wrap(endpoint.app, args.redis, f"{args.ns}storm-uvicorn:")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    uvicorn.run(app, host=pa.HOST, port=args.port, loop=loop, log_level="warning", access_log=False)
    return 0
