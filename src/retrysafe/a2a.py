"""Exactly-once A2A messages: JSON-RPC sends deduplicated by ``messageId``.

::

    from retrysafe.a2a import A2AIdempotency, A2AMiddleware

    # ASGI, in front of an A2A server:
    app = A2AMiddleware(app, store="redis://localhost:6379/0")
    # a function that answers one JSON-RPC request:
    dispatch = A2AIdempotency("sqlite:///idempotency.db").wrap(dispatch)

A send (``message/send`` of A2A v0.3 or ``SendMessage`` of v1.0) runs once per
``messageId``, principal and context; a repeated one gets the stored Task or
Message, in the spelling it asks in, and starts nothing. Every other request
(task reads, cancels, streaming sends) passes through; the middleware adds
:func:`agent_extension` to the agent card it serves.

On an a2a-sdk server, :class:`IdempotentRequestHandler` wraps its request
handler instead and covers every binding the SDK serves, streaming sends
included (it needs the ``a2a`` extra)::

    handler = IdempotentRequestHandler(DefaultRequestHandler(...), store=...)
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import warnings
from collections.abc import Awaitable, Callable, Collection, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any

from retrysafe._core.engine import Attempt, Engine, door_engine
from retrysafe._core.heartbeat import renewing
from retrysafe._core.principal import Anonymous, Principals, principal_option
from retrysafe._core.recording import arecord, record
from retrysafe._core.secret import check_secret
from retrysafe._http.asgi import (
    ASGIApp,
    Receive,
    Recorder,
    Scope,
    at_most,
    caller_scope,
    closing,
    is_async,
    read_body,
    replaying,
    run_detached,
    run_recorded,
    send_json,
)
from retrysafe._http.asgi import (
    Send as ASGISend,
)
from retrysafe._http.policy import DEFAULT_MAX_REQUEST_BODY
from retrysafe._http.request import HttpRequest
from retrysafe._model.record import Outcome
from retrysafe._protocols.a2a import (
    CARD_METHODS,
    CARD_PATH,
    EXTENSION_URI,
    SEND_METHODS,
    STREAM_METHODS,
    V10,
    ErrorCode,
    Send,
    advertised,
    agent_extension,
    invalid_request,
    parse_send,
    refusal,
    replayed,
    retry_after,
    settlement,
)
from retrysafe.errors import BodyTooLarge, IdempotencyError, InvalidKeyError, MissingExtraError
from retrysafe.stores import Store

if TYPE_CHECKING:
    from retrysafe._protocols.a2a_context import IdempotentContextBuilder
    from retrysafe._protocols.a2a_handler import IdempotentRequestHandler

__all__ = [
    "EXTENSION_URI",
    "MAX_CARD_BYTES",
    "SEND_METHODS",
    "STREAM_METHODS",
    "A2AIdempotency",
    "A2AMiddleware",
    "ErrorCode",
    "IdempotentContextBuilder",
    "IdempotentRequestHandler",
    "agent_extension",
]

log = logging.getLogger("retrysafe.a2a")

JSONRPC = dict[str, Any]
Handler = Callable[[JSONRPC], Any]

#: An answer that ran but cannot be stored (over ``max_body``).
_UNKEPT: Any = object()


class A2AIdempotency:
    """Run each A2A send once per ``messageId``; answer its repeats with the stored result.

    ``store`` is a :class:`~retrysafe.Store`, a store URL or an
    :class:`~retrysafe.Engine` (default ``$RETRYSAFE_STORE``, else SQLite); URLs
    are shared with ``@idempotent``. ``ttl``, ``lease`` and ``wait`` are seconds
    a record is kept, a send owns its messageId, a duplicate waits for the send
    in flight (default 0: an in-flight error at once); with an ``Engine`` they
    may only narrow its TTL. ``final_failures`` makes failed sends final
    (their JSON-RPC error is replayed) instead of retryable. ``operation``
    names the sends in the key hash; ``retention`` is the records' class;
    ``max_body`` the largest result stored, in bytes of JSON (1 MiB; a larger
    one is answered once and then fails finally, so it never runs twice).
    """

    def __init__(
        self,
        store: Store[Any] | Engine | str | None = None,
        *,
        ttl: float | None = None,
        lease: float | None = None,
        wait: float | None = None,
        final_failures: bool | None = None,
        operation: str = "a2a.send",
        retention: str | None = None,
        max_body: int | None = None,
    ) -> None:
        self.engine, self._plan = door_engine(
            store,
            "a2a.send",
            operation=operation,
            ttl=ttl,
            lease=lease,
            wait=wait,
            retention=retention,
            max_body=max_body,
        )
        self.final_failures = final_failures
        self.operation = operation
        #: Seconds a send's record is kept (what the agent card advertises).
        self.ttl = self._plan.ttl

    def __repr__(self) -> str:
        return f"<A2AIdempotency operation={self._plan.operation!r} engine={self.engine!r}>"

    # -- shared, I/O-free pieces ---------------------------------------------------

    def _prepare(self, request: Any, principal: str = "") -> Send | JSONRPC | None:
        """The send in ``request``; a JSON-RPC error for a send without a usable
        messageId; None for a request that passes through."""
        try:
            return parse_send(request, principal)
        except InvalidKeyError as exc:
            return refusal(request.get("id"), exc, self._plan.operation, _version(request))

    def _attempt(self, send: Send) -> Attempt:
        """The engine attempt of ``send`` (enter it with ``with`` or ``async with``)."""
        plan = self._plan.derive(send.key, send.scope, send.fingerprint, send.request_id)
        return Attempt(self.engine, plan)

    def _verdict(self, send: Send, response: Any) -> tuple[bool, Outcome | None, bool | None]:
        """``(succeeded, outcome, final)`` for the handler's response."""
        if response is not _UNKEPT:
            try:
                ok, outcome = settlement(send, response)
                return ok, outcome, self.final_failures
            except (TypeError, ValueError):
                pass
        # It ran, but its answer cannot be kept: a retry must not run it again.
        log.error(
            "retrysafe: the answer to message %r is not JSON or is over max_body; "
            "the message is marked failed finally",
            send.key,
        )
        return False, None, True

    # -- sync --------------------------------------------------------------------------

    def handle(self, request: Any, handler: Handler, *, principal: str = "") -> Any:
        """Answer one JSON-RPC request: ``handler(request)`` once per message.

        ``handler`` returns the JSON-RPC response object. A response that is not
        a JSON-RPC success, or an exception, leaves the message retryable and is
        returned (or raised) unchanged.
        """
        send = self._prepare(request, principal)
        if not isinstance(send, Send):
            return handler(request) if send is None else send
        entered = False
        try:
            with self._attempt(send) as att:
                entered = True
                if att.replay is not None:
                    return replayed(send, att.replay.outcome)
                with renewing(att):
                    response = handler(request)
                self._record(att, send, response)
                return response
        except IdempotencyError as exc:
            if entered:
                raise
            return refusal(send.id, exc, version=send.version)

    def _record(self, att: Attempt, send: Send, response: Any) -> None:
        """Record the response to ``send`` (None: no usable response); never raises."""
        ok, outcome, final = self._verdict(send, response)
        record(att, outcome, failed=not ok, final=final, answer=_answer_to(send))

    # -- async: the same shells with await ------------------------------------------------

    async def ahandle(
        self, request: Any, handler: Callable[[JSONRPC], Awaitable[Any]], *, principal: str = ""
    ) -> Any:
        """Async :meth:`handle`; ``handler`` is a coroutine function."""
        send = self._prepare(request, principal)
        if not isinstance(send, Send):
            return await handler(request) if send is None else send
        entered = False
        try:
            async with self._attempt(send) as att:
                entered = True
                if att.replay is not None:
                    return replayed(send, att.replay.outcome)
                with renewing(att):
                    response = await handler(request)
                await self._arecord(att, send, response)
                return response
        except IdempotencyError as exc:
            if entered:
                raise
            return refusal(send.id, exc, version=send.version)

    async def _arecord(self, att: Attempt, send: Send, response: Any) -> None:
        """Async :meth:`_record`."""
        ok, outcome, final = self._verdict(send, response)
        await arecord(att, outcome, failed=not ok, final=final, answer=_answer_to(send))

    def wrap(self, handler: Callable[..., Any]) -> Callable[..., Any]:
        """``handler`` (sync or async, taking one JSON-RPC request) deduplicated.

        The wrapper takes ``(request, *, principal="")``.
        """
        if is_async(handler):

            @functools.wraps(handler)
            async def async_dispatch(request: Any, *, principal: str = "") -> Any:
                return await self.ahandle(request, handler, principal=principal)

            return async_dispatch

        @functools.wraps(handler)
        def dispatch(request: Any, *, principal: str = "") -> Any:
            return self.handle(request, handler, principal=principal)

        return dispatch

    def close(self) -> None:
        self.engine.close()

    async def aclose(self) -> None:
        await self.engine.aclose()


# -- ASGI -----------------------------------------------------------------------------


class A2AMiddleware:
    """ASGI middleware in front of an A2A JSON-RPC server.

    Unlike the HTTP front doors' ``IdempotencyMiddleware``, it keys on each JSON-RPC
    send's ``messageId`` (no key header) and answers in JSON-RPC.

    A POST holding one JSON-RPC send is run once per messageId (see
    :class:`A2AIdempotency` for ``store``, ``ttl``, ``lease``, ``wait``,
    ``final_failures``, ``operation``, ``retention``, ``max_body``); its repeats are answered
    from the store with ``Idempotent-Replayed: true``. Everything else reaches
    the app untouched.

    - ``principal``, ``principal_headers``, ``principal_cookies``,
      ``principal_query``, ``anonymous``: who the caller is, as on every HTTP
      front door (see :class:`retrysafe.asgi.IdempotencyMiddleware` and
      docs/principals.md): an authenticated ``scope["user"]``, else the
      request's credentials. A send without any reaches the app without a
      record (``anonymous="run"``); ``"refuse"`` answers it with a JSON-RPC
      error (``idempotency_principal_required``).
    - ``path``: only POSTs to this path are inspected (default: every POST).
    - ``max_request_body``: the largest POST body buffered (10 MiB); a larger
      one gets a JSON-RPC error.
    - ``advertise``: add :attr:`extension` (see :func:`agent_extension`) to the
      agent card the app serves (``GET …/.well-known/agent-card.json`` and the
      extended card's JSON-RPC methods), unless the card declares it already or
      is signed (a change would break its signatures). Default True.
    """

    def __init__(
        self,
        app: ASGIApp,
        store: Store[Any] | Engine | str | None = None,
        *,
        principal: Callable[[HttpRequest], str | None] | None = None,
        principal_headers: Collection[str] | None = None,
        principal_cookies: Collection[str] | None = None,
        principal_query: Collection[str] | None = None,
        anonymous: Anonymous | None = None,
        scope: Callable[[Scope], str | None] | None = None,
        path: str | None = None,
        max_request_body: int = DEFAULT_MAX_REQUEST_BODY,
        advertise: bool = True,
        **options: Any,
    ) -> None:
        if int(max_request_body) < 0:
            raise ValueError("max_request_body must not be negative")
        self.principals = Principals(
            principal=principal_option(principal, scope, native=True),
            principal_headers=principal_headers,
            principal_cookies=principal_cookies,
            principal_query=principal_query,
            anonymous=anonymous,
        )
        self.app = app
        self.core = A2AIdempotency(store, **options)
        check_secret(self.core.engine.store)
        self.path = path
        self.max_request_body = int(max_request_body)
        self.advertise = bool(advertise)
        #: The AgentCard extension this middleware advertises.
        self.extension = agent_extension(ttl=self.core.ttl)
        self._signed_logged = False

    async def __call__(self, scope: Scope, receive: Receive, send: ASGISend) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or (self.path is not None and scope["path"] != self.path)
        ):
            if scope["type"] == "lifespan":
                send = closing(send, self.core.aclose)
            elif (
                self.advertise
                and scope["type"] == "http"
                and scope["method"] == "GET"
                and scope["path"].endswith(CARD_PATH)
            ):
                # The app answers in full: whether the client's copy is current
                # is asked of the card as rewritten, under its own ETag.
                held = [(k, v) for k, v in scope["headers"] if k.lower() in _CONDITIONS]
                scope = {**scope, "headers": [h for h in scope["headers"] if h not in held]}
                match = b",".join(v for k, v in held if k.lower() == b"if-none-match")
                send = _rewriting(send, self._card, match.decode("latin-1"))
            await self.app(scope, receive, send)
            return
        try:
            body = await read_body(receive, at_most(self.max_request_body))
        except BodyTooLarge:
            message = f"the request body is over {self.max_request_body} bytes"
            refused = invalid_request("idempotency_body_too_large", message)
            await _reply(send, refused.reply(None))  # the method is unknown: v1.0
            return
        if body is None:
            return  # the client left before sending its body
        downstream = replaying(body, receive)
        request = _parse(body)
        if isinstance(request, list) and any(_is_send(r) for r in request):
            message = "A2A sends must not be batched: send each message in a request of its own"
            refused = invalid_request("idempotency_batch_unsupported", message)
            first = next(r for r in request if _is_send(r))
            await _reply(send, refused.reply(None, _version(first)))
            return
        if not _is_send(request):
            if (
                self.advertise
                and isinstance(request, dict)
                and request.get("method") in CARD_METHODS
            ):
                send = _rewriting(send, self._card_result)
            await self.app(scope, downstream, send)
            return
        core = self.core
        try:
            caller = await caller_scope(scope, self.principals, core.engine.store, core.operation)
        except IdempotencyError as exc:
            await _reply(send, refusal(request.get("id"), exc, core.operation, _version(request)))
            return
        if caller is None:  # anonymous: the app answers it without a record
            await self.app(scope, downstream, send)
            return
        prepared = core._prepare(request, caller)
        if not isinstance(prepared, Send):
            await _reply(send, prepared)  # type: ignore[arg-type]  # a send: never None
            return
        # A server or middleware may cancel this task (a client that left, a
        # timeout); work the app runs outside it (a sync endpoint's thread) goes
        # on regardless, and a retry would run it again alongside: the send runs
        # to its end and is recorded (see run_detached).
        await run_detached(
            lambda hear, answer: self._run(prepared, scope, hear, answer), downstream, send
        )

    async def _run(self, prepared: Send, scope: Scope, receive: Receive, send: ASGISend) -> None:
        """Run (or replay) one send with the app, recording its answer."""
        core = self.core
        entered = False
        try:
            async with core._attempt(prepared) as att:
                entered = True
                if att.replay is not None:
                    await _reply(send, replayed(prepared, att.replay.outcome), replay=True)
                    return
                # _Answer stands in for the HTTP policy the recorder calls.
                recorder = Recorder(send, _Answer(core, prepared), att)  # type: ignore[arg-type]
                await run_recorded(self.app, scope, receive, recorder)
        except IdempotencyError as exc:
            if entered:
                raise
            await _reply(send, refusal(prepared.id, exc, version=prepared.version))

    def _card(self, card: Any) -> Any:
        """The agent card with :attr:`extension`; None to leave it as it is."""
        if isinstance(card, dict) and card.get("signatures") and not self._signed_logged:
            self._signed_logged = True
            log.info("retrysafe: the agent card is signed; its extensions are left as they are")
        return advertised(card, self.extension)

    def _card_result(self, response: Any) -> Any:
        """A JSON-RPC answer holding the extended card, with :attr:`extension`."""
        if not isinstance(response, dict):
            return None
        card = self._card(response.get("result"))
        return None if card is None else {**response, "result": card}


class _Answer:
    """The app's answer to one send, as :mod:`retrysafe.asgi`'s recorder records it.

    Only a 200 JSON answer can be a JSON-RPC success worth storing; any other
    fails the attempt (retryable).
    """

    __slots__ = ("answer", "core", "max_body", "send")

    def __init__(self, core: A2AIdempotency, send: Send) -> None:
        self.core, self.send = core, send
        self.max_body = core.engine.max_body
        self.answer = _answer_to(send)

    def recorded(
        self, status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes, size: int
    ) -> tuple[bool, Outcome | None, bool | None]:
        """(failed, what is stored, final) of the answer's JSON-RPC response; only a
        200 JSON answer can hold one."""
        response: Any = None
        if status == 200 and _is_json(headers):
            response = _parse(body) if size <= self.max_body else _UNKEPT
        ok, outcome, final = self.core._verdict(self.send, response)
        return not ok, outcome, final


def _is_json(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether the answer's content type is JSON."""
    ctype = next((v for k, v in headers if k.lower() == b"content-type"), b"")
    media = ctype.decode("latin-1").split(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


#: The largest agent card answer read to add the extension; a larger one passes as it is.
MAX_CARD_BYTES = 1 << 20


#: The request headers of a conditional GET, which the card's rewriting answers.
_CONDITIONS = (b"if-none-match", b"if-modified-since")


def _retagged(headers: list[tuple[bytes, bytes]], edited: bytes) -> list[tuple[bytes, bytes]]:
    """``headers`` with their ETag made the rewritten card's: the app's, marked with
    a digest of the rewritten body (weak, as the SDK's)."""
    digest = hashlib.sha256(edited).hexdigest()[:16]
    out = []
    for name, value in headers:
        if name.lower() == b"etag":
            opaque = value.decode("latin-1").removeprefix("W/").strip('"')
            value = f'W/"{opaque}-rs{digest}"'.encode("latin-1")
        out.append((name, value))
    return out


def _etag_matches(header: str, etag: str) -> bool:
    """Whether an If-None-Match value selects ``etag`` (RFC 9110 §13.1.2, weak comparison)."""
    tags = [tag.strip().removeprefix("W/") for tag in header.split(",")]
    return "*" in tags or etag.removeprefix("W/") in tags


def _rewriting(send: ASGISend, edit: Callable[[Any], Any], if_none_match: str = "") -> ASGISend:
    """``send``, with a 200 JSON answer of at most :data:`MAX_CARD_BYTES` read whole
    and replaced by ``edit`` of its JSON (unless ``edit`` gives None), its ETag
    changed with it; a 304 instead when ``if_none_match`` selects the ETag
    answered. Any other answer passes as it is."""
    start: MutableMapping[str, Any] | None = None
    chunks: list[bytes] = []
    size = 0
    unsent = False  # a 304 went out: the app's body is dropped

    async def not_modified(headers: Any) -> bool:
        """Send a 304 if the client's copy is the one answered (the conditions were
        taken from the app, which so answers in full)."""
        nonlocal unsent
        etag = next((v.decode("latin-1") for k, v in headers if k.lower() == b"etag"), "")
        if not (etag and if_none_match and _etag_matches(if_none_match, etag)):
            return False
        assert start is not None
        kept = [(k, v) for k, v in headers if k.lower() not in (b"content-type", b"content-length")]
        await send({**start, "status": 304, "headers": kept})
        await send({"type": "http.response.body", "body": b""})
        unsent = True
        return True

    async def rewritten(message: MutableMapping[str, Any]) -> None:
        nonlocal start, size
        if unsent:
            return
        if message["type"] == "http.response.start":
            if message["status"] == 200:
                start = message
                if _is_json(message.get("headers", ())):
                    return
                if await not_modified(message.get("headers", ())):  # a card left as it is
                    return
                start = None
        elif message["type"] == "http.response.body" and start is not None:
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_CARD_BYTES:  # too large to edit: send it on unchanged
                if await not_modified(start.get("headers", ())):
                    return
                await send(start)
                start = None
                for held in chunks:
                    await send({"type": "http.response.body", "body": held, "more_body": True})
                chunks.clear()
                await send(message)
                return
            chunks.append(chunk)
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            doc = edit(_parse(body))
            headers = [
                (k, v) for k, v in start.get("headers", ()) if k.lower() != b"content-length"
            ]
            if doc is not None:
                body = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
                headers = _retagged(headers, body)
            if await not_modified(headers):
                start = None
                return
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            start = None
            message = {"type": "http.response.body", "body": body}
        await send(message)

    return rewritten


def _answer_to(send: Send) -> str:
    return f"the answer to message {send.key!r}"


def _parse(body: bytes) -> Any:
    """The JSON in ``body``; None if it is not JSON (or nested too deeply to read)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _is_send(request: Any) -> bool:
    return isinstance(request, dict) and request.get("method") in SEND_METHODS


def _version(request: Any) -> str:
    """The A2A version of a send's spelling (v1.0 for anything else)."""
    return SEND_METHODS.get(request.get("method"), V10) if _is_send(request) else V10


async def _reply(send: ASGISend, doc: JSONRPC, *, replay: bool = False) -> None:
    """A JSON-RPC answer of retrysafe's own (HTTP 200, as A2A servers answer errors)."""
    headers = [("idempotent-replayed", "true")] if replay else []
    delay = retry_after(doc)
    if delay is not None:
        headers.append(("retry-after", delay))
    await send_json(send, 200, doc, headers)


def __getattr__(name: str) -> Any:
    """:class:`IdempotentRequestHandler` and :class:`IdempotentContextBuilder`,
    imported on first use (they need ``a2a-sdk``; the builder, its HTTP server),
    and the deprecated former name of :class:`A2AMiddleware`."""
    if name in ("IdempotentRequestHandler", "IdempotentContextBuilder"):
        module = "a2a_handler" if name == "IdempotentRequestHandler" else "a2a_context"
        try:
            found = importlib.import_module(f"retrysafe._protocols.{module}")
        except ImportError as exc:
            if exc.name is None or not exc.name.startswith(("a2a", "google", "starlette")):
                raise
            raise MissingExtraError("a2a", f"retrysafe.a2a.{name}", name=exc.name) from exc
        return getattr(found, name)
    if name == "IdempotencyMiddleware":
        warnings.warn(
            "retrysafe.a2a.IdempotencyMiddleware is A2AMiddleware: use that name (its "
            "contract is not that of the HTTP front doors' IdempotencyMiddleware)",
            DeprecationWarning,
            stacklevel=2,
        )
        return A2AMiddleware
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
