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
chunked bodies too) and handed to the app as a fresh ``wsgi.input``.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from http import HTTPStatus
from types import TracebackType
from typing import Any

from ._engine import Engine
from ._http import BodyError, Headers, HttpPolicy, HttpRequest, Response, declared_length
from ._http_io import Flow, Stream, enter, prepare, run_prepare
from .stores import Store

__all__ = ["IdempotencyMiddleware"]

Environ = dict[str, Any]
ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]
Write = Callable[[bytes], object]
StartResponse = Callable[..., Write]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]

_BLOCK = 64 << 10
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

        flow = prepare(policy, environ, method, path, lambda: _read_body(environ, policy), request)
        step = run_prepare(flow, _no_user)
        if step is None:
            return self.app(environ, start_response)
        if isinstance(step, Response):
            return _answer(start_response, step)
        with ExitStack() as stack:
            att = enter(policy, stack, step[1])
            if att is None:  # the store is down and fail_mode="open"
                return self.app(environ, start_response)
            if isinstance(att, Response):
                return _answer(start_response, att)
            start = _Start(start_response)
            result = self.app(environ, start)
            close = getattr(result, "close", None)
            if close is not None:
                stack.callback(close)
            flow = Flow(policy, att, stack.pop_all(), start.answer)
        return _respond(flow, start, _body(start.written, result))


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


def _respond(flow: Flow, start: _Start, chunks: Iterator[bytes]) -> Iterable[bytes]:
    """Read the body: up to ``max_body`` it is recorded, then sent; past it, it streams."""
    limit = flow.policy.max_body
    ready: list[bytes] = []
    try:
        for chunk in chunks:
            if not chunk:
                continue
            out = flow.push(chunk)
            if out is not None:
                ready.append(out)
            if flow.capture.size > limit:
                start.send()
                return Stream(flow, chunks, ready)
        if start.status is None:
            raise RuntimeError(_NO_START)
    except BaseException as exc:
        flow.finish(exc)
        raise
    flow.finish()
    start.send()
    last = flow.last()
    if last is not None:
        ready.append(last)
    return ready


def _read_body(environ: Environ, policy: HttpPolicy) -> bytes:
    """The keyed request's body, whole; the app reads it again from a copy."""
    stream = environ["wsgi.input"]
    size = declared_length(environ.get("CONTENT_LENGTH"))
    if size is not None:
        policy.check_length(size)  # (413 before reading a body declared too long)
        body = _read(stream, policy, size)
        if len(body) < size:
            raise BodyError(f"the request body ended after {len(body)} of its {size} bytes")
    elif environ.get("wsgi.input_terminated"):  # chunked: read to its end
        body = _read(stream, policy, None)
    else:
        body = b""
    environ["wsgi.input"] = io.BytesIO(body)
    environ["CONTENT_LENGTH"] = str(len(body))
    return body


def _read(stream: Any, policy: HttpPolicy, size: int | None) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while size is None or got < size:
        chunk = stream.read(_BLOCK if size is None else min(_BLOCK, size - got))
        if not chunk:
            break
        got += len(chunk)
        policy.check_length(got)
        chunks.append(chunk)
    return b"".join(chunks)


def _answer(start_response: StartResponse, response: Response) -> list[bytes]:
    start_response(_status_line(response.status), response.headers)
    return [response.body]


def _status_line(code: int) -> str:
    """``201 Created``: a WSGI status line for a status code."""
    try:
        return f"{code} {HTTPStatus(code).phrase}"
    except ValueError:
        return f"{code} Unknown"


def _text(value: str) -> str:
    """A WSGI string (bytes as latin-1) as the UTF-8 text an ASGI server gives."""
    try:
        return value.encode("latin-1").decode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return value


def _path(environ: Environ) -> str:
    return _text(environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", ""))


def _headers(environ: Environ) -> Iterator[tuple[str, str]]:
    for name, value in environ.items():
        if name.startswith("HTTP_"):
            yield name[5:].replace("_", "-").lower(), value
        elif name in ("CONTENT_TYPE", "CONTENT_LENGTH") and value:
            yield name.replace("_", "-").lower(), value


def _request(environ: Environ) -> HttpRequest:
    return HttpRequest(
        environ.get("REQUEST_METHOD", ""),
        _path(environ),
        environ.get("QUERY_STRING", ""),
        Headers(_headers(environ)),
        environ,
    )
