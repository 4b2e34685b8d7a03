"""Idempotency for any WSGI application (Flask, Bottle, Pyramid, Falcon, plain WSGI).

::

    from flask import Flask
    from retrysafe.wsgi import IdempotencyMiddleware

    app = Flask(__name__)
    app.wsgi_app = IdempotencyMiddleware(app.wsgi_app, store="redis://localhost:6379/0")

    # any WSGI app:
    application = IdempotencyMiddleware(application, store="sqlite:///idempotency.db")

The options and answers are those of :class:`retrysafe.asgi.IdempotencyMiddleware`.
Requests that carry no key (or use a method it does not protect) go straight
to the app. A keyed request's body is read whole (up to ``max_request_body``,
chunked bodies too) and handed to the app as a fresh ``wsgi.input`` (under
``fingerprint=False`` it is not read: the app reads it as it comes).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from retrysafe._core.engine import Engine
from retrysafe._http.flow import Exchange, Stream, enter, prepare, run_prepare
from retrysafe._http.policy import HttpPolicy
from retrysafe._http.problems import Response
from retrysafe._http.request import Headers, HttpRequest
from retrysafe._http.wsgi import (
    Environ,
    ExcInfo,
    StartResponse,
    Write,
    WSGIApp,
    environ_headers,
    read_body,
    status_line,
)
from retrysafe.stores import Store

__all__ = ["IdempotencyMiddleware"]

_NO_START = "the WSGI app returned its body without calling start_response"


class IdempotencyMiddleware:
    """Run each keyed request once; answer its retries with the stored response.

    ``store`` is a :class:`~retrysafe.Store`, a store URL or an
    :class:`~retrysafe.Engine` (default ``$RETRYSAFE_STORE`` or SQLite); the
    keyword options are those of :class:`retrysafe.asgi.IdempotencyMiddleware`.

    An answer up to ``max_body`` is read whole, recorded, and then sent. A
    longer one is sent as the app produces it, one chunk held back so that it
    is recorded before its last chunk leaves. If the server closes the answer
    early (the client went away), the rest of the app's body is still read and
    the answer recorded: the client's retry gets the replay.
    """

    def __init__(
        self, app: WSGIApp, store: Store[Any] | Engine | str | None = None, **options: Any
    ) -> None:
        self.app = app
        self.policy = HttpPolicy(store, **options)

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "")
        path = _path(environ)
        policy = self.policy.select(method, path)
        if policy is None:
            return self.app(environ, start_response)

        def request() -> HttpRequest:
            return _request(environ)

        preparing = prepare(
            policy, environ, method, path, lambda: read_body(environ, policy), request, _no_user
        )
        step = run_prepare(preparing)
        if step is None:
            return self.app(environ, start_response)
        if isinstance(step, Response):
            return _answer(start_response, step)
        held = enter(policy, step[1])
        if held is None:  # the store is down and fail_mode="open"
            return self.app(environ, start_response)
        if isinstance(held, Response):
            return _answer(start_response, held)
        start = _Start(start_response)
        try:
            result = self.app(environ, start)
        except BaseException as exc:  # the attempt fails (retryable)
            held.leave(exc)
            raise
        close = getattr(result, "close", None)
        if close is not None:
            held.callback(close)
        exchange = Exchange(policy, held.att, held, start.answer)
        return _respond(exchange, start, _body(start.written, result))


def _no_user() -> None:
    """WSGI has no framework identity: ``principal=`` or the credentials name the caller.

    ``REMOTE_USER`` is not used by default (a server may be set to take it from a
    request header); ``principal=`` can read it where the server authenticates.
    """


class _Start:
    """The app's ``start_response``: holds status and headers until the answer is decided."""

    __slots__ = ("code", "down", "headers", "sent", "status", "written")

    def __init__(self, down: StartResponse) -> None:
        self.down = down
        self.status: str | None = None
        self.code = 0
        self.headers: list[tuple[str, str]] = []
        self.sent = False
        self.written: list[bytes] = []

    def __call__(
        self, status: str, headers: list[tuple[str, str]], exc_info: ExcInfo | None = None
    ) -> Write:
        if exc_info is not None:
            if self.sent:  # too late to change the answer (PEP 3333)
                raise exc_info[1].with_traceback(exc_info[2])
        elif self.status is not None:
            raise RuntimeError("start_response was called twice without exc_info")
        self.code = int(status.split(" ", 1)[0])
        self.status, self.headers = status, list(headers)
        return self.written.append  # the legacy write(): its bytes come first

    def answer(self) -> tuple[int, list[tuple[str, str]]]:
        return self.code, self.headers

    def send(self) -> None:
        """Pass the status and headers on to the server."""
        if self.status is None:
            raise RuntimeError(_NO_START)
        self.sent = True
        self.down(self.status, self.headers)


def _body(written: list[bytes], result: Iterable[bytes]) -> Iterator[bytes]:
    """The app's body: what it passed to ``write()``, then its iterable."""
    for chunk in result:
        if written:
            yield from written
            written.clear()
        yield chunk
    yield from written


def _respond(exchange: Exchange, start: _Start, chunks: Iterator[bytes]) -> Iterable[bytes]:
    """Read the body: up to ``max_body`` it is recorded, then sent; past it, it streams."""
    limit = exchange.policy.max_body
    ready: list[bytes] = []
    try:
        for chunk in chunks:
            if not chunk:
                continue
            out = exchange.push(chunk)
            if out is not None:
                ready.append(out)
            if exchange.capture.size > limit:
                start.send()
                return Stream(exchange, chunks, ready)
        if start.status is None:
            raise RuntimeError(_NO_START)
    except BaseException as exc:
        exchange.finish(exc)
        raise
    exchange.finish()
    start.send()
    last = exchange.last()
    if last is not None:
        ready.append(last)
    return ready


def _answer(start_response: StartResponse, response: Response) -> list[bytes]:
    start_response(status_line(response.status), response.headers)
    return [response.body]


def _text(value: str) -> str:
    """A WSGI string (bytes as latin-1) as the UTF-8 text an ASGI server gives."""
    if value.isascii():  # the same in both (the common case)
        return value
    try:
        return value.encode("latin-1").decode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return value


def _path(environ: Environ) -> str:
    return _text(environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", ""))


def _request(environ: Environ) -> HttpRequest:
    return HttpRequest(
        environ.get("REQUEST_METHOD", ""),
        _path(environ),
        environ.get("QUERY_STRING", ""),
        Headers(environ_headers(environ)),
        environ,
    )
