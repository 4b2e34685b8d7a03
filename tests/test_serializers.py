"""Results round-trip through the store to the same type: JSON, dataclasses, pydantic, custom."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import uuid
from decimal import Decimal
from typing import Any, NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from retrysafe import Engine, Store, idempotent
from retrysafe.serializers import (
    JSON,
    CustomSerializer,
    JsonSerializer,
    TypedSerializer,
    resolve,
    to_json,
)


class Status(enum.Enum):
    OK = "succeeded"
    DECLINED = "declined"


@dataclasses.dataclass(frozen=True)
class Line:
    sku: str
    quantity: int
    price: Decimal


@dataclasses.dataclass
class Charge:
    id: uuid.UUID
    amount: Decimal
    status: Status
    created: dt.datetime
    lines: list[Line]
    tags: frozenset[str] = frozenset()
    refund_of: str | None = None
    pair: tuple[int, Decimal] = (0, Decimal(0))
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    total: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        self.total = sum(line.quantity for line in self.lines)


class Point(NamedTuple):
    x: int
    at: dt.date


class Receipt(BaseModel):
    charge_id: str
    amount: Decimal
    lines: list[Line]
    issued: dt.datetime


class Money:
    """A class of the caller's own, stored with a custom pair."""

    def __init__(self, cents: int, currency: str) -> None:
        self.cents, self.currency = cents, currency

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Money) and (self.cents, self.currency) == (
            other.cents,
            other.currency,
        )

    def to_json(self) -> list[Any]:
        return [self.cents, self.currency]

    @classmethod
    def from_json(cls, data: list[Any]) -> Money:
        return cls(*data)


def a_charge(n: int = 1) -> Charge:
    return Charge(
        id=uuid.UUID(int=n),
        amount=Decimal("19.99"),
        status=Status.OK,
        created=dt.datetime(2026, 11, 23, 7, 0, tzinfo=dt.UTC),
        lines=[Line("sku-1", 2, Decimal("9.995"))],
        tags=frozenset({"a", "b"}),
        pair=(3, Decimal("0.1")),
        extra={"note": [1, 2]},
    )


@pytest.fixture
def engine(store: Store[Any]) -> Engine:
    return Engine(store)


def _twice(f: Any, *args: Any) -> tuple[Any, Any]:
    return f(*args), f(*args)


def test_dataclass_by_annotation(engine: Engine) -> None:
    calls: list[int] = []

    @idempotent(store=engine, key="c{n}")
    def charge(n: int) -> Charge:
        calls.append(n)
        return a_charge(n)

    first, again = _twice(charge, 1)
    assert again == first == a_charge(1) and type(again) is Charge and calls == [1]
    assert type(again.lines[0]) is Line and type(again.amount) is Decimal
    assert again.status is Status.OK and again.tags == frozenset({"a", "b"})
    assert again.pair == (3, Decimal("0.1")) and again.total == 2


async def test_async_dataclass_and_containers(engine: Engine) -> None:
    @idempotent(store=engine, key="c{n}")
    async def charges(n: int) -> list[Charge]:
        return [a_charge(n), a_charge(n + 1)]

    first = await charges(1)
    again = await charges(1)
    assert again == first and all(type(c) is Charge for c in again)
    await engine.aclose()


def test_pydantic_model(engine: Engine) -> None:
    @idempotent(store=engine, key="r{n}")
    def receipt(n: int) -> Receipt:
        return Receipt(
            charge_id=f"ch_{n}",
            amount=Decimal("5.10"),
            lines=[Line("x", 1, Decimal("5.10"))],
            issued=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
        )

    first, again = _twice(receipt, 1)
    assert again == first and type(again) is Receipt and type(again.amount) is Decimal


def test_custom_pair_and_explicit_types(engine: Engine) -> None:
    @idempotent(store=engine, key="m{n}", serializer=(Money.to_json, Money.from_json))
    def quote(n: int):  # type: ignore[no-untyped-def]  # no annotation: the pair decides
        return Money(n * 100, "EUR")

    first, again = _twice(quote, 3)
    assert again == first == Money(300, "EUR") and type(again) is Money

    @idempotent(store=engine, key="p{n}", serializer=Point)
    def point(n: int) -> Any:
        return Point(n, dt.date(2026, 1, n))

    first, again = _twice(point, 2)
    assert again == first and type(again) is Point and type(again.at) is dt.date


def test_json_by_default(engine: Engine) -> None:
    @idempotent(store=engine, key="t{n}")
    def as_json(n: int):  # type: ignore[no-untyped-def]
        return (n, [n])

    @idempotent(store=engine, key="t{n}")
    def as_tuple(n: int) -> tuple[int, list[int]]:
        return (n, [n])

    assert _twice(as_json, 1) == ((1, [1]), [1, [1]])  # unannotated: decoded JSON
    assert _twice(as_tuple, 1) == ((1, [1]), (1, [1]))
    assert as_tuple.operation != as_json.operation  # (qualified names differ)


@pytest.mark.parametrize("falsy", [None, 0, "", {}, []])
def test_optional_and_falsy(engine: Engine, falsy: Any) -> None:
    @idempotent(store=engine, key="f{n}")
    def maybe(n: int) -> Charge | int | str | dict[str, int] | list[int] | None:
        return falsy

    first, again = _twice(maybe, 1)
    assert first == again == falsy and type(again) is type(falsy)


def test_unresolvable_annotation_runs_nothing(engine: Engine) -> None:
    calls: list[int] = []

    @idempotent(store=engine, key="u{n}")
    def later(n: int) -> NotDefinedYet:  # type: ignore[name-defined]  # noqa: F821
        calls.append(n)

    with pytest.raises(TypeError, match="serializer="):
        later(1)
    assert calls == [] and not engine.store.stats(engine.clock()).counts


def test_forward_reference_resolves_at_first_call(engine: Engine) -> None:
    @idempotent(store=engine, key="l{n}")
    def late(n: int) -> LateResult:
        return LateResult(n)

    assert late(1) == late(1) == LateResult(1) and type(late(1)) is LateResult


@dataclasses.dataclass
class LateResult:
    n: int


def test_a_type_it_cannot_rebuild_is_refused() -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError, match="dataclass"):
        resolve(None, Opaque)
    with pytest.raises(TypeError):
        resolve("pickle")
    with pytest.raises(TypeError):
        CustomSerializer(1, 2)  # type: ignore[arg-type]
    assert resolve("json", Charge) is JSON and resolve(None, dict[str, int]) is JSON
    assert isinstance(resolve(Charge), TypedSerializer)
    assert isinstance(resolve(JsonSerializer()), JsonSerializer)
    with pytest.raises(TypeError, match="cannot store"):
        to_json(object())


# -- property: every value of the supported types comes back equal and of its type ---------

decimals = st.decimals(allow_nan=False, allow_infinity=False, places=4)
lines = st.builds(Line, st.text(max_size=8), st.integers(-(10**12), 10**12), decimals)
charges = st.builds(
    Charge,
    id=st.uuids(),
    amount=decimals,
    status=st.sampled_from(Status),
    created=st.datetimes(timezones=st.just(dt.UTC)),
    lines=st.lists(lines, max_size=3),
    tags=st.frozensets(st.text(max_size=4), max_size=3),
    refund_of=st.none() | st.text(max_size=8),
    pair=st.tuples(st.integers(), decimals),
    extra=st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4), max_size=3),
)


@given(st.lists(charges, max_size=3))
def test_round_trip_property(values: list[Charge]) -> None:
    import json

    serializer = resolve(None, list[Charge])
    stored = json.loads(json.dumps(serializer.dump(values)))
    back = serializer.load(stored)
    assert back == values and all(type(v) is Charge for v in back)
