"""A Django process for tests/test_django_orm.py: ``python run.py COMMAND [ARGS]``.

The database and options come from the environment: ``RS_DB`` (a SQLite path, a
``postgresql://`` or a ``mysql://`` URL), ``RS_ATOMIC`` (``1``: ``ATOMIC_REQUESTS``), ``RS_OPTIONS``
(JSON, merged into ``settings.RETRYSAFE``), ``RS_DB_OPTIONS`` (JSON, merged into the
database's ``OPTIONS``: Django's ``pool``). Commands: ``migrate``, ``serve wsgi|asgi``
(prints ``READY <port>`` once listening), ``scenario NAME [ARGS]`` (prints one JSON
line), ``manage ARGS`` (a management command).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent / "src")]


def database(db: str) -> dict[str, Any]:
    """Django's ``DATABASES["default"]`` for a SQLite path, a PostgreSQL or a MySQL URL
    (mysqlclient, on MySQL or MariaDB)."""
    if db.startswith(("postgresql://", "mysql://")):
        url = urlsplit(db)
        return {
            "ENGINE": f"django.db.backends.{url.scheme}",
            "NAME": url.path.lstrip("/"),
            "USER": url.username or "",
            "HOST": url.hostname or "",
            "PORT": str(url.port or ""),
        }
    # IMMEDIATE: a transaction takes SQLite's write lock up front (no lock upgrade that
    # fails at once under concurrent writers)
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": db,
        "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 30},
    }


def configure() -> None:
    import django
    from django.conf import settings

    default = database(os.environ["RS_DB"])
    default["ATOMIC_REQUESTS"] = os.environ.get("RS_ATOMIC") == "1"
    options = json.loads(os.environ.get("RS_DB_OPTIONS") or "{}")
    if options:
        default["OPTIONS"] = {**default.get("OPTIONS", {}), **options}
    settings.configure(
        DEBUG=False,
        SECRET_KEY="retrysafe-tests",
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF="django_orm_app.views",
        MIDDLEWARE=["retrysafe.django.IdempotencyMiddleware"],
        INSTALLED_APPS=["retrysafe.django", "django_orm_app"],
        # "other": a database the Django store cannot live in (its vendor is "unknown")
        DATABASES={"default": default, "other": {"ENGINE": "django.db.backends.dummy"}},
        RETRYSAFE={
            "store": "django://default",
            "lease": 30,
            "wait": 30,
            **json.loads(os.environ.get("RS_OPTIONS") or "{}"),
        },
        USE_TZ=True,
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        LOGGING_CONFIG=None,
    )
    django.setup()


def serve(kind: str) -> None:
    """Serve the project on a free loopback port; print ``READY <port>`` once it listens."""
    if kind == "wsgi":
        from django.core.handlers.wsgi import WSGIHandler
        from werkzeug.serving import make_server

        server = make_server("127.0.0.1", 0, WSGIHandler(), threaded=True)
        print(f"READY {server.server_port}", flush=True)
        server.serve_forever()
        return
    import socket

    import uvicorn
    from django.core.handlers.asgi import ASGIHandler

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)  # connections queue until uvicorn accepts them
    print(f"READY {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(ASGIHandler(), log_level="warning", lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])


def main(argv: list[str]) -> None:
    configure()
    command, *args = argv
    if command == "migrate":
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        print(json.dumps("migrated"), flush=True)
    elif command == "serve":
        serve(args[0])
    elif command == "scenario":
        from django_orm_app import scenarios

        print(json.dumps(getattr(scenarios, args[0])(*args[1:])), flush=True)
    elif command == "manage":
        from django.core.management import call_command

        call_command(*args)
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
