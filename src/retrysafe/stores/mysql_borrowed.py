"""What the MySQL store needs of a connection it borrows (an ORM's: SQLAlchemy's pool,
Django's thread connection) rather than opens itself.

The store's own connections run in the mode of
:data:`~retrysafe.stores.mysql.connection.SESSION_SETUP`. A borrowed one keeps the
application's session, so nothing is set on it; what the statements rely on is
checked instead:

* a strict ``sql_mode`` (``STRICT_TRANS_TABLES`` or ``STRICT_ALL_TABLES``): too long a
  value is an error, never cut (MySQL 8's and MariaDB 10.2+'s default). Read once per
  connection (one round trip in its lifetime), refused otherwise;
* its server's ``max_allowed_packet``, read in the same statement and noted on the
  connection (:func:`~retrysafe.stores.mysql.connection.note_packet_limit`): a
  statement over it is refused before it is sent (the server would close the
  connection, which looks like an outage);
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

from collections.abc import Callable, Generator, Sequence
from contextlib import suppress
from typing import Any

from retrysafe.errors import StoreUnavailableError
from retrysafe.stores.mysql.connection import Op, note_packet_limit

__all__ = [
    "SESSION_QUERY",
    "accept_session",
    "committed_migration",
    "drive_migration",
    "session_op",
    "session_refusal",
]

#: The one statement that reads what a borrowed connection's session must be checked for.
SESSION_QUERY = "SELECT @@SESSION.sql_mode, @@max_allowed_packet"
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


def session_op() -> Op:
    """The op of :data:`SESSION_QUERY`: its row (``sql_mode``, ``max_allowed_packet``)."""
    return Op(SESSION_QUERY, (), lambda rowcount, row: row)


def accept_session(conn: Any, answer: tuple[int, Any], where: str) -> None:
    """Check the answer of :func:`session_op` on the driver connection ``conn``: raise
    :func:`session_refusal`'s error, else note its ``max_allowed_packet`` on ``conn``
    (which also marks it checked: :func:`~retrysafe.stores.mysql.connection.packet_limit`
    is no longer None)."""
    sql_mode, limit = answer[1]
    if isinstance(sql_mode, bytes):
        sql_mode = sql_mode.decode()
    refusal = session_refusal(str(sql_mode or ""), where)
    if refusal is not None:
        raise refusal
    note_packet_limit(conn, limit)


def drive_migration(
    conn: Any,
    flow: MigrationFlow,
    errors: tuple[type[BaseException], ...],
    unavailable: Callable[[BaseException], StoreUnavailableError],
) -> None:
    """Run the native store's migration ``flow`` (``MySQLStore._migration()``: each
    statement receives the first row of the one before) on a DB-API connection's
    cursor (PyMySQL, mysqlclient, or SQLAlchemy's sync facade of asyncmy). MySQL
    commits each DDL statement by itself.

    The connection is the application's and goes back to its pool: on any error the
    named migration lock (``GET_LOCK``, held by the session, not the transaction) is
    released, else every other store's migration would wait for it until that
    connection closes. A driver error (one of ``errors``) is raised as ``unavailable``
    makes it (the store's :class:`StoreUnavailableError`, not transient when the
    server's error is permanent, such as a missing privilege)."""
    row: Sequence[Any] | None = None
    held: Any = None  # the named lock's name once GET_LOCK ran
    cur = conn.cursor()
    try:
        while True:
            try:
                query, params = flow.send(row)
            except StopIteration:
                return
            cur.execute(query, params)
            row = cur.fetchone() if cur.description is not None else None
            if "GET_LOCK(" in query:
                held = params[0]
            elif "RELEASE_LOCK(" in query:
                held = None
    except BaseException as exc:
        if held is not None:
            with suppress(Exception):
                cur.execute("SELECT RELEASE_LOCK(%s)", (held,))
                cur.fetchall()
        if isinstance(exc, errors):
            raise unavailable(exc) from exc
        raise
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
