"""What reporting metrics costs: requests per second with metrics on against off, in one run.

Issue "Step 7" asks for an overhead benchmark with a target: the rate with metrics
on at least 0.95 of the rate with them off. In one process and one run, every
variant is measured with ``METRICS.enabled`` on and off, interleaved (on, off, the
next variant's on, off, ...; the whole order flips every round), after a warm-up:

* **asgi**: ``retrysafe.asgi.IdempotencyMiddleware`` around the endpoint of
  bench/http.py (a pure ASGI app that reads the body and answers 201 with a small
  JSON body), driven by direct ASGI calls on one event loop (uvloop when installed):
  no socket, no server, nothing that hides the Python work, so the worst case for
  the overhead. On ``memory://`` and on ``sqlite:///<temp dir>/m.db`` (default
  options), with first requests (a new key each), replays (one completed key) and
  the mix (the two alternating);
* **engine**: ``engine.begin`` + ``engine.complete`` on the memory store, and
  ``begin`` of a completed key (bench/stores.py's contenders): the per-call CPU
  cost metrics add;
* **server**: the same middleware and endpoint under uvicorn
  (``retrysafe._ops.serve.ServerThread``, a thread of this process, so that toggling
  ``METRICS.enabled`` reaches it) and an ``httpx.Client`` (keep-alive) sending keyed
  POSTs one after another from the main thread; first requests, replays and the mix.
  The server thread's own CPU clock gives its CPU per request too: the ratio a
  saturated server would reach.

A variant's ratio is the median over the rounds of its rate with metrics on divided
by its rate with them off *in the same round*; added CPU is the median over the
rounds of the difference in this process's CPU time per request (on - off), which
other load on the machine moves far less than the rate. Before the rounds each
variant is checked: with metrics on, its requests are counted (executions +
replays); with them off, nothing is. A separate table times each metrics call
(``timeit``, also in prometheus_client's multi-process mode): what the engine's
reports cost, piece by piece.

    python bench/metrics.py [--rounds R] [--seconds S] [--sections asgi,engine,server]
                            [--stores memory,sqlite] [--server-stores memory[,sqlite]]
                            [--rev REV] [--instructions [N]] [--call-instructions [N]]
                            [--profile]
                            [--write docs/performance.md]

``--rev`` measures a commit's ``src/`` (exported with ``git archive``, run in a child
process) instead of a working tree that others may be editing. ``--instructions``
counts, with valgrind, the instructions per request of the in-process memory variants
with metrics off and on: exact figures, whatever the machine's load (about 30 s
more). ``--call-instructions`` counts, with valgrind too, the instructions of each
metrics call and of a scrape, in one process and in multi-process mode. ``--profile``
adds a cProfile of the in-process memory-store variants' metrics-on loops after the
rounds.

This is a benchmark, not a test (pytest does not run it).
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
import contextlib
import cProfile
import importlib.util
import io
import json
import os
import pstats
import shlex
import sqlite3
import tempfile
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from retrysafe._core.metrics import METRICS

BEGIN_MARK = "<!-- bench/metrics.py: generated from here -->"
END_MARK = "<!-- bench/metrics.py: generated up to here -->"
SECTION = "## Step 7: metrics overhead"
SECTIONS = ("asgi", "engine", "server")


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bs = _load("_rsbench_stores", HERE / "stores.py")
bh = _load("_rsbench_http", HERE / "http.py")
# This script's own modules, in the order they use each other (each finds the ones
# loaded before it in sys.modules).
mp = _load("_rsbench_metrics_pairs", HERE / "_metrics_pairs.py")  # the variants
mc = _load("_rsbench_metrics_calls", HERE / "_metrics_calls.py")  # each metrics call, timed
mn = _load("_rsbench_metrics_count", HERE / "_metrics_count.py")  # instructions (valgrind)
mr = _load("_rsbench_metrics_report", HERE / "_metrics_report.py")  # tables and Markdown


# -- profile ------------------------------------------------------------------------------------


ENTRY_POINTS = ("claimed", "replayed", "settled", "store_call", "refused", "failed")


def profile(pairs: Sequence[mp.Pair], seconds: float, top: int = 25) -> str:
    """cProfile of each pair's metrics-on loop: the top functions by own time, and the
    metrics' own functions. Returns the text printed."""
    chunks = []
    for p in pairs:
        p.on.prepare()
        prof = cProfile.Profile()
        deadline = time.perf_counter() + seconds
        done = 0
        prof.enable()
        while time.perf_counter() < deadline:
            p.on.run(p.on.batch)
            done += p.on.batch
        prof.disable()
        METRICS.enabled = True
        buf = io.StringIO()
        buf.write(f"\n=== cProfile: {p.label}, metrics on, {done} requests ===\n")
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime").print_stats(top)
        stats = pstats.Stats(prof, stream=buf)
        raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
        entry = sum(
            v[3] for k, v in raw.items() if k[0].endswith("_metrics.py") and k[2] in ENTRY_POINTS
        )
        total = stats.total_tt  # type: ignore[attr-defined]
        buf.write(
            f"--- {p.label}: the engine's METRICS calls take {entry:.3f} s of "
            f"{total:.3f} s profiled ({entry / total:.0%}; cProfile inflates small "
            "calls: see the timeit table); their callees: ---\n"
        )
        stats.sort_stats("tottime").print_stats(r"_metrics\.py|prometheus_client|opentelemetry")
        text = buf.getvalue()
        print(text)
        chunks.append(text)
    return "\n".join(chunks)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    p.add_argument("--seconds", type=float, default=0.3, help="length of one measurement")
    p.add_argument("--warmup", type=float, default=0.3, help="warm-up seconds per side")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    p.add_argument("--stores", default="memory,sqlite", help="stores of the asgi section")
    p.add_argument("--server-stores", default="memory", help="stores of the server section")
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the rounds, cProfile each variant's metrics-on loop",
    )
    p.add_argument("--rev", help="measure this git revision's src/ (git archive), not the tree")
    p.add_argument(
        "--instructions",
        type=int,
        nargs="?",
        const=1000,
        default=0,
        metavar="N",
        help="also count the instructions per request of the in-process memory variants "
        "with valgrind (N requests each, default 1000)",
    )
    p.add_argument(
        "--call-instructions",
        type=int,
        nargs="?",
        const=10_000,
        default=0,
        metavar="N",
        help="also count the instructions of each metrics call and of a scrape with "
        "valgrind, in one process and in multi-process mode (N calls each, default 10000)",
    )
    p.add_argument("--count-run", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--call-count-run", type=int, help=argparse.SUPPRESS)
    p.add_argument("--call-costs-json", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--write",
        type=Path,
        default=None,
        metavar="PATH",
        help="write the results as Markdown into this file",
    )
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    args.stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    args.server_stores = [s.strip() for s in args.server_stores.split(",") if s.strip()]
    if set(args.sections) - set(SECTIONS):
        p.error(f"--sections: choose from {', '.join(SECTIONS)}")
    if set(args.stores + args.server_stores) - {"memory", "sqlite"}:
        p.error("--stores / --server-stores: choose from memory, sqlite")
    if args.rounds < 1 or args.seconds <= 0:
        p.error("--rounds must be at least 1 and --seconds positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.count_run:  # a child of instructions()
        mn.count_run(args.count_run[0], args.count_run[1], int(args.count_run[2]))
        return 0
    if args.call_count_run:  # a child of call_instructions()
        mn.call_count_run(args.call_count_run)
        return 0
    if args.call_costs_json:  # the child of multiprocess_costs()
        print(json.dumps(mc.call_costs()))
        return 0
    if args.rev and not bs.in_rev():
        return bs.run_rev(args.rev)
    command = shlex.join(["python", "bench/metrics.py", *(sys.argv[1:] if argv is None else argv)])
    started = time.monotonic()
    info = bs.machine_info()
    bs.note_rev(info)
    info["libraries"] = mr.library_info()
    info["SQLite"] = sqlite3.sqlite_version
    sections: dict[str, list[mp.Pair]] = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rsbench-metrics-")))
        urls = {"memory": "memory://", "sqlite": f"sqlite:///{tmp}/m.db"}
        loop = mp.new_loop()
        stack.callback(loop.close)
        builders: dict[str, Callable[[], list[mp.Pair]]] = {
            "asgi": lambda: [p for s in args.stores for p in mp.asgi_pairs(s, urls[s], loop)],
            "engine": mp.engine_pairs,
            "server": lambda: [
                p for s in args.server_stores for p in mp.server_pairs(s, urls[s], stack)
            ],
        }
        profiled = []
        for name in args.sections:
            pairs = builders[name]()
            mp.check_counting(pairs)
            print(
                f"\n[{name}] {len(pairs)} variants x (on, off), {args.rounds} rounds of "
                f"{args.seconds:g} s",
                flush=True,
            )
            mp.run_rounds(pairs, args.rounds, args.seconds, args.warmup)
            sections[name] = pairs
            if args.profile and name != "server":  # cProfile sees this thread only
                profiled += [p for p in pairs if p.store == "memory" and p.workload != mp.MIX]
        if args.profile:
            profile(profiled, max(1.0, args.seconds))
    info["load average at end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    costs: mc.Costs = {mc.SINGLE: mc.call_costs(), mc.MULTI: mc.multiprocess_costs()}
    counts = mn.instructions(args.instructions) if args.instructions else {}
    per_call = mn.call_instructions(args.call_instructions) if args.call_instructions else {}
    elapsed = time.monotonic() - started

    for name, pairs in sections.items():
        print(f"\n== {name}: metrics on / off (target >= {mr.TARGET}) ==")
        print(bs.plain(mr.results_table(pairs, "op" if name == "engine" else "req")))
        if name == "server":
            print(bs.plain(mr.server_table(pairs)))
    if counts:
        print("\n== instructions per request (valgrind), in process, memory store ==")
        print(bs.plain(mr.instructions_table(counts)))
    print("\n== what each metrics call costs (ns) ==")
    print(bs.plain(mr.costs_table(costs)))
    if per_call:
        print("\n== instructions per metrics call (valgrind) ==")
        print(bs.plain(mr.costs_table(per_call, "instructions")))
    for mode, c in costs.items():
        print(f"the children timed, {mode}: {c[mc.CHILDREN]}")
    print(
        f"\n(total {elapsed:.0f} s; load average at start "
        f"{info['load average at start (1, 5, 15 min)']}, at end {info['load average at end']})"
    )
    if args.write is not None:
        text = mr.render(sections, costs, counts, args, command, info, elapsed, per_call)
        args.write.write_text(bs.splice(args.write, text, (BEGIN_MARK, END_MARK), SECTION))
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
