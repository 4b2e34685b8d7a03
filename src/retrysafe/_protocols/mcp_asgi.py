"""Idempotent ``tools/call`` over Streamable HTTP: an ASGI middleware for any MCP app.

:class:`McpProxyMiddleware` sits in front of an ASGI app that serves MCP over
Streamable HTTP: a Python MCP app, or the forwarding app of ``retrysafe
mcp-proxy --upstream``. A POST whose JSON-RPC body is a keyed ``tools/call``
goes through :func:`~retrysafe._protocols.mcp.run_call`: the first one reaches
the app, whose answer (``application/json``, or ``text/event-stream`` streamed
through as it comes) is recorded before its response event leaves; a replay or
a refusal is answered as ``application/json`` and never reaches the app. Every
other request (GET, DELETE, other POSTs) passes through; the answers to
``initialize``, ``server/discover`` and ``tools/list`` are read on their way
back (the extension advertised, read-only tools learnt).

The caller is named as by every HTTP door (docs/principals.md): the
authenticated ``scope["user"]``, else the request's credentials (every
``Authorization`` line, API-key headers, session cookies), hashed with the
store's secret. A keyed call without any is refused by default
(``anonymous="refuse"``: a client that sends a key asks for exactly-once, and
run unrecorded its retries would run again); ``"share"`` gives such callers one
public space, and ``"run"`` runs them unrecorded (unsafe with retrying clients).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Awaitable, Callable, Collection, MutableMapping
from typing import Any, Unpack

from retrysafe._core.engine import Engine
from retrysafe._core.metrics import METRICS
from retrysafe._core.options import DEFAULT_MAX_BODY
from retrysafe._core.principal import Anonymous, Principals
from retrysafe._core.secret import check_secret
from retrysafe._http.asgi import at_most, caller_scope, read_body, replaying
from retrysafe._http.asgi import header as header_of
from retrysafe._protocols.mcp import (
    CALL_METHOD,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    CallOptions,
    OutcomeUnknown,
    call_engine,
    parse_call,
    refusal,
    run_call,
)
from retrysafe._protocols.mcp_proxy import (
    LISTENED,
    ToolBook,
    fit_replay,
    json_id,
    protocol_version,
    request_method,
)
from retrysafe.errors import (
    AmbiguousCredentialsError,
    BodyTooLarge,
    IdempotencyError,
    InvalidKeyError,
    PrincipalRequiredError,
)
from retrysafe.stores import Store

__all__ = ["McpProxyMiddleware"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Reply = dict[str, Any]

_JSON, _SSE, _OTHER, _PROBLEM = range(4)
#: The blank line that ends an SSE event.
_EVENT_END = re.compile(rb"\r?\n\r?\n")
#: The forwarder's answers when the upstream is down or slow (``application/problem+json``).
_UPSTREAM_FAILED = frozenset({502, 504})


class _NoAnswer(Exception):
    """The app's answer held no JSON-RPC response to the call (passed on as it was)."""


class _TooLarge:
    """In a reply: an answer over ``max_body``, passed on unread. Not JSON, so that
    :func:`~retrysafe._protocols.mcp.run_call` fails the attempt finally (the tool
    ran: never again), as the engine does with any answer it cannot store."""


_TOO_LARGE: Reply = {"result": {"answer": _TooLarge()}}


def _json_bytes(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def _json_answer(status: int, doc: dict[str, Any]) -> tuple[Message, Message]:
    body = _json_bytes(doc)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
    ]
    start = {"type": "http.response.start", "status": status, "headers": headers}
    return start, {"type": "http.response.body", "body": body, "more_body": False}


def _mode(status: int, headers: list[tuple[bytes, bytes]], hold: bool) -> int:
    """How :class:`_Watch` reads an answer: ``_PROBLEM`` is a 502/504 problem to a keyed call."""
    for name, value in headers:
        if name.lower() == b"content-type":
            kind = value.split(b";")[0].strip().lower()
            if status == 200 and kind == b"application/json":
                return _JSON
            if status == 200 and kind == b"text/event-stream":
                return _SSE
            if hold and status in _UPSTREAM_FAILED and kind == b"application/problem+json":
                return _PROBLEM
    return _OTHER


def _event_data(event: bytes) -> bytes | None:
    """The data of one SSE event (its ``data:`` lines joined), None if it has none."""
    lines = [
        line[5:].removeprefix(b" ")
        for line in event.replace(b"\r\n", b"\n").split(b"\n")
        if line.startswith(b"data:")
    ]
    return b"\n".join(lines) if lines else None


class _Watch:
    """The ASGI ``send`` of the app's answer to one JSON-RPC request.

    It finds the response to ``request_id`` in a JSON body or an SSE stream and
    resolves :attr:`reply` with it (``edit`` may change it first); with ``hold``,
    the response, and anything after it, wait for :attr:`gate` (the record). An
    answer that is neither, not 200, or over ``limit`` bytes passes through as it
    is, and :attr:`reply` fails with :class:`_NoAnswer`.
    """

    def __init__(
        self,
        send: Send,
        request_id: Any,
        *,
        hold: bool,
        limit: int,
        edit: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        self.send, self.rid, self.hold, self.limit, self.edit = send, request_id, hold, limit, edit
        self.reply: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self.gate = asyncio.Event()
        self._mode = _OTHER
        self._start: Message | None = None
        self._buffer = bytearray()
        self._found = False
        self._skipping = False  # inside an SSE event over the limit, passed on unread
        self._skipped = False  # such an event went by before the response was found
        self._tail = b""  # the last bytes skipped, where an event end may begin

    def _miss(self) -> None:
        if not self.reply.done():
            self.reply.set_exception(_NoAnswer())
            self.reply.exception()  # retrieved: nobody may be waiting

    def _match(self, data: bytes) -> dict[str, Any] | None:
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            return None
        if (
            isinstance(doc, dict)
            and "method" not in doc
            and ("result" in doc or "error" in doc)
            and json_id(doc.get("id")) == json_id(self.rid)
        ):
            return doc
        return None

    async def _found_it(self, doc: dict[str, Any]) -> bool:
        """Resolve the reply; True if ``doc`` was edited. Waits for the gate if held."""
        edited = self.edit(doc) if self.edit is not None else False
        self._found = True
        if not self.reply.done():
            self.reply.set_result({k: v for k, v in doc.items() if k in ("result", "error")})
        if self.hold:
            await self.gate.wait()
        return edited

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self._mode = _mode(message["status"], message.get("headers", []), self.hold)
            if self._mode in (_JSON, _PROBLEM):
                self._start = message  # sent with the body, once it is read whole
                return
            if self._mode == _OTHER:
                self._miss()
            await self.send(message)
            return
        done_json = self._found and self._mode == _JSON
        if kind != "http.response.body" or self._mode == _OTHER or done_json:
            await self.send(message)
            return
        more = message.get("more_body", False)
        if self._mode == _SSE:
            await self._sse_chunk(message.get("body", b""), more)
            return
        self._buffer += message.get("body", b"")
        if len(self._buffer) > self.limit:
            await self._give_up(more)
        elif self._mode == _JSON:
            if not more:
                await self._json()
        elif not more:
            await self._problem()

    async def _give_up(self, more: bool) -> None:
        """A JSON body over the limit: what was held goes on as it is, and so does the
        rest. It is the response: the tool ran, and its answer cannot be recorded."""
        mode, self._mode = self._mode, _OTHER
        if not self.reply.done():
            self.reply.set_result(_TOO_LARGE)
        if mode == _JSON and self._start is not None:
            await self.send(self._start)
        body, self._buffer = bytes(self._buffer), bytearray()
        await self.send({"type": "http.response.body", "body": body, "more_body": more})

    async def _json(self) -> None:
        assert self._start is not None
        body, self._buffer = bytes(self._buffer), bytearray()
        start = self._start
        doc = self._match(body)
        if doc is None:
            self._miss()
        elif await self._found_it(doc):
            body = _json_bytes(doc)
            headers = [(n, v) for n, v in start["headers"] if n.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            start = {**start, "headers": headers}
        await self.send(start)
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def _problem(self) -> None:
        """The upstream failed the keyed call (the forwarder's 502/504 problem): the
        attempt fails, retryable, and the client gets the JSON-RPC error an MCP client
        reads (``data.code`` the problem's, ``retryable``), not a code-less HTTP error."""
        assert self._start is not None
        body, self._buffer = bytes(self._buffer), bytearray()
        try:
            problem = json.loads(body)
        except (ValueError, RecursionError):
            problem = None
        code = problem.get("code") if isinstance(problem, dict) else None
        self._miss()
        if not isinstance(code, str):  # not the forwarder's: as it came
            await self.send(self._start)
            await self.send({"type": "http.response.body", "body": body, "more_body": False})
            return
        assert isinstance(problem, dict)
        detail = problem.get("detail")
        data = {"code": code, "retryable": True, "retryAfter": 1}
        error = {
            "code": INTERNAL_ERROR,
            "message": detail if isinstance(detail, str) else "the upstream did not answer",
            "data": data,
        }
        await self.gate.wait()  # the attempt failed first: the retry is not in flight
        for part in _json_answer(200, {"jsonrpc": "2.0", "id": self.rid, "error": error}):
            await self.send(part)

    def _body(self, body: bytes, more: bool) -> Message:
        return {"type": "http.response.body", "body": body, "more_body": more}

    def _ended(self) -> None:
        """The stream ended without the response: the attempt fails finally if an
        event over the limit went by unread (it may have been the response); else
        the outcome is unknown and the claim runs out its lease."""
        if self._skipped and not self.reply.done():
            self.reply.set_result(_TOO_LARGE)
        if not self.reply.done():  # the call may still be running upstream
            self.reply.set_result(OutcomeUnknown())

    async def _sse_chunk(self, data: bytes, more: bool) -> None:
        """One chunk of an SSE stream. An event over the limit (a big notification,
        say) is passed on unread to its end; the events after it are read again."""
        if self._skipping:
            joined = self._tail + data
            end = _EVENT_END.search(joined)
            if end is None:
                self._tail = joined[-3:]
                await self.send(self._body(data, more))
                if not more:
                    self._ended()
                return
            cut = end.end() - len(self._tail)
            self._skipping, self._tail = False, b""
            await self.send(self._body(data[:cut], more or cut < len(data)))
            if cut == len(data) and not more:
                self._ended()
                return
            data = data[cut:]
        self._buffer += data
        await self._sse(more)
        if more and len(self._buffer) > self.limit:
            held, self._buffer = bytes(self._buffer), bytearray()
            await self.send(self._body(held, True))
            self._skipping, self._tail = True, held[-3:]
            self._skipped = self._skipped or not self._found

    async def _sse(self, more: bool) -> None:
        buffer = bytes(self._buffer).replace(b"\r\n", b"\n")
        *events, rest = buffer.split(b"\n\n")
        self._buffer = bytearray(rest)
        out = bytearray()
        for event in events:
            data = None if self._found else _event_data(event)
            doc = None if data is None else self._match(data)
            if doc is not None:
                if out:  # what came before the response goes on at once
                    await self.send(
                        {"type": "http.response.body", "body": bytes(out), "more_body": True}
                    )
                    out.clear()
                if await self._found_it(doc):
                    kept = [ln for ln in event.split(b"\n") if not ln.startswith(b"data:")]
                    event = b"\n".join([*kept, b"data: " + _json_bytes(doc)])
            out += event + b"\n\n"
        if not more:
            out += self._buffer
            self._buffer.clear()
            self._ended()
        if out or not more:
            await self.send(self._body(bytes(out), more))


class McpProxyMiddleware:
    """Idempotent ``tools/call`` in front of ``app``, an ASGI app serving MCP over
    Streamable HTTP.

    ``store``: a store, its URL or an engine (default ``$RETRYSAFE_STORE``, else
    SQLite); ``ttl``, ``lease``, ``wait``, ``operation``, ``retention``,
    ``max_body`` (the largest request body read, and answer recorded: default
    1 MiB): the engine's options; ``principal_headers``, ``principal_cookies``,
    ``anonymous``: who the caller is (docs/principals.md). ``anonymous``
    defaults to ``"refuse"``: a keyed call without credentials is refused.
    """

    def __init__(
        self,
        app: ASGIApp,
        store: Store[Any] | Engine | str | None = None,
        *,
        principal_headers: Collection[str] | None = None,
        principal_cookies: Collection[str] | None = None,
        anonymous: Anonymous | None = None,
        final_failures: bool | None = None,
        **options: Unpack[CallOptions],
    ) -> None:
        self.app = app
        self.engine, self.plan = call_engine(store, **options)
        check_secret(self.engine.store)
        self.principals = Principals(
            principal_headers=principal_headers,
            principal_cookies=principal_cookies,
            anonymous="refuse" if anonymous is None else anonymous,
        )
        self.final_failures = final_failures
        self.max_body = max(int(options.get("max_body") or DEFAULT_MAX_BODY), 1)
        self.book = ToolBook(self.engine.ttl)

    def __repr__(self) -> str:
        return f"<McpProxyMiddleware app={self.app!r} engine={self.engine!r}>"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            body = await read_body(receive, at_most(self.max_body))
        except BodyTooLarge:
            error = {"code": INVALID_REQUEST, "message": "the request body is too large"}
            for part in _json_answer(413, {"jsonrpc": "2.0", "id": None, "error": error}):
                await send(part)
            return
        if body is None:  # the client left
            return
        replay = replaying(body, receive)
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):
            doc = None
        if not isinstance(doc, dict) or "id" not in doc:
            await self.app(scope, replay, send)
            return
        method = request_method(doc)
        if method == CALL_METHOD:
            await self._call(scope, replay, send, doc)
        elif method in LISTENED:
            watch = _Watch(
                send,
                doc["id"],
                hold=False,
                limit=self.max_body,
                edit=lambda answer: self.book.answered(method, answer),
            )
            await self.app(scope, replay, watch)
        else:
            await self.app(scope, replay, send)

    async def _call(self, scope: Scope, receive: Receive, send: Send, doc: dict[str, Any]) -> None:
        rid = doc["id"]
        header_keys = [
            v.decode("latin-1") for n, v in scope["headers"] if n.lower() == b"idempotency-key"
        ]
        try:
            call = parse_call(doc.get("params"), header_keys=header_keys, request_id=rid)
            if call is None or self.book.read_only(call.name):
                caller = None  # unrecorded, whoever calls
            else:
                caller = await caller_scope(
                    scope, self.principals, self.engine.store, self.plan.operation
                )
        except (InvalidKeyError, AmbiguousCredentialsError, PrincipalRequiredError) as exc:
            METRICS.refused(self.plan.operation, exc)
            await self._answer(send, rid, {"error": refusal(exc)})
            return
        except IdempotencyError as exc:  # the store, for its secret
            await self._answer(send, rid, {"error": refusal(exc)})
            return
        if call is None or caller is None:  # unkeyed, read-only, or anonymous="run"
            await self.app(scope, receive, send)
            return
        call = call.of(caller)
        watch = _Watch(send, rid, hold=True, limit=self.max_body)
        task: asyncio.Task[None] | None = None

        async def call_next() -> Reply:
            nonlocal task
            task = asyncio.ensure_future(self.app(scope, receive, watch))
            waited: set[asyncio.Future[Any]] = {task, watch.reply}
            await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
            if not watch.reply.done():
                task.result()  # the app's error, if it raised
                raise _NoAnswer()
            return watch.reply.result()

        try:
            reply = await run_call(
                self.engine, self.plan, call, call_next, final_failures=self.final_failures
            )
        except _NoAnswer:
            reply = None  # the app's answer went to the client as it was
        finally:
            watch.gate.set()
            if task is not None:
                with contextlib.suppress(_NoAnswer):
                    await task
        if task is None and reply is not None:
            header = header_of(scope, b"mcp-protocol-version")
            version = protocol_version(doc.get("params"), header)
            await self._answer(send, rid, fit_replay(reply, version))

    @staticmethod
    async def _answer(send: Send, request_id: Any, reply: Reply) -> None:
        for part in _json_answer(200, {"jsonrpc": "2.0", "id": request_id, **reply}):
            await send(part)
