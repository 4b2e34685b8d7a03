"""Expiry, the sweeper and the archive, on every store (real Redis and PostgreSQL).

Expired records go, live ones stay, financial ones are archived exactly once,
and a sweep killed at any moment is resumed by the next without loss or
duplicates.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, StoreSpec

from retrysafe import Claim, Engine, Outcome, Status, Store, Sweeper

HOUR = 3600.0


@pytest.fixture
def spec(store_spec: StoreSpec, tmp_path: Path) -> StoreSpec:
    """The store, with an archive of its own where the store needs one (Redis)."""
    if store_spec.name == "redis":
        options = dict(store_spec.options, archive=f"sqlite:///{tmp_path}/archive.db")
        return StoreSpec(store_spec.name, store_spec.url, options)
    return store_spec


@pytest.fixture
def sstore(spec: StoreSpec) -> Iterator[Store[Any]]:
    s = spec.open()
    yield s
    s.close()


def populate(
    store: Store[Any], clock: Clock, *, expired: int, financial: int, live: int, tag: str = "k"
) -> dict[str, list[str]]:
    """Records that will be expired one hour later (standard and financial) and live ones."""
    made: dict[str, list[str]] = {"standard": [], "financial": [], "live": []}
    short = Engine(store, ttl=HOUR, clock=clock)
    money = Engine(store, ttl=HOUR, retention="financial", clock=clock)
    long = Engine(store, ttl=100 * HOUR, clock=clock)
    plan = [("standard", short, expired), ("financial", money, financial), ("live", long, live)]
    for kind, engine, n in plan:
        for i in range(n):
            claim = engine.begin(f"{tag}-{kind}-{i}", operation=f"op.{kind}", fingerprint="fp")
            assert isinstance(claim, Claim)
            if i % 3:  # a mix of completed, failed and processing records
                engine.complete(claim, Outcome(f'{{"n":{i}}}'.encode(), 201))
            elif i % 2:
                engine.fail(claim)
            made[kind].append(claim.key_hash)
    return made


def test_lazy_expiry_then_sweep(sstore: Store[Any], clock: Clock) -> None:
    made = populate(sstore, clock, expired=10, financial=6, live=5)
    clock.advance(2 * HOUR)
    # Lazy: an expired record is absent for a claim even before any sweep.
    engine = Engine(sstore, ttl=HOUR, clock=clock)
    again = engine.begin("k-standard-1", operation="op.standard", fingerprint="other")
    assert isinstance(again, Claim)
    engine.complete(again, Outcome(b"new", 200))

    report = Sweeper(sstore, batch_size=4, clock=clock).run()
    assert report.deleted == 15 and report.archived == 6 and report.batches >= 4
    for kh in made["standard"] + made["financial"]:
        if kh != again.key_hash:
            assert sstore.get(kh) is None
    reclaimed = sstore.get(again.key_hash)
    assert reclaimed is not None and reclaimed.outcome is not None
    assert reclaimed.outcome.body == b"new"
    for kh in made["live"]:
        assert sstore.get(kh) is not None

    archived = sstore.archived_records(limit=100)
    assert sorted(a.record.key_hash for a in archived) == sorted(made["financial"])
    for a in archived:
        assert a.record.retention == "financial"
        assert a.record.operation == "op.financial"
        assert a.archived_at == clock.now
    bodies = {a.record.key: a.record.outcome.body for a in archived if a.record.outcome}
    assert bodies["k-financial-1"] == b'{"n":1}'

    # Nothing left: a second sweep is a no-op.
    assert Sweeper(sstore, clock=clock).run().deleted == 0
    assert len(sstore.archived_records(limit=100)) == 6


def test_one_batch_is_bounded(sstore: Store[Any], clock: Clock) -> None:
    populate(sstore, clock, expired=9, financial=0, live=2)
    clock.advance(2 * HOUR)
    first = sstore.sweep(clock.now, 4)
    assert (first.deleted, first.done) == (4, False)
    second = sstore.sweep(clock.now, 4)
    assert second.deleted == 4
    third = sstore.sweep(clock.now, 4)
    assert (third.deleted, third.done) == (1, True)
    assert sstore.sweep(clock.now, 4).deleted == 0


def test_sweep_as_of_a_time_keeps_what_expires_later(sstore: Store[Any], clock: Clock) -> None:
    made = populate(sstore, clock, expired=3, financial=2, live=0)
    # One hour after creation, minus a second: nothing has expired yet.
    assert sstore.sweep(clock.now + HOUR - 1, 100).deleted == 0
    assert all(sstore.get(kh) is not None for kh in made["standard"] + made["financial"])
    assert sstore.archived_records() == []


def test_archive_is_idempotent(sstore: Store[Any], clock: Clock) -> None:
    made = populate(sstore, clock, expired=0, financial=3, live=0)
    records = [sstore.get(kh) for kh in made["financial"]]
    assert sstore.archive_records(records, clock.now) == 3
    assert sstore.archive_records(records, clock.now + 5) == 0
    assert len(sstore.archived_records()) == 3


def test_records_and_stats(sstore: Store[Any], clock: Clock) -> None:
    populate(sstore, clock, expired=6, financial=3, live=4)
    clock.advance(HOUR / 2)
    processing = sstore.records(status=Status.PROCESSING, limit=100)
    assert processing and all(r.status is Status.PROCESSING for r in processing)
    created = [r.created_at for r in sstore.records(limit=100)]
    assert created == sorted(created) and len(created) == 13
    assert {r.operation for r in sstore.records(operation="op.live")} == {"op.live"}
    assert len(sstore.records(operation="op.live", limit=2)) == 2
    assert sstore.records(created_before=clock.now - 2 * HOUR) == []

    stats = sstore.stats(clock.now)
    assert sum(stats.counts.values()) == 13 and stats.expired == 0
    assert stats.by_operation() == {"op.standard": 6, "op.financial": 3, "op.live": 4}
    by_status = stats.by_status()
    assert by_status["processing"] == len(processing)
    assert by_status["completed"] + by_status["failed"] + by_status["processing"] == 13
    assert stats.oldest_processing is not None
    assert stats.oldest_processing.status is Status.PROCESSING

    clock.advance(HOUR)
    later = sstore.stats(clock.now)
    assert later.expired == 9 and sum(later.counts.values()) == 4
    Sweeper(sstore, clock=clock).run()
    swept = sstore.stats(clock.now)
    assert swept.expired == 0 and swept.archived == 3


_CHILD = textwrap.dedent(
    """
    import itertools, json, sys, time
    from retrysafe import open_store
    url, options, now = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
    free = int(sys.argv[4])
    store = open_store(url, **options)
    if hasattr(store, "migrate"):
        store.migrate()  # the schema before the sweep: no kill in a migration
    for step in itertools.count():
        if step >= free:  # each further batch only when the parent says
            print("held", flush=True)
            sys.stdin.readline()
        if store.sweep(now, 5).done:
            break
        time.sleep(0.002)
    print("done", flush=True)
    """
)


def kill_sweeps_until_one_finishes(spec: StoreSpec, now: float, free: tuple[int, int]) -> int:
    """Sweep in child processes, each SIGKILLed at a random moment, until one finishes.

    A child sweeps a random number (within ``free``) of batches, then waits; the
    parent lets it start one more and kills it at a random moment, inside that
    batch or after it (the child then waits again), however fast or busy the
    machine. So every kill lands in a sweep in progress, and a run advances at
    most ``free[1] + 1`` batches. The moments grow later from kill to kill (from
    within 20 ms, by 20% a kill), so that a batch longer than the first ones gets
    its turn to finish, and each phase of a batch is met on the way. Returns the
    number of kills.
    """
    rng = random.Random(int(os.environ.get("PYTEST_SEED", "0")) or None)
    argv = [sys.executable, "-c", _CHILD, spec.url, json.dumps(spec.options), repr(now)]
    for kills in range(200):
        child = subprocess.Popen(
            [*argv, str(rng.randint(*free))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert child.stdin is not None and child.stdout is not None
        said = child.stdout.readline().strip()
        if said == "held":
            child.stdin.write("go\n")
            child.stdin.flush()
            time.sleep(rng.uniform(0, 0.02 * 1.2**kills))
            child.send_signal(signal.SIGKILL)
            said = child.stdout.read()
        _, errors = child.communicate(timeout=30)
        if "done" in said.split():  # (the kill may still have come before its exit)
            assert child.returncode in (0, -signal.SIGKILL), errors
            return kills
        assert child.returncode == -signal.SIGKILL, errors
    pytest.fail("the sweep never finished")


# Ten child processes at least (48 batches, 5 at most a run), 13 to 31 s beside two CPU
# hogs: the default 120 s is under five times that.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("store_spec", ["sqlite", "redis", "postgres", "mysql"], indirect=True)
def test_killed_sweeps_lose_and_duplicate_nothing(
    spec: StoreSpec, sstore: Store[Any], clock: Clock
) -> None:
    made = populate(sstore, clock, expired=120, financial=120, live=20)
    kills = kill_sweeps_until_one_finishes(spec, clock.now + 2 * HOUR, free=(0, 4))
    # 240 expired records in batches of 5: at least 48 batches, at most 5 a run.
    assert kills >= 9, kills

    for kh in made["standard"] + made["financial"]:
        assert sstore.get(kh) is None
    assert all(sstore.get(kh) is not None for kh in made["live"])
    archived = sstore.archived_records(limit=1000)
    keys = [a.record.key_hash for a in archived]
    assert len(keys) == len(set(keys)), "a record was archived twice"
    assert sorted(keys) == sorted(made["financial"]), "a financial record was lost"
