"""retrysafe.keys: content hashes, UUID keys and key checks."""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
import uuid
from dataclasses import dataclass
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

import retrysafe
from retrysafe import InvalidKeyError
from retrysafe._client import keys
from retrysafe._model.hashing import protocol_key
from retrysafe.keys import (
    cart_hash,
    intent_hash,
    is_valid_key,
    new_key,
    parse_uuid_key,
    uuid4,
    uuid7,
    validate_key,
)

# -- cart_hash ---------------------------------------------------------------------

variant_ids = st.one_of(
    st.text(min_size=1, max_size=12), st.integers(min_value=0, max_value=10**12)
)
prices = st.one_of(
    st.integers(min_value=0, max_value=10**6),
    st.decimals(min_value=0, max_value=10**6, places=2, allow_nan=False, allow_infinity=False),
)
carts = st.lists(
    st.fixed_dictionaries(
        {"variant_id": variant_ids, "quantity": st.integers(1, 99), "price": prices}
    ),
    min_size=1,
    max_size=8,
    unique_by=lambda item: str(item["variant_id"]),
)


@given(carts, st.randoms())
def test_cart_hash_ignores_item_order(cart: list[dict], rnd) -> None:
    shuffled = list(cart)
    rnd.shuffle(shuffled)
    assert cart_hash(shuffled) == cart_hash(cart)


@given(carts, st.data())
def test_cart_hash_changes_with_quantity_or_price(cart: list[dict], data) -> None:
    index = data.draw(st.integers(0, len(cart) - 1))
    what = data.draw(st.sampled_from(["quantity", "price", "variant_id"]))
    changed = [dict(item) for item in cart]
    if what == "quantity":
        changed[index]["quantity"] += data.draw(st.integers(1, 5))
    elif what == "price":
        changed[index]["price"] = Decimal(changed[index]["price"]) + Decimal("0.01")
    else:
        changed[index]["variant_id"] = "\x00new"  # no strategy draws this id
    assert cart_hash(changed) != cart_hash(cart)


def test_cart_hash_format_and_documented_encoding() -> None:
    cart = [
        {"variant_id": "v2", "quantity": 1, "price": "5"},
        {"variant_id": "v1", "quantity": 2, "price": Decimal("29.90")},
    ]
    digest = cart_hash(cart)
    assert len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)
    encoded = b'[["v1",2,"29.9"],["v2",1,"5"]]'
    assert digest == hashlib.sha256(encoded).hexdigest()


def test_cart_hash_normalizes_prices_and_ids() -> None:
    one = cart_hash([{"variant_id": 42, "quantity": 1, "price": "29.90"}])
    assert one == cart_hash([{"variant_id": "42", "quantity": 1, "price": Decimal("29.9")}])
    assert one == cart_hash([{"variant_id": 42, "quantity": 1, "price": " 29.900 "}])
    assert cart_hash([{"variant_id": 1, "quantity": 1, "price": 100}]) == cart_hash(
        [{"variant_id": 1, "quantity": 1, "price": Decimal("1E+2")}]
    )
    assert cart_hash([{"variant_id": 1, "quantity": 1, "price": "0.00"}]) == cart_hash(
        [{"variant_id": 1, "quantity": 1, "price": Decimal("-0")}]
    )


def test_cart_hash_ids_with_separators_cannot_collide() -> None:
    a = [{"variant_id": "a,1", "quantity": 1, "price": 1}]
    b = [
        {"variant_id": "a", "quantity": 1, "price": 1},
        {"variant_id": "1", "quantity": 1, "price": 1},
    ]
    c = [{"variant_id": 'a",1,"1', "quantity": 1, "price": 1}]
    assert len({cart_hash(a), cart_hash(b), cart_hash(c)}) == 3


def test_cart_hash_reads_attributes_and_ignores_other_fields() -> None:
    @dataclass
    class Line:
        variant_id: str
        quantity: int
        price: Decimal
        title: str = ""

    lines = [Line("v1", 2, Decimal("3.50"), "Socks"), Line("v2", 1, Decimal("10"), "Hat")]
    dicts = [
        {"variant_id": "v2", "quantity": 1, "price": 10, "title": "x"},
        {"variant_id": "v1", "quantity": 2, "price": "3.5"},
    ]
    assert cart_hash(lines) == cart_hash(dicts)
    assert cart_hash(iter(lines)) == cart_hash(lines)


@pytest.mark.parametrize(
    ("items", "error", "reason"),
    [
        ([], ValueError, "empty"),
        ([{"variant_id": "v", "quantity": 1, "price": 2.5}], TypeError, "float"),
        ([{"variant_id": "v", "quantity": 1, "price": True}], TypeError, "price"),
        ([{"variant_id": "v", "quantity": 1, "price": "abc"}], ValueError, "not a number"),
        ([{"variant_id": "v", "quantity": 1, "price": "NaN"}], ValueError, "finite"),
        ([{"variant_id": "v", "quantity": 0, "price": 1}], ValueError, "at least 1"),
        ([{"variant_id": "v", "quantity": 1.0, "price": 1}], TypeError, "quantity"),
        ([{"variant_id": "v", "quantity": True, "price": 1}], TypeError, "quantity"),
        ([{"variant_id": "v", "price": 1}], ValueError, "no quantity"),
        ([{"quantity": 1, "price": 1}], ValueError, "no variant_id"),
        ([{"variant_id": None, "quantity": 1, "price": 1}], TypeError, "variant_id"),
        ([{"variant_id": "", "quantity": 1, "price": 1}], ValueError, "empty"),
        (
            [
                {"variant_id": 7, "quantity": 1, "price": 1},
                {"variant_id": "7", "quantity": 2, "price": 1},
            ],
            ValueError,
            "twice",
        ),
        ({"variant_id": "v", "quantity": 1, "price": 1}, TypeError, "iterable of cart items"),
        ("v1", TypeError, "iterable of cart items"),
    ],
)
def test_cart_hash_refuses_ambiguous_carts(items: object, error: type, reason: str) -> None:
    with pytest.raises(error, match=reason):
        cart_hash(items)  # type: ignore[arg-type]


def test_cart_hash_fits_the_default_cart_mandate_key() -> None:
    digest = cart_hash([{"variant_id": "v1", "quantity": 1, "price": "9.99"}])
    key = retrysafe.IdempotencyMap.default().key(
        "cart_mandate", session_id="sess_abc123", cart_hash=digest
    )
    assert key == f"cart_mandate:sess_abc123:{digest}"


# -- intent_hash -------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(st.dictionaries(st.text(max_size=6), json_values, min_size=1, max_size=6))
def test_intent_hash_ignores_key_order(intent: dict) -> None:
    reversed_intent = dict(reversed(list(intent.items())))
    assert intent_hash(reversed_intent) == intent_hash(intent)
    assert len(intent_hash(intent)) == 64


def test_intent_hash_sees_values() -> None:
    intent = {"max_price": "100", "sku": "abc", "nested": {"b": 1, "a": 2}}
    same = {"nested": {"a": 2, "b": 1}, "sku": "abc", "max_price": "100"}
    assert intent_hash(intent) == intent_hash(same)
    assert intent_hash(intent) != intent_hash({**intent, "max_price": "101"})
    assert intent_hash(intent) == hashlib.sha256(retrysafe.canonical_json(intent)).hexdigest()


# -- UUID keys ---------------------------------------------------------------------


def test_uuid4_and_new_key() -> None:
    value = uuid.UUID(uuid4())
    assert value.version == 4 and value.variant == uuid.RFC_4122
    assert uuid.UUID(new_key()).version == 4
    assert uuid.UUID(new_key(7)).version == 7
    with pytest.raises(ValueError, match="4 or 7"):
        new_key(1)


def test_uuid7_layout() -> None:
    before = time.time_ns() // 1_000_000
    text = uuid7()
    after = time.time_ns() // 1_000_000
    value = uuid.UUID(text)
    assert text == str(value)  # lower-case, hyphenated
    assert value.version == 7 and value.variant == uuid.RFC_4122
    assert (value.int >> 76) & 0xF == 7 and (value.int >> 62) & 0b11 == 0b10
    assert before <= value.int >> 80 <= after + 1


def test_uuid7_is_strictly_increasing_across_threads() -> None:
    per_thread, threads = 4000, 8
    results: list[list[str]] = [[] for _ in range(threads)]
    shared: list[str] = []  # appended in the order the keys were made
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def work(out: list[str]) -> None:
        start.wait()
        for i in range(per_thread):
            if i % 2:
                out.append(uuid7())
            else:
                with lock:
                    shared.append(uuid7())

    workers = [threading.Thread(target=work, args=(out,)) for out in results]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for out in [*results, shared]:
        assert all(a < b for a, b in itertools.pairwise(out))
    everything = [key for out in results for key in out] + shared
    assert len(set(everything)) == per_thread * threads


def test_uuid7_survives_a_clock_step_back(monkeypatch: pytest.MonkeyPatch) -> None:
    first = uuid7()
    real = time.time_ns
    monkeypatch.setattr(keys.time, "time_ns", lambda: real() - 10 * 60 * 10**9)
    later = [uuid7() for _ in range(100)]
    assert first < later[0] and later == sorted(later) and len(set(later)) == 100


def test_uuid7_counter_overflow_advances_the_timestamp(monkeypatch: pytest.MonkeyPatch) -> None:
    frozen = time.time_ns()
    monkeypatch.setattr(keys.time, "time_ns", lambda: frozen)
    a = uuid7()
    keys._uuid7.counter = (1 << 42) - 1  # a state it can reach; left as is afterwards
    b = uuid7()
    assert a < b and (uuid.UUID(b).int >> 80) == (uuid.UUID(a).int >> 80) + 1


# -- checks ------------------------------------------------------------------------


def test_validate_key_is_the_package_one() -> None:
    assert validate_key is retrysafe.validate_key
    assert keys.__all__ == sorted(keys.__all__)
    assert is_valid_key("order-1") and is_valid_key("a b")
    for bad in ("", "x" * 256, "caf\u00e9", "a\nb", None, 42):
        assert not is_valid_key(bad)


def test_parse_uuid_key() -> None:
    v4, v7 = uuid4(), uuid7()
    assert parse_uuid_key(v4) == uuid.UUID(v4)
    assert parse_uuid_key(v7.upper()) == uuid.UUID(v7)
    assert str(parse_uuid_key(v7.upper())) == v7
    assert parse_uuid_key(v7, versions=(7,)).version == 7
    with pytest.raises(InvalidKeyError, match="not a version 7 UUID"):
        parse_uuid_key(v4, versions=[7])
    v1 = str(uuid.uuid1())
    with pytest.raises(InvalidKeyError, match=r"version 1, variant bits 10"):
        parse_uuid_key(v1)
    assert parse_uuid_key(v1, versions=(1,)).version == 1


@pytest.mark.parametrize(
    "key",
    [
        "",
        "order-1",
        "0190b6a27d3c7cc19d3e5f1a2b3c4d5e",  # no hyphens
        "{0190b6a2-7d3c-7cc1-9d3e-5f1a2b3c4d5e}",
        "urn:uuid:0190b6a2-7d3c-7cc1-9d3e-5f1a2b3c4d5e",
        "0190B6A2-7d3c-7cc1-9d3e-5f1a2b3c4d5e",  # mixed case
        " 0190b6a2-7d3c-7cc1-9d3e-5f1a2b3c4d5e",
        "0190b6a2-7d3c-7cc1-1d3e-5f1a2b3c4d5e",  # variant 0
        "0190b6a2-7d3c-7cc1-fd3e-5f1a2b3c4d5e",  # variant 111
        "00000000-0000-0000-0000-000000000000",  # nil
        "ffffffff-ffff-ffff-ffff-ffffffffffff",  # max
        "0190b6a2-7d3c-0cc1-9d3e-5f1a2b3c4d5e",  # version 0
        "0190b6a2-7d3c-7cc1-9d3e-5f1a2b3c4d5\u0435",  # Cyrillic e
        42,
    ],
)
def test_parse_uuid_key_refuses(key: object) -> None:
    with pytest.raises(InvalidKeyError):
        parse_uuid_key(key)


def test_parse_uuid_key_checks_its_versions_argument() -> None:
    for bad in ((), (9,), ("7",), (True,)):
        with pytest.raises(ValueError, match="versions"):
            parse_uuid_key(uuid4(), versions=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["order-42", "a b", "~" * 255])
def test_protocol_key_keeps_an_engine_key(key: str) -> None:
    assert protocol_key(key) == key


@pytest.mark.parametrize(
    "key", ["commande_é_42", "k" * 256, "k" * 1024, "🔑", "a\ttab", "\ud800", "sha256:" + "0" * 64]
)
def test_protocol_key_hashes_any_other_string(key: str) -> None:
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    assert protocol_key(key) == "sha256:" + digest
    assert validate_key(protocol_key(key)) == protocol_key(key)


def test_protocol_key_cannot_alias_a_hashed_key() -> None:
    hashed = protocol_key("commande_é_42")
    assert protocol_key(hashed) != hashed


@pytest.mark.parametrize(
    ("key", "reason"),
    [("", "empty"), ("k" * 1025, "1025 characters"), (42, "not int"), (None, "not NoneType")],
)
def test_protocol_key_refuses(key: object, reason: str) -> None:
    with pytest.raises(InvalidKeyError, match=reason):
        protocol_key(key)
    assert protocol_key("k" * 2000, limit=2000) == protocol_key("k" * 2000, limit=4000)
