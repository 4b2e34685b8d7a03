"""``mysql://`` and ``mariadb://``: records in one InnoDB table of MySQL or MariaDB.

:class:`MySQLStore` is the store; the schema, the connections, the operations work and
the application transactions live in modules of their own.
"""

from __future__ import annotations

try:
    import pymysql  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the MySQL store needs PyMySQL (and asyncmy for asyncio): pip install 'retrysafe[mysql]'"
    ) from exc

from retrysafe.errors import SchemaVersionError
from retrysafe.stores.mysql.schema import SCHEMA_VERSION
from retrysafe.stores.mysql.store import MySQLStore

__all__ = ["SCHEMA_VERSION", "MySQLStore", "SchemaVersionError"]
