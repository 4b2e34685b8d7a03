"""The WSGI middleware: Flask on a real threaded server, and the WSGI details called directly.

The answers every front door gives alike are in ``test_http.py``; these are
the WSGI-specific cases: ``write()``, ``exc_info``, lazy ``start_response``,
``close()``, the hold-back of a streamed answer, client disconnects and
chunked request bodies.
"""

from __future__ import annotations

import io
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.util import setup_testing_defaults

import httpx
import pytest
from _hangup import CALLER, cookieless, hang_up, status_of, wait_for
from _http_apps import Counter, flask_app
from _http_servers import ThreadServer

from retrysafe import Status, Store
from retrysafe.wsgi import IdempotencyMiddleware

WSGIApp = Callable[..., Iterable[bytes]]


def keyed(tid: str, key: str | None = None) -> dict[str, str]:
    return {"x-test-id": tid, "idempotency-key": key or f"key-{tid}", **CALLER}


# -- Flask on a real server ---------------------------------------------------------------


def flask(counter: Counter, store: Store[Any], **options: Any) -> ThreadServer:
    """The shared test API in Flask, plus ``/drip``: a slow stream, for disconnects."""
    from flask import Response, request

    app = flask_app(counter)

    def drip() -> Response:
        counter.hit(request.headers.get("x-test-id"))
        chunks, size = int(request.args["chunks"]), int(request.args["size"])

        def body() -> Iterator[bytes]:
            for i in range(chunks):
                time.sleep(0.005)
                yield bytes([97 + i % 26]) * size

        return Response(body(), 200, mimetype="text/plain")

    app.add_url_rule("/drip", view_func=drip, methods=["POST"])
    app.wsgi_app = IdempotencyMiddleware(app.wsgi_app, store=store, **options)  # type: ignore[method-assign]
    return ThreadServer(app, "wsgi")


def test_flask_replays_byte_for_byte_without_the_cookie(
    store: Store[Any], counter: Counter, tid: str
) -> None:
    with (
        flask(counter, store) as server,
        httpx.Client(base_url=server.url, cookies=cookieless()) as client,
    ):
        first = client.post("/orders", json={"item": "book"}, headers=keyed(tid))
        again = client.post("/orders", json={"item": "book"}, headers=keyed(tid))
    assert first.status_code == again.status_code == 201
    assert first.headers["set-cookie"].startswith("session=secret-cookie")
    assert "idempotent-replayed" not in first.headers
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["content-type"] == first.headers["content-type"]
    assert again.headers["x-order"] == "1"
    assert "set-cookie" not in again.headers
    assert counter.count(tid) == 1
    assert status_of(store, f"key-{tid}") is Status.COMPLETED


def test_a_big_stream_reaches_the_client_intact_and_replays_without_body(
    store: Store[Any], counter: Counter, tid: str
) -> None:
    expected = b"".join(bytes([97 + i % 26]) * 4096 for i in range(300))  # 1.2 MB
    with flask(counter, store, max_body=100_000) as server:
        first = httpx.post(server.url + "/stream?chunks=300&size=4096", headers=keyed(tid))
        again = httpx.post(server.url + "/stream?chunks=300&size=4096", headers=keyed(tid))
    assert first.status_code == 200 and first.content == expected
    assert first.headers["content-type"].startswith("text/plain")
    assert again.status_code == 200 and again.content == b""
    assert again.headers["idempotent-body-omitted"] == "true"
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["content-length"] == "0"
    assert "content-type" not in again.headers  # it described the body that is not there
    assert counter.count(tid) == 1


def test_a_client_that_leaves_mid_stream_still_gets_the_replay(
    store: Store[Any], counter: Counter, tid: str
) -> None:
    with flask(counter, store, max_body=10_000) as server:
        got = hang_up(server.port, "/drip?chunks=200&size=1000", keyed(tid))
        assert got.startswith(b"HTTP/1.1 200")
        wait_for(store, f"key-{tid}", Status.COMPLETED)
        again = httpx.post(server.url + "/drip?chunks=200&size=1000", headers=keyed(tid))
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.headers["idempotent-body-omitted"] == "true"
    assert counter.count(tid) == 1


def _chunked(data: bytes, size: int = 1000) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def test_a_chunked_request_body_is_read_whole(
    memory: Store[Any], counter: Counter, tid: str
) -> None:
    data = bytes(range(256)) * 40
    with (
        flask(counter, memory) as server,
        httpx.Client(base_url=server.url, cookies=cookieless()) as client,
    ):
        first = client.post("/raw", content=_chunked(data), headers=keyed(tid))
        assert first.request.headers["transfer-encoding"] == "chunked"
        again = client.post("/raw", content=_chunked(data), headers=keyed(tid))
        other = client.post("/raw", content=_chunked(data + b"!"), headers=keyed(tid))
    assert first.status_code == 200 and first.content == data  # the app read the body too
    assert again.headers["idempotent-replayed"] == "true" and again.content == data
    assert other.status_code == 422 and other.json()["code"] == "idempotency_conflict"
    assert counter.count(tid) == 1


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_max_request_body_is_413_and_nothing_runs(
    memory: Store[Any], counter: Counter, tid: str, chunked: bool
) -> None:
    data = b"x" * 5000
    with flask(counter, memory, max_request_body=1000) as server:
        content = _chunked(data) if chunked else data
        response = httpx.post(server.url + "/raw", content=content, headers=keyed(tid))
        assert response.status_code == 413
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["code"] == "idempotency_body_too_large"
        assert status_of(memory, f"key-{tid}") is None
        small = httpx.post(server.url + "/raw", content=_chunked(b"y" * 900), headers=keyed(tid))
        assert small.status_code == 200 and small.content == b"y" * 900
    assert counter.count(tid) == 1


def test_the_legacy_write_callable_on_a_real_server(memory: Store[Any], tid: str) -> None:
    runs: list[int] = []

    def legacy(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        runs.append(1)
        write = start_response("201 Created", [("Content-Type", "text/plain")])
        write(b"written ")
        write(b"first, ")
        return [b"then ", b"returned"]

    app = IdempotencyMiddleware(legacy, store=memory)
    with ThreadServer(app, "wsgi") as server:
        first = httpx.post(server.url + "/", headers=keyed(tid))
        again = httpx.post(server.url + "/", headers=keyed(tid))
    assert first.status_code == again.status_code == 201
    assert first.content == again.content == b"written first, then returned"
    assert again.headers["idempotent-replayed"] == "true"
    assert len(runs) == 1


# -- WSGI details, called as a server would -----------------------------------------------


class Server:
    """Calls a WSGI app as a server does and keeps what it was given."""

    def __init__(self, app: WSGIApp) -> None:
        self.app = app
        self.status: str | None = None
        self.headers: dict[str, str] = {}
        self.on_start: Callable[[], None] = lambda: None

    def start_response(
        self, status: str, headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Any:
        self.on_start()
        self.status, self.headers = status, {k.lower(): v for k, v in headers}
        return lambda data: pytest.fail("the middleware must not use the server's write()")

    def call(
        self, body: bytes = b"", key: str | None = "k", method: str = "POST"
    ) -> Iterable[bytes]:
        environ: dict[str, Any] = {}
        setup_testing_defaults(environ)
        environ.update(
            REQUEST_METHOD=method,
            CONTENT_LENGTH=str(len(body)),
            CONTENT_TYPE="application/octet-stream",
        )
        environ["wsgi.input"] = io.BytesIO(body)
        if key is not None:
            environ["HTTP_IDEMPOTENCY_KEY"] = key
            environ["HTTP_AUTHORIZATION"] = CALLER["authorization"]
        return self.app(environ, self.start_response)

    def get(self, body: bytes = b"", key: str | None = "k") -> bytes:
        result = self.call(body, key)
        try:
            return b"".join(result)
        finally:
            getattr(result, "close", lambda: None)()


class Body:
    """An app's body: ``n`` chunks of ``size`` bytes; remembers how far it got and close()."""

    def __init__(self, n: int, size: int, fail_at: int | None = None) -> None:
        self.n, self.size, self.fail_at = n, size, fail_at
        self.made = 0
        self.closed = False

    def __iter__(self) -> Iterator[bytes]:
        for i in range(self.n):
            if i == self.fail_at:
                raise KeyError("the app broke mid-answer")
            self.made += 1
            yield bytes([97 + i % 26]) * self.size

    def close(self) -> None:
        self.closed = True


def app_of(body: Body, status: str = "200 OK") -> WSGIApp:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Body:
        start_response(status, [("Content-Type", "text/plain")])
        return body

    return app


def test_a_streamed_answer_is_recorded_before_its_last_chunk(store: Store[Any]) -> None:
    body = Body(10, 50)
    server = Server(IdempotencyMiddleware(app_of(body), store=store, max_body=100))
    seen = []
    for chunk in server.call():
        seen.append((chunk, status_of(store, "k")))
    assert b"".join(c for c, _ in seen) == b"".join(bytes([97 + i]) * 50 for i in range(10))
    assert [s for _, s in seen] == [Status.PROCESSING] * 9 + [Status.COMPLETED]
    assert body.closed and server.status == "200 OK"


def test_a_small_answer_is_recorded_before_the_server_starts_sending(store: Store[Any]) -> None:
    server = Server(IdempotencyMiddleware(app_of(Body(3, 10), "201 Created"), store=store))
    states: list[Status | None] = []
    server.on_start = lambda: states.append(status_of(store, "k"))
    assert server.get() == b"a" * 10 + b"b" * 10 + b"c" * 10
    assert server.status == "201 Created"
    assert states == [Status.COMPLETED]
    replay = Server(server.app)
    assert replay.get() == b"a" * 10 + b"b" * 10 + b"c" * 10
    assert replay.status == "201 Created" and replay.headers["idempotent-replayed"] == "true"


def test_closed_mid_stream_the_rest_is_read_and_recorded(memory: Store[Any]) -> None:
    body = Body(100, 1000)
    server = Server(IdempotencyMiddleware(app_of(body), store=memory, max_body=5000))
    result = iter(server.call())
    next(result), next(result)
    result.close()  # type: ignore[attr-defined]
    assert body.made == 100 and body.closed
    assert status_of(memory, "k") is Status.COMPLETED
    replay = Server(server.app)
    assert replay.get() == b""
    assert replay.headers["idempotent-body-omitted"] == "true"


def test_closed_before_the_first_chunk_is_still_recorded(memory: Store[Any]) -> None:
    body = Body(100, 1000)
    server = Server(IdempotencyMiddleware(app_of(body), store=memory, max_body=5000))
    server.call().close()  # type: ignore[attr-defined]
    assert body.made == 100 and body.closed
    assert status_of(memory, "k") is Status.COMPLETED


@pytest.mark.parametrize("fail_at", [0, 2, 50], ids=["first", "buffered", "streaming"])
def test_an_exception_from_the_app_propagates_and_stays_retryable(
    memory: Store[Any], fail_at: int
) -> None:
    body = Body(100, 1000, fail_at=fail_at)
    server = Server(IdempotencyMiddleware(app_of(body), store=memory, max_body=5000))
    with pytest.raises(KeyError, match="the app broke mid-answer"):
        server.get()
    assert body.closed
    assert status_of(memory, "k") is Status.FAILED
    again = Body(3, 10)
    server.app.app = app_of(again)  # type: ignore[attr-defined]
    assert server.get() == b"a" * 10 + b"b" * 10 + b"c" * 10  # runs again
    assert status_of(memory, "k") is Status.COMPLETED


def test_an_app_that_raises_before_answering(memory: Store[Any]) -> None:
    error = LookupError("no answer")

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        raise error

    with pytest.raises(LookupError) as caught:
        Server(IdempotencyMiddleware(app, store=memory)).call()
    assert caught.value is error
    assert status_of(memory, "k") is Status.FAILED


def test_exc_info_replaces_an_answer_not_yet_sent(memory: Store[Any]) -> None:
    runs = []

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        runs.append(1)
        start_response("200 OK", [("Content-Type", "text/plain")])
        try:
            raise ValueError("late trouble")
        except ValueError:
            start_response("500 Internal Server Error", [("X-Error", "1")], sys.exc_info())
        return [b"error page"]

    server = Server(IdempotencyMiddleware(app, store=memory))
    assert server.get() == b"error page"
    assert server.status == "500 Internal Server Error" and server.headers == {"x-error": "1"}
    assert status_of(memory, "k") is Status.FAILED
    assert server.get() == b"error page" and len(runs) == 2  # 5xx: retryable


def test_exc_info_after_the_answer_started_reraises(memory: Store[Any]) -> None:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        yield b"x" * 2000
        yield b"y" * 2000
        try:
            raise ValueError("too late")
        except ValueError:
            start_response("500 Internal Server Error", [], sys.exc_info())
        yield b"never"

    server = Server(IdempotencyMiddleware(app, store=memory, max_body=1000))
    with pytest.raises(ValueError, match="too late"):
        server.get()
    assert server.status == "200 OK"
    assert status_of(memory, "k") is Status.FAILED


def test_start_response_may_be_called_lazily(memory: Store[Any]) -> None:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
        start_response("202 Accepted", [("Content-Type", "text/plain")])
        yield environ["wsgi.input"].read()

    server = Server(IdempotencyMiddleware(app, store=memory))
    assert server.get(b"payload") == b"payload"
    assert server.status == "202 Accepted"
    assert Server(server.app).get(b"payload") == b"payload"


def test_an_app_that_never_starts_a_response(memory: Store[Any]) -> None:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        return []

    with pytest.raises(RuntimeError, match="without calling start_response"):
        Server(IdempotencyMiddleware(app, store=memory)).get()
    assert status_of(memory, "k") is Status.FAILED


def test_write_then_an_iterable_and_close(memory: Store[Any]) -> None:
    body = Body(2, 3)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Body:
        start_response("200 OK", [])(b"w")
        return body

    server = Server(IdempotencyMiddleware(app, store=memory))
    assert server.get() == b"waaabbb"
    assert body.closed


def test_unprotected_requests_pass_through_untouched(memory: Store[Any]) -> None:
    seen: list[dict[str, Any]] = []

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        seen.append(environ)
        start_response("200 OK", [])
        return [b"ok"]

    server = Server(IdempotencyMiddleware(app, store=memory))
    result = server.call(b"body", key=None)
    assert result == [b"ok"]  # the app's own iterable, not a copy
    get = server.call(b"", key="k", method="GET")
    assert get == [b"ok"]
    assert all(isinstance(e["wsgi.input"], io.BytesIO) for e in seen)
    assert seen[0]["wsgi.input"].read() == b"body"  # nothing was read before the app
    assert status_of(memory, "k") is None


def test_a_short_request_body_is_refused(memory: Store[Any]) -> None:
    server = Server(IdempotencyMiddleware(app_of(Body(1, 1)), store=memory))
    environ: dict[str, Any] = {}
    setup_testing_defaults(environ)
    environ.update(
        REQUEST_METHOD="POST",
        CONTENT_LENGTH="100",
        HTTP_IDEMPOTENCY_KEY="k",
        HTTP_AUTHORIZATION=CALLER["authorization"],
    )
    environ["wsgi.input"] = io.BytesIO(b"only ten b")
    body = b"".join(server.app(environ, server.start_response))
    assert server.status == "400 Bad Request"
    assert b"ended after 10 of its 100 bytes" in body
    assert status_of(memory, "k") is None


def test_a_close_that_raises_after_the_answer_is_recorded(memory: Store[Any]) -> None:
    from retrysafe._core.heartbeat import _heartbeat

    class Breaks(Body):
        def close(self) -> None:
            super().close()
            raise OSError("close broke")

    body = Breaks(2, 3)
    server = Server(IdempotencyMiddleware(app_of(body), store=memory))
    with pytest.raises(OSError, match="close broke"):
        server.get()  # the server sees close()'s error, as with any WSGI app
    assert body.closed
    assert status_of(memory, "k") is Status.COMPLETED  # recorded before close() ran
    assert not any(w.claim.key == "k" for w in _heartbeat.active)  # no longer renewed


# -- what a keyed request holds -------------------------------------------------------------


def _held(memory: Store[Any], key: str) -> Any:
    from retrysafe import Engine
    from retrysafe._http.flow import Held

    att = Engine(memory).attempt(key, operation="held").__enter__()
    return Held(att)


def _held_status(memory: Store[Any], key: str) -> Status | None:
    from retrysafe import key_hash

    record = memory.get(key_hash("", "held", key))
    return None if record is None else record.status


def test_held_closes_last_in_first_out_then_stops_renewing_then_leaves(
    memory: Store[Any],
) -> None:
    from retrysafe._core.heartbeat import _heartbeat

    held = _held(memory, "h1")
    active = _heartbeat.active
    order: list[str] = []
    held.callback(lambda: order.append("first"))
    held.callback(lambda: order.append(f"second, renewed: {held.renewal.entry in active}"))
    held.leave(KeyError("the app broke"))
    assert order == ["second, renewed: True", "first"]
    assert held.renewal.entry not in _heartbeat.active
    assert _held_status(memory, "h1") is Status.FAILED  # the exception failed it
    held.leave()  # leaving again does nothing
    assert _held_status(memory, "h1") is Status.FAILED


def test_held_raises_a_callback_error_and_fails_the_attempt_with_it(memory: Store[Any]) -> None:
    held = _held(memory, "h2")
    ran: list[str] = []

    def breaks() -> None:
        raise OSError("close broke")

    held.callback(lambda: ran.append("ran"))
    held.callback(breaks)
    with pytest.raises(OSError, match="close broke"):
        held.leave()
    assert ran == ["ran"]  # the callbacks before it still run
    assert _held_status(memory, "h2") is Status.FAILED


def test_status_lines_are_those_of_http_status() -> None:
    from http import HTTPStatus

    from retrysafe._http.wsgi import status_line

    for code in range(100, 1000):
        try:
            want = f"{code} {HTTPStatus(code).phrase}"
        except ValueError:
            want = f"{code} Unknown"
        assert status_line(code) == want


class Trickle(io.RawIOBase):
    """A ``wsgi.input`` that gives at most ``most`` bytes per read, as a socket may."""

    def __init__(self, data: bytes, most: int) -> None:
        self.data, self.most = data, most

    def read(self, size: int = -1) -> bytes:
        n = self.most if size < 0 else min(size, self.most)
        out, self.data = self.data[:n], self.data[n:]
        return out


@pytest.mark.parametrize("size", [50, 200_000], ids=["one-block", "several-blocks"])
def test_a_body_given_a_few_bytes_per_read_is_read_whole(memory: Store[Any], size: int) -> None:
    seen: list[bytes] = []

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        seen.append(environ["wsgi.input"].read())
        start_response("201 Created", [])
        return [b"ok"]

    server = Server(IdempotencyMiddleware(app, store=memory))
    environ: dict[str, Any] = {}
    setup_testing_defaults(environ)
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    environ.update(
        REQUEST_METHOD="POST",
        CONTENT_LENGTH=str(size),
        HTTP_IDEMPOTENCY_KEY="k",
        HTTP_AUTHORIZATION=CALLER["authorization"],
    )
    environ["wsgi.input"] = Trickle(body, 7)
    assert b"".join(server.app(environ, server.start_response)) == b"ok"
    assert server.status == "201 Created" and seen == [body]


def test_paths_are_the_utf_8_text_an_asgi_server_gives() -> None:
    from retrysafe.wsgi import _path

    assert _path({"SCRIPT_NAME": "/app", "PATH_INFO": "/orders"}) == "/app/orders"
    assert _path({"PATH_INFO": "/caf\xc3\xa9"}) == "/café"  # UTF-8 bytes as latin-1
    assert _path({"PATH_INFO": "/\xff"}) == "/\udcff"  # not UTF-8: surrogate-escaped


# -- the caller, from the environ -----------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "environ", "query", "user"),
    [
        ({}, {"HTTP_AUTHORIZATION": "Bearer a"}, "", None),  # the lone path
        ({}, {"HTTP_X_API_KEY": " k1 "}, "", None),  # the lone path, stripped
        ({}, {"HTTP_AUTHORIZATION": "Bearer a, Bearer b"}, "", None),  # joined lines: one value
        ({}, {"HTTP_AUTHORIZATION": ""}, "", None),  # empty: anonymous
        ({"anonymous": "share"}, {"HTTP_AUTHORIZATION": ""}, "", None),
        ({}, {"HTTP_AUTHORIZATION": "Bearer caf\xc3\xa9"}, "", None),  # not ASCII: the rules
        ({}, {"HTTP_AUTHORIZATION": "Bearer a", "HTTP_COOKIE": "sessionid=s"}, "", None),
        ({}, {"HTTP_AUTHORIZATION": "Bearer a", "HTTP_COOKIE": "currency=USD"}, "", None),
        ({}, {"HTTP_AUTHORIZATION": "Bearer a", "HTTP_X_API_KEY": "k"}, "", None),
        ({}, {"HTTP_COOKIE": "sessionid=s"}, "", None),
        ({}, {"HTTP_AUTHORIZATION": "Bearer a"}, "", "auth.user:1"),  # the user comes first
        ({"principal_query": ["token"]}, {"HTTP_AUTHORIZATION": "Bearer a"}, "token=t", None),
        ({"principal_query": ["token"]}, {"HTTP_AUTHORIZATION": "Bearer a"}, "", None),
        ({"principal_headers": ["x-tenant"]}, {"HTTP_X_TENANT": "t1"}, "", None),
        ({"principal_headers": ["x-tenant"]}, {"HTTP_X_API_KEY": "k"}, "", None),  # not read
        ({}, {"HTTP_HOST": "h"}, "", None),  # no credential at all
    ],
)
def test_the_caller_of_an_environ_is_whom_the_rules_name(
    options: dict[str, Any], environ: dict[str, str], query: str, user: str | None
) -> None:
    """The one-pass reading of an environ's credentials (with its shortcut for one
    credential header) gives the principal the general rules give, every time."""
    from retrysafe._core.principal import Principals
    from retrysafe._http.flow import caller

    p = Principals(**options)
    lines = [("authorization", "HTTP_AUTHORIZATION"), *p.environ_names, ("cookie", "HTTP_COOKIE")]
    general = [(name, environ[key]) for name, key in dict(lines).items() if key in environ]
    want = p.others(user, general, query)
    for _ in range(2):  # the second time from memory, where the shortcut remembers
        assert caller(p, environ, user, query) == want
