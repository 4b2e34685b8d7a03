"""bench/metrics.py's instruction counts (valgrind's callgrind): per request of the
in-process memory variants, and per metrics call.

Loaded by path by bench/metrics.py (see its docstring); not a script of its own.
"""

from __future__ import annotations

import functools
import gc
import os
import re
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

from retrysafe._core.metrics import METRICS

# bench/metrics.py loads this module by path, as it loads bench/stores.py and bench/http.py
# (the bench folder stays off sys.path: see there); they are in sys.modules by then.
bs = sys.modules["_rsbench_stores"]
mp = sys.modules["_rsbench_metrics_pairs"]
mc = sys.modules["_rsbench_metrics_calls"]
BenchError = bs.BenchError
SCRIPT, ROOT = mc.SCRIPT, mc.ROOT


# -- instructions per metrics call, whatever the machine's load -------------------------------

CALL_WARMUP = 200


def call_count_run(n: int) -> None:
    """The child of :func:`call_instructions`: an empty loop of ``n``, then each of
    :data:`CALLS` ``n`` times and :data:`SCRAPE` ``n // 100`` times, each batch inside
    one ``functools.reduce`` call (the only code callgrind counts, dumped after each)."""
    names = mc.call_names()
    batches = [("", "pass", True, n)]
    batches += [(what, stmt, enabled, n) for what, stmt, enabled, _ in mc.CALLS]
    batches.append((mc.SCRAPE, "scrape()", True, max(1, n // 100)))
    try:
        for _, stmt, enabled, k in batches:
            METRICS.enabled = enabled
            timer = timeit.Timer(stmt, globals=names)
            timer.timeit(min(k, CALL_WARMUP))
            gc.collect()
            functools.reduce(lambda _, t: t.timeit(k), [timer], None)
    finally:
        METRICS.enabled = True


def _call_instructions(n: int, multi: bool, tmp: str) -> dict[str, float]:
    folder = Path(tmp) / ("multi" if multi else "single")
    folder.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    if multi:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
    argv = [sys.executable, str(SCRIPT), "--call-count-run", str(n)]
    totals, stderr = callgrind(argv, folder / "calls.out", env)
    whats = [what for what, *_ in mc.CALLS]
    if len(totals) != len(whats) + 2:
        raise BenchError(f"call instructions: callgrind gave {totals}:\n{stderr[-2000:]}")
    per_loop = totals[0] / n
    counts = {w: t / n - per_loop for w, t in zip(whats, totals[1:-1], strict=True)}
    counts[mc.SCRAPE] = totals[-1] / max(1, n // 100)
    return counts


def call_instructions(n: int) -> mc.Costs:
    """mode -> call -> instructions per call, counted by callgrind (an empty loop's
    subtracted; the scrape's not), in one process and in multi-process mode."""
    from concurrent.futures import ThreadPoolExecutor

    with (
        tempfile.TemporaryDirectory(prefix="rsbench-callgrind-") as tmp,
        ThreadPoolExecutor(2) as pool,
    ):
        single, multi = pool.map(lambda multi: _call_instructions(n, multi, tmp), (False, True))
    return {mc.SINGLE: single, mc.MULTI: multi}


# -- instructions: what metrics add per request, whatever the machine's load ----------------

COUNTED = [("asgi", mp.FIRST), ("asgi", mp.REPLAY), ("engine", mp.FIRST), ("engine", mp.REPLAY)]
COUNT_WARMUP = 200


def count_run(section: str, workload: str, n: int) -> None:
    """The child of :func:`instructions`: one in-process variant on the memory store,
    warmed up with metrics off and on, then ``n`` requests off and ``n`` on, each batch
    inside one ``functools.reduce`` call: the only code callgrind counts (and dumps
    after), so start-up, warm-up and preparation are left out."""
    loop = mp.new_loop()
    pairs = mp.asgi_pairs("memory", "memory://", loop) if section == "asgi" else mp.engine_pairs()
    chosen = next(p for p in pairs if p.workload == workload)
    for state in (False, True):
        METRICS.enabled = state
        chosen.prepare()
        chosen.run(COUNT_WARMUP)
    for state in (False, True):
        METRICS.enabled = state
        chosen.prepare()
        gc.collect()
        gc.freeze()  # a full collection within one batch would walk the whole heap
        functools.reduce(lambda _, k: chosen.run(k), [n], None)
    METRICS.enabled = True


def callgrind(
    argv: list[str], out: Path, env: dict[str, str] | None = None
) -> tuple[list[int], str]:
    """Run ``argv`` under callgrind, counting only inside ``functools.reduce`` calls
    and dumping after each: the instructions of each dump, and the child's stderr
    (an empty list if it failed)."""
    run = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--collect-atstart=no",
            "--toggle-collect=functools_reduce",
            "--dump-after=functools_reduce",
            f"--callgrind-out-file={out}",
            *argv,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    dumps = sorted(out.parent.glob(f"{out.name}.*"), key=lambda f: int(f.suffix[1:]))
    totals = []
    for dump in dumps:
        found = re.search(r"^totals: (\d+)", dump.read_text(), re.M)
        totals.append(int(found.group(1)) if found else -1)
    if run.returncode != 0 or (totals and min(totals) <= 0):
        return [], run.stderr
    return totals, run.stderr


def _instructions(section: str, workload: str, n: int, tmp: str) -> tuple[float, float]:
    argv = [sys.executable, str(SCRIPT), "--count-run", section, workload, str(n)]
    totals, stderr = callgrind(argv, Path(tmp) / f"{section}-{workload}.out")
    if len(totals) != 2:
        raise BenchError(
            f"{section}/{workload}: callgrind gave {totals} (expected 2 dumps):\n{stderr[-2000:]}"
        )
    return totals[0] / n, totals[1] / n


def instructions(n: int) -> dict[tuple[str, str], tuple[float, float]]:
    """(section, workload) -> instructions per request (off, on) on the memory store,
    counted by valgrind's callgrind: the same on every run, whatever the machine's load."""
    from concurrent.futures import ThreadPoolExecutor

    with (
        tempfile.TemporaryDirectory(prefix="rsbench-callgrind-") as tmp,
        ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool,
    ):
        results = pool.map(lambda job: _instructions(*job, n, tmp), COUNTED)
        return dict(zip(COUNTED, results, strict=True))
