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

        def run(*a: Any, **k: Any) -> Any:
            return loop.run_until_complete(wrapped(*a, **k))

        run.operation = wrapped.operation  # type: ignore[attr-defined]
        return run

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
    with pytest.raises(ValueError, match=r"\{missing\} is not an argument"):
        h.wrap(lambda k: calls.append(k), store=engine, key="{missing}")  # refused at decoration
    g = h.wrap(lambda k: calls.append(k), store=engine, key="{k[id]}")
    with pytest.raises(InvalidKeyError, match="has no value"):
        g({"other": 1})
    assert calls == []


def test_unserialisable_result_fails_the_record_finally(h: Harness, engine: Engine) -> None:
    calls: list[int] = []

    def fn(n: int) -> Any:
        calls.append(n)
        return object()  # the side effect ran; its answer cannot be stored

    f = h.wrap(fn, store=engine, key="{n}")
    with pytest.raises(TypeError, match="cannot be stored"):
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


# -- keys ---------------------------------------------------------------------------


class Account:
    def __init__(self, account_id: str) -> None:
        self.account_id = account_id
        self.calls = 0

    @idempotent(store="memory://", key="{self.account_id}:{amount}")
    def charge(self, amount: int) -> str:
        self.calls += 1
        return f"{self.account_id}-{amount}"

    @idempotent(store="memory://", key="{self.account_id}:{amount}")
    async def acharge(self, amount: int) -> str:
        self.calls += 1
        return f"{self.account_id}-{amount}"


def test_templates_reach_into_arguments(h: Harness, engine: Engine) -> None:
    calls: list[Any] = []

    def fn(order: dict[str, Any], user: Any, n: int, tags: list[str]) -> int:
        calls.append(n)
        return n

    class User:
        id = "u7"

    f = h.wrap(fn, store=engine, key="{order[id]}/{user.id}/{n:04d}/{tags[0]!r}", validate=("n",))
    assert f({"id": "o1"}, User(), 3, ["a"]) == 3 == f({"id": "o1"}, User(), 3, ["a"])
    assert calls == [3]
    expected = "o1/u7/0003/'a'"
    assert engine.store.get(key_hash("", f.operation, expected)) is not None


def test_method_templates_may_use_self() -> None:
    a, b = Account("acct_a"), Account("acct_b")
    assert a.charge(5) == "acct_a-5" and a.charge(5) == "acct_a-5"
    assert b.charge(5) == "acct_b-5"  # another account: another key
    assert (a.calls, b.calls) == (1, 1)
    assert asyncio.run(a.acharge(6)) == asyncio.run(a.acharge(6)) == "acct_a-6" and a.calls == 2


def test_missing_key_raises_by_default_and_writes_nothing(h: Harness, engine: Engine) -> None:
    calls: list[Any] = []
    f = h.wrap(lambda order: calls.append(order), store=engine, key="order:{order[id]}")
    for order in ({}, {"id": None}, {"id": ""}, [], None):
        with pytest.raises(InvalidKeyError, match="has no value"):
            f(order)
    g = h.wrap(lambda order: calls.append(order), store=engine, key=lambda order: None)
    with pytest.raises(InvalidKeyError):
        g({"id": 1})
    assert calls == [] and not engine.store.stats(engine.clock()).counts


def test_missing_key_may_run_unprotected(
    h: Harness, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[Any] = []
    f = h.wrap(
        lambda order: calls.append(order) or len(calls),
        store=engine,
        key="{order[id]}",
        raise_on_missing_key=False,
    )
    assert f({}) == 1 and f({}) == 2  # no key: runs every time, unprotected
    assert f({"id": 9}) == 3 and f({"id": 9}) == 3  # a key: once
    assert "without idempotency" in caplog.text
    bad = h.wrap(lambda k: k, store=engine, key="{k}", raise_on_missing_key=False)
    with pytest.raises(InvalidKeyError):
        bad("é")  # a key that is there but malformed is always an error


def test_operation_from_the_map(h: Harness, store: Store[Any], clock: Clock) -> None:
    from retrysafe import IdempotencyMap

    payment = IdempotencyMap.default().operations["payment"]
    calls: list[Any] = []

    def pay(order_id: str, amount: int, currency: str, timestamp: int, card: str) -> str:
        calls.append(amount)
        return f"paid {amount}"

    f = h.wrap(pay, store=Engine(store, clock=clock, ttl=30 * 24 * 3600), operation=payment)
    args = ("o_1", 500, "EUR", 1702500000, "tok_visa")
    assert f(*args) == f(*args) == "paid 500" and calls == [500]
    key = payment.build(order_id="o_1", amount=500, currency="EUR", timestamp=1702500000)
    record = store.get(key_hash("", "payment", key))
    assert record is not None and record.retention == "financial"
    assert record.expires_at - record.created_at == pytest.approx(payment.ttl)


def test_bad_options_are_refused_at_decoration() -> None:
    with pytest.raises(TypeError):
        idempotent(key=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        idempotent(validate=[1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="must name an argument"):
        idempotent(key="{}")(lambda a: a)
    with pytest.raises(ValueError, match="not an argument"):
        idempotent(validate=("amount",))(lambda a: a)
    with pytest.raises(TypeError, match="exception classes"):
        idempotent(final_failures=(int,))(lambda a: a)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        idempotent(serializer=5)(lambda a: a)


# -- validate= -------------------------------------------------------------------


def test_validate_names_the_arguments_that_conflict(h: Harness, engine: Engine) -> None:
    calls: list[Any] = []

    def charge(order: dict[str, Any], amount: int, note: str) -> int:
        calls.append(amount)
        return amount

    f = h.wrap(charge, store=engine, key="{order[id]}", validate=("order[currency]", "amount"))
    assert f({"id": 1, "currency": "EUR"}, 100, "first") == 100
    # A change outside the validated paths is the same request: replayed.
    assert f({"id": 1, "currency": "EUR", "x": 2}, 100, "retry") == 100
    for order, amount in (({"id": 1, "currency": "USD"}, 100), ({"id": 1, "currency": "EUR"}, 5)):
        with pytest.raises(FingerprintMismatchError):
            f(order, amount, "first")
    assert calls == [100]


def test_validate_nothing_never_conflicts(h: Harness, engine: Engine) -> None:
    f = h.wrap(lambda k, v: v, store=engine, key="{k}", validate=())
    assert f("a", 1) == 1 and f("a", 2) == 1


def test_validate_lets_unhashable_arguments_through(h: Harness, engine: Engine) -> None:
    conn = object()  # a connection, a client: not part of the request
    f = h.wrap(lambda db, n: n, store=engine, key="{n}", validate="n")
    assert f(conn, 1) == f(object(), 1) == 1
    g = h.wrap(lambda db, n: n, store=engine, key="{n}", operation="g")
    with pytest.raises(TypeError, match="validate="):
        g(conn, 1)


# -- final failures -------------------------------------------------------------------


class CardDeclined(Exception):
    def __init__(self, reason: str, code: int) -> None:
        super().__init__(reason, code)
        self.reason, self.code = reason, code


def test_listed_exceptions_are_final_and_raised_again(h: Harness, engine: Engine) -> None:
    calls: list[Any] = []

    def charge(n: int) -> str:
        calls.append(n)
        if n == 1:
            raise CardDeclined("insufficient funds", 51)
        raise ConnectionError("gateway down")

    f = h.wrap(charge, store=engine, key="{n}", final_failures=(CardDeclined,))
    for _ in range(3):
        with pytest.raises(CardDeclined) as err:
            f(1)
        assert (err.value.reason, err.value.code) == ("insufficient funds", 51)
    assert calls == [1]  # retries raised it again without running
    for _ in range(2):
        with pytest.raises(ConnectionError):
            f(2)  # not listed: retryable
    assert calls == [1, 2, 2]


def test_all_failures_final_keep_no_text(h: Harness, engine: Engine) -> None:
    calls: list[Any] = []

    def fn(n: int) -> str:
        calls.append(n)
        raise ValueError("card 4242 4242 4242 4242 declined", n)

    f = h.wrap(fn, store=engine, key="{n}", final_failures=True)
    with pytest.raises(ValueError, match="4242"):
        f(4)  # the original, once
    for _ in range(2):
        with pytest.raises(ValueError) as err:
            f(4)  # replayed: the class (a built-in), none of its text
        assert "4242" not in str(err.value)
    assert calls == [4]
    stored = engine.store.get(key_hash("", f.operation, "4"))
    assert stored is not None and b"4242" not in stored.outcome.body  # type: ignore[union-attr]

    class Private(Exception):
        pass

    def boom(n: int) -> None:
        raise Private("secret sauce")

    p = h.wrap(boom, store=engine, key="{n}", final_failures=True, operation="p")
    with pytest.raises(Private):
        p(1)
    with pytest.raises(IdempotencyError, match=r"Private; it is not run again") as err:
        p(1)  # not a listed class: named, not rebuilt, and its text was not kept
    assert "secret" not in str(err.value)


class Declined(ValueError):
    pass


def test_a_replayed_failure_is_the_nearest_listed_class(h: Harness, engine: Engine) -> None:
    """The same class in every process: the nearest ancestor the decorator lists."""
    calls: list[Any] = []

    def charge(n: int) -> None:
        calls.append(n)
        raise Declined("do not honour", 5)

    f = h.wrap(charge, store=engine, key="{n}", final_failures=(ValueError,))
    with pytest.raises(Declined):
        f(1)  # the original
    for _ in range(2):
        with pytest.raises(ValueError) as err:
            f(1)
        assert type(err.value) is ValueError and err.value.args == ("do not honour", 5)
    again = h.wrap(
        charge, store=engine, key="{n}", final_failures=(ValueError,), operation=f.operation
    )
    with pytest.raises(ValueError) as err:
        again(1)  # "another process": the same answer
    assert type(err.value) is ValueError and calls == [1]


def test_engine_final_failures_store_the_error(h: Harness, store: Store[Any], clock: Clock) -> None:
    f = h.wrap(
        lambda n: (_ for _ in ()).throw(KeyError("k")),
        store=Engine(store, clock=clock, final_failures=True),
        key="{n}",
    )
    for _ in range(2):
        with pytest.raises(KeyError):
            f(1)


def test_more_bad_options_are_refused_at_decoration() -> None:
    def fn(n: int) -> int:
        return n

    for options in (
        {"ttl": -1},
        {"ttl": "1h"},
        {"lease": 0},
        {"wait": -5},
        {"wait": True},
        {"retention": "bogus"},
        {"scope": 5},
        {"store": 5},
    ):
        with pytest.raises((TypeError, ValueError)):
            idempotent(**options)(fn)  # type: ignore[arg-type]

    def gen(n: int) -> Any:
        yield n

    async def agen(n: int) -> Any:
        yield n

    for f in (gen, agen):
        with pytest.raises(TypeError, match="generator"):
            idempotent(store="memory://")(f)

    class Wallet:
        def withdraw(self, amount: int) -> int:
            return amount

    with pytest.raises(TypeError, match="receiver"):
        idempotent(store="memory://")(Wallet.withdraw)
    idempotent(store="memory://", scope=lambda self, amount: str(id(self)))(Wallet.withdraw)

    import functools

    with pytest.raises(TypeError, match="operation="):
        idempotent(store="memory://")(functools.partial(fn, 1))
    part = idempotent(store="memory://", operation="part")(functools.partial(fn, 1))
    assert part() == part() == 1


def test_bare_decorator(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("RETRYSAFE_STORE", f"sqlite:///{tmp_path}/bare.db")  # the default store
    calls: list[int] = []

    @idempotent
    def fn(n: int) -> int:
        calls.append(n)
        return n

    assert fn(1) == fn(1) == 1 and fn(2) == 2 and calls == [1, 2]


@pytest.mark.parametrize(
    "path", ["order[id]", "a.b[0].c", "a[b[c]", "a[1x]", "a[ 1]", "a[-1]", "a[\u0663]", "a]b"]
)
def test_key_paths_are_walked_as_str_format_walks_them(path: str) -> None:
    """The paths split once at decoration reach what ``string.Formatter`` reaches."""
    import string
    import types

    from retrysafe._decorator import _lookup, _split

    value = types.SimpleNamespace(b=[types.SimpleNamespace(c="c")])
    arguments: dict[str, Any] = {
        "order": {"id": 7},
        "a": {"b[c": 1, "1x": 2, " 1": 3, "-1": 4, 3: 5, "b": None},
        "a]b": 6,
    }
    if path.startswith("a.b"):
        arguments["a"] = value
    assert _lookup(_split(path), arguments) == string.Formatter().get_field(path, (), arguments)[0]
    for bad in ("a..b", "a[]", "a[x"):
        with pytest.raises(ValueError):
            _split(bad)
