"""``postgresql://``: records in one PostgreSQL table, one statement per operation.

A claim is one plain SQL statement (no server-side function). It reads the row
by primary key and, only when there is none, inserts the new record with ``ON
CONFLICT (key_hash) DO NOTHING``, all from one snapshot. A new key is claimed;
an existing row comes back without a lock or a write, and Python applies
:func:`retrysafe._model.decide.claimable` to it, so a replay, an in-flight key or a
conflict is answered in that one round trip. When a concurrent insert committed
after the snapshot, the statement returns no row and runs again.

A row that may be taken over (expired, failed and retryable, or its lease ran
out) needs a second statement: a compare-and-set ``UPDATE`` on the token and
status that were read, which re-checks the rule on the current row. That extra
round trip is the price of keeping the common cases to one. Only retries and
crash recovery pay it, while a single statement that could also overwrite would
make every replay cost more on the server. If the ``UPDATE`` loses a race, the
claim starts over.

Completion, failure and renewal are single compare-and-set ``UPDATE``
statements on the fencing token. Every statement runs in autocommit mode, so an
error never leaves anything half-written.

Connections come from ``psycopg_pool``: one thread-safe pool for the sync
methods and one pool per running event loop for the async ones, all created on
first use, so constructing a store never connects. Checking out a connection
costs no round trip. Statements are composed once, and psycopg prepares each
one on a connection after a few uses. A forked child never uses its parent's
pools: it forgets them (without closing them) and makes its own.

The partitioned table (``partitioned=True``)
---------------------------------------------

An opt-in layout for large tables: the records table is partitioned by range of
``expires_at`` (``partition_interval`` per partition, aligned to the epoch), so a
partition whose upper bound has passed holds only expired records, and a sweep
drops it whole instead of deleting its rows one by one. The layout is chosen
when the table is created (its own migration path; the catalog's ``relkind``
tells the two apart and a store opened in the other mode refuses the table).

*Exactly once without a unique key.* A partitioned table's primary key must
contain the partition key, so ``(key_hash, expires_at)`` is the most it can
enforce: two claims of one new key with different expiries (a per-call TTL, or
a partition bound between them) could both insert, and ``ON CONFLICT
(key_hash)`` is not available. So a claim is one call of the plpgsql function
``<table>_claim(…)`` (still one round trip), which first takes
``pg_advisory_xact_lock(hashtextextended(key_hash, <table's seed>))``. Every
insert and every takeover of a key happens in that function, under that lock,
so they are serialized per key; the lock is released at commit, after the
commit is visible. Each statement of a VOLATILE function takes a new snapshot
under READ COMMITTED, so the read that follows the lock sees what the previous
holder committed: it finds no row and inserts, finds a row that is not
claimable and returns it (replay, in flight, conflict), or takes a claimable one
over with the same compare-and-set ``UPDATE`` as the unpartitioned path (a
completion, failure, renewal or delete that slipped in between makes it read
again). Completion, failure and renewal stay single compare-and-set ``UPDATE``
statements on the fencing token, without the lock: a token names one claim, and
they never create a row. Replays pay the lock too (one function call instead of
one statement), and every lookup by key hash probes each partition's index:
keep the number of live partitions small (tens).

*Rows that move.* A takeover writes a new ``expires_at``, and PostgreSQL moves
the row to its new partition. A statement that waited for the moving row (the
old owner's late completion, a delete) then fails with a serialization error
instead of re-checking it; nothing was written, so the store runs it again and
it finds the row with the new owner's token (a completion answers False).

*No DEFAULT partition.* PostgreSQL refuses ``DETACH PARTITION … CONCURRENTLY``
when the table has a default partition, and a plain detach or a drop takes
ACCESS EXCLUSIVE on the parent, which every claim would queue behind. So there
is none: partitions are made ahead (at creation and at every sweep, up to
``now + partition_ahead + 2 intervals``), and a claim whose row falls outside
them (a longer TTL, a skewed clock) fails with "no partition", makes the
partition (``<table>_add_partition``: a table created apart and attached, which
locks the parent only in SHARE UPDATE EXCLUSIVE mode; claims go on) and claims
again. Only that claim pays for the DDL. A backend that was building its partition
descriptor while such an attach committed can keep one without the new partition
(PostgreSQL consumes the invalidation mid-build) until the table changes again; a
claim that finds no partition after the add found it attached therefore goes on
on a new connection, and the stale one is closed.

*The sweep* takes one bounded step per call (see ``PostgresStore._psweep``):
it finishes what an interrupted sweep left (a pending detach, a detached table),
makes the partitions ahead, and takes the oldest partition whose upper bound is
<= now through ``DETACH PARTITION … CONCURRENTLY``, then, in one transaction,
copies its financial rows to the archive (``ON CONFLICT DO NOTHING``), counts
its rows and drops it. No row is deleted one by one: expired records of the
current partition wait for it to end (at most one interval), as lazy expiry
allows.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import re
import select
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
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

from retrysafe._model.decide import claimable
from retrysafe._model.duration import parse_duration
from retrysafe._model.record import ClaimResult, Outcome, Record, Status
from retrysafe.errors import SchemaModeError, SchemaVersionError, StoreUnavailableError
from retrysafe.stores._base import ArchivedRecord, Store, StoreStats, SweepBatch
from retrysafe.stores._redact import redact, redact_in
from retrysafe.stores._sql import (
    ARCHIVE_COLUMNS,
    COLUMNS,
    archived_from_row,
    outcome_params,
    record_from_row,
    record_params,
)

log = logging.getLogger("retrysafe")

__all__ = ["SCHEMA_VERSION", "PostgresStore", "SchemaModeError", "SchemaVersionError"]


class _Op(NamedTuple):
    """One statement and how to read its result: ``parse(rowcount, first_row)``.

    ``parse`` may return another op, which the executor then runs on the same
    connection (a claim's takeover, or its retry after a lost race).
    """

    query: str
    params: Sequence[Any]
    parse: Callable[[int, Sequence[Any] | None], Any]
    #: ``recover(op, error)`` when the statement raised: the op to run instead, or
    #: raise. ``None``: every error is the caller's (the unpartitioned table's ops).
    recover: Callable[[_Op, psycopg.Error], _Op] | None = None


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
#: The record columns that schema v2 adds (v1 rows become standard).
_V2_COLUMNS: tuple[tuple[str, str, bool], ...] = (("retention", "text", False),)
#: Every record column of the current schema: each version appends its own.
_RECORD_COLUMNS = (*_V1_COLUMNS, *_V2_COLUMNS)
if tuple(c[0] for c in _RECORD_COLUMNS) != COLUMNS:  # pragma: no cover - needs a migration
    raise ImportError("retrysafe.stores.postgres: the schema does not match _sql.COLUMNS")

_V1_TABLE = """
CREATE TABLE {table} (
    {columns},
    CONSTRAINT {pkey} PRIMARY KEY (key_hash),
    CONSTRAINT {status_check} CHECK (status IN ('processing', 'completed', 'failed'))
) WITH (fillfactor = 90)
"""
_V1_INDEX = "CREATE INDEX {index} ON {table} (expires_at)"

#: The version this code writes and understands.
SCHEMA_VERSION = 2


def _v1(table: sql.Identifier, base: str) -> list[sql.Composable]:
    """Schema v1: the table and its expiry index."""
    columns = sql.SQL(",\n    ").join(
        sql.SQL("{} {}{}").format(
            sql.Identifier(name), sql.SQL(type_), sql.SQL("" if nullable else " NOT NULL")
        )
        for name, type_, nullable in _V1_COLUMNS
    )
    return [
        sql.SQL(_V1_TABLE).format(
            table=table,
            columns=columns,
            pkey=sql.Identifier(f"{base}_pkey"),
            status_check=sql.Identifier(f"{base}_status_check"),
        ),
        sql.SQL(_V1_INDEX).format(index=sql.Identifier(f"{base}_expires_at"), table=table),
    ]


class _Names(NamedTuple):
    """The objects of one store: ``table`` (the records), its ``base`` name (without
    the schema; the prefix of its index and constraint names) and the ``archive``
    table in the same schema."""

    table: sql.Identifier
    base: str
    archive: sql.Identifier

    @classmethod
    def of(cls, parts: tuple[str, ...]) -> _Names:
        *schema, base = parts
        return cls(sql.Identifier(*parts), base, sql.Identifier(*schema, f"{base}_archive"))


_V2_RETENTION = "ALTER TABLE {table} ADD COLUMN retention text NOT NULL DEFAULT 'standard'"
_V2_ARCHIVE = """
CREATE TABLE {archive} (
    {columns},
    archived_at double precision NOT NULL,
    CONSTRAINT {pkey} PRIMARY KEY (key_hash, token)
)
"""
_V2_ARCHIVE_INDEX = "CREATE INDEX {index} ON {archive} (archived_at)"


def _v2(names: _Names) -> list[sql.Composable]:
    """Schema v2: every record's retention class, and the archive of swept financial
    records (one row per claim: a fencing token is unique per claim), newest first.

    Adding a column with a constant default only changes the catalog (PostgreSQL
    11+): no rewrite, the table is locked for a moment. The archive has every record
    column as of v2; a later migration that adds a record column adds it to both.
    Names stay within 63 bytes: the base name has at most 48 characters.
    """
    columns = sql.SQL(",\n    ").join(
        sql.SQL("{} {}{}").format(
            sql.Identifier(name), sql.SQL(type_), sql.SQL("" if nullable else " NOT NULL")
        )
        for name, type_, nullable in (*_V1_COLUMNS, *_V2_COLUMNS)
    )
    return [
        sql.SQL(_V2_RETENTION).format(table=names.table),
        sql.SQL(_V2_ARCHIVE).format(
            archive=names.archive,
            columns=columns,
            pkey=sql.Identifier(f"{names.base}_archive_pkey"),
        ),
        sql.SQL(_V2_ARCHIVE_INDEX).format(
            index=sql.Identifier(f"{names.base}_archived_at"), archive=names.archive
        ),
    ]


#: Migrations by the version they lead to (index 0 → v1). Append, never edit.
_MIGRATIONS: tuple[Callable[[_Names], list[sql.Composable]], ...] = (
    lambda names: _v1(names.table, names.base),
    _v2,
)
assert len(_MIGRATIONS) == SCHEMA_VERSION


# -- the partitioned table (``partitioned=True``) ----------------------------------------
#
# Another migration path, chosen when the table is created and never mixed with the
# one above (the catalog tells them apart: ``relkind`` 'p' or 'r'). It creates the
# table at version 2 in one step; a later version appends its step to both paths.

#: The comment on a partitioned records table: it marks the layout and keeps its interval.
_PARENT_COMMENT = "retrysafe records, partitioned by expires_at, partition_interval={interval}"
_PARENT_INTERVAL = re.compile(r"partition_interval=([0-9]+)")
#: The comment on each partition: sweeps drop only detached tables that carry it.
_PARTITION_COMMENT = "retrysafe partition of {base}"

_P_TABLE = """
CREATE TABLE {table} (
    {columns},
    CONSTRAINT {pkey} PRIMARY KEY (key_hash, expires_at),
    CONSTRAINT {status_check} CHECK (status IN ('processing', 'completed', 'failed'))
) PARTITION BY RANGE (expires_at)
"""

# The claim: one call, one transaction. The advisory lock on the key hash serializes
# every insert and takeover of one key (the table cannot: its primary key must hold
# the partition key, so two rows of one key with other expiries would both fit). Each
# statement of a VOLATILE function takes a fresh snapshot under READ COMMITTED, so
# the read after the lock sees whatever the previous holder committed.
_P_CLAIM = """
CREATE FUNCTION {fn}({arg_types})
RETURNS TABLE (o_found {table}, o_claimed boolean, o_attempts integer, o_took_over text)
LANGUAGE plpgsql VOLATILE AS $retrysafe$
DECLARE
    cur {table};
    now_ double precision := {now};
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended($1, {seed}));
    FOR i IN 1..100 LOOP
        SELECT * INTO cur FROM {table} AS t WHERE t.key_hash = $1;
        IF NOT FOUND THEN
            INSERT INTO {table} ({cols}) VALUES ({args});
            o_claimed := true;
            o_attempts := {attempts};
            RETURN NEXT;
            RETURN;
        END IF;
        IF NOT {cur_claimable} THEN
            o_found := cur;
            o_claimed := false;
            RETURN NEXT;
            RETURN;
        END IF;
        UPDATE {table} AS t SET {assignments}
        WHERE t.key_hash = $1 AND t.token = cur.token AND t.status = cur.status
        AND {t_claimable}
        RETURNING t.attempts INTO o_attempts;
        IF FOUND THEN
            o_claimed := true;
            IF cur.expires_at > now_ THEN
                o_took_over := cur.status;
            END IF;
            RETURN NEXT;
            RETURN;
        END IF;
        -- A completion, failure, renewal or delete changed the row since the read.
    END LOOP;
    RAISE EXCEPTION 'retrysafe: a claim kept losing races' USING ERRCODE = '40001';
END
$retrysafe$
"""

# A partition for the range around ``p_at`` when no attached one covers it: created
# apart and attached, which locks the parent in SHARE UPDATE EXCLUSIVE mode (claims
# go on); ``CREATE TABLE … PARTITION OF`` would take ACCESS EXCLUSIVE. The advisory
# lock serializes the calls (two claims that need the same partition); a sweep's
# concurrent detach holds no lock on the parent while it waits, so neither waits for
# the other. A name held by a detached table a sweep has not dropped yet gets a suffix.
_P_ADD_PARTITION = """
CREATE FUNCTION {fn}(p_at double precision) RETURNS text
LANGUAGE plpgsql VOLATILE AS $retrysafe$
DECLARE
    lo double precision := floor(p_at / {interval}) * {interval};
    parent regclass;
    sch text;
    stem text;
    name text;
    k integer := 0;
BEGIN
    PERFORM set_config('lock_timeout', {lock_timeout}, true);
    PERFORM pg_advisory_xact_lock({ddl_lock});
    parent := {parent}::regclass;
    stem := {base} || '_p' || lo::bigint;
    IF EXISTS (
        SELECT FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
        WHERE i.inhparent = parent AND NOT i.inhdetachpending
        AND c.relname ~ ('^' || stem || '(_[0-9])?$')
    ) THEN
        RETURN NULL;
    END IF;
    SELECT n.nspname INTO sch FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
    WHERE c.oid = parent;
    name := stem;
    WHILE to_regclass(format('%I.%I', sch, name)) IS NOT NULL LOOP
        k := k + 1;
        IF k > 9 THEN
            RAISE EXCEPTION 'retrysafe: no free name for a partition of % from %', parent, lo;
        END IF;
        name := stem || '_' || k;
    END LOOP;
    EXECUTE format(
        'CREATE TABLE %I.%I (LIKE %s INCLUDING DEFAULTS INCLUDING CONSTRAINTS) '
        'WITH (fillfactor = 90)', sch, name, parent);
    EXECUTE format('COMMENT ON TABLE %I.%I IS %L', sch, name, {comment});
    EXECUTE format('ALTER TABLE %s ATTACH PARTITION %I.%I FOR VALUES FROM (%L) TO (%L)',
        parent, sch, name, lo, lo + {interval});
    RETURN name;
END
$retrysafe$
"""

#: How long partition DDL (a sweep's detach and drop, a new partition) waits for a lock.
_DDL_LOCK_TIMEOUT = "2s"


def _column_defs(*, defaults: bool) -> sql.Composable:
    """The record columns as the unpartitioned path leaves them: ``retention`` has the
    default that v2 gave it in the records table (``defaults``), none in the archive."""
    return sql.SQL(",\n    ").join(
        sql.SQL("{} {}{}{}").format(
            sql.Identifier(name),
            sql.SQL(type_),
            sql.SQL("" if nullable else " NOT NULL"),
            sql.SQL(" DEFAULT 'standard'" if defaults and name == "retention" else ""),
        )
        for name, type_, nullable in _RECORD_COLUMNS
    )


def _p_claimable(alias: str) -> str:
    """:func:`retrysafe._model.decide.claimable` over ``alias`` in the claim function."""
    arg = {c: f"${i}" for i, c in enumerate(COLUMNS, 1)}
    return (
        f"({alias}.expires_at <= now_ OR ({alias}.fingerprint = {arg['fingerprint']} AND ("
        f"({alias}.status = 'failed' AND NOT {alias}.final) OR "
        f"({alias}.status = 'processing' AND {alias}.lease_until <= now_))))"
    )


class _PNames(NamedTuple):
    """The extra objects of a partitioned store: its two functions, and its lock ids."""

    claim: sql.Identifier
    add_partition: sql.Identifier
    claim_seed: int
    ddl_lock: int
    sweep_lock: int


def _lock_id(parts: tuple[str, ...], purpose: str) -> int:
    digest = hashlib.sha256(f"retrysafe:{purpose}:{'.'.join(parts)}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _p_schema(names: _Names, pnames: _PNames, interval: int) -> list[sql.Composable]:
    """The partitioned table at version 2, from nothing (partitions come after).

    The parent, its expiry index (each partition gets its own), the archive exactly as
    the unpartitioned path has it, the comment that records the interval, and the
    claim and partition functions.
    """
    arg = {c: f"${i}" for i, c in enumerate(COLUMNS, 1)}
    assignments = []
    for c in COLUMNS[1:]:
        value = arg[c]
        if c in _KEPT_WHEN_LIVE:
            value = f"CASE WHEN t.expires_at > now_ THEN {_KEPT_WHEN_LIVE[c]} ELSE {value} END"
        assignments.append(sql.SQL("{} = {}").format(sql.Identifier(c), sql.SQL(value)))
    claim = sql.SQL(_P_CLAIM).format(
        fn=pnames.claim,
        arg_types=sql.SQL(", ").join(sql.SQL(type_) for _, type_, _ in _RECORD_COLUMNS),
        table=names.table,
        now=sql.SQL(arg["updated_at"]),
        seed=sql.Literal(pnames.claim_seed),
        cols=sql.SQL(", ").join(map(sql.Identifier, COLUMNS)),
        args=sql.SQL(", ").join(sql.SQL(arg[c]) for c in COLUMNS),
        attempts=sql.SQL(arg["attempts"]),
        cur_claimable=sql.SQL(_p_claimable("cur")),
        assignments=sql.SQL(", ").join(assignments),
        t_claimable=sql.SQL(_p_claimable("t")),
    )
    add_partition = sql.SQL(_P_ADD_PARTITION).format(
        fn=pnames.add_partition,
        interval=sql.Literal(interval),
        lock_timeout=sql.Literal(_DDL_LOCK_TIMEOUT),
        ddl_lock=sql.Literal(pnames.ddl_lock),
        parent=sql.Literal(names.table.as_string(None)),
        base=sql.Literal(names.base),
        comment=sql.Literal(_PARTITION_COMMENT.format(base=names.base)),
    )
    return [
        sql.SQL(_P_TABLE).format(
            table=names.table,
            columns=_column_defs(defaults=True),
            pkey=sql.Identifier(f"{names.base}_pkey"),
            status_check=sql.Identifier(f"{names.base}_status_check"),
        ),
        sql.SQL(_V1_INDEX).format(
            index=sql.Identifier(f"{names.base}_expires_at"), table=names.table
        ),
        sql.SQL(_V2_ARCHIVE).format(
            archive=names.archive,
            columns=_column_defs(defaults=False),
            pkey=sql.Identifier(f"{names.base}_archive_pkey"),
        ),
        sql.SQL(_V2_ARCHIVE_INDEX).format(
            index=sql.Identifier(f"{names.base}_archived_at"), archive=names.archive
        ),
        sql.SQL("COMMENT ON TABLE {} IS {}").format(
            names.table, sql.Literal(_PARENT_COMMENT.format(interval=interval))
        ),
        claim,
        add_partition,
    ]


#: Migrations of the partitioned path by the version they lead to, after the one step
#: that creates it at version 2 (:func:`_p_schema`). A new version appends its step
#: here and to :data:`_MIGRATIONS`.
_P_MIGRATIONS: dict[int, Callable[[_Names, _PNames], list[sql.Composable]]] = {}
assert set(_P_MIGRATIONS) == set(range(3, SCHEMA_VERSION + 1))

# -- statement pieces --------------------------------------------------------------

#: A SELECT of a whole record, in :data:`COLUMNS` order, over alias ``t``. Empty
#: metadata and headers come back as NULL, which the row decoder reads as empty
#: without ``json.loads``.
_SELECT_COLUMNS = ", ".join(
    {
        "response_headers": "NULLIF(t.response_headers, '[]')",
        "metadata": "NULLIF(t.metadata, '{}')",
    }.get(c, f"t.{c}")
    for c in COLUMNS
)

#: :func:`retrysafe._model.decide.claimable` over the current row ``t``; its placeholders
#: are, in order: claim time, fingerprint, claim time.
_CLAIMABLE = (
    "(t.expires_at <= %s OR (t.fingerprint = %s AND ("
    "(t.status = 'failed' AND NOT t.final) OR (t.status = 'processing' AND t.lease_until <= %s))))"
)

#: ``stats``: counts of live rows with the key of the oldest processing one (one scan;
#: only processing rows are aggregated into the array), expired rows (through the
#: ``expires_at`` index), the archive's size; parameter: now. No index serves the
#: scan, which an occasional operator's command can afford. An index on (status,
#: created_at) would serve ``records(status=…)`` and the oldest processing row, but
#: a completion changes ``status``: it would turn the HOT update of every completion
#: and failure (no indexed column changes, fillfactor 90) into a write of every
#: index of the table, on the request path, for a listing.
_STATS = (
    "SELECT operation, status, count(*), min(created_at) FILTER (WHERE status = 'processing'), "
    "(array_agg(key_hash ORDER BY created_at) FILTER (WHERE status = 'processing'))[1] "
    "FROM {table} WHERE expires_at > %s GROUP BY operation, status",
    "SELECT count(*) FROM {table} WHERE expires_at <= %s",
    "SELECT {select_cols} FROM {table} AS t WHERE t.key_hash = %s",
    "SELECT count(*) FROM {archive}",
)

# -- URL handling ------------------------------------------------------------------

_DEFAULT_INTERVAL = 86400.0
_DEFAULT_AHEAD = 7 * 86400.0

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}")
_OWN_OPTIONS = (
    "table",
    "min_size",
    "max_size",
    "auto_migrate",
    "partitioned",
    "partition_interval",
    "partition_ahead",
)
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

UNAVAILABLE_ERRORS = (psycopg.Error, PoolTimeout, PoolClosed, OSError)


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


#: Where a claim's row says whether the claim inserted the record (after the columns).
_INSERTED = len(COLUMNS)
#: Claim statements one claim may run before it gives up (each further one means
#: that a concurrent writer changed the row in between).
_MAX_CLAIM_STATEMENTS = 100
#: Columns that a takeover of a live record keeps (``attempts`` counts on).
_KEPT_WHEN_LIVE = {"created_at": "t.created_at", "attempts": "t.attempts + 1"}


def _takeover_params(record: Record, found: Record) -> list[Any]:
    """Parameters of the takeover ``UPDATE`` that writes ``record`` over ``found``."""
    now = record.updated_at
    params: list[Any] = []
    for column, value in zip(COLUMNS[1:], record_params(record)[1:], strict=True):
        if column in _KEPT_WHEN_LIVE:
            params.append(now)
        params.append(value)
    params += (record.key_hash, found.token, found.status.value, now, record.fingerprint, now)
    return params


def _cell_or_none(rowcount: int, row: Sequence[Any] | None) -> Any:
    """A versioned cell's row (version, JSON text, expires_at), or None."""
    return None if row is None else (int(row[0]), row[1], row[2])


def _created(op: _Op, failed: _Op, exc: psycopg.Error) -> _Op:
    """``CREATE TABLE IF NOT EXISTS`` lost a race to another creator: run ``op`` anyway."""
    # unique_violation or duplicate_object (the row type's name), duplicate_table
    if exc.sqlstate not in ("23505", "42710", "42P07"):
        raise exc
    return op


#: Where the partitioned claim's row says whether it claimed (then the attempt number
#: and the status taken over), after the columns of the record that stood in the way.
_P_CLAIMED = len(COLUMNS)
#: Times a compare-and-set runs again after a takeover moved its row (see _retry_moved).
_MAX_MOVED_RETRIES = 10


def _pclaimed(rowcount: int, row: Sequence[Any] | None) -> ClaimResult:
    """The partitioned claim function's answer (it took any takeover under its lock)."""
    assert row is not None
    if row[_P_CLAIMED]:
        took_over = row[_P_CLAIMED + 2]
        return ClaimResult(
            True,
            attempts=row[_P_CLAIMED + 1],
            took_over=None if took_over is None else Status(took_over),
        )
    return ClaimResult(False, record=record_from_row(row))


#: The query of an op that makes the executor go on on another pooled connection (this
#: one is closed): ``parse(0, None)`` gives the op to run there (see _pclaim_recover).
_RECONNECT = "-- retrysafe: another connection"


def _no_partition(exc: psycopg.Error) -> bool:
    """The row's ``expires_at`` has no attached partition (not a CHECK constraint's error)."""
    return exc.sqlstate == "23514" and exc.diag.constraint_name is None


def _retry_moved(tries: int, op: _Op, exc: psycopg.Error) -> _Op:
    """Run a statement on a partitioned table again when a takeover moved its row.

    A takeover that changes ``expires_at`` across a partition bound moves the row;
    an ``UPDATE`` or ``DELETE`` that waited for it then fails with a serialization
    error ("tuple to be locked was already moved to another partition") instead of
    re-checking the row. Nothing was written, so running the statement again is
    safe, and it finds the row where it is now (with the new owner's token, so a
    compare-and-set answers False).
    """
    if exc.sqlstate != "40001" or tries >= _MAX_MOVED_RETRIES:
        raise exc
    return op._replace(recover=partial(_retry_moved, tries + 1))


class _Partition(NamedTuple):
    """An attached partition: its qualified name, bounds, and whether a detach is pending."""

    name: sql.Identifier
    lower: float
    upper: float
    pending: bool


_BOUNDS = re.compile(r"FROM \('([^']+)'\) TO \('([^']+)'\)")


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


class _LoopPool:
    """The async pool of one event loop, closed by ``aclose()`` or when the loop shuts down."""

    __slots__ = ("guard", "migrate_lock", "pool")

    def __init__(self, pool: AsyncConnectionPool[_AsyncConnection]) -> None:
        self.pool = pool
        self.migrate_lock = asyncio.Lock()
        self.guard: asyncio.Task[None] | None = None


#: Pools a forked child inherited from its parent. They are kept referenced, never
#: closed: closing (or a finalizer) would send Terminate on the parent's connections,
#: and their worker threads did not survive the fork. One entry per store and fork.
_INHERITED: list[Any] = []


def _forget_pools(ref: weakref.ref[PostgresStore]) -> None:
    """After ``fork()``, in the child: drop the parent's pools and locks (see ``__init__``)."""
    store = ref()
    if store is None:
        return
    _INHERITED.append((store._pool, list(store._apools.values())))
    store._pool = None
    store._apools = weakref.WeakKeyDictionary()
    store._lock = threading.Lock()


class PostgresStore(Store[_Op]):
    """Records in one PostgreSQL table (default ``retrysafe_records``).

    ``url`` is a libpq URL (``postgresql://`` or ``postgres://``, libpq query
    parameters allowed); the query may also carry this store's own ``table``,
    ``min_size``, ``max_size``, ``auto_migrate``, ``partitioned``,
    ``partition_interval`` and ``partition_ahead`` options. ``connect_timeout``
    bounds both connecting and waiting for a pooled connection. With
    ``auto_migrate`` the schema is created or upgraded on first use.

    ``partitioned=True`` creates the table partitioned by ``expires_at`` in ranges of
    ``partition_interval`` (a duration, default one day, whole seconds, at least a
    minute; an existing table keeps its own) and keeps partitions ready
    ``partition_ahead`` (default 7 days: the longest TTL expected) beyond now, so
    that sweeps drop whole partitions instead of deleting rows (see the module
    docstring). The layout is fixed when the table is created; opening it in the
    other mode raises :class:`SchemaModeError`.
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
        partitioned: bool = False,
        partition_interval: float | str | None = None,
        partition_ahead: float | str = _DEFAULT_AHEAD,
    ) -> None:
        scheme = url.partition("://")[0].lower()
        if scheme not in {"postgresql", "postgres"}:
            raise ValueError(f"not a postgresql:// URL: {redact(url)!r}")
        authority = url.partition("://")[2].partition("?")[0]
        if "@" in authority and set(authority.rpartition("@")[0].partition(":")[2]) & {"@", "/"}:
            # libpq would read the password's tail as the host or the database.
            raise ValueError(
                f"invalid PostgreSQL URL {redact(url)!r}: the password holds '@' or '/'; "
                "percent-encode them (%40, %2F)"
            )
        self.url = url
        conninfo, options = _split_url(url)
        table = _option("table", table, "retrysafe_records", options.get("table"), str)
        min_size = _option("min_size", min_size, 0, options.get("min_size"), int)
        max_size = _option("max_size", max_size, 10, options.get("max_size"), int)
        auto_migrate = _option(
            "auto_migrate", auto_migrate, True, options.get("auto_migrate"), _to_bool
        )
        interval = partial(parse_duration, field="partition_interval")
        ahead = partial(parse_duration, field="partition_ahead", allow_zero=True)
        partitioned = _option(
            "partitioned", partitioned, False, options.get("partitioned"), _to_bool
        )
        if partition_interval is not None:
            partition_interval = interval(partition_interval)
        partition_interval = _option(
            "partition_interval",
            partition_interval,
            None,
            options.get("partition_interval"),
            interval,
        )
        partition_ahead = _option(
            "partition_ahead",
            ahead(partition_ahead),
            _DEFAULT_AHEAD,
            options.get("partition_ahead"),
            ahead,
        )
        if not partitioned and (
            partition_interval is not None or partition_ahead != _DEFAULT_AHEAD
        ):
            raise ValueError("partition_interval and partition_ahead need partitioned=true")
        if partition_interval is not None and (
            partition_interval != int(partition_interval) or partition_interval < 60
        ):
            raise ValueError(
                f"partition_interval must be a whole number of seconds, at least 60, "
                f"not {partition_interval!r}"
            )
        if min_size < 0 or max_size < 1 or max_size < min_size:
            raise ValueError(
                f"need 0 <= min_size <= max_size and max_size >= 1, "
                f"not min_size={min_size} max_size={max_size}"
            )
        try:
            params = psycopg.conninfo.conninfo_to_dict(conninfo)
        except psycopg.Error as exc:
            detail = redact_in(str(exc), url)
            raise ValueError(f"invalid PostgreSQL URL {redact(url)!r}: {detail}") from None
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
        self.partitioned = bool(partitioned)
        #: Seconds per partition; a table that exists keeps its own (read at migration).
        self.partition_interval = float(partition_interval or _DEFAULT_INTERVAL)
        self.partition_ahead = float(partition_ahead)
        self._interval_given = partition_interval is not None
        self._conninfo = conninfo
        self._conn_kwargs = kwargs
        host = str(params.get("host") or params.get("hostaddr") or "localhost")
        port = str(params.get("port") or "5432")
        dbname = str(params.get("dbname") or params.get("user") or "")
        # libpq reads a password holding "/" or "@" as part of the host or database.
        self._where = redact_in(f"{host}:{port}/{dbname} (table {table})", url)

        self._pool: ConnectionPool[_Connection] | None = None
        self._apools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopPool] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        self._migrated = not auto_migrate
        #: How compare-and-set statements recover: only a partitioned table moves rows.
        self._moved = partial(_retry_moved, 0) if self.partitioned else None
        self._build_sql(_table_parts(table))
        # A pool must not cross a fork (gunicorn --preload, multiprocessing, Celery):
        # the child would share the parent's sockets (each reading the other's
        # replies) and wait on pool workers that did not survive the fork. The child
        # makes fresh pools on first use. The hook holds the store only weakly.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_pools(ref))

    def _build_sql(self, parts: tuple[str, ...]) -> None:
        """Compose every statement once; the executors only bind parameters."""
        *schema, base = parts
        names = _Names.of(parts)
        table = names.table
        versions = sql.Identifier(*schema, f"{base}_schema")
        cols = sql.SQL(", ").join(map(sql.Identifier, COLUMNS))
        cas = sql.SQL(" WHERE key_hash = %s AND token = %s AND status = 'processing'")

        def text(query: sql.Composable) -> str:
            return query.as_string(None)

        select_cols = sql.SQL(_SELECT_COLUMNS)
        # Read the row from the statement's snapshot (no lock, no write) and insert
        # only when there is none: one row with the inserted flag last, or no row when
        # a concurrent insert committed after the snapshot.
        self._q_claim = text(
            sql.SQL(
                "WITH cur AS (SELECT {select_cols} FROM {table} AS t WHERE t.key_hash = %s), "
                "ins AS (INSERT INTO {table} ({cols}) SELECT {values} "
                "WHERE NOT EXISTS (SELECT FROM cur) ON CONFLICT (key_hash) DO NOTHING RETURNING 1) "
                "SELECT {nulls}, true FROM ins UNION ALL SELECT *, false FROM cur"
            ).format(
                table=table,
                cols=cols,
                values=sql.SQL(", ").join(sql.SQL("%s") for _ in COLUMNS),
                nulls=sql.SQL(", ").join(sql.SQL("NULL") for _ in COLUMNS),
                select_cols=select_cols,
            )
        )
        # Take over a claimable row: compare-and-set on the row the claim read (token
        # and status) with the rule re-checked on the current row.
        assignments = []
        for c in COLUMNS[1:]:
            value = sql.SQL("%s")
            if c in _KEPT_WHEN_LIVE:
                value = sql.SQL("CASE WHEN t.expires_at > %s THEN {} ELSE %s END").format(
                    sql.SQL(_KEPT_WHEN_LIVE[c])
                )
            assignments.append(sql.SQL("{} = {}").format(sql.Identifier(c), value))
        self._q_takeover = text(
            sql.SQL(
                "UPDATE {} AS t SET {} WHERE t.key_hash = %s AND t.token = %s AND t.status = %s "
                "AND {} RETURNING t.attempts"
            ).format(table, sql.SQL(", ").join(assignments), sql.SQL(_CLAIMABLE))
        )
        outcome = sql.SQL(
            "response_status = %s, response_headers = %s, response_media_type = %s, "
            "response_body = %s"
        )
        self._q_complete = text(
            sql.SQL(
                "UPDATE {} SET status = 'completed', {}, completed_at = %s, updated_at = %s"
            ).format(table, outcome)
            + cas
        )
        self._q_fail = text(
            sql.SQL("UPDATE {} SET status = 'failed', {}, final = %s, updated_at = %s").format(
                table, outcome
            )
            + cas
        )
        self._q_renew = text(
            sql.SQL(
                "UPDATE {} SET lease_until = %s, updated_at = %s, "
                "expires_at = GREATEST(expires_at, %s)"
            ).format(table)
            + cas
        )
        self._q_get = text(
            sql.SQL("SELECT {} FROM {} AS t WHERE t.key_hash = %s").format(select_cols, table)
        )
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
        self._migrations = [[text(q) for q in migration(names)] for migration in _MIGRATIONS]

        # Operations work (sweeper, CLI).
        self._names = names
        self._q_sweep = text(self._sweep_query(names))
        archive_cols = sql.SQL(", ").join(map(sql.Identifier, ARCHIVE_COLUMNS))
        marks = sql.SQL(", ").join(sql.SQL("%s") for _ in ARCHIVE_COLUMNS)
        self._q_archive = text(
            sql.SQL(
                "INSERT INTO {} ({}) VALUES ({}) ON CONFLICT (key_hash, token) DO NOTHING"
            ).format(names.archive, archive_cols, marks)
        )
        self._q_list = sql.SQL("SELECT {} FROM {} AS t").format(select_cols, table)
        self._q_list_archive = sql.SQL("SELECT {}, t.archived_at FROM {} AS t").format(
            select_cols, names.archive
        )
        self._q_stats = [
            text(sql.SQL(q).format(table=table, archive=names.archive, select_cols=select_cols))
            for q in _STATS
        ]

        # The table's layout, from the catalog: relkind 'p' (partitioned) or 'r', and
        # the comment that keeps a partitioned table's interval.
        self._table_name = text(table)
        self._q_mode = (
            "SELECT c.relkind::text, obj_description(c.oid, 'pg_class') "
            "FROM pg_class AS c WHERE c.oid = to_regclass(%s)"
        )
        # The partitioned table's claim, partitions and sweep.
        pn = self._pnames = _PNames(
            sql.Identifier(*schema, f"{base}_claim"),
            sql.Identifier(*schema, f"{base}_add_partition"),
            _lock_id(parts, "claim"),
            _lock_id(parts, "ddl"),
            _lock_id(parts, "sweep"),
        )
        types = [sql.SQL(type_) for _, type_, _ in _RECORD_COLUMNS]
        self._q_pclaim = text(
            sql.SQL("SELECT {}, r.o_claimed, r.o_attempts, r.o_took_over FROM {}({}) AS r").format(
                sql.SQL(", ").join(
                    sql.SQL("(r.o_found).{}").format(sql.Identifier(c)) for c in COLUMNS
                ),
                pn.claim,
                sql.SQL(", ").join(sql.SQL("%s::{}").format(t) for t in types),
            )
        )
        self._q_add_partition = text(sql.SQL("SELECT {}(%s)").format(pn.add_partition))
        # A change to the parent that makes every backend rebuild its partition
        # descriptor (see _refreshed); it waits 2 s at most for its lock.
        self._q_refresh = text(
            sql.SQL(
                "DO $retrysafe$ BEGIN PERFORM set_config('lock_timeout', '2s', true); "
                "EXECUTE {}; END $retrysafe$"
            ).format(
                sql.Literal(
                    sql.SQL("ALTER TABLE ONLY {} ALTER COLUMN expires_at SET STATISTICS -1")
                    .format(self._names.table)
                    .as_string(None)
                )
            )
        )
        self._q_partitions = (
            "SELECT n.nspname, c.relname, i.inhdetachpending, pg_get_expr(c.relpartbound, c.oid) "
            "FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid "
            "JOIN pg_namespace AS n ON n.oid = c.relnamespace WHERE i.inhparent = to_regclass(%s)"
        )
        # Tables a sweep detached and did not drop: named like a partition of this table,
        # marked as one, and no longer attached.
        self._q_leftovers = (
            "SELECT n.nspname, c.relname FROM pg_class AS c "
            "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
            "WHERE c.relnamespace = (SELECT p.relnamespace FROM pg_class AS p "
            "WHERE p.oid = to_regclass(%s)) AND c.relkind = 'r' AND NOT c.relispartition "
            "AND c.relname ~ %s AND obj_description(c.oid, 'pg_class') = %s ORDER BY c.relname"
        )
        self._leftover_args = (
            self._table_name,
            f"^{base}_p[0-9]+(_[0-9])?$",
            _PARTITION_COMMENT.format(base=base),
        )
        self._cols = cols

        # Versioned cells of retrysafe.guards (see retrysafe._core.cells): the table
        # <base>_state beside the records, created on first use (the ops' recovery
        # below), apart from the records schema and its migrations.
        state = sql.Identifier(*schema, f"{base}_state")
        self._q_cell_table = text(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (key text PRIMARY KEY, version bigint NOT NULL, "
                "value text NOT NULL, expires_at double precision)"
            ).format(state)
        )
        self._q_cell_read = text(
            sql.SQL("SELECT version, value, expires_at FROM {} WHERE key = %s::text").format(state)
        )
        # expected None: insert version 1, or replace an expired cell (NULL never expires).
        self._q_cell_create = text(
            sql.SQL(
                "INSERT INTO {} AS c (key, version, value, expires_at) "
                "VALUES (%s::text, 1, %s::text, %s::double precision) ON CONFLICT (key) DO UPDATE "
                "SET version = 1, value = EXCLUDED.value, expires_at = EXCLUDED.expires_at "
                "WHERE c.expires_at <= %s::double precision"
            ).format(state)
        )
        self._q_cell_update = text(
            sql.SQL(
                "UPDATE {} SET version = version + 1, value = %s::text, "
                "expires_at = %s::double precision WHERE key = %s::text AND "
                "version = %s::bigint AND (expires_at IS NULL OR expires_at > %s::double precision)"
            ).format(state)
        )
        self._q_cells_sweep = text(
            sql.SQL(
                "DELETE FROM {0} WHERE key IN (SELECT key FROM {0} WHERE expires_at <= %s "
                "LIMIT %s) AND expires_at <= %s"
            ).format(state)
        )
        self._q_cells_index = text(
            sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (expires_at)").format(
                sql.Identifier(f"{base}_state_expires_at"), state
            )
        )
        self._archive_cols = archive_cols

    @staticmethod
    def _sweep_query(names: _Names) -> sql.Composable:
        """One sweep batch as one statement; parameters: now, limit, now, now.

        Locks the ``limit`` oldest expired rows through the ``expires_at`` index,
        skipping rows a claim holds (the sweeper never waits on a claim); the lock
        re-reads a row that a committed claim changed meanwhile and drops it unless
        it is still expired, and the ``DELETE`` checks again. The deleted financial
        rows go to the archive in the same statement, so a killed sweep moved a row
        whole or did not touch it. Returns one row: (deleted, archived).

        ``= ANY(ARRAY(…))`` rather than ``IN (…)``: the batch's keys are collected
        once and deleted through the primary key, where ``IN`` lets the planner
        hash-join them against a scan of the whole table.

        A store over another table layout (a partitioned table, say) overrides this
        method; the statement must keep the parameters and the result row.
        """
        cols = sql.SQL(", ").join(map(sql.Identifier, COLUMNS))
        archive_cols = sql.SQL(", ").join(map(sql.Identifier, ARCHIVE_COLUMNS))
        return sql.SQL(
            "WITH moved AS (DELETE FROM {table} AS t WHERE t.key_hash = ANY(ARRAY("
            "SELECT d.key_hash FROM {table} AS d WHERE d.expires_at <= %s "
            "ORDER BY d.expires_at LIMIT %s FOR UPDATE SKIP LOCKED)) "
            "AND t.expires_at <= %s RETURNING {cols}), "
            "archived AS (INSERT INTO {archive} ({archive_cols}) "
            "SELECT {cols}, %s FROM moved WHERE retention = 'financial' "
            "ON CONFLICT (key_hash, token) DO NOTHING RETURNING 1) "
            "SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM archived)"
        ).format(table=names.table, archive=names.archive, cols=cols, archive_cols=archive_cols)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {redact(self.url)} table={self.table}>"

    # -- schema ------------------------------------------------------------------

    def _migration(self) -> _Flow:
        """Create or upgrade the schema; the version-table check skips the lock when current.

        Either way the catalog must show the table in this store's mode (partitioned
        or not) before anything else runs on it.
        """
        exists = yield self._q_versions_exist, (self._versions_name,)
        if exists and exists[0]:
            row = yield self._q_version, None
            if self._check_version(row) == SCHEMA_VERSION:
                self._check_mode((yield self._q_mode, (self._table_name,)))
                return SCHEMA_VERSION
        yield self._q_lock, (self._lock_id,)
        yield self._q_create_versions, None
        version = self._check_version((yield self._q_version, None))
        self._check_mode((yield self._q_mode, (self._table_name,)))
        if self.partitioned:
            yield from self._p_migration(version)
            return SCHEMA_VERSION
        for target in range(version + 1, SCHEMA_VERSION + 1):
            for statement in self._migrations[target - 1]:
                yield statement, None
            yield self._q_set_version, (target,)
        return SCHEMA_VERSION

    def _p_migration(self, version: int) -> _Flow:
        """The partitioned path: create the table at version 2 with partitions from now
        on, then any later step."""
        if version == 0:
            interval = int(self.partition_interval)
            for statement in _p_schema(self._names, self._pnames, interval):
                yield statement.as_string(None), None
            for lower in self._lowers_ahead(time.time(), set()):
                yield self._q_add_partition, (lower,)
            yield self._q_set_version, (2,)
            version = 2
        for target in range(version + 1, SCHEMA_VERSION + 1):
            for statement in _P_MIGRATIONS[target](self._names, self._pnames):
                yield statement.as_string(None), None
            yield self._q_set_version, (target,)
        return SCHEMA_VERSION

    def _check_mode(self, row: Sequence[Any] | None) -> None:
        """Refuse a table in the other mode; adopt a partitioned table's interval."""
        kind = row[0] if row else None
        if kind is None:  # not created yet
            return
        partitioned = kind == "p"
        if partitioned != self.partitioned:
            found, opened = (
                ("partitioned", "unpartitioned")
                if partitioned
                else ("unpartitioned", "partitioned")
            )
            raise SchemaModeError(
                f"PostgreSQL store at {self._where}: the table is {found} "
                f"(partitioned={str(partitioned).lower()}) but the store was opened "
                f"{opened} (partitioned={str(self.partitioned).lower()}); the mode is fixed "
                "when the table is created: open it in its own mode or use another table"
            )
        if partitioned:
            match = _PARENT_INTERVAL.search(row[1] or "") if row else None
            if match is None:
                raise SchemaModeError(
                    f"PostgreSQL store at {self._where}: a partitioned table that retrysafe "
                    "did not create (its comment names no partition_interval)"
                )
            interval = float(match.group(1))
            if self._interval_given and interval != self.partition_interval:
                raise SchemaModeError(
                    f"PostgreSQL store at {self._where}: the table is partitioned with "
                    f"partition_interval={interval:g}s, not {self.partition_interval:g}s; "
                    "the interval is fixed when the table is created"
                )
            self.partition_interval = interval

    def _lowers_ahead(self, now: float, have: set[float]) -> Iterator[float]:
        """Lower bounds of the partitions missing from ``have`` between the one that
        holds ``now`` and ``now + partition_ahead + 2 intervals``."""
        step = self.partition_interval
        lower = math.floor(now / step) * step
        end = now + self.partition_ahead + 2 * step
        while lower < end:
            if lower not in have:
                yield lower
            lower += step

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
            entry = self._apools[loop] = _LoopPool(pool)
            entry.guard = loop.create_task(self._close_at_shutdown(loop, entry))
            await pool.open(wait=False)
        return entry

    async def _close_at_shutdown(self, loop: asyncio.AbstractEventLoop, entry: _LoopPool) -> None:
        """Close ``entry``'s pool when its loop shuts down without ``aclose()``.

        ``asyncio.run()`` and pytest-asyncio cancel every task before closing a loop;
        a psycopg_pool worker that is connecting at that moment swallows the
        cancellation and would block the shutdown until its pool is closed.
        """
        try:
            await loop.create_future()
        finally:
            if self._apools.get(loop) is entry:
                del self._apools[loop]
                await entry.pool.close()

    # The two executors: take a live pooled connection (skipping idle ones the server
    # dropped, see _closed_by_server), migrate once if due, run the op's statement.

    def _checkout(self, pool: ConnectionPool[_Connection]) -> _Connection:
        """A live pooled connection (skipping idle ones the server dropped), the schema
        migrated once; the caller puts it back."""
        conn = pool.getconn()
        for _ in range(self.max_size):
            if not _closed_by_server(conn):
                break
            conn.close()  # the pool replaces a closed connection
            pool.putconn(conn)
            conn = pool.getconn()
        if not self._migrated:
            try:
                with self._lock:
                    if not self._migrated:
                        _drive(conn, self._migration())
                        self._migrated = True
            except BaseException:
                pool.putconn(conn)
                raise
        return conn

    def _run(self, op: _Op) -> Any:
        try:
            pool = self._pool or self._sync_pool()
            conn: _Connection | None = self._checkout(pool)
            try:
                cur = conn.store_cursor()
                while True:
                    if op.query is _RECONNECT:
                        old, conn = conn, None
                        old.close()  # the pool replaces a closed connection
                        pool.putconn(old)
                        conn = self._checkout(pool)
                        cur = conn.store_cursor()
                        op = op.parse(0, None)
                        continue
                    try:
                        cur.execute(op.query, op.params)
                    except psycopg.Error as exc:
                        if op.recover is None:
                            raise
                        op = op.recover(op, exc)
                        continue
                    result = op.parse(cur.rowcount, cur.fetchone() if _has_rows(cur) else None)
                    if result.__class__ is not _Op:
                        return result
                    op = result
            finally:
                if conn is not None:
                    pool.putconn(conn)
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable(exc) from exc

    async def _acheckout(self, pool: AsyncConnectionPool[_AsyncConnection]) -> _AsyncConnection:
        """A live pooled connection (as :meth:`_checkout`, without the migration)."""
        conn = await pool.getconn()
        for _ in range(self.max_size):
            if not _closed_by_server(conn):
                break
            await conn.close()
            await pool.putconn(conn)
            conn = await pool.getconn()
        return conn

    async def _arun(self, op: _Op) -> Any:
        try:
            entry = await self._loop_pool()
            pool = entry.pool
            conn: _AsyncConnection | None = await self._acheckout(pool)
            try:
                if not self._migrated:
                    async with entry.migrate_lock:
                        if not self._migrated:
                            await _adrive(conn, self._migration())
                            self._migrated = True
                cur = conn.store_cursor()
                while True:
                    if op.query is _RECONNECT:
                        old, conn = conn, None
                        await old.close()
                        await pool.putconn(old)
                        conn = await self._acheckout(pool)
                        cur = conn.store_cursor()
                        op = op.parse(0, None)
                        continue
                    try:
                        await cur.execute(op.query, op.params)
                    except psycopg.Error as exc:
                        if op.recover is None:
                            raise
                        op = op.recover(op, exc)
                        continue
                    row = await cur.fetchone() if _has_rows(cur) else None
                    result = op.parse(cur.rowcount, row)
                    if result.__class__ is not _Op:
                        return result
                    op = result
            finally:
                if conn is not None:
                    await pool.putconn(conn)
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable(exc) from exc

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
            if entry.guard is not None:
                entry.guard.cancel()
            await entry.pool.close()
        if self._pool is not None:
            await asyncio.to_thread(self.close)

    # -- operations ------------------------------------------------------------------

    def _claim(self, record: Record, statements: int = 1) -> _Op:
        if self.partitioned:
            return _Op(
                self._q_pclaim,
                record_params(record),
                _pclaimed,
                partial(self._pclaim_recover, record, statements),
            )
        params = (record.key_hash, *record_params(record))
        return _Op(self._q_claim, params, partial(self._claimed, record, statements))

    def _claimed(
        self, record: Record, statements: int, rowcount: int, row: Sequence[Any] | None
    ) -> ClaimResult | _Op:
        """The claim statement's answer, or the statement to run next."""
        if row is None:  # a concurrent insert committed after the snapshot: look again
            return self._claim_again(record, statements)
        if row[_INSERTED]:
            return ClaimResult(True, attempts=record.attempts)
        found = record_from_row(row)
        now = record.updated_at
        if not claimable(found, record.fingerprint, now):
            return ClaimResult(False, record=found)
        self._check_statements(statements)
        took_over = found.status if found.expires_at > now else None
        params = _takeover_params(record, found)
        return _Op(
            self._q_takeover, params, partial(self._took_over, record, statements + 1, took_over)
        )

    def _took_over(
        self,
        record: Record,
        statements: int,
        took_over: Status | None,
        rowcount: int,
        row: Sequence[Any] | None,
    ) -> ClaimResult | _Op:
        """The takeover's answer; when it lost a race, the claim starts over."""
        if row is None:  # a concurrent claim, completion, renewal or delete came first
            return self._claim_again(record, statements)
        return ClaimResult(True, attempts=row[0], took_over=took_over)

    def _claim_again(self, record: Record, statements: int) -> _Op:
        self._check_statements(statements)
        return self._claim(record, statements + 1)

    def _pclaim_recover(
        self, record: Record, statements: int, op: _Op, exc: psycopg.Error, *, found: bool = False
    ) -> _Op:
        """A partitioned claim that failed: make the partition its row needs, or run it again.

        The row's ``expires_at`` had no partition (beyond the ones made ahead, or in a
        range a sweep just detached): add it in a transaction of its own (the claim's
        failed and released everything), then claim again. A serialization failure
        (a row moved under a statement) only means: look again.

        ``found``: the add before this claim found the partition attached (made by
        another session). A session that still finds no partition for the row then
        routes rows with a stale partition descriptor: PostgreSQL can lose the
        invalidation of an ``ATTACH PARTITION`` that commits while a backend builds its
        descriptor (it consumes the message mid-build and keeps the list it read
        before), and that backend then misses the partition, for inserts and reads
        alike, until the next change to the table; it would fail every retry. So the
        claim goes on on another connection (a new backend reads the catalog afresh)
        and this one is closed.
        """
        if not (_no_partition(exc) or exc.sqlstate == "40001"):
            raise exc
        self._check_statements(statements, exc)
        again = self._claim(record, statements + 1)
        if exc.sqlstate == "40001":
            return again
        if found:
            return _Op(_RECONNECT, (), lambda rowcount, row: again)

        def added(rowcount: int, row: Sequence[Any] | None) -> _Op:
            # NULL: the partition was attached already, so a healthy session sees it now.
            if row is not None and row[0] is None:
                return again._replace(
                    recover=partial(self._pclaim_recover, record, statements + 1, found=True)
                )
            return self._refreshed(again)

        add = _Op(self._q_add_partition, (record.expires_at,), added)
        if statements < 4:
            return add
        # The partition was there when asked, and still the row found none: another
        # session is attaching it, or a sweep detaching it. Wait a little (on the
        # server, so the sync and async executors alike never block) and look again.
        delay = min(0.002 * statements, 0.05)
        return _Op("SELECT pg_sleep(%s)", (delay,), lambda rowcount, row: add)

    def _refreshed(self, then: _Op) -> _Op:
        """Run ``then`` after a change that makes every backend rebuild the table's
        partition descriptor, once a partition was attached or detached.

        A backend that built its descriptor while the attach (or detach) committed
        can keep the old one until the table changes again (see _pclaim_recover),
        and until then it misses a new partition's rows: a completion there would
        find no row. This second change, made after the first committed, bounds
        that to the backend's next statement. Its failure (a lock it could not get
        within 2 s) only leaves the rare case to the reconnect of _pclaim_recover.
        """
        return _Op(self._q_refresh, (), lambda rowcount, row: then, lambda op, exc: then)

    def _check_statements(self, statements: int, last: BaseException | None = None) -> None:
        """Give up on a claim that keeps losing races (a bug, or a pathological writer)."""
        if statements >= _MAX_CLAIM_STATEMENTS:
            why = f"; the last: {str(last).strip()}" if last is not None else ""
            raise StoreUnavailableError(
                f"PostgreSQL store at {self._where}: a claim ran {statements} statements "
                f"without settling (concurrent writers kept changing the key{why})",
                retry_after=1.0,
            )

    def _complete(self, key_hash: str, token: str, outcome: Outcome, now: float) -> _Op:
        params = (*outcome_params(outcome), now, now, key_hash, token)
        return _Op(self._q_complete, params, _changed, self._moved)

    def _fail(
        self, key_hash: str, token: str, outcome: Outcome | None, final: bool, now: float
    ) -> _Op:
        params = (*outcome_params(outcome), bool(final), now, key_hash, token)
        return _Op(self._q_fail, params, _changed, self._moved)

    def _renew(self, key_hash: str, token: str, lease_until: float, now: float) -> _Op:
        params = (lease_until, now, lease_until, key_hash, token)
        return _Op(self._q_renew, params, _changed, self._moved)

    def _get(self, key_hash: str) -> _Op:
        return _Op(self._q_get, (key_hash,), _record_or_none)

    def _delete(self, key_hash: str) -> _Op:
        return _Op(self._q_delete, (key_hash,), _changed, self._moved)

    def _cell_read(self, key: str) -> _Op:
        return _Op(self._q_cell_read, (key,), _cell_or_none, self._cells_missing)

    def _cell_write(
        self, key: str, expected: int | None, text: str, expires_at: float | None, now: float
    ) -> _Op:
        if expected is None:
            op = _Op(self._q_cell_create, (key, text, expires_at, now), _changed)
        else:
            op = _Op(self._q_cell_update, (text, expires_at, key, expected, now), _changed)
        return op._replace(recover=self._cells_missing)

    def _cells_missing(self, op: _Op, exc: psycopg.Error) -> _Op:
        """A cell op that found no cells table: create it, then run the op again."""
        if exc.sqlstate != "42P01":  # undefined_table
            raise exc
        return _Op(self._q_cell_table, (), lambda rowcount, row: op, partial(_created, op))

    # -- operations work (sweeper, CLI): sync, never on the request path ---------------

    @contextmanager
    def _ops_connection(self) -> Iterator[_Connection]:
        """A live, migrated pooled connection for work of several statements or rows."""
        try:
            pool = self._pool or self._sync_pool()
            conn = self._checkout(pool)
            try:
                yield conn
            finally:
                pool.putconn(conn)  # the pool rolls back a transaction left open
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable(exc) from exc

    def _ops_rows(self, query: sql.Composable, params: Sequence[Any]) -> list[Any]:
        with self._ops_connection() as conn:
            return conn.store_cursor().execute(query, params).fetchall()

    def sweep(self, now: float, limit: int = 1000) -> SweepBatch:
        """One bounded sweep step (see :meth:`Store.sweep`).

        A partitioned table deletes no rows one by one: a step drops at most one
        partition that holds only expired records, however many (``limit`` bounds
        row deletes, so it does not apply), after finishing what an interrupted
        sweep left behind; see :meth:`_psweep`.
        """
        if self.partitioned:
            return self._psweep(now)

        def parse(rowcount: int, row: Sequence[Any] | None) -> SweepBatch:
            assert row is not None
            deleted, archived = int(row[0]), int(row[1])
            return SweepBatch(deleted, archived, done=deleted < limit)

        return self._run(_Op(self._q_sweep, (now, limit, now, now), parse))

    def sweep_cells(self, now: float, limit: int = 1000) -> int:
        with self._ops_connection() as conn:
            cur = conn.store_cursor()
            try:
                cur.execute(self._q_cells_index)
            except psycopg.errors.UndefinedTable:
                return 0  # no guard has written a cell yet
            except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject):
                pass  # another sweeper created the index at the same moment
            cur.execute(self._q_cells_sweep, (now, limit, now))
            return int(cur.rowcount)

    def _psweep(self, now: float) -> SweepBatch:
        """A sweep step on the partitioned table: detach, archive, drop.

        1. Finish an interrupted sweep: a detach left pending is finalized, and a
           detached partition (found by name, comment and catalog) is archived and
           dropped like any other; that is the whole step.
        2. Create the partitions missing up to ``now + partition_ahead + 2 intervals``.
        3. Take the oldest attached partition whose upper bound is <= ``now`` (its
           rows are all expired): ``DETACH PARTITION … CONCURRENTLY``, then in one
           transaction copy its financial rows to the archive (``ON CONFLICT DO
           NOTHING``), count its rows and ``DROP`` it.

        Detach before archive before drop: a sweep killed at any point leaves either
        an attached partition, a pending detach or a detached table, and the next
        step goes on from there; the archive's key absorbs a second copy. Claims
        are never blocked: a concurrent detach locks the parent in SHARE UPDATE
        EXCLUSIVE mode, new queries stop seeing the partition at once, and it waits
        for the ones that still do; the drop locks only the detached table. Every
        lock wait is bounded by ``lock_timeout``; a step that times out (a long
        transaction on the table) stops there and reports done, and the next sweep
        takes it up. Only one sweep works on a table at a time (a session advisory
        lock); another one returns at once with nothing done.
        """
        pn = self._pnames
        deleted = archived = 0
        with self._ops_connection() as conn:
            cur = conn.cursor()
            if not cur.execute("SELECT pg_try_advisory_lock(%s)", (pn.sweep_lock,)).fetchone()[0]:
                return SweepBatch(0, 0, done=True)
            try:
                cur.execute("SELECT set_config('lock_timeout', %s, false)", (_DDL_LOCK_TIMEOUT,))
                parts = self._partitions(cur)
                for part in parts:
                    if part.pending:
                        cur.execute(
                            sql.SQL("ALTER TABLE {} DETACH PARTITION {} FINALIZE").format(
                                self._names.table, part.name
                            )
                        )
                leftovers = cur.execute(self._q_leftovers, self._leftover_args).fetchall()
                for schema, name in leftovers:
                    rows, copied = self._archive_and_drop(conn, sql.Identifier(schema, name), now)
                    deleted += rows
                    archived += copied
                if leftovers:
                    return SweepBatch(deleted, archived, done=False)

                have = {p.lower for p in parts if not p.pending}
                attached = False
                for lower in self._lowers_ahead(now, have):
                    row = cur.execute(self._q_add_partition, (lower,)).fetchone()
                    attached = attached or (row is not None and row[0] is not None)
                if attached:
                    self._refresh(cur)

                expired = sorted(
                    (p for p in parts if not p.pending and p.upper <= now), key=lambda p: p.upper
                )
                if not expired:
                    return SweepBatch(0, 0, done=True)
                cur.execute(
                    sql.SQL("ALTER TABLE {} DETACH PARTITION {} CONCURRENTLY").format(
                        self._names.table, expired[0].name
                    )
                )
                self._refresh(cur)
                rows, copied = self._archive_and_drop(conn, expired[0].name, now)
                return SweepBatch(rows, copied, done=len(expired) == 1)
            except psycopg.errors.LockNotAvailable:
                return SweepBatch(deleted, archived, done=True)
            finally:
                cur.execute("RESET lock_timeout")
                cur.execute("SELECT pg_advisory_unlock(%s)", (pn.sweep_lock,))

    def _partitions(self, cur: psycopg.Cursor[Any]) -> list[_Partition]:
        """The partitions attached to the table (or with a detach pending), from the catalog."""
        found = []
        for schema, name, pending, bound in cur.execute(self._q_partitions, (self._table_name,)):
            match = _BOUNDS.search(bound or "")
            if match is not None:  # not a range with finite bounds: not one of ours
                lower, upper = float(match.group(1)), float(match.group(2))
                found.append(_Partition(sql.Identifier(schema, name), lower, upper, pending))
        return found

    def _refresh(self, cur: Any) -> None:
        """The sweep's :meth:`_refreshed`: a failure is logged and the sweep goes on."""
        try:
            cur.execute(self._q_refresh)
        except psycopg.Error as exc:
            log.info("retrysafe: could not refresh %s's partitions: %s", self._where, exc)

    def _archive_and_drop(
        self, conn: _Connection, part: sql.Identifier, now: float
    ) -> tuple[int, int]:
        """Copy a detached partition's financial rows to the archive, count its rows and
        drop it, in one transaction: (rows, newly archived)."""
        moved = sql.SQL(
            "WITH archived AS (INSERT INTO {archive} ({archive_cols}) "
            "SELECT {cols}, %s FROM {part} WHERE retention = 'financial' "
            "ON CONFLICT (key_hash, token) DO NOTHING RETURNING 1) "
            "SELECT (SELECT count(*) FROM {part}), (SELECT count(*) FROM archived)"
        ).format(
            archive=self._names.archive, archive_cols=self._archive_cols, cols=self._cols, part=part
        )
        with conn.transaction():
            cur = conn.cursor()
            rows, copied = cur.execute(moved, (now,)).fetchone()
            cur.execute(sql.SQL("DROP TABLE {}").format(part))
        return int(rows), int(copied)

    def records(
        self,
        *,
        status: Status | str | None = None,
        operation: str | None = None,
        created_before: float | None = None,
        limit: int = 100,
        key: str | None = None,
    ) -> list[Record]:
        where: list[sql.Composable] = []
        params: list[Any] = []
        if status is not None:
            where.append(sql.SQL("t.status = %s"))
            params.append(Status(status).value)
        if operation is not None:
            where.append(sql.SQL("t.operation = %s"))
            params.append(operation)
        if created_before is not None:
            where.append(sql.SQL("t.created_at < %s"))
            params.append(float(created_before))
        if key is not None:
            where.append(sql.SQL("t.key = %s"))
            params.append(key)
        query = self._q_list
        if where:
            query += sql.SQL(" WHERE ") + sql.SQL(" AND ").join(where)
        query += sql.SQL(" ORDER BY t.created_at, t.key_hash LIMIT %s")
        params.append(limit)
        return [record_from_row(row) for row in self._ops_rows(query, params)]

    def stats(self, now: float) -> StoreStats:
        counts_q, expired_q, get_q, archived_q = self._q_stats
        stats = StoreStats()
        oldest: tuple[float, str] | None = None
        with self._ops_connection() as conn, conn.transaction():
            cur = conn.store_cursor()
            # One snapshot for every count.
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            for operation, status, n, created_at, key_hash in cur.execute(counts_q, (now,)):
                stats.counts[(operation, status)] = int(n)
                if key_hash is not None and (oldest is None or created_at < oldest[0]):
                    oldest = (created_at, key_hash)
            stats.expired = int(cur.execute(expired_q, (now,)).fetchone()[0])
            if oldest is not None:
                row = cur.execute(get_q, (oldest[1],)).fetchone()
                stats.oldest_processing = None if row is None else record_from_row(row)
            stats.archived = int(cur.execute(archived_q).fetchone()[0])
        return stats

    def archive_records(self, records: Sequence[Record], archived_at: float) -> int:
        rows = [(*record_params(r), archived_at) for r in records]
        if not rows:
            return 0
        with self._ops_connection() as conn, conn.transaction():
            cur = conn.store_cursor()
            cur.executemany(self._q_archive, rows)  # pipelined; rowcount sums the inserts
            return cur.rowcount

    def archived_records(
        self, *, operation: str | None = None, limit: int = 100
    ) -> list[ArchivedRecord]:
        query = self._q_list_archive
        params: list[Any] = []
        if operation is not None:
            query += sql.SQL(" WHERE t.operation = %s")
            params.append(operation)
        query += sql.SQL(" ORDER BY t.archived_at DESC LIMIT %s")
        params.append(limit)
        return [archived_from_row(row) for row in self._ops_rows(query, params)]
