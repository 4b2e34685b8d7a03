"""Compact JSON text, the way ``json.JSONEncoder.encode`` writes it, and the value of
a stored JSON body, the way ``json.loads`` reads it, with less work per call.

``JSONEncoder.encode`` builds a new C encoder (and a Python closure) on every call,
about a third of what encoding a small value costs. :func:`compact_encoder` builds
one C encoder once. That encoder keeps no table of the containers it is inside (a
table shared between calls would keep entries after an error), so a value that
contains itself recurses until Python's recursion limit; it is then encoded again
the standard way, which raises what ``encode`` raises ("Circular reference
detected"). Where the limit has been raised past :data:`_SAFE_LIMIT` every value is
encoded the standard way. The text is the same, byte for byte.
"""

from __future__ import annotations

import json
import json.encoder
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["compact_encoder", "json_bytes", "json_value"]

#: The highest recursion limit under which a value that contains itself reaches the
#: limit before the C stack runs out; above it, the standard encoder's table of open
#: containers finds the cycle instead (a raised limit crashed the process).
_SAFE_LIMIT = 10_000


def compact_encoder(
    *, sort_keys: bool = False, default: Callable[[Any], Any] | None = None
) -> Callable[[Any], str]:
    """``JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False,
    sort_keys=sort_keys, default=default).encode``, the same text faster."""
    standard = json.JSONEncoder(
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
        sort_keys=sort_keys,
        default=default,
    )
    checked = standard.encode
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - no C accelerator (another interpreter)
        return checked
    chunks = make(
        None,  # no table of open containers (see the module docstring)
        standard.default,
        json.encoder.encode_basestring,
        standard.indent,
        standard.key_separator,
        standard.item_separator,
        standard.sort_keys,
        standard.skipkeys,
        standard.allow_nan,
    )
    join = "".join
    limit = sys.getrecursionlimit

    def encode(value: Any) -> str:
        if limit() > _SAFE_LIMIT:  # a raised limit: a cycle could end the C stack first
            return checked(value)
        try:
            return join(chunks(value, 0))
        except RecursionError:
            return checked(value)  # a cycle: the standard error (or a genuinely deep value)

    return encode


_UTF8_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode
_ASCII_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def json_bytes(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON. Text that UTF-8 cannot carry (a lone
    surrogate that arrived as ``"\\ud800"`` and is sent on) is written with JSON's
    ``\\u`` escapes instead, as it came. Raises what ``json.dumps`` raises."""
    try:
        return _UTF8_JSON(value).encode()
    except UnicodeEncodeError:
        return _ASCII_JSON(value).encode()


_decoder = json.JSONDecoder()  # json.loads's own decoder has these (default) options
_scan: Callable[[str, int], tuple[Any, int]] = _decoder.scan_once  # type: ignore[attr-defined]
#: The first byte of a JSON text that is neither whitespace nor a byte-order mark.
_STARTS = frozenset(b'{["-0123456789tfn')


def json_value(data: bytes) -> Any:
    """``json.loads(data)``, with less work for a text that starts with its value and
    has nothing after it (as :func:`compact_encoder` writes). ``json.loads`` first
    guesses the encoding, then matches whitespace around the value with a regular
    expression twice: two thirds of reading a small value. Anything else (another
    encoding, whitespace, extra data, an error) is read by ``json.loads`` itself."""
    if data and data[0] in _STARTS and data[1:2] != b"\0":
        text = data.decode("utf-8", "surrogatepass")  # the encoding json.loads finds
        try:
            value, end = _scan(text, 0)
        except StopIteration:
            end = -1
        if end == len(text):
            return value
    return json.loads(data)
