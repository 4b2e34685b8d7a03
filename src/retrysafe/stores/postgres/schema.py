"""The PostgreSQL schema: the record columns, the migrations of the plain and the
partitioned table, and the statement pieces the store composes its SQL from."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import NamedTuple

from psycopg import sql

from retrysafe.stores._sql import COLUMN_SPECS, COLUMNS

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
