"""Helpers to make and check idempotency keys.

- :func:`cart_hash` and :func:`intent_hash`: the content hashes of the
  ``cart_mandate:{session_id}:{cart_hash}`` and
  ``intent_mandate:{user_id}:{intent_hash}`` keys of the agentic-commerce
  idempotency map.
- :func:`uuid4`, :func:`uuid7` and :func:`new_key`: random keys for clients.
- :func:`validate_key`, :func:`is_valid_key` and :func:`parse_uuid_key`: checks
  for servers.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from retrysafe._map.operations import plain_decimal
from retrysafe._model.hashing import canonical_json, validate_key
from retrysafe.errors import InvalidKeyError

__all__ = [
    "cart_hash",
    "intent_hash",
    "is_valid_key",
    "new_key",
    "parse_uuid_key",
    "uuid4",
    "uuid7",
    "validate_key",
]


# -- content hashes ----------------------------------------------------------------


def _item_field(item: Any, name: str, index: int) -> Any:
    if isinstance(item, Mapping):
        if name in item:
            return item[name]
    elif hasattr(item, name):
        return getattr(item, name)
    raise ValueError(f"cart item {index} has no {name}")


def _price(value: Any, index: int) -> str:
    if isinstance(value, float):
        raise TypeError(
            f"cart item {index}: price is a float ({value!r}); floats round, so equal prices "
            "could hash differently: pass a str, an int (minor units) or a Decimal"
        )
    if isinstance(value, bool) or not isinstance(value, (str, int, Decimal)):
        raise TypeError(
            f"cart item {index}: price must be a str, an int or a Decimal, "
            f"not {type(value).__name__}"
        )
    try:
        number = Decimal(value.strip()) if isinstance(value, str) else Decimal(value)
    except InvalidOperation:
        raise ValueError(f"cart item {index}: price {value!r} is not a number") from None
    text = plain_decimal(number)
    if text is None:
        raise ValueError(f"cart item {index}: price {value!r} is not a finite, sensible number")
    return text


def cart_hash(items: Iterable[Any]) -> str:
    """SHA-256 (64 lower-case hex digits) of a cart's variant ids, quantities and prices.

    Each item is a mapping or an object with ``variant_id`` (str or int),
    ``quantity`` (a positive int) and ``price`` (str, int or Decimal; floats are
    refused with ``TypeError``); other fields are ignored. The hash is of the
    canonical JSON ``[[variant_id, quantity, price], ...]`` sorted by variant id,
    with the id as a string and the price as a plain decimal string
    (``"29.90"`` → ``"29.9"``), so the order of the items does not matter and
    no choice of ids can collide with another cart. Raises ``ValueError`` for
    an empty cart, a missing field, a repeated variant id or a bad quantity.
    """
    if isinstance(items, (str, bytes, Mapping)):
        raise TypeError("items must be an iterable of cart items, not a single value")
    rows: dict[str, list[Any]] = {}
    for index, item in enumerate(items):
        variant = _item_field(item, "variant_id", index)
        if isinstance(variant, bool) or not isinstance(variant, (str, int)):
            raise TypeError(
                f"cart item {index}: variant_id must be a str or an int, "
                f"not {type(variant).__name__}"
            )
        variant = str(variant)
        if not variant:
            raise ValueError(f"cart item {index}: variant_id is empty")
        quantity = _item_field(item, "quantity", index)
        if isinstance(quantity, bool) or not isinstance(quantity, int):
            raise TypeError(
                f"cart item {index}: quantity must be an int, not {type(quantity).__name__}"
            )
        if quantity < 1:
            raise ValueError(f"cart item {index}: quantity must be at least 1, not {quantity}")
        price = _price(_item_field(item, "price", index), index)
        if variant in rows:
            raise ValueError(
                f"cart item {index}: variant {variant!r} appears twice; merge the lines "
                "into one with the total quantity"
            )
        rows[variant] = [variant, int(quantity), price]
    if not rows:
        raise ValueError("the cart is empty")
    return hashlib.sha256(canonical_json([rows[v] for v in sorted(rows)])).hexdigest()


def intent_hash(intent: Any) -> str:
    """SHA-256 (64 hex digits) of ``canonical_json(intent)``: key order does not matter."""
    return hashlib.sha256(canonical_json(intent)).hexdigest()


# -- random keys -------------------------------------------------------------------


def uuid4() -> str:
    """A random (version 4) UUID, lower-case and hyphenated."""
    return str(uuid.uuid4())


_COUNTER_MAX = (1 << 42) - 1


class _UUID7:
    """RFC 9562 version 7 UUIDs, strictly increasing within the process.

    Layout: 48-bit Unix time in ms, version 7, a 42-bit counter (the 12 bits
    of ``rand_a`` and the top 30 of ``rand_b``, RFC 9562 §6.2 method 1), the
    variant ``10`` and 32 random bits. A new millisecond seeds the counter with
    41 random bits; within a millisecond (or if the clock steps back) the
    counter goes up by one, and when it overflows the timestamp is advanced.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.last_ms = -1
        self.counter = 0
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self.lock = threading.Lock()  # a thread of the parent may have held it

    def __call__(self) -> str:
        with self.lock:
            now = time.time_ns() // 1_000_000
            if now > self.last_ms:
                self.last_ms = now
                self.counter = int.from_bytes(os.urandom(6)) >> 7  # 41 bits
            else:
                self.counter += 1
                if self.counter > _COUNTER_MAX:
                    self.last_ms += 1
                    self.counter = int.from_bytes(os.urandom(6)) >> 7
            ms, counter = self.last_ms, self.counter
        value = (
            (ms & 0xFFFF_FFFF_FFFF) << 80
            | 0x7 << 76
            | (counter >> 30) << 64
            | 0b10 << 62
            | (counter & 0x3FFF_FFFF) << 32
            | int.from_bytes(os.urandom(4))
        )
        return str(uuid.UUID(int=value))


_uuid7 = _UUID7()


def uuid7() -> str:
    """A time-ordered (version 7) UUID, lower-case; strictly increasing within the process.

    Thread-safe. Keys made later sort later, which keeps B-tree indexes of
    keys compact.
    """
    return _uuid7()


def new_key(version: int = 4) -> str:
    """A fresh key: a version 4 (random) or version 7 (time-ordered) UUID."""
    if version == 4:
        return uuid4()
    if version == 7:
        return uuid7()
    raise ValueError(f"version must be 4 or 7, not {version!r}")


# -- checks ------------------------------------------------------------------------


def is_valid_key(key: object) -> bool:
    """Whether ``key`` is 1-255 characters of visible ASCII or space."""
    try:
        validate_key(key)
    except InvalidKeyError:
        return False
    return True


_UUID_RE = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    r"|[0-9A-F]{8}-[0-9A-F]{4}-[0-9A-F]{4}-[0-9A-F]{4}-[0-9A-F]{12}"
)


def parse_uuid_key(key: object, versions: Iterable[int] = (4, 7)) -> uuid.UUID:
    """The UUID in ``key``; :class:`InvalidKeyError` unless it is a UUID of an allowed version.

    The key must be the hyphenated form, all lower-case or all upper-case, with
    the RFC 9562 variant. ``str()`` of the result is the lower-case form, the
    one to store so that a retry in the other case finds the same record.
    """
    allowed = tuple(versions)
    if not allowed or not all(type(v) is int and 1 <= v <= 8 for v in allowed):
        raise ValueError(f"versions must be UUID versions 1-8, not {allowed!r}")
    names = " or ".join(map(str, allowed))
    if not isinstance(key, str) or not _UUID_RE.fullmatch(key):
        valid = validate_key(key)
        shown = valid if len(valid) <= 60 else valid[:57] + "..."
        raise InvalidKeyError(
            f"idempotency key {shown!r} is not a UUID: send a hyphenated version {names} "
            "UUID such as 0190b6a2-7d3c-7cc1-9d3e-5f1a2b3c4d5e"
        )
    value = uuid.UUID(key)
    if value.variant != uuid.RFC_4122 or value.version not in allowed:
        raise InvalidKeyError(
            f"idempotency key {key!r} is not a version {names} UUID "
            f"(version {(value.int >> 76) & 0xF}, variant bits {value.int >> 62 & 0b11:02b})"
        )
    return value
