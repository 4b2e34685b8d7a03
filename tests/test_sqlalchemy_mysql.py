"""The SQLAlchemy store on MySQL/MariaDB: what is particular to a borrowed PyMySQL or
asyncmy connection (tests/test_sqlalchemy.py runs the shared ORM tests on it too).

The store sets nothing on a borrowed connection: bytes reach the server intact and
times are right whatever the session's character set handling and time zone, too long
a value fails in the default (strict) mode, and a session that is not strict is
refused before anything is written. Each op ends with a ``COMMIT`` on its connection,
and the pool's reset ``ROLLBACK`` is skipped: the statements are counted on the server.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import ssl
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy
from _servers import MySQLServer
from sqlalchemy import Integer, LargeBinary, String
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from retrysafe import Engine, Outcome, Record, Replay, Status, StoreUnavailableError, open_store
from retrysafe._model.hashing import key_hash
from retrysafe.sqlalchemy import SQLAlchemyStore, create_tables
from retrysafe.stores.sqlalchemy_mysql import SQLAlchemyMySQLStore

#: Every byte value, 1 MiB.
BODY = bytes(range(256)) * 4096


class Base(DeclarativeBase):
    pass


class Blob(Base):
    """An application row written in the same transaction as the completion."""

    __tablename__ = "blobs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    data: Mapped[bytes] = mapped_column(LargeBinary(length=2**24))


@pytest.fixture
def url(mysql_server: MySQLServer) -> Iterator[str]:
    """The server's URL for PyMySQL, the ``blobs`` table created."""
    url = mysql_server.url.replace("mysql://", "mysql+pymysql://", 1)
    engine = sqlalchemy.create_engine(url)
    Base.metadata.create_all(engine)
    engine.dispose()
    yield url


def _table() -> dict[str, str]:
    return {"table": f"t_{uuid.uuid4().hex[:12]}"}


def test_the_dialects_and_drivers(url: str) -> None:
    maria = sqlalchemy.create_engine(url.replace("mysql+", "mariadb+", 1))
    assert isinstance(SQLAlchemyStore(maria), SQLAlchemyMySQLStore)
    for refused in ("mysql+mysqldb://u@h/db", "mariadb+mysqldb://u@h/db"):
        with pytest.raises(TypeError, match=r"PyMySQL driver \(asyncmy for an AsyncEngine\)"):
            SQLAlchemyStore(sqlalchemy.create_engine(refused))
    with pytest.raises(TypeError, match=r"mysql\+asyncmy://"):
        SQLAlchemyStore(create_async_engine("mysql+aiomysql://u@h/db"))
    with pytest.raises(TypeError, match="not 'mysqlconnector'"):
        SQLAlchemyStore(sqlalchemy.create_engine("mysql+mysqlconnector://u@h/db", module=sqlite3))
    with pytest.raises(ValueError, match="StaticPool"):
        SQLAlchemyStore(sqlalchemy.create_engine(url, poolclass=sqlalchemy.StaticPool))


def _questions(engine: sqlalchemy.Engine) -> int:
    """The statements the pool's one connection has received: this one included, and
    then two more (the COMMIT here, the pool's reset ROLLBACK)."""
    with engine.connect() as conn:
        row = conn.exec_driver_sql("SHOW SESSION STATUS LIKE 'Questions'").one()
        conn.commit()
        return int(row[1])


@pytest.mark.parametrize(("isolation", "sent"), [(None, 8), ("AUTOCOMMIT", 5)])
def test_the_round_trips_of_a_borrowed_connection(url: str, isolation: Any, sent: int) -> None:
    """A claim is INSERT, SELECT, COMMIT; a completion UPDATE, COMMIT; a replay (the
    claim of a completed key) INSERT, SELECT, COMMIT; no pool reset after any of them.
    On an AUTOCOMMIT engine, no COMMIT either."""
    options = {"isolation_level": isolation} if isolation else {}
    db = sqlalchemy.create_engine(url, pool_size=1, max_overflow=0, **options)
    engine = Engine(SQLAlchemyStore(db, **_table()))
    with engine.attempt("warm", operation="o") as att:  # migrated, sql_mode read
        att.outcome = Outcome.json(0)
    before = _questions(db)
    with engine.attempt("k", operation="o") as att:
        att.outcome = Outcome.json(1)
    replay = engine.begin("k", operation="o")
    assert isinstance(replay, Replay) and replay.outcome.value == 1
    assert _questions(db) - before - 3 == sent
    engine.store.close()
    db.dispose()


def _claim(store: Any, key: str, **fields: Any) -> Any:
    """A claim of ``key`` sent to the store as it is (no engine in between)."""
    now = time.time()
    record = Record(
        key_hash=key_hash("", "o", key),
        key=key,
        scope="",
        operation="o",
        fingerprint="f",
        status=Status.PROCESSING,
        token=uuid.uuid4().hex,
        lease_until=now + 30,
        expires_at=now + 3600,
        created_at=now,
        updated_at=now,
        **fields,
    )
    return store.claim(record)


def test_bytes_times_and_too_long_values_need_no_session_settings(url: str) -> None:
    """A session in another time zone, with the drivers' default bytes handling: a 1 MiB
    body of every byte value round-trips (PyMySQL and asyncmy, store op and session
    completion), times are Unix seconds, and too long a value fails and writes nothing."""
    tz = {"connect_args": {"init_command": "SET SESSION time_zone = '+05:00'"}}
    db = sqlalchemy.create_engine(url, **tz)
    table = _table()
    store = SQLAlchemyStore(db, **table)
    engine = Engine(store)
    with engine.attempt("body", operation="o") as att:
        att.outcome = Outcome(body=BODY)
    replayed = engine.begin("body", operation="o")
    assert replayed is not None and replayed.record.outcome.body == BODY  # type: ignore[union-attr]
    assert abs(replayed.record.created_at - time.time()) < 60  # type: ignore[union-attr]
    with (
        engine.attempt("session", operation="o") as att,
        Session(db) as session,
        att.transaction(session),
    ):
        session.add(Blob(name="session", data=BODY))
        att.outcome = Outcome(body=BODY)
    with Session(db) as session:
        assert session.query(Blob).filter_by(name="session").one().data == BODY
    native = open_store(url.replace("+pymysql", "", 1), **table)
    got = native.get(key_hash("", "o", "session"))
    assert got is not None and got.outcome is not None and got.outcome.body == BODY
    native.close()

    with pytest.raises(StoreUnavailableError, match="too long"):
        _claim(store, "long", request_id="r" * 70_000)  # TEXT holds 65,535 bytes
    assert store.get(key_hash("", "o", "long")) is None  # nothing written, nothing cut

    async def main() -> bytes:
        aengine = create_async_engine(url.replace("+pymysql", "+asyncmy", 1), **tz)
        astore = SQLAlchemyStore(aengine, **table)
        try:
            async with (
                Engine(astore).attempt("abody", operation="o") as att,
                AsyncSession(aengine) as session,
                att.atransaction(session),
            ):
                session.add(Blob(name="async", data=BODY))
                att.outcome = Outcome(body=BODY)
            again = await Engine(astore).abegin("abody", operation="o")
            return again.record.outcome.body  # type: ignore[union-attr,no-any-return]
        finally:
            await astore.aclose()
            await aengine.dispose()

    assert asyncio.run(main()) == BODY
    store.close()
    db.dispose()


def test_a_session_that_is_not_strict_is_refused(url: str) -> None:
    """Cut values would go unnoticed: the store refuses the connection (not transient),
    writes nothing, and so does the completion in such a session."""
    lax = {"connect_args": {"init_command": "SET SESSION sql_mode = 'NO_ENGINE_SUBSTITUTION'"}}
    table = _table()
    strict_db = sqlalchemy.create_engine(url)
    strict = SQLAlchemyStore(strict_db, **table)
    strict.migrate()
    lax_db = sqlalchemy.create_engine(url, **lax)
    engine = Engine(SQLAlchemyStore(lax_db, **table))
    with pytest.raises(StoreUnavailableError, match="is not strict") as refused:
        engine.begin("k", operation="o")
    assert refused.value.transient is False
    assert strict.get(key_hash("", "o", "k")) is None
    # a strict store, the completion in a lax session: refused, the session rolled back
    with (
        pytest.raises(StoreUnavailableError, match="is not strict"),
        Engine(strict).attempt("k2", operation="o") as att,
        Session(lax_db) as session,
        att.transaction(session),
    ):
        session.add(Blob(name="lax", data=b"x"))
        att.outcome = Outcome.json(1)
    assert strict.get(key_hash("", "o", "k2")).status is Status.FAILED  # type: ignore[union-attr]
    with Session(strict_db) as session:
        assert session.query(Blob).filter_by(name="lax").count() == 0
    strict.close()
    strict_db.dispose()
    lax_db.dispose()


#: Twice MariaDB's default max_allowed_packet (16 MiB): the server would close the
#: connection while the client still writes, which looks like an outage.
OVERSIZE = b"\0" * (32 * 2**20)


def test_an_answer_over_the_packet_fails_finally_at_once(url: str) -> None:
    """A borrowed connection's max_allowed_packet is read with its sql_mode: an answer
    over it is refused before it is sent (not transient), the attempt fails finally at
    once (no resends for the lease), and so does one completed in a Session. Sync
    Engine and AsyncEngine."""
    table = _table()
    db = sqlalchemy.create_engine(url)
    store = SQLAlchemyStore(db, **table)
    engine = Engine(store, max_body=len(OVERSIZE), lease=300)
    claim = engine.begin("big", operation="o")
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="max_allowed_packet") as refused:
        engine.complete(claim, Outcome(body=OVERSIZE))  # type: ignore[arg-type]
    assert refused.value.transient is False and time.monotonic() - started < 30  # lease: 300 s
    record = store.get(key_hash("", "o", "big"))
    assert record is not None and record.status is Status.FAILED and record.final
    with (
        pytest.raises(StoreUnavailableError, match="max_allowed_packet"),
        engine.attempt("big-session", operation="o") as att,
        Session(db) as session,
        att.transaction(session),
    ):
        session.add(Blob(name="big-session", data=b"x"))
        att.outcome = Outcome(body=OVERSIZE)
    record = store.get(key_hash("", "o", "big-session"))
    assert record is not None and record.status is Status.FAILED
    with Session(db) as session:
        assert session.query(Blob).filter_by(name="big-session").count() == 0

    async def main() -> tuple[bool, float, Any]:
        aengine = create_async_engine(url.replace("+pymysql", "+asyncmy", 1))
        astore = SQLAlchemyStore(aengine, **table)
        try:
            eng = Engine(astore, max_body=len(OVERSIZE), lease=300)
            aclaim = await eng.abegin("abig", operation="o")
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="max_allowed_packet") as err:
                await eng.acomplete(aclaim, Outcome(body=OVERSIZE))  # type: ignore[arg-type]
            took = time.monotonic() - started
            with pytest.raises(StoreUnavailableError, match="max_allowed_packet"):
                async with (
                    eng.attempt("abig-session", operation="o") as att,
                    AsyncSession(aengine) as session,
                    att.atransaction(session),
                ):
                    session.add(Blob(name="abig-session", data=b"x"))
                    att.outcome = Outcome(body=OVERSIZE)
            in_session = await astore.aget(key_hash("", "o", "abig-session"))
            assert in_session is not None and in_session.status is Status.FAILED
            return err.value.transient, took, await astore.aget(key_hash("", "o", "abig"))
        finally:
            await astore.aclose()
            await aengine.dispose()

    transient, took, record = asyncio.run(main())
    assert transient is False and took < 30  # not resent for the 300 s lease
    assert record is not None and record.status is Status.FAILED and record.final
    store.close()
    db.dispose()


def test_an_engine_url_with_a_charset(url: str) -> None:
    """``?charset=utf8mb4`` (as SQLAlchemy's MySQL docs advise) is the engine's: the
    store takes the engine, and its own connections use utf8mb4 anyway."""
    for charset in ("utf8mb4", "utf8mb3"):
        db = sqlalchemy.create_engine(f"{url}?charset={charset}")
        store = SQLAlchemyStore(db, **_table())
        engine = Engine(store)
        with engine.attempt("k", operation="o") as att:
            att.outcome = Outcome.json({"text": "naïve ☃"})
        replay = engine.begin("k", operation="o")
        assert json.loads(replay.record.outcome.body) == {"text": "naïve ☃"}  # type: ignore[union-attr]
        store.close()
        db.dispose()


@pytest.fixture
def limited(mysql_server: MySQLServer) -> Iterator[tuple[str, str]]:
    """A user with a password and SELECT, INSERT, UPDATE, DELETE only (no CREATE): the
    (user, password) pair."""
    user, password = f"lim_{uuid.uuid4().hex[:8]}", "pw-secret"
    admin = sqlalchemy.create_engine(mysql_server.url.replace("mysql://", "mysql+pymysql://"))
    with admin.begin() as conn:
        for host in ("127.0.0.1", "localhost"):
            conn.exec_driver_sql(f"CREATE USER '{user}'@'{host}' IDENTIFIED BY '{password}'")
            conn.exec_driver_sql(
                f"GRANT SELECT, INSERT, UPDATE, DELETE ON {mysql_server.database}.* "
                f"TO '{user}'@'{host}'"
            )
    yield user, password
    with admin.begin() as conn:
        for host in ("127.0.0.1", "localhost"):
            conn.exec_driver_sql(f"DROP USER '{user}'@'{host}'")
    admin.dispose()


def test_a_failed_migration_frees_the_named_lock(
    url: str, mysql_server: MySQLServer, limited: tuple[str, str]
) -> None:
    """create_tables by a user who may not CREATE fails with a typed error (not
    transient: a permission) and releases the migration lock on the application's
    pooled connection: another store migrates at once, not after a 30 s wait."""
    user, password = limited
    table = _table()
    db = sqlalchemy.create_engine(
        url.replace(f"//{mysql_server.user}@", f"//{user}:{password}@", 1), pool_size=1
    )
    with pytest.raises(StoreUnavailableError, match="CREATE command denied") as refused:
        create_tables(db, **table)
    assert refused.value.transient is False
    with db.connect() as conn:  # the pool's one connection, the one that failed
        assert conn.exec_driver_sql("SELECT 1").scalar() == 1
        other = open_store(mysql_server.url, **table)
        started = time.monotonic()
        other.migrate()
        assert time.monotonic() - started < 20  # a held lock makes it wait 30 s
        other.close()
    db.dispose()


def test_an_async_engines_tls_and_password_reach_the_stores_own_connections(
    url: str, mysql_server: MySQLServer, limited: tuple[str, str]
) -> None:
    """The sync calls of a store on an AsyncEngine use connections of the store's own:
    they take the engine's password and TLS settings (connect_args, the URL's ssl
    options), never connect in clear text without them (the test server has no TLS:
    the connection is refused), and what they cannot carry is refused up front."""
    user, password = limited
    table = _table()
    SQLAlchemyStore(sqlalchemy.create_engine(url), **table).migrate()
    async_url = url.replace("+pymysql", "+asyncmy", 1)
    no_password = async_url.replace(f"//{mysql_server.user}@", f"//{user}@", 1)
    store = SQLAlchemyStore(
        create_async_engine(no_password, connect_args={"password": password}), **table
    )
    assert store.get(key_hash("", "o", "none")) is None
    store.close()
    ca = ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt"
    for engine in (
        create_async_engine(async_url, connect_args={"ssl": ssl.create_default_context()}),
        create_async_engine(f"{async_url}?ssl_ca={ca}"),
    ):
        tls = SQLAlchemyStore(engine, **table)
        with pytest.raises(StoreUnavailableError, match="SSL"):
            tls.get(key_hash("", "o", "none"))
        tls.close()
    with pytest.raises(ValueError, match="server_public_key"):
        SQLAlchemyStore(create_async_engine(async_url, connect_args={"server_public_key": "k"}))
