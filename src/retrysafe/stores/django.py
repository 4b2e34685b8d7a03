"""``django://alias``: records in a Django project's own database.

:class:`DjangoStore` is the SQLite, PostgreSQL or MySQL store, whichever the alias's
database is, with every statement, the table, its migration, sweeps, stats and
the archive the native store's: the CLI pointed at the same database
(``sqlite:///same.db``, ``postgresql://…``, ``mysql://…``) reads and writes the same
records.

Two kinds of connection:

* the store's own operations (claims, failures, replays, sweeps) commit on their
  own, on connections the store opens from the alias's settings (never Django's
  ``connections[alias]``, nor a connection of Django's pool): on PostgreSQL and
  MySQL the native store's bounded pool, on SQLite a connection per thread, closed when the
  thread ends;
* the completion of :meth:`Attempt.transaction` runs on the thread's own
  ``django.db.connections[alias]`` (the one the ORM writes through) inside
  ``transaction.atomic(using=alias)``, so it commits with the ORM's writes or
  rolls back with them.

Django's transactions are sync: :meth:`~DjangoStore.acompletion_transaction` is
refused.
"""

from __future__ import annotations

import contextlib
import os
import threading
import urllib.parse
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import Any, ClassVar

from retrysafe._model.record import Status
from retrysafe.stores._base import AsyncTransaction, Transaction
from retrysafe.stores._packing import STATUSES
from retrysafe.stores.sqlite import SCHEMA_VERSION, SQLiteStore

__all__ = [
    "VENDORS",
    "DjangoSQLiteStore",
    "DjangoStore",
    "Links",
    "ViewBlock",
    "alias_of",
    "status_of",
    "vendor_of",
]

#: The Django database vendors a store can live in, and the native store of each.
VENDORS = ("sqlite", "postgresql", "mysql")


def status_of(code: int) -> Status:
    """The status a record row's ``status`` column codes (both SQL stores code it alike)."""
    return STATUSES[code]


def alias_of(url: str) -> tuple[str, str]:
    """The database alias of a ``django://alias`` URL (``django://`` alone: ``default``)
    and its query (the native store's URL options: ``?timeout=5``, ``?table=name``)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() != "django":
        raise ValueError(f"not a django:// URL: {url!r}")
    alias = (parts.netloc + parts.path).strip("/") or "default"
    return alias, parts.query


def vendor_of(alias: str) -> str:
    """The vendor of a database alias (``sqlite``, ``postgresql``, ``mysql``, …);
    ValueError for an alias ``settings.DATABASES`` does not name."""
    from django.db import connections

    if alias not in connections.settings:
        raise ValueError(
            f"django://{alias}: settings.DATABASES has no {alias!r} database "
            f"(it has {', '.join(map(repr, connections.settings)) or 'none'})"
        )
    return str(connections[alias].vendor)


def _unsupported(alias: str, vendor: str) -> ValueError:
    return ValueError(
        f"django://{alias}: the database is {vendor}; the Django store keeps its records in "
        "SQLite, PostgreSQL (with psycopg 3) or MySQL/MariaDB. Use another store "
        "(RETRYSAFE['store'], "
        "e.g. redis://) for this database"
    )


def with_query(url: str, query: str) -> str:
    """``url`` with a URL query (the native store's options), if any."""
    return f"{url}?{query}" if query else url


class _Holder:
    """A thread's connection, closed when the thread ends (its thread-local data goes)."""

    __slots__ = ("__weakref__", "closer", "wrapper")

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        self.closer = weakref.finalize(self, _close, wrapper)


class Links:
    """The Django SQLite store's own connections: one Django connection per thread, in
    autocommit, made from the alias's settings (never ``connections[alias]``, the
    thread's own, which the application's transactions use), closed when its thread
    ends or by :meth:`close`. A forked child makes its own."""

    def __init__(self, alias: str, prepare: Callable[[Any], None]) -> None:
        self.alias = alias
        self.prepare = prepare  # called once on each new DB-API connection
        self.lock = threading.Lock()
        self.closers: list[weakref.finalize[Any, Any]] = []
        self.forget()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget(ref))

    def forget(self) -> None:
        """Drop every thread's connection without closing it (the parent's, after a fork)."""
        for closer in self.closers:
            closer.detach()
        self.local = threading.local()
        self.closers = []

    def open(self) -> int:
        """How many of the store's connections are open (one per live thread that used it)."""
        with self.lock:
            return sum(closer.alive for closer in self.closers)

    def raw(self) -> Any:
        """This thread's DB-API connection, connected (again, if it was closed)."""
        holder = getattr(self.local, "holder", None)
        if holder is not None:
            wrapper = holder.wrapper
            if wrapper.connection is not None and not _closed(wrapper):
                return wrapper.connection
            self.drop()
        from django.db import connections

        wrapper = connections.create_connection(self.alias)
        wrapper.inc_thread_sharing()  # close() may run in another thread
        try:
            wrapper.ensure_connection()
            if not wrapper.get_autocommit():
                wrapper.set_autocommit(True)
            self.prepare(wrapper.connection)
        except BaseException:
            wrapper.close()
            raise
        holder = _Holder(wrapper)
        with self.lock:
            self.closers = [closer for closer in self.closers if closer.alive]
            self.closers.append(holder.closer)
        self.local.holder = holder
        return wrapper.connection

    def drop(self) -> None:
        """Close this thread's connection (a broken one); the next use makes another."""
        holder = self.local.__dict__.pop("holder", None)
        if holder is not None:
            holder.closer()

    def close(self) -> None:
        """Close every thread's connection; each thread makes a new one on its next use."""
        with self.lock:
            closers, self.closers = self.closers, []
        self.local = threading.local()
        for closer in closers:
            closer()


def _forget(ref: weakref.ref[Links]) -> None:
    links = ref()
    if links is not None:
        links.forget()


def _closed(wrapper: Any) -> bool:
    closed = getattr(wrapper.connection, "closed", False)  # psycopg: a property; sqlite3: none
    return bool(closed)


def _close(wrapper: Any) -> None:
    with contextlib.suppress(Exception):  # closed by the server already: nothing to release
        wrapper.close()


class ViewBlock:
    """What the transactional middleware passes to ``att.transaction()``: the alias's
    completion transaction, which it may leave by an exception after :attr:`commit`
    was set, and then commits the block's writes without completing the record (a
    streamed answer, recorded as it streams). Without it, an exception rolls back."""

    __slots__ = ("alias", "commit", "committed")

    def __init__(self, alias: str) -> None:
        self.alias = alias
        #: True: leaving the block by an exception commits its writes all the same.
        self.commit = False
        #: Set by the block's first ``on_commit`` hook: its COMMIT succeeded (a later
        #: hook may still raise out of it).
        self.committed = False

    def _on_commit(self) -> None:
        self.committed = True


class DjangoStore:
    """The store of a Django database alias: ``DjangoStore(using="default")``.

    It is a :class:`~retrysafe.stores.sqlite.SQLiteStore`, a
    :class:`~retrysafe.stores.postgres.PostgresStore` or a
    :class:`~retrysafe.stores.mysql.MySQLStore` (whichever the alias's database is:
    MySQL and MariaDB are Django's ``mysql`` vendor), connected from the alias's
    settings; keyword ``options`` go to that store (``timeout``, ``synchronous``;
    ``table``, ``max_size``, ``auto_migrate``, ``partitioned``, …), and ``query`` is
    that store's URL query (``django://default?table=name`` gives ``table=name``).
    Opening it never connects. Another vendor (Oracle, …) is a ValueError.

    :meth:`completion_transaction` is ``transaction.atomic(using=alias)`` on the
    thread's connection: ``att.transaction()`` commits the record's completion
    with the ORM writes of its block (see docs/django.md).
    """

    alias: str
    #: True: a store of this class keeps its records in the Django database ``alias``.
    django: ClassVar[bool] = True

    def __new__(cls, using: str = "default", *, query: str = "", **options: Any) -> Any:
        if cls is DjangoStore:
            vendor = vendor_of(using)
            if vendor == "sqlite":
                cls = DjangoSQLiteStore
            elif vendor == "postgresql":  # (psycopg is imported only for PostgreSQL)
                from retrysafe.stores.django_postgres import DjangoPostgresStore

                cls = DjangoPostgresStore
            elif vendor == "mysql":  # MySQL and MariaDB (PyMySQL for the store's own)
                from retrysafe.stores.django_mysql import DjangoMySQLStore

                cls = DjangoMySQLStore
            else:
                raise _unsupported(using, vendor)
        return object.__new__(cls)

    # -- the application transaction (see retrysafe._core.transactions) ----------------

    @contextmanager
    def completion_transaction(self, connection: Any = None) -> Iterator[Transaction[Any]]:
        """``transaction.atomic(using=alias)`` on the thread's connection; yields it.

        The block's ORM writes and the completion commit together when the
        outermost ``atomic()`` commits: inside an ``atomic()`` of the
        application's, this is a savepoint of it, and the completion commits
        when that outer block does (or rolls back with it). ``connection``, if
        given, must be that connection, the alias, or a :class:`ViewBlock` of it.
        """
        from django.db import connections, transaction

        alias = self.alias
        wrapper = connections[alias]
        block = connection if isinstance(connection, ViewBlock) else None
        if block is not None:
            connection = block.alias
        if connection is not None and connection is not wrapper and connection != alias:
            raise ValueError(
                f"the Django store of {alias!r} completes on django.db.connections[{alias!r}] "
                f"(the thread's connection), not on {connection!r}"
            )
        outer = wrapper.atomic_blocks
        if block is not None and outer and not outer[-1]._from_testcase:
            # (Django's own check for durable=True, with what to do about it)
            raise RuntimeError(
                f"the idempotency middleware's transaction on {alias!r} must be the outermost: "
                "a request already inside transaction.atomic() would settle its attempt when "
                "a savepoint is released, before anything commits; put the middleware before "
                "any middleware that opens atomic(), or set RETRYSAFE['transactional'] = False"
            )
        escaped: BaseException | None = None
        with transaction.atomic(using=alias, durable=block is not None):
            raw = wrapper.connection  # connected by atomic()
            if block is not None:  # the first hook: run by Django just after the COMMIT
                transaction.on_commit(block._on_commit, using=alias)
            try:
                yield Transaction(wrapper, lambda op: self._unbroken(wrapper, raw, op))
            except BaseException as exc:
                if block is None or not block.commit:
                    raise
                escaped = exc  # (leaving atomic() without it commits the block's writes)
        if escaped is not None:
            raise escaped

    def acompletion_transaction(
        self, connection: Any = None
    ) -> AbstractAsyncContextManager[AsyncTransaction[Any]]:
        """Refused: Django's transactions are sync."""
        raise TypeError(
            "Django's transactions are sync: run the sync att.transaction() in "
            "asgiref.sync.sync_to_async (thread_sensitive=True), as the ORM's writes"
        )

    def _unbroken(self, wrapper: Any, raw: Any, op: Any) -> bool:
        """Run a completion op in the block's transaction, unless Django will roll it back
        (``needs_rollback``: ``set_rollback(True)``, or an error caught in an inner
        ``atomic()``): then ``TransactionManagementError``, as for any query there, so the
        attempt is never settled by a completion that cannot commit."""
        wrapper.validate_no_broken_transaction()
        return self._in_transaction(raw, op)

    def _in_transaction(self, raw: Any, op: Any) -> bool:
        """Run a completion op on the thread's DB-API connection, in its transaction."""
        raise NotImplementedError  # (each vendor's class)

    def migrate_on(self, connection: Any) -> int:
        """Create or upgrade the records' schema on a Django connection (``manage.py
        migrate``'s, outside a transaction) with the native store's migration; return
        its version."""
        connection.ensure_connection()
        return self._migrate_raw(connection.connection)

    def _migrate_raw(self, raw: Any) -> int:
        raise NotImplementedError  # (each vendor's class)


# -- SQLite ---------------------------------------------------------------------------


class DjangoSQLiteStore(DjangoStore, SQLiteStore):
    """:class:`DjangoStore` on SQLite: the native statements on Django's sqlite3
    connections (the file is switched to WAL, as the native store keeps it)."""

    def __init__(self, using: str = "default", *, query: str = "", **options: Any) -> None:
        from django.db import connections

        name = str(connections.settings[using]["NAME"])
        # (the native store's options come from a URL; the path is Django's)
        SQLiteStore.__init__(self, with_query("sqlite:///django.db", query), **options)
        self.alias, self.url, self.path = using, f"django://{using}", name
        self._links = Links(using, self._prepare)

    def _prepare(self, conn: Any) -> None:
        """A new connection of the store's own: WAL (a file's; an in-memory database
        has none), the store's ``synchronous``, the schema checked once."""
        self._wal(conn)
        conn.execute(f"PRAGMA synchronous={self.synchronous}")
        if not self._migrated:
            self._migrate(conn)

    def _wal(self, conn: Any) -> None:
        if conn.execute("PRAGMA journal_mode").fetchone()[0] != "memory":
            self._set_wal(conn)

    def _migrate_raw(self, raw: Any) -> int:
        self._migrated, self._rewrite_allowed = False, True
        self._wal(raw)
        self._migrate(raw)
        return SCHEMA_VERSION

    def _on_connection(self, op: Callable[[Any], Any]) -> Any:
        from django.db import connections

        thread = connections[self.alias]
        if thread.in_atomic_block:
            # SQLite has one writer: inside the thread's atomic() (which may hold the write
            # lock), a write on another connection would wait for this very thread. The
            # store's call joins that transaction instead, as the native store's calls
            # join its completion_transaction().
            return op(thread.connection)
        conn = self._links.raw()
        if conn.in_transaction:  # (a statement left one open: never carry it on)
            conn.execute("ROLLBACK")
        return op(conn)

    def _in_transaction(self, raw: Any, op: Any) -> bool:
        return bool(op(raw))

    def migrate(self) -> int:
        """Create or upgrade the schema on a connection of the store's; return its version."""
        self._migrated = False
        return super().migrate()

    def close(self) -> None:
        """Close the store's own connections (never the application's)."""
        self._links.close()

    def __repr__(self) -> str:
        return f"<DjangoStore django://{self.alias} sqlite {self.path!r}>"
