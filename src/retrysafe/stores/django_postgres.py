"""The Django store on PostgreSQL (see :mod:`retrysafe.stores.django`): the native
PostgreSQL store's statements on Django's psycopg 3 connections."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import psycopg

from retrysafe.stores.django import DjangoStore, Links, with_query
from retrysafe.stores.postgres import SCHEMA_VERSION, PostgresStore
from retrysafe.stores.postgres.connection import UNAVAILABLE_ERRORS
from retrysafe.stores.postgres.transactions import completion_failed

__all__ = ["DjangoPostgresStore"]


class _Lender:
    """The one-connection "pool" :meth:`PostgresConnections._checkout` takes from: this
    thread's connection (a new one if it was closed), so that the native checkout
    (skipping a connection the server dropped, migrating once) runs unchanged."""

    def __init__(self, links: Links) -> None:
        self.links = links

    def getconn(self) -> Any:
        return self.links.raw()

    def putconn(self, conn: Any) -> None:
        if conn.closed:
            self.links.drop()


class _Lent:
    """:class:`_Lender` of one given connection (``manage.py migrate``'s)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def getconn(self) -> Any:
        return self.conn

    def putconn(self, conn: Any) -> None:
        pass


def _server_binding(conn: psycopg.Connection[Any]) -> None:
    """The store's own connections bind parameters on the server and prepare their
    statements, as the native store's do (Django's cursor factory binds them
    client-side, and Django turns preparing off for connection poolers)."""
    conn.cursor_factory = psycopg.Cursor
    conn.prepare_threshold = 5  # psycopg's default


class DjangoPostgresStore(DjangoStore, PostgresStore):  # type: ignore[misc]  # (its acompletion_transaction refuses)
    """:class:`DjangoStore` on PostgreSQL (psycopg 3): the native statements on Django's
    connections."""

    drive_inline = True  # its async calls are a thread hop

    def __init__(self, using: str = "default", *, query: str = "", **options: Any) -> None:
        from django.db import connections
        from django.db.backends.postgresql.psycopg_any import is_psycopg3

        if not is_psycopg3:
            raise ValueError(f"django://{using}: the Django store needs psycopg 3, not psycopg2")
        conf = connections.settings[using]
        host = conf.get("HOST") or "localhost"
        port = conf.get("PORT") or 5432
        url = f"postgresql://{host}:{port}/{conf.get('NAME') or 'postgres'}"
        PostgresStore.__init__(self, with_query(url, query), **options)
        self.alias, self.url = using, f"django://{using}"
        self._links = Links(using, _server_binding)
        self._lender = _Lender(self._links)

    def _take(self) -> psycopg.Connection[Any]:
        return self._checkout(cast(Any, self._lender))

    def _give(self, conn: psycopg.Connection[Any], broken: bool = False) -> None:
        idle = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        if broken or conn.closed or not idle:
            self._links.drop()

    async def _arun(self, op: Any) -> Any:
        return await asyncio.to_thread(self._run, op)

    def _migrate_raw(self, raw: Any) -> int:
        self._migrated, self._rewrite_allowed = False, True
        self._checkout(cast(Any, _Lent(raw)))
        return SCHEMA_VERSION

    def _in_transaction(self, raw: Any, op: Any) -> bool:
        try:
            cur = psycopg.Cursor(raw).execute(op.query, op.params)
        except UNAVAILABLE_ERRORS as exc:
            raise completion_failed(exc) from exc
        return bool(op.parse(cur.rowcount, None))

    def close(self) -> None:
        """Close the store's own connections (never the application's)."""
        self._links.close()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __repr__(self) -> str:
        return f"<DjangoStore django://{self.alias} postgresql table={self.table}>"
