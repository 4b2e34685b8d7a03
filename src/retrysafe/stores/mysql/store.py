"""``mysql://`` and ``mariadb://``: records in one InnoDB table, one round trip per claim,
completion and replay.

A claim is ``INSERT … ON DUPLICATE KEY UPDATE key_hash = key_hash`` and a ``SELECT`` of
the key's row, sent together: the primary key lets one insert win, the insert of a
key that exists only locks its row for the statement, and the ``SELECT`` (a fresh read
once the insert committed) tells the claimant whether the row holds its own fencing
token. A claimable row that is not the claimant's is taken over by a compare-and-set
``UPDATE`` on its token and status that checks the takeover rule again on the locked
row. docs/stores.md ("MySQL and MariaDB") explains why this holds under REPEATABLE
READ and READ COMMITTED alike.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from retrysafe._model.decide import claimable
from retrysafe._model.record import ClaimResult, Outcome, Record
from retrysafe.errors import SchemaVersionError, StoreUnavailableError
from retrysafe.stores._base import Store
from retrysafe.stores._options import option, table_parts, to_bool
from retrysafe.stores._redact import redact
from retrysafe.stores._sql import COLUMNS, outcome_params, record_params
from retrysafe.stores.mysql.connection import (
    Op,
    Row,
    errno_of,
    parse_url,
    retry_locked,
)
from retrysafe.stores.mysql.maintenance import MySQLMaintenance
from retrysafe.stores.mysql.schema import (
    SCHEMA_VERSION,
    SELECT_COLUMNS,
    Names,
    quote,
    row_record,
    schema_statements,
)
from retrysafe.stores.mysql.transactions import MySQLTransactions

__all__ = ["MySQLStore"]

#: Claim statements one claim may run before it gives up (each further one means that
#: a concurrent writer changed the row in between).
_MAX_CLAIM_STATEMENTS = 100
#: Seconds a first use waits for another process's migration (a named lock).
_MIGRATION_WAIT = 30
_CAS = " WHERE key_hash = %s AND token = %s AND status = 'processing'"
#: The takeover rule of retrysafe._model.decide.claimable, on the locked row.
_CLAIMABLE = (
    "(expires_at <= %s OR (fingerprint = %s AND ((status = 'failed' AND NOT final) "
    "OR (status = 'processing' AND lease_until <= %s))))"
)


def _changed(rowcount: int, row: Row | None) -> bool:
    return rowcount == 1


def _record_or_none(rowcount: int, row: Row | None) -> Record | None:
    return None if row is None else row_record(row)


def _cell_or_none(rowcount: int, row: Row | None) -> Any:
    """A versioned cell's row (version, JSON text, expires_at), or None."""
    return None if row is None else (int(row[0]), row[1], row[2])


def _cell_taken(op: Op, exc: BaseException, tries: int = 0) -> Any:
    """A cell's first write that failed: lost to a concurrent one (duplicate key: not
    written), or chosen as a deadlock's victim among concurrent first writers (run
    again, a few times)."""
    if errno_of(exc) == 1062:
        return False
    again = retry_locked(op, exc, tries)
    return again._replace(recover=lambda o, e: _cell_taken(o, e, tries + 1))


class MySQLStore(MySQLTransactions, MySQLMaintenance, Store[Op]):
    """Records in one InnoDB table (default ``retrysafe_records``) of MySQL 8 or MariaDB
    10.6+.

    ``url`` is ``mysql://user:password@host:port/database`` (or ``mariadb://``); its
    query may carry the connection's ``unix_socket``, ``ssl_ca``, ``ssl_cert``,
    ``ssl_key``, ``ssl_verify_cert`` and ``charset``, and this store's ``table``,
    ``max_size``, ``connect_timeout`` and ``auto_migrate``. ``connect_timeout`` bounds
    both connecting and waiting for one of the ``max_size`` pooled connections. With
    ``auto_migrate`` the tables are created on first use.
    """

    settle_expiry = True

    def __init__(
        self,
        url: str,
        *,
        table: str = "retrysafe_records",
        max_size: int = 10,
        connect_timeout: float = 2.0,
        auto_migrate: bool = True,
    ) -> None:
        self.url = url
        connect, options = parse_url(url)
        table = option("table", table, "retrysafe_records", options.get("table"), str)
        max_size = option("max_size", max_size, 10, options.get("max_size"), int)
        connect_timeout = option(
            "connect_timeout", connect_timeout, 2.0, options.get("connect_timeout"), float
        )
        auto_migrate = option(
            "auto_migrate", auto_migrate, True, options.get("auto_migrate"), to_bool
        )
        if "min_size" in options:
            int(options["min_size"])  # accepted for symmetry with PostgreSQL; pools grow lazily
        if max_size < 1:
            raise ValueError(f"max_size must be at least 1, not {max_size}")
        if not connect_timeout > 0:
            raise ValueError(f"connect_timeout must be positive, not {connect_timeout!r}")
        self.table = table
        self.max_size = max_size
        self.connect_timeout = float(connect_timeout)
        self.auto_migrate = auto_migrate
        self._connect_kwargs = connect
        where = connect.get("unix_socket") or f"{connect['host']}:{connect['port']}"
        self._where = f"{where}/{connect['database']} (table {table})"
        self._migrated = not auto_migrate
        self._names = Names.of(table_parts(table, "database"))
        self._build_sql(self._names)
        self._init_connections()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {redact(self.url)} table={self.table}>"

    def _build_sql(self, names: Names) -> None:
        t = names.table
        cols = SELECT_COLUMNS
        marks = ", ".join(["%s"] * len(COLUMNS))
        self._q_insert = (
            f"INSERT INTO {t} ({cols}) VALUES ({marks}) ON DUPLICATE KEY UPDATE key_hash = key_hash"
        )
        self._q_get = f"SELECT {cols} FROM {t} WHERE key_hash = %s"
        sets = ", ".join(f"{quote(c)} = %s" for c in COLUMNS[1:])
        self._q_takeover = (
            f"UPDATE {t} SET {sets} WHERE key_hash = %s AND token = %s AND status = %s "
            f"AND {_CLAIMABLE}"
        )
        outcome = (
            "response_status = %s, response_headers = %s, response_media_type = %s, "
            "response_body = %s"
        )
        complete = (
            f"UPDATE {t} SET status = 'completed', {outcome}, completed_at = %s, updated_at = %s"
        )
        fail = f"UPDATE {t} SET status = 'failed', {outcome}, final = %s, updated_at = %s"
        until = ", expires_at = %s"
        self._q_complete = complete + _CAS
        self._q_fail = fail + _CAS
        self._q_complete_until = complete + until + _CAS
        self._q_fail_until = fail + until + _CAS
        # expires_at is assigned last: GREATEST reads the row's own value.
        self._q_renew = (
            f"UPDATE {t} SET lease_until = %s, updated_at = %s, "
            "expires_at = GREATEST(expires_at, %s)" + _CAS
        )
        self._q_delete = f"DELETE FROM {t} WHERE key_hash = %s"
        c = names.cells
        self._q_cell_read = f"SELECT version, value, expires_at FROM {c} WHERE cell_key = %s"
        # A first write: drop the cell if it expired, then insert version 1 (a duplicate
        # key means a live cell, or a concurrent first write that came first).
        self._q_cell_create = (
            f"DELETE FROM {c} WHERE cell_key = %s AND expires_at <= %s",
            f"INSERT INTO {c} (cell_key, version, value, expires_at) VALUES (%s, 1, %s, %s)",
        )
        self._q_cell_update = (
            f"UPDATE {c} SET version = version + 1, value = %s, expires_at = %s "
            "WHERE cell_key = %s AND version = %s AND (expires_at IS NULL OR expires_at > %s)"
        )
        # Schema.
        self._q_versions_exist = (
            "SELECT COUNT(*) FROM information_schema.tables "
            "WHERE table_schema = COALESCE(%s, DATABASE()) AND table_name = %s"
        )
        self._q_version = f"SELECT COALESCE(MAX(version), 0) FROM {names.versions}"
        self._q_create_versions = (
            f"CREATE TABLE IF NOT EXISTS {names.versions} (version INT NOT NULL PRIMARY KEY, "
            "applied_at DOUBLE NOT NULL) ENGINE=InnoDB"
        )
        self._q_set_version = (
            f"INSERT INTO {names.versions} (version, applied_at) "
            "VALUES (%s, UNIX_TIMESTAMP(NOW(6)))"
        )
        self._schema = schema_statements(names)
        self._build_maintenance_sql(names)

    # -- schema ------------------------------------------------------------------

    def _migration_op(self, then: Op) -> Op:
        """Ops that create or check the tables, then ``then``: one statement when the
        version table shows the current version, the whole migration under a named
        lock (``GET_LOCK``, held by the connection, so a migration cut short frees it)
        otherwise."""
        return _flow_op(self._migration(), then, self)

    def _migration(self) -> Any:
        names = self._names
        exists = yield self._q_versions_exist, (names.database, f"{names.base}_schema")
        if exists and exists[0]:
            current = self._check_version((yield self._q_version, ()))
            if current == SCHEMA_VERSION:
                return
        got = yield "SELECT GET_LOCK(%s, %s)", (names.lock, _MIGRATION_WAIT)
        if not got or got[0] != 1:
            raise StoreUnavailableError(
                f"MySQL store at {self._where}: another process held the migration lock "
                f"for {_MIGRATION_WAIT}s",
                retry_after=1.0,
            )
        yield self._q_create_versions, ()
        version = self._check_version((yield self._q_version, ()))
        if version < SCHEMA_VERSION:
            for statement in self._schema:
                yield statement, ()
            yield self._q_set_version, (SCHEMA_VERSION,)
        yield "SELECT RELEASE_LOCK(%s)", (names.lock,)

    def _check_version(self, row: Row | None) -> int:
        version = int(row[0]) if row else 0
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"MySQL store at {self._where}: schema version {version} is newer than "
                f"this retrysafe supports ({SCHEMA_VERSION}); upgrade retrysafe"
            )
        return version

    def migrate(self) -> int:
        """Create the tables if missing (under a named lock); return the schema version."""
        self._migrated = False
        return int(self._run(_version_op()))

    async def amigrate(self) -> int:
        """:meth:`migrate` from a coroutine."""
        self._migrated = False
        return int(await self._arun(_version_op()))

    # -- operations ------------------------------------------------------------------

    def _claim(self, record: Record, statements: int = 1) -> Op:
        return Op(
            (self._q_insert, self._q_get),
            (record_params(record), (record.key_hash,)),
            partial(self._claimed, record, statements),
        )

    def _claimed(self, record: Record, statements: int, rowcount: int, row: Row | None) -> Any:
        """The claim's answer, or the statement to run next."""
        if row is None:  # deleted between the insert and the read: look again
            return self._claim_again(record, statements)
        found = row_record(row)
        if found.token == record.token:
            return ClaimResult(True, attempts=record.attempts)
        now = record.updated_at
        if not claimable(found, record.fingerprint, now):
            return ClaimResult(False, record=found)
        self._check_statements(statements)
        live = found.expires_at > now
        attempts = found.attempts + 1 if live else record.attempts
        created_at = found.created_at if live else record.created_at
        values = list(record_params(record))
        values[COLUMNS.index("attempts")] = attempts
        values[COLUMNS.index("created_at")] = created_at
        params = (
            *values[1:],
            record.key_hash,
            found.token,
            found.status.value,
            now,
            record.fingerprint,
            now,
        )
        took_over = found.status if live else None
        return Op(
            self._q_takeover,
            params,
            partial(self._took_over, record, statements + 1, attempts, took_over),
        )

    def _took_over(
        self,
        record: Record,
        statements: int,
        attempts: int,
        took_over: Any,
        rowcount: int,
        row: Row | None,
    ) -> Any:
        """The takeover's answer; when it lost a race, the claim starts over."""
        if rowcount != 1:
            return self._claim_again(record, statements)
        return ClaimResult(True, attempts=attempts, took_over=took_over)

    def _claim_again(self, record: Record, statements: int) -> Op:
        self._check_statements(statements)
        return self._claim(record, statements + 1)

    def _check_statements(self, statements: int) -> None:
        if statements >= _MAX_CLAIM_STATEMENTS:
            raise StoreUnavailableError(
                f"MySQL store at {self._where}: a claim ran {statements} statements "
                "without settling (concurrent writers kept changing the key)",
                retry_after=1.0,
            )

    def _complete(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome,
        now: float,
        expires_at: float | None = None,
    ) -> Op:
        values = (*outcome_params(outcome), now, now)
        if expires_at is None:
            return Op(self._q_complete, (*values, key_hash, token), _changed)
        return Op(self._q_complete_until, (*values, expires_at, key_hash, token), _changed)

    def _fail(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome | None,
        final: bool,
        now: float,
        expires_at: float | None = None,
    ) -> Op:
        values = (*outcome_params(outcome), bool(final), now)
        if expires_at is None:
            return Op(self._q_fail, (*values, key_hash, token), _changed)
        return Op(self._q_fail_until, (*values, expires_at, key_hash, token), _changed)

    def _renew(self, key_hash: str, token: str, lease_until: float, now: float) -> Op:
        return Op(self._q_renew, (lease_until, now, lease_until, key_hash, token), _changed)

    def _get(self, key_hash: str) -> Op:
        return Op(self._q_get, (key_hash,), _record_or_none)

    def _delete(self, key_hash: str) -> Op:
        return Op(self._q_delete, (key_hash,), _changed)

    def _cell_read(self, key: str) -> Op:
        return Op(self._q_cell_read, (key,), _cell_or_none)

    def _cell_write(
        self, key: str, expected: int | None, text: str, expires_at: float | None, now: float
    ) -> Op:
        if expected is None:
            params = ((key, now), (key, text, expires_at))
            return Op(self._q_cell_create, params, lambda rowcount, row: True, _cell_taken)
        return Op(self._q_cell_update, (text, expires_at, key, expected, now), _changed)


def _version_op() -> Op:
    return Op("DO 0", (), lambda rowcount, row: SCHEMA_VERSION)


def _flow_op(flow: Any, then: Op, store: MySQLStore, row: Row | None = None) -> Op:
    """The migration ``flow`` (a generator of statements that receives each one's first
    row) as a chain of ops ending in ``then``."""
    try:
        query, params = flow.send(row)
    except StopIteration:
        store._migrated = True
        return then
    return Op(query, params, lambda rowcount, found: _flow_op(flow, then, store, found))
