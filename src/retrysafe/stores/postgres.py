"""``postgresql://``: records in one PostgreSQL table; claim-or-read is one function call.

The claim is a PL/pgSQL function created by the schema migration: it reads the
row and, only when :func:`retrysafe._decide.claimable` allows it, inserts or
overwrites it, all in one round trip and correct under READ COMMITTED
concurrency. Completion, failure and renewal are single compare-and-set
``UPDATE`` statements on the fencing token. Every statement runs in autocommit
mode, so an error never leaves anything half-written.

Connections come from ``psycopg_pool``: one thread-safe pool for the sync
methods and one pool per running event loop for the async ones, all created on
first use, so constructing a store never connects.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import select
import threading
import weakref
from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple
from urllib.parse import unquote

try:
    import psycopg
    from psycopg import pq, sql
    from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolClosed, PoolTimeout
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the PostgreSQL store needs psycopg 3 and psycopg_pool: pip install 'retrysafe[postgres]'"
    ) from exc

from .._errors import StoreUnavailableError
from .._record import ClaimResult, Outcome, Record, Status
from ._base import Store
from ._sql import COLUMNS, outcome_params, record_from_row, record_params

__all__ = ["SCHEMA_VERSION", "PostgresStore", "SchemaVersionError"]


class SchemaVersionError(StoreUnavailableError):
    """The table's schema is newer than this version of retrysafe knows."""


class _Op(NamedTuple):
    """One statement and how to read its result: ``parse(rowcount, first_row)``."""

    query: str
    params: Sequence[Any]
    parse: Callable[[int, Sequence[Any] | None], Any]


# -- the schema ------------------------------------------------------------------

#: The record columns of schema v1, in :data:`COLUMNS` order: (name, type, nullable).
_V1_COLUMNS: tuple[tuple[str, str, bool], ...] = (
    ("key_hash", "text", False),
    ("key", "text", False),
    ("scope", "text", False),
    ("operation", "text", False),
    ("fingerprint", "text", False),
    ("status", "text", False),
    ("token", "text", False),
    ("lease_until", "double precision", False),
    ("expires_at", "double precision", False),
    ("created_at", "double precision", False),
    ("updated_at", "double precision", False),
    ("completed_at", "double precision", True),
    ("attempts", "integer", False),
    ("request_id", "text", True),
    ("final", "boolean", False),
    ("response_status", "integer", True),
    ("response_headers", "text", True),
    ("response_media_type", "text", True),
    ("response_body", "bytea", True),
    ("request_payload", "bytea", True),
    ("metadata", "text", False),
)
if tuple(c[0] for c in _V1_COLUMNS) != COLUMNS:  # pragma: no cover - a schema change needs v2
    raise ImportError("retrysafe.stores.postgres: the schema does not match _sql.COLUMNS")
_TYPES = {name: type_ for name, type_, _ in _V1_COLUMNS}

# The claimable rule of retrysafe._decide over row alias {r} and claim time p_updated_at.
_CLAIMABLE = """(
    {r}.expires_at <= p_updated_at
    OR ({r}.fingerprint = p_fingerprint AND (
        ({r}.status = 'failed' AND NOT {r}.final)
        OR ({r}.status = 'processing' AND {r}.lease_until <= p_updated_at)))
)"""

_V1_TABLE = """
CREATE TABLE {table} (
    {columns},
    CONSTRAINT {pkey} PRIMARY KEY (key_hash),
    CONSTRAINT {status_check} CHECK (status IN ('processing', 'completed', 'failed'))
) WITH (fillfactor = 90)
"""
_V1_INDEX = "CREATE INDEX {index} ON {table} (expires_at)"
_V1_CLAIM = """
CREATE OR REPLACE FUNCTION {fn}(
    {params})
RETURNS {table} LANGUAGE plpgsql VOLATILE AS $retrysafe$
-- Claim-or-read. Not claimed: returns the live record that stands in the way.
-- Claimed: returns a row whose key_hash is NULL, attempts is this attempt's number
-- and status the status taken over (NULL for a new or expired key).
DECLARE
    cur {table}%ROWTYPE;
    claimed {table}%ROWTYPE;
    live boolean;
BEGIN
    LOOP
        SELECT * INTO cur FROM {table} AS r WHERE r.key_hash = p_key_hash;
        IF NOT FOUND THEN
            INSERT INTO {table} AS r ({columns}) VALUES ({values})
                ON CONFLICT (key_hash) DO NOTHING;
            IF FOUND THEN
                claimed.attempts := p_attempts;
                RETURN claimed;
            END IF;
        ELSIF NOT {cur_claimable} THEN
            RETURN cur;
        ELSE
            live := cur.expires_at > p_updated_at;
            UPDATE {table} AS r SET {assignments}
                WHERE r.key_hash = p_key_hash AND r.token = cur.token
                    AND r.status = cur.status AND {r_claimable};
            IF FOUND THEN
                IF live THEN
                    claimed.attempts := cur.attempts + 1;
                    claimed.status := cur.status;
                ELSE
                    claimed.attempts := p_attempts;
                END IF;
                RETURN claimed;
            END IF;
        END IF;
        -- A concurrent claim, completion or delete got there first: look again.
    END LOOP;
END
$retrysafe$
"""

#: The version this code writes and understands.
SCHEMA_VERSION = 1


def _v1(table: sql.Identifier, fn: sql.Identifier, base: str) -> list[sql.Composable]:
    """Schema v1: the table, its expiry index and the claim function."""
    columns = sql.SQL(",\n    ").join(
        sql.SQL("{} {}{}").format(
            sql.Identifier(name), sql.SQL(type_), sql.SQL("" if nullable else " NOT NULL")
        )
        for name, type_, nullable in _V1_COLUMNS
    )
    special = {
        "created_at": "CASE WHEN live THEN cur.created_at ELSE p_created_at END",
        "attempts": "CASE WHEN live THEN cur.attempts + 1 ELSE p_attempts END",
    }
    assignments = sql.SQL(", ").join(
        sql.SQL("{} = {}").format(sql.Identifier(c), sql.SQL(special.get(c, f"p_{c}")))
        for c in COLUMNS
        if c != "key_hash"
    )
    claim = sql.SQL(_V1_CLAIM).format(
        fn=fn,
        table=table,
        params=sql.SQL(",\n    ").join(sql.SQL(f"p_{c} {_TYPES[c]}") for c in COLUMNS),
        columns=sql.SQL(", ").join(map(sql.Identifier, COLUMNS)),
        values=sql.SQL(", ").join(sql.SQL(f"p_{c}") for c in COLUMNS),
        assignments=assignments,
        cur_claimable=sql.SQL(_CLAIMABLE.format(r="cur")),
        r_claimable=sql.SQL(_CLAIMABLE.format(r="r")),
    )
    return [
        sql.SQL(_V1_TABLE).format(
            table=table,
            columns=columns,
            pkey=sql.Identifier(f"{base}_pkey"),
            status_check=sql.Identifier(f"{base}_status_check"),
        ),
        sql.SQL(_V1_INDEX).format(index=sql.Identifier(f"{base}_expires_at"), table=table),
        claim,
    ]


#: Migrations by the version they lead to (index 0 → v1). Append, never edit.
_MIGRATIONS: tuple[Callable[[sql.Identifier, sql.Identifier, str], list[sql.Composable]], ...] = (
    _v1,
)
assert len(_MIGRATIONS) == SCHEMA_VERSION

# -- URL handling ------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}")
_OWN_OPTIONS = ("table", "min_size", "max_size", "auto_migrate")
_PASSWORD_IN_URL = re.compile(r"(://[^:/@?#]*:)[^@/?#]*@")
_PASSWORD_PARAM = re.compile(r"(?i)([?&]password=)[^&#]*")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _split_url(url: str) -> tuple[str, dict[str, str]]:
    """(libpq URL without our own query options, our options)."""
    base, _, rest = url.partition("?")
    query, hash_, fragment = rest.partition("#")
    keep: list[str] = []
    ours: dict[str, str] = {}
    for item in query.split("&"):
        name, _, value = item.partition("=")
        if unquote(name) in _OWN_OPTIONS:
            ours[unquote(name)] = unquote(value)
        elif item:
            keep.append(item)
    conninfo = base + ("?" + "&".join(keep) if keep else "") + hash_ + fragment
    return conninfo, ours


def _redact(url: str) -> str:
    """``url`` with any password replaced by ``***``."""
    return _PASSWORD_PARAM.sub(r"\1***", _PASSWORD_IN_URL.sub(r"\1***@", url))


def _table_parts(table: str) -> tuple[str, ...]:
    parts = tuple(table.split("."))
    if len(parts) > 2 or not all(_NAME.fullmatch(p) for p in parts):
        raise ValueError(
            f"invalid table name {table!r}: use [schema.]name, letters, digits and "
            "underscores, at most 48 characters each"
        )
    return parts


def _option(name: str, given: Any, default: Any, url_value: str | None, convert: Any) -> Any:
    """A store option from the URL or the keyword argument (not both, unless equal)."""
    if url_value is None:
        return given
    try:
        value = convert(url_value)
    except ValueError as exc:
        raise ValueError(f"invalid {name}={url_value!r} in the store URL") from exc
    if given != default and given != value:
        raise ValueError(f"{name} given both in the URL ({value!r}) and as an argument ({given!r})")
    return value


def _to_bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(text)


# -- the executors' helpers ---------------------------------------------------------

_UNAVAILABLE = (psycopg.Error, PoolTimeout, PoolClosed, OSError)


def _closed_by_server(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """True when an idle pooled connection has input: the server closed or is closing it.

    No round trip: a zero-timeout poll of the socket. An idle autocommit connection
    expects nothing, so anything readable (EOF, a FATAL shutdown notice) means discard.
    """
    try:
        fd = conn.pgconn.socket
    except psycopg.Error:
        return True
    if _poll is None:  # pragma: no cover - platforms without poll()
        return bool(fd < 1024 and select.select([fd], [], [], 0)[0])
    poller = _poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


_poll = getattr(select, "poll", None)


def _has_rows(cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]) -> bool:
    """Whether the statement returned rows (cheaper than building ``cur.description``)."""
    result = cur.pgresult
    return result is not None and result.status == pq.ExecStatus.TUPLES_OK


def _first(rowcount: int, row: Sequence[Any] | None) -> Any:
    return None if row is None else row[0]


def _changed(rowcount: int, row: Sequence[Any] | None) -> bool:
    return rowcount == 1


def _record_or_none(rowcount: int, row: Sequence[Any] | None) -> Record | None:
    return None if row is None else record_from_row(row)


_ATTEMPTS = COLUMNS.index("attempts")
_STATUS = COLUMNS.index("status")


def _claim_result(rowcount: int, row: Sequence[Any] | None) -> ClaimResult:
    assert row is not None
    if row[0] is None:  # the claim function's answer for "claimed": no key_hash
        took_over = None if row[_STATUS] is None else Status(row[_STATUS])
        return ClaimResult(True, attempts=row[_ATTEMPTS], took_over=took_over)
    return ClaimResult(False, record=record_from_row(row))


# A migration is a generator of (query, params) that receives each statement's first row.
_Flow = Generator[tuple[str, Sequence[Any] | None], Sequence[Any] | None, int]


def _drive(conn: psycopg.Connection[Any], flow: _Flow) -> int:
    """Run a migration flow in one transaction on a sync connection."""
    row: Sequence[Any] | None = None
    with conn.transaction():
        try:
            while True:
                query, params = flow.send(row)
                cur = conn.execute(query, params)
                row = cur.fetchone() if _has_rows(cur) else None
        except StopIteration as stop:
            return int(stop.value)


async def _adrive(conn: psycopg.AsyncConnection[Any], flow: _Flow) -> int:
    """Run a migration flow in one transaction on an async connection."""
    row: Sequence[Any] | None = None
    async with conn.transaction():
        try:
            while True:
                query, params = flow.send(row)
                cur = await conn.execute(query, params)
                row = await cur.fetchone() if _has_rows(cur) else None
        except StopIteration as stop:
            return int(stop.value)


class _Connection(psycopg.Connection[Any]):
    """A pooled connection that keeps one binary cursor for the store's statements."""

    _store_cursor: psycopg.Cursor[Any] | None = None

    def store_cursor(self) -> psycopg.Cursor[Any]:
        cur = self._store_cursor
        if cur is None:
            cur = self._store_cursor = self.cursor(binary=True)
        return cur


class _AsyncConnection(psycopg.AsyncConnection[Any]):
    """:class:`_Connection` for the async pools."""

    _store_cursor: psycopg.AsyncCursor[Any] | None = None

    def store_cursor(self) -> psycopg.AsyncCursor[Any]:
        cur = self._store_cursor
        if cur is None:
            cur = self._store_cursor = self.cursor(binary=True)
        return cur


class _LoopPool(NamedTuple):
    pool: AsyncConnectionPool[_AsyncConnection]
    migrate_lock: asyncio.Lock


class PostgresStore(Store[_Op]):
    """Records in one PostgreSQL table (default ``retrysafe_records``).

    ``url`` is a libpq URL (``postgresql://`` or ``postgres://``, libpq query
    parameters allowed); the query may also carry this store's own ``table``,
    ``min_size``, ``max_size`` and ``auto_migrate`` options. ``connect_timeout``
    bounds both connecting and waiting for a pooled connection. With
    ``auto_migrate`` the schema is created or upgraded on first use.
    """

    def __init__(
        self,
        url: str,
        *,
        table: str = "retrysafe_records",
        min_size: int = 0,
        max_size: int = 10,
        connect_timeout: float = 2.0,
        auto_migrate: bool = True,
    ) -> None:
        scheme = url.partition("://")[0].lower()
        if scheme not in {"postgresql", "postgres"}:
            raise ValueError(f"not a postgresql:// URL: {_redact(url)!r}")
        self.url = url
        conninfo, options = _split_url(url)
        table = _option("table", table, "retrysafe_records", options.get("table"), str)
        min_size = _option("min_size", min_size, 0, options.get("min_size"), int)
        max_size = _option("max_size", max_size, 10, options.get("max_size"), int)
        auto_migrate = _option(
            "auto_migrate", auto_migrate, True, options.get("auto_migrate"), _to_bool
        )
        if min_size < 0 or max_size < 1 or max_size < min_size:
            raise ValueError(f"need 0 <= min_size <= max_size and max_size >= 1, "
                             f"not min_size={min_size} max_size={max_size}")  # fmt: skip
        try:
            params = psycopg.conninfo.conninfo_to_dict(conninfo)
        except psycopg.Error as exc:
            raise ValueError(f"invalid PostgreSQL URL {_redact(url)!r}: {exc}") from None
        kwargs: dict[str, Any] = {"autocommit": True}
        if "connect_timeout" in params:
            connect_timeout = float(params["connect_timeout"])
        else:
            kwargs["connect_timeout"] = max(1, round(connect_timeout))
        if "application_name" not in params:
            kwargs["fallback_application_name"] = "retrysafe"

        self.table = table
        self.min_size = min_size
        self.max_size = max_size
        self.connect_timeout = connect_timeout
        self.auto_migrate = auto_migrate
        self._conninfo = conninfo
        self._conn_kwargs = kwargs
        host = str(params.get("host") or params.get("hostaddr") or "localhost")
        port = str(params.get("port") or "5432")
        dbname = str(params.get("dbname") or params.get("user") or "")
        self._where = f"{host}:{port}/{dbname} (table {table})"

        self._pool: ConnectionPool[_Connection] | None = None
        self._apools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopPool] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        self._migrated = not auto_migrate
        self._build_sql(_table_parts(table))

    def _build_sql(self, parts: tuple[str, ...]) -> None:
        """Compose every statement once; the executors only bind parameters."""
        *schema, base = parts
        table = sql.Identifier(*parts)
        fn = sql.Identifier(*schema, f"{base}_claim")
        versions = sql.Identifier(*schema, f"{base}_schema")
        cols = sql.SQL(", ").join(map(sql.Identifier, COLUMNS))
        cas = sql.SQL(" WHERE key_hash = %s AND token = %s AND status = 'processing'")

        def text(query: sql.Composable) -> str:
            return query.as_string(None)

        self._q_claim = text(
            sql.SQL("SELECT {} FROM {}({})").format(
                cols, fn, sql.SQL(", ").join(sql.SQL(f"%s::{_TYPES[c]}") for c in COLUMNS)
            )
        )
        outcome = sql.SQL(
            "response_status = %s, response_headers = %s, response_media_type = %s, "
            "response_body = %s"
        )
        self._q_complete = text(
            sql.SQL("UPDATE {} SET status = 'completed', {}, completed_at = %s, updated_at = %s")
            .format(table, outcome) + cas
        )  # fmt: skip
        self._q_fail = text(
            sql.SQL("UPDATE {} SET status = 'failed', {}, final = %s, updated_at = %s")
            .format(table, outcome) + cas
        )  # fmt: skip
        self._q_renew = text(
            sql.SQL("UPDATE {} SET lease_until = %s, updated_at = %s").format(table) + cas
        )
        self._q_get = text(sql.SQL("SELECT {} FROM {} WHERE key_hash = %s").format(cols, table))
        self._q_delete = text(sql.SQL("DELETE FROM {} WHERE key_hash = %s").format(table))

        self._q_versions_exist = "SELECT to_regclass(%s) IS NOT NULL"
        self._versions_name = text(versions)
        self._q_version = text(sql.SQL("SELECT coalesce(max(version), 0) FROM {}").format(versions))
        self._read_version = _Op(self._q_version, (), _first)
        self._q_lock = "SELECT pg_advisory_xact_lock(%s)"
        digest = hashlib.sha256(f"retrysafe:{'.'.join(parts)}".encode()).digest()
        self._lock_id = int.from_bytes(digest[:8], "big", signed=True)
        self._q_create_versions = text(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (version integer PRIMARY KEY, "
                "applied_at timestamptz NOT NULL DEFAULT now())"
            ).format(versions)
        )
        self._q_set_version = text(sql.SQL("INSERT INTO {} (version) VALUES (%s)").format(versions))
        self._migrations = [
            [text(q) for q in migration(table, fn, base)] for migration in _MIGRATIONS
        ]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {_redact(self.url)} table={self.table}>"

    # -- schema ------------------------------------------------------------------

    def _migration(self) -> _Flow:
        """Create or upgrade the schema; the version-table check skips the lock when current."""
        exists = yield self._q_versions_exist, (self._versions_name,)
        if exists and exists[0]:
            row = yield self._q_version, None
            if self._check_version(row) == SCHEMA_VERSION:
                return SCHEMA_VERSION
        yield self._q_lock, (self._lock_id,)
        yield self._q_create_versions, None
        version = self._check_version((yield self._q_version, None))
        for target in range(version + 1, SCHEMA_VERSION + 1):
            for statement in self._migrations[target - 1]:
                yield statement, None
            yield self._q_set_version, (target,)
        return SCHEMA_VERSION

    def _check_version(self, row: Sequence[Any] | None) -> int:
        version = int(row[0]) if row else 0
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"PostgreSQL store at {self._where}: schema version {version} is newer than "
                f"this retrysafe supports ({SCHEMA_VERSION}); upgrade retrysafe"
            )
        return version

    def migrate(self) -> int:
        """Create or upgrade the schema (under an advisory lock); return its version."""
        self._migrated = False
        return int(self._run(self._read_version))

    async def amigrate(self) -> int:
        """:meth:`migrate` from a coroutine."""
        self._migrated = False
        return int(await self._arun(self._read_version))

    # -- connections ---------------------------------------------------------------

    def _unavailable(self, exc: BaseException) -> StoreUnavailableError:
        if isinstance(exc, StoreUnavailableError):
            return exc
        if isinstance(exc, PoolTimeout):
            reason = (
                f"no connection within {self.connect_timeout:g}s (server down or unreachable, "
                f"or all {self.max_size} pooled connections busy)"
            )
        else:
            reason = str(exc).strip() or type(exc).__name__
        return StoreUnavailableError(
            f"PostgreSQL store at {self._where} is unavailable: {reason}",
            retry_after=max(1.0, self.connect_timeout),
        )

    def _pool_kwargs(self) -> dict[str, Any]:
        return {
            "kwargs": self._conn_kwargs,
            "min_size": self.min_size,
            "max_size": self.max_size,
            "open": False,
            "timeout": self.connect_timeout,
            # Give up reconnecting quickly so that new callers start a fresh attempt
            # (rather than wait out a long backoff) once the server is back.
            "reconnect_timeout": self.connect_timeout,
            "name": f"retrysafe {self._where}",
        }

    def _sync_pool(self) -> ConnectionPool[_Connection]:
        pool = self._pool
        if pool is None:
            with self._lock:
                pool = self._pool
                if pool is None:
                    pool = ConnectionPool(
                        self._conninfo, connection_class=_Connection, **self._pool_kwargs()
                    )
                    pool.open(wait=False)
                    self._pool = pool
        return pool

    async def _loop_pool(self) -> _LoopPool:
        loop = asyncio.get_running_loop()
        entry = self._apools.get(loop)
        if entry is None:
            # Pools of loops that ended without aclose(): their tasks are gone, drop them.
            for old in [old for old in self._apools if old.is_closed()]:
                self._apools.pop(old, None)
            pool = AsyncConnectionPool(
                self._conninfo, connection_class=_AsyncConnection, **self._pool_kwargs()
            )
            entry = self._apools[loop] = _LoopPool(pool, asyncio.Lock())
            await pool.open(wait=False)
        return entry

    # The two executors: take a live pooled connection (skipping idle ones the server
    # dropped, see _closed_by_server), migrate once if due, run the op's statement.

    def _run(self, op: _Op) -> Any:
        try:
            pool = self._pool or self._sync_pool()
            conn = pool.getconn()
            for _ in range(self.max_size):
                if not _closed_by_server(conn):
                    break
                conn.close()  # the pool replaces a closed connection
                pool.putconn(conn)
                conn = pool.getconn()
            try:
                if not self._migrated:
                    with self._lock:
                        if not self._migrated:
                            _drive(conn, self._migration())
                            self._migrated = True
                cur = conn.store_cursor()
                cur.execute(op.query, op.params)
                rowcount, row = cur.rowcount, cur.fetchone() if _has_rows(cur) else None
            finally:
                pool.putconn(conn)
        except _UNAVAILABLE as exc:
            raise self._unavailable(exc) from exc
        return op.parse(rowcount, row)

    async def _arun(self, op: _Op) -> Any:
        try:
            entry = await self._loop_pool()
            pool = entry.pool
            conn = await pool.getconn()
            for _ in range(self.max_size):
                if not _closed_by_server(conn):
                    break
                await conn.close()
                await pool.putconn(conn)
                conn = await pool.getconn()
            try:
                if not self._migrated:
                    async with entry.migrate_lock:
                        if not self._migrated:
                            await _adrive(conn, self._migration())
                            self._migrated = True
                cur = conn.store_cursor()
                await cur.execute(op.query, op.params)
                rowcount, row = cur.rowcount, await cur.fetchone() if _has_rows(cur) else None
            finally:
                await pool.putconn(conn)
        except _UNAVAILABLE as exc:
            raise self._unavailable(exc) from exc
        return op.parse(rowcount, row)

    def close(self) -> None:
        """Close the sync pool (and forget async pools of closed loops); reopens on use."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
        for loop in [loop for loop in self._apools if loop.is_closed()]:
            self._apools.pop(loop, None)

    async def aclose(self) -> None:
        """Close the running loop's pool and the sync pool; reopens on use."""
        entry = self._apools.pop(asyncio.get_running_loop(), None)
        if entry is not None:
            await entry.pool.close()
        if self._pool is not None:
            await asyncio.to_thread(self.close)

    # -- operations ------------------------------------------------------------------

    def _claim(self, record: Record) -> _Op:
        return _Op(self._q_claim, record_params(record), _claim_result)

    def _complete(self, key_hash: str, token: str, outcome: Outcome, now: float) -> _Op:
        params = (*outcome_params(outcome), now, now, key_hash, token)
        return _Op(self._q_complete, params, _changed)

    def _fail(
        self, key_hash: str, token: str, outcome: Outcome | None, final: bool, now: float
    ) -> _Op:
        params = (*outcome_params(outcome), bool(final), now, key_hash, token)
        return _Op(self._q_fail, params, _changed)

    def _renew(self, key_hash: str, token: str, lease_until: float, now: float) -> _Op:
        return _Op(self._q_renew, (lease_until, now, key_hash, token), _changed)

    def _get(self, key_hash: str) -> _Op:
        return _Op(self._q_get, (key_hash,), _record_or_none)

    def _delete(self, key_hash: str) -> _Op:
        return _Op(self._q_delete, (key_hash,), _changed)
