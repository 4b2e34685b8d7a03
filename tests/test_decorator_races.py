"""``@idempotent`` exactly once: 64 threads, 200 tasks, processes, and a crashed worker.

Every racer calls the decorated function at once with ``wait=`` so that all of
them end with the winner's answer. The side effect is a line in a file,
outside the store: it must be there exactly once.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from _racing import race_processes
from conftest import StoreSpec

from retrysafe import (
    Engine,
    InProgressError,
    LeaseLostError,
    Status,
    Store,
    idempotent,
    key_hash,
    open_store,
)

THREADS = 64
TASKS = 200
PROCESSES = 4
OP = "decorated-race"


def _effect(effects: Path, who: str) -> str:
    with effects.open("a") as f:  # the side effect: one line per execution
        f.write(f"{who}\n")
    return who


def _check(answers: list[str], effects: Path, racers: int) -> None:
    lines = effects.read_text().splitlines()
    assert len(lines) == 1, f"{len(lines)} executions"
    assert len(answers) == racers and set(answers) == set(lines), "someone got another answer"


def test_threads(store_spec: StoreSpec, tmp_path: Path) -> None:
    store = store_spec.open()
    effects = tmp_path / "effects"
    barrier = threading.Barrier(THREADS)

    # ``who`` differs per racer and is not part of the request: only ``n`` is validated.
    @idempotent(store=Engine(store), key="order-{n}", wait=30, validate="n", operation=OP)
    def create_order(n: int, who: str) -> str:
        time.sleep(0.01)  # hold the key while the others arrive
        return _effect(effects, who)

    def racer(i: int) -> str:
        barrier.wait()
        return create_order(1, f"thread-{i}")

    with ThreadPoolExecutor(THREADS) as pool:
        answers = list(pool.map(racer, range(THREADS)))
    store.close()
    _check(answers, effects, THREADS)


async def test_tasks(store_spec: StoreSpec, tmp_path: Path) -> None:
    store = store_spec.open()
    effects = tmp_path / "effects"
    gate = asyncio.Event()

    @idempotent(store=Engine(store), key="order-{n}", wait=30, validate="n", operation=OP)
    async def create_order(n: int, who: str) -> str:
        await asyncio.sleep(0.01)  # hold the key while the others arrive
        return _effect(effects, who)

    async def racer(i: int) -> str:
        await gate.wait()
        return await create_order(1, f"task-{i}")

    tasks = [asyncio.create_task(racer(i)) for i in range(TASKS)]
    await asyncio.sleep(0)
    gate.set()
    answers = await asyncio.gather(*tasks)
    await store.aclose()
    _check(answers, effects, TASKS)


def _decorated_racer(store: Store[Any], effects: str) -> Callable[[str], str]:
    @idempotent(store=Engine(store), key="order-{n}", wait=30, validate="n", operation=OP)
    def create_order(n: int, who: str) -> str:
        time.sleep(0.01)
        return _effect(Path(effects), who)

    return lambda who: create_order(1, who)


def test_processes(shared_spec: StoreSpec, tmp_path: Path) -> None:
    effects = tmp_path / "effects"
    answers = race_processes(shared_spec, _decorated_racer, str(effects), processes=PROCESSES)
    _check(answers, effects, PROCESSES * 8)


# -- a worker killed mid-call: its lease runs out and the next call takes over -----------

LEASE = 3.0


def _crashing_worker(spec: StoreSpec, effects: str) -> None:
    @idempotent(store=Engine(spec.open()), key="order-{n}", lease=LEASE, operation="crash")
    def create_order(n: int) -> str:
        _effect(Path(effects), "started")
        time.sleep(120)  # killed here, holding the key
        return "never"

    create_order(1)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_crash_takeover(shared_spec: StoreSpec, tmp_path: Path, mode: str) -> None:
    effects = tmp_path / "effects"
    ctx = mp.get_context("spawn")
    worker = ctx.Process(target=_crashing_worker, args=(shared_spec, str(effects)))
    worker.start()
    deadline = time.monotonic() + 60
    while not (effects.exists() and effects.read_text()):  # until it holds the key
        assert time.monotonic() < deadline and worker.is_alive()
        time.sleep(0.02)
    assert worker.pid is not None
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=30)
    assert worker.exitcode == -signal.SIGKILL

    store = shared_spec.open()
    engine = Engine(store)
    options = {"store": engine, "key": "order-{n}", "lease": LEASE, "operation": "crash"}
    if mode == "sync":

        @idempotent(**options)
        def retry(n: int) -> str:
            return _effect(effects, "retried")

        with pytest.raises(InProgressError):
            retry(1)  # the dead worker's lease is still alive
        waited = idempotent(**options, wait=LEASE * 4)(retry.__wrapped__)
        assert waited(1) == "retried" and retry(1) == "retried"
    else:

        @idempotent(**options)
        async def aretry(n: int) -> str:
            return _effect(effects, "retried")

        async def run() -> None:
            with pytest.raises(InProgressError):
                await aretry(1)
            waited = idempotent(**options, wait=LEASE * 4)(aretry.__wrapped__)
            assert await waited(1) == "retried" and await aretry(1) == "retried"
            await store.aclose()

        asyncio.run(run())
    assert effects.read_text().splitlines() == ["started", "retried"]
    record = store.get(key_hash("", "crash", "order-1"))
    assert record is not None and record.status is Status.COMPLETED and record.attempts == 2
    store.close()


# -- a call that outlives its lease keeps its key (renewal), unless renew=False ---------


def test_long_call_keeps_its_key(store_spec: StoreSpec, tmp_path: Path) -> None:
    _long_call(store_spec.open(), tmp_path, renew=True)


def test_long_call_without_renewal_is_taken_over(tmp_path: Path) -> None:
    _long_call(open_store("memory://"), tmp_path, renew=False)


def _long_call(store: Store[Any], tmp_path: Path, renew: bool) -> None:
    effects = tmp_path / "effects"
    running, done = threading.Event(), threading.Event()
    lease = 1.0

    @idempotent(
        store=Engine(store), key="k", lease=lease, renew=renew, operation="long", validate=()
    )
    def slow(who: str) -> str:
        running.set()
        _effect(effects, who)
        done.wait(timeout=30)  # runs until the test has seen 2.5 leases go by
        return who

    outcome: list[Any] = []

    def call_first() -> None:
        try:
            outcome.append(slow("first"))
        except LeaseLostError as exc:
            outcome.append(exc)

    first = threading.Thread(target=call_first)
    first.start()
    assert running.wait(timeout=30)
    rival = idempotent(store=Engine(store), key="k", lease=lease, operation="long", validate=())
    answers: list[str] = []
    deadline = time.monotonic() + 2.5 * lease
    while time.monotonic() < deadline:
        try:
            answers.append(rival(lambda who: _effect(effects, who))("rival"))
        except InProgressError:
            answers.append("in flight")
        time.sleep(0.05)  # a client's retry interval
    done.set()
    first.join(timeout=30)
    store.close()
    if renew:
        assert set(answers) == {"in flight"} and effects.read_text().splitlines() == ["first"]
        assert outcome == ["first"]
    else:  # the lease ran out while the first call was still running: it ran twice
        assert "rival" in answers and effects.read_text().splitlines() == ["first", "rival"]
        assert isinstance(outcome[0], LeaseLostError)  # and the first one's result was refused
