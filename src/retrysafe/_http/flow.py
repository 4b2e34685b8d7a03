"""What the WSGI and Django front doors share: reading a request, recording an answer.

:func:`prepare` (driven by :func:`run_prepare` / :func:`arun_prepare`) reads the
key, the caller and the body; :func:`enter` / :func:`aenter` begin the attempt
(sync: held by a :class:`Held`); :class:`Exchange`, :class:`Stream` and
:func:`astream` pass the app's answer on with one chunk held back, so it is
recorded before its last byte leaves (docs/wsgi.md, "What the middleware does
with a keyed request").
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Iterator,
    Mapping,
)
from contextlib import AsyncExitStack
from typing import Any

from retrysafe._core.engine import Attempt, run_to_end
from retrysafe._core.heartbeat import renewing
from retrysafe._core.principal import NOBODY, Principal, Principals, unscoped
from retrysafe._core.recording import arecord, record
from retrysafe._http.policy import Capture, HttpPolicy
from retrysafe._http.problems import Response
from retrysafe._http.request import Canonicalize, HttpRequest
from retrysafe._model.record import Outcome
from retrysafe.errors import IdempotencyError

__all__ = [
    "USER",
    "Answer",
    "Exchange",
    "Held",
    "PrepareFlow",
    "Prepared",
    "Stream",
    "aenter",
    "arun_prepare",
    "astream",
    "caller",
    "enter",
    "prepare",
    "run_prepare",
]

log = logging.getLogger("retrysafe.http")

#: The app's status code and headers, read when the answer is recorded.
Answer = Callable[[], tuple[int, list[tuple[str, str]]]]
#: What :func:`prepare` gives: (the request's policy, the attempt to enter), an
#: answer instead, or None.
Prepared = tuple[HttpPolicy, Attempt] | Response | None


#: What a :func:`prepare` flow asks its driver for: the identity the framework
#: authenticated (a str, or None; asked only of an async driver), (yielding the
#: policy) its deployment secret, or (yielding a :class:`Canonicalize`) a large
#: JSON body's canonical form.
USER = "user"
PrepareFlow = Generator[str | HttpPolicy | Canonicalize, Any, Prepared]


def prepare(
    policy: HttpPolicy,
    meta: Mapping[str, Any],
    method: str,
    path: str,
    body: Callable[[], bytes],
    request: Callable[[], HttpRequest],
    user: Callable[[], str | None] | None = None,
) -> PrepareFlow:
    """What a protected request asks for, from its WSGI-style headers in ``meta``.

    A flow: for a keyed request it reads the framework's identity (only when the
    ``principal`` callable does not decide) from ``user()``, or without ``user``
    yields :data:`USER` for it (an async front door awaits it); then it yields the
    policy whose deployment secret it needs (until the policy has it), and returns
    what the request gets.
    ``body()`` reads the whole request body (raising :class:`BodyError` over
    the limit); it is called only for a keyed request of a known principal,
    after ``Content-Length`` was checked, and never under ``fingerprint=False``.
    """
    values = [meta[name] for name in policy.environ_names if name in meta]
    try:
        key = policy.key(values)
        if key is None:
            return policy.missing(request)
        query = meta.get("QUERY_STRING", "")
        principals = policy.principals
        who = principals.named(request)
        if who is None:  # the framework's user is read only when principal= did not decide
            known = (yield USER) if user is None else user()
            who = caller(principals, meta, known, query)
            if who is None:  # anonymous: run without a record (anonymous="run")
                unscoped(policy.operation)
                return None
        elif who is NOBODY:  # principal= said ANONYMOUS: no record (anonymous="run")
            unscoped(policy.operation)
            return None
        if not policy.fingerprint:  # the body is the app's to read
            secret = policy.secret or (yield policy)
            return (policy, policy.bare_attempt(key, who, secret, meta.get("HTTP_X_REQUEST_ID")))
        policy.check_declared(meta.get("CONTENT_LENGTH"))
        secret = policy.secret or (yield policy)
        data, ctype = body(), meta.get("CONTENT_TYPE")
        form = policy.body_form(ctype, data)
        if isinstance(form, Canonicalize):
            form = yield form
        attempt = policy.attempt(
            key,
            method,
            path,
            query,
            ctype,
            data,
            who,
            secret,
            meta.get("HTTP_X_REQUEST_ID"),
            form,
        )
    except IdempotencyError as exc:
        return policy.refusal(exc)
    return (policy, attempt)


def caller(
    principals: Principals, meta: Mapping[str, Any], user: str | None, query: str
) -> Principal | None:
    """:meth:`~retrysafe._core.principal.Principals.others` of a WSGI environ (the
    server joined repeated lines), in one pass over the credential names.

    A request whose one credential is a single header (no cookie, no
    ``principal_query`` parameter, no framework user) takes the remembered
    :meth:`~retrysafe._core.principal.Principals.lone` answer: the same principal.
    """
    found: list[tuple[str, str]] = []
    for name, key in principals.environ_names:
        value = meta.get(key)
        if value is not None:
            found.append((name, value))
    cookie = meta.get("HTTP_COOKIE")
    if cookie:
        found.append(("cookie", cookie))
    elif user is None and len(found) == 1 and (not query or not principals.query):
        name, value = found[0]
        if value.isascii():  # (a WSGI str is latin-1: ASCII is the same in bytes)
            return principals.lone(name.encode(), value.encode())
    return principals.others(user, found, query)


class _Driver:
    """Where a :func:`prepare` flow stands: what it needs next, or what it returned."""

    __slots__ = ("flow", "need", "value")

    def __init__(self, flow: PrepareFlow, need: str | HttpPolicy | Canonicalize | None) -> None:
        self.flow: PrepareFlow = flow
        self.need = need  # what the flow asked for first
        self.value: Prepared = None

    def resume(self, reply: Any, error: IdempotencyError | None) -> None:
        """Hand the flow what it asked for, or the error that getting it raised."""
        try:
            self.need = self.flow.send(reply) if error is None else self.flow.throw(error)
        except StopIteration as stop:
            self.need, self.value = None, stop.value


def run_prepare(flow: PrepareFlow) -> Prepared:
    """Drive a :func:`prepare` flow that was given its ``user`` (it never yields :data:`USER`)."""
    try:  # most flows need nothing: they return at once
        first = flow.send(None)
    except StopIteration as stop:
        return stop.value
    step = _Driver(flow, first)
    reply: Any  # a canonical body or a secret: what the flow asked for
    while (need := step.need) is not None:
        try:
            # need is a Canonicalize or the policy (never USER: the flow has its user)
            reply = need.run() if isinstance(need, Canonicalize) else need.load_secret()  # type: ignore[union-attr]
        except IdempotencyError as exc:  # the store is down, a bad body: the flow answers it
            step.resume(None, exc)
        else:
            step.resume(reply, None)
    return step.value


async def arun_prepare(flow: PrepareFlow, user: Callable[[], Awaitable[str | None]]) -> Prepared:
    """Async :func:`run_prepare`: the user and the secret are awaited."""
    step = _Driver(flow, None)
    step.resume(None, None)
    reply: Any
    while (need := step.need) is not None:
        try:
            if isinstance(need, Canonicalize):
                reply = await need.arun()
            else:
                reply = await (user() if need == USER else need.aload_secret())  # type: ignore[union-attr]
        except IdempotencyError as exc:
            step.resume(None, exc)
        else:
            step.resume(reply, None)
    return step.value


class Held:
    """A begun attempt, held until its answer is recorded: the attempt, the renewal
    of its lease, and callbacks to run first (the app's ``close()``).

    :meth:`leave` leaves them as an ``ExitStack`` would (the callbacks last in,
    first out, then the renewal, then the attempt, which an exception fails),
    once, without an ``ExitStack``'s cost on every request.
    """

    __slots__ = ("att", "closers", "held", "renewal")

    def __init__(self, att: Attempt) -> None:
        self.att = att
        self.renewal = renewing(att)
        self.closers: list[Callable[[], object]] = []
        self.held = True

    def callback(self, close: Callable[[], object]) -> None:
        """Run ``close()`` first when leaving."""
        self.closers.append(close)

    def leave(self, exc: BaseException | None = None) -> None:
        """Leave the attempt (failed by ``exc``, or by an error of a callback, which is raised)."""
        if not self.held:
            return
        self.held = False
        error = exc
        closers = self.closers
        while closers:  # (usually one: the app's close())
            try:
                closers.pop()()
            except BaseException as err:
                error = err
        self.renewal.__exit__(None, None, None)
        if error is None:
            self.att.__exit__(None, None, None)
            return
        self.att.__exit__(type(error), error, error.__traceback__)
        if error is not exc:
            raise error  # (not None: it differs from exc)


def enter(policy: HttpPolicy, attempt: Attempt) -> Held | Response | None:
    """Begin the attempt: held, to run the app in, an answer instead (a refusal or a
    replay), or None to serve without idempotency (fail open).

    Only errors of beginning become answers; the app's own errors are not seen here.
    """
    try:
        att = attempt.__enter__()
    except IdempotencyError as exc:
        return policy.refusal(exc)
    if att.replay is not None:  # (leaving a replayed attempt does nothing)
        return policy.replay(att.replay)
    return Held(att)


async def aenter(
    policy: HttpPolicy, stack: AsyncExitStack, attempt: Attempt
) -> Attempt | Response | None:
    """Async :func:`enter`."""
    try:
        att = await stack.enter_async_context(attempt)
    except IdempotencyError as exc:
        return policy.refusal(exc)
    if att.replay is not None:
        return policy.replay(att.replay)
    stack.enter_context(renewing(att))  # the lease is renewed until the answer is recorded
    return att


def _exc_info(exc: BaseException | None) -> tuple[Any, Any, Any]:
    return (None, None, None) if exc is None else (type(exc), exc, exc.__traceback__)


class Exchange:
    """One answer on its way out: the hold-back rule, the copy, and the attempt's end.

    ``stack`` holds the entered attempt (and whatever must close with it, such
    as the app's iterable): a :class:`Held` (sync) or an ``AsyncExitStack``.
    :meth:`finish` records the answer and leaves it; given an exception it
    leaves it with that exception instead, which fails the attempt (retryable).
    """

    __slots__ = ("answer", "att", "capture", "held", "policy", "stack")

    def __init__(
        self,
        policy: HttpPolicy,
        att: Attempt,
        stack: Held | AsyncExitStack,
        answer: Answer,
    ) -> None:
        self.policy, self.att, self.stack, self.answer = policy, att, stack, answer
        self.capture = Capture(policy.max_body)
        self.held: bytes | None = None

    def push(self, chunk: bytes) -> bytes | None:
        """Hold ``chunk`` back; the chunk held before it may leave (None at first)."""
        self.capture.add(chunk)
        out, self.held = self.held, chunk
        return out

    def last(self) -> bytes | None:
        """The held chunk, once (after :meth:`finish`)."""
        held, self.held = self.held, None
        return held

    def recorded(self) -> tuple[bool, Outcome | None, bool]:
        """What the answer records: (failed, what is stored, final), in one pass."""
        status, headers = self.answer()
        capture = self.capture
        return self.policy.recorded_text(status, headers, capture.body(), capture.size)

    def finish(self, exc: BaseException | None = None) -> None:
        """Record the answer (unless ``exc``) and leave the attempt."""
        try:
            if exc is None:
                failed, kept, final = self.recorded()
                record(self.att, kept, failed=failed, final=final)
        finally:
            self.stack.leave(exc)  # type: ignore[union-attr]  # a sync flow holds a Held

    async def afinish(self, exc: BaseException | None = None) -> None:
        """Async :meth:`finish`."""
        try:
            if exc is None:
                failed, kept, final = self.recorded()
                await arecord(self.att, kept, failed=failed, final=final)
        finally:
            await self.stack.__aexit__(*_exc_info(exc))  # type: ignore[union-attr]  # async: a stack


class Stream:
    """The app's body as a sync iterable that records the answer before its last chunk.

    ``ready`` are chunks already free to leave. :meth:`close` before the end
    (the client went away) reads the rest of the body and records the answer.
    An exception from the app's body fails the attempt and propagates.
    """

    __slots__ = ("_chunks", "_exchange", "_open", "_ready")

    def __init__(
        self, exchange: Exchange, chunks: Iterator[bytes], ready: Iterable[bytes] = ()
    ) -> None:
        self._exchange, self._chunks = exchange, chunks
        self._ready = deque(ready)
        self._open = True

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> bytes:
        if self._ready:
            return self._ready.popleft()
        if self._open and (out := self._pull()) is not None:
            return out
        last = self._exchange.last()
        if last is None:
            raise StopIteration
        return last

    def _pull(self) -> bytes | None:
        """The next chunk free to leave; None when the body has ended and is recorded."""
        exchange = self._exchange
        try:
            for chunk in self._chunks:
                if chunk and (out := exchange.push(chunk)) is not None:
                    return out
        except BaseException as exc:
            self._open = False
            exchange.held = None  # nothing more leaves after a failure
            exchange.finish(exc)
            raise
        self._open = False
        exchange.finish()
        return None

    def close(self) -> None:
        if not self._open:
            return
        log.info("retrysafe: the answer's reader went away; reading the rest to record it")
        self._ready.clear()
        while self._pull() is not None:
            pass


_END: Any = object()


async def _next(chunks: AsyncIterator[bytes]) -> Any:
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return _END


async def astream(exchange: Exchange, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Async :class:`Stream`.

    Each read of the app's body runs as a task of its own, so a reader that is
    cancelled (Django cancels a request whose client disconnected) or closes
    the stream early does not cut the body short: the rest is read in the
    background and the answer recorded.
    """
    step: asyncio.Future[Any] | None = None
    try:
        while True:
            step = asyncio.ensure_future(_next(chunks))
            chunk = await asyncio.shield(step)
            step = None
            if chunk is _END:
                break
            if chunk and (out := exchange.push(chunk)) is not None:
                yield out
    except (GeneratorExit, asyncio.CancelledError):
        run_to_end(_drain(exchange, chunks, step))
        raise
    except BaseException as exc:
        await exchange.afinish(exc)
        raise
    await exchange.afinish()
    last = exchange.last()
    if last is not None:
        yield last


async def _drain(
    exchange: Exchange, chunks: AsyncIterator[bytes], step: Awaitable[Any] | None
) -> None:
    """Read the rest of a body nobody reads any more, and record the answer."""
    log.info("retrysafe: the answer's reader went away; reading the rest to record it")
    try:
        chunk = await (step if step is not None else _next(chunks))
        while chunk is not _END:
            if chunk:
                exchange.push(chunk)
            chunk = await _next(chunks)
    except BaseException as exc:
        log.error("retrysafe: the app failed while its answer was read to the end: %r", exc)
        await exchange.afinish(exc)
        raise
    await exchange.afinish()
