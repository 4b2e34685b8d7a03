"""The Redis record codec: a record as one string, and back (layout in docs/stores.md)."""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Sequence
from typing import Any

from retrysafe._model.record import FINANCIAL, STANDARD, Outcome, Record, Status
from retrysafe.errors import StoreUnavailableError
from retrysafe.stores._packing import tagged_token, untag_token

__all__ = ["HEAD", "HEADER", "LAYOUT_VERSION", "LENGTHS", "record_from_value"]

#: What decoding a value that is not a well-formed record raises (another program's
#: key, a truncated or corrupt value): struct.error, IndexError, KeyError, ValueError
#: (UnicodeDecodeError, json.JSONDecodeError, a wrong field count), TypeError.
_MALFORMED: tuple[type[BaseException], ...] = (
    struct.error,
    IndexError,
    KeyError,
    ValueError,
    TypeError,
)

# -- layout --------------------------------------------------------------------------

#: First byte of every record this code writes; a new layout gets a new version.
LAYOUT_VERSION = b"3"
#: The versions this code reads: 1 (written before the compact fields), 2 (before
#: the short header and the 16-byte UUID keys and scope digests) and 3.
LAYOUT_VERSIONS = (b"1", b"2", b"3")
#: The fixed part of a record of versions 1 and 2 (docs/stores.md, "Redis layout").
HEADER = struct.Struct(">cIddd?c?ddIII")
#: Version 3's: the first 40 bytes of HEADER (a has-completed byte of 0, 1 or 2),
#: then completed_at only when that byte is 1, then the lengths LENGTHS.
HEAD = struct.Struct(">cIddd?cBd")
#: Version 3's lengths: token, fingerprint (one byte each) and claim blob (uint16).
LENGTHS = struct.Struct(">BBH")

_FIXED = HEADER.size  # 60
_HEAD = HEAD.size  # 40
#: A completed_at equal to updated_at (what complete writes), not stored again.
_SAME = 2
_DONE = struct.Struct(">cBd")  # complete: status, has completed_at (_SAME), updated_at
_FAILED = struct.Struct(">?c")  # fail: final, status
_DOUBLE = struct.Struct(">d")

_STATUS_BYTE: dict[Status, bytes] = {
    Status.PROCESSING: b"p",
    Status.COMPLETED: b"c",
    Status.FAILED: b"f",
}
_STATUS: dict[bytes, Status] = {v: k for k, v in _STATUS_BYTE.items()}
_TOOK: tuple[Status | None, ...] = (None, Status.PROCESSING, Status.FAILED, None)

# -- encoding ------------------------------------------------------------------------

_MAX_PEXPIRE_MS = 10**15  # ~31,000 years; keeps PX far from its overflow error
#: The flags character of a claim blob: chr(0x30 + flags), so bits 1, 2 and 4 keep
#: the digits "0"-"7" of records written before bit 8 (financial) existed; bits 16
#: and 32 (version 3) make "@" to "o".
_FLAG_CHARS = "".join(chr(0x30 + i) for i in range(64))
_UUID_KEY = 16
_SCOPE_DIGEST = 32
_HEX32 = re.compile("[0-9a-f]{32}")
_UUID = re.compile("[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_encode_json = json.JSONEncoder(separators=(",", ":")).encode
_encode_meta = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode  # metadata_json
_CACHE_MAX = 256
_HEX64 = re.compile("[0-9a-f]{64}")
#: The compact outcome prefix: a marker byte (JSON prefixes start with "["), the
#: status (uint16; 0xFFFF for None), then the media type and the headers. Marker 2
#: (version 3) has the status in one byte instead, less 100 (statuses 100-355);
#: marker 3 (version 3) none at all: the status is None.
_COMPACT = 1
_COMPACT_HEAD = struct.Struct(">BH")
_SHORT = 2
_NONE = 3
_NO_STATUS = 0xFFFF
_U16 = struct.Struct(">H")
#: Media types stored as one byte (0 means "spelled out").
_MEDIA_TYPES = ("", "application/json", "application/octet-stream", "text/plain; charset=utf-8")
_MEDIA_CODE = {m: i for i, m in enumerate(_MEDIA_TYPES) if m}
#: Outcome prefixes (JSON + NUL) of header-less outcomes by (status, media type), and
#: back: the common ones (``Outcome.json``, a bare 200) are a dict lookup each way.
_PREFIX_OF: dict[tuple[int | None, str], bytes] = {}
_PREFIX: dict[bytes, tuple[int | None, str]] = {}


def _ttl_ms(expires_at: float, now: float) -> int:
    """Physical TTL in ms for PX (at least 1); 0 means "no TTL" (infinite)."""
    delta = (expires_at - now) * 1000.0
    if 1.0 <= delta <= _MAX_PEXPIRE_MS:
        return math.ceil(delta)
    if not math.isfinite(delta):
        return 0 if delta > 0 else 1
    return min(max(1, math.ceil(delta)), _MAX_PEXPIRE_MS)


_stored_token = tagged_token  # the names the Redis store and the tests import
_read_token = untag_token


def _stored_fingerprint(fingerprint: str) -> bytes:
    """A fingerprint as version 2 stores it: NUL and 32 bytes for 64 lowercase hex
    digits (a SHA-256), else its UTF-8, escaped by a leading SOH if it starts with
    NUL or SOH."""
    if len(fingerprint) == 64 and _HEX64.fullmatch(fingerprint):
        return b"\x00" + bytes.fromhex(fingerprint)
    raw = fingerprint.encode()
    return b"\x01" + raw if raw[:1] in (b"\x00", b"\x01") else raw


def _read_fingerprint(raw: bytes) -> str:
    """Inverse of :func:`_stored_fingerprint`."""
    if raw[:1] == b"\x00" and len(raw) == 33:
        return raw[1:].hex()
    if raw[:1] == b"\x01":
        return raw[1:].decode()
    if raw[:1] == b"\x00":
        raise ValueError(f"a binary fingerprint of {len(raw) - 1} bytes")
    return raw.decode()


def _record_value(r: Record) -> bytes:
    """The stored form of a record being claimed (attempts 1; a takeover patches it):
    version 3, or version 2 for a token or fingerprint over 255 bytes or a claim blob
    over 65,535 (a large request payload)."""
    token = _stored_token(r.token)
    fp = _stored_fingerprint(r.fingerprint)
    blob = _claim_blob(r)
    completed = r.completed_at
    if len(token) < 256 and len(fp) < 256 and len(blob) <= 0xFFFF:
        same = completed == r.updated_at
        head = HEAD.pack(
            LAYOUT_VERSION,
            1,
            r.created_at,
            r.expires_at,
            r.lease_until,
            r.final,
            _STATUS_BYTE[r.status],
            0 if completed is None else _SAME if same else 1,
            r.updated_at,
        )
        lengths = LENGTHS.pack(len(token), len(fp), len(blob))
        if completed is not None and not same:
            head += _DOUBLE.pack(completed)
        parts = [head, lengths, token, fp, blob]
    else:
        blob = _claim_blob(r, compact=False)
        parts = [_v2_header(r, len(token), len(fp), blob), token, fp, blob]
    if r.outcome is not None:
        parts.append(_outcome_blob(r.outcome))
    return b"".join(parts)


def _v2_header(r: Record, token_len: int, fp_len: int, blob: bytes) -> bytes:
    """The fixed header of a version-2 record."""
    completed = r.completed_at
    return HEADER.pack(
        b"2",
        1,
        r.created_at,
        r.expires_at,
        r.lease_until,
        r.final,
        _STATUS_BYTE[r.status],
        completed is not None,
        r.updated_at,
        0.0 if completed is None else completed,
        fp_len,
        len(blob),
        token_len,
    )


def _claim_blob(r: Record, *, compact: bool = True) -> bytes:
    """The claim blob. ``compact`` (version 3): a lowercase UUID key as its 16 bytes,
    and a scope that ends in ``:`` and 32 lowercase hex digits with those as 16 bytes;
    versions 1 and 2 wrote neither."""
    rid = r.request_id
    payload = r.request_payload
    key, scope = r.key, r.scope
    flags = (rid is not None) | (payload is not None) << 1 | (r.retention == FINANCIAL) << 3
    raw: list[bytes] = []
    if compact:
        if len(key) == 36 and _UUID.fullmatch(key):
            flags |= _UUID_KEY
            raw.append(bytes.fromhex(key.replace("-", "")))
        cut = len(scope) - 32
        if cut > 0 and scope[cut - 1] == ":" and _HEX32.fullmatch(scope, cut):
            flags |= _SCOPE_DIGEST
            raw.append(bytes.fromhex(scope[cut:]))
            scope = scope[:cut]
    fields = [scope, r.operation, rid or ""]
    if not flags & _UUID_KEY:
        fields.insert(0, key)
    text = "\x00".join(fields)
    if text.count("\x00") != len(fields) - 1:  # a NUL inside a field: JSON strings instead
        flags |= 4
        text = "\x00".join(json.dumps(s) for s in fields)
    meta = _encode_meta(r.metadata) if r.metadata else ""
    lead = "" if raw else "\x00"  # versions 1 and 2: flags NUL key ...
    parts = [_FLAG_CHARS[flags].encode(), *raw, f"{lead}{text}\x00{meta}".encode()]
    if payload is not None:
        parts += (b"\x00", payload)
    return b"".join(parts)


def _outcome_blob(outcome: Outcome) -> bytes:
    """An outcome as version 2 stores it: the compact prefix, else the JSON one."""
    headers = outcome.headers
    prefix: bytes | None
    if headers:
        prefix = _compact_prefix(outcome.status, outcome.media_type, headers, len(outcome.body))
        if prefix is None:
            prefix = _json_prefix(outcome.status, outcome.media_type, headers)
    else:
        key = (outcome.status, outcome.media_type)
        prefix = _PREFIX_OF.get(key)
        if prefix is None:
            prefix = _compact_prefix(outcome.status, outcome.media_type, (), 0)
            if prefix is None:
                prefix = _json_prefix(outcome.status, outcome.media_type, ())
            if len(_PREFIX_OF) < _CACHE_MAX:
                _PREFIX_OF[key] = prefix
    return b"".join((prefix, outcome.body))


def _json_prefix(status: int | None, media_type: str, headers: Sequence[Any]) -> bytes:
    """The JSON outcome prefix (every form an outcome can take; version 1 wrote only it)."""
    pairs = [[k, v] for k, v in headers]
    return _encode_json([status, media_type, pairs]).encode() + b"\x00"


def _short(text: str) -> bytes | None:
    """A length byte and the UTF-8 of ``text``; None if longer than 255 bytes."""
    raw = text.encode("utf-8", "surrogatepass")
    return bytes((len(raw),)) + raw if len(raw) < 256 else None


def _compact_prefix(
    status: int | None, media_type: str, headers: Sequence[Any], body_len: int
) -> bytes | None:
    """The compact outcome prefix (docs/stores.md, "Redis layout"); None when a field
    does not fit it (the JSON prefix holds those)."""
    if len(headers) > 255:
        return None
    if status is None:
        status = _NO_STATUS
    elif type(status) is not int or not 0 <= status < _NO_STATUS:
        return None
    code = _MEDIA_CODE.get(media_type)
    if code is not None:
        media = bytes((code,))
    else:
        spelled = _short(media_type)
        if spelled is None:
            return None
        media = b"\x00" + spelled
    if status == _NO_STATUS:
        head = bytes((_NONE,))
    elif 100 <= status <= 355:
        head = bytes((_SHORT, status - 100))
    else:
        head = _COMPACT_HEAD.pack(_COMPACT, status)
    out = [head, media, bytes((len(headers),))]
    for name, value in headers:
        if name == "content-type" and value == media_type:
            out.append(b"\x01")
        elif name == "content-length" and value == str(body_len):
            out.append(b"\x02")
        else:
            n, v = _short(name), value.encode("utf-8", "surrogatepass")
            if n is None or len(v) > 0xFFFF:
                return None
            out += (b"\x00", n, _U16.pack(len(v)), v)
    return b"".join(out)


# -- parsing -------------------------------------------------------------------------


def record_from_value(value: bytes | None, key_hash: str) -> Record | None:
    """A :class:`Record` from a stored value (``None`` if there is none)."""
    if value is None:
        return None
    version = value[:1]
    if version == b"3":
        (_, attempts, created, expires, lease, final, status, has_completed, updated) = (
            HEAD.unpack_from(value)
        )
        at = _HEAD
        if has_completed == 1:
            (completed,) = _DOUBLE.unpack_from(value, at)
            at += 8
        else:
            completed = updated
        token_len, fp_len, blob_len = LENGTHS.unpack_from(value, at)
        token_at = at + 4
    else:
        (
            version,
            attempts,
            created,
            expires,
            lease,
            final,
            status,
            has_completed,
            updated,
            completed,
            fp_len,
            blob_len,
            token_len,
        ) = HEADER.unpack_from(value)
        token_at = _FIXED
        if version not in LAYOUT_VERSIONS:
            raise StoreUnavailableError(
                f"Redis record {key_hash} has layout version {version!r}; this retrysafe "
                "reads versions b'1' to b'3' (a newer retrysafe wrote it?)"
            )
    fp_at = token_at + token_len
    blob_at = fp_at + fp_len
    end = blob_at + blob_len
    if len(value) < end or blob_len == 0:
        raise ValueError(f"truncated: {len(value)} bytes, the header announces at least {end}")
    raw_fp = value[fp_at:blob_at]
    raw_token = value[token_at:fp_at]
    flags = value[blob_at] - 0x30
    if not 0 <= flags < (64 if version == b"3" else 16):
        raise ValueError(f"unknown claim flags {value[blob_at]!r}")
    key = digest = None
    at = blob_at + 1
    if flags & _UUID_KEY:
        key = _uuid_text(value[at : at + 16])
        at += 16
    if flags & _SCOPE_DIGEST:
        digest = value[at : at + 16].hex()
        at += 16
    if not flags & 48:
        at += 1  # the NUL after the flags
    count = 4 if key is None else 3  # the fields before the metadata
    payload = None
    if not flags & 6:  # no payload, no JSON fields: one split
        texts = value[at:end].decode().split("\x00")
        meta = texts.pop()
    else:
        parts = value[at:end].split(b"\x00", count + 1)
        texts = [json.loads(p) if flags & 4 else p.decode() for p in parts[:count]]
        meta = parts[count].decode()
        if flags & 2:
            payload = parts[count + 1]
    if key is None:
        key = texts.pop(0)
    scope, operation, rid = texts
    if digest is not None:
        if len(digest) != 32:
            raise ValueError("truncated scope digest")
        scope += digest
    return Record(
        key_hash=key_hash,
        key=key,
        scope=scope,
        operation=operation,
        fingerprint=raw_fp.decode() if version == b"1" else _read_fingerprint(raw_fp),
        status=_STATUS[status],
        token=raw_token.decode() if version == b"1" else _read_token(raw_token),
        lease_until=lease,
        expires_at=expires,
        created_at=created,
        updated_at=updated,
        completed_at=completed if has_completed else None,
        attempts=attempts,
        request_id=rid if flags & 1 else None,
        final=final,
        outcome=_outcome(value, end) if len(value) > end else None,
        request_payload=payload,
        metadata=json.loads(meta) if meta else {},
        retention=FINANCIAL if flags & 8 else STANDARD,
    )


def _uuid_text(raw: bytes) -> str:
    """A UUID's 16 bytes as the lowercase hyphenated text they were stored from."""
    if len(raw) != 16:
        raise ValueError("truncated UUID key")
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _outcome(value: bytes, start: int) -> Outcome:
    """The outcome stored from ``start``: a compact prefix or a JSON one, and the body."""
    if value[start] in (_COMPACT, _SHORT, _NONE):
        return _compact_outcome(value, start)
    cut = value.index(b"\x00", start)
    prefix = value[start:cut]
    known = _PREFIX.get(prefix)
    if known is not None:
        return Outcome(value[cut + 1 :], known[0], (), known[1])
    status, media_type, pairs = json.loads(prefix)
    if not pairs and len(_PREFIX) < _CACHE_MAX:
        _PREFIX[prefix] = (status, media_type)
    return Outcome(value[cut + 1 :], status, tuple((k, v) for k, v in pairs), media_type)


def _compact_outcome(value: bytes, start: int) -> Outcome:
    """Inverse of :func:`_compact_prefix`, and the body after it."""
    marker = value[start]
    if marker == _SHORT:
        status = value[start + 1] + 100
        at = start + 2
    elif marker == _NONE:
        status = _NO_STATUS
        at = start + 1
    else:
        _, status = _COMPACT_HEAD.unpack_from(value, start)
        at = start + 3
    code = value[at]
    if code:
        media_type = _MEDIA_TYPES[code]
        at += 1
    else:
        n = value[at + 1]
        media_type = value[at + 2 : at + 2 + n].decode("utf-8", "surrogatepass")
        at += 2 + n
    count = value[at]
    at += 1
    if not count:
        return Outcome(value[at:], None if status == _NO_STATUS else status, (), media_type)
    headers: list[tuple[str, str]] = []
    length_at = -1  # the content-length pair, filled in once the body is known
    for _ in range(count):
        tag = value[at]
        if tag == 1:
            headers.append(("content-type", media_type))
            at += 1
        elif tag == 2:
            length_at = len(headers)
            headers.append(("content-length", ""))
            at += 1
        elif tag == 0:
            n = value[at + 1]
            name = value[at + 2 : at + 2 + n].decode("utf-8", "surrogatepass")
            at += 2 + n
            (m,) = _U16.unpack_from(value, at)
            headers.append((name, value[at + 2 : at + 2 + m].decode("utf-8", "surrogatepass")))
            at += 2 + m
        else:
            raise ValueError(f"unknown header tag {tag}")
    if at > len(value):
        raise ValueError("truncated outcome")
    body = value[at:]
    if length_at >= 0:
        headers[length_at] = ("content-length", str(len(body)))
    return Outcome(body, None if status == _NO_STATUS else status, tuple(headers), media_type)
