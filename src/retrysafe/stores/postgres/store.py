"""``postgresql://``: records in one PostgreSQL table, one statement per operation.

:class:`PostgresStore` composes every statement once and describes each operation as
one op; the schema, the connections and the operations work are modules of their
own. docs/stores.md ("PostgreSQL statements") explains the statements and the
partitioned layout.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool

from retrysafe._model.decide import claimable
from retrysafe._model.duration import parse_duration
from retrysafe._model.record import ClaimResult, Outcome, Record, Status
from retrysafe.errors import SchemaModeError, SchemaVersionError, StoreUnavailableError
from retrysafe.stores._base import Store
from retrysafe.stores._options import option, table_parts, to_bool
from retrysafe.stores._packing import tagged_token
from retrysafe.stores._redact import redact, redact_in
from retrysafe.stores._sql import ARCHIVE_COLUMNS, COLUMNS
from retrysafe.stores.postgres.connection import (
    _DEFAULT_AHEAD,
    _DEFAULT_INTERVAL,
    _RECONNECT,
    _Connection,
    _Flow,
    _forget_pools,
    _LoopPool,
    _Op,
    _split_url,
)
from retrysafe.stores.postgres.maintenance import PostgresMaintenance
from retrysafe.stores.postgres.rows import (
    COMPLETED,
    FAILED,
    PROCESSING,
    STATUSES,
    V3_TYPES,
    outcome_params,
    pack_digest,
    row_params,
    row_record,
)
from retrysafe.stores.postgres.schema import (
    _CLAIMABLE,
    _KEPT_WHEN_LIVE,
    _MIGRATIONS,
    _P_MIGRATIONS,
    _PARENT_INTERVAL,
    _PARTITION_COMMENT,
    _SELECT_COLUMNS,
    _STATS,
    SCHEMA_VERSION,
    _lock_id,
    _Names,
    _p_schema,
    _PNames,
)
from retrysafe.stores.postgres.transactions import PostgresTransactions

__all__ = ["PostgresStore"]


def _first(rowcount: int, row: Sequence[Any] | None) -> Any:
    return None if row is None else row[0]


def _changed(rowcount: int, row: Sequence[Any] | None) -> bool:
    return rowcount == 1


def _record_or_none(rowcount: int, row: Sequence[Any] | None) -> Record | None:
    return None if row is None else row_record(row)


#: Where a claim's row says whether the claim inserted the record (after the columns).
_INSERTED = len(COLUMNS)
#: Claims whose packed key hash and token a store keeps for their completion (beyond
#: that many it forgets them all: a completion packs again what it does not find).
_HELD = 1024
#: Claim statements one claim may run before it gives up (each further one means
#: that a concurrent writer changed the row in between).
_MAX_CLAIM_STATEMENTS = 100


#: The first schema version whose migration rewrites the table (v2 -> v3): an older
#: table is upgraded only by ``migrate()`` (``retrysafe migrate``), never on first use.
_REWRITES = 3


def _takeover_params(record: Record, row: Sequence[Any], found: Sequence[Any]) -> list[Any]:
    """Parameters of the takeover ``UPDATE`` that writes ``record`` (its packed ``row``)
    over the row ``found`` (its stored token and status, as read)."""
    now = record.updated_at
    params: list[Any] = []
    for column, value in zip(COLUMNS[1:], row[1:], strict=True):
        if column in _KEPT_WHEN_LIVE:
            params.append(now)
        params.append(value)
    params += (row[0], found[6], found[5], now, row[4], now)
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


class PostgresStore(PostgresTransactions, PostgresMaintenance, Store[_Op]):
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
    that sweeps drop whole partitions instead of deleting rows (docs/stores.md,
    "Partitioned table"). The layout is fixed when the table is created; opening it in the
    other mode raises :class:`SchemaModeError`.
    """

    settle_expiry = True

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
        table = option("table", table, "retrysafe_records", options.get("table"), str)
        min_size = option("min_size", min_size, 0, options.get("min_size"), int)
        max_size = option("max_size", max_size, 10, options.get("max_size"), int)
        auto_migrate = option(
            "auto_migrate", auto_migrate, True, options.get("auto_migrate"), to_bool
        )
        interval = partial(parse_duration, field="partition_interval")
        ahead = partial(parse_duration, field="partition_ahead", allow_zero=True)
        partitioned = option("partitioned", partitioned, False, options.get("partitioned"), to_bool)
        if partition_interval is not None:
            partition_interval = interval(partition_interval)
        partition_interval = option(
            "partition_interval",
            partition_interval,
            None,
            options.get("partition_interval"),
            interval,
        )
        partition_ahead = option(
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
        url_timeout = params.get("connect_timeout")
        if url_timeout is not None:
            connect_timeout = float(url_timeout)
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
        #: Whether a migration that rewrites the table may run: only when asked for
        #: (``migrate()``), never on first use, where old processes may still run.
        self._rewrite_allowed = False
        #: key hash -> (token, packed key hash, packed token) of the claims this
        #: process holds: its completion, failure or renewal binds them as they are.
        self._held: dict[str, tuple[str, bytes, bytes]] = {}
        #: How compare-and-set statements recover: only a partitioned table moves rows.
        self._moved = partial(_retry_moved, 0) if self.partitioned else None
        self._build_sql(table_parts(table))
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
        cas = sql.SQL(f" WHERE key_hash = %s AND token = %s AND status = {PROCESSING}")

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
            value: sql.Composable = sql.SQL("%s")
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
        complete = sql.SQL(
            "UPDATE {} SET status = {}, {}, completed_at = NULL, updated_at = %s"
        ).format(table, sql.Literal(COMPLETED), outcome)
        fail = sql.SQL("UPDATE {} SET status = {}, {}, final = %s, updated_at = %s").format(
            table, sql.Literal(FAILED), outcome
        )
        until = sql.SQL(", expires_at = %s")
        self._q_complete = text(complete + cas)
        self._q_fail = text(fail + cas)
        # The same, moving the record's expiry too (a call that keeps its answer ttl
        # from when it is stored).
        self._q_complete_until = text(complete + until + cas)
        self._q_fail_until = text(fail + until + cas)
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
        types = [sql.SQL(V3_TYPES[c].removesuffix(" NOT NULL")) for c in COLUMNS]
        self._q_pclaim = text(
            sql.SQL("SELECT {}, r.o_claimed, r.o_attempts, r.o_took_over FROM {}({}) AS r").format(
                sql.SQL(", ").join(
                    sql.SQL("(r.o_found).{}").format(sql.Identifier(c)) for c in COLUMNS
                ),
                pn.claim,
                sql.SQL(", ").join(sql.SQL("%s::{}").format(t) for t in types),
            )
        )
        # The hot path's statements (a claim, its completion or failure, renewals)
        # each keep a cursor, and with it psycopg's adapters, from one run to the next.
        self._cursor_queries = frozenset(
            (
                self._q_claim,
                self._q_pclaim,
                self._q_complete,
                self._q_fail,
                self._q_renew,
                self._q_complete_until,
                self._q_fail_until,
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
        if 0 < version < _REWRITES and not self._rewrite_allowed:
            raise SchemaVersionError(
                f"PostgreSQL store at {self._where}: the table is at schema version "
                f"{version}; version {SCHEMA_VERSION} rewrites it, which a process of the "
                "older retrysafe still using it cannot survive, so it is not done on first "
                "use: stop those processes, run `retrysafe migrate --store URL`, then start "
                "this version (docs/stores.md, 'Upgrading to schema v3')"
            )
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
        self._migrated, self._rewrite_allowed = False, True
        return int(self._run(self._read_version))

    async def amigrate(self) -> int:
        """:meth:`migrate` from a coroutine."""
        self._migrated, self._rewrite_allowed = False, True
        return int(await self._arun(self._read_version))

    # -- operations ------------------------------------------------------------------

    def _claim(self, record: Record, statements: int = 1) -> _Op:
        sent = row_params(record)
        if self.partitioned:
            return _Op(
                self._q_pclaim,
                sent,
                partial(self._pclaimed, record, sent),
                partial(self._pclaim_recover, record, statements),
            )
        params = (sent[0], *sent)
        return _Op(self._q_claim, params, partial(self._claimed, record, sent, statements))

    def _hold(self, record: Record, sent: Sequence[Any]) -> None:
        """Keep the packed key hash and token of a claim this process now holds."""
        held = self._held
        if len(held) >= _HELD:
            held.clear()
        held[record.key_hash] = (record.token, sent[0], sent[6])

    def _packed(self, key_hash: str, token: str, settle: bool) -> tuple[bytes, bytes]:
        """The packed key hash and token of a claim, as held or packed again; ``settle``:
        the claim ends (a completion or failure) and is no longer held."""
        held = self._held.pop(key_hash, None) if settle else self._held.get(key_hash)
        if held is not None and held[0] == token:
            return held[1], held[2]
        return pack_digest(key_hash), tagged_token(token)

    def _pclaimed(
        self, record: Record, sent: Sequence[Any], rowcount: int, row: Sequence[Any] | None
    ) -> ClaimResult:
        """The partitioned claim function's answer (it took any takeover under its lock)."""
        assert row is not None
        if row[_P_CLAIMED]:
            self._hold(record, sent)
            took_over = row[_P_CLAIMED + 2]
            return ClaimResult(
                True,
                attempts=row[_P_CLAIMED + 1],
                took_over=None if took_over is None else STATUSES[took_over],
            )
        return ClaimResult(False, record=row_record(row, sent, record))

    def _claimed(
        self,
        record: Record,
        sent: Sequence[Any],
        statements: int,
        rowcount: int,
        row: Sequence[Any] | None,
    ) -> ClaimResult | _Op:
        """The claim statement's answer, or the statement to run next."""
        if row is None:  # a concurrent insert committed after the snapshot: look again
            return self._claim_again(record, statements)
        if row[_INSERTED]:
            self._hold(record, sent)
            return ClaimResult(True, attempts=record.attempts)
        found = row_record(row, sent, record)
        now = record.updated_at
        if not claimable(found, record.fingerprint, now):
            return ClaimResult(False, record=found)
        self._check_statements(statements)
        took_over = found.status if found.expires_at > now else None
        params = _takeover_params(record, sent, row)
        return _Op(
            self._q_takeover,
            params,
            partial(self._took_over, record, sent, statements + 1, took_over),
        )

    def _took_over(
        self,
        record: Record,
        sent: Sequence[Any],
        statements: int,
        took_over: Status | None,
        rowcount: int,
        row: Sequence[Any] | None,
    ) -> ClaimResult | _Op:
        """The takeover's answer; when it lost a race, the claim starts over."""
        if row is None:  # a concurrent claim, completion, renewal or delete came first
            return self._claim_again(record, statements)
        self._hold(record, sent)
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

    def _complete(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome,
        now: float,
        expires_at: float | None = None,
    ) -> _Op:
        if expires_at is None:
            params = (*outcome_params(outcome), now, *self._packed(key_hash, token, True))
            return _Op(self._q_complete, params, _changed, self._moved)
        values = (*outcome_params(outcome), now)
        return self._settle_until(self._q_complete_until, values, expires_at, key_hash, token)

    def _fail(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome | None,
        final: bool,
        now: float,
        expires_at: float | None = None,
    ) -> _Op:
        values = (*outcome_params(outcome), bool(final), now)
        if expires_at is None:
            return _Op(
                self._q_fail, (*values, *self._packed(key_hash, token, True)), _changed, self._moved
            )
        return self._settle_until(self._q_fail_until, values, expires_at, key_hash, token)

    def _settle_until(
        self, query: str, values: tuple[Any, ...], expires_at: float, key_hash: str, token: str
    ) -> _Op:
        """A completion or failure that moves the record's expiry to ``expires_at``."""
        params = (*values, expires_at, *self._packed(key_hash, token, True))
        recover = partial(self._settle_recover, expires_at, 0) if self.partitioned else None
        return _Op(query, params, _changed, recover)

    def _settle_recover(
        self, expires_at: float, tries: int, op: _Op, exc: psycopg.Error, *, found: bool = False
    ) -> _Op:
        """A completion or failure on a partitioned table that moves its row to an
        expiry with no partition yet: add it (as a claim does), then write again. A
        moved row (a serialization failure) only means: write again (see
        _retry_moved). ``found``: the add before this write found the partition
        attached already (made by another session); still missing it is a stale
        descriptor (see _pclaim_recover): write again on another connection.
        """
        if not (_no_partition(exc) or exc.sqlstate == "40001") or tries >= _MAX_MOVED_RETRIES:
            raise exc
        again = op._replace(recover=partial(self._settle_recover, expires_at, tries + 1))
        if exc.sqlstate == "40001":
            return again
        if found:
            return _Op(_RECONNECT, (), lambda rowcount, row: again)

        def added(rowcount: int, row: Sequence[Any] | None) -> _Op:
            if row is not None and row[0] is None:  # attached already: a healthy session sees it
                return op._replace(
                    recover=partial(self._settle_recover, expires_at, tries + 1, found=True)
                )
            return self._refreshed(again)

        return _Op(self._q_add_partition, (expires_at,), added)

    def _renew(self, key_hash: str, token: str, lease_until: float, now: float) -> _Op:
        params = (lease_until, now, lease_until, *self._packed(key_hash, token, False))
        return _Op(self._q_renew, params, _changed, self._moved)

    def _get(self, key_hash: str) -> _Op:
        return _Op(self._q_get, (pack_digest(key_hash),), _record_or_none)

    def _delete(self, key_hash: str) -> _Op:
        return _Op(self._q_delete, (pack_digest(key_hash),), _changed, self._moved)

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
