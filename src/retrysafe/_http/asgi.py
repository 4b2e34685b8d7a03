"""ASGI I/O shared by the front doors: the idempotency middleware (behind
:mod:`retrysafe.asgi`, :mod:`retrysafe.fastapi` and the gateway) and the plumbing of
the doors that speak JSON over HTTP (Mesh, A2A, webhooks)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any, TypeVar

from retrysafe._core.engine import Attempt
from retrysafe._core.heartbeat import renewing
from retrysafe._core.principal import Principal, Principals, asgi_user, unscoped
from retrysafe._core.recording import arecord
from retrysafe._core.secret import asecret_of
from retrysafe._http.policy import Capture, HttpPolicy
from retrysafe._http.problems import Response
from retrysafe._http.request import Canonicalize, Headers, HttpRequest
from retrysafe._model.json_text import json_bytes
from retrysafe.errors import BodyTooLarge, IdempotencyError

if TYPE_CHECKING:
    from retrysafe.stores import Store

__all__ = [
    "UNPROVEN_END",
    "ASGIApp",
    "IdempotencyMiddleware",
    "Message",
    "Receive",
    "Recorder",
    "Scope",
    "Send",
    "at_most",
    "caller",
    "caller_scope",
    "closing",
    "header",
    "http_request",
    "identify",
    "is_async",
    "lifespan",
    "read_body",
    "replaying",
    "run_recorded",
    "send_answer",
    "send_json",
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
http_log = logging.getLogger("retrysafe.http")


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
        Headers(scope["headers"]),
        scope,
    )


async def caller_scope(
    scope: Scope, principals: Principals, store: Store[Any], operation: str
) -> str | None:
    """The record scope of an ASGI request's caller (a keyed hash, see
    :mod:`retrysafe._core.principal`); None: anonymous, to run without a record.

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
    found = [(k, v) for k, v in scope["headers"] if k in wanted]
    return identify(scope, principals, found, scope.get("query_string", b"").decode("latin-1"))


def identify(
    scope: Scope, principals: Principals, found: list[tuple[bytes, bytes]], query: str
) -> Principal | None:
    """:func:`caller`, given the request's header lines named in ``principals.raw_names``
    (raw, in order) and its query string.

    A request whose one credential is one header line (no ``principal=``, no
    ``scope["user"]``, no credential query parameters) gets
    :meth:`Principals.lone`: the same principal, remembered.
    """
    if (
        len(found) == 1
        and principals.fn is None
        and scope.get("user") is None
        and (not query or not principals.query)
    ):
        name, value = found[0]
        if name in principals.lone_names:
            return principals.lone(name, value)
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in found]
    return principals.identify(
        lambda: http_request(scope), lambda: asgi_user(scope), headers, query
    )


def is_async(handler: Callable[..., Any]) -> bool:
    """True for a coroutine function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        type(handler).__call__
    )


def at_most(limit: int) -> Callable[[int], None]:
    """A :func:`read_body` check that raises :class:`BodyTooLarge` past ``limit`` bytes."""

    def check(size: int) -> None:
        if size > limit:
            raise BodyTooLarge(f"request body over {limit} bytes")

    return check


async def read_body(
    receive: Receive, check: Callable[[int], None], message: Message | None = None
) -> bytes | None:
    """The whole request body, or None if the client left.

    ``check(size)`` is called with the bytes read so far as each chunk arrives,
    and raises to stop the read: :func:`at_most`, or an HTTP policy's
    ``check_length``. ``message`` is the request's first message, if the caller
    has received it already.
    """
    chunks: list[bytes] = []
    size = 0
    if message is None:
        message = await receive()
    while True:
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            check(size)
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
        message = await receive()


async def send_json(
    send: Send,
    status: int,
    value: Any,
    headers: Iterable[tuple[str, str]] = (),
    media_type: str = "application/json",
) -> None:
    """Send ``value`` as a compact UTF-8 JSON response.

    Text that UTF-8 cannot carry (a lone surrogate a request sent as ``"\\ud800"``,
    echoed back) is written with JSON's ``\\u`` escapes instead, as it came.
    """
    body = json_bytes(value)
    await send_answer(send, Response.sized(status, [("content-type", media_type), *headers], body))


#: The handlings whose request was cancelled, kept referenced until they end.
_orphans: set[asyncio.Future[None]] = set()


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

    The task hands its outcome to a future the caller awaits (a cancellation
    reaches that future, never the task): no shield. On Python 3.12+ it starts
    eagerly, so a handling that ends without suspending costs no turn of the
    event loop.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()
    task = _detached(loop, _carry(handling, done))
    try:
        return await done
    except asyncio.CancelledError:
        _left(done, task)
        raise


def _left(done: asyncio.Future[Any], task: asyncio.Future[None]) -> None:
    """The caller awaiting ``done``, the outcome of ``task``, was cancelled: the task
    runs on (kept referenced until it ends), or its failure is logged."""
    if not done.done():
        done.cancel()
    if done.cancelled():
        if not task.done():
            _orphans.add(task)
            task.add_done_callback(_orphans.discard)
    elif done.exception() is not None:  # it ended as the caller was cancelled
        _orphan_failed(done.exception())


async def _carry(handling: Coroutine[Any, Any, T], done: asyncio.Future[T]) -> None:
    """Await ``handling`` and hand its outcome to ``done``; once ``done`` is cancelled
    (the caller left), a failure is logged instead."""
    try:
        result = await handling
    except BaseException as exc:
        _hand_failure(done, exc)
        return
    if not done.done():
        done.set_result(result)


def _hand_failure(done: asyncio.Future[Any], exc: BaseException) -> None:
    """Hand the failure ``exc`` of a detached handling to ``done`` (logged if its caller
    left); re-raised if it is not the handling's to end with (a cancellation of the
    task itself as the loop closes, KeyboardInterrupt, SystemExit)."""
    if isinstance(exc, asyncio.CancelledError):  # the task itself was cancelled
        if not done.done():
            done.cancel()
        raise exc
    if done.cancelled():
        _orphan_failed(exc)
    elif not done.done():
        done.set_exception(exc)
    if not isinstance(exc, Exception):
        raise exc  # KeyboardInterrupt, SystemExit: the loop's to handle


def _orphan_failed(exc: BaseException | None) -> None:
    log.warning("retrysafe: the handling of a cancelled request failed: %r", exc)


if sys.version_info >= (3, 12):

    def _detached(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]) -> Any:
        """A task for ``coro``, run eagerly up to its first suspension."""
        return asyncio.Task(coro, loop=loop, eager_start=True)

else:  # 3.11: no eager tasks (driving the coroutine by hand would run its first
    # part in the caller's task, where anyio's cancel scopes would take it for theirs)

    def _detached(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]) -> Any:
        """A task for ``coro``."""
        return loop.create_task(coro)


async def run_detached(
    run: Callable[[Receive, Send], Coroutine[Any, Any, None]], receive: Receive, send: Send
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


class IdempotencyMiddleware:
    """Run each keyed request once; answer its retries with the stored response.

    Options (the same in :mod:`retrysafe.wsgi` and :mod:`retrysafe.django`):

    - ``store``: a :class:`~retrysafe.Store`, a store URL or an
      :class:`~retrysafe.Engine` (default ``$RETRYSAFE_STORE`` or SQLite).
    - ``methods``: the methods protected (default POST and PATCH).
    - ``require_key``: answer 400 to a protected request without a key; a bool
      or a callable taking a :class:`retrysafe.http.HttpRequest`.
    - ``header``: the key header, or several names (default ``Idempotency-Key``
      and ``X-Idempotency-Key``).
    - Who the caller is (records never cross callers; see docs/principals.md):
      ``principal``, a callable taking the request and returning the caller's
      identity (a str; None lets the rules below decide;
      :data:`retrysafe.http.ANONYMOUS`: the caller is unauthenticated,
      ``anonymous`` decides at once); else an
      authenticated ``scope["user"]`` (Starlette's ``AuthenticationMiddleware``
      placed before this one); else every credential the request carries:
      each ``Authorization`` line, the ``principal_headers`` (default
      ``X-API-Key``, ``Api-Key`` and the like), the session cookies
      (``principal_cookies``: their names; default every cookie but
      analytics, consent, CSRF and load-balancer ones) and the
      ``principal_query`` parameters (default none). ``anonymous``: what a
      keyed request without any of them gets: ``"run"`` (default: it runs
      without a record, never replaying another caller's answer),
      ``"refuse"`` (403 ``idempotency_principal_required``) or ``"share"``
      (one record space for every anonymous caller: public endpoints only).
      Two different ``Authorization`` lines are 400
      ``idempotency_credentials_ambiguous``.
    - ``operation``: the operation name in the key hash (default ``"http"``).
    - ``ttl``, ``lease``, ``wait``: seconds a record is kept, an attempt owns
      its key, a duplicate waits for the attempt in flight (default 0: 409).
    - ``duplicate_response``: ``"replay"`` (default) or ``"no_content"`` (204
      for a replayed 2xx answer, as the Go middleware's mobile API does).
    - ``fail_mode``: ``"closed"`` (503 + ``Retry-After`` when the store is
      down, default) or ``"open"`` (serve without idempotency, logged).
    - ``final_failures``: record 5xx answers and exceptions as final (replayed)
      instead of retryable.
    - ``keep_statuses``: only answers with these statuses are stored (e.g.
      ``range(200, 300)``); any other fails the attempt retryable and stores
      nothing, so a retry runs again (default None: every answer but 408, 413,
      414, 429 and 431; 5xx as ``final_failures`` says).
    - ``fingerprint``: False stores no fingerprint: any request under a stored
      key is its duplicate, whatever its method, path, query or body (never
      ``idempotency_conflict``); the body is not read before the app reads it,
      so ``max_request_body`` does not apply (default True).
    - ``max_body``: the largest response body stored (1 MiB); a larger one is
      streamed to the client, and replayed as its status and headers with an
      empty body and ``Idempotent-Body-Omitted: true``.
    - ``max_request_body``: the largest keyed request body accepted (10 MiB;
      413 above it).
    - ``store_headers``: only these response headers are stored (default: all
      but ``Set-Cookie``, ``Authorization`` and hop-by-hop headers; naming a
      sensitive header here allows it). ``drop_headers``: never stored.
    - ``retention``: ``"standard"`` (default) or ``"financial"`` (archived
      before the sweeper deletes it).
    - ``map``: an :class:`~retrysafe.IdempotencyMap` or the path of its TOML
      file. A request that matches one of its routes gets that route's policy
      (the operation's name, ttl, lease, final failures and retention; the
      route's require_key, header, duplicate answer, wait and key format);
      other requests get the options above.
    """

    def __init__(self, app: ASGIApp, store: Any = None, **options: Any) -> None:
        self.app = app
        self.policy = HttpPolicy(store, **options)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                send = closing(send, self.policy.engine.aclose)
            await self.app(scope, receive, send)
            return
        policy = self.policy.select(scope["method"], scope["path"])
        if policy is None:
            await self.app(scope, receive, send)
            return
        names, credentials = policy.raw_header_names, policy.principals.raw_names
        values: list[str] = []
        found: list[tuple[bytes, bytes]] = []
        ctype = rid = clen = None
        for name, value in scope["headers"]:
            if name in names:
                values.append(value.decode("latin-1"))
            elif name == b"content-type":
                ctype = value.decode("latin-1")
            elif name in credentials:
                found.append((name, value))
            elif name == b"content-length":
                clen = value
            elif name == b"x-request-id":
                rid = value.decode("latin-1")

        query = scope["query_string"].decode("latin-1")
        # The app runs outside this try: its own errors are never taken for the
        # middleware's (an IdempotencyError of the app's, on a request without a key,
        # must neither run it again under fail_mode="open" nor become a refusal).
        attempt: Attempt | None = None
        body: bytes | None
        try:
            key = policy.key(values)
            if key is None:
                refusal = policy.missing(lambda: http_request(scope))
                if refusal is not None:
                    await send_answer(send, refusal)
                    return
            else:
                who = identify(scope, policy.principals, found, query)
                if who is None:  # anonymous: run without a record (anonymous="run")
                    unscoped(policy.operation)
                elif not policy.fingerprint:  # the body is the app's to read, as it arrives
                    secret = policy.secret or await policy.aload_secret()
                    attempt = policy.bare_attempt(key, who, secret, rid)
                    body = None
                else:
                    policy.check_declared(clen)
                    secret = policy.secret or await policy.aload_secret()
                    message = await receive()
                    if message["type"] != "http.request":
                        return  # the client left before sending its body
                    if message.get("more_body", False):
                        whole = await read_body(receive, policy.check_length, message)
                        if whole is None:
                            return
                        body = whole
                    else:
                        body = message.get("body", b"")
                    form = policy.body_form(ctype, body)
                    if isinstance(form, Canonicalize):  # a large JSON body: off the event loop
                        form = await form.arun()
                    attempt = policy.attempt(
                        key,
                        scope["method"],
                        self.request_path(scope),
                        query,
                        ctype,
                        body,
                        who,
                        secret,
                        rid,
                        form,
                    )
        except IdempotencyError as exc:
            refusal = policy.refusal(exc)
            if refusal is not None:
                await send_answer(send, refusal)
                return
            # else the store is down before the body was read: fail open, below
        if attempt is None:  # no key, an anonymous caller, or failing open
            await self.app(scope, receive, send)
            return

        await self._keyed(policy, attempt, scope, body, receive, send)

    def request_path(self, scope: Scope) -> str:
        """The path a keyed request's fingerprint covers: ``scope["path"]``, the one the
        app routes on (the gateway covers the exact target it forwards instead)."""
        return str(scope["path"])

    async def _keyed(
        self,
        policy: HttpPolicy,
        attempt: Attempt,
        scope: Scope,
        body: bytes | None,
        receive: Receive,
        send: Send,
    ) -> None:
        """Claim a keyed request's key, then replay, refuse, or run the app (``body``
        is the request's, already read; None: not read, the app reads it) and record
        its answer."""
        try:
            att = await attempt.__aenter__()  # left in _run, the task that runs the app
        except IdempotencyError as exc:
            refusal = policy.refusal(exc)
            if refusal is None:  # fail open
                await self.app(scope, receive if body is None else replaying(body, receive), send)
            else:
                await send_answer(send, refusal)
            return
        if att.replay is not None:  # nothing runs: nothing to carry past a cancellation
            await send_answer(send, policy.replay(att.replay))
            return
        # A cancelled request (a client that left, a timeout middleware) does not
        # stop a keyed one: work the app runs in a thread would go on regardless,
        # and a retry would run it again alongside (see to_the_end). The app runs in
        # a task that hands its end to ``done``, as to_the_end's does, but one object
        # is its receive, its send (the recorder) and its body: no wrapper between.
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        keyed = _Keyed(self.app, scope, body, receive, send, policy, att, done)
        task = _detached(loop, keyed.run())
        try:
            await done
        except asyncio.CancelledError:
            keyed.cancelled = True  # the app hears http.disconnect, what it sends goes nowhere
            _left(done, task)
            raise


async def run_recorded(app: ASGIApp, scope: Scope, receive: Receive, recorder: Recorder) -> None:
    """Run ``app`` with ``recorder`` recording its answer, its lease renewed meanwhile.

    An app that returns without a complete answer fails the attempt (retryable).
    """
    att = recorder.att
    with renewing(att):
        await app(scope, receive, recorder.send)
    if not att.finished:
        http_log.warning("retrysafe: the app returned without a complete response")
        await att.afail()


class Recorder:
    """Wraps ``send``: copies the answer and records it before its last byte leaves.

    A client that disconnects does not stop the recording: the app runs to its
    end and its answer is stored, so the client's retry gets the replay.
    """

    __slots__ = (
        "att",
        "cancelled",
        "capture",
        "connected",
        "down",
        "length",
        "policy",
        "start",
        "started",
    )

    def __init__(self, send: Send, policy: HttpPolicy, att: Attempt) -> None:
        self.down, self.policy, self.att = send, policy, att
        self.start: Message | None = None
        self.capture = Capture(policy.max_body)
        self.connected = True
        self.cancelled = False  # the request was cancelled: nothing more is sent
        self.started = False
        self.length = -1  # the answer's Content-Length, if it declares one

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.start = message  # held until the first body message
            self.length = -1
            for name, value in message.get("headers", ()):
                if name.lower() == b"content-length" and value.isdigit():
                    self.length = int(value)
            return
        if kind == "http.response.body" and self.start is not None:
            start = self.start
            capture = self.capture
            capture.add(message.get("body", b""))
            # The answer is complete at the last message, or as soon as the body
            # reaches its Content-Length (a client may retry from that moment).
            if not self.att.finished and (
                not message.get("more_body", False) or capture.size == self.length
            ):
                if message.get(UNPROVEN_END):
                    # Nothing proves the answer whole: a retry runs again rather
                    # than replay what may be half an answer.
                    http_log.warning("retrysafe: the answer's end cannot be proven; not stored")
                    await self.att.afail(final=False)
                else:
                    failed, stored, final = self.policy.recorded(
                        start["status"], start.get("headers", ()), capture.body(), capture.size
                    )
                    await arecord(
                        self.att, stored, failed=failed, final=final, answer=self.policy.answer
                    )
            if not self.started:
                self.started = True
                await self._forward(start)
            await self._forward(message)
            return
        await self._forward(message)

    async def _forward(self, message: Message) -> None:
        if not self.connected or self.cancelled:
            return
        try:
            await self.down(message)
        except OSError as exc:  # the client went away; finish and record anyway
            self.connected = False
            http_log.info("retrysafe: client disconnected; the answer is still recorded (%s)", exc)


class _Keyed(Recorder):
    """The run of a claimed request's app, in a task of its own (see
    :meth:`IdempotencyMiddleware._keyed`): the app's receive (the body already read,
    then the client's messages), its send (the recorder) and the task's body, which
    hands its end to ``done`` as :func:`to_the_end`'s task does."""

    __slots__ = ("app", "body", "done", "scope", "up")

    def __init__(
        self,
        app: ASGIApp,
        scope: Scope,
        body: bytes | None,
        receive: Receive,
        send: Send,
        policy: HttpPolicy,
        att: Attempt,
        done: asyncio.Future[None],
    ) -> None:
        super().__init__(send, policy, att)
        self.app, self.scope, self.up, self.done = app, scope, receive, done
        self.body: bytes | None = body

    async def receive(self) -> Message:
        """The body read before the claim, then the client's messages; once the
        request is cancelled, ``http.disconnect``."""
        if self.cancelled:
            return {"type": "http.disconnect"}
        body = self.body
        if body is None:
            return await self.up()
        self.body = None
        return {"type": "http.request", "body": body, "more_body": False}

    async def run(self) -> None:
        """Run the app and record its answer (an exception of the app fails the
        attempt, as leaving ``async with attempt`` would); hand the end to ``done``."""
        att = self.att
        try:
            try:
                await run_recorded(self.app, self.scope, self.receive, self)
            except BaseException as exc:
                await att.__aexit__(type(exc), exc, exc.__traceback__)
                raise
        except BaseException as exc:
            _hand_failure(self.done, exc)
            return
        if not self.done.done():
            self.done.set_result(None)


async def send_answer(send: Send, response: Response) -> None:
    """Send ``response`` whole, in one start and one body message, its headers as they are."""
    await send(
        {
            "type": "http.response.start",
            "status": response.status,
            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers],
        }
    )
    await send({"type": "http.response.body", "body": response.body})
