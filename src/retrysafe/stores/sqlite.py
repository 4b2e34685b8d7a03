"""``sqlite:///path``: the embedded default store (WAL, safe across processes on one host)."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from functools import partial
from operator import itemgetter
from typing import Any

from retrysafe._model.decide import claimable
from retrysafe._model.record import ClaimResult, Outcome, Record
from retrysafe.errors import SchemaVersionError, StoreUnavailableError
from retrysafe.stores._base import (
    ArchivedRecord,
    AsyncTransaction,
    RecordQuery,
    Store,
    StoreStats,
    SweepBatch,
    Transaction,
)
from retrysafe.stores._sql import ARCHIVE_COLUMNS, COLUMN_SPECS, COLUMNS, list_clause
from retrysafe.stores._sql import record_from_row as v2_record
from retrysafe.stores._sqlite_rows import (
    COMPLETED,
    FAILED,
    FINANCIAL_CODE,
    PROCESSING,
    V3_TYPES,
    outcome_params,
    pack_hex,
    pack_key,
    pack_token,
    row_params,
    row_record,
    status_code,
    status_value,
    v3_record,
)

__all__ = ["SCHEMA_VERSION", "SQLiteStore"]

SCHEMA_VERSION = 4
_Op = Callable[[sqlite3.Connection], Any]

#: SQLite's type for each column kind of :data:`COLUMN_SPECS`.
_TYPES = {"text": "TEXT", "real": "REAL", "integer": "INTEGER", "bool": "INTEGER", "bytes": "BLOB"}
#: Column defaults, as schema v1 declared them.
_DEFAULTS = {"final": "0", "metadata": "'{}'"}


def _declare(name: str, kind: str, nullable: bool) -> str:
    """One column's declaration (without a primary key)."""
    default = _DEFAULTS.get(name)
    return (
        f"{name} {_TYPES[kind]}"
        + ("" if nullable else " NOT NULL")
        + ("" if default is None else f" DEFAULT {default}")
    )


def _columns(specs: Sequence[tuple[str, str, bool]], *, key: bool) -> str:
    """The declarations of ``specs``; ``key``: ``key_hash`` is the primary key."""
    lines = [
        f"{name} {_TYPES[kind]} PRIMARY KEY"
        if key and name == "key_hash"
        else _declare(name, kind, nullable)
        for name, kind, nullable in specs
    ]
    return ",\n    ".join(lines)


# Schema v1 had the columns before ``retention``; v2 added it and the archive. A later
# column needs its own migration, which adds it to both tables.
_V1_SPECS = COLUMN_SPECS[: COLUMNS.index("retention")]
_RETENTION = COLUMN_SPECS[COLUMNS.index("retention")]
_V2_SPECS = COLUMN_SPECS[: COLUMNS.index("retention") + 1]
if len(_V2_SPECS) != len(COLUMN_SPECS):  # pragma: no cover - needs a migration
    raise ImportError("retrysafe.stores.sqlite: a column of _sql.COLUMNS has no migration")
_COLS = ", ".join(COLUMNS)
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS retrysafe_records (
    {_columns(_V1_SPECS, key=True)}
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS retrysafe_records_expires_at ON retrysafe_records (expires_at);
"""
# v2: the retention class of every record (rows of v1 are standard), and the
# archive: financial records the sweeper removed, each at most once (a fencing
# token is unique per claim), newest first by ``archived_at``.
_V2 = f"""
ALTER TABLE retrysafe_records ADD COLUMN {_declare(*_RETENTION)} DEFAULT 'standard';
CREATE TABLE IF NOT EXISTS retrysafe_archive (
    {_columns(_V2_SPECS, key=False)},
    archived_at REAL NOT NULL,
    PRIMARY KEY (key_hash, token)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS retrysafe_archive_archived_at ON retrysafe_archive (archived_at);
"""
# v3: the compact rows of _sqlite_rows (packed digests, status and retention codes,
# no empty texts, no completed_at twice), in tables rebuilt with those types; every
# row of v2 is rewritten, in the migration's one transaction.
_V3_COLUMNS = ",\n    ".join(f"{name} {type_}" for name, type_ in V3_TYPES.items())
_V3_TABLES = (
    (
        "retrysafe_records",
        f"{_COLS}",
        f"""CREATE TABLE retrysafe_records_v3 (
    {_V3_COLUMNS},
    PRIMARY KEY (key_hash)
) WITHOUT ROWID""",
        ("CREATE INDEX retrysafe_records_expires_at ON retrysafe_records (expires_at)",),
    ),
    (
        "retrysafe_archive",
        f"{_COLS}, archived_at",
        f"""CREATE TABLE retrysafe_archive_v3 (
    {_V3_COLUMNS},
    archived_at REAL NOT NULL,
    PRIMARY KEY (key_hash, token)
) WITHOUT ROWID""",
        ("CREATE INDEX retrysafe_archive_archived_at ON retrysafe_archive (archived_at)",),
    ),
)
_Tables = tuple[tuple[str, str, str, tuple[str, ...]], ...]


def _rewrite(
    conn: sqlite3.Connection, tables: _Tables, decode: Callable[[Sequence[Any]], Record]
) -> None:
    """Rebuild ``tables`` (each: name, columns, its new table's ``CREATE`` under the name
    ending ``_v3``, its indexes) with every row in the current form, ``decode`` reading
    the old one (inside the migration's transaction)."""
    for table, cols, create, indexes in tables:
        conn.execute(create)
        marks = ", ".join("?" * (cols.count(",") + 1))
        rows = conn.execute(f"SELECT {cols} FROM {table}")
        conn.executemany(
            f"INSERT INTO {table}_v3 ({cols}) VALUES ({marks})",
            ((*row_params(decode(row)), *row[len(COLUMNS) :]) for row in rows),
        )
        conn.execute(f"DROP TABLE {table}")
        conn.execute(f"ALTER TABLE {table}_v3 RENAME TO {table}")
        for index in indexes:
            conn.execute(index)


def _v3(conn: sqlite3.Connection, start: int) -> None:
    """Rewrite both tables in the compact row form (it writes the current form)."""
    _rewrite(conn, _V3_TABLES, v2_record)


# v4: the records in a rowid table, found by an index on the key hash's first 8 bytes
# (its rowid beside them): no 32-byte primary key in the expiry index and no pages
# left part-empty by random-key inserts (rows are appended). A trigger keeps a key
# hash to one row: it drops any INSERT of a key already there, under the write lock
# (cheaper than the INSERT ... SELECT ... WHERE NOT EXISTS, which SQLite runs through
# a temporary table as it reads the table it writes). Fencing tokens packed whatever
# their length, and an answer's content-type and content-length as marks when its
# media type and body give them (see _sqlite_rows). A file older than v3 has its rows
# in the current form already (_v3 writes it).
_V4_RECORDS: _Tables = (
    (
        "retrysafe_records",
        _COLS,
        f"CREATE TABLE retrysafe_records_v3 (\n    {_V3_COLUMNS}\n)",
        (
            "CREATE INDEX retrysafe_records_key ON retrysafe_records (substr(key_hash, 1, 8))",
            "CREATE INDEX retrysafe_records_expires_at ON retrysafe_records (expires_at)",
            "CREATE TRIGGER retrysafe_records_one_per_key BEFORE INSERT ON retrysafe_records "
            "WHEN EXISTS (SELECT 1 FROM retrysafe_records WHERE substr(key_hash, 1, 8) = "
            "substr(NEW.key_hash, 1, 8) AND key_hash = NEW.key_hash) "
            "BEGIN SELECT RAISE(IGNORE); END",
        ),
    ),
)


def _v4(conn: sqlite3.Connection, start: int) -> None:
    """Rebuild the records as a rowid table; rewrite a v3 file's rows in the v4 form."""
    decode = v3_record if start == 3 else row_record
    _rewrite(conn, _V4_RECORDS, decode)
    if start == 3:
        _rewrite(conn, _V3_TABLES[1:], v3_record)


#: Migrations by the version they lead to; v1 is the initial schema. Append, never edit.
#: A callable one is given the connection and the file's version before the upgrade.
MIGRATIONS: dict[int, str | Callable[[sqlite3.Connection, int], None]] = {
    1: _SCHEMA,
    2: _V2,
    3: _v3,
    4: _v4,
}

#: A record by its key hash (?1), through the index on its first 8 bytes.
_KEY = "substr(key_hash, 1, 8) = substr(?1, 1, 8) AND key_hash = ?1"
_SELECT = f"SELECT {_COLS} FROM retrysafe_records WHERE {_KEY}"
#: Reads and writes one claim may take before it gives up (each retry means a
#: concurrent writer changed the key in between).
_MAX_CLAIM_STATEMENTS = 100
# Its parameters: the key hash twice, the token.
_CAS = (
    " WHERE substr(key_hash, 1, 8) = substr(?, 1, 8) AND key_hash = ? AND token = ? "
    f"AND status = {PROCESSING}"
)

# -- statements that bind no NULL (a None costs sqlite3 an adapter lookup) ------------
#
# One text per set of values present, made on first use: a claim's record has a few
# (processing, with or without a request id, ...), a finish one per outcome shape.

#: Where the nullable columns are in a row of :data:`COLUMNS` order.
_NULLABLE = tuple(i for i, type_ in enumerate(V3_TYPES.values()) if "NOT NULL" not in type_)
_nullable = itemgetter(*_NULLABLE)
_INSERTS: dict[tuple[bool, ...], tuple[str, Callable[[Sequence[Any]], Any]]] = {}


def _insert(params: tuple[Any, ...]) -> tuple[str, tuple[Any, ...]]:
    """The ``INSERT`` of a row that binds its values other than NULL, and those values."""
    present = tuple([v is not None for v in _nullable(params)])
    made = _INSERTS.get(present)
    if made is None:
        absent = {i for i, here in zip(_NULLABLE, present, strict=True) if not here}
        keep = [i for i in range(len(COLUMNS)) if i not in absent]
        made = _INSERTS[present] = (
            f"INSERT INTO retrysafe_records ({', '.join(COLUMNS[i] for i in keep)}) "
            f"VALUES ({', '.join('?' * len(keep))})",
            itemgetter(*keep),
        )
    return made[0], made[1](params)


_OUTCOME_COLUMNS = ("response_status", "response_headers", "response_media_type", "response_body")
_FINISHES: dict[tuple[str, tuple[bool, ...]], str] = {}


def _finish(sets: str, outcome: tuple[Any, Any, Any, Any]) -> tuple[str, tuple[Any, ...]]:
    """The compare-and-set ``UPDATE`` that writes ``sets`` (its own parameters last) and
    the outcome's columns, binding those other than NULL; and those values."""
    present = tuple([v is not None for v in outcome])
    sql = _FINISHES.get((sets, present))
    if sql is None:
        columns = ", ".join(
            f"{c} = ?" if here else f"{c} = NULL"
            for c, here in zip(_OUTCOME_COLUMNS, present, strict=True)
        )
        sql = _FINISHES[(sets, present)] = f"UPDATE retrysafe_records SET {columns}, {sets}" + _CAS
    return sql, tuple([v for v in outcome if v is not None])


# Take over a claimable record: the predicate of _decide.claimable, re-checked
# atomically on the current row; attempts and created_at carry over from a live one.
# Parameters: ?1..?22 the new record in COLUMNS order (?1 key_hash, ?5 fingerprint,
# ?11 updated_at, the claim's now).
_NUMBERED = ", ".join(f"?{i + 1}" for i in range(len(COLUMNS)))
_TAKEOVER = (
    f"UPDATE retrysafe_records SET ({_COLS}) = ({_NUMBERED}), "
    "attempts = CASE WHEN expires_at > ?11 THEN attempts + 1 ELSE 1 END, "
    "created_at = CASE WHEN expires_at > ?11 THEN created_at ELSE ?11 END "
    f"WHERE {_KEY} AND (expires_at <= ?11 OR (fingerprint = ?5 AND "
    f"((status = {FAILED} AND final = 0) OR (status = {PROCESSING} AND lease_until <= ?11)))) "
    "RETURNING attempts"
)
# completed_at NULL: the completion's updated_at (see _sqlite_rows).
_COMPLETE = f"status = {COMPLETED}, completed_at = NULL, updated_at = ?"
_FAIL = f"status = {FAILED}, final = ?, updated_at = ?"
_SETTLE_UNTIL = {s: s + ", expires_at = ?" for s in (_COMPLETE, _FAIL)}


def _settle(sets: str, now: float, expires_at: float | None) -> tuple[str, tuple[float, ...]]:
    """A completion's or failure's SET clause and its times: with ``expires_at``, the
    record's expiry moves too (a call that keeps its answer ``ttl`` from now)."""
    if expires_at is None:
        return sets, (now,)
    return _SETTLE_UNTIL[sets], (now, expires_at)


# A renewal past the record's expiry pushes the expiry to the new lease's end: a
# live attempt never expires under its owner (the claim would be free to take).
_RENEW = (
    "UPDATE retrysafe_records SET lease_until = ?, updated_at = ?, "
    "expires_at = max(expires_at, ?)" + _CAS
)
_DELETE = f"DELETE FROM retrysafe_records WHERE {_KEY}"

# -- operations work (sweeper, CLI) ---------------------------------------------------
#
# No index beyond the key's and the expiry's: listing by status or created_at and the stats scan
# the table, which an operator's occasional command can afford, while an index
# on (status, created_at) would be rewritten by every claim and every completion.

_ARCHIVE_COLS = ", ".join(ARCHIVE_COLUMNS)
#: The oldest expired records of one sweep batch (?1 now, ?2 limit), through the
#: expires_at index. Evaluated twice in one write transaction, so twice the same set.
_DOOMED = "SELECT rowid FROM retrysafe_records WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2"
_SWEEP_ARCHIVE = (
    f"INSERT INTO retrysafe_archive ({_ARCHIVE_COLS}) SELECT {_COLS}, ?1 FROM retrysafe_records "
    f"WHERE rowid IN ({_DOOMED}) AND expires_at <= ?1 AND retention = {FINANCIAL_CODE} "
    "ON CONFLICT DO NOTHING"
)
# A financial row goes only once its copy is in the archive: the two statements pick
# their rows by the same subquery, and this guard keeps that from being what
# stands between a financial record and its loss.
_SWEEP_DELETE = (
    f"DELETE FROM retrysafe_records WHERE rowid IN ({_DOOMED}) AND expires_at <= ?1 "
    f"AND (retention IS NOT {FINANCIAL_CODE} OR EXISTS (SELECT 1 FROM retrysafe_archive AS a "
    "WHERE a.key_hash = retrysafe_records.key_hash AND a.token = retrysafe_records.token))"
)
_ARCHIVE_INSERT = (
    f"INSERT INTO retrysafe_archive ({_ARCHIVE_COLS}) "
    f"VALUES ({', '.join('?' * len(ARCHIVE_COLUMNS))}) ON CONFLICT DO NOTHING"
)
# One scan counts the live records and finds the oldest processing one: with a
# single min(), SQLite takes the bare key_hash from the row holding the minimum.
_STATS_COUNTS = (
    "SELECT operation, status, count(*), min(created_at), key_hash FROM retrysafe_records "
    "WHERE expires_at > ? GROUP BY operation, status"
)
_STATS_EXPIRED = "SELECT count(*) FROM retrysafe_records WHERE expires_at <= ?"
_STATS_ARCHIVED = "SELECT count(*) FROM retrysafe_archive"

# -- versioned cells (retrysafe.guards, see retrysafe._core.cells) ---------------------------
#
# A table of their own, created on first use: not part of the records schema or its
# migrations (PRAGMA user_version counts those only). Each write is one statement that
# applies retrysafe._core.cells.writable to the current row.

_CELLS = (
    "CREATE TABLE IF NOT EXISTS retrysafe_state (key TEXT PRIMARY KEY, "
    "version INTEGER NOT NULL, value TEXT NOT NULL, expires_at REAL) WITHOUT ROWID"
)
_CELL_READ = "SELECT version, value, expires_at FROM retrysafe_state WHERE key = ?"
# The sweep's: expired cells, a bounded number at a time, by an index only it needs.
_CELLS_EXIST = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'retrysafe_state'"
_CELLS_INDEX = (
    "CREATE INDEX IF NOT EXISTS retrysafe_state_expires_at ON retrysafe_state (expires_at)"
)
_CELLS_SWEEP = (
    "DELETE FROM retrysafe_state WHERE key IN "
    "(SELECT key FROM retrysafe_state WHERE expires_at <= ? LIMIT ?)"
)
# expected None: insert version 1, or replace an expired cell (NULL never expires).
_CELL_CREATE = (
    "INSERT INTO retrysafe_state (key, version, value, expires_at) VALUES (?1, 1, ?2, ?3) "
    "ON CONFLICT (key) DO UPDATE SET version = 1, value = ?2, expires_at = ?3 "
    "WHERE expires_at <= ?4"
)
_CELL_UPDATE = (
    "UPDATE retrysafe_state SET version = version + 1, value = ?2, expires_at = ?3 "
    "WHERE key = ?1 AND version = ?5 AND (expires_at IS NULL OR expires_at > ?4)"
)

#: How a writer waits for the lock: sleeps doubling from the first to the longest.
_FIRST_WAIT = 0.0001
_LONGEST_WAIT = 0.001


def _begin(conn: sqlite3.Connection) -> None:
    conn.execute("BEGIN IMMEDIATE")


def _busy(exc: sqlite3.OperationalError) -> bool:
    """True for SQLITE_BUSY (another connection holds the lock), whatever the extended code."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF == sqlite3.SQLITE_BUSY
    return "database is locked" in str(exc)  # pragma: no cover - Python < 3.11


def _path_from_url(url: str) -> tuple[str, dict[str, str]]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "sqlite":
        raise ValueError(f"not a sqlite:// URL: {url!r}")
    path = parts.netloc + parts.path
    # sqlite:///rel.db → "rel.db"; sqlite:////abs/x.db → "/abs/x.db"
    path = path[1:] if path.startswith("/") else path
    if not path or path == ":memory:":
        raise ValueError("sqlite:// needs a file path (use memory:// for an in-process store)")
    return path, dict(urllib.parse.parse_qsl(parts.query))


def _create_private(path: str) -> None:
    """Create the database file with mode 0600 (owner only) unless it exists.

    SQLite would create it 0644 under the usual umask; it creates the ``-wal``
    and ``-shm`` files with the database file's mode, so they are 0600 too. An
    existing file keeps its mode.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    except OSError:
        return  # no directory, no permission, ...: sqlite3.connect reports it
    os.close(fd)


def _forget_connections(ref: weakref.ref[SQLiteStore]) -> None:
    store = ref()
    if store is not None:  # the parent's connections are the parent's: forget, never close
        store._local = threading.local()
        store._generation += 1
        store._conns = []
        store._conns_lock = threading.Lock()


class SQLiteStore(Store[_Op]):
    """Records in one SQLite file, shared by every thread and process on the host.

    WAL mode, one connection per thread (reopened in a forked child); every write
    is one atomic statement. Replays and in-flight answers are plain reads that
    take no lock.
    ``?synchronous=normal`` in the URL trades durability of the last commits on
    power loss for speed (default ``full``); ``?timeout=SECONDS`` is how long a
    writer waits for the lock (default 10); ``?sweep_gap=SECONDS`` sets
    :attr:`sweep_gap` (0: sweep at full speed, with no claims to make room for).
    """

    drive_inline = True  # its async calls are a thread hop (asyncio.to_thread)
    settle_expiry = True

    def __init__(self, url: str, *, timeout: float | None = None, synchronous: str | None = None):
        path, options = _path_from_url(url)
        self.url = url
        self.path = path
        self.timeout = float(timeout if timeout is not None else options.get("timeout", 10))
        sync = (synchronous or options.get("synchronous", "full")).upper()
        if sync not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
            raise ValueError(f"synchronous must be off, normal, full or extra, not {sync!r}")
        self.synchronous = sync
        if "sweep_gap" in options:
            gap = float(options["sweep_gap"])
            if not gap >= 0:
                raise ValueError(f"sweep_gap must be >= 0 seconds, not {gap!r}")
            self.sweep_gap = gap
        self._local = threading.local()
        self._generation = 0  # bumped by close(): threads reopen their connection
        self._conns: list[sqlite3.Connection] = []  # every thread's, for close()
        self._conns_lock = threading.Lock()
        self._migrated = False
        # A file at an older version is upgraded by migrate() only, not on first use:
        # the upgrade rewrites the tables under any older process still using them.
        self._rewrite_allowed = False
        self._cells_ready = False  # the table of retrysafe.guards' cells exists
        # A connection must not cross a fork (gunicorn --preload, multiprocessing):
        # the child opens its own. The hook holds the store only weakly.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_connections(ref))

    # -- connections ---------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        _create_private(self.path)
        # timeout=0: a busy lock raises at once and _run waits itself, in finer steps
        # than SQLite's busy handler (1, 2, 5, 10 … 100 ms), which would let a waiting
        # claim sleep through the short gaps a sweep leaves between transactions.
        conn = sqlite3.connect(self.path, timeout=0, isolation_level=None, check_same_thread=False)
        try:
            self._set_wal(conn)
            conn.execute(f"PRAGMA synchronous={self.synchronous}")
            if not self._migrated:
                self._migrate(conn)
        except BaseException:
            conn.close()
            raise
        with self._conns_lock:
            self._conns.append(conn)
        return conn

    def _set_wal(self, conn: sqlite3.Connection) -> None:
        # WAL is kept in the file: only a new file is switched, and only once.
        # Switching needs a moment alone with the file, and processes that open a
        # new one together race for it: SQLite reports "locked" at once instead of
        # waiting, or a disk I/O error from the wal-index being set up under it
        # (seen once with 6 processes on a fresh file). Retry within the timeout
        # until the file says WAL; a lasting error is raised at the deadline.
        deadline = time.monotonic() + self.timeout
        delay = 0.001
        while True:
            try:
                if conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
                    return
                if conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal":
                    return
            except sqlite3.OperationalError as exc:
                transient = "locked" in str(exc) or "disk I/O" in str(exc)
                if not transient or time.monotonic() > deadline:
                    raise
            else:
                if time.monotonic() > deadline:
                    raise sqlite3.OperationalError(
                        f"{self.path} could not be switched to WAL (another process holds it)"
                    )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _conn(self) -> sqlite3.Connection:
        local = self._local
        if getattr(local, "generation", None) != self._generation:
            local.conn = self._connect()
            local.generation = self._generation
        return local.conn

    def _migrate(self, conn: sqlite3.Connection) -> None:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"SQLite store {self.path}: schema version {version} is newer than this "
                f"retrysafe supports ({SCHEMA_VERSION}); upgrade retrysafe"
            )
        if version < SCHEMA_VERSION:
            conn.execute("BEGIN IMMEDIATE")
            try:
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                if 0 < version < SCHEMA_VERSION and not self._rewrite_allowed:
                    raise SchemaVersionError(
                        f"SQLite store {self.path}: the file is at schema version {version}; "
                        f"version {SCHEMA_VERSION} rewrites its tables, which a process of "
                        "the older retrysafe still using the file cannot survive, so it is "
                        "not done on first use: stop those processes, run `retrysafe migrate "
                        "--store URL`, then start this version (docs/stores.md, 'Upgrading "
                        "a SQLite file')"
                    )
                for target in range(version + 1, SCHEMA_VERSION + 1):
                    migration = MIGRATIONS[target]
                    if callable(migration):
                        migration(conn, version)
                    else:
                        for statement in migration.split(";"):
                            if statement.strip():
                                conn.execute(statement)
                    conn.execute(f"PRAGMA user_version={target}")
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        self._migrated = True

    def migrate(self) -> int:
        """Create or upgrade the schema; return its version.

        Only this upgrades a file of an older version (stop the processes of the
        older retrysafe first); opening one otherwise raises :class:`SchemaVersionError`.
        """
        self._rewrite_allowed = True
        self._run(lambda conn: None)
        return SCHEMA_VERSION

    def close(self) -> None:
        """Close every thread's connection (call it when no operation is running).

        Async operations run on worker threads, so this closes theirs too; any
        thread reopens a connection on its next use.
        """
        with self._conns_lock:
            self._generation += 1
            conns, self._conns = self._conns, []
        self._local.__dict__.pop("conn", None)
        for conn in conns:
            conn.close()

    # -- executors -----------------------------------------------------------

    def _on_connection(self, op: _Op) -> Any:
        """Run ``op`` on a connection of the store's (this thread's); a store that borrows
        its connections (the SQLAlchemy and Django stores) takes one here."""
        return op(self._conn())

    def _run(self, op: _Op) -> Any:
        try:
            return self._on_connection(op)
        except sqlite3.OperationalError as exc:
            if _busy(exc):
                return self._run_when_free(op)
            raise StoreUnavailableError(f"SQLite store {self.path}: {exc}") from exc
        except sqlite3.DatabaseError as exc:  # corrupt file, not a database, …
            raise StoreUnavailableError(
                f"SQLite store {self.path}: {exc}", transient=False
            ) from exc

    def _run_when_free(self, op: _Op) -> Any:
        """Run ``op`` again until the write lock is free, for at most ``timeout`` seconds.

        An op that found the lock taken wrote nothing (each op is one statement or
        one transaction, rolled back on error), so running it again is safe.
        """
        deadline = time.monotonic() + self.timeout
        delay = _FIRST_WAIT
        while True:
            time.sleep(delay)
            delay = min(delay * 2, _LONGEST_WAIT)
            try:
                return self._on_connection(op)
            except sqlite3.OperationalError as exc:
                if not _busy(exc) or time.monotonic() >= deadline:
                    raise StoreUnavailableError(f"SQLite store {self.path}: {exc}") from exc
            except sqlite3.DatabaseError as exc:
                raise StoreUnavailableError(
                    f"SQLite store {self.path}: {exc}", transient=False
                ) from exc

    async def _arun(self, op: _Op) -> Any:
        return await asyncio.to_thread(self._run, op)

    # -- operations ------------------------------------------------------------

    def _claim(self, record: Record) -> _Op:
        # A plain read answers replays and in-flight keys without a lock; an
        # absent key is inserted, a claimable one taken over, each by one
        # atomic statement that re-checks the rule. Losing a race reads again.
        def op(conn: sqlite3.Connection) -> ClaimResult:
            params = row_params(record)
            key = params[:1]
            insert = _insert(params)
            for _ in range(_MAX_CLAIM_STATEMENTS):
                row = conn.execute(_SELECT, key).fetchone()
                if row is None:
                    if conn.execute(*insert).rowcount == 1:
                        return ClaimResult(True)
                    continue
                cur = row_record(row)
                if not claimable(cur, record.fingerprint, record.updated_at):
                    return ClaimResult(False, record=cur)
                taken = conn.execute(_TAKEOVER, params).fetchone()
                if taken is not None:
                    live = cur.expires_at > record.updated_at
                    return ClaimResult(
                        True, attempts=taken[0], took_over=cur.status if live else None
                    )
            # Unreachable while one connection writes at a time; as PostgreSQL says it.
            raise StoreUnavailableError(
                f"SQLite store {self.path}: a claim ran {_MAX_CLAIM_STATEMENTS} statements "
                "without settling (concurrent writers kept changing the key)",
                retry_after=1.0,
            )

        return op

    @staticmethod
    def _write(sql: str, params: tuple[Any, ...]) -> _Op:
        return lambda conn: conn.execute(sql, params).rowcount == 1

    def _complete(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome,
        now: float,
        expires_at: float | None = None,
    ) -> _Op:
        sets, times = _settle(_COMPLETE, now, expires_at)
        sql, values = _finish(sets, outcome_params(outcome))
        key = pack_hex(key_hash)
        return self._write(sql, (*values, *times, key, key, pack_token(token)))

    def _fail(
        self,
        key_hash: str,
        token: str,
        outcome: Outcome | None,
        final: bool,
        now: float,
        expires_at: float | None = None,
    ) -> _Op:
        sets, times = _settle(_FAIL, now, expires_at)
        sql, values = _finish(sets, outcome_params(outcome))
        key = pack_hex(key_hash)
        return self._write(sql, (*values, 1 if final else 0, *times, key, key, pack_token(token)))

    def _renew(self, key_hash: str, token: str, lease_until: float, now: float) -> _Op:
        key = pack_hex(key_hash)
        params = (lease_until, now, lease_until, key, key, pack_token(token))
        return self._write(_RENEW, params)

    def _get(self, key_hash: str) -> _Op:
        key = (pack_hex(key_hash),)

        def op(conn: sqlite3.Connection) -> Record | None:
            row = conn.execute(_SELECT, key).fetchone()
            return None if row is None else row_record(row)

        return op

    def _delete(self, key_hash: str) -> _Op:
        return self._write(_DELETE, (pack_hex(key_hash),))

    def _cells_table(self, conn: sqlite3.Connection) -> None:
        """Create the cells' table once per store object (it stays in the file)."""
        if not self._cells_ready:
            conn.execute(_CELLS)
            self._cells_ready = True

    def sweep_cells(self, now: float, limit: int = 1000) -> int:
        def op(conn: sqlite3.Connection) -> int:
            if conn.execute(_CELLS_EXIST).fetchone() is None:
                return 0
            conn.execute(_CELLS_INDEX)
            return conn.execute(_CELLS_SWEEP, (now, limit)).rowcount

        return int(self._run(op))

    def _cell_read(self, key: str) -> _Op:
        def op(conn: sqlite3.Connection) -> Any:
            self._cells_table(conn)
            return conn.execute(_CELL_READ, (key,)).fetchone()

        return op

    def _cell_write(
        self, key: str, expected: int | None, text: str, expires_at: float | None, now: float
    ) -> _Op:
        query = _CELL_CREATE if expected is None else _CELL_UPDATE
        params = (
            (key, text, expires_at, now)
            if expected is None
            else (key, text, expires_at, now, expected)
        )

        def op(conn: sqlite3.Connection) -> bool:
            self._cells_table(conn)
            return conn.execute(query, params).rowcount == 1

        return op

    # -- operations work (sweeper, CLI) ----------------------------------------------

    @staticmethod
    @contextmanager
    def _transaction(conn: sqlite3.Connection, mode: str = "IMMEDIATE") -> Iterator[None]:
        """``BEGIN <mode>`` … ``COMMIT``, rolled back on any error."""
        conn.execute(f"BEGIN {mode}")
        try:
            yield
            conn.execute("COMMIT")  # inside: a failed commit must not leave the lock held
        except BaseException:
            if conn.in_transaction:  # some errors (a full disk) end it already
                conn.execute("ROLLBACK")
            raise

    # -- transactional completion (see retrysafe._core.transactions) -----------------

    @contextmanager
    def completion_transaction(
        self, connection: sqlite3.Connection | None = None
    ) -> Iterator[Transaction[_Op]]:
        """``BEGIN IMMEDIATE`` … ``COMMIT`` on ``connection`` or this thread's store connection.

        By default the transaction runs on the connection the store itself uses in
        this thread, so store calls made inside the block (a guard, another claim)
        join the transaction instead of waiting for its write lock. ``BEGIN
        IMMEDIATE`` takes the lock up front, waiting for it as the store's own
        writes do (up to its ``timeout``, then :class:`StoreUnavailableError`).
        """
        if connection is None:
            conn = self._conn()
            if conn.in_transaction:
                raise ValueError("a transaction of this store is already open in this thread")
            self._run(_begin)
        else:
            conn = connection
            self._same_file(conn)
            if conn.in_transaction:
                raise ValueError("the connection is inside a transaction already; commit it first")
            try:
                _begin(conn)
            except sqlite3.OperationalError as exc:  # the lock stayed taken for its timeout
                raise StoreUnavailableError(f"SQLite store {self.path}: {exc}") from exc
        try:
            yield Transaction(conn, lambda op: op(conn))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # some errors (a full disk) end it already
                conn.execute("ROLLBACK")
            raise

    def acompletion_transaction(
        self, connection: Any = None
    ) -> AbstractAsyncContextManager[AsyncTransaction[_Op]]:
        raise TypeError(
            "atransaction() needs a PostgreSQL store, or a SQLAlchemy store on an "
            "AsyncEngine; with this SQLite store, run the sync transaction() in a thread "
            "(asyncio.to_thread)"
        )

    def _same_file(self, conn: sqlite3.Connection) -> None:
        row = conn.execute("PRAGMA database_list").fetchone()
        path = row[2] if row else ""
        if not path or os.path.realpath(path) != os.path.realpath(self.path):
            raise ValueError(
                f"the connection is to {path or 'an in-memory database'!r}, "
                f"not to the store's file {self.path!r}"
            )

    #: Seconds of statement work one sweep transaction aims at; the rows it moves
    #: adapt to their measured cost. With its commit it holds the write lock for
    #: about twice that, under the 1 ms after which a waiting claim first retries.
    sweep_hold = 0.0005
    #: Seconds a sweep leaves the lock free after each transaction, at least, and at
    #: least as long as the transaction held it (see :meth:`sweep`); 0 for none (a
    #: sweep with no claims to make room for).
    sweep_gap = 0.002
    #: Rows moved between two checkpoints of the sweep (see :meth:`_sweep_some`).
    sweep_checkpoint_rows = 200
    _sweep_rows = 32  # the next transaction's rows; adapted per store

    def sweep(self, now: float, limit: int = 1000) -> SweepBatch:
        """Move up to ``limit`` expired records, oldest first, in short transactions.

        Each transaction takes the write lock first (``BEGIN IMMEDIATE``), copies
        the financial ones of its oldest expired records to the archive and deletes
        them all; a process killed in between leaves a transaction that SQLite rolls
        back, never a deleted record that was not archived.

        SQLite has one write lock and no queue: a claim that finds it taken sleeps
        and retries after 1, 2, 5, 10 … ms, and a writer that takes the lock again
        at once starves it. So each transaction moves as many rows as take about
        :attr:`sweep_hold` seconds, and then the lock stays free for
        :attr:`sweep_gap` seconds or as long as it was held, if longer: a waiting
        claim retries into the gap. A batch of 1000 thus holds the lock for about
        a millisecond at a time, whatever the size of the table.
        """
        deleted = archived = unchecked = 0
        while deleted < limit:
            rows = min(limit - deleted, self._sweep_rows)
            moved, copied, working, held = self._run(partial(self._sweep_some, now, rows))
            deleted += moved
            archived += copied
            unchecked += moved
            if unchecked >= self.sweep_checkpoint_rows or moved < rows:
                self._run(self._checkpoint)
                unchecked = 0
            if moved < rows:
                break
            fits = int(self.sweep_hold * moved / working) if working > 0 else 10_000
            self._sweep_rows = max(8, min(10_000, fits))
            if self.sweep_gap > 0:
                time.sleep(max(self.sweep_gap, held))
        return SweepBatch(deleted, archived, done=deleted < limit)

    def _sweep_some(
        self, now: float, rows: int, conn: sqlite3.Connection
    ) -> tuple[int, int, float, float]:
        """One transaction: (deleted, archived, seconds of statements, seconds locked).

        It commits with ``synchronous=NORMAL`` even when the store is ``FULL``: the
        commit then holds the write lock without waiting for an fsync. Atomicity is
        kept (the archive copy and the delete commit together or not at all); a
        power loss can only undo the last sweep transactions, whose records come
        back expired and are swept again.
        """
        params = (now, rows)
        relaxed = self.synchronous in ("FULL", "EXTRA")
        if relaxed:
            conn.execute("PRAGMA synchronous=NORMAL")
        try:
            with self._transaction(conn):
                locked = time.perf_counter()
                archived = conn.execute(_SWEEP_ARCHIVE, params).rowcount
                deleted = conn.execute(_SWEEP_DELETE, params).rowcount
                working = time.perf_counter() - locked
        finally:
            if relaxed:
                conn.execute(f"PRAGMA synchronous={self.synchronous}")
        return deleted, archived, working, time.perf_counter() - locked

    @staticmethod
    def _checkpoint(conn: sqlite3.Connection) -> None:
        """A passive checkpoint: copies the WAL into the database, takes no write lock.

        The sweep writes most of the WAL; without it, a claim's commit would cross
        the autocheckpoint threshold (1000 pages) and copy the sweep's pages itself.
        """
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()

    def _list_records(self, query: RecordQuery) -> list[Record]:
        clause, params = list_clause(query, mark="?", status=status_code, key=pack_key)
        text = f"SELECT {_COLS} FROM retrysafe_records{clause}"
        rows = self._run(lambda conn: conn.execute(text, params).fetchall())
        return [row_record(row) for row in rows]

    def stats(self, now: float) -> StoreStats:
        # One read transaction: every count comes from the same snapshot (WAL
        # readers never block writers).
        def op(conn: sqlite3.Connection) -> StoreStats:
            stats = StoreStats()
            oldest: tuple[float, str] | None = None
            with self._transaction(conn, "DEFERRED"):
                for operation, status, n, created_at, key_hash in conn.execute(
                    _STATS_COUNTS, (now,)
                ):
                    stats.counts[(operation, status_value(status))] = n
                    if status == PROCESSING and (oldest is None or created_at < oldest[0]):
                        oldest = (created_at, key_hash)
                stats.expired = conn.execute(_STATS_EXPIRED, (now,)).fetchone()[0]
                if oldest is not None:
                    row = conn.execute(_SELECT, (oldest[1],)).fetchone()
                    stats.oldest_processing = None if row is None else row_record(row)
                stats.archived = conn.execute(_STATS_ARCHIVED).fetchone()[0]
            return stats

        return self._run(op)

    def archive_records(self, records: Sequence[Record], archived_at: float) -> int:
        rows = [(*row_params(r), archived_at) for r in records]

        def op(conn: sqlite3.Connection) -> int:
            with self._transaction(conn):
                return conn.executemany(_ARCHIVE_INSERT, rows).rowcount

        return self._run(op) if rows else 0

    def archived_records(
        self, *, operation: str | None = None, limit: int = 100
    ) -> list[ArchivedRecord]:
        query = f"SELECT {_ARCHIVE_COLS} FROM retrysafe_archive"
        params: list[Any] = []
        if operation is not None:
            query += " WHERE operation = ?"
            params.append(operation)
        query += " ORDER BY archived_at DESC LIMIT ?"
        params.append(limit)
        rows = self._run(lambda conn: conn.execute(query, params).fetchall())
        return [
            ArchivedRecord(record=row_record(row), archived_at=row[len(COLUMNS)]) for row in rows
        ]
