"""The engine on the memory store, this tree against a commit, in one run.

Three measurements, each of the work tree's ``src/`` and of ``--rev``'s (exported
with ``git archive``), each in child processes that import only their own tree:

* ``--instructions [N]`` (default): instructions per call counted by valgrind's
  callgrind (the same on every run, whatever the machine's load) for N calls of
  ``engine.begin(new_key, operation=..., fingerprint=...)`` + ``engine.complete``
  (first call), ``engine.begin`` of a completed key (replay), and an
  ``@idempotent`` function on the memory store (first call, replay). Only the
  batch of N calls is counted (start-up and warm-up are left out).
* ``--rate``: calls per second of the same four workloads, the two trees'
  children taking turns for ``--rounds`` rounds of ``--seconds`` (wall clock, so
  noisy on a busy machine: read the ratio of the two trees within the run).
* ``--gc [RECORDS]``: a full (generation 2) collection with RECORDS completed
  records in a memory store (default 100,000): the objects the collector tracks
  and the median time of 5 collections (and of 5 before the records were written).

    python bench/engine.py [--instructions [N]] [--rate] [--gc [RECORDS]]
                           [--rev REV] [--rounds R] [--seconds S]

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
import functools
import gc
import importlib.util
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

#: The commit the issue's targets are measured against.
START = "dcb54ec"
OPERATION = "bench.charge"
FINGERPRINT = "f" * 64
RESULT: dict[str, Any] = {"id": "ch_123", "amount": 1999, "currency": "eur", "ok": True}
WORKLOADS = ("engine/first", "engine/replay", "idempotent/first", "idempotent/replay")
WARMUP = 300


# -- the child: one tree's retrysafe -------------------------------------------------------


def workload(name: str) -> Callable[[int], None]:
    """``run(n)``: n calls of one workload on a fresh memory store."""
    from retrysafe import Claim, Engine, Outcome, Replay, idempotent

    engine = Engine("memory://")
    seq = itertools.count()
    outcome = Outcome.json(RESULT)

    if name == "engine/first":

        def run(n: int) -> None:
            begin, complete = engine.begin, engine.complete
            for _ in range(n):
                claim = begin(f"k-{next(seq)}", operation=OPERATION, fingerprint=FINGERPRINT)
                assert type(claim) is Claim
                complete(claim, outcome)

        return run
    if name == "engine/replay":
        claim = engine.begin("done", operation=OPERATION, fingerprint=FINGERPRINT)
        assert type(claim) is Claim
        engine.complete(claim, outcome)

        def run(n: int) -> None:
            begin = engine.begin
            for _ in range(n):
                found = begin("done", operation=OPERATION, fingerprint=FINGERPRINT)
                assert type(found) is Replay

        return run
    ran = [0]

    @idempotent(store=engine, key="{order[order_id]}")
    def charge(order: dict[str, Any]) -> dict[str, Any]:
        ran[0] += 1
        return {"order_id": order["order_id"], "charged": order["amount"], "ok": True}

    if name == "idempotent/first":

        def run(n: int) -> None:
            before = ran[0]
            for _ in range(n):
                charge(order={"order_id": f"o-{next(seq)}", "amount": 1999})
            assert ran[0] == before + n

        return run
    order = {"order_id": "o-done", "amount": 1999}
    charge(order=order)

    def run(n: int) -> None:
        before = ran[0]
        for _ in range(n):
            charge(order=order)
        assert ran[0] == before

    return run


def child_count(name: str, n: int) -> None:
    """Warm up, then run n calls inside one ``functools.reduce`` call: the only code
    callgrind counts (see :func:`instructions`)."""
    run = workload(name)
    run(WARMUP)
    gc.collect()
    gc.freeze()  # a full collection within the batch would walk the whole heap
    functools.reduce(lambda _, k: run(k), [n], None)


def child_rate(seconds: float) -> None:
    """Print the calls per second of every workload over ``seconds`` each."""
    rates = {}
    for name in WORKLOADS:
        run = workload(name)
        run(WARMUP)
        done, start = 0, time.perf_counter()
        while (now := time.perf_counter()) - start < seconds:
            run(200)
            done += 200
        rates[name] = done / (now - start)
    print(json.dumps(rates))


def child_gc(records: int) -> None:
    """Print the tracked objects and the median gen-2 collection time with ``records``."""
    from retrysafe import Engine, Outcome

    engine = Engine("memory://")
    gc.collect()
    empty = _pause()
    for i in range(records):
        claim = engine.begin(f"key-{i}", operation=OPERATION, fingerprint=FINGERPRINT)
        engine.complete(claim, Outcome.json({"id": i, "status": "ok"}))  # type: ignore[arg-type]
    gc.collect()
    print(json.dumps({"objects": len(gc.get_objects()), "ms": _pause(), "empty": empty}))


def _pause() -> float:
    """The median time of 5 full collections, in ms."""
    times = []
    for _ in range(5):
        start = time.perf_counter()
        gc.collect(2)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


# -- the parent: two trees, one run ---------------------------------------------------------


@contextlib.contextmanager
def trees(rev: str) -> Iterator[dict[str, str]]:
    """label -> the ``src/`` directory to import retrysafe from: ``rev``, and the tree."""
    spec = importlib.util.spec_from_file_location("_rsbench_stores", HERE / "stores.py")
    assert spec is not None and spec.loader is not None
    stores = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stores)
    with stores.exported(rev) as (commit, src):
        yield {commit: src, "tree": str(ROOT / "src")}


def child(src: str, *args: str, wrap: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": src}
    argv = [*wrap, sys.executable, __file__, "--child", *args]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{run.stderr[-3000:]}")
    return run


def instructions(src: str, name: str, n: int) -> float:
    """Instructions per call of ``name`` with ``src``'s retrysafe."""
    with tempfile.TemporaryDirectory(prefix="rsbench-callgrind-") as tmp:
        out = Path(tmp) / "cg.out"
        wrap = (
            "valgrind",
            "--tool=callgrind",
            "--collect-atstart=no",
            "--toggle-collect=functools_reduce",
            "--dump-after=functools_reduce",
            f"--callgrind-out-file={out}",
        )
        child(src, "count", name, str(n), wrap=wrap)
        dumps = list(Path(tmp).glob("cg.out.*"))
        if len(dumps) != 1:
            raise SystemExit(f"{name}: expected one callgrind dump, found {len(dumps)}")
        found = re.search(r"^totals: (\d+)", dumps[0].read_text(), re.M)
        assert found is not None
        return int(found.group(1)) / n


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [header, *rows]
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instructions", nargs="?", type=int, const=2000, metavar="N")
    p.add_argument("--rate", action="store_true", help="calls per second, trees taking turns")
    p.add_argument("--gc", nargs="?", type=int, const=100_000, metavar="RECORDS")
    p.add_argument("--rev", default=START, help=f"the commit to compare with (default {START})")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.5)
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "count":
            child_count(rest[0], int(rest[1]))
        elif kind == "rate":
            child_rate(float(rest[0]))
        else:
            child_gc(int(rest[0]))
        return 0
    if args.instructions is None and not args.rate and args.gc is None:
        args.instructions = 2000
    print(f"python bench/engine.py {' '.join(sys.argv[1:])}".rstrip())
    with trees(args.rev) as srcs:
        base, tree = list(srcs)
        if args.instructions:
            if not shutil.which("valgrind"):
                raise SystemExit("--instructions needs valgrind")
            n = args.instructions
            rows = []
            for name in WORKLOADS:
                was, now = (instructions(srcs[t], name, n) for t in (base, tree))
                rows.append([name, f"{was:,.0f}", f"{now:,.0f}", f"{was / now:.2f}x"])
            print(f"\ninstructions per call (valgrind, N={n}, memory store)")
            print(table(["workload", base, tree, f"{base} / tree"], rows))
        if args.rate:
            samples: dict[str, dict[str, list[float]]] = {t: {} for t in srcs}
            for r in range(args.rounds):
                for t in (base, tree) if r % 2 == 0 else (tree, base):
                    rates = json.loads(child(srcs[t], "rate", str(args.seconds)).stdout)
                    for name, rate in rates.items():
                        samples[t].setdefault(name, []).append(rate)
                print(f"  round {r + 1}/{args.rounds}", flush=True)
            rows = []
            for name in WORKLOADS:
                was, now = (statistics.median(samples[t][name]) for t in (base, tree))
                rows.append([name, f"{was:,.0f}", f"{now:,.0f}", f"{now / was:.2f}x"])
            print(f"\ncalls per second (median of {args.rounds} interleaved rounds)")
            print(table(["workload", base, tree, f"tree / {base}"], rows))
        if args.gc:
            rows = []
            for t in (base, tree):
                got = json.loads(child(srcs[t], "gc", str(args.gc)).stdout)
                rows.append([t, f"{got['objects']:,}", f"{got['ms']:.1f}", f"{got['empty']:.1f}"])
            print(f"\nfull collection with {args.gc:,} records (median of 5)")
            print(table(["tree", "tracked objects", "gen-2 ms", "ms, empty store"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
