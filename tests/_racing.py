"""Racing processes: threads in several spawned processes, released at once.

``race_processes(spec, setup, *args)`` starts ``processes`` processes; each
opens the store of ``spec``, calls ``setup(store, *args)`` once to get a racer,
and runs ``racer(who)`` from ``threads`` threads after every process and thread
is ready. ``setup`` must be a module-level function (spawn pickles it by
name). Returns every racer's answer.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from conftest import StoreSpec

from retrysafe import Store

Setup = Callable[..., Callable[[str], Any]]


def race_processes(
    spec: StoreSpec,
    setup: Setup,
    *args: Any,
    processes: int = 4,
    threads: int = 8,
    timeout: float = 90,
) -> list[Any]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(processes)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(spec, setup, args, threads, barrier, queue))
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    answers = [queue.get(timeout=timeout) for _ in range(processes * threads)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return answers


def _child(
    spec: StoreSpec, setup: Setup, args: tuple[Any, ...], threads: int, barrier: Any, queue: Any
) -> None:
    store: Store[Any] = spec.open()
    racer = setup(store, *args)
    inner = threading.Barrier(threads)

    def run(i: int) -> Any:
        inner.wait()
        return racer(f"pid-{os.getpid()}-{i}")

    barrier.wait()
    with ThreadPoolExecutor(threads) as pool:
        for answer in pool.map(run, range(threads)):
            queue.put(answer)
    store.close()
