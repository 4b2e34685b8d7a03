"""One test API, written in every framework the HTTP front doors serve.

Each handler counts its runs in a file per test id (``X-Test-Id``), so a test
can tell how often a side effect ran, even across worker processes:

- ``POST|PATCH|PUT /orders``: 201 JSON ``{"n": runs, "body": <json body>}``,
  with ``X-Order: n`` and a ``Set-Cookie`` that must never be stored;
- ``POST /raw``: 200, the request body echoed as octet-stream;
- ``POST /status/<code>``: that status, JSON body;
- ``POST /boom``: raises;
- ``POST /slow?ms=N``: sleeps, then 200 JSON; ``POST /slow?gate=NAME``: held until the
  test calls ``counter.open_gate(NAME)`` (a minute at most), then 200 JSON;
- ``POST /stream?chunks=N&size=M``: N chunks of M bytes, streamed;
- ``GET /count/<id>``: ``{"n": runs}``.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# FastAPI reads handler annotations at runtime: its Request must be a module global.
from fastapi import Request as FastAPIRequest
from fastapi.responses import Response as FastAPIResponse

FRAMEWORKS = ["starlette", "fastapi", "flask", "django"]


class Counter:
    """Run counts in a directory: one file per test id, one byte per run (O_APPEND)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, test_id: str) -> Path:
        safe = "".join(c for c in test_id if c.isalnum() or c in "-_") or "default"
        return self.root / safe

    def hit(self, test_id: str | None) -> int:
        fd = os.open(self._path(test_id or "default"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, b"x")
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def count(self, test_id: str) -> int:
        try:
            return self._path(test_id).stat().st_size
        except FileNotFoundError:
            return 0

    def open_gate(self, name: str) -> None:
        """Let the requests held at gate ``name`` (``/slow?gate=name``) answer."""
        self._path(f"gate-{name}").touch()

    def pauses(self, query: dict[str, str]) -> Iterator[float]:
        """The pauses of ``/slow``: ``ms`` milliseconds, or until the test opens ``gate``
        (a file, so the gateway's upstream process sees it; at most a minute, so that a
        failed test does not leave a request hanging)."""
        gate = query.get("gate")
        if gate is None:
            yield int(query.get("ms", 500)) / 1000
            return
        opened, deadline = self._path(f"gate-{gate}"), time.monotonic() + 60
        while not opened.exists() and time.monotonic() < deadline:
            yield 0.005


def _json(body: bytes) -> Any:
    return json.loads(body) if body else None


def _stream_params(query: dict[str, str]) -> tuple[int, int]:
    return int(query.get("chunks", 10)), int(query.get("size", 1000))


COOKIE = "session=secret-cookie; Path=/"


# -- Starlette and FastAPI ------------------------------------------------------------


def starlette_app(counter: Counter) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def orders(request: Request) -> Response:
        n = counter.hit(request.headers.get("x-test-id"))
        body = _json(await request.body())
        return JSONResponse(
            {"n": n, "body": body}, 201, headers={"x-order": str(n), "set-cookie": COOKIE}
        )

    async def raw(request: Request) -> Response:
        counter.hit(request.headers.get("x-test-id"))
        return Response(await request.body(), 200, media_type="application/octet-stream")

    async def status(request: Request) -> Response:
        n = counter.hit(request.headers.get("x-test-id"))
        code = int(request.path_params["code"])
        return JSONResponse({"n": n, "status": code}, code)

    async def boom(request: Request) -> Response:
        counter.hit(request.headers.get("x-test-id"))
        raise RuntimeError("boom")

    async def slow(request: Request) -> Response:
        await request.body()
        for pause in counter.pauses(dict(request.query_params)):
            await asyncio.sleep(pause)
        n = counter.hit(request.headers.get("x-test-id"))
        return JSONResponse({"n": n}, 200, headers={"x-pid": str(os.getpid())})

    async def stream(request: Request) -> Response:
        counter.hit(request.headers.get("x-test-id"))
        chunks, size = _stream_params(dict(request.query_params))

        async def body() -> Any:
            for i in range(chunks):
                yield bytes([97 + i % 26]) * size

        return StreamingResponse(body(), 200, media_type="text/plain")

    async def count(request: Request) -> Response:
        return JSONResponse({"n": counter.count(request.path_params["test_id"])})

    return Starlette(
        routes=[
            Route("/orders", orders, methods=["POST", "PATCH", "PUT"]),
            Route("/raw", raw, methods=["POST"]),
            Route("/status/{code}", status, methods=["POST"]),
            Route("/boom", boom, methods=["POST"]),
            Route("/slow", slow, methods=["POST"]),
            Route("/stream", stream, methods=["POST"]),
            Route("/count/{test_id}", count, methods=["GET"]),
        ]
    )


def fastapi_app(counter: Counter) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI()

    async def orders(request: FastAPIRequest) -> FastAPIResponse:
        n = counter.hit(request.headers.get("x-test-id"))
        body = _json(await request.body())
        return JSONResponse(
            {"n": n, "body": body}, 201, headers={"x-order": str(n), "set-cookie": COOKIE}
        )

    for method in ("POST", "PATCH", "PUT"):
        app.add_api_route(
            "/orders",
            orders,
            methods=[method],
            status_code=201,
            operation_id=f"orders_{method.lower()}",
        )

    @app.post("/raw")
    async def raw(request: FastAPIRequest) -> FastAPIResponse:
        counter.hit(request.headers.get("x-test-id"))
        return Response(await request.body(), 200, media_type="application/octet-stream")

    @app.post("/status/{code}")
    async def status(code: int, request: FastAPIRequest) -> FastAPIResponse:
        n = counter.hit(request.headers.get("x-test-id"))
        return JSONResponse({"n": n, "status": code}, code)

    @app.post("/boom")
    async def boom(request: FastAPIRequest) -> FastAPIResponse:
        counter.hit(request.headers.get("x-test-id"))
        raise RuntimeError("boom")

    @app.post("/slow")
    async def slow(request: FastAPIRequest, ms: int = 500) -> FastAPIResponse:
        for pause in counter.pauses(dict(request.query_params)):
            await asyncio.sleep(pause)
        n = counter.hit(request.headers.get("x-test-id"))
        return JSONResponse({"n": n}, 200)

    @app.post("/stream")
    async def stream(
        request: FastAPIRequest, chunks: int = 10, size: int = 1000
    ) -> FastAPIResponse:
        counter.hit(request.headers.get("x-test-id"))

        async def body() -> Any:
            for i in range(chunks):
                yield bytes([97 + i % 26]) * size

        return StreamingResponse(body(), 200, media_type="text/plain")

    @app.get("/count/{test_id}")
    async def count(test_id: str) -> dict[str, int]:
        return {"n": counter.count(test_id)}

    return app


# -- Flask ----------------------------------------------------------------------------


def flask_app(counter: Counter) -> Any:
    from flask import Flask, Response, request

    app = Flask("retrysafe-test")

    def tid() -> str | None:
        return request.headers.get("x-test-id")

    @app.route("/orders", methods=["POST", "PATCH", "PUT"])
    def orders() -> Response:
        n = counter.hit(tid())
        body = json.dumps({"n": n, "body": _json(request.get_data())})
        return Response(
            body, 201, {"x-order": str(n), "set-cookie": COOKIE}, mimetype="application/json"
        )

    @app.post("/raw")
    def raw() -> Response:
        counter.hit(tid())
        return Response(request.get_data(), 200, mimetype="application/octet-stream")

    @app.post("/status/<int:code>")
    def status(code: int) -> Response:
        n = counter.hit(tid())
        return Response(json.dumps({"n": n, "status": code}), code, mimetype="application/json")

    @app.post("/boom")
    def boom() -> Response:
        counter.hit(tid())
        raise RuntimeError("boom")

    @app.post("/slow")
    def slow() -> Response:
        request.get_data()
        for pause in counter.pauses(request.args.to_dict()):
            time.sleep(pause)
        n = counter.hit(tid())
        return Response(
            json.dumps({"n": n}), 200, {"x-pid": str(os.getpid())}, mimetype="application/json"
        )

    @app.post("/stream")
    def stream() -> Response:
        counter.hit(tid())
        chunks, size = _stream_params(request.args.to_dict())

        def body() -> Any:
            for i in range(chunks):
                yield bytes([97 + i % 26]) * size

        return Response(body(), 200, mimetype="text/plain")

    @app.get("/count/<test_id>")
    def count(test_id: str) -> Response:
        return Response(json.dumps({"n": counter.count(test_id)}), mimetype="application/json")

    return app


# -- Django ---------------------------------------------------------------------------

_django_counter: Counter | None = None


def _django_views() -> list[Any]:
    from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
    from django.urls import path
    from django.views.decorators.csrf import csrf_exempt

    def tid(request: Any) -> str | None:
        return request.headers.get("x-test-id")

    def hit(request: Any) -> int:
        assert _django_counter is not None
        return _django_counter.hit(tid(request))

    def orders(request: Any) -> HttpResponse:
        n = hit(request)
        response = JsonResponse({"n": n, "body": _json(request.body)}, status=201)
        response["X-Order"] = str(n)
        response.set_cookie("session", "secret-cookie")
        return response

    def raw(request: Any) -> HttpResponse:
        hit(request)
        return HttpResponse(request.body, content_type="application/octet-stream")

    def status(request: Any, code: int) -> HttpResponse:
        n = hit(request)
        return JsonResponse({"n": n, "status": code}, status=code)

    def boom(request: Any) -> HttpResponse:
        hit(request)
        raise RuntimeError("boom")

    def slow(request: Any) -> HttpResponse:
        assert _django_counter is not None
        for pause in _django_counter.pauses(request.GET.dict()):
            time.sleep(pause)
        return JsonResponse({"n": hit(request)}, headers={"x-pid": str(os.getpid())})

    def stream(request: Any) -> HttpResponse:
        hit(request)
        chunks, size = _stream_params(request.GET.dict())
        body = (bytes([97 + i % 26]) * size for i in range(chunks))
        return StreamingHttpResponse(body, content_type="text/plain")

    def count(request: Any, test_id: str) -> HttpResponse:
        assert _django_counter is not None
        return JsonResponse({"n": _django_counter.count(test_id)})

    views = [
        ("orders", orders),
        ("raw", raw),
        ("status/<int:code>", status),
        ("boom", boom),
        ("slow", slow),
        ("stream", stream),
        ("count/<str:test_id>", count),
    ]
    return [path(route, csrf_exempt(view)) for route, view in views]


def django_app(counter: Counter, options: dict[str, Any]) -> Any:
    """A Django WSGI handler with the middleware configured from ``settings.RETRYSAFE``."""
    global _django_counter
    import django
    from django.conf import settings

    _django_counter = counter
    if not settings.configured:
        # Users and sessions (tests/test_principals.py logs users in) live in a
        # SQLite file of this process's own, migrated by the tests that use it.
        folder = tempfile.mkdtemp(prefix="retrysafe-django-")
        atexit.register(shutil.rmtree, folder, True)
        settings.configure(
            DEBUG=False,
            SECRET_KEY="retrysafe-tests",
            ALLOWED_HOSTS=["*"],
            ROOT_URLCONF=__name__,
            MIDDLEWARE=["retrysafe.django.IdempotencyMiddleware"],
            INSTALLED_APPS=[
                "django.contrib.auth",
                "django.contrib.contenttypes",
                "django.contrib.sessions",
            ],
            DATABASES={
                "default": {
                    "ENGINE": "django.db.backends.sqlite3",
                    "NAME": os.path.join(folder, "django.sqlite3"),
                }
            },
            PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"],
            DATA_UPLOAD_MAX_MEMORY_SIZE=None,
            LOGGING_CONFIG=None,
            USE_TZ=True,
        )
        django.setup()
    from django.core.handlers.wsgi import WSGIHandler
    from django.test import override_settings

    with override_settings(RETRYSAFE=options):
        return WSGIHandler()


def __getattr__(name: str) -> Any:  # Django's URLconf, built on first use
    if name == "urlpatterns":
        patterns = _django_views()
        globals()["urlpatterns"] = patterns
        return patterns
    raise AttributeError(name)


def upstream_from_env() -> Any:
    """The Starlette test API with no middleware: the gateway's upstream process."""
    return starlette_app(Counter(os.environ["RETRYSAFE_TEST_COUNTERS"]))


def _env() -> tuple[Counter, dict[str, Any]]:
    return Counter(os.environ["RETRYSAFE_TEST_COUNTERS"]), {
        "store": os.environ["RETRYSAFE_TEST_STORE"]
    }


def starlette_from_env() -> Any:
    """The protected Starlette API, for worker processes (uvicorn --factory), with
    retrysafe's metrics at ``/_metrics/``."""
    from starlette.routing import Mount

    from retrysafe.asgi import IdempotencyMiddleware
    from retrysafe.metrics import MetricsApp

    counter, options = _env()
    app = starlette_app(counter)
    app.router.routes.append(Mount("/_metrics", app=MetricsApp(token=None, loopback=True)))
    app.add_middleware(IdempotencyMiddleware, **options)
    return app


def _with_metrics(app: Any) -> Any:
    """A WSGI app with retrysafe's metrics at ``/_metrics/``."""
    from werkzeug.middleware.dispatcher import DispatcherMiddleware

    from retrysafe.metrics import wsgi_app

    return DispatcherMiddleware(app, {"/_metrics": wsgi_app(token=None, loopback=True)})


def flask_from_env() -> Any:
    """The protected Flask API, for worker processes (gunicorn), with metrics."""
    from retrysafe.wsgi import IdempotencyMiddleware

    counter, options = _env()
    app = flask_app(counter)
    app.wsgi_app = _with_metrics(IdempotencyMiddleware(app.wsgi_app, **options))
    return app


def django_from_env() -> Any:
    """The protected Django API, for worker processes (gunicorn), with metrics."""
    counter, options = _env()
    return _with_metrics(django_app(counter, options))
