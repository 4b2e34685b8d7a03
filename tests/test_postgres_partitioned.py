"""The partitioned PostgreSQL table (``partitioned=True``), on a real server.

The conformance suite, the race tests and the shared sweep suite run here on
the partitioned store (``store_spec`` is overridden below). Then what only this
layout has: exactly one claim per key when racers use TTLs that put the key in
different partitions, sweeps that drop whole partitions and archive once,
interrupted sweeps that lose nothing, claims that a sweep never blocks, and a
table that refuses to open in the other mode.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import Clock, StoreSpec, make_spec

# The shared suites, collected again in this module, on the partitioned store.
from test_conformance import (  # noqa: F401
    test_an_outcome_that_cannot_be_stored_fails_finally,
    test_attempt_context_manager,
    test_bad_arguments_touch_nothing,
    test_cancelled_during_claim_releases_the_key,
    test_cancelled_during_completion_still_completes,
    test_expired_processing_record_is_free,
    test_failure_is_retryable_by_default,
    test_final_failure_is_replayed,
    test_fingerprint_conflict_in_every_state,
    test_good_keys,
    test_lease_expiry_takeover_and_fencing,
    test_one_mebibyte_body_round_trip,
    test_record_keeps_what_design_lists,
    test_renew_extends_a_live_lease,
    test_scope_and_operation_separate_records,
    test_state_machine,
    test_ttl_expiry_and_narrowing,
    test_wait_ends_with_the_first_attempt,
    test_wait_is_bounded,
)
from test_races import test_processes_race, test_tasks_race, test_threads_race  # noqa: F401

# Not test_one_batch_is_bounded (it counts rows per batch; a step here drops a whole
# partition: see test_a_step_drops_one_whole_partition) nor the kill test (see
# test_killed_sweeps_lose_and_duplicate_nothing below).
from test_sweep import (  # noqa: F401
    kill_sweeps_until_one_finishes,
    populate,
    test_archive_is_idempotent,
    test_lazy_expiry_then_sweep,
    test_records_and_stats,
    test_sweep_as_of_a_time_keeps_what_expires_later,
)

from retrysafe import (
    Claim,
    Engine,
    InProgressError,
    LeaseLostError,
    Outcome,
    Replay,
    Status,
    StoreUnavailableError,
    open_store,
)
from retrysafe.stores._packing import tagged_token
from retrysafe.stores.postgres import PostgresStore, SchemaModeError

HOUR = 3600.0
INTERVAL = 1800.0  # conftest's postgres-partitioned store


@pytest.fixture
def store_spec(request: pytest.FixtureRequest, tmp_path: Path) -> StoreSpec:
    """Every store of this module, the shared suites' included, is partitioned."""
    return make_spec("postgres-partitioned", request, tmp_path)


@pytest.fixture
def shared_spec(store_spec: StoreSpec) -> StoreSpec:
    return store_spec


@pytest.fixture
def spec(store_spec: StoreSpec) -> StoreSpec:
    """test_sweep's fixture: the store (PostgreSQL keeps its archive in a table)."""
    return store_spec


@pytest.fixture
def sstore(spec: StoreSpec) -> Iterator[Any]:
    s = spec.open()
    yield s
    s.close()


@pytest.fixture
def pg(store_spec: StoreSpec) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(store_spec.url, autocommit=True) as conn:
        yield conn


def table_of(spec: StoreSpec) -> str:
    return str(spec.options["table"])


def attached(pg: psycopg.Connection[Any], table: str) -> dict[str, tuple[float, float]]:
    """The table's attached partitions from pg_inherits: name → (lower, upper)."""
    rows = pg.execute(
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits AS i "
        "JOIN pg_class AS c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = %s::regclass AND NOT i.inhdetachpending",
        (table,),
    ).fetchall()
    found = {}
    for name, bound in rows:
        lower, upper = (float(v) for v in bound.split("'")[1::2])
        found[name] = (lower, upper)
    return found


def holding(parts: dict[str, tuple[float, float]], at: float) -> str:
    """The partition whose range holds ``at``."""
    (name,) = [n for n, (lo, hi) in parts.items() if lo <= at < hi]
    return name


def raw(key_hash: str) -> bytes:
    """A key hash as the table stores it (schema v3)."""
    return bytes.fromhex(key_hash)


def rows_of(pg: psycopg.Connection[Any], table: str, key_hash: str) -> int:
    """The rows of one key in ``table`` (a partition, or the parent)."""
    return count(pg, f"SELECT count(*) FROM {table} WHERE key_hash = %s", raw(key_hash))


def count(pg: psycopg.Connection[Any], query: str, *params: Any) -> int:
    row = pg.execute(query, params).fetchone()
    assert row is not None
    return int(row[0])


# -- exactly once: racers whose TTLs put one key in different partitions --------------------

KEYS = 6
OP = "race"


def ttl_of(racer: int) -> float:
    """TTLs from 5 minutes to 2.5 hours: one key's racers aim at five partitions."""
    return 300.0 + (racer % 5) * INTERVAL


def race_all_keys(engine: Engine, round_: str, racer: int, who: str, effects: Path) -> list[Any]:
    """One racer claims every key (in its own order) with its own TTL."""
    keys = list(range(KEYS))
    random.Random(who).shuffle(keys)
    results = []
    for k in keys:
        key = f"{round_}-{k}"
        result = engine.begin(key, operation=OP, fingerprint="same", ttl=ttl_of(racer), wait=30)
        if isinstance(result, Replay):
            results.append((key, "replay", result.outcome.value))
            continue
        assert isinstance(result, Claim)
        with effects.open("a") as f:
            f.write(f"{key} {who}\n")
        engine.complete(result, Outcome.json(who))
        results.append((key, "claim", who))
    return results


def _process_racer(
    store_spec: StoreSpec, round_: str, effects: str, barrier: Any, queue: Any
) -> None:
    store = store_spec.open()
    engine = Engine(store)
    threads = 8
    inner = threading.Barrier(threads)

    def racer(i: int) -> list[Any]:
        inner.wait()
        return race_all_keys(engine, round_, i, f"pid-{os.getpid()}-{i}", Path(effects))

    barrier.wait()
    with ThreadPoolExecutor(threads) as pool:
        for results in pool.map(racer, range(threads)):
            queue.put(results)
    store.close()


def test_racers_with_different_ttls_claim_each_key_once(
    store_spec: StoreSpec, pg: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """32 threads here and 4 processes of 8 threads race on the same new keys, each
    racer with a TTL that aims the key at another partition (some beyond the ones
    made ahead, so the race also creates partitions): one claim per key."""
    round_ = uuid.uuid4().hex[:8]
    effects = tmp_path / "effects"
    effects.touch()
    ctx = mp.get_context("spawn")
    processes = 4
    barrier = ctx.Barrier(processes + 1)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_process_racer, args=(store_spec, round_, str(effects), barrier, queue))
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    store = store_spec.open()
    engine = Engine(store)
    threads = 32
    local = threading.Barrier(threads)

    def racer(i: int) -> list[Any]:
        local.wait()
        return race_all_keys(engine, round_, i, f"thread-{i}", effects)

    barrier.wait()
    with ThreadPoolExecutor(threads) as pool:
        results = [r for rs in pool.map(racer, range(threads)) for r in rs]
    results += [r for _ in range(processes * 8) for r in queue.get(timeout=120)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    store.close()

    racers = threads + processes * 8
    assert len(results) == racers * KEYS
    lines = effects.read_text().splitlines()
    for k in range(KEYS):
        key = f"{round_}-{k}"
        mine = [r for r in results if r[0] == key]
        winners = [who for _, role, who in mine if role == "claim"]
        assert len(winners) == 1, f"{key}: {len(winners)} racers executed"
        assert {answer for _, _, answer in mine} == set(winners), f"{key}: another answer"
        assert [line for line in lines if line.startswith(f"{key} ")] == [f"{key} {winners[0]}"]
    table = table_of(store_spec)
    assert count(pg, f"SELECT count(*) FROM {table}") == KEYS
    assert count(pg, f"SELECT count(DISTINCT key_hash) FROM {table}") == KEYS


def test_a_takeover_moves_the_row_and_fences_the_old_owner(
    store_spec: StoreSpec, pg: psycopg.Connection[Any], clock: Clock
) -> None:
    """A lease takeover with a longer TTL moves the row to a later partition; the old
    owner's late completion, which waited on the moving row, answers 'lease lost'."""
    store = store_spec.open()
    table = table_of(store_spec)
    try:
        first = Engine(store, ttl=600, lease=5, clock=clock)
        old = first.begin("k", operation=OP)
        assert isinstance(old, Claim)
        before = holding(attached(pg, table), old.expires_at)
        clock.advance(10)
        new = Engine(store, ttl=3 * HOUR, clock=clock).begin("k", operation=OP)
        assert isinstance(new, Claim) and new.took_over is Status.PROCESSING
        assert new.attempts == 2
        partitions = attached(pg, table)
        after = holding(partitions, new.expires_at)
        assert after != before
        assert rows_of(pg, after, old.key_hash) == 1
        assert rows_of(pg, table, old.key_hash) == 1
        with pytest.raises(LeaseLostError):
            first.complete(old, Outcome(b"stale"))

        # The old owner's completion waits on the row while another takeover moves it
        # back and commits: PostgreSQL fails the waiting UPDATE (serialization error),
        # the store runs it again and it finds the new token: False, not an error.
        answers: list[Any] = []
        with pg.transaction():
            pg.execute(
                f"UPDATE {table} SET expires_at = %s, token = %s WHERE key_hash = %s",
                (old.expires_at + 1, tagged_token("other"), raw(old.key_hash)),
            )
            late = threading.Thread(
                target=lambda: answers.append(
                    store.complete(new.key_hash, new.token, Outcome(b"late"), clock.now)
                )
            )
            late.start()
            # Until the completion waits for the row (0.3 s of sleep could end before it
            # had even been sent on a busy machine: then it never met the moved row).
            waiting_on_a_lock(pg, "%UPDATE%")
            assert late.is_alive()
        late.join(10)
        assert answers == [False]
        got = store.get(new.key_hash)
        assert got is not None and got.token == "other" and got.outcome is None
        assert store.delete(new.key_hash) and store.get(new.key_hash) is None
    finally:
        store.close()


def test_a_claim_beyond_the_partitions_made_ahead_creates_its_own(
    store_spec: StoreSpec, pg: psycopg.Connection[Any], clock: Clock
) -> None:
    store = store_spec.open()
    table = table_of(store_spec)
    try:
        engine = Engine(store, ttl=400 * HOUR, clock=clock)
        far = engine.begin("far", operation=OP)
        assert isinstance(far, Claim)
        name = holding(attached(pg, table), far.expires_at)
        lower = int(far.expires_at // INTERVAL * INTERVAL)
        assert name == f"{table}_p{lower}"
        # A table of that name that a sweep detached and has not dropped yet: the new
        # partition of the same range takes a suffix (and the leftover is not touched).
        pg.execute(f"ALTER TABLE {table} DETACH PARTITION {name}")
        again = engine.begin("far", operation=OP)  # the detached row is gone for claims
        assert isinstance(again, Claim) and again.took_over is None
        assert holding(attached(pg, table), again.expires_at) == f"{name}_1"
        assert count(pg, f"SELECT count(*) FROM {name}") == 1
        assert store.sweep(again.expires_at + 1, 10).deleted == 1  # the leftover first
        assert pg.execute("SELECT to_regclass(%s)", (name,)).fetchone() == (None,)
        # The change that follows every attach and detach (it makes every backend
        # rebuild its partition list) is valid SQL for this table, run on its own.
        pg.execute(store._q_refresh)
    finally:
        store.close()


def test_a_partition_that_stays_missing_ends_in_a_clear_error(
    store_spec: StoreSpec, clock: Clock
) -> None:
    """If the partition a claim needs never shows up (here: making it is a no-op), the
    claim backs off on the server and gives up with an error naming the cause."""
    store = store_spec.open()
    try:
        store.get("0" * 64)  # the schema exists
        store._q_add_partition = "SELECT %s::text"  # "there already is one", but none
        engine = Engine(store, ttl=400 * HOUR, clock=clock)
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError) as info:
            engine.begin("nowhere", operation=OP)
        assert "no partition" in str(info.value) and "100 statements" in str(info.value)
        assert time.monotonic() - started > 1.0  # it waited between tries
    finally:
        store.close()


def stale_session_trigger(pg: psycopg.Connection[Any], table: str) -> None:
    """Make the sessions that set ``retrysafe_test.stale`` behave like a backend whose
    partition descriptor lacks a partition: every insert fails as PostgreSQL's tuple
    routing does ("no partition of relation … found for row", SQLSTATE 23514)."""
    pg.execute(f"""
        CREATE FUNCTION {table}_stale() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF current_setting('retrysafe_test.stale', true) = 'on' THEN
                RAISE EXCEPTION 'no partition of relation "{table}" found for row'
                USING ERRCODE = 'check_violation';
            END IF;
            RETURN NEW;
        END $$""")
    pg.execute(
        f"CREATE TRIGGER stale BEFORE INSERT ON {table} "
        f"FOR EACH ROW EXECUTE FUNCTION {table}_stale()"
    )


def test_a_session_that_cannot_see_an_attached_partition_is_replaced(
    store_spec: StoreSpec, pg: psycopg.Connection[Any]
) -> None:
    """PostgreSQL (15 here) can leave a backend with a partition descriptor that lacks
    a partition attached while the backend was building it: the invalidation is
    consumed mid-build, and until the table changes again the backend's inserts into
    that range fail (64 threads making their first claims hit it about once in 50
    races). A claim that still finds no partition after the add found it attached
    goes on on a new connection instead of retrying on the stale one until it gives up.
    """
    table = table_of(store_spec)
    store = open_store(store_spec.url, **store_spec.options, max_size=1)
    try:
        assert store.get("0" * 64) is None  # the schema and the partitions ahead exist
        stale_session_trigger(pg, table)
        with store._pool.connection() as conn:  # the store's only connection
            conn.execute("SET retrysafe_test.stale = on")
            stale_pid = conn.info.backend_pid
        started = time.monotonic()
        claim = Engine(store, ttl=600).begin("k", operation=OP)  # a partition made ahead
        assert isinstance(claim, Claim)
        assert time.monotonic() - started < 1.0  # no backoff until it gives up
        assert rows_of(pg, table, claim.key_hash) == 1
        deadline = time.monotonic() + 10  # a closed session's backend ends a moment later
        while pg.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (stale_pid,)).fetchall():
            assert time.monotonic() < deadline, "the stale session was not closed"
            time.sleep(0.02)
    finally:
        store.close()


async def test_a_session_that_cannot_see_an_attached_partition_is_replaced_async(
    store_spec: StoreSpec, pg: psycopg.Connection[Any]
) -> None:
    table = table_of(store_spec)
    store = open_store(store_spec.url, **store_spec.options, max_size=1)
    try:
        assert await store.aget("0" * 64) is None
        stale_session_trigger(pg, table)
        entry = await store._loop_pool()
        async with entry.pool.connection() as conn:
            await conn.execute("SET retrysafe_test.stale = on")
        claim = await Engine(store, ttl=600).abegin("k", operation=OP)
        assert isinstance(claim, Claim)
        assert rows_of(pg, table, claim.key_hash) == 1
    finally:
        await store.aclose()


# -- sweeps drop whole partitions ----------------------------------------------------------


def drain(store: Any, now: float) -> tuple[int, int, int]:
    """Sweep steps until done: (deleted, archived, steps)."""
    deleted = archived = steps = 0
    while True:
        batch = store.sweep(now, 1000)
        deleted, archived, steps = deleted + batch.deleted, archived + batch.archived, steps + 1
        if batch.done:
            return deleted, archived, steps


def test_sweep_drops_whole_partitions_and_archives_once(
    sstore: Any, spec: StoreSpec, pg: psycopg.Connection[Any], clock: Clock
) -> None:
    table = table_of(spec)
    made = populate(sstore, clock, expired=40, financial=25, live=10)
    clock.advance(INTERVAL)
    more = populate(sstore, clock, expired=20, financial=15, live=0, tag="m")
    drain(sstore, clock.now)  # the empty partitions made at creation (real time) go
    before = attached(pg, table)
    full = {holding(before, clock.now - INTERVAL + HOUR), holding(before, clock.now + HOUR)}
    assert [count(pg, f"SELECT count(*) FROM {n}") for n in sorted(full)] == [65, 35]

    now = clock.now + 3 * HOUR
    deleted, archived, steps = drain(sstore, now)
    assert (deleted, archived) == (100, 40)
    after = attached(pg, table)
    assert full <= set(before) and not full & set(after)
    assert all(hi > now for _, hi in after.values())  # every expired partition went
    assert steps >= 2  # one step per partition
    for kh in made["standard"] + made["financial"] + more["standard"] + more["financial"]:
        assert sstore.get(kh) is None
    assert all(sstore.get(kh) is not None for kh in made["live"])
    archived_keys = [a.record.key_hash for a in sstore.archived_records(limit=1000)]
    assert sorted(archived_keys) == sorted(made["financial"] + more["financial"])
    assert drain(sstore, now)[:2] == (0, 0)
    assert sstore.stats(now).archived == 40
    # No row was deleted one by one: the partitions went whole.
    assert count(pg, f"SELECT count(*) FROM {table}") == 10


def test_a_step_drops_one_whole_partition(
    sstore: Any, spec: StoreSpec, pg: psycopg.Connection[Any], clock: Clock
) -> None:
    """``limit`` bounds row deletes; a partition is one step however many rows it has."""
    drain(sstore, clock.now)
    for i in range(3):
        populate(sstore, clock, expired=7 + i, financial=0, live=0, tag=f"p{i}")
        clock.advance(INTERVAL)
    now = clock.now + 2 * HOUR
    expired = [name for name, (_, hi) in attached(pg, table_of(spec)).items() if hi <= now]
    steps = []
    while not steps or not steps[-1].done:
        steps.append(sstore.sweep(now, 2))
    assert len(steps) == len(expired)  # one partition per step, empty ones too
    assert [b.deleted for b in steps if b.deleted] == [7, 8, 9]
    assert [b.done for b in steps] == [False] * (len(steps) - 1) + [True]


def test_partitions_are_made_ahead_at_every_sweep(
    sstore: Any, spec: StoreSpec, pg: psycopg.Connection[Any], clock: Clock
) -> None:
    drain(sstore, clock.now)
    now = clock.now
    for hours in (0, 5, 30):
        now += hours * HOUR
        drain(sstore, now)
        lowers = sorted(lo for lo, _ in attached(pg, table_of(spec)).values())
        first = now // INTERVAL * INTERVAL
        ahead = now + HOUR + 2 * INTERVAL  # partition_ahead + 2 intervals
        assert lowers == [first + i * INTERVAL for i in range(len(lowers))]
        assert lowers[-1] < ahead <= lowers[-1] + INTERVAL


# -- interrupted sweeps ----------------------------------------------------------------


def test_a_sweep_interrupted_after_its_detach_loses_nothing(
    sstore: Any, spec: StoreSpec, pg: psycopg.Connection[Any], clock: Clock
) -> None:
    """Detached by hand (as a sweep killed right after its detach), with some of its
    financial rows already archived (killed in the middle of the archive copy):
    the next sweep archives the rest once, counts its rows and drops it."""
    table = table_of(spec)
    made = populate(sstore, clock, expired=10, financial=12, live=3)
    drain(sstore, clock.now)
    name = holding(attached(pg, table), clock.now + HOUR)
    pg.execute(f"ALTER TABLE {table} DETACH PARTITION {name}")
    assert sstore.get(made["financial"][0]) is None  # detached: gone for the store
    half = made["financial"][:5]
    pg.execute(
        f"INSERT INTO {table}_archive SELECT *, %s FROM {name} WHERE key_hash = ANY(%s)",
        (clock.now, [raw(kh) for kh in half]),
    )
    now = clock.now + 2 * HOUR
    batch = sstore.sweep(now, 1000)
    assert (batch.deleted, batch.archived, batch.done) == (22, 7, False)
    assert pg.execute("SELECT to_regclass(%s)", (name,)).fetchone() == (None,)
    assert drain(sstore, now)[:2] == (0, 0)
    keys = [a.record.key_hash for a in sstore.archived_records(limit=100)]
    assert sorted(keys) == sorted(made["financial"])
    assert all(sstore.get(kh) is not None for kh in made["live"])


def test_a_pending_detach_is_finalized(
    sstore: Any, spec: StoreSpec, pg: psycopg.Connection[Any], clock: Clock
) -> None:
    """A concurrent detach cancelled while it waited (a sweep killed in its second
    phase) leaves the partition 'detach pending'; the next sweep finishes it."""
    table = table_of(spec)
    made = populate(sstore, clock, expired=4, financial=6, live=2)
    drain(sstore, clock.now)
    name = holding(attached(pg, table), clock.now + HOUR)
    with (
        psycopg.connect(spec.url, autocommit=True) as blocker,
        psycopg.connect(spec.url, autocommit=True) as detacher,
    ):
        pid = detacher.info.backend_pid
        with blocker.transaction():
            blocker.execute(f"SELECT count(*) FROM {table}")  # an older lock on the parent
            errors: list[Exception] = []

            def detach() -> None:
                try:
                    detacher.execute(f"ALTER TABLE {table} DETACH PARTITION {name} CONCURRENTLY")
                except psycopg.Error as exc:
                    errors.append(exc)

            thread = threading.Thread(target=detach)
            thread.start()
            _detach_waiting(pg)
            pg.execute("SELECT pg_cancel_backend(%s)", (pid,))
            thread.join(10)
        assert errors and isinstance(errors[0], psycopg.errors.QueryCanceled)
    pending = pg.execute(
        "SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = %s::regclass", (name,)
    ).fetchall()
    assert pending == [(True,)]
    assert sstore.get(made["standard"][0]) is None  # pending: no longer seen

    now = clock.now + 2 * HOUR
    assert drain(sstore, now)[:2] == (10, 6)
    assert pg.execute("SELECT to_regclass(%s)", (name,)).fetchone() == (None,)
    keys = [a.record.key_hash for a in sstore.archived_records(limit=100)]
    assert sorted(keys) == sorted(made["financial"])


# A child process a kill (12 to 15, each 1.3 to 2 s to start beside two CPU hogs, 28 s in
# all there, several times that at load 20): past the default 120 s in a busy full run.
@pytest.mark.timeout(300)
def test_killed_sweeps_lose_and_duplicate_nothing(
    spec: StoreSpec, sstore: Any, pg: psycopg.Connection[Any], clock: Clock
) -> None:
    """A child sweeps three expired partitions of 1500 records (half of them financial)
    and is killed at random moments (in a detach, between detach and drop, in the
    archive copy) until one run finishes: nothing lost, nothing archived twice."""
    table = table_of(spec)
    made: dict[str, list[str]] = {"live": []}
    for i in range(3):
        made["live"] += populate(sstore, clock, expired=1, financial=1, live=2, tag=f"k{i}")["live"]
        # Many more records in the same partition, written directly.
        pg.execute(
            f"INSERT INTO {table} (key_hash, key, scope, operation, fingerprint, status, token, "
            "lease_until, expires_at, created_at, updated_at, attempts, final, metadata, "
            "retention) SELECT sha256(convert_to(%s || j, 'UTF8')), 'k', '', 'op', 'fp', 1, "
            "convert_to('t' || j, 'UTF8'), 0, %s + j / 1000.0, 0, 0, 1, false, NULL, "
            "CASE WHEN j %% 2 = 0 THEN 'financial' END "
            "FROM generate_series(1, 1500) AS j",
            (f"bulk{i}-", clock.now + HOUR),
        )
        clock.advance(INTERVAL)
    drain(sstore, clock.now - 3 * INTERVAL)
    now = clock.now + 2 * HOUR
    expired = f"SELECT key_hash FROM {table} WHERE expires_at <= %s AND retention = %s"
    financial = sorted(r[0] for r in pg.execute(expired, (now, "financial")))
    assert len(financial) == 3 * 751
    # Three partitions detached, archived and dropped in 5 batches; a run is let
    # start one batch and killed in it (or just after), so kills land in each.
    kills = kill_sweeps_until_one_finishes(spec, now, free=(0, 0))
    assert kills >= 3, kills
    print(f"{kills} kills")

    assert count(pg, f"SELECT count(*) FROM {table} WHERE expires_at <= %s", now) == 0
    assert all(sstore.get(kh) is not None for kh in made["live"])
    assert count(pg, f"SELECT count(*) FROM {table}") == len(made["live"])
    archived = [r[0] for r in pg.execute(f"SELECT key_hash FROM {table}_archive")]
    assert len(archived) == len(set(archived)), "a record was archived twice"
    assert sorted(archived) == financial, "a financial record was lost"
    leftovers = count(
        pg, "SELECT count(*) FROM pg_class WHERE relname ~ %s AND relkind = 'r'", f"^{table}_p[0-9]"
    )
    assert leftovers == len(attached(pg, table))  # no detached table left behind


# -- claims go on while a sweep works -----------------------------------------------------


def waiting_on_a_lock(pg: psycopg.Connection[Any], statement: str, timeout: float = 30) -> None:
    """Wait until another session's ``statement`` (an SQL pattern) waits on a lock; ``pg``
    may be in a transaction (its view of pg_stat_activity is refreshed every time)."""
    deadline = time.monotonic() + timeout
    while not pg.execute(
        "SELECT 1 FROM pg_stat_activity, pg_stat_clear_snapshot() WHERE wait_event_type ="
        " 'Lock' AND query ILIKE %s AND pid <> pg_backend_pid()",
        (statement,),
    ).fetchall():
        assert time.monotonic() < deadline, f"no {statement} waited on a lock"
        time.sleep(0.02)


def _detach_waiting(pg: psycopg.Connection[Any]) -> None:
    """Wait until a ``DETACH PARTITION`` is in its phase two, waiting on older transactions."""
    waiting_on_a_lock(pg, "%DETACH PARTITION%")


def claims_go_on(store: Any, clock: Clock, tag: str, within: float = 10) -> None:
    """A few claims, replays and completions on other keys finish within ``within``
    seconds, run while the test holds what a blocked one would wait for."""
    pool = ThreadPoolExecutor(1)
    try:
        pool.submit(_claims, store, clock, tag).result(timeout=within)
    except TimeoutError:
        pytest.fail("claims were blocked")
    finally:
        pool.shutdown(wait=False)


def _claims(store: Any, clock: Clock, tag: str) -> None:
    engine = Engine(store, clock=clock)
    for i in range(5):
        claim = engine.begin(f"{tag}-{i}", operation="op", ttl=(i + 1) * HOUR)
        assert isinstance(claim, Claim)
        engine.complete(claim, Outcome(b"ok"))
        assert isinstance(engine.begin(f"{tag}-{i}", operation="op"), Replay)
        with pytest.raises(InProgressError):
            held = engine.begin(f"{tag}-held-{i}", operation="op")
            engine.begin(f"{tag}-held-{i}", operation="op")
        assert isinstance(held, Claim)


def test_claims_are_not_blocked_while_a_detach_waits(
    sstore: Any, spec: StoreSpec, clock: Clock, pg: psycopg.Connection[Any]
) -> None:
    """An old transaction on the table makes the sweep's concurrent detach wait (phase
    two waits for every transaction that saw the partition): claims go on meanwhile,
    which they could not if the detach held or queued for an exclusive lock."""
    populate(sstore, clock, expired=30, financial=10, live=0)
    drain(sstore, clock.now)
    clock.advance(2 * HOUR)
    table = table_of(spec)
    batches: list[Any] = []
    with psycopg.connect(spec.url, autocommit=True) as blocker:
        with blocker.transaction():
            blocker.execute(f"SELECT count(*) FROM {table}")
            sweeper = threading.Thread(target=lambda: batches.append(drain(sstore, clock.now)))
            sweeper.start()
            _detach_waiting(pg)  # (and it waits until the blocker's transaction ends)
            claims_go_on(sstore, clock, "during")
        sweeper.join(30)
    assert batches and batches[0][:2] == (40, 10)


def test_claims_are_not_blocked_by_a_slow_archive(
    sstore: Any, spec: StoreSpec, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The archive copy and the drop lock only the detached table (and archive rows)."""
    populate(sstore, clock, expired=30, financial=30, live=0)
    drain(sstore, clock.now)
    clock.advance(2 * HOUR)
    reached, claimed = threading.Event(), threading.Event()
    original = sstore._archive_and_drop

    def slow(conn: Any, part: Any, now: float) -> tuple[int, int]:
        with conn.transaction():  # the copy and the drop inside, their locks held
            result = original(conn, part, now)
            if result[0] and not reached.is_set():  # the partition with the records
                reached.set()
                claimed.wait(60)  # until the test's claims are done
        return result

    monkeypatch.setattr(sstore, "_archive_and_drop", slow)
    batches: list[Any] = []
    sweeper = threading.Thread(target=lambda: batches.append(drain(sstore, clock.now)))
    sweeper.start()
    try:
        assert reached.wait(10)
        claims_go_on(sstore, clock, "during")  # while the archive step holds its locks
    finally:
        claimed.set()
    sweeper.join(30)
    assert batches and batches[0][:2] == (60, 30)


# -- the mode is fixed at creation ---------------------------------------------------------


def test_the_other_mode_is_refused(postgres_server: Any, clock: Clock) -> None:
    url = postgres_server.url
    plain, parted = f"m_{uuid.uuid4().hex[:10]}", f"m_{uuid.uuid4().hex[:10]}"
    opened = [
        PostgresStore(url, table=plain),
        PostgresStore(
            url, table=parted, partitioned=True, partition_interval="1h", partition_ahead="2h"
        ),
    ]
    for store in opened:
        claim = Engine(store, clock=clock).begin("k", operation="op")
        assert isinstance(claim, Claim)
        store.close()

    wrong = PostgresStore(url, table=plain, partitioned=True)
    with pytest.raises(SchemaModeError) as err:
        wrong.get("x")
    assert isinstance(err.value, StoreUnavailableError) and isinstance(err.value, ValueError)
    assert "unpartitioned (partitioned=false)" in str(err.value)
    assert "partitioned (partitioned=true)" in str(err.value)
    with pytest.raises(SchemaModeError, match="partitioned"):
        wrong.migrate()
    wrong.close()

    wrong = PostgresStore(url, table=parted)
    with pytest.raises(SchemaModeError) as err:
        Engine(wrong, clock=clock).begin("k", operation="op")
    assert "table is partitioned (partitioned=true)" in str(err.value)
    assert "opened unpartitioned (partitioned=false)" in str(err.value)
    wrong.close()

    # The interval is the table's: another one given explicitly is refused, none is adopted.
    other = PostgresStore(url, table=parted, partitioned=True, partition_interval="2h")
    with pytest.raises(SchemaModeError, match="partition_interval=3600s, not 7200s"):
        other.get("x")
    other.close()
    same = open_store(f"{url}?table={parted}&partitioned=true")
    assert isinstance(same, PostgresStore) and same.partition_interval == 86400.0
    assert same.get("x") is None and same.partition_interval == 3600.0
    same.close()


def test_url_options(postgres_server: Any) -> None:
    url = postgres_server.url
    store = open_store(f"{url}?partitioned=true&partition_interval=1d&partition_ahead=36h")
    assert isinstance(store, PostgresStore)
    assert (store.partitioned, store.partition_interval, store.partition_ahead) == (
        True,
        86400.0,
        36 * HOUR,
    )
    store.close()
    plain = open_store(url)
    assert isinstance(plain, PostgresStore) and not plain.partitioned
    plain.close()
    for bad in (
        "partitioned=maybe",
        "partitioned=true&partition_interval=59s",
        "partitioned=true&partition_interval=90.5",
        "partition_interval=1h",
        "partitioned=true&partition_ahead=-1h",
    ):
        with pytest.raises(ValueError):
            open_store(f"{url}?{bad}")
    with pytest.raises(ValueError, match="both"):
        PostgresStore(f"{url}?partition_interval=1h", partitioned=True, partition_interval="2h")
