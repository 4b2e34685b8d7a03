"""ASGI plumbing shared by the front doors that speak JSON over HTTP (mesh, a2a)."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any, TypeVar

from ._http import Headers, HttpRequest
from ._principal import Principal, Principals, asgi_user, unscoped
from ._secret import asecret_of

if TYPE_CHECKING:
    from .stores import Store

__all__ = [
    "UNPROVEN_END",
    "ASGIApp",
    "BodyTooLarge",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "caller",
    "caller_scope",
    "closing",
    "header",
    "http_request",
    "is_async",
    "lifespan",
    "read_body",
    "replaying",
    "send_json",
    "send_response",
    "to_the_end",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
T = TypeVar("T")

#: A key of an answer's last ``http.response.body`` message: true when nothing
#: proves the answer ended there (the upstream's body ran to a close that could
#: as well have cut it short). The client gets it; it is never stored.
UNPROVEN_END = "retrysafe.unproven_end"

log = logging.getLogger("retrysafe")


async def lifespan(
    receive: Receive,
    send: Send,
    on_shutdown: Callable[[], Awaitable[None]],
    on_startup: Callable[[], object] | None = None,
) -> None:
    """Serve an app's lifespan: call ``on_startup`` and start; at shutdown, await
    ``on_shutdown``. A failure of ``on_shutdown`` is logged; it never stops the shutdown.
    """
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            if on_startup is not None:
                on_startup()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await _close_at_shutdown(on_shutdown)
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _close_at_shutdown(close: Callable[[], Awaitable[None]]) -> None:
    """Await ``close``; a failure is logged, never raised (it must not stop a shutdown)."""
    try:
        await close()
    except Exception as exc:
        log.warning("retrysafe: closing the store at shutdown failed: %r", exc)


def closing(send: Send, close: Callable[[], Awaitable[None]]) -> Send:
    """``send`` for an app's lifespan that awaits ``close`` before shutdown completes.

    For middleware in front of an app that serves its own lifespan. A failure of
    ``close`` is logged; it never stops the shutdown.
    """

    async def closing_send(message: Message) -> None:
        if message["type"] == "lifespan.shutdown.complete":
            await _close_at_shutdown(close)
        await send(message)

    return closing_send


def replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` that gives the app the already-read ``body``, then the client's messages."""
    sent = False

    async def replay_receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay_receive


class BodyTooLarge(Exception):
    """The request body passed the limit given to :func:`read_body`."""


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of the (lower-case) header ``name``, or None."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def http_request(scope: Scope) -> HttpRequest:
    """The request of an ASGI ``scope``, as ``principal=`` and ``require_key=`` see it."""
    return HttpRequest(
        scope["method"],
        scope["path"],
        scope.get("query_string", b"").decode("latin-1"),
        Headers((k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]),
        scope,
    )


async def caller_scope(
    scope: Scope, principals: Principals, store: Store[Any], operation: str
) -> str | None:
    """The record scope of an ASGI request's caller (a keyed hash, see
    :mod:`retrysafe._principal`); None: anonymous, to run without a record.

    Raises what :meth:`Principals.identify` raises, and
    :class:`~retrysafe.StoreUnavailableError` if the deployment secret cannot be read.
    """
    who = caller(scope, principals)
    if who is None:
        unscoped(operation)
        return None
    return who.scope(await asecret_of(store))


def caller(scope: Scope, principals: Principals) -> Principal | None:
    """Who sends an ASGI request (see :meth:`Principals.identify`); None: anonymous,
    to run without a record."""
    wanted = principals.raw_names
    found = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k in wanted]
    query = scope.get("query_string", b"").decode("latin-1")
    return principals.identify(lambda: http_request(scope), lambda: asgi_user(scope), found, query)


def is_async(handler: Callable[..., Any]) -> bool:
    """True for a coroutine function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        type(handler).__call__
    )


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body (at most ``limit`` bytes), or None if the client left.

    Raises :class:`BodyTooLarge` past ``limit``.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"request body over {limit} bytes")
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_response(
    send: Send, status: int, headers: Iterable[tuple[str, str]], body: bytes
) -> None:
    """Send a whole response in one start and one body message."""
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    raw.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


async def send_json(
    send: Send,
    status: int,
    value: Any,
    headers: Iterable[tuple[str, str]] = (),
    media_type: str = "application/json",
) -> None:
    """Send ``value`` as a compact UTF-8 JSON response."""
    body = _JSON(value).encode()
    await send_response(send, status, [("content-type", media_type), *headers], body)


#: The handlings whose request was cancelled, kept referenced until they end.
_orphans: set[asyncio.Task[Any]] = set()


async def to_the_end(handling: Coroutine[Any, Any, T]) -> T:
    """Await ``handling`` in a task of its own that a cancellation of the caller
    does not stop.

    A server or middleware may cancel a request's task (a client that left, a
    timeout) while its handler runs, and work the handler runs outside that
    task (a plain handler in a worker thread) goes on regardless. Failing the
    key then would let a retry run the handler a second time, alongside the
    first: instead the handling runs to its end and records its answer, and a
    retry meanwhile is told it is still in flight. A failure of a handling
    whose caller is gone is logged as a warning.
    """
    task = asyncio.ensure_future(handling)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            _orphans.add(task)
            task.add_done_callback(_orphan_ended)
        raise


async def run_detached(
    run: Callable[[Receive, Send], Awaitable[None]], receive: Receive, send: Send
) -> None:
    """``await run(receive, send)`` through :func:`to_the_end`, for one HTTP request.

    If the request's task is cancelled, ``run`` goes on (and records its
    answer) but is done with the request: it then hears ``http.disconnect``
    and what it sends goes nowhere.
    """
    cancelled = False

    async def hear() -> Message:
        return {"type": "http.disconnect"} if cancelled else await receive()

    async def answer(message: Message) -> None:
        if not cancelled:
            await send(message)

    try:
        await to_the_end(run(hear, answer))
    except asyncio.CancelledError:
        cancelled = True
        raise


def _orphan_ended(task: asyncio.Task[Any]) -> None:
    _orphans.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.warning("retrysafe: the handling of a cancelled request failed: %r", task.exception())
