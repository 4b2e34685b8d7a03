"""``@idempotent`` on every store, for plain and async functions."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import pytest
from conftest import Clock

from retrysafe import (
    Engine,
    FingerprintMismatchError,
    IdempotencyError,
    InProgressError,
    InvalidKeyError,
    LeaseLostError,
    Store,
    idempotent,
    key_hash,
)


class Harness:
    """Decorates a plain function as sync or async, and calls it the same way in both modes."""

    def __init__(self, mode: str, store: Store[Any]) -> None:
        self.mode = mode
        self.store = store
        self.loop = asyncio.new_event_loop() if mode == "async" else None

    def wrap(self, body: Callable[..., Any], **options: Any) -> Callable[..., Any]:
        if self.mode == "sync":
            return idempotent(**options)(body)

        async def async_body(*args: Any, **kwargs: Any) -> Any:
            return body(*args, **kwargs)

        async_body.__signature__ = inspect.signature(body)  # type: ignore[attr-defined]
        async_body.__qualname__ = body.__qualname__
        async_body.__module__ = body.__module__
        wrapped = idempotent(**options)(async_body)
        loop = self.loop
        assert loop is not None
        return lambda *a, **k: loop.run_until_complete(wrapped(*a, **k))

    def close(self) -> None:
        if self.loop is not None:
            self.loop.run_until_complete(self.store.aclose())  # this loop's connections
            self.loop.close()


@pytest.fixture
def h(mode: str, store: Store[Any]) -> Any:
    harness = Harness(mode, store)
    yield harness
    harness.close()


@pytest.fixture
def engine(store: Store[Any], clock: Clock) -> Engine:
    return Engine(store, clock=clock, lease=10)


def test_replay_runs_nothing(h: Harness, engine: Engine) -> None:
    calls: list[int] = []

    def charge(order: dict[str, Any], amount: int) -> dict[str, Any]:
        calls.append(amount)
        return {"charge": f"ch_{order['id']}", "amount": amount}

    f = h.wrap(charge, store=engine, key="{order[id]}")
    first = f({"id": 7}, 100)
    assert f({"id": 7}, 100) == first == {"charge": "ch_7", "amount": 100}
    assert f(order={"id": 7}, amount=100) == first  # keyword form: same call
    assert calls == [100]
    assert f({"id": 8}, 100)["charge"] == "ch_8" and calls == [100, 100]


@pytest.mark.parametrize("falsy", [0, "", {}, [], None, False, 0.0])
def test_falsy_results_replay_as_themselves(h: Harness, engine: Engine, falsy: Any) -> None:
    calls: list[Any] = []

    def fn(x: int) -> Any:
        calls.append(x)
        return falsy

    f = h.wrap(fn, store=engine, key="k{x}")
    assert f(1) == falsy
    replayed = f(1)
    assert replayed == falsy and type(replayed) is type(falsy)
    assert calls == [1]


def test_other_arguments_conflict(h: Harness, engine: Engine) -> None:
    f = h.wrap(lambda order_id, amount: amount, store=engine, key="{order_id}")
    f("o1", 100)
    with pytest.raises(FingerprintMismatchError) as err:
        f("o1", 200)
    assert (
        err.value.original_fingerprint and err.value.original_fingerprint != err.value.fingerprint
    )


def test_callable_key_and_default_key(h: Harness, engine: Engine) -> None:
    calls: list[Any] = []

    def fn(a: int, b: int = 2) -> int:
        calls.append((a, b))
        return a + b

    by_callable = h.wrap(fn, store=engine, key=lambda a, b=2: f"sum-{a}", operation="by_callable")
    assert by_callable(1) == by_callable(1) == 3
    whole = h.wrap(fn, store=engine, operation="whole")  # no key: all arguments are the key
    assert whole(1, b=2) == whole(1) == 3 and whole(5) == 7
    assert calls == [(1, 2), (1, 2), (5, 2)]


def test_exception_marks_failed_and_next_call_runs(h: Harness, engine: Engine) -> None:
    calls: list[int] = []

    def flaky(n: int) -> str:
        calls.append(n)
        if len(calls) == 1:
            raise ConnectionError("gateway timed out")
        return "ok"

    f = h.wrap(flaky, store=engine, key="{n}")
    with pytest.raises(ConnectionError):
        f(1)
    assert f(1) == "ok" and f(1) == "ok"
    assert calls == [1, 1]


def test_in_progress_raises(engine: Engine) -> None:
    inner: list[BaseException] = []

    def slow(n: int) -> int:
        try:
            f(n)  # the same call while this one holds the key
        except InProgressError as exc:
            inner.append(exc)
        return n

    f = idempotent(store=engine, key="{n}")(slow)
    assert f(3) == 3
    assert len(inner) == 1 and inner[0].retry_after >= 1


def test_takeover_and_late_completion_refused(engine: Engine, clock: Clock) -> None:
    """A worker whose lease ran out is taken over; its late result is refused (fencing)."""
    runs: list[str] = []

    def work(n: int) -> str:
        runs.append("run")
        if len(runs) == 1:
            clock.advance(11)  # this worker stalls past its 10 s lease…
            assert takeover(n) == "second"  # …and a retry takes the key over and finishes
            return "first"
        return "second"

    takeover = idempotent(store=engine, key="{n}", operation="work")(work)
    with pytest.raises(LeaseLostError):
        takeover(1)
    assert takeover(1) == "second"  # the new owner's answer is what replays
    assert runs == ["run", "run"]


def test_version_never_replays_an_old_result(h: Harness, engine: Engine) -> None:
    v1 = h.wrap(lambda x: "v1", store=engine, key="{x}", operation="price", version=1)
    v2 = h.wrap(lambda x: "v2", store=engine, key="{x}", operation="price", version=2)
    assert v1(1) == "v1" and v2(1) == "v2" and v1(1) == "v1"


def test_bad_key_runs_nothing(h: Harness, engine: Engine) -> None:
    calls: list[Any] = []
    f = h.wrap(lambda k: calls.append(k), store=engine, key="{k}")
    for bad in ("", "é", "x" * 256, "a\nb"):
        with pytest.raises(InvalidKeyError):
            f(bad)
    g = h.wrap(lambda k: calls.append(k), store=engine, key="{missing}")
    with pytest.raises(InvalidKeyError, match="template"):
        g(1)
    assert calls == []


def test_unserialisable_result_fails_the_record_finally(h: Harness, engine: Engine) -> None:
    calls: list[int] = []

    def fn(n: int) -> Any:
        calls.append(n)
        return object()  # the side effect ran; its answer cannot be stored

    f = h.wrap(fn, store=engine, key="{n}")
    with pytest.raises(TypeError, match="JSON value"):
        f(1)
    with pytest.raises(IdempotencyError, match="failed finally"):
        f(1)  # a retry is told, and runs nothing
    assert calls == [1]


def test_decorator_ttl_sets_the_engines_ttl(h: Harness, store: Store[Any], clock: Clock) -> None:
    week = 7 * 24 * 3600.0
    f = h.wrap(lambda n: n, store=store, key="{n}", ttl=week, operation="weekly")
    assert f(1) == 1
    record = store.get(key_hash("", "weekly", "1"))
    assert record is not None and record.expires_at - record.created_at == pytest.approx(week)


def test_store_as_url(h: Harness, tmp_path: Any) -> None:
    calls: list[int] = []
    f = h.wrap(lambda n: calls.append(n) or n, store=f"sqlite:///{tmp_path}/x.db", key="{n}")
    assert f(4) == 4 and f(4) == 4 and calls == [4]


def test_methods_key_on_their_arguments(h: Harness, engine: Engine) -> None:
    class Service:
        def __init__(self) -> None:
            self.calls = 0

        def charge(self, amount: int) -> int:
            self.calls += 1
            return amount

    f = h.wrap(Service.charge, store=engine, key="c{amount}")
    a, b = Service(), Service()
    assert f(a, 5) == 5 and f(b, 5) == 5  # a new instance is the same request
    assert a.calls + b.calls == 1


async def test_async_in_progress_raises(engine: Engine) -> None:
    started, release = asyncio.Event(), asyncio.Event()

    @idempotent(store=engine, key="{n}")
    async def slow(n: int) -> int:
        started.set()
        await release.wait()
        return n

    first = asyncio.create_task(slow(3))
    await started.wait()
    with pytest.raises(InProgressError):
        await slow(3)
    release.set()
    assert await first == 3 and await slow(3) == 3
    await engine.aclose()  # this loop's connections


async def test_async_takeover_and_late_completion_refused(engine: Engine, clock: Clock) -> None:
    runs: list[str] = []

    @idempotent(store=engine, key="{n}")
    async def work(n: int) -> str:
        runs.append("run")
        if len(runs) == 1:
            clock.advance(11)
            assert await work(n) == "second"
            return "first"
        return "second"

    with pytest.raises(LeaseLostError):
        await work(1)
    assert await work(1) == "second" and runs == ["run", "run"]
    await engine.aclose()  # this loop's connections


def test_wrong_calls_raise_like_the_function_and_write_nothing(store: Store[Any]) -> None:
    calls: list[Any] = []

    @idempotent(store=Engine(store), key="k")
    def fn(a: int, b: int = 2) -> int:
        calls.append((a, b))
        return a + b

    for args, kwargs in (((1, 2, 3), {}), ((), {}), ((1,), {"a": 2}), ((1,), {"zzz": 2})):
        with pytest.raises(TypeError):
            fn(*args, **kwargs)
    assert calls == []
    assert fn(1) == fn(a=1) == fn(1, b=2) == 3 and calls == [(1, 2)]


def test_varargs_and_keyword_only_bind(store: Store[Any]) -> None:
    calls: list[Any] = []

    @idempotent(store=Engine(store))
    def fn(a: int, *rest: int, scale: int = 1, **extra: Any) -> int:
        calls.append(a)
        return (a + sum(rest)) * scale

    assert fn(1, 2, 3, scale=2) == fn(1, 2, 3, scale=2) == 12
    assert fn(1, 2, 3) == 6 and len(calls) == 2
