"""The conformance suite: every store, sync and async, through the engine.

Each test runs on memory, SQLite, Redis and PostgreSQL (real servers), and on the
SQLAlchemy stores (SQLite and PostgreSQL, on a sync Engine and on an AsyncEngine), in
both modes; nothing here knows which store it talks to.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import SQLALCHEMY_STORES, STORES, Api, Clock, StoreSpec, make_spec

from retrysafe import (
    Claim,
    Engine,
    FingerprintMismatchError,
    InProgressError,
    InvalidKeyError,
    LeaseLostError,
    Outcome,
    Replay,
    Status,
    Store,
    key_hash,
)
from retrysafe.stores.memory import MemoryStore

OP = "payments.charge"


@pytest.fixture(params=STORES + SQLALCHEMY_STORES)
def store_spec(request: pytest.FixtureRequest, tmp_path: Path) -> StoreSpec:
    """This module's stores: the shared list plus the SQLAlchemy stores."""
    return make_spec(request.param, request, tmp_path)


def claim(result: Claim | Replay) -> Claim:
    assert isinstance(result, Claim), f"expected a claim, got {result!r}"
    return result


def replay(result: Claim | Replay) -> Replay:
    assert isinstance(result, Replay), f"expected a replay, got {result!r}"
    return result


def test_state_machine(api: Api, store: Store[Any], clock: Clock) -> None:
    first = claim(api.begin("k1", operation=OP, fingerprint="fp", request_id="req_1"))
    assert (first.attempts, first.took_over) == (1, None)
    stored = store.get(first.key_hash)
    assert stored is not None and stored.status is Status.PROCESSING
    assert stored.token == first.token and stored.request_id == "req_1"

    with pytest.raises(InProgressError) as busy:
        api.begin("k1", operation=OP, fingerprint="fp")
    assert busy.value.retry_after >= 1 and busy.value.code == "idempotency_in_flight"

    clock.advance(2)
    api.complete(first, Outcome(b'{"charge":"ch_1"}', 201, (("content-type", "application/json"),)))
    again = replay(api.begin("k1", operation=OP, fingerprint="fp", request_id="req_2"))
    record = again.record
    assert record.status is Status.COMPLETED and not again.failed
    assert again.outcome == Outcome(
        b'{"charge":"ch_1"}', 201, (("content-type", "application/json"),)
    )
    assert record.request_id == "req_1"  # the original request, not the retry
    assert record.completed_at == clock.now and record.created_at == clock.now - 2
    assert record.key == "k1" and record.operation == OP and record.fingerprint == "fp"
    assert record.expires_at == record.created_at + api.engine.ttl


def test_record_keeps_what_design_lists(api: Api, store: Store[Any]) -> None:
    c = claim(
        api.begin(
            "meta",
            operation=OP,
            scope="tenant-7",
            fingerprint="f",
            metadata={"user_id": 42, "gateway_tx": "tx_9"},
            request_payload=b"\x00raw body\xff",
        )
    )
    api.complete(c, Outcome.json({"ok": True, "n": 0}))
    record = store.get(c.key_hash)
    assert record is not None
    assert record.scope == "tenant-7" and record.metadata == {"user_id": 42, "gateway_tx": "tx_9"}
    assert record.request_payload == b"\x00raw body\xff"
    assert record.outcome is not None and record.outcome.value == {"ok": True, "n": 0}
    assert c.key_hash == key_hash("tenant-7", OP, "meta")


def test_scope_and_operation_separate_records(api: Api) -> None:
    a = claim(api.begin("same", operation="a", scope="alice"))
    b = claim(api.begin("same", operation="a", scope="bob"))
    c = claim(api.begin("same", operation="b", scope="alice"))
    assert len({a.key_hash, b.key_hash, c.key_hash}) == 3
    api.complete(a, Outcome.json("alice's answer"))
    api.complete(b, Outcome.json("bob's answer"))
    assert replay(api.begin("same", operation="a", scope="bob")).outcome.value == "bob's answer"


def test_fingerprint_conflict_in_every_state(api: Api) -> None:
    processing = claim(api.begin("p", operation=OP, fingerprint="A"))
    with pytest.raises(FingerprintMismatchError) as err:
        api.begin("p", operation=OP, fingerprint="B")
    assert err.value.original_fingerprint == "A" and err.value.fingerprint == "B"
    assert err.value.code == "idempotency_conflict"

    api.complete(processing, Outcome.json(1))
    with pytest.raises(FingerprintMismatchError):
        api.begin("p", operation=OP, fingerprint="B")

    failed = claim(api.begin("f", operation=OP, fingerprint="A"))
    api.fail(failed)
    with pytest.raises(FingerprintMismatchError):  # a retry must be the same request
        api.begin("f", operation=OP, fingerprint="B")
    assert replay(api.begin("p", operation=OP, fingerprint="A")).outcome.value == 1


def test_failure_is_retryable_by_default(api: Api, store: Store[Any]) -> None:
    first = claim(api.begin("k", operation=OP, fingerprint="f"))
    api.fail(first, Outcome(b"boom", 502))
    retry = claim(api.begin("k", operation=OP, fingerprint="f"))
    assert (retry.attempts, retry.took_over) == (2, Status.FAILED)
    record = store.get(retry.key_hash)
    assert record is not None and record.status is Status.PROCESSING
    assert record.outcome is None, "the failed attempt's outcome must not survive a new claim"
    api.complete(retry, Outcome.json("second time lucky"))
    assert (
        replay(api.begin("k", operation=OP, fingerprint="f")).outcome.value == "second time lucky"
    )


def test_final_failure_is_replayed(make_api: Any) -> None:
    api = make_api(final_failures=True)
    first = claim(api.begin("k", operation=OP))
    api.fail(first, Outcome(b"card declined", 402))
    again = replay(api.begin("k", operation=OP))
    assert again.failed and again.outcome == Outcome(b"card declined", 402)
    # per-call override: this failure stays retryable
    other = claim(api.begin("k2", operation=OP))
    api.fail(other, final=False)
    claim(api.begin("k2", operation=OP))


def test_lease_expiry_takeover_and_fencing(api: Api, clock: Clock, store: Store[Any]) -> None:
    stale = claim(api.begin("k", operation=OP, fingerprint="f", lease=5))
    clock.advance(4.9)
    with pytest.raises(InProgressError):
        api.begin("k", operation=OP, fingerprint="f")
    clock.advance(0.2)  # the lease ran out: the worker is presumed dead
    new = claim(api.begin("k", operation=OP, fingerprint="f"))
    assert (new.attempts, new.took_over) == (2, Status.PROCESSING)
    assert new.token != stale.token

    for late in (
        lambda: api.complete(stale, Outcome.json("stale")),
        lambda: api.fail(stale),
        lambda: api.renew(stale),
    ):
        with pytest.raises(LeaseLostError):
            late()
        record = store.get(new.key_hash)
        assert record is not None and record.token == new.token
        assert record.status is Status.PROCESSING and record.outcome is None

    api.complete(new, Outcome.json("fresh"))
    with pytest.raises(LeaseLostError):
        api.complete(stale, Outcome.json("stale"))
    assert replay(api.begin("k", operation=OP, fingerprint="f")).outcome.value == "fresh"


def test_renew_extends_a_live_lease(api: Api, clock: Clock) -> None:
    c = claim(api.begin("k", operation=OP, lease=10))
    clock.advance(8)
    api.renew(c, 10)
    assert c.lease_until == clock.now + 10
    clock.advance(8)  # past the first lease, inside the renewed one
    with pytest.raises(InProgressError):
        api.begin("k", operation=OP)
    api.complete(c, Outcome.json("done"))


def test_renewal_past_the_expiry_moves_it(make_api: Any, clock: Clock) -> None:
    """A running attempt never expires under its owner: renewing moves the expiry."""
    api = make_api(ttl=10, lease=10)
    c = claim(api.begin("k", operation=OP))
    first_expiry = c.expires_at
    clock.advance(8)
    api.renew(c, 10)  # to now + 10: past the record's expiry
    assert c.lease_until == clock.now + 10 and c.expires_at == c.lease_until > first_expiry
    clock.advance(8)  # past the first expiry, inside the renewed lease
    with pytest.raises(InProgressError):
        api.begin("k", operation=OP)
    api.complete(c, Outcome.json("done"))
    assert replay(api.begin("k", operation=OP)).outcome.value == "done"
    clock.advance(3)  # past the moved expiry: the key is free again
    assert isinstance(api.begin("k", operation=OP), Claim)


def test_ttl_expiry_and_narrowing(make_api: Any, clock: Clock) -> None:
    api = make_api(ttl=100)
    c = claim(api.begin("k", operation=OP, fingerprint="A"))
    assert c.expires_at == clock.now + 100
    api.complete(c, Outcome.json("old"))
    clock.advance(99)
    replay(api.begin("k", operation=OP, fingerprint="A"))
    clock.advance(1)  # expired records behave as absent, whatever their fingerprint
    fresh = claim(api.begin("k", operation=OP, fingerprint="B"))
    assert (fresh.attempts, fresh.took_over) == (1, None)

    narrow = claim(api.begin("n", operation=OP, ttl=10))
    assert narrow.expires_at == clock.now + 10
    wide = claim(api.begin("w", operation=OP, ttl=10_000))  # may only narrow
    assert wide.expires_at == clock.now + 100
    assert wide.lease_until <= wide.expires_at


def test_expired_processing_record_is_free(make_api: Any, clock: Clock) -> None:
    api = make_api(ttl=10, lease=60)  # the lease is capped by the TTL
    c = claim(api.begin("k", operation=OP))
    assert c.lease_until == c.expires_at
    clock.advance(10)
    assert claim(api.begin("k", operation=OP)).took_over is None


def test_one_mebibyte_body_round_trip(api: Api) -> None:
    body = os.urandom(1 << 20)
    c = claim(api.begin("big", operation=OP))
    api.complete(c, Outcome(body, 200, (("content-type", "application/octet-stream"),)))
    got = replay(api.begin("big", operation=OP)).outcome
    assert got is not None and got.body == body and got.status == 200


def test_an_outcome_that_cannot_be_stored_fails_finally(make_api: Any, store: Store[Any]) -> None:
    """The handler ran: a retry must get the failure, not run the side effect again."""
    api = make_api(max_body=1000)
    c = claim(api.begin("big", operation=OP))
    with pytest.raises(ValueError, match="max_body"):
        api.complete(c, Outcome(b"x" * 1001))
    record = store.get(c.key_hash)
    assert record is not None and record.status is Status.FAILED and record.final
    assert replay(api.begin("big", operation=OP)).failed
    c = claim(api.begin("not-an-outcome", operation=OP))
    with pytest.raises(TypeError, match="Outcome"):
        api.complete(c, {"not": "an Outcome"})
    assert replay(api.begin("not-an-outcome", operation=OP)).failed


BAD_KEYS: list[Any] = [
    "",
    "x" * 256,
    "tab\there",
    "new\nline",
    "nul\x00",
    "del\x7f",
    "caf\u00e9",
    "emoji\U0001f600",
    "\u200b",
    None,
    42,
    b"bytes",
    ["k"],
]
GOOD_KEYS = [
    " ",
    "~",
    "x" * 255,
    "order:789/2999 USD",
    '"quoted"',
    "550e8400-e29b-41d4-a716-446655440000",
]


class SpyStore:
    """Wraps a real store and records which operations reached it."""

    def __init__(self, inner: Store[Any]) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name: str) -> Any:
        self.calls.append(name)
        return getattr(self.inner, name)


@pytest.mark.parametrize("bad", BAD_KEYS, ids=repr)
def test_bad_keys_touch_nothing(api: Api, bad: Any) -> None:
    spy = SpyStore(api.engine.store)
    api.engine.store = spy  # type: ignore[assignment]
    with pytest.raises(InvalidKeyError) as err:
        api.begin(bad, operation=OP)
    assert err.value.code == "idempotency_key_invalid" and str(err.value)
    assert spy.calls == []


@pytest.mark.parametrize("good", GOOD_KEYS, ids=repr)
def test_good_keys(api: Api, good: str) -> None:
    api.complete(claim(api.begin(good, operation=OP)), Outcome.json(good))
    assert replay(api.begin(good, operation=OP)).outcome.value == good


def test_bad_arguments_touch_nothing(api: Api) -> None:
    spy = SpyStore(api.engine.store)
    api.engine.store = spy  # type: ignore[assignment]
    for kwargs in (
        {"operation": 5},
        {"scope": None},
        {"fingerprint": b"x"},
        {"ttl": 0},
        {"lease": -1},
        {"request_payload": "text, not bytes"},
        {"request_id": 7},
        {"metadata": {"when": object()}},
        {"metadata": {"x": float("nan")}},
        {"metadata": ["not", "a", "dict"]},
        {"nonsense": 1},
        {"ttl": "10"},
        {"lease": True},
        {"ttl": float("nan")},
        {"wait": -1},
        {"wait": "1"},
    ):
        with pytest.raises((TypeError, ValueError)):
            api.begin("k", **kwargs)
    assert spy.calls == []


def test_attempt_context_manager(api: Api, mode: str) -> None:
    engine = api.engine

    def run(key: str, body: Any) -> Any:
        if mode == "sync":
            with engine.attempt(key, operation=OP) as att:
                if att.replay:
                    return ("replay", att.replay.outcome.value)
                return body(att)

        async def go() -> Any:
            async with engine.attempt(key, operation=OP) as att:
                if att.replay:
                    return ("replay", att.replay.outcome.value)
                return body(att)

        assert api.loop is not None
        return api.loop.run_until_complete(go())

    def ok(att: Any) -> str:
        att.outcome = Outcome.json("v")
        return "ran"

    def boom(att: Any) -> None:
        raise KeyError("handler failed")

    assert run("a", ok) == "ran"
    assert run("a", ok) == ("replay", "v")
    with pytest.raises(KeyError):
        run("b", boom)
    assert run("b", ok) == "ran"  # the failure was retryable
    with pytest.raises(RuntimeError, match="without an outcome"):
        run("c", lambda att: None)
    assert run("c", ok) == "ran"


class SeesInFlight:
    """Wraps a real store; ``busy`` is set once a claim found the key in flight."""

    def __init__(self, inner: Store[Any]) -> None:
        self.inner = inner
        self.busy = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _seen(self, result: Any) -> Any:
        if not result.claimed:
            self.busy.set()
        return result

    def claim(self, record: Any) -> Any:
        return self._seen(self.inner.claim(record))

    async def aclaim(self, record: Any) -> Any:
        return self._seen(await self.inner.aclaim(record))


@pytest.mark.parametrize("first_attempt_ends", ["completes", "fails"])
def test_wait_ends_with_the_first_attempt(api: Api, first_attempt_ends: str) -> None:
    """A waiter gets the first attempt's answer, or takes the key over when it failed."""
    first = claim(api.begin("k", operation=OP, fingerprint="f"))
    spy = SeesInFlight(api.engine.store)
    api.engine.store = spy  # type: ignore[assignment]
    owner = Engine(spy.inner)

    def finish() -> None:
        spy.busy.wait(10)  # the waiter has seen the key in flight
        if first_attempt_ends == "completes":
            owner.complete(first, Outcome.json("first answer"))
        else:
            owner.fail(first)

    finisher = threading.Thread(target=finish)
    finisher.start()
    answer = api.begin("k", operation=OP, fingerprint="f", wait=10)
    finisher.join()
    assert spy.busy.is_set()
    if first_attempt_ends == "completes":
        assert replay(answer).outcome.value == "first answer"
    else:
        retry = claim(answer)
        assert retry.took_over is Status.FAILED and retry.attempts == 2


@pytest.mark.parametrize("real_clock", [True, False], ids=["real-clock", "frozen-clock"])
def test_wait_is_bounded(make_api: Any, real_clock: bool) -> None:
    api = make_api(clock=time.time) if real_clock else make_api()  # the fake clock never moves
    claim(api.begin("k", operation=OP))
    started = time.monotonic()
    with pytest.raises(InProgressError):
        api.begin("k", operation=OP, wait=0.3)
    assert 0.3 <= time.monotonic() - started < 5


class Stalls:
    """Wraps a real store: the named async call does its work, then waits on ``release``."""

    def __init__(self, inner: Store[Any], name: str) -> None:
        self.inner, self.name = inner, name
        self.reached, self.release, self.failed = asyncio.Event(), asyncio.Event(), asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def _stall(self, result: Any) -> Any:
        self.reached.set()
        await self.release.wait()
        return result

    async def aclaim(self, record: Any) -> Any:
        result = await self.inner.aclaim(record)
        return await self._stall(result) if self.name == "aclaim" else result

    async def acomplete(self, *args: Any) -> Any:
        if self.name == "acomplete":
            await self._stall(None)
        return await self.inner.acomplete(*args)

    async def afail(self, *args: Any) -> Any:
        result = await self.inner.afail(*args)
        self.failed.set()
        return result


async def test_cancelled_during_completion_still_completes(store: Store[Any]) -> None:
    """A client that disconnects cancels the task; the side effect that ran is recorded."""
    stalls = Stalls(store, "acomplete")
    engine = Engine(store)
    engine.store = stalls  # type: ignore[assignment]
    runs: list[int] = []

    async def handler() -> None:
        async with engine.attempt("k", operation=OP) as att:
            runs.append(1)
            att.outcome = Outcome.json("charged once")

    task = asyncio.create_task(handler())
    await stalls.reached.wait()  # completion under way
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stalls.release.set()
    engine.store = store  # type: ignore[assignment]
    for _ in range(200):  # the shielded completion finishes on its own
        result = await engine.abegin("k", operation=OP, wait=5)
        if isinstance(result, Replay):
            break
    assert result.outcome.value == "charged once" and runs == [1]
    await store.aclose()


class OwnTimeout(MemoryStore):
    """A store like most client libraries: its claim enters a timeout (here one already
    due) before its first wait; ``drive_inline`` is the Store default, False."""

    drive_inline = False

    def __init__(self) -> None:
        super().__init__()
        self.tasks: list[asyncio.Task[Any] | None] = []

    async def aclaim(self, record: Any) -> Any:
        self.tasks.append(asyncio.current_task())
        async with asyncio.timeout(0):
            await asyncio.Event().wait()
        raise AssertionError("the timeout did not fire")


async def test_a_store_calls_own_timeout_ends_that_call_not_its_caller() -> None:
    """A timeout entered by a store call belongs to that call's task: on Python 3.11,
    driving the call's first step by hand in the caller's task (as the engine does for
    stores that say they may be) made it cancel the caller, and the call waited on."""
    store = OwnTimeout()
    engine = Engine(store)
    with pytest.raises(TimeoutError):
        async with engine.attempt("k", operation=OP):
            raise AssertionError("claimed")
    assert store.tasks and store.tasks[0] is not asyncio.current_task()
    assert MemoryStore.drive_inline and not Store.drive_inline


async def test_cancelled_during_claim_releases_the_key(store: Store[Any]) -> None:
    """A claim that lands after its task was cancelled is failed, not left in flight."""
    stalls = Stalls(store, "aclaim")
    engine = Engine(store)
    engine.store = stalls  # type: ignore[assignment]

    async def handler() -> None:
        async with engine.attempt("k", operation=OP) as att:
            att.outcome = Outcome.json("never")

    task = asyncio.create_task(handler())
    await stalls.reached.wait()  # the claim is written; its answer is on the way
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stalls.release.set()
    await asyncio.wait_for(stalls.failed.wait(), 10)
    retry = await Engine(store).abegin("k", operation=OP)
    assert isinstance(retry, Claim) and retry.took_over is Status.FAILED
    await store.aclose()
