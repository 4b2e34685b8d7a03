"""Exactly once under load: a storm of keyed requests on N worker processes, one store.

``uvicorn --workers N`` serves a small ASGI endpoint behind
``retrysafe.asgi.IdempotencyMiddleware``, every worker on the same store: SQLite (a
file), Redis, Redis Cluster (3 primaries + 3 replicas), PostgreSQL or MySQL (``mysql``:
a private MariaDB, started as the tests start it), each server started here on
loopback and stopped at the end. The endpoint's side effect is one line per
execution appended to a file of the worker's own (``O_APPEND``), so the count crosses
processes and costs no store round trip.

The storm: ``--requests`` POSTs (100,000 by default) with an ``Idempotency-Key``, of
which ``--duplicates`` (30 %) are extra copies of a key (one to a few per key). Every
copy of a key goes out at the same moment, each on a keep-alive connection of its
own, so a duplicate races its first copy; ``--connections`` connections from
``--clients`` load processes (a minimal HTTP/1.1 client on asyncio streams: httpx
would be the bottleneck) keep as many keys in flight as fit. A 409 (in flight) is
sent again after 10 ms, as a client honouring ``Retry-After`` would, until a 2xx.
Each execution awaits ``--work`` seconds (5 ms) after its side effect, as a
handler's own I/O would. The table counts the keys whose duplicates found the first
copy still running (a 409); the others were replayed. ``--stores memory`` gives each
worker a store of its own, to see the check fail.

It prints, per store: throughput (answers per second, 409s included), p50/p99
latency of an answer, the status counts, executions against distinct keys, keys run
more than once (must be 0), keys whose answers differ (must be 0), and exits 1 if
either is not 0. This is a benchmark, not a test (pytest does not run it).

    python bench/load.py [--stores sqlite,redis,cluster,postgres,mysql] [--requests N]
                         [--duplicates F] [--workers N] [--connections C] [--clients P]
                         [--work SECONDS] [--write [docs/performance.md]]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _load(name: str, path: Path) -> ModuleType:
    """A module by file path, without putting its folder on sys.path."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


BEGIN_MARK = "<!-- bench/load.py: generated from here -->"
END_MARK = "<!-- bench/load.py: up to here -->"
EFFECTS = "RSLOAD_EFFECTS"
STORE = "RSLOAD_STORE"
WORK = "RSLOAD_WORK"


# -- the server side (imported by uvicorn in each worker) ----------------------------------


def app() -> Any:
    """The endpoint behind the middleware, on the store of $RSLOAD_STORE (a factory)."""
    from retrysafe.asgi import IdempotencyMiddleware

    effects = Path(os.environ[EFFECTS])
    work = float(os.environ.get(WORK, "0"))
    state: dict[str, Any] = {"fd": None, "n": 0}

    async def endpoint(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        key = dict(scope["headers"]).get(b"idempotency-key", b"").decode()
        if state["fd"] is None:  # per worker process, opened after the fork
            state["fd"] = os.open(
                effects / f"{os.getpid()}", os.O_WRONLY | os.O_APPEND | os.O_CREAT
            )
        os.write(state["fd"], f"{key}\n".encode())
        state["n"] += 1
        if work:
            await asyncio.sleep(work)  # the handler's own I/O: duplicates arrive meanwhile
        body = json.dumps({"key": key, "by": os.getpid(), "n": state["n"]}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 201,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return IdempotencyMiddleware(endpoint, store=os.environ[STORE])


# -- the load side -------------------------------------------------------------------------


def plan(requests: int, duplicates: float, seed: int = 7) -> list[tuple[str, int]]:
    """(key, copies) pairs: ``requests`` in all, ``duplicates`` of them extra copies."""
    rng = random.Random(seed)
    distinct = requests - int(requests * duplicates)
    copies = Counter({i: 1 for i in range(distinct)})
    for _ in range(requests - distinct):
        copies[rng.randrange(distinct)] += 1
    run = f"{rng.getrandbits(48):012x}"
    return [(f"{run}-{i}", copies[i]) for i in range(distinct)]


class _Conn:
    """One keep-alive HTTP/1.1 connection that sends the storm's POST."""

    BODY = b'{"amount": 100, "currency": "EUR"}'

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.head = (
            b"POST /orders HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\n"
            b"authorization: Bearer rsbench\r\n"
            b"content-length: %d\r\n" % len(self.BODY)
        )

    async def post(self, key: str) -> tuple[int, bytes]:
        self.writer.write(self.head + b"idempotency-key: " + key.encode() + b"\r\n\r\n" + self.BODY)
        status = int((await self.reader.readline()).split()[1])
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        return status, await self.reader.readexactly(length)


async def _ask(conn: _Conn, key: str, out: list[Any]) -> None:
    """One copy of a key, sent again after 10 ms while it is answered 409."""
    while True:
        t0 = time.perf_counter()
        status, answer = await conn.post(key)
        out.append((key, status, time.perf_counter() - t0, answer if status < 300 else b""))
        if status != 409:
            return
        await asyncio.sleep(0.01)


def _load_process(port: int, groups: list[tuple[str, int]], connections: int, queue: Any) -> None:
    """One load process: every copy of a key goes out at the same moment, each on a
    connection of its own; ``connections`` connections, as many keys at once as fit."""
    out: list[Any] = []

    async def run() -> None:
        free: asyncio.Queue[_Conn] = asyncio.Queue()
        for _ in range(connections):
            free.put_nowait(_Conn(*await asyncio.open_connection("127.0.0.1", port)))
        taking = asyncio.Lock()  # a key takes all its connections, then the next key
        todo = iter(groups)

        async def worker() -> None:
            for key, copies in todo:
                async with taking:
                    conns = [await free.get() for _ in range(copies)]
                await asyncio.gather(*(_ask(c, key, out) for c in conns))
                for c in conns:
                    free.put_nowait(c)

        await asyncio.gather(*(worker() for _ in range(connections)))
        while not free.empty():
            free.get_nowait().writer.close()

    asyncio.run(run())
    queue.put(out)


def storm(
    port: int, groups: list[tuple[str, int]], connections: int, clients: int
) -> tuple[list[Any], float]:
    """Send the keys from ``clients`` processes (each its share of the keys and of the
    connections); the answers and the seconds it took."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    share = max(connections // clients, max(n for _, n in groups))
    procs = [
        ctx.Process(target=_load_process, args=(port, groups[c::clients], share, queue))
        for c in range(clients)
    ]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results = [queue.get(timeout=1800) for _ in procs]
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    return [r for chunk in results for r in chunk], elapsed


# -- servers -------------------------------------------------------------------------------


def start_store(kind: str, tmp: Path, stack: contextlib.ExitStack) -> str:
    servers = bs._servers_module()
    if kind == "sqlite":
        return f"sqlite:///{tmp}/load.db"
    if kind == "memory":  # one store per worker: the check must find keys run twice
        return "memory://"
    if kind == "cluster":
        cluster = stack.enter_context(servers.RedisCluster(3, 1))
        return str(cluster.url)
    return bs.start_server(kind, stack)  # redis, postgres, mysql (a MariaDB)


def serve(
    url: str, effects: Path, workers: int, work: float
) -> tuple[subprocess.Popen[bytes], int]:
    port = bs._servers_module().free_port()
    env = {**os.environ, STORE: url, EFFECTS: str(effects), WORK: str(work)}
    # uvicorn imports the app by name; bench/ itself cannot be on sys.path (its http.py
    # would shadow the standard library's), so a one-line module elsewhere loads it.
    shim = effects.parent / "rsload_app.py"
    shim.write_text(
        f"import importlib.util as u\ns = u.spec_from_file_location('rsload', "
        f"{str(Path(__file__).resolve())!r})\nm = u.module_from_spec(s)\n"
        "s.loader.exec_module(m)\napp = m.app\n"
    )
    argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "rsload_app:app",
        "--app-dir",
        str(shim.parent),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--log-level",
        "warning",
        "--no-access-log",
        "--backlog",
        "4096",
    ]
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"uvicorn on {url} did not start")
        time.sleep(0.1)
    time.sleep(1.0)  # let every worker finish its startup (a bound socket is the parent's)
    return proc, port


def stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# -- one store -----------------------------------------------------------------------------


def measure(kind: str, args: argparse.Namespace, groups: list[tuple[str, int]]) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rsload-")))
        effects = tmp / "effects"
        effects.mkdir()
        url = start_store(kind, tmp, stack)
        proc, port = serve(url, effects, args.workers, args.work)
        try:
            results, elapsed = storm(port, groups, args.connections, args.clients)
        finally:
            stop(proc)
        runs: Counter[str] = Counter()
        by_worker = {}
        for f in effects.iterdir():
            lines = f.read_text().splitlines()
            by_worker[f.name] = len(lines)
            runs.update(lines)
    statuses = Counter(status for _, status, _, _ in results)
    # A duplicate "in flight" got at least one 409: it came while its first copy ran.
    in_flight = len({key for key, status, _, _ in results if status == 409})
    answers: dict[str, set[bytes]] = {}
    for key, status, _, body in results:
        if status < 300:
            answers.setdefault(key, set()).add(body)
    latencies = sorted(t for _, _, t, _ in results)
    distinct = {key for key, _ in groups}
    requests = sum(n for _, n in groups)
    return {
        "store": kind,
        "requests": requests,
        "distinct": len(distinct),
        "duplicates": requests - len(distinct),
        "http": len(results),
        "seconds": elapsed,
        "rate": len(results) / elapsed,
        "p50": latencies[len(latencies) // 2] * 1000,
        "p99": latencies[int(len(latencies) * 0.99)] * 1000,
        "statuses": dict(sorted(statuses.items())),
        "in_flight": in_flight,
        "executions": sum(runs.values()),
        "twice": sum(1 for n in runs.values() if n > 1),
        "never": len(distinct - set(runs)),
        "unanswered": len(distinct - set(answers)),
        "differ": sum(1 for a in answers.values() if len(a) > 1),
        "workers_ran": len([n for n in by_worker.values() if n]),
    }


def row(r: dict[str, Any]) -> str:
    st = ", ".join(f"{k}: {v}" for k, v in r["statuses"].items())
    return (
        f"| {r['store']} | {r['requests']:,} ({r['duplicates']:,} dup., {r['in_flight']:,} "
        f"keys met in flight) | {r['rate']:,.0f} "
        f"| {r['p50']:.1f} / {r['p99']:.1f} | {st} | {r['executions']:,} / {r['distinct']:,} "
        f"| {r['twice']} | {r['differ']} | {r['workers_ran']} |"
    )


def render(results: Sequence[dict[str, Any]], command: str, info: dict[str, str]) -> str:
    lines = ["### The last run", "", "```sh", command, "```", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    lines += [
        "",
        "| store | requests | answers/s | p50 / p99 ms | statuses | executions / keys "
        "| keys run twice | keys with differing answers | workers that ran |",
        "|---|--:|--:|--:|---|--:|--:|--:|--:|",
    ]
    lines += [row(r) for r in results]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stores", default="sqlite,redis,cluster,postgres,mysql")
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--duplicates", type=float, default=0.3)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--work", type=float, default=0.005, help="seconds each execution waits")
    p.add_argument("--write", nargs="?", const=str(ROOT / "docs/performance.md"))
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the servers on the way out
    if shutil.which("redis-server") is None and {"redis", "cluster"} & set(args.stores.split(",")):
        raise SystemExit("redis-server is needed (bash scripts/test.sh installs it)")
    info = bs.machine_info()
    command = "python bench/load.py " + " ".join(sys.argv[1:])
    groups = plan(args.requests, args.duplicates)
    results = []
    for kind in args.stores.split(","):
        r = measure(kind, args, groups)
        results.append(r)
        print(json.dumps(r), flush=True)
    info["load average at end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    info["setup"] = (
        f"uvicorn --workers {args.workers}, {args.connections} connections from "
        f"{args.clients} load processes, {args.work * 1000:g} ms of awaited work "
        "per execution"
    )
    text = render(results, command, info)
    print(text)
    if args.write:
        path = Path(args.write)
        path.write_text(bs.splice(path, text, (BEGIN_MARK, END_MARK), "## Load: exactly once"))
    bad = [r["store"] for r in results if r["twice"] or r["differ"] or r["never"]]
    if bad:
        print(f"DUPLICATE OR LOST EXECUTIONS on {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__" or os.environ.get(STORE) is None:
    bs = _load("rsbench_stores", HERE / "stores.py")

if __name__ == "__main__":
    sys.exit(main())
