"""Requests per second of a minimal POST endpoint in Flask and Django under gunicorn,
bare and behind retrysafe.

One run measures, with the same load generator and the same settings, for each app
(``--app flask,django``):

* **bare**: the endpoint alone (Flask: a route; Django: a view, settings in code, no
  database, no middleware);
* **memory**: the endpoint behind retrysafe with ``store="memory://"`` (Flask:
  ``app.wsgi_app = retrysafe.wsgi.IdempotencyMiddleware(app.wsgi_app, ...)``; Django:
  ``retrysafe.django.IdempotencyMiddleware`` in ``MIDDLEWARE``, ``RETRYSAFE`` in settings);
* **floor**: the least an idempotency middleware of that kind can do (a WSGI middleware
  for Flask, a Django middleware for Django): one dict lookup to claim the key or find
  its answer, the endpoint, one dict store to keep the answer; a replay answers the
  stored bytes. No fingerprint, scope, key validation, engine or stored headers.

Every server is its own gunicorn process (one ``gthread`` worker with
:data:`THREADS` threads: what a Flask or Django deployment runs, keep-alive included;
the memory store lives in the worker) on a free loopback port. The endpoint reads the
JSON body and answers 201 with a small JSON; it counts its executions, so every
measurement checks that first calls ran it once per request and replays not at all.

Load, rounds and ratios are those of ``bench/http.py`` (wrk and its Lua script, a new
key per first call, a small key set for replays, interleaved rounds, ratios to the bare
server of the same app in the same round). This is a benchmark, not a test.

    python bench/wsgi.py [--rounds N] [--seconds S] [--connections C] [--threads T]
                         [--app flask[,django]] [--variants bare,memory,floor]
                         [--workloads first,replay] [--rev REV] [--write PATH]
    python bench/wsgi.py --breakdown [REQUESTS] [--app ...] [--rev REV] [--write PATH]

``--breakdown`` calls each app's WSGI callable in-process (no sockets, no server) and
counts the instructions per request with valgrind when it is installed (else the least
CPU time). ``--write PATH`` writes the generated block to PATH (never to
docs/performance.md by default).
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/http.py, first on sys.path when this runs as a script, would shadow the standard
# library's ``http`` (which gunicorn, Flask and Django import).
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterable, Sequence  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402


def _load(name: str, path: Path) -> ModuleType:
    """A module by file path, without putting its folder on sys.path."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


#: bench/http.py: the load (wrk, its Lua script), the measurement and the tables.
H = _load("_rsbench_http", HERE / "http.py")

ROOT = HERE.parent
HOST, PATH, CALLS_PATH = H.HOST, H.PATH, H.CALLS_PATH
ANSWER = H.ANSWER
FIRST, REPLAY = H.FIRST, H.REPLAY
BARE = H.BARE
APPS = ("flask", "django")
#: gunicorn's settings, the same for every server.
WORKER_CLASS, THREADS = "gthread", 4
VARIANTS = {
    BARE: "the endpoint alone",
    "memory": 'behind retrysafe, `store="memory://"`, default options (Flask: '
    "`app.wsgi_app = retrysafe.wsgi.IdempotencyMiddleware(app.wsgi_app, ...)`; Django: "
    '`retrysafe.django.IdempotencyMiddleware` in `MIDDLEWARE`, `RETRYSAFE = {"store": ...}`)',
    "floor": "floor middleware (Flask: a WSGI middleware; Django: a Django middleware): a "
    "dict lookup to claim the key or find its answer, the endpoint, a dict store to keep "
    "the answer; a replay answers the stored bytes",
}
#: (variant, workload) -> the least ratio to bare the issue asks for.
TARGETS = {("memory", FIRST): 0.75, ("memory", REPLAY): 1.2}
#: The most a variant's p99 may be, as a multiple of its bare server's p99.
P99_TARGET = 2.0
LIBRARIES = ("gunicorn", "flask", "werkzeug", "django")
BreakdownKey = tuple[str, str, str]  # (app, variant, workload)


# -- the server side (runs in the gunicorn worker, or in-process for --breakdown) -------------


class Counter:
    """How often the endpoint ran (the worker's threads share it)."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def hit(self) -> None:
        with self.lock:
            self.calls += 1


PROCESSING = b"processing"
FLOOR_RECORDS = 100_000  # the dict is cleared when full, like bench/http.py's floor


class Records:
    """The floor's store: a dict of key -> answer bytes (or :data:`PROCESSING`)."""

    def __init__(self) -> None:
        self.records: dict[str, bytes] = {}

    def claim(self, key: str) -> bytes | None:
        old = self.records.get(key)
        if old is None:
            if len(self.records) >= FLOOR_RECORDS:
                self.records.clear()
            self.records[key] = PROCESSING
        return old

    def keep(self, key: str, answer: bytes) -> None:
        self.records[key] = answer


REPLAYED = [("Content-Type", "application/json"), ("Idempotent-Replayed", "true")]


class WSGIFloor:
    """The floor as a WSGI middleware: one lookup to claim, the app, one store to keep."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.store = Records()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        key = environ.get("HTTP_IDEMPOTENCY_KEY")
        if key is None or environ["REQUEST_METHOD"] != "POST":
            return self.app(environ, start_response)  # type: ignore[no-any-return]
        key = "floor:" + key
        old = self.store.claim(key)
        if old is not None:
            status = "409 Conflict" if old == PROCESSING else "201 Created"
            start_response(status, REPLAYED)
            return [b"" if old == PROCESSING else old]
        started: list[Any] = []
        result = self.app(environ, lambda *args: started.append(args))
        try:
            body = b"".join(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        self.store.keep(key, body)
        start_response(*started[0])
        return [body]


class DjangoFloor:
    """The floor as a Django middleware (``MIDDLEWARE``)."""

    store = Records()

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: Any) -> Any:
        from django.http import HttpResponse

        key = request.META.get("HTTP_IDEMPOTENCY_KEY")
        if key is None or request.method != "POST":
            return self.get_response(request)
        key = "floor:" + key
        old = self.store.claim(key)
        if old is not None:
            status = 409 if old == PROCESSING else 201
            response = HttpResponse(b"" if status == 409 else old, status=status)
            response["Content-Type"] = "application/json"
            response["Idempotent-Replayed"] = "true"
            return response
        response = self.get_response(request)
        self.store.keep(key, response.content)
        return response


def flask_app(kind: str, store: str) -> Any:
    """The Flask app of one variant: ``POST /orders`` and ``GET /_calls``."""
    from flask import Flask, jsonify, request

    app = Flask("rsbench")
    counter = Counter()

    @app.post(PATH)
    def create() -> Any:
        request.get_json()
        counter.hit()
        return jsonify(ANSWER), 201

    @app.get(CALLS_PATH)
    def calls() -> str:
        return str(counter.calls)

    if kind == "memory":
        from retrysafe.wsgi import IdempotencyMiddleware

        app.wsgi_app = IdempotencyMiddleware(app.wsgi_app, store=store)  # type: ignore[method-assign]
    elif kind == "floor":
        app.wsgi_app = WSGIFloor(app.wsgi_app)  # type: ignore[method-assign]
    return app


def django_app(kind: str, store: str) -> Any:
    """Django's WSGI handler of one variant: settings in code, no database (a process
    may build several: each handler reads ``MIDDLEWARE`` when it is made)."""
    import django
    from django.conf import settings
    from django.core.handlers.wsgi import WSGIHandler
    from django.http import HttpResponse, JsonResponse
    from django.urls import clear_url_caches, path

    counter = Counter()

    def create(request: Any) -> Any:
        json.loads(request.body)
        counter.hit()
        return JsonResponse(ANSWER, status=201)

    def calls(request: Any) -> Any:
        return HttpResponse(str(counter.calls), content_type="text/plain")

    class Urls:  # ROOT_URLCONF may be any hashable object with urlpatterns
        urlpatterns = [path(PATH.lstrip("/"), create), path(CALLS_PATH.lstrip("/"), calls)]

    if not settings.configured:
        settings.configure(
            DEBUG=False,
            SECRET_KEY="rsbench-not-secret",
            ALLOWED_HOSTS=["*"],
            INSTALLED_APPS=[],
            DATABASES={},
            USE_TZ=True,
        )
        django.setup(set_prefix=False)
    settings.ROOT_URLCONF = Urls
    settings.MIDDLEWARE = {
        "memory": ["retrysafe.django.IdempotencyMiddleware"],
        "floor": [f"{__name__}.DjangoFloor"],
    }.get(kind, [])
    settings.RETRYSAFE = {"store": store}
    clear_url_caches()
    return WSGIHandler()


def make_app(app: str, kind: str, store: str = "memory://") -> Any:
    return (flask_app if app == "flask" else django_app)(kind, store)


def serve(argv: Sequence[str]) -> int:
    """``--serve``: one gunicorn server of one variant, until SIGTERM."""
    from gunicorn.app.base import BaseApplication

    parser = argparse.ArgumentParser(prog="bench/wsgi.py --serve")
    parser.add_argument("--kind", choices=tuple(VARIANTS), required=True)
    parser.add_argument("--app", choices=APPS, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--src", help="import retrysafe from this folder")
    args = parser.parse_args(argv)
    if args.src:
        sys.path.insert(0, args.src)

    class Gunicorn(BaseApplication):  # type: ignore[misc]
        """gunicorn's documented custom application: the app is built in the worker."""

        def load_config(self) -> None:
            for name, value in server_settings(args.port).items():
                self.cfg.set(name, value)

        def load(self) -> Any:
            return make_app(args.app, args.kind)

    Gunicorn().run()
    return 0


def server_settings(port: int) -> dict[str, Any]:
    """gunicorn's settings, the same for every variant."""
    return {
        "bind": f"{HOST}:{port}",
        "workers": 1,
        "worker_class": WORKER_CLASS,
        "threads": THREADS,
        "loglevel": "warning",
        "accesslog": None,
    }


# -- the client side ---------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (gunicorn's workers)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


class Server(H.Server):  # type: ignore[misc,name-defined]
    """One gunicorn server: the arbiter and its worker."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path) -> None:
        self.name, self.port, self.log = name, port, log
        script = str(Path(__file__).resolve())
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, script, "--serve", *argv, "--port", str(port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )

    def cpu(self) -> float:
        pids = [self.proc.pid, *_children(self.proc.pid)]
        return sum(H._cpu_seconds(pid) for pid in pids)


def start_variants(
    names: Sequence[str], apps: Sequence[str], stack: contextlib.ExitStack, base: str | None
) -> list[Any]:
    """Start every server (retrysafe from ``base`` if given) and wait for them."""
    servers_mod = _load("_rsbench_servers", ROOT / "tests" / "_servers.py")
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rsbench-wsgi-")))
    src = ["--src", base] if base else []
    variants = []
    for app in apps:
        bare = None
        for name in [BARE, *(n for n in VARIANTS if n in names and n != BARE)]:
            port = servers_mod.free_port()
            log = tmp / f"{name}-{app}-{port}.log"
            server = Server(f"{name} ({app})", ["--kind", name, "--app", app, *src], port, log)
            stack.callback(server.stop)
            spec = H.Spec(name, VARIANTS[name])
            variant = H.Variant(name, app, spec, server, server, bare)
            bare = bare or variant
            variants.append(variant)
    for v in variants:
        v.server.wait_ready()
    return variants


def targets_table(rows: Sequence[Any]) -> list[str]:
    """Each target of the issue: the median ratio or p99 multiple, and whether it is met;
    for the req/s targets also the server CPU ratio (bare's CPU per request over the
    variant's: the req/s ratio of a server that is the bottleneck, steadier on a busy
    machine)."""
    bare = {(r.variant.app, r.workload): r for r in rows if r.variant.reference is None}
    out = [
        "| app | variant | workload | target | measured | met? | by server CPU |",
        "|---|---|---|---|--:|---|--:|",
    ]
    for r in rows:
        v = r.variant
        if v.name != "memory" or r.problems:
            continue
        app = v.app
        target = TARGETS.get((v.name, r.workload))
        if target is not None and r.ratio is not None:
            met = "met" if r.ratio >= target else "**missed**"
            cpu = statistics.median(r.cpu_ratios) if r.cpu_ratios else None
            by_cpu = "-" if cpu is None else f"{cpu:.2f} ({'met' if cpu >= target else 'missed'})"
            out.append(
                f"| {app} | {v.name} | {r.workload} | req/s >= {target:.2f} x bare "
                f"| {r.ratio:.2f} | {met} | {by_cpu} |"
            )
        ref = bare[app, r.workload].median("p99_ms")
        if ref:
            times = r.median("p99_ms") / ref
            met = "met" if times <= P99_TARGET else "**missed**"
            out.append(
                f"| {app} | {v.name} | {r.workload} | p99 <= {P99_TARGET:.0f} x bare's "
                f"| {times:.2f} | {met} | - |"
            )
    return out


def render(
    rows: Sequence[Any], args: argparse.Namespace, command: str, info: dict[str, str], took: float
) -> str:
    names = list(dict.fromkeys(r.variant.name for r in rows))
    settings = ", ".join(f"`{k}={v}`" for k, v in server_settings(0).items() if k != "bind")
    out = [
        "### WSGI and Django: the last run",
        "",
        H._wrap(
            f"Generated by `bench/wsgi.py --write` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; "
            "do not edit by hand. All servers ran at once and were measured interleaved, in "
            f"{args.rounds} rounds of {args.seconds} s per server and workload (the order "
            "flips every round), after a warm-up. A ratio is the median over the rounds of "
            "the variant's rate divided by its bare server's rate *in the same round*."
        ),
        "",
        "```",
        command,
        "```",
        "",
        f"The run took {took:.0f} s.",
        "",
        "#### Setup",
        "",
        "- endpoint: `POST /orders` reads the JSON body and answers 201 with a small JSON",
        "  (Flask: `request.get_json()`, `jsonify(...), 201`; Django: `json.loads(request.body)`,",
        "  `JsonResponse(..., status=201)`, settings in code, no database, no other middleware)",
        f"- gunicorn: {settings}, each server its own process on its own loopback port",
        f"- load: `wrk -t {args.threads} -c {args.connections} -d {args.seconds}s --latency`, "
        "the Lua script of bench/http.py",
        "- server CPU us/req: user + system CPU time of gunicorn's arbiter and worker",
        *(f"- {n}: {VARIANTS[n]}" for n in names),
        "",
        "#### Machine",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        "",
        "#### Results",
        "",
        *H.results_table(rows),
        "",
        "#### Targets",
        "",
        *targets_table(rows),
        "",
    ]
    invalid = [f"- {r.variant.label} / {r.workload}: {p}" for r in rows for p in r.problems]
    if invalid:
        out += ["Invalid measurements (left out of the figures):", "", *invalid, ""]
    return "\n".join(out)


# -- where the time goes: the WSGI callable in-process -------------------------------------------

BREAKDOWN = {
    BARE: "the app's WSGI callable alone",
    "floor": "the floor middleware",
    "memory": 'retrysafe, `store="memory://"`',
    "stubbed": "retrysafe with the engine's claim and completion stubbed out (every key is "
    "claimed, so its replay column is a first call); the rest of the middleware stays",
    "plumbing": "the same with the body's canonical form and the fingerprint's hash stubbed "
    "out too: the key, the caller's scope, the body read and the answer's recording stay",
}


def _stub_engine() -> None:
    """In this process, every engine attempt claims its key and stores nothing."""
    from retrysafe._core.engine import Attempt

    def enter(self: Any) -> Any:
        self.claim = self.replay = None
        return self

    def leave(self: Any, *exc: object) -> None:
        return None

    def settle(self: Any, *args: object, **kwargs: object) -> None:
        self.finished = True

    Attempt.__enter__, Attempt.__exit__ = enter, leave  # type: ignore[method-assign,assignment]
    Attempt.complete = Attempt.fail = settle  # type: ignore[method-assign,assignment]


def environ(key: str, body: bytes) -> dict[str, Any]:
    """A WSGI environ as gunicorn builds it for wrk's POST."""
    return {
        "REQUEST_METHOD": "POST",
        "SCRIPT_NAME": "",
        "PATH_INFO": PATH,
        "QUERY_STRING": "",
        "RAW_URI": PATH,
        "SERVER_NAME": HOST,
        "SERVER_PORT": "8000",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "REMOTE_ADDR": HOST,
        "REMOTE_PORT": "50000",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(body)),
        "HTTP_HOST": f"{HOST}:8000",
        "HTTP_USER_AGENT": "wrk",
        "HTTP_AUTHORIZATION": "Bearer rsbench",
        "HTTP_IDEMPOTENCY_KEY": key,
        "wsgi.input": io.BytesIO(body),
        "wsgi.input_terminated": True,
        "wsgi.errors": sys.stderr,
        "wsgi.url_scheme": "http",
        "wsgi.version": (1, 0),
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }


def breakdown_run(argv: Sequence[str]) -> int:
    """``--breakdown-run APP N VARIANTS [SRC]``: each variant's N first calls and N replays
    in-process, one loop each, in the order of :data:`BREAKDOWN` (stubbed and plumbing
    patch this process, so they come last); retrysafe from SRC if given. Prints the CPU
    seconds of each loop as JSON."""
    import math

    app_name, n, names = argv[0], int(argv[1]), argv[2].split(",")
    if len(argv) > 3:
        sys.path.insert(0, argv[3])
    body = H.REQUEST_BODY.encode()
    statuses: list[str] = []

    def start_response(status: str, headers: Any, exc_info: Any = None) -> Callable[..., None]:
        statuses.append(status)
        return lambda data: None

    took = {}
    for name in (n for n in BREAKDOWN if n in names):
        if name in ("stubbed", "plumbing"):
            _stub_engine()
        if name == "plumbing":
            import retrysafe._http.policy as policy

            # this process only: the body's canonical form and the hash over it
            policy.body_form = lambda *args: (b"b", b"")  # type: ignore[assignment]
            policy.form_fingerprint = lambda *args: "f" * 64  # type: ignore[assignment]
        app = make_app(app_name, "memory" if name in ("stubbed", "plumbing") else name)

        def call(env: dict[str, Any]) -> float:
            result = app(env, start_response)  # noqa: B023 (called before the next app)
            for _ in result:
                pass
            close = getattr(result, "close", None)
            if close is not None:
                close()
            return 0.0

        for i in range(200):  # warm-up; warm-0 is the replayed key
            call(environ(f"{name}-warm-{i}", body))
        for workload in ("first", "replay"):
            keys = [
                f"{name}-warm-0" if workload == "replay" else f"{name}-key-{i}" for i in range(n)
            ]
            envs = [environ(key, body) for key in keys]
            statuses.clear()
            start = time.process_time()
            # Under valgrind, instructions are collected inside math.fsum only: this loop.
            math.fsum(call(env) for env in envs)
            took[f"{name}/{workload}"] = time.process_time() - start
            if len(statuses) != n or any(not s.startswith("201") for s in statuses):
                raise H.BenchError(f"{app_name}/{name}: answers other than 201: {set(statuses)}")
    print(json.dumps(took))
    return 0


def _run_argv(app: str, names: Sequence[str], n: int, src: str | None) -> list[str]:
    script = str(Path(__file__).resolve())
    argv = [sys.executable, script, "--breakdown-run", app, str(n), ",".join(names)]
    return [*argv, *([src] if src else [])]


#: callgrind counts only inside math.fsum (nothing on the request path of Flask, Django
#: or retrysafe calls it) and writes one dump after each call: one per measured loop.
CALLGRIND = [
    "valgrind",
    "--tool=callgrind",
    "--collect-atstart=no",
    "--toggle-collect=math_fsum",
    "--dump-after=math_fsum",
]


def _instructions(app: str, names: Sequence[str], n: int, src: str | None) -> list[float]:
    """Instructions executed in each measured loop of one app's variants (callgrind)."""
    with tempfile.TemporaryDirectory(prefix="rsbench-callgrind-") as tmp:
        out_file = Path(tmp) / "out"
        out = subprocess.run(
            [*CALLGRIND, f"--callgrind-out-file={out_file}", *_run_argv(app, names, n, src)],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if out.returncode != 0:
            raise H.BenchError(f"{app}: valgrind failed:\n{out.stderr[-3000:]}")
        dumps = sorted(Path(tmp).glob("out.*"), key=lambda p: int(p.suffix[1:]))
        totals = []
        for dump in dumps:
            m = re.search(r"^totals: (\d+)", dump.read_text(), re.MULTILINE)
            if m is None:
                raise H.BenchError(f"{app}: no totals in {dump.name}")
            totals.append(float(m.group(1)))
    return totals


def breakdown(
    apps: Sequence[str], names: Sequence[str], requests: int, src: str | None
) -> tuple[str, dict[BreakdownKey, float]]:
    """Per-request cost of each in-process variant (of ``names``, bare always): valgrind
    instructions (exact) when valgrind is installed, else the least CPU time of 9 runs.
    One process per app runs all its variants."""
    from concurrent.futures import ThreadPoolExecutor

    chosen = [n for n in BREAKDOWN if n == BARE or n in names]
    loops = [(name, w) for name in chosen for w in ("first", "replay")]
    valgrind = shutil.which("valgrind") is not None

    def cost(app: str) -> list[float]:
        if valgrind:
            totals = _instructions(app, chosen, requests, src)
            if len(totals) != len(loops):
                raise H.BenchError(f"{app}: {len(totals)} callgrind dumps for {len(loops)} loops")
            return [t / requests for t in totals]
        runs = []
        for _ in range(9):
            out = subprocess.run(
                _run_argv(app, chosen, requests, src), capture_output=True, text=True, check=True
            )
            runs.append(json.loads(out.stdout.splitlines()[-1]))
        return [min(r[f"{n}/{w}"] for r in runs) / requests * 1e6 for n, w in loops]

    with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
        per_app = dict(zip(apps, pool.map(cost, apps), strict=True))
    costs = {
        (app, name, w): value
        for app, values in per_app.items()
        for (name, w), value in zip(loops, values, strict=True)
    }
    return ("instructions" if valgrind else "CPU us"), costs


def breakdown_table(unit: str, costs: dict[BreakdownKey, float]) -> list[str]:
    fmt = "{:,.0f}" if unit == "instructions" else "{:.1f}"
    out = [
        f"| app | in-process variant | first call: {unit}/request | over bare "
        f"| replay: {unit}/request | over bare |",
        "|---|---|--:|--:|--:|--:|",
    ]
    apps = list(dict.fromkeys(app for app, _, _ in costs))
    for app in apps:
        for name in (n for n in BREAKDOWN if (app, n, "first") in costs):
            cells = []
            for w in ("first", "replay"):
                here = costs[app, name, w]
                more = here - costs[app, BARE, w]
                cells += [fmt.format(here), "-" if name == BARE else f"{more:+,.0f}"]
            out.append(f"| {app} | {name} | " + " | ".join(cells) + " |")
    return out


def render_breakdown(
    unit: str, costs: dict[BreakdownKey, float], command: str, requests: int, code: str
) -> str:
    how = (
        "instructions executed (valgrind's callgrind: the same on every run, whatever the "
        f"machine's load) in a loop of {requests} requests, after 200 to warm up; one "
        "process per app runs its variants one after the other"
        if unit == "instructions"
        else f"the least CPU time of 9 runs of {requests} requests"
    )
    return "\n".join(
        [
            "#### WSGI and Django: where the time goes (in-process)",
            "",
            H._wrap(
                f"Generated by `bench/wsgi.py --breakdown --write` on "
                f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; do not edit by hand. Each variant "
                "runs in a process of its own, without sockets or a server: a loop of calls "
                "of the app's WSGI callable with environs built beforehand (gunicorn's keys, "
                "the body and headers of the HTTP run), a new key each (first calls) or one "
                f"completed key (replays). Cost per request: {how}."
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


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=int, default=5, help="per server, workload and round")
    p.add_argument("--warmup", type=int, default=2, help="seconds per server and workload")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="wrk threads")
    p.add_argument("--app", default="flask,django", help="flask, django or flask,django")
    p.add_argument(
        "--variants",
        default=",".join(dict.fromkeys([*VARIANTS, *BREAKDOWN])),
        help="bare is always measured (--breakdown also knows stubbed)",
    )
    p.add_argument("--workloads", default="first,replay")
    p.add_argument(
        "--breakdown",
        type=int,
        nargs="?",
        const=1000,
        metavar="REQUESTS",
        help="instead of benchmarking: the cost per request in-process (valgrind "
        "instructions if installed, else CPU time)",
    )
    p.add_argument("--rev", help="measure this git revision's src/ (exported with git archive)")
    p.add_argument("--write", metavar="PATH", help="write the generated block to PATH")
    args = p.parse_args(argv)
    args.apps = list(dict.fromkeys(args.app.split(",")))
    if not args.apps or any(a not in APPS for a in args.apps):
        p.error(f"--app: {' or '.join(APPS)}, or both separated by a comma")
    unknown = set(args.variants.split(",")) - set(VARIANTS) - set(BREAKDOWN)
    if unknown:
        p.error(f"unknown variants: {', '.join(sorted(unknown))}")
    args.workload_names = [H.WORKLOADS[w] for w in args.workloads.split(",") if w in H.WORKLOADS]
    if not args.workload_names:
        p.error("--workloads: first and/or replay")
    if args.seconds < 1 or args.warmup < 1 or args.connections < args.threads:
        p.error("--seconds, --warmup: at least 1; --connections: at least --threads")
    return args


def _write(path: str, text: str) -> None:
    Path(path).write_text(text)
    print(f"\nwrote {path}")


def main(argv: Sequence[str] | None = None) -> int:
    import signal

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve"]:
        return serve(argv[1:])
    if argv[:1] == ["--breakdown-run"]:
        return breakdown_run(argv[1:])
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stores = _load("_rsbench_stores", HERE / "stores.py")  # machine and git details
    command = shlex.join(["python", "bench/wsgi.py", *argv])
    with contextlib.ExitStack() as stack:
        base, code = None, f"{H.retrysafe_version()} ({stores.git_state()})"
        if args.rev:
            base, code = H.export_rev(args.rev, stack)
        if args.breakdown:
            names = args.variants.split(",")
            unit, costs = breakdown(args.apps, names, args.breakdown, base)
            print(stores.plain(breakdown_table(unit, costs)))
            if args.write:
                _write(args.write, render_breakdown(unit, costs, command, args.breakdown, code))
            return 0
        script = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "post.lua"
        script.write_text(f"BODY = {json.dumps(H.REQUEST_BODY)}\n{H.LUA}")
        load = H.Load(args.threads, args.connections, args.seconds, script)
        info = stores.machine_info()
        info["retrysafe"] = code
        info["server libraries"] = stores.library_info(LIBRARIES)
        t0 = time.monotonic()
        variants = start_variants(args.variants.split(","), args.apps, stack, base)
        print(f"servers: {', '.join(f'{v.label} :{v.server.port}' for v in variants)}", flush=True)
        H.run_rounds(variants, args.workload_names, load, args.rounds, args.warmup)
        took = time.monotonic() - t0
    info["load average at end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    H.TARGETS.clear()  # bench/http.py's table reads its targets: these are this bench's
    H.TARGETS.update(TARGETS)
    rows = H.rows_of(variants, args.workload_names)
    print()
    print(stores.plain(H.results_table(rows)))
    print()
    print(stores.plain(targets_table(rows)))
    if args.write:
        _write(args.write, render(rows, args, command, info, took))
    return 1 if any(r.problems for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
