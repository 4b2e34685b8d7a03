"""Redis (and Redis Cluster) store: one string per record; claims are one native SET.

Each record is one Redis string under ``<prefix>{<key_hash>}`` (the whole key hash
is the cluster hash tag). The engine's ``now`` decides what is logically expired;
the physical TTL decides when Redis drops a record by itself:

* a ``standard`` record gets a physical TTL (PX, set at claim) that follows
  ``expires_at``: Redis removing it at expiry is its cleanup;
* a ``financial`` record gets none: only :meth:`RedisStore.sweep` removes it, after
  copying it to the archive, so Redis can never drop one unarchived (a TTL with a
  grace period would still lose records whenever the sweeper is down for longer).

Every write that replaces a record follows the same rule: a claim or takeover
writes the new record with PX (standard) or without (financial, which also clears
any TTL the old record had); complete, fail and renew keep the TTL the claim set
(a renewal past expires_at moves both expires_at and the TTL to the lease's end).

The commands, one round trip each on the request path:

* claim: ``SET key value NX GET PX ttl`` (Redis >= 7.0): writes the new record if
  the key is free and returns nothing, or writes nothing and returns the live
  record. If that record is claimable (see :func:`retrysafe._model.decide.claimable`:
  expired, a retryable failure, a lease that ran out) a second round trip runs
  the claim script, which re-checks and takes it over atomically. On servers
  without ``SET NX GET`` every claim runs the script (one round trip).
* complete / fail / renew: one EVALSHA each; like redis-py's ``Lock``, a write
  acts only on a processing record whose fencing token matches, and keeps the TTL
  (``SET KEEPTTL``, Redis >= 6.0).
* get: one GET; delete: one DEL.
* sweep (operations work, not the request path): ``SCAN MATCH <prefix>{*}`` on
  the server or on every cluster primary, keeping the cursor between batches;
  GETs in a pipeline; the financial records among the expired ones are copied to
  the archive store (``archive=``, a SQLite or PostgreSQL store; its
  ``archive_records`` ignores a copy it already holds), and only then is each
  expired record deleted by a script that deletes the key only if it still holds
  the very value that was read. A sweep killed at any moment so loses nothing and
  archives nothing twice; a record claimed again meanwhile is never deleted. An
  expired financial record with no archive configured stops the sweep
  (:class:`~retrysafe.StoreUnavailableError`, nothing deleted in that batch).
* records / stats: a full SCAN pass with pipelined GETs, for operations commands.

Layout, version 1. A fixed 60-byte header (``struct`` :data:`HEADER`,
``>cIddd?c?ddIII``, big-endian), then the variable parts back to back::

    offset  size  field
         0     1  layout version, b"1" (:data:`LAYOUT_VERSION`)
         1     4  attempts (uint32)
         5     8  created_at    (IEEE-754 double, seconds since the epoch)
        13     8  expires_at    (double)
        21     8  lease_until   (double)
        29     1  final         (0 or 1)
        30     1  status        b"p" processing, b"c" completed, b"f" failed
        31     1  has completed_at (0: completed_at is None)
        32     8  updated_at    (double)
        40     8  completed_at  (double; 0.0 when absent)
        48     4  F: fingerprint length in bytes (uint32)
        52     4  C: claim blob length in bytes (uint32)
        56     4  T: token length in bytes (uint32)
        60     T  fencing token (UTF-8)
      60+T     F  fingerprint (UTF-8)
    60+T+F     C  claim blob
  60+T+F+C     -  outcome blob, to the end (empty: no outcome)

Times are doubles, so they round-trip exactly. The fields a write changes are
adjacent: complete replaces bytes 30-47 in one piece, and the outcome; fail
replaces the final flag, status and updated_at (and the outcome); renew
lease_until and updated_at; a takeover copies attempts + 1 and created_at from the
record it replaces. Needs Redis >= 6.0 (``KEEPTTL``).

Claim blob, written once at claim: fields separated by NUL::

    flags NUL key NUL scope NUL operation NUL request_id NUL metadata [NUL payload]

``flags`` is one ASCII character, ``chr(0x30 | bits)`` (``0``-``9``, ``:``-``?``),
a bit set: 1 request_id present (else None); 2 request payload present (else None;
the payload is the raw rest of the blob); 4 key, scope, operation and request_id
are JSON strings (only when one holds a NUL); 8 retention ``financial`` (else
``standard``). Bit 8 came later within layout version 1: records written before it
have the digits ``0``-``7`` and read as standard, and a reader that knows only bits
1, 2 and 4 still decodes the new characters (as standard records).
``metadata`` is the JSON of ``Record.metadata_json``, or empty for ``{}``.

Outcome blob: ``JSON [status, media_type, headers]`` (ASCII; headers a list of
pairs), NUL, then the body bytes.

A record whose first byte is not :data:`LAYOUT_VERSION`, a value this layout
cannot decode (another program's, truncated or corrupt), or a key that is not a
string, is never overwritten; reading it raises
:class:`~retrysafe.StoreUnavailableError` naming the key. So does an error reply
(NOPERM, BUSY, a script error). A forked child never uses its parent's clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import json
import math
import os
import struct
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias
from urllib.parse import unquote_plus, urlsplit, urlunsplit

try:
    import redis
    import redis.asyncio
    import redis.asyncio.cluster
    import redis.asyncio.retry
    import redis.cluster
    from redis import exceptions as _rx
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "retrysafe's Redis store needs redis-py: pip install 'retrysafe[redis]'"
    ) from _exc

try:  # redis-py >= 7
    from redis.maint_notifications import MaintNotificationsConfig
except ImportError:  # pragma: no cover - older redis-py
    MaintNotificationsConfig = None

from retrysafe._model.decide import claimable
from retrysafe._model.record import FINANCIAL, STANDARD, ClaimResult, Outcome, Record, Status
from retrysafe.errors import StoreUnavailableError
from retrysafe.stores import open_store
from retrysafe.stores._base import ArchivedRecord, Store, StoreStats, SweepBatch
from retrysafe.stores._redact import redact

__all__ = ["HEADER", "LAYOUT_VERSION", "RedisStore", "record_from_value"]

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "retrysafe:"

_SCHEMES = {
    "redis": ("redis", False),
    "rediss": ("rediss", False),
    "unix": ("unix", False),
    "redis+cluster": ("redis", True),
    "rediss+cluster": ("rediss", True),
}

#: Errors that mean "the server could not be reached or refused to act right now".
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    _rx.ConnectionError,  # includes BusyLoadingError, AuthenticationError, MaxConnectionsError
    _rx.TimeoutError,
    _rx.ClusterError,  # ClusterDownError, MasterDownError
    _rx.RedisClusterException,  # no reachable node, slot not covered
    _rx.TryAgainError,
    _rx.ReadOnlyError,  # a write reached a replica during failover
    _rx.OutOfMemoryError,  # maxmemory reached; the script wrote nothing
    OSError,  # includes asyncio.TimeoutError
)

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

#: First byte of every record; a new layout gets a new version.
LAYOUT_VERSION = b"1"
#: The fixed part of a record (see the module docstring).
HEADER = struct.Struct(">cIddd?c?ddIII")

_FIXED = HEADER.size  # 60
_DONE = struct.Struct(">c?dd")  # complete: status, has completed_at, updated_at, completed_at
_FAILED = struct.Struct(">?c")  # fail: final, status
_DOUBLE = struct.Struct(">d")
_U32 = struct.Struct(">I")

_STATUS_BYTE: dict[Status, bytes] = {
    Status.PROCESSING: b"p",
    Status.COMPLETED: b"c",
    Status.FAILED: b"f",
}
_STATUS: dict[bytes, Status] = {v: k for k, v in _STATUS_BYTE.items()}
_TOOK: tuple[Status | None, ...] = (None, Status.PROCESSING, Status.FAILED, None)

# -- Lua -----------------------------------------------------------------------------
# 1-based positions in a record: attempts 2, created 6, expires 14, lease 22, final 30,
# status 31 (p=112 c=99 f=102), has completed 32, updated 33, completed 41, lengths
# F C T at 49 53 57, token 61. A claim's own record carries the claim's ``now`` as
# its updated_at.

# KEYS[1] record key; ARGV[1] the new record (attempts 1, created = now), ARGV[2]
# its fingerprint, ARGV[3] PX ms ("0": no TTL). Mirrors retrysafe._model.decide.claimable.
# Claimed: returns attempts * 4 + took_over (0 none, 1 processing, 2 failed).
# Not claimed: returns the live record.
_CLAIM = """
local key = KEYS[1]
local v = redis.call('GET', key)
local new = ARGV[1]
local attempts = 1
local took = 0
if v then
  if string.byte(v, 1) ~= 49 then
    return v
  end
  local now = struct.unpack('>d', new, 33)
  if struct.unpack('>d', v, 14) > now then
    local status = string.byte(v, 31)
    if status ~= 112 and status ~= 102 then
      return v
    end
    local f, c, t = struct.unpack('>I4I4I4', v, 49)
    if string.sub(v, 61 + t, 60 + t + f) ~= ARGV[2] then
      return v
    end
    if status == 102 then
      if string.byte(v, 30) ~= 0 then
        return v
      end
      took = 2
    elseif struct.unpack('>d', v, 22) > now then
      return v
    else
      took = 1
    end
    attempts = struct.unpack('>I4', v, 2) + 1
    new = '1' .. struct.pack('>I4', attempts) .. string.sub(v, 6, 13) .. string.sub(new, 14)
  end
end
if ARGV[3] == '0' then
  redis.call('SET', key, new)
else
  redis.call('SET', key, new, 'PX', ARGV[3])
end
return attempts * 4 + took
"""

# The compare-and-set scripts: KEYS[1] record key, ARGV[1] token length (uint32) ..
# token. They act only on a processing record owned by the token, keep its TTL, and
# return 1 if they wrote, else 0. ``e`` is where the claim blob ends.
_CAS = """
local v = redis.call('GET', KEYS[1])
local t = ARGV[1]
if not v or string.byte(v, 31) ~= 112 or string.sub(v, 57, 56 + #t) ~= t then
  return 0
end
"""
_END = """local f, c, t = struct.unpack('>I4I4I4', v, 49)
local e = 60 + f + c + t
"""

# ARGV[2] bytes 31-48 (status c, has completed_at, updated_at, completed_at),
# ARGV[3] the outcome blob.
_COMPLETE = f"""{_CAS}{_END}
local new = string.sub(v, 1, 30) .. ARGV[2] .. string.sub(v, 49, e) .. ARGV[3]
redis.call('SET', KEYS[1], new, 'KEEPTTL')
return 1
"""

# ARGV[2] bytes 30-31 (final, status f), ARGV[3] updated_at, ARGV[4] the outcome
# blob (absent: no outcome).
_FAIL = f"""{_CAS}{_END}
local new = string.sub(v, 1, 29) .. ARGV[2] .. string.sub(v, 32, 32) .. ARGV[3]
  .. string.sub(v, 41, e) .. (ARGV[4] or '')
redis.call('SET', KEYS[1], new, 'KEEPTTL')
return 1
"""

# ARGV[2] lease_until, ARGV[3] updated_at, ARGV[4] the lease's PX ms from now. A
# lease past expires_at also moves expires_at (and a TTL the record has) to its end,
# so a live attempt never expires under its owner.
_RENEW = f"""{_CAS}
local expires = string.sub(v, 14, 21)
local later = struct.unpack('>d', ARGV[2]) > struct.unpack('>d', expires)
if later then
  expires = ARGV[2]
end
local new = string.sub(v, 1, 13) .. expires .. ARGV[2] .. string.sub(v, 30, 32) .. ARGV[3]
  .. string.sub(v, 41)
redis.call('SET', KEYS[1], new, 'KEEPTTL')
if later and redis.call('PTTL', KEYS[1]) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return 1
"""


# The sweep's compare-and-delete: KEYS[1] record key, ARGV[1] the value the sweep
# read (and judged expired, and archived if financial). Deletes only that value: a
# record claimed again, completed or renewed since is left alone. Returns 1 or 0.
_SWEEP_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# A versioned cell of retrysafe.guards (see retrysafe._core.cells): one string under
# ``<prefix>cell:<key>`` (never ``<prefix>{...}``, so the sweep's SCAN skips it),
# ``version LF expires_at LF json`` (expires_at empty: never). The compare-and-set:
# KEYS[1] the cell, ARGV[1] the expected version ('' for none live), ARGV[2]
# ``expires_at LF json`` of the new value, ARGV[3] now, ARGV[4] PX ms ('0': no TTL).
# Applies retrysafe._core.cells.writable; returns 1 if it wrote, else 0.
_CELL_WRITE = """
local cur = redis.call('GET', KEYS[1])
local version = 0
local live = false
if cur then
  local a = string.find(cur, '\\n', 1, true)
  local b = string.find(cur, '\\n', a + 1, true)
  version = tonumber(string.sub(cur, 1, a - 1))
  local x = string.sub(cur, a + 1, b - 1)
  live = x == '' or tonumber(x) > tonumber(ARGV[3])
end
if ARGV[1] == '' then
  if live then
    return 0
  end
  version = 0
elseif not live or version ~= tonumber(ARGV[1]) then
  return 0
end
local new = string.format('%d', version + 1) .. '\\n' .. ARGV[2]
if ARGV[4] == '0' then
  redis.call('SET', KEYS[1], new)
else
  redis.call('SET', KEYS[1], new, 'PX', ARGV[4])
end
return 1
"""


def _sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


_CLAIM_SHA, _COMPLETE_SHA, _FAIL_SHA, _RENEW_SHA = map(_sha, (_CLAIM, _COMPLETE, _FAIL, _RENEW))
_CELL_WRITE_SHA = _sha(_CELL_WRITE)
#: Script text by SHA-1, to load a script the server does not know (NOSCRIPT).
_SCRIPTS: dict[str, str] = {
    _CLAIM_SHA: _CLAIM,
    _COMPLETE_SHA: _COMPLETE,
    _FAIL_SHA: _FAIL,
    _RENEW_SHA: _RENEW,
    _CELL_WRITE_SHA: _CELL_WRITE,
}


# -- ops -----------------------------------------------------------------------------


#: One round trip: (command args, reply parser, key hash, claim record, redis-py options).
#: ``parse(reply, op)`` returns the answer, or another op to run next (a claim that
#: found a claimable record). A plain tuple: the cheapest thing to build per call.
_Op: TypeAlias = tuple[Sequence[Any], Callable[..., Any], str, Record | None, dict[str, Any]]
_NO_OPTIONS: dict[str, Any] = {}  # never mutated


# -- encoding ------------------------------------------------------------------------

_SET_GET: dict[str, Any] = {"get": True}  # SET ... GET replies with the old value
_MAX_PEXPIRE_MS = 10**15  # ~31,000 years; keeps PX far from its overflow error
#: The flags character of a claim blob: chr(0x30 | flags), so bits 1, 2 and 4 keep
#: the digits "0"-"7" of records written before bit 8 (financial) existed.
_FLAG_CHARS = "0123456789:;<=>?"
_encode_json = json.JSONEncoder(separators=(",", ":")).encode
_encode_meta = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode  # metadata_json
_CACHE_MAX = 256
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


def _token(token: str) -> bytes:
    """Token length (uint32) and token, as a record holds them from offset 56."""
    raw = token.encode()
    return _U32.pack(len(raw)) + raw


def _record_value(r: Record) -> bytes:
    """The stored form of a record being claimed (attempts 1; a takeover patches it)."""
    token = r.token.encode()
    fp = r.fingerprint.encode()
    blob = _claim_blob(r)
    completed = r.completed_at
    fixed = HEADER.pack(
        LAYOUT_VERSION,
        1,
        r.created_at,
        r.expires_at,
        r.lease_until,
        r.final,
        _STATUS_BYTE[r.status],
        completed is not None,
        r.updated_at,
        0.0 if completed is None else completed,
        len(fp),
        len(blob),
        len(token),
    )
    if r.outcome is None:
        return b"".join((fixed, token, fp, blob))
    return b"".join((fixed, token, fp, blob, _outcome_blob(r.outcome)))


def _claim_blob(r: Record) -> bytes:
    rid = r.request_id
    payload = r.request_payload
    flags = (rid is not None) | (payload is not None) << 1 | (r.retention == FINANCIAL) << 3
    text = f"{r.key}\x00{r.scope}\x00{r.operation}\x00{'' if rid is None else rid}\x00"
    if text.count("\x00") != 4:  # a NUL inside a field: JSON strings instead
        flags |= 4
        text = "".join(f"{json.dumps(s)}\x00" for s in (r.key, r.scope, r.operation, rid or ""))
    meta = _encode_meta(r.metadata) if r.metadata else ""
    blob = f"{_FLAG_CHARS[flags]}\x00{text}{meta}".encode()
    if payload is None:
        return blob
    return b"".join((blob, b"\x00", payload))


def _outcome_blob(outcome: Outcome) -> bytes:
    headers = outcome.headers
    if headers:
        prefix = _outcome_prefix(outcome.status, outcome.media_type, headers)
    else:
        key = (outcome.status, outcome.media_type)
        prefix = _PREFIX_OF.get(key)
        if prefix is None:
            prefix = _outcome_prefix(outcome.status, outcome.media_type, ())
            if len(_PREFIX_OF) < _CACHE_MAX:
                _PREFIX_OF[key] = prefix
    return b"".join((prefix, outcome.body))


def _outcome_prefix(status: int | None, media_type: str, headers: Sequence[Any]) -> bytes:
    pairs = [[k, v] for k, v in headers]
    return _encode_json([status, media_type, pairs]).encode() + b"\x00"


# -- parsing -------------------------------------------------------------------------


def record_from_value(value: bytes | None, key_hash: str) -> Record | None:
    """A :class:`Record` from a stored value (``None`` if there is none)."""
    if value is None:
        return None
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
    if version != LAYOUT_VERSION:
        raise StoreUnavailableError(
            f"Redis record {key_hash} has layout version {version!r}; this retrysafe "
            f"reads version {LAYOUT_VERSION!r} (a newer retrysafe wrote it?)"
        )
    fp_at = _FIXED + token_len
    blob_at = fp_at + fp_len
    end = blob_at + blob_len
    if len(value) < end or blob_len == 0:
        raise ValueError(f"truncated: {len(value)} bytes, the header announces at least {end}")
    flags = value[blob_at]
    if flags | 9 == 57:  # "0" "1" "8" "9": no payload, no JSON fields: decode at once
        text = value[_FIXED:end].decode()
        if text.isascii():  # byte offsets are character offsets
            blob_at -= _FIXED
            token, fp = text[:token_len], text[token_len:blob_at]
            _, key, scope, operation, rid, meta = text[blob_at:].split("\x00")
            return Record(
                key_hash,
                key,
                scope,
                operation,
                fp,
                _STATUS[status],
                token,
                lease,
                expires,
                created,
                updated,
                completed if has_completed else None,
                attempts,
                rid if flags & 1 else None,
                final,
                _outcome(value, end) if len(value) > end else None,
                None,
                json.loads(meta) if meta else {},
                FINANCIAL if flags & 8 else STANDARD,
            )
    parts = value[blob_at:end].split(b"\x00", 6)
    if flags & 4:
        key, scope, operation, rid = (json.loads(p) for p in parts[1:5])
    else:
        key, scope, operation, rid = (
            parts[1].decode(),
            parts[2].decode(),
            parts[3].decode(),
            parts[4].decode(),
        )
    meta = parts[5]
    return Record(
        key_hash,
        key,
        scope,
        operation,
        value[fp_at:blob_at].decode(),
        _STATUS[status],
        value[_FIXED:fp_at].decode(),
        lease,
        expires,
        created,
        updated,
        completed if has_completed else None,
        attempts,
        rid if flags & 1 else None,
        final,
        _outcome(value, end) if len(value) > end else None,
        parts[6] if flags & 2 else None,
        json.loads(meta) if meta else {},
        FINANCIAL if flags & 8 else STANDARD,
    )


def _outcome(value: bytes, start: int) -> Outcome:
    cut = value.index(b"\x00", start)
    prefix = value[start:cut]
    known = _PREFIX.get(prefix)
    if known is not None:
        return Outcome(value[cut + 1 :], known[0], (), known[1])
    status, media_type, pairs = json.loads(prefix)
    if not pairs and len(_PREFIX) < _CACHE_MAX:
        _PREFIX[prefix] = (status, media_type)
    return Outcome(value[cut + 1 :], status, tuple((k, v) for k, v in pairs), media_type)


def _parse_set_claim(reply: Any, op: _Op) -> ClaimResult | _Op:
    """The reply of ``SET NX GET``: claimed, a live record, or the claim script to run."""
    if reply is None:
        return ClaimResult(True)
    args, _, key_hash, r, _ = op  # args: SET key value NX GET [PX ms]
    found = record_from_value(reply, key_hash)
    assert r is not None
    if not claimable(found, r.fingerprint, r.updated_at):
        return ClaimResult(False, found)
    ttl = args[6] if len(args) > 5 else 0
    return (
        ("EVALSHA", _CLAIM_SHA, 1, args[1], args[2], r.fingerprint, ttl),
        _parse_claim,
        key_hash,
        None,
        _NO_OPTIONS,
    )


def _parse_claim(reply: Any, op: _Op) -> ClaimResult:
    if type(reply) is int:
        return ClaimResult(True, None, reply >> 2, _TOOK[reply & 3])
    return ClaimResult(False, record_from_value(reply, op[2]))


def _op_key(args: Sequence[Any]) -> str:
    """The record key an op's command acts on (EVALSHA sha 1 key …, or CMD key …)."""
    key = args[3] if args[0] == "EVALSHA" else args[1]
    return key.decode(errors="replace") if isinstance(key, bytes) else str(key)


def _parse_get(reply: Any, op: _Op) -> Record | None:
    return record_from_value(reply, op[2])


def _parse_bool(reply: Any, op: _Op) -> bool:
    return bool(reply)


def _parse_cell(reply: Any, op: _Op) -> list[Any] | None:
    """A cell's ``version LF expires_at LF json`` (see _CELL_WRITE), expired or not, as
    ``[version, json, expires_at]``: a list, since an executor takes a tuple for the
    next op to run."""
    if reply is None:
        return None
    version, expires_at, text = reply.decode().split("\n", 2)
    return [int(version), text, float(expires_at) if expires_at else None]


# -- URLs --------------------------------------------------------------------------


#: URL schemes of the stores that can hold a Redis store's archive.
#: Archive URLs: durable stores only. A memory:// archive would lose every record the
#: sweep deletes from Redis when the process ends (a MemoryStore object is accepted,
#: for tests that read it in the same process).
_ARCHIVE_SCHEMES = frozenset({"sqlite", "postgresql", "postgres"})


def _parse_url(url: str, prefix: str) -> tuple[str, bool, str, str | None]:
    """(URL for redis-py, cluster?, prefix, archive URL).

    ``prefix=`` in the query wins over ``prefix``; ``archive=`` is a URL-encoded
    store URL.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(
            f"not a Redis URL: {redact(url)!r} (expected redis://, rediss://, unix://, "
            "redis+cluster:// or rediss+cluster://)"
        )
    client_scheme, cluster = _SCHEMES[scheme]
    keep: list[str] = []
    archive: str | None = None
    for piece in parts.query.split("&"):
        if not piece:
            continue
        name, _, value = piece.partition("=")
        name = unquote_plus(name)
        if name == "prefix":
            prefix = unquote_plus(value)
        elif name == "archive":
            archive = unquote_plus(value)
        elif name == "decode_responses":
            raise ValueError("decode_responses is not supported: record bodies are bytes")
        else:
            keep.append(piece)
    if cluster and parts.path not in ("", "/", "/0"):
        raise ValueError(f"Redis Cluster has only database 0: {redact(url)!r}")
    client_url = urlunsplit(parts._replace(scheme=client_scheme, query="&".join(keep)))
    return client_url, cluster, prefix, archive


def _check_archive(archive: object) -> None:
    """Refuse an ``archive`` option that cannot hold archived records."""
    if archive is None:
        return
    if isinstance(archive, str):
        if urlsplit(archive).scheme.lower() not in _ARCHIVE_SCHEMES:
            raise ValueError(
                f"archive must be a sqlite:/// or postgresql:// store URL, not {redact(archive)!r}"
            )
        return
    if isinstance(archive, RedisStore) or not isinstance(archive, Store):
        raise TypeError(
            "archive must be a SQLite, PostgreSQL or memory Store or its URL, "
            f"not {type(archive).__name__}"
        )


# -- the store -----------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Pass:
    """Where a sweep's walk over the keyspace stands between batches.

    ``nodes`` are what SCAN targets in turn (``[None]``: the one server; else the
    cluster's primaries), ``node`` the index of the current one and ``cursor`` its
    SCAN cursor; ``pending`` the keys SCAN returned that no batch has judged yet;
    ``now`` the earliest time any key of this pass was judged at.
    """

    nodes: list[Any]
    now: float
    node: int = 0
    cursor: int = 0
    pending: list[bytes] = field(default_factory=list)


#: Clients a forked child inherited from its parent, kept referenced and never closed
#: (a finalizer must not touch the parent's connections). One entry per store and fork.
_INHERITED: list[Any] = []


def _forget_clients(ref: weakref.ref[RedisStore]) -> None:
    """After ``fork()``, in the child: drop the parent's clients and lock (see ``__init__``)."""
    store = ref()
    if store is None:
        return
    _INHERITED.append((store._sync, list(store._async.values()), list(store._starting.values())))
    store._sync = None
    store._async = weakref.WeakKeyDictionary()
    store._starting = weakref.WeakKeyDictionary()
    store._lock = threading.Lock()
    store._sync_lock = threading.Lock()
    store._sweep_lock = threading.Lock()
    store._sweep_pass = None


class RedisStore(Store[_Op]):
    """Records in Redis or Redis Cluster; see the module docstring for the layout.

    Nothing connects until the first operation. The sync client is shared by all
    threads; an asyncio client is made per running event loop. redis-py's own
    retries are off (a re-sent script could apply twice): a failed round trip
    raises :class:`~retrysafe.StoreUnavailableError` at once, and the next call
    reconnects. ``max_connections`` bounds the sync client's pool and each asyncio
    client's (per event loop); a call past it waits for a free connection for up to
    ``socket_timeout``.
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        archive: Store[Any] | str | None = None,
        socket_timeout: float = 5.0,
        connect_timeout: float = 2.0,
        max_connections: int = 100,
    ) -> None:
        self.url = url
        if isinstance(max_connections, bool) or not isinstance(max_connections, int):
            raise TypeError("max_connections must be an int")
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self.max_connections = max_connections
        self._client_url, self.cluster, self.prefix, in_url = _parse_url(url, prefix)
        self._safe_url = redact(url)
        if in_url is not None:
            if archive is not None:
                raise ValueError(
                    f"two archives for {self._safe_url}: archive= in the URL and the "
                    "archive argument; give one"
                )
            archive = in_url
        _check_archive(archive)
        #: The archive's URL, opened on first use; or the archive Store itself.
        self._archive_url = archive if isinstance(archive, str) else None
        self._archive: Store[Any] | None = archive if isinstance(archive, Store) else None
        self._sweep_lock = threading.Lock()
        self._sweep_pass: _Pass | None = None
        self._options: dict[str, Any] = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": connect_timeout,
        }
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._set_claims = True  # claims use SET NX GET until the server refuses it
        self._sync: Any = None
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = (
            weakref.WeakKeyDictionary()
        )
        #: Per event loop, the task mapping a new asyncio cluster client's slots.
        self._starting: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = (
            weakref.WeakKeyDictionary()
        )
        # Clients must not cross a fork: redis-py's asyncio pools do not notice one
        # (a child would share the parent's sockets and read its replies), a cluster
        # client holds locks, and so does this store. The child makes its own clients
        # on first use. The hook holds the store only weakly.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_clients(ref))

    def record_key(self, key_hash: str) -> str:
        """The Redis key of a record."""
        return f"{self.prefix}{{{key_hash}}}"

    # -- ops ---------------------------------------------------------------------

    def _claim(self, record: Record) -> _Op:
        kh = record.key_hash
        key = f"{self.prefix}{{{kh}}}"
        value = _record_value(record)
        # Financial records get no physical TTL: only the sweeper, after archiving
        # them, may remove them (see the module docstring).
        ttl = 0 if record.retention == FINANCIAL else _ttl_ms(record.expires_at, record.updated_at)
        if not self._set_claims:  # the server has no SET NX GET
            args: Sequence[Any] = ("EVALSHA", _CLAIM_SHA, 1, key, value, record.fingerprint, ttl)
            return (args, _parse_claim, kh, None, _NO_OPTIONS)
        if ttl:
            args = ("SET", key, value, "NX", "GET", "PX", ttl)
        else:
            args = ("SET", key, value, "NX", "GET")
        return (args, _parse_set_claim, kh, record, _SET_GET)

    def _complete(self, key_hash: str, token: str, outcome: Outcome, now: float) -> _Op:
        args = (
            "EVALSHA",
            _COMPLETE_SHA,
            1,
            f"{self.prefix}{{{key_hash}}}",
            _token(token),
            _DONE.pack(b"c", True, now, now),
            _outcome_blob(outcome),
        )
        return (args, _parse_bool, key_hash, None, _NO_OPTIONS)

    def _fail(
        self, key_hash: str, token: str, outcome: Outcome | None, final: bool, now: float
    ) -> _Op:
        args: list[Any] = [
            "EVALSHA",
            _FAIL_SHA,
            1,
            self.record_key(key_hash),
            _token(token),
            _FAILED.pack(final, b"f"),
            _DOUBLE.pack(now),
        ]
        if outcome is not None:
            args.append(_outcome_blob(outcome))
        return (args, _parse_bool, key_hash, None, _NO_OPTIONS)

    def _renew(self, key_hash: str, token: str, lease_until: float, now: float) -> _Op:
        args = (
            "EVALSHA",
            _RENEW_SHA,
            1,
            self.record_key(key_hash),
            _token(token),
            _DOUBLE.pack(lease_until),
            _DOUBLE.pack(now),
            _ttl_ms(lease_until, now) or 1,
        )
        return (args, _parse_bool, key_hash, None, _NO_OPTIONS)

    def _get(self, key_hash: str) -> _Op:
        return (("GET", self.record_key(key_hash)), _parse_get, key_hash, None, _NO_OPTIONS)

    def _delete(self, key_hash: str) -> _Op:
        return (("DEL", self.record_key(key_hash)), _parse_bool, key_hash, None, _NO_OPTIONS)

    def cell_key(self, key: str) -> str:
        """The Redis key of a versioned cell of retrysafe.guards."""
        return f"{self.prefix}cell:{key}"

    def _cell_read(self, key: str) -> _Op:
        return (("GET", self.cell_key(key)), _parse_cell, key, None, _NO_OPTIONS)

    def _cell_write(
        self, key: str, expected: int | None, text: str, expires_at: float | None, now: float
    ) -> _Op:
        ttl = 0 if expires_at is None else _ttl_ms(expires_at, now)
        rest = f"{'' if expires_at is None else repr(expires_at)}\n{text}"
        args = (
            "EVALSHA",
            _CELL_WRITE_SHA,
            1,
            self.cell_key(key),
            "" if expected is None else str(expected),
            rest,
            repr(now),
            ttl,
        )
        return (args, _parse_bool, key, None, _NO_OPTIONS)

    # -- executors ---------------------------------------------------------------

    # Both executors send an op, hand a failed send to _retry_or_raise and a reply
    # to _settle; either may answer with the op to run next (a takeover, a fallback
    # to script claims). Only the send differs, by an await. Whatever the client
    # raises is a failed send: redis-py's asyncio cluster client has been seen to
    # raise AttributeError (a connection closed under it while slots moved), and
    # that must reach the caller as StoreUnavailableError (503), not as a 500.

    def _run(self, op: _Op) -> Any:
        while True:
            try:
                client = self._sync or self._sync_client()
                try:
                    reply = client.execute_command(*op[0], **op[4])
                except _rx.NoScriptError:  # a new or flushed server: load, then run once
                    client.script_load(_SCRIPTS[op[0][1]])
                    reply = client.execute_command(*op[0], **op[4])
            except Exception as exc:
                op = self._retry_or_raise(op, exc)
                continue
            result = self._settle(op, reply)
            if type(result) is not tuple:
                return result
            op = result

    async def _arun(self, op: _Op) -> Any:
        loop = asyncio.get_running_loop()
        while True:
            try:
                client = self._async.get(loop) or await self._aconnect(loop)
                try:
                    reply = await client.execute_command(*op[0], **op[4])
                except _rx.NoScriptError:
                    await client.script_load(_SCRIPTS[op[0][1]])
                    reply = await client.execute_command(*op[0], **op[4])
            except Exception as exc:
                op = self._retry_or_raise(op, exc)
                continue
            result = self._settle(op, reply)
            if type(result) is not tuple:
                return result
            op = result

    def _retry_or_raise(self, op: _Op, exc: BaseException) -> _Op:
        """The op to run after a failed send, or StoreUnavailableError."""
        if isinstance(exc, UNAVAILABLE_ERRORS):
            raise self._unavailable(exc) from exc
        if isinstance(exc, _rx.ResponseError):
            return self._refused(op, exc)
        raise self._unavailable(exc) from exc  # anything else redis-py raises

    def _settle(self, op: _Op, reply: Any) -> Any:
        """The op's parsed reply (or the next op); a malformed record is unavailable."""
        try:
            return op[1](reply, op)
        except _MALFORMED as exc:
            raise self._malformed(op, exc) from exc

    def _refused(self, op: _Op, exc: _rx.ResponseError) -> _Op:
        """The op to run instead of one the server refused, or the error to raise."""
        text = str(exc)
        args, parse, _, record, _ = op
        if parse is _parse_set_claim and "syntax error" in text:
            # Redis < 7.0 has no SET NX GET: claim with the script from now on.
            self._set_claims = False
            assert record is not None
            return self._claim(record)
        key = _op_key(args)
        if "WRONGTYPE" in text:
            raise StoreUnavailableError(
                f"Redis store {self._safe_url}: {key} is not a retrysafe record "
                "(another program's key, or an older layout)",
                transient=False,
            ) from exc
        # NOPERM, BUSY, a script error (the script met a value it cannot read), …
        detail = text.strip() or type(exc).__name__
        raise StoreUnavailableError(
            f"Redis store {self._safe_url} refused {args[0]} on {key}: {detail}",
            transient=detail.startswith("BUSY"),  # a script still running: it passes
        ) from exc

    def _malformed(self, op: _Op, exc: BaseException) -> StoreUnavailableError:
        """The error for a reply that is not a well-formed record (left as it is)."""
        detail = str(exc) or type(exc).__name__
        return StoreUnavailableError(
            f"Redis store {self._safe_url}: {_op_key(op[0])} holds a value that is not "
            f"a readable retrysafe record ({type(exc).__name__}: {detail}); it was not "
            "overwritten: delete it if it is stale",
            transient=False,
        )

    def _unavailable(self, exc: BaseException) -> StoreUnavailableError:
        detail = str(exc) or type(exc).__name__
        return StoreUnavailableError(f"Redis store {self._safe_url} is unavailable: {detail}")

    # -- operations work: sweep, listing, stats, archive (sync, never on the hot path) --

    @property
    def archive(self) -> Store[Any] | None:
        """The store that keeps this store's archived financial records (opened lazily)."""
        archive = self._archive
        if archive is None and self._archive_url is not None:
            with self._lock:
                if self._archive is None:
                    self._archive = open_store(self._archive_url)
                archive = self._archive
        return archive

    def _need_archive(self) -> Store[Any]:
        archive = self.archive
        if archive is None:
            raise NotImplementedError(
                f"Redis store {self._safe_url} has no archive: open it with "
                "RedisStore(url, archive='sqlite:///archive.db') or ?archive=<URL-encoded URL>"
            )
        return archive

    def archive_records(self, records: Sequence[Record], archived_at: float) -> int:
        """Copy ``records`` into the archive store; how many were new (see :class:`Store`)."""
        return self._need_archive().archive_records(records, archived_at)

    def archived_records(
        self, *, operation: str | None = None, limit: int = 100
    ) -> list[ArchivedRecord]:
        """The archive store's records, most recently archived first."""
        return self._need_archive().archived_records(operation=operation, limit=limit)

    def sweep(self, now: float, limit: int = 1000) -> SweepBatch:
        """Delete at most ``limit`` records expired at ``now``; archive financial ones first.

        The store walks its keys with ``SCAN`` (every primary of a cluster) and keeps
        its place between calls, so successive batches continue one pass. ``done``
        is true once a whole pass, judged at ``now`` or later, found nothing more to
        delete; the next call starts a new pass. Values under the prefix that are not
        records are skipped, never deleted. A batch looks at no more than
        ``max(10 * limit, 1000)`` keys, so it stays short on a large keyspace.

        Raises :class:`~retrysafe.StoreUnavailableError`, having deleted nothing in
        the batch, when a financial record expired and the store has no archive.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive integer, not {limit!r}")
        with self._sweep_lock:
            try:
                return self._sweep(now, limit)
            except BaseException as exc:
                self._sweep_pass = None  # the next sweep rescans rather than skip a key
                if isinstance(exc, _rx.RedisError | OSError):
                    raise self._ops_error(exc) from exc
                raise

    def _sweep(self, now: float, limit: int) -> SweepBatch:
        client = self._sync or self._sync_client()
        count = min(max(limit, 100), 1000)  # keys per SCAN and per pipeline of GETs
        budget = max(10 * limit, 1000)  # keys one batch may look at
        p = self._sweep_pass
        if p is None:
            p = self._sweep_pass = self._new_pass(client, now)
        p.now = min(p.now, now)
        found: list[tuple[bytes, bytes, Record]] = []  # key, value as read, record
        seen: set[bytes] = set()  # SCAN may return a key twice
        examined = 0
        done = False
        while len(found) < limit:
            if not p.pending:
                if p.node >= len(p.nodes):  # the pass is over
                    if p.now >= now:  # and every key of it was judged at `now` or later
                        done = True
                        self._sweep_pass = None
                        break
                    p = self._sweep_pass = self._new_pass(client, now)
                if examined >= budget:
                    break
                p.pending = self._scan_step(client, p, count)
                continue
            keys = p.pending[:count]
            values = self._get_many(client, keys)
            used = len(keys)
            for i, (key, value) in enumerate(zip(keys, values, strict=True)):
                record = self._expired(key, value, now)
                if record is not None and key not in seen:
                    seen.add(key)
                    found.append((key, value, record))
                    if len(found) == limit:
                        used = i + 1  # the rest stays pending for the next batch
                        break
            examined += used
            del p.pending[:used]
        financial = [r for _, _, r in found if r.retention == FINANCIAL]
        archived = 0
        if financial:
            archive = self.archive
            if archive is None:
                raise StoreUnavailableError(
                    f"Redis store {self._safe_url}: {len(financial)} expired financial "
                    "records are not swept: financial records need an archive: "
                    "RedisStore(url, archive='sqlite:///archive.db') or ?archive=<URL>"
                )
            archived = archive.archive_records(financial, now)  # before any delete
        deleted = self._delete_unchanged(client, [(k, v) for k, v, _ in found])
        return SweepBatch(deleted, archived, done)

    def _new_pass(self, client: Any, now: float) -> _Pass:
        nodes = list(client.get_primaries()) if self.cluster else [None]
        return _Pass(nodes, now)

    def _scan_step(self, client: Any, p: _Pass, count: int) -> list[bytes]:
        """One SCAN on the pass's current node; moves the pass on; the keys it returned."""
        node = p.nodes[p.node]
        match = self._match
        if node is None:
            cursor, keys = client.scan(p.cursor, match=match, count=count)
        else:
            cursors, keys = client.scan(p.cursor, match=match, count=count, target_nodes=node)
            cursor = cursors[node.name]
        cursor = int(cursor)
        if cursor == 0:  # this node is done
            p.node += 1
        p.cursor = cursor
        return list(keys)

    @property
    def _match(self) -> str:
        """The SCAN pattern of this store's record keys: ``<prefix>{*}``, glob-escaped."""
        return "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix) + "{*}"

    def _get_many(self, client: Any, keys: Sequence[bytes]) -> list[Any]:
        """GET each key in one pipeline (no MULTI); an error reply stands in its place."""
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.execute_command("GET", key)
        return pipe.execute(raise_on_error=False)

    def _key_hash(self, key: bytes) -> str:
        return key.decode(errors="replace")[len(self.prefix) + 1 : -1]

    def _decode(self, key: bytes, value: Any) -> Record | None:
        """The record a scanned key holds; ``None`` for anything that is not one."""
        if type(value) is not bytes:  # gone (None), or an error reply (another type)
            return None
        try:
            return record_from_value(value, self._key_hash(key))
        except (*_MALFORMED, StoreUnavailableError):  # another program's value
            return None

    def _expired(self, key: bytes, value: Any, now: float) -> Record | None:
        """The record under ``key`` if it is one and expired at ``now``."""
        if type(value) is not bytes or len(value) < _FIXED or value[0] != 49:
            return None
        if not _DOUBLE.unpack_from(value, 13)[0] <= now:  # live: no need to decode
            return None
        return self._decode(key, value)

    def _delete_unchanged(self, client: Any, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Delete each key that still holds the value read; how many were deleted."""
        if not items:
            return 0
        pipe = client.pipeline(transaction=False)
        for key, value in items:
            pipe.execute_command("EVAL", _SWEEP_DELETE, 1, key, value)
        replies = pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return sum(1 for reply in replies if reply == 1)

    def _scan_records(self, client: Any) -> Iterator[Record]:
        """Every record under the prefix (a full SCAN pass), in no particular order."""
        p = self._new_pass(client, 0.0)
        while p.node < len(p.nodes):
            keys = self._scan_step(client, p, 1000)
            if keys:
                for key, value in zip(keys, self._get_many(client, keys), strict=True):
                    record = self._decode(key, value)
                    if record is not None:
                        yield record

    def records(
        self,
        *,
        status: Status | str | None = None,
        operation: str | None = None,
        created_before: float | None = None,
        limit: int = 100,
        key: str | None = None,
    ) -> list[Record]:
        """Records (expired ones included), oldest ``created_at`` first: a full SCAN."""
        want = None if status is None else Status(status)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit must be a non-negative integer, not {limit!r}")
        try:
            client = self._sync or self._sync_client()
            chosen = (
                r
                for r in self._scan_records(client)
                if (want is None or r.status is want)
                and (operation is None or r.operation == operation)
                and (created_before is None or r.created_at < created_before)
                and (key is None or r.key == key)
            )
            return heapq.nsmallest(limit, chosen, key=lambda r: (r.created_at, r.key_hash))
        except (_rx.RedisError, OSError) as exc:
            raise self._ops_error(exc) from exc

    def stats(self, now: float) -> StoreStats:
        """Counts of live records by (operation, status), expired ones, the archive's size."""
        stats = StoreStats()
        counts = stats.counts
        try:
            client = self._sync or self._sync_client()
            for r in self._scan_records(client):
                if r.expires_at <= now:
                    stats.expired += 1
                    continue
                group = (r.operation, r.status.value)
                counts[group] = counts.get(group, 0) + 1
                if r.status is Status.PROCESSING and (
                    stats.oldest_processing is None
                    or r.created_at < stats.oldest_processing.created_at
                ):
                    stats.oldest_processing = r
        except (_rx.RedisError, OSError) as exc:
            raise self._ops_error(exc) from exc
        archive = self.archive
        if archive is not None:
            stats.archived = archive.stats(now).archived
        return stats

    def _ops_error(self, exc: BaseException) -> StoreUnavailableError:
        """The error for a failed SCAN, pipeline or script of the operations work."""
        if isinstance(exc, _rx.ResponseError):
            detail = str(exc).strip() or type(exc).__name__
            return StoreUnavailableError(f"Redis store {self._safe_url} refused: {detail}")
        return self._unavailable(exc)

    # -- clients -----------------------------------------------------------------

    def _client_options(self, retry: Any) -> dict[str, Any]:
        options = {**self._options, "retry": retry}
        if MaintNotificationsConfig is not None:
            # With maintenance notifications on ("auto", the default) redis-py's asyncio
            # pool skips its stale-connection check, so the first call after a server
            # restart would fail; they only matter for RESP3 on Redis Enterprise.
            options["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
        return options

    def _sync_client(self) -> Any:
        # Its own lock: a cluster client connects while it is built, and the event
        # loop must not wait on that for ``self._lock`` (which the async clients take).
        with self._sync_lock:
            if self._sync is None:
                options = self._client_options(Retry(NoBackoff(), 0))
                if self.cluster:
                    # A cluster client connects here (topology discovery); a plain one lazily.
                    self._sync = redis.cluster.RedisCluster.from_url(self._client_url, **options)
                else:
                    # As for the asyncio clients below: redis-py's default pool (bounded
                    # at 100 since redis-py 8) refuses a call past its limit, which the
                    # store would report as unavailable; a burst of threads waits instead.
                    pool = redis.BlockingConnectionPool.from_url(
                        self._client_url,
                        max_connections=self.max_connections,
                        timeout=self._options["socket_timeout"],
                        **options,
                    )
                    self._sync = redis.Redis.from_pool(pool)  # (closes the pool too)
            return self._sync

    async def _aconnect(self, loop: asyncio.AbstractEventLoop) -> Any:
        """The loop's client, made on first use. A cluster client maps the slots once,
        before any task uses it: redis-py's asyncio cluster client, first used by many
        tasks at once, maps them in each and closes connections the others are using
        (seen as "Connection closed by server" from a healthy cluster)."""
        if not self.cluster:
            return self._async_client(loop)
        task = self._starting.get(loop)
        if task is None or task.done():
            task = self._starting[loop] = loop.create_task(self._astart(loop))
            # A start whose every caller was cancelled still has its error read.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(task)  # a cancelled caller leaves the others' start

    async def _astart(self, loop: asyncio.AbstractEventLoop) -> Any:
        client = self._async_client(loop, register=False)
        try:
            await client.initialize()
        except BaseException:
            with contextlib.suppress(Exception):
                await client.aclose()
            raise
        finally:
            if self._starting.get(loop) is asyncio.current_task():
                del self._starting[loop]
        self._async[loop] = client
        return client

    def _async_client(self, loop: asyncio.AbstractEventLoop, *, register: bool = True) -> Any:
        with self._lock:
            client = self._async.get(loop)
            if client is None:
                # A client pins its loop (so the weak key never dies by itself):
                # forget the clients of loops that were closed.
                for old in [lp for lp in self._async if lp.is_closed()]:
                    del self._async[old]
                options = self._client_options(redis.asyncio.retry.Retry(NoBackoff(), 0))
                if self.cluster:
                    options["max_connections"] = self.max_connections
                    client = redis.asyncio.cluster.RedisCluster.from_url(
                        self._client_url, **options
                    )
                else:
                    # redis-py's default asyncio pool refuses a call past its limit
                    # ("Too many connections"): under a burst of concurrent tasks, a
                    # call waits for a free connection instead (up to socket_timeout).
                    pool = redis.asyncio.BlockingConnectionPool.from_url(
                        self._client_url,
                        max_connections=self.max_connections,
                        timeout=self._options["socket_timeout"],
                        **options,
                    )
                    client = redis.asyncio.Redis.from_pool(pool)  # (closes the pool too)
                if register:
                    self._async[loop] = client
            return client

    def close(self) -> None:
        """Close the sync client and the archive; forget clients of closed event loops."""
        with self._sync_lock, self._lock:
            client, self._sync = self._sync, None
            for old in [lp for lp in self._async if lp.is_closed()]:
                del self._async[old]
            archive = self._archive
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        if archive is not None and self._archive_url is not None:  # ours, not the caller's
            with contextlib.suppress(Exception):
                archive.close()

    async def aclose(self) -> None:
        """Close the current event loop's client, then as :meth:`close`."""
        loop = asyncio.get_running_loop()
        starting = self._starting.pop(loop, None)
        if starting is not None and not starting.done():  # a cluster client being started
            await asyncio.wait([starting])  # (its client, if any, is closed below)
        with self._lock:
            client = self._async.pop(loop, None)
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._safe_url}>"
