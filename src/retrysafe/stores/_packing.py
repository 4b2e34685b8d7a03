"""Packers of record values shared by the stores: hex digests and tokens as their
bytes, canonical UUID keys, principal scopes and an answer's headers. Each reads
back exactly the text it was given; docs/stores.md gives the layouts that use them."""

from __future__ import annotations

from retrysafe._model.record import Outcome, Status

__all__ = [
    "COMPLETED",
    "FAILED",
    "PROCESSING",
    "STATUSES",
    "pack_headers",
    "pack_hex",
    "pack_key",
    "pack_scope",
    "tagged_token",
    "unheaders",
    "unkey",
    "unscope",
    "untag_token",
]

#: A record's status as the SQL stores keep it: a code (SQLite stores 0 and 1 in no
#: bytes at all), and the status of each code.
PROCESSING, COMPLETED, FAILED = 0, 1, 2
STATUSES = (Status.PROCESSING, Status.COMPLETED, Status.FAILED)

_MAX_HEX_TOKEN = 1024
_fromhex = bytes.fromhex


def pack_hex(text: str) -> str | bytearray:
    """Even-length lowercase hex (a SHA-256 digest, say) as its bytes; any other text
    as it is (reads back the same either way)."""
    if text and not len(text) & 1:
        try:
            packed = bytearray.fromhex(text)
        except ValueError:
            return text
        if packed.hex() == text:
            return packed
    return text


def pack_key(key: str) -> str | bytearray:
    """A lowercase canonical UUID as its 16 bytes; any other key as it is."""
    if len(key) == 36 and key[8] == key[13] == key[18] == key[23] == "-":
        packed = pack_hex(key.replace("-", ""))
        if type(packed) is bytearray and len(packed) == 16:
            return packed
    return key


def unkey(value: str | bytes) -> str:
    if type(value) is not bytes:
        return value  # type: ignore[return-value]
    h = value.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


#: The principal kinds of retrysafe's scopes, each stored as one byte below 0x20.
_KINDS = ("", "credentials", "user", "principal", "public")
_KIND_CODES = {kind: code for code, kind in enumerate(_KINDS) if kind}


def pack_scope(scope: str) -> str | bytearray:
    """``kind:hex`` (a principal's scope) as the kind's code and the bytes, or as
    ``kind:`` and the bytes for another kind (one not starting with a control
    character); other scopes as they are."""
    kind, colon, digits = scope.partition(":")
    if colon and kind.isascii():
        packed = pack_hex(digits)
        if type(packed) is bytearray:
            code = _KIND_CODES.get(kind)
            if code is not None:
                return bytearray((code,)) + packed
            if not kind or kind[0] >= " ":
                return bytearray(kind, "ascii") + b":" + packed
    return scope


def unscope(value: str | bytes) -> str:
    if type(value) is not bytes:
        return value  # type: ignore[return-value]
    if value[0] < 0x20:
        return f"{_KINDS[value[0]]}:{value[1:].hex()}"
    kind, _, packed = value.partition(b":")
    return f"{kind.decode()}:{packed.hex()}"


#: Names that stand for a header the answer's other columns give: ``content-type``
#: equal to the media type, ``content-length`` equal to the body's length (each with an
#: empty value in the text).
_TYPE_MARK, _LENGTH_MARK = "\x01", "\x02"
_MARKS = (_TYPE_MARK, _LENGTH_MARK)


def pack_headers(headers: tuple[tuple[str, str], ...], media: str, body: bytes) -> str | None:
    """Names and values joined by NUL, ``content-type`` and ``content-length`` as a mark
    when the media type and body give them; JSON pairs when a name or value holds a
    NUL, a name is a mark or the first name begins with ``[``; NULL for none."""
    if not headers:
        return None
    parts: list[str] = []
    for name, value in headers:
        if name in _MARKS:
            return Outcome(headers=headers).headers_json()
        if name == "content-type" and value == media:
            parts += (_TYPE_MARK, "")
        elif name == "content-length" and value == str(len(body)):
            parts += (_LENGTH_MARK, "")
        else:
            parts += (name, value)
    try:
        text = "\0".join(parts)
    except TypeError:  # not str: JSON keeps what it can, as before
        return Outcome(headers=headers).headers_json()
    if text.count("\0") != len(parts) - 1 or parts[0].startswith("["):
        return Outcome(headers=headers).headers_json()
    return text


def unheaders(text: str | None, media: str, body: bytes) -> tuple[tuple[str, str], ...]:
    if not text:
        return ()
    if text[0] == "[":
        return Outcome.parse_headers(text)
    parts = text.split("\0")
    names = parts[::2]
    if _TYPE_MARK in names or _LENGTH_MARK in names:
        names = [
            "content-type"
            if name == _TYPE_MARK
            else "content-length"
            if name == _LENGTH_MARK
            else name
            for name in names
        ]
        values = [
            media if name == _TYPE_MARK else str(len(body)) if name == _LENGTH_MARK else value
            for name, value in zip(parts[::2], parts[1::2], strict=True)
        ]
        return tuple(zip(names, values, strict=True))
    return tuple(zip(names, parts[1::2], strict=True))


def tagged_token(token: str) -> bytes:
    """A fencing token as Redis layout 2 and PostgreSQL schema v3 store it: lowercase
    hex of up to 1,024 digits (what the engine makes) as its bytes after 0 (even
    length) or 1 (odd: a leading 0 digit added); any other token as its UTF-8, after
    byte 2 if it starts with byte 0, 1 or 2."""
    n = len(token)
    if 0 < n <= _MAX_HEX_TOKEN:
        digits = "0" + token if n & 1 else token
        try:
            raw = _fromhex(digits)
        except ValueError:
            pass
        else:
            if raw.hex() == digits:  # not uppercase, no whitespace
                return (b"\x01" if n & 1 else b"\x00") + raw
    raw = token.encode()
    return b"\x02" + raw if raw[:1] in (b"\x00", b"\x01", b"\x02") else raw


def untag_token(raw: bytes) -> str:
    """Inverse of :func:`tagged_token`."""
    form = raw[0] if raw else 3
    if form == 0:
        return raw[1:].hex()
    if form == 1:
        return raw[1:].hex()[1:]
    if form == 2:
        return raw[1:].decode()
    return raw.decode()
