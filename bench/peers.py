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
import os
import secrets
import shlex
import time
from collections import Counter
from collections.abc import Sequence
from types import ModuleType
from typing import Any

PARTS = ("function", "http", "storm")
BEGIN_MARK = "<!-- bench/peers.py: generated from here -->"
END_MARK = "<!-- bench/peers.py: up to here -->"

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


# This script's own modules, in the order they use each other (each finds the ones
# loaded before it in sys.modules).
pa = _load("_rsbench_peers_app", HERE / "_peers_app.py")  # the app and the middlewares
ph = _load("_rsbench_peers_http", HERE / "_peers_http.py")  # HTTP throughput
ps = _load("_rsbench_peers_storm", HERE / "_peers_storm.py")  # the duplicate storm
pr = _load("_rsbench_peers_report", HERE / "_peers_report.py")  # tables and Markdown
post = pa.post  # bench/sizes.py drives its ASGI app with it


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
        return ps.serve(sys.argv[2:])
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
    sides: dict[str, ph.HttpSide] = {}
    http_trips: dict[tuple[str, str], Counter[str]] = {}
    storms: list[ps.Storm] = []

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
            http, sides = ph.http_contenders(bs, runner, url, ns)
            for side in sides.values():
                stack.callback(runner.run, side.close())
            print(
                f"\n[HTTP level] {len(http)} contenders, {args.rounds} rounds of {args.seconds:g}s",
                flush=True,
            )
            bs.run_rounds(http, args.rounds, args.seconds, args.warmup)
            for c in http:
                http_trips[(c.name, c.workload)] = ph.count_round_trips(c)
            for side in sides.values():
                for w in (pa.FIRST, pa.REPLAY):
                    print(f"  {side.mw.name} {w}s answered: {pa.describe_answers(side.answers[w])}")
        if "storm" in args.parts:
            print(
                f"\n[storm] {args.keys} keys x {args.clients} concurrent callers, handler "
                f"{args.work * 1000:g} ms",
                flush=True,
            )
            storms += ps.function_storms(url, ns, args.keys, args.clients, args.waves, args.work)
            for wave, mw in itertools.product(args.waves, pa.MIDDLEWARES.values()):
                storm = asyncio.run(
                    ps.asgi_storm(mw, url, ns, args.keys, args.clients, wave, args.work)
                )
                print(f"  in process / {mw.name}: {ps.storm_line(storm)}", flush=True)
                storms.append(storm)
            free_port = bs._servers_module().free_port
            storms += ps.server_storms(
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
    doc = pr.render(
        args, command, info, libraries, dec, http, sides, http_trips, storms, elapsed, bs
    )
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
