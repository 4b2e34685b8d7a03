"""Exactly once under contention: 64 threads, 64 tasks and 8 processes race on one key.

Every racer starts at the same barrier. Exactly one claim may win; everyone
else must end with the winner's answer (the losers wait for it), and the side
effect, recorded outside the store, must have happened exactly once.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from _racing import race_processes
from conftest import SHARED_STORES, SQLALCHEMY_STORES, STORES, StoreSpec, make_spec

from retrysafe import Claim, Engine, Outcome, Replay

THREADS = 64
PROCESSES = 8
OP = "race"


@pytest.fixture(params=STORES + SQLALCHEMY_STORES)
def store_spec(request: pytest.FixtureRequest, tmp_path: Path) -> StoreSpec:
    """This module's stores: the shared list plus the SQLAlchemy stores."""
    return make_spec(request.param, request, tmp_path)


@pytest.fixture(
    params=[*SHARED_STORES, "sqlalchemy-sqlite", "sqlalchemy-postgres", "sqlalchemy-mysql"]
)
def shared_spec(request: pytest.FixtureRequest, tmp_path: Path) -> StoreSpec:
    """The stores several processes share, the SQLAlchemy ones on a sync Engine too."""
    return make_spec(request.param, request, tmp_path)


def race_once(engine: Engine, key: str, effects: Path, who: str) -> tuple[str, Any]:
    """One racer: claim or wait for the winner's answer. Returns (role, answer)."""
    result = engine.begin(key, operation=OP, fingerprint="same", wait=30)
    if isinstance(result, Replay):
        return "replay", result.outcome.value
    assert isinstance(result, Claim)
    with effects.open("a") as f:  # the side effect: one line per execution
        f.write(f"{who}\n")
    engine.complete(result, Outcome.json(who))
    return "claim", who


def check(results: list[tuple[str, Any]], effects: Path, racers: int) -> None:
    roles = [role for role, _ in results]
    assert roles.count("claim") == 1, f"{roles.count('claim')} racers executed"
    assert len(results) == racers
    winner = next(answer for role, answer in results if role == "claim")
    assert {answer for _, answer in results} == {winner}, "someone got another answer"
    assert effects.read_text().splitlines() == [winner]


@pytest.mark.parametrize("round_", range(3))
def test_threads_race(store_spec: StoreSpec, tmp_path: Path, round_: int) -> None:
    store = store_spec.open()
    engine = Engine(store)
    effects = tmp_path / f"effects-{round_}"
    effects.touch()
    barrier = threading.Barrier(THREADS)

    def racer(i: int) -> tuple[str, Any]:
        barrier.wait()
        return race_once(engine, f"key-{round_}", effects, f"thread-{i}")

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(racer, range(THREADS)))
    store.close()
    check(results, effects, THREADS)


async def test_tasks_race(store_spec: StoreSpec, tmp_path: Path) -> None:
    store = store_spec.open()
    engine = Engine(store)
    effects = tmp_path / "effects"
    effects.touch()
    gate = asyncio.Event()

    async def racer(i: int) -> tuple[str, Any]:
        await gate.wait()
        result = await engine.abegin("key", operation=OP, fingerprint="same", wait=30)
        if isinstance(result, Replay):
            return "replay", result.outcome.value
        with effects.open("a") as f:
            f.write(f"task-{i}\n")
        await asyncio.sleep(0.01)  # hold the lease while the others arrive
        await engine.acomplete(result, Outcome.json(f"task-{i}"))
        return "claim", f"task-{i}"

    tasks = [asyncio.create_task(racer(i)) for i in range(THREADS)]
    await asyncio.sleep(0)
    gate.set()
    results = await asyncio.gather(*tasks)
    await store.aclose()
    check(results, effects, THREADS)


def _engine_racer(store: Any, key: str, effects: str) -> Any:
    engine = Engine(store)
    return lambda who: race_once(engine, key, Path(effects), who)


@pytest.mark.parametrize("round_", range(2))
def test_processes_race(shared_spec: StoreSpec, tmp_path: Path, round_: int) -> None:
    effects = tmp_path / "effects"
    effects.touch()
    answers = race_processes(
        shared_spec, _engine_racer, f"key-{round_}", str(effects), processes=PROCESSES, threads=8
    )
    check(answers, effects, PROCESSES * 8)
