"""The PostgreSQL schema: the record columns, the migrations of the plain and the
partitioned table, and the statement pieces the store composes its SQL from."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import NamedTuple

from psycopg import sql

from retrysafe.stores._sql import COLUMN_SPECS, COLUMNS
from retrysafe.stores.postgres.rows import FAILED, PROCESSING, V3_ORDER, V3_TYPES

__all__ = ["SCHEMA_VERSION"]


#: Columns that a takeover of a live record keeps (``attempts`` counts on).
_KEPT_WHEN_LIVE = {"created_at": "t.created_at", "attempts": "t.attempts + 1"}


# -- the schema ------------------------------------------------------------------

#: PostgreSQL's type for each column kind of :data:`COLUMN_SPECS`.
_TYPES = {
    "text": "text",
    "real": "double precision",
    "integer": "integer",
    "bool": "boolean",
    "bytes": "bytea",
}
#: Schema v1 had the columns before ``retention``; v2 added it. A later column needs
#: its own migration (and the check below fails until it has one).
_V2_FROM, _V2_END = COLUMNS.index("retention"), COLUMNS.index("retention") + 1
#: The record columns of schema v1, in :data:`COLUMNS` order: (name, type, nullable).
_V1_COLUMNS: tuple[tuple[str, str, bool], ...] = tuple(
    (name, _TYPES[kind], nullable) for name, kind, nullable in COLUMN_SPECS[:_V2_FROM]
)
#: The record columns that schema v2 adds (v1 rows become standard).
_V2_COLUMNS: tuple[tuple[str, str, bool], ...] = tuple(
    (name, _TYPES[kind], nullable) for name, kind, nullable in COLUMN_SPECS[_V2_FROM:_V2_END]
)
#: Every record column of the current schema: each version appends its own.
_RECORD_COLUMNS = (*_V1_COLUMNS, *_V2_COLUMNS)

_V1_TABLE = """
CREATE TABLE {table} (
    {columns},
    CONSTRAINT {pkey} PRIMARY KEY (key_hash),
    CONSTRAINT {status_check} CHECK (status IN ('processing', 'completed', 'failed'))
) WITH (fillfactor = 90)
"""
_V1_INDEX = "CREATE INDEX {index} ON {table} (expires_at)"

#: The version this code writes and understands.
SCHEMA_VERSION = 3


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
    the schema; the prefix of its index and constraint names), the ``archive``
    table in the same schema, and that ``schema`` (empty: the search path's)."""

    table: sql.Identifier
    base: str
    archive: sql.Identifier
    schema: tuple[str, ...]

    @classmethod
    def of(cls, parts: tuple[str, ...]) -> _Names:
        *schema, base = parts
        return cls(
            sql.Identifier(*parts),
            base,
            sql.Identifier(*schema, f"{base}_archive"),
            tuple(schema),
        )


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


# -- schema v3: the compact row (stores/postgres/rows.py) ---------------------------

_V3_TABLE = """
CREATE TABLE {table} (
    {columns},
    CONSTRAINT {status_check} CHECK (status IN (0, 1, 2))
){tail}
"""
_V3_ARCHIVE = """
CREATE TABLE {archive} (
    {columns},
    archived_at double precision NOT NULL,
    CONSTRAINT {pkey} PRIMARY KEY (key_hash, token)
)
"""


def _v3_columns() -> sql.Composable:
    """The v3 record columns, in their order in the table (rows.V3_ORDER)."""
    return sql.SQL(",\n    ").join(
        sql.SQL("{} {}").format(sql.Identifier(name), sql.SQL(V3_TYPES[name])) for name in V3_ORDER
    )


def _packed_digest(col: str) -> str:
    """rows.pack_digest in SQL, over the text column ``col``."""
    return (
        f"CASE WHEN {col} ~ '^[0-9a-f]{{64}}$' THEN decode({col}, 'hex') "
        f"WHEN octet_length({col}) = 32 THEN convert_to({col}, 'UTF8') || '\\xff'::bytea "
        f"ELSE convert_to({col}, 'UTF8') END"
    )


#: rows.row_params in SQL, over a v2 row ``o``: each record column's v3 value, in
#: :data:`COLUMNS` order. tests/test_postgres_v3.py checks that both give the same bytes.
#: The headers keep their JSON text (rows.row_record reads both forms).
_V3_VALUES: dict[str, str] = {
    "key_hash": _packed_digest("o.key_hash"),
    "key": (
        "CASE WHEN o.key ~ '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' "
        "THEN decode(replace(o.key, '-', ''), 'hex') "
        "WHEN octet_length(o.key) = 16 THEN convert_to(o.key, 'UTF8') || '\\xff'::bytea "
        "ELSE convert_to(o.key, 'UTF8') END"
    ),
    "scope": (
        "CASE WHEN o.scope ~ '^[\\x01-\\x39\\x3b-\\x7f]*:([0-9a-f]{2})+$' AND ("
        "split_part(o.scope, ':', 1) IN ('credentials', 'user', 'principal', 'public') "
        "OR split_part(o.scope, ':', 1) !~ '^[\\x01-\\x1f]') "
        "THEN '\\x00'::bytea || CASE split_part(o.scope, ':', 1) "
        "WHEN 'credentials' THEN '\\x01'::bytea WHEN 'user' THEN '\\x02'::bytea "
        "WHEN 'principal' THEN '\\x03'::bytea WHEN 'public' THEN '\\x04'::bytea "
        "ELSE convert_to(split_part(o.scope, ':', 1) || ':', 'UTF8') END "
        "|| decode(split_part(o.scope, ':', 2), 'hex') "
        "WHEN o.scope ~ '^\\x01' THEN '\\x01'::bytea || convert_to(o.scope, 'UTF8') "
        "ELSE convert_to(o.scope, 'UTF8') END"
    ),
    "operation": "o.operation",
    "fingerprint": _packed_digest("o.fingerprint"),
    "status": (
        "CASE o.status WHEN 'processing' THEN 0 WHEN 'completed' THEN 1 ELSE 2 END::smallint"
    ),
    "token": (
        "CASE WHEN o.token ~ '^[0-9a-f]+$' AND length(o.token) <= 1024 "
        "THEN CASE WHEN length(o.token) % 2 = 0 "
        "THEN '\\x00'::bytea || decode(o.token, 'hex') "
        "ELSE '\\x01'::bytea || decode('0' || o.token, 'hex') END "
        "WHEN o.token ~ '^[\\x01\\x02]' THEN '\\x02'::bytea || convert_to(o.token, 'UTF8') "
        "ELSE convert_to(o.token, 'UTF8') END"
    ),
    "lease_until": "o.lease_until",
    "expires_at": "o.expires_at",
    "created_at": "o.created_at",
    "updated_at": "o.updated_at",
    "completed_at": (
        "CASE WHEN o.status <> 'completed' THEN o.completed_at "
        "WHEN o.completed_at IS NULL THEN 'NaN'::double precision "
        "WHEN o.completed_at = o.updated_at THEN NULL ELSE o.completed_at END"
    ),
    "attempts": "o.attempts",
    "request_id": "o.request_id",
    "final": "o.final",
    "response_status": "CASE WHEN o.response_body IS NULL THEN NULL ELSE o.response_status END",
    "response_headers": (
        "CASE WHEN o.response_body IS NULL OR coalesce(o.response_headers, '[]') = '[]' "
        "THEN NULL ELSE convert_to(o.response_headers, 'UTF8') END"
    ),
    "response_media_type": (
        "CASE WHEN o.response_body IS NULL OR o.response_media_type = 'application/json' "
        "THEN NULL WHEN coalesce(o.response_media_type, '') = '' "
        "THEN 'application/octet-stream' ELSE o.response_media_type END"
    ),
    "response_body": "o.response_body",
    "request_payload": "o.request_payload",
    "metadata": "NULLIF(NULLIF(o.metadata, '{}'), '')",
    "retention": "NULLIF(o.retention, 'standard')",
}
assert tuple(_V3_VALUES) == COLUMNS


def _v3_copy(target: sql.Composable, source: sql.Composable, extra: str = "") -> sql.Composable:
    """``INSERT INTO target SELECT …`` every row of the v2 table ``source``, converted
    (and ``extra``, a column both tables have after the record's)."""
    cols = [*COLUMNS, *([extra] if extra else [])]
    values = [*_V3_VALUES.values(), *([f"o.{extra}"] if extra else [])]
    return sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {} AS o").format(
        target,
        sql.SQL(", ").join(map(sql.Identifier, cols)),
        sql.SQL(", ".join(values)),
        source,
    )


def _v3_archive(names: _Names) -> list[sql.Composable]:
    """The archive at v3: a new table, the rows copied and converted, the old one
    dropped and the new one renamed to its name (with its primary key's)."""
    schema, base = names.schema, names.base
    new = sql.Identifier(*schema, f"{base}_archive_v3")
    return [
        sql.SQL(_V3_ARCHIVE).format(
            archive=new,
            columns=_v3_columns(),
            pkey=sql.Identifier(f"{base}_av3_pkey"),
        ),
        _v3_copy(new, names.archive, "archived_at"),
        sql.SQL(_V2_ARCHIVE_INDEX).format(
            index=sql.Identifier(f"{base}_archived_at_v3"), archive=new
        ),
        sql.SQL("DROP TABLE {}").format(names.archive),
        sql.SQL("ALTER TABLE {} RENAME TO {}").format(new, sql.Identifier(f"{base}_archive")),
        sql.SQL("ALTER TABLE {} RENAME CONSTRAINT {} TO {}").format(
            names.archive,
            sql.Identifier(f"{base}_av3_pkey"),
            sql.Identifier(f"{base}_archive_pkey"),
        ),
        sql.SQL("ALTER INDEX {} RENAME TO {}").format(
            sql.Identifier(*schema, f"{base}_archived_at_v3"),
            sql.Identifier(f"{base}_archived_at"),
        ),
    ]


def _v3(names: _Names) -> list[sql.Composable]:
    """Schema v3: the compact row. A new table, every row copied and converted in SQL,
    the indexes built after the copy, the old table dropped and the new one renamed
    to its name (with its indexes' and constraints'); the archive likewise. Writes
    wait for the whole copy (``EXCLUSIVE``), reads only for the swap.
    """
    schema, base = names.schema, names.base
    new = sql.Identifier(*schema, f"{base}_v3")
    return [
        sql.SQL("LOCK TABLE {}, {} IN EXCLUSIVE MODE").format(names.table, names.archive),
        sql.SQL(_V3_TABLE).format(
            table=new,
            columns=_v3_columns(),
            status_check=sql.Identifier(f"{base}_status_check"),
            tail=sql.SQL(" WITH (fillfactor = 90)"),
        ),
        _v3_copy(new, names.table),
        # The primary key after the copy: one sort instead of an insert per row.
        sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} PRIMARY KEY (key_hash)").format(
            new, sql.Identifier(f"{base}_v3_pkey_")
        ),
        sql.SQL(_V1_INDEX).format(index=sql.Identifier(f"{base}_v3_expires_at"), table=new),
        sql.SQL("DROP TABLE {}").format(names.table),
        sql.SQL("ALTER TABLE {} RENAME TO {}").format(new, sql.Identifier(base)),
        sql.SQL("ALTER TABLE {} RENAME CONSTRAINT {} TO {}").format(
            names.table, sql.Identifier(f"{base}_v3_pkey_"), sql.Identifier(f"{base}_pkey")
        ),
        sql.SQL("ALTER INDEX {} RENAME TO {}").format(
            sql.Identifier(*schema, f"{base}_v3_expires_at"), sql.Identifier(f"{base}_expires_at")
        ),
        *_v3_archive(names),
    ]


#: Migrations by the version they lead to (index 0 → v1). Append, never edit.
_MIGRATIONS: tuple[Callable[[_Names], list[sql.Composable]], ...] = (
    lambda names: _v1(names.table, names.base),
    _v2,
    _v3,
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
RETURNS TABLE (o_found {table}, o_claimed boolean, o_attempts integer, o_took_over {took_over})
LANGUAGE plpgsql VOLATILE AS $retrysafe$
DECLARE
    cur {table};
    now_ double precision := {now};
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_key}, {seed}));
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


class _Codes(NamedTuple):
    """How a schema version's claim function spells a status and locks a key."""

    failed: str
    processing: str
    took_over: str  # the type of o_took_over
    lock_key: str  # the text the advisory lock hashes


_V2_CODES = _Codes("'failed'", "'processing'", "text", "$1")
_V3_CODES = _Codes(str(FAILED), str(PROCESSING), "smallint", "encode($1, 'hex')")


def _p_claimable(alias: str, codes: _Codes = _V2_CODES) -> str:
    """:func:`retrysafe._model.decide.claimable` over ``alias`` in the claim function."""
    arg = {c: f"${i}" for i, c in enumerate(COLUMNS, 1)}
    return (
        f"({alias}.expires_at <= now_ OR ({alias}.fingerprint = {arg['fingerprint']} AND ("
        f"({alias}.status = {codes.failed} AND NOT {alias}.final) OR "
        f"({alias}.status = {codes.processing} AND {alias}.lease_until <= now_))))"
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


def _p_claim(names: _Names, pnames: _PNames, types: list[str], codes: _Codes) -> sql.Composable:
    """The claim function over arguments of ``types`` (the record columns')."""
    arg = {c: f"${i}" for i, c in enumerate(COLUMNS, 1)}
    assignments = []
    for c in COLUMNS[1:]:
        value = arg[c]
        if c in _KEPT_WHEN_LIVE:
            value = f"CASE WHEN t.expires_at > now_ THEN {_KEPT_WHEN_LIVE[c]} ELSE {value} END"
        assignments.append(sql.SQL("{} = {}").format(sql.Identifier(c), sql.SQL(value)))
    return sql.SQL(_P_CLAIM).format(
        fn=pnames.claim,
        arg_types=sql.SQL(", ").join(map(sql.SQL, types)),
        table=names.table,
        took_over=sql.SQL(codes.took_over),
        now=sql.SQL(arg["updated_at"]),
        lock_key=sql.SQL(codes.lock_key),
        seed=sql.Literal(pnames.claim_seed),
        cols=sql.SQL(", ").join(map(sql.Identifier, COLUMNS)),
        args=sql.SQL(", ").join(sql.SQL(arg[c]) for c in COLUMNS),
        attempts=sql.SQL(arg["attempts"]),
        cur_claimable=sql.SQL(_p_claimable("cur", codes)),
        assignments=sql.SQL(", ").join(assignments),
        t_claimable=sql.SQL(_p_claimable("t", codes)),
    )


def _p_schema(names: _Names, pnames: _PNames, interval: int) -> list[sql.Composable]:
    """The partitioned table at version 2, from nothing (partitions come after).

    The parent, its expiry index (each partition gets its own), the archive exactly as
    the unpartitioned path has it, the comment that records the interval, and the
    claim and partition functions.
    """
    claim = _p_claim(names, pnames, [type_ for _, type_, _ in _RECORD_COLUMNS], _V2_CODES)
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
_P_MIGRATIONS: dict[int, Callable[[_Names, _PNames], list[sql.Composable]]] = {
    3: lambda names, pnames: _p_v3(names, pnames),
}
assert set(_P_MIGRATIONS) == set(range(3, SCHEMA_VERSION + 1))

#: The partitioned v3 step's middle: in one block, new partitions with the old ones'
#: bounds (under temporary names), the rows copied and converted, the old table
#: dropped and everything renamed to the old names. Detached tables a sweep left
#: behind and detaches left pending hold only expired rows: their financial rows go
#: to the (v2) archive first, as the sweep would have done, and they are dropped.
_P_V3 = """
DO $retrysafe$
DECLARE
    parent regclass := {parent}::regclass;
    sch text;
    r record;
    temps text[] := '{{}}';
    olds text[] := '{{}}';
BEGIN
    SELECT n.nspname INTO sch FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
    WHERE c.oid = parent;
    FOR r IN
        SELECT c.oid::regclass AS rel FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
        WHERE i.inhparent = parent AND i.inhdetachpending
        UNION ALL
        SELECT c.oid::regclass FROM pg_class AS c
        WHERE c.relnamespace = (SELECT p.relnamespace FROM pg_class AS p WHERE p.oid = parent)
        AND c.relkind = 'r' AND NOT c.relispartition AND c.relname ~ {leftover}
        AND obj_description(c.oid, 'pg_class') = {comment}
    LOOP
        EXECUTE format('INSERT INTO %s ({archive_cols}) SELECT {cols}, %s FROM %s '
            'WHERE retention = ''financial'' ON CONFLICT (key_hash, token) DO NOTHING',
            {archive}, extract(epoch FROM clock_timestamp()), r.rel);
        EXECUTE format('DROP TABLE %s', r.rel);
    END LOOP;
    FOR r IN
        SELECT c.oid, c.relname, pg_get_expr(c.relpartbound, c.oid) AS bound
        FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
        WHERE i.inhparent = parent
    LOOP
        EXECUTE format('CREATE TABLE %I.%I PARTITION OF %s %s WITH (fillfactor = 90)',
            sch, 'retrysafe_v3_' || r.oid, {new}, r.bound);
        EXECUTE format('COMMENT ON TABLE %I.%I IS %L', sch, 'retrysafe_v3_' || r.oid, {comment});
        temps := temps || ('retrysafe_v3_' || r.oid);
        olds := olds || r.relname::text;
    END LOOP;
    EXECUTE {copy};
    EXECUTE format('COMMENT ON TABLE %s IS %L', {new}, obj_description(parent, 'pg_class'));
    EXECUTE format('DROP TABLE %s', parent);
    EXECUTE format('ALTER TABLE %s RENAME TO %I', {new}, {base});
    FOR i IN 1..coalesce(array_length(temps, 1), 0) LOOP
        EXECUTE format('ALTER TABLE %I.%I RENAME TO %I', sch, temps[i], olds[i]);
    END LOOP;
END
$retrysafe$
"""


def _p_v3(names: _Names, pnames: _PNames) -> list[sql.Composable]:
    """Schema v3 of the partitioned table: the compact row (see :func:`_v3`).

    The claim function goes first (it returns the table's row type, so the table
    cannot be dropped while it exists) and comes back with the v3 argument types.
    The primary key and the expiry index are built after the copy, on the parent
    (each partition gets its own). The archive is migrated as on the other path.
    """
    schema, base = names.schema, names.base
    new = sql.Identifier(*schema, f"{base}_v3")
    archive_cols = sql.SQL(", ").join(map(sql.Identifier, (*COLUMNS, "archived_at")))
    middle = sql.SQL(_P_V3).format(
        parent=sql.Literal(names.table.as_string(None)),
        leftover=sql.Literal(f"^{base}_p[0-9]+(_[0-9])?$"),
        comment=sql.Literal(_PARTITION_COMMENT.format(base=base)),
        archive_cols=sql.SQL(archive_cols.as_string(None).replace("'", "''")),
        cols=sql.SQL(", ").join(map(sql.Identifier, COLUMNS)),
        archive=sql.Literal(names.archive.as_string(None)),
        new=sql.Literal(new.as_string(None)),
        copy=sql.Literal(_v3_copy(new, names.table).as_string(None)),
        base=sql.Literal(base),
    )
    types = [V3_TYPES[c].removesuffix(" NOT NULL") for c in COLUMNS]
    return [
        sql.SQL("LOCK TABLE {}, {} IN EXCLUSIVE MODE").format(names.table, names.archive),
        sql.SQL("DROP FUNCTION {}").format(pnames.claim),
        sql.SQL(_V3_TABLE).format(
            table=new,
            columns=_v3_columns(),
            status_check=sql.Identifier(f"{base}_status_check"),
            tail=sql.SQL(" PARTITION BY RANGE (expires_at)"),
        ),
        middle,
        sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} PRIMARY KEY (key_hash, expires_at)").format(
            names.table, sql.Identifier(f"{base}_pkey")
        ),
        sql.SQL(_V1_INDEX).format(index=sql.Identifier(f"{base}_expires_at"), table=names.table),
        *_v3_archive(names),
        _p_claim(names, pnames, types, _V3_CODES),
    ]


# -- statement pieces --------------------------------------------------------------

#: A SELECT of a whole record, in :data:`COLUMNS` order, over alias ``t``.
_SELECT_COLUMNS = ", ".join(f"t.{c}" for c in COLUMNS)

#: :func:`retrysafe._model.decide.claimable` over the current row ``t``; its placeholders
#: are, in order: claim time, fingerprint, claim time.
_CLAIMABLE = (
    f"(t.expires_at <= %s OR (t.fingerprint = %s AND ((t.status = {FAILED} AND NOT t.final) "
    f"OR (t.status = {PROCESSING} AND t.lease_until <= %s))))"
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
    f"SELECT operation, status, count(*), min(created_at) FILTER (WHERE status = {PROCESSING}), "
    f"(array_agg(key_hash ORDER BY created_at) FILTER (WHERE status = {PROCESSING}))[1] "
    "FROM {table} WHERE expires_at > %s GROUP BY operation, status",
    "SELECT count(*) FROM {table} WHERE expires_at <= %s",
    "SELECT {select_cols} FROM {table} AS t WHERE t.key_hash = %s",
    "SELECT count(*) FROM {archive}",
)
