"""retrysafe.guards on every store, sync and async, with threads and processes racing."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from _racing import race_processes
from conftest import Clock, StoreSpec, make_spec

from retrysafe import IdempotencyError, Store, StoreUnavailableError, open_store
from retrysafe._core.cells import Cell, Cells
from retrysafe.guards import (
    DEFAULT_EVENTS,
    DEFAULT_TRANSITIONS,
    History,
    HistoryFullError,
    InvalidTransitionError,
    OutOfOrderError,
    PaymentNotFoundError,
    PaymentStateMachine,
    SequenceGapError,
    SequenceGuard,
    SessionRegistry,
    VersionConflictError,
    VersionedRecords,
)

THREADS = 64

Call = Callable[..., Any]


@pytest.fixture(params=["sync", "async"])
def call(request: pytest.FixtureRequest, store: Store[Any]) -> Iterator[Call]:
    """``call(guard, "advance", ...)``: the sync method, or its ``a`` twin on a loop."""
    if request.param == "sync":
        yield lambda guard, name, *args, **kwargs: getattr(guard, name)(*args, **kwargs)
        return
    loop = asyncio.new_event_loop()

    def run(guard: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        return loop.run_until_complete(getattr(guard, "a" + name)(*args, **kwargs))

    yield run
    loop.run_until_complete(store.aclose())
    loop.close()


def race(n: int, racer: Callable[[int], Any]) -> list[Any]:
    """``racer(i)`` from ``n`` threads released together; answers or the exceptions raised."""
    barrier = threading.Barrier(n)

    def run(i: int) -> Any:
        barrier.wait()
        try:
            return racer(i)
        except IdempotencyError as exc:
            return exc

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


# -- the cell primitive ----------------------------------------------------------------------


def test_cells(store: Store[Any], call: Call, clock: Clock) -> None:
    cells = Cells(store, "test", "ns", clock)
    key = cells.key("a:b", "c")
    assert key != cells.key("a", "b:c") and key != Cells(store, "test", "other").key("a:b", "c")
    assert call(cells, "read", key) is None
    assert call(cells, "write", key, None, {"n": 1}, None)
    assert not call(cells, "write", key, None, {"n": 2}, None)  # exists
    assert not call(cells, "write", key, 2, {"n": 2}, None)  # not that version
    assert call(cells, "write", key, 1, [1, "x", None], 10)
    assert call(cells, "read", key) == Cell(2, [1, "x", None], clock() + 10)
    clock.advance(10)  # expired: reads as absent, an int expects in vain, None writes anew
    assert call(cells, "read", key) is None
    assert not call(cells, "write", key, 2, "late", None)
    assert call(cells, "write", key, None, "new", None)
    assert call(cells, "read", key) == Cell(1, "new", None)
    for bad in (0, True, "1"):
        with pytest.raises(ValueError):
            call(cells, "write", key, bad, "x", None)
    with pytest.raises(ValueError):
        call(cells, "write", key, 1, float("inf"), None)
    with pytest.raises(ValueError):
        call(cells, "write", key, 1, "x", -1)
    assert call(cells, "read", key) == Cell(1, "new", None)


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:1/0", "postgresql://nobody@127.0.0.1:1/x?connect_timeout=1"]
)
def test_unreachable_store(url: str) -> None:
    store = open_store(url)
    with pytest.raises(StoreUnavailableError):
        SequenceGuard(store).accept("s", "op", 1)
    store.close()


def test_redis_script_flushed(request: pytest.FixtureRequest, tmp_path: Any) -> None:
    store = make_spec("redis", request, tmp_path).open()
    guard = SequenceGuard(store)
    guard.accept("s", "op", 1)
    store._sync_client().script_flush()  # type: ignore[attr-defined]
    guard.accept("s", "op", 2)  # NOSCRIPT: loaded again
    assert guard.last("s", "op") == 2
    store.close()


# -- payments ------------------------------------------------------------------------------


def path_to(state: str, initial: str = "pending") -> list[str]:
    """The states after ``initial`` that lead to ``state`` in the default table."""
    seen, queue = {initial: [initial]}, deque([initial])
    while queue:
        s = queue.popleft()
        for nxt in sorted(DEFAULT_TRANSITIONS[s]):
            if nxt not in seen:
                seen[nxt] = [*seen[s], nxt]
                queue.append(nxt)
    return seen[state][1:]


PAIRS = [(a, b) for a in DEFAULT_TRANSITIONS for b in DEFAULT_TRANSITIONS]


def test_every_pair_of_the_default_table(store: Store[Any], call: Call, clock: Clock) -> None:
    machine = PaymentStateMachine(store, clock=clock)
    for current, target in PAIRS:
        pid = f"pay_{current}_{target}"
        assert call(machine, "start", pid).changed
        for step in path_to(current):
            assert call(machine, "advance", pid, step).changed
        assert call(machine, "state", pid) == current
        if target == current:
            t = call(machine, "advance", pid, target)
            assert (t.previous, t.state, t.changed) == (current, current, False)
        elif target in DEFAULT_TRANSITIONS[current]:
            t = call(machine, "advance", pid, target)
            assert (t.payment_id, t.previous, t.state, t.changed) == (pid, current, target, True)
            assert call(machine, "state", pid) == target
        else:
            with pytest.raises(InvalidTransitionError) as err:
                call(machine, "advance", pid, target)
            e = err.value
            assert (e.payment_id, e.current, e.requested) == (pid, current, target)
            assert e.code == "payment_transition_invalid" and isinstance(e, IdempotencyError)
            assert call(machine, "state", pid) == current  # nothing written


def test_events_repeats_unknown_and_absent(store: Store[Any], call: Call, clock: Clock) -> None:
    machine = PaymentStateMachine(store, clock=clock)
    for event, state in DEFAULT_EVENTS.items():
        pid = f"pay_{event}"
        call(machine, "start", pid)
        for step in path_to(state)[:-1]:
            call(machine, "advance", pid, step)
        assert call(machine, "advance", pid, event).changed
        again = call(machine, "advance", pid, event)  # a redelivered webhook
        assert (again.previous, again.state, again.changed) == (state, state, False)
    with pytest.raises(ValueError, match="unknown"):
        call(machine, "advance", "pay_payment.failed", "payment.exploded")
    with pytest.raises(ValueError):
        call(machine, "advance", "pay_payment.failed", 3)
    # start never moves a payment back
    assert call(machine, "start", "pay_payment.failed") == type(again)(
        "pay_payment.failed", "failed", "failed", False
    )
    with pytest.raises(PaymentNotFoundError) as missing:
        call(machine, "advance", "nobody", "payment.succeeded")
    assert missing.value.code == "payment_not_found" and call(machine, "state", "nobody") is None
    made = call(machine, "advance", "nobody", "payment.succeeded", create=True)
    assert (made.previous, made.state, made.changed) == (None, "succeeded", True)
    with pytest.raises(InvalidTransitionError):
        call(machine, "advance", "other", "refunded", create=True)
    assert call(machine, "state", "other") is None


def test_custom_table_and_namespaces(store: Store[Any], call: Call, clock: Clock) -> None:
    with pytest.raises(ValueError):
        PaymentStateMachine(store, transitions={"pending": {"gone"}})
    with pytest.raises(ValueError):
        PaymentStateMachine(store, events={"x": "nowhere"})
    table = {**DEFAULT_TRANSITIONS, "refunded": {"disputed"}, "disputed": set()}
    a = PaymentStateMachine(store, transitions=table, events={"dispute": "disputed"}, clock=clock)
    b = PaymentStateMachine(store, namespace="other", clock=clock)
    call(a, "start", "p")
    for step in ("succeeded", "refunded", "dispute"):
        call(a, "advance", "p", step)
    assert call(a, "state", "p") == "disputed" and call(b, "state", "p") is None
    # Cells are not idempotency records: the engine and the stats see none of them.
    assert store.stats(clock()).counts == {}
    store.sweep(clock() + 10**9)  # the sweeper leaves cells alone
    assert call(a, "state", "p") == "disputed"


def test_payment_ttl(store: Store[Any], call: Call, clock: Clock) -> None:
    machine = PaymentStateMachine(store, ttl=60, clock=clock)
    call(machine, "start", "p")
    clock.advance(61)
    assert call(machine, "state", "p") is None


# -- sequences -------------------------------------------------------------------------------


def test_sequences(store: Store[Any], call: Call, clock: Clock) -> None:
    guard = SequenceGuard(store, clock=clock)
    assert call(guard, "last", "s1", "cart") is None
    call(guard, "accept", "s1", "cart", 1)
    call(guard, "accept", "s1", "cart", 5)  # a gap is fine unless strict
    for stale in (5, 4, 0):
        with pytest.raises(OutOfOrderError) as err:
            call(guard, "accept", "s1", "cart", stale)
        assert (err.value.last, err.value.sequence) == (5, stale)
        assert err.value.code == "sequence_out_of_order"
    assert call(guard, "last", "s1", "cart") == 5
    assert call(guard, "last", "s1", "prefs") is None  # per operation
    assert call(guard, "last", "s2", "cart") is None  # per session
    for bad, exc in ((True, TypeError), (-1, ValueError), ("6", TypeError), (6.0, TypeError)):
        with pytest.raises(exc):
            call(guard, "accept", "s1", "cart", bad)
    with pytest.raises(TypeError):
        call(guard, "accept", 7, "cart", 6)
    assert call(guard, "last", "s1", "cart") == 5  # nothing written
    clock.advance(86401)  # the default ttl: forgotten
    assert call(guard, "last", "s1", "cart") is None
    call(guard, "accept", "s1", "cart", 2)


def test_strict_sequences(store: Store[Any], call: Call, clock: Clock) -> None:
    guard = SequenceGuard(store, strict=True, clock=clock)
    call(guard, "accept", "s", "op", 3)  # any first number
    call(guard, "accept", "s", "op", 4)
    with pytest.raises(SequenceGapError) as err:
        call(guard, "accept", "s", "op", 6)
    e = err.value
    assert (e.expected, e.last, e.sequence, e.code) == (5, 4, 6, "sequence_gap")
    with pytest.raises(OutOfOrderError):
        call(guard, "accept", "s", "op", 4)
    assert call(guard, "last", "s", "op") == 4
    call(guard, "accept", "s", "op", 5)


# -- sessions ----------------------------------------------------------------------------------


def test_sessions(store: Store[Any], call: Call, clock: Clock) -> None:
    reg = SessionRegistry(store, ttl=3600, clock=clock)
    assert call(reg, "get", "u1", "phone") is None
    first = call(reg, "open", "u1", "phone")
    assert first.created and first.expires_at == clock() + 3600
    again = call(reg, "open", "u1", "phone")
    assert (again.token, again.created, again.expires_at) == (first.token, False, first.expires_at)
    other = call(reg, "open", "u1", "laptop")
    assert other.created and other.token != first.token
    assert call(reg, "get", "u1", "phone").token == first.token
    assert not call(reg, "close", "u1", "phone", "wrong")
    assert not call(reg, "close", "u1", "phone", "é")  # non-ASCII compares too
    assert call(reg, "get", "u1", "phone").token == first.token
    assert call(reg, "close", "u1", "phone", first.token)
    assert call(reg, "get", "u1", "phone") is None
    assert not call(reg, "close", "u1", "phone", first.token)
    fresh = call(reg, "open", "u1", "phone")
    assert fresh.created and fresh.token != first.token
    clock.advance(3600)  # expired: replaced
    assert call(reg, "get", "u1", "phone") is None
    renewed = call(reg, "open", "u1", "phone")
    assert renewed.created and renewed.token != fresh.token
    assert renewed.token not in repr(renewed)  # a bearer secret stays out of logs


def test_long_identifiers_work_alike_on_every_store(
    store: Store[Any], call: Call, clock: Clock
) -> None:
    """Identifiers longer than a database index allows are hashed into the cell's key."""
    records = VersionedRecords(store, clock=clock)
    long_a, long_b = "a" * 3000, "a" * 2999 + "b"
    assert call(records, "put", "profile", long_a, {"n": 1}, expected_version=0).version == 1
    assert call(records, "put", "profile", long_b, {"n": 2}, expected_version=0).version == 1
    assert call(records, "get", "profile", long_a).value == {"n": 1}
    assert call(records, "get", "profile", long_b).value == {"n": 2}


# -- versioned sync and history ----------------------------------------------------------------


def test_cas(store: Store[Any], call: Call, clock: Clock) -> None:
    recs = VersionedRecords(store, clock=clock)
    made = call(recs, "put", "user", "u1", {"name": "a"})
    assert (made.version, made.value, made.applied) == (1, {"name": "a"}, True)
    with pytest.raises(VersionConflictError) as err:
        call(recs, "put", "user", "u1", {"name": "b"}, expected_version=0)
    assert (err.value.current, err.value.expected, err.value.code) == (1, 0, "version_conflict")
    assert call(recs, "put", "user", "u1", {"name": "b"}, expected_version=1).version == 2
    with pytest.raises(VersionConflictError):
        call(recs, "put", "user", "u1", {"name": "c"}, expected_version=1)
    got = call(recs, "get", "user", "u1")
    assert (got.version, got.value, got.updated_at) == (2, {"name": "b"}, clock())
    with pytest.raises(VersionConflictError):
        call(recs, "put", "user", "u2", {}, expected_version=3)
    assert call(recs, "get", "user", "u2") is None
    with pytest.raises(ValueError):
        call(recs, "put", "user", "u1", float("nan"), expected_version=2)
    with pytest.raises(TypeError):
        call(recs, "put", "user", "u1", object(), expected_version=2)
    assert call(recs, "get", "user", "u1").version == 2


def test_lww(store: Store[Any], call: Call, clock: Clock) -> None:
    recs = VersionedRecords(store, conflict="lww", clock=clock)
    with pytest.raises(TypeError):
        call(recs, "put", "user", "u1", {"v": 1})
    with pytest.raises(ValueError):
        call(recs, "put", "user", "u1", {"v": 1}, timestamp=1.0, expected_version=1)
    assert call(recs, "put", "user", "u1", {"v": 10}, timestamp=10.0).applied
    older = call(recs, "put", "user", "u1", {"v": 5}, timestamp=5.0)
    assert (older.applied, older.value, older.timestamp) == (False, {"v": 10}, 10.0)
    # equal timestamps: the greater canonical JSON wins, in either order
    assert call(recs, "put", "user", "u1", {"v": 11}, timestamp=10.0).applied
    assert not call(recs, "put", "user", "u1", {"v": 10}, timestamp=10.0).applied
    assert not call(recs, "put", "user", "u1", {"v": 11}, timestamp=10.0).applied  # a replay
    newer = call(recs, "put", "user", "u1", {"v": 1}, timestamp=12)
    assert (newer.applied, newer.version) == (True, 3)
    assert call(recs, "get", "user", "u1").value == {"v": 1}


def test_history(store: Store[Any], call: Call, clock: Clock) -> None:
    hist = History(store, max_entries=3, clock=clock)
    assert call(hist, "entries", "u1") == []
    for i, entry in enumerate([{"consent": "email", "given": True}, "x", [1, 2]]):
        assert call(hist, "append", "u1", entry) == i
        clock.advance(1)
    entries = call(hist, "entries", "u1")
    assert [(e.position, e.entry) for e in entries] == [
        (0, {"consent": "email", "given": True}),
        (1, "x"),
        (2, [1, 2]),
    ]
    assert [e.recorded_at for e in entries] == [clock() - 3, clock() - 2, clock() - 1]
    with pytest.raises(HistoryFullError):
        call(hist, "append", "u1", "y")
    assert len(call(hist, "entries", "u1")) == 3
    assert not hasattr(hist, "delete") and not hasattr(hist, "update")


# -- threads racing ------------------------------------------------------------------------------


def test_threads_race_one_transition_pair(store: Store[Any]) -> None:
    machine = PaymentStateMachine(store)
    machine.start("p")
    events = ["payment.succeeded", "payment.failed"]
    answers = race(THREADS, lambda i: machine.advance("p", events[i % 2]))
    won = [a for a in answers if not isinstance(a, Exception) and a.changed]
    assert len(won) == 1
    final = machine.state("p")
    assert won[0].state == final and final in ("succeeded", "failed")
    for a in answers:
        if isinstance(a, Exception):
            assert isinstance(a, InvalidTransitionError) and a.current == final
        elif a is not won[0]:
            assert (a.previous, a.state, a.changed) == (final, final, False)


def test_threads_race_one_sequence_number(store: Store[Any]) -> None:
    guard = SequenceGuard(store)
    guard.accept("s", "cart", 1)
    answers = race(THREADS, lambda i: guard.accept("s", "cart", 2))
    assert answers.count(None) == 1
    assert all(isinstance(a, OutOfOrderError) and a.last == 2 for a in answers if a is not None)
    assert guard.last("s", "cart") == 2


def test_threads_race_session_opens(store: Store[Any]) -> None:
    reg = SessionRegistry(store)
    answers = race(THREADS, lambda i: reg.open("u", "d"))
    assert len({a.token for a in answers}) == 1
    assert sum(a.created for a in answers) == 1
    assert reg.get("u", "d").token == answers[0].token


def test_threads_race_cas_on_one_version(store: Store[Any]) -> None:
    recs = VersionedRecords(store)
    recs.put("e", "1", {"who": None})
    answers = race(THREADS, lambda i: recs.put("e", "1", {"who": i}, expected_version=1))
    won = [a for a in answers if not isinstance(a, Exception)]
    assert len(won) == 1
    assert all(
        isinstance(a, VersionConflictError) and a.current == 2 for a in answers if a not in won
    )
    got = recs.get("e", "1")
    assert (got.version, got.value) == (2, won[0].value)


def test_threads_race_lww_writes(store: Store[Any]) -> None:
    recs = VersionedRecords(store, conflict="lww")
    stamps = random.sample(range(1000), THREADS)
    race(THREADS, lambda i: recs.put("e", "1", {"ts": stamps[i]}, timestamp=stamps[i]))
    got = recs.get("e", "1")
    assert (got.value, got.timestamp) == ({"ts": max(stamps)}, max(stamps))


def test_threads_race_history_appends(store: Store[Any]) -> None:
    hist = History(store)
    positions = race(THREADS, lambda i: hist.append("s", {"i": i}))
    assert [p for p in positions if isinstance(p, Exception)] == []
    assert sorted(positions) == list(range(THREADS))
    entries = hist.entries("s")
    assert [e.position for e in entries] == list(range(THREADS))
    assert sorted(e.entry["i"] for e in entries) == list(range(THREADS))
    assert all(entries[p].entry == {"i": i} for i, p in enumerate(positions))


async def test_tasks_race_session_opens_and_sequences(store: Store[Any]) -> None:
    reg, guard = SessionRegistry(store), SequenceGuard(store)
    opened = await asyncio.gather(*(reg.aopen("u", "d") for _ in range(THREADS)))
    assert len({s.token for s in opened}) == 1 and sum(s.created for s in opened) == 1
    accepted = await asyncio.gather(
        *(guard.aaccept("s", "op", 1) for _ in range(THREADS)), return_exceptions=True
    )
    assert accepted.count(None) == 1
    assert all(isinstance(a, OutOfOrderError) for a in accepted if a is not None)
    await store.aclose()


# -- processes racing ------------------------------------------------------------------------------


def _process_racer(store: Store[Any], tag: str) -> Callable[[str], Any]:
    machine = PaymentStateMachine(store, namespace=tag)
    guard = SequenceGuard(store, namespace=tag)
    reg = SessionRegistry(store, namespace=tag)

    def racer(who: str) -> Any:
        event = "payment.succeeded" if int(who.rsplit("-", 1)[1]) % 2 else "payment.failed"
        try:
            moved: Any = machine.advance("p", event).changed
        except InvalidTransitionError as exc:
            moved = ("invalid", exc.current)
        try:
            guard.accept("s", "op", 2)
            accepted = True
        except OutOfOrderError:
            accepted = False
        session = reg.open("u", "d")
        return moved, accepted, session.token, session.created

    return racer


def test_processes_race(shared_spec: StoreSpec, shared_store: Store[Any]) -> None:
    tag = "race"
    PaymentStateMachine(shared_store, namespace=tag).start("p")
    SequenceGuard(shared_store, namespace=tag).accept("s", "op", 1)
    answers = race_processes(shared_spec, _process_racer, tag)
    assert len(answers) == 32
    final = PaymentStateMachine(shared_store, namespace=tag).state("p")
    assert [a[0] for a in answers].count(True) == 1
    assert all(a[0] in (True, False, ("invalid", final)) for a in answers)
    assert [a[1] for a in answers].count(True) == 1
    assert len({a[2] for a in answers}) == 1 and [a[3] for a in answers].count(True) == 1
    assert SequenceGuard(shared_store, namespace=tag).last("s", "op") == 2


def test_partitioned_postgres(request: pytest.FixtureRequest, tmp_path: Any) -> None:
    """The cells' table sits beside a partitioned records table, unpartitioned."""
    store = make_spec("postgres-partitioned", request, tmp_path).open()
    try:
        machine = PaymentStateMachine(store)
        machine.start("p")
        assert machine.advance("p", "payment.succeeded").changed
        answers = race(16, lambda i: SequenceGuard(store).accept("s", "op", 1))
        assert answers.count(None) == 1
        short = SessionRegistry(store, ttl=1)
        short.open("u", "d")
        assert store.sweep_cells(time.time() + 2) == 1  # the sweep finds the cells' table
    finally:
        store.close()


def test_the_sweeper_deletes_expired_cells(store: Store[Any], clock: Clock) -> None:
    """Expired cells do not pile up in the SQL stores (memory and Redis expire them themselves)."""
    from retrysafe import Sweeper

    assert store.sweep_cells(clock()) == 0  # no cell yet: nothing to do, no error
    sessions = SessionRegistry(store, ttl=60, clock=clock)
    for n in range(5):
        sessions.open(f"user-{n}", "phone")
    keeper = SessionRegistry(store, ttl=3600, clock=clock, namespace="long")
    kept = keeper.open("user-0", "phone")
    clock.advance(61)
    report = Sweeper(store, batch_size=2, clock=clock).run()
    sql = type(store).__name__ in ("SQLiteStore", "PostgresStore", "MySQLStore")
    assert report.cells == (5 if sql else 0)
    assert store.sweep_cells(clock()) == 0
    assert keeper.get("user-0", "phone").token == kept.token  # a live cell stays
    assert sessions.open("user-1", "phone").created  # an expired one is made anew
