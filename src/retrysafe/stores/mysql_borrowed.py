"""What the MySQL store needs of a connection it borrows (an ORM's: SQLAlchemy's pool,
Django's thread connection) rather than opens itself.

The store's own connections run in the mode of
:data:`~retrysafe.stores.mysql.connection.SESSION_SETUP`. A borrowed one keeps the
application's session, so nothing is set on it; what the statements rely on is
checked instead:

* a strict ``sql_mode`` (``STRICT_TRANS_TABLES`` or ``STRICT_ALL_TABLES``): too long a
  value is an error, never cut (MySQL 8's and MariaDB 10.2+'s default). Read once per
  connection (one round trip in its lifetime), refused otherwise;
* no ``NO_BACKSLASH_ESCAPES``: the drivers escape with backslashes;
* bytes: PyMySQL sends them as ``X'…'`` and asyncmy as ``_binary'…'``, whatever the
  connection's ``binary_prefix`` and character set; mysqlclient (Django's) sends a
  quoted string unless its ``binary_prefix`` is set, which the store sets while it
  runs a statement (a client-side flag: nothing is sent; the bytes arrive intact
  either way, the prefix spares MySQL 8's invalid-string warning);
* the time zone: every time is a ``DOUBLE`` of Unix seconds the store binds, so the
  session's ``time_zone`` changes nothing.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

from retrysafe.errors import StoreUnavailableError

__all__ = ["SQL_MODE_QUERY", "committed_migration", "drive_migration", "session_refusal"]

#: The one statement that reads a borrowed connection's mode.
SQL_MODE_QUERY = "SELECT @@SESSION.sql_mode"
_STRICT = frozenset({"STRICT_TRANS_TABLES", "STRICT_ALL_TABLES"})

MigrationFlow = Generator[tuple[str, Sequence[Any]], Sequence[Any] | None, None]


def session_refusal(sql_mode: str | Sequence[str], where: str) -> StoreUnavailableError | None:
    """The error for a borrowed connection whose ``sql_mode`` the store's statements
    cannot run in, or None. Not transient: the application's configuration."""
    modes = (
        {m.strip().upper() for m in sql_mode.split(",")}
        if isinstance(sql_mode, str)
        else {m.upper() for m in sql_mode}
    )
    if not modes & _STRICT:
        why = "is not strict: a value too long for its column would be cut, not refused"
    elif "NO_BACKSLASH_ESCAPES" in modes:
        why = "has NO_BACKSLASH_ESCAPES: the drivers escape parameters with backslashes"
    else:
        return None
    return StoreUnavailableError(
        f"{where}: the connection's sql_mode ({','.join(sorted(modes)) or 'empty'}) {why}; "
        "set a strict sql_mode (e.g. STRICT_TRANS_TABLES, the server default) for the "
        "application's connections (init_command, or the server's sql_mode)",
        transient=False,
    )


def drive_migration(conn: Any, flow: MigrationFlow) -> None:
    """Run the native store's migration ``flow`` (``MySQLStore._migration()``: each
    statement receives the first row of the one before) on a DB-API connection's
    cursor (PyMySQL, mysqlclient, or SQLAlchemy's sync facade of asyncmy). MySQL
    commits each DDL statement by itself."""
    row: Sequence[Any] | None = None
    cur = conn.cursor()
    try:
        while True:
            try:
                query, params = flow.send(row)
            except StopIteration:
                return
            cur.execute(query, params)
            row = cur.fetchone() if cur.description is not None else None
    finally:
        cur.close()


def committed_migration(flow: MigrationFlow) -> MigrationFlow:
    """The native migration ``flow`` for a connection that is not in autocommit mode:
    a ``COMMIT`` before it takes and before it releases the named lock, so that what it
    read under the lock is current (no older snapshot) and what it wrote is committed
    before another process may take the lock; and one at its end, so that the op that
    follows on the connection reads from a snapshot of its own."""
    row: Sequence[Any] | None = None
    while True:
        try:
            query, params = flow.send(row)
        except StopIteration:
            yield "COMMIT", ()
            return
        if "_LOCK(" in query:
            yield "COMMIT", ()
        row = yield query, params
