"""Operations: a key template, its scope, TTL, lease and retention, validated when built."""

from __future__ import annotations

import decimal
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from string import Formatter
from typing import Any

from retrysafe._core.engine import DEFAULT_LEASE, DEFAULT_TTL, Engine
from retrysafe._map.checks import (
    FIELD_NAME,
    OPERATION_NAME,
    boolean,
    duration,
    kind,
    string,
    suggest,
)
from retrysafe._model.duration import format_duration
from retrysafe._model.hashing import MAX_KEY_LENGTH, validate_key
from retrysafe._model.record import FINANCIAL, RETENTIONS, STANDARD
from retrysafe.errors import InvalidKeyError, MapError

__all__ = ["Operation", "default_operations", "plain_decimal"]

_SCOPE = re.compile(r"[a-z_]+")
_VISIBLE = re.compile(r"[!-~]*")


def plain_decimal(value: decimal.Decimal) -> str | None:
    """``value`` written out exactly, without exponent or trailing zeros.

    ``29.90`` → ``29.9``, ``1E+2`` → ``100``, ``-0`` → ``0``. None if it is not
    finite or would be over 300 digits long.
    """
    if not value.is_finite():
        return None
    exponent = value.as_tuple().exponent
    assert isinstance(exponent, int)
    if len(value.as_tuple().digits) + abs(exponent) > 300:
        return None
    text = format(value, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


# -- key templates -----------------------------------------------------------------


def _template(template: Any) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """Check a key template; return (literals, fields, separators).

    ``literals`` has one more entry than ``fields``: the key is
    ``literals[0] + value0 + literals[1] + … + literals[-1]``. The separators are
    the punctuation characters right next to a field; values may not contain
    them, and two fields must be separated by one, so a key splits back into
    its values in exactly one way.
    """
    if not isinstance(template, str):
        raise MapError(f"key template must be a string, not {kind(template)}", field=("key",))

    def bad(why: str) -> MapError:
        return MapError(f"bad key template {template!r}: {why}", field=("key",))

    try:
        parsed = list(Formatter().parse(template))
    except ValueError as error:
        raise bad(str(error)) from None
    literals: list[str] = [""]
    fields: list[str] = []
    for literal, name, spec, conversion in parsed:
        if "{" in literal or "}" in literal:
            raise bad("literal braces ({{ or }}) are not allowed in a key")
        literals[-1] += literal
        if name is None:
            continue
        shown = (
            "{"
            + name
            + (f"!{conversion}" if conversion else "")
            + (f":{spec}" if spec else "")
            + "}"
        )
        if name == "" or name.isdigit():
            raise bad(f"{shown} is positional; name every field, such as {{order_id}}")
        if "." in name or "[" in name:
            raise bad(
                f"{shown} uses attribute or index access; use a plain name such as {{order_id}}"
            )
        if not FIELD_NAME.fullmatch(name):
            raise bad(f"{shown} is not a valid field name (letters, digits and _)")
        if conversion:
            raise bad(f"{shown} has a conversion (!{conversion}); conversions are not allowed")
        if spec:
            raise bad(f"{shown} has a format spec (:{spec}); format specs are not allowed")
        if name in fields:
            raise bad(f"field {{{name}}} appears twice")
        fields.append(name)
        literals.append("")
    if not fields:
        raise bad("it has no {field}, so every request would share one key")
    for literal in literals:
        if not _VISIBLE.fullmatch(literal):
            odd = next(c for c in literal if not "!" <= c <= "~")
            raise bad(f"it contains {odd!r}; keys are visible ASCII without spaces")
    separators: set[str] = set()
    for i, literal in enumerate(literals):
        if i > 0 and literal and not literal[0].isalnum():
            separators.add(literal[0])
        if i < len(fields) and literal and not literal[-1].isalnum():
            separators.add(literal[-1])
    for i in range(1, len(fields)):
        middle = literals[i]
        if not (middle and (middle[0] in separators or middle[-1] in separators)):
            raise bad(
                f"fields {{{fields[i - 1]}}} and {{{fields[i]}}} must be separated by "
                "punctuation such as ':', or their values could run together"
            )
    if sum(map(len, literals)) + len(fields) > MAX_KEY_LENGTH:
        raise bad(f"its keys would be over {MAX_KEY_LENGTH} characters long")
    return tuple(literals), tuple(fields), "".join(sorted(separators))


def _value_class(separators: str) -> str:
    """A regex character class: visible ASCII except braces and ``separators``."""
    excluded = "".join(f"\\x{ord(c):02x}" for c in sorted(set(separators) | {"{", "}"}))
    return f"[^\\x00-\\x20\\x7f-\\U0010ffff{excluded}]"


@dataclass(frozen=True)
class Operation:
    """One kind of idempotent operation: how its key is built and how long it is kept.

    ``key`` is a template such as ``"payment:{order_id}:{amount}"`` (plain named
    fields only). ``scope`` documents what the key is unique within (``user``,
    ``order``, …; it is not the engine's principal scope). ``ttl`` and ``lease``
    are seconds or duration text (``"7d"``); ``lease`` may not exceed ``ttl``.
    ``retention`` is ``"standard"`` or ``"financial"`` (archived before deletion).
    Raises :class:`MapError` for any invalid value.
    """

    name: str
    _: KW_ONLY
    key: str
    scope: str
    ttl: float = DEFAULT_TTL
    lease: float = DEFAULT_LEASE
    final_failures: bool = False
    retention: str = STANDARD
    description: str = ""
    _literals: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _fields: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _separators: str = field(init=False, repr=False, compare=False)
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _value_re: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _field_set: frozenset[str] = field(init=False, repr=False, compare=False)
    _format: Callable[..., str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not OPERATION_NAME.fullmatch(self.name):
            raise MapError(
                f"operation name must be a letter then up to 99 letters, digits, '_', '.' "
                f"or '-', not {self.name!r}",
                field=("name",),
            )
        literals, fields, separators = _template(self.key)
        scope = string(self.scope, "scope")
        if not _SCOPE.fullmatch(scope):
            raise MapError(
                f"must be a lower-case word such as user, order or session, not {scope!r}",
                field=("scope",),
            )
        ttl = duration(self.ttl, "ttl")
        lease = duration(self.lease, "lease")
        if lease > ttl:
            raise MapError(
                f"lease ({format_duration(lease)}) must not be longer than ttl "
                f"({format_duration(ttl)})",
                field=("lease",),
            )
        boolean(self.final_failures, "final_failures")
        if self.retention not in RETENTIONS:
            raise MapError(
                f"must be one of {', '.join(map(repr, RETENTIONS))}, not {self.retention!r}"
                + suggest(str(self.retention), RETENTIONS),
                field=("retention",),
            )
        string(self.description, "description")
        value = _value_class(separators)
        pattern = "".join(
            re.escape(literal) + (f"(?P<{name}>{value}+)" if name else "")
            for literal, name in zip(literals, (*fields, None), strict=True)
        )
        setter = object.__setattr__
        setter(self, "ttl", ttl)
        setter(self, "lease", lease)
        setter(self, "_literals", literals)
        setter(self, "_fields", fields)
        setter(self, "_separators", separators)
        setter(self, "_regex", re.compile(pattern))
        setter(self, "_value_re", re.compile(f"{value}+"))
        setter(self, "_field_set", frozenset(fields))
        # Templates hold no literal braces, so "{}" placeholders are safe.
        setter(self, "_format", "{}".join(literals).format)

    @property
    def fields(self) -> tuple[str, ...]:
        """The template's field names, in order."""
        return self._fields

    @property
    def separators(self) -> str:
        """The characters a field value may not contain (besides braces)."""
        return self._separators

    def engine(self, store: Any = None, **options: Any) -> Engine:
        """An :class:`Engine` with this operation's ttl, lease, final_failures and retention.

        ``store`` and any other ``options`` (``wait``, ``clock``, …) go to the engine.
        """
        settings: dict[str, Any] = {
            "ttl": self.ttl,
            "lease": self.lease,
            "final_failures": self.final_failures,
            "retention": self.retention,
        }
        settings.update(options)
        return Engine(store, **settings)

    def build(self, **values: Any) -> str:
        """The key for ``values`` (see :meth:`IdempotencyMap.key`)."""
        return self._build(values)

    def _build(self, values: dict[str, Any]) -> str:
        # Fill the template, then check the whole key with one regex: it must
        # parse back to exactly these values (no separator, brace, space or
        # other character that would make it ambiguous or invalid).
        if values.keys() != self._field_set:
            raise self._fields_error(values)
        fields = self._fields
        texts = list(map(values.__getitem__, fields))
        for i, value in enumerate(texts):
            if type(value) is not str:
                texts[i] = self._text(fields[i], value)
        key = self._format(*texts)
        found = self._regex.fullmatch(key)
        if found is None or found.groups() != tuple(texts):
            for name, text in zip(fields, texts, strict=True):
                self._check(name, text)
            raise InvalidKeyError(f"{self.name} key {key!r} does not parse back to its values")
        if len(key) > MAX_KEY_LENGTH:
            validate_key(key)  # raises with the length
        return key

    def _fields_error(self, values: Mapping[str, Any]) -> InvalidKeyError:
        fields = self._fields
        problems = []
        missing = [name for name in fields if name not in values]
        if missing:
            problems.append("missing " + ", ".join(missing))
        extra = [name for name in values if name not in fields]
        if extra:
            problems.append("unexpected " + ", ".join(extra))
        return InvalidKeyError(
            f"{self.name} key {self.key!r}: {'; '.join(problems)} (it takes {', '.join(fields)})"
        )

    def _text(self, name: str, value: Any) -> str:
        """A field value as key text: str, int, Decimal (plain, normalized) or UUID."""
        if type(value) is int:
            return str(value)
        if isinstance(value, decimal.Decimal):
            plain = plain_decimal(value)
            if plain is None:
                raise InvalidKeyError(f"{self.name} key field {name} is {value}: not a key part")
            return plain
        if isinstance(value, uuid.UUID):
            return str(value)
        if isinstance(value, str):
            return str.__str__(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return int.__repr__(value)
        if isinstance(value, float):
            raise InvalidKeyError(
                f"{self.name} key field {name} is a float ({value!r}): floats round, and a "
                "rounded amount makes a different key; pass an int (minor units), a "
                "Decimal or a str"
            )
        raise InvalidKeyError(
            f"{self.name} key field {name} is a {type(value).__name__}; pass a str, an "
            "int, a Decimal or a UUID"
        )

    def _check(self, name: str, text: str) -> None:
        """Raise :class:`InvalidKeyError` saying why ``text`` cannot be a field value."""
        if self._value_re.fullmatch(text):
            return
        if not text:
            raise InvalidKeyError(f"{self.name} key field {name} is empty")
        odd = next(c for c in text if c in self._separators or c in "{}" or not "!" <= c <= "~")
        if odd in self._separators:
            why = f"the separator {odd!r} of {self.key!r}, so the key would be ambiguous"
        elif odd in "{}":
            why = f"{odd!r}; braces are not allowed in keys"
        else:
            why = f"{odd!r}; keys are visible ASCII without spaces"
        raise InvalidKeyError(f"{self.name} key field {name} ({text!r}) contains {why}")

    def parse(self, key: str) -> dict[str, str]:
        """The field values of a client's ``key``; :class:`InvalidKeyError` if it does not fit."""
        match = self._regex.fullmatch(key) if isinstance(key, str) else None
        if match is None:
            validate_key(key)
            shown = key if len(key) <= 80 else key[:77] + "..."
            raise InvalidKeyError(
                f"idempotency key {shown!r} does not match the {self.name} key format {self.key!r}"
            )
        return match.groupdict()

    def to_dict(self) -> dict[str, Any]:
        """The operation as plain data (durations in seconds), without its name."""
        data: dict[str, Any] = {
            "key": self.key,
            "scope": self.scope,
            "ttl": self.ttl,
            "lease": self.lease,
            "final_failures": self.final_failures,
            "retention": self.retention,
        }
        if self.description:
            data["description"] = self.description
        return data


# -- the agentic-commerce idempotency map -------------------------------------------


def default_operations() -> tuple[Operation, ...]:
    """The operations of the agentic-commerce idempotency map (see IdempotencyMap.default)."""
    day, week = 24 * 3600.0, 7 * 24 * 3600.0
    return (
        Operation(
            "session",
            key="session:{user_id}:{timestamp}:{nonce}",
            scope="user",
            ttl=day,
            description="Session creation",
        ),
        Operation(
            "session_token",
            key="session:{user_id}:{device_id}:{timestamp}",
            scope="user",
            ttl=day,
            description="Session token generation: one per user and device (a retry gets the "
            "existing token, not a new session)",
        ),
        Operation(
            "session_update",
            key="session_update:{session_id}:{operation_type}:{sequence_number}",
            scope="session",
            ttl=day,
            description="Session state update (cart, preferences); the sequence number "
            "increases monotonically, and refusing an earlier one than the last processed "
            "is the application's check",
        ),
        Operation(
            "cart_mandate",
            key="cart_mandate:{session_id}:{cart_hash}",
            scope="session",
            ttl=30 * 60.0,
            description="Cart mandate: the user's commitment to these items at these prices "
            "(expires after 30 minutes to prevent stale pricing)",
        ),
        Operation(
            "intent_mandate",
            key="intent_mandate:{user_id}:{intent_hash}",
            scope="user",
            ttl=day,
            description="Intent mandate",
        ),
        Operation(
            "payment",
            key="payment:{order_id}:{amount}:{currency}:{timestamp}",
            scope="order",
            ttl=week,
            retention=FINANCIAL,
            description="Payment transaction (pass the same key to the payment gateway)",
        ),
        Operation(
            "order",
            key="order:{cart_mandate_id}:{user_id}",
            scope="cart",
            ttl=week,
            retention=FINANCIAL,
            description="Order creation, exactly once per cart mandate (kept like a payment: "
            "an order commits money)",
        ),
        Operation(
            "webhook",
            key="webhook:{source}:{event_id}",
            scope="event",
            ttl=day,
            description="Webhook processing (Shopify: X-Shopify-Event-Id)",
        ),
        Operation(
            "payment_webhook",
            key="webhook:{gateway}:{transaction_id}:{event_type}",
            scope="event",
            ttl=day,
            description="Payment gateway webhook (payment.succeeded, payment.failed, "
            "refund.processed)",
        ),
        Operation(
            "sync",
            key="sync:{entity}:{entity_id}:{version}",
            scope="entity",
            ttl=day,
            description="Data synchronization",
        ),
        Operation(
            "user_sync",
            key="sync:user:{user_id}:{version}:{timestamp}",
            scope="user",
            ttl=day,
            description="User data sync (optimistic locking by version)",
        ),
    )
