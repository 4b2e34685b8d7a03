"""retrysafe.steps: multi-step operations with recovery points.

The external calls go to a simulated downstream (a payment gateway that
dedupes by idempotency key, in a SQLite file of its own) and are logged one line
per call, so a test can tell calls made from effects that happened.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from _racing import race_processes
from conftest import Clock, StoreSpec

from retrysafe import (
    Engine,
    FingerprintMismatchError,
    InProgressError,
    InvalidKeyError,
    LeaseLostError,
    Status,
    Store,
    key_hash,
)
from retrysafe.steps import Run, StepResultError, Workflow

STEPS = ("create_order", "charge", "receipt")


class Downstream:
    """The payment gateway: one effect per idempotency key; every call is logged."""

    def __init__(self, root: Path) -> None:
        self.db, self.calls = root / "gateway.db", root / "calls"
        with sqlite3.connect(self.db) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS effects (n INTEGER PRIMARY KEY, key UNIQUE)")

    def call(self, key: str) -> dict[str, str]:
        with self.calls.open("a") as f:
            f.write(f"{key}\n")
        with sqlite3.connect(self.db, timeout=30) as conn:
            conn.execute("INSERT OR IGNORE INTO effects (key) VALUES (?)", (key,))
            (n,) = conn.execute("SELECT n FROM effects WHERE key = ?", (key,)).fetchone()
        return {"id": f"tx_{n}", "key": key}

    def call_log(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []

    def effects(self) -> list[str]:
        with sqlite3.connect(self.db) as conn:
            return [k for (k,) in conn.execute("SELECT key FROM effects ORDER BY n")]


def _finish(run: Run, results: list[Any]) -> dict[str, Any]:
    return {"ids": [r["id"] for r in results], "references": dict(run.references)}


class Flow:
    """A 3-step checkout run in sync or async mode (on a loop of this test's own)."""

    def __init__(self, workflow: Workflow, gateway: Downstream, mode: str) -> None:
        self.workflow, self.gateway, self.mode = workflow, gateway, mode
        self.loop = asyncio.new_event_loop() if mode == "async" else None
        self.fail_at: str | None = None  # a step that raises (once it called downstream)

    def _call(self, name: str, key: str) -> dict[str, str]:
        result = self.gateway.call(key)
        if self.fail_at == name:
            raise ConnectionError(f"{name} timed out")
        return result

    def run(self, key: str, **options: Any) -> Any:
        if self.loop is None:

            def body(run: Run) -> Any:
                results = [
                    run.step(n, lambda k, n=n: self._call(n, k), reference="id") for n in STEPS
                ]
                return _finish(run, results)

            return self.workflow.run(key, body, **options)

        async def abody(run: Run) -> Any:
            async def call(key: str, name: str) -> dict[str, str]:
                await asyncio.sleep(0)
                return self._call(name, key)

            results = [await run.astep(n, lambda k, n=n: call(k, n), reference="id") for n in STEPS]
            return _finish(run, results)

        return self.loop.run_until_complete(self.workflow.arun(key, abody, **options))

    def references(self, key: str, **options: Any) -> dict[str, str]:
        if self.loop is None:
            return self.workflow.references(key, **options)
        return self.loop.run_until_complete(self.workflow.areferences(key, **options))

    def close(self) -> None:
        if self.loop is not None:
            self.loop.run_until_complete(self.workflow.engine.store.aclose())
            self.loop.close()


@pytest.fixture
def flow(store: Store[Any], tmp_path: Path, mode: str, clock: Clock) -> Iterator[Flow]:
    engine = Engine(store, clock=clock)
    wf = Workflow(engine, operation="checkout", retention="financial", steps=STEPS)
    f = Flow(wf, Downstream(tmp_path), mode)
    yield f
    f.close()


CLEAN = {
    "ids": ["tx_1", "tx_2", "tx_3"],
    "references": {"create_order": "tx_1", "charge": "tx_2", "receipt": "tx_3"},
}


def test_steps_run_once_and_replay(flow: Flow) -> None:
    assert flow.run("order_42", scope="user_1", fingerprint="fp") == CLEAN
    assert flow.gateway.call_log() == [f"order_42:{n}" for n in STEPS]
    # A replay of the completed operation runs nothing, and answers the same.
    assert flow.run("order_42", scope="user_1", fingerprint="fp") == CLEAN
    assert len(flow.gateway.call_log()) == 3
    assert flow.references("order_42", scope="user_1") == CLEAN["references"]
    # Another scope is another operation (and, downstream, the same derived keys).
    assert flow.references("order_42", scope="user_2") == {}
    # Same key, other input: a conflict, nothing runs.
    with pytest.raises(FingerprintMismatchError):
        flow.run("order_42", scope="user_1", fingerprint="other")
    assert len(flow.gateway.call_log()) == 3
    # Each step is its own record, under its derived key and operation.
    record = flow.workflow.engine.store.get(
        key_hash("user_1", "checkout/charge", "order_42:charge")
    )
    assert record is not None and record.status is Status.COMPLETED
    assert record.outcome is not None and record.outcome.value["reference"] == "tx_2"
    assert record.retention == "financial"


def test_step_failure_resumes_at_that_step(flow: Flow) -> None:
    flow.fail_at = "charge"
    with pytest.raises(ConnectionError):
        flow.run("order_7")
    assert flow.gateway.call_log() == ["order_7:create_order", "order_7:charge"]
    # An unfinished operation: the finished steps' references are there to reconcile.
    assert flow.references("order_7") == {"create_order": "tx_1"}
    flow.fail_at = None
    assert flow.run("order_7") == CLEAN  # the charge's effect happened once (tx_2)
    calls = flow.gateway.call_log()
    assert calls == ["order_7:create_order", "order_7:charge", "order_7:charge", "order_7:receipt"]
    assert flow.gateway.effects() == [f"order_7:{n}" for n in STEPS]
    store = flow.workflow.engine.store
    record = store.get(key_hash("", "checkout", "order_7"))
    assert record is not None and record.attempts == 2 and record.status is Status.COMPLETED


def test_keys_of_steps_never_meet_the_operations(flow: Flow) -> None:
    # Operation key "a:charge" and step "charge" of operation key "a" share a derived
    # key text but not a record (another operation in the key hash).
    flow.run("a:charge")
    flow.run("a")
    assert flow.run("a:charge") == CLEAN
    assert flow.run("a")["ids"] == ["tx_4", "tx_5", "tx_6"]


@pytest.mark.parametrize(
    "name", ["", "has space", "a:b", "a/b", "é", 7, "x" * 260], ids=lambda n: str(n)[:8]
)
def test_invalid_step_names(name: Any, memory: Store[Any]) -> None:
    wf = Workflow(memory, operation="op")
    called: list[str] = []

    def body(run: Run) -> Any:
        return run.step(name, called.append)

    with pytest.raises(InvalidKeyError):
        wf.run("k", body)
    assert called == []
    with pytest.raises(InvalidKeyError):  # declared steps: refused before anything is written
        Workflow(memory, operation="op", steps=[name]).run("k2", body)
    assert memory.get(key_hash("", "op", "k2")) is None


def test_derived_key_too_long_refused_before_the_claim(memory: Store[Any]) -> None:
    wf = Workflow(memory, operation="op", steps=["charge"])
    key = "k" * 250  # valid itself; "k…k:charge" is 257 characters
    with pytest.raises(InvalidKeyError, match="derived key"):
        wf.run(key, lambda run: None)
    assert memory.get(key_hash("", "op", key)) is None


def test_duplicate_step_name(memory: Store[Any]) -> None:
    wf = Workflow(memory, operation="op")
    called: list[str] = []

    def body(run: Run) -> None:
        run.step("a", lambda k: called.append(k))
        run.step("a", lambda k: called.append(k))

    with pytest.raises(InvalidKeyError, match="twice"):
        wf.run("k", body)
    assert called == ["k:a"]
    with pytest.raises(InvalidKeyError):
        Workflow(memory, operation="op", steps=["a", "a"])
    with pytest.raises(ValueError):
        Workflow(memory, operation="a/b")


def test_unstorable_step_result_is_final(memory: Store[Any], mode: str) -> None:
    """A step that returned ran its side effect: never call it again, say which key."""
    wf = Workflow(memory, operation="op")
    called: list[str] = []

    def body(run: Run) -> Any:
        return run.step("charge", lambda k: called.append(k) or object())

    async def abody(run: Run) -> Any:
        return await run.astep("charge", lambda k: called.append(k) or object())

    def go() -> Any:
        return wf.run("k", body) if mode == "sync" else asyncio.run(wf.arun("k", abody))

    with pytest.raises(StepResultError, match="cannot be stored") as first:
        go()
    assert first.value.derived_key == "k:charge" and isinstance(first.value, TypeError)
    with pytest.raises(StepResultError) as again:  # the operation replays its failure
        go()
    assert again.value.step == "charge" and again.value.derived_key == "k:charge"
    assert called == ["k:charge"]
    record = memory.get(key_hash("", "op/charge", "k:charge"))
    assert record is not None and record.status is Status.FAILED and record.final


def test_missing_reference_is_final_and_sync_step_refuses_a_coroutine(
    memory: Store[Any],
) -> None:
    wf = Workflow(memory, operation="op")
    with pytest.raises(StepResultError, match="KeyError"):
        wf.run("k", lambda run: run.step("charge", lambda k: {"no": "id"}, reference="id"))
    with pytest.raises(StepResultError, match="AttributeError"):  # whatever the callable raises
        wf.run("k1", lambda run: run.step("charge", lambda k: {}, reference=lambda r: r.id))
    with pytest.raises(StepResultError):  # final: the step is not called again
        wf.run("k1", lambda run: run.step("charge", lambda k: pytest.fail("called again")))

    async def coro(key: str) -> None:
        raise AssertionError("never runs")

    with pytest.raises(TypeError, match="use astep"):  # it never ran: retryable
        wf.run("k2", lambda run: run.step("charge", coro))
    assert wf.run("k2", lambda run: run.step("charge", lambda k: k)) == "k2:charge"


def test_values_are_the_stored_form_and_unstorable_final_result_is_retryable(
    memory: Store[Any],
) -> None:
    wf = Workflow(memory, operation="op")
    seen: list[Any] = []

    def body(run: Run) -> Any:
        seen.append(run.step("a", lambda k: (1, 2)))  # a tuple: stored (and given) as a list
        return {"bad": object()} if len(seen) == 1 else seen[-1]

    with pytest.raises(TypeError, match="workflow's result"):
        wf.run("k", body)
    assert wf.run("k", body) == [1, 2] and seen == [[1, 2], [1, 2]]


@pytest.mark.parametrize("lease", [5.0, 1.0])
def test_in_progress_while_it_runs(memory: Store[Any], lease: float) -> None:
    """A duplicate while the operation runs is in progress, also for a step that
    outlives its lease (three times over): the heartbeat renews it."""
    wf = Workflow(memory, operation="op", lease=lease)
    inside, release = threading.Event(), threading.Event()

    def body(run: Run) -> Any:
        return run.step("a", lambda k: inside.set() or (release.wait(10) and k))

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(wf.run, "k", body)
        assert inside.wait(10)
        deadline = time.monotonic() + 3 * min(lease, 1.0)
        while time.monotonic() < deadline:
            with pytest.raises(InProgressError):
                wf.run("k", body)
            time.sleep(0.05)  # a client's retry interval
        release.set()
        assert first.result() == "k:a"
    assert wf.run("k", body) == "k:a"


# -- fencing: a takeover never runs a step whose previous owner is provably alive ---------


def test_takeover_waits_out_a_live_step_owner(store: Store[Any], clock: Clock) -> None:
    lease = 0.3  # on the test's clock; a step's claim waits this long in real time
    wf = Workflow(Engine(store, clock=clock), operation="op", lease=lease, renew=False)
    calls: list[str] = []
    in_charge, release = threading.Event(), threading.Event()

    def charge(key: str) -> str:
        calls.append(key)
        if len(calls) == 1:
            in_charge.set()
            release.wait(10)
        return key

    def body(run: Run) -> Any:
        run.step("create_order", lambda k: clock.advance(0.6 * lease))  # time passes
        return [run.step("charge", charge), run.step("receipt", lambda k: calls.append(k) or k)]

    with ThreadPoolExecutor(1) as pool:
        old = pool.submit(wf.run, "k", body)
        assert in_charge.wait(10)
        clock.advance(0.5 * lease)  # the operation's lease ran out; the charge's has not
        with pytest.raises(InProgressError):
            wf.run("k", body)  # took the operation over, but waits out the live charge
        assert calls == ["k:charge"]
        release.set()
        with pytest.raises(LeaseLostError):  # its steps were recorded; its completion refused
            old.result()
    assert wf.run("k", body) == ["k:charge", "k:receipt"]
    assert calls == ["k:charge", "k:receipt"]


def test_late_step_completion_of_a_stalled_owner_is_refused(
    store: Store[Any], clock: Clock, tmp_path: Path
) -> None:
    lease = 1.0
    wf = Workflow(Engine(store, clock=clock), operation="op", lease=lease, renew=False)
    gateway = Downstream(tmp_path)
    in_charge, release = threading.Event(), threading.Event()

    def charge(key: str) -> dict[str, str]:
        result = gateway.call(key)
        if not in_charge.is_set():
            in_charge.set()
            release.wait(10)  # stalled past its lease
        return result

    def body(run: Run) -> Any:
        return run.step("charge", charge, reference="id")

    with ThreadPoolExecutor(1) as pool:
        old = pool.submit(wf.run, "k", body)
        assert in_charge.wait(10)
        clock.advance(2 * lease)  # both leases ran out: the owner looks dead
        assert wf.run("k", body)["id"] == "tx_1"  # same derived key: the gateway dedupes
        release.set()
        with pytest.raises(LeaseLostError):
            old.result()  # its late completion of the step is refused
    assert gateway.call_log() == ["k:charge", "k:charge"] and gateway.effects() == ["k:charge"]
    record = store.get(key_hash("", "op/charge", "k:charge"))
    assert record is not None and record.attempts == 2 and record.status is Status.COMPLETED


def test_a_run_that_lost_its_lease_starts_no_further_step(memory: Store[Any]) -> None:
    wf = Workflow(memory, operation="op", lease=0.3)
    called: list[str] = []

    def lose_the_operation(key: str) -> None:
        called.append(key)
        memory.delete(key_hash("", "op", "k"))  # as if another attempt had taken it over
        deadline = time.monotonic() + 10
        while not run_of[0]._watch.entry.done:  # until the heartbeat finds the lease lost
            assert time.monotonic() < deadline
            time.sleep(0.01)

    run_of: list[Any] = []

    def body(run: Run) -> None:
        run_of.append(run)
        run.step("a", lose_the_operation)
        run.step("b", called.append)

    with pytest.raises(LeaseLostError, match="'b' not started"):
        wf.run("k", body)
    assert called == ["k:a"]
    record = memory.get(key_hash("", "op/a", "k:a"))
    assert record is not None and record.status is Status.COMPLETED  # its own step is recorded


# -- concurrency: threads and processes racing one operation key ---------------------------


def _racer(store: Store[Any], root: str) -> Callable[[str], Any]:
    gateway = Downstream(Path(root))
    wf = Workflow(Engine(store), operation="race", steps=STEPS)

    def body(run: Run) -> Any:
        results = [run.step(n, gateway.call, reference="id") for n in STEPS]
        return _finish(run, results)

    def racer(who: str) -> Any:
        try:
            return wf.run("order_1", body)
        except InProgressError:
            return "in progress"

    return racer


def _check_race(answers: list[Any], gateway: Downstream) -> None:
    got = [a for a in answers if a != "in progress"]
    assert got and all(a == CLEAN for a in got), answers
    assert gateway.call_log() == [f"order_1:{n}" for n in STEPS]


def test_threads(store: Store[Any], tmp_path: Path) -> None:
    racer = _racer(store, str(tmp_path))
    barrier = threading.Barrier(32)

    def go(i: int) -> Any:
        barrier.wait()
        return racer(str(i))

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(go, range(32)))
    answers.append(racer("after"))  # and a replay after the race
    assert answers[-1] == CLEAN
    _check_race(answers, Downstream(tmp_path))


def test_processes(shared_spec: StoreSpec, tmp_path: Path) -> None:
    Downstream(tmp_path)
    answers = race_processes(shared_spec, _racer, str(tmp_path), processes=4, threads=8)
    assert len(answers) == 32
    _check_race(answers, Downstream(tmp_path))


# -- recovery points: a worker process SIGKILLed at each point, a new one finishes ---------

LEASE = 0.5
POINTS = ["before", "after:create_order", "after:charge", "after:receipt", "mid:charge"]


def _kill_at(point: str, here: str) -> None:
    if point == here:
        os.kill(os.getpid(), signal.SIGKILL)


def _checkout(point: str, gateway: Downstream) -> Callable[[Run], Any]:
    def body(run: Run) -> Any:
        _kill_at(point, "before")
        results = []
        for name in STEPS:

            def call(key: str, name: str = name) -> dict[str, str]:
                result = gateway.call(key)
                _kill_at(point, f"mid:{name}")  # after the external call, before it is recorded
                return result

            results.append(run.step(name, call, reference="id"))
            _kill_at(point, f"after:{name}")
        return _finish(run, results)

    return body


def _workflow(store: Store[Any]) -> Workflow:
    return Workflow(Engine(store), operation="checkout", lease=LEASE, wait=10 * LEASE, steps=STEPS)


def _worker(spec: StoreSpec, root: str, point: str) -> None:
    _workflow(spec.open()).run("order_9", _checkout(point, Downstream(Path(root))), scope=point)


def _step_status(store: Store[Any], point: str, name: str) -> Status | None:
    record = store.get(key_hash(point, f"checkout/{name}", f"order_9:{name}"))
    return None if record is None else record.status


def test_recovery_points(shared_spec: StoreSpec, tmp_path: Path) -> None:
    store = shared_spec.open()
    clean = _workflow(store).run("order_9", _checkout("none", Downstream(tmp_path)), scope="clean")
    assert clean == CLEAN
    # One worker per kill point, all at once; each point is a scope (and a gateway) of its own.
    roots = {point: tmp_path / point.replace(":", "_") for point in POINTS}
    ctx = mp.get_context("spawn")
    workers = []
    for point, root in roots.items():
        root.mkdir()
        Downstream(root)
        workers.append(ctx.Process(target=_worker, args=(shared_spec, str(root), point)))
        workers[-1].start()
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == -signal.SIGKILL
    # The recovery points the dead workers left behind.
    assert _step_status(store, "before", "create_order") is None
    for name in STEPS:
        assert _step_status(store, f"after:{name}", name) is Status.COMPLETED
    assert _step_status(store, "after:charge", "receipt") is None
    assert _step_status(store, "mid:charge", "create_order") is Status.COMPLETED
    assert _step_status(store, "mid:charge", "charge") is Status.PROCESSING
    for point, root in roots.items():
        gateway = Downstream(root)
        # A new caller waits out the dead worker's lease, then resumes where it stopped.
        result = _workflow(store).run("order_9", _checkout("none", gateway), scope=point)
        assert result == clean, point
        once = [f"order_9:{n}" for n in STEPS]
        assert gateway.effects() == once, point
        if point == "mid:charge":  # called again with the same key: the gateway deduped
            assert gateway.call_log() == [once[0], once[1], once[1], once[2]]
        else:
            assert gateway.call_log() == once, point
        record = store.get(key_hash(point, "checkout", "order_9"))
        assert record is not None and record.attempts == 2 and record.status is Status.COMPLETED
    store.close()
