"""Settings of the example shop: orders once per cart mandate, the idempotency records
in the shop's own database (``django://default``), completed in the view's transaction.

The database is a SQLite file (``$ORDERS_DB``, default ``db.sqlite3`` here), or
PostgreSQL when ``$ORDERS_DATABASE_URL`` is a ``postgresql://user@host:port/name`` URL.
"""

import os
from pathlib import Path
from urllib.parse import urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-a-secret")
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
ROOT_URLCONF = "shop.urls"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"  # (as the migration)

INSTALLED_APPS = [
    "retrysafe.django",  # the records table (manage.py migrate) and the retrysafe_* commands
    "orders",
]

MIDDLEWARE = [
    "retrysafe.django.IdempotencyMiddleware",
]

RETRYSAFE = {
    "store": "django://default",  # the records live next to the orders
    "require_key": True,  # POST /orders without Idempotency-Key: 400
    "wait": 30,  # a duplicate that arrives mid-flight waits for the first answer
    # "transactional": True is the default with a django:// store
}

_url = os.environ.get("ORDERS_DATABASE_URL")
if _url:
    _parts = urlsplit(_url)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": _parts.path.lstrip("/"),
            "USER": _parts.username or "",
            "PASSWORD": _parts.password or "",
            "HOST": _parts.hostname or "",
            "PORT": str(_parts.port or ""),
        }
    }
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ.get("ORDERS_DB", BASE_DIR / "db.sqlite3"),
            # BEGIN IMMEDIATE: a transaction takes SQLite's write lock first, so it never
            # fails half-way when another worker writes (Django 5.1+)
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 20},
        }
    }
