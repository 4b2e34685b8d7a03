"""The Redis (and Redis Cluster) store: one string per record, claimed with one native
SET; complete, fail and renew are one script each. The commands, the layout and
the sweep are described in docs/stores.md ("Redis layout")."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from redis import exceptions as _rx

from retrysafe._model.decide import claimable
from retrysafe._model.record import FINANCIAL, ClaimResult, Outcome, Record, Status
from retrysafe.errors import StoreUnavailableError
from retrysafe.stores import open_store
from retrysafe.stores._base import ArchivedRecord, RecordQuery, Store, StoreStats, SweepBatch
from retrysafe.stores._redact import redact
from retrysafe.stores.redis.clients import (
    DEFAULT_PREFIX,
    DEFAULT_URL,
    UNAVAILABLE_ERRORS,
    RedisClients,
    _forget_clients,
    _parse_url,
)
from retrysafe.stores.redis.codec import (
    _DONE,
    _DOUBLE,
    _FAILED,
    _HEAD,
    _MALFORMED,
    _MAX_PEXPIRE_MS,
    _SAME,
    _TOOK,
    _outcome_blob,
    _record_value,
    _stored_fingerprint,
    _stored_token,
    _ttl_ms,
    record_from_value,
)
from retrysafe.stores.redis.connections import AsyncPool, Pool, endpoint
from retrysafe.stores.redis.lua import (
    _CELL_WRITE_SHA,
    _CLAIM_SHA,
    _COMPLETE_SHA,
    _FAIL_SHA,
    _RENEW_SHA,
    _SCRIPTS,
    _SWEEP_DELETE,
)

__all__ = ["RedisStore"]

#: What a scanned value that is not a record raises while it is decoded.
_NOT_A_RECORD: tuple[type[BaseException], ...] = (*_MALFORMED, StoreUnavailableError)

# -- ops -----------------------------------------------------------------------------


_NO_OPTIONS: dict[str, Any] = {}  # never mutated


class _Op(NamedTuple):
    """One round trip: a command, and how to read its reply.

    ``parse(reply, op)`` returns the answer, or another op to run next (a claim
    that found a claimable record, or the script claim that replaces a refused
    ``SET NX GET``).
    """

    #: The command and its arguments, as ``execute_command`` takes them.
    args: Sequence[Any]
    parse: Callable[[Any, _Op], Any]
    #: The record's key hash (or a cell's key): for decoding the reply and for errors.
    key: str
    #: The record a ``SET NX GET`` claim writes: its takeover or fallback needs it.
    record: Record | None = None
    #: redis-py options of ``execute_command`` (``get=True`` for ``SET … GET``).
    options: dict[str, Any] = _NO_OPTIONS


_SET_GET: dict[str, Any] = {"get": True}  # SET ... GET replies with the old value


def _parse_set_claim(reply: Any, op: _Op) -> ClaimResult | _Op:
    """The reply of ``SET NX GET``: claimed, a live record, or the claim script to run."""
    if reply is None:
        return ClaimResult(True)
    args, r = op.args, op.record  # args: SET key value NX GET [PX ms]
    found = record_from_value(reply, op.key)
    assert r is not None
    if not claimable(found, r.fingerprint, r.updated_at):
        return ClaimResult(False, found)
    ttl = args[6] if len(args) > 5 else 0
    return _Op(_claim_script(args[1], args[2], r, ttl), _parse_claim, op.key)


def _claim_script(key: str | bytes, value: bytes, record: Record, ttl: int) -> tuple[Any, ...]:
    """The claim script's command (see lua._CLAIM): it reads records of every layout."""
    fp = record.fingerprint
    return ("EVALSHA", _CLAIM_SHA, 1, key, value, _stored_fingerprint(fp), ttl, fp)


def _parse_claim(reply: Any, op: _Op) -> ClaimResult:
    if type(reply) is int:
        return ClaimResult(True, None, reply >> 2, _TOOK[reply & 3])
    return ClaimResult(False, record_from_value(reply, op.key))


def _parse_get(reply: Any, op: _Op) -> Record | None:
    return record_from_value(reply, op.key)


def _until(expires_at: float, now: float) -> tuple[bytes, int]:
    """A completion's or failure's new expiry and its PX ms, as the scripts take them
    (see lua._SETTLE); an expiry past any PX (0: no TTL) gets the longest PX."""
    return _DOUBLE.pack(expires_at), _ttl_ms(expires_at, now) or _MAX_PEXPIRE_MS


def _parse_bool(reply: Any, op: _Op) -> bool:
    return bool(reply)


def _parse_cell(reply: Any, op: _Op) -> list[Any] | None:
    """A cell's ``version LF expires_at LF json`` (see _CELL_WRITE), expired or not, as
    ``[version, json, expires_at]``."""
    if reply is None:
        return None
    version, expires_at, text = reply.decode().split("\n", 2)
    return [int(version), text, float(expires_at) if expires_at else None]


# -- sending -------------------------------------------------------------------------
# A standalone server's hot commands go through the store's own pools (connections.py;
# docs/stores.md, "The store's own connections"), unless its URL asks for something
# they do not do (TLS, ...): then, as the operations work always does, through redis-py.
# A standalone client's command goes straight to a pooled connection: redis-py's
# pool (its bound, its wait, its check of a returned connection, its fork guard),
# then one send and one read. Left out is what the client wraps around that, which
# this store has no use for: retries (off), reply callbacks (the ops parse raw
# replies) and per-command observability. An error reply leaves the connection in
# step; any other failure (a timeout, a cancelled read) may leave a reply unread,
# so that connection is closed before it returns to the pool. A cluster client
# routes by slot and follows redirections: its commands go through it.


def _send(client: Any, op: _Op) -> Any:
    """One command on one of ``client``'s pooled connections; its raw reply."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_command(*op.args)
        return conn.read_response()
    except _rx.ResponseError:
        raise
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


async def _asend(client: Any, op: _Op) -> Any:
    """As :func:`_send`, on an asyncio client."""
    pool = client.connection_pool
    conn = await pool.get_connection()
    try:
        await conn.send_command(*op.args)
        return await conn.read_response()
    except _rx.ResponseError:
        raise
    except BaseException:
        await conn.disconnect(nowait=True)
        raise
    finally:
        await pool.release(conn)


def _call(pool: Pool, op: _Op) -> Any:
    """One command on the store's own pool; a new or flushed server's scripts loaded."""
    try:
        return pool.call(op.args)
    except _rx.NoScriptError:
        pool.call(("SCRIPT", "LOAD", _SCRIPTS[op.args[1]]))
        return pool.call(op.args)


async def _acall(pool: AsyncPool, op: _Op) -> Any:
    """As :func:`_call`, on an event loop's pool."""
    try:
        return await pool.call(op.args)
    except _rx.NoScriptError:
        await pool.call(("SCRIPT", "LOAD", _SCRIPTS[op.args[1]]))
        return await pool.call(op.args)


def _send_cluster(client: Any, op: _Op) -> Any:
    return client.execute_command(*op.args, **op.options)


async def _asend_cluster(client: Any, op: _Op) -> Any:
    return await client.execute_command(*op.args, **op.options)


#: URL schemes of the stores that can hold a Redis store's archive.
#: Archive URLs: durable stores only. A memory:// archive would lose every record the
#: sweep deletes from Redis when the process ends (a MemoryStore object is accepted,
#: for tests that read it in the same process).
_ARCHIVE_SCHEMES = frozenset({"sqlite", "postgresql", "postgres", "mysql", "mariadb"})


def _check_archive(archive: object) -> None:
    """Refuse an ``archive`` option that cannot hold archived records."""
    if archive is None:
        return
    if isinstance(archive, str):
        if urlsplit(archive).scheme.lower() not in _ARCHIVE_SCHEMES:
            raise ValueError(
                "archive must be a sqlite:///, postgresql:// or mysql:// store URL, "
                f"not {redact(archive)!r}"
            )
        return
    if isinstance(archive, RedisStore) or not isinstance(archive, Store):
        raise TypeError(
            "archive must be a SQLite, PostgreSQL, MySQL or memory Store or its URL, "
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


class RedisStore(RedisClients, Store[_Op]):
    """Records in Redis or Redis Cluster (layout: docs/stores.md, "Redis layout").

    Nothing connects until the first operation. On a standalone server the hot
    commands go through the store's own connections, the rest through redis-py
    (docs/stores.md, "The store's own connections"); the sync pool and client are
    shared by all threads, and each running event loop gets its own. No command is
    re-sent (a re-sent script could apply twice): a failed round trip raises
    :class:`~retrysafe.StoreUnavailableError` at once, and the next call
    reconnects. ``max_connections`` bounds each pool (the sync one, and each event
    loop's); a call past it waits for a free connection for up to
    ``socket_timeout``. ``compact_keys`` keeps records under the key hash's 32 bytes
    rather than its hex; read docs/stores.md ("Redis keys") before turning it on.
    """

    settle_expiry = True

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        archive: Store[Any] | str | None = None,
        socket_timeout: float = 5.0,
        connect_timeout: float = 2.0,
        max_connections: int = 100,
        compact_keys: bool = False,
    ) -> None:
        self.url = url
        if isinstance(max_connections, bool) or not isinstance(max_connections, int):
            raise TypeError("max_connections must be an int")
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self.max_connections = max_connections
        self._client_url, self.cluster, self.prefix, in_url, compact = _parse_url(url, prefix)
        self._safe_url = redact(url)
        #: Record keys ``<prefix>{<32 bytes>}`` (binary) instead of ``<prefix>{<64 hex>}``
        #: (docs/stores.md, "Redis keys"); ``compact_keys=`` in the URL wins.
        self.compact_keys = bool(compact_keys) if compact is None else compact
        self._open = f"{self.prefix}{{".encode()
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
        self._endpoint = None
        if not self.cluster:
            pool_options = {"max_connections": max_connections, "timeout": socket_timeout}
            try:
                self._endpoint = endpoint(self._client_url, {**pool_options, **self._options})
            except Exception:  # a bad URL option: redis-py reports it at first use, as before
                self._endpoint = None
        self._pool: Pool | None = None
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncPool] = (
            weakref.WeakKeyDictionary()
        )
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

    def record_key(self, key_hash: str) -> str | bytes:
        """The Redis key of a record: ``<prefix>{<key_hash>}``; with ``compact_keys``,
        a key hash of 64 hex digits as its 32 bytes between the braces (bytes)."""
        if self.compact_keys:
            try:
                raw = bytes.fromhex(key_hash)
            except ValueError:  # not a key hash the engine makes: the text form
                raw = b""
            if len(raw) == 32 and len(key_hash) == 64:
                return b"".join((self._open, raw, b"}"))
        return f"{self.prefix}{{{key_hash}}}"

    # -- ops ---------------------------------------------------------------------

    def _claim(self, record: Record) -> _Op:
        kh = record.key_hash
        key = self.record_key(kh)
        value = _record_value(record)
        # Financial records get no physical TTL: only the sweeper, after archiving
        # them, may remove them (docs/stores.md, "Redis layout").
        ttl = 0 if record.retention == FINANCIAL else _ttl_ms(record.expires_at, record.updated_at)
        if not self._set_claims:  # the server has no SET NX GET
            return _Op(_claim_script(key, value, record, ttl), _parse_claim, kh)
        if ttl:
            args: Sequence[Any] = ("SET", key, value, "NX", "GET", "PX", ttl)
        else:
            args = ("SET", key, value, "NX", "GET")
        return _Op(args, _parse_set_claim, kh, record, _SET_GET)

    def _complete(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome,
        now: float,
        expires_at: float | None = None,
    ) -> _Op:
        args: tuple[Any, ...] = (
            "EVALSHA",
            _COMPLETE_SHA,
            1,
            self.record_key(key_hash),
            _stored_token(token),
            _DONE.pack(b"c", _SAME, now),
            _outcome_blob(outcome),
        )
        if expires_at is not None:
            args = (*args, *_until(expires_at, now))
        return _Op(args, _parse_bool, key_hash)

    def _fail(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome | None,
        final: bool,
        now: float,
        expires_at: float | None = None,
    ) -> _Op:
        args: list[Any] = [
            "EVALSHA",
            _FAIL_SHA,
            1,
            self.record_key(key_hash),
            _stored_token(token),
            _FAILED.pack(final, b"f"),
            _DOUBLE.pack(now),
        ]
        if outcome is not None:
            args.append(_outcome_blob(outcome))
        if expires_at is not None:
            if outcome is None:
                args.append(b"")
            args.extend(_until(expires_at, now))
        return _Op(args, _parse_bool, key_hash)

    def _renew(self, key_hash: str, token: str, lease_until: float, now: float) -> _Op:
        args = (
            "EVALSHA",
            _RENEW_SHA,
            1,
            self.record_key(key_hash),
            _stored_token(token),
            _DOUBLE.pack(lease_until),
            _DOUBLE.pack(now),
            _ttl_ms(lease_until, now) or 1,
        )
        return _Op(args, _parse_bool, key_hash)

    def _get(self, key_hash: str) -> _Op:
        return _Op(("GET", self.record_key(key_hash)), _parse_get, key_hash)

    def _delete(self, key_hash: str) -> _Op:
        return _Op(("DEL", self.record_key(key_hash)), _parse_bool, key_hash)

    def cell_key(self, key: str) -> str:
        """The Redis key of a versioned cell of retrysafe.guards."""
        return f"{self.prefix}cell:{key}"

    def _cell_read(self, key: str) -> _Op:
        return _Op(("GET", self.cell_key(key)), _parse_cell, key)

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
        return _Op(args, _parse_bool, key)

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
                if self._endpoint is not None:
                    reply = _call(self._pool or self._sync_pool(), op)
                else:
                    client = self._sync or self._sync_client()
                    send = _send_cluster if self.cluster else _send
                    try:
                        reply = send(client, op)
                    except _rx.NoScriptError:  # a new or flushed server: load, run once
                        client.script_load(_SCRIPTS[op.args[1]])
                        reply = send(client, op)
            except Exception as exc:
                op = self._retry_or_raise(op, exc)
                continue
            result = self._settle(op, reply)
            if type(result) is not _Op:
                return result
            op = result

    async def _arun(self, op: _Op) -> Any:
        loop = asyncio.get_running_loop()
        while True:
            try:
                if self._endpoint is not None:
                    reply = await _acall(self._pools.get(loop) or self._async_pool(loop), op)
                else:
                    client = self._async.get(loop) or await self._aconnect(loop)
                    asend = _asend_cluster if self.cluster else _asend
                    try:
                        reply = await asend(client, op)
                    except _rx.NoScriptError:
                        await client.script_load(_SCRIPTS[op.args[1]])
                        reply = await asend(client, op)
            except Exception as exc:
                op = self._retry_or_raise(op, exc)
                continue
            result = self._settle(op, reply)
            if type(result) is not _Op:
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
            return op.parse(reply, op)
        except _MALFORMED as exc:
            raise self._malformed(op, exc) from exc

    def _refused(self, op: _Op, exc: _rx.ResponseError) -> _Op:
        """The op to run instead of one the server refused, or the error to raise."""
        text = str(exc)
        args, record = op.args, op.record
        if op.parse is _parse_set_claim and "syntax error" in text:
            # Redis < 7.0 has no SET NX GET: claim with the script from now on.
            self._set_claims = False
            assert record is not None
            return self._claim(record)
        key = self._op_key(args)
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
            f"Redis store {self._safe_url}: {self._op_key(op.args)} holds a value that is not "
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

    def _op_key(self, args: Sequence[Any]) -> str:
        """The record key an op's command acts on (EVALSHA sha 1 key …, or CMD key …),
        as text: a compact key as ``<prefix>{<key_hash>}``."""
        key = args[3] if args[0] == "EVALSHA" else args[1]
        if type(key) is not bytes:
            return str(key)
        if key.startswith(self._open) and len(key) == len(self._open) + 33:
            return f"{self.prefix}{{{self._key_hash(key)}}}"
        return key.decode(errors="backslashreplace")

    def _key_hash(self, key: bytes) -> str:
        """The key hash of a scanned record key (either form: 32 bytes are compact)."""
        inner = key[len(self._open) : -1]
        return inner.hex() if len(inner) == 32 else inner.decode(errors="replace")

    def _decode(self, key: bytes, value: Any) -> Record | None:
        """The record a scanned key holds; ``None`` for anything that is not one."""
        if type(value) is not bytes:  # gone (None), or an error reply (another type)
            return None
        try:
            return record_from_value(value, self._key_hash(key))
        except _NOT_A_RECORD:  # another program's value
            return None

    def _expired(self, key: bytes, value: Any, now: float) -> Record | None:
        """The record under ``key`` if it is one and expired at ``now``."""
        if type(value) is not bytes or len(value) < _HEAD or value[0] not in (49, 50, 51):
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

    def _list_records(self, query: RecordQuery) -> list[Record]:
        """The records ``query`` selects, from a full SCAN."""
        try:
            client = self._sync or self._sync_client()
            return query.select(self._scan_records(client))
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

    def close(self) -> None:
        """Close the sync pool and client and the archive; forget the pools and clients
        of closed event loops."""
        with self._sync_lock, self._lock:
            client, self._sync = self._sync, None
            pool, self._pool = self._pool, None
            for old in [lp for lp in self._async if lp.is_closed()]:
                del self._async[old]
            for old in [lp for lp in self._pools if lp.is_closed()]:
                del self._pools[old]
            archive = self._archive
        if pool is not None:
            pool.close()
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        if archive is not None and self._archive_url is not None:  # ours, not the caller's
            with contextlib.suppress(Exception):
                archive.close()

    async def aclose(self) -> None:
        """Close the current event loop's pool and client, then as :meth:`close`."""
        loop = asyncio.get_running_loop()
        starting = self._starting.pop(loop, None)
        if starting is not None and not starting.done():  # a cluster client being started
            await asyncio.wait([starting])  # (its client, if any, is closed below)
        with self._lock:
            client = self._async.pop(loop, None)
            pool = self._pools.pop(loop, None)
        if pool is not None:
            pool.close()
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._safe_url}>"
