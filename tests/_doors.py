"""Every HTTP front door, serving the test API on a real loopback server.

:func:`build` puts the test API of ``_http_apps`` behind one front door
(Starlette, FastAPI, Flask, Django, or the gateway in front of a real upstream
process); :class:`Door` is one door on one store, and the ``door`` fixture of
``conftest.py`` serves each door on each store for a whole test module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from _http_apps import Counter, django_app, fastapi_app, flask_app, starlette_app
from _http_servers import ThreadServer

from retrysafe import Store

DOORS = ["starlette", "fastapi", "flask", "django", "gateway"]


def build(
    door: str, counter: Counter, store: Store[Any], upstream: str | None, **options: Any
) -> tuple[Any, str]:
    """The test API behind front door ``door``, and its kind (asgi or wsgi)."""
    if door in ("starlette", "fastapi"):
        from retrysafe.asgi import IdempotencyMiddleware

        app = starlette_app(counter) if door == "starlette" else fastapi_app(counter)
        app.add_middleware(IdempotencyMiddleware, store=store, **options)
        return app, "asgi"
    if door == "flask":
        from retrysafe.wsgi import IdempotencyMiddleware as WsgiMiddleware

        app = flask_app(counter)
        app.wsgi_app = WsgiMiddleware(app.wsgi_app, store=store, **options)  # type: ignore[method-assign]
        return app, "wsgi"
    if door == "django":
        return django_app(counter, {"store": store, **options}), "wsgi"
    if door == "gateway":
        from retrysafe.gateway import create_app

        assert upstream is not None
        return create_app(upstream, store=store, **options), "asgi"
    raise AssertionError(door)


@dataclass
class Door:
    """One front door on one store, served for a whole module; ``serve`` makes variants."""

    name: str
    spec: Any  # conftest.StoreSpec
    store: Store[Any]
    counter: Counter
    upstream: str | None
    url: str = ""

    @contextlib.contextmanager
    def serve(self, **options: Any) -> Iterator[str]:
        app, kind = build(self.name, self.counter, self.store, self.upstream, **options)
        with ThreadServer(app, kind) as server:
            yield server.url
