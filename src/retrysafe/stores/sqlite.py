"""``sqlite:///path``: the embedded default store (WAL, safe across processes on one host)."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable
from typing import Any

from .._decide import claimable
from .._errors import StoreUnavailableError
from .._record import ClaimResult, Outcome, Record
from ._base import Store
from ._sql import COLUMNS, outcome_params, record_from_row, record_params

__all__ = ["SCHEMA_VERSION", "SQLiteStore"]

SCHEMA_VERSION = 1
_Op = Callable[[sqlite3.Connection], Any]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS retrysafe_records (
    key_hash TEXT PRIMARY KEY,
    key TEXT NOT NULL,
    scope TEXT NOT NULL,
    operation TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    status TEXT NOT NULL,
    token TEXT NOT NULL,
    lease_until REAL NOT NULL,
    expires_at REAL NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    completed_at REAL,
    attempts INTEGER NOT NULL,
    request_id TEXT,
    final INTEGER NOT NULL DEFAULT 0,
    response_status INTEGER,
    response_headers TEXT,
    response_media_type TEXT,
    response_body BLOB,
    request_payload BLOB,
    metadata TEXT NOT NULL DEFAULT '{}'
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS retrysafe_records_expires_at ON retrysafe_records (expires_at);
"""
#: Migrations by the version they lead to; v1 is the initial schema.
MIGRATIONS: dict[int, str] = {1: _SCHEMA}

_COLS = ", ".join(COLUMNS)
_SELECT = f"SELECT {_COLS} FROM retrysafe_records WHERE key_hash = ?"
#: Reads and writes one claim may take before it gives up (each retry means a
#: concurrent writer changed the key in between).
_MAX_CLAIM_STATEMENTS = 100
_MARKS = ", ".join("?" * len(COLUMNS))
_INSERT = f"INSERT INTO retrysafe_records ({_COLS}) VALUES ({_MARKS}) ON CONFLICT DO NOTHING"
# Take over a claimable record: the predicate of _decide.claimable, re-checked
# atomically on the current row; attempts and created_at carry over from a live one.
# Parameters: ?1..?21 the new record in COLUMNS order (?1 key_hash, ?5 fingerprint,
# ?11 updated_at, the claim's now).
_NUMBERED = ", ".join(f"?{i + 1}" for i in range(len(COLUMNS)))
_TAKEOVER = (
    f"UPDATE retrysafe_records SET ({_COLS}) = ({_NUMBERED}), "
    "attempts = CASE WHEN expires_at > ?11 THEN attempts + 1 ELSE 1 END, "
    "created_at = CASE WHEN expires_at > ?11 THEN created_at ELSE ?11 END "
    "WHERE key_hash = ?1 AND (expires_at <= ?11 OR (fingerprint = ?5 AND "
    "((status = 'failed' AND final = 0) OR (status = 'processing' AND lease_until <= ?11)))) "
    "RETURNING attempts"
)
_CAS = " WHERE key_hash = ? AND token = ? AND status = 'processing'"
_COMPLETE = (
    "UPDATE retrysafe_records SET status = 'completed', response_status = ?, "
    "response_headers = ?, response_media_type = ?, response_body = ?, "
    "completed_at = ?, updated_at = ?" + _CAS
)
_FAIL = (
    "UPDATE retrysafe_records SET status = 'failed', response_status = ?, "
    "response_headers = ?, response_media_type = ?, response_body = ?, "
    "final = ?, updated_at = ?" + _CAS
)
_RENEW = "UPDATE retrysafe_records SET lease_until = ?, updated_at = ?" + _CAS
_DELETE = "DELETE FROM retrysafe_records WHERE key_hash = ?"


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
    writer waits for the lock (default 10).
    """

    def __init__(self, url: str, *, timeout: float | None = None, synchronous: str | None = None):
        path, options = _path_from_url(url)
        self.url = url
        self.path = path
        self.timeout = float(timeout if timeout is not None else options.get("timeout", 10))
        sync = (synchronous or options.get("synchronous", "full")).upper()
        if sync not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
            raise ValueError(f"synchronous must be off, normal, full or extra, not {sync!r}")
        self.synchronous = sync
        self._local = threading.local()
        self._generation = 0  # bumped by close(): threads reopen their connection
        self._conns: list[sqlite3.Connection] = []  # every thread's, for close()
        self._conns_lock = threading.Lock()
        self._migrated = False
        # A connection must not cross a fork (gunicorn --preload, multiprocessing):
        # the child opens its own. The hook holds the store only weakly.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_connections(ref))

    # -- connections ---------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False
        )
        self._set_wal(conn)
        conn.execute(f"PRAGMA synchronous={self.synchronous}")
        if not self._migrated:
            self._migrate(conn)
        with self._conns_lock:
            self._conns.append(conn)
        return conn

    def _set_wal(self, conn: sqlite3.Connection) -> None:
        # Switching a new file to WAL needs a moment alone with it, and SQLite
        # reports "locked" at once instead of waiting: retry within the timeout.
        deadline = time.monotonic() + self.timeout
        delay = 0.001
        while True:
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
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
            raise StoreUnavailableError(
                f"SQLite store {self.path}: schema version {version} is newer than this "
                f"retrysafe supports ({SCHEMA_VERSION}); upgrade retrysafe"
            )
        if version < SCHEMA_VERSION:
            conn.execute("BEGIN IMMEDIATE")
            try:
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                for target in range(version + 1, SCHEMA_VERSION + 1):
                    for statement in MIGRATIONS[target].split(";"):
                        if statement.strip():
                            conn.execute(statement)
                    conn.execute(f"PRAGMA user_version={target}")
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        self._migrated = True

    def migrate(self) -> int:
        """Create or upgrade the schema; return its version."""
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

    def _run(self, op: _Op) -> Any:
        try:
            return op(self._conn())
        except sqlite3.OperationalError as exc:
            raise StoreUnavailableError(f"SQLite store {self.path}: {exc}") from exc
        except sqlite3.DatabaseError as exc:  # corrupt file, not a database, …
            raise StoreUnavailableError(f"SQLite store {self.path}: {exc}") from exc

    async def _arun(self, op: _Op) -> Any:
        return await asyncio.to_thread(self._run, op)

    # -- operations ------------------------------------------------------------

    def _claim(self, record: Record) -> _Op:
        # A plain read answers replays and in-flight keys without a lock; an
        # absent key is inserted, a claimable one taken over, each by one
        # atomic statement that re-checks the rule. Losing a race reads again.
        def op(conn: sqlite3.Connection) -> ClaimResult:
            params = record_params(record)
            for _ in range(_MAX_CLAIM_STATEMENTS):
                row = conn.execute(_SELECT, (record.key_hash,)).fetchone()
                if row is None:
                    if conn.execute(_INSERT, params).rowcount == 1:
                        return ClaimResult(True)
                    continue
                cur = record_from_row(row)
                if not claimable(cur, record.fingerprint, record.updated_at):
                    return ClaimResult(False, record=cur)
                taken = conn.execute(_TAKEOVER, params).fetchone()
                if taken is not None:
                    live = cur.expires_at > record.updated_at
                    return ClaimResult(
                        True, attempts=taken[0], took_over=cur.status if live else None
                    )

        return op

    @staticmethod
    def _write(sql: str, params: tuple[Any, ...]) -> _Op:
        return lambda conn: conn.execute(sql, params).rowcount == 1

    def _complete(self, key_hash: str, token: str, outcome: Outcome, now: float) -> _Op:
        return self._write(_COMPLETE, (*outcome_params(outcome), now, now, key_hash, token))

    def _fail(
        self, key_hash: str, token: str, outcome: Outcome | None, final: bool, now: float
    ) -> _Op:
        return self._write(_FAIL, (*outcome_params(outcome), final, now, key_hash, token))

    def _renew(self, key_hash: str, token: str, lease_until: float, now: float) -> _Op:
        return self._write(_RENEW, (lease_until, now, key_hash, token))

    def _get(self, key_hash: str) -> _Op:
        def op(conn: sqlite3.Connection) -> Record | None:
            row = conn.execute(_SELECT, (key_hash,)).fetchone()
            return None if row is None else record_from_row(row)

        return op

    def _delete(self, key_hash: str) -> _Op:
        return self._write(_DELETE, (key_hash,))
