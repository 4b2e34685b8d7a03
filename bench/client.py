"""What step 6's client side costs: ``Client``, ``AsyncClient``, the gateway hop, the outbox.

In one run, from one thread, against one local HTTP server (a pure ASGI app that
answers 201 with a small JSON body, under uvicorn in a subprocess on a free
loopback port; keep-alive):

* **clients**: ``retrysafe.client.Client.post`` against a plain ``httpx.Client.post``
  (the floor), and ``AsyncClient.post`` against ``httpx.AsyncClient.post``: the same
  request to the same server; the retrysafe client adds a key and its bookkeeping;
* **gateway**: the same ``Client.post`` through ``python -m retrysafe gateway``
  (SQLite store) against straight to the server: first calls (a new key each) and
  retries (one key again, answered from the gateway's store);
* **enqueue**: ``Outbox.enqueue`` against a bare ``sqlite3`` autocommit INSERT of the
  same row into a WAL file on one kept-open connection, with two more floors that
  split the difference (``synchronous=NORMAL``; a connection per INSERT);
* **flush**: ``Outbox.flush(client)`` of N queued items against the same N
  ``Client.post`` calls sent directly (the items are queued before the clock starts).

Every variant runs interleaved with its floor in rounds (the order flips every round)
after a warm-up; figures are medians over the rounds, ratios ratios of medians (see
bench/stores.py). With strace installed, a separate pass counts the fsyncs, database
opens and file deletions per outbox operation. This is a benchmark, not a test.

    python bench/client.py [--rounds R] [--seconds S] [--flush-items N] [--no-syscalls]
                           [--rev REV] [--write docs/performance.md]

``--rev`` measures a commit's ``src/`` (exported with ``git archive``, run in a child
process, the gateway included) instead of a working tree that others may be editing.
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
import json
import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

BEGIN_MARK = "<!-- bench/client.py: generated from here -->"
END_MARK = "<!-- bench/client.py: generated up to here -->"
SECTION = "## Step 6: the client and the outbox"
LIBRARIES = ("httpx", "httpcore", "h11", "uvicorn", "uvloop", "httptools")


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bs = _load("_rsbench_stores", HERE / "stores.py")
Contender = bs.Contender
BenchError = bs.BenchError

# This script's own modules, in the order they use each other (each finds the ones
# loaded before it in sys.modules).
cn = _load("_rsbench_client_names", HERE / "_client_names.py")  # the shared names
cr = _load("_rsbench_client_report", HERE / "_client_report.py")  # the Markdown


# -- the server (runs in a uvicorn subprocess) ----------------------------------------------


class Endpoint:
    """Pure ASGI: read the body, answer 201 with a small prebuilt JSON body. Counts the
    POSTs it answered and those that carried an ``Idempotency-Key`` (``GET /_calls``)."""

    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(cn.ANSWER)).encode()),
    ]

    def __init__(self) -> None:
        self.calls = self.keyed = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["method"] == "GET":
            body = json.dumps({"calls": self.calls, "keyed": self.keyed}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            more = message.get("more_body", False)
        self.calls += 1
        if any(k == b"idempotency-key" for k, _ in scope["headers"]):
            self.keyed += 1
        await send({"type": "http.response.start", "status": 201, "headers": self.headers})
        await send({"type": "http.response.body", "body": cn.ANSWER})


def serve(port: int) -> int:
    import signal

    import uvicorn

    have = {m: importlib.util.find_spec(m) is not None for m in ("uvloop", "httptools")}
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    uvicorn.run(
        Endpoint(),
        host=cn.HOST,
        port=port,
        workers=1,
        log_level="warning",
        access_log=False,
        loop="uvloop" if have["uvloop"] else "asyncio",
        http="httptools" if have["httptools"] else "h11",
    )
    return 0


# -- processes -------------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (clock ticks, 10 ms on Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


class Process:
    """A server subprocess, its output in ``log``; ``url`` once it answers."""

    def __init__(self, name: str, argv: list[str], log: Path) -> None:
        self.name, self.log, self.url = name, log, ""
        with log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

    def wait(self, probe: Callable[[], str | None], timeout: float = 30.0) -> None:
        """Until ``probe()`` gives the URL of a server that answers."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")
            with contextlib.suppress(OSError, ValueError):
                url = probe()
                if url:
                    self.url = url
                    return
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name} did not answer in {timeout:g} s")
            time.sleep(0.1)

    @property
    def cpu(self) -> float:
        return _cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_upstream(tmp: Path, stack: contextlib.ExitStack) -> Process:
    servers = _load("_rsbench_servers", ROOT / "tests" / "_servers.py")
    port = servers.free_port()
    argv = [sys.executable, str(Path(__file__).resolve()), "--serve", str(port)]
    proc = Process("upstream", argv, tmp / "upstream.log")
    stack.callback(proc.stop)
    url = f"http://{cn.HOST}:{port}"
    proc.wait(lambda: url if _get(url + cn.CALLS_PATH) is not None else None)
    return proc


def start_gateway(upstream: str, store: str, tmp: Path, stack: contextlib.ExitStack) -> Process:
    argv = [
        sys.executable,
        "-m",
        "retrysafe",
        "gateway",
        "--upstream",
        upstream,
        "--store",
        store,
        "--listen",
        f"{cn.HOST}:0",
    ]
    proc = Process("gateway", argv, tmp / "gateway.log")
    stack.callback(proc.stop)

    def probe() -> str | None:
        found = re.search(r"listening on (http://\S+)", proc.log.read_text())
        if not found:
            return None
        url = found.group(1).rstrip("/")
        with urllib.request.urlopen(url + "/_retrysafe/health", timeout=5):
            return url

    proc.wait(probe)
    return proc


# -- measuring -------------------------------------------------------------------------------


@dataclass
class Served(Contender):  # type: ignore[misc,valid-type]
    """A contender that calls servers: also their CPU time per call (``pids``), summed
    over the rounds (the warm-up left out), since a process's CPU clock ticks in 10 ms."""

    procs: tuple[Process, ...] = ()
    sent: list[int] = field(default_factory=lambda: [0])  # calls made, warm-up included
    server_s: list[float] = field(default_factory=list)
    server_n: list[int] = field(default_factory=list)

    def _server_cpu(self) -> float:
        return sum(p.cpu for p in self.procs)

    def measure(self, seconds: float) -> float:
        cpu, sent = self._server_cpu(), self.sent[0]
        rate = super().measure(seconds)
        self.server_s.append(self._server_cpu() - cpu)
        self.server_n.append(self.sent[0] - sent)
        return rate

    @property
    def server_cpu(self) -> float:
        """Server CPU us per call over the rounds (not the warm-up)."""
        n = sum(self.server_n[1:])
        return sum(self.server_s[1:]) / n * 1e6 if n else float("nan")


def served(
    section: str,
    name: str,
    call: Callable[[], None],
    procs: Sequence[Process],
    prepare: Callable[[], None] | None = None,
    detail: str = "",
) -> Served:
    c = Served(section, name, "call", lambda n: None, detail=detail, procs=tuple(procs))
    sent = c.sent

    def run(n: int) -> None:
        for _ in range(n):
            call()
        sent[0] += n

    c.run = run
    if prepare is not None:
        c.prepare = prepare
    return c


@dataclass
class Tally:
    """What the upstream must have seen: POSTs, and POSTs with a key."""

    calls: int = 0
    keyed: int = 0

    def add(self, keyed: bool) -> None:
        self.calls += 1
        self.keyed += keyed


def _check(r: Any, what: str, replayed: bool = False) -> None:
    if r.status_code != 201 or r.content != cn.ANSWER:
        raise BenchError(f"{what}: answered {r.status_code} {r.content[:200]!r}")
    if (r.headers.get("idempotent-replayed") == "true") != replayed:
        raise BenchError(f"{what}: Idempotent-Replayed is {r.headers.get('idempotent-replayed')}")


def sync_contenders(
    upstream: Process, gateway: Process | None, tally: Tally, stack: contextlib.ExitStack
) -> list[Served]:
    import httpx

    from retrysafe.client import Client

    plain = stack.enter_context(httpx.Client(base_url=upstream.url))
    ours = stack.enter_context(Client(base_url=upstream.url))

    def floor() -> None:
        r = plain.post(cn.PATH, content=cn.BODY, headers=cn.HEADERS)
        tally.add(False)
        _check(r, cn.HTTPX)

    def client() -> None:
        r = ours.post(cn.PATH, content=cn.BODY, headers=cn.HEADERS)
        tally.add(True)
        _check(r, cn.CLIENT)

    out = [
        served("http", cn.HTTPX, floor, [upstream]),
        served("http", cn.CLIENT, client, [upstream]),
    ]
    if gateway is None:
        return out
    via = stack.enter_context(Client(base_url=gateway.url))
    retry_key = [""]

    def gw_first() -> None:
        r = via.post(cn.PATH, content=cn.BODY, headers=cn.VIA)
        tally.add(True)
        _check(r, cn.GW_FIRST)

    def gw_prepare() -> None:  # a completed key to retry
        retry_key[0] = str(uuid.uuid4())
        r = via.post(cn.PATH, content=cn.BODY, headers={**cn.VIA, "Idempotency-Key": retry_key[0]})
        tally.add(True)
        _check(r, cn.GW_REPLAY)

    def gw_replay() -> None:
        r = via.post(cn.PATH, content=cn.BODY, headers={**cn.VIA, "Idempotency-Key": retry_key[0]})
        _check(r, cn.GW_REPLAY, replayed=True)

    both = [gateway, upstream]
    return [
        *out,
        served("gateway", cn.GW_FIRST, gw_first, both),
        served("gateway", cn.GW_REPLAY, gw_replay, both, prepare=gw_prepare),
    ]


def async_contenders(upstream: Process, tally: Tally, stack: contextlib.ExitStack) -> list[Served]:
    """The async pair, each ``run(n)`` one ``run_until_complete`` of n sequential calls."""
    import httpx

    from retrysafe.client import AsyncClient

    loop = asyncio.new_event_loop()
    stack.callback(loop.close)
    plain = httpx.AsyncClient(base_url=upstream.url)
    ours = AsyncClient(base_url=upstream.url)
    stack.callback(lambda: loop.run_until_complete(ours.aclose()))
    stack.callback(lambda: loop.run_until_complete(plain.aclose()))

    def make(name: str, client: Any, keyed: bool) -> Served:
        async def calls(n: int) -> None:
            post = client.post
            for _ in range(n):
                r = await post(cn.PATH, content=cn.BODY, headers=cn.HEADERS)
                tally.add(keyed)
                _check(r, name)

        c = served("async", name, lambda: None, [upstream])

        def run(n: int) -> None:
            loop.run_until_complete(calls(n))
            c.sent[0] += n

        c.run = run
        return c

    return [make(cn.AHTTPX, plain, False), make(cn.ACLIENT, ours, True)]


def mock_contenders(stack: contextlib.ExitStack) -> list[Any]:
    """The same four clients on ``httpx.MockTransport``: no socket, no server, so the CPU
    per call is the clients' own work (request, headers, response), measured closely."""
    import httpx

    from retrysafe.client import AsyncClient, Client

    def handler(request: httpx.Request) -> httpx.Response:
        keyed = b"1" if "idempotency-key" in request.headers else b"0"
        return httpx.Response(201, headers=[(b"x-keyed", keyed)], content=cn.ANSWER)

    transport = httpx.MockTransport(handler)
    loop = asyncio.new_event_loop()
    stack.callback(loop.close)
    out = []
    for name, cls, keyed in ((cn.HTTPX, httpx.Client, b"0"), (cn.CLIENT, Client, b"1")):
        client = stack.enter_context(cls(base_url="http://server", transport=transport))

        def run(n: int, post: Any = client.post, name: str = name, keyed: bytes = keyed) -> None:
            for _ in range(n):
                r = post(cn.PATH, content=cn.BODY, headers=cn.HEADERS)
                if r.status_code != 201 or r.headers["x-keyed"] != keyed.decode():
                    raise BenchError(f"{name}{cn.MOCK}: {r.status_code} {r.headers}")

        out.append(Contender("mock", name + cn.MOCK, "call", run))
    for name, acls, keyed in (
        (cn.AHTTPX, httpx.AsyncClient, b"0"),
        (cn.ACLIENT, AsyncClient, b"1"),
    ):
        aclient = acls(base_url="http://server", transport=transport)
        stack.callback(lambda c=aclient: loop.run_until_complete(c.aclose()))

        async def calls(
            n: int, post: Any = aclient.post, name: str = name, keyed: bytes = keyed
        ) -> None:
            for _ in range(n):
                r = await post(cn.PATH, content=cn.BODY, headers=cn.HEADERS)
                if r.status_code != 201 or r.headers["x-keyed"] != keyed.decode():
                    raise BenchError(f"{name}{cn.MOCK}: {r.status_code} {r.headers}")

        def arun(n: int, calls: Any = calls) -> None:
            loop.run_until_complete(calls(n))

        out.append(Contender("mock", name + cn.MOCK, "call", arun))
    return out


# -- the outbox ------------------------------------------------------------------------------


def _outbox_file(path: Path) -> Path:
    """A new outbox file: the table and index the Outbox makes, WAL mode."""
    from retrysafe.client import Outbox

    Outbox(path).items()
    return path


def sqlite_ops(
    directory: Path, url: str, stack: contextlib.ExitStack
) -> dict[str, Callable[[], None]]:
    """One enqueue (or its floor) per call, each variant on its own file in ``directory``."""
    from retrysafe.client import Outbox

    head = json.dumps(cn.HEADERS, sort_keys=True)
    insert = (
        "INSERT INTO retrysafe_outbox (key, method, url, headers, body, created_at) "
        "VALUES (?, ?, ?, ?, ?, ?)"
    )

    def kept(name: str, synchronous: str) -> Callable[[], None]:
        conn = sqlite3.connect(_outbox_file(directory / name), isolation_level=None)
        stack.callback(conn.close)
        conn.execute(f"PRAGMA synchronous={synchronous}")
        execute = conn.execute

        def op() -> None:
            execute(insert, (str(uuid.uuid4()), "POST", url, head, cn.BODY, time.time()))

        return op

    def per_call() -> Callable[[], None]:
        path = _outbox_file(directory / "floor-per-call.db")

        def op() -> None:
            conn = sqlite3.connect(path, isolation_level=None)
            try:
                conn.execute(insert, (str(uuid.uuid4()), "POST", url, head, cn.BODY, time.time()))
            finally:
                conn.close()

        return op

    def enqueue(name: str, held: bool) -> Callable[[], None]:
        outbox = Outbox(_outbox_file(directory / name))
        if held:  # another connection keeps the file open: no checkpoint on each close
            conn = sqlite3.connect(outbox.path, isolation_level=None)
            stack.callback(conn.close)
            conn.execute("SELECT count(*) FROM retrysafe_outbox").fetchall()

        def op() -> None:
            outbox.enqueue("POST", url, cn.BODY, headers=cn.HEADERS)

        return op

    return {
        cn.FLOOR_FULL: kept("floor-full.db", "FULL"),
        cn.FLOOR_NORMAL: kept("floor-normal.db", "NORMAL"),
        cn.FLOOR_PER_CALL: per_call(),
        cn.ENQUEUE: enqueue("enqueue.db", held=False),
        cn.ENQUEUE_HELD: enqueue("enqueue-held.db", held=True),
    }


def outboxes(directory: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
    """The two outboxes that get flushed: alone, and with the file held open."""
    from retrysafe.client import Outbox

    out = {cn.FLUSH: Outbox(_outbox_file(directory / "flush.db"))}
    held = Outbox(_outbox_file(directory / "flush-held.db"))
    conn = sqlite3.connect(held.path, isolation_level=None)
    stack.callback(conn.close)
    conn.execute("SELECT count(*) FROM retrysafe_outbox").fetchall()
    out[cn.FLUSH_HELD] = held
    return out


@dataclass
class FlushCycles(Served):
    """``Outbox.flush(client)`` of ``items`` queued mutations per cycle, cycles until
    ``seconds`` of flushing; the queuing (untimed) happens before each cycle's clock."""

    outbox: Any = None
    client: Any = None
    url: str = ""
    items: int = 50
    tally: Any = None
    queue_s: list[float] = field(default_factory=list)  # wall time spent queuing

    def measure(self, seconds: float) -> float:
        clock, cpu_clock = time.perf_counter, time.process_time
        wall = cpu = server = 0.0
        done = 0
        queue = 0.0
        while done == 0 or wall < seconds:
            q = clock()
            for _ in range(self.items):
                self.outbox.enqueue("POST", self.url, cn.BODY, headers=cn.HEADERS)
            queue += clock() - q
            s0, c0, t0 = self._server_cpu(), cpu_clock(), clock()
            result = self.outbox.flush(self.client)
            wall += clock() - t0
            cpu += cpu_clock() - c0
            server += self._server_cpu() - s0
            for _ in range(len(result.delivered)):
                self.tally.add(True)
            if not result.complete or len(result.delivered) != self.items:
                raise BenchError(f"{self.name}: {result!r}")
            done += self.items
        self.cpu_us.append(cpu / done * 1e6)
        self.server_s.append(server)
        self.server_n.append(done)
        self.queue_s.append(queue)
        return done / wall


def flush_contenders(
    upstream: Process, directory: Path, items: int, tally: Tally, stack: contextlib.ExitStack
) -> list[Served]:
    from retrysafe.client import Client

    client = stack.enter_context(Client(base_url=upstream.url))
    url = upstream.url + cn.PATH

    def post() -> None:  # what the flush sends for an item, with a new key
        r = client.post(url, content=cn.BODY, headers=cn.HEADERS)
        tally.add(True)
        _check(r, cn.POSTS)

    out = [served("flush", cn.POSTS, post, [upstream])]
    for name, outbox in outboxes(directory, stack).items():
        out.append(
            FlushCycles(
                "flush",
                name,
                "call",
                lambda n: None,
                procs=(upstream,),
                outbox=outbox,
                client=client,
                url=url,
                items=items,
                tally=tally,
            )
        )
    return out


# -- syscalls and connections per outbox operation ------------------------------------------

MARK = "/rsbench-client-mark"


def _mark(phase: str, edge: str) -> None:
    os.access(f"{MARK}/{phase}/{edge}", os.F_OK)  # shows in strace's output, does nothing


def syscall_child(directory: str) -> int:
    """``--syscalls-child DIR``: each outbox variant ``SYSCALL_OPS`` times between marks;
    prints the SQLite connections each opened per operation (JSON)."""
    import httpx

    from retrysafe.client import Client

    opened = [0]
    connect = sqlite3.connect

    def counting(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        opened[0] += 1
        return connect(*args, **kwargs)

    sqlite3.connect = counting  # type: ignore[assignment]  # the outbox calls sqlite3.connect
    url = f"http://{cn.HOST}:9{cn.PATH}"
    connections: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        for name, op in sqlite_ops(Path(directory), url, stack).items():
            op()  # warm
            _mark(name, "begin")
            before = opened[0]
            for _ in range(cn.SYSCALL_OPS):
                op()
            connections[name] = (opened[0] - before) / cn.SYSCALL_OPS
            _mark(name, "end")
        transport = httpx.MockTransport(lambda request: httpx.Response(201, content=cn.ANSWER))
        client = stack.enter_context(Client(transport=transport))
        for name, outbox in outboxes(Path(directory), stack).items():
            for _ in range(cn.SYSCALL_OPS):
                outbox.enqueue("POST", url, cn.BODY, headers=cn.HEADERS)
            _mark(name, "begin")
            before = opened[0]
            result = outbox.flush(client)
            connections[name] = (opened[0] - before) / cn.SYSCALL_OPS
            _mark(name, "end")
            if len(result.delivered) != cn.SYSCALL_OPS:
                raise BenchError(f"{name}: {result!r}")
    print(json.dumps(connections))
    return 0


def count_syscalls(tmp: Path) -> dict[str, cn.Syscalls]:
    """Per operation of each outbox variant, in a child process (under ``strace -f`` when
    it is installed): connections opened, fsyncs and files deleted."""
    directory = tmp / "syscalls"
    directory.mkdir()
    trace = tmp / "strace.txt"
    child = [sys.executable, str(Path(__file__).resolve()), "--syscalls-child", str(directory)]
    traced = shutil.which("strace") is not None
    calls = "trace=fsync,fdatasync,unlink,unlinkat,access,faccessat,faccessat2"
    argv = ["strace", "-f", "-qq", "-o", str(trace), "-e", calls, *child] if traced else child
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BenchError(f"the syscall pass failed: {done.stderr[-2000:]}")
    connections = json.loads(done.stdout.strip().splitlines()[-1])
    counted: dict[str, tuple[float, float]] = {}
    if traced:
        phase: str | None = None
        fsyncs = deletes = 0
        for line in trace.read_text().splitlines():
            found = re.search(rf'"{MARK}/(.+)/(begin|end)"', line)
            if found:
                if found.group(2) == "begin":
                    phase, fsyncs, deletes = found.group(1), 0, 0
                elif phase is not None:
                    counted[phase] = (fsyncs / cn.SYSCALL_OPS, deletes / cn.SYSCALL_OPS)
                    phase = None
            elif phase is not None and "= -1" not in line:
                if re.search(r"\b(fsync|fdatasync)\(", line):
                    fsyncs += 1
                elif re.search(r"\bunlink(at)?\(", line):
                    deletes += 1
    return {
        name: cn.Syscalls(n, *counted.get(name, (None, None)))  # type: ignore[arg-type]
        for name, n in connections.items()
    }


def _filesystem(path: Path) -> str:
    best = ("", "?", "?")
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, kind = line.split()[:3]
            if str(path).startswith(mount) and len(mount) >= len(best[0]):
                best = (mount, kind, device)
    return f"{best[1]} on {best[2]} (mounted at {best[0]})"


# -- main ------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["--serve"]:
        return serve(int(raw[1]))
    if raw[:1] == ["--syscalls-child"]:
        return syscall_child(raw[1])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--seconds", type=float, default=0.3)
    p.add_argument("--warmup", type=float, default=0.3)
    p.add_argument("--flush-items", type=int, default=50, help="mutations per flush (N)")
    p.add_argument("--no-gateway", action="store_true", help="skip the gateway section")
    p.add_argument("--no-syscalls", action="store_true", help="skip the strace pass")
    p.add_argument("--write", type=Path)
    p.add_argument("--rev", help="measure this git revision's src/ (git archive), not the tree")
    args = p.parse_args(raw)
    if args.rev and not bs.in_rev():
        return bs.run_rev(args.rev)
    if args.rounds < 1 or args.seconds <= 0 or args.flush_items < 1:
        p.error("--rounds >= 1, --seconds > 0, --flush-items >= 1")
    script = os.path.relpath(sys.argv[0]) if sys.argv[0] else "bench/client.py"
    command = shlex.join(["python", script, *raw])
    started = time.monotonic()
    info = bs.machine_info()
    bs.note_rev(info)
    cs: dict[str, Any] = {}
    tally = Tally()
    syscalls: dict[str, cn.Syscalls] = {}

    def measure(name: str, group: list[Any]) -> None:
        print(
            f"\n[{name}] {len(group)} contenders, {args.rounds} rounds of {args.seconds:g}s",
            flush=True,
        )
        bs.run_rounds(group, args.rounds, args.seconds, args.warmup)
        cs.update((c.name, c) for c in group)

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rsclient-")))
        info["temp dir (SQLite files)"] = _filesystem(tmp)
        upstream = start_upstream(tmp, stack)
        gateway = None
        if not args.no_gateway:
            gateway = start_gateway(upstream.url, f"sqlite:///{tmp / 'g.db'}", tmp, stack)
        measure("http, sync", sync_contenders(upstream, gateway, tally, stack))
        measure("http, async", async_contenders(upstream, tally, stack))
        measure("no socket (httpx.MockTransport)", mock_contenders(stack))
        outdir = tmp / "outbox"
        outdir.mkdir()
        ops = sqlite_ops(outdir, upstream.url + cn.PATH, stack)
        enqueue = []
        for name, op in ops.items():

            def run(n: int, op: Callable[[], None] = op) -> None:
                for _ in range(n):
                    op()

            enqueue.append(Contender("enqueue", name, "op", run))
        measure("outbox enqueue", enqueue)
        measure("outbox flush", flush_contenders(upstream, outdir, args.flush_items, tally, stack))
        seen = _get(upstream.url + cn.CALLS_PATH)
        if (seen["calls"], seen["keyed"]) != (tally.calls, tally.keyed):
            raise BenchError(
                f"the server answered {seen} POSTs, the benchmark expected "
                f"{tally.calls} ({tally.keyed} with a key)"
            )
        print(
            f"\nthe server answered {seen['calls']:,} POSTs ({seen['keyed']:,} with a key), "
            "as expected",
            flush=True,
        )
        if gateway is not None:
            gateway.stop()
            lines = gateway.log.read_text().count('"POST ' + cn.PATH)
            info["gateway's log"] = (
                f"{lines:,} access-log lines, one per request (uvicorn's "
                "default in `retrysafe gateway`), to a file"
            )
        if not args.no_syscalls:
            print("counting connections and syscalls per outbox operation", flush=True)
            syscalls = count_syscalls(tmp)
    elapsed = time.monotonic() - started
    info["load average at end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    info["SQLite"] = sqlite3.sqlite_version
    info["client libraries"] = bs.library_info(list(LIBRARIES))
    text = cr.render(args, command, info, cs, syscalls, elapsed)
    print()
    print(text)
    if args.write is not None:
        args.write.write_text(bs.splice(args.write, text, (BEGIN_MARK, END_MARK), SECTION))
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
