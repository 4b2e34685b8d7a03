"""WSGI I/O shared by the front doors that serve WSGI (the middleware, webhooks, metrics)."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator
from http import HTTPStatus
from types import TracebackType
from typing import Any, Protocol

from retrysafe._http.request import declared_length
from retrysafe.errors import BodyError

__all__ = [
    "Environ",
    "ExcInfo",
    "StartResponse",
    "WSGIApp",
    "Write",
    "environ_headers",
    "read_body",
    "status_line",
]

Environ = dict[str, Any]
ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]
Write = Callable[[bytes], object]
StartResponse = Callable[..., Write]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]

_BLOCK = 64 << 10


class LengthCheck(Protocol):
    """What :func:`read_body` asks of its policy: a check of the size read so far."""

    def check_length(self, size: int) -> None: ...


def read_body(environ: Environ, policy: LengthCheck) -> bytes:
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


def _read(stream: Any, policy: LengthCheck, size: int | None) -> bytes:
    chunks: list[bytes] = []
    got = 0
    # A small declared body in one read, unless the stream gives less. (A larger one
    # is read a block at a time: a read may allocate its whole size before any byte
    # arrives, so memory follows the bytes received, not the bytes declared.)
    if size is not None and size <= _BLOCK:
        first: bytes = stream.read(size)
        if not first or len(first) >= size:
            return first
        chunks.append(first)
        got = len(first)
    while size is None or got < size:
        chunk = stream.read(_BLOCK if size is None else min(_BLOCK, size - got))
        if not chunk:
            break
        got += len(chunk)
        policy.check_length(got)
        chunks.append(chunk)
    return b"".join(chunks)


#: The status line of every code Python knows, built once.
_STATUS_LINES = {int(status): f"{int(status)} {status.phrase}" for status in HTTPStatus}


def status_line(code: int) -> str:
    """``201 Created``: a WSGI status line for a status code."""
    line = _STATUS_LINES.get(code)
    return f"{code} Unknown" if line is None else line


def environ_headers(environ: Environ) -> Iterator[tuple[str, str]]:
    for name, value in environ.items():
        if name.startswith("HTTP_"):
            yield name[5:].replace("_", "-").lower(), value
        elif name in ("CONTENT_TYPE", "CONTENT_LENGTH") and value:
            yield name.replace("_", "-").lower(), value
