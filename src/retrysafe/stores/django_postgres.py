"""The Django store on PostgreSQL (see :mod:`retrysafe.stores.django`): the native
PostgreSQL store, its pools and statements, on connections made from the alias's
settings."""

from __future__ import annotations

from typing import Any, cast
from urllib.parse import parse_qsl, urlencode

import psycopg
from psycopg import sql

from retrysafe.stores.django import DjangoStore, with_query
from retrysafe.stores.postgres import SCHEMA_VERSION, PostgresStore
from retrysafe.stores.postgres.connection import UNAVAILABLE_ERRORS
from retrysafe.stores.postgres.transactions import completion_failed

__all__ = ["DjangoPostgresStore", "connect_kwargs"]

#: What Django's connection parameters hold for its own connections only: its
#: cursor class (client-side binding) and its adapters (time zones for the ORM).
_DJANGO_ONLY = ("cursor_factory", "context")


class _Lent:
    """The one-connection "pool" :meth:`PostgresConnections._checkout` takes from
    (``manage.py migrate``'s connection), so the native migration runs unchanged."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def getconn(self) -> Any:
        return self.conn

    def putconn(self, conn: Any) -> None:
        pass


def connect_kwargs(alias: str) -> dict[str, Any]:
    """psycopg's connect arguments for the store's own connections to ``alias``: Django's
    (``DatabaseWrapper.get_connection_params()``: the database, the user, ``OPTIONS``),
    without its cursor class and adapters. ``prepare_threshold`` is the alias's: Django's
    default, None, prepares nothing (transaction poolers such as pgbouncer work)."""
    from django.db import connections

    params = dict(connections[alias].get_connection_params())
    for name in _DJANGO_ONLY:
        params.pop(name, None)
    return params


def _threshold(value: str) -> int | None:
    """A URL's ``prepare_threshold``: a whole number, or ``none`` (never prepare)."""
    if value.lower() in ("none", "null", ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"prepare_threshold must be a whole number or none, not {value!r}"
        ) from None


class DjangoPostgresStore(DjangoStore, PostgresStore):  # type: ignore[misc]  # (its acompletion_transaction refuses)
    """:class:`DjangoStore` on PostgreSQL (psycopg 3): the native store, its bounded pools
    (``min_size``/``max_size``) of connections made from the alias's settings, never
    taken from nor given back to Django's (``OPTIONS["pool"]``)."""

    def __init__(self, using: str = "default", *, query: str = "", **options: Any) -> None:
        from django.db import connections
        from django.db.backends.postgresql.psycopg_any import is_psycopg3

        if not is_psycopg3:
            raise ValueError(f"django://{using}: the Django store needs psycopg 3, not psycopg2")
        pairs = parse_qsl(query, keep_blank_values=True)
        given = {name: value for name, value in pairs if name == "prepare_threshold"}
        query = urlencode([(name, value) for name, value in pairs if name not in given])
        # The native options (table, pool sizes, ...) as the native store reads them; the
        # connection itself is Django's (the URL's host and database are never used).
        PostgresStore.__init__(self, with_query("postgresql://django", query), **options)
        params = connect_kwargs(using)
        kwargs = self._conn_kwargs
        # The URL's libpq parameters (sslmode, connect_timeout, application_name, ...)
        # win over the alias's, as in a postgresql:// URL.
        url = psycopg.conninfo.conninfo_to_dict(self._conninfo)
        if url.get("host") == "django":
            del url["host"]
        if "connect_timeout" not in url and "connect_timeout" in params:
            self.connect_timeout = float(params["connect_timeout"])
        if given:
            url["prepare_threshold"] = _threshold(given["prepare_threshold"])
        self._conninfo = ""
        self._conn_kwargs = params = {**kwargs, **params, **url, "autocommit": True}
        self._role = connections.settings[using].get("OPTIONS", {}).get("assume_role")
        host = params.get("host") or "localhost"
        where = f"{host}:{params.get('port') or 5432}/{params.get('dbname') or ''}"
        self._where = f"{where} (table {self.table}, Django alias {using!r})"
        self.alias, self.url = using, f"django://{using}"

    def _pool_kwargs(self) -> dict[str, Any]:
        """The native pools' arguments, with the alias's ``assume_role`` (Django sets it on
        each of its connections) set on each new connection."""
        kwargs = super()._pool_kwargs()
        if self._role:
            kwargs["configure"] = self._assume_role
        return kwargs

    def _assume_role(self, conn: Any) -> Any:
        query = sql.SQL("SET ROLE {}").format(sql.Identifier(self._role))
        return conn.execute(query)  # (an AsyncConnection's: a coroutine the pool awaits)

    def _migrate_raw(self, raw: Any) -> int:
        self._migrated, self._rewrite_allowed = False, True
        self._checkout(cast(Any, _Lent(raw)))
        return SCHEMA_VERSION

    def _in_transaction(self, raw: Any, op: Any) -> bool:
        try:
            cur = psycopg.Cursor(raw).execute(op.query, op.params)
        except psycopg.errors.InFailedSqlTransaction:
            raise  # the application's error (caught without a savepoint), not the store's
        except UNAVAILABLE_ERRORS as exc:
            raise completion_failed(exc) from exc
        return bool(op.parse(cur.rowcount, None))

    def __repr__(self) -> str:
        return f"<DjangoStore django://{self.alias} postgresql table={self.table}>"
