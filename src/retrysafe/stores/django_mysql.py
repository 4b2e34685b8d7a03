"""The Django store on MySQL or MariaDB (see :mod:`retrysafe.stores.django`): the native
MySQL store, its pools (PyMySQL, asyncmy) and statements, on connections made from the
alias's settings; the completion on Django's own connection (mysqlclient)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from retrysafe.stores._base import Transaction
from retrysafe.stores.django import DjangoStore, with_query
from retrysafe.stores.mysql import SCHEMA_VERSION, MySQLStore
from retrysafe.stores.mysql.connection import DRIVER_ERRORS, execute, packet_limit
from retrysafe.stores.mysql.transactions import completion_failed, run_guarded, take_savepoint
from retrysafe.stores.mysql_borrowed import (
    accept_session,
    committed_migration,
    drive_migration,
    session_op,
)

__all__ = ["DjangoMySQLStore", "mysql_connect_kwargs"]

#: What of Django's connection parameters (``get_connection_params()``: the settings and
#: ``OPTIONS``) the store's own PyMySQL connections take. The rest is mysqlclient's or
#: Django's (its converters, its ``init_command``); the character set is the store's,
#: utf8mb4, whatever the alias's.
_TAKEN = ("host", "port", "user", "password", "database", "unix_socket", "ssl")


def mysql_connect_kwargs(alias: str) -> dict[str, Any]:
    """PyMySQL's connect arguments for the store's own connections to ``alias``."""
    from django.db import connections

    params = connections[alias].get_connection_params()
    return {name: params[name] for name in _TAKEN if name in params}


def _mysql_errors() -> tuple[type[BaseException], ...]:
    """The drivers' errors, with mysqlclient's (Django's driver)."""
    try:
        import MySQLdb  # type: ignore[import-untyped]  # (mysqlclient ships no types)
    except ImportError:  # pragma: no cover - Django's MySQL backend needs it
        return DRIVER_ERRORS
    return (*DRIVER_ERRORS, MySQLdb.MySQLError)


class DjangoMySQLStore(DjangoStore, MySQLStore):  # type: ignore[misc]  # (its acompletion_transaction refuses)
    """:class:`DjangoStore` on MySQL or MariaDB: the native store, its bounded pools of
    PyMySQL connections made from the alias's settings (host, port, user, password,
    database or socket, ``OPTIONS["ssl"]``), in the native store's own session mode.
    The completion runs on the thread's Django connection (mysqlclient) in its
    ``atomic()`` block, which must be strict (``sql_mode``, Django's recommended
    setting: its check ``mysql.W002``); a completion over that connection's
    ``max_allowed_packet`` is refused before it is sent (both read once per
    connection)."""

    def __init__(self, using: str = "default", *, query: str = "", **options: Any) -> None:
        # The native options (table, pool sizes, ...) as the native store reads them; the
        # connection itself is Django's (the URL's host and database are never used).
        MySQLStore.__init__(self, with_query("mysql://django/django", query), **options)
        from django.db import connections

        params = connections[using].get_connection_params()
        if "connect_timeout" in params and "connect_timeout=" not in query:  # (the URL's wins)
            self.connect_timeout = float(params["connect_timeout"])
        self._connect_kwargs = kwargs = mysql_connect_kwargs(using)
        where = kwargs.get("unix_socket") or (
            f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 3306)}"
        )
        self._where = f"{where}/{kwargs.get('database', '')} (table {self.table}, alias {using!r})"
        self.alias, self.url = using, f"django://{using}"
        self._errors = _mysql_errors()

    def _migrate_raw(self, raw: Any) -> int:
        drive_migration(
            raw, committed_migration(self._migration()), self._errors, self._unavailable
        )
        self._migrated = True
        return SCHEMA_VERSION

    @contextmanager
    def completion_transaction(self, connection: Any = None) -> Iterator[Transaction[Any]]:
        """The base's, and, as the block begins, the savepoint the completion releases
        first: a deadlock or an implicit commit in the block ends the transaction and the
        savepoint, and the completion is refused (see retrysafe.stores.mysql.transactions)."""
        with super().completion_transaction(connection) as tx:
            try:
                execute(tx.connection.connection, take_savepoint())
            except self._errors as exc:
                raise completion_failed(exc) from exc
            yield tx

    def _in_transaction(self, raw: Any, op: Any) -> bool:
        try:  # the session's sql_mode and packet limit, once per connection
            if packet_limit(raw) is None:
                accept_session(raw, execute(raw, session_op()), f"MySQL store at {self._where}")
            self._check_size(raw, op)  # (before anything is sent)
        except self._errors as exc:
            raise completion_failed(exc) from exc
        # mysqlclient sends bytes as a quoted string in the connection's character set
        # unless told otherwise (a client-side flag: no statement). The bytes arrive
        # intact either way (the columns are binary); _binary'…' spares MySQL 8's
        # "Invalid utf8mb4 character string" warning, as SQLAlchemy's docs advise.
        prefix = raw._binary_prefix
        raw._binary_prefix = True
        try:
            return run_guarded(raw, op)
        except self._errors as exc:
            raise completion_failed(exc) from exc
        finally:
            raw._binary_prefix = prefix

    def __repr__(self) -> str:
        return f"<DjangoStore django://{self.alias} mysql table={self.table}>"
