"""Key validation, key hashing and request fingerprints."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime as _dt
import decimal
import hashlib
import importlib
import re
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from retrysafe._model.json_text import compact_encoder
from retrysafe.errors import InvalidKeyError

__all__ = [
    "MAX_KEY_LENGTH",
    "MAX_PROTOCOL_KEY_LENGTH",
    "canonical_json",
    "fingerprint",
    "is_key",
    "key_hash",
    "printable",
    "protocol_key",
    "validate_key",
]

MAX_KEY_LENGTH = 255
KEY_PATTERN = re.compile(r"[\x20-\x7e]{1,255}")


def is_key(key: object) -> bool:
    """Whether ``key`` is a valid idempotency key (what KEY_PATTERN matches), without a
    regular expression: the printable ASCII characters are exactly space to ``~``."""
    return (
        type(key) is str and 0 < len(key) <= MAX_KEY_LENGTH and key.isascii() and key.isprintable()
    )


def validate_key(key: object) -> str:
    """Return ``key`` if it is 1-255 characters of visible ASCII or space.

    Raises :class:`InvalidKeyError` (with a reason) for anything else.
    """
    if not isinstance(key, str):
        raise InvalidKeyError(f"idempotency key must be a str, not {type(key).__name__}")
    if KEY_PATTERN.fullmatch(key):
        return key
    if not key:
        raise InvalidKeyError("idempotency key is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKeyError(
            f"idempotency key is {len(key)} characters long; the limit is {MAX_KEY_LENGTH}"
        )
    bad = next(c for c in key if not " " <= c <= "~")
    raise InvalidKeyError(
        f"idempotency key contains {bad!r}: only visible ASCII characters and space are allowed"
    )


#: The longest key a protocol door (Mesh, A2A) accepts, in characters: those protocols
#: define the key as any string, so a door bounds it rather than refusing what the
#: spec allows.
MAX_PROTOCOL_KEY_LENGTH = 1024
#: The prefix of a hashed protocol key.
HASHED_KEY_PREFIX = "sha256:"


def protocol_key(value: object, limit: int = MAX_PROTOCOL_KEY_LENGTH) -> str:
    """The engine key for a key a protocol defines as any string (a Mesh
    idempotency key, an A2A messageId).

    A string of 1-``limit`` characters is accepted. One that is already a valid
    engine key (1-255 visible ASCII) is kept as it is, unless it starts with
    ``sha256:``; any other is stored as ``sha256:`` and the SHA-256 (hex) of its
    UTF-8 bytes, so no raw key can stand for a hashed one. Raises
    :class:`InvalidKeyError` for anything else, with the reason.
    """
    if type(value) is not str:
        raise InvalidKeyError(f"idempotency key must be a string, not {type(value).__name__}")
    if is_key(value) and not value.startswith(HASHED_KEY_PREFIX):
        return value
    if not value:
        raise InvalidKeyError("idempotency key is empty")
    if len(value) > limit:
        raise InvalidKeyError(
            f"idempotency key is {len(value)} characters long; the limit is {limit}"
        )
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
    return HASHED_KEY_PREFIX + digest


#: C0 and C1 control characters, DEL, and the invisible bidirectional controls that
#: reorder what a terminal shows.
_UNPRINTABLE = re.compile(
    r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with control characters shown as ``\\xNN`` or ``\\uNNNN`` escapes.

    For printing client input (keys, operations, headers) on a terminal: an
    ANSI escape sequence or a bidirectional override is shown, never obeyed.
    """
    return _UNPRINTABLE.sub(_escape, text)


def _builtin_sha256() -> Callable[[bytes], Any]:
    """The interpreter's own SHA-256 where it has one (CPython: ``_sha256`` on 3.11,
    ``_sha2`` after): for the few bytes of a key it costs a third less than OpenSSL's
    (no digest context to set up and clear). The same digest either way."""
    for name in ("_sha256", "_sha2"):
        with contextlib.suppress(ImportError, AttributeError):
            return importlib.import_module(name).sha256
    return hashlib.sha256  # pragma: no cover - a build without them


_sha256 = _builtin_sha256()

#: (scope, operation) -> the length-prefixed start of their key hashes' input.
_heads: dict[tuple[str, str], str] = {}
#: The most heads kept (scopes come from requests): past it, the dict starts again.
_MAX_HEADS = 4096
#: The longest head kept (the dict holds at most about 4096 x 2 x 512 characters).
_MAX_HEAD = 512


def key_hash(scope: str, operation: str, key: str) -> str:
    """SHA-256 (hex) over scope, operation and key, each length-prefixed.

    Two scopes (principals), two operations or two function versions never
    share a record, and no choice of parts can collide with another.
    """
    head = _heads.get((scope, operation))
    if head is None:
        head = f"{len(scope)}:{scope}{len(operation)}:{operation}"
        if len(head) <= _MAX_HEAD:  # a long one is made again each time, never kept
            if len(_heads) >= _MAX_HEADS:
                _heads.clear()
            _heads[scope, operation] = head
    return _sha256(f"{head}{len(key)}:{key}".encode()).hexdigest()


def json_default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=canonical_json)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$bytes": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, uuid.UUID)):
        return str(value)
    if isinstance(value, Mapping):
        return dict(value)
    dump = getattr(value, "model_dump", None)  # pydantic v2
    if callable(dump):
        return dump(mode="json")
    raise TypeError(
        f"cannot fingerprint a {type(value).__name__} (only JSON-like values, dataclasses, "
        "pydantic models, dates, decimals, UUIDs and bytes)"
    )


_CANONICAL = compact_encoder(sort_keys=True, default=json_default)


def canonical_json(value: Any) -> bytes:
    """Canonical JSON: sorted keys, no whitespace, UTF-8; tuples as lists.

    Equal data gives equal bytes whatever its key order.
    """
    return _CANONICAL(value).encode()


def fingerprint(*parts: Any) -> str:
    """SHA-256 (hex) of the canonical JSON of ``parts``."""
    return _sha256(canonical_json(list(parts))).hexdigest()
