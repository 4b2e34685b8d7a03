"""The Django middleware: settings, sync (WSGI) and async (ASGI) chains, streamed answers.

Django is served for real: its ``WSGIHandler`` on werkzeug's threaded server
and its ``ASGIHandler`` on uvicorn, with the views below (sync and async). The
answers every front door gives alike are in ``test_http.py`` (Django under
WSGI there); the async chain gets the same core checks here.
"""

from __future__ import annotations

import asyncio
import collections
import io
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from wsgiref.util import setup_testing_defaults

import httpx
import pytest
from _hangup import CALLER, cookieless, hang_up, status_of, wait_for
from _http_apps import Counter, django_app
from _http_servers import ThreadServer
from asgiref.sync import iscoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from django.http import (
    FileResponse,
    HttpRequest,
    HttpResponse,
    JsonResponse,
    StreamingHttpResponse,
)
from django.test import RequestFactory, override_settings
from django.urls import path

from retrysafe import Status, Store, open_store
from retrysafe._core.principal import Principal
from retrysafe._core.secret import secret_of
from retrysafe.django import IdempotencyMiddleware

pytestmark = pytest.mark.filterwarnings(
    "ignore:StreamingHttpResponse must consume:Warning"  # async views under WSGI, by design
)

KINDS = ["wsgi", "asgi"]

# -- the views ------------------------------------------------------------------------------

RUNS: collections.Counter[str] = collections.Counter()
_runs_lock = threading.Lock()


def _hit(request: HttpRequest) -> int:
    tid = request.headers.get("x-test-id", "")
    with _runs_lock:
        RUNS[tid] += 1
        return RUNS[tid]


def orders(request: HttpRequest) -> HttpResponse:
    n = _hit(request)
    body = json.loads(request.body) if request.body else None
    response = JsonResponse({"n": n, "body": body}, status=201)
    response["X-Order"] = str(n)
    response.set_cookie("session", "secret-cookie")
    return response


async def aorders(request: HttpRequest) -> HttpResponse:
    return orders(request)


def raw(request: HttpRequest) -> HttpResponse:
    _hit(request)
    return HttpResponse(request.body, content_type="application/octet-stream")


def status(request: HttpRequest, code: int) -> HttpResponse:
    return JsonResponse({"n": _hit(request)}, status=code)


async def boom(request: HttpRequest) -> HttpResponse:
    _hit(request)
    raise RuntimeError("boom")


def _shape(request: HttpRequest) -> tuple[int, int, float]:
    q = request.GET
    return int(q.get("chunks", 10)), int(q.get("size", 1000)), float(q.get("delay", 0))


def stream(request: HttpRequest) -> StreamingHttpResponse:
    _hit(request)
    chunks, size, delay = _shape(request)

    def body() -> Iterator[bytes]:
        for i in range(chunks):
            time.sleep(delay)
            yield bytes([97 + i % 26]) * size

    return StreamingHttpResponse(body(), content_type="text/plain")


async def astream(request: HttpRequest) -> StreamingHttpResponse:
    _hit(request)
    chunks, size, delay = _shape(request)

    async def body() -> AsyncIterator[bytes]:
        for i in range(chunks):
            await asyncio.sleep(delay)
            yield bytes([97 + i % 26]) * size

    return StreamingHttpResponse(body(), content_type="text/plain")


def file(request: HttpRequest) -> FileResponse:
    _hit(request)
    return FileResponse(io.BytesIO(expected(50, 1000)), content_type="application/pdf")


urlpatterns = [
    path("orders", orders),
    path("aorders", aorders),
    path("raw", raw),
    path("status/<int:code>", status),
    path("boom", boom),
    path("stream", stream),
    path("astream", astream),
    path("file", file),
]


def expected(chunks: int, size: int) -> bytes:
    return b"".join(bytes([97 + i % 26]) * size for i in range(chunks))


# -- serving ----------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def django_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Django configured once per process as the shared suite does; this module's views."""
    django_app(Counter(tmp_path_factory.mktemp("unused")), {"store": "memory://"})
    with override_settings(ROOT_URLCONF=__name__):
        yield


def handler(kind: str, **options: Any) -> Any:
    """Django's WSGI or ASGI handler, its middleware configured by ``settings.RETRYSAFE``."""
    from django.core.handlers.asgi import ASGIHandler
    from django.core.handlers.wsgi import WSGIHandler

    with override_settings(RETRYSAFE=options):
        return WSGIHandler() if kind == "wsgi" else ASGIHandler()


def serve(kind: str, **options: Any) -> ThreadServer:
    app = handler(kind, **options)
    store = options.get("store")
    if kind == "asgi" and isinstance(store, Store):
        app = _closing(app, store)
    return ThreadServer(app, kind)


def _closing(app: Any, store: Store[Any]) -> Any:
    """``app``, closing the store's connections of the server's event loop when it stops."""

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)
        while (await receive())["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        await store.aclose()
        await send({"type": "lifespan.shutdown.complete"})

    return asgi


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def keyed(tid: str, key: str | None = None, **extra: str) -> dict[str, str]:
    return {"x-test-id": tid, "idempotency-key": key or f"key-{tid}", **CALLER, **extra}


def problem(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["code"] == code


# -- replays ------------------------------------------------------------------------------------


@pytest.mark.parametrize("view", ["orders", "aorders"])
def test_replay_is_byte_for_byte_and_the_cookie_only_first(
    kind: str, view: str, store: Store[Any], tid: str
) -> None:
    with (
        serve(kind, store=store) as server,
        httpx.Client(base_url=server.url, cookies=cookieless()) as client,
    ):
        first = client.post(f"/{view}", json={"item": "book"}, headers=keyed(tid))
        again = client.post(f"/{view}", json={"item": "book"}, headers=keyed(tid))
    assert first.status_code == again.status_code == 201
    assert first.json() == {"n": 1, "body": {"item": "book"}}
    assert first.headers["set-cookie"].startswith("session=secret-cookie")
    assert "idempotent-replayed" not in first.headers
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["content-type"] == "application/json"
    assert again.headers["x-order"] == "1"
    assert "set-cookie" not in again.headers
    assert RUNS[tid] == 1
    assert status_of(store, f"key-{tid}") is Status.COMPLETED


def test_a_cookie_is_replayed_when_store_headers_allow_it(
    kind: str, memory: Store[Any], tid: str
) -> None:
    allowed = ["content-type", "x-order", "set-cookie"]
    with serve(kind, store=memory, store_headers=allowed) as server:
        first = httpx.post(server.url + "/orders", json={}, headers=keyed(tid))
        again = httpx.post(server.url + "/orders", json={}, headers=keyed(tid))
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["set-cookie"] == first.headers["set-cookie"]
    assert again.cookies["session"] == "secret-cookie"
    assert RUNS[tid] == 1


def test_the_async_chain_gives_the_same_answers(memory: Store[Any], tid: str) -> None:
    """What test_http.py checks for Django under WSGI, briefly, for Django under ASGI."""
    with serve("asgi", store=memory, max_request_body=1000) as server:
        url = server.url
        assert httpx.post(url + "/orders", json={"a": 1}, headers=keyed(tid)).status_code == 201
        problem(
            httpx.post(url + "/orders", json={"a": 2}, headers=keyed(tid)),
            422,
            "idempotency_conflict",
        )
        bad = {"x-test-id": tid, "idempotency-key": "a, b"}
        problem(httpx.post(url + "/orders", json={}, headers=bad), 400, "idempotency_key_invalid")
        problem(
            httpx.post(url + "/raw", content=b"x" * 5000, headers=keyed(tid, "big")),
            413,
            "idempotency_body_too_large",
        )
        for n in (2, 3):  # a 5xx and an exception stay retryable
            assert httpx.post(url + "/status/503", headers=keyed(tid, "5xx")).status_code == 503
            assert RUNS[tid] == n
        for n in (4, 5):
            assert httpx.post(url + "/boom", headers=keyed(tid, "boom")).status_code == 500
            assert RUNS[tid] == n
        assert httpx.post(url + "/orders", json={}, headers={"x-test-id": tid}).status_code == 201
        assert RUNS[tid] == 6  # no key: passed through
    with serve("asgi", store=memory, require_key=True) as server:
        problem(
            httpx.post(server.url + "/orders", json={}, headers={"x-test-id": tid}),
            400,
            "idempotency_key_required",
        )
    assert RUNS[tid] == 6


# -- streamed answers -------------------------------------------------------------------------


@pytest.mark.parametrize("view", ["stream", "astream"])
def test_streamed_answers_are_replayed_and_big_ones_stream_intact(
    kind: str, view: str, memory: Store[Any], tid: str
) -> None:
    with serve(kind, store=memory, max_body=100_000) as server:
        small = f"{server.url}/{view}?chunks=40&size=1000"
        first = httpx.post(small, headers=keyed(tid, "small"))
        again = httpx.post(small, headers=keyed(tid, "small"))
        big = f"{server.url}/{view}?chunks=300&size=4096"
        big_first = httpx.post(big, headers=keyed(tid, "big"))
        big_again = httpx.post(big, headers=keyed(tid, "big"))
    assert first.content == again.content == expected(40, 1000)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["content-type"] == "text/plain"
    assert big_first.status_code == 200 and big_first.content == expected(300, 4096)
    assert big_again.status_code == 200 and big_again.content == b""
    assert big_again.headers["idempotent-body-omitted"] == "true"
    assert big_again.headers["idempotent-replayed"] == "true"
    assert RUNS[tid] == 2


def test_a_file_response_is_recorded_not_handed_to_the_server(
    kind: str, memory: Store[Any], tid: str
) -> None:
    with serve(kind, store=memory, max_body=10_000) as server:
        first = httpx.post(server.url + "/file", headers=keyed(tid))
        again = httpx.post(server.url + "/file", headers=keyed(tid))
    assert first.content == expected(50, 1000) and first.headers["content-length"] == "50000"
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["idempotent-body-omitted"] == "true"
    assert "content-type" not in again.headers
    assert RUNS[tid] == 1


def test_a_file_response_does_not_go_to_wsgi_file_wrapper(memory: Store[Any], tid: str) -> None:
    """A server's file wrapper would send the file past the middleware, unrecorded."""
    environ: dict[str, Any] = {}
    setup_testing_defaults(environ)
    environ.update(
        REQUEST_METHOD="POST",
        PATH_INFO="/file",
        HTTP_IDEMPOTENCY_KEY="k",
        HTTP_X_TEST_ID=tid,
        CONTENT_LENGTH="0",
        HTTP_AUTHORIZATION=CALLER["authorization"],
    )
    environ["wsgi.file_wrapper"] = lambda *args: pytest.fail("handed to wsgi.file_wrapper")
    app = handler("wsgi", store=memory)
    response = app(environ, lambda status, headers: None)
    assert b"".join(response) == expected(50, 1000)
    response.close()
    assert status_of(memory, "k") is Status.COMPLETED


@pytest.mark.parametrize("view", ["stream", "astream"])
def test_a_client_that_leaves_mid_stream_still_gets_the_replay(
    kind: str, view: str, store: Store[Any], tid: str
) -> None:
    target = f"/{view}?chunks=200&size=1000&delay=0.005"
    with serve(kind, store=store, max_body=10_000) as server:
        assert hang_up(server.port, target, keyed(tid)).startswith(b"HTTP/1.1 200")
        wait_for(store, f"key-{tid}", Status.COMPLETED)
        again = httpx.post(server.url + target, headers=keyed(tid))
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.headers["idempotent-body-omitted"] == "true"
    assert RUNS[tid] == 1


def _request(key: str = "k") -> HttpRequest:
    return RequestFactory().post(
        "/x",
        b"",
        content_type="application/octet-stream",
        headers={"idempotency-key": key, **CALLER},
    )


def test_a_sync_stream_is_recorded_before_its_last_chunk(store: Store[Any]) -> None:
    def view(request: HttpRequest) -> StreamingHttpResponse:
        return StreamingHttpResponse(bytes([97 + i]) * 50 for i in range(10))

    middleware = IdempotencyMiddleware(view, store=store, max_body=100)
    response = middleware(_request())
    seen = [(chunk, status_of(store, "k")) for chunk in response]
    response.close()
    assert b"".join(c for c, _ in seen) == expected(10, 50)
    assert [s for _, s in seen] == [Status.PROCESSING] * 9 + [Status.COMPLETED]


async def test_an_async_stream_is_recorded_before_its_last_chunk(memory: Store[Any]) -> None:
    async def body() -> AsyncIterator[bytes]:
        for i in range(10):
            yield bytes([97 + i]) * 50

    async def view(request: HttpRequest) -> StreamingHttpResponse:
        return StreamingHttpResponse(body())

    middleware = IdempotencyMiddleware(view, store=memory, max_body=100)
    assert iscoroutinefunction(middleware)
    response = await middleware(_request())
    seen = [(chunk, status_of(memory, "k")) async for chunk in response]
    assert b"".join(c for c, _ in seen) == expected(10, 50)
    assert [s for _, s in seen] == [Status.PROCESSING] * 9 + [Status.COMPLETED]


def test_the_view_iterator_is_read_to_its_end_before_it_is_closed(memory: Store[Any]) -> None:
    made, closed = [], []

    def body() -> Iterator[bytes]:
        try:
            for i in range(100):
                made.append(i)
                yield b"x" * 1000
        finally:
            closed.append(len(made))

    def view(request: HttpRequest) -> StreamingHttpResponse:
        return StreamingHttpResponse(body())

    response = IdempotencyMiddleware(view, store=memory, max_body=5000)(_request())
    chunks = iter(response)
    next(chunks), next(chunks)
    response.close()  # as a WSGI server does when the client has gone
    assert closed == [100]  # read to its end first, closed after
    assert status_of(memory, "k") is Status.COMPLETED


# -- request bodies ---------------------------------------------------------------------------


def test_a_body_over_data_upload_max_memory_size_is_413(
    kind: str, memory: Store[Any], tid: str
) -> None:
    with serve(kind, store=memory) as server, override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000):
        response = httpx.post(server.url + "/raw", content=b"x" * 5000, headers=keyed(tid))
        problem(response, 413, "idempotency_body_too_large")
        assert "DATA_UPLOAD_MAX_MEMORY_SIZE" in response.json()["detail"]
        small = httpx.post(server.url + "/raw", content=b"y" * 500, headers=keyed(tid))
        assert small.status_code == 200 and small.content == b"y" * 500
    assert RUNS[tid] == 1


# -- settings ---------------------------------------------------------------------------------


def test_settings_drive_the_middleware(kind: str, tmp_path: Path, tid: str) -> None:
    url = f"sqlite:///{tmp_path}/django.db"
    options = {"store": url, "require_key": True, "header": "X-Request-Key", "methods": ["PUT"]}
    with serve(kind, **options) as server:
        response = httpx.put(server.url + "/raw", content=b"a", headers={"x-test-id": tid})
        problem(response, 400, "idempotency_key_required")
        assert "X-Request-Key" in response.json()["detail"]
        headers = {"x-test-id": tid, "x-request-key": f"k-{tid}", **CALLER}
        for _ in range(2):
            assert httpx.put(server.url + "/raw", content=b"a", headers=headers).content == b"a"
        assert httpx.post(server.url + "/raw", content=b"b", headers=headers).status_code == 200
    assert RUNS[tid] == 2  # one PUT (then its replay) and the unprotected POST
    store = open_store(url)
    assert status_of(store, f"k-{tid}") is Status.COMPLETED
    store.close()


def tenant(request: Any) -> str | None:
    """A ``principal`` named by its dotted path in the settings."""
    assert isinstance(request.native, HttpRequest)
    return request.headers.get("x-tenant")


def test_principal_by_dotted_path(kind: str, memory: Store[Any], tid: str) -> None:
    with serve(kind, store=memory, principal=f"{__name__}.tenant") as server:
        for t in ("t1", "t2", "t1"):
            httpx.post(server.url + "/raw", content=b"a", headers=keyed(tid, **{"x-tenant": t}))
    assert RUNS[tid] == 2
    t2 = Principal("principal", "t2").scope(secret_of(memory))
    assert status_of(memory, f"key-{tid}", scope=t2) is Status.COMPLETED


def test_the_store_defaults_to_retrysafe_store(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tid: str
) -> None:
    url = f"sqlite:///{tmp_path}/env.db"
    monkeypatch.setenv("RETRYSAFE_STORE", url)
    with serve("wsgi") as server:
        for _ in range(2):
            httpx.post(server.url + "/raw", content=b"a", headers=keyed(tid))
    assert RUNS[tid] == 1
    store = open_store(url)
    assert status_of(store, f"key-{tid}") is Status.COMPLETED
    store.close()


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("redis://localhost", "settings.RETRYSAFE must be a dict"),
        ({"stor": "memory://"}, "unknown option.*'stor'.*the options are store, methods"),
        ({"duplicate_response": "always"}, 'RETRYSAFE: duplicate_response must be "replay"'),
        ({"require_key": 1}, "RETRYSAFE: require_key must be a bool or a callable"),
        ({"store": "mongodb://db"}, "RETRYSAFE: unknown store URL"),
        ({"ttl": "1h"}, "RETRYSAFE: ttl must be a number of seconds"),
        ({"principal": "nowhere.who"}, "RETRYSAFE: principal 'nowhere.who' is not the dotted path"),
        (
            {"store": "memory://", "map": "/nonexistent/idempotency.toml"},
            "RETRYSAFE: .*idempotency.toml",
        ),
    ],
    ids=[
        "not-a-dict",
        "unknown-name",
        "bad-choice",
        "bad-type",
        "bad-url",
        "bad-ttl",
        "bad-path",
        "missing-map",
    ],
)
def test_a_bad_setting_is_a_clear_error_when_django_loads(setting: Any, message: str) -> None:
    from django.core.handlers.wsgi import WSGIHandler

    with override_settings(RETRYSAFE=setting), pytest.raises(ImproperlyConfigured, match=message):
        WSGIHandler()


def test_keyword_options_take_precedence_over_settings(memory: Store[Any]) -> None:
    with override_settings(RETRYSAFE={"store": "mongodb://never-opened", "methods": ["PUT"]}):
        middleware = IdempotencyMiddleware(lambda request: HttpResponse(b"ok"), store=memory)
    assert middleware.policy.methods == {"PUT"}
    assert middleware.policy.engine.store is memory
    assert not iscoroutinefunction(middleware)


def test_a_stored_answer_becomes_exactly_its_django_response() -> None:
    from retrysafe._http.problems import Response
    from retrysafe.django import _answer

    stored = Response(
        201,
        [
            ("x-order", "a"),
            ("Vary", "Accept"),
            ("vary", "Cookie"),
            ("set-cookie", "session=s1; Path=/"),
            ("idempotent-replayed", "true"),
        ],
        b"body",
    )
    response = _answer(stored)
    assert response.status_code == 201 and response.content == b"body"
    assert "Content-Type" not in response  # only the answer's own headers
    assert list(response.items()) == [
        ("x-order", "a"),
        ("Vary", "Accept, Cookie"),  # repeated lines joined, the first spelling kept
        ("idempotent-replayed", "true"),
    ]
    assert response.cookies["session"].value == "s1"
    typed = _answer(Response(200, [("content-type", "application/json")], b"{}"))
    assert typed["Content-Type"] == "application/json"
