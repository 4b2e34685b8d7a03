"""Redis (and Redis Cluster) store: one hash per record, one Lua script per write.

Each record is a Redis hash under ``<prefix>{<key_hash>}``: the whole key hash is
the cluster hash tag, so a record and any companion key share one slot. Claim,
complete, fail and renew are each one EVALSHA of a script that touches only that
key; like redis-py's ``Lock``, a write acts only when the fencing token matches.
A claim that is refused returns the live record in the same reply. get is one
HMGET, delete one DEL. The key's physical TTL (PEXPIRE, set at claim) follows
``expires_at`` so Redis drops expired records by itself; the engine's ``now``
decides what is logically expired.

Hash fields (see :data:`FIELDS`; an absent field is ``None``)::

    hash key scope op fp status token lease exp created updated final meta
    attempts completed rid payload                  -- the record
    code headers mime body                          -- the outcome (no body: none)

Floats are stored as ``repr(float)`` (exact round trip), booleans as ``"1"``/``"0"``,
headers and metadata as the JSON of ``Outcome.headers_json``/``Record.metadata_json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple
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

from .._errors import StoreUnavailableError
from .._record import ClaimResult, Outcome, Record, Status
from ._base import Store

__all__ = ["FIELDS", "REQUIRED_FIELDS", "RedisStore", "record_from_values"]

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
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    _rx.ConnectionError,  # includes BusyLoadingError, AuthenticationError, MaxConnectionsError
    _rx.TimeoutError,
    _rx.ClusterError,  # ClusterDownError, MasterDownError
    _rx.RedisClusterException,  # no reachable node, slot not covered
    _rx.TryAgainError,
    _rx.ReadOnlyError,  # a write reached a replica during failover
    _rx.OutOfMemoryError,  # maxmemory reached; the script wrote nothing
    OSError,  # includes asyncio.TimeoutError
)

# -- layout and Lua ----------------------------------------------------------------

#: Fields every record has, in the order a claim sends their values.
REQUIRED_FIELDS: tuple[str, ...] = (
    "hash", "key", "scope", "op", "fp", "status", "token",
    "lease", "exp", "created", "updated", "final", "meta",
)  # fmt: skip
#: Every field, in the order of :func:`record_from_values` (HMGET replies).
FIELDS: tuple[str, ...] = (
    *REQUIRED_FIELDS,
    "attempts", "completed", "rid", "payload", "code", "headers", "mime", "body",
)  # fmt: skip
_L = {name: i + 1 for i, name in enumerate(FIELDS)}  # 1-based Lua positions
_NR = len(REQUIRED_FIELDS)

# KEYS[1] record key
# ARGV[1] pexpire ms ("0": no TTL); ARGV[2..1+NR] REQUIRED_FIELDS values (their
# "updated" is the claim's now); then optional field/value pairs.
# Claimed: returns {attempts, took_over status or ""}. Not claimed: the live record
# as HMGET of FIELDS. Mirrors retrysafe._decide.claimable exactly.
_CLAIM = f"""
local key = KEYS[1]
local F = {{{", ".join(f"'{f}'" for f in FIELDS)}}}
local cur = redis.call('HMGET', key, unpack(F))
local now = tonumber(ARGV[{1 + _L["updated"]}])
local attempts = 1
local took = ''
local created = ARGV[{1 + _L["created"]}]
if cur[{_L["exp"]}] then
  if tonumber(cur[{_L["exp"]}]) > now then
    local status = cur[{_L["status"]}]
    local ok = false
    if cur[{_L["fp"]}] == ARGV[{1 + _L["fp"]}] then
      if status == 'failed' then
        ok = cur[{_L["final"]}] ~= '1'
      elseif status == 'processing' then
        ok = tonumber(cur[{_L["lease"]}]) <= now
      end
    end
    if not ok then
      return cur
    end
    attempts = tonumber(cur[{_L["attempts"]}]) + 1
    created = cur[{_L["created"]}]
    took = status
  end
  redis.call('DEL', key)
end
local args = {{}}
for i = 1, {_NR} do
  args[2 * i - 1] = F[i]
  args[2 * i] = ARGV[i + 1]
end
args[{2 * _L["created"]}] = created
args[{2 * _NR + 1}] = 'attempts'
args[{2 * _NR + 2}] = attempts
for i = {_NR + 2}, #ARGV do
  args[#args + 1] = ARGV[i]
end
redis.call('HSET', key, unpack(args))
if ARGV[1] ~= '0' then
  redis.call('PEXPIRE', key, ARGV[1])
end
return {{attempts, took}}
"""

# KEYS[1] record key
# ARGV[1] token, ARGV[2] n, ARGV[3..2+n] fields to delete, ARGV[3+n..] field/value pairs.
# Acts only on a processing record owned by the token. Returns 1 if written, else 0.
_CAS = """
local key = KEYS[1]
local cur = redis.call('HMGET', key, 'status', 'token')
if cur[1] ~= 'processing' or cur[2] ~= ARGV[1] then
  return 0
end
local n = tonumber(ARGV[2])
if n > 0 then
  redis.call('HDEL', key, unpack(ARGV, 3, 2 + n))
end
redis.call('HSET', key, unpack(ARGV, 3 + n))
return 1
"""

_SCRIPTS = {"claim": _CLAIM, "cas": _CAS}

_OUTCOME_FIELDS = ("code", "headers", "mime", "body")
_NO_CODE = ("code",)
_MAX_PEXPIRE_MS = 10**15  # ~31,000 years; keeps PEXPIRE far from its overflow error
_DEFAULT_MEDIA_TYPE = "application/octet-stream"

_STATUS: dict[bytes, Status] = {s.value.encode(): s for s in Status}


# -- ops ---------------------------------------------------------------------------


class _Op(NamedTuple):
    """One round trip: a script name (or a plain command), its key and args, a parser."""

    command: str
    key: str
    args: Sequence[Any]
    parse: Callable[[Any], Any]


class _Conn(NamedTuple):
    """A client and its registered scripts (sync ``Script`` or ``AsyncScript``)."""

    client: Any
    scripts: dict[str, Any]


def _send(conn: _Conn, op: _Op) -> Any:
    """Issue ``op`` on ``conn``: the reply, or an awaitable of it for async clients."""
    script = conn.scripts.get(op.command)
    if script is not None:
        return script((op.key,), op.args)
    return conn.client.execute_command(op.command, op.key, *op.args)


# -- encoding ----------------------------------------------------------------------


def _f(value: float) -> str:
    return repr(float(value))


def _ttl_ms(expires_at: float, now: float) -> int:
    """Physical TTL in ms for PEXPIRE (at least 1); 0 means "no TTL" (infinite)."""
    delta = (expires_at - now) * 1000.0
    if not math.isfinite(delta):
        return 0 if delta > 0 else 1
    return min(max(1, math.ceil(delta)), _MAX_PEXPIRE_MS)


def _outcome_args(outcome: Outcome) -> list[Any]:
    args: list[Any] = [
        "headers",
        outcome.headers_json(),
        "mime",
        outcome.media_type,
        "body",
        outcome.body,
    ]
    if outcome.status is not None:
        args += ("code", outcome.status)
    return args


def _claim_args(r: Record) -> list[Any]:
    """PEXPIRE ms, the REQUIRED_FIELDS values, then optional field/value pairs."""
    args: list[Any] = [
        _ttl_ms(r.expires_at, r.updated_at),
        r.key_hash,
        r.key,
        r.scope,
        r.operation,
        r.fingerprint,
        r.status.value,
        r.token,
        _f(r.lease_until),
        _f(r.expires_at),
        _f(r.created_at),
        _f(r.updated_at),
        "1" if r.final else "0",
        r.metadata_json() if r.metadata else "{}",
    ]
    if r.completed_at is not None:
        args += ("completed", _f(r.completed_at))
    if r.request_id is not None:
        args += ("rid", r.request_id)
    if r.request_payload is not None:
        args += ("payload", r.request_payload)
    if r.outcome is not None:
        args += _outcome_args(r.outcome)
    return args


def _cas_args(token: str, delete: Sequence[str], pairs: Sequence[Any]) -> tuple[Any, ...]:
    return (token, len(delete), *delete, *pairs)


# -- parsing -----------------------------------------------------------------------


def record_from_values(values: Sequence[Any]) -> Record | None:
    """A :class:`Record` from an HMGET of :data:`FIELDS` (``None`` if there is none)."""
    (
        key_hash, key, scope, op, fp, status, token, lease, exp, created, updated,
        final, meta, attempts, completed, rid, payload, code, headers, mime, body,
    ) = values  # fmt: skip
    if exp is None:
        return None
    outcome = None
    if body is not None:
        outcome = Outcome(
            body=body,
            status=None if code is None else int(code),
            headers=_headers(headers),
            media_type=mime.decode() if mime else _DEFAULT_MEDIA_TYPE,
        )
    return Record(
        key_hash=key_hash.decode(),
        key=key.decode(),
        scope=scope.decode(),
        operation=op.decode(),
        fingerprint=fp.decode(),
        status=_STATUS[status],
        token=token.decode(),
        lease_until=float(lease),
        expires_at=float(exp),
        created_at=float(created),
        updated_at=float(updated),
        completed_at=None if completed is None else float(completed),
        attempts=int(attempts),
        request_id=None if rid is None else rid.decode(),
        final=final == b"1",
        outcome=outcome,
        request_payload=payload,
        metadata=json.loads(meta) if meta and meta != b"{}" else {},
    )


def _headers(raw: bytes | None) -> tuple[tuple[str, str], ...]:
    if not raw or raw == b"[]":
        return ()
    return tuple((k, v) for k, v in json.loads(raw))


def _parse_claim(reply: list[Any]) -> ClaimResult:
    first = reply[0]
    if type(first) is int:
        return ClaimResult(claimed=True, attempts=first, took_over=_STATUS.get(reply[1]))
    return ClaimResult(claimed=False, record=record_from_values(reply))


def _parse_bool(reply: Any) -> bool:
    return bool(reply)


# -- URLs --------------------------------------------------------------------------


def _redact(url: str) -> str:
    """``url`` with any password (userinfo or ``password=`` query) replaced by ``***``."""
    parts = urlsplit(url)
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hostport}"
    query = "&".join(
        f"{p.partition('=')[0]}=***" if unquote_plus(p.partition("=")[0]) == "password" else p
        for p in parts.query.split("&")
        if p
    )
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def _parse_url(url: str, prefix: str) -> tuple[str, bool, str]:
    """(URL for redis-py, cluster?, prefix); ``prefix=`` in the query wins over ``prefix``."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(
            f"not a Redis URL: {_redact(url)!r} (expected redis://, rediss://, unix://, "
            "redis+cluster:// or rediss+cluster://)"
        )
    client_scheme, cluster = _SCHEMES[scheme]
    keep: list[str] = []
    for piece in parts.query.split("&"):
        if not piece:
            continue
        name, _, value = piece.partition("=")
        name = unquote_plus(name)
        if name == "prefix":
            prefix = unquote_plus(value)
        elif name == "decode_responses":
            raise ValueError("decode_responses is not supported: record bodies are bytes")
        else:
            keep.append(piece)
    if cluster and parts.path not in ("", "/", "/0"):
        raise ValueError(f"Redis Cluster has only database 0: {_redact(url)!r}")
    client_url = urlunsplit(parts._replace(scheme=client_scheme, query="&".join(keep)))
    return client_url, cluster, prefix


# -- the store ---------------------------------------------------------------------


class RedisStore(Store[_Op]):
    """Records in Redis or Redis Cluster; see the module docstring for the layout.

    Nothing connects until the first operation. The sync client is shared by all
    threads; an asyncio client is made per running event loop. redis-py's own
    retries are off (a re-sent script could apply twice): a failed round trip
    raises :class:`~retrysafe.StoreUnavailableError` at once, and the next call
    reconnects.
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        socket_timeout: float = 5.0,
        connect_timeout: float = 2.0,
    ) -> None:
        self.url = url
        self._client_url, self.cluster, self.prefix = _parse_url(url, prefix)
        self._safe_url = _redact(url)
        self._options: dict[str, Any] = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": connect_timeout,
        }
        self._lock = threading.Lock()
        self._sync: _Conn | None = None
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Conn] = (
            weakref.WeakKeyDictionary()
        )

    def record_key(self, key_hash: str) -> str:
        """The Redis key of a record."""
        return f"{self.prefix}{{{key_hash}}}"

    # -- ops ---------------------------------------------------------------------

    def _claim(self, record: Record) -> _Op:
        args = _claim_args(record)
        return _Op("claim", self.record_key(record.key_hash), args, _parse_claim)

    def _complete(self, key_hash: str, token: str, outcome: Outcome, now: float) -> _Op:
        t = _f(now)
        pairs = ["status", Status.COMPLETED.value, "completed", t, "updated", t]
        pairs += _outcome_args(outcome)
        delete = _NO_CODE if outcome.status is None else ()
        return _Op("cas", self.record_key(key_hash), _cas_args(token, delete, pairs), _parse_bool)

    def _fail(
        self, key_hash: str, token: str, outcome: Outcome | None, final: bool, now: float
    ) -> _Op:
        pairs: list[Any] = ["status", Status.FAILED.value, "final", "1" if final else "0"]
        pairs += ("updated", _f(now))
        if outcome is None:
            delete: Sequence[str] = _OUTCOME_FIELDS
        else:
            pairs += _outcome_args(outcome)
            delete = _NO_CODE if outcome.status is None else ()
        return _Op("cas", self.record_key(key_hash), _cas_args(token, delete, pairs), _parse_bool)

    def _renew(self, key_hash: str, token: str, lease_until: float, now: float) -> _Op:
        pairs = ("lease", _f(lease_until), "updated", _f(now))
        return _Op("cas", self.record_key(key_hash), _cas_args(token, (), pairs), _parse_bool)

    def _get(self, key_hash: str) -> _Op:
        return _Op("HMGET", self.record_key(key_hash), FIELDS, record_from_values)

    def _delete(self, key_hash: str) -> _Op:
        return _Op("DEL", self.record_key(key_hash), (), _parse_bool)

    # -- executors ---------------------------------------------------------------

    def _run(self, op: _Op) -> Any:
        try:
            conn = self._sync or self._sync_conn()
            reply = _send(conn, op)
        except _UNAVAILABLE as exc:
            raise self._unavailable(exc) from exc
        return op.parse(reply)

    async def _arun(self, op: _Op) -> Any:
        loop = asyncio.get_running_loop()
        try:
            conn = self._async.get(loop) or self._async_conn(loop)
            reply = await _send(conn, op)
        except _UNAVAILABLE as exc:
            raise self._unavailable(exc) from exc
        return op.parse(reply)

    def _unavailable(self, exc: BaseException) -> StoreUnavailableError:
        detail = str(exc) or type(exc).__name__
        return StoreUnavailableError(f"Redis store {self._safe_url} is unavailable: {detail}")

    # -- clients -----------------------------------------------------------------

    def _client_options(self, retry: Any) -> dict[str, Any]:
        options = {**self._options, "retry": retry}
        if MaintNotificationsConfig is not None:
            # With maintenance notifications on ("auto", the default) redis-py's asyncio
            # pool skips its stale-connection check, so the first call after a server
            # restart would fail; they only matter for RESP3 on Redis Enterprise.
            options["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
        return options

    def _sync_conn(self) -> _Conn:
        with self._lock:
            if self._sync is None:
                options = self._client_options(Retry(NoBackoff(), 0))
                cls = redis.cluster.RedisCluster if self.cluster else redis.Redis
                # A cluster client connects here (topology discovery); a plain one lazily.
                client = cls.from_url(self._client_url, **options)
                self._sync = _Conn(client, _register(client))
            return self._sync

    def _async_conn(self, loop: asyncio.AbstractEventLoop) -> _Conn:
        with self._lock:
            conn = self._async.get(loop)
            if conn is None:
                # A client pins its loop (so the weak key never dies by itself):
                # forget the clients of loops that were closed.
                for old in [lp for lp in self._async if lp.is_closed()]:
                    del self._async[old]
                options = self._client_options(redis.asyncio.retry.Retry(NoBackoff(), 0))
                cls = redis.asyncio.cluster.RedisCluster if self.cluster else redis.asyncio.Redis
                client = cls.from_url(self._client_url, **options)
                conn = self._async[loop] = _Conn(client, _register(client))
            return conn

    def close(self) -> None:
        """Close the sync client and forget clients of closed event loops."""
        with self._lock:
            conn, self._sync = self._sync, None
            for old in [lp for lp in self._async if lp.is_closed()]:
                del self._async[old]
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.client.close()

    async def aclose(self) -> None:
        """Close the current event loop's client, then as :meth:`close`."""
        loop = asyncio.get_running_loop()
        with self._lock:
            conn = self._async.pop(loop, None)
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.client.aclose()
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._safe_url}>"


def _register(client: Any) -> dict[str, Any]:
    return {name: client.register_script(text) for name, text in _SCRIPTS.items()}
