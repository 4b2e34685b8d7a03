"""SQLAlchemy 2.x: the records in the application's database, and the completion in
the application's ORM transaction.

::

    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session
    from retrysafe import Engine
    from retrysafe.sqlalchemy import SQLAlchemyStore

    db = create_engine("postgresql+psycopg://app@localhost/shop")
    engine = Engine(SQLAlchemyStore(db))

    with engine.attempt(key, operation="order", scope=user_id) as att:
        if att.replay:
            return att.replay.outcome.value
        with Session(db) as session, att.transaction(session):
            session.add(Order(cart_mandate_id=mandate_id, user_id=user_id, total=total))
            att.outcome = Outcome.json({"cart_mandate_id": mandate_id})
        # committed: the order row and the completed record, together

:class:`SQLAlchemyStore` takes an ``Engine`` or an ``AsyncEngine`` (SQLite through
pysqlite or aiosqlite, PostgreSQL through psycopg 3, MySQL and MariaDB through
PyMySQL or asyncmy) and borrows its connections
from the engine's pool. :func:`create_tables` creates the records' tables for
applications (and Alembic migrations) that create their schema explicitly.
See docs/sqlalchemy.md.
"""

from __future__ import annotations

from retrysafe.stores.sqlalchemy import (
    SQLAlchemySQLiteStore,
    SQLAlchemyStore,
    acreate_tables,
    create_tables,
)

__all__ = ["SQLAlchemySQLiteStore", "SQLAlchemyStore", "acreate_tables", "create_tables"]
