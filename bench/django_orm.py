"""What completing inside Django's transaction costs: one new order per call.

For SQLite and PostgreSQL, one thread measures calls per second (and microseconds
per call) of:

* **floor**: ``transaction.atomic()`` + ``Order.objects.create(...)`` (the ORM write
  alone, no idempotency);
* **django txn**: the ``django://`` store, ``att.transaction()`` around the same
  ORM create (claim committed on its own, then the ORM write and the completion in
  one transaction);
* **django 2 commits**: the same store, the ORM create committed first and the
  record completed after it (what the middleware did before: not atomic);
* **native txn**: the native store (``sqlite:///same.db`` / ``postgresql://``) and
  its ``att.transaction()`` with the same row written by a raw ``INSERT``;
* **view floor** / **middleware**: a view that creates the order, called alone
  and through ``retrysafe.django.IdempotencyMiddleware`` (transactional, the
  ``django://`` store) with a ``RequestFactory`` request (no HTTP server).

Contenders run interleaved in rounds after a warm-up; a figure is the median over
the rounds. Not a test.

    python bench/django_orm.py [--seconds S] [--rounds R] [--vendors sqlite,postgres]
                               [--postgres-url URL] [--prepare-threshold N]

It creates (and drops) a database of its own on the PostgreSQL server at
``--postgres-url``, or on one it starts (tests/_servers.py).
"""

# ruff: noqa: E402  (the imports follow the sys.path guard below)
from __future__ import annotations

import sys
from pathlib import Path

# Keep this folder off sys.path: bench/http.py would shadow the standard library's http.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse
import contextlib
import itertools
import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

VENDORS = ("sqlite", "postgres")


def configure(sqlite_path: str, pg_url: str | None, prepare: int | None = None) -> None:
    import django
    from django.conf import settings

    databases: dict[str, Any] = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": sqlite_path,
            "OPTIONS": {"transaction_mode": "IMMEDIATE"},
        }
    }
    if pg_url:
        url = urlsplit(pg_url)
        databases["postgres"] = {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": url.path.lstrip("/"),
            "USER": url.username or "",
            "HOST": url.hostname or "",
            "PORT": str(url.port or ""),
            # Django turns psycopg's prepared statements off (for connection poolers)
            # unless OPTIONS sets prepare_threshold; the store's own connections follow it
            "OPTIONS": {} if prepare is None else {"prepare_threshold": prepare},
        }
    settings.configure(
        SECRET_KEY="bench",
        ALLOWED_HOSTS=["*"],
        INSTALLED_APPS=["retrysafe.django"],
        DATABASES=databases,
        USE_TZ=True,
        LOGGING_CONFIG=None,
    )
    django.setup()


def order_model() -> Any:
    from django.db import models

    class Order(models.Model):
        cart_mandate_id = models.CharField(max_length=100, unique=True)
        user_id = models.CharField(max_length=100)
        total = models.IntegerField()

        class Meta:
            app_label = "bench_orders"
            db_table = "bench_orders"

    return Order


def contenders(
    alias: str, native_url: str, order: Any, query: str = ""
) -> dict[str, Callable[[str], Any]]:
    """Each contender: a call that creates the order of a new mandate (``query``: the
    ``django://`` store's URL query)."""
    from django.db import connections, transaction
    from django.http import JsonResponse
    from django.test import RequestFactory

    from retrysafe import Engine, Outcome
    from retrysafe.django import IdempotencyMiddleware
    from retrysafe.stores.django import DjangoStore

    objects = order.objects.db_manager(alias)
    django_engine = Engine(DjangoStore(alias, query=query))
    native_engine = Engine(native_url)
    mark = "?" if connections[alias].vendor == "sqlite" else "%s"
    insert = (
        f"INSERT INTO bench_orders (cart_mandate_id, user_id, total) VALUES ({mark}, {mark}, 5)"
    )

    def floor(m: str) -> Any:
        with transaction.atomic(using=alias):
            return objects.create(cart_mandate_id=m, user_id="u", total=5).pk

    def django_txn(m: str) -> Any:
        attempt = django_engine.attempt(f"order:{m}:u", operation="order", scope="u")
        with attempt as att, att.transaction():
            pk = objects.create(cart_mandate_id=m, user_id="u", total=5).pk
            att.outcome = Outcome.json({"id": pk})
        return pk

    def django_two_commits(m: str) -> Any:
        with django_engine.attempt(f"order:{m}:u", operation="order", scope="u") as att:
            with transaction.atomic(using=alias):
                pk = objects.create(cart_mandate_id=m, user_id="u", total=5).pk
            att.outcome = Outcome.json({"id": pk})
        return pk

    def native_txn(m: str) -> Any:
        attempt = native_engine.attempt(f"order:{m}:u", operation="order", scope="u")
        with attempt as att, att.transaction() as conn:
            conn.execute(insert, (m, "u"))
            att.outcome = Outcome.json({"id": m})
        return m

    def view(request: Any) -> Any:
        data = json.loads(request.body)
        pk = objects.create(cart_mandate_id=data["m"], user_id="u", total=5).pk
        return JsonResponse({"id": pk}, status=201)

    def atomic_view(request: Any) -> Any:
        with transaction.atomic(using=alias):
            return view(request)

    middleware = IdempotencyMiddleware(view, store=DjangoStore(alias, query=query))
    assert middleware.alias == alias
    factory = RequestFactory()

    def request(m: str) -> Any:
        return factory.post(
            "/orders",
            data=json.dumps({"m": m}),
            content_type="application/json",
            HTTP_AUTHORIZATION="Bearer bench",
            HTTP_IDEMPOTENCY_KEY=f"order:{m}:u",
        )

    def view_floor(m: str) -> Any:
        return atomic_view(request(m)).status_code

    def through_middleware(m: str) -> Any:
        response = middleware(request(m))
        assert response.status_code == 201, response.content
        return response.status_code

    return {
        "floor (ORM create in atomic)": floor,
        "django txn (att.transaction)": django_txn,
        "django 2 commits": django_two_commits,
        "native txn (raw INSERT)": native_txn,
        "view floor (RequestFactory)": view_floor,
        "middleware (transactional)": through_middleware,
    }


def measure(call: Callable[[str], Any], names: Iterator[str], seconds: float) -> float:
    """Calls per second of ``call`` over ``seconds``."""
    n = 0
    started = time.perf_counter()
    deadline = started + seconds
    while True:
        for _ in range(20):
            call(next(names))
        n += 20
        now = time.perf_counter()
        if now >= deadline:
            return n / (now - started)


def bench_vendor(
    vendor: str, alias: str, native_url: str, order: Any, args: argparse.Namespace
) -> dict[str, float]:
    from django.db import connections

    with connections[alias].schema_editor() as editor:
        editor.create_model(order)
    from retrysafe.stores.django import DjangoStore

    store = DjangoStore(alias)
    store.migrate_on(connections[alias])
    store.close()
    calls = contenders(alias, native_url, order, args.store_query)
    counter = itertools.count()
    names = (f"{vendor}-{i}" for i in counter)
    for call in calls.values():  # warm-up
        measure(call, names, args.warmup)
    rates: dict[str, list[float]] = {name: [] for name in calls}
    order_of = list(calls)
    for r in range(args.rounds):
        for name in order_of if r % 2 == 0 else reversed(order_of):
            rates[name].append(measure(calls[name], names, args.seconds))
    return {name: statistics.median(values) for name, values in rates.items()}


def report(vendor: str, medians: dict[str, float]) -> None:
    floor = medians["floor (ORM create in atomic)"]
    view_floor = medians["view floor (RequestFactory)"]
    print(f"\n{vendor}: median calls/s over the rounds (one thread)")
    print(f"{'contender':34} {'calls/s':>9} {'us/call':>9} {'vs floor':>9}")
    for name, rate in medians.items():
        base = view_floor if name.startswith(("view", "middleware")) else floor
        print(f"{name:34} {rate:9.0f} {1e6 / rate:9.1f} {base / rate:8.2f}x")


@contextlib.contextmanager
def postgres(url: str | None) -> Iterator[str]:
    """A new database on the server at ``url`` (else on one started here), dropped after."""
    with contextlib.ExitStack() as stack:
        if url is None:
            sys.path.insert(0, str(_HERE.parent / "tests"))
            from _servers import PostgresServer  # type: ignore[import-not-found]

            url = stack.enter_context(PostgresServer()).url
        import psycopg

        name = f"retrysafe_bench_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        try:
            yield f"{url.rpartition('/')[0]}/{name}"
        finally:
            from django.db import connections

            connections.close_all()
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=1.0, help="length of one measurement")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per contender")
    p.add_argument("--warmup", type=float, default=0.3, help="warm-up seconds per contender")
    p.add_argument("--vendors", default=",".join(VENDORS), help="comma-separated subset")
    p.add_argument("--postgres-url", help="use this PostgreSQL instead of starting one")
    p.add_argument(
        "--prepare-threshold",
        type=int,
        help="PostgreSQL: Django's OPTIONS prepare_threshold (default: unset, Django never "
        "prepares, nor do the store's own connections, which follow the alias)",
    )
    p.add_argument(
        "--store-query",
        default="",
        help="the django:// store's URL query, e.g. prepare_threshold=5 (PostgreSQL: its own "
        "connections prepare their statements)",
    )
    args = p.parse_args(argv)
    vendors = args.vendors.split(",")
    folder = tempfile.mkdtemp(prefix="retrysafe-bench-django-")
    sqlite_path = f"{folder}/shop.sqlite3"
    with postgres(args.postgres_url) if "postgres" in vendors else contextlib.nullcontext() as pg:
        configure(sqlite_path, pg, args.prepare_threshold)
        order = order_model()
        if "sqlite" in vendors:
            report(
                "SQLite", bench_vendor("sqlite", "default", f"sqlite:///{sqlite_path}", order, args)
            )
        if "postgres" in vendors:
            report("PostgreSQL", bench_vendor("postgres", "postgres", pg, order, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
