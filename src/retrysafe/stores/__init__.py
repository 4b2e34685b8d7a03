"""Stores behind one protocol, opened by URL with :func:`open_store`."""

from __future__ import annotations

import os
import urllib.parse
from typing import Any, cast

from retrysafe.stores._base import (
    ArchivedRecord,
    RecordQuery,
    Store,
    StoreStats,
    SweepBatch,
    settles_expiry,
)
from retrysafe.stores._redact import redact

__all__ = [
    "DEFAULT_STORE_URL",
    "ArchivedRecord",
    "RecordQuery",
    "Store",
    "StoreStats",
    "SweepBatch",
    "open_store",
    "redact",
    "settles_expiry",
]

#: The embedded default when neither an argument nor ``RETRYSAFE_STORE`` names a store.
DEFAULT_STORE_URL = "sqlite:///retrysafe.db"


def open_store(url: str | None = None, **options: Any) -> Store[Any]:
    """Open a store by URL; never connects (the first operation does).

    ``memory://``, ``sqlite:///path/to.db``, ``redis://host:port/db``,
    ``rediss://…``, ``redis+cluster://host:port``, ``postgresql://user@host:port/db``,
    ``mysql://user@host:port/db`` (or ``mariadb://``),
    ``django://alias`` (the records in the tables of a Django database, see
    :class:`retrysafe.stores.django.DjangoStore`).
    Without ``url``, ``RETRYSAFE_STORE`` or :data:`DEFAULT_STORE_URL` is used.
    Extra keyword options go to the store's constructor.
    """
    url = url or os.environ.get("RETRYSAFE_STORE") or DEFAULT_STORE_URL
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "memory":
        from retrysafe.stores.memory import MemoryStore

        return MemoryStore(url, **options)
    if scheme == "sqlite":
        from retrysafe.stores.sqlite import SQLiteStore

        return SQLiteStore(url, **options)
    if scheme in {"redis", "rediss", "redis+cluster", "rediss+cluster", "unix"}:
        from retrysafe.stores.redis import RedisStore

        return RedisStore(url, **options)
    if scheme in {"postgresql", "postgres"}:
        from retrysafe.stores.postgres import PostgresStore

        return PostgresStore(url, **options)
    if scheme in {"mysql", "mariadb"}:
        from retrysafe.stores.mysql import MySQLStore

        return MySQLStore(url, **options)
    if scheme == "django":
        from retrysafe.stores.django import DjangoStore, alias_of

        alias, query = alias_of(url)
        return cast("Store[Any]", DjangoStore(alias, query=query, **options))
    raise ValueError(
        f"unknown store URL {redact(url)!r}: use memory://, sqlite:///path, redis://, "
        "rediss://, redis+cluster://, postgresql://, mysql://, mariadb:// or django://alias"
    )
