"""``att.transaction()`` on the ``django://`` store in plain code (no middleware), each
scenario run in a configured Django process by ``run.py scenario NAME``; each returns
what it saw, for the test to check."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.db import IntegrityError, transaction

from django_orm_app.models import Order
from retrysafe import Engine, IdempotencyMap, Outcome, Store, open_store
from retrysafe._model.hashing import key_hash
from retrysafe.errors import LeaseLostError

IMAP = IdempotencyMap.default()


def _key(mandate: str, user: str) -> str:
    return IMAP.key("order", cart_mandate_id=mandate, user_id=user)


def create_order(
    engine: Engine, mandate: str, user: str, total: int, *, crash: str = "", lease: Any = None
) -> dict[str, Any]:
    """One order per cart mandate: the row and the completed record commit together."""
    with engine.attempt(
        _key(mandate, user), operation="order", scope=user, fingerprint=str(total), lease=lease
    ) as att:
        if att.replay is not None:
            return att.replay.outcome.value  # type: ignore[union-attr,no-any-return]
        with att.transaction():
            order = Order.objects.create(cart_mandate_id=mandate, user_id=user, total=total)
            if crash == "before_commit":
                os.kill(os.getpid(), signal.SIGKILL)
            if crash == "raise":
                raise RuntimeError("after the write")
            att.outcome = Outcome.json({"id": order.pk, "cart_mandate_id": mandate})
        return {"id": order.pk, "cart_mandate_id": mandate}


def status(store: Store[Any], mandate: str, user: str) -> str | None:
    record = store.get(key_hash(user, "order", _key(mandate, user)))
    return None if record is None else record.status.value


def rows(mandate: str) -> int:
    return int(Order.objects.filter(cart_mandate_id=mandate).count())


def transactions(native_url: str) -> dict[str, Any]:
    """:func:`plain`, :func:`outer` and :func:`stale`, the records read back through the
    native store at ``native_url`` (another connection: it sees what committed)."""
    native = open_store(native_url)
    return {"plain": plain(native), "outer": outer(native), "stale": stale()}


def plain(native: Store[Any]) -> dict[str, Any]:
    """Outside any atomic(): commit together, replay, roll back together."""
    engine = Engine("django://default")
    first = create_order(engine, "p1", "u", 5)
    seen = {"after_first": (rows("p1"), status(native, "p1", "u"))}
    again = create_order(engine, "p1", "u", 5)
    seen["replayed"] = again == first
    seen["after_replay"] = rows("p1")
    with contextlib.suppress(RuntimeError):
        create_order(engine, "p2", "u", 5, crash="raise")
    seen["after_raise"] = (rows("p2"), status(native, "p2", "u"))
    seen["retry"] = create_order(engine, "p2", "u", 5)["cart_mandate_id"]
    seen["after_retry"] = (rows("p2"), status(native, "p2", "u"))
    return seen


def outer(native: Store[Any]) -> dict[str, Any]:
    """Inside an outer atomic(): the completion commits when the outermost block does."""
    engine = Engine("django://default")
    seen: dict[str, Any] = {}
    with transaction.atomic():
        create_order(engine, "o1", "u", 5)
        seen["inside"] = (rows("o1"), status(native, "o1", "u"))  # (rows: this connection's)
    seen["committed"] = (rows("o1"), status(native, "o1", "u"))
    try:
        with transaction.atomic():
            create_order(engine, "o2", "u", 5)
            raise RuntimeError("the outer block fails after the attempt")
    except RuntimeError:
        pass
    seen["rolled_back"] = (rows("o2"), status(native, "o2", "u"))
    return seen


class Clock:
    def __init__(self) -> None:
        self.now = 1_900_000_000.0

    def __call__(self) -> float:
        return self.now


def stale() -> dict[str, Any]:
    """A worker whose lease was taken over: its ORM write rolls back, the new owner's
    record stays."""
    clock = Clock()
    engine = Engine("django://default", lease=5, clock=clock)
    key = _key("s1", "u")
    seen: dict[str, Any] = {}
    try:
        with engine.attempt(key, operation="order", scope="u", fingerprint="1") as att:
            clock.now += 6  # the lease ran out: another worker takes the key over
            taker = engine.begin(key, operation="order", scope="u", fingerprint="1")
            seen["taker_attempts"] = taker.attempts  # type: ignore[union-attr]
            with att.transaction():
                Order.objects.create(cart_mandate_id="s1", user_id="u", total=1)
                att.outcome = Outcome.json({"late": True})
    except LeaseLostError:
        seen["lease_lost"] = True
    record = engine.store.get(key_hash("u", "order", key))
    seen["rows"] = rows("s1")
    seen["record"] = (record.status.value, record.token == taker.token)  # type: ignore[union-attr]
    return seen


def crash(lease: str) -> None:
    """Killed between the ORM write and the commit (never returns)."""
    create_order(
        Engine("django://default"), "m1", "u", 7, crash="before_commit", lease=float(lease)
    )


def after_crash(native_url: str) -> dict[str, Any]:
    """What a crash left, then the retry once the dead worker's lease ran out."""
    native = open_store(native_url)
    seen: dict[str, Any] = {"left": (rows("m1"), status(native, "m1", "u"))}
    seen["retry"] = create_order(Engine("django://default", wait=30), "m1", "u", 7)
    seen["after"] = (rows("m1"), status(native, "m1", "u"))
    return seen


def race(threads: str) -> dict[str, Any]:
    """Threads of this process on one mandate (two users): answers, in order, and the
    mandate's rows once all have answered."""
    engine = Engine("django://default", wait=30)
    n = int(threads)
    barrier = threading.Barrier(n)

    def racer(i: int) -> Any:
        barrier.wait()
        try:
            return create_order(engine, "m1", "alice" if i % 4 else "bob", 3)
        except IntegrityError:  # the mandate has another user's order (the unique column)
            return "taken"

    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(racer, range(n)))
    return {"answers": answers, "rows": rows("m1")}


def async_plain(native_url: str) -> dict[str, Any]:
    """``att.transaction()`` from async code: the attempt async, the block in Django's
    sync thread (``sync_to_async``), as the ORM's writes."""
    import asyncio

    from asgiref.sync import sync_to_async

    engine = Engine("django://default")
    native = open_store(native_url)

    async def order(mandate: str) -> Any:
        attempt = engine.attempt(_key(mandate, "u"), operation="order", scope="u")
        async with attempt as att:
            if att.replay is not None:
                return att.replay.outcome.value  # type: ignore[union-attr]

            def block() -> Any:
                with att.transaction():
                    made = Order.objects.create(cart_mandate_id=mandate, user_id="u", total=2)
                    att.outcome = Outcome.json({"id": made.pk})
                return {"id": made.pk}

            return await sync_to_async(block, thread_sensitive=True)()

    async def both() -> tuple[Any, Any]:
        first = await order("a1")
        again = await order("a1")
        await engine.store.aclose()
        return first, again

    first, again = asyncio.run(both())
    return {"same": first == again, "after": (rows("a1"), status(native, "a1", "u"))}


def threads(count: str) -> dict[str, int]:
    """``count`` short-lived threads (a thread-per-request server's) each make one store
    call; then how many connections of the store's are still open."""
    engine = Engine("django://default?max_size=2")
    store: Any = engine.store

    def call() -> None:
        store.get("00" * 32)

    for _ in range(int(count)):
        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
    if store.django and hasattr(store, "_links"):  # SQLite: a connection per live thread
        return {"open": int(store._links.open())}
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()"
        )
        return {"open": int(cur.fetchone()[0])}


def pool() -> dict[str, Any]:
    """With Django's connection pool (``OPTIONS["pool"]``, two connections): the store's
    calls from many threads take none of them, and give none back changed."""
    from django.db import connection

    engine = Engine("django://default")
    callers = [threading.Thread(target=engine.store.get, args=("00" * 32,)) for _ in range(6)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    seen: dict[str, Any] = {"order": create_order(engine, "q1", "u", 1)["cart_mandate_id"]}
    seen["rows"] = rows("q1")  # the ORM still gets a pooled connection
    engine.store.close()
    connection.close()  # back to Django's pool
    with connection.cursor() as cur:  # (a parameter where only client-side binding works)
        cur.execute("SET statement_timeout = %s", [5000])
        raw = connection.connection
        seen["cursor"] = raw.cursor_factory.__module__.startswith("django.")
        seen["prepare_threshold"] = raw.prepare_threshold
    return seen


def statements(path: str) -> dict[str, Any]:
    """The statements a keyed request sends on the request's connection (the ORM's), the
    completion's UPDATE aside (it runs on the DB-API connection underneath)."""
    import json

    from django.db import connection
    from django.test import Client

    seen: list[str] = []

    def wrap(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(" ".join(sql.split()[:1]).upper())
        return execute(sql, params, many, context)

    body = json.dumps({"cart_mandate_id": "st1", "user_id": "u", "total": 5})
    # A new connection's own statements aside (MySQL: Django's session setup, and its
    # sql_mode, which the store's completion checks once per connection)
    connection.ensure_connection()
    if connection.vendor == "mysql":
        assert "STRICT_TRANS_TABLES" in connection.sql_mode
    with connection.execute_wrapper(wrap):
        answer = Client().post(
            path,
            data=body,
            content_type="application/json",
            HTTP_AUTHORIZATION="Bearer alice",
            HTTP_IDEMPOTENCY_KEY=_key("st1", "u"),
        )
    return {"status": answer.status_code, "statements": seen, "rows": rows("st1")}


def records() -> list[Any]:
    """The records through the app's unmanaged model (the admin's view of them)."""
    from retrysafe.django.models import Record

    return sorted(
        (r.operation, r.status_name, r.record().key, r.created is not None)
        for r in Record.objects.all()
    )


def middleware(store: str, transactional: str) -> str:
    """How the middleware takes ``transactional`` with ``store`` (its error, if any)."""
    from django.core.exceptions import ImproperlyConfigured

    from retrysafe.django import IdempotencyMiddleware

    option = {"true": True, "false": False}[transactional]
    try:
        made = IdempotencyMiddleware(lambda r: None, store=store, transactional=option)
    except ImproperlyConfigured as exc:
        return str(exc)
    return f"alias={made.alias}"


def misuse() -> dict[str, str]:
    """What the Django store refuses, each as its error's type and message."""
    import asyncio

    from django.db import connections

    from retrysafe.stores.django import DjangoStore

    seen: dict[str, str] = {}

    def refused(name: str, call: Any) -> None:
        try:
            call()
        except (TypeError, ValueError) as exc:
            seen[name] = f"{type(exc).__name__}: {exc}"
        else:
            seen[name] = "accepted"

    refused("vendor", lambda: DjangoStore("other"))
    refused("alias", lambda: open_store("django://nowhere"))
    engine = Engine("django://default")

    def given(connection: Any) -> None:
        attempt = engine.attempt(f"given-{id(connection)}", operation="order", scope="u")
        with attempt as att, att.transaction(connection) as conn:
            assert conn is connections["default"]
            att.outcome = Outcome.json({"given": True})

    refused("own_connection", lambda: given(connections["default"]))
    refused("other_connection", lambda: given(object()))

    async def in_async() -> None:
        attempt = engine.attempt("async", operation="order", scope="u")
        async with attempt as att, att.atransaction():
            pass

    refused("atransaction", lambda: asyncio.run(in_async()))
    return seen


def prepare(query: str = "") -> dict[str, Any]:
    """The ``prepare_threshold`` of the alias's connect arguments, and what the store of
    ``django://default?QUERY`` connects with (its ``prepare_threshold``, its libpq
    parameters, its connect timeout); whether they keep Django's cursor class."""
    from retrysafe.stores.django import DjangoStore
    from retrysafe.stores.django_postgres import connect_kwargs

    kwargs = connect_kwargs("default")
    store: Any = DjangoStore("default", query=query)
    try:
        mine = dict(store._conn_kwargs)
        mine.pop("password", None)
        return {
            "given": "prepare_threshold" in kwargs,
            "threshold": kwargs.get("prepare_threshold"),
            "store_threshold": mine.get("prepare_threshold"),
            "django_cursor": "cursor_factory" in kwargs or "cursor_factory" in mine,
            "kwargs": {k: v for k, v in mine.items() if isinstance(v, (str, int, type(None)))},
            "timeout": store.connect_timeout,
        }
    finally:
        store.close()


def nested() -> dict[str, Any]:
    """A keyed request inside an outer ``atomic()`` (a wrapper of the project's): refused
    before the view runs; then the same request on its own."""
    import json

    from django.test import Client

    body = json.dumps({"cart_mandate_id": "n1", "user_id": "u", "total": 5})

    def post() -> Any:
        return Client().post(
            "/orders",
            data=body,
            content_type="application/json",
            HTTP_AUTHORIZATION="Bearer alice",
            HTTP_IDEMPOTENCY_KEY=_key("n1", "u"),
        )

    seen: dict[str, Any] = {}
    try:
        with transaction.atomic():
            post()
    except RuntimeError as exc:
        seen["error"] = f"RuntimeError: {exc}"
    seen["rows"] = rows("n1")
    from retrysafe.django.models import Record

    seen["records"] = [r.status_name for r in Record.objects.all()]
    seen["retry"] = post().status_code
    seen["rows_after"] = rows("n1")
    return seen


def marked(native_url: str) -> dict[str, Any]:
    """A transaction marked for rollback: in plain code, the completion refuses it (the
    attempt fails); through the middleware, an ``on_commit`` hook that raises after the
    COMMIT leaves the attempt completed, with no "stale" alert."""
    import json
    import logging

    from django.db.transaction import TransactionManagementError
    from django.test import Client

    native = open_store(native_url)
    engine = Engine("django://default")
    seen: dict[str, Any] = {}
    try:
        attempt = engine.attempt(_key("k1", "u"), operation="order", scope="u")
        with attempt as att, att.transaction():
            Order.objects.create(cart_mandate_id="k1", user_id="u", total=5)
            transaction.set_rollback(True)
            att.outcome = Outcome.json({"ok": 1})
    except TransactionManagementError as exc:
        seen["plain"] = type(exc).__name__
    seen["plain_after"] = (rows("k1"), status(native, "k1", "u"))

    logged: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    logging.getLogger().addHandler(Keep(logging.WARNING))
    body = json.dumps({"cart_mandate_id": "k2", "user_id": "u", "total": 5})
    headers = {"HTTP_AUTHORIZATION": "Bearer alice", "HTTP_IDEMPOTENCY_KEY": _key("k2", "u")}
    client = Client(raise_request_exception=False)
    first = client.post(
        "/orders", data=body, content_type="application/json", HTTP_X_HOOK="1", **headers
    )
    again = client.post("/orders", data=body, content_type="application/json", **headers)
    seen["hook"] = (first.status_code, again.status_code, again.get("idempotent-replayed"))
    from retrysafe.django.models import Record

    # (the middleware's record: its scope is the caller's, so read them all)
    seen["hook_after"] = (rows("k2"), sorted(r.status_name for r in Record.objects.all()))
    seen["logged"] = [m for m in logged if "stale" in m or "could not mark" in m]
    return seen


def binary(native_url: str, name: str, size: str = "") -> dict[str, Any]:
    """A 1 MiB answer of every byte value (or ``size`` zero bytes) completed in
    ``att.transaction()`` (on Django's own connection), read back through the native
    store; or the refusal of a Django connection whose session the completion cannot
    run in, or of an answer over its max_allowed_packet."""
    body = b"\0" * int(size) if size else bytes(range(256)) * 4096
    engine = Engine("django://default", max_body=len(body))
    try:
        with engine.attempt(name, operation="o") as att, att.transaction():
            Order.objects.create(cart_mandate_id=name, user_id="u", total=1)
            att.outcome = Outcome(body=body)
    except Exception as exc:
        refused = f"{type(exc).__name__}: {exc}"
    else:
        refused = ""
    native = open_store(native_url)
    record = native.get(key_hash("", "o", name))
    assert record is not None
    return {
        "refused": refused,
        "status": record.status.value,
        "same": record.outcome is not None and record.outcome.body == body,
        "rows": rows(name),
    }


def mysql_params(query: str = "") -> dict[str, Any]:
    """What the MySQL store's own connections take of the alias (and of its URL's query),
    and that they connect."""
    store: Any = open_store(f"django://default?{query}" if query else "django://default")
    try:
        assert store.get("00" * 32) is None  # (its own connection, migrated)
        return {
            "kwargs": sorted(store._connect_kwargs),
            "timeout": store.connect_timeout,
            "table": store.table,
            "repr": repr(store),
        }
    finally:
        store.close()


def failed_migration(native_url: str) -> dict[str, Any]:
    """``migrate`` by a user who may not CREATE (the records' migration fails on Django's
    connection, which stays open), then the native store's migration by one who may,
    in this same process: how long it waited for the named migration lock."""
    from django.core.management import call_command

    try:
        call_command("migrate", "retrysafe", verbosity=0)
    except Exception as exc:
        error = exc
    else:  # pragma: no cover - the grants allow no CREATE
        raise AssertionError("migrate succeeded without the CREATE privilege")
    store = open_store(native_url)
    started = time.monotonic()
    store.migrate()
    waited = time.monotonic() - started
    store.close()
    return {
        "error": f"{type(error).__name__}: {error}",
        "transient": getattr(error, "transient", None),
        "waited": waited,
    }
