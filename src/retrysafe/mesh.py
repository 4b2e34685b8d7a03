"""The Mesh front door: the ``urn:mesh:ext:idempotency`` extension, Mesh's idempotency extension.

::

    mesh = MeshIdempotency("redis://localhost:6379/0")
    response = mesh.handle(request_envelope, charge)   # charge(call) -> result

A request that carries the extension runs its handler once per key, function
and version; retries get the first answer with ``status: cached``. A request
without it is passed to the handler untouched. :class:`MeshApp` serves Mesh
calls over HTTP with the same logic.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

from retrysafe._core.engine import DEFAULT_MAX_BODY, Attempt, Engine, engine_for
from retrysafe._core.heartbeat import renewing
from retrysafe._core.metrics import METRICS
from retrysafe._core.options import DEFAULT_TTL, Options, positive
from retrysafe._core.principal import Anonymous, Principals, principal_option
from retrysafe._core.recording import arecord, record
from retrysafe._core.secret import check_secret
from retrysafe._http.asgi import (
    Receive,
    Scope,
    Send,
    at_most,
    caller_scope,
    header,
    is_async,
    lifespan,
    read_body,
    send_json,
    to_the_end,
)
from retrysafe._http.request import HttpRequest, declared_length
from retrysafe._model.hashing import MAX_PROTOCOL_KEY_LENGTH
from retrysafe._protocols.mesh import (
    MAX_TTL,
    URN,
    MeshCall,
    loads,
    parse,
    retry_after_of,
    status_of,
    transport_error,
)
from retrysafe._protocols.mesh_discovery import Discovery, MeshFunction, functions
from retrysafe.errors import BodyTooLarge, IdempotencyError, MeshError
from retrysafe.stores import Store

__all__ = [
    "MAX_KEY_LENGTH",
    "MAX_TTL",
    "URN",
    "MeshApp",
    "MeshError",
    "MeshFunction",
    "MeshIdempotency",
    "status_of",
]

log = logging.getLogger("retrysafe")

#: The longest idempotency key accepted, in characters (the extension defines a key as
#: any string). A key that is not 1-255 visible ASCII is stored as its SHA-256.
MAX_KEY_LENGTH = MAX_PROTOCOL_KEY_LENGTH

Handler = Callable[[dict[str, Any]], Any]
Answer = tuple[int, dict[str, Any], list[tuple[str, str]]]
#: ``MeshApp(http_status=...)``: the protocol's semantic statuses, or 200 for every answer.
HTTP_STATUSES = ("semantic", "always_200")


class MeshIdempotency:
    """Make Mesh calls exactly-once: ``handle(envelope, handler)`` → response envelope.

    ``store`` is a :class:`~retrysafe.stores.Store`, a store URL or an
    :class:`~retrysafe.Engine` (default: ``$RETRYSAFE_STORE`` or the embedded
    SQLite file). ``ttl`` is how long an answer is kept, from when it is stored,
    when the request's ``ttl`` option gives none (default 24 h, or ``max_ttl`` if
    shorter; with an engine, the engine's). ``max_ttl`` is the longest ``ttl`` a
    request may ask for (default: ``ttl``, so a caller cannot make its records
    outlive the policy; the reference implementation allows 30 days,
    ``max_ttl=MAX_TTL``; with an engine, at most the engine's ``ttl``): a longer
    one is refused with ``INVALID_ARGUMENTS``. ``lease`` and ``wait`` are the engine's
    (how long an attempt owns a key; how long a duplicate waits for it before it
    gets ``IDEMPOTENCY_PROCESSING``).
    """

    def __init__(
        self,
        store: Store[Any] | Engine | str | None = None,
        *,
        ttl: float | None = None,
        max_ttl: float | None = None,
        lease: float | None = None,
        wait: float | None = None,
    ) -> None:
        # Checks the options as every call will use them (TypeError, ValueError); no I/O.
        given = Options(ttl=ttl, lease=lease, wait=wait).ttl
        longest = None if max_ttl is None else positive("max_ttl", max_ttl)
        ceiling = store.ttl if isinstance(store, Engine) else None
        if given is None:
            default = DEFAULT_TTL if ceiling is None else ceiling
            default = default if longest is None else min(default, longest)
        else:
            default = given if ceiling is None else min(given, ceiling)
        longest = default if longest is None else longest
        if ceiling is not None and longest > ceiling:
            raise ValueError(f"max_ttl={longest:g} is over the engine's ttl={ceiling:g}")
        if default > longest:
            raise ValueError(f"ttl={default:g} is over max_ttl={longest:g}")
        # The engine's ttl is the ceiling of every call's: the longest a request may ask.
        self.engine = engine_for(store, ttl=longest, lease=lease, wait=wait)
        self.engine.attempt("-", ttl=default, lease=lease, wait=wait)
        self.ttl, self.max_ttl = default, longest
        self.lease, self.wait = lease, wait

    def __repr__(self) -> str:
        return (
            f"<MeshIdempotency engine={self.engine!r} ttl={self.ttl:g}s max_ttl={self.max_ttl:g}s>"
        )

    def _parse(self, envelope: Any, scope: str) -> MeshCall | dict[str, Any]:
        if type(scope) is not str:
            raise TypeError(f"scope must be a str, not {type(scope).__name__}")
        return parse(envelope, self.max_ttl)

    def _attempt(self, call: MeshCall, scope: str) -> Attempt:
        # A longer ttl was refused by parse; a call parsed elsewhere is held to it too.
        ttl = self.ttl if call.ttl is None else min(call.ttl, self.max_ttl)
        return self.engine.attempt(
            call.key,  # type: ignore[arg-type]  # only keyed calls get here
            operation=call.operation,
            scope=scope,
            fingerprint=call.fingerprint,
            request_id=call.id,
            ttl=ttl,
            lease=self.lease,
            wait=self.wait,
            ttl_from="completion",  # a cache duration: counted from when the answer is stored
        )

    # -- sync -------------------------------------------------------------------

    def handle(self, envelope: Any, handler: Handler, *, scope: str = "") -> dict[str, Any]:
        """The response envelope for the request ``envelope``.

        ``handler(call)`` gets the envelope's ``call`` object and returns the
        ``result`` (a JSON value), or raises :class:`MeshError` to answer with
        an error. ``scope`` is the caller (tenant, user): two scopes never share
        a record. A malformed envelope gets an error envelope, never an
        exception; an exception from the handler fails the attempt (a retry
        runs it again) and propagates.
        """
        call = self._parse(envelope, scope)
        if isinstance(call, dict):
            return call
        return self._handle(call, handler, scope)

    def _handle(self, call: MeshCall, handler: Handler, scope: str) -> dict[str, Any]:
        if call.key is None:
            return call.finish(_run(handler, call.call), None).response
        entered = False
        try:
            with self._attempt(call, scope) as att:
                entered = True
                if att.replay is not None:
                    return call.replayed(att.replay)
                with renewing(att):
                    result = _run(handler, call.call)
                step = call.finish(result, att.claim, self.engine.max_body)
                record(att, step.outcome, failed=step.failed, final=step.final)
                return call.stored(step.response, att.claim)
        except IdempotencyError as exc:
            if entered:
                raise
            return call.refused(exc)

    def close(self) -> None:
        """Close the engine's store."""
        self.engine.close()

    # -- async: the same shells with await ----------------------------------------

    async def ahandle(self, envelope: Any, handler: Handler, *, scope: str = "") -> dict[str, Any]:
        """Async :meth:`handle`: ``handler`` may be async (or plain: it then runs on the loop)."""
        call = self._parse(envelope, scope)
        if isinstance(call, dict):
            return call
        return await self._ahandle(call, handler, scope)

    async def _ahandle(self, call: MeshCall, handler: Handler, scope: str | None) -> dict[str, Any]:
        """``scope`` None: an anonymous caller's call, run without a record."""
        if call.key is None or scope is None:
            return call.finish(await _arun(handler, call.call), None).response
        entered = False
        try:
            async with self._attempt(call, scope) as att:
                entered = True
                if att.replay is not None:
                    return call.replayed(att.replay)
                with renewing(att):
                    result = await _arun(handler, call.call)
                step = call.finish(result, att.claim, self.engine.max_body)
                await arecord(att, step.outcome, failed=step.failed, final=step.final)
                return call.stored(step.response, att.claim)
        except IdempotencyError as exc:
            if entered:
                raise
            return call.refused(exc)

    async def aclose(self) -> None:
        """Close the store's connections of the running event loop."""
        await self.engine.aclose()


def _run(handler: Handler, call: dict[str, Any]) -> Any:
    """The handler's result, or the :class:`MeshError` it raised."""
    try:
        return handler(call)
    except MeshError as err:
        return err


async def _arun(handler: Handler, call: dict[str, Any]) -> Any:
    try:
        result = handler(call)
        return await result if inspect.isawaitable(result) else result
    except MeshError as err:
        return err


# -- HTTP ------------------------------------------------------------------------------


def _asynchronous(handler: Handler) -> Callable[[dict[str, Any]], Awaitable[Any]]:
    """``handler`` as a coroutine function: a plain one runs in a worker thread."""
    if not callable(handler):
        raise TypeError(f"a handler must be callable, not {type(handler).__name__}")
    if is_async(handler):  # an object with an async __call__ counts as async too
        return handler

    async def in_thread(call: dict[str, Any]) -> Any:
        return await asyncio.to_thread(handler, call)

    return in_thread


class MeshApp:
    """An ASGI app that serves Mesh calls: POST a request envelope, get the response.

    A ``handlers`` value may be a :class:`MeshFunction`, which declares what
    ``describe`` says of it and may opt out of the idempotency extension. The
    app answers the protocol's ``urn:cline:mesh:fn:capabilities`` and
    ``urn:cline:mesh:fn:describe`` itself (``service`` names it there), unless
    a handler has that name; these reads are never recorded.

    ``handlers`` maps ``call.function`` to a callable taking the ``call`` object
    (plain ones run in a worker thread, async ones on the loop). Every call goes
    through :class:`MeshIdempotency` (``store`` may also be one; ``ttl``,
    ``max_ttl``, ``lease`` and ``wait`` go to it). Who the caller is comes from the options
    every HTTP front door shares (``principal``, ``principal_headers``,
    ``principal_cookies``, ``principal_query``, ``anonymous``; see
    :class:`retrysafe.asgi.IdempotencyMiddleware` and docs/principals.md): an
    authenticated ``scope["user"]``, else the request's credentials; a call
    without any runs without a record (``anonymous="run"``).

    ``http_status="semantic"`` (the default) answers each Mesh answer with the
    status of its error code (:func:`status_of`: 200 on success, 409 for
    ``IDEMPOTENCY_CONFLICT`` and ``IDEMPOTENCY_PROCESSING``, 503 ``UNAVAILABLE``,
    ...), as the protocol's HTTP binding asks, with ``Retry-After`` when the
    error has a ``retry_after``; ``"always_200"`` answers every Mesh answer,
    ``PARSE_ERROR`` included, with 200. Either way a body over ``max_body``
    bytes is 413 and a method other than POST 405.
    """

    def __init__(
        self,
        handlers: Mapping[str, Handler | MeshFunction],
        store: MeshIdempotency | Store[Any] | Engine | str | None = None,
        *,
        principal: Callable[[HttpRequest], str | None] | None = None,
        principal_headers: Collection[str] | None = None,
        principal_cookies: Collection[str] | None = None,
        principal_query: Collection[str] | None = None,
        anonymous: Anonymous | None = None,
        scope: Callable[[Scope], str | None] | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        ttl: float | None = None,
        max_ttl: float | None = None,
        lease: float | None = None,
        wait: float | None = None,
        service: str = "mesh",
        http_status: str = "semantic",
    ) -> None:
        if http_status not in HTTP_STATUSES:
            raise ValueError(f"http_status must be 'semantic' or 'always_200', not {http_status!r}")
        self.http_status = http_status
        self.functions = functions(handlers)
        self.handlers = {name: _asynchronous(fn.handler) for name, fn in self.functions.items()}
        self.principals = Principals(
            principal=principal_option(principal, scope, native=True),
            principal_headers=principal_headers,
            principal_cookies=principal_cookies,
            principal_query=principal_query,
            anonymous=anonymous,
        )
        if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 0:
            raise ValueError(f"max_body must be a number of bytes >= 0, not {max_body!r}")
        self.max_body = max_body
        self.discovery = Discovery(self.functions, service=service, max_body=max_body)
        if isinstance(store, MeshIdempotency):
            self.mesh = store
        else:
            self.mesh = MeshIdempotency(store, ttl=ttl, max_ttl=max_ttl, lease=lease, wait=wait)
        check_secret(self.mesh.engine.store)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send, self.mesh.aclose)
        elif scope["type"] == "http":
            answer = await self._answer(scope, receive)
            if answer is not None:
                status, body, headers = answer
                await send_json(send, status, body, headers)

    async def _caller(self, scope: Scope, call: MeshCall) -> str | None:
        """The record scope of the call's caller; None: anonymous, run without a record."""
        if call.key is None:
            return ""  # no idempotency asked: nothing is recorded
        return await caller_scope(scope, self.principals, self.mesh.engine.store, call.operation)

    def _http(self, response: dict[str, Any]) -> Answer:
        """A Mesh answer with its HTTP status and headers, in the app's binding."""
        if self.http_status == "always_200":
            return 200, response, []
        after = retry_after_of(response)
        return status_of(response), response, [] if after is None else [("retry-after", str(after))]

    async def _answer(self, scope: Scope, receive: Receive) -> Answer | None:
        """(HTTP status, response envelope, headers); None if the client left."""
        if scope["method"] != "POST":
            return 405, transport_error("send Mesh requests with POST"), [("allow", "POST")]
        length = header(scope, b"content-length")
        try:
            if (declared_length(length) or 0) > self.max_body:
                raise BodyTooLarge
            body = await read_body(receive, at_most(self.max_body))
        except BodyTooLarge:
            return 413, transport_error(f"the request is over {self.max_body} bytes"), []
        if body is None:
            return None
        request, refusal = loads(body)
        if refusal is not None:
            return self._http(refusal)
        call = parse(request, self.mesh.max_ttl)
        if isinstance(call, dict):
            return self._http(call)
        discovered = self.discovery.answer(request, call)  # discovery; opted-out functions
        if discovered is not None:
            return self._http(discovered)
        handler = self.handlers.get(call.function)
        if handler is None:
            return self._http(call.not_found())
        try:
            caller = await self._caller(scope, call)
        except IdempotencyError as exc:
            METRICS.refused(call.operation, exc)
            return self._http(call.refused(exc))
        try:
            return self._http(await to_the_end(self.mesh._ahandle(call, handler, caller)))
        except Exception:
            log.exception("retrysafe: mesh function %r failed", call.function)
            return self._http(call.crashed())
