"""``postgresql://``: records in one PostgreSQL table.

:class:`PostgresStore` is the store; the schema, the connections and the operations
work live in modules of their own.
"""

from __future__ import annotations

try:
    import psycopg  # noqa: F401
    import psycopg_pool  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the PostgreSQL store needs psycopg 3 and psycopg_pool: pip install 'retrysafe[postgres]'"
    ) from exc

from retrysafe.errors import SchemaModeError, SchemaVersionError
from retrysafe.stores.postgres.connection import UNAVAILABLE_ERRORS
from retrysafe.stores.postgres.schema import SCHEMA_VERSION
from retrysafe.stores.postgres.store import PostgresStore

__all__ = [
    "SCHEMA_VERSION",
    "UNAVAILABLE_ERRORS",
    "PostgresStore",
    "SchemaModeError",
    "SchemaVersionError",
]
